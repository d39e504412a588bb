"""Fetching peers' rollouts: the DHT says who has which round (each record's manifest), GetRollouts brings it
(rpc/rollout_serving.py), rl/rollouts.py checks it, and the pool keeps it for the trainer's next update.

Runs on the node's event loop as a supervised task; each blocking gRPC call runs on the fetcher's own small thread
pool under a deadline, so a dead or slow peer costs one thread for at most ``timeout`` seconds and blocks nobody:
the trainer waits at most ``--external-wait`` for the pool, then takes whatever it holds. A peer whose batch is
refused is not asked again for ``AVOID_SECONDS``. Each poll asks at most one key per network group (a /24 or /48:
noloco_node/addresses.py), in random order, so keys minted by the hundred on one machine or subnet take no more of
the fetches than one honest peer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from noloco_node.discovery.dht import Discovery, PeerRecord
from noloco_node.rl.rollouts import ExternalPool, RolloutError, decode_batch
from noloco_node.rl.stats import RolloutStats
from noloco_node.rpc.client import ExchangeError, fetch_rollouts
from noloco_node.rpc.transport import Transport

log = logging.getLogger(__name__)

AVOID_SECONDS = 60.0
MAX_PARALLEL = 4
DHT_DEADLINE = 10.0


class RolloutFetcher:
    def __init__(
        self,
        discovery: Discovery,
        transport: Transport,
        pool: ExternalPool,
        stats: RolloutStats,
        *,
        run_fingerprint: str,
        interval: float,
        timeout: float,
    ) -> None:
        self.discovery = discovery
        self.transport = transport
        self.pool = pool
        self.stats = stats
        self.run_fingerprint = run_fingerprint
        self.interval = interval
        self.timeout = timeout
        self.peers: list[PeerRecord] = []  # the last lookup, for /status
        self._fetched_round: dict[str, int] = {}
        self._avoid_until: dict[str, float] = {}
        self._executor = ThreadPoolExecutor(max_workers=MAX_PARALLEL, thread_name_prefix="rollout-fetch")

    async def run(self) -> None:
        while True:
            await self.fetch_once()
            await asyncio.sleep(self.interval)

    async def fetch_once(self) -> None:
        self.peers = await asyncio.wait_for(self.discovery.live_peers(), DHT_DEADLINE)
        now = time.monotonic()
        # Bounded by the live peers: what is known of peers that left is forgotten (a bar until it expires).
        live = {p.peer_id for p in self.peers}
        self._fetched_round = {k: v for k, v in self._fetched_round.items() if k in live}
        self._avoid_until = {k: v for k, v in self._avoid_until.items() if v > now}
        due = [
            p
            for p in self.peers
            if p.rollout_round > self._fetched_round.get(p.peer_id, -1) and self._avoid_until.get(p.peer_id, 0) <= now
        ]
        random.shuffle(due)
        one_per_host = list({p.network_group: p for p in due}.values())
        await asyncio.gather(*(self._fetch(p) for p in one_per_host[:MAX_PARALLEL]))

    async def _fetch(self, peer: PeerRecord) -> None:
        call = functools.partial(
            fetch_rollouts,
            peer.address,
            self.run_fingerprint,
            peer.rollout_round,
            timeout=self.timeout,
            transport=self.transport,
            peer_id=peer.peer_id,
        )
        try:
            loop = asyncio.get_running_loop()
            batch = await asyncio.wait_for(loop.run_in_executor(self._executor, call), self.timeout + 1.0)
        except (asyncio.TimeoutError, TimeoutError):
            self.stats.fetch_failed("DEADLINE_EXCEEDED")
            return
        except ExchangeError as error:
            self.stats.fetch_failed(error.reason)
            return
        except grpc.RpcError as error:
            code = error.code()
            self.stats.fetch_failed(code.name if code is not None else "UNKNOWN")
            if code == grpc.StatusCode.NOT_FOUND:  # that round is stale there: wait for the next manifest
                self._fetched_round[peer.peer_id] = peer.rollout_round
            return
        self._fetched_round[peer.peer_id] = peer.rollout_round
        try:
            groups = decode_batch(
                batch, run_fingerprint=self.run_fingerprint, peer_id=peer.peer_id, round_=peer.rollout_round
            )
        except RolloutError as error:
            self.stats.refusal(error.reason)
            self._avoid_until[peer.peer_id] = time.monotonic() + AVOID_SECONDS
            log.warning("refused the rollouts of peer %s (%s): %s", peer.peer_id[-8:], error.reason, error)
            return
        self.pool.add(groups)
        self.stats.accepted(len(groups))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
