"""A node's persistent identity: an RSA key kept in its data directory, and the peer id derived from it.

The key is created on first start as ``<data dir>/node_key.pem`` (PKCS#8, file mode 0600, written atomically so a
crash never leaves half a key) and reused on every restart, so a node keeps its peer id, its data shard and its
place in other peers' bookkeeping across restarts. The peer id is a digest of the public key: nobody can claim a
peer id without holding its key, and discovery/dht.py's DHT records are signed with that key (hivemind's
``RSASignatureValidator``), so nobody can overwrite another peer's address or readiness.
"""

from __future__ import annotations

import base64
import hashlib
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from noloco_node.atomic_files import write_atomically
from noloco_node.errors import NolocoError

KEY_FILE = "node_key.pem"
PEER_ID_PREFIX = "nl"


class IdentityError(NolocoError):
    """The key file exists but cannot be used (unreadable, not an RSA key, readable by others)."""


def peer_id_of(public_key: RSAPublicKey) -> str:
    """``nl`` + the first 20 bytes of SHA-256 over the OpenSSH encoding of the key, in base32 (lower case)."""
    digest = hashlib.sha256(public_key.to_bytes()).digest()[:20]
    return PEER_ID_PREFIX + base64.b32encode(digest).decode().lower()


class NodeIdentity:
    """The node's private key (as hivemind's RSAPrivateKey, for its DHT signature validator) and its peer id."""

    def __init__(self, private_key: RSAPrivateKey, path: Path | None = None) -> None:
        self.private_key = private_key
        self.public_key = private_key.get_public_key()
        self.peer_id = peer_id_of(self.public_key)
        self.path = path

    @classmethod
    def ephemeral(cls) -> NodeIdentity:
        """A throw-away identity (tools that only read the DHT)."""
        return cls(RSAPrivateKey())

    @classmethod
    def load_or_create(cls, data_dir: Path) -> NodeIdentity:
        path = data_dir / KEY_FILE
        if path.exists():
            return cls(_load(path), path)
        data_dir.mkdir(parents=True, exist_ok=True)
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write_atomically(path, pem, mode=0o600)  # never readable by others, not even for an instant
        return cls(_wrap(key), path)


def _wrap(key: rsa.RSAPrivateKey) -> RSAPrivateKey:
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind's class only generates keys; give it ours
    wrapped._private_key = key
    return wrapped


def _load(path: Path) -> RSAPrivateKey:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise IdentityError(
            f"{path} is readable by other users (mode {mode:o}); the node key must be private: chmod 600 {path}"
        )
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as error:
        raise IdentityError(f"cannot read the node key {path}: {error}") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise IdentityError(f"{path} is not an RSA private key")
    return _wrap(key)
