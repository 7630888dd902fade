"""The pieces that run inside vLLM 0.32 (in-process, SPMD): start-up loader, token ban, weight reload.

Why these exist (read from the installed vllm, 0.32.0):
- `load_format="dummy"` randomizes every parameter *and persistent buffer*. Some buffers are not in
  any checkpoint (Qwen2.5-VL's `visual.input_norm` holds the image mean/std), so a later weight load
  cannot repair them and image prompts come out wrong. `vlrl_dummy` randomizes parameters only.
- After loading, vLLM's CPU (and quantized GPU) linear layers repack their weights into kernel
  formats and drop the `weight_loader` of the original parameters, so a second `model.load_weights`
  fails ("'Parameter' object has no attribute 'weight_loader'"). vLLM's layerwise reload
  (`initialize_layerwise_reload` / `finalize_layerwise_reload`, what `Worker.reload_weights` uses)
  restores the checkpoint-format parameters on the meta device, buffers incoming tensors per layer,
  processes a layer as soon as all its elements arrived and copies the result into the existing
  kernel tensors. We call those steps ourselves so that one reload takes several buckets and we can
  check that every parameter was loaded.
- `reload_on_worker` is passed to `llm.collective_rpc`: with `external_launcher` the executor runs
  in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the function and the bucket generator are
  called directly, nothing is pickled, and tensors are handed over by reference.
- Banned tokens: a custom logits processor (one `index_fill_` per step for the whole batch) instead
  of `allowed_token_ids` (a vocabulary-sized list validated per request) or `bad_words` (a Python
  loop per request per step); `logit_bias` is clamped to +-100, which is not a ban.
- Log lines repeated per prompt or per step, each forwarded by Ray to the driver, that
  `silence_repeated_logs` drops (only these messages): vLLM's CPU worker replaces
  `torch.set_num_threads` with a function that logs a warning, and the multimodal renderer sets
  and restores the thread count around every image prompt (two warnings per prompt, 2,400 lines
  in a 60-step quickstart); and the INFO line of the prefix-cache reset after each weight sync.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch

DUMMY_LOAD_FORMAT = "vlrl_dummy"
_registered = False
# logger name -> start of the one message dropped from it
REPEATED_LOGS = {
    "vllm.v1.worker.cpu_worker": "CPU backend doesn't allow to use `torch.set_num_threads`",
    "vllm.v1.core.block_pool": "Successfully reset prefix cache",
}


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_repeated_logs() -> None:
    """Drop the per-prompt / per-step vLLM log lines of `REPEATED_LOGS` (idempotent)."""
    for name, prefix in REPEATED_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))


def register_dummy_loader() -> str:
    """Register (once) the `vlrl_dummy` load format and return its name."""
    global _registered
    if not _registered:
        from vllm.model_executor.model_loader import register_model_loader
        from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
        from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

        class ParameterOnlyDummyLoader(DummyModelLoader):
            """Random parameters; buffers keep the values the model's constructor computed."""

            def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
                for param in model.parameters():
                    initialize_single_dummy_weight(param)

        register_model_loader(DUMMY_LOAD_FORMAT)(ParameterOnlyDummyLoader)
        _registered = True
    return DUMMY_LOAD_FORMAT


def ban_tokens_processor(token_ids: Sequence[int]) -> type:
    """A vLLM v1 logits-processor class that sets the logits of `token_ids` to -inf for every request."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    banned = tuple(sorted(set(int(i) for i in token_ids)))

    class BanTokens(LogitsProcessor):
        """Applied before sampling (not argmax-invariant: greedy requests see it too)."""

        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
            vocab = vllm_config.model_config.get_vocab_size()
            self.index = torch.tensor([i for i in banned if i < vocab], dtype=torch.long, device=device)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: Any) -> None:
            pass  # the same tokens for every request: no per-request state

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            # logits: [num_requests, vocab] float32
            return logits.index_fill_(1, self.index, float("-inf")) if self.index.numel() else logits

    BanTokens.BANNED = banned
    return BanTokens


def reload_on_worker(
    worker: Any, buckets: Iterable[list[tuple[str, torch.Tensor]]]
) -> tuple[set[str], set[str]]:
    """Load checkpoint-named tensors bucket by bucket into the worker's model; (loaded, expected) names."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(model)
        # After the restore, parameters carry their checkpoint-format (loadable) names and shapes.
        expected = {name for name, _ in model.named_parameters()}
        loaded: set[str] = set()
        try:
            for bucket in buckets:
                loaded |= set(model.load_weights(bucket))
        finally:
            finalize_layerwise_reload(model, worker.model_config)
    return loaded, expected


def cpu_kv_cache_bytes(
    hf_config: Any, dtype: torch.dtype, max_model_len: int, max_num_seqs: int, cap_bytes: int
) -> int:
    """KV-cache size for CPU engines: enough for `max_num_seqs` full sequences, at most `cap_bytes`.

    vLLM on CPU otherwise sizes the cache as (fraction x host RAM - this process's RSS), which fails
    when the training process itself is large; an explicit size is independent of the RSS.
    """
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    per_token = 2 * int(text.num_hidden_layers) * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    # + one 128-token block per sequence of slack for block rounding.
    need = per_token * (max_model_len + 128) * max_num_seqs
    return int(min(need, cap_bytes))
