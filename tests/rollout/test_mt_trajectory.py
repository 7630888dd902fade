"""Multi-turn trajectories built by hand: ids, masks, log-probs and mrope positions with images in the
prompt and in the middle of the response, equal to the processor's expansion and transformers'
`get_rope_index` on the whole sequence (Qwen2-VL, Qwen2.5-VL, Qwen3-VL); estimators skip mask holes."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from rollout_helpers import ROWS, data_config, prompt_batch

from vlrl.algorithms import compute_advantages
from vlrl.data.encoded_images import decoded
from vlrl.models.processor import load_processor
from vlrl.rollout.multi_turn.rendering import TurnEncoder, TurnRenderer
from vlrl.rollout.multi_turn.trajectory import Trajectory, assemble_trajectories

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def _trajectories(path: str):
    """Two samples per prompt (one image / no image); each: call, tool turn with an image, answer."""
    from transformers import AutoConfig

    tokenizer, processor = load_processor(path)
    prompts = prompt_batch(path, [ROWS[0], ROWS[2]])
    encoder = TurnEncoder(data_config(256), tokenizer, processor, AutoConfig.from_pretrained(path))
    renderer = TurnRenderer(tokenizer, processor.chat_template, True, 64)
    trajectories, texts = [], []
    for row in (0, 0, 1, 1):
        t = Trajectory(row, list(prompts.raw_prompt_ids[row]), list(prompts.images[row]),
                       int(prompts.attention_mask[row].sum()))  # fmt: skip
        call = tokenizer.encode('call {"name": "show"}', add_special_tokens=False)
        t.add_generated(call, [-0.5] * len(call), "call")
        tool_text = renderer.tool_turn("look", 1)
        tool_image = Image.new("RGB", (70 + 30 * (len(trajectories) % 2), 50), "red")  # resized to the rule
        t.add_context(*encoder.encode(tool_text, [tool_image]))
        answer = tokenizer.encode("red<|im_end|>", add_special_tokens=False)
        t.add_generated(answer, [-0.25] * len(answer), "red")
        t.stop_reason = "eos"
        trajectories.append(t)
        texts.append(prompts.prompts[row] + tokenizer.decode(call) + tool_text + "red<|im_end|>")
    batch = assemble_trajectories(prompts, trajectories, tokenizer.pad_token_id, encoder.positions)
    return batch, trajectories, texts, processor, (len(call), len(answer))


@pytest.mark.parametrize("arch", FAMILIES)
def test_layout_and_positions_match_transformers(tiny_model, arch):
    from transformers import AutoModelForImageTextToText

    path = tiny_model(arch)
    batch, trajectories, texts, processor, (n_call, n_answer) = _trajectories(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    P = batch.prompt_length
    for i, t in enumerate(trajectories):
        real = batch.attention_mask[i].bool()
        assert len(t.images) == (2 if i < 2 else 1)  # prompt image + tool image / tool image only
        images = [decoded(image) for image in t.images]  # the prompt image crosses encoded
        out = processor(text=[texts[i]], images=images, do_resize=False, return_tensors="pt")
        # the trajectory's tokens are the processor's expansion of the whole conversation
        assert batch.input_ids[i][real].tolist() == out["input_ids"][0].tolist()
        expected, _ = model.model.get_rope_index(
            out["input_ids"], mm_token_type_ids=out["mm_token_type_ids"], image_grid_thw=out["image_grid_thw"]
        )
        assert torch.equal(batch.position_ids[i][:, real], expected[:, 0])
        # the mask covers the sampled tokens only: the call and the answer, not the tool turn
        mask = batch.response_mask[i]
        n = len(t.response)
        assert mask[:n_call].all() and not mask[n_call : n - n_answer].any() and mask[n - n_answer : n].all()
        assert int(batch.attention_mask[i, P:].sum()) == n and not mask[n:].any()
        lp = batch.rollout_log_probs[i]
        assert (lp[:n_call] == -0.5).all() and (lp[n_call : n - n_answer] == 0).all()
        assert (lp[n - n_answer : n] == -0.25).all()
    assert batch.trajectories[0]["num_turns"] == 2 and batch.trajectories[0]["final_response"] == "red"


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "remax", "dr_grpo"])
def test_estimators_skip_mask_holes(estimator):
    """Advantages are 0 inside holes (tool turns) and equal, for every token of a sample, to the
    advantage the same sample gets with the holes removed."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0], [1, 0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0],
                         [1, 0, 1, 0, 1, 0, 1, 0]])  # fmt: skip
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # [N] last sampled token
    rewards = torch.zeros(mask.shape)
    rewards[torch.arange(4), last] = scores
    groups = torch.tensor([0, 0, 1, 1])
    kwargs = {"gamma": 1.0}
    if estimator == "remax":
        kwargs["baseline_scores"] = torch.tensor([0.5, 0.5, 0.1, 0.1])
    adv, _ = compute_advantages(estimator, rewards, mask, groups, **kwargs)
    assert (adv[mask == 0] == 0).all()
    # the same samples with the holes squeezed out (left-aligned, no holes)
    dense_mask = torch.zeros_like(mask)
    dense_rewards = torch.zeros_like(rewards)
    for i in range(4):
        k = int(mask[i].sum())
        dense_mask[i, :k] = 1
        dense_rewards[i, k - 1] = scores[i]
    dense, _ = compute_advantages(estimator, dense_rewards, dense_mask, groups, **kwargs)
    for i in range(4):
        torch.testing.assert_close(adv[i][mask[i] == 1], dense[i][dense_mask[i] == 1])


def test_multi_turn_metrics():
    from vlrl.trainer.metrics import multi_turn_metrics

    def info(turns, calls, errors=0, timeouts=0, stop="eos"):
        return {"num_turns": turns, "num_tool_calls": calls, "num_user_turns": 0, "tool_errors": errors,
                "tool_timeouts": timeouts, "tool_truncated": 0, "stop_reason": stop}  # fmt: skip

    out = multi_turn_metrics(
        [info(2, 1), info(1, 0), info(2, 1, 1, 1, "overflow"), info(3, 2, stop="turn_limit")], "mt"
    )
    assert (
        out["mt/turns_mean"] == 2.0 and out["mt/tool_calls_mean"] == 1.0 and out["mt/tool_call_rate"] == 0.75
    )
    assert out["mt/tool_errors"] == 1 and out["mt/tool_timeouts"] == 1
    assert out["mt/stop_overflow"] == 1 and out["mt/stop_turn_limit"] == 1 and out["mt/stop_length"] == 0
    assert multi_turn_metrics([], "mt") == {}


def test_user_turn_after_the_models_eos_closes_the_turn_once(tiny_model):
    """After a final turn the model already sampled its EOS (`<|im_end|>`): the user turn appended
    must not repeat it, or the trajectory differs from the chat template's conversation."""
    tokenizer, processor = load_processor(tiny_model("qwen2_5_vl"))
    renderer = TurnRenderer(tokenizer, processor.chat_template, True, 64)
    user = "\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.user_turn("sure?") == "<|im_end|>" + user  # the closing, when the model did not write it
    assert renderer.user_turn("sure?", "<|im_end|>") == user
    assert renderer.user_turn("sure?", "</tool_call>") == "<|im_end|>" + user  # not a prefix: kept whole


def test_equal_tool_images_of_a_call_are_one_object(tiny_model):
    """A tool answering a group's samples alike gives them one image object (the actor's vision cache
    then encodes it once per pass); images are shared within a call only."""
    from transformers import AutoConfig

    path = tiny_model("qwen2_5_vl")
    tokenizer, processor = load_processor(path)
    encoder = TurnEncoder(data_config(256), tokenizer, processor, AutoConfig.from_pretrained(path))
    text = "<|vision_start|><|image_pad|><|vision_end|>red"
    encoder.new_call()
    _, _, (first,) = encoder.encode(text, [Image.new("RGB", (70, 50), "red")])
    _, _, (again,) = encoder.encode(text, [Image.new("RGB", (70, 50), "red")])  # a new object, same pixels
    _, _, (other,) = encoder.encode(text, [Image.new("RGB", (70, 50), "blue")])
    assert again is first and other is not first
    assert first.size == other.size and first.tobytes() != other.tobytes()
    encoder.new_call()
    _, _, (next_call,) = encoder.encode(text, [Image.new("RGB", (70, 50), "red")])
    assert next_call is not first and next_call.tobytes() == first.tobytes()
