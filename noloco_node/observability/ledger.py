"""The contribution ledger: each member's part in a run, rebuilt by anyone from published receipts alone.

Receipts (security/receipts.py) come from members' ``receipts.jsonl`` files, or from the live members of a run,
found through the DHT and asked over gRPC (``GetReceipts``, rpc/receipt_serving.py); both partners of an exchange
keep the same receipt, so most arrive twice and count once (by call binding). Nothing here trusts the source: each
receipt is checked on its own (both signatures, by keys whose digests are the named peer ids), and one that proves
nothing is refused with its reason and counted:

- ``malformed``: not a receipt; ``other_run``: signed for another run than the ledger's;
- ``wrong_signer`` / ``bad_signature`` / ``self_signed``: forged or altered (a signature that does not cover these
  terms, a key that is not the named member's, one member named as both partners);
- ``future``: a time past the ledger's clock (beyond the allowed skew);
- ``replayed``: a caller's call binding already counted with other terms (only that caller can sign two terms
  under its own nonce; another caller's receipt that names the same nonce is another call, so a key that learns an
  honest call's nonce cannot get the honest receipt refused by publishing one of its own first);
- ``counted_twice``: a member credited again for a payload kind and outer step it already has credit for (the
  receipt's other member keeps its credit if that is new).

Per member the ledger counts outer steps blended (distinct outer steps with a receipt of a blended kind:
:data:`BLENDED_KINDS`, the payloads a blend is made of; a reservation's ``meet`` or ``phase`` swap is an exchange,
not a blend), the tokens it claimed to train in those phases (each receipt names both sides' claims, which the
partner signs but cannot check: an honest member's is the run's inner steps x batch x sequence length), exchanges
by kind, partners, and first and last seen (the receipts' times). Standing decides nothing
here. Members are grouped by who exchanged with whom: the largest group is the swarm, and any other group is shown as
a closed cluster, members who only ever exchanged among themselves (a pair of free keys signing receipts for each
other is one: a receipt needs a partner's signature, and theirs come from nobody else).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import grpc

from noloco_node.discovery.dht import PeerRecord
from noloco_node.observability.status_client import list_peers
from noloco_node.rpc.client import ExchangeError, fetch_receipts
from noloco_node.rpc.receipt_serving import RECEIPTS_PAGE as PAGE
from noloco_node.rpc.transport import Transport
from noloco_node.security.auth import CallAuthenticator, SwarmSecret
from noloco_node.security.identity import NodeIdentity
from noloco_node.security.receipts import RECEIPTS_FILE, Receipt, ReceiptError

BLENDED_KINDS = ("weights", "progress")
FUTURE_SKEW = 300.0  # seconds past the ledger's clock a receipt's time may be (members' clocks differ)
MAX_PAGES = 10_000  # GetReceipts pages read from one member at most (a million receipts)
SHOWN_REFUSALS = 20  # refusals listed one by one; the rest are counted by reason
READERS = 8  # members read at once


class LedgerSourceError(ValueError):
    """A source of receipts that cannot be read (a missing file, a status server that does not answer)."""


@dataclass
class MemberRecord:
    peer_id: str
    blended_steps: set[int] = field(default_factory=set)
    tokens: int = 0  # what it claimed to train per phase, summed over its blended steps
    exchanges: Counter[str] = field(default_factory=Counter)
    partners: set[str] = field(default_factory=set)
    first_seen: int = 0
    last_seen: int = 0

    @property
    def blends(self) -> int:
        return len(self.blended_steps)

    def as_dict(self) -> dict[str, object]:
        return {
            "peer_id": self.peer_id,
            "blends": self.blends,
            "tokens": self.tokens,
            "exchanges": dict(self.exchanges),
            "partners": sorted(self.partners),
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
        }


@dataclass
class Refusal:
    reason: str
    source: str
    detail: str


@dataclass
class Ledger:
    run: str
    receipts: int = 0  # counted (distinct, accepted)
    duplicates: int = 0  # the same receipt again (its other partner's copy)
    members: dict[str, MemberRecord] = field(default_factory=dict)
    refused: Counter[str] = field(default_factory=Counter)
    refusals: list[Refusal] = field(default_factory=list)  # the first SHOWN_REFUSALS
    clusters: list[list[str]] = field(default_factory=list)  # who exchanged with whom, largest first
    quarantined: dict[str, str] = field(default_factory=dict)  # members the node asked holds quarantined: reason

    def refuse(self, reason: str, source: str, detail: str) -> None:
        self.refused[reason] += 1
        if len(self.refusals) < SHOWN_REFUSALS:
            self.refusals.append(Refusal(reason, source, detail))

    def as_dict(self) -> dict[str, object]:
        return {
            "run": self.run,
            "receipts": self.receipts,
            "duplicates": self.duplicates,
            "members": [self.members[m].as_dict() for m in sorted(self.members)],
            "refused": dict(self.refused),
            "refusals": [vars(r) for r in self.refusals],
            "swarm": self.clusters[0] if self.clusters else [],
            "closed_clusters": self.clusters[1:],
            "quarantined": self.quarantined,
        }


def build_ledger(
    lines: Iterable[tuple[str, str]],
    *,
    run: str | None = None,
    now: float | None = None,
    quarantined: Mapping[str, str] | None = None,
) -> Ledger:
    """The ledger of ``run`` from (source, receipt line) pairs; without ``run``, of the run most receipts name.
    ``quarantined`` (peer id: reason, as a node's status lists them) are counted all the same and shown apart."""
    parsed: list[tuple[str, Receipt | ReceiptError]] = []
    for source, line in lines:
        try:
            parsed.append((source, Receipt.from_json(line)))
        except ReceiptError as error:
            parsed.append((source, error))
    if run is None:
        runs = Counter(r.terms.run for _, r in parsed if isinstance(r, Receipt))
        run = runs.most_common(1)[0][0] if runs else ""
    ledger = Ledger(run)
    clock = time.time() if now is None else now
    seen: dict[tuple[str, str], Receipt] = {}  # by call binding and the caller who chose it
    credited: set[tuple[str, str, int]] = set()  # (member, kind, its outer step)
    for source, receipt in parsed:
        if isinstance(receipt, ReceiptError):
            ledger.refuse(receipt.reason, source, str(receipt))
            continue
        terms = receipt.terms
        if terms.run != run:
            ledger.refuse("other_run", source, f"a receipt of run {terms.run[:16]!r}")
            continue
        try:
            receipt.check()
        except ReceiptError as error:
            ledger.refuse(error.reason, source, str(error))
            continue
        if terms.time > clock + FUTURE_SKEW:
            ledger.refuse("future", source, f"dated {_when(terms.time)}, after this ledger's clock")
            continue
        known = seen.get((terms.binding, terms.caller))
        if known is not None:
            if known.terms == terms:
                ledger.duplicates += 1
            else:
                ledger.refuse("replayed", source, f"call binding {terms.binding[:16]}… already counted")
            continue
        seen[(terms.binding, terms.caller)] = receipt
        ledger.receipts += 1
        for member, partner in ((terms.caller, terms.server), (terms.server, terms.caller)):
            step = terms.step_of(member)
            if (member, terms.kind, step) in credited:
                ledger.refuse("counted_twice", source, f"{member} at outer step {step} ({terms.kind}) again")
                continue
            credited.add((member, terms.kind, step))
            record = ledger.members.setdefault(member, MemberRecord(member))
            _credit(record, terms.kind, step, terms.tokens_of(member), partner, terms.time)
    ledger.clusters = _clusters(ledger.members)
    ledger.quarantined = {peer: reason for peer, reason in (quarantined or {}).items() if peer in ledger.members}
    return ledger


def _credit(record: MemberRecord, kind: str, step: int, tokens: int, partner: str, when: int) -> None:
    record.exchanges[kind] += 1
    if kind in BLENDED_KINDS and step not in record.blended_steps:
        record.blended_steps.add(step)
        record.tokens += tokens
    record.partners.add(partner)
    record.first_seen = min(record.first_seen or when, when)
    record.last_seen = max(record.last_seen, when)


def _clusters(members: dict[str, MemberRecord]) -> list[list[str]]:
    """Members grouped by who exchanged with whom, largest first."""
    return connected_groups(list(members), [(m, p) for m, record in members.items() for p in record.partners])


def connected_groups(members: Sequence[str], pairs: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The groups ``members`` fall into when each of ``pairs`` joins its two (connected components), largest first,
    each sorted; a pair naming someone not in ``members`` joins nothing."""
    parent = {m: m for m in members}

    def root(m: str) -> str:
        while parent[m] != m:
            parent[m] = parent[parent[m]]
            m = parent[m]
        return m

    for a, b in pairs:
        if a in parent and b in parent:
            parent[root(a)] = root(b)
    groups: dict[str, list[str]] = {}
    for member in members:
        groups.setdefault(root(member), []).append(member)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: (-len(g), g))


def read_receipt_files(paths: Iterable[Path]) -> Iterator[tuple[str, str]]:
    """(source, line) of every receipt in these files, or in these data directories' receipts.jsonl."""
    for path in paths:
        file = path / RECEIPTS_FILE if path.is_dir() else path
        try:
            with file.open(encoding="utf-8", errors="replace") as lines:
                for number, line in enumerate(lines, start=1):
                    if line.strip():
                        yield f"{file}:{number}", line.strip()
        except OSError as error:
            raise LedgerSourceError(f"cannot read receipts from {file}: {error}") from None


def read_member_receipts(
    address: str, peer_id: str, run: str, *, transport: Transport, timeout: float = 10.0
) -> Iterator[tuple[str, str]]:
    """(source, line) of every receipt the member ``peer_id`` at ``address`` serves (GetReceipts), page by page."""
    after = 0
    for _ in range(MAX_PAGES):
        try:
            lines = fetch_receipts(address, run, after, PAGE, timeout=timeout, transport=transport, peer_id=peer_id)
        except (grpc.RpcError, ExchangeError) as error:
            raise LedgerSourceError(f"cannot read the receipts of {peer_id} at {address}: {error}") from None
        if not lines:
            return
        for number, line in enumerate(lines, start=after + 1):
            yield f"{peer_id}#{number}", line
        after += len(lines)


def read_swarm_receipts(
    bootstrap: list[str], run: str, *, secret: SwarmSecret | None = None
) -> tuple[list[tuple[str, str]], list[str]]:
    """The receipts of every live member of ``run`` a DHT client finds (status_client.list_peers) that it can dial,
    and what could not be read (an unreachable member, one that did not answer): a member behind a NAT is credited
    by its partners' copies. Read with a throw-away key (and the run's secret, for a private run)."""
    identity = NodeIdentity.ephemeral()
    authenticator = CallAuthenticator(secret, identity.peer_id) if secret is not None else None
    transport = Transport(authenticator=authenticator, identity=identity)
    records = list_peers(bootstrap, run, secret=secret)
    missed = [f"{r.peer_id}: not reachable directly" for r in records if not (r.reachable and r.address)]
    reachable = [r for r in records if r.reachable and r.address]

    def read(record: PeerRecord) -> list[tuple[str, str]] | str:
        try:
            return list(read_member_receipts(record.address, record.peer_id, run, transport=transport))
        except LedgerSourceError as error:
            return str(error)

    lines: list[tuple[str, str]] = []
    try:
        with ThreadPoolExecutor(READERS) as pool:  # members are read side by side: a slow one holds up no other
            for result in pool.map(read, reachable):
                if isinstance(result, str):
                    missed.append(result)
                else:
                    lines.extend(result)
    finally:
        transport.close_channels()
    return lines, missed


def format_ledger(ledger: Ledger) -> str:
    """The ledger as a readable report."""
    out = [
        f"run {ledger.run[:16]}: {ledger.receipts} receipts counted ({ledger.duplicates} copies from the other "
        f"partner), {sum(ledger.refused.values())} refused, {len(ledger.members)} members"
    ]
    swarm = set(ledger.clusters[0]) if ledger.clusters else set()
    header = (
        f"{'member':<36} {'blends':>6} {'tokens':>13} {'exchanges':>9} {'partners':>8}  {'first seen':<19}  "
        f"{'last seen':<19}"
    )
    out.append(header)

    def row(member: str) -> str:
        record = ledger.members[member]
        return (
            f"{member:<36} {record.blends:>6} {record.tokens:>13,} {sum(record.exchanges.values()):>9} "
            f"{len(record.partners):>8}  {_when(record.first_seen):<19}  {_when(record.last_seen):<19}"
        )

    shown = sorted(
        (m for m in ledger.members if m not in ledger.quarantined),
        key=lambda m: (m not in swarm, -ledger.members[m].blends, m),
    )
    out.extend(row(member) for member in shown)
    if ledger.quarantined:
        out.append("quarantined by the node asked (counted all the same: standing decides nothing here):")
        out.extend(f"{row(m)}  {reason}" for m, reason in sorted(ledger.quarantined.items()))
    for cluster in ledger.clusters[1:]:
        out.append(f"closed cluster (exchanged only among themselves, never with the swarm): {', '.join(cluster)}")
    if ledger.refused:
        out.append("refused: " + ", ".join(f"{reason} {n}" for reason, n in sorted(ledger.refused.items())))
        out.extend(f"  {r.reason}: {r.source}: {r.detail}" for r in ledger.refusals)
    return "\n".join(out)


def ledger_json(ledger: Ledger) -> str:
    return json.dumps(ledger.as_dict(), indent=2)


def _when(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
