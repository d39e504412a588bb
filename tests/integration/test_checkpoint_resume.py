"""A training process killed with SIGKILL resumes from its last checkpoint to bit-identical weights."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

STEPS = 200


def train_command(checkpoint_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "noloco_node",
        "--log-level",
        "WARNING",
        "train",
        "--model",
        "tiny",
        "--steps",
        str(STEPS),
        "--inner-steps",
        "25",
        "--checkpoint-every",
        "10",
        "--seq-len",
        "64",
        "--batch-size",
        "8",
        "--eval-batches",
        "2",
        "--seed",
        "11",
        "--checkpoint-dir",
        str(checkpoint_dir),
    ]


def read_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_sigkill_mid_run_then_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    reference_dir, interrupted_dir = tmp_path / "reference", tmp_path / "interrupted"
    subprocess.run(train_command(reference_dir), check=True, timeout=300)

    process = subprocess.Popen(train_command(interrupted_dir))
    checkpoint = interrupted_dir / "checkpoint.pt"
    deadline = time.monotonic() + 240
    killed_at = None
    while time.monotonic() < deadline and process.poll() is None:
        if checkpoint.exists():
            step = read_checkpoint(checkpoint)["replica"]["inner_step"]
            if step >= STEPS // 4:
                process.send_signal(signal.SIGKILL)
                killed_at = step
                break
        time.sleep(0.02)
    assert process.wait(timeout=30) == -signal.SIGKILL, "the run finished before it could be killed"
    last_saved = read_checkpoint(checkpoint)["replica"]["inner_step"]
    assert killed_at is not None and last_saved < STEPS, f"killed at {killed_at}, last checkpoint {last_saved}"

    subprocess.run(train_command(interrupted_dir), check=True, timeout=300)

    reference = read_checkpoint(reference_dir / "checkpoint.pt")["replica"]
    resumed = read_checkpoint(checkpoint)["replica"]
    assert resumed["inner_step"] == reference["inner_step"] == STEPS
    assert resumed["outer_step"] == reference["outer_step"] == STEPS // 25
    assert resumed["data_positions"] == reference["data_positions"]
    for key in ("theta", "phi", "delta"):
        for name, a, b in zip(reference["param_names"], reference[key], resumed[key], strict=True):
            assert torch.equal(a, b), f"{key} of {name} differs after resume"
    for index, state in reference["optimizer"]["state"].items():
        for field, value in state.items():
            assert torch.equal(value, resumed["optimizer"]["state"][index][field]), f"Adam {field} of {index}"
