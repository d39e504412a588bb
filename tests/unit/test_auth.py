"""Membership proofs (auth.py), the node key (identity.py) and the secret's loading and redaction."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from noloco_node import logs
from noloco_node.security.auth import (
    CallAuthenticator,
    SecretError,
    SwarmSecret,
    load_secret,
    record_mac,
    record_mac_ok,
)
from noloco_node.security.identity import IdentityError, NodeIdentity, peer_id_of

METHOD = "/noloco.v1.Peer/Exchange"


def _pair(secret: bytes = b"0123456789abcdef-shared") -> tuple[CallAuthenticator, CallAuthenticator]:
    shared = SwarmSecret(secret, "test")
    return CallAuthenticator(shared, "client"), CallAuthenticator(shared, "server")


def test_a_signed_call_passes_once_and_the_server_proves_itself() -> None:
    client, server = _pair()
    metadata, nonce = client.call_metadata(METHOD, "server")
    checked = server.check_call(METHOD, metadata)
    assert checked == ("client", nonce)
    assert server.check_call(METHOD, metadata) == "replayed"
    # The same proof in front of another member of the run (a replay captured on the path): refused there too.
    other_member = CallAuthenticator(SwarmSecret(b"0123456789abcdef-shared", "test"), "another-server")
    assert other_member.check_call(METHOD, metadata) == "bad_mac"
    assert client.check_server(METHOD, nonce, server.reply_metadata(METHOD, nonce)) is None
    other_nonce = client.call_metadata(METHOD, "server")[1]
    assert client.check_server(METHOD, other_nonce, server.reply_metadata(METHOD, nonce)) is not None  # not this call


def test_missing_wrong_tampered_and_stale_proofs_are_refused() -> None:
    client, server = _pair()
    _, stranger = _pair(b"another-secret-of-16-bytes-or-more")
    assert server.check_call(METHOD, []) == "missing"
    assert server.check_call(METHOD, stranger.call_metadata(METHOD, "server")[0]) == "bad_mac"
    metadata = dict(client.call_metadata(METHOD, "server")[0])
    assert server.check_call("/noloco.v1.Peer/GetState", list(metadata.items())) == "bad_mac"  # bound to the method
    tampered = {**metadata, "x-noloco-peer": "someone-else"}
    assert server.check_call(METHOD, list(tampered.items())) == "bad_mac"
    assert server.check_call(METHOD, list({**metadata, "x-noloco-nonce": "zz"}.items())) == "malformed"
    client_from_the_past = CallAuthenticator(SwarmSecret(b"0123456789abcdef-shared", "t"), "client")
    real_time = time.time
    try:
        time.time = lambda: real_time() - 600  # type: ignore[assignment]
        old = client_from_the_past.call_metadata(METHOD, "server")[0]
    finally:
        time.time = real_time  # type: ignore[assignment]
    assert server.check_call(METHOD, old) == "stale"
    assert stranger.check_server(METHOD, "00" * 16, server.reply_metadata(METHOD, "00" * 16)) is not None


def test_record_macs_cover_key_subkey_and_content() -> None:
    secret = SwarmSecret(b"0123456789abcdef-shared", "test")
    value = {"address": "1.2.3.4:5", "outer_step": 3}
    value["mac"] = record_mac(secret, "k", "s", value)
    assert record_mac_ok(secret, "k", "s", value)
    assert not record_mac_ok(secret, "k", "other", value)
    assert not record_mac_ok(secret, "k", "s", {**value, "outer_step": 4})
    assert not record_mac_ok(SwarmSecret(b"another-secret-of-16-bytes", "t"), "k", "s", value)


def test_the_secret_loads_from_a_private_file_or_the_environment_and_never_prints(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("a-long-enough-swarm-secret\n")
    path.chmod(0o600)
    secret = load_secret(path, {})
    assert secret is not None and "a-long-enough" not in repr(secret) and "a-long-enough" not in str(secret)
    path.chmod(0o644)
    with pytest.raises(SecretError, match="readable by anyone"):
        load_secret(path, {})
    with pytest.raises(SecretError, match="at least 16"):
        load_secret(None, {"NOLOCO_SWARM_SECRET": "short"})
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(tmp_path / "missing", {})
    assert load_secret(None, {}) is None
    assert load_secret(None, {"NOLOCO_SWARM_SECRET": "from-the-environment-123"}) is not None


def test_log_lines_never_show_a_loaded_secret(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure_logging("INFO", "text")
    SwarmSecret(b"do-not-print-this-secret", "test")
    logging.getLogger("noloco_node.test").warning("config was %s", "do-not-print-this-secret")
    try:
        raise ValueError("do-not-print-this-secret")
    except ValueError:
        logging.getLogger("noloco_node.test").exception("failed")
    err = capsys.readouterr().err
    assert "do-not-print-this-secret" not in err and err.count("[secret]") == 3


def test_the_node_key_is_private_persistent_and_names_the_peer(tmp_path: Path) -> None:
    first = NodeIdentity.load_or_create(tmp_path)
    key = tmp_path / "node_key.pem"
    assert key.stat().st_mode & 0o777 == 0o600
    again = NodeIdentity.load_or_create(tmp_path)
    assert again.peer_id == first.peer_id == peer_id_of(first.public_key)
    assert first.peer_id != NodeIdentity.ephemeral().peer_id
    signature = first.private_key.sign(b"record")
    assert again.public_key.verify(b"record", signature)
    os.chmod(key, 0o644)
    with pytest.raises(IdentityError, match="readable by other users"):
        NodeIdentity.load_or_create(tmp_path)
    os.chmod(key, 0o600)
    key.write_text("not a key")
    with pytest.raises(IdentityError, match="cannot read"):
        NodeIdentity.load_or_create(tmp_path)


def test_doctor_names_the_peer_id_of_a_kept_key_and_says_what_a_missing_or_broken_one_means(tmp_path: Path) -> None:
    from noloco_node.node.machine_checks import identity

    missing = identity(tmp_path / "fresh")
    assert missing.level == "warn" and "new peer id" in missing.detail and "backed-up node_key.pem" in missing.fix
    assert not (tmp_path / "fresh" / "node_key.pem").exists()  # the check creates nothing
    # Restored from a backup on a fresh data directory: the same peer id as before.
    original = NodeIdentity.load_or_create(tmp_path / "old")
    restored = tmp_path / "new"
    restored.mkdir()
    shutil.copy2(tmp_path / "old" / "node_key.pem", restored / "node_key.pem")
    kept = identity(restored)
    assert kept.level == "ok" and original.peer_id in kept.detail
    (restored / "node_key.pem").write_text("not a key")
    broken = identity(restored)
    assert broken.level == "fail" and "cannot read the node key" in broken.detail and "backup" in broken.fix
