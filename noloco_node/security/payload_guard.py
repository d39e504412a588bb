"""Admission of a verified payload: the norm bound on a partner's weights, and rate-limited complaints about peers.

wire/payload.py proves a payload well-formed (names, shapes, dtypes, sizes, checksums, finite values). That does not
make it a model of this run: random weights, or honest weights scaled by 1000, pass every one of those checks and
would wreck the blend (NoLoCo's outer step moves phi towards the partner's theta by beta/2 of the gap). So before
a partner's tensors are blended, their distance from this node's own slow weights is measured,

    d = ||theta_partner - phi_own||_2 / ||phi_own||_2        (over all tensors at once; also for phi if sent)

and the payload is refused (INVALID_ARGUMENT, reason ``norm_bound``) when d exceeds the bound. The bound is fixed
when configured; by default it is ``factor`` times the median distance of the recently accepted payloads (a
median, so that a hostile partner cannot ratchet it up by pushing each accepted payload a little further), and
``initial`` until a few exchanges have been seen. Honest replicas stay close (the pull towards the group mean keeps
the spread bounded, docs/architecture.md), so honest partners sit well inside the bound.

A member that holds the secret can still send a subtly bad model inside the bound; see the README's threat model.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Sequence

import grpc
import torch

from noloco_node.wire.frames import PayloadError

log = logging.getLogger(__name__)

DISTANCE_SLICE = 1 << 20  # elements per slice: the distance never allocates a model-sized temporary


def relative_distance(partner: Sequence[torch.Tensor], own: Sequence[torch.Tensor]) -> float:
    """||partner - own|| / ||own|| over every tensor, in fp32, slice by slice."""
    gap, norm = 0.0, 0.0
    with torch.no_grad():
        for theirs, mine in zip(partner, own, strict=True):
            a, b = theirs.reshape(-1), mine.reshape(-1)
            for start in range(0, a.numel(), DISTANCE_SLICE):
                mine_slice = b[start : start + DISTANCE_SLICE].float()
                diff = a[start : start + DISTANCE_SLICE].float() - mine_slice
                gap += float(torch.dot(diff, diff))
                norm += float(torch.dot(mine_slice, mine_slice))
    return math.sqrt(gap) / max(math.sqrt(norm), 1e-12)


class NormGuard:
    """The bound on a partner's relative distance, learnt from recently accepted payloads. Thread-safe."""

    def __init__(
        self,
        *,
        fixed: float | None = None,
        factor: float = 5.0,
        initial: float = 1.0,
        window: int = 32,
        min_history: int = 4,
    ) -> None:
        self.fixed = fixed
        self.factor = factor
        self.initial = initial
        self.min_history = min_history
        self._accepted: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.last_distance: float | None = None

    def bound(self) -> float:
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            if len(self._accepted) < self.min_history:
                return self.initial
            return self.factor * statistics.median(self._accepted)

    @property
    def learnt(self) -> bool:
        with self._lock:
            return self.fixed is None and len(self._accepted) >= self.min_history

    def admit(self, distance: float, peer: str) -> None:
        """Accept (and learn from) the distance, or raise PayloadError naming it and the bound."""
        bound = self.bound()
        if not math.isfinite(distance) or distance > bound:
            raise PayloadError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "norm_bound",
                f"the weights from {peer} are {distance:.3g} (relative L2) from this node's, beyond the bound "
                f"{bound:.3g}",
            )
        with self._lock:
            self._accepted.append(distance)
            self.last_distance = distance


class Complaints:
    """Logs a refusal once per (peer, reason), then at most once per ``interval`` with the count suppressed, so
    that a peer sending garbage in a loop cannot flood the log."""

    def __init__(self, interval: float = 60.0, max_tracked: int = 10_000) -> None:
        self.interval = interval
        self.max_tracked = max_tracked
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def complain(self, peer: str, reason: str, message: str) -> bool:
        """Log ``message`` unless this complaint was logged recently; returns whether it was logged."""
        now = time.monotonic()
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
