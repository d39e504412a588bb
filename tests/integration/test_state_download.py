"""State downloads over real gRPC: resumed tensor by tensor from a second donor when the first is cut mid-transfer,
started over when the second donor's snapshot is of another step, and refused with "busy" past a donor's cap."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
import torch

from noloco_node.rpc.client import ExchangeError, Outgoing
from noloco_node.rpc.contracts import AdmitsEverything
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.service import start_server
from noloco_node.rpc.state_download import StateDownload
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import build_manifest
from noloco_node.wire.receive_buffers import ReceiveBuffers

from .throttling_proxy import ThrottlingProxy

RUN = "run-state-test"
SHAPES = [("phi/a", (300, 100)), ("phi/b", (200,)), ("delta/a", (300, 100)), ("delta/b", (200,))]


class Donor(AdmitsEverything):
    """A PeerNode that serves a fixed snapshot (the role node/outer_step.py's published state plays)."""

    def __init__(self, seed: int, outer_step: int, *, slow: threading.Event | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.named = [(name, torch.randn(shape, generator=g)) for name, shape in SHAPES]
        self.run_fingerprint = RUN
        self.peer_id = f"donor-{seed}"
        self.receive_buffers = ReceiveBuffers(max_idle_bytes=0)
        self.outer_step = outer_step
        self.slow = slow
        metadata = {"inner_step": outer_step * 10, "outer_step": outer_step, "adam_step": outer_step * 10}
        manifest = build_manifest(
            self.named,
            wire_dtype="fp32",
            run_fingerprint=RUN,
            peer_id=self.peer_id,
            outer_step=outer_step,
            metadata_json=json.dumps(metadata),
        )
        self.snapshot = Outgoing(manifest, _Gated([t for _, t in self.named], slow))

    def state_snapshot(self) -> Outgoing:
        return self.snapshot

    def info(self) -> pb.InfoReply:
        return pb.InfoReply(peer_id=self.peer_id, run_fingerprint=RUN)

    def expected_layout(self) -> list:
        return []

    wire_dtype = "fp32"  # exchanges are not served here

    def max_payload_bytes(self) -> int:
        return 0

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str = "weights") -> None:
        return None


class _Gated(list):
    """The snapshot's tensors; with a gate, serving waits on it before the second tensor (a stalled download)."""

    def __init__(self, tensors: list[torch.Tensor], gate: threading.Event | None) -> None:
        super().__init__(tensors)
        self.gate = gate
        self.waiting = threading.Event()  # a download is being held at the gate

    def __getitem__(self, index):  # the server serves a slice (what the manifest names): the same gate
        if not isinstance(index, slice):
            return list.__getitem__(self, index)
        part = _Gated(list.__getitem__(self, index), self.gate)
        part.waiting = self.waiting
        return part

    def __iter__(self):
        for index, tensor in enumerate(list.__iter__(self)):
            if index == 1 and self.gate is not None:
                self.waiting.set()
                self.gate.wait(20)
            yield tensor


@pytest.fixture
def serve():
    servers = []

    def start(donor: Donor, **options: int) -> tuple[str, int]:
        server, port = start_server(donor, ExchangeMetrics(), bind="127.0.0.1:0", **options)
        servers.append(server)
        return f"127.0.0.1:{port}", port

    yield start
    for server in servers:
        server.stop(grace=None)


def test_a_download_cut_mid_transfer_resumes_chunk_wise_from_another_donor_of_the_same_step(serve) -> None:
    first, second = Donor(1, outer_step=6), Donor(2, outer_step=6)
    _, first_port = serve(first, chunk_bytes=16384)
    second_address, _ = serve(second, chunk_bytes=16384)
    # 200 kB of the first donor's 481 kB pass (phi/a 120 kB, phi/b 0.8 kB, part of delta/a), then a cut. At 2 MB/s,
    # not 1 GB/s: poured in at once, the 200 kB could all sit in gRPC's buffers when it reported the broken
    # connection, and nothing was kept (a failure of `make test` on a loaded machine).
    cutter = ThrottlingProxy(first_port, bytes_per_second=2_000_000, cut_after_bytes=200_000)
    download = StateDownload(SHAPES, run_fingerprint=RUN, peer_id="joiner")
    try:
        with pytest.raises(ExchangeError):
            download.fetch(f"127.0.0.1:{cutter.port}", timeout=20)
    finally:
        cutter.close()
    # How many verified chunks gRPC delivers before it reports the broken connection varies (on a loaded machine
    # as little as part of the first tensor): check what was kept, whatever it is.
    whole = len(download.done) - (1 if download.partial_bytes else 0)
    assert cutter.cuts >= 1 and 0 <= whole <= 3 and len(download.done) >= 1
    partial_values = download.partial_bytes // 4
    tensors, counters = download.fetch(second_address, timeout=20)
    assert download.resumed == 1 and counters == {"inner_step": 60, "outer_step": 6, "adam_step": 60}
    for index, (name, _) in enumerate(SHAPES):
        got, a, b = tensors[name].reshape(-1), first.named[index][1].reshape(-1), second.named[index][1].reshape(-1)
        if index < whole:
            assert torch.equal(got, a), name  # kept from the first donor
        elif index == whole and partial_values:
            # The tensor that was cut: what arrived from the first, the rest from the second, not a byte twice.
            assert torch.equal(got[:partial_values], a[:partial_values]), name
            assert torch.equal(got[partial_values:], b[partial_values:]), name
        else:
            assert torch.equal(got, b), name  # from the second


def test_a_donor_at_another_step_restarts_the_download_instead_of_mixing_steps(serve) -> None:
    first, later = Donor(1, outer_step=6), Donor(3, outer_step=7)
    _, first_port = serve(first)
    later_address, _ = serve(later)
    cutter = ThrottlingProxy(first_port, bytes_per_second=10**9, cut_after_bytes=125_000)
    download = StateDownload(SHAPES, run_fingerprint=RUN, peer_id="joiner")
    try:
        with pytest.raises(ExchangeError):
            download.fetch(f"127.0.0.1:{cutter.port}", timeout=20)
    finally:
        cutter.close()
    with pytest.raises(ExchangeError) as refused:
        download.fetch(later_address, timeout=20)  # asks to resume step 6; the donor is at step 7
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and download.done == []
    tensors, counters = download.fetch(later_address, timeout=20)  # so it starts over, whole, at step 7
    assert counters["outer_step"] == 7 and download.resumed == 0
    assert all(torch.equal(tensors[name], t) for name, t in later.named)


def test_a_donor_serving_its_maximum_of_downloads_answers_busy(serve) -> None:
    gate = threading.Event()
    donor = Donor(1, outer_step=3, slow=gate)
    address, _ = serve(donor, max_state_downloads=1)
    stalled = StateDownload(SHAPES, run_fingerprint=RUN, peer_id="first-joiner")
    holder = threading.Thread(target=lambda: stalled.fetch(address, timeout=30))
    holder.start()
    try:
        assert donor.snapshot.tensors.waiting.wait(20), "the first download never reached the donor"
        busy = None
        try:
            StateDownload(SHAPES, run_fingerprint=RUN, peer_id="second-joiner").fetch(address, timeout=10)
        except ExchangeError as error:
            busy = error
        assert busy is not None and busy.reason == "busy", busy
        assert busy.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        gate.set()
        holder.join(30)
    tensors, _ = StateDownload(SHAPES, run_fingerprint=RUN, peer_id="third").fetch(address, timeout=20)
    assert torch.equal(tensors["phi/a"], donor.named[0][1])  # the slot is free again


def test_a_cancelled_download_ends_at_once_keeps_what_arrived_and_counts_its_bytes(serve) -> None:
    """A node asked to stop cancels its download (node/catch_up.py): the fetch, reading a donor behind a slow link,
    ends within a second instead of at its deadline, with what arrived kept for a later donor of the same step."""
    first, second = Donor(1, outer_step=6), Donor(2, outer_step=6)
    _, first_port = serve(first, chunk_bytes=16384)
    second_address, _ = serve(second, chunk_bytes=16384)
    slow = ThrottlingProxy(first_port, bytes_per_second=40_000)  # 481 kB: about 12 s
    download = StateDownload(SHAPES, run_fingerprint=RUN, peer_id="joiner")
    outcome: list[BaseException] = []

    def fetch() -> None:
        try:
            download.fetch(f"127.0.0.1:{slow.port}", timeout=60)
        except ExchangeError as error:
            outcome.append(error)

    fetching = threading.Thread(target=fetch)
    try:
        fetching.start()
        deadline = time.monotonic() + 30
        while download.bytes_received < 100_000:
            assert time.monotonic() < deadline and fetching.is_alive(), "no bytes arrived"
            time.sleep(0.05)
        cancelled = time.monotonic()
        download.cancel()
        fetching.join(10)
        assert not fetching.is_alive() and time.monotonic() - cancelled < 2.0
    finally:
        slow.close()
    (error,) = outcome
    assert error.code == grpc.StatusCode.CANCELLED
    assert len(download.done) >= 1  # what arrived is kept
    fresh = StateDownload(SHAPES, run_fingerprint=RUN, peer_id="joiner")
    fresh.done, fresh.partial_bytes, fresh.counters = download.done, download.partial_bytes, download.counters
    tensors, counters = fresh.fetch(second_address, timeout=20)  # a later download of the same step resumes it
    assert fresh.resumed == 1 and counters["outer_step"] == 6 and set(tensors) == {name for name, _ in SHAPES}
