"""A rank other than 0 of a multi-GPU member (training/data_parallel.py): it trains in step with rank 0 and adopts
rank 0's blended weights after each outer step.

It runs the one inner loop (training/loop.py); its "outer sync" is a broadcast from rank 0, which took the
NoLoCo outer step (arXiv 2506.10911, eq. 3-5) for the whole member. No DHT, no gRPC, no checkpoints: rank 0 is the
swarm member and holds all of that.
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
from noloco_node.training.data_parallel import DataParallel, weights_digest
from noloco_node.training.loop import InnerLoop
from noloco_node.training.replica import Replica

log = logging.getLogger(__name__)


def run_follower(
    node_cfg: NodeConfig, train_cfg: TrainConfig, data_cfg: DataConfig, data_parallel: DataParallel
) -> int:
    """Train in step with rank 0 (DDP), adopt its weights after each of its outer steps, stop when it stops."""
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
        data_parallel.broadcast_state(replica)
        # SIGTERM (torchrun forwards it to every rank) is turned into a stop agreed at the next step boundary, so
        # that rank 0 still finishes the step, checkpoints and leaves the DHT instead of hanging in a collective.
        stop_requested = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop_requested.set())
        loop = InnerLoop(
            replica,
            total_steps=train_cfg.total_steps,
            inner_steps=train_cfg.inner_steps,
            stop_requested=stop_requested.is_set,  # passed into every step's agreement between the ranks
        )
        for _phase in loop.phases():
            data_parallel.broadcast_params(replica.params)  # rank 0's outer step: theta = phi
            replica.outer_step += 1
        log.info(
            "rank %d of %d stopped at inner step %d, weights digest %s",
            data_parallel.rank,
            data_parallel.world_size,
            replica.inner_step,
            weights_digest(replica.params),
        )
        return 0
    finally:
        data_parallel.close()
