"""The sparse wire dtype (wire/sparse.py): what the codec keeps, error feedback that loses nothing, the sizes a
manifest declares, and every kind of malformed record refused on arrival with a precise status and nothing handed
over (a hypothesis fuzz over the record fields: positions, order, scales, padding)."""

from __future__ import annotations

import math
from collections.abc import Callable

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from noloco_node.algorithm import compressed_partner_weights
from noloco_node.wire import sparse
from noloco_node.wire.frames import (
    PayloadError,
    build_manifest,
    iter_frames,
    layout_of,
    wire_num_bytes,
)
from noloco_node.wire.payload import PayloadReceiver

RUN = "run-sparse"


def named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("progress/a", torch.randn(3, 4096, generator=g) * 0.01),  # three full chunks
        ("progress/b", torch.randn(5000, generator=g)),  # one full chunk and a short one of 904 values
        ("progress/c", torch.randn(1, generator=g)),  # a chunk of one value keeps it
    ]


def frames_of(tensors: list[tuple[str, torch.Tensor]], chunk_bytes: int = 100) -> list[bytes]:
    manifest = build_manifest(tensors, wire_dtype="sparse", run_fingerprint=RUN, peer_id="peer-1", outer_step=3)
    return list(iter_frames(manifest, [t for _, t in tensors], chunk_bytes=chunk_bytes))


def receiver() -> PayloadReceiver:
    return PayloadReceiver(layout_of(named()), run_fingerprint=RUN, max_total_bytes=10**8, allowed_dtypes=("sparse",))


def test_a_chunk_keeps_its_largest_values_with_their_signs_at_two_magnitudes() -> None:
    values = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    decoded = sparse.decode(sparse.encode(values), values.numel())
    kept = decoded != 0
    assert int(kept.sum()) == sparse.kept(4096) == 64
    top = values.abs().topk(64).indices
    assert torch.equal(kept.nonzero().view(-1), top.sort().values)
    assert torch.equal(decoded[kept].sign(), values[kept].sign())
    magnitudes = decoded[kept].abs().unique()
    assert len(magnitudes) == 2  # the mean of the larger half and of the smaller half
    assert math.isclose(float(magnitudes.max()), float(values.abs().topk(32).values.mean()), rel_tol=1e-2)


def test_sizes_are_fixed_by_the_shape() -> None:
    assert sparse.record_bytes(4096) == 4 + 96 + 16  # scales, 64 positions of 12 bits, 64 codes of 2 bits
    for numel in (1, 2, 3, 4095, 4096, 5000, 3 * 4096):
        assert (
            sparse.encode(torch.randn(numel)).numel() == sparse.encoded_bytes(numel) == wire_num_bytes(numel, "sparse")
        )
    assert sparse.encoded_bytes(4096 * 64) / (4096 * 64) < 0.03


def test_the_pair_sum_moves_as_without_compression() -> None:
    """i blends with phi_j + D_j + (Delta_i - D_i), j with phi_i + D_i + (Delta_j - D_j): the two add up to the two
    fast weights, whatever the codec left out."""
    generator = torch.Generator().manual_seed(3)
    phi = [[torch.randn(5000, generator=generator)] for _ in range(2)]
    progress = [[torch.randn(5000, generator=generator) * 0.01] for _ in range(2)]
    sent = [[sparse.decode(sparse.encode(p[0]), 5000)] for p in progress]
    left_out = [[p[0] - s[0]] for p, s in zip(progress, sent, strict=True)]
    seen = [compressed_partner_weights(phi[1 - i], sent[1 - i], left_out[i]) for i in range(2)]
    theta = [phi[i][0] + progress[i][0] for i in range(2)]
    assert torch.allclose(seen[0][0] + seen[1][0], theta[0] + theta[1], atol=1e-5)
    # The sum holds for any D (or none): each side's view must also carry what the partner sent and nothing else
    # of the partner's progress, so that a view without D_j (phi_j + Delta_i, say) fails here.
    for i in range(2):
        assert torch.allclose(seen[i][0], phi[1 - i][0] + sent[1 - i][0] + left_out[i][0], atol=1e-6)
        assert not torch.allclose(seen[i][0], phi[1 - i][0] + progress[i][0], atol=1e-4)


def test_a_round_trip_through_frames_decodes_what_the_codec_kept() -> None:
    rx = receiver()
    for raw in frames_of(named()):
        rx.feed(raw)
    payload = rx.finish()
    for name, tensor in named():
        assert torch.equal(payload.tensors[name].reshape(-1), sparse.decode(sparse.encode(tensor), tensor.numel()))


def _bf16_bytes(value: float) -> tuple[int, int]:
    raw = int(torch.tensor([value]).to(torch.bfloat16).view(torch.int16)) & 0xFFFF
    return raw & 0xFF, raw >> 8


def _breakage(data: st.DataObject, length: int) -> tuple[str, list[tuple[int, Callable[[int], int]]]]:
    """What is broken in a record of a chunk of ``length`` values: (its name, [(byte offset in the record, new
    value from the old)])."""
    k = sparse.kept(length)
    index_end = sparse.SCALE_BYTES + sparse.index_bytes(k)
    kind = data.draw(st.sampled_from(["non_finite_scale", "negative_scale", "low_above_high", "position"]))
    if kind == "non_finite_scale":
        at = data.draw(st.sampled_from([0, 2]))  # the low or the high scale
        low, high = _bf16_bytes(data.draw(st.sampled_from([math.nan, math.inf, -math.inf])))
        return kind, [(at, lambda _old: low), (at + 1, lambda _old: high)]
    if kind == "negative_scale":
        low, high = _bf16_bytes(-data.draw(st.floats(1e-6, 10.0)))
        return kind, [(0, lambda _old: low), (1, lambda _old: high)]
    if kind == "low_above_high":
        low, high = _bf16_bytes(1e30)
        return kind, [(0, lambda _old: low), (1, lambda _old: high)]
    if length < 4096:  # the last position past the chunk's end
        return "position_outside", [(index_end - 1, lambda _old: 0xFF)]
    # The last position made 0: equal to or before the one before it
    return "position_order", [(index_end - 1, lambda _old: 0), (index_end - 2, lambda old: old & 0x0F)]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_malformed_records_are_refused_precisely_and_nothing_is_handed_over(data: st.DataObject) -> None:
    """Bytes of one record (a scale, a position) made what no encoder writes, sent with right checksums: refused
    with INVALID_ARGUMENT bad_sparse, whatever chunking the sender chose, and no payload is handed over."""
    tensors = named(data.draw(st.integers(0, 3)))
    encodings = [sparse.encode(t) for _, t in tensors]
    tensor = data.draw(st.integers(0, 1))  # the tensors with records of 4096 values (and b's short one)
    numel = tensors[tensor][1].numel()
    full, rest = sparse.chunk_lengths(numel)
    record = data.draw(st.integers(0, full + (1 if rest else 0) - 1))
    start, length = sparse.record_span(numel, record)
    kind, changes = _breakage(data, length)
    for offset, change in changes:
        encodings[tensor][start + offset] = change(int(encodings[tensor][start + offset]))
    manifest = build_manifest(tensors, wire_dtype="sparse", run_fingerprint=RUN, peer_id="peer-1", outer_step=3)
    chunk_bytes = data.draw(st.sampled_from([64, 100, 116, 4096]))
    rx = receiver()
    handed: list[object] = []
    with pytest.raises(PayloadError) as refused:
        for raw in iter_frames(manifest, encodings, chunk_bytes=chunk_bytes):
            rx.feed(raw)
        handed.append(rx.finish())
    assert not handed
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, (kind, refused.value)
    assert refused.value.reason == "bad_sparse", (kind, refused.value)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda r: r.__setitem__(slice(4, 7), bytes([5, 0, 0])), "positions repeated or out of order"),  # 5 then 0
        (lambda r: r.__setitem__(-1, r[-1] | 0xC0), None),  # a code bit: any code is valid in a full chunk
    ],
)
def test_bad_records_names_what_is_wrong(change, why: str | None) -> None:
    record = bytearray(sparse.encode(torch.randn(4096, generator=torch.Generator().manual_seed(4))))
    change(record)
    assert sparse.bad_records(torch.tensor(list(record), dtype=torch.uint8).view(1, -1), 4096) == why


def test_padding_bits_of_a_short_chunk_are_refused() -> None:
    """A chunk of 3 values keeps 2 (k is even); its code byte has room for 4 codes: bits of the other two are
    padding, and set they are refused."""
    record = bytearray(sparse.encode(torch.tensor([1.0, -2.0, 3.0])))
    assert sparse.bad_records(torch.tensor(list(record), dtype=torch.uint8).view(1, -1), 3) is None
    record[-1] |= 0x40
    assert sparse.bad_records(torch.tensor(list(record), dtype=torch.uint8).view(1, -1), 3) == "padding bits set"
