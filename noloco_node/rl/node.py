"""The RL node (`noloco-node rl`): RL post-training with rollouts shared through the swarm, SAPO-style (Swarm
sAmpling Policy Optimization, arXiv 2509.08721), on the same identity, DHT, gRPC server, caller proofs, admission,
status endpoint and metrics as a pretraining node (node/daemon.py).

The composition root of that work, started in this order and stopped in reverse:

1. the DHT (it forks a helper process, so ``run_rl_node`` starts it while the process has one thread); the
   node's record carries its manifest: the newest round it serves and its task families (discovery/dht.py);
2. the gRPC server: GetRollouts from this node's book, Info; every Exchange refused (rl/served.py);
3. the HTTP status endpoint: /status (observability/rl_status.py), /metrics, /healthz, and the page (web/rl.html);
4. supervised tasks: the record refresh and the rollout fetcher (rl/fetcher.py);
5. the trainer thread (rl/trainer.py): the warm-up, then the rounds.

No weights cross: every node keeps its own policy, any model it can load, and nodes with different models share a
swarm. So the run's fingerprint names only the work and ``--run-name``, not the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import signal
import threading
import time

import torch

from noloco_node import __version__
from noloco_node.addresses import record_address
from noloco_node.config.models import DataConfig, TrainConfig
from noloco_node.config.node_config import NodeConfig
from noloco_node.config.rl_config import RolloutConfig
from noloco_node.discovery.dht import Discovery, PeerRecord
from noloco_node.discovery.reachability import announce_host
from noloco_node.errors import NolocoError
from noloco_node.model.run_model import model_source, run_tokenizer
from noloco_node.node.catch_up import NodeError
from noloco_node.node.descriptors import connection_budget, raise_descriptor_limit
from noloco_node.node.launch import leave_process, run_on_uvloop, with_bootstrap_expanded
from noloco_node.node.security import NodeSecurity, SecuritySetupError
from noloco_node.node.supervisor import Supervisor
from noloco_node.observability.http_server import StatusServer, rl_routes
from noloco_node.observability.rl_status import RolloutNodeStatus, RolloutPeer
from noloco_node.observability.status import Health
from noloco_node.observability.status_file import write_status_file
from noloco_node.rl.fetcher import RolloutFetcher
from noloco_node.rl.policy import Policy
from noloco_node.rl.rollouts import ExternalPool, RolloutBook
from noloco_node.rl.served import RolloutPeerNode
from noloco_node.rl.stats import RolloutStats
from noloco_node.rl.tasks import check_families
from noloco_node.rl.trainer import RolloutTrainer
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.service import start_server
from noloco_node.security.caller_proof import CallerVerifier
from noloco_node.training.replica import resolve_device
from noloco_node.wire import peer_pb2 as pb

log = logging.getLogger(__name__)

PROTOCOL = "sapo-rollouts/1"
STATUS_FILE_SECONDS = 1.0
FETCH_TIMEOUT = 5.0  # a round's rollouts are a few KiB: a peer that cannot send them in this long is skipped


def rl_run_fingerprint(run_name: str) -> str:
    """The DHT namespace of an RL run: the work and its name, not the model (nodes may run different ones)."""
    return hashlib.sha256(json.dumps({"work": PROTOCOL, "run_name": run_name}).encode()).hexdigest()[:32]


class RolloutNode:
    def __init__(self, node_cfg: NodeConfig, train_cfg: TrainConfig, data_cfg: DataConfig, rl_cfg: RolloutConfig):
        self.cfg = node_cfg
        self.rl_cfg = rl_cfg
        self.descriptor_limit = raise_descriptor_limit()
        try:
            check_families([*rl_cfg.tasks, *rl_cfg.eval_tasks])
        except NolocoError as error:
            raise NodeError(f"rl.tasks: {error}") from None
        self.device = resolve_device(train_cfg.device)
        self.tokenizer = run_tokenizer(data_cfg, train_cfg)
        self.source = model_source(train_cfg, self.tokenizer.vocab_size)
        try:
            self.security = NodeSecurity(node_cfg.security, node_cfg.data_dir)
        except SecuritySetupError as error:
            raise NodeError(str(error)) from None
        self.run_fingerprint = rl_run_fingerprint(node_cfg.run_name)
        self.discovery = Discovery.of_node(self.run_fingerprint, node_cfg, self.security.identity, self.security.secret)
        self.peer_id = self.security.peer_id
        self.address = ""
        self.status_url = ""
        self.metrics = ExchangeMetrics()
        self.stats = RolloutStats(self.metrics.registry)
        self.book = RolloutBook(self.run_fingerprint, self.peer_id)
        self.pool = ExternalPool(rl_cfg.max_rollout_age)
        self.supervisor = Supervisor()
        self.stop_event = threading.Event()
        self.fetcher = RolloutFetcher(
            self.discovery,
            self.security.transport,
            self.pool,
            self.stats,
            run_fingerprint=self.run_fingerprint,
            interval=rl_cfg.fetch_seconds,
            timeout=FETCH_TIMEOUT,
        )
        self.loop: asyncio.AbstractEventLoop | None = None
        self._publishing: set[asyncio.Future[None]] = set()
        self.trainer = RolloutTrainer(
            rl_cfg,
            self._make_policy,
            seed=train_cfg.seed,
            book=self.book,
            pool=self.pool,
            stats=self.stats,
            stop=self.stop_event,
            published=self._published,
        )
        self.trainer_thread: threading.Thread | None = None
        self.trainer_error: BaseException | None = None

    def _make_policy(self) -> Policy:
        return Policy(
            self.source.initial_model(self.device),
            self.tokenizer,
            self.device,
            lr=self.rl_cfg.format_lr,
            max_new_tokens=self.rl_cfg.max_new_tokens,
            temperature=self.rl_cfg.temperature,
        )

    # ------------------------------------------------------------------------------------------ what it says

    def record(self, *, leaving: bool = False) -> PeerRecord:
        return PeerRecord(
            peer_id=self.peer_id,
            address=self.address,
            run_fingerprint=self.run_fingerprint,
            outer_step=self.trainer.round,
            inner_step=self.trainer.round,
            leaving=leaving,
            rollout_round=self.book.latest_round,
            rollout_families=tuple(self.rl_cfg.tasks[:8]),
        )

    def health(self) -> Health:
        if self.trainer_error is not None:
            return Health(state="failed", reason=f"trainer thread died: {self.trainer_error!r}", ok=False)
        if self.trainer.round >= self.rl_cfg.rounds:
            return Health(state="finished", reason=f"ran its {self.rl_cfg.rounds} rounds", ok=False)
        if self.stop_event.is_set():
            return Health(state="stopping", reason="shutting down", ok=False)
        if self.trainer_thread is None or self.trainer.warming_up:
            return Health(state="starting", reason="format warm-up", ok=False)
        problem = self.supervisor.problem()
        if problem is not None:
            return Health(state="failed", reason=problem, ok=False)
        return Health(state="training", reason="", ok=True)

    def info(self) -> pb.InfoReply:
        return pb.InfoReply(
            peer_id=self.peer_id,
            run_fingerprint=self.run_fingerprint,
            outer_step=self.trainer.round,
            inner_step=self.trainer.round,
            health=self.health().state,
            version=__version__,
        )

    def status(self) -> RolloutNodeStatus:
        now = time.time()
        return RolloutNodeStatus(
            peer_id=self.peer_id,
            run_name=self.cfg.run_name,
            run_fingerprint=self.run_fingerprint,
            version=__version__,
            model=self.source.name,
            address=self.address,
            status_url=self.status_url,
            health=self.health(),
            round=self.trainer.round,
            rounds=self.rl_cfg.rounds,
            local=self.rl_cfg.local,
            external=self.rl_cfg.external,
            group_size=self.rl_cfg.group_size,
            families=list(self.rl_cfg.tasks),
            rewards=list(self.stats.points),
            cumulative_local_reward=self.stats.cumulative_local_reward,
            by_family=self.stats.families([*self.rl_cfg.tasks, *self.rl_cfg.eval_tasks]),
            evaluations=list(self.stats.evaluations),
            rollouts_served=self.book.served_groups,
            rollouts_fetched=self.stats.fetched,
            rollouts_used=self.stats.external_used,
            rollouts_stale=self.pool.stale,
            rollouts_refused=dict(self.stats.refused),
            fetch_failures=dict(self.stats.fetch_failures),
            peers=[self._peer(p, now) for p in self.fetcher.peers],
        )

    def _peer(self, record: PeerRecord, now: float) -> RolloutPeer:
        used, reward = self.stats.peer_contribution(record.peer_id)
        return RolloutPeer(
            peer_id=record.peer_id,
            address=record.address,
            rollout_round=record.rollout_round,
            families=list(record.rollout_families),
            record_age_seconds=max(0.0, now - record.updated),
            rollouts_used=used,
            reward=reward,
        )

    def write_status(self) -> None:
        try:
            write_status_file(self.cfg.data_dir, self.status())
        except OSError as error:
            log.warning("could not write status.json: %s", error)

    # ------------------------------------------------------------------------------------------ event loop

    def _published(self, round_: int) -> None:
        """On the trainer thread: a round's rollouts are in the book; say so in the DHT record (on the loop)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._publish_soon)

    def _publish_soon(self) -> None:
        task = asyncio.ensure_future(self._publish())
        self._publishing.add(task)  # held until done: the loop keeps only weak references to its tasks
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, *, leaving: bool = False) -> None:
        try:
            await asyncio.wait_for(self.discovery.publish(self.record(leaving=leaving)), timeout=10)
        except Exception as error:  # the DHT failing must not end anything: the next publish may work
            log.warning("could not publish the DHT record: %r", error)

    async def _refresh_record(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.record_ttl / 3)
            await self._publish()

    async def _write_status_file(self) -> None:
        while True:  # rounds take about a second: launchers and tests read the file rather than poll HTTP
            await asyncio.sleep(STATUS_FILE_SECONDS)
            await asyncio.to_thread(self.write_status)

    def _train(self) -> None:
        try:
            self.trainer.run()
        except BaseException as error:
            self.trainer_error = error
            log.exception("the RL trainer thread died")

    async def run(self) -> int:
        self.loop = loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop_requested.set)
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        self.cfg.data_dir.mkdir(parents=True, exist_ok=True)
        async with contextlib.AsyncExitStack() as components:
            if self.discovery.dht is None:
                await asyncio.to_thread(self.discovery.start)
            components.push_async_callback(asyncio.to_thread, self.discovery.shutdown)
            self.peer_id = self.book.peer_id = self.discovery.peer_id
            await self._start_grpc(components)
            server = StatusServer(rl_routes(self.status, self.metrics.registry), healthz=self.health)
            port = await server.start(self.cfg.status_host, self.cfg.status_port)
            components.push_async_callback(server.close)
            self.status_url = f"http://{self.cfg.status_host}:{port}"
            log.info("status endpoint: %s/ (JSON at /status, Prometheus at /metrics, /healthz)", self.status_url)
            # Unwound in reverse: the supervised tasks (the record's refresh among them) stop, then the tombstone.
            components.push_async_callback(self._publish, leaving=True)
            components.push_async_callback(self.supervisor.stop)
            await self._publish()
            await asyncio.to_thread(self.write_status)
            self.supervisor.spawn("dht-record", self._refresh_record)
            self.supervisor.spawn("status-file", self._write_status_file)
            if self.rl_cfg.external:
                self.supervisor.spawn("rollout-fetch", self.fetcher.run)
            components.callback(self.fetcher.close)
            self.trainer_thread = threading.Thread(target=self._train, name="rl-trainer", daemon=True)
            self.trainer_thread.start()
            finished = asyncio.ensure_future(asyncio.to_thread(self.trainer_thread.join))
            stop_wait = asyncio.ensure_future(stop_requested.wait())
            await asyncio.wait([finished, stop_wait], return_when=asyncio.FIRST_COMPLETED)
            self.stop_event.set()
            await finished
            stop_wait.cancel()
            await asyncio.to_thread(self.write_status)
            log.info(
                "RL node done: %d rounds, cumulative local reward %.2f, %d peers' rollouts used",
                self.trainer.round,
                self.stats.cumulative_local_reward,
                self.stats.external_used,
            )
        return 1 if self.trainer_error is not None else 0

    async def _start_grpc(self, components: contextlib.AsyncExitStack) -> None:
        served = RolloutPeerNode(self.run_fingerprint, lambda: self.peer_id, self.info)
        server, port = start_server(
            served,
            self.metrics,
            bind=f"{self.cfg.grpc_host}:{self.cfg.grpc_port}",
            max_calls_per_address=self.cfg.security.max_calls_per_address,
            max_connections=connection_budget(self.descriptor_limit),
            transport=self.security.transport,
            verifier=CallerVerifier(self.peer_id, max_clock_skew=self.cfg.security.max_clock_skew),
            rollouts=self.book,
        )

        async def stop() -> None:
            await asyncio.to_thread(lambda: server.stop(grace=2).wait(5))
            self.security.transport.close_channels()

        components.push_async_callback(stop)
        self.address = record_address(
            announce_host(self.cfg.grpc_host, self.cfg.announce_host), self.cfg.announce_port or port
        )


def run_rl_node(node_cfg: NodeConfig, train_cfg: TrainConfig, data_cfg: DataConfig, rl_cfg: RolloutConfig) -> int:
    """Build the RL node, start its DHT while the process has one thread, and run it on uvloop."""
    node = RolloutNode(with_bootstrap_expanded(node_cfg), train_cfg, data_cfg, rl_cfg)
    node.discovery.start()
    return leave_process(run_on_uvloop(node.run))
