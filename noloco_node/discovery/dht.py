"""Finding the run's live peers through a Hivemind DHT: namespaced, expiring records, refreshed while alive.

Every node stores a record: its gRPC address, outer and inner step, fingerprint, whether it is ready to pair, and
when it wrote it, under its hash buckets' keys ``noloco/<run fingerprint>/peers/<level>/<bits>`` (discovery/
buckets.py: a bucket holds about --bucket-records records whatever the swarm's size, so a lookup costs a node the
same in a swarm of 10 or 10,000). The subkey is the node's public key in hivemind's ``[owner:...]`` form, so every
DHT peer (all run ``RSASignatureValidator``) refuses a write to it that the node's private key did not sign: nobody
can overwrite another peer's address or readiness. Readers take the peer id from that key (identity.py), never from
the record's content, ignore unsigned subkeys and records outside their owner's bucket. In a private run the
record also carries a MAC under the swarm secret (auth.py), and readers drop records without a valid one. Records
expire after ``record_ttl`` seconds unless refreshed, so a crashed node disappears on its own; a node that leaves
writes a tombstone (the DHT keeps the entry with the latest expiration, so a record cannot simply be deleted) and
readers skip tombstones. Peers of another run live under other keys and are never seen; a record whose
fingerprint does not match its key is ignored too. What a node knows of the swarm is its view (discovery/view.py):
the buckets it read, each read replacing what it held of that bucket.

``hivemind.DHT`` forks a helper process, so a node starts its Discovery before any gRPC or torch thread exists.
Every call into the DHT is awaited with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from noloco_node.addresses import canonical_address, group_of_address
from noloco_node.config.node_config import DEFAULT_BUCKET_RECORDS, NodeConfig
from noloco_node.discovery.buckets import MAX_BUCKET_ENTRIES, Bucket, SwarmSize
from noloco_node.discovery.view import MAX_LIVE_PEERS, RecordView
from noloco_node.discovery.vouched import VouchedRecords
from noloco_node.security.auth import SwarmSecret, record_mac, record_mac_ok
from noloco_node.security.identity import NodeIdentity, peer_id_of

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class BoundedRecords(RecordValidatorBase):
    """Every DHT peer of a run (bootstrap peers and nodes) refuses to store, and every reader drops, an entry larger
    than MAX_STORED_VALUE_BYTES or expiring more than MAX_RECORD_TTL from now. Writing costs nothing, so without it
    one key could hold entries that outlive any refresh and answers larger than the transport carries."""

    def validate(self, record: DHTRecord) -> bool:
        return len(record.value) <= MAX_STORED_VALUE_BYTES and record.expiration_time <= get_dht_time() + MAX_RECORD_TTL


class RememberedSignatures(RSASignatureValidator):
    """hivemind's ``RSASignatureValidator`` that remembers the verdict on each record it checked (the last
    REMEMBERED_VERDICTS). Every lookup brings a bucket's records from each DHT peer it asks, and the same records
    come back at every lookup until their owners refresh them: checking each again (its public key parsed, the record
    serialized, an RSA verify) was half of a member's DHT process CPU in a local swarm of 16. A verdict depends on the
    record's bytes and expiration alone, so a record seen before gets the one it got; a record changed in any byte is
    a new record, checked in full."""

    def __init__(self, private_key: Any) -> None:
        super().__init__(private_key)
        self._verdicts: dict[bytes, bool] = {}

    def validate(self, record: DHTRecord) -> bool:
        digest = hashlib.blake2b(digest_size=16)
        for part in (record.key, record.subkey if record.subkey is not None else b"", record.value):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
        digest.update(repr((record.subkey is None, record.expiration_time)).encode())
        seen = digest.digest()
        verdict = self._verdicts.get(seen)
        if verdict is None:
            verdict = self._verdicts[seen] = super().validate(record)
            if len(self._verdicts) > REMEMBERED_VERDICTS:
                del self._verdicts[next(iter(self._verdicts))]  # the oldest first
        return verdict


class TiedDHT(hivemind.DHT):
    """hivemind.DHT whose helper process (and the p2pd daemon it spawns) dies with the node.

    hivemind forks the DHT into a child process that starts p2pd. A node killed with SIGKILL gets no chance to shut
    them down, and both were left running, orphaned, for good. Here the child asks the kernel for SIGTERM when its
    parent dies (Linux prctl PR_SET_PDEATHSIG), leads its own process group so that p2pd is in it, and answers
    SIGTERM by killing that group.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._node_pid = os.getpid()  # set before hivemind forks the child in super().__init__(start=True)
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                os.setpgid(0, 0)
                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
            if os.getppid() != self._node_pid:  # the node died before the prctl took effect
                os.killpg(0, signal.SIGKILL)
        bound_dictionaries()
        super().run()


def bound_dictionaries(limit: int = MAX_BUCKET_ENTRIES) -> None:
    """In a DHT process: store at most ``limit`` live entries under one key (a new subkey past it is refused; an
    entry already held may be refreshed). Subkeys cost nothing to mint, and hivemind keeps any number: one key
    could grow past what an answer can carry (p2pd refuses messages above 4 MiB), and nobody would find anyone."""
    from hivemind.dht import storage

    unbounded = storage.DHTLocalStorage.store_subkey
    if getattr(unbounded, "bounded", False):
        return

    def store_subkey(self: Any, key: Any, subkey: Any, value: bytes, expiration_time: float) -> bool:
        held = self.get(key)
        entries = None if held is None else held.value
        if isinstance(entries, storage.DictionaryDHTValue) and subkey not in entries and len(entries) >= limit:
            return False
        return bool(unbounded(self, key, subkey, value, expiration_time))

    store_subkey.bounded = True  # type: ignore[attr-defined]
    storage.DHTLocalStorage.store_subkey = store_subkey


DEFAULT_RECORD_TTL = 30.0
MAX_RECORD_TTL = 600.0  # the longest lifetime a record may be stored for: a record expiring later is refused
MAX_FOLLOWED = 2  # peers whose buckets every lookup reads too
# A peer record as its writer stores it (msgpack, before the DHT's signature): readers and writers refuse larger
# ones. An honest record is 150-300 bytes; 8 relay multiaddrs and 8 relay ids of today's lengths stay under 1.5 KB.
MAX_RECORD_BYTES = 2048
# Anything this DHT stores or returns, signature included: a start record (32 short entries at most) fits.
MAX_STORED_VALUE_BYTES = 4096
# A record dated (``updated``) further ahead of the reader's clock is refused: no honest clock is that far off.
MAX_RECORD_AHEAD_SECONDS = 300.0
DEFAULT_DHT_TIMEOUT = 10.0
REMEMBERED_VERDICTS = 8192  # records' signature verdicts a DHT process keeps: ~1 MB, past a view's 1,024 records
DHT_SILENCE_SECONDS = 5.0  # a DHT peer that did not answer is skipped by lookups for this long (no doubling)
# live_peers() callers within this long of a lookup's start share its answer: a lookup fetches every record from
# several DHT peers, and unshared lookups from the pairing loops, status page and catch-up filled slow links
# (docs/benchmarks.md, bench race, "Scaling").
LOOKUP_SHARING_SECONDS = 1.0
# ... and this long while the node probes for its swarm (buckets.py): a probe reads one bucket, mostly an empty
# one, and a swarm at level 10 takes 10 probes to find: one a second kept a joiner of a swarm of 10,000 alone for
# 11 s.
PROBE_SHARING_SECONDS = 0.2
MAX_START_ENTRIES = 32  # what a start record may say: the model's few entries and the run-wide settings
MODEL_START_KEYS = frozenset({"model", "config", "weights", "tokenizer", "seed"})


# The one network group of every member reached through relays (not dialled at the address its record names).
RELAYED_GROUP = "relayed"


@dataclass(frozen=True)
class PeerRecord:
    """What a node advertises about itself."""

    peer_id: str
    address: str  # host:port of its gRPC server
    run_fingerprint: str
    outer_step: int = 0
    inner_step: int = 0
    ready: bool = False  # still looking for this phase's partner (sync, stream) / has an offer (overlap mode)
    leaving: bool = False  # a tombstone: the node has left
    reachable: bool = True  # its gRPC address answers (reachability.py); else it is reached through its relays
    shard: int = -1  # the data shard it trains on (-1: not chosen yet); joiners pick one nobody holds
    updated: float = 0.0  # DHT time of writing
    # DHT time its next outer step is due, in a mode whose partners meet at their steps (sync: pairing/reserved.py);
    # 0: not known, or not said. A hint for whom to ask: the peer asked holds the asker's own word to the window.
    next_step_at: float = 0.0
    p2p_id: str = ""  # its libp2p daemon's id (tunnels.py); not its peer id, which is its node key's
    p2p_addrs: tuple[str, ...] = ()  # a reachable member that relays for others: where its daemon listens
    relays: tuple[str, ...] = ()  # an unreachable member: the libp2p ids of the relays it can be reached through
    # An RL node's manifest (noloco_node/rl/): the newest round whose rollouts it serves (GetRollouts; -1: none yet)
    # and their task families. The rollouts themselves never enter the DHT.
    rollout_round: int = -1
    rollout_families: tuple[str, ...] = ()
    # The established peers of its latest blends (pairing/standing.py): a stranger a node's established peer names
    # rides on that peer's share of the node's steps, without a stranger turn.
    partners: tuple[str, ...] = ()
    # While it holds its first step for --wait-for-peers: how many other members it sees live. A waiting node counts
    # a peer as one to start with only once that peer sees as many (or trains): nodes launched together start
    # together, not each when it alone has seen the others. -1: not waiting.
    starting_with: int = -1

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> PeerRecord | None:
        """A record read from the DHT, or None if it is malformed (records are written by strangers)."""
        if not isinstance(value, dict):
            return None
        try:
            record = cls(
                peer_id=peer_id,
                address=str(value["address"]),
                run_fingerprint=str(value["run_fingerprint"]),
                outer_step=int(value.get("outer_step", 0)),
                inner_step=int(value.get("inner_step", 0)),
                ready=bool(value.get("ready", False)),
                leaving=bool(value.get("leaving", False)),
                reachable=bool(value.get("reachable", True)),
                shard=int(value.get("shard", -1)),
                updated=float(value.get("updated", 0.0)),
                next_step_at=_time_or_zero(value.get("next_step_at", 0.0)),
                p2p_id=_short_text(value.get("p2p_id", "")),
                p2p_addrs=_short_texts(value.get("p2p_addrs", ())),
                relays=_short_texts(value.get("relays", ())),
                rollout_round=int(value.get("rollout_round", -1)),
                rollout_families=_short_texts(value.get("rollout_families", ())),
                partners=_short_texts(value.get("partners", ())),
                starting_with=int(value.get("starting_with", -1)),
            )
        except (KeyError, TypeError, ValueError):
            return None
        if canonical_address(record.address) is not None:
            return None  # one spelling per address (addresses.py): a name or a second spelling would be a new "machine"
        return record

    @property
    def network_group(self) -> str:
        """The network group of the address peers dial (addresses.py): what counts as one machine, however many
        keys it holds. A member reached only through relays is dialled at no address of its own: the address its
        record names is a string it chose, so every such member weighs as one group together (``RELAYED_GROUP``)."""
        return group_of_address(self.address) if self.reachable else RELAYED_GROUP

    def to_value(self) -> dict[str, Any]:
        value = asdict(self)
        del value["peer_id"]  # readers derive it from the subkey, the owner key: a claim here would prove nothing
        value["p2p_addrs"], value["relays"] = list(self.p2p_addrs), list(self.relays)
        value["rollout_families"] = list(self.rollout_families)
        value["partners"] = list(self.partners)
        return value


_MAX_TEXT = 256  # a libp2p id or multiaddr; longer is not one
_MAX_TEXTS = 8  # addresses or relays a record may name


def _time_or_zero(value: Any) -> float:
    """A time a record says (0: none); not a finite, non-negative number, the record is malformed."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError("not a time")
    return float(value)


def _short_text(value: Any) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise ValueError("not a short string")
    return value


def _short_texts(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or len(value) > _MAX_TEXTS:
        raise ValueError("not a short list")
    return tuple(_short_text(item) for item in value)


def record_bytes(value: Any) -> int:
    """The size of a record as stored (msgpack), or more than MAX_RECORD_BYTES for what msgpack cannot encode."""
    try:
        return len(MSGPackSerializer.dumps(value))
    except (TypeError, ValueError, OverflowError):
        return MAX_RECORD_BYTES + 1


def starts_key(run_name: str) -> str:
    """Where the nodes of one run *name* say what they started from, whatever their fingerprint: a node started
    from another model (or revision, tokenizer, seed) lives under another peers key and would otherwise never hear
    why nobody pairs with it."""
    return f"noloco/run/{hashlib.sha256(run_name.encode()).hexdigest()[:16]}/starts"


@dataclass(frozen=True)
class RunStart:
    """Another node of the same run name whose fingerprint differs, and what it says it started from."""

    peer_id: str
    run_fingerprint: str
    start: dict[str, str]

    def refusal(self, run_name: str, own: dict[str, str]) -> str:
        """Why this node and that peer never pair, in the words of what differs between their starts: the model
        (model, config, weights, tokenizer, seed) or a run-wide setting (node/run_layout.py), each by its name."""
        differing = [key for key in sorted(set(own) | set(self.start)) if self.start.get(key) != own.get(key)]
        what = "; ".join(f"{key} {self.start.get(key, '?')} (this node: {own.get(key, '?')})" for key in differing)
        model_differs = not differing or any(key in MODEL_START_KEYS for key in differing)
        how = "started from a different model" if model_differs else "trains with other run-wide settings"
        what = what or f"run fingerprint {self.run_fingerprint}"
        return f"peer {self.peer_id} of run {run_name!r} {how}, so it and this node refuse to pair: {what}"


_OWNER_SUBKEY = re.compile(r"^\[owner:(ssh-rsa [A-Za-z0-9+/=]+)\]$")


def owner_subkey(identity: NodeIdentity) -> str:
    """The subkey a node writes its record under: its public key, which hivemind's validator makes it own."""
    return RSASignatureValidator(identity.private_key).local_public_key.decode()


class _OwnerIds:
    """Peer ids of owner subkeys, cached: parsing an RSA key for every record of every lookup adds up."""

    def __init__(self, limit: int = 4096) -> None:
        self._ids: dict[str, str | None] = {}
        self._limit = limit

    def peer_id(self, subkey: str) -> str | None:
        if subkey not in self._ids:
            if len(self._ids) >= self._limit:
                self._ids.clear()
            match = _OWNER_SUBKEY.match(subkey)
            try:
                self._ids[subkey] = peer_id_of(RSAPublicKey.from_bytes(match.group(1).encode())) if match else None
            except (ValueError, TypeError):
                self._ids[subkey] = None
        return self._ids[subkey]


class Discovery:
    """One node's presence in the DHT: publish its own record, read everyone else's."""

    def __init__(
        self,
        run_fingerprint: str,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        announce_maddrs: Sequence[str] | None = None,
        record_ttl: float = DEFAULT_RECORD_TTL,
        dht_timeout: float = DEFAULT_DHT_TIMEOUT,
        client_mode: bool = False,
        identity: NodeIdentity | None = None,
        secret: SwarmSecret | None = None,
        run_name: str | None = None,
        start: dict[str, str] | None = None,
        bucket_records: int = DEFAULT_BUCKET_RECORDS,
    ) -> None:
        self.identity = identity or NodeIdentity.ephemeral()
        self.starts_key = starts_key(run_name) if run_name is not None else None
        self.run_start = dict(start or {})
        self._start_stored_at = -float("inf")  # DHT time the start record was last stored
        self.secret = secret
        self.subkey = owner_subkey(self.identity)
        self._owners = _OwnerIds()
        self.run_fingerprint = run_fingerprint
        self.size = SwarmSize(bucket_records)
        self.record_ttl = record_ttl
        self.dht_timeout = dht_timeout
        self._dht_kwargs: dict[str, Any] = {
            "initial_peers": list(initial_peers) or None,
            "host_maddrs": list(host_maddrs),
            "client_mode": client_mode,  # a reader only (`noloco-node peers`): dials out, accepts nothing
            "record_validators": [RememberedSignatures(self.identity.private_key), BoundedRecords()],
            # A silent DHT peer is skipped for 5 s flat: hivemind's default doubles it without a cap, which kept
            # the far side of a healed partition out of lookups for long after (docs/threat-model.md, 8).
            "blacklist_time": DHT_SILENCE_SECONDS,
            "backoff_rate": 1.0,
            # Every read here asks for the latest (a bucket's records change at each member's publish), so a copy
            # kept is never the answer: hivemind's default would, after each read, also store the whole bucket at
            # the nearest DHT peer without it, and read again every key read lately just before it expires.
            "cache_nearest": 0,
            "cache_refresh_before_expiry": 0,
            # Kademlia's k (BitTorrent's DHT uses 8): also the beam of every search, so a read or a store visits
            # about 8 DHT peers instead of hivemind's 20. A record is stored at the 5 nearest either way.
            "bucket_size": 8,
        }
        if announce_maddrs:
            self._dht_kwargs["announce_maddrs"] = list(announce_maddrs)
        self.dht: hivemind.DHT | None = None
        self._last_expiration = 0.0
        self._written: dict[int, float] = {}  # level -> DHT time its record there expires (a leave tombstones each)
        self._published: PeerRecord | None = None  # written again at once when the node's level moves
        self._last_stored = -math.inf  # monotonic time the record at the node's level was last stored
        self._republish: asyncio.Task[bool] | None = None
        # Peers whose buckets every lookup reads too, while a strategy waits on them (a reserved partner)
        self._followed: list[str] = []
        self._lookup: tuple[float, asyncio.Task[list[PeerRecord]]] | None = None  # (started, the shared lookup)
        # Peers listed from their own answers while the DHT lags (node/report.py's watch decides whom)
        self.vouched: VouchedRecords[PeerRecord] = VouchedRecords(record_ttl)
        # Peers whose records are kept first when the view holds more than MAX_LIVE_PEERS (the node's standing)
        self.preferred: Callable[[str], bool] = lambda _peer_id: False
        self.view: RecordView[PeerRecord] = RecordView(lambda p: p == self.peer_id or self.preferred(p))

    @classmethod
    def of_node(
        cls,
        run_fingerprint: str,
        cfg: NodeConfig,
        identity: NodeIdentity,
        secret: SwarmSecret | None,
        *,
        run_name: str | None = None,
        start: dict[str, str] | None = None,
    ) -> Discovery:
        """A node's discovery, from its settings (bootstrap, addresses, record lifetime, client mode)."""
        return cls(
            run_fingerprint,
            initial_peers=cfg.bootstrap,
            host_maddrs=cfg.dht_host_maddrs,
            announce_maddrs=cfg.dht_announce_maddrs or None,
            record_ttl=cfg.record_ttl,
            client_mode=cfg.dht_client_mode,
            identity=identity,
            secret=secret,
            run_name=run_name,
            start=start,
            bucket_records=cfg.bucket_records,
        )

    def start(self) -> None:
        """Start the DHT process (it forks: call this before starting gRPC servers or torch threads)."""
        started = time.monotonic()
        self.dht = TiedDHT(start=True, **self._dht_kwargs)
        log.info(
            "DHT up in %.1fs as %s, reachable at %s",
            time.monotonic() - started,
            self.peer_id,
            " ".join(self.visible_maddrs()),
        )

    @property
    def key(self) -> str:
        """The DHT key of this node's bucket at its level: where its record is read."""
        return Bucket.of(self.peer_id, self.size.level).key(self.run_fingerprint)

    @property
    def peer_id(self) -> str:
        """This node's peer id: derived from its key (identity.py), not hivemind's transport id."""
        return self.identity.peer_id

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self._require().get_visible_maddrs()]

    async def p2p(self) -> Any:
        """A handle on the DHT's libp2p daemon in this process (hivemind's replica), for tunnels.py."""
        return await self._require().replicate_p2p()

    def _require(self) -> hivemind.DHT:
        if self.dht is None:
            raise RuntimeError("Discovery.start() has not been called")
        return self.dht

    async def _await(self, future: Any, what: str) -> Any:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout=self.dht_timeout)
        except asyncio.TimeoutError:
            future.cancel()
            raise TimeoutError(f"DHT {what} took longer than {self.dht_timeout}s") from None

    async def publish(self, record: PeerRecord) -> bool:
        """Write (or refresh) this node's record in its buckets at its level and the one its estimate leans to
        (buckets.py); it expires ``record_ttl`` seconds from now unless refreshed. True when the one at the node's
        level is stored."""
        now = get_dht_time()
        expiration = max(now + self.record_ttl, self._last_expiration + 1e-3)
        value = PeerRecord(**{**asdict(record), "updated": now}).to_value()
        own_level, levels = self.size.level, self.size.written_levels()
        own_key = Bucket.of(self.peer_id, own_level).key(self.run_fingerprint)
        mac = {} if self.secret is None else {"mac": record_mac(self.secret, own_key, self.subkey, value)}
        size = record_bytes({**value, **mac})
        if size > MAX_RECORD_BYTES:  # readers would drop it: say so here, where it can be fixed
            raise ValueError(f"this node's DHT record is {size} bytes, over the {MAX_RECORD_BYTES} readers accept")
        if record.leaving:  # a tombstone wherever a record may still be read
            levels = tuple(sorted({*levels, *(lv for lv, until in self._written.items() if until > now)}))
        stores = [self._store_record(Bucket.of(self.peer_id, level), value, expiration) for level in levels]
        results = dict(zip(levels, await asyncio.gather(*stores), strict=True))
        self._lookup = None  # the next lookup sees this node's own record as it now is
        for level, stored in results.items():
            if stored:
                self._written[level] = expiration
        stored = results[own_level] if own_level in results else any(results.values())
        if stored:
            self._last_expiration = expiration
            self._last_stored = time.monotonic()
        self._published = None if record.leaving else record
        # The start record never changes: refreshed at a third of its lifetime, not at every outer step's publish.
        if self.starts_key is not None and not record.leaving and now >= self._start_stored_at + self.record_ttl / 3:
            self._start_stored_at = now
            start = {"run_fingerprint": self.run_fingerprint, **self.run_start}
            if self.secret is not None:
                start["mac"] = record_mac(self.secret, self.starts_key, self.subkey, start)
            future = self._require().store(self.starts_key, start, expiration, subkey=self.subkey, return_future=True)
            await self._await(future, "store")
        return stored

    async def _store_record(self, bucket: Bucket, value: dict[str, Any], expiration: float) -> bool:
        key = bucket.key(self.run_fingerprint)
        if self.secret is not None:
            value = {**value, "mac": record_mac(self.secret, key, self.subkey, value)}
        future = self._require().store(key, value, expiration, subkey=self.subkey, return_future=True)
        return bool(await self._await(future, "store"))

    async def other_starts(self) -> list[RunStart]:
        """Nodes of this run name with another fingerprint, and what each started from (at most MAX_LIVE_PEERS)."""
        if self.starts_key is None:
            return []
        found = await self._await(self._require().get(self.starts_key, latest=True, return_future=True), "get")
        if found is None or not isinstance(found.value, dict):
            return []
        others = []
        for subkey, entry in list(found.value.items())[:MAX_LIVE_PEERS]:
            value = getattr(entry, "value", None)
            peer_id = self._owners.peer_id(subkey) if isinstance(subkey, str) else None
            if peer_id is None or peer_id == self.peer_id or not isinstance(value, dict):
                continue
            if self.secret is not None and not record_mac_ok(self.secret, self.starts_key, subkey, value):
                continue
            fingerprint = value.get("run_fingerprint")
            if not isinstance(fingerprint, str) or fingerprint == self.run_fingerprint:
                continue
            start = {str(k): str(v)[:128] for k, v in value.items() if k not in ("run_fingerprint", "mac")}
            others.append(RunStart(peer_id, fingerprint, dict(list(start.items())[:MAX_START_ENTRIES])))
        return others

    async def withdraw(self, record: PeerRecord) -> bool:
        """Replace this node's record with a tombstone, so that peers stop choosing it at once."""
        tombstone = PeerRecord(**{**asdict(record), "ready": False, "leaving": True})
        return await self.publish(tombstone)

    def describe(self) -> dict[str, Any]:
        """For /status: the level, the size estimate, whether it still probes, and the records in view."""
        estimate = self.size.estimate
        return {
            "level": self.size.level,
            "estimated_members": None if estimate is None else round(estimate),
            "probing": self.size.probing,
            "in_view": len(self.view),
        }

    def follow(self, peer_ids: Sequence[str]) -> None:
        """Read these peers' buckets at every lookup too (at most MAX_FOLLOWED, the first), until followed no more:
        a strategy waiting on a partner learns within a lookup whether it left or went on (at level 0 the one
        bucket read holds them anyway)."""
        self._followed = list(peer_ids)[:MAX_FOLLOWED]

    async def current_record(self, peer_id: str) -> PeerRecord | None:
        """``peer_id``'s record as the DHT holds it now: the newest found in its buckets at this node's level and the
        two beside it (a writer writes at its own level and a neighbour, and two members' levels may differ by one;
        the read at its own level refreshes the view's copy of that bucket); None when none holds it. A record in
        the view may be as old as its lifetime, several outer steps behind its peer."""
        buckets = [Bucket.of(peer_id, level) for level in range(max(0, self.size.level - 1), self.size.level + 2)]
        reads = await asyncio.gather(*(self._read_bucket(bucket) for bucket in buckets), return_exceptions=True)
        newest: PeerRecord | None = None
        for bucket, read in zip(buckets, reads, strict=True):
            if isinstance(read, BaseException):
                continue
            found, _ = read
            if bucket.level == self.size.level:  # a bucket of another level holds other writers than the view's
                self.view.replace(bucket, found)
            for record, _ in found:
                if record.peer_id == peer_id and (newest is None or record.updated > newest.updated):
                    newest = record
        return newest

    def stored_within(self, seconds: float) -> PeerRecord | None:
        """The record last published, if it was stored at the node's level within ``seconds``; else None."""
        if self._published is None or time.monotonic() - self._last_stored > seconds:
            return None
        return self._published

    async def live_peers(self, *, include_self: bool = False) -> list[PeerRecord]:
        """The unexpired, well-formed, non-tombstone records of this run in the node's view, in no particular
        order (at most MAX_LIVE_PEERS: the ``preferred`` peers' first, then a random sample of the rest), with the
        vouched ones. In a swarm of up to about --bucket-records members, every member.

        Callers within LOOKUP_SHARING_SECONDS of a lookup's start share its answer (and its failure); within
        PROBE_SHARING_SECONDS while the node probes for its swarm."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        shared = self._lookup
        sharing = PROBE_SHARING_SECONDS if self.size.probing else LOOKUP_SHARING_SECONDS
        if shared is None or shared[1].get_loop() is not loop or (shared[1].done() and now - shared[0] > sharing):
            task = loop.create_task(self._lookup_records())
            task.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved even if nobody waits
            shared = self._lookup = (now, task)
        records = self.vouched.merged(await asyncio.shield(shared[1]))
        return [r for r in records if include_self or r.peer_id != self.peer_id]

    async def _lookup_records(self) -> list[PeerRecord]:
        """One lookup: a random bucket at the node's level (or a probe level), and the followed peers' buckets;
        each replaces what the view held of it. The random one's count feeds the size estimate."""
        sampled = Bucket.random(self.size.read_level())
        above_level = self.size.above_level()
        above = Bucket.random(above_level) if above_level is not None else None
        followed = {Bucket.of(peer_id, self.size.level) for peer_id in self._followed} - {sampled}
        buckets = [sampled, *followed, *([above] if above is not None else [])]
        reads = await asyncio.gather(*(self._read_bucket(bucket) for bucket in buckets), return_exceptions=True)
        for bucket, read in zip(buckets, reads, strict=True):
            if isinstance(read, BaseException):
                if bucket is sampled:
                    raise read
                continue  # a followed bucket's read failed: what the view holds of it stays
            found, members = read
            others = members - any(record.peer_id == self.peer_id for record, _ in found)
            if bucket is above:  # a larger swarm, if anything: in view only once the node moves there
                if self.size.observe(bucket, members, others):
                    self.view.replace(bucket, found)
                    log.info(
                        "discovery: a larger swarm above, about %.0f members: reading level %d",
                        self.size.estimate,
                        self.size.level,
                    )
                    self._publish_at_new_level()
                continue
            self.view.replace(bucket, found)
            if bucket is sampled and self.size.observe(bucket, members, others):
                log.info("discovery: about %.0f members, reading level %d", self.size.estimate, self.size.level)
                self._publish_at_new_level()
        return self.view.records()

    def _publish_at_new_level(self) -> None:
        """The node's level moved: its record goes to its new levels now, not at its next refresh."""
        record = self._published
        if record is None or (self._republish is not None and not self._republish.done()):
            return
        self._republish = asyncio.get_running_loop().create_task(self.publish(record))
        self._republish.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def _read_bucket(self, bucket: Bucket) -> tuple[list[tuple[PeerRecord, float]], int]:
        """The live records of ``bucket`` with their expirations, and how many well-formed records of its members
        it holds (tombstones included: a member that left was a member until now, for the size estimate)."""
        key = bucket.key(self.run_fingerprint)
        found = await self._await(self._require().get(key, latest=True, return_future=True), "get")
        if found is None or not isinstance(found.value, dict):
            return [], 0
        records: list[tuple[PeerRecord, float]] = []
        members = 0
        latest = get_dht_time() + MAX_RECORD_AHEAD_SECONDS
        for subkey, entry in list(found.value.items())[: MAX_BUCKET_ENTRIES * 4]:
            value = getattr(entry, "value", None)
            peer_id = self._owners.peer_id(subkey) if isinstance(subkey, str) else None
            if peer_id is None:
                continue  # not written under an owner key: anyone could have written it
            if not bucket.holds(peer_id):
                continue  # not its owner's bucket: a key's records there would cost it nothing to multiply
            if record_bytes(value) > MAX_RECORD_BYTES:
                continue
            secret = self.secret
            if secret is not None and not (isinstance(value, dict) and record_mac_ok(secret, key, subkey, value)):
                continue  # not written by a member of this private run
            record = PeerRecord.from_value(peer_id, value)
            if record is None or record.run_fingerprint != self.run_fingerprint:
                continue
            if record.updated > latest:
                continue  # dated in the future: not an honest clock
            members += 1
            if not record.leaving:
                records.append((record, float(getattr(entry, "expiration_time", 0.0))))
        return records, members

    def shutdown(self) -> None:
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
