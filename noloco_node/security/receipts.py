"""Contribution receipts: what one committed exchange proves, signed by both partners, and where a node keeps them.

Every exchange between two members whose payloads are sealed (payload_seal.py) ends in a commit (proto
``Verdict``). With the commit each side also signs the exchange's *receipt terms*: the run, the payload kind, both
peer ids (caller and server), each side's outer step and the tokens it claims to train per phase (from its
manifest), the SHA-256 digests of both payloads (the
seals' digests, so the receipt names exactly what crossed), the call's binding (its caller proof's nonce, fresh per
call) and a time the caller names, which the server signs only within the clock skew it allows a caller's proof
(``--max-clock-skew``, caller_proof.py).

- Neither side can make a receipt alone: it carries both signatures, each checked against a key whose digest is the
  signer's peer id (identity.py).
- A receipt cannot be moved into another run or step, or made to name other payloads: those are in the signed terms.
  Replaying it whole adds nothing: the ledger (observability/ledger.py) counts one receipt per call binding and
  caller, and a member once per payload kind and outer step.
- A member's history survives its data directory: its partners keep the same receipts, so a member restored from
  its backed-up key on a fresh directory is credited by theirs (docs/security.md, "Identity").

A node appends each receipt it holds to ``receipts.jsonl`` in its data directory (:class:`ReceiptBook`, one JSON
object per line) and serves them in pages from its gRPC service (``GetReceipts``, rpc/receipt_serving.py);
``noloco-node contributions`` rebuilds the ledger from such files and pages.
"""

from __future__ import annotations

import json
import threading
import time
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from hivemind.utils.crypto import RSAPublicKey

from noloco_node.security.identity import NodeIdentity, peer_id_of
from noloco_node.security.payload_seal import PayloadSeal
from noloco_node.wire import peer_pb2 as pb

RECEIPTS_FILE = "receipts.jsonl"
MAX_RECEIPT_BYTES = 8192  # a receipt line longer than this is refused unread (two keys and two signatures fit)
_DOMAIN = "noloco-receipt-v1"


class ReceiptError(ValueError):
    """A receipt that proves nothing: ``reason`` names why (malformed, wrong_signer, bad_signature, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ReceiptTerms:
    """What both partners sign."""

    run: str
    kind: str
    caller: str
    server: str
    caller_step: int
    server_step: int
    caller_tokens: int  # the tokens each side claims it trains per phase (its manifest's phase_tokens)
    server_tokens: int
    caller_digest: str  # hex SHA-256 of the caller's payload (its seal's digest)
    server_digest: str
    binding: str  # the call's caller-proof nonce
    time: int  # Unix seconds, named by the caller

    def message(self) -> bytes:
        fields = (
            _DOMAIN,
            self.run,
            self.kind,
            self.caller,
            self.server,
            str(self.caller_step),
            str(self.server_step),
            str(self.caller_tokens),
            str(self.server_tokens),
            self.caller_digest,
            self.server_digest,
            self.binding,
            str(self.time),
        )
        return "|".join(fields).encode()

    def step_of(self, member: str) -> int:
        return self.caller_step if member == self.caller else self.server_step

    def tokens_of(self, member: str) -> int:
        return self.caller_tokens if member == self.caller else self.server_tokens


@dataclass(frozen=True)
class Receipt:
    terms: ReceiptTerms
    caller_key: str  # OpenSSH text of the caller's public key
    server_key: str
    caller_signature: str  # base64 RSA-PSS signatures over ``terms.message()``
    server_signature: str

    def to_json(self) -> str:
        return json.dumps({**asdict(self.terms), **{k: v for k, v in asdict(self).items() if k != "terms"}})

    @classmethod
    def from_json(cls, line: str) -> Receipt:
        """A receipt parsed from one line, or ReceiptError ``malformed``; its signatures are not checked here."""
        if len(line) > MAX_RECEIPT_BYTES:
            raise ReceiptError("malformed", f"a receipt of {len(line)} bytes (at most {MAX_RECEIPT_BYTES})")
        try:
            data = json.loads(line)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            terms = ReceiptTerms(
                run=_text(data, "run"),
                kind=_text(data, "kind"),
                caller=_text(data, "caller"),
                server=_text(data, "server"),
                caller_step=_count(data, "caller_step"),
                server_step=_count(data, "server_step"),
                caller_tokens=_count(data, "caller_tokens"),
                server_tokens=_count(data, "server_tokens"),
                caller_digest=_text(data, "caller_digest"),
                server_digest=_text(data, "server_digest"),
                binding=_text(data, "binding"),
                time=_count(data, "time"),
            )
            keys = ("caller_key", "server_key", "caller_signature", "server_signature")
            return cls(terms, *(_text(data, name) for name in keys))
        except ValueError as error:
            raise ReceiptError("malformed", f"not a receipt: {error}") from None

    def check(self) -> None:
        """ReceiptError unless both signatures are the named peers' own, over these terms."""
        for who, key_text, signature in (
            (self.terms.caller, self.caller_key, self.caller_signature),
            (self.terms.server, self.server_key, self.server_signature),
        ):
            verify_signature(self.terms, who, key_text.encode(), signature.encode())
        if self.terms.caller == self.terms.server:
            raise ReceiptError("self_signed", f"{self.terms.caller} is named as both partners")


def _text(data: dict[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{name!r} is not a string")
    return value


def _count(data: dict[str, Any], name: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name!r} is not a non-negative integer")
    return value


def verify_signature(terms: ReceiptTerms, signer: str, key_text: bytes, signature: bytes) -> None:
    """ReceiptError unless ``signature`` is ``signer``'s (its key's digest is the peer id) over ``terms``."""
    try:
        key = RSAPublicKey.from_bytes(key_text)
    except (ValueError, TypeError, IndexError, UnsupportedAlgorithm):
        raise ReceiptError("wrong_signer", f"the key given for {signer} does not parse") from None
    if peer_id_of(key) != signer:
        raise ReceiptError("wrong_signer", f"the key given for {signer} is {peer_id_of(key)}'s")
    if not signature or not key.verify(terms.message(), signature):
        raise ReceiptError("bad_signature", f"{signer}'s signature does not cover these terms")


@dataclass
class ReceiptDraft:
    """One side's part of one exchange's receipt: its terms, this side's signature, the partner's key."""

    terms: ReceiptTerms
    own_signature: bytes
    own_key: bytes
    peer_key: bytes
    caller_side: bool

    @classmethod
    def sign(cls, identity: NodeIdentity, terms: ReceiptTerms, peer_key: bytes, *, caller_side: bool) -> ReceiptDraft:
        return cls(
            terms, identity.private_key.sign(terms.message()), identity.public_key.to_bytes(), peer_key, caller_side
        )

    def countersigned(self, peer_signature: bytes) -> Receipt:
        """The whole receipt, once the partner's signature over the same terms is checked; ReceiptError if not."""
        peer = self.terms.server if self.caller_side else self.terms.caller
        verify_signature(self.terms, peer, self.peer_key, peer_signature)
        own, theirs = (self.own_key, self.own_signature), (self.peer_key, peer_signature)
        (caller_key, caller_sig), (server_key, server_sig) = (own, theirs) if self.caller_side else (theirs, own)
        return Receipt(self.terms, caller_key.decode(), server_key.decode(), caller_sig.decode(), server_sig.decode())


def terms_of(
    seal: PayloadSeal, *, caller_side: bool, run: str, kind: str, own: pb.Manifest, peer: pb.Manifest, named_time: int
) -> ReceiptTerms:
    """The terms of the exchange ``seal`` sealed, as this side knows them: its own payload's manifest and the peer's
    (outer steps, token claims), and both payloads' digests (the seal's)."""
    own_digest, peer_digest = seal.sent_digest.hex(), seal.received_digest.hex()
    if caller_side:
        caller, server, called, served = seal.identity.peer_id, seal.peer, own, peer
        caller_digest, server_digest = own_digest, peer_digest
    else:
        caller, server, called, served = seal.peer, seal.identity.peer_id, peer, own
        caller_digest, server_digest = peer_digest, own_digest
    return ReceiptTerms(
        run=run,
        kind=kind,
        caller=caller,
        server=server,
        caller_step=called.outer_step,
        server_step=served.outer_step,
        caller_tokens=called.phase_tokens,
        server_tokens=served.phase_tokens,
        caller_digest=caller_digest,
        server_digest=server_digest,
        binding=seal.binding,
        time=named_time,
    )


def acceptable_time(named: int, max_skew: float, now: float | None = None) -> bool:
    """Whether a server signs a receipt whose caller named ``named``: within ``max_skew`` of its own clock."""
    return abs(named - (time.time() if now is None else now)) <= max_skew


class ReceiptBook:
    """The receipts a node holds, appended to ``receipts.jsonl`` in its data directory; thread-safe (exchange
    threads on both sides add to it). In memory only each line's offset (8 bytes a receipt), so a page of the file
    costs a seek and the page's own bytes however long the node has run."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / RECEIPTS_FILE
        self._lock = threading.Lock()
        self._offsets = array("Q")  # each receipt line's byte offset, 8 bytes apiece
        if self.path.exists():
            with self.path.open("rb+") as file:
                offset = 0
                for line in file:
                    if line.strip():
                        self._offsets.append(offset)
                    offset += len(line)
                if offset and not line.endswith(b"\n"):  # a line torn by a crash must not swallow the next receipt
                    file.write(b"\n")

    @property
    def count(self) -> int:
        return len(self._offsets)

    def add(self, receipt: Receipt) -> None:
        line = (receipt.to_json() + "\n").encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab") as file:
                self._offsets.append(file.tell())
                file.write(line)

    def page(self, after: int, limit: int) -> list[str]:
        """Up to ``limit`` receipt lines from receipt number ``after`` on (0-based), as stored."""
        with self._lock:
            if after >= len(self._offsets):
                return []
            with self.path.open("rb") as file:
                file.seek(self._offsets[after])
                lines: list[str] = []
                while len(lines) < limit:
                    line = file.readline()
                    if not line:
                        break
                    if line.strip():
                        lines.append(line.decode("utf-8", errors="replace").strip())
                return lines
