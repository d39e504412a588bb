"""Who is calling: a proof of the caller's peer id, bound to the server it was made for, that cannot be replayed.

A peer id is a digest of the node's RSA public key (identity.py), and its DHT record is signed with that key. A
caller proves its id on every Exchange by sending, in the call's metadata, its public key and an RSA signature
over the method, the *server's* peer id, its own peer id, a millisecond timestamp and a random nonce. The server
accepts the call only when the key's digest is the claimed id, the signature verifies, the target is the server
itself, the timestamp is within the allowed clock skew and the nonce has not been seen. Everything the node then
decides about the caller (quarantine, pairing, counters, logs) is keyed on that proven id; a manifest that names
another peer is refused and nothing is held against the peer it named.

Why a signature rather than the swarm secret's HMAC (auth.py): the secret is shared by every member, so it proves
membership, not identity; one member could otherwise speak for another. Why the target's id is signed: a proof
captured in front of one node is worthless in front of any other. Cost: one RSA-2048 signature per call (about
1 ms) and one verification (tens of microseconds) on the server.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from hivemind.utils.crypto import RSAPublicKey

from noloco_node.errors import NolocoError
from noloco_node.security.identity import NodeIdentity, peer_id_of

KEY_HEADER = "noloco-caller-key"
TIME_HEADER = "noloco-caller-ts"
NONCE_HEADER = "noloco-caller-nonce"
SIGNATURE_HEADER = "noloco-caller-sig"
_DOMAIN = "noloco-caller-proof-v1"
MAX_REMEMBERED_NONCES = 65536  # per server; a flood of valid proofs costs the flooder a signature each


class CallerProofError(NolocoError):
    """A call whose caller did not prove the id it claims; ``reason`` is short, for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _message(method: str, target: str, caller: str, timestamp: str, nonce: str) -> bytes:
    return "|".join((_DOMAIN, method, target, caller, timestamp, nonce)).encode()


def prove(identity: NodeIdentity, method: str, target_peer_id: str) -> list[tuple[str, str]]:
    """The metadata that proves ``identity``'s peer id to the server whose peer id is ``target_peer_id``."""
    timestamp = str(int(time.time() * 1000))
    nonce = secrets.token_hex(16)
    signature = identity.private_key.sign(_message(method, target_peer_id, identity.peer_id, timestamp, nonce))
    return [
        (KEY_HEADER, identity.public_key.to_bytes().decode()),
        (TIME_HEADER, timestamp),
        (NONCE_HEADER, nonce),
        (SIGNATURE_HEADER, signature.decode()),
    ]


class CallerVerifier:
    """The server's side: checks proofs made for this server and remembers nonces until they are too old to use."""

    def __init__(self, own_peer_id: str, *, max_clock_skew: float = 60.0) -> None:
        self.own_peer_id = own_peer_id
        self.max_clock_skew = max_clock_skew
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> expiry (monotonic), oldest first
        self._keys: OrderedDict[str, str] = OrderedDict()  # public key text -> peer id (parsing costs more)

    def verify(self, method: str, metadata: Sequence[tuple[str, Any]] | None) -> str:
        """The caller's proven peer id, or CallerProofError."""
        fields = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
        missing = [h for h in (KEY_HEADER, TIME_HEADER, NONCE_HEADER, SIGNATURE_HEADER) if not fields.get(h)]
        if missing:
            raise CallerProofError("no_proof", f"the call carries no proof of its caller's identity ({missing[0]})")
        key_text, timestamp, nonce = fields[KEY_HEADER], fields[TIME_HEADER], fields[NONCE_HEADER]
        if len(key_text) > 2048 or len(nonce) > 64 or len(fields[SIGNATURE_HEADER]) > 1024:
            raise CallerProofError("bad_proof", "oversized identity proof")
        try:
            skew = abs(time.time() - int(timestamp) / 1000)
        except ValueError:
            raise CallerProofError("bad_proof", "the identity proof's timestamp is not a number") from None
        if skew > self.max_clock_skew:
            raise CallerProofError(
                "stale_proof",
                f"the identity proof is {skew:.0f} s from this node's clock (at most {self.max_clock_skew:.0f})",
            )
        public_key, caller = self._key(key_text)
        if not public_key.verify(
            _message(method, self.own_peer_id, caller, timestamp, nonce), fields[SIGNATURE_HEADER].encode()
        ):
            raise CallerProofError(
                "bad_proof", "the identity proof does not verify (made for another server, method or key)"
            )
        self._remember(nonce)
        return caller

    def _key(self, key_text: str) -> tuple[RSAPublicKey, str]:
        try:
            public_key = RSAPublicKey.from_bytes(key_text.encode())
        except (ValueError, TypeError, IndexError, UnsupportedAlgorithm):  # key text that does not parse, or
            # names a key type cryptography does not know (``ssh-foo AAAA``: UnsupportedAlgorithm, not ValueError)
            raise CallerProofError("bad_proof", "the identity proof's public key does not parse") from None
        with self._lock:
            caller = self._keys.get(key_text)
        if caller is None:
            caller = peer_id_of(public_key)
            with self._lock:
                self._keys[key_text] = caller
                while len(self._keys) > 4096:
                    self._keys.popitem(last=False)
        return public_key, caller

    def _remember(self, nonce: str) -> None:
        """Remember a nonce until its proof fails the clock check anyway. Only expired nonces are forgotten: with
        the table full of live ones a new proof is refused (``busy``, the caller may try again) rather than an
        unexpired nonce forgotten, which would let its proof be replayed."""
        now = time.monotonic()
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise CallerProofError("replayed_proof", "this identity proof was used before")
            if len(self._seen) >= MAX_REMEMBERED_NONCES:
                raise CallerProofError(
                    "busy", f"{MAX_REMEMBERED_NONCES} identity proofs are in use within the clock window: try again"
                )
            self._seen[nonce] = now + 2 * self.max_clock_skew  # older proofs fail the clock check anyway
