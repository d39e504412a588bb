"""Peer records read from the DHT are parsed defensively; run fingerprints separate incompatible runs."""

from __future__ import annotations

import pytest

from noloco_node.config.models import model_config_for
from noloco_node.discovery.dht import PeerRecord
from noloco_node.model.source import SeededDecoder, run_fingerprint


def test_record_round_trip() -> None:
    record = PeerRecord("peer", "10.0.0.1:7000", "fp", outer_step=5, inner_step=250, ready=True, updated=12.5)
    assert PeerRecord.from_value("peer", record.to_value()) == record


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
