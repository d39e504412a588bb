"""A member made of two processes (torchrun, DDP with gloo on CPU) joins a swarm as one replica: it blends with a
plain node, its ranks end with identical weights, and a SIGTERM stops both ranks together, gracefully."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .swarm_harness import Bootstrap, NodeProcess

TRAIN = [
    *("--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2", "--inner-steps", "20"),
    *("--device", "cpu"),  # gloo on the host, on any machine (a GPU machine may have fewer GPUs than ranks)
]


def _member(bootstrap: Bootstrap, tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "member.log"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "noloco_node", "join", "--bootstrap", *bootstrap.maddrs, "--data-dir", str(tmp_path / "member"),
        "--status-port", "0", "--torch-threads", "1", *bootstrap.run_args(), *TRAIN, *args,
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT), log


def _digests(log: str) -> dict[int, tuple[int, str]]:
    found = re.findall(r"rank (\d) of 2 stopped at inner step (\d+), weights digest (\w+)", log)
    return {int(rank): (int(step), digest) for rank, step, digest in found}


@pytest.mark.slow  # a torchrun member of two ranks (its layout has unit tests): `make test-slow`
def test_a_two_process_member_blends_as_one_replica(bootstrap: Bootstrap, tmp_path: Path) -> None:
    # Each starts training once it sees the other: on a fast machine a plain node could otherwise finish its 120
    # steps while torchrun still starts the member.
    member, log = _member(bootstrap, tmp_path, "--steps", "120", "--pair-timeout", "5", "--wait-for-peers", "1")
    plain = NodeProcess(
        "plain",
        bootstrap,
        tmp_path,
        *TRAIN,
        "--steps",
        "120",
        "--pair-timeout",
        "5",
        "--shard-index",
        "7",
        "--wait-for-peers",
        "1",
    )
    try:
        assert member.wait(timeout=300) == 0, log.read_text()[-4000:]
        assert plain.wait(timeout=300) == 0, plain.output()[-3000:]
        digests = _digests(log.read_text())
        assert set(digests) == {0, 1} and digests[0] == digests[1], digests  # both ranks: step 120, same weights
        assert digests[0][0] == 120
        plain_status = plain.status()
        assert plain_status is not None
        partners = {h["partner"] for h in plain_status["history"] if h["partner"]}
        member_id = (tmp_path / "member" / "status.json").read_text()
        assert partners and all(p in member_id for p in partners)  # the plain node blended with the member
    finally:
        plain.stop()
        if member.poll() is None:
            member.kill()


@pytest.mark.slow  # the fast tier runs a two-process member in the test above: `make test-slow`
def test_sigterm_stops_every_rank_of_a_member_at_the_same_step(bootstrap: Bootstrap, tmp_path: Path) -> None:
    member, log = _member(bootstrap, tmp_path, "--steps", "100000", "--pair-timeout", "2", "--log-every", "0")
    try:
        deadline = time.monotonic() + 120
        while "outer step 2 " not in log.read_text():
            assert time.monotonic() < deadline and member.poll() is None, log.read_text()[-4000:]
            time.sleep(0.5)
        member.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
        # torchrun itself reports a signal as a failure (SignalException, exit 1) whatever its workers did: what
        # matters is what the ranks did.
        member.wait(timeout=60)
        assert "stopping: finishing the current step" in log.read_text()
        digests = _digests(log.read_text())
        assert set(digests) == {0, 1} and digests[0] == digests[1], digests
        assert (tmp_path / "member" / "checkpoint.pt").exists()
    finally:
        if member.poll() is None:
            member.kill()
