"""Receipts on real swarms: the ledger rebuilt from the receipts of four honest members and of a pair of free keys that
only ever blended with each other (real node processes, real DHTs, real gRPC on 127.0.0.1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from noloco_node.rpc.client import UNACKNOWLEDGED

from .swarm_harness import Bootstrap, NodeProcess, stop_all

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2", "--inner-steps", "20"]


@pytest.mark.slow
def test_the_ledger_credits_each_honest_member_its_own_blends_and_shows_a_pair_of_free_keys_as_a_closed_cluster(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    """Four members of a run, and two more of the same run (the same settings: the run's fingerprint) on a DHT of
    their own: fresh keys that can only sign receipts for each other. The ledger, from all six data directories,
    credits each honest member with exactly the blends its own status counted, and prints the pair as a cluster no
    honest member ever exchanged with."""

    def member(name: str, dht: Bootstrap, index: int, others: int) -> NodeProcess:
        args = ["--steps", "100", "--shard-index", str(index), "--pair-timeout", "5", "--wait-for-peers", str(others)]
        return NodeProcess(name, dht, tmp_path, *TRAIN, *args)

    honest = [member(f"honest{i}", bootstrap, i, 3) for i in range(4)]
    (tmp_path / "elsewhere").mkdir()
    elsewhere = Bootstrap(tmp_path / "elsewhere").for_run(bootstrap.run_name or "")
    pair = [member(f"sybil{i}", elsewhere, i, 1) for i in range(2)]
    try:
        codes = [node.wait(timeout=400) for node in [*honest, *pair]]
        assert codes == [0] * 6, "\n".join(node.output()[-1500:] for node in [*honest, *pair])
    finally:
        stop_all([*honest, *pair])
        elsewhere.stop()
    answer = subprocess.run(
        [sys.executable, "-m", "noloco_node", "contributions", "--json", *(str(n.data_dir) for n in [*honest, *pair])],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    ledger = json.loads(answer.stdout)
    members = {m["peer_id"]: m for m in ledger["members"]}
    honest_ids = {node.status()["peer_id"] for node in honest}
    pair_ids = {node.status()["peer_id"] for node in pair}
    for node in honest:
        status = node.status()
        blends = sum(1 for h in status["history"] if h["partner"])
        in_doubt = status["exchange_outcomes"].get(UNACKNOWLEDGED, 0)  # acks lost: the server's receipt credits more
        assert blends >= 3 and blends <= members[status["peer_id"]]["blends"] <= blends + in_doubt, (node.name, members)
    assert set(ledger["swarm"]) == honest_ids and ledger["closed_clusters"] == [sorted(pair_ids)]
    for sybil in pair_ids:
        assert set(members[sybil]["partners"]) == pair_ids - {sybil} and members[sybil]["blends"] >= 1
    assert ledger["refused"] == {}
    report = subprocess.run(
        [sys.executable, "-m", "noloco_node", "contributions", *(str(n.data_dir) for n in [*honest, *pair])],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "closed cluster" in report and all(peer in report for peer in pair_ids)
