"""Membership of a private run: the swarm secret, and the proofs every gRPC call and DHT record carry.

A private run shares one secret (a file, or the ``NOLOCO_SWARM_SECRET`` variable; never a command-line flag, which
``ps`` would show). The secret itself never crosses the network: keys are derived from it with HMAC-SHA256, one per
purpose, and what travels is a MAC.

- A call carries ``x-noloco-peer``, ``x-noloco-time`` (ms), ``x-noloco-nonce`` and ``x-noloco-mac`` = HMAC over
  the method, the caller's peer id, **the server's peer id**, the time and the nonce. Binding the server means a
  proof captured in front of one member (in a run without TLS, anyone on the path can read it) is worthless in
  front of every other; in front of the same member its nonce has been seen. The server refuses a call with
  UNAUTHENTICATED, before any handler
  runs and so before it reveals anything about its model, when the MAC is missing or wrong, when the time is more
  than ``max_clock_skew`` away from its own clock (stale), or when the nonce was already seen (replayed); nonces
  are remembered for twice the skew, after which the time check refuses a replay anyway.
- The server answers with ``x-noloco-server-mac`` over the client's nonce and its own peer id in its initial
  metadata, and the client checks it before sending a byte of its model: a stranger listening at a peer's address
  learns nothing either.
- A DHT record carries a MAC over its canonical content (discovery/dht.py); readers drop records without a valid one.

This authenticates membership, not individual members: anyone holding the secret is a member. Per-member identity
is the node key of identity.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from noloco_node import logs
from noloco_node.config.settings import SECRET_ENV, SECRET_FILE_ENV
from noloco_node.errors import NolocoError

MIN_SECRET_BYTES = 16
MAX_REMEMBERED_NONCES = 200_000  # a member flooding calls cannot grow the cache without bound

PEER_HEADER = "x-noloco-peer"
TIME_HEADER = "x-noloco-time"
NONCE_HEADER = "x-noloco-nonce"
MAC_HEADER = "x-noloco-mac"
SERVER_MAC_HEADER = "x-noloco-server-mac"


class SecretError(NolocoError):
    """The secret could not be loaded (missing file, too short, readable by others)."""


class SwarmSecret:
    """The shared secret of a private run. Its repr and str never show it."""

    def __init__(self, value: bytes, source: str) -> None:
        if len(value) < MIN_SECRET_BYTES:
            raise SecretError(
                f"the swarm secret from {source} is {len(value)} bytes; use at least {MIN_SECRET_BYTES} "
                f"(e.g. `head -c 32 /dev/urandom | base64 > swarm.secret`)"
            )
        self._value = value
        self.source = source
        with contextlib.suppress(UnicodeDecodeError):  # a binary secret cannot appear in text anyway
            logs.redact(value.decode())

    def key(self, purpose: str) -> bytes:
        """A key for one purpose (``grpc``, ``dht``): compromise of one MAC scheme says nothing of the other."""
        return hmac.new(self._value, f"noloco-node/v1/{purpose}".encode(), hashlib.sha256).digest()

    def __repr__(self) -> str:
        return f"SwarmSecret(from {self.source})"

    __str__ = __repr__


def load_secret(secret_file: Path | None, environ: dict[str, str] | None = None) -> SwarmSecret | None:
    """The run's secret from ``secret_file``, else ``$NOLOCO_SWARM_SECRET_FILE``, else ``$NOLOCO_SWARM_SECRET``;
    None for an open run. Surrounding whitespace (a trailing newline) is not part of the secret."""
    env = os.environ if environ is None else environ
    path = secret_file or (Path(env[SECRET_FILE_ENV]) if env.get(SECRET_FILE_ENV) else None)
    if path is not None:
        try:
            mode = path.stat().st_mode & 0o777
            value = path.read_bytes().strip()
        except OSError as error:
            raise SecretError(f"cannot read the swarm secret file {path}: {error.strerror}") from None
        if mode & 0o007:
            raise SecretError(f"the swarm secret file {path} is readable by anyone (mode {mode:o}): chmod 600 {path}")
        return SwarmSecret(value, str(path))
    if env.get(SECRET_ENV):
        return SwarmSecret(env[SECRET_ENV].strip().encode(), f"${SECRET_ENV}")
    return None


def _mac(key: bytes, *fields: str) -> str:
    return hmac.new(key, "\n".join(fields).encode(), hashlib.sha256).hexdigest()


class CallAuthenticator:
    """Signs outgoing calls and checks incoming ones for one node (thread-safe)."""

    def __init__(self, secret: SwarmSecret, peer_id: str, *, max_clock_skew: float = 60.0) -> None:
        self.key = secret.key("grpc")
        self.peer_id = peer_id
        self.max_clock_skew = max_clock_skew
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ client side

    def call_metadata(self, method: str, target_peer_id: str) -> tuple[list[tuple[str, str]], str]:
        """The metadata that proves membership for one call to the server ``target_peer_id`` (and to no other),
        and its nonce (to check the server's answer)."""
        now, nonce = str(int(time.time() * 1000)), secrets.token_hex(16)
        mac = _mac(self.key, "call", method, self.peer_id, target_peer_id, now, nonce)
        return [(PEER_HEADER, self.peer_id), (TIME_HEADER, now), (NONCE_HEADER, nonce), (MAC_HEADER, mac)], nonce

    def check_server(self, method: str, nonce: str, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """None when the server proved membership for this call; else why not."""
        values = dict(metadata or ())
        server_peer, server_mac = values.get(PEER_HEADER), values.get(SERVER_MAC_HEADER)
        if not isinstance(server_peer, str) or not isinstance(server_mac, str):
            return "the server sent no membership proof (not a member of this private run)"
        if not hmac.compare_digest(server_mac, _mac(self.key, "reply", method, nonce, server_peer)):
            return "the server's membership proof is wrong (another secret)"
        return None

    # ------------------------------------------------------------------ server side

    def check_call(self, method: str, metadata: Sequence[tuple[str, Any]] | None) -> tuple[str, str] | str:
        """(peer id, nonce) of a call that proved membership; else the reason it is refused."""
        values = dict(metadata or ())
        peer, sent_at, nonce, mac = (values.get(h) for h in (PEER_HEADER, TIME_HEADER, NONCE_HEADER, MAC_HEADER))
        if not all(isinstance(v, str) for v in (peer, sent_at, nonce, mac)):
            return "missing"
        assert isinstance(peer, str) and isinstance(sent_at, str) and isinstance(nonce, str) and isinstance(mac, str)
        if len(nonce) != 32 or len(peer) > 128 or not sent_at.isdigit() or len(sent_at) > 16:
            return "malformed"
        if not hmac.compare_digest(mac, _mac(self.key, "call", method, peer, self.peer_id, sent_at, nonce)):
            return "bad_mac"
        now = time.time()
        if abs(now - int(sent_at) / 1000) > self.max_clock_skew:
            return "stale"
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return "replayed"
            if len(self._seen) >= MAX_REMEMBERED_NONCES:
                return "nonce_cache_full"
            self._seen[nonce] = now + 2 * self.max_clock_skew
        return peer, nonce

    def reply_metadata(self, method: str, nonce: str) -> list[tuple[str, str]]:
        return [(PEER_HEADER, self.peer_id), (SERVER_MAC_HEADER, _mac(self.key, "reply", method, nonce, self.peer_id))]


REFUSAL_MESSAGES = {
    "missing": "this run is private: the call carries no membership proof",
    "malformed": "malformed membership proof",
    "bad_mac": "membership proof does not verify (wrong swarm secret, or made for another server)",
    "stale": "membership proof is stale: its timestamp is outside the allowed clock skew",
    "replayed": "membership proof was already used (replayed request)",
    "nonce_cache_full": "too many calls within the replay window",
}


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call without a valid membership proof with UNAUTHENTICATED before its handler runs, and adds
    the server's proof to the initial metadata of the calls it lets through."""

    def __init__(self, authenticator: CallAuthenticator, on_refusal: Callable[[str], None]) -> None:
        self.authenticator = authenticator
        self.on_refusal = on_refusal

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED
        method = handler_call_details.method
        checked = self.authenticator.check_call(method, handler_call_details.invocation_metadata)
        if isinstance(checked, str):
            self.on_refusal(checked)
            return _refusing(handler, REFUSAL_MESSAGES[checked])
        _peer, nonce = checked
        return _proving(handler, self.authenticator.reply_metadata(method, nonce))


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return _same_kind(handler, abort)


def _proving(handler: grpc.RpcMethodHandler, reply: list[tuple[str, str]]) -> grpc.RpcMethodHandler:
    inner = (
        handler.stream_stream or handler.unary_stream or handler.stream_unary or handler.unary_unary
    )  # exactly one is set
    if handler.response_streaming:

        def streaming(request: Any, context: grpc.ServicerContext) -> Any:
            context.send_initial_metadata(reply)  # before the handler reads: the caller waits for it to send
            yield from inner(request, context)

        return _same_kind(handler, streaming)

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        context.send_initial_metadata(reply)
        return inner(request, context)

    return _same_kind(handler, unary)


def _same_kind(handler: grpc.RpcMethodHandler, behaviour: Callable) -> grpc.RpcMethodHandler:
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        behaviour, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


def record_mac(secret: SwarmSecret, key: str, subkey: str, value: dict[str, Any]) -> str:
    """The MAC a DHT record of a private run carries, over its key, subkey and canonical JSON content."""
    content = json.dumps({k: v for k, v in value.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return _mac(secret.key("dht"), "record", key, subkey, content)


def record_mac_ok(secret: SwarmSecret, key: str, subkey: str, value: dict[str, Any]) -> bool:
    mac = value.get("mac")
    return isinstance(mac, str) and hmac.compare_digest(mac, record_mac(secret, key, subkey, value))
