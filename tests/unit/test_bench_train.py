"""`bench train`: its figures are consistent with each other and with the model's shape."""

from __future__ import annotations

import pytest

from noloco_bench.train import flops_per_token, run_train_bench
from noloco_node.config.models import model_config_for
from noloco_node.model.decoder import parameter_count


def test_the_train_bench_reports_consistent_throughput_and_mfu() -> None:
    result = run_train_bench("tiny", steps=4, warmup=1, batch_size=2, seq_len=32, device="cpu")
    cfg = model_config_for("tiny", vocab_size=256, max_seq_len=32)
    assert result.parameters == parameter_count(cfg) and result.tokens_per_step == 64
    assert len(result.step_seconds) == 4 and all(s > 0 for s in result.step_seconds)
    assert result.flops_per_token == 6 * result.parameters + 12 * cfg.num_layers * 32 * cfg.hidden_size
    assert result.tokens_per_second == pytest.approx(64 / sorted(result.step_seconds)[2])
    assert result.mfu == pytest.approx(result.tokens_per_second * result.flops_per_token / result.peak_flops)
    assert result.peak_source.startswith("measured") and "MFU:" in result.report()


def test_flops_per_token_counts_weights_and_attention() -> None:
    assert flops_per_token(1_000, layers=2, context=10, width=4) == 6_000 + 12 * 2 * 10 * 4
