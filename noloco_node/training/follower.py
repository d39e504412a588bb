"""A rank other than 0 of a multi-GPU member (training/data_parallel.py): it trains its shards in step with rank 0,
and takes part in whatever rank 0 does with the whole model between phases.

It runs the one inner loop (training/loop.py); its "outer sync" is :meth:`Replica.follow`: rank 0 takes the NoLoCo
outer step (arXiv 2506.10911, eq. 3-5) for the whole member, and this rank takes its part in the collectives of it
(theta gathered, the blended weights written, candidates evaluated, snapshots taken). No DHT, no gRPC, no
checkpoints of its own: rank 0 is the swarm member and holds all of that.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch

from noloco_node.config.models import DataConfig, TrainConfig
from noloco_node.config.node_config import NodeConfig
from noloco_node.data.corpus import ReplicaShard
from noloco_node.model.run_model import run_model
from noloco_node.training.data_parallel import DataParallel
from noloco_node.training.loop import InnerLoop
from noloco_node.training.replica import Replica

log = logging.getLogger(__name__)


def run_follower(
    node_cfg: NodeConfig, train_cfg: TrainConfig, data_cfg: DataConfig, data_parallel: DataParallel
) -> int:
    """Follow rank 0 from its start (its resumed or downloaded state) through every phase to its leaving."""
    if node_cfg.torch_threads:
        torch.set_num_threads(node_cfg.torch_threads)
    corpus, source = run_model(data_cfg, train_cfg)
    data_parallel.start()
    try:
        index, count = data_parallel.shard(data_parallel.share_shard_index(-1), node_cfg.num_shards)
        shard = ReplicaShard(
            corpus.train, replica=index, num_replicas=count, seq_len=train_cfg.seq_len, seed=train_cfg.seed
        )
        replica = Replica(source, train_cfg, [shard], data_parallel=data_parallel)
        # SIGTERM (torchrun forwards it to every rank) is turned into a stop agreed at the next step boundary, so
        # that rank 0 still finishes the step, checkpoints and leaves the DHT instead of hanging in a collective.
        stop_requested = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop_requested.set())
        if not replica.follow():  # rank 0 resumes, downloads or starts from the seed, and publishes its state
            return 0
        loop = InnerLoop(
            replica,
            total_steps=train_cfg.total_steps,
            inner_steps=train_cfg.inner_steps,
            stop_requested=stop_requested.is_set,  # passed into every step's agreement between the ranks
        )
        for _phase in loop.phases():
            if not replica.follow():  # rank 0's outer step
                return 0
        replica.follow()  # the phases are over: rank 0's final checkpoint and its leaving
        return 0
    finally:
        data_parallel.close()
