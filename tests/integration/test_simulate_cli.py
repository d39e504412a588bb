"""`noloco-node simulate --compare` end to end, as a user runs it: every method, the table, JSON and PNG."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

METHODS = ["noloco", "diloco", "diloco-nesterov", "ddp", "solo"]


def run_compare(out: Path, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "noloco_node", "simulate", "--compare", "--out", str(out), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def check_outputs(out: Path, replicas: int, steps: int) -> dict:
    metrics = json.loads((out / "metrics.json").read_text())
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = metrics["results"]
    assert list(results) == METHODS
    for name, result in results.items():
        assert result["steps"][0] == 0 and result["steps"][-1] == steps
        assert all(math.isfinite(v) for v in result["val_loss"])
        assert result["val_loss"][-1] < result["val_loss"][0] - 0.5, f"{name} did not learn"
        assert result["replicas"] == replicas
    # DiLoCo and DDP keep every replica identical; NoLoCo and solo do not, solo drifts furthest apart.
    assert results["diloco"]["spread"][-1] == 0.0
    assert results["diloco-nesterov"]["spread"][-1] == 0.0
    assert results["ddp"]["spread"][-1] == 0.0
    assert 0.0 < results["noloco"]["spread"][-1] < results["solo"]["spread"][-1]
    ppl = {name: r["final_val_ppl"] for name, r in results.items()}
    want = (ppl["diloco"] - ppl["noloco"]) / ppl["ddp"]
    assert metrics["relative_metric"]["diloco"] == pytest.approx(want)
    return metrics


def test_compare_with_an_odd_number_of_replicas(tmp_path: Path) -> None:
    done = run_compare(
        tmp_path, "--replicas", "3", "--steps", "60", "--inner-steps", "15", "--seq-len", "64", "--eval-batches", "2"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    check_outputs(tmp_path, replicas=3, steps=60)
    for method in METHODS:
        assert f"| {method} |" in done.stdout
    assert "(ppl_diloco - ppl_noloco) / ppl_ddp" in done.stdout
    assert "[         noloco] step    15/60" in done.stderr  # progress while it runs


@pytest.mark.slow
def test_default_compare_of_eight_replicas_on_the_tiny_model(tmp_path: Path) -> None:
    """The README's command with its defaults; about 6 minutes on 2 cores."""
    done = run_compare(tmp_path, "--replicas", "8", "--model", "tiny", timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = check_outputs(tmp_path, replicas=8, steps=600)
    assert metrics["results"]["noloco"]["final_val_loss"] < 2.5
