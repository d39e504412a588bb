"""The life of one outer step of a node, on its trainer thread (docs/architecture.md, "The life of an outer step").

At the end of every inner phase (training/loop.py):

1. the pairing strategy gives the partner's payload, or None (it waited for it in sync mode, or took the freshest
   offer in overlap mode);
2. the blend: ``algorithm.noloco_outer_step`` (arXiv 2506.10911, eq. 3-5, the paper's sign corrected) over this
   node and the partner, taken only if it measures no worse than the step alone (node/blend_check.py: then, and
   only then, the pair counts as blended, in every mode); the strategy sees the result before the replica adopts
   it (theta = phi);
0. before pairing, this phase's own movement ||theta - phi|| / ||phi|| is measured: it sets the norm bound a
   partner's payload is checked against (security/payload_guard.py);
3. the upkeep, off the critical path: one copy of the outer state into reused buffers becomes the joiner snapshot
   and, when due, the checkpoint that the writer thread saves meanwhile (training/checkpoints.py);
4. evaluation, the history entry, status.json and the DHT record.

This is the only code that writes the replica between inner steps; every other thread reads published copies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from noloco_node import algorithm
from noloco_node.config.models import OuterConfig, TrainConfig
from noloco_node.node.blend_check import GAIN_PHASES, BlendVerdict
from noloco_node.node.probation import Probation
from noloco_node.node.report import ProgressLog
from noloco_node.observability.telemetry import KEEP_OUTER_STEPS, Telemetry
from noloco_node.pairing.standing import STRANGER_WEIGHT, SwarmStep
from noloco_node.pairing.strategy import PairingStrategy
from noloco_node.security.payload_guard import MAX_DRIFT_STEPS, NormGuard, relative_distances
from noloco_node.training.checkpoints import CheckpointWriter, Snapshots, replica_state_of
from noloco_node.training.data_parallel import DataParallel
from noloco_node.training.loop import InnerLoop, InnerPhase, StepHook
from noloco_node.training.replica import Batch, Replica, StepLoss, learning_rate
from noloco_node.wire.frames import build_manifest
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import LatestSnapshot, Published

log = logging.getLogger(__name__)


PartnerTensors = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def partner_tensors(
    payload: Payload, names: Sequence[str], *, send_phi: bool, send_delta: bool, send_theta: bool = True
) -> PartnerTensors:
    """The partner's theta, phi and outer momentum delta in parameter order (each empty when the payload does not
    carry it: phi and delta when the run does not send them, theta in a stream run's phase payload)."""
    theta = [payload.tensors[f"theta/{n}"] for n in names] if send_theta else []
    phi = [payload.tensors[f"phi/{n}"] for n in names] if send_phi else []
    delta = [payload.tensors[f"delta/{n}"] for n in names] if send_delta else []
    return theta, phi, delta


@dataclass
class OuterStepDeps:
    """What an outer step works with; the node (node/daemon.py) builds it."""

    replica: Replica
    strategy: PairingStrategy
    outer_cfg: OuterConfig
    send_phi: bool
    send_delta: bool  # --blend-momenta
    run_fingerprint: str
    peer_id: Callable[[], str]
    telemetry: Telemetry
    progress: ProgressLog
    validation: Sequence[Batch]
    snapshots: Snapshots
    snapshot: LatestSnapshot  # the joiner snapshot that GetState serves
    checkpoints: CheckpointWriter
    checkpoint_extra: Callable[[], dict[str, Any]]  # run identity, model config and standing, for every checkpoint
    checkpoint_every: int
    write_status: Callable[[], None]
    loop: asyncio.AbstractEventLoop
    publish_record: Callable[[], Any]  # a coroutine function, run on the event loop
    norm_guard: NormGuard  # bounds partners by this node's own movement, measured here before each pairing
    max_staleness: int  # how many outer steps a partner may be ahead or behind (for the norm bound's learning rate)
    judge: Callable[[Payload], bool]  # the norm bound, for a payload that arrived before this node had one
    paired: Callable[[str, int], None]  # a blend with this peer at this outer step (pairing/caller.py: standing)
    refuse_blend: Callable[[str, str], None]  # a partner whose blend failed the loss check, and why: set aside
    # Network groups refused under the norm bound after a mark (node/payload_admission.py): the probation's test.
    far_groups_since: Callable[[int], int]
    train_while_waiting: bool = True  # --train-while-waiting: inner steps instead of idle time at the outer step
    # Adopt a live peer's state when this node fell out of every peer's reach (True: adopted); None: never.
    # front: the outer step to take a donor near (None: the credible front of every peer this node believes).
    catch_up: Callable[[int | None], bool] | None = None
    believe: Callable[[str], bool] = lambda _peer_id: True  # whose outer step counts (pairing/standing.py)
    # The outer step the swarm's clock is at, given this node's, when most peers with standing are beyond reach
    # ahead (pairing/standing.py); None: keep this node's. Not given: never moved.
    swarm_step: Callable[[int], SwarmStep | None] | None = None
    probation: Probation | None = None  # a downloaded state's first phases, judged here (node/probation.py)
    data_parallel: DataParallel | None = None


# Solo steps in a row with every live peer ahead at or beyond the edge of reach (--max-staleness) before the node
# downloads a peer's state: a node as fast as they are would stay out of their reach (and drift beyond the norm bound)
# for good. Over these steps it also measures its pace against the front's, to tell a node that started late from a
# straggler.
BEHIND_STEPS = 3
# Outer steps between catch-ups: 2 after the first, doubling up to this until the node blends again. A node that
# started late catches up once and pairs; a straggler (slower than the swarm) would otherwise fall behind and
# download again every few of its phases, costing its donors a state upload each time.
MAX_CATCH_UP_BACKOFF = 64


class StepsWhileWaiting:
    """Inner steps the trainer takes while it waits for its partner (--train-while-waiting), instead of idling.

    They are borrowed from the next phase: that phase still ends at the next multiple of H, so the run's inner and
    outer steps are unchanged, and at least half of its steps are left to it (never an empty or a token phase). The
    blend then uses this node's fresher weights with the partner's as sent, the eager-style use of one's own fresh
    progress (arXiv 2502.12996); the partner blended with what this node sent at its phase's end."""

    def __init__(
        self, replica: Replica, train_cfg: TrainConfig, hooks: Sequence[StepHook], stop_requested: Callable[[], bool]
    ) -> None:
        self.replica = replica
        self.hooks = hooks
        self.stop_requested = stop_requested
        # At most half of the next phase: each phase keeps at least H/2 steps of its own, so that the weights a
        # partner receives at a phase's end always carry a substantial phase of training.
        h = train_cfg.inner_steps
        next_boundary = (replica.inner_step // h + 1) * h
        self.last_step = min(next_boundary - (h + 1) // 2, train_cfg.total_steps - 1)
        self.losses: list[StepLoss] = []
        self.seconds = 0.0

    def __call__(self) -> bool:
        """One inner step; False (and no step) when the borrowing must stop."""
        replica = self.replica
        if replica.inner_step >= self.last_step or self.stop_requested():
            return False
        started = time.monotonic()
        loss = replica.train_step()
        if loss is None:
            return False
        seconds = time.monotonic() - started
        for hook in self.hooks:  # as in the inner loop: they see the step's own time
            hook(replica, loss, seconds)
        self.losses.append(loss)
        self.seconds += time.monotonic() - started  # wall time with the hooks (an emulated step time sleeps there)
        return True


class OuterStep:
    def __init__(self, deps: OuterStepDeps) -> None:
        self.deps = deps
        self._train_cfg: TrainConfig | None = None
        self._hooks: list[StepHook] = []
        self._stop_requested: Callable[[], bool] = lambda: False
        self._behind = 0  # solo steps in a row with every live peer out of reach ahead
        self._catch_up_backoff = 1
        self._next_catch_up = 0  # the outer step from which a catch-up may be tried again
        self._behind_since: tuple[int, int] = (0, 0)  # (own outer step, the front) when the node fell out of reach
        self._clock_joined_from: int | None = None  # this outer step's clock move to its partner's (Lamport)
        # The validation losses of the slow weights the last phases began from (the loss check's allowance).
        self._phase_start_losses: deque[float] = deque(maxlen=GAIN_PHASES + 1)

    def train(self, train_cfg: TrainConfig, *, stop_requested: Callable[[], bool], hooks: Sequence[StepHook]) -> None:
        """The trainer thread's whole life: the one inner loop with this outer step between its phases."""
        deps = self.deps
        deps.strategy.start(deps.replica)

        def on_step(replica: Replica, loss: StepLoss, seconds: float) -> None:
            deps.telemetry.on_inner_step(replica.inner_step, loss, seconds, replica.current_lr)

        self._train_cfg, self._hooks, self._stop_requested = train_cfg, [*hooks, on_step], stop_requested
        inner = InnerLoop(
            deps.replica,
            total_steps=train_cfg.total_steps,
            inner_steps=train_cfg.inner_steps,
            stop_requested=stop_requested,
            after_step=self._hooks,
        )
        # A sharded member's other ranks (training/data_parallel.py) take part in what this outer step does with
        # the whole model, and train when it lets them: from here, and after each outer step.
        replica = deps.replica
        replica.release_followers(train=True, first=True)
        for phase in inner.phases():
            replica.followers_wait()
            self(phase)
            replica.release_followers(train=True)
        replica.followers_wait()  # the phases are over for every rank: the final checkpoint is taken with them

    def _next_phase(self, outer_step: int) -> int | None:
        """The outer step that ends the node's next phase, or None when it trains no further phase (its run is
        done, or it is stopping): a strategy then offers peers nothing to reserve or exchange for it."""
        cfg = self._train_cfg
        if self._stop_requested() or (cfg is not None and self.deps.replica.inner_step >= cfg.total_steps):
            return None
        return outer_step + 1

    def publish_state(self, *, checkpoint: bool = True) -> None:
        """Copy the outer state (theta == phi here) into reused buffers; it becomes the joiner snapshot, and the
        checkpoint when one is due. Trainer thread, at an outer step, and once at start with no checkpoint: the
        state a node starts from is on disk already (a checkpoint, a model folder), rebuilt from the run's seed, or
        a download on probation: writing it again would cost a 1.3b node 13 GB at every start and restore nothing."""
        deps, replica = self.deps, self.deps.replica
        # A downloaded state on probation is not checkpointed: the checkpoint is what a bad one rolls back to.
        on_probation = deps.probation is not None and deps.probation.pending
        due = checkpoint and replica.outer_step % deps.checkpoint_every == 0 and not on_probation

        def take() -> Published:
            copy = deps.snapshots.take(replica)
            copy.manifest = build_manifest(  # what GetState serves of it: the slow weights
                deps.snapshots.served(copy),
                wire_dtype="fp32",
                run_fingerprint=deps.run_fingerprint,
                peer_id=deps.peer_id(),
                outer_step=replica.outer_step,
                metadata_json=json.dumps(copy.metadata["counters"]),
            )
            # Said before anyone reads the copy: a stop right after this step writes nothing more (trainer.py).
            copy.metadata["checkpointed"] = due
            return copy

        copy = deps.snapshot.renew(take)  # held by the latest snapshot until the next renewal: hold() succeeds
        if due and copy.hold():
            history = deps.telemetry.history_list(KEEP_OUTER_STEPS)  # a copy of the list, as of this step
            strategy_state = deps.strategy.checkpoint_state()
            deps.checkpoints.submit(
                lambda: {
                    **deps.checkpoint_extra(),
                    "replica": replica_state_of(copy),
                    "history": history,
                    "strategy": strategy_state,
                },
                copy.release,
            )

    def __call__(self, phase: InnerPhase) -> None:
        deps, replica = self.deps, self.deps.replica
        phase_ended = time.monotonic()
        # This phase's own movement, before pairing: the norm bound a partner is checked against comes from it
        # (payload_guard.py), so the first exchange is already bounded and no payload can widen the bound.
        steps = max(1, len(phase.losses))
        phase_lr, partner_lr = phase_learning_rates(
            replica.train_cfg, replica.inner_step, deps.max_staleness, phase_steps=steps
        )
        distance, per_tensor = relative_distances(replica.outer_theta(), replica.phi)
        movement = deps.norm_guard.observe_phase(
            distance, steps, replica.train_cfg.inner_steps, phase_lr, partner_lr, per_tensor
        )
        wait_started = time.monotonic()
        extra, sent = None, None
        if deps.train_while_waiting and deps.data_parallel is None and self._train_cfg is not None:
            # Not in a multi-GPU member: its other ranks take their steps in lockstep with rank 0's phases.
            extra = StepsWhileWaiting(replica, self._train_cfg, self._hooks, self._stop_requested)
            if deps.send_delta:  # the theta the partner gets: both sides blend momenta from what was sent
                sent = [t.clone() for t in replica.fast_weights()]
        partner = deps.strategy.partner(replica, phase.seconds, extra)
        if partner is not None and partner.unjudged and not deps.judge(partner):
            partner.release()  # it came before this node had a bound, and fails it now: never blended
            partner = None
        extra_seconds, extra_steps = (extra.seconds, len(extra.losses)) if extra is not None else (0.0, 0)
        waited = time.monotonic() - wait_started - extra_seconds
        self._clock_joined_from = None
        weight, verdict = self._blend(partner, sent if extra is not None and extra.losses else None)
        if partner is not None:
            partner.release()  # blended or refused: its buffers can take the next outer step's payload
            if weight is None:
                partner = None  # refused by the loss check: a solo step
            else:
                self._catch_up_backoff, self._behind = 1, 0
        moved_from, caught_up = self._rejoin_the_swarm()
        if moved_from is None and not caught_up and partner is None:
            caught_up = self._catch_up_if_left_behind()
        if caught_up:
            deps.strategy.state_replaced()
        if caught_up or moved_from is not None:
            deps.strategy.start(replica)  # what it offers peers now comes from the adopted state, or step
        # The loss check measured the adopted weights already, unless a downloaded state replaced them since.
        if verdict is not None and not caught_up:
            val_loss = verdict.alone if weight is None else verdict.blended
        else:
            val_loss = replica.evaluate(deps.validation)
        # A state adopted at this very step has trained no phase yet: it is judged at the next one.
        rolled_back = (
            not caught_up
            and deps.probation is not None
            and deps.probation.judge(replica, val_loss, partner is not None, deps.far_groups_since)
        )
        if caught_up or rolled_back:  # other weights: their history of gains is not this one's
            self._phase_start_losses.clear()
        if not rolled_back:  # rolled back, the weights are the checkpoint's: measured when next needed
            self._phase_start_losses.append(val_loss)
        if rolled_back:
            deps.strategy.state_replaced()
            deps.strategy.start(replica)  # what it offers peers comes from its own state again
        # The outer step's own work since the phase ended: the movement, the blend and its loss check, the
        # evaluation (not the wait for the partner, nor the steps trained meanwhile).
        blend_seconds = time.monotonic() - phase_ended - waited - extra_seconds
        entry = {
            "outer_step": replica.outer_step,
            "inner_step": replica.inner_step,
            "train_loss": phase.mean_loss,
            "val_loss": val_loss,
            "partner": partner.peer_id if partner else None,
            "partner_step": partner.outer_step if partner else None,
            "partner_weight": weight,
            "loss_with_partner": verdict.blended if verdict is not None else None,
            "loss_alone": verdict.alone if verdict is not None else None,
            "train_seconds": phase.seconds + extra_seconds,
            "phase_steps": len(phase.losses) + extra_steps,
            "steps_while_waiting": extra_steps,
            "caught_up": caught_up,
            "clock_moved_from": moved_from if moved_from is not None else self._clock_joined_from,
            "rolled_back": rolled_back,
            "wait_seconds": waited,
            "blend_seconds": blend_seconds,
            "upkeep_seconds": 0.0,
            # Kept in the checkpoint's history: a restarted node's norm bound starts from them.
            "movement": movement,
            "phase_lr": phase_lr,
            "partner_lr": partner_lr,
            "time": time.time(),
        }
        deps.telemetry.on_outer_step(entry)  # before the snapshot: the checkpoint's history includes this step
        deps.progress.outer_step(entry, partner, deps.telemetry.tokens_per_second())
        upkeep_started = time.monotonic()
        self.publish_state()
        deps.write_status()
        entry["upkeep_seconds"] = time.monotonic() - upkeep_started  # the same dict the history holds
        asyncio.run_coroutine_threadsafe(deps.publish_record(), deps.loop)

    def _rejoin_the_swarm(self) -> tuple[int | None, bool]:
        """When at least half of the hosts this node knows are beyond --max-staleness ahead (Standing.swarm_step):
        move its outer step forward to theirs, weights kept, or download a peer's state; returns (the step the
        clock moved from, whether a state was adopted).

        Two halves of a swarm that were split train at their own paces and end many outer steps apart: each half
        still pairs within itself, so nobody is ever left behind alone, and without this the halves never meet
        again. The outer step is a logical clock (a Lamport clock, advanced to the majority's), and the weights of
        the half that was behind carry its own training: the blends that follow merge them, with the norm bound
        widened for the steps the two were apart (security/payload_guard.py). Further apart than that widening
        allows (MAX_DRIFT_STEPS), the two sides' weights have drifted beyond any bound (seen: relative distances
        of 0.93-1.12 after 40-67 outer steps apart), so the node downloads a state from the front instead, kept
        only if it measures no worse than its own (node/probation.py); refused, it moves its clock all the same. A
        node these peers never blended with has no standing with them and is left to _catch_up_if_left_behind."""
        deps, replica = self.deps, self.deps.replica
        found = deps.swarm_step(replica.outer_step) if deps.swarm_step is not None else None
        if found is None:
            return None, False
        self._behind = 0
        if found.steps_apart > MAX_DRIFT_STEPS and deps.catch_up is not None:
            log.warning(
                "most peers with standing are %d outer steps ahead, beyond reach, and this node last blended with "
                "them %d of its outer steps ago: downloading a peer's state",
                found.outer_step - replica.outer_step,
                found.steps_apart,
            )
            if deps.catch_up(found.outer_step):
                return None, True
        moved_from = replica.outer_step
        replica.advance_clock(found.outer_step)
        log.warning(
            "most peers with standing are %d outer steps ahead, beyond reach: clock moved from outer step %d to %d, "
            "weights kept",
            found.outer_step - moved_from,
            moved_from,
            found.outer_step,
        )
        return moved_from, False

    def _catch_up_if_left_behind(self) -> bool:
        """After a solo step: when every live peer has been ahead, at or beyond the edge of reach, for BEHIND_STEPS
        solo steps in a row, adopt a donor's state (node/catch_up.py: only one that measures no worse than this
        node's own). A node that came up late, or whose joiner download was refused, otherwise trains alone for
        good: as fast as the others, it never gets back within reach, and drifts beyond their norm bound. A peer's
        step is the one its own server last said when it refused this node as out of reach, if newer than its DHT
        record; peers count as ``believe`` says (once this node has peers with standing, theirs alone).

        A peer exactly --max-staleness ahead at this node's step counts as out of reach: it is within reach only
        until its own next outer step, which may come at once (its record says the step it reached, not how far
        into the next phase it is). Counted as within, a node that trained 2.95 phases behind its peers at their
        pace read them as within reach at each of its own steps, was out of their reach for all but the first
        twentieth of each phase, and trained alone for good. Peers behind, whose records understate how far they
        have come, count as within reach up to --max-staleness."""
        deps, replica = self.deps, self.deps.replica
        steps = [step for peer, step in deps.telemetry.peer_steps().items() if deps.believe(peer)]
        edge = replica.outer_step + deps.max_staleness
        within = [s for s in steps if replica.outer_step - deps.max_staleness <= s < edge]
        ahead = [s for s in steps if s >= edge]
        if not ahead or within:
            self._behind = 0
            return False
        if self._behind == 0:
            self._behind_since = (replica.outer_step, max(ahead))
        self._behind += 1
        if deps.catch_up is None or self._behind < BEHIND_STEPS or replica.outer_step < self._next_catch_up:
            return False
        if self._slower_than_the_swarm(max(ahead)):
            # A straggler: a state from the front would put it back within reach only until its next phase ends,
            # and in the meantime a peer at that step may wait for it. Tried again only after the longest backoff.
            self._catch_up_backoff = MAX_CATCH_UP_BACKOFF
            self._next_catch_up = replica.outer_step + MAX_CATCH_UP_BACKOFF
            log.warning("slower than half the swarm's pace: no catch-up for %d outer steps", MAX_CATCH_UP_BACKOFF)
            return False
        behind_by = min(ahead) - replica.outer_step
        log.warning(
            "every live peer is %d+ outer steps ahead, at or beyond the edge of reach: downloading a peer's state",
            behind_by,
        )
        adopted = deps.catch_up(None)  # the trainer waits: the download adopts the state while nothing else writes it
        if adopted:
            self._behind = 0
        self._catch_up_backoff = min(MAX_CATCH_UP_BACKOFF, self._catch_up_backoff * 2)
        self._next_catch_up = replica.outer_step + self._catch_up_backoff
        return adopted

    def _slower_than_the_swarm(self, front: int) -> bool:
        """While out of reach (solo steps, no waiting), did this node advance less than half as many outer steps as
        the swarm's front? A node that started late keeps pace with the front; a straggler does not."""
        own_since, front_since = self._behind_since
        return (self.deps.replica.outer_step - own_since) * 2 < front - front_since

    def _blend(
        self, partner: Payload | None, sent_theta: list[torch.Tensor] | None = None
    ) -> tuple[float | None, BlendVerdict | None]:
        """The outer step over the group that answered: this node plus the partner, or this node alone.
        ``sent_theta``: the fast weights the partner got, when this node trained on while waiting. A partner's
        blend is taken only if it measures no worse than the step alone (node/blend_check.py); the partner then
        counts as blended with (pairing/standing.py), else it is refused and set aside. Returns the partner's
        weight in the blend (STRANGER_WEIGHT without standing; None: a solo step) and the loss check's verdict
        (None: no partner answered)."""
        deps, replica = self.deps, self.deps.replica
        # theta where the outer state lives (training/step_plan.py places it): the live weights on a GPU that holds
        # it, where the blends and the loss check's candidates are a few passes over device memory; else theta
        # gathered on the host once per outer step (again only when the node trained on while it waited). A
        # partner's tensors are moved there one at a time (algorithm.py).
        fast = replica.outer_theta()

        def outer_step(received: PartnerTensors | None, partner_weight: float = 1.0) -> tuple[list[torch.Tensor], ...]:
            return algorithm.noloco_pair_step(
                fast,
                replica.phi,
                replica.delta,
                received,
                alpha=deps.outer_cfg.alpha,
                beta=deps.outer_cfg.beta,
                gamma=deps.outer_cfg.effective_gamma,
                blend_momenta=deps.send_delta,
                sent_theta=sent_theta,
                partner_weight=partner_weight,
            )

        weight: float | None = None
        verdict: BlendVerdict | None = None
        if partner is None:
            new_phi, new_delta = outer_step(None)
        else:
            # One candidate at a time (each is a copy of the model): the solo step's loss first, then the blend's.
            alone = replica.loss_of(outer_step(None)[0], deps.validation)
            weight = 1.0 if deps.believe(partner.peer_id) else STRANGER_WEIGHT
            new_phi, new_delta = outer_step(
                partner_tensors(partner, replica.names, send_phi=deps.send_phi, send_delta=deps.send_delta), weight
            )
            if not self._phase_start_losses:  # the first outer step since the trainer started, or a rollback
                self._phase_start_losses.append(replica.loss_of(replica.phi, deps.validation))
            verdict = BlendVerdict(
                earlier=self._phase_start_losses[0],
                phases=len(self._phase_start_losses),
                blended=replica.loss_of(new_phi, deps.validation),
                alone=alone,
            )
            if verdict.harmful:
                deps.refuse_blend(partner.peer_id, verdict.describe())
                new_phi, new_delta = outer_step(None)
                weight = None
            else:
                deps.paired(partner.peer_id, replica.outer_step)
        next_phase = self._next_phase(replica.outer_step)
        partners_clock = self._partners_clock(partner if weight is not None else None, next_phase)
        deps.strategy.after_blend(new_phi, new_delta, fast, replica.phi, partners_clock or next_phase)
        replica.apply_outer_step(new_phi, new_delta)
        if partners_clock is not None:
            self._clock_joined_from = replica.outer_step
            replica.advance_clock(partners_clock)
        return weight, verdict

    def _partners_clock(self, blended: Payload | None, next_phase: int | None) -> int | None:
        """The outer step to move this node's clock to after blending with ``blended``, a partner at the edge of
        reach ahead: one within --max-staleness - 1 of the partner's (at least 1), a Lamport clock that lags on
        purpose. None: the clock keeps its own pace.

        Pairs form across outer steps, and the one of a pair whose phase ends first waits for the other, idle once
        its borrowed steps run out: a member behind its partner waits for the partner's *next* phase end, and falls
        further behind. Nothing pulled it back, so a member a moment behind drifted out of reach phase by phase,
        trained alone, and ended its run alone after its peers had left. A pair one outer step apart is the normal
        state of a swarm whose phases are staggered (how an odd member of three finds a partner), so the clock moves
        only at the edge: whole phases skipped, only after a blend with a peer this node believes, and never past
        the run's last phase."""
        deps, replica = self.deps, self.deps.replica
        keep = max(1, deps.max_staleness - 1)
        if blended is None or next_phase is None or blended.outer_step - replica.outer_step <= keep:
            return None
        if not deps.believe(blended.peer_id):
            return None
        target = blended.outer_step + 1 - keep
        skipped_steps = (target - next_phase) * replica.train_cfg.inner_steps
        if replica.inner_step + skipped_steps >= replica.train_cfg.total_steps:
            return None
        return target


def phase_learning_rates(
    cfg: TrainConfig, inner_step: int, max_staleness: int, *, phase_steps: int | None = None
) -> tuple[float, float]:
    """The mean learning rate of the phase that ended at ``inner_step`` (of ``phase_steps`` steps, H by default),
    and the largest one a partner up to ``max_staleness`` outer steps ahead or behind may have trained its phase
    at."""
    h = cfg.inner_steps
    length = h if phase_steps is None else phase_steps
    phase = [learning_rate(s, cfg) for s in range(max(0, inner_step - length), max(1, inner_step))]
    reach = (max_staleness + 1) * h
    stride = max(1, h // 8)  # the schedule is monotone between warmup's end and the ends of the window
    samples = [*range(max(0, inner_step - reach), inner_step + reach + 1, stride), cfg.effective_warmup_steps]
    window = [learning_rate(s, cfg) for s in samples if inner_step - reach <= s <= inner_step + reach]
    return sum(phase) / len(phase), max(window)


def held_outer_state(copy: Published, count: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The slow weights and outer momentum of a published snapshot (training/checkpoints.py's order), for checks
    made off the trainer while the copy is held."""
    return list(copy.tensors[:count]), list(copy.tensors[count : 2 * count])
