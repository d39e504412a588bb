"""Peer records read from the DHT are parsed defensively and bounded in size, lifetime and number; run fingerprints
separate incompatible runs."""

from __future__ import annotations

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.timed_storage import get_dht_time

from noloco_node.config.models import model_config_for
from noloco_node.discovery.dht import (
    MAX_RECORD_BYTES,
    MAX_RECORD_TTL,
    MAX_STORED_VALUE_BYTES,
    BoundedRecords,
    PeerRecord,
    RememberedSignatures,
    record_bytes,
)
from noloco_node.discovery.view import kept_records
from noloco_node.model.source import SeededDecoder, run_fingerprint


def test_record_round_trip() -> None:
    record = PeerRecord(
        "peer", "10.0.0.1:7000", "fp", outer_step=5, inner_step=250, ready=True, updated=12.5, next_step_at=42.0
    )
    assert PeerRecord.from_value("peer", record.to_value()) == record
    older = {k: v for k, v in record.to_value().items() if k != "next_step_at"}  # a node of an earlier version
    assert PeerRecord.from_value("peer", older).next_step_at == 0.0  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "value",
    [
        None,
        "text",
        {},
        {"address": "10.0.0.1:7000"},
        {"address": "no-port", "run_fingerprint": "fp"},
        {"address": "10.0.0.1:99999", "run_fingerprint": "fp"},
        {"address": ":7000", "run_fingerprint": "fp"},
        {"address": "10.0.0.1:7000", "run_fingerprint": "fp", "outer_step": "many"},
        *(
            {"address": "10.0.0.1:7000", "run_fingerprint": "fp", "next_step_at": due}
            for due in (float("nan"), float("inf"), -1.0, "soon", True)
        ),
    ],
)
def test_malformed_records_are_dropped(value: object) -> None:
    assert PeerRecord.from_value("peer", value) is None


def test_fingerprint_separates_runs_and_is_stable() -> None:
    tiny = SeededDecoder(model_config_for("tiny", vocab_size=256, max_seq_len=128), seed=0)
    base = run_fingerprint(tiny, run_name="r", seed=0)
    assert base == run_fingerprint(tiny, run_name="r", seed=0)
    assert base != run_fingerprint(tiny, run_name="r2", seed=0)
    assert base != run_fingerprint(tiny, run_name="r", seed=1)
    assert base != run_fingerprint(
        SeededDecoder(model_config_for("tiny", vocab_size=256, max_seq_len=256), 0), run_name="r", seed=0
    )
    assert base != run_fingerprint(
        SeededDecoder(model_config_for("small", vocab_size=256, max_seq_len=128), 0), run_name="r", seed=0
    )


def test_run_wide_settings_are_in_the_fingerprint_and_a_mismatch_is_named() -> None:
    """Nodes that differ in H (or any run-wide setting: the tokens per inner step too) live in different runs, and
    each names the setting; a member's own settings (its micro-batch, compile) change nothing."""
    from noloco_node.config.models import DataConfig, OuterConfig, TrainConfig
    from noloco_node.config.node_config import NodeConfig
    from noloco_node.data.corpus import load_corpus
    from noloco_node.discovery.dht import RunStart
    from noloco_node.node.run_layout import RunLayout

    corpus = load_corpus(DataConfig(max_bytes=200_000))
    node, outer = NodeConfig(), OuterConfig()
    base = RunLayout.of(node, TrainConfig(inner_steps=20), outer, corpus)
    assert (
        base.run_fingerprint
        == RunLayout.of(node, TrainConfig(inner_steps=20, micro_batch=2, compile="off"), outer, corpus).run_fingerprint
    )
    for differs in (
        {"train": TrainConfig(inner_steps=30)},
        {"train": TrainConfig(inner_steps=20, batch_size=16)},
        {"train": TrainConfig(inner_steps=20, lr=1e-3)},
        {"outer": OuterConfig(alpha=0.3)},
        {"node": NodeConfig(wire_dtype="int8")},
        {"node": NodeConfig(blend_momenta=True)},
        {"node": NodeConfig(bucket_records=32)},  # where records are looked for: others would never find them
    ):
        other = RunLayout.of(
            differs.get("node", node),
            differs.get("train", TrainConfig(inner_steps=20)),
            differs.get("outer", outer),
            corpus,
        )
        assert other.run_fingerprint != base.run_fingerprint, differs
    other = RunLayout.of(node, TrainConfig(inner_steps=30), outer, corpus)
    refusal = RunStart("peer-b", other.run_fingerprint, other.start).refusal("r", base.start)
    assert "trains with other run-wide settings" in refusal
    assert "inner_steps 30 (this node: 20)" in refusal and "model" not in refusal.split(":", 1)[1], refusal


def test_past_the_limit_preferred_records_are_kept_first_and_the_rest_sampled_whatever_their_dates() -> None:
    """1,100 records dated an hour ahead and two honest ones: the honest one this node prefers (standing) is always
    kept, and which of the rest are kept does not follow their dates (readers used to keep the newest)."""
    flood = [PeerRecord(f"f{i}", f"127.0.0.2:{9000 + i}", "run", updated=10_000.0 + i) for i in range(1100)]
    honest = [PeerRecord(p, "127.0.0.1:7000", "run", updated=100.0) for p in ("established", "stranger")]
    kept_stranger = 0
    for _ in range(20):
        kept = kept_records([*flood, *honest], lambda peer_id: peer_id == "established", limit=1024)
        ids = {r.peer_id for r in kept}
        assert len(kept) == 1024 and "established" in ids
        kept_stranger += "stranger" in ids
        assert min(r.updated for r in kept if r.peer_id.startswith("f")) < 10_000.0 + 1100 - 1024  # not the newest
    assert 10 <= kept_stranger <= 20  # kept with probability 1023/1101 each time, not never
    assert kept_records(honest, lambda _peer_id: False) == honest  # under the limit: everything, as it came


def test_records_too_large_or_too_long_lived_are_refused_by_every_dht_peer_and_by_readers() -> None:
    validator = BoundedRecords()
    now = get_dht_time()
    ok = DHTRecord(b"key", b"subkey", b"x" * MAX_STORED_VALUE_BYTES, now + 30)
    assert validator.validate(ok)
    assert not validator.validate(DHTRecord(b"key", b"subkey", b"x" * (MAX_STORED_VALUE_BYTES + 1), now + 30))
    assert not validator.validate(DHTRecord(b"key", b"subkey", b"x", now + MAX_RECORD_TTL + 60))
    honest = PeerRecord("p", "127.0.0.1:7000", "run", outer_step=5, ready=True).to_value()
    assert record_bytes(honest) < 300
    filled = {**honest, "relays": ["r" * 256] * 8, "p2p_addrs": ["a" * 256] * 8}
    assert PeerRecord.from_value("p", filled) is not None and record_bytes(filled) > MAX_RECORD_BYTES
    assert record_bytes({"not msgpack": object()}) > MAX_RECORD_BYTES


def test_a_records_signature_is_checked_once_and_any_changed_byte_is_checked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same record comes back from every DHT peer a lookup asks, lookup after lookup: its signature is checked
    once. A record that differs in its value, its expiration or its owner is a new record, checked in full, and a
    forged one is refused however often it comes."""
    from hivemind.utils.crypto import RSAPublicKey
    from hivemind.utils.serializer import MSGPackSerializer

    from noloco_node.security.identity import NodeIdentity

    checks: list[bytes] = []
    verify = RSAPublicKey.verify

    def counted(self: RSAPublicKey, data: bytes, signature: bytes) -> bool:
        checks.append(data)
        return verify(self, data, signature)

    monkeypatch.setattr(RSAPublicKey, "verify", counted)
    owner, other = NodeIdentity.ephemeral(), NodeIdentity.ephemeral()
    signer, reader = RememberedSignatures(owner.private_key), RememberedSignatures(other.private_key)
    subkey, now = signer.local_public_key, get_dht_time()
    key = b"noloco/run/peers/0/"
    value = MSGPackSerializer.dumps(PeerRecord("p", "127.0.0.1:7000", "run").to_value())
    record = DHTRecord(key, subkey, signer.sign_value(DHTRecord(key, subkey, value, now + 30)), now + 30)

    assert all(reader.validate(record) for _ in range(5))
    assert len(checks) == 1
    changed_value = DHTRecord(key, subkey, record.value.replace(b"7000", b"7001"), now + 30)
    later = DHTRecord(key, subkey, record.value, now + 31)  # the signature covers the expiration
    assert not reader.validate(changed_value) and not reader.validate(later)
    assert len(checks) == 3
    # Another key's signature under the owner's subkey: refused, each time, and checked once.
    forged_value = RememberedSignatures(other.private_key)
    forged = DHTRecord(
        key,
        subkey,
        forged_value.strip_value(record)
        + RSASignatureValidator.SIGNATURE_FORMAT.replace(
            b"_value_", other.private_key.sign(forged_value._serialize_record(DHTRecord(key, subkey, value, now + 30)))
        ),
        now + 30,
    )
    assert not any(reader.validate(forged) for _ in range(3))
    assert len(checks) == 4
