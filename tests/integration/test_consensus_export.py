"""From raw text to a usable model with real processes: a tokenizer trained here, a prepared corpus, a 3-node
swarm training on it, and `export --from swarm` averaging the live members' slow weights over GetState."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .swarm_harness import Bootstrap, NodeProcess, stop_all

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "4", "--inner-steps", "20"]


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "noloco_node", *args], capture_output=True, text=True, timeout=timeout, env=os.environ
    )


def _prepared_corpus(tmp_path: Path) -> Path:
    """A byte-level BPE trained on 1 MB of the standard library, and 3 MB of it tokenized with it."""
    tokenizer = tmp_path / "tokenizer.json"
    done = _cli("data", "tokenizer", "stdlib", "--vocab-size", "512", "--max-bytes", "1000000", "--out", str(tokenizer))
    assert done.returncode == 0, done.stderr
    prepared = tmp_path / "prepared"
    done = _cli(
        "data", "prepare", "stdlib", "--tokenizer", str(tokenizer), "--max-bytes", "3000000", "--out", str(prepared)
    )
    assert done.returncode == 0, done.stderr
    assert "validation:" in done.stdout and json.loads((prepared / "meta.json").read_text())["vocab_size"] == 512
    return prepared


@pytest.mark.slow  # a learning test: a corpus and tokenizer prepared, three nodes trained (about 90 s)
def test_consensus_of_three_live_nodes_is_no_worse_than_its_members(bootstrap: Bootstrap, tmp_path: Path) -> None:
    prepared = _prepared_corpus(tmp_path)
    nodes: list[NodeProcess] = []
    for i in range(3):
        # No --shard-index: each joiner picks a shard no live peer holds (they start one after another, as real
        # members do; two starting in the same second could still collide).
        nodes.append(
            NodeProcess(
                f"node{i}", bootstrap, tmp_path, *TRAIN, "--data", str(prepared), "--steps", "100000",
                "--num-shards", "3", "--pair-timeout", "5",
            )
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not (status := nodes[-1].status()) or not status["status_url"]:
            assert nodes[-1].process.poll() is None and time.monotonic() < deadline, nodes[-1].output()[-2000:]
            time.sleep(0.5)
        # The next joiner picks its shard from the records it finds: this one's must be in the DHT first.
        while status["peer_id"] not in (listed := _cli("peers", "--url", status["status_url"], timeout=60)).stdout:
            assert time.monotonic() < deadline, listed.stdout + listed.stderr
    shards = [json.loads((node.data_dir / "shard.json").read_text())["shard"] for node in nodes]
    assert sorted(shards) == [0, 1, 2], shards
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            statuses = [node.status() for node in nodes]
            if all(s and s["outer_step"] >= 6 for s in statuses):
                break
            assert all(node.process.poll() is None for node in nodes), "\n".join(n.output()[-2000:] for n in nodes)
            time.sleep(1.0)
        else:
            pytest.fail("the swarm did not reach outer step 6:\n" + "\n".join(n.output()[-1500:] for n in nodes))
        peer_ids = {node.status()["peer_id"] for node in nodes}
        # Another run-wide setting than the swarm's is another run: nothing is exported, and the error says which.
        other = _cli(
            "export", "--from", "swarm", "--peers", "3", "--wait", "3", "--out", str(tmp_path / "other"),
            "--data", str(prepared), *TRAIN, "--inner-steps", "30", "--steps", "100000", *bootstrap.run_args(),
            "--bootstrap", *bootstrap.maddrs,
        )  # fmt: skip
        assert other.returncode != 0 and not (tmp_path / "other").exists(), other.stdout
        assert "trains with other run-wide settings" in other.stderr, other.stderr
        assert "inner_steps 20 (this node: 30)" in other.stderr, other.stderr
        out = tmp_path / "consensus"
        done = _cli(
            "export", "--from", "swarm", "--peers", "3", "--eval", "--out", str(out), "--data", str(prepared),
            *TRAIN, "--steps", "100000", *bootstrap.run_args(), "--bootstrap", *bootstrap.maddrs,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        print(done.stdout)
    finally:
        stop_all(nodes)
    meta = json.loads((out / "noloco.json").read_text())
    members = meta["members"]
    assert {m["peer_id"] for m in members} == peer_ids  # the three live nodes, each once
    assert all(m["outer_step"] >= 6 for m in members)
    # The replicas differ (NoLoCo never makes them identical), and the average sits between them.
    assert meta["spread_rms_std"] > 0 and all(0 < m["distance"] < 0.5 for m in members)
    losses = [m["val_loss"] for m in members]
    assert meta["members_mean_val_loss"] == pytest.approx(statistics.fmean(losses))
    assert meta["val_loss"] <= meta["members_mean_val_loss"], done.stdout
    assert "lower than or equal to the members' mean" in done.stdout
    # The exported folder is a usable model: eval reads it with its own tokenizer, on the same prepared data.
    evaluated = _cli("eval", str(out), "--data", str(prepared), "--seq-len", "64", "--batches", "4", "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    result = json.loads(evaluated.stdout)
    # the same windows (seq 64, 4 batches of 8) as export's own evaluation: the round trip kept every weight
    assert result["loss"] == pytest.approx(meta["val_loss"], rel=1e-5)
    assert result["loss"] < math.log(512) - 0.3  # it learnt: the initial loss is ln(vocabulary)
    assert (out / "tokenizer.json").read_text() == (prepared / "tokenizer.json").read_text()
