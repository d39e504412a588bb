"""The rotated modulo code (wire/side_info.py): a tensor read against the receiver's own close copy."""

from __future__ import annotations

import torch

from noloco_node.wire import side_info


def _pair(gap_scale: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    own = torch.randn(96, 128, generator=g) * 0.05
    return own + torch.randn(96, 128, generator=g) * gap_scale, own


def test_the_receiver_reads_the_sender_to_a_fraction_of_the_gap_whatever_its_size() -> None:
    """The error follows the gap between the two copies, not the weights: at gaps 1,000x apart it stays the same
    fraction of the gap, well under the gap itself (the receiver's own copy as a guess misses by the whole gap)."""
    for gap_scale in (1e-6, 1e-3):
        sent, own = _pair(gap_scale)
        error = float((side_info.receive(sent, own, seed=7) - sent).norm() / (sent - own).norm())
        assert 0.2 < error < 0.75, (gap_scale, error)


def test_within_one_step_the_code_decodes_the_senders_grid_value() -> None:
    """Every rotated value whose gap to the receiver's is under one step decodes to the sender's own grid value
    (its rounding alone: at most half a step); a gap of two steps or more does not."""
    sent, own = _pair(1e-3)
    sent_rows, own_rows = side_info.rotate(sent, 3), side_info.rotate(own, 3)
    step = side_info.grid_step(side_info.sketch(sent_rows), side_info.sketch(own_rows))
    decoded = side_info.decode(side_info.encode(sent_rows, step, 3), step, own_rows, 3)
    miss = (decoded - sent_rows).abs() / step.float()
    within = (sent_rows - own_rows).abs() < step.float()
    assert within.float().mean() > 0.9
    assert float(miss[within].max()) <= 0.5 + 1e-4
    beyond = (sent_rows - own_rows).abs() > 2 * step.float()
    assert bool(beyond.any()) and float(miss[beyond].min()) > 0.5


def test_the_rotation_is_orthonormal_and_undone_exactly() -> None:
    sent, _ = _pair(1e-3)
    rows = side_info.rotate(sent, 11)
    assert abs(float(rows.norm() / sent.norm()) - 1.0) < 1e-5
    assert torch.allclose(side_info.unrotate(rows, 11, sent), sent, atol=1e-6)


def test_identical_copies_read_exactly_and_the_bytes_are_a_fifth_of_a_byte_a_value() -> None:
    sent, _ = _pair(1e-3)
    assert torch.allclose(side_info.receive(sent, sent.clone(), seed=5), sent, atol=1e-6)
    assert side_info.encoded_bytes(4096 * 64) / (4096 * 64) < 0.22
