"""The gRPC exchange over real sockets on 127.0.0.1: exact payloads both ways, fast refusals, bad payloads and cut
streams that change nothing.

The served side is a small holder of real tensors that records what it would blend with (the daemon in node/daemon.py
plays that role in a swarm); everything between the two sides is the real server, client and wire format.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from noloco_node.algorithm import noloco_outer_step
from noloco_node.rpc.client import ExchangeError, Outgoing, exchange_with, fetch_info, fetch_receipts
from noloco_node.rpc.contracts import EXCHANGE_METHOD, AdmitsEverything
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.service import start_server
from noloco_node.rpc.transport import CHANNEL_OPTIONS, Transport
from noloco_node.security.caller_proof import CallerVerifier
from noloco_node.security.identity import NodeIdentity
from noloco_node.security.receipts import Receipt, ReceiptBook, ReceiptTerms
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire import peer_pb2_grpc as pb_grpc
from noloco_node.wire.frames import PayloadKind, build_manifest, iter_frames, layout_of
from noloco_node.wire.payload import Payload
from noloco_node.wire.receive_buffers import ReceiveBuffers

RUN = "run-exchange-test"


def params(seed: int, sizes: tuple[int, ...] = (1000, 37, 4096)) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"theta/p{i}", torch.randn(n, generator=g)) for i, n in enumerate(sizes)]


def outgoing(named: list[tuple[str, torch.Tensor]], peer_id: str, run: str = RUN) -> Outgoing:
    manifest = build_manifest(named, wire_dtype="fp32", run_fingerprint=run, peer_id=peer_id, outer_step=7)
    return Outgoing(manifest, [t for _, t in named])


class Holder(AdmitsEverything):
    """A PeerNode holding fixed tensors; records the payloads it was asked to blend with."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], *, busy: bool = False) -> None:
        self.run_fingerprint = RUN
        self.peer_id = "holder"
        self.named = named
        self.busy = busy
        self.completed: list[Payload] = []
        self.released = threading.Event()
        self.receive_buffers = ReceiveBuffers(max_idle_bytes=10**9)

    def expected_layout(self):
        return layout_of(self.named)

    wire_dtype = "fp32"  # what this double and its callers send

    def max_payload_bytes(self) -> int:
        return 10**9

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str = "weights"):
        return None if self.busy else self

    def outgoing(self) -> Outgoing:
        return outgoing(self.named, self.peer_id)

    def complete(self, payload: Payload) -> bool:
        self.completed.append(payload)
        return True

    def release(self) -> None:
        self.released.set()

    def info(self) -> pb.InfoReply:
        return pb.InfoReply(peer_id=self.peer_id, run_fingerprint=RUN, outer_step=7, ready_to_pair=not self.busy)

    def state_snapshot(self):
        return None


@pytest.fixture
def served():
    servers = []

    def serve(holder: Holder) -> tuple[str, ExchangeMetrics]:
        metrics = ExchangeMetrics()
        server, port = start_server(holder, metrics, bind="127.0.0.1:0")
        servers.append(server)
        return f"127.0.0.1:{port}", metrics

    yield serve
    for server in servers:
        server.stop(grace=None)


def test_both_sides_receive_exact_tensors_and_blend_identically(served) -> None:
    theta_a, theta_b = params(1), params(2)
    holder = Holder(theta_a)
    address, server_metrics = served(holder)
    client_metrics = ExchangeMetrics()
    got = exchange_with(
        address,
        outgoing(theta_b, "caller"),
        layout_of(theta_b),
        run_fingerprint=RUN,
        max_payload_bytes=10**9,
        timeout=20,
        metrics=client_metrics,
    )
    assert holder.released.wait(5)
    assert len(holder.completed) == 1 and holder.completed[0].peer_id == "caller"
    for name, tensor in theta_a:
        assert torch.equal(got.tensors[name], tensor)
    for name, tensor in theta_b:
        assert torch.equal(holder.completed[0].tensors[name], tensor)
    # Each side's blend from what it received equals the blend from the partner's original tensors.
    phi = [torch.zeros_like(t) for _, t in theta_a]
    delta = [torch.zeros_like(t) for _, t in theta_a]
    received = [got.tensors[name] for name, _ in theta_a]
    via_wire = noloco_outer_step([t for _, t in theta_b], phi, delta, [received], [], alpha=0.5, beta=0.7, gamma=0.7)
    direct = noloco_outer_step(
        [t for _, t in theta_b], phi, delta, [[t for _, t in theta_a]], [], alpha=0.5, beta=0.7, gamma=0.7
    )
    for x, y in zip(via_wire[0], direct[0], strict=True):
        assert torch.equal(x, y)
    payload_bytes = sum(t.numel() * 4 for _, t in theta_a)
    assert server_metrics.outcomes["completed"] == 1
    assert server_metrics.bytes_sent == client_metrics.bytes_received == payload_bytes
    assert client_metrics.bytes_sent == server_metrics.bytes_received == payload_bytes


def test_large_payloads_both_ways_do_not_deadlock(served) -> None:
    big_a, big_b = params(3, (6_000_000, 2_000_000)), params(4, (6_000_000, 2_000_000))  # 32 MB each way
    holder = Holder(big_a)
    address, _ = served(holder)
    got = exchange_with(
        address, outgoing(big_b, "caller"), layout_of(big_b), run_fingerprint=RUN, max_payload_bytes=10**9, timeout=60
    )
    assert torch.equal(got.tensors["theta/p0"], big_a[0][1])
    assert holder.released.wait(5) and torch.equal(holder.completed[0].tensors["theta/p1"], big_b[1][1])


def test_busy_peer_refuses_at_once(served) -> None:
    holder = Holder(params(1), busy=True)
    address, metrics = served(holder)
    with pytest.raises(ExchangeError) as error:
        exchange_with(
            address,
            outgoing(params(2), "caller"),
            layout_of(params(2)),
            run_fingerprint=RUN,
            max_payload_bytes=10**9,
            timeout=20,
        )
    assert error.value.code == grpc.StatusCode.ABORTED and error.value.reason == "busy"
    assert holder.completed == [] and metrics.outcomes["busy"] == 1


def test_another_runs_peer_is_refused_and_changes_nothing(served) -> None:
    holder = Holder(params(1))
    address, metrics = served(holder)
    with pytest.raises(ExchangeError) as error:
        exchange_with(
            address,
            outgoing(params(2), "stranger", run="other-run"),
            layout_of(params(2)),
            run_fingerprint="other-run",
            max_payload_bytes=10**9,
            timeout=20,
        )
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert holder.completed == [] and metrics.rejected["wrong_run"] == 1


def test_a_payload_with_nan_is_refused_and_changes_nothing(served) -> None:
    holder = Holder(params(1))
    address, metrics = served(holder)
    poisoned = params(2)
    poisoned[2][1][100] = float("nan")
    with pytest.raises(ExchangeError) as error:
        exchange_with(
            address,
            outgoing(poisoned, "caller"),
            layout_of(poisoned),
            run_fingerprint=RUN,
            max_payload_bytes=10**9,
            timeout=20,
        )
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in str(error.value)
    assert holder.released.wait(5)
    assert holder.completed == [] and metrics.rejected["not_finite"] == 1


def test_a_stream_cut_half_way_changes_nothing(served) -> None:
    holder = Holder(params(1, (2_000_000,)))
    address, metrics = served(holder)
    named = params(2, (2_000_000,))
    stop, half_sent = threading.Event(), threading.Event()

    def half_then_stall() -> Iterator[bytes]:
        for i, frame in enumerate(
            iter_frames(outgoing(named, "caller").manifest, [t for _, t in named], chunk_bytes=2**20)
        ):
            if i == 4:  # the manifest and 3 of 8 chunks have gone out
                half_sent.set()
                stop.wait(30)
                return
            yield frame

    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.stream_stream(EXCHANGE_METHOD)(half_then_stall(), timeout=30)
        assert half_sent.wait(10)
        call.cancel()  # the caller vanishes mid-stream
        stop.set()
    assert holder.released.wait(10)
    assert holder.completed == []
    assert metrics.outcomes["completed"] == 0


def test_keyed_sides_seal_both_payloads_and_a_server_answering_in_anothers_name_is_refused(tmp_path: Path) -> None:
    """Between nodes (keys on both sides) each payload is sealed for its call (security/payload_seal.py). A server
    that answers where the caller dialled someone else (a relay, a proxy, a reused address) can prove any id it
    claims to a caller that cannot check, and name it in its manifest: its seal is its own, and is refused."""
    caller, server_key, victim = NodeIdentity.ephemeral(), NodeIdentity.ephemeral(), NodeIdentity.ephemeral()
    honest, impostor = Holder(params(1)), Holder(params(3))
    honest.peer_id, impostor.peer_id = server_key.peer_id, victim.peer_id
    served_receipts = ReceiptBook(tmp_path)
    called_receipts: list[Receipt] = []
    server_metrics, caller_metrics = ExchangeMetrics(), ExchangeMetrics()
    servers = [
        start_server(
            holder,
            server_metrics,
            bind="127.0.0.1:0",
            transport=Transport(identity=server_key),
            verifier=CallerVerifier(claimed),  # accepts proofs made for the id it claims
            receipts=served_receipts,
        )
        for holder, claimed in ((honest, server_key.peer_id), (impostor, victim.peer_id))
    ]
    try:
        (_, honest_port), (_, impostor_port) = servers

        def call(port: int, peer: str) -> Payload:
            return exchange_with(
                f"127.0.0.1:{port}",
                outgoing(params(2), caller.peer_id),
                layout_of(params(2)),
                answers=[PayloadKind("weights", tuple(layout_of(params(2))), "fp32")],  # the kind receipts name
                run_fingerprint=RUN,
                max_payload_bytes=10**9,
                timeout=20,
                peer=peer,
                transport=Transport(identity=caller),
                metrics=caller_metrics,
                receipts=called_receipts.append,
            )

        got = call(honest_port, server_key.peer_id)
        assert torch.equal(got.tensors["theta/p0"], params(1)[0][1])
        assert honest.released.wait(5) and len(honest.completed) == 1
        # The commit signed the exchange's receipt on both sides: each holds the same one, naming both payloads.
        assert caller_metrics.receipts == {"kept": 1} and server_metrics.receipts == {"kept": 1}, (
            server_metrics.receipts
        )
        assert [r.to_json() for r in called_receipts] == served_receipts.page(0, 10) and len(called_receipts) == 1
        receipt = called_receipts[0]
        receipt.check()
        assert (receipt.terms.caller, receipt.terms.server, receipt.terms.run) == (
            caller.peer_id,
            server_key.peer_id,
            RUN,
        )
        with pytest.raises(ExchangeError) as refused:
            call(impostor_port, victim.peer_id)
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED and refused.value.reason == "wrong_signer"
        assert server_key.peer_id in str(refused.value)
        assert impostor.released.wait(5) and impostor.completed == []  # the caller refused: nothing blended there
    finally:
        for server, _ in servers:
            server.stop(grace=None)


def test_a_members_receipts_are_served_page_by_page_and_only_to_its_run(tmp_path: Path) -> None:
    """GetReceipts over real gRPC: 150 receipts come back as pages of at most 100, in the order kept, then an empty
    page; a caller of another run is refused before anything is read."""
    caller, server_key = NodeIdentity.ephemeral(), NodeIdentity.ephemeral()
    book = ReceiptBook(tmp_path)
    for step in range(150):
        ids = (caller.peer_id, server_key.peer_id)
        terms = ReceiptTerms(RUN, "weights", *ids, step, step, 1, 1, "", "", f"n{step}", 0)
        book.add(Receipt(terms, "", "", "", ""))  # serving checks nothing: the reader does
    server, port = start_server(Holder(params(1)), ExchangeMetrics(), bind="127.0.0.1:0", receipts=book)
    try:
        address = f"127.0.0.1:{port}"
        pages = [fetch_receipts(address, RUN, after, 1000, timeout=5) for after in (0, 100, 150)]
        assert [len(page) for page in pages] == [100, 50, 0]
        assert [Receipt.from_json(line).terms.binding for line in pages[0] + pages[1]] == [f"n{i}" for i in range(150)]
        with pytest.raises(grpc.RpcError) as refused:
            fetch_receipts(address, "another-run", 0, 10, timeout=5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        server.stop(grace=None)


def test_info(served) -> None:
    address, _ = served(Holder(params(1)))
    reply = fetch_info(address, timeout=5)
    assert (reply.peer_id, reply.run_fingerprint, reply.outer_step) == ("holder", RUN, 7)


def test_a_caller_that_stalls_without_a_deadline_is_cut_off(served) -> None:
    """Slow-loris: a manifest, then nothing, and no deadline. The server gives up after its own limit."""
    holder = Holder(params(1))
    metrics = ExchangeMetrics()
    server, port = start_server(holder, metrics, bind="127.0.0.1:0", max_call_seconds=1.0)
    stop = threading.Event()

    def manifest_then_silence() -> Iterator[pb.Frame]:
        # As protobuf objects through the generated stub: a client of the .proto alone must be served the same.
        yield pb.Frame.FromString(next(iter_frames(outgoing(params(2), "loris").manifest, [t for _, t in params(2)])))
        stop.wait(30)

    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            call = pb_grpc.PeerStub(channel).Exchange(manifest_then_silence())  # no timeout on purpose
            with pytest.raises(grpc.RpcError) as error:
                for _ in call:
                    pass
            # Whichever of the server's limits fires first: its wait for the payload (DEADLINE_EXCEEDED) or the
            # watchdog's limit on the whole call (CANCELLED). Both are the server's own, not the caller's.
            assert error.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
        assert holder.released.wait(5) and holder.completed == []
        assert metrics.outcomes["aborted"] + metrics.outcomes["cut_deadline"] == 1, metrics.outcomes
    finally:
        stop.set()
        server.stop(grace=None)


@pytest.mark.parametrize("cut_at", [40, 700, 9_000, 600_000, 1_500_000, 2_400_000])
def test_a_connection_cut_at_any_byte_leaves_both_sides_unchanged(served, cut_at: int) -> None:
    """All-or-nothing: wherever the connection breaks (in the manifest, a chunk header, a chunk's data, the end),
    the caller gets an error and the served side blends nothing."""
    from .throttling_proxy import ThrottlingProxy

    named = params(2, (300_000, 7, 300_000))  # 2.4 MB in fp32 each way
    holder = Holder(params(1, (300_000, 7, 300_000)))
    address, metrics = served(holder)
    cutter = ThrottlingProxy(int(address.rsplit(":", 1)[1]), bytes_per_second=10**9, cut_after_bytes=cut_at)
    try:
        with pytest.raises(ExchangeError):
            exchange_with(
                f"127.0.0.1:{cutter.port}",
                outgoing(named, "caller"),
                layout_of(named),
                run_fingerprint=RUN,
                max_payload_bytes=10**9,
                timeout=10,
            )
    finally:
        cutter.close()
    assert cutter.cuts >= 1
    if holder.released.wait(3):  # a server that saw the manifest released its session
        assert holder.completed == [] and metrics.outcomes["completed"] == 0
    assert holder.completed == []
