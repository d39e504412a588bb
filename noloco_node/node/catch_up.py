"""Where a node starts from: its data shard, and its state (its own checkpoint, a live donor's, or the run's seed).

- The shard: ``--shard-index`` if given; else the one it trained on before (``shard.json`` in its data dir, so a
  restart resumes the same data stream); else the first shard, in an order drawn from its peer id, that no live
  peer holds, so that replicas see different data.
- The state: its checkpoint, unless the swarm has moved more than ``--max-behind`` outer steps ahead of it; else
  a donor's snapshot, drawn at random among the freshest live peers and resumable from another donor of the same
  outer step (rpc/state_download.py); else the run's seed.

Whom a node believes here: a DHT record is signed by its owner, but its owner may lie. One record claiming outer
step 1,000,000 once made a fresh joiner adopt an attacker's random state, and a member restarting from a good
checkpoint believe itself 999,924 steps behind and throw it away. So:

- **The swarm's front is claimed by peers with standing** once this node has any (pairing/standing.py; a
  restarting member has its checkpoint's standing back before it looks), and it is **corroborated by network
  groups, not keys**: the furthest outer step that peers in at least two groups claim (noloco_node/addresses.py:
  keys and names cost nothing, so many records from one address or one /24 are one claim; with a single group in
  sight, the furthest step two of its peers claim, or its one peer's), and donors are the peers within one step
  of it. A restarting member takes no front beyond what its own history makes plausible (``plausible_reach``: its
  last step, plus twice its own pace for the time it was away), whoever claims it.
- **Only the slow weights are adopted, and they are measured first**, on this node's own validation batches: a
  member adopts them only if they are no worse than its own checkpoint's, a fresh joiner only if they are at least
  ``STATE_IMPROVEMENT`` better than the run's seed (a donor past outer step 0 has learnt something). The counters
  must be the donor's claimed step, consistent with it, and short of this run's ``--steps`` (counters at its end
  would end the node that took them, and its checkpoint would end it again at every restart). The outer momentum
  and Adam's moments are rebuilt locally, never taken from the donor (training/replica.py
  ``adopt_donor_weights``): two free keys once served honest weights with moments of 1 and 0, and both a joiner
  and a restarting member ended worse than the seed. A state that fails is dropped whole, its donor is not asked
  again, and the node keeps what it had.

Everything here runs on the event loop and awaits the DHT and the donors under deadlines; loading a checkpoint and
adopting a downloaded state run in threads. One download, over every donor it tries, has a deadline of its own
(``DOWNLOAD_BUDGET`` times one donor's); it beats the health clock while bytes arrive (a node downloading is alive),
and a stop request cancels it at once: a joiner stopped in the middle starts nothing, writes nothing, and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from noloco_node.atomic_files import write_atomically
from noloco_node.config.models import TrainConfig
from noloco_node.config.node_config import NodeConfig
from noloco_node.data.corpus import Corpus, ReplicaShard
from noloco_node.discovery.dht import Discovery, PeerRecord
from noloco_node.errors import NolocoError
from noloco_node.model.checkpoint_file import load_checkpoint
from noloco_node.model.source import ModelSource
from noloco_node.node.probation import Probation
from noloco_node.observability.telemetry import Telemetry
from noloco_node.rpc.client import ExchangeError
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.state_download import StateDownload
from noloco_node.rpc.transport import Transport
from noloco_node.training.checkpoints import state_layout
from noloco_node.training.data_parallel import DataParallel
from noloco_node.training.replica import Batch, Replica

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
STATE_IMPROVEMENT = 0.01  # a joiner adopts a donor's state only if its validation loss is 1% below the seed's
# A download, over all the donors it tries, lasts at most this many times one donor's deadline: a download resumes
# where the last donor stopped, so two deadlines hold a whole state at --min-link-rate with one donor failing.
DOWNLOAD_BUDGET = 2.0
WATCH_SECONDS = 1.0  # how often a download in progress is checked for a stop request and for progress


def credible_front(peers: Sequence[PeerRecord]) -> int | None:
    """The furthest outer step that peers in enough network groups claim to have reached: the k-th furthest of the
    groups' claims (each group's: the lower median of its peers'), k = max(2, half the groups), so that an outsider
    needs as many groups as the honest ones in sight to move it (many keys in one group are one claim). One group
    in sight: the furthest step two of its peers claim, or its one peer's. None if no peer is in sight."""
    furthest: dict[str, list[int]] = {}
    for peer in peers:
        furthest.setdefault(peer.network_group, []).append(peer.outer_step)
    if not furthest:
        return None
    if len(furthest) == 1:
        claims = sorted(next(iter(furthest.values())), reverse=True)
        return claims[1] if len(claims) > 1 else claims[0]
    # A group's claim is the lower median of its peers' claims: one liar key beside honest nodes in a shared
    # group (a NAT, a loopback test) does not make that group claim the liar's step.
    claims = sorted((sorted(steps)[(len(steps) - 1) // 2] for steps in furthest.values()), reverse=True)
    return claims[max(2, (len(claims) + 1) // 2) - 1]


def implausible_counters(
    got: dict[str, int], donor: PeerRecord, inner_steps: int, total_steps: int, *, before: PeerRecord | None = None
) -> str | None:
    """Why the counters a donor sent cannot be the state of the step its record claims, or cannot be this member's
    (at or past its own ``--steps``: adopting them would end it), or None. ``donor`` is its record as read after the
    download, ``before`` as read before it: a donor trains on while it serves, so a download that outlasts its
    phases finds its record steps ahead of the state it sent (seen: 3 steps, 1 s phases, a 3 s download)."""
    outer, inner = int(got["outer_step"]), int(got["inner_step"])
    if inner >= total_steps:
        return f"inner step {inner}, at or past this run's --steps ({total_steps}): it would end this node"
    lowest = min(donor.outer_step, before.outer_step) if before is not None else donor.outer_step
    if not lowest - 1 <= outer <= donor.outer_step + 1:
        said = f"{lowest} to {donor.outer_step}" if lowest != donor.outer_step else f"{donor.outer_step}"
        return f"outer step {outer}, but its record says {said}"
    # At outer step k a replica has taken k phases of H inner steps (the run's last may be shorter), and borrowed
    # at most half of the next one.
    if not (outer - 1) * inner_steps < inner < (outer + 1) * inner_steps:
        return f"inner step {inner} at outer step {outer} with H = {inner_steps}"
    return None


def plausible_reach(history: Sequence[dict[str, Any]], max_staleness: int, now: float) -> int | None:
    """The furthest outer step the swarm can plausibly have reached since this node's checkpoint, from its own
    history (outer steps and their wall-clock times): its last step, plus ``max_staleness``, plus twice its own pace
    for the time since. None without two timed steps to measure a pace on. A restarting member takes no front and no
    donor beyond it, whoever claims it (the same bound as pairing/standing.py ``swarm_step``)."""
    timed = [(int(h["outer_step"]), float(h["time"])) for h in history if "time" in h and "outer_step" in h]
    if len(timed) < 2 or timed[-1][0] <= timed[0][0] or timed[-1][1] <= timed[0][1]:
        return None
    seconds_per_step = (timed[-1][1] - timed[0][1]) / (timed[-1][0] - timed[0][0])
    return timed[-1][0] + max_staleness + int(2 * max(0.0, now - timed[-1][1]) / seconds_per_step)


def donors_near(peers: Sequence[PeerRecord], front: int) -> list[PeerRecord]:
    """The peers within one outer step of the front: a claim far beyond it is not believed."""
    return [p for p in peers if front - 1 <= p.outer_step <= front + 1]


class NodeError(NolocoError):
    """A node that cannot start as configured (the message says why and what to change)."""


class StoppedBeforeTrainingError(Exception):
    """The node was asked to stop before it had a state to train: it leaves without training or writing one."""


@dataclass
class CatchUp:
    cfg: NodeConfig
    train_cfg: TrainConfig
    run_fingerprint: str
    peer_id: str
    discovery: Discovery
    transport: Transport
    telemetry: Telemetry
    metrics: ExchangeMetrics
    download_timeout: float
    validation: Sequence[Batch]  # this node's own batches: a donor's state is measured on them before adoption
    # Whose claims of the swarm's front count (pairing/standing.py): once this node has peers with standing, theirs
    # alone, so that strangers' records cannot pull a running node onto a front of their making.
    believe: Callable[[str], bool] = lambda _peer_id: True
    refused_donors: set[str] = field(default_factory=set)  # never asked again: their state went bad (Probation)
    run_start: dict[str, str] = field(default_factory=dict)  # the run's model and settings (node/run_layout.py)
    stopping: Callable[[], bool] = lambda: False  # SIGTERM or SIGINT: a download in progress is cancelled
    probation: Probation = field(init=False)
    # The pairing strategy's state saved with the checkpoint this node resumed from (a sparse run's gap estimates);
    # empty when it started otherwise or adopted a donor's state since.
    resumed_strategy_state: dict[str, Any] = field(default_factory=dict)
    # The standing this node's checkpoint kept (pairing/standing.py ``restore``): restored before any front is
    # taken, so that a restarting member believes the peers it had standing with.
    restore_standing: Callable[[Sequence[dict[str, Any]]], None] = lambda _saved: None
    front_cap: int | None = None  # plausible_reach of the checkpoint's history; None: no cap (a joiner)
    far_refusals: Callable[[], int] = lambda: 0  # refusals under the norm bound so far: Probation's mark

    def __post_init__(self) -> None:
        self.probation = Probation(self.cfg.data_dir / CHECKPOINT_FILE, self.refused_donors)

    async def choose_shard(self) -> int:
        """This node's data shard (see the module docstring). Two nodes starting in the same second may still pick
        the same one: nothing breaks, their data overlaps."""
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
        record = {"run_fingerprint": self.run_fingerprint, "num_shards": count, "shard": chosen}
        await asyncio.to_thread(write_atomically, memory, json.dumps(record))
        return chosen

    async def replica(
        self, shard_index: int, corpus: Corpus, source: ModelSource, data_parallel: DataParallel | None
    ) -> Replica:
        """The replica on its shard (of this member's slice of it, on several GPUs), in its initial state; in a
        multi-GPU member the other ranks take their shards of it (they follow rank 0's whole-model calls)."""
        index, count = shard_index, self.cfg.num_shards
        if data_parallel is not None:
            await asyncio.to_thread(data_parallel.share_shard_index, index)
            index, count = data_parallel.shard(index, count)
        shard = ReplicaShard(
            corpus.train, replica=index, num_replicas=count, seq_len=self.train_cfg.seq_len, seed=self.train_cfg.seed
        )
        replica = await asyncio.to_thread(Replica, source, self.train_cfg, [shard], data_parallel=data_parallel)
        self.telemetry.phase = "looking for a checkpoint or a donor's state"
        await self.initial_state(replica)
        return replica

    async def initial_state(self, replica: Replica) -> None:
        """Resume from this node's checkpoint unless the swarm has credibly moved far ahead of it; else download a
        live donor's state that measures well; else start from the run's seed."""
        checkpoint = self.cfg.data_dir / CHECKPOINT_FILE
        if checkpoint.exists():
            await self._resume(replica, checkpoint)
            if not self.cfg.download_state:
                return
            front = self._capped(credible_front(await self._donor_candidates()))
            # Further behind than the staleness bound, a node could pair with nobody: it would train alone at the
            # swarm's pace and never catch up (seen in a 3-node tiny swarm: a restart 4 steps behind, solo to the end).
            allowed = min(self.cfg.max_behind, self.cfg.max_staleness)
            if front is None or front - replica.outer_step <= allowed:
                return
            log.info(
                "the checkpoint is %d outer steps behind the swarm (more than %d, the lower of --max-behind and "
                "--max-staleness): downloading state",
                front - replica.outer_step,
                allowed,
            )
            if not await self.download_state(replica, has_own_state=True):
                log.warning("no donor served a state better than the checkpoint's: training on from the checkpoint")
            return
        if self.cfg.download_state and await self.download_state(replica, has_own_state=False):
            return
        if self.stopping():  # not the seed: a restart would resume from a seed checkpoint instead of downloading
            raise StoppedBeforeTrainingError("asked to stop while downloading the swarm's state")
        log.info("starting run %s from its seed (%d)", self.run_fingerprint, self.train_cfg.seed)

    async def _resume(self, replica: Replica, checkpoint: Path) -> None:
        payload = await asyncio.to_thread(load_checkpoint, checkpoint)  # torch.load: never on the event loop
        if payload.get("run_fingerprint") != self.run_fingerprint:
            theirs = payload.get("run_start") or {}
            differing = [
                f"{key} {theirs.get(key, '?')} (now: {self.run_start.get(key, '?')})"
                for key in sorted(set(theirs) | set(self.run_start))
                if theirs and theirs.get(key) != self.run_start.get(key)
            ]
            raise NodeError(
                f"{checkpoint} belongs to run {payload.get('run_fingerprint')}, not {self.run_fingerprint}"
                + (f" ({'; '.join(differing)})" if differing else "")
                + ": give the run's settings again, or use another --data-dir"
            )
        await asyncio.to_thread(replica.load_state_dict, payload["replica"])
        self.telemetry.restore_history(payload.get("history", []))
        self.restore_standing(payload.get("standing", []))
        self.front_cap = plausible_reach(payload.get("history", []), self.cfg.max_staleness, time.time())
        self.resumed_strategy_state = payload.get("strategy", {})
        log.info("resumed from %s at outer step %d", checkpoint, replica.outer_step)

    def _capped(self, front: int | None) -> int | None:
        """``front``, no further than this node's own history makes plausible (``plausible_reach``)."""
        if front is None or self.front_cap is None or front <= self.front_cap:
            return front
        log.warning(
            "peers claim the swarm is at outer step %d; at this node's own pace it can be at %d at most: "
            "taking donors near %d",
            front,
            self.front_cap,
            self.front_cap,
        )
        return self.front_cap

    async def _donor_candidates(self) -> list[PeerRecord]:
        try:
            return [
                p
                for p in await self.discovery.live_peers()
                if p.outer_step > 0 and p.address and p.reachable and self.believe(p.peer_id)
            ]
        except (TimeoutError, OSError) as error:
            log.warning("DHT lookup for donors failed: %s", error)
            return []

    async def _current_record(self, donor: PeerRecord) -> PeerRecord:
        """The donor's record as the DHT holds it now, to judge the state it sent against: the one in this node's
        view may be several outer steps old (a view above level 0 reads a peer's bucket now and then), and an
        honest donor's state was refused as not the step its old record claimed. The old one if the read fails."""
        try:
            return await self.discovery.current_record(donor.peer_id) or donor
        except (TimeoutError, OSError):
            return donor

    async def download_state(
        self,
        replica: Replica,
        *,
        has_own_state: bool,
        rounds: int = 3,
        purpose: str = "joined a run in progress",
        near: int | None = None,
    ) -> bool:
        """Adopt a fresh donor's snapshot that measures well (see the module docstring). Donors are drawn at
        random near the credible front, so joiners spread out; a busy or failing donor is followed by the next
        one, which continues the download where the last stopped when its snapshot is of the same outer step."""
        layout = state_layout(replica.source)
        own_loss = await asyncio.to_thread(replica.evaluate, self.validation)
        needed = own_loss if has_own_state else own_loss * (1 - STATE_IMPROVEMENT)
        refused = set(self.refused_donors)  # and, for this download, those whose state measured worse
        download = StateDownload(layout, run_fingerprint=self.run_fingerprint, peer_id=self.peer_id)
        deadline = time.monotonic() + DOWNLOAD_BUDGET * self.download_timeout
        for attempt in range(rounds):
            if self.stopping() or time.monotonic() >= deadline:
                break
            peers = [p for p in await self._donor_candidates() if p.peer_id not in refused]
            # ``near``: a front the caller corroborated itself (pairing/standing.py swarm_step).
            front = self._capped(credible_front(peers) if near is None else near)
            if front is None:
                return False
            donors = donors_near(peers, front)
            random.shuffle(donors)
            counters = download.counters
            if counters is not None:  # a partial download resumes best at its own outer step
                donors.sort(key=lambda p: p.outer_step != counters["outer_step"])
            for donor in donors:
                if self.stopping() or time.monotonic() >= deadline:
                    break
                self.telemetry.phase = f"downloading state of outer step {donor.outer_step} from {donor.peer_id[-8:]}"
                before = await self._current_record(donor)
                try:
                    tensors, got = await self._fetch(download, donor, deadline)
                except ExchangeError as error:
                    log.warning(
                        "state download from %s failed (%s); %d tensors kept for the next donor",
                        donor.peer_id[-8:],
                        error,
                        len(download.done),
                    )
                    continue
                claimed = await self._current_record(donor)
                implausible = implausible_counters(
                    got, claimed, self.train_cfg.inner_steps, self.train_cfg.total_steps, before=before
                )
                if implausible is not None:
                    refused.add(donor.peer_id)
                    download = StateDownload(layout, run_fingerprint=self.run_fingerprint, peer_id=self.peer_id)
                    self.metrics.outcome("state_refused")
                    log.warning("refused the state from %s: implausible counters (%s)", donor.peer_id, implausible)
                    continue
                phi = [tensors[f"phi/{name}"] for name in replica.names]
                loss = await asyncio.to_thread(replica.loss_of, phi, self.validation)
                if not loss <= needed:  # NaN fails too
                    refused.add(donor.peer_id)
                    download = StateDownload(layout, run_fingerprint=self.run_fingerprint, peer_id=self.peer_id)
                    self.metrics.outcome("state_refused")
                    log.warning(
                        "refused the state of outer step %d from %s: validation loss %.4f on this node's batches, "
                        "against %.4f for %s",
                        got["outer_step"],
                        donor.peer_id,
                        loss,
                        own_loss,
                        "its own checkpoint" if has_own_state else "the run's seed",
                    )
                    continue
                await asyncio.to_thread(
                    replica.adopt_donor_weights, tensors, int(got["outer_step"]), int(got["inner_step"])
                )
                self.metrics.outcome("state_downloaded")
                self.probation.begin(donor.peer_id, loss, self.far_refusals())
                log.info(
                    "%s: state of outer step %d from %s (validation loss %.4f, against %.4f; %.3f MB downloaded)%s",
                    purpose,
                    replica.outer_step,
                    donor.peer_id[-8:],
                    loss,
                    own_loss,
                    download.bytes_received / 1e6,
                    " (resumed where another donor stopped)" if download.resumed else "",
                )
                self.resumed_strategy_state = {}
                return True
            if attempt + 1 < rounds:
                await asyncio.sleep(2.0)
        if time.monotonic() >= deadline:
            log.warning("gave up downloading a state after %.0f s", DOWNLOAD_BUDGET * self.download_timeout)
        return False

    async def _fetch(self, download: StateDownload, donor: PeerRecord, deadline: float) -> tuple[dict, dict[str, int]]:
        """One donor's share of the download, in a thread, within what is left of the download's deadline. Bytes
        arriving beat the health clock (a 1.3B state at the default minimum link rate takes longer than
        --stall-after); a stop request cancels the call."""
        fetching = asyncio.ensure_future(
            asyncio.to_thread(
                download.fetch,
                donor.address,
                timeout=min(self.download_timeout, max(0.0, deadline - time.monotonic())),
                transport=self.transport,
                donor_peer_id=donor.peer_id,
            )
        )
        seen = download.bytes_received
        while True:
            # The call has its own deadline; the watch bounds the hand-off back from the thread.
            done, _ = await asyncio.wait({fetching}, timeout=WATCH_SECONDS)
            if done:
                return fetching.result()
            if download.bytes_received != seen:
                seen = download.bytes_received
                self.telemetry.beat()
            if self.stopping() or time.monotonic() > deadline + 5:
                download.cancel()
                with contextlib.suppress(ExchangeError, asyncio.TimeoutError):
                    await asyncio.wait_for(fetching, timeout=10)
                raise ExchangeError(grpc.StatusCode.CANCELLED, "stopped", "the download was cancelled")
