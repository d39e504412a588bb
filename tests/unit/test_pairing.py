"""Pairing state without sockets: one exchange at a time, fast refusals, first partner wins, bounded close."""

from __future__ import annotations

import threading
import time

import torch

from noloco_node.pairing.rounds import OfferBook, PairingRound
from noloco_node.rpc import peer_pb2 as pb
from noloco_node.rpc.client import Outgoing
from noloco_node.wire.payload import Payload


def payload(peer: str, step: int) -> Payload:
    return Payload(pb.Manifest(peer_id=peer, outer_step=step), {"theta/x": torch.zeros(1)})


def round_at(step: int = 5) -> PairingRound:
    return PairingRound(step, Outgoing(pb.Manifest(), []))


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
    assert current.partner.peer_id == "a" and current.done.is_set()
    assert current.try_session("x", 5, max_staleness=2) is None  # already paired


def test_the_first_complete_exchange_is_the_partner() -> None:
    current = round_at()
    current.set_partner(payload("a", 5))
    current.set_partner(payload("b", 5))
    assert current.partner.peer_id == "a"


def test_closing_waits_for_the_exchange_in_flight_then_refuses_new_ones() -> None:
    current = round_at()
    session = current.try_session("x", 5, max_staleness=0)
    assert session is not None

    def finish_later() -> None:
        time.sleep(0.3)
        session.complete(payload("late", 5))
        session.release()

    threading.Thread(target=finish_later).start()
    partner = current.close(wait_for_exchange=10)
    assert partner is not None and partner.peer_id == "late"  # applied whole, not dropped half-way
    assert current.try_session("x", 5, max_staleness=0) is None


def test_closing_gives_up_on_an_exchange_that_outlives_its_bound() -> None:
    current = round_at()
    session = current.try_session("x", 5, max_staleness=0)
    assert session is not None
    assert current.close(wait_for_exchange=0.1) is None
    session.release()


def test_offer_book_keeps_the_freshest_offer_within_the_staleness_bound() -> None:
    book = OfferBook()
    assert book.try_session() is None  # nothing to offer yet
    book.offer = Outgoing(pb.Manifest(), [])
    session = book.try_session()
    assert session is not None and book.try_session() is None
    session.complete(payload("a", 3))
    session.release()
    book.store(payload("a", 2))  # older than what is held from that peer: ignored
    book.store(payload("b", 6))
    book.store(payload("c", 1))
    assert book.take_freshest(own_outer_step=7, max_staleness=2).peer_id == "b"
    assert book.take_freshest(own_outer_step=7, max_staleness=2) is None  # each offer is used once
    book.store(payload("d", 1))
    assert book.take_freshest(own_outer_step=7, max_staleness=2) is None  # too stale


def test_the_last_partner_waits_its_turn_while_others_may_come() -> None:
    current = PairingRound(5, Outgoing(pb.Manifest(), []), last_partner="old", repeat_after=time.monotonic() + 0.3)
    assert current.try_session("old", 5, max_staleness=0) is None
    other = current.try_session("new", 5, max_staleness=0)
    assert other is not None
    other.release()
    time.sleep(0.35)
    assert current.try_session("old", 5, max_staleness=0) is not None
