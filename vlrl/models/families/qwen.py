"""The Qwen records: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE), Qwen3.5, and text models."""

from __future__ import annotations

from vlrl.models.families import GATES, Family

ALL_GATES = tuple(GATES)
# Qwen2/2.5-VL checkpoints keep the 4.x names of the text model and the vision tower.
_QWEN2_VL_NAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))

QWEN2_VL = Family(
    name="qwen2_vl",
    model_types=("qwen2_vl",),
    vision=True,
    processor_prefixes=("Qwen2VL",),
    positions="mrope",
    vision_scheme="qwen2_vl",
    checkpoint_prefixes=_QWEN2_VL_NAMES,
    varlen_vision_attention=True,
    tiny_arch="qwen2_vl",
    gates=ALL_GATES,
)
QWEN2_5_VL = Family(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    vision=True,
    processor_prefixes=("Qwen2_5_VL",),
    positions="mrope",
    vision_scheme="qwen2_5_vl",
    checkpoint_prefixes=_QWEN2_VL_NAMES,
    varlen_vision_attention=True,
    tiny_arch="qwen2_5_vl",
    gates=ALL_GATES,
)
QWEN3_VL = Family(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    vision=True,
    processor_prefixes=("Qwen3VL",),
    positions="mrope",
    vision_scheme="qwen3_vl",
    varlen_vision_attention=True,
    tiny_arch="qwen3_vl",
    gates=ALL_GATES,
)
QWEN3_VL_MOE = Family(
    name="qwen3_vl_moe",
    model_types=("qwen3_vl_moe",),
    vision=True,
    positions="mrope",
    vision_scheme="qwen3_vl",
    transposed_experts=True,
    varlen_vision_attention=True,
    tiny_arch="qwen3_vl_moe",
    gates=ALL_GATES,
)
# Qwen3.5: Qwen3-VL's processor, vision tower and mrope rule (transformers 5.19's `get_rope_index`
# is the same code), over a hybrid text model: three gated-delta-rule (linear attention) layers per
# full-attention layer.
QWEN3_5 = Family(
    name="qwen3_5",
    model_types=("qwen3_5",),
    vision=True,
    positions="mrope",
    vision_scheme="qwen3_vl",
    packing="padded",
    packing_note=(
        "transformers 5.19's torch fallbacks of the gated-delta-rule layers "
        "(`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`) ignore `cu_seqlens`, so packed rows "
        "leak state into each other; the fla kernels that honour it need CUDA and are not gated here"
    ),
    engine_needs_chunked_prefill=True,
    cpu_engine_dtype="bf16",
    attention_output_gate=True,
    varlen_vision_attention=True,
    tiny_arch="qwen3_5",
    gates=ALL_GATES,
)
# Text-only causal LMs (Qwen2, Qwen3, Llama, ...): 1-D positions, checkpoint names as at runtime.
TEXT = Family(name="text", model_types=("qwen2", "qwen3", "llama"), vision=False, gates=ALL_GATES)

QWEN_FAMILIES = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, QWEN3_5)
