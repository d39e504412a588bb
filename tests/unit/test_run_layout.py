"""Limits a node derives from its run's layout: the stall bound follows the slowest link it accepts."""

from __future__ import annotations

from typing import Any, cast

import pytest

from noloco_node.node.run_layout import RunLayout


def layout(min_link_rate: float, shapes: tuple[tuple[int, ...], ...] = ((256, 64), (64,))) -> RunLayout:
    return RunLayout(
        source=cast(Any, None),  # not consulted by the limits
        run_fingerprint="run",
        start={},
        names=tuple(f"t{i}" for i in range(len(shapes))),
        shapes=shapes,
        send_phi=False,
        send_delta=False,
        wire_dtype="bf16",
        mode="sync",
        exchange_timeout=60.0,
        min_link_rate=min_link_rate,
    )


def test_the_stall_bound_is_the_configured_one_on_fast_links() -> None:
    assert layout(5e6).stall_seconds(2.0) == 2.0
    assert layout(5e6, ((4096, 4096),)).stall_seconds(2.0) == 2.0  # a 1 MiB chunk at 5 MB/s: 0.42 s for two


def test_the_stall_bound_covers_two_chunks_at_the_slowest_link_accepted() -> None:
    # the largest tensor, 256 x 64 values, is one chunk of at most 64 KB (fp32): two take 13.1 s at 10 KB/s
    assert layout(10_000).stall_seconds(2.0) == pytest.approx(2 * 256 * 64 * 4 / 10_000)
    # chunks are at most 1 MiB, whatever the tensor
    assert layout(1e6, ((4096, 4096),)).stall_seconds(2.0) == pytest.approx(2 * 2**20 / 1e6)


def test_a_sparse_stream_run_exchanges_phi_in_the_side_code_and_sparse_progress() -> None:
    """phi's matrices travel in the side-information code, its small and one-dimensional tensors (and the outer
    momentum) in int8, the progress top-k coded."""
    from dataclasses import replace

    from noloco_node.wire import quantize, side_info, sparse

    sparse_run = replace(layout(1e6), mode="stream", send_phi=True, send_delta=True, wire_dtype="sparse")
    kinds = {kind.name: kind for kind in sparse_run.payload_kinds()}
    assert set(kinds) == {"phase", "progress"}
    phase = kinds["phase"]
    assert (phase.wire_dtype, phase.parts) == ("int8", ["phi", "delta"])
    assert [phase.dtype_of(item) for item in phase.layout] == ["side", "int8", "int8", "int8"]
    assert phase.wire_bytes() == (
        side_info.encoded_bytes(256 * 64)
        + quantize.encoded_bytes(64, "int8")
        + quantize.encoded_bytes(256 * 64, "int8")
        + quantize.encoded_bytes(64, "int8")
    )
    assert (kinds["progress"].wire_dtype, kinds["progress"].parts) == ("sparse", ["progress"])
    numel = 256 * 64 + 64
    assert kinds["progress"].wire_bytes() == sparse.encoded_bytes(256 * 64) + sparse.encoded_bytes(64)
    # the progress is decoded to fp32 on arrival and the partner's theta rebuilt: both counted
    assert sparse_run.receive_pool_bytes() >= phase.wire_bytes() + 3 * 4 * numel
    int4_run = replace(sparse_run, wire_dtype="int4")
    assert {kind.name: kind.dtype_of(kind.layout[0]) for kind in int4_run.payload_kinds()} == {
        "phase": "bf16",
        "progress": "int4",
    }


def test_every_kind_that_reserves_a_partner_is_served_only_as_standing_allows() -> None:
    """In every mode exactly one payload kind chooses the partner, and it is the one a round does not carry: a sync
    run's meeting, a stream run's phase swap (both reserve the pair), overlap's weights. node/served.py asks
    pairing/standing.py before it serves that kind to anyone."""
    from dataclasses import replace

    runs = {
        "sync": layout(1e6),
        "stream": replace(layout(1e6), mode="stream", send_phi=True, wire_dtype="sparse"),
        "overlap": replace(layout(1e6), mode="overlap"),
    }
    rounds = {"sync": "weights", "stream": "progress", "overlap": None}
    for mode, run in runs.items():
        names = [kind.name for kind in run.payload_kinds()]
        choosing = run.partner_choosing_kind()
        assert choosing in names and choosing != rounds[mode], mode
        assert sorted(names) == sorted({choosing, rounds[mode] or choosing}), mode
