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


def test_a_sparse_stream_run_exchanges_int8_phi_a_reservation_and_sparse_progress() -> None:
    from dataclasses import replace

    from noloco_node.wire import sparse

    sparse_run = replace(layout(1e6), mode="stream", send_phi=True, wire_dtype="sparse", phi_every=8)
    kinds = {kind.name: kind for kind in sparse_run.payload_kinds()}
    assert set(kinds) == {"phase", "progress", "reservation"}
    assert (kinds["phase"].wire_dtype, kinds["phase"].parts) == ("int8", ["phi"])
    assert (kinds["progress"].wire_dtype, kinds["progress"].parts) == ("sparse", ["progress"])
    assert kinds["reservation"].layout == () and kinds["reservation"].wire_bytes() == 0
    assert kinds["phase"].family == kinds["reservation"].family == "phase" and not kinds["progress"].family
    numel = 256 * 64 + 64
    assert kinds["progress"].wire_bytes() == sparse.encoded_bytes(256 * 64) + sparse.encoded_bytes(64)
    # the progress is decoded to fp32 on arrival and the partner's theta rebuilt: both counted
    assert sparse_run.receive_pool_bytes() >= kinds["phase"].wire_bytes() + 3 * 4 * numel
    int4_run = replace(sparse_run, wire_dtype="int4", phi_every=1)
    assert {kind.name for kind in int4_run.payload_kinds()} == {"phase", "progress"}


def test_every_kind_that_reserves_a_partner_is_served_only_as_standing_allows() -> None:
    """A stranger's reservation reserves the pair as a phase swap does: without this, free keys would buy partner
    choice in every phase of a sparse run that sends no phi (node/served.py asks pairing/standing.py first)."""
    from dataclasses import replace

    from noloco_node.node.served import PARTNER_CHOOSING_KINDS

    for run in (layout(1e6), replace(layout(1e6), mode="stream", send_phi=True, wire_dtype="sparse", phi_every=8)):
        for kind in run.payload_kinds():
            assert (kind.name in PARTNER_CHOOSING_KINDS) == (kind.name != "progress"), kind.name
