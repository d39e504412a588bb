"""Who may hold what on a node's server (rpc/admission.py): slots per kind, per peer and per address, and bars."""

from __future__ import annotations

import pytest

from noloco_node.node.descriptors import connection_budget
from noloco_node.rpc.admission import DOWNLOAD, EXCHANGE, INFO, Admission, Refused, remote_host


def test_each_kind_has_its_own_slots_and_one_host_cannot_take_them_all() -> None:
    admission = Admission(slots={EXCHANGE: 3, DOWNLOAD: 1, INFO: 2}, per_address=2)
    held = [admission.enter(EXCHANGE, peer=f"sybil{i}", address="10.0.0.9") for i in range(2)]
    with pytest.raises(Refused) as per_address:  # a third key from the same host
        admission.enter(EXCHANGE, peer="sybil2", address="10.0.0.9")
    assert per_address.value.reason == "per_address"
    honest = admission.enter(EXCHANGE, peer="honest", address="10.0.0.1")
    with pytest.raises(Refused) as full:
        admission.enter(EXCHANGE, peer="late", address="10.0.0.2")
    assert full.value.reason == "no_slot"
    # Exchanges are full, yet a download and Info still have their slots.
    admission.enter(DOWNLOAD, peer="joiner", address="10.0.0.3")
    admission.enter(INFO, peer=None, address="10.0.0.9")
    with pytest.raises(Refused) as per_peer:
        admission.enter(DOWNLOAD, peer="joiner", address="10.0.0.4")
    assert per_peer.value.reason in ("per_peer", "no_slot")
    for ticket in [*held, honest]:
        admission.leave(ticket)
    assert admission.in_use()[EXCHANGE] == 0
    one = admission.enter(EXCHANGE, peer="honest", address="10.0.0.1")
    with pytest.raises(Refused) as twice:
        admission.enter(EXCHANGE, peer="honest", address="10.0.0.5")
    assert twice.value.reason == "per_peer"
    admission.leave(one)


def test_a_stall_bars_its_peer_and_address_from_exchanges_doubling_each_time() -> None:
    now = [0.0]
    admission = Admission(
        slots={EXCHANGE: 4, DOWNLOAD: 1, INFO: 1}, bar_seconds=0.2, max_bar_seconds=10, clock=lambda: now[0]
    )
    ticket = admission.enter(EXCHANGE, peer="hog", address="10.0.0.9")
    admission.leave(ticket)
    assert admission.bar(ticket) == pytest.approx(0.2)
    for peer, address in (("hog", "10.0.0.8"), ("new-key", "10.0.0.9")):
        with pytest.raises(Refused) as barred:
            admission.enter(EXCHANGE, peer=peer, address=address)
        assert barred.value.reason == "barred"
    admission.leave(admission.enter(INFO, peer="hog", address="10.0.0.9"))  # still answered
    admission.leave(admission.enter(EXCHANGE, peer="honest", address="10.0.0.1"))
    now[0] += 0.25  # past the bar
    again = admission.enter(EXCHANGE, peer="hog", address="10.0.0.9")
    admission.leave(again)
    assert admission.bar(again) == pytest.approx(0.4)


@pytest.mark.parametrize(("stall", "min_rate", "bars"), [(0.2, 0.0, True), (0.0, 1e9, True), (0.0, 0.0, False)])
def test_a_cut_exchange_is_barred_before_its_caller_hears_of_the_cut(stall: float, min_rate: float, bars: bool) -> None:
    """Stalled (no byte for ``stall``) or trickling (below ``min_rate``): the bar is set before the call is cancelled,
    so a caller that calls again the moment it is cut finds it. A call cut at its deadline is not barred."""
    import threading

    from noloco_node.rpc.call_gate import CallGate
    from noloco_node.rpc.metrics import ExchangeMetrics
    from noloco_node.rpc.transport import Watchdog

    admission = Admission(slots={EXCHANGE: 2, DOWNLOAD: 1, INFO: 1})
    gate = CallGate(
        ExchangeMetrics(), admission, watchdog=Watchdog(tick=0.05), min_link_rate=min_rate, stall_seconds=stall
    )
    cancelled = threading.Event()
    refused_at_cancel: list[str] = []

    class Context:
        def cancel(self) -> None:
            try:
                admission.leave(admission.enter(EXCHANGE, peer="hog-again", address="10.0.0.9"))
            except Refused as refused:
                refused_at_cancel.append(refused.reason)
            cancelled.set()

    ticket = admission.enter(EXCHANGE, peer="hog", address="10.0.0.9")
    moved = iter(range(10**6))  # a trickle: one byte more at every look
    guard = gate.watch(
        Context(), ticket, limit=0.3 if not bars else 30, progress=lambda: next(moved) if min_rate else 0
    )  # type: ignore[arg-type]
    guard.grace = 0.1
    try:
        assert cancelled.wait(5), "the watchdog never cut the call"
    finally:
        gate.leave(ticket, guard)
        gate.watchdog.stop()
    assert guard.cut_reason == ("stalled" if stall else "too_slow" if min_rate else "deadline")
    assert refused_at_cancel == (["barred"] if bars else [])


def test_remote_hosts_and_the_connection_budget() -> None:
    assert remote_host("ipv4:127.0.0.2:5555") == "127.0.0.2"
    assert remote_host("ipv6:[::1]:5555") == "::1"
    assert connection_budget(1024) == 384 and connection_budget(100) == 16 and connection_budget(10**7) == 4096


def test_a_call_whose_receiver_cannot_be_built_gives_its_slot_back() -> None:
    """The exchange slot was taken before the receiver was built; a node whose payload kinds raised there kept the
    slot for ever (eight such calls and it served no exchange again)."""
    from noloco_node.rpc.metrics import ExchangeMetrics
    from noloco_node.rpc.service import PeerService

    class Broken:
        run_fingerprint, peer_id, receive_buffers = "run", "server", None
        closed = 0

        def payload_kinds(self) -> list:
            raise RuntimeError("the node is shutting down")

        def max_payload_bytes(self) -> int:
            return 1 << 20

        def value_observer(self) -> Broken:
            return self

        def close(self) -> None:
            self.closed += 1

    class Context:
        def invocation_metadata(self) -> list:
            return []

        def peer(self) -> str:
            return "ipv4:127.0.0.1:5555"

    node = Broken()
    service = PeerService(node, ExchangeMetrics())  # type: ignore[arg-type]
    for _ in range(10):
        with pytest.raises(RuntimeError):
            next(service.Exchange(iter(()), Context()))  # type: ignore[arg-type]
    assert service.admission.in_use().get(EXCHANGE, 0) == 0 and node.closed == 10


def test_the_slots_held_are_read_by_status_and_metrics_at_each_read() -> None:
    from prometheus_client import generate_latest

    from noloco_node.rpc.call_gate import CallGate
    from noloco_node.rpc.metrics import ExchangeMetrics

    metrics = ExchangeMetrics()
    assert metrics.calls_in_use == {}  # no server yet
    gate = CallGate(metrics, Admission(slots={EXCHANGE: 2, DOWNLOAD: 1, INFO: 1}))
    ticket = gate.admission.enter(EXCHANGE, peer="a", address="10.0.0.1")
    assert metrics.snapshot()["calls_in_use"] == {EXCHANGE: 1, DOWNLOAD: 0, INFO: 0}
    assert b'noloco_calls_in_use{kind="exchange"} 1.0' in generate_latest(metrics.registry)
    gate.admission.leave(ticket)
    assert metrics.calls_in_use[EXCHANGE] == 0
    assert b'noloco_calls_in_use{kind="exchange"} 0.0' in generate_latest(metrics.registry)
