"""The rule of who may read or write the replica's tensors (docs/architecture.md, "Who owns which tensor"): a
partner streaming this node's weights while the trainer applies its outer step receives exactly the weights as
they were when they were offered. Real gRPC server and a slow real client on 127.0.0.1."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import grpc
import torch

from noloco_node import algorithm
from noloco_node.config.models import TrainConfig, model_config_for
from noloco_node.data.corpus import ReplicaShard
from noloco_node.model.source import SeededDecoder
from noloco_node.pairing.pairing_round import PairingRound
from noloco_node.pairing.strategy import OfferPublisher
from noloco_node.rpc.client import Outgoing
from noloco_node.rpc.contracts import EXCHANGE_METHOD, AdmitsEverything
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.service import start_server
from noloco_node.rpc.transport import CHANNEL_OPTIONS
from noloco_node.training.replica import Replica
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import PayloadKind, TensorLayout, build_manifest, iter_frames, read_verdict, verdict_frame
from noloco_node.wire.payload import PayloadReceiver
from noloco_node.wire.receive_buffers import ReceiveBuffers

RUN = "ownership-test"
TOKENS = torch.randint(0, 256, (50_000,), generator=torch.Generator().manual_seed(0))


class _RoundNode(AdmitsEverything):
    """The served side of a node in a sync round (as node/served.py wires it), without the rest of the node."""

    def __init__(self, pairing_round: PairingRound, layout: list[TensorLayout]) -> None:
        self.round = pairing_round
        self.layout = layout
        self.run_fingerprint = RUN
        self.peer_id = "served"
        self.receive_buffers = ReceiveBuffers(max_idle_bytes=0)
        self.sessions = 0

    def expected_layout(self) -> list[TensorLayout]:
        return self.layout

    wire_dtype = "bf16"  # what this double and its callers send

    def max_payload_bytes(self) -> int:
        return sum(item.numel for item in self.layout) * 4 + 1024

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str = "weights"):
        self.sessions += 1
        return self.round.try_session(partner_id, partner_outer_step, max_staleness=2)

    def info(self) -> pb.InfoReply:
        return pb.InfoReply(peer_id=self.peer_id, run_fingerprint=RUN, ready_to_pair=self.round.open)

    def state_snapshot(self) -> None:
        return None


def test_an_exchange_streaming_through_the_outer_step_delivers_the_pre_step_tensors() -> None:
    torch.manual_seed(0)
    model_cfg = SeededDecoder(model_config_for("small", vocab_size=256, max_seq_len=32), seed=0)
    replica = Replica(
        model_cfg,
        TrainConfig(seq_len=32, batch_size=2, total_steps=100, device="cpu"),
        [ReplicaShard(TOKENS, replica=0, num_replicas=1, seq_len=32, seed=0)],
    )
    for _ in range(3):
        replica.train_step()
    names = replica.names
    shapes = [tuple(p.shape) for p in replica.params]
    weights = PayloadKind(
        "weights",
        tuple(TensorLayout(f"{part}/{n}", s) for part in ("theta", "phi") for n, s in zip(names, shapes, strict=True)),
        "bf16",
    )
    offers = OfferPublisher(weights, run_fingerprint=RUN, peer_id=lambda: "served")
    before = {f"theta/{n}": p.detach().to(torch.bfloat16).clone() for n, p in zip(names, replica.params, strict=True)}
    before |= {f"phi/{n}": t.to(torch.bfloat16).clone() for n, t in zip(names, replica.phi, strict=True)}
    pairing_round = PairingRound(replica.outer_step, offers.publish(replica.weights(), 0))
    layout = [TensorLayout(name, tuple(t.shape)) for name, t in before.items()]
    node = _RoundNode(pairing_round, layout)
    server, port = start_server(node, ExchangeMetrics(), bind="127.0.0.1:0", chunk_bytes=16384)
    caller_named = [(name, torch.zeros(item.shape)) for name, item in zip(before, layout, strict=True)]
    caller = Outgoing(
        build_manifest(caller_named, wire_dtype="bf16", run_fingerprint=RUN, peer_id="caller", outer_step=0),
        [t for _, t in caller_named],
    )
    receiver = PayloadReceiver(layout, run_fingerprint=RUN, max_total_bytes=node.max_payload_bytes())
    stepped = threading.Event()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            # The caller commits with its payload; the server's round is closed by then, so it answers no.
            sent: Iterator[bytes] = itertools.chain(
                iter_frames(caller.manifest, caller.tensors), [verdict_frame(commit=True)]
            )
            call = channel.stream_stream(EXCHANGE_METHOD)(sent, timeout=120)
            verdicts = []
            for index, frame in enumerate(call):
                if receiver.ended:
                    verdicts.append(read_verdict(frame))
                    continue
                receiver.feed(frame)
                if index == 2:
                    # The trainer's side, mid-stream: its wait for the exchange runs out (the timeouts that once
                    # had to agree), and it applies its outer step in place, as Replica.apply_outer_step does.
                    assert pairing_round.close(wait_for_exchange=0.05) is None
                    new_phi, new_delta = algorithm.noloco_outer_step(
                        replica.fast_weights(), replica.phi, replica.delta, [], [], alpha=0.5, beta=0.7, gamma=0.7
                    )
                    replica.apply_outer_step([p * 3 + 1 for p in new_phi], new_delta)
                    replica.train_step()
                    stepped.set()
                time.sleep(0.002)  # a slow link: most of the payload crosses after the step
        payload = receiver.finish()
    finally:
        server.stop(grace=None)
    assert stepped.is_set() and node.sessions == 1
    # Its round closed before the caller's commit came: it did not blend, and said so (neither side blends).
    assert [v.commit for v in verdicts] == [False] and "closed" in verdicts[0].reason
    moved = sum(not torch.equal(p.detach().to(torch.bfloat16), before[f"theta/{n}"]) for n, p in
                zip(replica.names, replica.params, strict=True))  # fmt: skip
    assert moved == len(replica.names)  # the live weights did change under the stream
    for name, tensor in before.items():
        assert torch.equal(payload.tensors[name], tensor), name  # yet the partner got the offered ones, exactly
    assert pairing_round.offer.holders == 0  # and the copy went back to its pool once the stream ended
