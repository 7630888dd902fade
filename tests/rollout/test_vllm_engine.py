"""The vLLM engine on one rank (Qwen2.5-VL, fp32): guard, outputs, bans, weight sync vs transformers."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
from rollout_helpers import (
    data_config,
    greedy_hf_batch,
    load_hf_model,
    make_token_argmax,
    masked_entropy,
    one_rank_actor,
    one_rank_engine,
    perturb,
    prompt_batch,
    rollout_config,
    save_model,
)

from vlrl.models.processor import load_processor
from vlrl.rollout import NoWeightsError, create_rollout_engine, sync_weights, vllm_hooks
from vlrl.rollout.vllm_hooks import REPEATED_LOGS

GREEDY = {"temperature": 0.0, "n": 1}


@pytest.fixture(scope="module")
def vl(tiny_model):
    """One engine for the module, in a one-rank gloo world that is torn down afterwards."""
    path = tiny_model("qwen2_5_vl")
    with one_rank_engine(path, calculate_log_probs=True) as engine:
        yield SimpleNamespace(path=path, engine=engine, prompts=prompt_batch(path), base=load_hf_model(path))


def synced(vl) -> None:
    """Give the engine the checkpoint's weights (once per module)."""
    if not vl.engine.has_weights:
        sync_weights(vl.base, vl.engine, bucket_mb=1)


def test_generate_before_sync_fails(vl):
    with pytest.raises(NoWeightsError, match="sync"):
        vl.engine.generate(vl.prompts)


def test_start_up_checks(vl, tiny_model):
    tokenizer, processor = load_processor(vl.path)
    bad = rollout_config(max_model_len=512, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        create_rollout_engine(bad, data_config(), vl.path, tokenizer, processor)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        create_rollout_engine(
            rollout_config(tensor_parallel_size=2), data_config(), vl.path, tokenizer, processor
        )


def test_outputs_for_one_two_and_no_images(vl):
    synced(vl)
    engine, prompts = vl.engine, vl.prompts
    batch = engine.generate(prompts, {"seed": 11})
    n, width_p = 2, prompts.input_ids.shape[1]
    assert len(batch) == 6 and batch.prompt_length == width_p
    assert batch.group_ids.tolist() == [100, 100, 101, 101, 102, 102]
    assert batch.input_ids[:, :width_p].equal(prompts.input_ids.repeat_interleave(n, 0))
    assert batch.input_ids[:, width_p:].equal(batch.responses)
    last = prompts.position_ids.amax(dim=(1, 2)).repeat_interleave(n)  # [N] max prompt position
    steps = torch.arange(batch.responses.shape[1])
    assert batch.position_ids[:, :, width_p:].equal((last[:, None] + 1 + steps).unsqueeze(1).expand(6, 3, -1))
    lengths = batch.response_mask.sum(-1)
    for row, length in zip(batch.responses.tolist(), lengths.tolist()):
        ended = [i for i, t in enumerate(row[:length]) if t in engine.eos_token_ids]
        assert ended in ([], [length - 1])  # ends at its first EOS, or ran to the limit
        assert all(t == engine.pad_token_id for t in row[length:])
    mask = batch.response_mask.bool()
    assert (batch.rollout_log_probs[mask] <= 0).all() and (batch.rollout_log_probs[~mask] == 0).all()
    assert batch.rollout_log_probs[mask].lt(-1e-3).any()  # sampled at temperature 1: real log-probs
    assert not torch.isin(batch.responses, torch.tensor(engine.banned_token_ids)).any()


def test_repeated_vllm_log_lines_are_dropped(vl):
    """Per image prompt vLLM's CPU worker warns twice that it cannot set the thread count, and each
    weight sync logs a prefix-cache reset: both dropped, other messages of those loggers kept."""
    synced(vl)
    loggers = [logging.getLogger(name) for name in REPEATED_LOGS]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)  # tests run with vLLM's logging unconfigured (WARNING)
    try:
        vl.engine.generate(vl.prompts)
        sync_weights(vl.base, vl.engine, bucket_mb=1)
        for logger in loggers:
            logger.warning("another message")
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    assert [r.getMessage() for r in records] == ["another message"] * len(loggers)


def test_weight_sync_logs_no_reload_warning(vl):
    """vLLM's layerwise reload warned "RotaryEmbedding / MRotaryEmbedding / FusedMMInputNorm: Failed to
    load weights" at every sync (layers holding only buffers no checkpoint contains): dropped."""
    synced(vl)
    logger = logging.getLogger(vllm_hooks.RELOAD_WARNING_LOGGER)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        sync_weights(vl.base, vl.engine, bucket_mb=1)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []


def test_cpu_engine_runs_the_v1_runner(vl):
    """On CPU (no Triton) vLLM runs its V1 model runner, the one the engine built its processor for."""
    assert vl.engine.use_v2 is False
    assert vl.engine.llm.llm_engine.vllm_config.use_v2_model_runner is False


def test_cpu_engine_takes_32_token_blocks(vl):
    """vLLM accepts the CPU block size (its CPU attention wants multiples of 32) and keeps it."""
    assert vl.engine.llm.llm_engine.vllm_config.cache_config.block_size == 32


def test_seeds_repeat_and_differ(vl):
    synced(vl)
    first = vl.engine.generate(vl.prompts, {"seed": 5}).responses
    assert vl.engine.generate(vl.prompts, {"seed": 5}).responses.equal(first)
    assert not vl.engine.generate(vl.prompts, {"seed": 6}).responses.equal(first)
    group = first.view(3, 2, -1)
    assert any(not g[0].equal(g[1]) for g in group)  # the samples of one prompt differ


def test_image_content_ids_sample_what_vllms_own_hashing_samples(vl, monkeypatch):
    """Requests carry content ids for their images (vllm_inputs.ImageIds), so vLLM skips hashing the
    pixels; its caches are keyed as before, so a call samples the same tokens with the same log-probs."""
    from vlrl.rollout import vllm_engine, vllm_inputs

    synced(vl)
    with_ids = vl.engine.generate(vl.prompts, {"seed": 5})
    assert vl.engine.requests(vl.prompts)[0]["multi_modal_uuids"]["image"][0].startswith("vlrl-")

    def without_ids(ids, images=(), videos=(), image_ids=None):
        return vllm_inputs.vllm_request(ids, images, videos)

    monkeypatch.setattr(vllm_engine, "vllm_request", without_ids)
    assert "multi_modal_uuids" not in vl.engine.requests(vl.prompts)[0]
    hashed = vl.engine.generate(vl.prompts, {"seed": 5})
    assert hashed.responses.equal(with_ids.responses)
    assert hashed.rollout_log_probs.equal(with_ids.rollout_log_probs)


def test_streamed_groups_are_the_batch_rows_and_generate_samples_the_same(vl):
    """`generate_stream` reports every group once, as it finishes, with the final batch's tokens;
    driving the engine step by step samples exactly what one `LLM.generate` call samples."""
    from vlrl.batch.rows import FinishedGroups
    from vlrl.rollout.base import resolve_sampling, seeded_rng

    synced(vl)
    overrides = {"seed": 5, "n": 2, "max_tokens": 12}
    *groups, batch = vl.engine.generate_stream(vl.prompts, overrides)
    assert groups and all(isinstance(g, FinishedGroups) for g in groups)
    assert sorted(r for g in groups for r in g.prompt_rows) == list(range(len(vl.prompts)))
    streamed = {
        2 * row + j: g.responses[2 * k + j]
        for g in groups
        for k, row in enumerate(g.prompt_rows)
        for j in range(2)
    }
    s = resolve_sampling(vl.engine.config, 12, overrides)
    vl.engine.llm.reset_prefix_cache()
    with seeded_rng(vl.engine.call_seed(s)):  # the V1 runner's seeding, as the engine does it
        outputs = vl.engine.llm.generate(
            vl.engine.requests(vl.prompts), vl.engine.sampling_params(s), use_tqdm=False
        )
    direct = [list(o.token_ids) for out in outputs for o in sorted(out.outputs, key=lambda o: o.index)]
    assert [streamed[i] for i in range(len(batch))] == direct
    pad = vl.engine.pad_token_id
    for i, ids in enumerate(direct):
        assert batch.responses[i].tolist() == ids + [pad] * (batch.responses.shape[1] - len(ids))


def test_sync_matches_transformers_greedy(vl):
    """Perturbed weights, synced in 1 MiB buckets: vLLM's greedy tokens equal transformers'."""
    synced(vl)
    before = vl.engine.generate(vl.prompts, GREEDY)
    model = copy.deepcopy(vl.base)
    perturb(model, seed=2)
    metrics = sync_weights(model, vl.engine, bucket_mb=1)
    after = vl.engine.generate(vl.prompts, GREEDY)
    expected = greedy_hf_batch(vl.path, model, vl.prompts, 12)
    assert after.responses.equal(expected.responses)
    assert not after.responses.equal(before.responses)
    # The engine's log-probs of its tokens match transformers' (both after the token ban).
    torch.testing.assert_close(after.rollout_log_probs, expected.rollout_log_probs, atol=2e-4, rtol=0)
    assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in model.state_dict().values())
    assert metrics["sync/bucket_mb"] <= 1.0
    sync_weights(vl.base, vl.engine, bucket_mb=64)  # back to the checkpoint, one bucket
    assert vl.engine.generate(vl.prompts, GREEDY).responses.equal(before.responses)


def test_lora_sync_matches_transformers_greedy_on_the_merged_model(vl):
    """A LoRA-wrapped model with trained-looking adapters: the sync merges them, and vLLM's greedy
    tokens and log-probs equal transformers' on peft's own merge of the same model."""
    from vlrl.config import LoraConfig
    from vlrl.models.lora import apply_lora

    synced(vl)
    before = vl.engine.generate(vl.prompts, GREEDY)
    model = apply_lora(copy.deepcopy(vl.base), LoraConfig(rank=4, alpha=16))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B starts at 0 (no change); give it values, as training would
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    try:
        metrics = sync_weights(model, vl.engine, bucket_mb=1)
        after = vl.engine.generate(vl.prompts, GREEDY)
        merged = copy.deepcopy(model).merge_and_unload()  # peft's merge, independent of ours
        expected = greedy_hf_batch(vl.path, merged, vl.prompts, 12)
        assert after.responses.equal(expected.responses)
        assert not after.responses.equal(before.responses)  # the adapters reached the engine
        torch.testing.assert_close(after.rollout_log_probs, expected.rollout_log_probs, atol=2e-4, rtol=0)
        # plain tensors under plain names: as many bytes as the merged model, no adapter tensors
        assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in merged.state_dict().values())
    finally:
        sync_weights(vl.base, vl.engine, bucket_mb=64)


def test_image_token_is_never_sampled(vl):
    """With `<|image_pad|>` the argmax after every prefix, neither greedy nor sampling emits it."""
    synced(vl)
    image_pad = vl.engine.hf_config.image_token_id
    model = copy.deepcopy(vl.base)
    make_token_argmax(model, image_pad)
    text_row = vl.prompts.select([2])
    plain = model.generate(input_ids=text_row.input_ids, attention_mask=text_row.attention_mask,
                           max_new_tokens=3, do_sample=False)  # fmt: skip
    assert (plain[0, -3:] == image_pad).all()  # the setup works: unbanned, it would be generated
    sync_weights(model, vl.engine, bucket_mb=1)
    try:
        for overrides in (GREEDY, {"seed": 1}, {"seed": 2, "temperature": 2.0}):
            out = vl.engine.generate(vl.prompts, overrides)
            assert not torch.isin(out.responses, torch.tensor(vl.engine.banned_token_ids)).any()
    finally:
        sync_weights(vl.base, vl.engine, bucket_mb=64)


def test_prompt_longer_than_the_window_fails_clearly(vl):
    synced(vl)
    with pytest.raises(ValueError, match="max_model_len"):
        vl.engine.generate(vl.prompts, {"max_tokens": 260})


def test_cpu_sleep_is_a_no_op_and_empty_shards_work(vl):
    synced(vl)
    vl.engine.sleep()
    vl.engine.wake_up()
    out = vl.engine.generate(vl.prompts.select([2]), GREEDY)
    assert len(out) == 1 and out.response_mask[0, 0] == 1
    empty = vl.engine.generate(vl.prompts.select([]), {"n": 3})
    assert len(empty) == 0 and empty.prompt_length == vl.prompts.input_ids.shape[1]


def test_greedy_with_several_samples(vl):
    """vLLM refuses greedy n > 1; the engine asks for one sample and repeats it."""
    synced(vl)
    out = vl.engine.generate(vl.prompts, {"temperature": 0.0, "n": 2})
    assert len(out) == 6 and all(out.responses[i].equal(out.responses[i + 1]) for i in range(0, 6, 2))
    assert out.responses[::2].equal(vl.engine.generate(vl.prompts, GREEDY).responses)


def test_actor_scores_what_the_engines_sample(vl, tmp_path):
    """A banned token holds the largest logit everywhere: the actor's log-probs and entropy are those
    of the distribution the vLLM and HF engines sample from (ban + temperature), not the raw one."""
    synced(vl)
    vision_start = vl.engine.hf_config.vision_start_token_id
    model = copy.deepcopy(vl.base)
    make_token_argmax(model, vision_start)
    folder = save_model(model, vl.path, str(tmp_path / "banned_argmax"))
    temperature, settings = 0.7, {"seed": 4, "temperature": 0.7}
    tokenizer, processor = load_processor(folder)
    hf_engine = create_rollout_engine(
        rollout_config(name="hf", calculate_log_probs=True), data_config(), folder, tokenizer, processor
    )
    sync_weights(model, vl.engine, bucket_mb=64)
    try:
        actor = one_rank_actor(folder, temperature)
        assert (
            actor.model.banned_token_ids
            == tuple(vl.engine.banned_token_ids)
            == tuple(hf_engine.banned_token_ids)
        )
        for engine in (vl.engine, hf_engine):
            batch = engine.generate(vl.prompts, settings)
            mask = batch.response_mask.bool()
            actor_log_probs = actor.compute_log_probs(batch)
            torch.testing.assert_close(
                actor_log_probs[mask], batch.rollout_log_probs[mask], atol=2e-4, rtol=0
            )
            out = actor.model.forward_micro_batch(batch, temperature, image_anchor=True, with_entropy=True)
            expected = masked_entropy(model, folder, batch, vl.engine.banned_token_ids, temperature)
            torch.testing.assert_close(out.entropy[mask].double(), expected[mask], atol=2e-4, rtol=0)
            # the raw (unbanned) distribution is far from it: the check can tell them apart
            raw = masked_entropy(model, folder, batch, [], temperature)
            assert (raw - expected)[mask].abs().min() > 0.1
    finally:
        sync_weights(vl.base, vl.engine, bucket_mb=64)


def test_log_probs_are_those_of_the_truncated_distribution(vl):
    """V1 runner (CPU): the engine's log-probs include top-k/top-p (vllm_settings.LOGPROBS_MODE).

    With top_k=1 (or a tiny top_p) the distribution sampled from keeps one token: its log-prob is
    exactly 0, whereas the untruncated one of a random-ish tiny model is well below 0."""
    from vlrl.rollout import vllm_settings

    synced(vl)
    assert vl.engine.llm.llm_engine.vllm_config.model_config.logprobs_mode == vllm_settings.LOGPROBS_MODE
    for overrides in ({"top_k": 1, "seed": 3}, {"top_p": 1e-6, "seed": 3}):
        out = vl.engine.generate(vl.prompts, overrides)
        mask = out.response_mask.bool()
        assert out.rollout_log_probs[mask].abs().max().item() == 0.0
    full = vl.engine.generate(vl.prompts, {"seed": 3})
    assert full.rollout_log_probs[full.response_mask.bool()].lt(-1e-3).any()


def test_weights_taken_between_engine_steps_sample_the_rest_of_each_response(vl, tmp_path):
    """Partial rollouts: new weights loaded after the 4th engine step of a generation. Every token
    is labelled with the version that sampled it, and its log-prob is the one of that policy on the
    whole prefix: the old policy's before the switch, the new one's after it (the requests in flight
    recompute their KV cache under the new weights; with the old cache kept, the new policy's
    teacher-forced log-probs would not match). The update leaves the vision tower as it was (frozen:
    the engine keeps the image embeddings it computed, `load_weights_in_flight`)."""
    synced(vl)
    engine, temperature = vl.engine, 0.7
    new = copy.deepcopy(vl.base)
    language = {name: p for name, p in new.named_parameters() if ".visual." not in f".{name}"}
    with torch.no_grad():
        before = {name: p.clone() for name, p in new.named_parameters() if name not in language}
        perturb(new, seed=5, scale=0.3)
        for name, p in new.named_parameters():
            if name in before:
                p.copy_(before[name])
    new_folder = save_model(new, vl.path, str(tmp_path / "new"))
    calls = []

    def switch_after_four_steps() -> None:
        calls.append(None)
        if len(calls) == 5:
            engine.load_weights_in_flight(new.state_dict().items())
            engine.set_policy_version(8)

    engine.set_policy_version(7)
    engine.between_steps = switch_after_four_steps
    try:
        batch = engine.generate(vl.prompts, {"seed": 2, "temperature": temperature, "ignore_eos": True})
    finally:
        engine.between_steps, engine.policy_version = None, None
        sync_weights(vl.base, engine, bucket_mb=64)
    mask = batch.response_mask.bool()
    assert mask.all()  # ignore_eos: every response runs to the limit, past the switch
    versions = batch.rollout_versions
    assert set(versions.unique().tolist()) == {7, 8}
    for row in versions.tolist():
        switch = row.index(8)
        assert 0 < switch < len(row) and row == [7] * switch + [8] * (len(row) - switch)
    before, after = versions == 7, versions == 8
    old_lp = one_rank_actor(vl.path, temperature).compute_log_probs(batch)
    new_lp = one_rank_actor(new_folder, temperature).compute_log_probs(batch)
    engine_lp = batch.rollout_log_probs
    torch.testing.assert_close(engine_lp[before], old_lp[before], atol=2e-4, rtol=0)
    torch.testing.assert_close(engine_lp[after], new_lp[after], atol=2e-4, rtol=0)
    assert (old_lp - new_lp)[after].abs().max() > 0.05  # the two policies are told apart
