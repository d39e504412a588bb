"""The swarm member: an asyncio daemon (uvloop) that trains one replica and blends with random peers.

This is the composition root (docs/architecture.md, "The node"): it builds every component from the settings and
runs them as a stack, each started after the ones it needs and stopped before them:

1. the Hivemind DHT (it forks a helper process, so it starts while the process has one thread);
2. the gRPC server (its own thread pool): exchanges, state downloads, Info, every call's caller proven;
3. the HTTP status endpoint, on this event loop;
4. supervised background tasks (node/supervisor.py): the DHT record, the view of the swarm, the strategy's work;
5. the trainer thread: the one inner loop (training/loop.py) with the outer step (node/outer_step.py) between
   phases, pairing through the chosen strategy (pairing/).

On SIGINT/SIGTERM the trainer stops at the next step boundary, a final checkpoint is written, the DHT record is
replaced by a tombstone, and the rest stops in reverse. Torch compute and torch I/O never run on the event loop:
exchanges run on their own bounded executor, checkpoints on the writer thread, loads in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time

import torch

from noloco_node.addresses import record_address
from noloco_node.config.models import DataConfig, OuterConfig, TrainConfig
from noloco_node.config.node_config import NodeConfig
from noloco_node.discovery.dht import Discovery, PeerRecord
from noloco_node.discovery.reachability import announce_host
from noloco_node.model.run_model import load_run_corpus
from noloco_node.node import report
from noloco_node.node.catch_up import NodeError, StoppedBeforeTrainingError
from noloco_node.node.descriptors import connection_budget, raise_descriptor_limit
from noloco_node.node.fault_injection import Drill
from noloco_node.node.machine_checks import log_local_checks
from noloco_node.node.peering import Peering
from noloco_node.node.reach import Reach
from noloco_node.node.run_layout import RunLayout
from noloco_node.node.security import NodeSecurity, SecuritySetupError
from noloco_node.node.supervisor import Supervisor
from noloco_node.node.trainer import Trainer
from noloco_node.observability.http_server import StatusServer, node_routes
from noloco_node.observability.status import Health, NodeStatus
from noloco_node.observability.status_file import write_status_file
from noloco_node.observability.telemetry import HealthInputs, Telemetry
from noloco_node.pairing.peer_policy import PeerPolicy
from noloco_node.pairing.standing import Standing
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.service import start_server
from noloco_node.security.caller_proof import CallerVerifier
from noloco_node.training.replica import Replica, resolve_device
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.published import LatestSnapshot

log = logging.getLogger(__name__)


__all__ = ["Node", "NodeError"]


class Node:
    """One swarm member: its components, and the order they start and stop in."""

    def __init__(self, node_cfg: NodeConfig, train_cfg: TrainConfig, outer_cfg: OuterConfig, data_cfg: DataConfig):
        self.cfg = node_cfg
        self.drill = Drill.from_environment(os.environ)  # faults to simulate (tests, drills): before any work
        self.descriptor_limit = raise_descriptor_limit()  # before anything opens a file or a socket
        self.train_cfg = train_cfg
        self.outer_cfg = outer_cfg
        self.corpus = load_run_corpus(data_cfg, train_cfg)
        self.layout = RunLayout.of(node_cfg, train_cfg, outer_cfg, self.corpus)
        self.run_fingerprint = self.layout.run_fingerprint
        self.source = self.layout.source
        log_local_checks(
            node_cfg, train_cfg, self.layout.source, on_gpu=resolve_device(train_cfg.device).type == "cuda"
        )
        try:
            self.security = NodeSecurity(node_cfg.security, node_cfg.data_dir)
        except SecuritySetupError as error:
            raise NodeError(str(error)) from None
        self.discovery = Discovery.of_node(
            self.run_fingerprint,
            node_cfg,
            self.security.identity,
            self.security.secret,
            run_name=node_cfg.run_name,
            start=self.layout.start,
        )
        self.peer_id = self.security.peer_id
        self.address = ""
        self._status_file_errors = 0
        self.status_url = ""
        self.dht_maddrs: list[str] = []
        self.metrics = ExchangeMetrics()
        self.standing = Standing(standing_seconds=node_cfg.standing_seconds, stranger_share=node_cfg.stranger_share)
        self.discovery.preferred = self.standing.established  # kept first when a lookup finds too many records
        self.reach = Reach(
            node_cfg, self.discovery, self.security.transport, self.metrics, established=self.standing.established
        )
        self.telemetry = Telemetry(
            tokens_per_step=train_cfg.batch_size * train_cfg.seq_len,
            degraded_after=node_cfg.degraded_after,
            stall_after=node_cfg.stall_after,
        )
        self.policy = PeerPolicy(
            exchange_timeout=self.layout.exchange_ceiling(),
            min_deadline=node_cfg.min_exchange_deadline,
            avoid_seconds=node_cfg.avoid_seconds,
        )
        self.supervisor = Supervisor()
        self.stop_event = threading.Event()  # a stop was asked for, or the trainer ended
        self.stop_requested = asyncio.Event()  # SIGINT or SIGTERM (replaced in run(), on its event loop)
        self.snapshot = LatestSnapshot()  # the joiner snapshot (GetState), one per outer step
        self.peering = Peering.build(
            node_cfg,
            self.layout,
            peer_id=lambda: self.peer_id,
            security=self.security,
            policy=self.policy,
            standing=self.standing,
            metrics=self.metrics,
            discovery=self.discovery,
            telemetry=self.telemetry,
            snapshot=self.snapshot,
            publish_record=self._publish,
            stopping=self.stop_event,
            info=self.info,
            outer_step=lambda: None if self.replica is None else self.replica.outer_step,
            reach=self.reach,
        )
        self.strategy = self.peering.strategy
        self.trainer = Trainer(
            cfg=node_cfg,
            train_cfg=train_cfg,
            outer_cfg=outer_cfg,
            layout=self.layout,
            corpus=self.corpus,
            security=self.security,
            discovery=self.discovery,
            telemetry=self.telemetry,
            metrics=self.metrics,
            standing=self.standing,
            policy=self.policy,
            peering=self.peering,
            snapshot=self.snapshot,
            write_status=self.write_status,
            publish_record=self._publish,
            stop_event=self.stop_event,
            stop_requested=lambda: self.stop_requested.is_set(),
        )

    @property
    def replica(self) -> Replica | None:
        return self.trainer.replica

    # ------------------------------------------------------------------------------------------ what it says

    def ready_to_pair(self) -> bool:
        return self.strategy.ready()

    def info(self) -> pb.InfoReply:
        return report.info_reply(self)

    def status(self) -> NodeStatus:
        """What GET /status serves and status.json holds (node/report.py builds it)."""
        return report.node_status(self)

    def health(self) -> Health:
        replica, dht = self.replica, self.discovery.dht
        return self.telemetry.health(
            HealthInputs(
                trainer_started=self.trainer.thread is not None,
                trainer_alive=self.trainer.alive,
                trainer_error=self.trainer.error,
                stopping=self.stop_event.is_set(),
                finished=replica is not None and replica.inner_step >= self.train_cfg.total_steps,
                dht_alive=dht is not None and dht.is_alive(),
                task_problem=self.supervisor.problem(),
            )
        )

    def record(self) -> PeerRecord:
        replica = self.replica
        return PeerRecord(
            peer_id=self.peer_id,
            address=self.address,
            run_fingerprint=self.run_fingerprint,
            outer_step=replica.outer_step if replica else 0,
            inner_step=replica.inner_step if replica else 0,
            ready=self.ready_to_pair(),
            next_step_at=self.strategy.next_step_at(),
            shard=-1 if self.trainer.shard is None else self.trainer.shard,
            partners=self.standing.recent_partners(),
            starting_with=self.trainer.starting_with,
            **self.reach.record_fields(),
        )

    def write_status(self) -> None:
        """status.json in the data dir: the same document as GET /status, for launchers and post-mortems."""
        try:
            write_status_file(self.cfg.data_dir, self.status())
        except OSError as error:  # a full disk or no descriptor left: the next outer step writes it again
            self._status_file_errors += 1
            if self._status_file_errors in (1, 10, 100) or self._status_file_errors % 1000 == 0:
                log.warning("could not write status.json (%d times so far): %s", self._status_file_errors, error)

    # ------------------------------------------------------------------------------------------ event loop tasks

    def _answered_again(self, peer_id: str) -> None:
        if self.policy.answered_again(peer_id):
            log.info("peer %s answers again after a silence: called again at once", peer_id[-8:])

    async def _publish(self) -> None:
        try:
            await self.discovery.publish(self.record())
        except Exception as error:  # the DHT failing must not end the refresh loop; the next attempt may work
            log.warning("could not publish the DHT record: %r", error)

    async def _refresh_record(self) -> None:
        """The record stored again every third of --record-ttl, unless an outer step or a reservation stored it
        since with the same reach: each store is a DHT search and a write at one or two levels, the larger part of a
        member's discovery work (a phase of 15 s stores the record at least twice of its own)."""
        while True:
            await asyncio.sleep(self.cfg.record_ttl / 3)
            try:
                await self.reach.refresh()
            except Exception as error:  # a witness or relay failing must not end the refresh loop
                log.warning("could not refresh how this node is reached: %r", error)
            fresh = self.discovery.stored_within(self.cfg.record_ttl / 3)
            if fresh is not None and all(getattr(fresh, f) == v for f, v in self.reach.record_fields().items()):
                continue
            await self._publish()

    # ------------------------------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until training ends or SIGINT/SIGTERM; returns the exit code."""
        loop = asyncio.get_running_loop()
        self.peering.context.loop = loop
        stop_requested = self.stop_requested = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop_requested.set)
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        self.cfg.data_dir.mkdir(parents=True, exist_ok=True)
        async with contextlib.AsyncExitStack() as components:
            await self._start_dht(components)
            port = await self._start_grpc(components)
            await self.reach.start(self.address, port, self.dht_maddrs)
            components.push_async_callback(self.reach.close)
            await self._start_status_endpoint(components)
            components.push_async_callback(self.supervisor.stop)
            self.supervisor.spawn(
                "watch-peers",
                lambda: report.watch_peers(
                    self.discovery,
                    self.telemetry,
                    self.run_fingerprint,
                    self.cfg.run_name,
                    transport=self.security.transport,
                    answered_again=self._answered_again,
                    vouch_for=self.standing.established,
                ),
            )
            try:
                outer_step = await self.trainer.prepare(self.peer_id, self.address)
            except StoppedBeforeTrainingError as stopped:
                log.info("stopping: %s; nothing was trained or written", stopped)
                return 0
            await asyncio.to_thread(self.write_status)  # the resumed state (its history, its norm bound) at once
            components.push_async_callback(self._withdraw)
            await self._publish()
            self.supervisor.spawn("dht-record", self._refresh_record)
            await self.trainer.wait_for_peers(stop_requested)
            if not self.reach.witnessed:  # a swarm launched together: now there are peers to ask, before pairing
                await self.reach.refresh()
                await self._publish()
            self.supervisor.spawn(f"{self.strategy.mode}-pairing", self.strategy.run)
            self.telemetry.training_started = time.time()
            finished = self.trainer.start(outer_step, self.drill, self.peer_id)
            await self._until_stopped(finished, stop_requested)
            if self.trainer.error is None:  # a trainer that died mid-step may leave half-updated state: keep the last
                await asyncio.to_thread(self.trainer.final_checkpoint)
            await asyncio.to_thread(self.write_status)
        return 1 if self.trainer.error is not None else 0

    async def _start_dht(self, components: contextlib.AsyncExitStack) -> None:
        if self.discovery.dht is None:  # run_node starts it before the loop exists; this is for direct callers
            await asyncio.to_thread(self.discovery.start)
        components.push_async_callback(asyncio.to_thread, self.discovery.shutdown)
        self.peer_id = self.discovery.peer_id
        self.dht_maddrs = await asyncio.to_thread(self.discovery.visible_maddrs)

    async def _start_grpc(self, components: contextlib.AsyncExitStack) -> int:
        server, port = start_server(
            self.peering.served,
            self.metrics,
            bind=f"{self.cfg.grpc_host}:{self.cfg.grpc_port}",
            max_call_seconds=self.layout.exchange_ceiling(),
            max_download_seconds=self.layout.download_timeout(),
            max_state_downloads=self.cfg.max_state_downloads,
            max_concurrent_calls=self.cfg.security.max_concurrent_calls,
            min_link_rate=self.cfg.min_link_rate,
            stall_seconds=self.layout.stall_seconds(self.cfg.security.stall_seconds),
            max_calls_per_address=self.cfg.security.max_calls_per_address,
            max_connections=connection_budget(self.descriptor_limit),
            transport=self.security.transport,
            verifier=CallerVerifier(self.peer_id, max_clock_skew=self.cfg.security.max_clock_skew),
            origin=lambda peer: None if self.reach.tunnels is None else self.reach.tunnels.origin(peer),
            receipts=self.peering.receipts,
        )

        async def stop() -> None:
            await asyncio.to_thread(lambda: server.stop(grace=2).wait(5))
            self.security.transport.close_channels()
            self.peering.exchanges.shutdown(wait=False, cancel_futures=True)

        components.push_async_callback(stop)
        self.address = record_address(
            announce_host(self.cfg.grpc_host, self.cfg.announce_host), self.cfg.announce_port or port
        )
        return port

    async def _start_status_endpoint(self, components: contextlib.AsyncExitStack) -> None:
        server = StatusServer(node_routes(self.status, self.metrics.registry), healthz=self.health)
        port = await server.start(self.cfg.status_host, self.cfg.status_port)
        components.push_async_callback(server.close)
        self.status_url = f"http://{self.cfg.status_host}:{port}"
        log.info("status endpoint: %s/ (JSON at /status, Prometheus at /metrics, /healthz)", self.status_url)
        await asyncio.to_thread(self.write_status)  # launchers find the status URL in status.json from the start

    async def _until_stopped(self, finished: asyncio.Future[None], stop_requested: asyncio.Event) -> None:
        async def stop_asked() -> None:
            await stop_requested.wait()

        stop_wait = asyncio.ensure_future(stop_asked())
        await asyncio.wait([finished, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        if self.trainer.error is not None and not stop_requested.is_set():
            # Keep answering: /healthz says 503 and /status says why, so an operator or a probe can see it.
            log.error("trainer failed; serving status for %.0f s before exiting", self.cfg.failure_linger)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop_requested.wait(), timeout=self.cfg.failure_linger)
        if stop_requested.is_set():
            log.info("stopping: finishing the current step")
        self.stop_event.set()
        self.strategy.interrupt()  # a trainer waiting for a partner returns at once
        await finished
        stop_wait.cancel()

    async def _withdraw(self) -> None:
        """Leave the swarm: the DHT record becomes a tombstone, held tensors are let go, the writer stops."""
        try:
            await asyncio.wait_for(self.discovery.withdraw(self.record()), timeout=10)
        except (TimeoutError, asyncio.TimeoutError, OSError) as error:
            # Leaving goes on: the record expires by itself within --record-ttl.
            log.warning("could not replace the DHT record with a tombstone (%s); it expires by itself", error)
        except Exception:  # a defect, not the network: said whole, and the rest of the leave still runs
            log.exception("replacing the DHT record with a tombstone failed; it expires by itself")
        self.strategy.close()
        self.snapshot.clear()
        await asyncio.to_thread(self.trainer.checkpoints.close, 60.0)
        data_parallel, replica = self.trainer.data_parallel, self.replica
        if data_parallel is not None and replica is not None:
            await asyncio.to_thread(replica.report_stopped)
            await asyncio.to_thread(replica.release_followers, train=False)
            data_parallel.close()
