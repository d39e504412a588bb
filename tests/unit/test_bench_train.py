"""`bench train`: its figures are consistent with each other and with the model's shape."""

from __future__ import annotations

import pytest

from noloco_bench.train import REFERENCE_BATCH, run_train_bench
from noloco_node.config.models import model_config_for
from noloco_node.model.decoder import parameter_count
from noloco_node.training.step_plan import flops_per_token


def test_the_train_bench_reports_consistent_throughput_and_mfu() -> None:
    result = run_train_bench("tiny", steps=4, warmup=1, batch_size=4, micro_batch=2, seq_len=32, device="cpu")
    cfg = model_config_for("tiny", vocab_size=256, max_seq_len=32)
    assert result.parameters == parameter_count(cfg) and result.tokens_per_step == 128
    assert result.planned.plan.micro_batch == 2 and result.planned.plan.accumulation == 2
    assert len(result.step_seconds) == 4 and all(s > 0 for s in result.step_seconds)
    assert result.flops_per_token == 6 * result.parameters + 12 * cfg.num_layers * 32 * cfg.hidden_size
    assert result.tokens_per_second == pytest.approx(128 / sorted(result.step_seconds)[2])
    assert result.mfu == pytest.approx(result.tokens_per_second * result.flops_per_token / result.peak_flops)
    # The eager, unplanned step beside it: the old default batch in one pass, nothing compiled.
    assert result.reference is not None and result.reference.tokens_per_step == REFERENCE_BATCH * 32
    assert result.reference.plan.accumulation == 1 and not result.reference.plan.compiled
    report = result.report()
    assert result.peak_source.startswith("measured") and report.count("MFU:") == 2 and "planned / reference" in report


def test_flops_per_token_counts_weights_and_attention() -> None:
    assert flops_per_token(1_000, layers=2, context=10, width=4) == 6_000 + 12 * 2 * 10 * 4


def test_the_outer_step_bench_reports_its_parts_as_a_share_of_the_phase() -> None:
    from noloco_bench.outer_step import run_outer_step_bench

    result = run_outer_step_bench("tiny", inner_steps=20, batch_size=2, seq_len=32, device="cpu")
    assert [parts.placement for parts in result.placements] == ["the CPU"]  # a GPU adds the host placement
    parts = result.placements[0]
    pieces = [parts.movement, parts.gather, parts.blends, parts.check, parts.adopt, parts.snapshot]
    assert all(seconds > 0 for seconds in pieces) and result.step_seconds > 0 and result.checkpoint_seconds > 0
    assert result.phase_seconds == pytest.approx(20 * result.step_seconds)
    assert result.share(parts) == pytest.approx(sum(pieces) / result.phase_seconds)
    # The loss check evaluates the node's validation shape: 8 batches of the training batch's 2 sequences.
    assert result.validation_tokens == 8 * 2 * 32
    assert f"{result.share(parts):.2%} of the phase" in result.report()
