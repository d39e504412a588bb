"""One replica of DiLoCo's global barrier for `noloco-node bench stragglers`.

N of these processes train the same model on their own shards with the same emulated log-normal step times as the
swarm's nodes (node.emulated_step_factor), and every H inner steps all of them all-reduce their weights over gloo
on 127.0.0.1: DiLoCo's outer step, which nobody passes before the slowest replica arrives. The rank-0 process
prints the wall-clock of the inner steps (start-up excluded) as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from noloco_node.config.models import DataConfig, TrainConfig, model_config_for
from noloco_node.data.corpus import ReplicaShard, load_corpus
from noloco_node.model.source import SeededDecoder
from noloco_node.node.fault_injection import emulated_step_factor
from noloco_node.training.replica import Replica


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--inner-steps", type=int, required=True)
    parser.add_argument("--step-time-seconds", type=float, required=True)
    parser.add_argument("--step-time-sigma", type=float, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=900),
    )
    train = TrainConfig(
        model_size=args.model, seq_len=128, batch_size=8, total_steps=args.steps, inner_steps=args.inner_steps
    )
    corpus = load_corpus(DataConfig())
    model_cfg = model_config_for(args.model, vocab_size=corpus.vocab_size, max_seq_len=train.seq_len)
    shard = ReplicaShard(corpus.train, replica=args.rank, num_replicas=args.world, seq_len=train.seq_len, seed=0)
    replica = Replica(SeededDecoder(model_cfg, train.seed, args.model), train, [shard])
    rng = np.random.default_rng(list(hashlib.sha256(f"barrier-{args.rank}".encode()).digest()[:8]))
    dist.barrier()
    started = time.monotonic()
    waited = 0.0
    while replica.inner_step < args.steps:
        step_started = time.monotonic()
        replica.train_step()
        target = args.step_time_seconds * emulated_step_factor(rng, args.step_time_sigma)
        time.sleep(max(0.0, target - (time.monotonic() - step_started)))
        if replica.inner_step % args.inner_steps == 0 or replica.inner_step == args.steps:
            barrier_started = time.monotonic()
            for param in replica.params:  # DiLoCo's outer step: the mean of every replica, after all arrive
                dist.all_reduce(param.data)
                param.data.div_(args.world)
            waited += time.monotonic() - barrier_started
    seconds = time.monotonic() - started
    totals = torch.tensor([seconds, waited], dtype=torch.float64)
    dist.all_reduce(totals)
    if args.rank == 0:
        print(json.dumps({"seconds": float(totals[0]) / args.world, "barrier_seconds": float(totals[1]) / args.world}))
    leave(args.rank)


def leave(rank: int) -> None:
    """Exit without tearing gloo down. Once every rank has passed a last barrier no collective is in flight, and
    nothing is left to clean up that the kernel does not (sockets, memory). Tearing down instead races: a rank that
    exits first closes its connections while another rank's gloo and store threads are being destroyed during
    interpreter shutdown, and that rank then dies in C++ ("terminate called without an active exception"), failing
    the benchmark about one run in four."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
