"""The swarm member: an asyncio daemon (uvloop) that trains one replica and blends with random peers.

Start order (DESIGN.md): the Hivemind DHT first (it forks a helper process), then the gRPC server (threads), then
the trainer thread; shutdown on SIGINT/SIGTERM runs in reverse: the trainer stops at the next step boundary, a
final checkpoint is written, the DHT record is replaced by a tombstone, the gRPC server and the DHT stop.

Each outer step blends with ``algorithm.noloco_outer_step`` (arXiv 2506.10911, eq. 3-5) over the group that
actually answered: this node plus the partner whose payload arrived whole, or this node alone.

Pairing modes (DESIGN.md, "Asynchrony"):

- ``sync``: at its outer step the node opens a *pairing round* and advertises itself ready. Incoming calls and
  its own calls to random ready peers race for the round's exchange lock, which is only ever *tried*, never
  waited on: a node busy with one exchange answers every other call with ABORTED at once, so two nodes that call
  each other simultaneously both get a fast refusal and retry with random jitter instead of deadlocking. The
  first exchange that completes is the partner; after ``pair_timeout`` without one the node takes a solo step.
- ``overlap``: no waiting. After its outer step the node offers its projected fast weights (phi + last Delta);
  during the next inner phase a background task swaps offers with a random peer, and at the next outer step the
  node blends with the freshest offer it holds that is within ``max_staleness`` outer steps.

Torch compute (inner steps, the blend, snapshots) runs only in the trainer thread or gRPC worker threads; the
event loop only talks to the DHT and schedules exchanges, each under a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import random
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from noloco_node import algorithm
from noloco_node.config.models import DataConfig, ModelConfig, NodeConfig, OuterConfig, TrainConfig, model_config_for
from noloco_node.data.corpus import Corpus, ReplicaShard, load_corpus, validation_batches
from noloco_node.discovery.dht import Discovery, PeerRecord, expand_bootstrap
from noloco_node.discovery.reachability import announce_host, check_reachable
from noloco_node.model.decoder import LlamaDecoder, named_parameters_ordered, run_fingerprint
from noloco_node.observability import report
from noloco_node.observability.http_server import StatusServer, status_page
from noloco_node.observability.metrics import render_metrics
from noloco_node.observability.status import Health, NodeStatus
from noloco_node.observability.telemetry import KEEP_OUTER_STEPS, HealthInputs, Telemetry
from noloco_node.pairing.peer_policy import PeerPolicy
from noloco_node.pairing.rounds import OfferBook, PairingRound
from noloco_node.rpc import peer_pb2 as pb
from noloco_node.rpc.client import ExchangeError, Outgoing, exchange_with
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.service import start_server
from noloco_node.rpc.state_download import StateDownload
from noloco_node.security.node_security import NodeSecurity, SecuritySetupError
from noloco_node.training.data_parallel import DataParallel, run_follower, weights_digest
from noloco_node.training.replica import Replica, load_checkpoint, save_checkpoint
from noloco_node.wire.payload import Payload, PayloadError, ReceiveBuffers, TensorLayout, build_manifest

log = logging.getLogger(__name__)


def emulated_step_factor(rng: np.random.Generator, sigma: float) -> float:
    """A log-normal factor of mean 1 (mu = -sigma^2 / 2): how much longer or shorter this inner step takes."""
    return float(rng.lognormal(-sigma * sigma / 2, sigma)) if sigma > 0 else 1.0


def run_identity(node_cfg: NodeConfig, train_cfg: TrainConfig, corpus: Corpus) -> tuple[ModelConfig, str]:
    """The model a node of these settings trains and its run's fingerprint (the DHT namespace and pairing key):
    `export --from swarm` computes the same pair to find the run."""
    model_cfg = model_config_for(train_cfg.model_size, vocab_size=corpus.vocab_size, max_seq_len=train_cfg.seq_len)
    fingerprint = run_fingerprint(
        model_cfg, run_name=node_cfg.run_name, seed=train_cfg.seed, tokenizer=corpus.tokenizer.fingerprint
    )
    return model_cfg, fingerprint


class NodeError(Exception):
    """A node that cannot start as configured (the message says why and what to change)."""


class Node:
    """One swarm member. Implements exchange.PeerNode for the gRPC service."""

    def __init__(self, node_cfg: NodeConfig, train_cfg: TrainConfig, outer_cfg: OuterConfig, data_cfg: DataConfig):
        self.cfg = node_cfg
        self.train_cfg = train_cfg
        self.outer_cfg = outer_cfg
        self.data_cfg = data_cfg
        self.corpus = load_corpus(data_cfg)
        self.model_cfg, self.run_fingerprint = run_identity(node_cfg, train_cfg, self.corpus)
        self.gamma = outer_cfg.effective_gamma
        self.send_phi = self.gamma != outer_cfg.beta  # the fast path needs only the partner's fast weights
        with torch.device("meta"):
            shapes_model = LlamaDecoder(self.model_cfg)
        self._param_shapes = [(n, tuple(p.shape)) for n, p in named_parameters_ordered(shapes_model)]
        self.metrics = ExchangeMetrics()
        self.receive_buffers = ReceiveBuffers(max_idle_bytes=self.max_payload_bytes())
        try:
            self.security = NodeSecurity(node_cfg.security, node_cfg.data_dir)
        except SecuritySetupError as error:
            raise NodeError(str(error)) from None
        self.discovery = Discovery(
            self.run_fingerprint,
            initial_peers=node_cfg.bootstrap,
            host_maddrs=node_cfg.dht_host_maddrs,
            announce_maddrs=node_cfg.dht_announce_maddrs or None,
            record_ttl=node_cfg.record_ttl,
            client_mode=node_cfg.dht_client_mode,
            identity=self.security.identity,
            secret=self.security.secret,
        )
        self.peer_id = ""
        self.address = ""
        self.reachable = True  # until the self-check says otherwise
        self.shard: int | None = None  # chosen at start (_choose_shard)
        self.replica: Replica | None = None
        self.stop_event = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._round: PairingRound | None = None  # sync mode: the open pairing round, if any
        self._offers = OfferBook()  # overlap mode
        self._snapshot: tuple[Outgoing, int] | None = None
        self.policy = PeerPolicy(
            exchange_timeout=self.exchange_ceiling(),
            min_deadline=node_cfg.min_exchange_deadline,
            avoid_seconds=node_cfg.avoid_seconds,
        )
        self._last_paired: dict[str, int] = {}  # peer id -> outer step of the last blend with it
        self._last_partner: str | None = None
        self._known_peers: set[str] = set()  # live peers of the run at the last DHT lookup
        self.telemetry = Telemetry(
            tokens_per_step=train_cfg.batch_size * train_cfg.seq_len,
            degraded_after=node_cfg.degraded_after,
            stall_after=node_cfg.stall_after,
        )
        self.data_parallel: DataParallel | None = None  # rank 0 of a multi-process member (data_parallel.py)
        self._ranks_stopped = False
        self.trainer: threading.Thread | None = None
        self.trainer_error: BaseException | None = None
        self.status_url = ""
        self.dht_maddrs: list[str] = []
        self._progress = report.ProgressLog(every=node_cfg.log_every, total_steps=train_cfg.total_steps)

    # ------------------------------------------------------------------------------------------ PeerNode

    def expected_layout(self) -> list[TensorLayout]:
        """Known from the model config alone, so that a call arriving while the node starts is refused cleanly."""
        prefixes = ("theta", "phi") if self.send_phi else ("theta",)
        return [TensorLayout(f"{prefix}/{name}", shape) for prefix in prefixes for name, shape in self._param_shapes]

    def exchange_ceiling(self) -> float:
        """The longest an exchange may take: --exchange-timeout, or longer when the payload needs it at
        --min-link-rate (both directions share nothing on a full-duplex link, so one payload's time)."""
        payload = sum(layout.numel for layout in self.expected_layout()) * (2 if self.cfg.wire_dtype == "bf16" else 4)
        return max(self.cfg.exchange_timeout, payload / self.cfg.min_link_rate + 10.0)

    def download_timeout(self) -> float:
        """The deadline of one state download: the fp32 state (4 model-sized tensors) at --min-link-rate."""
        state = 4 * 4 * sum(math.prod(shape) for _, shape in self._param_shapes)
        return max(self.cfg.exchange_timeout, state / self.cfg.min_link_rate + 10.0)

    def max_payload_bytes(self) -> int:
        return sum(layout.numel for layout in self.expected_layout()) * 4 + 1024

    def open_session(self, partner_id: str, partner_outer_step: int) -> Any:
        if partner_id == self.peer_id:
            return None
        if self.cfg.mode == "overlap":
            return self._offers.try_session()
        current = self._round
        return None if current is None else current.try_session(partner_id, partner_outer_step, self.cfg.max_staleness)

    def info(self) -> pb.InfoReply:
        return report.info_reply(self)

    def state_snapshot(self) -> Outgoing | None:
        return self._snapshot[0] if self._snapshot else None

    def admit(self, payload: Payload) -> None:
        """The norm bound (payload_guard.py): the partner's tensors against this node's slow weights. Called from
        a gRPC or worker thread; in sync mode phi cannot change meanwhile (the trainer waits for the round)."""
        replica = self.replica
        if replica is None:
            return
        theta, phi = self._partner_tensors(payload)
        self.security.admit(payload, [(theta, replica.phi)] + ([(phi, replica.phi)] if phi else []))

    def refused_peer(self, partner_id: str) -> bool:
        return self.policy.quarantined(partner_id)

    def bad_payload(self, partner_id: str, error: PayloadError) -> None:
        self.security.bad_payload(partner_id, error, self.policy)

    # ------------------------------------------------------------------------------------------ state

    def ready_to_pair(self) -> bool:
        if self.cfg.mode == "overlap":
            return self._offers.offer is not None
        current = self._round
        return current is not None and current.open

    def health(self) -> Health:
        replica = self.replica
        dht = self.discovery.dht
        return self.telemetry.health(
            HealthInputs(
                trainer_started=self.trainer is not None,
                trainer_alive=self.trainer is not None and self.trainer.is_alive(),
                trainer_error=self.trainer_error,
                stopping=self.stop_event.is_set(),
                finished=replica is not None and replica.inner_step >= self.train_cfg.total_steps,
                dht_alive=dht is not None and dht.is_alive(),
            )
        )

    def status(self) -> NodeStatus:
        """What GET /status serves and status.json holds (report.py builds it)."""
        return report.node_status(self)

    def record(self) -> PeerRecord:
        replica = self.replica
        return PeerRecord(
            peer_id=self.peer_id,
            address=self.address,
            run_fingerprint=self.run_fingerprint,
            outer_step=replica.outer_step if replica else 0,
            inner_step=replica.inner_step if replica else 0,
            ready=self.ready_to_pair(),
            reachable=self.reachable,
            shard=-1 if self.shard is None else self.shard,
        )

    def _outgoing(self, theta: Sequence[torch.Tensor], phi: Sequence[torch.Tensor]) -> Outgoing:
        assert self.replica is not None
        named = [(f"theta/{n}", t) for n, t in zip(self.replica.names, theta, strict=True)]
        if self.send_phi:
            named += [(f"phi/{n}", t) for n, t in zip(self.replica.names, phi, strict=True)]
        manifest = build_manifest(
            named,
            wire_dtype=self.cfg.wire_dtype,
            run_fingerprint=self.run_fingerprint,
            peer_id=self.peer_id,
            outer_step=self.replica.outer_step,
        )
        return Outgoing(manifest, [t for _, t in named])

    def _take_snapshot(self) -> None:
        """The donor snapshot for joiners: a copy, so that serving never blocks training."""
        assert self.replica is not None
        named, metadata = self.replica.outer_snapshot()
        manifest = build_manifest(
            named,
            wire_dtype="fp32",
            run_fingerprint=self.run_fingerprint,
            peer_id=self.peer_id,
            outer_step=self.replica.outer_step,
            metadata_json=json.dumps(metadata),
        )
        self._snapshot = (Outgoing(manifest, [t for _, t in named]), self.replica.outer_step)

    # ------------------------------------------------------------------------------------------ outer step

    def _partner_tensors(self, payload: Payload) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        assert self.replica is not None
        theta = [payload.tensors[f"theta/{n}"] for n in self.replica.names]
        phi = [payload.tensors[f"phi/{n}"] for n in self.replica.names] if self.send_phi else []
        return theta, phi

    def _blend(self, partner: Payload | None) -> None:
        """The outer step over the group that answered; runs in the trainer thread."""
        replica = self.replica
        assert replica is not None
        peer_thetas, peer_phis = ([], [])
        if partner is not None:
            self._last_paired[partner.peer_id] = replica.outer_step
            self._last_partner = partner.peer_id
            theta, phi = self._partner_tensors(partner)
            peer_thetas, peer_phis = [theta], ([phi] if phi else [])
        new_phi, new_delta = algorithm.noloco_outer_step(
            replica.fast_weights(),
            replica.phi,
            replica.delta,
            peer_thetas,
            peer_phis,
            alpha=self.outer_cfg.alpha,
            beta=self.outer_cfg.beta,
            gamma=self.gamma,
        )
        if self.cfg.mode == "overlap":
            # The offer for the next phase: projected fast weights phi_new + (theta - phi_old), in fp32.
            projected = algorithm.projected_fast_weights(new_phi, replica.fast_weights(), replica.phi)
        replica.apply_outer_step(new_phi, new_delta)
        if self.cfg.mode == "overlap":
            self._offers.offer = self._outgoing(projected, replica.phi)

    def _sync_outer_step(self, phase_seconds: float) -> Payload | None:
        """Open a pairing round, wait for a partner at most pair_timeout, close the round; returns the partner."""
        replica = self.replica
        assert replica is not None and self.loop is not None
        # theta is stable while the trainer waits here, so the round sends the live weights without a copy.
        current = PairingRound(replica.outer_step, self._outgoing(replica.fast_weights(), replica.phi))
        if self._known_peers - {self._last_partner, None}:
            # Others exist: give them a moment to become ready before blending with the last partner again.
            grace = min(self.cfg.pair_timeout / 2, phase_seconds / 2)
            current.last_partner, current.repeat_after = self._last_partner, time.monotonic() + grace
        self._round = current
        seeker = asyncio.run_coroutine_threadsafe(self._seek_partner(current), self.loop)
        asyncio.run_coroutine_threadsafe(self._publish(), self.loop)
        deadline = time.monotonic() + self.cfg.pair_timeout
        # Wait for a partner, but not past a shutdown request: a leaving node does not sit out its pair timeout.
        while not current.done.wait(0.2) and not self.stop_event.is_set() and time.monotonic() < deadline:
            self.telemetry.beat()
        # An exchange still streaming holds the lock and finishes, bounded by its deadline.
        partner = current.close(wait_for_exchange=self.exchange_ceiling() + 5)
        self._round = None
        seeker.cancel()
        return partner

    def _overlap_partner(self) -> Payload | None:
        assert self.replica is not None
        return self._offers.take_freshest(self.replica.outer_step, self.cfg.max_staleness)

    # ------------------------------------------------------------------------------------------ trainer thread

    def _train(self) -> None:
        try:
            self._train_loop()
            replica = self.replica
            if (
                self.data_parallel is not None
                and not self._ranks_stopped
                and replica is not None
                and replica.inner_step < self.train_cfg.total_steps
            ):
                # Stopped between phases (during a pairing wait): the other ranks wait at their next step.
                self.data_parallel.agree_to_continue(True, replica.device)
        except BaseException as error:  # a dead trainer must be visible, not silent
            self.trainer_error = error
            log.exception("trainer thread failed")
        finally:
            self.stop_event.set()

    def _train_loop(self) -> None:
        replica = self.replica
        assert replica is not None
        if self.cfg.mode == "overlap" and self._offers.offer is None:
            self._offers.offer = self._outgoing([t.clone() for t in replica.fast_weights()], replica.phi)
        val = validation_batches(
            self.corpus.validation,
            seq_len=self.train_cfg.seq_len,
            batch_size=self.train_cfg.batch_size,
            num_batches=self.train_cfg.eval_batches,
        )
        H = self.train_cfg.inner_steps
        step_rng = np.random.default_rng(list(hashlib.sha256(self.peer_id.encode()).digest()[:8]))
        while replica.inner_step < self.train_cfg.total_steps and not self.stop_event.is_set():
            started = time.monotonic()
            losses = []
            while not self.stop_event.is_set() or self.data_parallel is not None:
                step_started = time.monotonic()
                # In a data-parallel member the stop is agreed with the other ranks at a step boundary.
                loss = replica.train_step(stop=self.stop_event.is_set())
                if loss is None:  # the ranks agreed to stop (any of them was asked to): the member stops
                    self._ranks_stopped = True
                    self.stop_event.set()
                    break
                losses.append(loss)
                if self.cfg.slow_factor > 1.0:  # fault injection: a straggler (a slower GPU, a busy machine)
                    time.sleep((self.cfg.slow_factor - 1.0) * (time.monotonic() - step_started))
                if self.cfg.step_time_seconds is not None:  # bench stragglers: log-normal step times
                    target = self.cfg.step_time_seconds * emulated_step_factor(step_rng, self.cfg.step_time_sigma)
                    time.sleep(max(0.0, target - (time.monotonic() - step_started)))
                self.telemetry.on_inner_step(
                    replica.inner_step, losses[-1], time.monotonic() - step_started, replica.current_lr
                )
                if self.cfg.fail_at_inner_step is not None and replica.inner_step >= self.cfg.fail_at_inner_step:
                    raise RuntimeError(f"injected fault at inner step {replica.inner_step} (fail_at_inner_step)")
                if replica.inner_step % H == 0 or replica.inner_step >= self.train_cfg.total_steps:
                    break
            if self.stop_event.is_set():
                break
            train_seconds = time.monotonic() - started
            wait_started = time.monotonic()
            partner = self._sync_outer_step(train_seconds) if self.cfg.mode == "sync" else self._overlap_partner()
            waited = time.monotonic() - wait_started
            blend_started = time.monotonic()
            self._blend(partner)
            blend_seconds = time.monotonic() - blend_started
            if partner is not None:
                partner.release()  # blended: its buffers can take the next outer step's payload
            if self.data_parallel is not None:
                self.data_parallel.broadcast_params(replica.params)  # the other ranks adopt theta = phi
            upkeep_started = time.monotonic()
            self._take_snapshot()
            upkeep_seconds = time.monotonic() - upkeep_started
            val_loss = replica.evaluate(val)
            entry = {
                "outer_step": replica.outer_step,
                "inner_step": replica.inner_step,
                "train_loss": sum(losses) / len(losses),
                "val_loss": val_loss,
                "partner": partner.peer_id if partner else None,
                "partner_step": partner.outer_step if partner else None,
                "train_seconds": train_seconds,
                "wait_seconds": waited,
                "blend_seconds": blend_seconds,
                "upkeep_seconds": upkeep_seconds,
                "time": time.time(),
            }
            self.telemetry.on_outer_step(entry)
            self._progress.outer_step(entry, partner, self.telemetry.tokens_per_second())
            upkeep_started = time.monotonic()
            if replica.outer_step % self.cfg.checkpoint_every == 0:
                self._checkpoint()
            self._write_status()
            entry["upkeep_seconds"] += time.monotonic() - upkeep_started  # the same dict the history holds
            asyncio.run_coroutine_threadsafe(self._publish(), self.loop)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------------ event loop tasks

    async def _publish(self) -> None:
        if not self.peer_id:
            return
        try:
            await self.discovery.publish(self.record())
        except Exception as error:  # the DHT failing must not end the refresh loop; the next attempt may work
            log.warning("could not publish the DHT record: %r", error)

    async def _refresh_record(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.record_ttl / 3)
            await self._publish()

    def _choosable(self, peers: list[PeerRecord], own_step: int) -> list[PeerRecord]:
        self.policy.forget({p.peer_id for p in peers})
        return [
            p
            for p in peers
            if p.ready
            and p.address
            and p.reachable
            and not self.policy.avoided(p.peer_id)
            and abs(p.outer_step - own_step) <= self.cfg.max_staleness
        ]

    async def _call(self, peer: PeerRecord, outgoing: Outgoing) -> Payload | None:
        """One exchange call in a worker thread, under a deadline learnt from earlier exchanges (peer_policy.py); a
        peer that fails is avoided, longer after each failure. exchange_with records the exchange in the metrics."""
        deadline = self.policy.deadline(peer.peer_id)
        started = time.monotonic()
        try:
            payload = await asyncio.wait_for(
                asyncio.to_thread(
                    exchange_with,
                    peer.address,
                    outgoing,
                    self.expected_layout(),
                    run_fingerprint=self.run_fingerprint,
                    max_payload_bytes=self.max_payload_bytes(),
                    timeout=deadline,
                    metrics=self.metrics,
                    buffers=self.receive_buffers,
                    peer=peer.peer_id,
                    transport=self.security.transport,
                ),
                timeout=deadline + 5,
            )
            await asyncio.to_thread(self._admit_received, payload)
        except (ExchangeError, asyncio.TimeoutError) as error:
            reason = error.reason if isinstance(error, ExchangeError) else "timeout"
            if isinstance(error, ExchangeError) and error.bad_payload is not None:
                self.bad_payload(peer.peer_id, error.bad_payload)
            elif reason != "busy":
                avoid = self.policy.failed(peer.peer_id)
                log.warning(
                    "exchange with %s failed (%s, deadline %.1fs), avoided for %.0fs: %s",
                    peer.peer_id[-8:],
                    reason,
                    deadline,
                    avoid,
                    error,
                )
            return None
        self.policy.succeeded(peer.peer_id, time.monotonic() - started)
        return payload

    def _admit_received(self, payload: Payload) -> None:
        """The norm bound for a payload this node called for; refused, it is counted and released (ExchangeError)."""
        try:
            self.admit(payload)
        except PayloadError as error:
            payload.release()
            self.metrics.rejection(error.reason)
            raise ExchangeError(error.code, error.reason, error.message, bad_payload=error) from None

    def _partner_order(self, candidates: list[PeerRecord]) -> list[PeerRecord]:
        """Random among the least recently paired first. Nodes of equal speed reach their outer steps in lockstep
        and would otherwise keep finding their last partner ready first, splitting the swarm into fixed pairs that
        never mix (seen in a 4-node swarm before this ordering)."""
        random.shuffle(candidates)
        return sorted(candidates, key=lambda p: self._last_paired.get(p.peer_id, -1))

    async def _seek_partner(self, current: PairingRound) -> None:
        """sync mode: call ready peers (least recently paired first) until the round has a partner or closes."""
        # Let the other nodes reaching this outer step publish their readiness before choosing among them.
        await asyncio.sleep(random.uniform(0.05, 0.25))
        alone_until = time.monotonic() + self.cfg.alone_grace
        while current.open:
            try:
                live = await self.discovery.live_peers()
                self._known_peers = {p.peer_id for p in live}
                self.telemetry.on_peers(live)
                candidates = self._choosable(live, current.outer_step)
            except (TimeoutError, OSError) as error:
                log.warning("DHT lookup failed: %s", error)
                live, candidates = [], []
            within_reach = [p for p in live if abs(p.outer_step - current.outer_step) <= self.cfg.max_staleness]
            if not within_reach and time.monotonic() >= alone_until:
                # Nobody else in the run within the staleness bound (alone, or every other node far ahead or far
                # behind): waiting the whole pair_timeout would only idle the trainer. A peer that comes within
                # reach is found at the next outer step.
                current.done.set()
                return
            candidates = [p for p in self._partner_order(candidates) if current.may_pair_with(p.peer_id)]
            for peer in candidates:
                if not current.open:
                    return
                if not current.lock.acquire(blocking=False):
                    break  # someone is exchanging with us right now; see how it ends
                try:
                    if not current.open:
                        return
                    payload = await self._call(peer, current.outgoing)
                    if payload is not None:
                        current.set_partner(payload)
                        return
                finally:
                    current.lock.release()
            await asyncio.sleep(random.uniform(0.05, 0.3))  # jitter: two nodes calling each other desynchronise

    async def _overlap_exchanges(self) -> None:
        """overlap mode: once per inner phase, swap offers with a random peer in the background."""
        exchanged_for = -1
        while True:
            await asyncio.sleep(random.uniform(0.2, 0.6))
            replica, offer = self.replica, self._offers.offer
            if replica is None or offer is None or replica.outer_step == exchanged_for:
                continue
            try:
                candidates = self._choosable(await self.discovery.live_peers(), replica.outer_step)
            except (TimeoutError, OSError):
                continue
            random.shuffle(candidates)
            for peer in candidates:
                if not self._offers.exchange_lock.acquire(blocking=False):
                    break
                try:
                    payload = await self._call(peer, offer)
                finally:
                    self._offers.exchange_lock.release()
                if payload is not None:
                    self._offers.store(payload)
                    exchanged_for = replica.outer_step
                    break

    # ------------------------------------------------------------------------------------------ files

    def _checkpoint(self) -> None:
        assert self.replica is not None
        save_checkpoint(
            self.cfg.data_dir / "checkpoint.pt",
            {
                "run_fingerprint": self.run_fingerprint,
                "model_config": self.model_cfg.model_dump(mode="json"),
                "tokenizer_json": self.corpus.tokenizer.json_text,  # export, eval and generate need it
                "replica": self.replica.state_dict(),
                "history": self.telemetry.history_list(KEEP_OUTER_STEPS),  # so /status keeps its curve on restart
            },
        )
        self.telemetry.on_checkpoint()

    def _write_status(self) -> None:
        """status.json in the data dir: the same document as GET /status, for launchers and post-mortems."""
        path = self.cfg.data_dir / "status.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.status().model_dump_json())
        tmp.replace(path)

    # ------------------------------------------------------------------------------------------ lifecycle

    async def _choose_shard(self) -> int:
        """This node's data shard: --shard-index if given; else the one it trained on before (shard.json in its
        data dir, so that a restart resumes the same data stream); else the first shard, in an order drawn from its
        peer id, that no live peer of the run holds (the least held when all are), so replicas see different data.
        Two nodes starting in the same second may still pick the same shard: nothing breaks, they overlap."""
        if self.cfg.shard_index is not None:
            return self.cfg.shard_index
        count = self.cfg.num_shards
        memory = self.cfg.data_dir / "shard.json"
        try:
            saved = json.loads(memory.read_text())
            if saved.get("run_fingerprint") == self.run_fingerprint and saved.get("num_shards") == count:
                return int(saved["shard"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no choice made yet (or an unreadable one): choose
        try:
            held = [p.shard for p in await self.discovery.live_peers() if 0 <= p.shard < count]
        except (TimeoutError, OSError) as error:
            log.warning("DHT lookup of the peers' shards failed (%s): choosing from the peer id alone", error)
            held = []
        seed = int.from_bytes(hashlib.sha256(self.peer_id.encode()).digest()[:8], "big")
        preference = [int(i) for i in np.random.default_rng(seed).permutation(count)]
        chosen = min(preference, key=lambda shard: (held.count(shard), preference.index(shard)))
        memory.parent.mkdir(parents=True, exist_ok=True)
        tmp = memory.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"run_fingerprint": self.run_fingerprint, "num_shards": count, "shard": chosen}))
        tmp.replace(memory)
        return chosen

    async def _initial_state(self) -> None:
        """Resume from this node's checkpoint unless the swarm has moved far ahead of it; else download a live
        donor's state; else start from the run's seed."""
        replica = self.replica
        assert replica is not None
        checkpoint = self.cfg.data_dir / "checkpoint.pt"
        if checkpoint.exists():
            payload = load_checkpoint(checkpoint)
            if payload.get("run_fingerprint") != self.run_fingerprint:
                raise NodeError(
                    f"{checkpoint} belongs to run {payload.get('run_fingerprint')}, not "
                    f"{self.run_fingerprint}; use another --data-dir"
                )
            await asyncio.to_thread(replica.load_state_dict, payload["replica"])
            self.telemetry.restore_history(payload.get("history", []))
            log.info("resumed from %s at outer step %d", checkpoint, replica.outer_step)
            if not self.cfg.download_state:
                return
            peers = await self._donor_candidates()
            front = max((p.outer_step for p in peers), default=replica.outer_step)
            if front - replica.outer_step <= self.cfg.max_behind:
                return
            log.info(
                "the checkpoint is %d outer steps behind the swarm (more than --max-behind %d): downloading state",
                front - replica.outer_step,
                self.cfg.max_behind,
            )
            if not await self._download_state():
                log.warning("no donor could serve its state: training on from the checkpoint")
            return
        if self.cfg.download_state and await self._download_state():
            return
        log.info("starting run %s from its seed (%d)", self.run_fingerprint, self.train_cfg.seed)

    async def _donor_candidates(self) -> list[PeerRecord]:
        try:
            return [p for p in await self.discovery.live_peers() if p.outer_step > 0 and p.address and p.reachable]
        except (TimeoutError, OSError) as error:
            log.warning("DHT lookup for donors failed: %s", error)
            return []

    async def _download_state(self, rounds: int = 3) -> bool:
        """Adopt a fresh donor's snapshot. Donors are drawn at random among the freshest (within one outer step of
        the swarm's front), so joiners spread out; a busy or failing donor is followed by the next one, which
        continues the download where the last stopped when its snapshot is of the same outer step."""
        replica = self.replica
        assert replica is not None
        download = StateDownload(replica.snapshot_layout(), run_fingerprint=self.run_fingerprint, peer_id=self.peer_id)
        for attempt in range(rounds):
            peers = await self._donor_candidates()
            if not peers:
                return False
            front = max(p.outer_step for p in peers)
            donors = [p for p in peers if p.outer_step >= front - 1]
            random.shuffle(donors)
            if download.counters is not None:  # a partial download resumes best at its own outer step
                donors.sort(key=lambda p: p.outer_step != download.counters["outer_step"])  # type: ignore[index]
            for donor in donors:
                self.telemetry.phase = f"downloading state of outer step {donor.outer_step} from {donor.peer_id[-8:]}"
                try:
                    tensors, counters = await asyncio.to_thread(
                        download.fetch,
                        donor.address,
                        timeout=self.download_timeout(),
                        transport=self.security.transport,
                    )
                except ExchangeError as error:
                    log.warning(
                        "state download from %s failed (%s); %d tensors kept for the next donor",
                        donor.peer_id[-8:],
                        error,
                        len(download.done),
                    )
                    continue
                await asyncio.to_thread(replica.load_outer_snapshot, tensors, counters)
                self.metrics.outcome("state_downloaded")
                log.info(
                    "joined a run in progress: state of outer step %d from %s%s",
                    replica.outer_step,
                    donor.peer_id[-8:],
                    " (resumed where another donor stopped)" if download.resumed else "",
                )
                return True
            if attempt + 1 < rounds:
                await asyncio.sleep(2.0)
        return False

    async def run(self) -> int:
        """Serve until training ends or SIGINT/SIGTERM; returns the exit code."""
        self.loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(signum, stop_requested.set)
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        self.cfg.data_dir.mkdir(parents=True, exist_ok=True)
        # 1. DHT (forks), 2. gRPC server (threads), 3. trainer thread.
        if self.discovery.dht is None:  # run_node starts it before the loop exists; this is for direct callers
            await asyncio.to_thread(self.discovery.start)
        self.peer_id = self.discovery.peer_id
        server, port = start_server(
            self,
            self.metrics,
            bind=f"{self.cfg.grpc_host}:{self.cfg.grpc_port}",
            max_call_seconds=self.exchange_ceiling(),
            max_download_seconds=self.download_timeout(),
            max_state_downloads=self.cfg.max_state_downloads,
            max_concurrent_calls=self.cfg.security.max_concurrent_calls,
            min_link_rate=self.cfg.min_link_rate,
            transport=self.security.transport,
        )
        self.address = f"{announce_host(self.cfg.grpc_host, self.cfg.announce_host)}:{self.cfg.announce_port or port}"
        if self.cfg.check_reachability:
            check = await asyncio.wait_for(
                asyncio.to_thread(check_reachable, self.address, self.peer_id, self.security.transport, timeout=5.0),
                timeout=10.0,  # the call has its own 5 s deadline; this bounds the thread hand-off too
            )
            self.reachable = check.reachable
            if not check.reachable:
                log.warning("%s", check.advice(self.address, port))
        self.dht_maddrs = await asyncio.to_thread(self.discovery.visible_maddrs)
        status_server = StatusServer(
            {
                "/status": lambda: ("application/json", self.status().model_dump_json().encode()),
                "/metrics": lambda: (
                    "text/plain; version=0.0.4; charset=utf-8",
                    render_metrics(self.status(), self.metrics.snapshot()),
                ),
                "/": lambda: ("text/html; charset=utf-8", status_page()),
            },
            healthz=self.health,
        )
        status_port = await status_server.start(self.cfg.status_host, self.cfg.status_port)
        self.status_url = f"http://{self.cfg.status_host}:{status_port}"
        log.info("status endpoint: %s/ (JSON at /status, Prometheus at /metrics, /healthz)", self.status_url)
        self._write_status()  # launchers find the status URL in status.json from the start
        tasks: list[asyncio.Task[None]] = [
            asyncio.create_task(
                report.watch_peers(
                    self.discovery, self.telemetry, self.run_fingerprint, transport=self.security.transport
                )
            )
        ]
        try:
            self.shard = await self._choose_shard()
            index, count = self.shard, self.cfg.num_shards
            if self.data_parallel is not None:
                await asyncio.to_thread(self.data_parallel.share_shard_index, index)
                index, count = self.data_parallel.shard(index, count)
            shard = ReplicaShard(
                self.corpus.train,
                replica=index,
                num_replicas=count,
                seq_len=self.train_cfg.seq_len,
                seed=self.train_cfg.seed,
            )
            self.replica = await asyncio.to_thread(
                Replica, self.model_cfg, self.train_cfg, [shard], data_parallel=self.data_parallel
            )
            self.telemetry.phase = "looking for a checkpoint or a donor's state"
            await self._initial_state()
            if self.data_parallel is not None:
                await asyncio.to_thread(self.data_parallel.broadcast_state, self.replica)
            await asyncio.to_thread(self._take_snapshot)
            log.info(
                "node %s up: run %s, gRPC %s, mode %s, shard %d/%d",
                self.peer_id,
                self.run_fingerprint,
                self.address,
                self.cfg.mode,
                self.shard,
                self.cfg.num_shards,
            )
            await self._publish()
            tasks.append(asyncio.create_task(self._refresh_record()))
            if self.cfg.mode == "overlap":
                tasks.append(asyncio.create_task(self._overlap_exchanges()))
            trainer = threading.Thread(target=self._train, name="trainer", daemon=True)
            self.trainer = trainer
            trainer.start()
            trainer_done = asyncio.create_task(asyncio.to_thread(trainer.join))
            stop_wait = asyncio.create_task(stop_requested.wait())
            await asyncio.wait({trainer_done, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if self.trainer_error is not None and not stop_requested.is_set():
                # Keep answering: /healthz says 503 and /status says why, so an operator or a probe can see it.
                log.error("trainer failed; serving status for %.0f s before exiting", self.cfg.failure_linger)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop_requested.wait(), timeout=self.cfg.failure_linger)
            if stop_requested.is_set():
                log.info("stopping: finishing the current step")
            self.stop_event.set()
            await trainer_done
            stop_wait.cancel()
            if self.trainer_error is None:  # a trainer that died mid-step may leave half-updated state: keep the last
                self._checkpoint()
            self._write_status()
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.discovery.withdraw(self.record()), timeout=10)
            server.stop(grace=2).wait(5)
            self.security.transport.close_channels()
            await status_server.close()
            await asyncio.to_thread(self.discovery.shutdown)
            if self.data_parallel is not None and self.replica is not None:
                log.info(
                    "rank 0 of %d stopped at inner step %d, weights digest %s",
                    self.data_parallel.world_size,
                    self.replica.inner_step,
                    weights_digest(self.replica.params),
                )
                self.data_parallel.close()
        if self.trainer_error is not None:
            return 1
        return 0


def run_node(node_cfg: NodeConfig, train_cfg: TrainConfig, outer_cfg: OuterConfig, data_cfg: DataConfig) -> int:
    """Build the node and run it on uvloop (plain asyncio where uvloop is unavailable)."""
    algorithm.warn_on_unstable_hyperparameters(outer_cfg.alpha, outer_cfg.beta, outer_cfg.effective_gamma)
    data_parallel = DataParallel.from_environment()
    if data_parallel is not None:
        train_cfg = train_cfg.model_copy(update={"device": data_parallel.device(train_cfg.device)})
        if not data_parallel.leader:  # another GPU of this member: no DHT, no gRPC, it follows rank 0
            return run_follower(node_cfg, train_cfg, data_cfg, data_parallel)
    if any(entry.startswith(("http://", "https://")) for entry in node_cfg.bootstrap):
        try:
            maddrs = expand_bootstrap(node_cfg.bootstrap, wait=node_cfg.bootstrap_wait)
        except OSError as error:
            raise NodeError(str(error)) from None
        node_cfg = node_cfg.model_copy(update={"bootstrap": maddrs})
    node = Node(node_cfg, train_cfg, outer_cfg, data_cfg)
    # The DHT forks a helper process: start it while this process has a single thread (DESIGN.md start order).
    node.discovery.start()
    if data_parallel is not None:
        data_parallel.start()
        node.data_parallel = data_parallel
    try:
        import uvloop
    except ImportError:
        return asyncio.run(node.run())
    return uvloop.run(node.run())


def read_status(data_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((data_dir / "status.json").read_text())
    except (OSError, ValueError):
        return None
