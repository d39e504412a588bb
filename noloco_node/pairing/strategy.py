"""What a pairing strategy is: when a node looks for a partner, what it offers, and which payload it blends with.

The outer step (node/outer_step.py) is the same maths whatever the strategy (NoLoCo, arXiv 2506.10911, eq. 3-5,
over the node and at most one partner); a strategy only decides the timing. It is called from three places,
each with its own methods:

- the trainer thread, at every outer step: :meth:`PairingStrategy.partner` returns the partner's payload to blend
  with (or None: a solo step), and :meth:`PairingStrategy.after_blend` sees the blend's result before it is
  applied (overlap mode publishes its next offer from it);
- the gRPC server's threads: :meth:`PairingStrategy.open_session` for a peer's incoming exchange call,
  :meth:`PairingStrategy.complete_payload` for a partner's payload before its check, and
  :meth:`PairingStrategy.ready` for the DHT record;
- the event loop: :meth:`PairingStrategy.run`, a background task (supervised by the node) for strategies that
  exchange between outer steps.

Strategies: ``sync`` (pairing/sync.py), ``overlap`` (pairing/overlap.py) and ``stream`` (pairing/stream.py);
another one implements this class and is registered in node/peering.py's ``STRATEGIES``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from noloco_node.discovery.dht import Discovery
from noloco_node.observability.telemetry import Telemetry
from noloco_node.pairing.caller import PeerCaller
from noloco_node.rpc.contracts import ExchangeSession
from noloco_node.training.replica import Replica
from noloco_node.wire.codecs import ENCODED_WIRE_DTYPES, encode_into, wire_num_bytes
from noloco_node.wire.frames import WIRE_DTYPES, PayloadKind, build_manifest
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import BufferPool, Published

log = logging.getLogger(__name__)


class OfferPublisher:
    """Copies of one kind of this node's payloads (wire/frames.py ``PayloadKind``: the weights of sync and overlap
    mode, a stream run's phase or progress payload) in the kind's wire dtype, published for exchanges
    (copy-on-publish: wire/published.py). The conversion to the wire dtype happens once here, not once per
    exchange, and the streams send straight from these buffers."""

    def __init__(
        self,
        kind: PayloadKind,
        *,
        run_fingerprint: str,
        peer_id: Callable[[], str],
        pinned: bool = False,
        phase_tokens: int = 0,
    ) -> None:
        self.kind = kind
        self.run_fingerprint = run_fingerprint
        self.peer_id = peer_id
        self.phase_tokens = phase_tokens  # what every manifest claims this node trains per phase (receipts name it)
        shapes = [item.shape for item in kind.layout]
        if kind.wire_dtype in ENCODED_WIRE_DTYPES:  # published as encoded bytes, once, whoever streams them
            self.pool = BufferPool(
                [(wire_num_bytes(item.numel, kind.dtype_of(item)),) for item in kind.layout],
                torch.uint8,
                encode=lambda buffer, source: encode_into(source, kind.wire_dtype, buffer),
            )
        else:
            self.pool = BufferPool(shapes, WIRE_DTYPES[kind.wire_dtype][1], pinned=pinned)

    def publish(self, parts: Mapping[str, Sequence[torch.Tensor]], outer_step: int) -> Published:
        """A held copy of the kind's parts (``{"theta": ..., "phi": ..., "delta": ...}``; parts the kind does not
        carry are ignored) as of ``outer_step``; release it when it is superseded."""
        sources = [tensor for part in self.kind.parts for tensor in parts[part]]
        if len(sources) != len(self.kind.layout):
            raise ValueError(f"{len(sources)} tensors for a {self.kind.name} payload of {len(self.kind.layout)}")
        manifest = build_manifest(
            self.kind.layout,
            wire_dtype=self.kind.wire_dtype,
            run_fingerprint=self.run_fingerprint,
            peer_id=self.peer_id(),
            outer_step=outer_step,
            phase_tokens=self.phase_tokens,
        )
        return self.pool.publish(sources, manifest=manifest)


@dataclass
class PairingContext:
    """What a strategy works with; built by the node (node/daemon.py)."""

    peer_id: Callable[[], str]
    caller: PeerCaller
    discovery: Discovery
    telemetry: Telemetry
    offers: dict[str, OfferPublisher]  # by payload kind (node/run_layout.py ``payload_kinds``)
    publish_record: Callable[[], Coroutine[Any, Any, None]]  # refresh this node's DHT record (its readiness)
    stopping: threading.Event
    pair_timeout: float
    alone_grace: float
    max_staleness: int
    exchange_ceiling: float  # the longest one exchange may take, whatever its deadline
    loop: asyncio.AbstractEventLoop | None = None  # set when the node's event loop runs

    def spawn(self, coroutine: Coroutine[Any, Any, None], what: str) -> Future[None]:
        """Run ``coroutine`` on the node's event loop from another thread. Its end is always read: an error is
        logged with its traceback and counted (``noloco_background_errors``), a cancellation is not an error."""
        assert self.loop is not None
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        metrics = self.caller.settings.metrics

        def ended(done: Future[None]) -> None:
            if done.cancelled():
                return
            error = done.exception()
            if error is not None:
                metrics.background_error(what)
                log.error("%s failed", what, exc_info=error)

        future.add_done_callback(ended)
        return future


class PairingStrategy(ABC):
    mode: str

    def __init__(self, ctx: PairingContext) -> None:
        self.ctx = ctx

    # ---------------------------------------------------------------------------------- gRPC threads

    @abstractmethod
    def ready(self) -> bool:
        """Whether peers may call now (published in the DHT record)."""

    def next_step_at(self) -> float:
        """When this node's next outer step is due, in DHT time, for its record: peers ask only those due near
        their own (pairing/reserved.py). 0: not known, or nothing in this mode depends on it."""
        return 0.0

    @abstractmethod
    def open_session(self, partner_id: str, partner_outer_step: int, kind: str) -> ExchangeSession | None:
        """A session for an incoming exchange of payloads of ``kind`` from ``partner_id`` (a proven id), or None:
        busy (ABORTED)."""

    def complete_payload(self, payload: Payload) -> Payload:
        """gRPC or exchange thread, before the norm check: the payload to blend, made whole from what this strategy
        received earlier (a stream run's progress with the partner's phase payload). Raises PayloadError when it
        cannot be; the payload's buffers are then released. By default the payload is whole."""
        return payload

    # ---------------------------------------------------------------------------------- event loop

    async def run(self) -> None:  # noqa: B027 - a strategy without background work keeps this default
        """Background work between outer steps (a supervised task); returns at once by default."""

    # ---------------------------------------------------------------------------------- trainer thread

    def start(self, replica: Replica) -> None:  # noqa: B027
        """Before the first inner phase (the replica is resumed or downloaded by now)."""

    @abstractmethod
    def partner(
        self, replica: Replica, phase_seconds: float, train_step: Callable[[], bool] | None = None
    ) -> Payload | None:
        """At an outer step: the partner's payload to blend with, or None for a solo step. While it waits, a
        strategy may call ``train_step`` (one inner step; False when no more may be taken) instead of idling."""

    def after_blend(  # noqa: B027
        self,
        new_phi: Sequence[torch.Tensor],
        new_delta: Sequence[torch.Tensor],
        theta: Sequence[torch.Tensor],
        old_phi: Sequence[torch.Tensor],
        next_outer_step: int | None,
    ) -> None:
        """The blend's result, before the replica adopts it (theta and old_phi are still the live tensors), and the
        outer step that ends the next phase: None when the node trains no further phase (its run is done, or it is
        stopping), so that it offers no peer a phase it will not train."""

    def checkpoint_state(self) -> dict[str, Any]:
        """Trainer thread: what the strategy keeps across a restart, saved with the checkpoint (tensors nobody
        writes again: the checkpoint writer reads them later). Nothing by default."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Before the first phase: what :meth:`checkpoint_state` saved, from the checkpoint the node resumed."""

    def state_replaced(self) -> None:  # noqa: B027
        """Trainer thread: the replica adopted another state (a donor's, or its checkpoint on a rollback)."""

    def interrupt(self) -> None:  # noqa: B027
        """The node is stopping: a trainer waiting in :meth:`partner` returns at once."""

    def close(self) -> None:  # noqa: B027
        """The node has stopped: release what the strategy still holds."""
