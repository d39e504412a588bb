"""A member of two ranks shards its model (FSDP2, gloo on the CPU): its steps are those of one process training
the same two data slices, its whole-model calls between phases (gather, evaluate, a candidate's loss, the outer
step, a snapshot and its reload) give what one process's give, and each rank holds half the training state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from noloco_node.training.replica import Replica

from .sharded_member_worker import PHASE, shard, source, train_config, validation

WORKER = Path(__file__).with_name("sharded_member_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _single_process_reference() -> dict[str, object]:
    """The same maths in one process: a replica of two data shards averages their gradients at every step."""
    torch.set_num_threads(1)
    replica = Replica(source(), train_config(), [shard(0, 2), shard(1, 2)])
    for _ in range(PHASE):
        replica.train_step()
    theta = [t.clone() for t in replica.fast_weights()]
    halfway = [0.5 * (a + b) for a, b in zip(theta, replica.phi, strict=True)]
    reference = {
        "theta_after_phase": theta,
        "val_loss": replica.evaluate(validation()),
        "loss_of_halfway": replica.loss_of(halfway, validation()),
        "state_bytes": sum(p.numel() for p in replica.params) * (4 + 4 + 8),
    }
    replica.apply_outer_step(halfway, [a - b for a, b in zip(halfway, replica.phi, strict=True)])
    for _ in range(PHASE):
        replica.train_step()
    reference["theta_final"] = [t.clone() for t in replica.fast_weights()]
    return reference


def _close(mine: list[torch.Tensor], reference: list[torch.Tensor]) -> bool:
    return all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(mine, reference, strict=True))


def test_a_sharded_member_trains_and_blends_as_one_process_with_half_the_state_per_rank(tmp_path: Path) -> None:
    out = tmp_path / "rank0.pt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER), str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    digests = [line for line in done.stdout.splitlines() + done.stderr.splitlines() if "weights digest" in line]
    report = torch.load(out, weights_only=False)
    reference = _single_process_reference()

    assert len(report["theta_after_phase"]) == len(reference["theta_after_phase"])
    assert _close(report["theta_after_phase"], reference["theta_after_phase"])
    assert abs(report["val_loss"] - reference["val_loss"]) < 1e-4
    assert abs(report["loss_of_halfway"] - reference["loss_of_halfway"]) < 1e-4
    assert report["val_loss_again"] == report["val_loss"]  # the candidate's measure left this replica's weights
    assert report["loss_of_halfway"] != report["val_loss"]
    assert report["state_theta_is_halfway"]  # the outer step wrote theta = phi into both ranks' shards
    assert report["inner_step"] == 2 * PHASE
    assert _close(report["theta_final"], reference["theta_final"])  # the phase after the outer step, and the reload
    # Each rank holds half of the weights, the gradients and Adam's moments.
    for rank in (0, 1):
        held = json.loads((tmp_path / f"rank0.pt.rank{rank}").read_text())["state_bytes"]
        assert abs(held / reference["state_bytes"] - 0.5) < 0.01, (rank, held, reference["state_bytes"])
    # Both ranks leave with the same whole weights (each gathers them).
    found = {line.split("weights digest ")[1].strip() for line in digests}
    assert len(digests) == 2 and len(found) == 1, digests
