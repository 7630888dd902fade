"""Turn a training checkpoint into a Hugging Face model folder that transformers and vLLM load.

    python -m vlrl.tools.model_merger --local_dir CKPT/global_step_N/actor [--target_dir OUT]

Reads the sharded weights (`actor/dcp`, torch.distributed.checkpoint) on one process, without a
process group, and the config + processor saved beside them (`actor/hf_config`). Default target:
`CKPT/global_step_N/actor/huggingface`.
"""

from __future__ import annotations

import argparse
import os

import torch


def load_full_model_state(dcp_dir: str) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) state dict from a DCP checkpoint written by `Actor.save_checkpoint`.

    Reads only the `model` entries, in this process (no process group), with a reader that runs
    no pickled code from the checkpoint (vlrl.workers.checkpoint_io). Same calls as torch 2.13's
    `format_utils.dcp_to_torch_save`, minus its `torch.save` / `torch.load(weights_only=False)`
    round trip: `dcp.load` would not fill an empty dict, the planner rebuilds it from the metadata.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from vlrl.workers.checkpoint_io import SafeFileSystemReader

    state: dict = {}
    _load_state_dict(
        state,
        storage_reader=SafeFileSystemReader(dcp_dir),
        planner=_EmptyStateDictLoadPlanner(keys={"model"}),
        no_dist=True,
    )
    return dict(state["model"])


def merge(local_dir: str, target_dir: str | None = None, dtype: str = "float32") -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

    meta = os.path.join(local_dir, "hf_config")
    dcp_dir = os.path.join(local_dir, "dcp")
    for path, what in ((meta, "config"), (dcp_dir, "sharded weights")):
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{path} is missing: --local_dir must be a checkpoint's actor folder ({what})"
            )
    target = target_dir or os.path.join(local_dir, "huggingface")
    config = AutoConfig.from_pretrained(meta)
    is_vlm = hasattr(config, "vision_config")
    model_cls = AutoModelForImageTextToText if is_vlm else AutoModelForCausalLM
    with torch.device("meta"):
        model = model_cls.from_config(config, dtype=getattr(torch, dtype))
    state = {k: v.to(getattr(torch, dtype)) for k, v in load_full_model_state(dcp_dir).items()}
    model.load_state_dict(state, assign=True, strict=True)
    model.save_pretrained(target)
    try:
        AutoProcessor.from_pretrained(meta).save_pretrained(target)
    except (OSError, ValueError, TypeError):  # a text-only model has only a tokenizer
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(meta).save_pretrained(target)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local_dir", required=True, help="a checkpoint's actor folder")
    parser.add_argument("--target_dir", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    print(f"wrote {merge(args.local_dir, args.target_dir, args.dtype)}")


if __name__ == "__main__":
    main()
