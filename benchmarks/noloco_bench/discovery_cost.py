"""`noloco-node bench discovery`: what finding peers costs one node among 10, 1,000 and 10,000 live records, in the
same run.

For each size, its own run fingerprint, and records published by separate processes (``publisher``: a DHT peer of
the run holding a few thousand keys, 1024-bit RSA to mint them in minutes on two cores; an honest record's subkey
is a 2048-bit key, about 140 bytes more), each record written where a settled member of a swarm of that size
writes it (its level, and the one its estimate leans to: discovery/buckets.py). Then one measured node per size,
each a process of its own with a real ``Discovery``, does for ``seconds`` what a member does: a lookup a second
(pairing and the status watch share one) and its own record published every two seconds (an outer step of a small
run), as a DHT client (it serves nothing, so what it moves is its own discovery, not its share of serving everyone
else's). For each: the bytes its libp2p daemon (p2pd) read and wrote, per second (its DHT traffic, counted twice where
it also crosses the daemon's local socket to the node's DHT process: the same count at every size), the CPU
seconds per second of the node, its DHT process and p2pd, its level and size estimate, the peers in its view, and
how long after its start it first saw another member (the median of lookups until then is what the pairing round
waits). The 10-record node is the reference: the figure at 10,000 records is printed as a multiple of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.timed_storage import get_dht_time

from noloco_bench.echo_flood import ManyKeysSigner
from noloco_node.discovery.buckets import Bucket, SwarmSize
from noloco_node.discovery.dht import MAX_RECORD_TTL, BoundedRecords, Discovery, PeerRecord, TiedDHT, owner_subkey
from noloco_node.security.identity import NodeIdentity, _wrap

STORES_IN_FLIGHT = 32  # a publisher's concurrent stores: larger batches broke hivemind's pipe under load
PUBLISH_EVERY = 2.0
LOOKUP_EVERY = 1.0
COLD_START_POLL = 0.25  # how often a joining node asks for peers before it has any (node/trainer.py wait_for_peers)


def settled_levels(members: int, bucket_records: int) -> tuple[int, ...]:
    """The levels a member of a swarm of ``members`` writes its record at, once its estimate has settled."""
    size = SwarmSize(bucket_records)
    for _ in range(64):
        level = size.read_level()
        size.observe(Bucket(level, 0), max(1, round(members / 2**level)), 1)
    return size.written_levels()


def mint(count: int) -> list[NodeIdentity]:
    from cryptography.hazmat.primitives.asymmetric import rsa

    return [NodeIdentity(_wrap(rsa.generate_private_key(public_exponent=65537, key_size=1024))) for _ in range(count)]


def publisher(fingerprint: str, count: int, members: int, bucket_records: int, bootstrap: list[str], done: Any) -> None:
    """A process: ``count`` keys' records of a ``members``-strong run, stored and refreshed until it is killed."""
    identities = mint(count)
    dht = TiedDHT(
        initial_peers=bootstrap,
        start=True,
        record_validators=[ManyKeysSigner(identities), BoundedRecords()],
    )
    levels = settled_levels(members, bucket_records)

    async def store_all() -> int:
        stored = 0
        pending: list[Any] = []
        for number, identity in enumerate(identities):
            record = PeerRecord(identity.peer_id, f"127.0.0.1:{20000 + number % 40000}", fingerprint, 10, 500, True)
            # Its own lifetime from its own store: storing 20,000 entries takes minutes.
            value, expiration = {**record.to_value(), "updated": get_dht_time()}, get_dht_time() + MAX_RECORD_TTL - 30
            for level in levels:
                key = Bucket.of(identity.peer_id, level).key(fingerprint)
                future = dht.store(key, value, expiration, subkey=owner_subkey(identity), return_future=True)
                pending.append(asyncio.wrap_future(future))
            if len(pending) >= STORES_IN_FLIGHT:
                stored += sum(bool(ok) for ok in await asyncio.gather(*pending, return_exceptions=True) if ok is True)
                pending = []
        stored += sum(bool(ok) for ok in await asyncio.gather(*pending, return_exceptions=True) if ok is True)
        return stored

    while True:
        done.put(asyncio.run(store_all()))
        time.sleep(MAX_RECORD_TTL / 2)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _tree(pid: int) -> list[int]:
    tree, queue = [], [pid]
    while queue:
        current = queue.pop()
        tree.append(current)
        queue.extend(_children(current))
    return tree


def _cpu_seconds(pid: int) -> float:
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def _io_bytes(pid: int) -> int:
    with contextlib.suppress(OSError):
        counters = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        return int(counters["rchar"]) + int(counters["wchar"])
    return 0


def _is_p2pd(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return "p2pd" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    return False


def measured_node(fingerprint: str, bucket_records: int, bootstrap: list[str], seconds: float, out: Any) -> None:
    """A process: one member's discovery, as a node does it, for ``seconds``; reports what it cost."""
    # A client of the DHT (it dials out, serves nothing): what it moves is its own lookups and stores, not the
    # share of everyone else's records and lookups that a full DHT peer also serves.
    discovery = Discovery(fingerprint, initial_peers=bootstrap, bucket_records=bucket_records, client_mode=True)
    started = time.monotonic()
    discovery.start()
    tree = _tree(os.getpid())
    p2pd = [pid for pid in tree if _is_p2pd(pid)]

    async def run() -> dict[str, Any]:
        record = PeerRecord(discovery.peer_id, "127.0.0.1:19999", fingerprint, 10, 500, True)
        await discovery.publish(record)
        first_peer = None
        while first_peer is None and time.monotonic() - started < 120:  # before the window: finding the swarm
            if await discovery.live_peers():
                first_peer = time.monotonic() - started
            await asyncio.sleep(COLD_START_POLL)
        await asyncio.sleep(10)  # the level settles
        cpu0 = sum(_cpu_seconds(pid) for pid in tree)
        bytes0 = sum(_io_bytes(pid) for pid in p2pd)
        window0 = time.monotonic()
        views, last_publish = [], 0.0
        while time.monotonic() - window0 < seconds:
            if time.monotonic() - last_publish >= PUBLISH_EVERY:
                await discovery.publish(record)
                last_publish = time.monotonic()
            with contextlib.suppress(TimeoutError, OSError):
                views.append(len(await discovery.live_peers()))
            await asyncio.sleep(LOOKUP_EVERY)
        elapsed = time.monotonic() - window0
        return {
            "fingerprint": fingerprint,
            "seconds_to_first_peer": first_peer,
            "p2pd_bytes_per_second": (sum(_io_bytes(pid) for pid in p2pd) - bytes0) / elapsed,
            "cpu_per_second": (sum(_cpu_seconds(pid) for pid in tree) - cpu0) / elapsed,
            "median_view": statistics.median(views) if views else 0,
            **discovery.describe(),
        }

    try:
        out.put(asyncio.run(run()))
    finally:
        discovery.shutdown()


@dataclass
class DiscoveryCost:
    sizes: list[int]
    results: dict[int, dict[str, Any]]
    stored: dict[int, int]

    def report(self) -> str:
        lines = [
            "| records | stores acknowledged | level | estimate | in view | p2pd KB/s | CPU % | first peer after |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for size in self.sizes:
            r = self.results.get(size)
            if r is None:
                lines.append(f"| {size} | {self.stored.get(size, 0)} | no answer | | | | | |")
                continue
            first = r["seconds_to_first_peer"]
            lines.append(
                f"| {size:,} | {self.stored.get(size, 0):,} | {r['level']} | {r['estimated_members']} | "
                f"{r['median_view']} | {r['p2pd_bytes_per_second'] / 1e3:.1f} | {100 * r['cpu_per_second']:.1f} | "
                f"{'never' if first is None else f'{first:.1f} s'} |"
            )
        reference = self.results.get(min(self.sizes))
        largest = self.results.get(max(self.sizes))
        if reference and largest and reference["p2pd_bytes_per_second"] > 0:
            ratio = largest["p2pd_bytes_per_second"] / reference["p2pd_bytes_per_second"]
            cpu = largest["cpu_per_second"] / max(1e-9, reference["cpu_per_second"])
            lines.append(
                f"at {max(self.sizes):,} records: {ratio:.2f}x the bytes and {cpu:.2f}x the CPU of the node among "
                f"{min(self.sizes):,} (target <= 2x)"
            )
        return "\n".join(lines)


def run_discovery_bench(sizes: list[int], *, seconds: float, bucket_records: int, publishers: int) -> DiscoveryCost:
    """Publish each size's records, then measure one node per size side by side (module docstring)."""
    validators = [RSASignatureValidator(NodeIdentity.ephemeral().private_key), BoundedRecords()]
    bootstrap_dht = TiedDHT(start=True, record_validators=validators)
    context = multiprocessing.get_context("spawn")
    processes: list[Any] = []
    stored: dict[int, int] = {}
    results: dict[int, dict[str, Any]] = {}
    try:
        bootstrap = [str(m) for m in bootstrap_dht.get_visible_maddrs()]
        fingerprints = {size: f"bench-discovery-{size}" for size in sizes}
        done: dict[int, Any] = {}
        for size in sizes:
            # Of a size's members, one is the measured node: the publishers hold the others.
            others = size - 1
            shares = [others // publishers + (i < others % publishers) for i in range(publishers)] if others else []
            done[size] = context.Queue()
            for share in (s for s in shares if s):
                process = context.Process(
                    target=publisher, args=(fingerprints[size], share, size, bucket_records, bootstrap, done[size])
                )
                process.start()
                processes.append(process)
        for size in sizes:
            count = min(publishers, size - 1)
            stored[size] = sum(done[size].get(timeout=1800) for _ in range(count))
            print(f"  {size:,} records: {stored[size]:,} stores acknowledged", flush=True)
        out = context.Queue()
        measured = [
            context.Process(target=measured_node, args=(fingerprints[size], bucket_records, bootstrap, seconds, out))
            for size in sizes
        ]
        for process in measured:
            process.start()
        for _ in measured:
            result = out.get(timeout=seconds + 300)
            size = next(s for s, f in fingerprints.items() if f == result["fingerprint"])
            results[size] = result
        for process in measured:
            process.join(timeout=30)
    finally:
        for process in processes:
            process.kill()
        bootstrap_dht.shutdown()
    return DiscoveryCost(sizes, results, stored)
