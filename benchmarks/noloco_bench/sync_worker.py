"""One host of `noloco-node bench sync`: times a NoLoCo pairwise exchange round and a ring all-reduce.

Started by bench/sync.py inside its own network namespace (shaped_network.py), one process per host. All hosts
join a gloo process group (the all-reduce DiLoCo implementations use, and the start line of every measurement)
and serve the node's gRPC exchange service. Every measurement starts at an absolute time on the machine's
monotonic clock (shared by every namespace), announced by rank 0 through the group, and ends when this host has
both sent and received its part; the round's time is the latest end minus the start, so barrier skew does not
shorten it.

- pairwise: hosts are paired at random; the lower rank calls the other's ``Exchange`` (exchange.py), which carries
  both directions at once, as a pairing does. ``cold``: the first call of a pairing, on a new connection; ``warm``:
  the same pairing again on the pooled connection (what a node's later exchanges with a peer see).
- ring: ``torch.distributed.all_reduce`` over gloo (its ring algorithm for large tensors) of the same tensor.
- hivemind (``--hivemind``): one round of hivemind's DecentralizedAverager, the all-reduce of hivemind-based
  swarms (a butterfly all-reduce over libp2p: each host reduces 1/N of the tensor), in a group of every host,
  timed from the trigger after matchmaking; the matchmaking time is reported apart.

Payloads are fp32 on the wire, so a 16 MB tensor moves 16 MB each way.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from noloco_bench.hivemind_rendezvous import rendezvous_dht
from noloco_node.rpc.client import Outgoing, exchange_with
from noloco_node.rpc.contracts import AdmitsEverything
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.service import start_server
from noloco_node.rpc.transport import Transport
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import TensorLayout, build_manifest, layout_of
from noloco_node.wire.payload import Payload
from noloco_node.wire.receive_buffers import ReceiveBuffers

RUN = "bench-sync"
PORT = 7100
CHUNK = 2**20


class _SyncPeer(AdmitsEverything):
    """The served side: accepts every exchange of the current payload and counts the completed ones."""

    def __init__(self) -> None:
        self.run_fingerprint = RUN
        self.peer_id = "sync"
        self.layout: list[TensorLayout] = []
        self._outgoing: Outgoing | None = None
        self.completed = 0
        self.changed = threading.Condition()
        self.receive_buffers = ReceiveBuffers(max_idle_bytes=0)

    def set_payload(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.layout = layout_of(named)
        manifest = build_manifest(named, wire_dtype="fp32", run_fingerprint=RUN, peer_id=self.peer_id, outer_step=1)
        self._outgoing = Outgoing(manifest, [t for _, t in named])
        self.receive_buffers = ReceiveBuffers(max_idle_bytes=self.max_payload_bytes())

    def expected_layout(self) -> list[TensorLayout]:
        return self.layout

    wire_dtype = "fp32"  # what this double and its callers send

    def max_payload_bytes(self) -> int:
        return sum(item.numel for item in self.layout) * 4 + 1024

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str = "weights") -> Any:
        return self

    def outgoing(self) -> Outgoing:
        assert self._outgoing is not None
        return self._outgoing

    def complete(self, payload: Payload) -> bool:
        payload.release()
        with self.changed:
            self.completed += 1
            self.changed.notify_all()
        return True

    def release(self) -> None:
        pass

    def info(self) -> pb.InfoReply:
        return pb.InfoReply(peer_id=self.peer_id, run_fingerprint=RUN)

    def state_snapshot(self) -> Outgoing | None:
        return None


def _reached(peer: Any, expected: int) -> bool:
    return bool(peer.completed >= expected)


def _agreed_start(lead: float = 0.3) -> float:
    """A start time on the shared monotonic clock, decided by rank 0 and known to every rank. The barrier first:
    a gloo broadcast returns on rank 0 before the others have arrived (their servers may not be up yet)."""
    dist.barrier()
    start = torch.tensor([time.monotonic() + lead], dtype=torch.float64)
    dist.broadcast(start, src=0)
    return float(start)


def _sleep_until(moment: float) -> None:
    while (left := moment - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))


def _latest_end(end: float) -> float:
    ends = torch.tensor([end], dtype=torch.float64)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX)
    return float(ends)


def _start_averagers(args: argparse.Namespace, addresses: list[str], tensors: dict[float, torch.Tensor]) -> dict:
    """One hivemind DHT per host (rank 0's first; the others join it through a file in the rendezvous folder)
    and one DecentralizedAverager per tensor size, all in groups of every host."""
    import hivemind

    dht = rendezvous_dht(args.rank, addresses[args.rank], Path(args.rendezvous))
    return {
        size: hivemind.averaging.DecentralizedAverager(
            [tensor.clone()],
            dht,
            start=True,
            prefix=f"sync{i}",
            target_group_size=args.world,
            min_group_size=args.world,
            min_matchmaking_time=5.0,
            request_timeout=3.0,
            # generous: on a 100 Mbit/s, 50 ms path hivemind's defaults give up on parts still in flight
            next_chunk_timeout=120.0,
            sender_timeout=60.0,  # shorter than reducer_timeout, as hivemind requires
            reducer_timeout=120.0,
            allreduce_timeout=900.0,
        )
        for i, (size, tensor) in enumerate(tensors.items())
    }


def _hivemind_round(averager: Any, matchmaking_seconds: float = 10.0) -> dict[str, float | None]:
    """One averaging step of every host, scheduled by hivemind for the same moment; the all-reduce is timed from
    the first host entering it to the last leaving it (stage changes, polled on the shared monotonic clock), so
    the matchmaking before it is reported apart."""
    from hivemind.averaging.control import AveragingStage
    from hivemind.utils import get_dht_time

    start = _agreed_start()
    _sleep_until(start)
    control = averager.step(
        wait=False,
        scheduled_time=get_dht_time() + matchmaking_seconds,
        timeout=matchmaking_seconds + 60,
        allow_retries=False,  # a failed round is reported as failed, not retried with a smaller group
    )
    entered = None
    while not control.done():
        if entered is None and control.stage == AveragingStage.RUNNING_ALLREDUCE:
            entered = time.monotonic()
        time.sleep(0.002)
    finished = time.monotonic()
    error = control.exception()
    ok = error is None and control.result() is not None and entered is not None
    if not ok:
        print(f"hivemind round failed on this host: {error!r} (entered all-reduce: {entered is not None})", flush=True)
    marks = torch.tensor([entered if ok else math.inf, finished, 0.0 if ok else 1.0], dtype=torch.float64)
    first_in = marks[:1].clone()
    dist.all_reduce(first_in, op=dist.ReduceOp.MIN)
    last_out = marks[1:2].clone()
    dist.all_reduce(last_out, op=dist.ReduceOp.MAX)
    failures = marks[2:].clone()
    dist.all_reduce(failures)
    if float(failures):
        return {"seconds": None, "matchmaking_seconds": None, "failed_hosts": int(float(failures))}
    return {"seconds": float(last_out - first_in), "matchmaking_seconds": float(first_in) - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--addresses", required=True, help="comma-separated host addresses, by rank")
    parser.add_argument("--iface", required=True)
    parser.add_argument("--sizes-mb", required=True)
    parser.add_argument("--warm-rounds", type=int, default=2)
    parser.add_argument("--ring-rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hivemind", action="store_true", help="also time a hivemind all-reduce round")
    parser.add_argument("--rendezvous", help="a folder shared by the hosts, for the DHT's first address")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints where a stuck host is
    torch.set_num_threads(1)
    addresses = args.addresses.split(",")
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    tensors = {
        size: torch.randn(int(size * 2**20) // 4, generator=torch.Generator().manual_seed(args.rank)) for size in sizes
    }
    # hivemind's DHT and averagers fork helper processes: start them before gloo, gRPC or torch threads exist
    averagers = _start_averagers(args, addresses, tensors) if args.hivemind else {}
    os.environ["GLOO_SOCKET_IFNAME"] = args.iface
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addresses[0]}:29500",
        rank=args.rank,
        world_size=args.world,
        timeout=__import__("datetime").timedelta(seconds=900),
    )
    peer = _SyncPeer()
    server, _ = start_server(
        peer, ExchangeMetrics(), bind=f"{addresses[args.rank]}:{PORT}", chunk_bytes=CHUNK, max_call_seconds=900
    )
    results: list[dict[str, Any]] = []
    try:
        for size_mb in sizes:
            tensor = tensors[size_mb].clone()
            numel = tensor.numel()
            named = [("theta/w", tensor)]
            peer.set_payload(named)
            outgoing = Outgoing(
                build_manifest(named, wire_dtype="fp32", run_fingerprint=RUN, peer_id=f"r{args.rank}", outer_step=1),
                [tensor],
            )
            buffers = ReceiveBuffers(max_idle_bytes=numel * 4 + 1024)
            order = np.random.default_rng([int(size_mb * 1000), 7]).permutation(args.world)
            position = int(np.where(order == args.rank)[0][0])
            partner = int(order[position ^ 1]) if (position ^ 1) < args.world else None
            transport = Transport()  # a fresh pool: the first round of this pairing connects anew
            entry: dict[str, Any] = {"size_mb": size_mb, "pairwise": [], "ring": []}
            for kind in ["cold"] + ["warm"] * args.warm_rounds:
                expected = peer.completed + 1
                start = _agreed_start()
                _sleep_until(start)
                if partner is not None and args.rank < partner:
                    payload = exchange_with(
                        f"{addresses[partner]}:{PORT}",
                        outgoing,
                        layout_of(named),
                        run_fingerprint=RUN,
                        max_payload_bytes=numel * 4 + 1024,
                        timeout=900,
                        chunk_bytes=CHUNK,
                        buffers=buffers,
                        transport=transport,
                    )
                    payload.release()
                elif partner is not None:
                    with peer.changed:
                        peer.changed.wait_for(functools.partial(_reached, peer, expected), timeout=900)
                end = time.monotonic()
                entry["pairwise"].append({"kind": kind, "seconds": _latest_end(end) - start})
            work = tensor.clone()
            for _ in range(args.ring_rounds):
                start = _agreed_start()
                _sleep_until(start)
                dist.all_reduce(work)
                entry["ring"].append(_latest_end(time.monotonic()) - start)
            transport.close_channels()
            if size_mb in averagers:
                entry["hivemind"] = _hivemind_round(averagers[size_mb])
            results.append(entry)
            if args.rank == 0:
                print(json.dumps(entry), flush=True)
    except BaseException:
        # A failed host must not leave the others waiting in a collective forever: say why and leave now.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    dist.barrier()
    server.stop(grace=1).wait(5)
    dist.destroy_process_group()
    if args.rank == 0:
        with open(args.out, "w") as handle:
            json.dump(results, handle)


if __name__ == "__main__":
    main()
