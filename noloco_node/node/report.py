"""What a node says about itself: its status document, its answer to a peer's Info call, progress lines, and
the view of the swarm it keeps fresh for its status page.

Everything here reads numbers the node already has (telemetry.py, exchange.ExchangeMetrics, the replica's
counters); nothing runs torch, so serving it costs the trainer nothing (`noloco-node bench status` measures that).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from noloco_node import __version__
from noloco_node.config.models import TrainConfig
from noloco_node.config.node_config import NodeConfig
from noloco_node.discovery.dht import Discovery, PeerRecord
from noloco_node.model.source import ModelSource
from noloco_node.node.reach import Reach
from noloco_node.node.security import NodeSecurity
from noloco_node.observability.status import (
    DiscoveryStatus,
    ExchangeRecord,
    Health,
    KnownPeer,
    NodeStatus,
    OuterStepRecord,
    SecurityStatus,
    TaskStatus,
)
from noloco_node.observability.telemetry import Telemetry
from noloco_node.rpc.client import REFUSED, fetch_info
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.transport import PLAIN, Transport
from noloco_node.training.replica import Replica
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.payload import Payload

if TYPE_CHECKING:  # the protocol's type only: what a node reports on, not an import of the pairing package
    from noloco_node.pairing.peer_policy import PeerPolicy
    from noloco_node.pairing.standing import Standing

log = logging.getLogger("noloco_node.node.daemon")  # progress lines read as the node's own
SHOWN_QUARANTINED = 100  # quarantined peers listed in the status at most (a flood of keys must not grow it)


class TaskView(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def restarts(self) -> int: ...

    @property
    def last_error(self) -> str | None: ...

    @property
    def gave_up(self) -> bool: ...


class Supervised(Protocol):
    @property
    def tasks(self) -> Mapping[str, TaskView]: ...


class ReportedNode(Protocol):
    """What a node exposes to be reported on (node/daemon.Node); a protocol, so this module imports no node."""

    peer_id: str
    run_fingerprint: str
    address: str
    reach: Reach
    status_url: str
    dht_maddrs: list[str]
    cfg: NodeConfig
    train_cfg: TrainConfig
    source: ModelSource
    telemetry: Telemetry
    metrics: ExchangeMetrics
    security: NodeSecurity
    standing: Standing
    policy: PeerPolicy
    discovery: Discovery

    @property
    def supervisor(self) -> Supervised: ...

    @property
    def replica(self) -> Replica | None: ...

    def ready_to_pair(self) -> bool: ...

    def health(self) -> Health: ...


def info_reply(node: ReportedNode) -> pb.InfoReply:
    """The answer to a peer's Info call: who this node is, how far it is, and its recent curve."""
    replica = node.replica
    train_loss, val_loss = node.telemetry.train_loss(), node.telemetry.val_loss()
    return pb.InfoReply(
        peer_id=node.peer_id,
        run_fingerprint=node.run_fingerprint,
        outer_step=replica.outer_step if replica else 0,
        inner_step=replica.inner_step if replica else 0,
        ready_to_pair=node.ready_to_pair(),
        health=str(node.health()),
        version=__version__,
        train_loss=train_loss,
        val_loss=val_loss,
        history=[
            pb.LossPoint(
                inner_step=point.inner_step,
                train_loss=point.train_loss,
                val_loss=math.nan if point.val_loss is None else point.val_loss,
                time=point.time,
            )
            for point in node.telemetry.loss_points(100)
        ],
    )


def node_status(node: ReportedNode) -> NodeStatus:
    """What GET /status serves and status.json holds; plain numbers only, cheap enough for any event loop."""
    replica = node.replica
    counters = node.metrics.snapshot()
    val_loss = node.telemetry.val_loss()
    last_checkpoint = node.telemetry.last_checkpoint
    peers = node.telemetry.known_peers()
    return NodeStatus(
        peer_id=node.peer_id,
        run_name=node.cfg.run_name,
        run_fingerprint=node.run_fingerprint,
        version=__version__,
        mode=node.cfg.mode,
        model_size=node.source.name,
        address=node.address,
        reachable=node.reach.reachable,
        **node.reach.status(),
        status_url=node.status_url,
        dht_maddrs=node.dht_maddrs,
        started_at=node.telemetry.started,
        training_started_at=node.telemetry.training_started,
        uptime_seconds=time.time() - node.telemetry.started,
        inner_step=replica.inner_step if replica else 0,
        outer_step=replica.outer_step if replica else 0,
        total_steps=node.train_cfg.total_steps,
        learning_rate=node.telemetry.learning_rate,
        train_loss=node.telemetry.train_loss(),
        val_loss=val_loss,
        val_perplexity=math.exp(min(val_loss, 50.0)) if val_loss is not None else None,
        tokens_per_second=node.telemetry.tokens_per_second(),
        grad_norm=node.telemetry.grad_norm(),
        step_plan=node.telemetry.step_plan,
        comm_wait_fraction=node.telemetry.comm_wait_fraction(),
        blends=node.telemetry.blends_since_start,
        outer_steps_behind=steps_behind(
            replica.outer_step if replica else 0, [p for p in peers if node.standing.believable(p.peer_id)]
        ),
        refusing_peers=refusing_peers(counters["recent"], node.standing.established),
        peak_rss_mb=peak_rss_mb(),
        checkpoint_age_seconds=time.time() - last_checkpoint if last_checkpoint else None,
        bytes_sent=counters["bytes_sent"],
        bytes_received=counters["bytes_received"],
        exchange_outcomes=counters["outcomes"],
        rejected_payloads=counters["rejected"],
        calls_in_use=counters["calls_in_use"],
        background_errors=counters["background_errors"],
        receipts=counters["receipts"],
        exchanges=[ExchangeRecord(**entry) for entry in counters["recent"][-20:]],
        peers=peers,
        discovery=DiscoveryStatus(**node.discovery.describe()) if node.discovery.dht is not None else None,
        refused_peers=list(node.telemetry.refused_starts.values()),
        quarantined_peers=node.policy.quarantined_now(SHOWN_QUARANTINED),
        history=[OuterStepRecord(**entry) for entry in node.telemetry.history_list(200)],
        security=security_status(node),
        tasks=[
            TaskStatus(name=t.name, restarts=t.restarts, last_error=t.last_error, gave_up=t.gave_up)
            for t in node.supervisor.tasks.values()
        ],
        health=node.health(),
    )


def steps_behind(own_outer_step: int, peers: list[KnownPeer]) -> int | None:
    """How far the furthest of ``peers`` is ahead of this node, in outer steps (0 when none is); None without peers.
    The caller passes the peers whose claims count (Standing.believable): a free key dated far ahead would otherwise
    set off the alert on an honest node."""
    if not peers:
        return None
    return max(0, max(peer.outer_step for peer in peers) - own_outer_step)


def refusing_peers(recent: list[dict[str, Any]], established: Callable[[str], bool]) -> int:
    """Peers with standing whose last answer among these exchanges (oldest first) was a refusal of this node. With
    standing only: free keys that refuse every call could otherwise page an operator about an honest node."""
    last: dict[str, str] = {}
    for entry in recent:
        if entry["role"] == "caller":
            last[entry["peer"]] = entry["outcome"]
    return sum(1 for peer, outcome in last.items() if outcome == REFUSED and established(peer))


def peak_rss_mb() -> float | None:
    """This process's peak resident memory (VmHWM), in MB; None where /proc is missing. Not getrusage's ru_maxrss:
    Linux carries that across exec, so a node started by a 550 MB test runner reported the runner's 550 MB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def security_status(node: ReportedNode) -> SecurityStatus:
    guard, tls = node.security.norm_guard, node.security.transport.tls
    return SecurityStatus(
        private_run=node.security.secret is not None,
        tls=tls is not None,
        mutual_tls=tls is not None and tls.ca is not None,
        norm_bound=guard.bound(),
        norm_bound_basis=guard.basis,
        last_partner_distance=guard.last_distance,
        last_partner_tensor_ratio=guard.last_tensor_ratio,
        established_peers=sum(node.standing.established(peer.peer_id) for peer in node.telemetry.known_peers()),
        stranger_share=node.standing.stranger_share,
        stranger_steps=node.standing.stranger_steps,
    )


class ProgressLog:
    """One line per outer step at most every ``every`` seconds, summing up the steps in between: a person watching
    the terminal follows along, and a week-long run does not fill a disk with tiny-model steps."""

    def __init__(self, *, every: float, total_steps: int) -> None:
        self.every = every
        self.total_steps = total_steps
        self._last_line = 0.0  # monotonic time of the last line (0: none yet)
        self._since: dict[str, Any] = {"outer_steps": 0, "blends": 0, "waited": 0.0}

    def outer_step(self, entry: dict[str, Any], partner: Payload | None, tokens_per_second: float | None) -> None:
        since = self._since
        since["outer_steps"] += 1
        since["blends"] += partner is not None
        since["waited"] += entry["wait_seconds"]
        last = entry["inner_step"] >= self.total_steps
        now = time.monotonic()
        if self._last_line and not last and now - self._last_line < self.every:
            return
        log.info(
            "outer step %d (inner %d/%d): train %.4f val %.4f (ppl %.2f), %s; %s, waited %.1fs, %s tokens/s",
            entry["outer_step"],
            entry["inner_step"],
            self.total_steps,
            entry["train_loss"],
            entry["val_loss"],
            math.exp(min(entry["val_loss"], 50.0)),
            f"blended with {partner.peer_id[-8:]} (step {partner.outer_step})" if partner else "solo step",
            f"{since['blends']}/{since['outer_steps']} outer steps blended since the last line",
            since["waited"],
            "-" if tokens_per_second is None else f"{tokens_per_second:.0f}",
        )
        self._last_line = now
        self._since = {"outer_steps": 0, "blends": 0, "waited": 0.0}


REMEMBER_SECONDS = 600.0  # how long the watch keeps asking a peer with standing that the DHT no longer lists
VOUCHED_EVERY = 1.0  # the watch's period while such a peer answers and the DHT still does not list it
MAX_REMEMBERED = 64


async def watch_peers(
    discovery: Discovery,
    telemetry: Telemetry,
    run_fingerprint: str,
    run_name: str,
    every: float = 3.0,
    starts_every: float = 30.0,
    max_info_calls: int = 16,
    transport: Transport = PLAIN,
    answered_again: Callable[[str], object] = lambda _peer: None,
    vouch_for: Callable[[str], bool] = lambda _peer: False,
) -> None:
    """Keep the view of the swarm fresh for the status page: DHT records, then each peer's Info (its curve). A peer
    whose Info failed and now answers is reported to ``answered_again`` (the path to it is whole again: pairing's
    peer_policy.py calls it again at once).

    A peer ``vouch_for`` accepts (one with standing) that the DHT stops listing is still asked, at its last
    address, for up to REMEMBER_SECONDS: a partition expires the far side's records, and after the heal the DHT
    takes 10-20 s to list them again. When it answers as itself, of this run, the DHT listing is renewed from its
    answer (discovery/vouched.py), so that pairing and the swarm's clock (pairing/standing.py swarm_step) see it within
    a watch round of the heal. Strangers are never vouched for: their records come from the DHT alone.

    Other starts of the run name change only when someone starts anew, mostly when a run's members start together:
    they are looked up every ``every`` s at first, the interval doubling up to ``starts_every`` s, so that a node
    started from another model is named within seconds of the start, not half a minute later."""
    starts_due, starts_interval = 0.0, every
    silent: set[str] = set()  # peers whose last Info failed (live ones only: bounded by the swarm)
    # The outer step each listed peer's last Info answered with: its curve gains a point only at an outer step, so a
    # listed peer is asked again once its record shows a later one (or it was silent). Asked every round, 16 peers
    # every 3 s, Info was the larger part of a member's own networking CPU at 32 members on one machine.
    answered_at: dict[str, int] = {}
    remembered: dict[str, tuple[PeerRecord, float]] = {}  # peers with standing: last record, when last listed
    while True:
        round_started = time.monotonic()
        records: list[PeerRecord] = []
        try:
            records = await discovery.live_peers()
            telemetry.on_peers(records)
            if time.monotonic() >= starts_due:
                telemetry.on_other_starts(await discovery.other_starts(), run_name, discovery.run_start)
                starts_due = time.monotonic() + starts_interval
                starts_interval = min(2 * starts_interval, starts_every)
        except (TimeoutError, OSError) as error:
            log.debug("DHT lookup for the status page failed: %s", error)
        # Asked (and vouched for again, with the step it answers) each round until the DHT lists it again.
        absent = _remember(remembered, [r for r in records if not discovery.vouched.holds(r.peer_id)], vouch_for)
        peers = telemetry.peer_addresses()
        random.shuffle(peers)
        unlisted_ids = {r.peer_id for r in absent}
        listed_steps = {r.peer_id: r.outer_step for r in records}
        asks = [
            *((r.peer_id, r.address, r) for r in absent),
            *(
                (p, a, None)
                for p, a in peers
                if p not in unlisted_ids
                and (p in silent or p not in answered_at or listed_steps.get(p, -1) > answered_at[p])
            ),
        ]
        asks = asks[:max_info_calls]

        async def ask(peer_id: str, address: str, unlisted: PeerRecord | None) -> pb.InfoReply | None:
            """Ask one peer's Info; the reply when it vouched for an unlisted peer (else None)."""
            try:
                reply = await asyncio.wait_for(
                    asyncio.to_thread(fetch_info, address, timeout=2.0, transport=transport, peer_id=peer_id),
                    timeout=3.0,
                )
            except Exception as error:  # an unreachable peer is shown without its curve, not an error here
                log.debug("Info from %s failed: %r", peer_id[-8:], error)
                silent.add(peer_id)
                return None
            if reply.peer_id != peer_id or reply.run_fingerprint != run_fingerprint:
                return None
            if unlisted is not None:
                if not discovery.vouched.holds(peer_id):
                    log.info("%s answers while the DHT does not list it: listed from its answers", peer_id[-8:])
                discovery.vouched.vouch(
                    replace(
                        unlisted,
                        outer_step=reply.outer_step,
                        inner_step=reply.inner_step,
                        ready=reply.ready_to_pair,
                        updated=time.time(),
                    )
                )
            telemetry.on_info(peer_id, reply)
            answered_at[peer_id] = reply.outer_step
            if peer_id in silent:
                silent.discard(peer_id)
                answered_again(peer_id)
            return reply if unlisted is not None else None

        replies = await asyncio.gather(*(ask(*entry) for entry in asks))
        vouched = [(entry[0], reply) for entry, reply in zip(asks, replies, strict=True) if reply is not None]
        if vouched:
            with contextlib.suppress(TimeoutError, OSError):
                telemetry.on_peers(await discovery.live_peers())  # the vouched ones, at once, with their steps
                for peer_id, reply in vouched:
                    telemetry.on_info(peer_id, reply)
        silent.intersection_update([*(peer_id for peer_id, _address in peers), *(r.peer_id for r in absent)])
        for gone in answered_at.keys() - {peer_id for peer_id, _address in peers}:
            del answered_at[gone]
        # A round every ``every`` s, however long its calls took (a silent peer's Info times out after 3 s: waiting
        # that and then ``every`` more would ask a cut-off peer only every 6 s); every second while a peer with
        # standing is listed from its own answers alone, whose step the listing then lags by a second at most
        # (a partner must be within --max-staleness outer steps).
        period = VOUCHED_EVERY if vouched else every
        await asyncio.sleep(max(0.5, period - (time.monotonic() - round_started)))


def _remember(
    remembered: dict[str, tuple[PeerRecord, float]], records: list[PeerRecord], vouch_for: Callable[[str], bool]
) -> list[PeerRecord]:
    """Update the peers with standing the watch keeps asking (listed now: their record, and now), forget those
    unlisted for REMEMBER_SECONDS and the oldest beyond MAX_REMEMBERED; returns those the DHT does not list."""
    now = time.monotonic()
    listed = {r.peer_id for r in records}
    for record in records:
        if vouch_for(record.peer_id):
            remembered[record.peer_id] = (record, now)
    for peer_id in [p for p, (_r, seen) in remembered.items() if now - seen > REMEMBER_SECONDS]:
        del remembered[peer_id]
    while len(remembered) > MAX_REMEMBERED:
        del remembered[min(remembered, key=lambda p: remembered[p][1])]
    return [record for peer_id, (record, _seen) in remembered.items() if peer_id not in listed]
