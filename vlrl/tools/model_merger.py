"""Turn a training checkpoint into a Hugging Face model folder that transformers and vLLM load.

    python -m vlrl.tools.model_merger --local_dir CKPT/global_step_N/actor [--target_dir OUT]

Reads the sharded weights (`actor/dcp`, torch.distributed.checkpoint) on one process, without a
process group, and the config + processor saved beside them (`actor/hf_config`). Default target:
`CKPT/global_step_N/actor/huggingface`.

LoRA checkpoints (`actor/hf_config/adapter_config.json` present) hold only the adapters: the base
weights are read from the model folder the run trained (`base_model_name_or_path` of that file, or
`--base_model`), the adapters are merged into them, and the folder holds plain weights.
`--adapter_only` writes the adapter alone instead (peft's format: `adapter_config.json` +
`adapter_model.safetensors`, loadable with `peft.PeftModel.from_pretrained(base, folder)`; default
target `actor/lora_adapter`).
"""

from __future__ import annotations

import argparse
import os

import torch

from vlrl.models.moe import write_checkpoint_layout


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


def merge(
    local_dir: str,
    target_dir: str | None = None,
    dtype: str = "float32",
    base_model: str | None = None,
    adapter_only: bool = False,
) -> str:
    from transformers import AutoConfig

    meta = os.path.join(local_dir, "hf_config")
    dcp_dir = os.path.join(local_dir, "dcp")
    for path, what in ((meta, "config"), (dcp_dir, "sharded weights")):
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{path} is missing: --local_dir must be a checkpoint's actor folder ({what})"
            )
    is_lora = os.path.isfile(os.path.join(meta, "adapter_config.json"))
    if adapter_only and not is_lora:
        raise ValueError(
            f"--adapter_only: {local_dir} is not a LoRA checkpoint (no hf_config/adapter_config.json)"
        )
    default = "lora_adapter" if adapter_only else "huggingface"
    target = target_dir or os.path.join(local_dir, default)
    torch_dtype = getattr(torch, dtype)
    state = {k: v.to(torch_dtype) for k, v in load_full_model_state(dcp_dir).items()}
    config = AutoConfig.from_pretrained(meta)
    if is_lora:
        model = _lora_model(config, meta, state, torch_dtype, base_model)
        if adapter_only:
            model.save_pretrained(target)  # peft: the adapter weights and adapter_config.json only
            return target
        model = model.merge_and_unload()
    else:
        with torch.device("meta"):
            model = _model_class(config).from_config(config, dtype=torch_dtype)
        model.load_state_dict(state, assign=True, strict=True)
    model.save_pretrained(target)
    write_checkpoint_layout(target, config)  # MoE experts as vLLM reads them (vlrl.models.moe)
    _save_processor(meta, target)
    return target


def _model_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM


def _lora_model(config, meta: str, adapters: dict, dtype: torch.dtype, base_model: str | None):
    """The base model (read from its folder) wrapped with the checkpoint's adapters, via peft."""
    from peft import LoraConfig, get_peft_model

    settings = LoraConfig.from_pretrained(meta)
    base_path = base_model or settings.base_model_name_or_path
    if not base_path or not os.path.exists(base_path):
        raise FileNotFoundError(
            f"LoRA checkpoint: its base model {base_path!r} is not a folder here; pass --base_model "
            "(the model_path the run trained)"
        )
    base = _model_class(config).from_pretrained(base_path, dtype=dtype)
    model = get_peft_model(base, settings)
    result = model.load_state_dict(adapters, strict=False)
    expected = {name for name, _ in model.named_parameters() if "lora_" in name}
    if result.unexpected_keys or expected - set(adapters):
        raise ValueError(
            f"the checkpoint's adapters do not fit {base_path}: unexpected {sorted(result.unexpected_keys)[:3]}, "
            f"missing {sorted(expected - set(adapters))[:3]}"
        )
    return model


def _save_processor(meta: str, target: str) -> None:
    from transformers import AutoProcessor

    try:
        AutoProcessor.from_pretrained(meta).save_pretrained(target)
    except (OSError, ValueError, TypeError):  # a text-only model has only a tokenizer
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(meta).save_pretrained(target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local_dir", required=True, help="a checkpoint's actor folder")
    parser.add_argument("--target_dir", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--base_model", default=None, help="LoRA: the base model folder (default: as recorded)"
    )
    parser.add_argument(
        "--adapter_only", action="store_true", help="LoRA: write the adapter alone (peft format)"
    )
    args = parser.parse_args(argv)
    target = merge(args.local_dir, args.target_dir, args.dtype, args.base_model, args.adapter_only)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
