"""Pairing state without sockets: one exchange at a time, fast refusals, first partner wins, bounded close, bounded
offer book, and published copies that are never reused while a stream holds them."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import grpc
import pytest
import torch
from hivemind.utils.timed_storage import get_dht_time

from noloco_node import algorithm
from noloco_node.discovery.dht import PeerRecord
from noloco_node.pairing.overlap import OfferBook, OverlapPairing
from noloco_node.pairing.pairing_round import PairingRound, Stage
from noloco_node.pairing.peer_policy import UNDELIVERED, PeerPolicy
from noloco_node.pairing.reserved import RepeatGrace, meeting_window
from noloco_node.pairing.strategy import OfferPublisher
from noloco_node.pairing.stream import StreamPairing, compressed_partner
from noloco_node.pairing.sync import SyncPairing
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire import quantize, side_info, sparse
from noloco_node.wire.frames import MEET_DUE, MEETING, PayloadError, PayloadKind, TensorLayout
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import BufferPool, LatestSnapshot, Published
from noloco_node.wire.receive_buffers import ReceiveBuffers


class Released(Payload):
    """A payload that remembers being released (its buffers given back)."""

    released = 0

    def release(self) -> None:
        self.released += 1


def payload(peer: str, step: int) -> Released:
    return Released(pb.Manifest(peer_id=peer, outer_step=step), {"theta/x": torch.zeros(1)})


def offer() -> Published:
    return BufferPool([(2,)], torch.float32).publish([torch.ones(2)])


def round_at(step: int = 5, **kwargs: object) -> PairingRound:
    return PairingRound(step, offer(), **kwargs)  # type: ignore[arg-type]


def test_a_round_serves_one_exchange_at_a_time_and_refuses_the_rest_at_once() -> None:
    current = round_at()
    first = current.try_session("x", 5, max_staleness=2)
    assert first is not None
    assert current.try_session("x", 5, max_staleness=2) is None  # busy: refused without waiting
    first.release()
    assert current.try_session("x", 9, max_staleness=2) is None  # too far apart in steps
    second = current.try_session("x", 4, max_staleness=2)
    assert second is not None
    second.complete(payload("a", 4))
    second.release()
    assert current.stage is Stage.PAIRED and current.partner.peer_id == "a" and current.waiting_over.done()
    assert current.try_session("x", 5, max_staleness=2) is None  # already paired


def test_the_first_complete_exchange_is_the_partner_and_a_late_one_is_let_go() -> None:
    current = round_at()
    first, late = payload("a", 5), payload("b", 5)
    current.settle(first)
    current.settle(late)
    current.wait(timeout=0)
    assert current.close(wait_for_exchange=0).peer_id == "a"
    assert late.released == 1 and first.released == 0


def test_waiting_past_the_timeout_stops_new_exchanges_but_lets_one_in_flight_finish() -> None:
    current = round_at()
    session = current.try_session("x", 5, max_staleness=0)
    assert session is not None
    current.wait(timeout=0.01)
    assert current.stage is Stage.CLOSING and current.try_session("y", 5, max_staleness=0) is None
    session.complete(payload("x", 5))  # the exchange that was streaming completes: it is still the partner
    session.release()
    assert current.close(wait_for_exchange=1).peer_id == "x"


def test_a_round_nobody_answered_closes_alone() -> None:
    current = round_at()
    current.wait(timeout=0.01)
    assert current.close(wait_for_exchange=1) is None and current.stage is Stage.CLOSED


def test_steps_taken_while_waiting_do_not_count_against_the_timeout_only_idling_does() -> None:
    """A partner whose phase ran longer arrives while this node trains its next phase's steps early: however long
    those take, the round is still open for it; once no step may be borrowed, the node idles --pair-timeout."""
    current, late = round_at(), payload("late", 5)
    steps: list[int] = []

    def train_step() -> bool:
        steps.append(len(steps))
        if len(steps) == 6:  # the late partner's exchange completes during the sixth step
            current.try_session("late", 5, max_staleness=0).complete(late)  # type: ignore[union-attr]
        return True

    current.wait(timeout=0.0, train_step=train_step)  # no idle time at all
    assert len(steps) == 6 and current.close(wait_for_exchange=0) is late

    alone, taken = round_at(), []

    def borrow_three() -> bool:
        taken.append(1)
        return len(taken) <= 3  # the fourth is refused: half of the next phase is borrowed

    alone.wait(timeout=0.01, train_step=borrow_three)
    assert len(taken) == 4 and alone.stage is Stage.CLOSING and alone.close(wait_for_exchange=0) is None

    # A run's last outer step borrows nothing: it idles the time the steps would have taken (at_least), then the
    # timeout. Its partner settles from another thread once the wait is under way.
    last, arriving, under_way = round_at(), payload("late", 5), threading.Event()

    def nothing_to_borrow() -> bool:
        under_way.set()
        return False

    def partner_arrives() -> None:
        under_way.wait(10)
        last.try_session("late", 5, max_staleness=0).complete(arriving)  # type: ignore[union-attr]

    arrival = threading.Thread(target=partner_arrives)
    arrival.start()
    last.wait(timeout=0.0, train_step=nothing_to_borrow, at_least=60.0)
    # Read before the arrival is joined: a round that stopped waiting is CLOSING, and would still take the exchange
    # completing after it (paired then), so only the stage as the wait returns tells whether it waited.
    stage_when_the_wait_returned = last.stage
    arrival.join(10)
    assert stage_when_the_wait_returned is Stage.PAIRED and last.close(wait_for_exchange=0) is arriving


def test_closing_waits_for_the_exchange_in_flight_then_refuses_new_ones() -> None:
    current = round_at()
    session = current.try_session("x", 5, max_staleness=0)
    assert session is not None

    def finish_later() -> None:
        current.waiting_over.result(timeout=10)  # close() has begun: it stops the waiting before it waits
        session.complete(payload("late", 5))
        session.release()

    threading.Thread(target=finish_later).start()
    partner = current.close(wait_for_exchange=10)
    assert partner is not None and partner.peer_id == "late"  # applied whole, not dropped half-way
    assert current.stage is Stage.CLOSED and current.try_session("x", 5, max_staleness=0) is None


def test_closing_gives_up_on_an_exchange_that_outlives_its_bound_and_its_copy_stays_valid() -> None:
    current = round_at()
    session = current.try_session("x", 5, max_staleness=0)
    assert session is not None
    assert current.close(wait_for_exchange=0.1) is None
    # The round let go of its offer, but the stream still holds it: its tensors are intact and not reused.
    assert current.offer.holders == 1 and torch.equal(session.outgoing().tensors[0], torch.ones(2))
    session.release()
    assert current.offer.holders == 0


def record(peer: str, host: str = "127.0.0.1") -> PeerRecord:
    return PeerRecord(peer, f"{host}:7000", "run", outer_step=5, ready=True)


def test_the_more_recently_paired_half_of_the_peers_in_view_waits_its_turn() -> None:
    """For the first part of a phase the more recently paired half of the peers in view waits, calling or called:
    peers never paired or paired longest ago are reserved first, so that nodes whose phases open together do not
    lock into groups that only ever pair among themselves. With two peers in view only the last partner waits."""
    strategy = sync_pairing()
    strategy.ctx.caller.last_paired.update({"a": 4, "b": 3, "c": 2, "d": 1})
    strategy._records = {p: record(p) for p in ("a", "b", "c", "d", "new", "newer")}
    strategy._grace_seconds = RepeatGrace.seconds(True, 7200, 7200)
    strategy._begin_phase([], [], 5)
    for recent in ("a", "b", "c"):
        assert strategy.open_session(recent, 5, "meet") is None
    for older in ("d", "new"):
        session = strategy.open_session(older, 5, "meet")
        assert session is not None
        session.release()
    assert strategy._phase is not None
    strategy._phase.repeat = RepeatGrace(frozenset("abc"), time.monotonic())  # their turn has come
    session = strategy.open_session("a", 5, "meet")
    assert session is not None
    session.release()

    grace = RepeatGrace.starting(100.0, 5.0, [record("last"), record("other")], {"last": 7, "other": 6})
    assert grace.allows("other", 100.0) and not grace.allows("last", 104.9) and grace.allows("last", 105.0)
    assert RepeatGrace.starting(100.0, 5.0, [record("last")], {"last": 7}).allows("last", 100.0)  # nobody else
    assert RepeatGrace.starting(100.0, 5.0, [record("x"), record("y")], {}).allows("x", 100.0)  # never paired
    # Counted per network group, as Standing.order counts: a host's other keys wait with the key it paired with.
    host = [record(key, "11.0.0.9") for key in ("h1", "h2", "h3")]
    others = [record(key, f"11.0.{i}.1") for i, key in enumerate(("p", "q", "r"), start=1)]
    grace = RepeatGrace.starting(100.0, 5.0, [*host, *others], {"h1": 7, "p": 6, "q": 5})
    assert grace.waiting == {"h1", "h2", "h3"}
    # No partner last time: no grace at all; at most half the pair timeout.
    assert RepeatGrace.seconds(False, 7200, 7200) == 0 and RepeatGrace.seconds(True, 10, 7200) == 5


def test_offer_book_keeps_the_nearest_offer_within_the_staleness_bound_both_ways() -> None:
    book = OfferBook()
    assert book.try_session("x") is None  # nothing to offer yet
    book.set_offer(offer())
    session = book.try_session("a")
    assert session is not None and book.try_session("a") is None
    session.complete(payload("a", 3))
    session.release()
    older = payload("a", 2)
    book.store("a", older)  # older than what is held from that peer: dropped (released)
    assert older.released == 1
    book.store("b", payload("b", 6))
    book.store("c", payload("c", 1))
    assert book.take_nearest(own_outer_step=7, max_staleness=2).peer_id == "b"
    assert book.take_nearest(own_outer_step=7, max_staleness=2) is None  # each offer is used once
    book.store("d", payload("d", 1))
    assert book.take_nearest(own_outer_step=7, max_staleness=2) is None  # too stale
    book.store("e", payload("e", 12))
    assert book.take_nearest(own_outer_step=7, max_staleness=2) is None  # too far ahead: the bound holds both ways
    for peer, step in (("f", 9), ("g", 6), ("h", 8)):
        book.store(peer, payload(peer, step))
    assert book.take_nearest(own_outer_step=7, max_staleness=2).peer_id == "h"  # the nearest, the fresher of two


def test_offer_book_stays_bounded_under_many_callers() -> None:
    """Thousands of callers (under as many proven ids) each leave an offer: the book keeps at most its bound, the
    freshest, and gives every other payload's buffers back."""
    book = OfferBook(max_offers=4)
    book.set_offer(offer())
    stored = []
    for caller in range(2000):
        session = book.try_session(f"peer{caller}")
        assert session is not None
        stored.append(payload(f"peer{caller}", caller % 50))
        session.complete(stored[-1])
        session.release()
        assert book.held_offers() <= 4
    kept = [p for p in stored if p.released == 0]
    assert len(kept) == 4 and all(p.outer_step == 49 for p in kept)
    book.close()
    assert all(p.released == 1 for p in stored)


def test_an_overlap_node_calling_a_peer_serves_that_peers_crossing_call_and_calls_while_serving() -> None:
    """Two overlap nodes in step call each other at once: each must serve the other's call while its own is in
    flight (a node calling out once refused every call in, so both calls were refused and both blended solo), and a
    node serving one caller still makes its own swap."""
    peer = record("p")
    in_flight = asyncio.Event()
    finish = asyncio.Event()
    calls: list[str] = []

    async def call(partner: PeerRecord, outgoing: Published) -> Payload:
        calls.append(partner.peer_id)
        in_flight.set()
        await finish.wait()
        return payload(partner.peer_id, 3)

    async def live_peers() -> list[PeerRecord]:
        return [peer]

    ctx = SimpleNamespace(
        peer_id=lambda: "self",
        discovery=SimpleNamespace(live_peers=live_peers),
        caller=SimpleNamespace(choosable=lambda peers, step: peers, order=list, call=call),
    )
    pairing = OverlapPairing(ctx)  # type: ignore[arg-type]
    pairing.book.set_offer(offer())

    async def scenario() -> None:
        runner = asyncio.create_task(pairing.run())
        await asyncio.wait_for(in_flight.wait(), 5)
        crossing = pairing.open_session("p", 3, "weights")  # the peer's own call arrives meanwhile
        assert crossing is not None
        assert pairing.open_session("q", 3, "weights") is None  # one caller served at a time
        crossing.complete(payload("p", 2))
        crossing.release()
        finish.set()
        await asyncio.wait_for(_until(lambda: pairing.book.held_offers() == 1 and not runner.done()), 5)
        # Serving a caller (its session still open), the node swaps at its next outer step all the same.
        serving = pairing.open_session("q", 4, "weights")
        assert serving is not None
        in_flight.clear()
        pairing.after_blend([torch.ones(2)], [torch.zeros(2)], [torch.ones(2)], [torch.ones(2)], 4)
        await asyncio.wait_for(in_flight.wait(), 5)
        serving.release()
        runner.cancel()

    ctx.offers = {"weights": _WeightsOffers()}
    asyncio.run(scenario())
    assert calls == ["p", "p"]
    kept = pairing.book.take_nearest(own_outer_step=3, max_staleness=2)
    assert kept is not None and kept.outer_step == 3  # the fresher of the peer's two offers
    pairing.close()


class _WeightsOffers:
    """The overlap strategy's publisher of its next offer (what after_blend calls), without a payload layout."""

    def publish(self, parts: object, outer_step: int) -> Published:
        return offer()


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_the_pool_never_hands_out_buffers_a_reader_still_holds() -> None:
    pool = BufferPool([(3,)], torch.float32, keep=2)
    first = pool.publish([torch.full((3,), 1.0)])
    assert first.hold()  # a stream reads it
    first.release()  # the publisher moves on
    second = pool.publish([torch.full((3,), 2.0)])
    assert second.tensors[0].data_ptr() != first.tensors[0].data_ptr()
    assert torch.equal(first.tensors[0], torch.full((3,), 1.0))  # the reader's copy is untouched
    first.release()  # the stream ends: its buffers go back to the pool
    second.release()
    third = pool.publish([torch.full((3,), 3.0)])
    assert third.tensors[0].data_ptr() in {first.tensors[0].data_ptr(), second.tensors[0].data_ptr()}
    assert pool.allocated == 2  # reused, not allocated anew


def test_latest_hands_out_held_copies_and_releases_the_superseded_one() -> None:
    pool = BufferPool([(1,)], torch.float32)
    latest = LatestSnapshot()
    assert latest.hold() is None
    one = latest.renew(lambda: pool.publish([torch.ones(1)]))
    reader = latest.hold()
    assert reader is one and one.holders == 2
    two = latest.renew(lambda: pool.publish([torch.zeros(1)]))
    assert one.holders == 1 and pool.allocated == 2  # the reader keeps the old copy alive, so a second set
    reader.release()
    assert one.holders == 0
    three = latest.renew(lambda: pool.publish([torch.full((1,), 3.0)]))
    # nobody read the latest: its own buffers took the next copy, and the pool allocated nothing
    assert two.holders == 0 and three.tensors[0].data_ptr() == two.tensors[0].data_ptr() and pool.allocated == 2
    assert float(latest.hold().tensors[0]) == 3.0


def test_a_reader_waits_for_a_renewal_in_progress_rather_than_find_no_snapshot() -> None:
    pool = BufferPool([(1,)], torch.float32)
    latest = LatestSnapshot()
    latest.renew(lambda: pool.publish([torch.ones(1)]))
    taking, finish = threading.Event(), threading.Event()
    seen: list[float] = []

    def slow_take() -> Published:
        taking.set()
        finish.wait(10)
        return pool.publish([torch.full((1,), 2.0)])

    renewer = threading.Thread(target=latest.renew, args=(slow_take,))
    renewer.start()
    assert taking.wait(10)
    reader = threading.Thread(target=lambda: seen.append(float(latest.hold().tensors[0])))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not seen  # it waits for the copy being taken
    finish.set()
    renewer.join(10)
    reader.join(10)
    assert seen == [2.0]


def test_a_failed_renewal_keeps_the_previous_snapshot_when_a_reader_held_it() -> None:
    pool = BufferPool([(1,)], torch.float32)
    latest = LatestSnapshot()
    one = latest.renew(lambda: pool.publish([torch.ones(1)]))
    reader = latest.hold()

    def failing() -> Published:
        raise RuntimeError("no memory")

    with pytest.raises(RuntimeError):
        latest.renew(failing)
    held = latest.hold()
    assert held is one and one.holders == 3
    held.release()
    reader.release()


def test_receive_buffers_are_reused_after_release() -> None:
    buffers = ReceiveBuffers(max_idle_bytes=1 << 20)
    tensor = buffers.take(torch.float32, 10)
    buffers.give_back([tensor])
    assert buffers.take(torch.float32, 10).data_ptr() == tensor.data_ptr()


def strategy_context(kinds: list[PayloadKind], peer_id: str, pair_timeout: float = 10.0) -> SimpleNamespace:
    """The parts of a node's PairingContext a strategy's phase bookkeeping uses (no loop, no network)."""
    return SimpleNamespace(
        peer_id=lambda: peer_id,
        offers={kind.name: OfferPublisher(kind, run_fingerprint="run", peer_id=lambda: peer_id) for kind in kinds},
        caller=SimpleNamespace(
            settings=SimpleNamespace(
                receive_buffers=ReceiveBuffers(max_idle_bytes=0), metrics=ExchangeMetrics(), run_fingerprint="run"
            ),
            policy=PeerPolicy(exchange_timeout=60.0, min_deadline=5.0, avoid_seconds=30.0),
            last_paired={},
        ),
        loop=None,
        max_staleness=1,
        pair_timeout=pair_timeout,
    )


def stream_pairing(
    progress_dtype: str = "bf16", peer_id: str = "self", shapes: tuple[tuple[int, ...], ...] = ((3, 2),)
):
    """A stream strategy with the parts of a node its phase bookkeeping uses (no loop, no network). A sparse one's
    phase payload is int8 with phi's matrices in the side code, as node/run_layout.py makes it."""
    sparse_wire = progress_dtype == "sparse"
    phi = tuple(
        TensorLayout(f"phi/w{i}", shape, "side" if sparse_wire and side_info.side_coded(shape) else "")
        for i, shape in enumerate(shapes)
    )
    kinds = [
        PayloadKind("phase", phi, "int8" if sparse_wire else "bf16"),
        PayloadKind("progress", tuple(TensorLayout(f"progress/w{i}", s) for i, s in enumerate(shapes)), progress_dtype),
    ]
    return StreamPairing(strategy_context(kinds, peer_id))  # type: ignore[arg-type]


def sync_pairing(peer_id: str = "self", pair_timeout: float = 10.0) -> SyncPairing:
    """A sync strategy with the parts of a node its phase bookkeeping uses (no loop, no network)."""
    kinds = [MEETING, PayloadKind("weights", (TensorLayout("theta/w0", (3, 2)),), "fp32")]
    return SyncPairing(strategy_context(kinds, peer_id, pair_timeout))  # type: ignore[arg-type]


def meeting(peer: str, step: int, seconds_to_step: float) -> Payload:
    return Payload(pb.Manifest(peer_id=peer, outer_step=step), {MEET_DUE: torch.tensor([seconds_to_step])})


def test_sync_reserves_a_peer_whose_outer_step_is_due_within_the_meeting_window_and_blends_its_weights() -> None:
    """A sync phase is reserved by the first meeting both sides commit; the server holds the caller's due time to
    the window (0.7 of half a phase and --pair-timeout: what the first there waits), an unknown one on either side
    meets anyone; the weights at the outer step come only from the reserved peer, once, of the reserved step."""
    strategy = sync_pairing(pair_timeout=10.0)
    strategy._phase_seconds = 30.0  # the last phase: this one's outer step is due in about 30 s
    window = meeting_window(10.0, 30.0)
    assert window == pytest.approx(0.7 * (10.0 + 15.0)) and meeting_window(10.0, None) == pytest.approx(7.0)
    strategy._begin_phase([], [], 4)
    assert strategy.ready()
    offer = strategy._phase.offer  # type: ignore[union-attr]
    assert [spec.name for spec in offer.manifest.tensors] == [MEET_DUE] and 29 < float(offer.tensors[0][0]) <= 30
    late = strategy.open_session("late", 4, "meet")
    assert late is not None and not late.complete(meeting("late", 4, 30 + window + 1))  # due too late
    late.release()
    assert strategy.ready() and strategy.open_session("any", 4, "weights") is None  # no round before the step
    near = strategy.open_session("near", 4, "meet")
    assert near is not None and near.complete(meeting("near", 4, 30 - window + 1))
    near.release()
    assert not strategy.ready() and strategy.open_session("other", 4, "meet") is None  # reserved

    weights = {"theta/w0": torch.ones(3, 2)}
    with pytest.raises(PayloadError) as stranger:
        strategy.complete_payload(Payload(pb.Manifest(peer_id="late", outer_step=4), dict(weights)))
    assert (stranger.value.code, stranger.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "not_reserved")
    whole = strategy.complete_payload(Payload(pb.Manifest(peer_id="near", outer_step=4), dict(weights)))
    assert whole.peer_id == "near" and torch.equal(whole.tensors["theta/w0"], torch.ones(3, 2))
    with pytest.raises(PayloadError):  # one round payload per reservation
        strategy.complete_payload(Payload(pb.Manifest(peer_id="near", outer_step=4), dict(weights)))

    unknown = sync_pairing()  # before its first phase was measured, a node meets anyone within reach
    unknown._begin_phase([], [], 0)
    session = unknown.open_session("far", 0, "meet")
    assert session is not None and session.complete(meeting("far", 0, 1000.0))
    session.release()
    for sent in (-1.0, math.nan):  # the caller did not know (or sent no number): unknown, so it meets
        assert sync_pairing().seconds_to_step(meeting("x", 0, sent)) is None


def test_a_sync_node_says_when_its_step_is_due_and_asks_only_peers_due_near_it() -> None:
    """A sync node's record says when its next outer step is due (DHT time; 0 before a phase was measured). It asks
    a peer whose record is due within the meeting window of its own step, or says nothing, and skips one due further
    off, which would refuse the ask (``_meet``). A stream node says nothing, and asks whatever the hint says."""
    strategy = sync_pairing(pair_timeout=10.0)
    assert strategy.next_step_at() == 0.0  # no phase yet
    strategy._begin_phase([], [], 4)
    assert strategy.next_step_at() == 0.0  # its first phase: not measured yet
    strategy._phase_seconds = 30.0
    strategy._begin_phase([], [], 5)
    phase, now, window = strategy._phase, get_dht_time(), meeting_window(10.0, 30.0)
    assert phase is not None and now + 29 < strategy.next_step_at() <= now + 31

    def record(peer: str, due: float) -> PeerRecord:
        return PeerRecord(peer, "127.0.0.1:7000", "run", outer_step=5, ready=True, next_step_at=due)

    assert strategy._worth_asking(phase, record("near", now + 30 + window - 1))
    assert strategy._worth_asking(phase, record("unknown", 0.0))
    assert not strategy._worth_asking(phase, record("late", now + 30 + window + 1))
    assert not strategy._worth_asking(phase, record("early", now + 30 - window - 1))

    stream = stream_pairing()
    stream._phase_seconds = 30.0
    stream._begin_phase([torch.zeros(3, 2)], [torch.zeros(3, 2)], 5)
    assert stream.next_step_at() == 0.0
    assert stream._phase is not None and stream._worth_asking(stream._phase, record("late", now + 1000))


def test_stream_reserves_the_first_phase_swap_and_rebuilds_its_partners_theta_from_phi_and_progress() -> None:
    strategy = stream_pairing()
    phi = torch.linspace(-1, 1, 6).view(3, 2)
    strategy._begin_phase([phi], [torch.zeros(3, 2)], 3)
    assert strategy.ready()
    assert strategy.open_session("b", 5, "phase") is None  # beyond --max-staleness
    session = strategy.open_session("b", 3, "phase")
    assert session is not None and strategy.open_session("c", 3, "phase") is None  # one swap at a time
    partner_phi = (phi + 0.001).to(torch.bfloat16)
    session.complete(Payload(pb.Manifest(peer_id="b", outer_step=3), {"phi/w0": partner_phi}))
    session.release()
    assert not strategy.ready() and strategy.open_session("c", 3, "phase") is None  # reserved

    progress = torch.full((3, 2), 1e-4)
    with pytest.raises(PayloadError) as stranger:  # progress from a peer it did not swap with
        strategy.complete_payload(Payload(pb.Manifest(peer_id="c", outer_step=3), {"progress/w0": progress}))
    assert (stranger.value.code, stranger.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "not_reserved")
    whole = strategy.complete_payload(Payload(pb.Manifest(peer_id="b", outer_step=3), {"progress/w0": progress}))
    assert whole.parts == ["theta", "phi"] and whole.peer_id == "b"
    want = partner_phi.to(torch.float32) + progress  # in fp32: phi's bf16 rounding kept, the progress's digits too
    assert whole.tensors["theta/w0"].dtype == torch.float32 and torch.equal(whole.tensors["theta/w0"], want)
    with pytest.raises(PayloadError) as again:  # one progress per reservation
        strategy.complete_payload(Payload(pb.Manifest(peer_id="b", outer_step=3), {"progress/w0": progress}))
    assert again.value.reason == "not_reserved"


def test_a_reserved_partner_that_delivers_nothing_is_set_aside_and_swaps_no_phase_meanwhile() -> None:
    """A peer that reserved a phase and delivered no progress is set aside (counted ``undelivered``) and refused
    at the next phase swap, whoever calls; its Info answering again does not lift it (only a failed path's
    avoidance is lifted that way); other peers still swap, a peer this node failed to call included."""
    strategy = stream_pairing()
    policy = strategy.ctx.caller.policy
    strategy._begin_phase([torch.zeros(3, 2)], [torch.zeros(3, 2)], 3)
    strategy._undelivered("holder", 3)
    assert policy.avoided("holder") and strategy.ctx.caller.settings.metrics.outcomes[UNDELIVERED] == 1
    assert not policy.answered_again("holder")
    strategy._undelivered("holder", 3)  # already set aside (a failed call to it, say): not doubled
    assert strategy.ctx.caller.settings.metrics.outcomes[UNDELIVERED] == 1
    strategy._begin_phase([torch.zeros(3, 2)], [torch.zeros(3, 2)], 4)
    assert strategy.ready() and strategy.open_session("holder", 4, "phase") is None
    session = strategy.open_session("honest", 4, "phase")
    assert session is not None
    session.release()
    policy.failed("undialable")  # a peer this node failed to call (behind a NAT): it still swaps by calling in
    strategy._begin_phase([torch.zeros(3, 2)], [torch.zeros(3, 2)], 5)
    session = strategy.open_session("undialable", 5, "phase")
    assert session is not None
    session.release()


def test_a_node_that_trains_no_further_phase_offers_none_to_reserve() -> None:
    """After its last outer step (its run done, or stopping) a stream node opens no next phase: a peer reserving
    one would wait for a progress that never comes, then set an honest member aside as undelivered."""
    strategy = stream_pairing()
    weights = [torch.zeros(3, 2)]
    strategy._begin_phase(weights, weights, 3)
    assert strategy.ready()
    strategy.after_blend(weights, weights, weights, weights, 4)
    session = strategy.open_session("b", 4, "phase")
    assert session is not None
    session.release()
    strategy.after_blend(weights, weights, weights, weights, None)
    assert not strategy.ready() and strategy.open_session("b", 4, "phase") is None


def test_stream_refuses_progress_of_another_phase_than_the_swapped_one() -> None:
    strategy = stream_pairing()
    strategy._begin_phase([torch.zeros(3, 2)], [torch.zeros(3, 2)], 3)
    session = strategy.open_session("b", 3, "phase")
    assert session is not None
    session.complete(Payload(pb.Manifest(peer_id="b", outer_step=3), {"phi/w0": torch.zeros(3, 2)}))
    session.release()
    with pytest.raises(PayloadError) as error:
        strategy.complete_payload(Payload(pb.Manifest(peer_id="b", outer_step=4), {"progress/w0": torch.zeros(3, 2)}))
    assert (error.value.code, error.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "round_step")
    # A new phase drops the old reservation: nobody is reserved, swaps are open again.
    strategy._begin_phase([torch.zeros(3, 2)], [torch.zeros(3, 2)], 4)
    assert strategy.ready() and strategy.open_session("b", 4, "phase") is not None


def test_a_sparse_stream_sends_phi_in_the_side_code_every_phase_and_blends_as_the_algorithm_says() -> None:
    """Node a's phase payload carries its phi matrix in the side code and its vector in int8; node b reads it
    against its own phi once the progress has crossed, and blends with phi_a as read + D_a + c (Delta_b - D_b),
    bit for bit as the algorithm and the codec say (what the simulator's noloco-sparse-side replays). The gaps b
    measured become its estimate, which its next phase payload's step follows and its checkpoint keeps."""
    shapes = ((64, 96), (64,))
    a, b = stream_pairing("sparse", "a", shapes), stream_pairing("sparse", "b", shapes)
    generator = torch.Generator().manual_seed(0)
    phi_b = [torch.randn(shape, generator=generator) for shape in shapes]
    phi_a = [p + 0.01 * torch.randn(p.shape, generator=generator) for p in phi_b]
    zeros = [torch.zeros(shape) for shape in shapes]
    for strategy, phi in ((a, phi_a), (b, phi_b)):
        strategy._begin_phase(phi, zeros, 7)
        assert strategy._phase is not None
    offer = a._phase.offer  # type: ignore[union-attr]
    assert [spec.dtype for spec in offer.manifest.tensors] == [pb.WIRE_DTYPE_SIDE_MOD3, pb.WIRE_DTYPE_INT8_BLOCK256]
    assert offer.manifest.tensors[0].num_bytes == side_info.encoded_bytes(64 * 96)
    # What b receives: the side code as its checked bytes, the int8 vector decoded (wire/payload.py).
    received = {"phi/w0": offer.tensors[0].clone(), "phi/w1": quantize.dequantize(offer.tensors[1], 64, "int8")}
    session = b.open_session("a", 7, "phase")
    assert session is not None and session.complete(Payload(pb.Manifest(peer_id="a", outer_step=7), received))
    session.release()

    progress_a = [0.001 * torch.randn(shape, generator=generator) for shape in shapes]
    sent_a = [sparse.decode(sparse.encode(p), p.numel()).view(p.shape) for p in progress_a]
    whole = b.complete_payload(
        Payload(pb.Manifest(peer_id="a", outer_step=7), {f"progress/w{i}": d.clone() for i, d in enumerate(sent_a)})
    )
    assert whole.parts == ["progress", "phi"] and whole.side_coded == ["phi/w0"]
    left_out_b = [0.001 * torch.randn(shape, generator=generator) for shape in shapes]
    assert b.side is not None and not b.side.estimates
    compressed_partner(whole, ["w0", "w1"], phi_b, left_out_b, b.side)

    seen, gap = side_info.decode(
        side_info.unpack(offer.tensors[0], 64 * 96), phi_b[0], side_info.seed_of("run", "a", 7, 0)
    )
    seen_phi = [seen, received["phi/w1"]]
    want = algorithm.compressed_partner_weights(seen_phi, sent_a, left_out_b, algorithm.OWN_LEFT_OUT_WEIGHT)
    assert whole.unjudged and whole.parts == ["theta", "phi"]
    for i in range(2):
        assert torch.equal(whole.tensors[f"theta/w{i}"], want[i]) and torch.equal(
            whole.tensors[f"phi/w{i}"], seen_phi[i]
        )
    assert torch.equal(b.side.estimates[0], gap) and set(b.side.estimates) == {0}
    # Before it measured a gap a sent step 0 (its partner keeps its own phi there); b's next step follows its estimate.
    assert not side_info.unpack(offer.tensors[0], 64 * 96).step.any()
    b._begin_phase(phi_b, zeros, 8)
    step = side_info.unpack(b._phase.offer.tensors[0], 64 * 96).step  # type: ignore[union-attr]
    assert torch.equal(step, (gap * side_info.STEP_IN_GAPS).float())

    state = b.checkpoint_state()
    restarted = stream_pairing("sparse", "b", shapes)
    restarted.restore(state)
    assert restarted.side is not None and torch.equal(restarted.side.estimates[0], gap)
    with pytest.raises(ValueError, match="chunks"):
        restarted.restore({"side_gap_estimates": {0: torch.ones(5)}})
    with pytest.raises(ValueError, match="no side-coded tensor"):
        restarted.restore({"side_gap_estimates": {1: torch.ones(1)}})
    assert torch.equal(restarted.side.estimates[0], gap)  # a refused state changed nothing
    assert stream_pairing().checkpoint_state() == {}  # a dense run keeps nothing
