"""CPU tests of the GPU acceptance suite (vlrl.tools.gpu_check): the command line, check selection,
error capture, time limits, the report and its table, the 3B-shape config, and a full run of every
check on tiny shapes with the packages the GPU machine lacks made unimportable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlrl.tools.gpu_check.cli import ALL_CHECKS, CHECKS, PRESETS, CheckSpec, run_suite, select, time_plan
from vlrl.tools.gpu_check.report import (
    CheckTimeout,
    build_report,
    format_markdown,
    format_table,
    run_check,
    time_limit,
)

ROOT = Path(__file__).resolve().parents[1]
# Not installed on the GPU machine (shared/ENVIRONMENT.md): the suite must never import them.
MISSING_ON_GPU_MACHINE = (
    "vllm",
    "ray",
    "flash_attn",
    "tensordict",
    "omegaconf",
    "datasets",
    "qwen_vl_utils",
    "wandb",
)
# A None entry in sys.modules makes `import x` fail and `importlib.util.find_spec(x)` return None,
# exactly as for a package that is not installed (CPython's importlib: find_spec, _find_and_load).
BLOCKER = f"import sys\nsys.modules.update(dict.fromkeys({MISSING_ON_GPU_MACHINE!r}))\n"


def _python(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_every_check_without_the_missing_packages() -> None:
    proc = _python(
        "import sys, runpy; sys.argv = ['gpu_check', '--help']; runpy.run_module('vlrl.tools.gpu_check', run_name='__main__')"
    )
    assert proc.returncode == 0, proc.stderr
    for name in ALL_CHECKS:
        assert name in proc.stdout


def test_select_keeps_registry_order_and_rejects_unknown_names() -> None:
    assert [s.name for s in select(None)] == list(CHECKS)
    assert [s.name for s in select("qwen3b_update, attention")] == ["attention", "qwen3b_update"]
    with pytest.raises(SystemExit, match="unknown check"):
        select("attention,nope")


def _ok(ctx, outcome) -> None:
    outcome.summary["value"] = 1.5
    outcome.expect(True, "never shown")


def _raises(ctx, outcome) -> None:
    outcome.details["measured_before_the_error"] = 7
    raise RuntimeError("boom on purpose")


def _finds_a_problem(ctx, outcome) -> None:
    outcome.expect(False, "a measured value is out of bounds")


def _slow(ctx, outcome) -> None:
    time.sleep(5)


def test_time_limits_fit_the_ten_minute_budget() -> None:
    """Every preset is one run of at most 10 minutes on one GPU (570 s of limits + start-up)."""
    for preset in PRESETS.values():
        assert sum(spec.limit_s for spec in preset.values()) <= 570
    plan = time_plan(list(PRESETS["scale"].values()))
    assert "logprob_memory" in plan and "update_mfu" in plan and "total              at most   500 s" in plan


def test_a_raising_check_is_recorded_and_the_others_still_run() -> None:
    registry = {
        "raises": CheckSpec("raises", f"{__name__}:_raises", 10, "raises"),
        "ok": CheckSpec("ok", f"{__name__}:_ok", 10, "passes"),
        "bad": CheckSpec("bad", f"{__name__}:_finds_a_problem", 10, "finds a problem"),
        "no_module": CheckSpec("no_module", "vlrl.tools.gpu_check.no_such_module:check", 10, "cannot import"),
    }
    results = run_suite(list(registry.values()), ctx=None, log=lambda _: None)
    by_name = {r.name: r for r in results}
    assert [r.name for r in results] == list(registry)
    raised = by_name["raises"]
    assert raised.status == "fail" and raised.error == "RuntimeError: boom on purpose"
    assert "_raises" in raised.traceback and raised.details == {"measured_before_the_error": 7}
    assert by_name["ok"].status == "pass" and by_name["ok"].summary == {"value": 1.5}
    assert by_name["bad"].status == "fail" and by_name["bad"].failures == [
        "a measured value is out of bounds"
    ]
    assert by_name["no_module"].status == "fail" and "ModuleNotFoundError" in by_name["no_module"].error
    report = build_report(results, {"device": "cpu"}, {"torch": "x"})
    assert report["ok"] is False
    assert report["summary"]["ok"] == {"status": "pass", "seconds": by_name["ok"].seconds, "value": 1.5}
    table = format_table(report)
    assert "boom on purpose" in table and "a measured value is out of bounds" in table
    assert "SOME CHECKS FAILED" in table
    json.dumps(report)  # JSON-safe


def test_time_limit_stops_a_check() -> None:
    start = time.perf_counter()
    result = run_check("slow", _slow, None, limit_s=0.5)
    assert time.perf_counter() - start < 3
    assert result.status == "fail" and result.error.startswith("CheckTimeout")
    with pytest.raises(CheckTimeout), time_limit(0.2):
        time.sleep(2)


def test_time_limit_restores_an_outer_timer() -> None:
    import signal

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.6)
        with time_limit(5):
            time.sleep(0.1)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 0.5
        time.sleep(0.8)
        assert fired == [True]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_report_is_json_safe_for_nan_and_objects() -> None:
    from vlrl.tools.gpu_check.report import CheckResult

    result = CheckResult("x", "pass", 0.1, {"mfu": float("nan")}, {"shape": (1, 2), "obj": object()}, [])
    report = build_report([result], {}, {})
    text = json.dumps(report, allow_nan=False)
    assert '"mfu": "nan"' in text and report["checks"][0]["details"]["shape"] == [1, 2]


def test_qwen25_vl_3b_shapes() -> None:
    """The stated config builds a model of Qwen2.5-VL-3B-Instruct's size (3.75 B parameters,
    vision tower 0.67 B) and FLOPs of ~6 N per token (N: decoder matmul parameters)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlrl.models.flops import decoder_matmul_params, flops_per_token
    from vlrl.models.tiny import SIZES, _token_ids, build_tokenizer
    from vlrl.tools.gpu_check.qwen3b_check import qwen25_vl_3b_config

    config = qwen25_vl_3b_config(_token_ids(build_tokenizer(SIZES["tiny"].vocab)))
    text, vision = config.text_config, config.vision_config
    assert (text.num_hidden_layers, text.hidden_size, text.intermediate_size) == (36, 2048, 11008)
    assert (text.num_attention_heads, text.num_key_value_heads, text.vocab_size) == (16, 2, 151936)
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size) == (32, 1280, 2048)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in model.model.visual.parameters())
    assert 3.70e9 < total < 3.80e9, total
    assert 0.66e9 < tower < 0.68e9, tower
    assert (
        6 * decoder_matmul_params(config)
        < flops_per_token(config, 1024)
        < 6.5 * decoder_matmul_params(config)
    )


def test_full_cpu_run_of_every_check_without_the_missing_packages(tmp_path: Path) -> None:
    """The whole suite on tiny shapes (`--device cpu`), with vLLM, Ray, tensordict, omegaconf,
    datasets, ... unimportable: every check runs and passes (two_ranks over two gloo processes;
    vllm_engine skips without vLLM, tests/rollout/test_vllm_check.py runs it), and the report has
    its structure."""
    out = tmp_path / "report.json"
    code = "import sys; from vlrl.tools.gpu_check.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = _python(
        code, "--device", "cpu", "--out", str(out), "--workdir", str(tmp_path / "work"), timeout=400
    )
    assert out.exists(), proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    failed = {c["name"]: (c["failures"], c["error"]) for c in report["checks"] if c["status"] == "fail"}
    assert not failed, failed
    assert statuses.pop("vllm_engine") == "skip"  # vLLM is blocked, as on the bare GPU machine
    assert set(statuses.values()) == {"pass"}, statuses
    assert proc.returncode == 0
    assert [c["name"] for c in report["checks"]] == list(CHECKS)
    assert report["ok"] is True and report["options"]["small"] is True and report["options"]["complete"]
    assert set(report["summary"]) == set(CHECKS)
    worker = next(c for c in report["checks"] if c["name"] == "rank_worker")
    phases = [
        "setup",
        "generate",
        "log_probs",
        "update_1",
        "update_2",
        "update_3",
        "checkpoint",
        "resume",
        "model_only_save",
    ]
    assert list(worker["details"]["memory"]) == phases
    assert "ALL PASSED" in proc.stdout


def test_a_missing_torchvision_stops_the_check_at_once_naming_it(tmp_path: Path) -> None:
    """Issue 31, finding 1: without torchvision every model check failed (the tiny processors hold a
    video processor), one of them after writing a 7.5 GB model; now the start-up says so in a line."""
    out = tmp_path / "report.json"
    code = (
        "sys.modules['torchvision'] = None\n"
        "from vlrl.tools.gpu_check.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = _python(code, "--device", "cpu", "--out", str(out), timeout=120)
    assert proc.returncode != 0 and not out.exists()
    assert "gpu_check needs these packages, not installed here: torchvision" in proc.stderr


def test_attention_check_catches_a_backend_that_mixes_sequences(tmp_path: Path, monkeypatch) -> None:
    """A "mask" backend whose mask lets a sequence see the one before it must be reported."""
    import torch

    from vlrl.models.attention import VarlenInfo
    from vlrl.tools.gpu_check.attention_check import check_attention
    from vlrl.tools.gpu_check.context import Context
    from vlrl.tools.gpu_check.report import Outcome

    def plain_causal(self: VarlenInfo) -> torch.Tensor:
        total = sum(self.lengths)
        return torch.ones(total, total, dtype=torch.bool).tril()

    monkeypatch.setattr(VarlenInfo, "block_causal_mask", plain_causal)
    outcome = Outcome()
    check_attention(Context(torch.device("cpu"), small=True, workdir=tmp_path), outcome)
    assert outcome.failures and all(f.startswith("mask:") for f in outcome.failures), outcome.failures
    assert outcome.summary["mask_max_err"] > 0.1 and outcome.summary["loop_max_err"] < 0.1


def test_scale_estimates() -> None:
    """The full-logits estimate, the layers "every_k:2" leaves un-checkpointed and the lighter
    policy's budget (largest power of two whose kept activations fit)."""
    from vlrl.tools.gpu_check.scale_check import full_logits_bytes, kept_layers, light_budget

    assert full_logits_bytes(16 * 8192, 151936) == 16 * 8192 * 151936 * 2  # 39.8 GB of bf16 logits
    assert kept_layers(36, 1) == 0 and kept_layers(36, 2) == 18 and kept_layers(36, 4) == 27
    per_token = 117 * 1024
    assert light_budget(8 * 2**30, per_token, 18, 16384) == 2048  # 8 GiB / (18 x 117 KiB) = 3,983 tokens
    assert light_budget(64 * 2**30, per_token, 18, 16384) == 16384  # capped at the "all" budget
    assert light_budget(0, per_token, 18, 16384) == 0
    assert light_budget(0, per_token, 0, 16384) == 16384  # nothing kept: no activation cost


def test_full_cpu_run_of_the_scale_preset(tmp_path: Path) -> None:
    """`--preset scale` on CPU (tiny stand-in, missing GPU-machine packages blocked): both checks
    pass, the update runs "all", the lighter policy and "all" at its budget, and the JSON and
    Markdown reports carry the goal lines."""
    out = tmp_path / "scale.json"
    code = "import sys; from vlrl.tools.gpu_check.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ("--preset", "scale", "--device", "cpu", "--out", str(out), "--workdir", str(tmp_path / "w"))
    proc = _python(code, *args, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "time budget" in proc.stdout and "at most   600 s" in proc.stdout  # 200 s x the CPU scale 3
    report = json.loads(out.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["logprob_memory", "update_mfu"] and report["ok"] is True
    update = checks["update_mfu"]["details"]
    assert update["all"]["checkpointed_layers"] == [2, 2]  # vision blocks and decoder layers
    assert update["every_k:2"]["checkpointed_layers"] == [1, 1]
    assert update["all"]["token_budget"] == 64 and update["every_k:2"]["token_budget"] == 32
    assert len(update["every_k:2"]["micro_batches"]) >= len(update["all"]["micro_batches"]) > 1
    assert "all@32" in update and update["all@32"]["checkpointed_layers"] == [2, 2]
    logprob = checks["logprob_memory"]
    assert logprob["summary"]["vocab"] == 2048 and logprob["details"]["full_logits_estimate_mib"] > 0
    markdown = (tmp_path / "scale.md").read_text()
    assert "## Goals" in markdown and "update MFU >= 35% (checkpointing 'all', 64-token" in markdown
    assert "full bf16 logits would take" in markdown


def test_markdown_lists_goals_and_failures() -> None:
    from vlrl.tools.gpu_check.report import CheckResult

    ok = CheckResult("a", "pass", 1.0, {"mfu": 0.1}, {"goal_lines": ["MFU >= 35%: NOT met (10.0%)"]}, [])
    bad = CheckResult("b", "fail", 2.0, {}, {}, ["too slow | really"], error="RuntimeError: boom")
    text = format_markdown(build_report([ok, bad], {"complete": True}, {"torch": "2.11"}))
    assert "| a | pass | 1.0 | mfu=0.1 |" in text
    assert "- a: MFU >= 35%: NOT met (10.0%)" in text
    assert "- b: too slow / really" in text and "- b: RuntimeError: boom" in text
