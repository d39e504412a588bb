"""Real swarms on loopback: a bootstrap peer and node processes that discover each other, exchange and learn."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from noloco_node.algorithm import noloco_outer_step
from noloco_node.config import DataConfig, TrainConfig, model_config_for
from noloco_node.data import ReplicaShard, load_corpus

from .swarm_harness import Bootstrap, NodeProcess

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "4"]


@pytest.fixture
def bootstrap(tmp_path: Path):
    peer = Bootstrap(tmp_path)
    yield peer
    peer.stop()


def test_three_nodes_discover_each_other_exchange_and_learn(bootstrap: Bootstrap, tmp_path: Path) -> None:
    nodes = [
        NodeProcess(
            f"node{i}",
            bootstrap,
            tmp_path,
            *TRAIN,
            "--steps",
            "200",
            "--inner-steps",
            "20",
            "--shard-index",
            str(i),
            "--pair-timeout",
            "5",
        )
        for i in range(3)
    ]
    try:
        codes = [node.wait(timeout=300) for node in nodes]
        assert codes == [0, 0, 0], "\n".join(node.output()[-2000:] for node in nodes)
        peer_ids = set()
        for node in nodes:
            status = node.status()
            assert status is not None and status["health"] == "finished"
            peer_ids.add(status["peer_id"])
            history = status["history"]
            assert len(history) == 10
            partners = [h["partner"] for h in history if h["partner"]]
            assert len(partners) >= 3, f"{node.name} blended only {len(partners)} times"
            assert status["outcomes"].get("completed", 0) >= 1 or status["bytes_received"] > 0
            first, last = history[0]["val_loss"], history[-1]["val_loss"]
            assert last < first - 0.3 and last < math.log(256) - 2
        for node in nodes:  # every partner is another node of this swarm
            assert {h["partner"] for h in node.status()["history"] if h["partner"]} <= peer_ids - {
                node.status()["peer_id"]
            }
    finally:
        for node in nodes:
            node.stop()


def test_two_nodes_blend_exactly_as_the_algorithm_says(bootstrap: Bootstrap, tmp_path: Path) -> None:
    """After one exchange each node's phi/delta equal noloco_outer_step on the tensors the two nodes held."""
    threads = torch.get_num_threads()
    args = [
        *TRAIN,
        "--steps",
        "10",
        "--inner-steps",
        "10",
        "--wire-dtype",
        "fp32",
        "--pair-timeout",
        "30",
        "--torch-threads",
        str(threads),
        "--num-shards",
        "2",
        "--seed",
        "5",
    ]
    nodes = [NodeProcess(f"node{i}", bootstrap, tmp_path, *args, "--shard-index", str(i)) for i in range(2)]
    try:
        assert [node.wait(timeout=300) for node in nodes] == [0, 0], nodes[0].output()[-2000:]
    finally:
        for node in nodes:
            node.stop()
    statuses = [node.status() for node in nodes]
    assert statuses[0]["history"][0]["partner"] == statuses[1]["peer_id"]
    assert statuses[1]["history"][0]["partner"] == statuses[0]["peer_id"]

    # Replay each node's inner phase here (same seed, shard and thread count: bit-identical), then blend.
    corpus = load_corpus(DataConfig())
    train_cfg = TrainConfig(
        model_size="tiny",
        seq_len=64,
        batch_size=8,
        total_steps=10,
        inner_steps=10,
        seed=5,
        eval_batches=4,
        device="cpu",
    )
    model_cfg = model_config_for("tiny", vocab_size=256, max_seq_len=64)
    from noloco_node.trainer import Replica

    torch.set_num_threads(threads)
    replicas = []
    for shard_index in range(2):
        shard = ReplicaShard(corpus.train, replica=shard_index, num_replicas=2, seq_len=64, seed=5)
        replica = Replica(model_cfg, train_cfg, [shard])
        replica.train_phase(10)
        replicas.append(replica)
    for i, replica in enumerate(replicas):
        partner = replicas[1 - i]
        want_phi, want_delta = noloco_outer_step(
            replica.fast_weights(),
            replica.phi,
            replica.delta,
            [partner.fast_weights()],
            [],
            alpha=0.5,
            beta=0.7,
            gamma=0.7,
        )
        saved = torch.load(nodes[i].data_dir / "checkpoint.pt", weights_only=True)["replica"]
        assert saved["outer_step"] == 1
        for name, got, want in zip(saved["param_names"], saved["phi"], want_phi, strict=True):
            assert torch.equal(got, want), f"phi of {name} on node {i}"
        for name, got, want in zip(saved["param_names"], saved["delta"], want_delta, strict=True):
            assert torch.equal(got, want), f"delta of {name} on node {i}"
