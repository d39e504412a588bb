"""Admission of a verified payload: the norm bound on a partner's weights, and rate-limited complaints about peers.

wire/payload.py proves a payload well-formed (names, shapes, dtypes, sizes, checksums, finite values). That does not
make it a model of this run: random weights, or honest weights scaled by 1000, pass every one of those checks and
would wreck the blend (NoLoCo's outer step moves phi towards the partner's theta by beta/2 of the gap). So before
a partner's tensors are blended, their distance from this node's own slow weights is measured,

    d = ||theta_partner - phi_own||_2 / ||phi_own||_2        (over all tensors at once; also for phi if sent)
    d = ||delta_partner - delta_own||_2 / ||phi_own||_2      (the outer momentum, with --blend-momenta)

and the payload is refused (INVALID_ARGUMENT, reason ``norm_bound``) when d exceeds the bound. The partner's theta
(or a sparse run's progress) is also measured tensor by tensor, each relative to this node's own tensor, and held to
:meth:`NormGuard.tensor_bounds`: the overall distance alone lets a payload spend the whole model's allowance on one
small tensor (0.8 of a bound spent on the tiny model's smallest tensor, an attention output projection with 3% of
its norm, moves that tensor by about 25 times the bound).

The bound is ``factor`` times the largest relative movement of this node's *own* recent inner phases,
``||theta_own - phi_own|| / ||phi_own||`` over the last ``window`` outer steps: the larger of that movement as it was
and the movement per unit of learning rate times the largest learning rate a partner within the staleness bound may
have trained at (in the warmup a partner two phases ahead moves more); fixed instead when configured. Not the
movement scaled down as the learning rate falls: the spread between replicas shrinks with their blends, not with
the learning rate, so a spread built while the rate was high outlasts it (32 tiny members, 300 steps: 40 honest
payloads refused at outer steps 10-14, 1.05-3.4 times a bound that had followed the rate down, 38 of them inside
the window's own movement times 3).
Why this node's own movement and not the distances of accepted payloads: a bound learnt from what peers send can
be walked up by the peers who send it (three payloads just inside a bound of 1.0 once lifted a learnt bound to
4.75, after which random weights were blended), while no payload moves a node's own phase. It is sound from the
first exchange (a node measures its phase before it pairs) and after a restart (the movements are in the
checkpoint's history). Why the movement bounds an honest partner: replicas start from the same weights and move
at the same learning rate, and the pull towards the group mean keeps the spread bounded, so an honest partner's
theta sits within its own phase's movement plus the spread of this node's phi; measured on the tiny model (4
replicas, H = 20 and 50), ``d / max(recent own movement)`` stayed below 1.3, hence the default factor of 3.
Whatever the movement, the bound never exceeds ``CEILING`` (0.9): weights as far from this node's as zero is
(d = 1, and random weights sit at d >= 1) are nobody's honest partner, and early in a run, when a tiny model's
first phases move it by up to 46% of its norm, 3x the movement alone would admit them.
A sparse run's progress (wire/sparse.py) is a top-k code of one phase's progress, no larger than the progress
itself, so the same bound holds it.
Until this node has finished one phase it has no bound: a payload that arrives then (an overlap offer in the
first phase) is kept unjudged and judged by the trainer, with the bound of its first phase, before it is blended
(node/served.py, node/outer_step.py); ``admit`` itself refuses as *not ready* (ABORTED, never held against the
peer).

A member that holds the secret can still send a subtly bad model inside the bound; see the README's threat model.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import grpc
import torch

from noloco_node.wire.frames import PayloadError

log = logging.getLogger(__name__)

CEILING = 0.9  # the loosest bound ever: zero weights are at distance 1.0, random ones beyond
NOT_READY = "not_ready"  # a refusal that says nothing about the peer
NORM_BOUND = "norm_bound"  # too far from this node's weights: drift or hostility, the peer is set aside for now
# Drift: two honest replicas that have not blended for k outer steps may be this much farther apart than the bound
# of one phase allows (sqrt(1 + k): the spread of independent walks), for k up to this many steps.
MAX_DRIFT_STEPS = 15
# A tensor's own bound is this many times the larger of the overall bound and its own (factor x movement) basis.
# An honest partner's tensors stray further from this node's profile than its whole does: a joiner's first phase
# after downloading a state (its Adam moments start from zero, so every coordinate moves by about the learning rate)
# moved the tiny model's embedding by 1.52 times that basis while the whole stayed inside its bound. What the
# per-tensor check stops is of another size: the overall allowance spent on one small tensor moves it by about 25
# times the bound.
TENSOR_SLACK = 3.0
DISTANCE_SLICE = 1 << 20  # elements per slice: the distance never allocates a model-sized temporary


def relative_distance(
    partner: Sequence[torch.Tensor], own: Sequence[torch.Tensor], scale: Sequence[torch.Tensor] | None = None
) -> float:
    """||partner - own|| / ||scale|| over every tensor (``scale`` defaults to ``own``), in fp32, slice by slice.

    A partner's outer momentum is compared with this node's own, relative to the size of its weights: momenta
    are movements, and ||own momentum|| alone would make any two honest ones look far apart."""
    return relative_distances(partner, own, scale)[0]


def relative_distances(
    partner: Sequence[torch.Tensor], own: Sequence[torch.Tensor], scale: Sequence[torch.Tensor] | None = None
) -> tuple[float, list[float]]:
    """:func:`relative_distance` over every tensor at once, and each tensor's own ||partner_t - own_t|| /
    ||scale_t|| (the per-tensor check of :meth:`NormGuard.admit`)."""
    scale = own if scale is None else scale
    gap, norm, per_tensor = 0.0, 0.0, []
    with torch.no_grad():
        for theirs, mine, size in zip(partner, own, scale, strict=True):
            a, b, c = theirs.reshape(-1), mine.reshape(-1), size.reshape(-1)
            tensor_gap, tensor_norm = 0.0, 0.0
            for start in range(0, a.numel(), DISTANCE_SLICE):
                # Where this node's own tensor lives (a GPU's outer state, or the host): a partner's slice moves there.
                own_slice = b[start : start + DISTANCE_SLICE].float()
                diff = a[start : start + DISTANCE_SLICE].to(own_slice.device, torch.float32) - own_slice
                size_slice = c[start : start + DISTANCE_SLICE].to(own_slice.device, torch.float32)
                tensor_gap += float(torch.dot(diff, diff))
                tensor_norm += float(torch.dot(size_slice, size_slice))
            gap, norm = gap + tensor_gap, norm + tensor_norm
            per_tensor.append(math.sqrt(tensor_gap) / max(math.sqrt(tensor_norm), 1e-12))
    return math.sqrt(gap) / max(math.sqrt(norm), 1e-12), per_tensor


def relative_norm(partner: Sequence[torch.Tensor], scale: Sequence[torch.Tensor]) -> float:
    """||partner|| / ||scale|| over every tensor, in fp32: the distance of theta = phi + partner from phi."""
    return relative_norms(partner, scale)[0]


def relative_norms(partner: Sequence[torch.Tensor], scale: Sequence[torch.Tensor]) -> tuple[float, list[float]]:
    """:func:`relative_norm` over every tensor at once, and each tensor's ||partner_t|| / ||scale_t||."""
    size, norm, per_tensor = 0.0, 0.0, []
    with torch.no_grad():
        for theirs, reference in zip(partner, scale, strict=True):
            tensor_size = float(torch.linalg.vector_norm(theirs, dtype=torch.float32))
            tensor_norm = float(torch.linalg.vector_norm(reference, dtype=torch.float32))
            size, norm = size + tensor_size**2, norm + tensor_norm**2
            per_tensor.append(tensor_size / max(tensor_norm, 1e-12))
    return math.sqrt(size) / max(math.sqrt(norm), 1e-12), per_tensor


class RunningGap:
    """The norm bound's distances, measured chunk by chunk while a payload arrives (a wire/payload.py
    ``ValueObserver``): for each part (theta, phi, delta) the sum of ``(theirs - mine)**2``, and ``||phi_own||**2``
    from the slices of phi it compared, so that nothing is left to compute after the last byte. ``references``
    maps a received tensor's name to this node's own tensor (flat, fp32) it is compared with; names without one
    (a stream run's progress) are not measured, and the payload is then checked whole after it has arrived."""

    def __init__(self, references: dict[str, torch.Tensor], release: Callable[[], None]) -> None:
        self._references: dict[str, torch.Tensor] | None = references
        self._release: Callable[[], None] | None = release
        self.gap: dict[str, float] = {}
        self.own: dict[str, float] = {}
        self.seen: dict[str, int] = {}
        self.tensor_gap: dict[str, float] = {}  # by received name: the per-tensor check's distances
        self.tensor_own: dict[str, float] = {}

    def observe(self, name: str, start: int, values: torch.Tensor) -> None:
        references = self._references  # close() may run meanwhile on another thread: read it once
        mine = None if references is None else references.get(name)
        if mine is None:
            return
        with torch.no_grad():
            own = mine[start : start + values.numel()]
            diff = torch.sub(values.reshape(-1), own)  # one kernel: bf16 is promoted to fp32 on the fly
            part = name.split("/", 1)[0]
            gap, own_squared = float(torch.dot(diff, diff)), float(torch.dot(own, own))
            self.gap[part] = self.gap.get(part, 0.0) + gap
            self.own[part] = self.own.get(part, 0.0) + own_squared
            self.tensor_gap[name] = self.tensor_gap.get(name, 0.0) + gap
            self.tensor_own[name] = self.tensor_own.get(name, 0.0) + own_squared
        self.seen[part] = self.seen.get(part, 0) + values.numel()

    def close(self) -> None:
        release, self._release, self._references = self._release, None, None
        if release is not None:
            release()

    def distances(self, numel_per_part: dict[str, int]) -> dict[str, float] | None:
        """Each part's ||theirs - mine|| / ||phi_own||, or None unless every element of every part was measured."""
        if any(self.seen.get(part) != numel for part, numel in numel_per_part.items()):
            return None
        phi_squared = self.own.get("theta", self.own.get("phi"))
        if phi_squared is None:
            return None
        norm = max(math.sqrt(phi_squared), 1e-12)
        return {part: math.sqrt(self.gap[part]) / norm for part in numel_per_part}

    def tensor_distances(self, part: str, names: Sequence[str]) -> list[float]:
        """Each tensor's ||theirs_t - mine_t|| / ||mine_t|| of ``part``, in the order of ``names`` (parameter names),
        once :meth:`distances` has found every element measured."""
        return [
            math.sqrt(self.tensor_gap.get(f"{part}/{name}", 0.0))
            / max(math.sqrt(self.tensor_own.get(f"{part}/{name}", 0.0)), 1e-12)
            for name in names
        ]


class NormGuard:
    """The bound on a partner's relative distance, from this node's own recent movement. Thread-safe."""

    def __init__(self, *, fixed: float | None = None, factor: float = 3.0, window: int = 8) -> None:
        self.fixed = fixed
        self.factor = factor
        self._per_lr: deque[float] = deque(maxlen=window)  # movement per unit of learning rate, per phase
        self._moved: deque[float] = deque(maxlen=window)  # movement, per phase
        # The same per tensor (each tensor's movement relative to its own norm): the per-tensor check of admit
        self._tensor_per_lr: deque[list[float]] = deque(maxlen=window)
        self._tensor_moved: deque[list[float]] = deque(maxlen=window)
        self._phase_lr = 0.0
        self._partner_lr = 0.0
        self._lock = threading.Lock()
        self.last_distance: float | None = None
        # The last admitted partner's largest tensor distance as a fraction of that tensor's bound (at most 1)
        self.last_tensor_ratio: float | None = None

    def observe_own_movement(
        self, movement: float, phase_lr: float, partner_lr: float, per_tensor: Sequence[float] | None = None
    ) -> None:
        """Trainer thread, at the end of every inner phase and before pairing: ``movement`` = ||theta - phi|| /
        ||phi|| of the phase just trained at mean learning rate ``phase_lr``; ``partner_lr``: the largest learning
        rate a partner within the staleness bound may have trained its phase at. Movement scales with the learning
        rate, so the bound rises with it: during the warmup a partner two phases ahead moves more than this node
        did (honest partners were refused at 0.00086 against a bound of 0.00062 before this scaling). It does not
        fall below the window's movement as it was when the rate falls (the module's docstring says why)."""
        if math.isfinite(movement) and phase_lr > 0 and math.isfinite(partner_lr):
            with self._lock:
                self._per_lr.append(movement / phase_lr)
                self._moved.append(movement)
                self._phase_lr, self._partner_lr = phase_lr, partner_lr
                if per_tensor is not None and all(math.isfinite(m) for m in per_tensor):
                    self._tensor_per_lr.append([m / phase_lr for m in per_tensor])
                    self._tensor_moved.append(list(per_tensor))

    def observe_phase(
        self,
        distance: float,
        steps: int,
        inner_steps: int,
        phase_lr: float,
        partner_lr: float,
        per_tensor: Sequence[float] | None = None,
    ) -> float | None:
        """A phase of ``steps`` inner steps moved theta ``distance`` (relative L2) from phi: its movement scaled to
        a whole phase of ``inner_steps`` (H) is observed and returned, or None when it is not measured.

        A phase under half of H (the run's last, or one whose steps were borrowed while waiting) is not measured
        once there is a bound: a few steps' movement scaled to H overstates a phase's (their noise adds up by the
        square root, not linearly), and the bound follows the largest movement it saw, so it would be the run's
        loosest. Scaled at all because a phase shortened by borrowed steps, measured as it was, refused honest
        partners that trained a whole phase."""
        if 2 * steps < inner_steps and self.bound() is not None:
            return None
        scale = inner_steps / max(1, steps)
        movement = distance * scale
        tensors = None if per_tensor is None else [m * scale for m in per_tensor]
        self.observe_own_movement(movement, phase_lr, partner_lr, tensors)
        return movement

    def restore(self, phases: Sequence[tuple[float, float, float]]) -> None:
        """(movement, phase_lr, partner_lr) of the phases a checkpoint recorded, oldest first, so that a restarted
        node is bounded at once."""
        for movement, phase_lr, partner_lr in phases:
            self.observe_own_movement(movement, phase_lr, partner_lr)

    def bound(self) -> float | None:
        """The current bound; None before this node has measured one phase of its own (and none is fixed)."""
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            if not self._per_lr:
                return None
            movement = max(max(self._per_lr) * self._partner_lr, max(self._moved))
            return min(CEILING, self.factor * movement)

    @property
    def basis(self) -> str:
        """Where the bound comes from: ``fixed``, ``own_movement``, or ``none_yet``."""
        if self.fixed is not None:
            return "fixed"
        with self._lock:
            return "own_movement" if self._per_lr else "none_yet"

    def tensor_bounds(self, bound: float, widen: float = 1.0) -> list[float] | None:
        """Each tensor's bound, for an overall ``bound`` already widened by ``widen`` for drift: ``TENSOR_SLACK``
        times the overall bound, or, for a tensor that moves more than that relative to its own norm, times
        ``factor`` times its own largest movement as for the whole, widened alike. None
        before this node has measured a phase tensor by tensor (a restart measures one before it pairs again), or
        with a fixed bound."""
        with self._lock:
            if self.fixed is not None or not self._tensor_per_lr:
                return None
            partner_lr = self._partner_lr
            per_lr_by_tensor = zip(*self._tensor_per_lr, strict=True)
            moved_by_tensor = zip(*self._tensor_moved, strict=True)
            movements = [
                max(max(per_lr) * partner_lr, max(moved))
                for per_lr, moved in zip(per_lr_by_tensor, moved_by_tensor, strict=True)
            ]
        return [TENSOR_SLACK * max(bound, self.factor * movement * widen) for movement in movements]

    def admit(
        self,
        distance: float,
        peer: str,
        steps_apart: int | None = None,
        tensors: Sequence[tuple[str, float]] | None = None,
    ) -> None:
        """Accept the distance, or raise PayloadError naming it and the bound. Nothing is learnt from it.

        ``steps_apart``: outer steps since this node last blended with the peer (None: never, or the peer has no
        standing: pairing/standing.py). Replicas that were apart drift (a partition, a slow node): the bound widens
        by sqrt(1 + k), k at most MAX_DRIFT_STEPS, so that two that were apart for a while can blend again; any
        other peer gets the bound of one phase.

        ``tensors``: (name, distance relative to this node's own tensor) for each tensor, in the order of the
        movements observed. Each is held to :meth:`tensor_bounds`: the overall distance alone lets a payload spend
        the whole model's allowance on one small tensor, moving it many times the bound."""
        bound = self.bound()
        widen = math.sqrt(1 + min(steps_apart, MAX_DRIFT_STEPS)) if steps_apart else 1.0
        if bound is not None:
            bound = min(CEILING, bound * widen)
        if bound is None:
            raise PayloadError(
                grpc.StatusCode.ABORTED,
                NOT_READY,
                "this node has not finished an inner phase yet, so it has no bound to check a partner against",
            )
        _within(distance, bound, f"the weights from {peer} are", "(relative L2)", "the bound")
        ratio = None
        bounds = self.tensor_bounds(bound, widen) if tensors is not None else None
        if tensors is not None and bounds is not None and len(bounds) == len(tensors):
            ratio = 0.0
            for (name, tensor_distance), tensor_bound in zip(tensors, bounds, strict=True):
                what = f"{name} from {peer} is"
                _within(tensor_distance, tensor_bound, what, "(relative L2 of that tensor)", "its bound")
                ratio = max(ratio, tensor_distance / max(tensor_bound, 1e-12))
        with self._lock:
            self.last_distance = distance
            if ratio is not None:
                self.last_tensor_ratio = ratio


def _within(distance: float, bound: float, what: str, measure: str, which: str) -> None:
    """Raise the norm bound's refusal unless ``distance`` is a number within ``bound``."""
    if not math.isfinite(distance) or distance > bound:
        raise PayloadError(
            grpc.StatusCode.INVALID_ARGUMENT,
            NORM_BOUND,
            f"{what} {distance:.3g} {measure} from this node's, beyond {which} {bound:.3g}",
        )


class Complaints:
    """Logs a refusal once per (peer, reason), then at most once per ``interval`` with the count suppressed, so
    that a peer sending garbage in a loop cannot flood the log."""

    def __init__(
        self, interval: float = 60.0, max_tracked: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self._clock = clock
        self.max_tracked = max_tracked
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def complain(self, peer: str, reason: str, message: str) -> bool:
        """Log ``message`` unless this complaint was logged recently; returns whether it was logged."""
        now = self._clock()
        with self._lock:
            if len(self._last) >= self.max_tracked:
                self._last.clear()
            last, suppressed = self._last.get((peer, reason), (-math.inf, 0))
            if now - last < self.interval:
                self._last[(peer, reason)] = (last, suppressed + 1)
                return False
            self._last[(peer, reason)] = (now, 0)
        extra = f" ({suppressed} more since the last report)" if suppressed else ""
        log.warning("refused %s from %s: %s%s", reason, peer, message, extra)
        return True
