"""A flood of DHT records from free keys (issue 43, docs/threat-model.md 12): what anyone can write into a run's
discovery without running a node.

Two kinds of record, each from a key of its own (1024-bit RSA, to mint thousands in a minute on two cores), every
one ready at the swarm's outer step with an address nobody listens on:

- *filled*: every field at its largest (eight 256-character addresses, relays and task families, as long as the
  record stays within the MAX_RECORD_BYTES readers accept): what a lookup carries is as large as it can be;
- *future*: dated ahead of the readers' clocks, half of them far ahead (a day: readers drop what is dated more than
  MAX_RECORD_AHEAD_SECONDS ahead) and half just inside that allowance (the most a writer can claim and be read):
  a reader that kept the newest records would keep these and nobody else.

Each record is stored in its own bucket at every level of FLOOD_LEVELS (discovery/buckets.py), where the members
of a small swarm read (up to the entries a DHT peer keeps under one key), and stored again every
``--restore-every`` seconds so that DHT peers that join later hold it too. ``--waves`` floods with new keys again
when told (a flood against a swarm whose standing has formed, with keys minted beforehand). Run as ``python -m
noloco_bench.record_flood --bootstrap ADDR --run-fingerprint FP``: prints a JSON line as each wave is stored, then
runs for ``--seconds`` and prints its report as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from functools import partial
from typing import Any

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from noloco_bench.discovery_cost import mint
from noloco_bench.echo_flood import FLOOD_LEVELS, ManyKeysSigner
from noloco_node.discovery.buckets import MAX_BUCKET_ENTRIES, Bucket
from noloco_node.discovery.dht import (
    MAX_RECORD_AHEAD_SECONDS,
    MAX_RECORD_BYTES,
    MAX_RECORD_TTL,
    BoundedRecords,
    PeerRecord,
    TiedDHT,
    owner_subkey,
    record_bytes,
)
from noloco_node.security.identity import NodeIdentity

LONGEST_TEXT = 256  # discovery/dht.py: a longer address, relay or family is refused
MOST_TEXTS = 8


def filled_value(record: PeerRecord) -> dict[str, Any]:
    """``record``'s value with its texts as long and its lists as full as readers accept (eight texts each), as
    long as the whole stays within MAX_RECORD_BYTES."""
    base = {**record.to_value(), "updated": get_dht_time()}
    for length in range(LONGEST_TEXT, 0, -8):
        text = ("/ip4/127.0.0.9/tcp/1/p2p/" + "x" * length)[:length]
        lists = {field: [text] * MOST_TEXTS for field in ("p2p_addrs", "relays", "rollout_families", "partners")}
        value = {**base, "p2p_id": text, **lists}
        if record_bytes(value) <= MAX_RECORD_BYTES:
            return value
    return base


def flood_values(identities: list[NodeIdentity], fingerprint: str, filled: int, outer_step: int) -> list[dict]:
    """One value per key: the first ``filled`` at full size, the rest dated ahead (half a day, half just inside the
    readers' allowance)."""
    values = []
    for number, identity in enumerate(identities):
        port = 20000 + number % 40000  # nobody listens there: a call to it fails at once
        record = PeerRecord(identity.peer_id, f"127.0.0.9:{port}", fingerprint, outer_step, outer_step * 20, True)
        if number < filled:
            values.append(filled_value(record))
        else:
            ahead = 86400.0 if number % 2 else MAX_RECORD_AHEAD_SECONDS - 30
            values.append({**record.to_value(), "updated": get_dht_time() + ahead})
    return values


# Entries per DHT traversal: a store at a time cost ~35 ms of CPU each, and a batch must stay under the 64 KiB a
# message to the DHT process may carry (100 broke the pipe).
STORE_BATCH = 20


async def _store_batch(entries: list[tuple[str, str, dict, float]], _dht: hivemind.DHT, node: hivemind.DHTNode) -> int:
    """In the flood's DHT process: store a batch of (key, subkey, value, expiration) in one traversal."""
    keys, subkeys, values, expirations = (list(column) for column in zip(*entries, strict=True))
    done = await node.store_many(keys, values, expirations, subkeys=subkeys)
    return sum(ok is True for ok in done.values())


def store_all(dht: TiedDHT, identities: list[NodeIdentity], values: list[dict], fingerprint: str) -> int:
    """Store every key's value in its bucket at each flood level, up to the entries a DHT peer keeps under one key
    (MAX_BUCKET_ENTRIES: it refuses the rest, and a refused store costs the traversal all the same); the number of
    stores that succeeded."""
    expiration = get_dht_time() + MAX_RECORD_TTL - 30
    entries, held = [], Counter[str]()
    for identity, value in zip(identities, values, strict=True):
        for level in FLOOD_LEVELS:
            key = Bucket.of(identity.peer_id, level).key(fingerprint)
            if held[key] < MAX_BUCKET_ENTRIES:
                held[key] += 1
                entries.append((key, owner_subkey(identity), value, expiration))
    return sum(
        dht.run_coroutine(partial(_store_batch, entries[start : start + STORE_BATCH]))
        for start in range(0, len(entries), STORE_BATCH)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", action="append", required=True, help="a DHT multiaddr of the run")
    parser.add_argument("--run-fingerprint", required=True)
    parser.add_argument("--filled", type=int, default=1000, help="records with every field at its largest, a wave")
    parser.add_argument("--future", type=int, default=1100, help="records dated ahead of the readers' clocks, a wave")
    parser.add_argument(
        "--waves",
        type=int,
        default=1,
        help="floods of new keys, all minted first; each after the first waits for a line on stdin: the outer step "
        "its records claim",
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to keep storing after the last wave")
    parser.add_argument("--restore-every", type=float, default=30.0)
    parser.add_argument(
        "--nice",
        type=int,
        default=19,
        help="on a machine shared with the swarm the flood waits for the nodes' CPU (at 19 its second wave took over "
        "400 s beside three training nodes on two cores; a flooder brings its own machine)",
    )
    args = parser.parse_args()
    os.nice(args.nice)
    per_wave = args.filled + args.future
    minted = time.monotonic()
    identities = mint(per_wave * args.waves)
    minted = time.monotonic() - minted
    dht = TiedDHT(
        initial_peers=args.bootstrap,
        start=True,
        client_mode=False,
        record_validators=[ManyKeysSigner(identities), BoundedRecords()],
    )
    flooded: list[tuple[list[NodeIdentity], list[dict]]] = []
    stores, store_seconds, outer_step = 0, [], 0
    try:
        for wave in range(args.waves):
            if wave:
                outer_step = int(sys.stdin.readline())
            keys = identities[wave * per_wave : (wave + 1) * per_wave]
            flooded.append((keys, flood_values(keys, args.run_fingerprint, args.filled, outer_step)))
            began = time.monotonic()
            stored = store_all(dht, *flooded[-1], args.run_fingerprint)
            store_seconds.append(round(time.monotonic() - began, 1))
            stores += stored
            print(json.dumps({"wave": wave, "stored": stored, "at": time.time()}), flush=True)
        rounds, until = 1, time.monotonic() + args.seconds
        while until - time.monotonic() > args.restore_every:
            time.sleep(args.restore_every)
            stores += sum(store_all(dht, keys, values, args.run_fingerprint) for keys, values in flooded)
            rounds += 1
        time.sleep(max(0.0, until - time.monotonic()))
    finally:
        dht.shutdown()
    sizes = [record_bytes(value) for _, values in flooded for value in values[: args.filled]]
    report = {
        "keys": len(identities),
        "waves": args.waves,
        "filled": args.filled,
        "future": args.future,
        "levels": list(FLOOD_LEVELS),
        "filled_record_bytes": max(sizes, default=0),
        "stores": stores,
        "rounds": rounds,
        "seconds_to_mint": round(minted, 1),
        "seconds_to_store": store_seconds,
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
