"""End-to-end integrity of an exchange's payloads: each side signs what it sent, bound to the call it sent it in.

An open run speaks plaintext gRPC, and a member behind a NAT is reached through a relay (discovery/relay.py) that
forwards the bytes of both payloads. Per-chunk checksums catch corruption, not intent, and a caller proof
(caller_proof.py) proves who opened the call, not what travelled in it. So the end frame of every exchange
payload is *sealed*: the sender signs, with its node key, a SHA-256 digest of the payload (wire/frames.py
``PayloadDigest``: the manifest's fields, then every chunk's tensor index, offset and bytes), together with the
call's binding (the caller proof's nonce, fresh per call and refused when replayed), the sender's peer id and the
receiver's. The receiver digests what arrives and checks the seal before the payload counts as complete:

- the signer's key must be the expected sender's (its digest is the peer id: the proven caller, or the peer that
  was dialled), so a relay cannot answer in a member's place, or send its own payload under a member's name;
- the signature must verify over this call's binding and the digest of the bytes that arrived, so a payload
  altered, truncated and re-ended, or replayed from another call or towards another receiver, is refused.

A failed seal is refused with a precise status (``unsealed`` and ``wrong_signer``: PERMISSION_DENIED; ``bad_seal``:
DATA_LOSS) and counted, and nothing is blended; it is not held against the named sender (wire/frames.py
``SEAL_FAILURES``): a relay could otherwise get honest members quarantined. Cost: one SHA-256 pass over the
payload on each side (about 1 GB/s per core, behind the transfer) and one RSA signature per payload.

What is not sealed: state downloads (GetState), which are served by reachable donors on direct connections and
checked by catch-up (node/catch_up.py); with ``--tls`` those are protected on the wire as well.
"""

from __future__ import annotations

import grpc
from cryptography.exceptions import UnsupportedAlgorithm
from hivemind.utils.crypto import RSAPublicKey

from noloco_node.security.caller_proof import NONCE_HEADER
from noloco_node.security.identity import NodeIdentity, peer_id_of
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import PayloadError

_DOMAIN = "noloco-payload-seal-v1"
MAX_SIGNER_KEY_BYTES = 2048
MAX_SIGNATURE_BYTES = 1024


def call_binding(metadata: object) -> str:
    """The binding of one call: its caller proof's nonce (``""`` when the call carries no proof)."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == NONCE_HEADER and isinstance(value, str):
            return value
    return ""


def _message(binding: str, sender: str, receiver: str, digest: bytes) -> bytes:
    return "|".join((_DOMAIN, binding, sender, receiver, digest.hex())).encode()


class PayloadSeal:
    """One side of one exchange: seals what this node sends to ``peer`` and checks the seal on what ``peer`` sends.

    ``identity`` is this node's key; ``binding`` the call's (``call_binding``), the same on both sides.
    """

    def __init__(self, identity: NodeIdentity, *, peer: str, binding: str) -> None:
        if not binding:
            raise ValueError("a payload seal needs the call's binding (its caller proof's nonce)")
        self.identity = identity
        self.peer = peer
        self.binding = binding
        # What the exchange's receipt names (receipts.py): the digests of both payloads, and the peer's key.
        self.sent_digest = b""
        self.received_digest = b""
        self.peer_key = b""

    def sign(self, digest: bytes) -> tuple[bytes, bytes]:
        """The seal of a payload this node sends: (signature, this node's public key)."""
        message = _message(self.binding, self.identity.peer_id, self.peer, digest)
        self.sent_digest = digest
        return self.identity.private_key.sign(message), self.identity.public_key.to_bytes()

    def check(self, digest: bytes, end: pb.End) -> None:
        """The seal of the payload ``peer`` sent, against the digest of what arrived; PayloadError if it fails."""
        if not end.signature or not end.signer_key:
            raise PayloadError(
                grpc.StatusCode.PERMISSION_DENIED,
                "unsealed",
                f"the payload from {self.peer} ends without its sender's seal (every exchange payload is signed)",
            )
        if len(end.signer_key) > MAX_SIGNER_KEY_BYTES or len(end.signature) > MAX_SIGNATURE_BYTES:
            raise PayloadError(grpc.StatusCode.PERMISSION_DENIED, "wrong_signer", "an oversized payload seal")
        try:
            key = RSAPublicKey.from_bytes(end.signer_key)
        except (ValueError, TypeError, IndexError, UnsupportedAlgorithm):  # key text that does not parse, or
            # names a key type cryptography does not know (``ssh-foo AAAA``: UnsupportedAlgorithm, not ValueError)
            raise PayloadError(
                grpc.StatusCode.PERMISSION_DENIED, "wrong_signer", "the payload seal's key does not parse"
            ) from None
        signer = peer_id_of(key)
        if signer != self.peer:
            raise PayloadError(
                grpc.StatusCode.PERMISSION_DENIED,
                "wrong_signer",
                f"the payload is sealed by {signer}, not by {self.peer}: something on the path answered in its place",
            )
        if not key.verify(_message(self.binding, self.peer, self.identity.peer_id, digest), end.signature):
            raise PayloadError(
                grpc.StatusCode.DATA_LOSS,
                "bad_seal",
                f"the payload from {self.peer} is not what it signed for this call: altered, cut or replayed on "
                "the way",
            )
        self.received_digest = digest
        self.peer_key = bytes(end.signer_key)
