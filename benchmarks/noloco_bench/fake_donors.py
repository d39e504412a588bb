"""Attack 3 of bench/outsider.py, the fake donor: a GetState server of the outsider's own and a signed DHT record
that offers its state as the run's outer step 1,000,000, so that a joiner or a restarting member adopts it.

:class:`FakeDonor` runs in a test's process; ``python -m noloco_bench.fake_donors`` runs a random one and poisoned
ones in a process of their own at the lowest CPU priority, on an outsider's host (bench outsider).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path

import grpc
import torch

from noloco_bench.outsider import CLAIMED_STEP, Target, download_phi, fresh_identity, targets_from_status_files
from noloco_node.config.models import ModelConfig, model_config_for
from noloco_node.discovery.dht import Discovery, PeerRecord
from noloco_node.model.source import SeededDecoder
from noloco_node.observability.status_file import read_status_document
from noloco_node.rpc.contracts import SERVICE
from noloco_node.rpc.transport import CHANNEL_OPTIONS
from noloco_node.training.checkpoints import state_layout
from noloco_node.wire.frames import build_manifest, iter_frames


class FakeDonor:
    """Attack 3: a GetState server of the outsider's own, serving a state of outer step 1,000,000, and a DHT record,
    signed with the outsider's own key, that says so (refreshed until ``close``). The state is random weights, or
    with ``honest`` (the node to copy) the freshest honest slow weights: they measure well, and only the counters
    lie. (GetState serves slow weights alone, so the outer momentum and Adam's moments an adopter rebuilds cannot
    be poisoned.) Two of them under two keys make the claim "corroborated" to a node that counts keys."""

    def __init__(
        self,
        maddrs: Sequence[str],
        run_fingerprint: str,
        model_cfg: ModelConfig,
        *,
        host: str = "127.0.0.1",
        honest: Callable[[], Target | None] | None = None,
        inner_steps: int = 50,
    ) -> None:
        self.identity = fresh_identity()
        self.run_fingerprint = run_fingerprint
        self.model_cfg = model_cfg
        self.honest = honest
        counters = {
            "inner_step": CLAIMED_STEP * inner_steps,
            "outer_step": CLAIMED_STEP,
            "adam_step": CLAIMED_STEP * inner_steps,
        }
        self.layout = state_layout(SeededDecoder(model_cfg, seed=0))
        named = [(name, torch.randn(shape) * 0.05) for name, shape in self.layout]
        self.manifest = build_manifest(
            named,
            wire_dtype="fp32",
            run_fingerprint=run_fingerprint,
            peer_id=self.identity.peer_id,
            outer_step=CLAIMED_STEP,
            metadata_json=json.dumps(counters),
        )
        self.tensors = [t for _, t in named]
        self.served = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
        handler = grpc.unary_stream_rpc_method_handler(self._get_state)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"GetState": handler}),))
        self.address = f"{host}:{self.server.add_insecure_port(f'{host}:0')}"
        self.server.start()
        self.discovery = Discovery(
            run_fingerprint,
            initial_peers=list(maddrs),
            identity=self.identity,
            record_ttl=10,
            host_maddrs=[f"/ip4/{host}/tcp/0"],
        )
        self.discovery.start()
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish_forever, daemon=True, name="fake-donor-record")
        self._publisher.start()

    def _get_state(self, _request: bytes, _context: grpc.ServicerContext) -> Iterator[bytes]:
        self.served += 1
        tensors = self.tensors
        target = self.honest() if self.honest is not None else None
        if target is not None:
            tensors = download_phi(target, self.model_cfg, self.identity)
            assert len(tensors) == len(self.layout)
        yield from iter_frames(self.manifest, tensors)

    def _publish_forever(self) -> None:
        record = PeerRecord(
            peer_id=self.identity.peer_id,
            address=self.address,
            run_fingerprint=self.run_fingerprint,
            outer_step=CLAIMED_STEP,
            inner_step=CLAIMED_STEP * 50,
            ready=False,
            reachable=True,
            shard=99,
        )
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                asyncio.run(self.discovery.publish(record))
            self._stop.wait(3.0)

    def close(self) -> None:
        self._stop.set()
        self._publisher.join(10)
        self.server.stop(grace=1)
        self.discovery.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m noloco_bench.fake_donors``: one donor of random weights and ``--poisoned`` donors of the honest
    nodes' own weights with counters of outer step 1,000,000 (two keys on two addresses: a "corroborated" front
    whose state measures well), until stopped; prints their peer ids and how often each was asked, as JSON."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--data-dir", type=Path, action="append", required=True, help="an honest node's data dir")
    parser.add_argument("--initial-peer", action="append", required=True, help="a DHT multiaddress of the swarm")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--random-host", default="127.0.0.1", help="the address the random donor serves on")
    parser.add_argument(
        "--poisoned-host",
        default="127.0.0.3",
        help="comma-separated addresses the poisoned donors serve on, one after another (several: several groups)",
    )
    parser.add_argument("--poisoned", type=int, default=2)
    args = parser.parse_args(argv)
    os.nice(19)
    model_cfg = model_config_for(args.model, vocab_size=256, max_seq_len=64)
    status = read_status_document(args.data_dir[0]) or {}
    honest = targets_from_status_files(args.data_dir)
    hosts = args.poisoned_host.split(",")
    donors = [FakeDonor(args.initial_peer, status["run_fingerprint"], model_cfg, host=args.random_host)]
    donors += [
        FakeDonor(
            args.initial_peer,
            status["run_fingerprint"],
            model_cfg,
            host=hosts[number % len(hosts)],
            honest=lambda: next(iter(honest()), None),
            inner_steps=args.inner_steps,
        )
        for number in range(args.poisoned)
    ]
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    print(json.dumps({"ready": [d.identity.peer_id for d in donors]}), flush=True)
    done.wait()
    for donor in donors:
        donor.close()
    print(json.dumps({"peer_ids": [d.identity.peer_id for d in donors], "served": [d.served for d in donors]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
