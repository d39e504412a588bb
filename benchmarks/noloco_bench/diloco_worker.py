"""One replica of DiLoCo, the baseline of `noloco-node bench stragglers` and `bench race`.

N of these processes train the same model on their own shards (the nodes' shards: same seed, same dealing) with
the same emulated log-normal step times as the swarm's nodes (node.fault_injection.emulated_step_factor). Every H
inner steps all of them run DiLoCo's outer step behind a global barrier: the progress theta - phi (the
pseudo-gradient, up to sign) is all-reduced over gloo (its ring algorithm) in bf16, the wire dtype of a NoLoCo
node's default payload, and every
replica applies the heavy-ball outer step on the mean (algorithm.diloco_heavy_ball_step, the simulator's
``diloco``): nobody passes it before the slowest replica arrives.

With ``--all-reduce hivemind`` the pseudo-gradient is averaged by hivemind's DecentralizedAverager instead (a
butterfly all-reduce over libp2p, fp16 on the wire; the all-reduce OpenDiLoCo runs DiLoCo on), in groups of every
replica, so its matchmaking is the barrier. Each process runs its own hivemind DHT, on its host's address; rank 0's
addresses reach the others through a file in ``--rendezvous``. Gloo still meets, for the start and the totals.

On a shaped network (bench race) each process runs in its host's namespace and gloo binds that host's interface
(``--iface``). With ``--eval-batches`` the rank-0 process evaluates the new slow weights after every outer step on
the nodes' validation batches and records (unix time, inner step, validation loss), printing each point as a JSON
line as it goes. At the end rank 0 prints, as JSON, the wall-clock of the inner steps (start-up excluded), the time
spent in the outer steps, and that curve.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from noloco_bench.hivemind_rendezvous import rendezvous_dht
from noloco_node import algorithm
from noloco_node.config.models import DataConfig, OuterConfig, TrainConfig
from noloco_node.data.corpus import ReplicaShard, validation_batches
from noloco_node.model.run_model import load_run_corpus, model_source
from noloco_node.node.fault_injection import emulated_step_factor
from noloco_node.training.replica import Replica

MeanFunction = Callable[[list[torch.Tensor], int], list[torch.Tensor]]


def gloo_mean(progress: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    """The all-replica mean over gloo's ring, bf16 on the wire as DiLoCo implementations send it."""
    sent = [p.to(torch.bfloat16) for p in progress]
    for tensor in sent:
        dist.all_reduce(tensor)
    return [tensor.float().div_(world) for tensor in sent]


class HivemindMean:
    """The all-replica mean by hivemind's DecentralizedAverager: a group of every replica (min_group_size = world,
    so matchmaking waits for the slowest, as DiLoCo's barrier does), fp16 on the wire."""

    def __init__(self, shapes: list[torch.Size], world: int, rank: int, host: str, rendezvous: Path,
                 matchmaking_seconds: float) -> None:  # fmt: skip
        import hivemind
        from hivemind.compression import Float16Compression

        self.dht = rendezvous_dht(rank, host, rendezvous)
        self.averager = hivemind.averaging.DecentralizedAverager(
            [torch.zeros(shape) for shape in shapes],
            self.dht,
            start=True,
            prefix="diloco",
            target_group_size=world,
            min_group_size=world,
            min_matchmaking_time=matchmaking_seconds,
            request_timeout=matchmaking_seconds / 2,  # hivemind asks for less than the matchmaking time
            compression=Float16Compression(),
            allow_state_sharing=False,  # nobody downloads state here: no declarations on the links
            # generous, as in bench sync: on a slow path hivemind's defaults give up on parts still in flight
            next_chunk_timeout=120.0,
            sender_timeout=60.0,
            reducer_timeout=120.0,
            allreduce_timeout=900.0,
        )
        self.failed_rounds = 0

    def __call__(self, progress: list[torch.Tensor], world: int) -> list[torch.Tensor]:
        with self.averager.get_tensors() as tensors:
            for tensor, own in zip(tensors, progress, strict=True):
                tensor.copy_(own)
        if self.averager.step(timeout=1800, allow_retries=True) is None:
            # No group within the deadline: this replica steps on its own progress, and says so in its totals.
            self.failed_rounds += 1
            return progress
        with self.averager.get_tensors() as tensors:
            return [tensor.clone() for tensor in tensors]

    def shutdown(self) -> None:
        """Stop the averager's and the DHT's processes (leave()'s os._exit skips multiprocessing's clean-up)."""
        self.averager.shutdown()
        self.dht.shutdown()


def outer_step(replica: Replica, world: int, outer: OuterConfig, mean: MeanFunction = gloo_mean) -> None:
    """DiLoCo's outer step: the all-replica mean of theta - phi, then heavy-ball on the mean's fast weights; every
    replica ends with the same phi."""
    theta, phi = replica.fast_weights(), replica.phi
    progress = algorithm.phase_progress(theta, phi)
    mean_theta = algorithm.fast_weights_from(phi, mean(progress, world))
    new_phi, new_delta = algorithm.diloco_heavy_ball_step(
        phi, replica.delta, [mean_theta], alpha=outer.diloco_alpha, beta=outer.diloco_beta
    )
    replica.apply_outer_step(new_phi, new_delta)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--address", default="127.0.0.1", help="rank 0's address, where gloo meets")
    parser.add_argument("--iface", help="the network interface gloo uses (a shaped host's veth)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--inner-steps", type=int, required=True)
    parser.add_argument("--step-time-seconds", type=float, required=True)
    parser.add_argument("--step-time-sigma", type=float, required=True)
    parser.add_argument("--eval-batches", type=int, default=0, help="0: no evaluation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--all-reduce", choices=("gloo", "hivemind"), default="gloo")
    parser.add_argument("--host", help="this host's address (hivemind binds it)")
    parser.add_argument("--rendezvous", type=Path, help="a folder all ranks share (hivemind's first DHT address)")
    parser.add_argument("--matchmaking-seconds", type=float, default=5.0, help="hivemind's min_matchmaking_time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface
    train = TrainConfig(
        model_size=args.model,
        total_steps=args.steps,
        inner_steps=args.inner_steps,
        eval_batches=max(1, args.eval_batches),
        seed=args.seed,
    )
    corpus = load_run_corpus(DataConfig(), train)
    shard = ReplicaShard(
        corpus.train, replica=args.rank, num_replicas=args.world, seq_len=train.seq_len, seed=train.seed
    )
    replica = Replica(model_source(train, corpus.vocab_size), train, [shard])
    mean: MeanFunction = gloo_mean
    if args.all_reduce == "hivemind":
        # hivemind's DHT and averager fork helper processes: start them before gloo's threads exist
        shapes = [p.shape for p in replica.phi]
        mean = HivemindMean(shapes, args.world, args.rank, args.host, args.rendezvous, args.matchmaking_seconds)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.address}:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=1800),
    )
    validation = (
        validation_batches(
            corpus.validation, seq_len=train.seq_len, batch_size=train.batch_size, num_batches=args.eval_batches
        )
        if args.eval_batches and args.rank == 0
        else []
    )
    outer = OuterConfig()
    rng = np.random.default_rng(list(hashlib.sha256(f"barrier-{args.rank}".encode()).digest()[:8]))
    curve: list[tuple[float, int, float]] = []
    dist.barrier()
    started_at = time.time()
    started = time.monotonic()
    waited = 0.0
    while replica.inner_step < args.steps:
        step_started = time.monotonic()
        replica.train_step()
        target = args.step_time_seconds * emulated_step_factor(rng, args.step_time_sigma)
        time.sleep(max(0.0, target - (time.monotonic() - step_started)))
        if replica.inner_step % args.inner_steps == 0 or replica.inner_step == args.steps:
            barrier_started = time.monotonic()
            outer_step(replica, args.world, outer, mean)
            waited += time.monotonic() - barrier_started
            if validation:
                point = (time.time(), replica.inner_step, replica.evaluate(validation))
                curve.append(point)
                # as it goes: a race that stops a run at its time cap keeps the curve so far
                print(json.dumps({"point": point, "barrier_seconds": waited, "started_at": started_at}), flush=True)
    seconds = time.monotonic() - started
    failed = mean.failed_rounds if isinstance(mean, HivemindMean) else 0
    totals = torch.tensor([seconds, waited, failed], dtype=torch.float64)
    dist.all_reduce(totals)
    if args.rank == 0:
        print(
            json.dumps(
                {
                    "seconds": float(totals[0]) / args.world,
                    "barrier_seconds": float(totals[1]) / args.world,
                    "failed_rounds": int(totals[2]),  # summed over the replicas
                    "started_at": started_at,
                    "curve": curve,
                }
            )
        )
    if isinstance(mean, HivemindMean):
        mean.shutdown()
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
