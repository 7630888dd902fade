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
