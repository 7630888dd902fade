"""GPU acceptance check: `python -m vlrl.tools.gpu_check --out report.json` (docs/gpu.md).

Checks (each independent, time-limited, recorded in one JSON report and printed as a table):
attention backends (attention_check), one RankWorker end to end (worker_check), packed vs padded
log-probs/gradients (logprob_check; the same on the tiny Qwen3-VL-MoE), a Qwen2.5-VL-3B-shaped
actor update with MFU (qwen3b_check).

Packages it needs, all preinstalled on the bare GPU machine (docs/gpu.md): torch, transformers,
tokenizers, safetensors, pillow, numpy, jinja2 (chat templates). It imports no vLLM, Ray,
flash-attn (optional: tested when importable), datasets or
wandb: vlrl imports those lazily, only on code paths this tool does not take (the config is built
from the dataclasses, the rollout is the HF engine, the worker is called without Ray).
"""
