"""RL post-training with shared rollouts (`noloco-node rl`, docs/rl.md) between real node processes, over the real
DHT and gRPC on 127.0.0.1: rollouts one node publishes are fetched and scored by the others; a liar's completions
are scored by the receiver and earn nothing; malformed batches are refused whole, counted by reason, and change
nothing; a peer that dies does not hold anyone up; a node with no peer, or with J = 0, trains alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from ..hf_models import save_model
from .swarm_harness import Bootstrap, NodeProcess, stop_all

# A small node: a short warm-up, I = J = 2 groups of G = 4 per round, runs until stopped.
RL = ["--format-steps", "10", "--local", "2", "--external", "2", "--group-size", "4", "--rounds", "100000"]
RL += ["--max-new-tokens", "4", "--seq-len", "128", "--external-wait", "1"]


def _wait_for(what: str, condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.5)


def _status(node: NodeProcess) -> dict:
    return node.status() or {}


def _rl_node(name: str, bootstrap: Bootstrap, base: Path, *args: str) -> NodeProcess:
    return NodeProcess(name, bootstrap, base, *RL, "--seed", str(zlib.crc32(name.encode()) % 1000), *args, work="rl")


def _liar(bootstrap: Bootstrap, lie: str) -> subprocess.Popen[str]:
    """A hostile member (noloco_bench/rollout_liar.py) that lives until the test stops it."""
    command = [sys.executable, "-m", "noloco_bench.rollout_liar", "--bootstrap", *bootstrap.maddrs]
    command += ["--run-name", str(bootstrap.run_name), "--lie", lie, "--seconds", "600"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# The malformations a hostile peer's batch is refused for, each from a member of its own (tests/unit/
# test_rl_rollouts.py refuses every reason; these cross real gRPC and the DHT).
MALFORMED = ("group_size", "unknown_family", "completion_too_long", "round", "peer")


@pytest.mark.slow  # RL over real gRPC stays in the fast tier (test_rollout_service.py): `make test-slow`
def test_rollouts_are_shared_scored_by_the_receiver_liars_earn_nothing_and_a_dead_peer_blocks_nobody(
    bootstrap: Bootstrap, tmp_path
):
    nodes = [_rl_node(f"n{i}", bootstrap, tmp_path) for i in range(3)]
    liars = [_liar(bootstrap, ",".join(("wrong", *MALFORMED)))]  # six members in one process
    try:
        # Every node trains on its peers' rollouts, each scored here, and refuses every malformed batch whole.
        _wait_for(
            "every node used its honest peers' and the liar's rollouts and refused every malformation",
            lambda: all(
                sum(1 for p in _status(n).get("peers", []) if p["rollouts_used"] > 0) >= 3
                and set(_status(n).get("rollouts_refused", {})) == set(MALFORMED)
                for n in nodes
            ),
            timeout=180,
        )
        honest = {_status(n)["peer_id"] for n in nodes}
        for node in nodes:
            status = _status(node)
            assert status["rollouts_served"] > 0, status
            scored = [p for p in status["rewards"] if p["external_groups"] > 0]
            assert scored and all(p["external_reward"] is not None for p in scored)
            used = {p["peer_id"]: p for p in status["peers"] if p["rollouts_used"] > 0}
            assert honest - {status["peer_id"]} <= set(used), used
            # The liar's completions, scored by this node's verifier, earn 0 whatever it says of them: every
            # advantage in its groups is 0, and they move nothing (tests/unit/test_grpo.py).
            (liar,) = (p for p in used.values() if p["peer_id"] not in honest)
            assert liar["reward"] == 0.0, liar
            # Malformed batches were refused whole: what was used came from the honest nodes and the liar alone.
            assert sum(p["rollouts_used"] for p in used.values()) == status["rollouts_used"]
            assert "refused the rollouts of peer" in node.output()
        # One honest node dies mid-round, without leaving: the others go on at their pace.
        os.kill(nodes[2].process.pid, signal.SIGKILL)
        nodes[2].process.wait(10)
        before = [_status(n)["round"] for n in nodes[:2]]
        # A round waits at most --external-wait (1 s) for peers' rollouts, plus its own work: four more rounds
        # each come well within 60 s unless a survivor waits on the dead node.
        _wait_for(
            f"four more rounds on both survivors (from {before})",
            lambda: all(_status(n)["round"] >= r + 4 for n, r in zip(nodes[:2], before, strict=True)),
            60,
        )
        for node in nodes[:2]:
            assert _status(node)["health"]["state"] == "training", _status(node)["health"]
    finally:
        for liar in liars:
            liar.terminate()
        for liar in liars:
            liar.communicate(timeout=30)
        stop_all(nodes)
    for node in nodes[:2]:
        assert node.process.returncode == 0, node.output()[-3000:]


@pytest.mark.slow  # the fast tier shares rollouts in the test above: `make test-slow` (docs/testing.md)
def test_nodes_of_other_models_share_rollouts_and_a_node_alone_or_with_j_zero_trains_on_its_own(
    bootstrap: Bootstrap, tmp_path
):
    # A Hugging Face Qwen2 folder with a BPE tokenizer of its own (--init-from), alone at first.
    folder = save_model("qwen2", tmp_path / "qwen2")
    hf = _rl_node("hf", bootstrap, tmp_path, "--init-from", str(folder))
    others: list[NodeProcess] = []
    try:
        _wait_for("a lone node made rounds", lambda: _status(hf).get("round", 0) >= 5, timeout=120)
        status = _status(hf)
        assert all(p["external_groups"] == 0 and p["local_groups"] == 2 for p in status["rewards"])
        assert status["health"]["state"] == "training" and "qwen2" in status["model"].lower()
        # This project's decoder joins (it shares text, not weights, so the models may differ), and a node with
        # J = 0 that trains on its own rollouts alone and still serves them.
        others = [
            _rl_node("decoder", bootstrap, tmp_path),
            _rl_node("solo", bootstrap, tmp_path, "--external", "0", "--rounds", "30"),
        ]
        decoder, solo = others
        _wait_for(
            "the two models trained on each other's rollouts",
            lambda: all(_status(n).get("rollouts_used", 0) >= 4 for n in (hf, decoder)),
            timeout=120,
        )
        # Its endpoint: the status as JSON, the page that draws it, the counters for Prometheus.
        url = _status(decoder)["status_url"]
        with urllib.request.urlopen(f"{url}/status", timeout=10) as answer:
            assert json.load(answer)["kind"] == "rl"
        with urllib.request.urlopen(f"{url}/", timeout=10) as answer:
            assert b"noloco-node rl" in answer.read()
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        assert 'noloco_rl_rollouts_total{family="' in metrics and "noloco_rl_round " in metrics
        assert solo.wait(120) == 0, solo.output()[-3000:]
        status = _status(solo)
        assert status["round"] == 30 and status["health"]["state"] == "finished"
        assert status["rollouts_fetched"] == 0 and all(p["external_groups"] == 0 for p in status["rewards"])
    finally:
        stop_all([hf, *others])
    assert hf.process.returncode == 0, hf.output()[-3000:]
