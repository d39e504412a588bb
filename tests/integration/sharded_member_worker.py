"""One rank of a sharded member without the node around it (run by torchrun from test_sharded_member.py).

Every rank trains its shards of the ``small`` model for a phase; then rank 0 does, with the whole model, what a
node does between phases (gather theta, evaluate, measure a candidate, take an outer step, snapshot the state,
load it again) while the other rank follows; both train one more phase. Rank 0 saves what it saw (torch.save) to
the file named by its argument, every rank its training state's bytes (its shards of the weights, gradients and
Adam) to that name with ``.rankN`` added.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from noloco_node.config.models import TrainConfig, model_config_for
from noloco_node.data.corpus import ReplicaShard
from noloco_node.model.source import SeededDecoder
from noloco_node.training.data_parallel import DataParallel
from noloco_node.training.replica import Replica
from noloco_node.training.sharded_tensors import local_part

TOKENS = (np.arange(400_000) * 7919 % 251).astype(np.uint8)
SEQ_LEN, PHASE = 32, 3


def train_config() -> TrainConfig:
    return TrainConfig(seq_len=SEQ_LEN, batch_size=4, total_steps=100, warmup_steps=2, device="cpu", micro_batch=2)


def source() -> SeededDecoder:
    return SeededDecoder(model_config_for("small", vocab_size=256, max_seq_len=SEQ_LEN), seed=0)


def shard(index: int, count: int) -> ReplicaShard:
    return ReplicaShard(TOKENS, replica=index, num_replicas=count, seq_len=SEQ_LEN, seed=0)


def validation() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.from_numpy(TOKENS[: 2 * 4 * (SEQ_LEN + 1)].astype(np.int64)).view(8, SEQ_LEN + 1)
    return [(tokens[:4, :-1], tokens[:4, 1:]), (tokens[4:, :-1], tokens[4:, 1:])]


def state_bytes(replica: Replica) -> int:
    """This rank's bytes of weights, gradients and Adam's moments."""
    total = 0
    for param in replica.params:
        total += local_part(param.detach()).nbytes
        if param.grad is not None:
            total += local_part(param.grad).nbytes
        for value in replica.optimizer.state.get(param, {}).values():
            if value.dim() > 0:
                total += local_part(value).nbytes
    return total


def main(out: Path) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    ranks = DataParallel.from_environment()
    assert ranks is not None
    ranks.device("cpu")
    ranks.start()
    index, count = ranks.shard(0, 1)
    replica = Replica(source(), train_config(), [shard(index, count)], data_parallel=ranks)
    report: dict[str, object] = {}
    try:
        if ranks.leader:
            replica.release_followers(train=True, first=True)
        elif not replica.follow():
            return
        for _ in range(PHASE):
            replica.train_step()
        report["state_bytes"] = state_bytes(replica)
        if not ranks.leader:
            assert replica.follow()  # rank 0's outer step
            for _ in range(PHASE):
                replica.train_step()
            replica.follow()  # until rank 0 leaves
            return
        replica.followers_wait()
        theta = [t.clone() for t in replica.fast_weights()]
        report["theta_after_phase"] = theta
        report["val_loss"] = replica.evaluate(validation())
        halfway = [0.5 * (a + b) for a, b in zip(theta, replica.phi, strict=True)]
        report["loss_of_halfway"] = replica.loss_of(halfway, validation())
        report["val_loss_again"] = replica.evaluate(validation())  # loss_of put this replica's weights back
        new_delta = [a - b for a, b in zip(halfway, replica.phi, strict=True)]
        replica.apply_outer_step(halfway, new_delta)
        state = replica.state_dict()
        report["state_theta_is_halfway"] = all(torch.equal(a, b) for a, b in zip(state["theta"], halfway, strict=True))
        replica.load_state_dict(state)
        replica.release_followers(train=True)
        for _ in range(PHASE):
            replica.train_step()
        replica.followers_wait()
        report["theta_final"] = [t.clone() for t in replica.fast_weights()]
        report["inner_step"] = replica.inner_step
        replica.report_stopped()
        replica.release_followers(train=False)
    finally:
        if ranks.leader:
            torch.save(report, out)
        Path(f"{out}.rank{ranks.rank}").write_text(json.dumps({"state_bytes": report.get("state_bytes")}))
        ranks.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
