"""The node's trainer: its one replica, how it is prepared, and the thread that trains it.

The node (daemon.py) owns the network side and the order components start and stop in; this owns the replica. It
prepares it (catch_up.py: the node's own checkpoint, a donor's state, or the run's seed), wires the outer step
(outer_step.py) to the node's pairing, standing and catch-up, runs the inner loop on a thread of its own (torch never
runs on the event loop), and writes the final checkpoint once that thread has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from noloco_node.config.models import OuterConfig, TrainConfig
from noloco_node.config.node_config import NodeConfig
from noloco_node.data.corpus import Corpus, validation_batches
from noloco_node.discovery.dht import Discovery
from noloco_node.node import report
from noloco_node.node.catch_up import CHECKPOINT_FILE, CatchUp
from noloco_node.node.fault_injection import Drill, fault_hooks
from noloco_node.node.outer_step import OuterStep, OuterStepDeps
from noloco_node.node.peering import Peering
from noloco_node.node.run_layout import RunLayout
from noloco_node.node.security import NodeSecurity
from noloco_node.observability.telemetry import KEEP_OUTER_STEPS, Telemetry
from noloco_node.pairing.peer_policy import PeerPolicy
from noloco_node.pairing.standing import Standing, SwarmStep
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.security.payload_guard import NORM_BOUND
from noloco_node.training.checkpoints import CheckpointWriter, Snapshots, replica_state_of
from noloco_node.training.data_parallel import DataParallel
from noloco_node.training.replica import Replica
from noloco_node.wire.published import LatestSnapshot

log = logging.getLogger(__name__)


class Trainer:
    """One replica: prepared on the event loop, trained on the trainer thread, checkpointed when it stops."""

    def __init__(
        self,
        *,
        cfg: NodeConfig,
        train_cfg: TrainConfig,
        outer_cfg: OuterConfig,
        layout: RunLayout,
        corpus: Corpus,
        security: NodeSecurity,
        discovery: Discovery,
        telemetry: Telemetry,
        metrics: ExchangeMetrics,
        standing: Standing,
        policy: PeerPolicy,
        peering: Peering,
        snapshot: LatestSnapshot,
        write_status: Callable[[], None],
        publish_record: Callable[[], Awaitable[None]],
        stop_event: threading.Event,
        stop_requested: Callable[[], bool],
    ) -> None:
        self.cfg, self.train_cfg, self.outer_cfg = cfg, train_cfg, outer_cfg
        self.layout, self.corpus, self.security, self.discovery = layout, corpus, security, discovery
        self.telemetry, self.metrics, self.standing, self.policy = telemetry, metrics, standing, policy
        self.peering, self.snapshot = peering, snapshot
        self.write_status, self.publish_record = write_status, publish_record
        self.stop_event, self.stop_requested = stop_event, stop_requested
        self.replica: Replica | None = None
        self.shard: int | None = None
        self.data_parallel: DataParallel | None = None  # rank 0 of a multi-process member
        self.snapshots: Snapshots | None = None  # the snapshot pool, once the replica exists
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.checkpoints = CheckpointWriter(cfg.data_dir / CHECKPOINT_FILE, on_written=telemetry.on_checkpoint)
        self.progress = report.ProgressLog(every=cfg.log_every, total_steps=train_cfg.total_steps)
        # Others seen live while holding the first step for --wait-for-peers (the record says it); -1 once training.
        self.starting_with = 0 if cfg.wait_for_peers else -1

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    # ------------------------------------------------------------------------------------------ before training

    async def prepare(self, peer_id: str, address: str) -> OuterStep:
        """The replica on its shard, resumed or downloaded, and its first published state."""
        self.checkpoints.start()
        validation = validation_batches(
            self.corpus.validation,
            seq_len=self.train_cfg.seq_len,
            batch_size=self.train_cfg.eval_batch_size,
            num_batches=self.train_cfg.eval_batches,
        )
        catch_up = CatchUp(
            cfg=self.cfg,
            train_cfg=self.train_cfg,
            run_fingerprint=self.layout.run_fingerprint,
            peer_id=peer_id,
            discovery=self.discovery,
            transport=self.security.transport,
            telemetry=self.telemetry,
            metrics=self.metrics,
            download_timeout=self.layout.download_timeout(),
            validation=validation,
            believe=self.standing.believable,
            restore_standing=self.standing.restore,
            far_refusals=lambda: self.peering.admission.far_refusals,
            run_start=self.layout.start,
            stopping=lambda: self.stop_requested() or self.stop_event.is_set(),
        )
        self.shard = await catch_up.choose_shard()
        self.replica = replica = await catch_up.replica(self.shard, self.corpus, self.layout.source, self.data_parallel)
        self.telemetry.step_plan = replica.plan.as_dict()
        self.peering.strategy.restore(catch_up.resumed_strategy_state)
        # A resumed node is bounded at once by the movements its checkpoint recorded (payload_guard.py).
        self.security.norm_guard.restore(
            [
                (h["movement"], h["phase_lr"], h["partner_lr"])
                for h in self.telemetry.history_list(16)
                if "phase_lr" in h and h.get("movement") is not None
            ]
        )
        self.snapshots = await asyncio.to_thread(Snapshots, replica)
        outer_step = OuterStep(
            OuterStepDeps(
                replica=replica,
                strategy=self.peering.strategy,
                outer_cfg=self.outer_cfg,
                send_phi=self.layout.send_phi,
                send_delta=self.layout.send_delta,
                run_fingerprint=self.layout.run_fingerprint,
                peer_id=lambda: peer_id,
                telemetry=self.telemetry,
                progress=self.progress,
                validation=validation,
                snapshots=self.snapshots,
                snapshot=self.snapshot,
                checkpoints=self.checkpoints,
                checkpoint_extra=self.checkpoint_extra,
                checkpoint_every=self.cfg.checkpoint_every,
                write_status=self.write_status,
                loop=asyncio.get_running_loop(),
                publish_record=self.publish_record,
                norm_guard=self.security.norm_guard,
                max_staleness=self.cfg.max_staleness,
                judge=self.peering.admission.judge,
                paired=self._blended,
                refuse_blend=self.peering.admission.refuse_blend,
                far_groups_since=self.peering.admission.far_groups_since,
                train_while_waiting=self.cfg.train_while_waiting,
                catch_up=functools.partial(self._catch_up, catch_up, replica),
                believe=self.standing.believable,
                swarm_step=self._swarm_step,
                probation=catch_up.probation,
                data_parallel=self.data_parallel,
            )
        )
        await asyncio.to_thread(functools.partial(outer_step.publish_state, checkpoint=False))
        log.info(
            "node %s up: run %s, gRPC %s, mode %s, shard %d/%d",
            peer_id,
            self.layout.run_fingerprint,
            address,
            self.cfg.mode,
            self.shard,
            self.cfg.num_shards,
        )
        return outer_step

    def _blended(self, peer_id: str, outer_step: int) -> None:
        """Trainer thread: a blend with ``peer_id`` passed the loss check at ``outer_step``."""
        self.peering.caller.paired(peer_id, outer_step)
        self.peering.admission.blend_taken(peer_id)

    async def wait_for_peers(self, stop_requested: asyncio.Event) -> None:
        """Hold the first inner step until --wait-for-peers other nodes are live and each of them sees as many (or
        trains), or the timeout passes, or a stop is asked. Each node publishes its record only after deciding
        whether to download a donor's state, so nodes launched together all start from step 0: none finds another
        already ahead. Its record says how many others it sees (``starting_with``): a peer whose discovery is
        seconds slower to see the others is waited for, rather than left to start that far behind."""
        wanted = self.cfg.wait_for_peers
        if wanted == 0:
            return
        self.telemetry.phase = f"waiting for {wanted} peer(s) to start"
        loop = asyncio.get_running_loop()
        started = loop.time()
        seen, ready = 0, 0
        while not stop_requested.is_set():
            try:
                peers = await self.discovery.live_peers()
            except Exception as error:  # a DHT lookup that fails is retried until the deadline
                log.debug("looking for peers to start with: %r", error)
            else:
                ready = sum(1 for peer in peers if peer.starting_with < 0 or peer.starting_with >= wanted)
                seen = len(peers)
                # What the peers waiting on this node need to know is whether it sees enough: the count, capped at
                # ``wanted``, is republished at most ``wanted`` times, not at every lookup of a view that churns.
                if min(seen, wanted) != self.starting_with:
                    self.starting_with = min(seen, wanted)
                    await self.publish_record()
            if ready >= wanted:
                log.info("%d peer(s) live after %.1f s: starting", seen, loop.time() - started)
                break
            if loop.time() - started > self.cfg.wait_for_peers_timeout:
                log.warning(
                    "only %d of %d peer(s) live and seeing as many after %.0f s (--wait-for-peers-timeout): "
                    "starting anyway",
                    ready,
                    wanted,
                    self.cfg.wait_for_peers_timeout,
                )
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop_requested.wait(), timeout=0.25)
        self.starting_with = -1
        self.telemetry.phase = "training"

    # ------------------------------------------------------------------------------------------ the thread

    def start(self, outer_step: OuterStep, drill: Drill, peer_id: str) -> asyncio.Future[None]:
        """Start the trainer thread; the future resolves on the event loop when it has ended, however it ended."""
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()

        def train() -> None:
            try:
                hooks = fault_hooks(drill, peer_id)
                outer_step.train(self.train_cfg, stop_requested=self.stop_event.is_set, hooks=hooks)
            except BaseException as error:  # a dead trainer must be visible, not silent
                self.error = error
                log.exception("trainer thread failed")
            finally:
                self.stop_event.set()
                loop.call_soon_threadsafe(finished.set_result, None)

        self.thread = threading.Thread(target=train, name="trainer", daemon=True)
        self.thread.start()
        return finished

    def final_checkpoint(self) -> None:
        """The live state as the stopped trainer left it (mid-phase too), so a restart resumes bit-exactly."""
        replica = self.replica
        if self.thread is not None:
            # `finished` resolves from the thread's last `finally`, a moment before the thread itself has ended
            self.thread.join()
        assert replica is not None and not self.alive
        # Never a copy beside the snapshot (the live state's copy was the peak of a node's host memory: 25 GiB more
        # at 1.3b, measured on an H200 machine). Stopped at the outer step the latest snapshot was taken at, that
        # snapshot is the state; stopped mid-phase, the state is taken into the snapshot's own buffers (the node is
        # leaving: no joiner downloads from it any more) and theta's host copy.
        copy = self.snapshot.hold()
        if copy is not None and copy.metadata["counters"]["inner_step"] == replica.inner_step:
            if copy.metadata.get("checkpointed"):  # that step's checkpoint is this state: written once, not twice
                copy.release()
                self.checkpoints.flush()
                return
            state = replica_state_of(copy)  # theta == phi at an outer step
        else:
            if copy is not None:
                copy.release()
            if self.snapshots is None:
                copy, state = None, replica.state_dict()
            else:
                self.snapshot.clear()
                copy = self.snapshots.take(replica)
                state = {**replica_state_of(copy), "theta": replica.fast_weights()}  # mid-phase: theta is not phi
        history = self.telemetry.history_list(KEEP_OUTER_STEPS)
        strategy = self.peering.strategy.checkpoint_state()
        self.checkpoints.submit(
            lambda: {**self.checkpoint_extra(), "replica": state, "history": history, "strategy": strategy},
            copy.release if copy is not None else lambda: None,
        )
        self.checkpoints.flush()

    def checkpoint_extra(self) -> dict[str, Any]:
        """What every checkpoint carries besides the state: the run's identity, and the node's standing (its own
        history with its peers: pairing/standing.py), read as the checkpoint is written."""
        return {
            "standing": self.standing.checkpoint_state(),
            "run_fingerprint": self.layout.run_fingerprint,
            "run_start": self.layout.start,  # names what differs when a node of other settings finds it
            "model_source": self.layout.source.record(),
            "tokenizer_json": self.corpus.tokenizer.json_text,  # export, eval and generate need it
        }

    # ------------------------------------------------------------------------------------------ called by the thread

    def _swarm_step(self, own_step: int) -> SwarmStep | None:
        """The outer step to move this node's clock to when most peers with standing are beyond reach ahead
        (pairing/standing.py), else None. Peers set aside for the norm bound are called again then: the bound they
        failed did not yet count the steps the two were apart."""
        recent = [h["train_seconds"] + h["wait_seconds"] for h in self.telemetry.history_list(8)]
        seconds_per_step = sorted(recent)[len(recent) // 2] if recent else 1.0
        target = self.standing.swarm_step(
            own_step, self.telemetry.peer_steps(), self.cfg.max_staleness, seconds_per_step
        )
        if target is not None:
            self.policy.lift(NORM_BOUND)
        return target

    def _catch_up(self, catch_up: CatchUp, replica: Replica, near: int | None) -> bool:
        """Left behind: download and adopt a donor's state (of a donor near outer step ``near``, else near the
        credible front) on the event loop. The thread waits for it, so the replica still has one writer at a time;
        every call in it has a deadline."""
        assert self.peering.context.loop is not None
        download = catch_up.download_state(
            replica, has_own_state=True, rounds=1, purpose="caught up with the swarm", near=near
        )
        adopted = asyncio.run_coroutine_threadsafe(download, self.peering.context.loop).result()
        if adopted:
            # Their payloads were refused as too far from weights this node no longer has.
            lifted = self.policy.lift(NORM_BOUND)
            if lifted:
                log.info("called again %d peer(s) set aside for the norm bound, after catching up", len(lifted))
        self.telemetry.phase = "training"
        return adopted
