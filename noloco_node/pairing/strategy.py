"""What a pairing strategy is: when a node looks for a partner, what it offers, and which payload it blends with.

The outer step (node/outer_step.py) is the same maths whatever the strategy (NoLoCo, arXiv 2506.10911, eq. 3-5,
over the node and at most one partner); a strategy only decides the timing. It is called from three places,
each with its own methods:

- the trainer thread, at every outer step: :meth:`PairingStrategy.partner` returns the partner's payload to blend
  with (or None: a solo step), and :meth:`PairingStrategy.after_blend` sees the blend's result before it is
  applied (overlap mode publishes its next offer from it);
- the gRPC server's threads: :meth:`PairingStrategy.open_session` for a peer's incoming exchange call, and
  :meth:`PairingStrategy.ready` for the DHT record;
- the event loop: :meth:`PairingStrategy.run`, a background task (supervised by the node) for strategies that
  exchange between outer steps.

Strategies: ``sync`` (pairing/sync.py) and ``overlap`` (pairing/overlap.py); a third one implements this class
and is registered in node/peering.py's ``STRATEGIES``.
"""

from __future__ import annotations

import asyncio
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from noloco_node.discovery.dht import Discovery
from noloco_node.observability.telemetry import Telemetry
from noloco_node.pairing.caller import PeerCaller
from noloco_node.rpc.contracts import ExchangeSession
from noloco_node.training.replica import Replica
from noloco_node.wire import quantize
from noloco_node.wire.frames import WIRE_DTYPES, build_manifest
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import BufferPool, Published


class OfferPublisher:
    """Copies of this node's fast weights (and, when the run needs them, its slow weights and outer momentum) in the
    wire dtype, published for exchanges (copy-on-publish: wire/published.py). The conversion to the wire dtype
    happens once here, not once per exchange, and the streams send straight from these buffers."""

    def __init__(
        self,
        names: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        *,
        send_phi: bool,
        send_delta: bool = False,
        wire_dtype: str,
        run_fingerprint: str,
        peer_id: Callable[[], str],
        pinned: bool = False,
    ) -> None:
        self.names = list(names)
        self.send_phi = send_phi
        self.send_delta = send_delta
        self.wire_dtype = wire_dtype
        self.run_fingerprint = run_fingerprint
        self.peer_id = peer_id
        shapes = list(shapes) * (1 + send_phi + send_delta)
        if quantize.is_quantized(wire_dtype):  # published as encoded bytes, once, whoever streams them
            self.pool = BufferPool(
                [(quantize.encoded_bytes(math.prod(shape), wire_dtype),) for shape in shapes],
                torch.uint8,
                encode=lambda buffer, source: quantize.quantize_into(source, wire_dtype, buffer),
            )
        else:
            self.pool = BufferPool(shapes, WIRE_DTYPES[wire_dtype][1], pinned=pinned)

    def publish(
        self,
        theta: Sequence[torch.Tensor],
        phi: Sequence[torch.Tensor],
        delta: Sequence[torch.Tensor],
        outer_step: int,
    ) -> Published:
        """A held copy of (theta[, phi][, delta]) as of ``outer_step``; release it when it is superseded."""
        named = [(f"theta/{n}", t) for n, t in zip(self.names, theta, strict=True)]
        if self.send_phi:
            named += [(f"phi/{n}", t) for n, t in zip(self.names, phi, strict=True)]
        if self.send_delta:
            named += [(f"delta/{n}", t) for n, t in zip(self.names, delta, strict=True)]
        manifest = build_manifest(
            named,
            wire_dtype=self.wire_dtype,
            run_fingerprint=self.run_fingerprint,
            peer_id=self.peer_id(),
            outer_step=outer_step,
        )
        return self.pool.publish([t for _, t in named], manifest=manifest)


@dataclass
class PairingContext:
    """What a strategy works with; built by the node (node/daemon.py)."""

    peer_id: Callable[[], str]
    caller: PeerCaller
    discovery: Discovery
    telemetry: Telemetry
    offers: OfferPublisher
    publish_record: Callable[[], Coroutine[Any, Any, None]]  # refresh this node's DHT record (its readiness)
    stopping: threading.Event
    pair_timeout: float
    alone_grace: float
    max_staleness: int
    exchange_ceiling: float  # the longest one exchange may take, whatever its deadline
    loop: asyncio.AbstractEventLoop | None = None  # set when the node's event loop runs


class PairingStrategy(ABC):
    mode: str

    def __init__(self, ctx: PairingContext) -> None:
        self.ctx = ctx

    # ---------------------------------------------------------------------------------- gRPC threads

    @abstractmethod
    def ready(self) -> bool:
        """Whether peers may call now (published in the DHT record)."""

    @abstractmethod
    def open_session(self, partner_id: str, partner_outer_step: int) -> ExchangeSession | None:
        """A session for an incoming exchange from ``partner_id`` (a proven id), or None: busy (ABORTED)."""

    # ---------------------------------------------------------------------------------- event loop

    async def run(self) -> None:  # noqa: B027 - a strategy without background work keeps this default
        """Background work between outer steps (a supervised task); returns at once by default."""

    # ---------------------------------------------------------------------------------- trainer thread

    def start(self, replica: Replica) -> None:  # noqa: B027
        """Before the first inner phase (the replica is resumed or downloaded by now)."""

    @abstractmethod
    def partner(self, replica: Replica, phase_seconds: float) -> Payload | None:
        """At an outer step: the partner's payload to blend with, or None for a solo step."""

    def after_blend(  # noqa: B027
        self,
        new_phi: Sequence[torch.Tensor],
        new_delta: Sequence[torch.Tensor],
        theta: Sequence[torch.Tensor],
        old_phi: Sequence[torch.Tensor],
        next_outer_step: int,
    ) -> None:
        """The blend's result, before the replica adopts it (theta and old_phi are still the live tensors)."""

    def interrupt(self) -> None:  # noqa: B027
        """The node is stopping: a trainer waiting in :meth:`partner` returns at once."""

    def close(self) -> None:  # noqa: B027
        """The node has stopped: release what the strategy still holds."""
