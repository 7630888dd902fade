"""The conformance gates of a model family, on CPU with a tiny random model of it.

    python -m vlrl.tools.family_check --arch qwen3_5 [--gates prompt_ids,positions] [--keep DIR]

Builds the arch's tiny model (`vlrl.models.tiny`, fp32 random weights), then runs each gate of
`vlrl.models.families.GATES` against the real components (the HF processor and model, vlrl's data
pipeline, an FSDP2 actor on a one-rank gloo world, the vLLM engine) and prints one line per gate:
passed or FAILED, what it measured and the bound. Exits 1 when a gate fails. A family's record lists
the gates it passes (`Family.gates`); the trainer refuses a family that misses one, and the test
suite runs this check for every family with a tiny builder (tests/test_family_check.py).

Bounds: an fp32 engine must match the fp32 actor within 2e-4 per token (max) — the same kernels'
rounding order only. A family whose CPU engine runs in bf16 (`Family.cpu_engine_dtype`: vLLM 0.32's
CPU kernels for it need that dtype) is held to BF16_BOUNDS instead, and a weight sync must bring the
engine at least 5x closer to the new weights than to the old ones.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlrl.data.encoded_images import decoded
from vlrl.models.families import GATES, Family, family_of

FP32_BOUNDS = (2e-5, 2e-4)  # (mean, max) |actor - engine| log-prob per sampled token
BF16_BOUNDS = (5e-3, 5e-2)
RESPONSE_TOKENS = 12


@dataclass
class GateResult:
    gate: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"{'passed' if self.passed else 'FAILED'}  {self.gate:<17} {self.detail}"


def _image(seed: int, height: int, width: int) -> Any:
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


def gate_rows() -> list[dict[str, Any]]:
    """Prompts with images of several sizes and aspect ratios, two images in one prompt, an image
    repeated across prompts, and a text-only prompt."""
    shared = _image(3, 64, 64)
    return [
        {"problem": "<image> what colour is the shape", "answer": "red", "images": [_image(0, 60, 90)]},
        {"problem": "<image> and <image> how many", "answer": "2", "images": [_image(1, 56, 56), _image(2, 120, 40)]},
        {"problem": "<image> which shape", "answer": "circle", "images": [shared]},
        {"problem": "the same <image> again", "answer": "circle", "images": [shared]},
        {"problem": "1 + 2 =", "answer": "3", "images": []},
    ]  # fmt: skip


def text_only(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with its images and their markers dropped (the rows of a text model)."""
    return {**row, "problem": row["problem"].replace("<image>", "").strip(), "images": []}


class FamilyCheck:
    """The tiny model of one arch and the components the gates compare (built on first use)."""

    def __init__(self, arch: str, folder: Path) -> None:
        from transformers import AutoConfig

        from vlrl.models.processor import load_processor
        from vlrl.models.tiny import build_tiny_model

        self.arch = arch
        self.path = str(build_tiny_model(folder / arch, arch))
        self.hf_config = AutoConfig.from_pretrained(self.path)
        self.family: Family = family_of(self.hf_config)
        self.tokenizer, self.processor = load_processor(self.path)
        self.rows = gate_rows() if self.family.vision else [text_only(row) for row in gate_rows()]
        self._engine: Any = None
        self._actor: Any = None

    # ---- the components
    def data_config(self) -> Any:
        from vlrl.config import DataConfig

        return DataConfig(prompt_key="problem", max_prompt_length=512, max_response_length=RESPONSE_TOKENS,
                          min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)  # fmt: skip

    def preparer(self) -> Any:
        from vlrl.data.prepare import RowPreparer

        return RowPreparer(self.data_config(), self.tokenizer, self.processor, self.hf_config)

    def samples(self) -> list[Any]:
        preparer = self.preparer()
        return [preparer.sample(row, "", 100 + i, use_processor=True) for i, row in enumerate(self.rows)]

    def prompts(self) -> Any:
        from vlrl.data.collate import collate_prompts

        return collate_prompts(self.samples(), self.tokenizer.pad_token_id)

    @property
    def engine_dtype(self) -> str:
        return self.family.cpu_engine_dtype or "fp32"

    @property
    def bounds(self) -> tuple[float, float]:
        return FP32_BOUNDS if self.engine_dtype == "fp32" else BF16_BOUNDS

    def engine(self) -> Any:
        if self._engine is None:
            from vlrl.config import RolloutConfig
            from vlrl.rollout import create_rollout_engine

            config = RolloutConfig(dtype=self.engine_dtype, gpu_memory_utilization=0.2, n=2, max_num_seqs=32,
                                   sync_bucket_mb=1, calculate_log_probs=True,
                                   enable_chunked_prefill=self.family.engine_needs_chunked_prefill)  # fmt: skip
            from vlrl.rollout import sync_weights

            self._engine = create_rollout_engine(
                config, self.data_config(), self.path, self.tokenizer, self.processor
            )
            sync_weights(self.actor().model.module, self._engine, bucket_mb=1)  # it starts with none
        return self._engine

    def actor(self) -> Any:
        if self._actor is None:
            self._actor = self.build_actor()
        return self._actor

    def build_actor(self, lora_rank: int = 0) -> Any:
        """An FSDP2 actor of the tiny model (fp32 on CPU; with LoRA adapters of `lora_rank`)."""
        from vlrl.config import PPOConfig
        from vlrl.workers.from_config import build_actor

        config = PPOConfig()
        model = config.worker.actor.model
        model.model_path, model.enable_gradient_checkpointing = self.path, False
        model.lora.rank, model.lora.alpha = lora_rank, 2 * lora_rank
        config.worker.actor.padding_free = self.family.packing == "packed"
        config.trainer.device = "cpu"
        config.data.max_prompt_length, config.data.max_response_length = 512, RESPONSE_TOKENS
        config.derive()
        return build_actor(config, self.processor, "cpu", model_path=self.path)

    def rollout(self, seed: int = 5) -> Any:
        """The engine's rollout of the gate prompts (2 samples each, temperature 1)."""
        return self.engine().generate(self.prompts(), {"seed": seed})

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

    # ---- the gates
    def prompt_ids(self) -> GateResult:
        """vlrl's expanded prompt ids = the HF processor's = the ids vLLM built from the raw ids."""
        from vllm import SamplingParams

        from vlrl.rollout.vllm_inputs import vllm_request

        mismatches = []
        samples, preparer = self.samples(), self.preparer()
        requests = [vllm_request(s.raw_prompt_ids, s.images) for s in samples]
        outs = self.engine().llm.generate(requests, SamplingParams(max_tokens=1), use_tqdm=False)
        for row, sample, out in zip(self.rows, samples, outs):
            ours = [int(t) for t in sample.input_ids]
            # the load-time count (length filters) from the image sizes alone, placeholders replaced
            sizes = [(image.height, image.width) for image in sample.images]
            counted = len(sample.raw_prompt_ids) - len(sizes) + sum(preparer.tokens_per_image(sizes))
            if sample.images and counted != len(ours):
                mismatches.append(
                    f"row {row['problem']!r}: counted from the sizes {counted} ids, vlrl {len(ours)}"
                )
            theirs = self._processor_ids(sample)
            if theirs is not None and theirs != ours:
                mismatches.append(f"row {row['problem']!r}: processor {len(theirs)} ids, vlrl {len(ours)}")
            if list(out.prompt_token_ids) != ours:
                mismatches.append(
                    f"row {row['problem']!r}: engine {len(out.prompt_token_ids)} ids, vlrl {len(ours)}"
                )
        sizes = sorted({decoded(img).size for sample in samples for img in sample.images})
        return GateResult(
            "prompt_ids",
            not mismatches,
            "; ".join(mismatches) or f"{len(samples)} prompts, image sizes {sizes}",
        )

    def _processed(self, sample: Any) -> Any:
        """The HF processor's output for `sample`'s unexpanded prompt and its images."""
        assert self.processor is not None, "a text model has no processor"
        text = self.tokenizer.decode(sample.raw_prompt_ids)
        images = [decoded(i) for i in sample.images] or None
        return self.processor(text=[text], images=images, return_tensors="pt")

    def _processor_ids(self, sample: Any) -> list[int] | None:
        if self.processor is None:
            return None
        return [int(t) for t in self._processed(sample)["input_ids"][0]]

    def positions(self) -> GateResult:
        """vlrl's position ids of every prompt = transformers' (`get_rope_index` for mrope)."""
        if not self.family.mrope:
            return GateResult("positions", True, "1-D positions 0..L-1 (no rule to compare)")
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(self.path)
        bad = []
        for sample in self.samples():
            out = self._processed(sample)
            expected, _ = model.model.get_rope_index(
                out["input_ids"],
                mm_token_type_ids=out["mm_token_type_ids"],
                image_grid_thw=out.get("image_grid_thw"),
            )
            if not torch.equal(torch.as_tensor(sample.position_ids), expected[:, 0]):
                bad.append(self.tokenizer.decode(sample.raw_prompt_ids)[:30])
        return GateResult(
            "positions", not bad, f"differ for {bad}" if bad else f"{len(self.rows)} prompts equal"
        )

    def packing(self) -> GateResult:
        """Packed = padded log-probs and gradients (padded-only family: a padded batch = each row
        alone); repeated images encoded once = encoded per copy."""
        batch = self.rollout()
        actor = self.actor()
        model = actor.model
        mask = batch.response_mask.bool()
        if self.family.packing == "packed":
            a, grads_a = self._log_probs_and_grads(model, batch, padding_free=True)
            b, grads_b = self._log_probs_and_grads(model, batch, padding_free=False)
            what = "packed vs padded"
        else:
            a, grads_a = self._log_probs_and_grads(model, batch, padding_free=False)
            alone = [self._log_probs_and_grads(model, batch.select([i]), False) for i in range(len(batch))]
            b = torch.cat([log_probs for log_probs, _ in alone])
            # the loss is a sum over rows: its gradient is the sum of each row's
            grads_b = {}
            for _, grads in alone:
                for name, grad in grads.items():
                    grads_b[name] = grads_b[name] + grad if name in grads_b else grad
            what = "padded batch vs each row alone"
        gap = (a - b)[mask].abs().max().item()
        grad_gap = _relative_gap(grads_a, grads_b)
        shared_gap = self._shared_images_gap(model, batch) if self.family.vision else 0.0
        anchor_gap = self._dummy_image_gap(model, batch) if self.family.vision else 0.0
        passed = gap <= 1e-5 and grad_gap <= 1e-4 and shared_gap <= 1e-5 and anchor_gap <= 1e-5
        detail = f"{what}: log-prob max gap {gap:.1e} (<= 1e-5), relative grad gap {grad_gap:.1e} (<= 1e-4)"
        if self.family.vision:
            detail += f"; text rows beside the dummy image {anchor_gap:.1e} (<= 1e-5)"
        if self.family.vision and self.family.shared_image_encoding:
            detail += f"; shared vs per-copy image encoding {shared_gap:.1e} (<= 1e-5)"
        elif self.family.vision:
            detail += "; each copy of an image encoded (no shared encoding for this family)"
        if self.family.packing == "padded":
            packed, _ = self._log_probs_and_grads(model, batch, padding_free=True)
            detail += f"; packed rows (refused for this family) differ by {(packed - a)[mask].abs().max().item():.1e}"
        return GateResult("packing", passed, detail)

    def _log_probs_and_grads(
        self, model: Any, batch: Any, padding_free: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """[n, R] log-probs and each parameter's gradient of their masked sum."""
        original = model.spec
        model.spec = dataclasses.replace(original, padding_free=padding_free)
        try:
            model.module.zero_grad(set_to_none=True)
            model.module.train()
            out = model.forward_micro_batch(batch, 1.0, image_anchor=bool(any(batch.images)))
            (out.log_probs * batch.response_mask).sum().backward()
            grads = {
                n: _full(p.grad).clone() for n, p in model.module.named_parameters() if p.grad is not None
            }
            model.module.zero_grad(set_to_none=True)
        finally:
            model.spec = original
        return out.log_probs.detach(), grads

    def _dummy_image_gap(self, model: Any, batch: Any) -> float:
        """Log-probs of the text-only rows alone vs beside the family's dummy image: what a rank
        whose micro-batch has no image runs while another rank's has one (FSDP lockstep)."""
        text_rows = batch.select([i for i, images in enumerate(batch.images) if not images])
        with torch.no_grad():
            alone = model.forward_micro_batch(text_rows, 1.0, image_anchor=False).log_probs
            beside = model.forward_micro_batch(text_rows, 1.0, image_anchor=True).log_probs
        return (alone - beside)[text_rows.response_mask.bool()].abs().max().item()

    def _shared_images_gap(self, model: Any, batch: Any) -> float:
        """Log-probs with each repeated image encoded once vs with distinct copies of it."""
        copies = copy.copy(batch)
        copies.images = [[copy.copy(img) for img in imgs] for imgs in batch.images]  # new objects: no sharing
        with torch.no_grad():
            shared = model.forward_micro_batch(batch, 1.0, image_anchor=True).log_probs
            apart = model.forward_micro_batch(copies, 1.0, image_anchor=True).log_probs
        return (shared - apart)[batch.response_mask.bool()].abs().max().item()

    def engine_log_probs(self) -> GateResult:
        """The actor's log-probs of the engine's sampled tokens = the engine's."""
        batch = self.rollout()
        mean, worst = self._gap(batch, self.actor().compute_log_probs(batch))
        lo, hi = self.bounds
        return GateResult("engine_log_probs", mean <= lo and worst <= hi,
                          f"{self.engine_dtype} engine, {int(batch.response_mask.sum())} tokens: mean gap {mean:.1e} "
                          f"(<= {lo:.0e}), max {worst:.1e} (<= {hi:.0e})")  # fmt: skip

    def _gap(self, batch: Any, log_probs: torch.Tensor) -> tuple[float, float]:
        mask = batch.response_mask.bool()
        gap = (log_probs - batch.rollout_log_probs)[mask].abs()
        return gap.mean().item(), gap.max().item()

    def weight_sync(self) -> GateResult:
        """After a sync of changed weights the engine samples from the new weights, not the old."""
        from vlrl.rollout import sync_weights

        actor = self.actor()
        module = actor.model.module
        before = {n: _full(p).detach().clone() for n, p in module.named_parameters()}
        with torch.no_grad():
            gen = torch.Generator().manual_seed(7)
            for p in module.parameters():  # every parameter moves: a stale one shows in the gap
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(
                    torch.randn(local.shape, generator=gen) * 0.3 * local.float().std().clamp(min=1e-3)
                )
        sync_weights(module, self.engine(), bucket_mb=1)
        batch = self.rollout(seed=9)
        new_mean, new_max = self._gap(batch, actor.compute_log_probs(batch))
        with torch.no_grad():
            for n, p in module.named_parameters():
                (p.to_local() if hasattr(p, "to_local") else p).copy_(_local(before[n], p))
        old_mean, _ = self._gap(batch, actor.compute_log_probs(batch))
        sync_weights(module, self.engine(), bucket_mb=1)  # back to the checkpoint's weights
        lo, hi = self.bounds
        passed = new_mean <= lo and new_max <= hi and old_mean >= 5 * max(new_mean, 1e-6)
        return GateResult("weight_sync", passed,
                          f"every parameter perturbed and synced: gap to new weights mean {new_mean:.1e} max "
                          f"{new_max:.1e}; to the old weights mean {old_mean:.1e} (>= 5x)")  # fmt: skip

    def lora(self) -> GateResult:
        """No adapter on the vision tower or its projector; the engine, given the merged weights,
        samples the LoRA actor's distribution (and not the base model's)."""
        from vlrl.models.loading import vision_modules
        from vlrl.rollout import sync_weights

        vision = [name for name, _ in vision_modules(self.actor().model.module)]
        lora_actor = self.build_actor(lora_rank=4)
        module = lora_actor.model.module
        adapted = [n for n, p in module.named_parameters() if "lora_" in n]
        on_vision = [n for n in adapted if any(f"{v}." in n for v in vision)]
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        with torch.no_grad():  # lora_B starts at zero: give the adapters a visible effect
            gen = torch.Generator().manual_seed(11)
            for name, p in module.named_parameters():
                if "lora_B" in name:
                    local = p.to_local() if hasattr(p, "to_local") else p
                    local.copy_(torch.randn(local.shape, generator=gen) * 0.5)
        sync_weights(module, self.engine(), bucket_mb=1)
        batch = self.rollout(seed=13)
        mean, worst = self._gap(batch, lora_actor.compute_log_probs(batch))
        base_mean, _ = self._gap(batch, self.actor().compute_log_probs(batch))
        sync_weights(self.actor().model.module, self.engine(), bucket_mb=1)  # back to the plain weights
        lo, hi = self.bounds
        passed = (bool(adapted) and not on_vision and trainable == set(adapted) and mean <= lo and worst <= hi
                  and base_mean >= 5 * max(mean, 1e-6))  # fmt: skip
        detail = (f"{len(adapted)} adapter tensors, {len(on_vision)} on {vision or 'no vision tower'}; "
                  f"merged sync vs LoRA actor: mean gap {mean:.1e} max {worst:.1e}; vs the base model {base_mean:.1e}")  # fmt: skip
        return GateResult("lora", passed, detail)

    def export(self) -> GateResult:
        """Changed weights saved as a checkpoint reload into a new actor to identical log-probs, and
        the merged export (`vlrl.tools.model_merger`) loads in transformers with the same log-probs."""
        actor = self.actor()
        module = actor.model.module
        batch = self.rollout(seed=17)
        before = {n: _full(p).detach().clone() for n, p in module.named_parameters()}
        _perturb(module, seed=19)
        try:
            expected = actor.compute_log_probs(batch)
            folder = Path(self.path).parent / "export"
            actor.save_checkpoint(str(folder))
            actor.model.hf_config.save_pretrained(folder / "hf_config")
            actor.model.tokenizer_or_processor().save_pretrained(folder / "hf_config")
            fresh = self.build_actor()
            fresh.load_checkpoint(str(folder))
            reloaded = (fresh.compute_log_probs(batch) - expected).abs().max().item()
            from vlrl.tools.model_merger import merge

            merged = self._transformers_log_probs(merge(str(folder)), batch)
        finally:
            with torch.no_grad():
                for n, p in module.named_parameters():
                    (p.to_local() if hasattr(p, "to_local") else p).copy_(_local(before[n], p))
        mask = batch.response_mask.bool()
        merged_gap = (merged - expected)[mask].abs().max().item()
        passed = reloaded == 0.0 and merged_gap <= 1e-4
        detail = f"reloaded checkpoint: max gap {reloaded:.1e} (= 0); merged export in transformers: max gap {merged_gap:.1e} (<= 1e-4)"
        return GateResult("export", passed, detail)

    def _transformers_log_probs(self, folder: str, batch: Any) -> torch.Tensor:
        """[N, R] log-probs of the responses by a plain transformers model loaded from `folder`
        (padded rows; the banned tokens removed, as the actor's sampling distribution does)."""
        from vlrl.models.loading import load_config, model_class
        from vlrl.models.packing import build_padded_inputs
        from vlrl.workers.vision import VisionCache

        model = model_class(load_config(folder)).from_pretrained(folder, dtype=torch.float32).eval()
        pixels = grid = None
        if any(batch.images):
            assert self.processor is not None  # rows with images: a vision model
            pixels, grid = VisionCache(self.processor.image_processor, family=self.family).collate(
                batch.images
            )
        args = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_length)
        inputs = build_padded_inputs(*args, pixel_values=pixels, image_grid_thw=grid)
        kwargs = self.family.model_inputs(dict(inputs.model_kwargs))
        with torch.no_grad():
            logits = model(**kwargs, use_cache=False).logits[inputs.rows, inputs.cols].double()
        logits[:, list(self.actor().model.banned_token_ids)] = float("-inf")
        tokens = batch.responses[inputs.rows, inputs.cols]
        out = torch.zeros(batch.responses.shape, dtype=torch.float64)
        out[inputs.rows, inputs.cols] = logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        return out.float()

    def run(self, gates: list[str]) -> list[GateResult]:
        return [getattr(self, gate)() for gate in gates]


@torch.no_grad()
def _perturb(module: torch.nn.Module, seed: int) -> None:
    """Add noise of 0.3 x each parameter's own spread to every parameter (this rank's shard)."""
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        local.add_(torch.randn(local.shape, generator=gen) * 0.3 * local.float().std().clamp(min=1e-3))


def _relative_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| of a parameter's gradient over that gradient's largest |b| (inf when the
    two do not name the same parameters). The scale is at least 1e-6 of the largest gradient of
    any parameter: a gradient that is zero in exact arithmetic (a key projection's bias, which
    shifts every score of a query alike and so leaves its softmax unchanged) is rounding noise
    (~1e-9 here), and its relative gap says nothing."""
    if a.keys() != b.keys():
        return float("inf")
    floor = 1e-6 * max(grad.abs().max().item() for grad in b.values())
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp(min=max(floor, 1e-12))).item() for n in a)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The shard of `full` that `like` (a DTensor on this one-rank world, or a tensor) holds."""
    return full if not hasattr(like, "to_local") else full.reshape(like.to_local().shape)


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """A one-rank gloo world (the actor's FSDP2 and the engine's external launcher need one);
    afterwards torch.set_num_threads is put back (vLLM's CPU worker replaces it process-wide)."""
    import os
    import socket

    import torch.distributed as dist

    set_num_threads = torch.set_num_threads
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    os.environ.update(env)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads = set_num_threads


def check_family(arch: str, gates: list[str] | None = None, folder: str | None = None) -> list[GateResult]:
    """Run `gates` (default: all) for the tiny model of `arch`; the results in gate order."""
    chosen = list(GATES) if gates is None else gates
    unknown = [g for g in chosen if g not in GATES]
    if unknown:
        raise ValueError(f"unknown gate(s) {unknown}; the gates are {list(GATES)}")
    with contextlib.ExitStack() as stack:
        where = folder or stack.enter_context(tempfile.TemporaryDirectory(prefix="vlrl-family-"))
        stack.enter_context(one_rank_world())
        check = FamilyCheck(arch, Path(where))
        stack.callback(check.close)
        return check.run(chosen)


def main(argv: list[str] | None = None) -> int:
    from vlrl.models.tiny import ARCHS

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", required=True, choices=ARCHS)
    parser.add_argument(
        "--gates", default=None, help=f"comma-separated, of {', '.join(GATES)} (default: all)"
    )
    parser.add_argument("--keep", default=None, help="build the tiny model in this folder and keep it")
    args = parser.parse_args(argv)
    results = check_family(args.arch, args.gates.split(",") if args.gates else None, args.keep)
    for result in results:
        print(result.line(), flush=True)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
