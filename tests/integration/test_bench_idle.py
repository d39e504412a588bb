"""`noloco-node bench idle`, smoke size: two real 2-node swarms (sync, stream) and a bare-model reference (overlap
runs the same code with another --mode)."""

from __future__ import annotations

import pytest

from noloco_bench.idle import run_idle_bench


@pytest.mark.slow  # a benchmark's smoke run: `make test-slow` (docs/testing.md)
def test_bench_idle_measures_each_mode_and_a_bare_reference() -> None:
    result = run_idle_bench(nodes=2, steps=60, model="tiny", seq_len=64, modes=("sync", "stream"))
    assert [mode.mode for mode in result.modes] == ["sync", "stream"]
    for mode in result.modes:
        assert len(mode.idle) == 2 and all(0.0 <= idle < 1.0 for idle in mode.idle)
        # Both nodes train all 60 steps from step 0 (--wait-for-peers): outer steps at 50 and at the end, each.
        assert mode.outer_steps == 2 * 2 and 0 <= mode.blends <= mode.outer_steps and mode.seconds > 0
        # A node holds more than a bare model.
        assert all(peak > result.bare_rss_mb > 50 for peak in mode.peak_rss_mb), (mode, result.bare_rss_mb)
    report = result.report()
    assert "sync     trainer idle" in report and "stream   trainer idle" in report and "MB more" in report
