"""``overlap`` pairing: no waiting at the outer step; offers are swapped in the background during the inner phase.

Right after its outer step a node publishes an *offer*: its projected fast weights phi_new + (theta - phi_old)
(``algorithm.projected_fast_weights``) with its new phi when the run needs it. During the next inner phase a
background task swaps offers with one random peer, and peers that call in swap theirs too. At the next outer step
the node blends with the offer nearest its own outer step within ``max_staleness`` either way, one phase old at
best: the price of never waiting (docs/architecture.md, "Pairing modes").

An offer is a published copy (wire/published.py): a partner may still be streaming the previous one while the
trainer applies its outer step, and it streams exactly what was offered. The :class:`OfferBook` keeps at most
``max_offers`` received offers (one per proven peer id, the stalest dropped first), so callers cannot make it grow.

A node serves one peer's swap at a time and makes one swap of its own at a time, and neither waits on the other:
two nodes that call each other at once both swap (each keeps the fresher offer of the other), where a node calling
out refused every call in, so two members in step refused each other's crossing calls and both blended solo.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Callable, Sequence

import torch

from noloco_node import algorithm
from noloco_node.pairing.strategy import PairingContext, PairingStrategy
from noloco_node.training.replica import Replica
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import Published

log = logging.getLogger(__name__)

MAX_OFFERS = 4  # offers received and kept per phase; each is a model-sized payload


class OfferBook:
    """This node's current offer, served to one caller at a time, and a bounded set of offers received from peers."""

    def __init__(self, max_offers: int = MAX_OFFERS) -> None:
        self.max_offers = max_offers
        self.serving = threading.Lock()
        self._guard = threading.Lock()
        self._offer: Published | None = None
        self._received: dict[str, Payload] = {}

    @property
    def offer(self) -> Published | None:
        return self._offer

    def set_offer(self, offer: Published) -> None:
        """Publish the next offer; the previous one is released (streams still reading it keep their hold)."""
        with self._guard:
            previous, self._offer = self._offer, offer
        if previous is not None:
            previous.release()

    def held_offers(self) -> int:
        with self._guard:
            return len(self._received)

    def try_session(self, partner_id: str) -> OfferSession | None:
        """A caller's swap, or None: no offer yet, or another caller is being served."""
        if not self.serving.acquire(blocking=False):
            return None
        with self._guard:
            offer = self._offer
            if offer is None or not offer.hold():
                self.serving.release()
                return None
        return OfferSession(self, offer, partner_id)

    def store(self, partner_id: str, payload: Payload) -> bool:
        """Keep the freshest offer of each (proven) peer, and at most ``max_offers`` in all: the stalest go first.
        Returns whether ``payload`` was kept."""
        dropped: list[Payload] = []
        with self._guard:
            known = self._received.get(partner_id)
            if known is not None and known.outer_step > payload.outer_step:
                dropped.append(payload)
            else:
                if known is not None:
                    dropped.append(known)
                self._received[partner_id] = payload
                while len(self._received) > self.max_offers:
                    stalest = min(self._received, key=lambda peer: self._received[peer].outer_step)
                    dropped.append(self._received.pop(stalest))
        for old in dropped:
            old.release()
        return payload not in dropped

    def take_nearest(self, own_outer_step: int, max_staleness: int) -> Payload | None:
        """The offer nearest this node's outer step within the staleness bound, on either side (the fresher of two
        as near); every other held offer is dropped (each is used once). A peer far ahead is as far from this
        replica as one far behind: the bound is the same both ways, as in sync mode."""
        with self._guard:
            received, self._received = self._received, {}
        within = [p for p in received.values() if abs(own_outer_step - p.outer_step) <= max_staleness]
        chosen = min(within, key=lambda p: (abs(own_outer_step - p.outer_step), -p.outer_step)) if within else None
        for payload in received.values():
            if payload is not chosen:
                payload.release()
        return chosen

    def close(self) -> None:
        """Release every offer held, received or own."""
        with self._guard:
            received, self._received = self._received, {}
            offer, self._offer = self._offer, None
        for payload in received.values():
            payload.release()
        if offer is not None:
            offer.release()


class OfferSession:
    """The ExchangeSession of overlap mode: swap offers, keep the partner's for the next blend."""

    def __init__(self, book: OfferBook, offer: Published, partner_id: str) -> None:
        self.book = book
        self.offer = offer
        self.partner_id = partner_id

    def outgoing(self) -> Published:
        return self.offer

    def complete(self, payload: Payload) -> bool:
        return self.book.store(self.partner_id, payload)

    def release(self) -> None:
        self.offer.release()
        self.book.serving.release()


class OverlapPairing(PairingStrategy):
    mode = "overlap"

    def __init__(self, ctx: PairingContext, *, max_offers: int = MAX_OFFERS) -> None:
        super().__init__(ctx)
        self.book = OfferBook(max_offers)
        self._outer_step = 0  # the outer step the current offer belongs to (read by the background task)

    def ready(self) -> bool:
        return self.book.offer is not None

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str) -> OfferSession | None:
        if kind != "weights" or partner_id == self.ctx.peer_id():
            return None
        return self.book.try_session(partner_id)

    def start(self, replica: Replica) -> None:
        self._outer_step = replica.outer_step
        self.book.set_offer(self.ctx.offers["weights"].publish(replica.weights(), replica.outer_step))

    def partner(
        self, replica: Replica, phase_seconds: float, train_step: Callable[[], bool] | None = None
    ) -> Payload | None:
        return self.book.take_nearest(replica.outer_step, self.ctx.max_staleness)

    def after_blend(
        self,
        new_phi: Sequence[torch.Tensor],
        new_delta: Sequence[torch.Tensor],
        theta: Sequence[torch.Tensor],
        old_phi: Sequence[torch.Tensor],
        next_outer_step: int | None,
    ) -> None:
        if next_outer_step is None:  # no further phase: no partner is offered weights it will not blend back with
            self.book.close()
            return
        # The offer for the next phase: projected fast weights phi_new + (theta - phi_old). The copy is made here,
        # before the replica overwrites theta and phi in place.
        projected = algorithm.projected_fast_weights(new_phi, theta, old_phi)
        self.book.set_offer(
            self.ctx.offers["weights"].publish(
                {"theta": projected, "phi": new_phi, "delta": new_delta}, next_outer_step
            )
        )
        self._outer_step = next_outer_step

    def close(self) -> None:
        self.book.close()

    async def run(self) -> None:
        """Once per inner phase, swap offers with a random peer."""
        ctx = self.ctx
        exchanged_for = -1
        while True:
            await asyncio.sleep(random.uniform(0.2, 0.6))
            step, offer = self._outer_step, self.book.offer
            if offer is None or step == exchanged_for:
                continue
            try:
                candidates = ctx.caller.choosable(await ctx.discovery.live_peers(), step)
            except (TimeoutError, OSError):
                continue
            for peer in ctx.caller.order(candidates):
                payload = await ctx.caller.call(peer, offer)
                if payload is not None:
                    self.book.store(peer.peer_id, payload)
                    exchanged_for = step
                    break
