"""Who may hold what on a node's server: slots per kind of call, per proven peer and per remote address, and the
bar on addresses and peers whose calls stalled or trickled.

One outsider must not be able to do more than waste its own slot (docs/threat-model.md has what idle streams and
a silent caller did before this existed). So:

- **Slots per kind.** Exchanges, state downloads and Info each have their own slots: streams of one kind, however
  many, never take the slots of another, so Info and GetState stay answerable while exchanges are full.
- **Per proven peer** (security/caller_proof.py): one exchange and one download at a time. **Per remote address**:
  at most ``per_address`` calls of each kind at once (a few honest peers may share a NAT; one host cannot take
  every slot by minting keys). The address is the caller's network group (noloco_node/addresses.py, given by
  rpc/call_gate.py): a machine with a whole /24 or /48 is still one address here.
- **Stalls.** An exchange that moves no byte for ``stall_seconds``, or moves its bytes below the minimum link rate,
  is cut by the watchdog (rpc/transport.py); its peer and its address are *barred* from new exchanges at the cut,
  before the caller hears of it, for ``bar_seconds`` after the first cut and twice as long after each further one
  (up to ``max_bar_seconds``). A silent stream is the same: no manifest within ``stall_seconds``; and a trickle
  that never quite stalls is cut for its rate, so it earns the bar too. The bar only refuses what the address
  would be *served*; this node may still call a peer there. An honest peer whose link died meanwhile loses a few
  rounds of being called in, not its place.

Memory is bounded: tables of at most ``MAX_TRACKED`` keys, the oldest forgotten first.
"""

from __future__ import annotations

import contextlib
import ipaddress
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from noloco_node.errors import NolocoError

EXCHANGE, DOWNLOAD, INFO, ROLLOUTS, RECEIPTS = "exchange", "download", "info", "rollouts", "receipts"
MAX_TRACKED = 4096


def remote_host(peer: str) -> str:
    """The host of a grpc ``context.peer()`` string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, ``unix:...``); an IPv4
    caller of a dual-stack server (``ipv6:[::ffff:1.2.3.4]:5``) as its IPv4 address."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        host = rest[1 : rest.find("]")] if "]" in rest else rest
        with contextlib.suppress(ValueError):
            mapped = ipaddress.IPv6Address(host).ipv4_mapped
            return str(mapped) if mapped is not None else host
        return host
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer


class Refused(NolocoError):  # noqa: N818  (a decision, not a failure: the caller is told why and tries elsewhere)
    """A call admission refused; ``reason`` is short, for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Ticket:
    """A slot held by one call; give it back with ``Admission.leave``."""

    kind: str
    peer: str | None
    address: str


@dataclass
class _Bar:
    strikes: int
    until: float  # monotonic


class Admission:
    def __init__(
        self,
        *,
        slots: dict[str, int],
        per_address: int = 4,
        bar_seconds: float = 30.0,
        max_bar_seconds: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slots = dict(slots)
        self._clock = clock
        self.per_address = per_address
        self.bar_seconds = bar_seconds
        self.max_bar_seconds = max_bar_seconds
        self._lock = threading.Lock()
        self._in_use = dict.fromkeys(self.slots, 0)
        self._by_peer: dict[tuple[str, str], int] = {}
        self._by_address: dict[tuple[str, str], int] = {}
        self._bars: OrderedDict[str, _Bar] = OrderedDict()

    def enter(self, kind: str, *, peer: str | None, address: str) -> Ticket:
        """A slot for one call of ``kind``, or Refused (barred, or the kind, peer or address is at its limit)."""
        now = self._clock()
        with self._lock:
            if kind == EXCHANGE:
                for what, key in (("peer", f"peer:{peer}" if peer else ""), ("address", f"address:{address}")):
                    bar = self._bars.get(key)
                    if bar is not None and bar.until > now:
                        raise Refused(
                            "barred",
                            f"refused for {bar.until - now:.0f}s more: "
                            f"an earlier call from this {what} stalled or trickled",
                        )
            if peer is not None and kind != INFO and self._by_peer.get((kind, peer), 0) >= 1:
                raise Refused("per_peer", f"busy: this peer already has a {kind} call in progress")
            if self._in_use[kind] >= self.slots[kind]:
                raise Refused("no_slot", f"busy: all {self.slots[kind]} {kind} slots are in use")
            if self._by_address.get((kind, address), 0) >= self.per_address:
                raise Refused("per_address", f"busy: {self.per_address} {kind} calls from this address already")
            self._in_use[kind] += 1
            if peer is not None:
                self._by_peer[(kind, peer)] = self._by_peer.get((kind, peer), 0) + 1
            self._by_address[(kind, address)] = self._by_address.get((kind, address), 0) + 1
        return Ticket(kind, peer, address)

    def leave(self, ticket: Ticket) -> None:
        with self._lock:
            self._in_use[ticket.kind] -= 1
            keys: list[tuple[dict[tuple[str, str], int], tuple[str, str]]] = [
                (self._by_address, (ticket.kind, ticket.address))
            ]
            if ticket.peer is not None:
                keys.append((self._by_peer, (ticket.kind, ticket.peer)))
            for table, key in keys:
                left = table.get(key, 0) - 1
                if left > 0:
                    table[key] = left
                else:
                    table.pop(key, None)

    def bar(self, ticket: Ticket) -> float:
        """A call of this ticket was cut for stalling or trickling: bar its peer and its address from new exchanges
        (doubling each time); returns the address's bar in seconds."""
        now = self._clock()
        seconds = 0.0
        with self._lock:
            for key in (f"peer:{ticket.peer}" if ticket.peer else None, f"address:{ticket.address}"):
                if key is None:
                    continue
                bar = self._bars.pop(key, None) or _Bar(0, now)
                if now > bar.until + self.max_bar_seconds:
                    bar.strikes = 0  # a stall long forgotten: start again from the shortest bar
                bar.strikes += 1
                seconds = min(self.max_bar_seconds, self.bar_seconds * 2 ** (bar.strikes - 1))
                bar.until = now + seconds
                self._bars[key] = bar  # newest last: the oldest are forgotten first
            while len(self._bars) > MAX_TRACKED:
                self._bars.popitem(last=False)
        return seconds

    def in_use(self) -> dict[str, int]:
        with self._lock:
            return dict(self._in_use)
