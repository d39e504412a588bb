"""``stream`` pairing: the partner is chosen during the inner phase, its slow weights stream while both train, and
only the phase's progress is exchanged at the outer step.

The NoLoCo blend of node i with partner j (arXiv 2506.10911, eq. 3-5) needs j's fast weights theta_j, and its slow
weights phi_j when gamma != beta or momenta are blended. phi_j is fixed for the whole inner phase, and
theta_j = phi_j + Delta_j, where only Delta_j, the phase's progress, waits for the phase's end. So:

1. at the start of a phase a node publishes its *phase payload* (phi, and delta with --blend-momenta, in bf16), and
   a background task swaps phase payloads with one ready peer (peers calling in do the same). The first complete
   swap *reserves* the pair for this phase on both sides; a node swaps with one peer at a time (its swap lock is
   only ever tried, so two nodes calling each other get a quick refusal and retry). While other peers are known,
   a phase does not swap with the last partner for its first min(--pair-timeout, phase)/2 seconds, calling or
   called (sync mode's rule for its rounds): partners rotate instead of locking into fixed pairs.
2. At the outer step the node publishes its *progress* Delta = theta - phi in the run's wire dtype and exchanges it
   with the reserved partner alone, in a pairing round like sync's (either side may call; the first exchange both
   sides commit settles the round on both). The partner's theta is rebuilt as phi_j + Delta_j (:meth:`StreamPairing.
   complete_payload`) and checked under the norm bound like any partner's weights.
3. No reservation by the outer step, the partner gone or already past this step, no progress within
   --pair-timeout, or the reservation spent by a progress exchange that did not settle (refused, or cut before
   both sides committed: a phase payload completes one progress): a solo step. A reserved partner that delivered
   no progress while its record said it was still at the phase (by --pair-timeout), or that had no record in the
   DHT at all (by PARTNER_MISSING_SECONDS), held this node's phase for nothing: it is set aside
   (``undelivered``, the doubling avoidance of a refused payload), and no phase is swapped with it meanwhile.
   The wait itself stays --pair-timeout: an honest partner that reserved early in its phase and late in this
   node's delivers up to a phase later, while this node trains on.

The blend is exact NoLoCo up to the rounding of phi (bf16) and Delta (the wire dtype): the simulator's
``noloco-stream`` methods measure that cost (docs/algorithm-study.md). On the critical path there is only Delta,
which quantizes well (its blocks scale to the progress, not to the weights): int8 is a quarter of the fp32 weights.

With ``--wire-dtype sparse`` (the simulator's ``noloco-sparse-side``): phi crosses at every phase in the
side-information code (pairing/side_phi.py: about 0.22 bytes a value, read against the receiver's own phi), the
progress top-k coded (wire/sparse.py: 0.028 bytes a value, nothing of what it leaves out kept for later), and each
side blends with the partner as :func:`compressed_partner` makes it after the exchange: theta_j = phi_j as read +
D_j + c (Delta_i - D_i) (algorithm.compressed_partner_weights, c = algorithm.OWN_LEFT_OUT_WEIGHT). Read only once the
exchange has settled, the partner's phi is judged then, with the rest of its payload, under the norm bound
(node/outer_step.py); on arrival only its progress is.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from noloco_node import algorithm
from noloco_node.discovery.dht import PeerRecord
from noloco_node.pairing.peer_policy import LOSS_CHECK, UNDELIVERED
from noloco_node.pairing.side_phi import SidePhi
from noloco_node.pairing.strategy import PairingContext, PairingStrategy
from noloco_node.pairing.sync import PairingRound, RepeatGrace, RoundSession, run_round
from noloco_node.training.replica import Replica
from noloco_node.wire import sparse
from noloco_node.wire.frames import PayloadError
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import Published

log = logging.getLogger(__name__)

# How long the partner's record may be missing from every DHT lookup before the node stops waiting for it: about
# three lookups (discovery/dht.py shares one lookup among the callers of a second).
PARTNER_MISSING_SECONDS = 3.0


@dataclass
class Phase:
    """One inner phase of this node, from its phase payload's point of view."""

    outer_step: int  # the outer step that ends this phase
    offer: Published  # this node's phase payload, held until the next phase's replaces it
    partner: Payload | None = None  # the reserved partner's phase payload, until its progress arrives
    open: bool = True  # False once this node has stopped waiting for a reservation: no new one
    reserved: threading.Event = field(default_factory=threading.Event)
    repeat: RepeatGrace = field(default_factory=RepeatGrace)  # the last partner waits its turn (sync.py)


class StreamPairing(PairingStrategy):
    mode = "stream"

    def __init__(self, ctx: PairingContext) -> None:
        super().__init__(ctx)
        self._guard = threading.Lock()  # the phase and its reservation
        self._swap_lock = threading.Lock()  # the one phase swap in flight
        self._phase: Phase | None = None
        self._round: PairingRound | None = None
        # The run's live peers as last looked up, so that the progress exchange starts without a DHT lookup.
        self._records: dict[str, PeerRecord] = {}
        # The last round's partner and the grace the next phase gives it (sync.py RepeatGrace).
        self._last_round: tuple[str | None, float] = (None, 0.0)
        self._partner_left = False  # this round's reserved partner went on past this phase, or left the swarm
        progress = ctx.offers["progress"].kind
        # A sparse run's phi in the side-information code, and what it knows of the replicas' gaps.
        self.side = (
            SidePhi([item.shape for item in progress.layout], ctx.caller.settings.run_fingerprint)
            if progress.wire_dtype == "sparse"
            else None
        )

    # ---------------------------------------------------------------------------------- gRPC threads

    def ready(self) -> bool:
        """Peers may start a phase swap: the phase is open and nobody is reserved yet."""
        phase = self._phase
        return phase is not None and phase.open and phase.partner is None

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str) -> PhaseSession | RoundSession | None:
        if partner_id == self.ctx.peer_id():
            return None
        if kind == "progress":
            current = self._round
            return (
                None if current is None else current.try_session(partner_id, partner_outer_step, self.ctx.max_staleness)
            )
        if kind != "phase":
            return None
        with self._guard:
            phase = self._phase
            if phase is None or not phase.open or phase.partner is not None:
                return None
            if abs(partner_outer_step - phase.outer_step) > self.ctx.max_staleness:
                return None
            if not phase.repeat.allows(partner_id):
                return None
            # One that reserved and never delivered, or whose blend measured worse than none, gets no phase while
            # set aside. Not one this node merely failed to call: a peer it cannot dial (a NAT, a firewall) still
            # reaches it by calling in.
            if self.ctx.caller.policy.avoided_for(partner_id) in (UNDELIVERED, LOSS_CHECK):
                return None
            if not self._swap_lock.acquire(blocking=False):
                return None
            if not phase.offer.hold():
                self._swap_lock.release()
                return None
        return PhaseSession(self, phase, partner_id)

    def complete_payload(self, payload: Payload) -> Payload:
        """A progress payload becomes the partner's whole payload: theta = phi + Delta (fp32), with the phi (and
        delta) of its phase payload; in a sparse run the progress with that phi still in its code (the trainer
        reads it once the exchange has settled: :func:`compressed_partner`). Anything else is whole already."""
        if payload.parts != ["progress"]:
            return payload
        with self._guard:
            phase, partner = self._phase, None
            if phase is not None and phase.partner is not None and phase.partner.peer_id == payload.peer_id:
                partner, phase.partner = phase.partner, None  # consumed: one progress per reservation
        if partner is None:
            payload.release()
            raise PayloadError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "no_phase_payload",
                "a progress payload from a peer this node has not swapped phase payloads with in this phase",
            )
        if partner.outer_step != payload.outer_step:
            payload.release()
            partner.release()
            raise PayloadError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "progress_step",
                f"progress of outer step {payload.outer_step} for a phase payload of outer step {partner.outer_step}",
            )
        return self._rebuild(partner, payload)

    def _rebuild(self, phase_payload: Payload, progress: Payload) -> Payload:
        pool = self.ctx.caller.settings.receive_buffers
        manifest = progress.manifest
        phase_tensors, phase_buffers = phase_payload.hand_over()
        progress_tensors, progress_buffers = progress.hand_over()
        if self.side is not None:  # phi stays in its code until the trainer reads it
            tensors = {**progress_tensors, **phase_tensors}
            return Payload(manifest, tensors, buffers=[*phase_buffers, *progress_buffers], pool=pool)
        parameters = [name.split("/", 1)[1] for name in progress_tensors]
        deltas = list(progress_tensors.values())
        buffers = [pool.take(torch.float32, delta.numel()).view(delta.shape) for delta in deltas]
        thetas = algorithm.fast_weights_from([phase_tensors[f"phi/{n}"] for n in parameters], deltas, out=buffers)
        tensors = {f"theta/{n}": theta for n, theta in zip(parameters, thetas, strict=True)}
        tensors.update(phase_tensors)
        rebuilt = [theta.view(-1) for theta in thetas]
        return Payload(manifest, tensors, buffers=[*phase_buffers, *progress_buffers, *rebuilt], pool=pool)

    def _spent(self, phase: Phase) -> bool:
        """Whether the phase's reserved partner payload was used by a progress exchange (whatever its outcome)."""
        with self._guard:
            return phase.partner is None

    def _reserve(self, phase: Phase, payload: Payload) -> bool:
        """The first complete phase swap of this phase reserves its partner; any other is let go."""
        with self._guard:
            reserved = self._phase is phase and phase.open and phase.partner is None
            if reserved:
                phase.partner = payload
                phase.reserved.set()
        if not reserved:
            payload.release()
            return False
        if self.ctx.loop is not None:  # no longer ready for other peers' swaps: say so
            self.ctx.spawn(self.ctx.publish_record(), "publishing the DHT record")
        return True

    # ---------------------------------------------------------------------------------- trainer thread

    def start(self, replica: Replica) -> None:
        self._begin_phase(replica.phi, replica.delta, replica.outer_step)
        if self.ctx.loop is not None:  # ready for phase swaps from now on: say so before the first phase ends
            self.ctx.spawn(self.ctx.publish_record(), "publishing the DHT record")

    def _begin_phase(self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], outer_step: int) -> None:
        sent = phi if self.side is None else self.side.encode(phi, self.ctx.peer_id(), outer_step)
        offer = self.ctx.offers["phase"].publish({"phi": sent, "delta": delta}, outer_step)
        phase = Phase(outer_step, offer, repeat=RepeatGrace.starting_now(*self._last_round))
        with self._guard:
            previous, self._phase = self._phase, phase
        if previous is not None:
            self._end_phase(previous)

    def _end_phase(self, phase: Phase) -> None:
        with self._guard:
            phase.open = False
            leftover, phase.partner = phase.partner, None
        phase.offer.release()
        if leftover is not None:
            leftover.release()

    def partner(
        self, replica: Replica, phase_seconds: float, train_step: Callable[[], bool] | None = None
    ) -> Payload | None:
        ctx = self.ctx
        assert ctx.loop is not None
        phase = self._phase
        if phase is None:
            return None
        if not ctx.stopping.is_set():
            self._await_reservation(phase, train_step)
        with self._guard:
            phase.open = False  # no reservation from here on
            reserved = phase.partner
        if reserved is None:
            self._last_round = (None, 0.0)
            return None  # nobody swapped phase payloads with this node: a solo step
        progress = algorithm.phase_progress(replica.fast_weights(), replica.phi)
        left_out = None
        if self.side is not None:  # sent top-k coded: what the code leaves out, Delta_i - D_i, stays here
            encoded = [sparse.encode(whole) for whole in progress]
            left_out = [
                whole.sub_(sparse.decode(code, whole.numel()).view_as(whole).to(whole.device))
                for whole, code in zip(progress, encoded, strict=True)
            ]
            progress = encoded
        offer = ctx.offers["progress"].publish({"progress": progress}, replica.outer_step)
        del progress
        current = PairingRound(replica.outer_step, offer, only_partner=reserved.peer_id)
        self._partner_left = False
        self._round = current
        seeker = self._exchange_progress(current, phase, reserved.peer_id, reserved.outer_step)
        ctx.discovery.follow([reserved.peer_id])  # its record, fresh at every lookup: gone, or gone on without us
        try:
            partner = run_round(ctx, current, seeker, train_step)
        finally:
            ctx.discovery.follow([])
        with self._guard:
            self._round = None
            leftover, phase.partner = phase.partner, None  # not consumed: the progress never came
        if leftover is not None:
            leftover.release()
            if not self._partner_left and not ctx.stopping.is_set():
                self._undelivered(reserved.peer_id, replica.outer_step)
        # The next phase's grace for this partner (sync.py RepeatGrace): a pair that blended a moment later than this
        # one is still inside its reserved phase, so without it each finds only its last partner open.
        last_partner = partner.peer_id if partner is not None else None
        others = bool(set(self._records) - {last_partner})
        self._last_round = (last_partner, RepeatGrace.seconds(last_partner, others, ctx.pair_timeout, phase_seconds))
        if partner is not None and self.side is not None and left_out is not None:
            compressed_partner(partner, replica.names, replica.phi, left_out, self.side)
        return partner

    def _undelivered(self, partner_id: str, outer_step: int) -> None:
        """The reserved partner's progress never reached this round (no exchange used the reservation) while its
        record said it was still at this phase, or while it had no record at all: it held this node's phase and
        gave nothing. Set aside like a peer
        whose payload was refused: not called, and no phase swap with it (:meth:`open_session`), for avoid_seconds,
        doubling. Not a failed call's avoidance, which a peer's Info answering again lifts (and which does not stop
        a peer this node cannot dial from swapping by calling in). An honest partner gets
        here only by delivering nothing within --pair-timeout of this node's outer step: a partner more than a phase
        behind."""
        policy = self.ctx.caller.policy
        if policy.avoided(partner_id):  # a failed call to it set it aside already
            return
        avoid = policy.failed(partner_id, UNDELIVERED)
        self.ctx.caller.settings.metrics.outcome(UNDELIVERED)
        log.warning(
            "outer step %d: %s reserved this phase and delivered no progress; set aside for %.0fs",
            outer_step,
            partner_id[-8:],
            avoid,
        )

    def _await_reservation(self, phase: Phase, train_step: Callable[[], bool] | None) -> None:
        """Not reserved at the phase's end (the first phase, an odd swarm, every peer taken, or a slow link still
        carrying phi): a peer in the same position may still swap now, at the price of phi on the critical path.
        --alone-grace at most, or --pair-timeout while a swap is in flight; training meanwhile when allowed."""
        ctx = self.ctx
        started = time.monotonic()
        while not phase.reserved.is_set():
            waited = time.monotonic() - started
            if waited >= (ctx.pair_timeout if self._swap_lock.locked() else ctx.alone_grace):
                return
            if train_step is None or not train_step():
                phase.reserved.wait(0.05)

    def after_blend(
        self,
        new_phi: Sequence[torch.Tensor],
        new_delta: Sequence[torch.Tensor],
        theta: Sequence[torch.Tensor],
        old_phi: Sequence[torch.Tensor],
        next_outer_step: int | None,
    ) -> None:
        if next_outer_step is None:  # no further phase: nobody may reserve one, then wait for its progress in vain
            self.close()
            if self.ctx.loop is not None:  # not ready for phase swaps any more: say so
                self.ctx.spawn(self.ctx.publish_record(), "publishing the DHT record")
            return
        self._begin_phase(new_phi, new_delta, next_outer_step)

    def checkpoint_state(self) -> dict[str, Any]:
        return {} if self.side is None else {"side_gap_estimates": self.side.state()}

    def restore(self, state: dict[str, Any]) -> None:
        estimates = state.get("side_gap_estimates")
        if self.side is not None and estimates is not None:
            self.side.restore(estimates)

    def interrupt(self) -> None:
        phase, current = self._phase, self._round
        if phase is not None:
            phase.reserved.set()  # a trainer waiting for a reservation goes on (it finds none, or uses it)
        if current is not None:
            current.stop_waiting()

    def close(self) -> None:
        with self._guard:
            phase, self._phase = self._phase, None
        if phase is not None:
            self._end_phase(phase)

    # ---------------------------------------------------------------------------------- event loop

    async def run(self) -> None:
        """During each phase, until the phase is reserved: swap phase payloads with a ready peer."""
        ctx = self.ctx
        while True:
            await asyncio.sleep(random.uniform(0.1, 0.3))
            phase = self._phase
            if phase is None or not phase.open or phase.partner is not None:
                continue
            try:
                live = await ctx.discovery.live_peers()
            except (TimeoutError, OSError) as error:
                log.warning("DHT lookup failed: %s", error)
                continue
            self._records = {p.peer_id: p for p in live}
            for peer in ctx.caller.order(ctx.caller.choosable(live, phase.outer_step)):
                if not phase.repeat.allows(peer.peer_id):
                    continue
                if not (phase.open and phase.partner is None) or not self._swap_lock.acquire(blocking=False):
                    break  # reserved meanwhile (a peer called in), or a peer is swapping with us right now
                try:
                    payload = await ctx.caller.call(peer, phase.offer, kind="phase")
                finally:
                    self._swap_lock.release()
                if payload is not None and self._reserve(phase, payload):
                    break

    async def _exchange_progress(self, current: PairingRound, phase: Phase, partner_id: str, partner_step: int) -> None:
        """Call the reserved partner with this node's progress until the round is settled; stop early when the
        partner is gone or already past this phase (it went on alone: nobody will answer), or when the reservation
        is spent: its phase payload completes one progress (:meth:`complete_payload`), so an exchange that used it
        and did not settle (refused, or cut before both sides committed) leaves nothing to pair with on this side,
        and the partner's retries would only be refused until --pair-timeout. The first call goes to the address
        known from the phase swap, without waiting for a DHT lookup; after a failed call the partner is only
        waited for (it calls in)."""
        ctx = self.ctx
        record, missing_since = self._records.get(partner_id), None
        listed = record is not None  # a partner never listed in the DHT this round cannot have left it
        while current.open:
            if self._spent(phase):
                current.stop_waiting()  # an exchange still in flight may settle the round
                return
            # Not dialled again once a call to it failed (it is avoided): a partner that is gone would be dialled
            # every few hundred milliseconds until --pair-timeout, each failure doubling its avoidance, so that a
            # member's restart would set it aside for many minutes; one that lives calls in from its own round.
            dial = record if record is not None and not ctx.caller.policy.avoided(partner_id) else None
            if dial is not None and dial.address and current.lock.acquire(blocking=False):
                try:
                    if not current.open:
                        return
                    payload = await ctx.caller.call(
                        dial,
                        current.offer,
                        kind="progress",
                        complete=self.complete_payload,
                    )
                finally:
                    current.lock.release()
                if payload is not None:
                    current.settle(payload)
                    return
            await asyncio.sleep(random.uniform(0.05, 0.2))  # the partner's round is not open yet, or it calls us
            try:
                live = await ctx.discovery.live_peers()
            except (TimeoutError, OSError):
                continue
            record = next((p for p in live if p.peer_id == partner_id), None)
            listed = listed or record is not None
            now = time.monotonic()
            missing_since = None if record is not None else (missing_since or now)
            gone = missing_since is not None and now - missing_since >= PARTNER_MISSING_SECONDS
            past = record is not None and record.outer_step > partner_step
            if gone or past:
                self._partner_left = past or listed  # it went on alone, or left: nothing was held back on purpose
                current.stop_waiting()
                return


class PhaseSession:
    """The ExchangeSession of a phase swap: holds the swap lock and this phase's payload until released."""

    def __init__(self, strategy: StreamPairing, phase: Phase, partner_id: str) -> None:
        self.strategy = strategy
        self.phase = phase
        self.partner_id = partner_id

    def outgoing(self) -> Published:
        return self.phase.offer

    def complete(self, payload: Payload) -> bool:
        return self.strategy._reserve(self.phase, payload)

    def release(self) -> None:
        self.phase.offer.release()
        self.strategy._swap_lock.release()


def compressed_partner(
    payload: Payload,
    names: Sequence[str],
    phi: Sequence[torch.Tensor],
    left_out: Sequence[torch.Tensor],
    side: SidePhi,
) -> None:
    """Trainer thread, a sparse run, after the exchange: the partner's payload (progress D_j, phi_j in its code)
    made what this node blends with: phi_j read against this node's ``phi`` (side_phi.py), and
    theta_j = phi_j + D_j + c (Delta_i - D_i), algorithm.compressed_partner_weights computed in the received
    progress's buffers. The payload is left unjudged: its phi was read only now, so the trainer judges all of it
    (node/outer_step.py)."""
    tensors = payload.tensors
    seen = side.read([tensors[f"phi/{name}"] for name in names], phi, payload.peer_id, payload.outer_step)
    sent = [tensors[f"progress/{name}"] for name in names]
    thetas = algorithm.compressed_partner_weights(seen, sent, left_out, algorithm.OWN_LEFT_OUT_WEIGHT, out=sent)
    whole = {f"theta/{name}": theta for name, theta in zip(names, thetas, strict=True)}
    whole.update({f"phi/{name}": read for name, read in zip(names, seen, strict=True)})
    whole.update({name: tensor for name, tensor in tensors.items() if name.startswith("delta/")})
    payload.tensors = whole
    payload.observer = None  # what it measured on arrival was the progress, not these
    payload.unjudged = True
