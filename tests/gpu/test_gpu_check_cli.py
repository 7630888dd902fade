"""`python -m vlrl.tools.gpu_check` on CUDA writes a report naming the GPU (one quick check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_command_writes_a_cuda_report(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vlrl.tools.gpu_check", "--only", "attention", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["options"]["device"] == "cuda" and report["environment"]["cuda_available"] is True
    assert report["summary"]["attention"]["status"] == "pass", proc.stdout + proc.stderr
