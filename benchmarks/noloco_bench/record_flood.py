"""Records from free keys under a run's peers key, as an outsider writes them (docs/threat-model.md, 12): each
signed by its own key (so every DHT peer stores it), naming an address of the outsider's where nothing answers,
claiming the swarm's front, and optionally dated in the future (``--ahead``) or with every field filled up to the
size readers accept (``--fill``). Refreshed until stopped. Used by tests/integration/test_discovery_flood.py.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from noloco_bench.echo_flood import ManyKeysSigner
from noloco_bench.outsider import attacker_arguments, fresh_identity, targets_from_status_files
from noloco_node.discovery.dht import MAX_RECORD_BYTES, PeerRecord, owner_subkey, peers_key, record_bytes
from noloco_node.observability.status_file import read_status_document
from noloco_node.security.identity import NodeIdentity

RECORD_LIFE = 20.0  # each store's lifetime; refreshed every third of it


def flood_record(
    identity: NodeIdentity, fingerprint: str, address: str, step: int, *, ahead: float, fill: bool
) -> dict:
    """One outsider record: ready, at ``step``, dated ``ahead`` seconds from now; with ``fill``, its free-form
    fields padded until the record is as large as readers accept."""
    record = PeerRecord(identity.peer_id, address, fingerprint, step, step * 20, ready=True)
    value = {**record.to_value(), "updated": get_dht_time() + ahead}
    if fill:
        value["p2p_id"] = "Q" * 64
        value["relays"] = ["R" * 64] * 8
        families: list[str] = []
        while record_bytes({**value, "rollout_families": [*families, "f" * 64]}) <= MAX_RECORD_BYTES:
            families.append("f" * 64)
        value["rollout_families"] = families
    return value


async def _store_all(_dht: Any, node: Any, key: str, subkeys: list[str], values: list[dict], expiration: float) -> int:
    """In the DHT's process: every record in one store_many; how many were stored."""
    stored = await node.store_many([key] * len(values), values, expiration, subkeys=subkeys)
    return sum(1 for ok in stored.values() if ok)


class RecordFlood:
    def __init__(
        self, initial_peers: Sequence[str], identities: Sequence[NodeIdentity], host: str, *, ahead: float, fill: bool
    ) -> None:
        self.identities = list(identities)
        self.host, self.ahead, self.fill = host, ahead, fill
        self.dht = hivemind.DHT(
            initial_peers=list(initial_peers),
            host_maddrs=[f"/ip4/{host}/tcp/0"],
            record_validators=[ManyKeysSigner(self.identities)],
            startup_timeout=60,
            start=True,
        )
        self.report: Counter[str] = Counter()

    def publish(self, fingerprint: str, step: int) -> int:
        values = [
            flood_record(identity, fingerprint, f"{self.host}:{9000 + n}", step, ahead=self.ahead, fill=self.fill)
            for n, identity in enumerate(self.identities)
        ]
        subkeys = [owner_subkey(identity) for identity in self.identities]
        store = functools.partial(
            _store_all,
            key=peers_key(fingerprint),
            subkeys=subkeys,
            values=values,
            expiration=get_dht_time() + RECORD_LIFE,
        )
        stored = self.dht.run_coroutine(store)
        self.report["stored"] += stored
        self.report["sizes"] = max(self.report["sizes"], max(record_bytes(v) for v in values))
        return stored


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m noloco_bench.record_flood``: the records as a process of its own, at the lowest CPU priority.
    Prints when its first refresh was stored, and its report, as JSON."""
    parser = attacker_arguments(main.__doc__)
    parser.add_argument("--records", type=int, default=1100)
    parser.add_argument("--ahead", type=float, default=0.0, help="date every record this far in the future (s)")
    parser.add_argument("--fill", action="store_true", help="fill every record up to the size readers accept")
    parser.add_argument("--host", default="127.0.0.2", help="the outsider's address: its DHT and its records")
    args = parser.parse_args(argv)
    os.nice(19)
    identities = [fresh_identity() for _ in range(args.records)]
    statuses = [read_status_document(data_dir) or {} for data_dir in args.data_dir]
    initial_peers = [maddr for status in statuses for maddr in status.get("dht_maddrs", [])]
    flood = RecordFlood(initial_peers, identities, args.host, ahead=args.ahead, fill=args.fill)
    targets = targets_from_status_files(args.data_dir)
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    began: float | None = None
    deadline = time.monotonic() + args.seconds
    while not done.is_set() and time.monotonic() < deadline:
        now = targets()
        if now:
            flood.publish(now[0].run_fingerprint, max(t.outer_step for t in now))
            began = began or time.time()
        done.wait(RECORD_LIFE / 3)
    flood.dht.shutdown()
    print(json.dumps({**flood.report, "began": began}))
    return 0


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
