"""The rotated modulo code (wire/side_info.py): a tensor read against the receiver's own close copy; its wire form,
and a phase payload carrying it, every malformed record refused on arrival with a precise status."""

from __future__ import annotations

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from noloco_node.wire import side_info
from noloco_node.wire.frames import PayloadError, PayloadKind, TensorLayout, build_manifest, iter_frames
from noloco_node.wire.payload import PayloadReceiver


def _pair(gap_scale: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    own = torch.randn(96, 128, generator=g) * 0.05
    return own + torch.randn(96, 128, generator=g) * gap_scale, own


def _read(sent: torch.Tensor, own: torch.Tensor, estimate: torch.Tensor | None) -> tuple[float, torch.Tensor]:
    """(the error of what the receiver read, relative to the gap; the gap it measured per chunk)."""
    seen, measured = side_info.decode(side_info.encode(sent, estimate, seed=7), own, seed=7)
    return float((seen - sent).norm() / (sent - own).norm()), measured


def test_the_receiver_reads_the_sender_to_a_fraction_of_the_gap_whatever_its_size() -> None:
    """With the sender's estimate of the gap right to within 20%, the error is about 0.65 of the gap at gaps 1,000x
    apart: it follows the gap between the two copies, not the weights."""
    for gap_scale in (1e-6, 1e-3):
        sent, own = _pair(gap_scale)
        _, measured = _read(sent, own, None)
        assert torch.allclose(measured, torch.full_like(measured, gap_scale), rtol=0.5)
        for estimate in (measured * 0.8, measured, measured * 1.2):
            error, _ = _read(sent, own, estimate)
            assert 0.5 < error < 0.75, (gap_scale, error)


def test_without_an_estimate_or_with_one_far_too_small_the_receiver_keeps_its_own_copy() -> None:
    """A step of 0 (a sender with no estimate yet) or under MIN_STEP_IN_GAPS measured gaps would decode worse
    than the receiver's own copy: the chunk is not decoded, and the receiver reads its own values."""
    sent, own = _pair(1e-3)
    _, measured = _read(sent, own, None)
    for estimate in (None, measured / 4):
        seen, _ = side_info.decode(side_info.encode(sent, estimate, seed=3), own, seed=3)
        assert torch.allclose(seen, own, atol=1e-6)
    # 10% above the limit: decoded, and closer than the receiver's own copy.
    error, _ = _read(sent, own, measured * 1.1 * side_info.MIN_STEP_IN_GAPS / side_info.STEP_IN_GAPS)
    assert error < 0.9


def test_within_one_step_the_code_decodes_the_senders_grid_value() -> None:
    """The modulo decode alone (before the shrink), at a step of one RMS gap: a rotated value whose gap to the
    receiver's is under one step comes back within half a step of the sender's; one whose gap is over two steps
    does not."""
    sent, own = _pair(1e-3)
    sent_rows, own_rows = side_info.rotate(sent, 3), side_info.rotate(own, 3)
    step = (sent_rows - own_rows).pow(2).mean(dim=1, keepdim=True).sqrt()
    dither = side_info._dither(sent_rows.shape[0], 3)
    codes = torch.remainder(torch.round(sent_rows / step + dither), side_info.LEVELS)
    reference = own_rows / step + dither
    decoded = (codes + side_info.LEVELS * torch.round((reference - codes) / side_info.LEVELS) - dither) * step
    miss = (decoded - sent_rows).abs() / step
    within = (sent_rows - own_rows).abs() < step
    assert within.float().mean() > 0.6 and float(miss[within].max()) <= 0.5 + 1e-4
    beyond = (sent_rows - own_rows).abs() > 2 * step
    assert bool(beyond.any()) and float(miss[beyond].min()) > 0.5


def test_the_rotation_is_orthonormal_and_undone_exactly() -> None:
    sent, _ = _pair(1e-3)
    rows = side_info.rotate(sent, 11)
    assert abs(float(rows.norm() / sent.norm()) - 1.0) < 1e-5
    assert torch.allclose(side_info.unrotate(rows, 11, sent), sent, atol=1e-6)


def test_identical_copies_read_exactly_and_a_value_costs_under_a_quarter_byte() -> None:
    sent, _ = _pair(1e-3)
    seen, measured = side_info.decode(side_info.encode(sent, torch.ones(3) * 1e-3, seed=5), sent.clone(), seed=5)
    assert torch.allclose(seen, sent, atol=1e-6) and float(measured.max()) == 0.0
    assert 0.2 < side_info.encoded_bytes(4096 * 64) / (4096 * 64) < 0.22


def test_the_wire_bytes_round_trip_and_their_size_is_fixed_by_the_shape() -> None:
    sent, own = _pair(1e-3)
    coded = side_info.encode(sent, torch.full((3,), 1e-3), seed=2)
    encoded = side_info.pack(coded)
    assert encoded.dtype == torch.uint8 and encoded.numel() == side_info.encoded_bytes(sent.numel())
    assert side_info.bad_records(encoded.view(-1, side_info.RECORD_BYTES)) is None
    back = side_info.unpack(encoded, sent.numel())
    assert torch.equal(back.sketch, coded.sketch) and torch.equal(back.step, coded.step)
    assert torch.equal(back.codes, coded.codes)
    assert torch.equal(side_info.decode(back, own, seed=2)[0], side_info.decode(coded, own, seed=2)[0])


def _record() -> bytearray:
    sent, _ = _pair(1e-3)
    return bytearray(side_info.pack(side_info.encode(sent, torch.full((3,), 1e-3), seed=2))[: side_info.RECORD_BYTES])


def _float_bytes(value: float) -> bytes:
    return bytes(torch.tensor([value], dtype=torch.float32).view(torch.uint8).tolist())


def _break(record: bytearray, data: st.DataObject) -> str:
    """Makes one field of ``record`` what no encoder writes; returns what bad_records says of it."""
    kind = data.draw(st.sampled_from(["sketch", "step", "negative_step", "code", "padding"]))
    bad = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    if kind == "sketch":
        at = 4 * data.draw(st.integers(0, side_info.SKETCH - 1))
        record[at : at + 4] = _float_bytes(bad)
        return "a NaN or infinite sketch value"
    if kind in ("step", "negative_step"):
        at = 4 * side_info.SKETCH
        record[at : at + 4] = _float_bytes(bad if kind == "step" else -data.draw(st.floats(1e-30, 1e30)))
        return "a NaN, infinite or negative step"
    if kind == "code":
        at = data.draw(st.integers(4 * (side_info.SKETCH + 1), side_info.RECORD_BYTES - 1))
        record[at] = data.draw(st.integers(side_info.MAX_CODE_BYTE + 1, 255))
        return f"a code byte above {side_info.MAX_CODE_BYTE}"
    record[-1] = data.draw(st.integers(side_info.LEVELS, side_info.MAX_CODE_BYTE))
    return "padding digits set"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_malformed_record_is_refused_with_what_is_wrong(data: st.DataObject) -> None:
    """Bytes no encoder writes, anywhere in a record: a sketch value or step that is not a finite number (a
    negative step too), a code byte above 3**5 - 1, a padding digit of the last byte set."""
    record = _record()
    why = _break(record, data)
    assert side_info.bad_records(torch.tensor(list(record), dtype=torch.uint8).view(1, -1)) == why


RUN = "run-side"
# A sparse stream run's phase payload (node/run_layout.py): phi's matrix in the side code, its vector in int8.
PHASE = (TensorLayout("phi/m", (96, 128), "side"), TensorLayout("phi/v", (64,)))


def _phase_frames(
    encoded: torch.Tensor, vector: torch.Tensor, chunk_bytes: int, side_dtype: str = "side"
) -> list[bytes]:
    layout = [TensorLayout(PHASE[0].name, PHASE[0].shape, side_dtype), PHASE[1]]
    manifest = build_manifest(layout, wire_dtype="int8", run_fingerprint=RUN, peer_id="peer-1", outer_step=3)
    return list(iter_frames(manifest, [encoded, vector], chunk_bytes=chunk_bytes))


def _receiver() -> PayloadReceiver:
    kind = PayloadKind("phase", PHASE, "int8")
    return PayloadReceiver([], kinds=[kind], run_fingerprint=RUN, max_total_bytes=10**8)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_phase_payload_with_a_malformed_side_record_is_refused_precisely_and_nothing_is_handed_over(
    data: st.DataObject,
) -> None:
    """A sparse run's phase payload whose side-coded tensor has one record broken, sent with right checksums in
    whatever chunking the sender chose: INVALID_ARGUMENT bad_side, nothing handed over. Whole, the same payload
    arrives with the code as its checked bytes (only the receiver's own phi reads them) and the vector decoded."""
    sent, _ = _pair(1e-3, seed=data.draw(st.integers(0, 3)))
    encoded = side_info.pack(side_info.encode(sent, torch.full((3,), 1e-3), seed=2))
    vector = torch.randn(64)
    chunk_bytes = data.draw(st.sampled_from([64, 100, 888, 4096]))
    received = _receiver()
    for raw in _phase_frames(encoded, vector, chunk_bytes):
        received.feed(raw)
    whole = received.finish()
    assert whole.side_coded == ["phi/m"] and torch.equal(whole.tensors["phi/m"], encoded)
    assert whole.tensors["phi/v"].dtype == torch.float32

    broken = bytearray(encoded.tolist())
    record = data.draw(st.integers(0, 2))
    part = bytearray(broken[record * side_info.RECORD_BYTES : (record + 1) * side_info.RECORD_BYTES])
    why = _break(part, data)
    broken[record * side_info.RECORD_BYTES : (record + 1) * side_info.RECORD_BYTES] = part
    refusing = _receiver()
    handed: list[object] = []
    with pytest.raises(PayloadError) as refused:
        for raw in _phase_frames(torch.tensor(list(broken), dtype=torch.uint8), vector, chunk_bytes):
            refusing.feed(raw)
        handed.append(refusing.finish())
    assert not handed
    assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "bad_side"), refused.value
    assert why in refused.value.message


def test_a_side_tensor_sent_in_another_dtype_is_refused_by_its_manifest() -> None:
    """The side-coded tensor in int8, or the int8 one in the side code: the run's layout names each tensor's dtype,
    and another is FAILED_PRECONDITION wire_dtype before anything is allocated."""
    sent, _ = _pair(1e-3)
    with pytest.raises(PayloadError) as refused:
        _receiver().feed(_phase_frames(sent, torch.randn(64), 4096, side_dtype="int8")[0])
    assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "wire_dtype")
