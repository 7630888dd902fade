"""The swanlab and mlflow loggers write with their real packages (offline, into the run folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlrl.trainer.loggers import Tracker


def test_swanlab_and_mlflow_log_metrics_locally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWANLAB_MODE", "local")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "run"
    tracker = Tracker(
        ["swanlab", "mlflow", "file"], "proj", "exp", str(run), {"worker": {"rollout": {"n": 5}}}
    )
    tracker.log({"reward/overall": 0.5, "actor/pg_loss": 1.0}, step=1)
    tracker.log({"reward/overall": 0.75}, step=2)
    tracker.log_generations([{"prompt": "p", "response": "r", "score": 1.0}], step=2)
    tracker.close()
    # mlflow: a file store under the run folder, one metric file per key, one line per step
    (metric,) = run.glob("mlruns/*/*/metrics/reward/overall")
    values = [line.split()[1] for line in metric.read_text().splitlines()]
    assert values == ["0.5", "0.75"]
    (param,) = run.glob("mlruns/*/*/params/worker.rollout.n")
    assert param.read_text() == "5"
    # swanlab: a local run folder with the config and the logged scalars
    (config,) = run.glob("swanlog/run-*/files/config.yaml")
    assert "rollout" in config.read_text()
    assert any(run.glob("swanlog/run-*/logs/*"))
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[1])["reward/overall"] == 0.75


def test_unknown_logger_is_never_dropped(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown logger 'neptune'"):
        Tracker(["neptune"], "p", "e", str(tmp_path), {})


def test_a_step_line_is_printed_without_the_console_logger(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """EasyR1's configs log to file and wandb only: a run still says where it is, once per step."""
    tracker = Tracker(["file"], "p", "e", str(tmp_path), {})
    tracker.log({"reward/overall": 0.25, "actor/pg_loss": 0.5}, step=3)
    tracker.log_generations([{"prompt": "p", "response": "r"}], step=3)
    tracker.close()
    err = capsys.readouterr().err
    assert "[step 3] reward/overall=0.25  pg_loss=0.5" in err and "sample" not in err


def test_console_samples_keep_both_ends_of_the_prompt(capsys: pytest.CaptureFixture) -> None:
    from vlrl.trainer.loggers import ConsoleLogger

    prompt = "QUESTION-7 " + "format boilerplate " * 40 + "END-OF-FORMAT"
    ConsoleLogger().log_generations([{"prompt": prompt, "response": "r"}], step=1)
    err = capsys.readouterr().err
    assert "QUESTION-7" in err and "END-OF-FORMAT" in err and "[...]" in err


def test_tensorboard_follows_tensorboard_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    tracker = Tracker(["tensorboard"], "proj", "exp", str(tmp_path / "run"), {})
    tracker.log({"reward/overall": 0.5}, step=1)
    tracker.close()
    assert list((tmp_path / "tb" / "proj" / "exp").glob("events.out.tfevents.*"))  # EasyR1's layout
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_wandb_without_a_key_says_how_to_run_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="WANDB_MODE=offline"):
        Tracker(["wandb"], "p", "e", str(tmp_path / "run"), {})


def test_each_start_is_an_attempt_and_the_history_takes_the_newest(tmp_path: Path) -> None:
    """Attempt 1 logs steps 1-3 and dies (its last line torn); attempt 2 resumes from the checkpoint
    of step 2: it validates first (a row of its own) and logs step 3 again with other values."""
    from vlrl.trainer.loggers import FileLogger, logged_history

    first = FileLogger(str(tmp_path))
    for step, reward in [(1, 0.1), (2, 0.2), (3, 0.3)]:
        first.log({"reward/overall": reward}, step=step)
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')  # killed mid-write
    second = FileLogger(str(tmp_path))
    assert second.attempt == 2
    assert logged_history(str(tmp_path), 2) == [
        {"step": 1, "reward/overall": 0.1},
        {"step": 2, "reward/overall": 0.2},
    ]
    second.log({"val/overall": 0.5}, step=2)
    second.log({"reward/overall": 0.35}, step=3)
    second.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()[:3]]
    assert [row["attempt"] for row in rows] == [1, 1, 1]
    assert logged_history(str(tmp_path), 3) == [
        {"step": 1, "reward/overall": 0.1},
        {"step": 2, "reward/overall": 0.2, "val/overall": 0.5},
        {"step": 3, "reward/overall": 0.35},
    ]
    assert FileLogger(str(tmp_path)).attempt == 3
