"""One outsider against a swarm: each attack of docs/threat-model.md, as a client of ``proto/noloco/v1/peer.proto``.

Used by ``noloco-node bench outsider`` (all attacks at once against a local swarm) and by
``tests/integration/test_outsider.py`` (one test per attack). It holds no secret and no honest peer's key: it makes
keys of its own (as many as it likes), reads what any peer may read (Info, GetState, the DHT) and sends what it
wants. It comes from an address of its own, through :class:`SourceBoundRelay` on a loopback swarm, as an outsider
on the internet would; honest nodes share 127.0.0.1.

The attacks (numbered as in the issue that measured them):

1. a payload in an honest peer's name (:func:`forged_payload`);
2. the norm-bound ratchet: payloads just inside the bound, then random and scaled weights (:func:`ratchet`);
3. a fake donor: a signed DHT record claiming outer step 1,000,000 and a GetState serving random weights
   (``noloco_bench/fake_donors.py``);
4. holding the pairing (a valid meeting's manifest, the exchange that reserves a sync node's partner, then
   silence: :func:`hog_once`) and the server slots (silent streams: :func:`silent_stream`);
5. idle TCP connections by the thousand (:func:`idle_connections`);
6. replayed membership proofs need a private run and a captured proof; tests/integration/test_security.py has it;
7. (stream mode; only when asked for: ``--attacks reserve``) a key that reserves each of a node's phases with a
   phase swap and never delivers a progress (:func:`reserve_once`);
8. (stream mode; only when asked for: ``--attacks progress``) a key that swaps a phase payload and then delivers a
   crafted progress (:func:`hostile_progress_once`): in ``bench outsider --mode stream`` one that shrinks the
   target's weights at 0.85 of its norm bound.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import torch
from cryptography.hazmat.primitives.asymmetric import rsa

from noloco_node.addresses import host_of_address
from noloco_node.config.models import ModelConfig, model_config_for
from noloco_node.model.decoder import LlamaDecoder, named_parameters_ordered
from noloco_node.model.source import SeededDecoder
from noloco_node.observability.status_file import read_status_document
from noloco_node.rpc.client import ExchangeError, Outgoing, fetch_info
from noloco_node.rpc.contracts import EXCHANGE_METHOD, GET_STATE_METHOD
from noloco_node.rpc.state_download import StateDownload
from noloco_node.rpc.transport import CHANNEL_OPTIONS, Transport
from noloco_node.security.caller_proof import prove
from noloco_node.security.identity import NodeIdentity, _wrap
from noloco_node.security.payload_guard import relative_norm
from noloco_node.security.payload_seal import PayloadSeal, call_binding
from noloco_node.training.checkpoints import state_layout
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire import side_info, sparse
from noloco_node.wire.frames import (
    MEET_DUE,
    ChunkView,
    PayloadDigest,
    PayloadError,
    TensorLayout,
    build_manifest,
    decode_frame,
    iter_frames,
    read_verdict,
    verdict_frame,
)

CLAIMED_STEP = 1_000_000


def fresh_identity() -> NodeIdentity:
    """A new key pair, as any stranger makes one (1024-bit: quick; servers accept any RSA size)."""
    return NodeIdentity(_wrap(rsa.generate_private_key(public_exponent=65537, key_size=1024)))


class KeyRing:
    """Keys made ahead of time and handed out in turn: on a machine it shares with the swarm, the outsider must
    not spend its CPU making keys (an outsider on the internet spends its own)."""

    def __init__(self, count: int = 64) -> None:
        self._keys = [fresh_identity() for _ in range(count)]
        self._next = 0
        self._lock = threading.Lock()

    def next(self) -> NodeIdentity:
        with self._lock:
            self._next = (self._next + 1) % len(self._keys)
            return self._keys[self._next]


KEYS: KeyRing | None = None


def key() -> NodeIdentity:
    """The next of the outsider's keys (the ring is made on first use)."""
    global KEYS
    if KEYS is None:
        KEYS = KeyRing()
    return KEYS.next()


@dataclass
class Target:
    """What the outsider knows of one honest node (all of it public: its DHT record or its Info)."""

    peer_id: str
    address: str
    run_fingerprint: str
    outer_step: int = 0
    # Its current norm bound: not public (an attacker guesses it from its own replica's movement); the bench reads
    # it from the node's status document, for an attacker that aims every payload at 0.85 of it.
    norm_bound: float | None = None


class SourceBoundRelay:
    """Listens on 127.0.0.1 and relays every connection to ``target`` from ``source`` (127.0.0.2 by default), so
    that a node sees the outsider at an address of its own. Daemon threads; ``close`` stops it."""

    def __init__(self, target: str, source: str = "127.0.0.2") -> None:
        host, port = host_of_address(target), target.rsplit(":", 1)[1]
        self.target, self.source = (host, int(port)), source
        self.family = socket.AF_INET6 if ":" in source else socket.AF_INET
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="relay").start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.socket(self.family, socket.SOCK_STREAM)
            try:
                upstream.bind((self.source, 0))
                upstream.connect(self.target)
            except OSError:
                client.close()
                upstream.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True, name="relay-pump").start()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


class Relays:
    """One SourceBoundRelay per (source address, target), made on first use; thread-safe; ``close`` stops all."""

    def __init__(self) -> None:
        self._relays: dict[tuple[str, str], SourceBoundRelay] = {}
        self._lock = threading.Lock()

    def to(self, target: Target, source: str) -> str:
        """The local address that reaches ``target`` from ``source``."""
        with self._lock:
            relay = self._relays.get((source, target.address))
            if relay is None:
                relay = self._relays[(source, target.address)] = SourceBoundRelay(target.address, source)
            return relay.address

    def close(self) -> None:
        with self._lock:
            relays, self._relays = list(self._relays.values()), {}
        for relay in relays:
            relay.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


# ---------------------------------------------------------------------------------------------- payloads


def theta_names(model_cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    return list(_theta_names(model_cfg.model_dump_json()))


def _layout(model_cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    return list(_state_layout(model_cfg.model_dump_json()))


# Built once per model: a meta-device model costs seconds of CPU at nice 19 (its first one imports torch._dynamo),
# and an attacker reads weights every half second.
@functools.cache
def _theta_names(model_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with torch.device("meta"):
        model = LlamaDecoder(ModelConfig.model_validate_json(model_json))
    return tuple((f"theta/{name}", tuple(p.shape)) for name, p in named_parameters_ordered(model))


@functools.cache
def _state_layout(model_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(state_layout(SeededDecoder(ModelConfig.model_validate_json(model_json), seed=0)))


def download_phi(
    target: Target, model_cfg: ModelConfig, identity: NodeIdentity, timeout: float = 30
) -> list[torch.Tensor]:
    """The target's slow weights, as GetState hands them to anyone (the distance of a crafted payload from them
    is then exact)."""
    download = StateDownload(
        _layout(model_cfg),
        run_fingerprint=target.run_fingerprint,
        peer_id=identity.peer_id,
    )
    tensors, _ = download.fetch(
        target.address, timeout=timeout, transport=Transport(identity=identity), donor_peer_id=target.peer_id
    )
    return [tensors[name.replace("theta/", "phi/", 1)] for name, _ in theta_names(model_cfg)]


def at_distance(phi: Sequence[torch.Tensor], distance: float, seed: int = 0) -> list[torch.Tensor]:
    """Weights exactly ``distance`` (relative L2) from ``phi``, in a random direction."""
    generator = torch.Generator().manual_seed(seed)
    noise = [torch.randn(p.shape, generator=generator) for p in phi]
    scale = distance * math.sqrt(sum(float((p.float() ** 2).sum()) for p in phi))
    scale /= math.sqrt(sum(float((n**2).sum()) for n in noise))
    return [p.float() + scale * n for p, n in zip(phi, noise, strict=True)]


def payload_frames(
    target: Target,
    model_cfg: ModelConfig,
    tensors: Sequence[torch.Tensor],
    *,
    peer_id: str,
    wire_dtype: str = "bf16",
    part: str = "theta",
) -> list[bytes]:
    """A payload of one part (``theta``, or a stream run's ``phi`` or ``progress``) of the model's tensors, for the
    target's outer step."""
    names = [name.split("/", 1)[1] for name, _ in theta_names(model_cfg)]
    named = [(f"{part}/{name}", t) for name, t in zip(names, tensors, strict=True)]
    manifest = build_manifest(
        named,
        wire_dtype=wire_dtype,
        run_fingerprint=target.run_fingerprint,
        peer_id=peer_id,
        outer_step=target.outer_step,
    )
    outgoing = Outgoing(manifest, [t for _, t in named])
    return list(iter_frames(outgoing.manifest, outgoing.tensors))


def meeting_outgoing(run_fingerprint: str, peer_id: str, outer_step: int, seconds_to_step: float = -1.0) -> Outgoing:
    """A sync meeting (wire/frames.py ``MEETING``) at ``outer_step``; by default one that says it does not know when
    its step is due, which every member meets (pairing/reserved.py)."""
    due = torch.tensor([seconds_to_step])
    manifest = build_manifest(
        [(MEET_DUE, due)], wire_dtype="fp32", run_fingerprint=run_fingerprint, peer_id=peer_id, outer_step=outer_step
    )
    return Outgoing(manifest, [due])


def call_exchange(
    channel: grpc.Channel, frames: Sequence[bytes], metadata: Sequence[tuple[str, str]] | None, timeout: float = 20
) -> tuple[grpc.StatusCode, str]:
    """One Exchange call that sends exactly these frames with exactly this metadata; its status and details."""
    call = channel.stream_stream(EXCHANGE_METHOD)(iter(frames), timeout=timeout, metadata=metadata)
    try:
        for _ in call:
            pass
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def exchange_status(
    address: str, frames: Sequence[bytes], metadata: Sequence[tuple[str, str]] | None, timeout: float = 20
) -> tuple[grpc.StatusCode, str]:
    """:func:`call_exchange` on a channel of its own."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        return call_exchange(channel, frames, metadata, timeout)


def sealed(
    frames: Sequence[bytes], identity: NodeIdentity, target_peer_id: str, proof: Sequence[tuple[str, str]]
) -> list[bytes]:
    """``frames`` with their end sealed by ``identity`` for the call ``proof`` opens (security/payload_seal.py), as
    any sender can seal whatever it sends: the digest covers the frames as they are. Frames that do not make a
    manifest, chunks and an end are returned unchanged."""
    out = list(frames)
    try:
        manifest = decode_frame(out[0]) if out else None
        if not isinstance(manifest, pb.Manifest):
            return out
        digest = PayloadDigest(manifest)
        for at, raw in enumerate(out[1:], start=1):
            body = decode_frame(raw)
            if isinstance(body, ChunkView):
                digest.chunk(body.tensor_index, body.offset, body.data)
            elif isinstance(body, pb.End):
                seal = PayloadSeal(identity, peer=target_peer_id, binding=call_binding(proof))
                signature, key = seal.sign(digest.digest())
                end = pb.End(total_bytes=body.total_bytes, signature=signature, signer_key=key)
                out[at] = pb.Frame(end=end).SerializeToString()
                break
    except PayloadError:  # frames no receiver could read: sent as they are
        return list(frames)
    return out


def send_exchange(
    address: str, target: Target, frames: Sequence[bytes], identity: NodeIdentity, *, timeout: float = 30
) -> tuple[grpc.StatusCode, str]:
    """One Exchange sending ``frames``, sealed, with a valid proof of ``identity`` made for the target."""
    proof = prove(identity, EXCHANGE_METHOD, target.peer_id)
    return exchange_status(address, sealed(frames, identity, target.peer_id, proof), proof, timeout)


def forged_payload(
    address: str, target: Target, model_cfg: ModelConfig, honest_peer_id: str, identity: NodeIdentity
) -> tuple[grpc.StatusCode, str]:
    """Attack 1: garbage (random weights) in an honest peer's name, under the outsider's own (valid) proof."""
    phi_like = [torch.randn(shape) for _, shape in theta_names(model_cfg)]
    return send_exchange(address, target, payload_frames(target, model_cfg, phi_like, peer_id=honest_peer_id), identity)


def ratchet(address: str, target: Target, model_cfg: ModelConfig, phi: Sequence[torch.Tensor]) -> dict[str, list[str]]:
    """Attack 2: three payloads at relative distance 0.95 from the target's own phi, then random weights and phi
    scaled by 3, each under a fresh key (a quarantine of one key stops nothing: each payload is judged on its own).
    Returns each payload's status code name, by kind."""
    codes: dict[str, list[str]] = {"ratchet_0.95": [], "random": [], "scaled_3x": []}
    payloads = [("ratchet_0.95", at_distance(phi, 0.95, seed)) for seed in range(3)]
    payloads.append(("random", [torch.randn(p.shape) * float(p.float().std()) for p in phi]))
    payloads.append(("scaled_3x", [3 * p.float() for p in phi]))
    for kind, weights in payloads:
        key = fresh_identity()
        # At the target's outer step as it is now (its Info): a node in short phases moves on while this builds
        # payloads, and one further than --max-staleness from it is refused as out of reach, never judged.
        now = replace(target, outer_step=fetch_info(address, timeout=5, peer_id=target.peer_id).outer_step)
        frames = payload_frames(now, model_cfg, weights, peer_id=key.peer_id)
        codes[kind].append(send_exchange(address, now, frames, key)[0].name)
    return codes


# ---------------------------------------------------------------------------------------------- holding things


def hog_once(address: str, target: Target, model_cfg: ModelConfig | None, *, hold: float = 60.0) -> str:
    """Attack 4: open an exchange under another of the outsider's keys, send a valid meeting's manifest (a sync
    node's reservation, pairing/reserved.py: while it is taken nobody else reserves the node, nor does the node
    itself; or, without a model config, nothing) and then nothing at all, until the node cuts it (or ``hold`` s).
    Returns the status code name; a hog that got in is cut (CANCELLED), one that did not is refused at once."""
    identity = key()
    meeting = meeting_outgoing(target.run_fingerprint, identity.peer_id, target.outer_step)
    first = next(iter_frames(meeting.manifest, meeting.tensors)) if model_cfg is not None else None
    release = threading.Event()

    def frames() -> Iterator[bytes]:
        if first is not None:
            yield first
        release.wait(hold)

    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.stream_stream(EXCHANGE_METHOD)(
            frames(), timeout=hold, metadata=prove(identity, EXCHANGE_METHOD, target.peer_id)
        )
        try:
            for _ in call:
                pass
            code = "OK"
        except grpc.RpcError as error:
            code = error.code().name
        finally:
            release.set()
    return code


def swap_once(
    address: str, target: Target, identity: NodeIdentity, frames: Sequence[bytes], *, timeout: float = 10.0
) -> str:
    """One exchange the way a stream pairing makes them: ``frames``, sealed by ``identity``, then once the target's
    own payload has arrived whole, a commit. Returns ``committed`` when the target acknowledged it (it took the
    payload), else the status code name (or ``not_committed``, ``no_acknowledgement``)."""
    proof = prove(identity, EXCHANGE_METHOD, target.peer_id)
    sealed_frames = sealed(list(frames), identity, target.peer_id, proof)
    theirs_ended = threading.Event()

    def requests() -> Iterator[bytes]:
        yield from sealed_frames
        if theirs_ended.wait(timeout):  # the target's payload has arrived whole: commit to it
            yield verdict_frame(commit=True)

    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.stream_stream(EXCHANGE_METHOD)(requests(), timeout=timeout, metadata=proof)
        try:
            for raw in call:
                if theirs_ended.is_set():
                    return "committed" if read_verdict(raw).commit else "not_committed"
                if isinstance(decode_frame(raw), pb.End):
                    theirs_ended.set()
        except grpc.RpcError as error:
            return error.code().name
        finally:
            theirs_ended.set()
    return "no_acknowledgement"


def phase_frames(
    target: Target, model_cfg: ModelConfig, peer_id: str, phi: Sequence[torch.Tensor] | None, run_wire_dtype: str
) -> list[bytes]:
    """A stream phase payload for the target's outer step, as the run's wire makes it: ``phi`` in bf16, or with the
    sparse wire its matrices in the side-information code with step 0 (a sender with no gap estimate yet, as in an
    honest joiner's first phase: the target keeps its own phi there) and the rest in int8. ``phi`` None: zeros."""
    names = [name.split("/", 1)[1] for name, _ in theta_names(model_cfg)]
    shapes = [tuple(shape) for _, shape in theta_names(model_cfg)]
    values = list(phi) if phi is not None else [torch.zeros(shape) for shape in shapes]
    sparse_wire = run_wire_dtype == "sparse"
    layout, tensors = [], []
    for name, shape, value in zip(names, shapes, values, strict=True):
        coded = sparse_wire and side_info.side_coded(shape)
        layout.append(TensorLayout(f"phi/{name}", shape, "side" if coded else ""))
        tensors.append(side_info.pack(side_info.encode(value, None, 0)) if coded else value)
    manifest = build_manifest(
        layout,
        wire_dtype="int8" if sparse_wire else "bf16",
        run_fingerprint=target.run_fingerprint,
        peer_id=peer_id,
        outer_step=target.outer_step,
    )
    return list(iter_frames(manifest, tensors))


def reserve_once(
    address: str,
    target: Target,
    identity: NodeIdentity,
    *,
    model_cfg: ModelConfig,
    phi: Sequence[torch.Tensor] | None,
    run_wire_dtype: str,
    timeout: float = 10.0,
) -> str:
    """Attack 7 (stream mode): a phase swap sealed and committed like an honest one, so that the target reserves its
    phase for ``identity``, which then never delivers a progress (it has no DHT record, and answers nothing): a phase
    payload of ``phi`` (the target's own, from GetState) as the run's wire sends it (:func:`phase_frames`). Returns
    ``reserved`` when the target acknowledged the swap, else what :func:`swap_once` returned."""
    frames = phase_frames(target, model_cfg, identity.peer_id, phi, run_wire_dtype)
    swapped = swap_once(address, target, identity, frames, timeout=timeout)
    return "reserved" if swapped == "committed" else swapped


def hostile_progress_once(
    address: str,
    target: Target,
    model_cfg: ModelConfig,
    identity: NodeIdentity,
    phi: Sequence[torch.Tensor],
    progress: Sequence[torch.Tensor],
    *,
    wire_dtype: str,
    within: float = 30.0,
    stop: threading.Event | None = None,
) -> tuple[str, str]:
    """Attack 8 (stream mode): swap a phase payload carrying ``phi`` (the target's own slow weights, from GetState,
    so that the progress is measured exactly as crafted: :func:`phase_frames`) at the target's outer step, then
    deliver ``progress`` in ``wire_dtype`` once the target's pairing round opens (it answers busy until
    its phase ends; asked again every 0.2 s for ``within`` s, or until ``stop`` is set). Returns what the swap got
    and what the progress got (:func:`swap_once`'s words; ``committed`` progress was blended)."""
    frames = phase_frames(target, model_cfg, identity.peer_id, phi, wire_dtype)
    swapped = swap_once(address, target, identity, frames)
    if swapped != "committed":
        return swapped, "not_sent"
    frames = payload_frames(
        target, model_cfg, progress, peer_id=identity.peer_id, wire_dtype=wire_dtype, part="progress"
    )
    deadline = time.monotonic() + within
    delivered = "not_sent"
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        delivered = swap_once(address, target, identity, frames)
        if delivered != grpc.StatusCode.ABORTED.name:  # busy: the round is not open yet
            break
        time.sleep(0.2)
    return swapped, delivered


def shrinking_progress(phi: Sequence[torch.Tensor], size: float, wire_dtype: str) -> list[torch.Tensor]:
    """A progress that pulls every tensor towards zero, ``size`` (relative L2 to ``phi``) as the target decodes it:
    minus phi, scaled; in the sparse wire scaled after its own top-k coding (which keeps a fraction of the mass). As
    far from the target as a progress may be, spread over every tensor in proportion to it, so that no tensor's own
    bound is nearer than the overall one."""
    values = [-t.float() for t in phi]
    if wire_dtype == "sparse":
        decoded = [sparse.decode(sparse.encode(v.reshape(-1)), v.numel()).view(v.shape) for v in values]
    else:
        decoded = values
    scale = size / max(relative_norm(decoded, phi), 1e-12)
    return [v * scale for v in values]


def silent_stream(address: str, target: Target, hold: float = 60.0) -> str:
    """Attack 4, on the slots: a stream that sends nothing at all."""
    return hog_once(address, target, None, hold=hold)


REFUSED_PAUSE = 0.5  # after a refusal, the outsider tries again this soon (a cut hog reconnects at once)
PHI_REFRESH_SECONDS = 2.0  # a dense run's reserving key downloads the target's phi this often for its phase swaps


def idle_connections(address: str, count: int) -> list[socket.socket]:
    """Attack 5: TCP connections that never send a byte (the caller closes them)."""
    host, port = address.rsplit(":", 1)
    opened = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect_ex((host, int(port)))
        except OSError:
            sock.close()
            break
        opened.append(sock)
    return opened


def probe_info(target: Target, transport: Transport) -> str:
    """An honest caller's Info: the status code name it got."""
    try:
        fetch_info(target.address, timeout=5, transport=transport, peer_id=target.peer_id)
    except ExchangeError as error:
        return error.code.name
    except grpc.RpcError as error:
        return error.code().name
    return "OK"


def probe_state(target: Target, transport: Transport) -> str:
    """An honest caller's state download, to its first frame (the node answered; the rest is not needed)."""
    metadata, _ = transport.sign(GET_STATE_METHOD, target.peer_id)
    with grpc.insecure_channel(target.address, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_stream(GET_STATE_METHOD, request_serializer=pb.StateRequest.SerializeToString)(
            pb.StateRequest(run_fingerprint=target.run_fingerprint), timeout=5, metadata=metadata
        )
        try:
            next(iter(call))
            call.cancel()
            return "OK"
        except grpc.RpcError as error:
            return error.code().name


# ---------------------------------------------------------------------------------------------- all at once


@dataclass
class OutsiderReport:
    """What the outsider did and what it saw, by attack."""

    forged: Counter[str] = field(default_factory=Counter)
    ratchet: Counter[str] = field(default_factory=Counter)
    hogs: Counter[str] = field(default_factory=Counter)
    # What the hog was answered when it called again the moment it was cut (even as the window closed).
    after_cut: Counter[str] = field(default_factory=Counter)
    silent: Counter[str] = field(default_factory=Counter)
    idle_connections: int = 0
    probes: Counter[str] = field(default_factory=Counter)  # Info / GetState asked of the honest nodes
    reservations: Counter[str] = field(default_factory=Counter)  # phase swaps that reserve and never deliver
    # Phase swaps followed by a progress that shrinks the target at 0.85 of its bound: "<swap> <progress>"
    progress: Counter[str] = field(default_factory=Counter)


ATTACKS = ("hog", "silent", "payloads", "idle", "reserve", "progress")  # the fake donor is a FakeDonor of its own
# The attacks on a stream run's phases, which a plain (sync) `bench outsider` leaves out.
STREAM_ATTACKS = ("reserve", "progress")
DEFAULT_ATTACKS = tuple(attack for attack in ATTACKS if attack not in STREAM_ATTACKS)


class Outsider:
    """Every attack at once against ``targets`` (read again from ``targets_now`` as the swarm moves), from
    127.0.0.2 (payloads from 127.0.0.3), until ``stop``. Each target gets a lock hog, ``silent_streams`` silent
    streams, idle connections, a forged payload and the ratchet every ``every`` seconds; a probe from 127.0.0.1
    asks each target's Info and GetState twice a second to see whether honest callers are still answered."""

    def __init__(
        self,
        targets_now: Callable[[], list[Target]],
        model_cfg: ModelConfig,
        *,
        attacks: Sequence[str] = DEFAULT_ATTACKS,
        silent_streams: int = 10,
        idle: int = 200,
        every: float = 10.0,
        source: str = "127.0.0.2",
        payload_source: str = "127.0.0.3",
        wire_dtype: str = "int8",
    ) -> None:
        unknown = set(attacks) - set(ATTACKS)
        if unknown:
            raise ValueError(f"unknown attacks {sorted(unknown)}; choose among {', '.join(ATTACKS)}")
        self.attacks = set(attacks)
        self.source = source
        # Payloads come from a second address: the first is soon barred for its stalls, and what is measured
        # here is whether the payloads themselves get in.
        self.payload_source = payload_source
        self.wire_dtype = wire_dtype  # the stream attacks': the run's progress wire dtype
        self.targets_now = targets_now
        self.model_cfg = model_cfg
        self.silent_streams = silent_streams
        self.idle = idle
        self.every = every
        self.report = OutsiderReport()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._relays = Relays()
        self._sockets: list[socket.socket] = []

    def _relay(self, target: Target, source: str | None = None) -> str:
        """The relay to ``target`` from ``source`` (default: the outsider's main address)."""
        return self._relays.to(target, source or self.source)

    def _current(self, peer_id: str) -> Target | None:
        return next((t for t in self.targets_now() if t.peer_id == peer_id), None)

    def start(self) -> None:
        for target in self.targets_now():
            if "hog" in self.attacks:
                self._spawn(self._hog_loop, target.peer_id)
            if "silent" in self.attacks:
                for _ in range(self.silent_streams):
                    self._spawn(self._silent_loop, target.peer_id)
            if "payloads" in self.attacks:
                self._spawn(self._payload_loop, target.peer_id)
            self._spawn(self._probe_loop, target.peer_id)
            if "idle" in self.attacks:
                self._sockets += idle_connections(self._relay(target), self.idle)
            if "reserve" in self.attacks:
                self._spawn(self._reserve_loop, target.peer_id)
            if "progress" in self.attacks:
                self._spawn(self._progress_loop, target.peer_id)
        self.report.idle_connections = len(self._sockets)

    def _spawn(self, loop: Callable[[str], None], peer_id: str) -> None:
        thread = threading.Thread(target=loop, args=(peer_id,), daemon=True, name=f"outsider-{loop.__name__}")
        thread.start()
        self._threads.append(thread)

    def _hog_loop(self, peer_id: str) -> None:
        while not self._stop.is_set() and (target := self._current(peer_id)) is not None:
            code = hog_once(self._relay(target), target, self.model_cfg, hold=30)
            self.report.hogs[code] += 1
            if code == "CANCELLED":
                # Cut: it comes back at once, whether or not its window has closed, so that every cut is followed
                # by the call the bar is there to refuse.
                self.report.after_cut[hog_once(self._relay(target), target, self.model_cfg, hold=30)] += 1
            else:
                self._stop.wait(REFUSED_PAUSE)

    def _silent_loop(self, peer_id: str) -> None:
        while not self._stop.is_set() and (target := self._current(peer_id)) is not None:
            code = silent_stream(self._relay(target), target, hold=30)
            self.report.silent[code] += 1
            if code != "CANCELLED":
                self._stop.wait(REFUSED_PAUSE)

    def _payload_loop(self, peer_id: str) -> None:
        identity = fresh_identity()
        while not self._stop.is_set() and (target := self._current(peer_id)) is not None:
            honest = next((t.peer_id for t in self.targets_now() if t.peer_id != peer_id), peer_id)
            address = self._relay(target, self.payload_source)
            self.report.forged[forged_payload(address, target, self.model_cfg, honest, identity)[0].name] += 1
            try:
                phi = download_phi(target, self.model_cfg, identity)
                for kind, codes in ratchet(address, target, self.model_cfg, phi).items():
                    for code in codes:
                        self.report.ratchet[f"{kind} {code}"] += 1
            except ExchangeError as error:
                self.report.ratchet[f"phi download {error.reason}"] += 1
            self._stop.wait(self.every)

    def _reserve_loop(self, peer_id: str) -> None:
        """One key (made for this target) tries to reserve each of the target's phases as it opens."""
        identity = fresh_identity()
        phi: list[torch.Tensor] | None = None
        fetched = -math.inf
        while not self._stop.is_set() and (target := self._current(peer_id)) is not None:
            address = self._relay(target, self.payload_source)
            if time.monotonic() - fetched > PHI_REFRESH_SECONDS:
                phi, fetched = self._phi(target, identity, self.report.reservations), time.monotonic()
                if phi is None:
                    self._stop.wait(REFUSED_PAUSE)
                    continue
            outcome = reserve_once(
                address, target, identity, model_cfg=self.model_cfg, phi=phi, run_wire_dtype=self.wire_dtype
            )
            self.report.reservations[outcome] += 1
            self._stop.wait(0.2)

    def _progress_loop(self, peer_id: str) -> None:
        """One key (made for this target) swaps a phase payload at each of the target's phases it can, then delivers
        a progress that shrinks the target's weights at 0.85 of its norm bound (:func:`shrinking_progress`)."""
        identity = fresh_identity()
        while not self._stop.is_set() and (target := self._current(peer_id)) is not None:
            if target.norm_bound is None:
                self._stop.wait(REFUSED_PAUSE)
                continue
            phi = self._phi(target, identity, self.report.progress)
            if phi is None:
                self._stop.wait(REFUSED_PAUSE)
                continue
            try:  # at the target's outer step as it is now: a node in short phases moves on while this builds
                info = fetch_info(target.address, timeout=5, peer_id=target.peer_id)
            except grpc.RpcError as error:  # restarting, or gone
                self.report.progress[f"info {error.code().name}"] += 1
                self._stop.wait(REFUSED_PAUSE)
                continue
            now = replace(target, outer_step=info.outer_step)
            progress = shrinking_progress(phi, 0.85 * target.norm_bound, self.wire_dtype)
            swapped, delivered = hostile_progress_once(
                self._relay(target, self.payload_source),
                now,
                self.model_cfg,
                identity,
                phi,
                progress,
                wire_dtype=self.wire_dtype,
                stop=self._stop,
            )
            self.report.progress[f"{swapped} {delivered}"] += 1
            self._stop.wait(0.2)

    def _phi(self, target: Target, identity: NodeIdentity, report: Counter[str]) -> list[torch.Tensor] | None:
        try:
            return download_phi(target, self.model_cfg, identity)
        except ExchangeError as error:
            report[f"phi download {error.reason}"] += 1
            return None

    def _probe_loop(self, peer_id: str) -> None:
        prober = fresh_identity()  # an honest-looking caller at the honest nodes' address
        transport = Transport(identity=prober)
        while not self._stop.is_set() and (target := self._current(peer_id)) is not None:
            for method, probe in (("info", probe_info), ("get_state", probe_state)):
                self.report.probes[f"{method} {probe(target, transport)}"] += 1
            self._stop.wait(0.5)

    def stop(self, grace: float = 10.0) -> OutsiderReport:
        """Stop attacking; calls still in flight get ``grace`` seconds in all (its threads are daemons: one held
        by a node that no longer answers is left behind), then the report as it stands."""
        self._stop.set()
        for sock in self._sockets:
            sock.close()
        deadline = time.monotonic() + grace
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._relays.close()
        return self.report


def targets_from_status_files(data_dirs: Sequence[Path]) -> Callable[[], list[Target]]:
    """The honest nodes as their status files show them: a local shortcut for what their DHT records say."""

    def now() -> list[Target]:
        found = []
        for data_dir in data_dirs:
            status = read_status_document(data_dir)
            if status and status.get("address"):
                found.append(
                    Target(
                        status["peer_id"],
                        status["address"],
                        status["run_fingerprint"],
                        status["outer_step"],
                        (status.get("security") or {}).get("norm_bound"),
                    )
                )
        return found

    return now


def attacker_arguments(description: str | None) -> argparse.ArgumentParser:
    """The command line every attacking process shares: the honest nodes (their data dirs), the model they train,
    and how long to attack."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data-dir", type=Path, action="append", required=True, help="an honest node's data dir")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seconds", type=float, required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m noloco_bench.outsider``: the outsider as a process of its own, at the lowest CPU priority
    (on a machine it shares with the swarm it stands for a host of its own, so it must not take the nodes' CPU).
    Prints its report as JSON."""
    parser = attacker_arguments(main.__doc__)
    parser.add_argument("--attacks", default=",".join(DEFAULT_ATTACKS))
    parser.add_argument("--silent-streams", type=int, default=10)
    parser.add_argument("--idle", type=int, default=200)
    parser.add_argument("--source", default="127.0.0.2", help="the address the outsider comes from")
    parser.add_argument("--payload-source", default="127.0.0.3", help="the address its payloads come from")
    parser.add_argument("--wire-dtype", default="int8", help="a stream run's progress wire dtype (stream attacks)")
    args = parser.parse_args(argv)
    os.nice(19)
    model_cfg = model_config_for(args.model, vocab_size=args.vocab_size, max_seq_len=args.seq_len)
    outsider = Outsider(
        targets_from_status_files(args.data_dir),
        model_cfg,
        attacks=[a for a in args.attacks.split(",") if a],
        silent_streams=args.silent_streams,
        idle=args.idle,
        source=args.source,
        payload_source=args.payload_source,
        wire_dtype=args.wire_dtype,
    )
    key()  # the key ring, made before the clock starts
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # stopped early, it still reports what it saw
        signal.signal(signum, lambda *_: done.set())
    outsider.start()
    done.wait(args.seconds)
    report = outsider.stop()
    print(
        json.dumps({name: dict(value) if isinstance(value, Counter) else value for name, value in vars(report).items()})
    )
    return 0


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Its daemon threads may still be inside gRPC calls (one a node holds, or a server answering): the
    # interpreter's finalization tearing them down makes grpc's core abort the process after the report is out
    # ("terminate called without an active exception"). Nothing is left to save: leave without it.
    os._exit(exit_code)
