"""The simulator's wire variants (simulate/wire_views.py): what a partner blends with when the weights cross the
wire in bf16, int8 or int4, whole (sync) or as phi in bf16 plus Delta (stream), and the sparse variants' bytes and
phi codes."""

from __future__ import annotations

import torch

from noloco_node.simulate.wire_views import ErrorFeedback, partner_view


def _state(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Slow weights of a trained-looking layer and fast weights one inner phase away (Delta ~ 1% of phi)."""
    g = torch.Generator().manual_seed(seed)
    phi = [torch.randn(512, 64, generator=g) * 0.05, torch.randn(1000, generator=g) * 0.05]
    theta = [p + torch.randn(p.shape, generator=g) * 5e-4 for p in phi]
    return theta, phi


def _error(seen: list[torch.Tensor], exact: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Error of what the partner saw, relative to the size of the pseudo-gradient it is meant to carry."""
    num = sum(float((s - e).norm() ** 2) for s, e in zip(seen, exact, strict=True)) ** 0.5
    den = sum(float((e - r).norm() ** 2) for e, r in zip(exact, reference, strict=True)) ** 0.5
    return num / den


def test_noloco_is_exact_and_each_wire_costs_what_its_precision_says() -> None:
    theta, phi = _state()
    seen_theta, _ = partner_view("noloco", theta, phi)
    assert all(torch.equal(a, b) for a, b in zip(seen_theta, theta, strict=True))
    errors = {method: _error(partner_view(method, theta, phi)[0], theta, phi) for method in (
        "noloco-bf16", "noloco-int8", "noloco-int4", "noloco-stream", "noloco-stream-int8", "noloco-stream-int4"
    )}  # fmt: skip
    # Quantizing the whole weights buries the phase's progress in noise; quantizing Delta does not: this is why
    # the stream mode sends phi (in the background) and Delta (on the critical path).
    assert errors["noloco-int4"] > 1.0 and errors["noloco-int8"] > 0.2, errors
    assert errors["noloco-stream-int4"] < 0.25 * errors["noloco-int4"], errors
    assert errors["noloco-stream-int8"] < 0.25 * errors["noloco-int8"], errors
    # The stream mode's floor is phi in bf16, the same rounding the sync mode's bf16 theta has.
    assert errors["noloco-stream"] <= errors["noloco-bf16"] * 1.1, errors
    assert errors["noloco-stream-int8"] < errors["noloco-stream"] * 1.5, errors


def test_the_stream_view_rebuilds_theta_from_its_own_phi() -> None:
    theta, phi = _state(1)
    seen_theta, seen_phi = partner_view("noloco-stream-int4", theta, phi)
    assert all(torch.equal(p, q.to(torch.bfloat16).float()) for p, q in zip(seen_phi, phi, strict=True))
    # The partner's blend uses (theta - phi) as sent: exactly the decoded Delta added to the phi it holds.
    delta = [t - p for t, p in zip(seen_theta, seen_phi, strict=True)]
    assert all(float(d.abs().max()) < 5e-3 for d in delta)


def test_sparse_methods_send_what_their_bytes_say() -> None:
    """Per parameter per outer step on a model of 4,096-multiples: the top-k codes (116 bytes per 4,096 values) on
    the critical path, and phi's int8 every K steps (or one bit a value more) in all; the peak is the outer step
    that carries phi whole."""
    from noloco_node.simulate.wire_views import bytes_per_parameter

    shapes = [(4096, 1024), (4096, 256)]
    total, critical, peak = bytes_per_parameter("noloco-sparse-phi8", shapes, sends_phi=False)
    assert critical == 116 / 4096
    assert abs(total - (116 / 4096 + (1 + 4 / 256) / 8)) < 1e-9
    assert abs(peak - (116 / 4096 + (1 + 4 / 256))) < 1e-9  # phi's int8 whole, once in 8 outer steps
    assert bytes_per_parameter("noloco-sparse-phi1", shapes, sends_phi=False)[0] > 1.0
    for method in ("noloco-sparse-sign-phi16", "noloco-sparse-parity-phi16"):
        total, critical, peak = bytes_per_parameter(method, shapes, sends_phi=False)
        assert critical == 116 / 4096 and total <= 0.25 and peak > 1.0, (method, total, peak)
    assert bytes_per_parameter("noloco-bf16", shapes, sends_phi=False) == (2.0, 2.0, 2.0)
    # phi at every outer step in the side-information code: a fifth of a byte a value and its sketches, the same
    # at every outer step.
    total, critical, peak = bytes_per_parameter("noloco-sparse-side", shapes, sends_phi=False)
    assert critical == 116 / 4096 and 0.2 < total <= 0.25 and peak == total, (total, peak)
    small = bytes_per_parameter("noloco-sparse-side", [(4096, 1024), (1000,)], sends_phi=False)
    assert small[0] > total  # a one-dimensional tensor's phi crosses in int8


def test_phi_in_the_side_information_code_pulls_a_pair_together_at_every_outer_step() -> None:
    """Two replicas whose slow weights drifted apart: in the steps a sparse method sends no phi nothing pulls them
    together (each blends the partner's progress onto its own phi); with phi in the side-information code every
    step they come closer (less than with phi exact: the decoded gap is shrunk against the code's rounding), from
    the second exchange on (the first gives the sender its estimate of the gap)."""
    from noloco_node.simulate.wire_views import sparse_pair_steps

    g = torch.Generator().manual_seed(4)
    base = [torch.randn(128, 64, generator=g) * 0.05]
    phis = [base, [base[0] + torch.randn(128, 64, generator=g) * 1e-3]]
    thetas = [[p[0] + torch.randn(128, 64, generator=g) * 1e-4] for p in phis]
    deltas = [[torch.zeros(128, 64)] for _ in phis]
    weights = {"alpha": 0.5, "beta": 0.7, "gamma": 0.7}

    def gap_after(rounds: int = 1, **how: object) -> float:
        """The gap between the two new slow weights after the last of ``rounds`` exchanges of the same state (the
        side-information code's first exchange measures the gap; later ones use it)."""
        feedback = [ErrorFeedback([(128, 64)]) for _ in phis]
        estimates: list[dict[int, torch.Tensor]] = [{}, {}]
        for _ in range(rounds):
            steps = sparse_pair_steps(
                [[0, 1]],
                thetas,
                phis,
                deltas,
                feedback,
                gap_estimates=estimates,
                **how,
                **weights,  # type: ignore[arg-type]
            )
        return float((steps[0][0][0] - steps[1][0][0]).norm())

    before = float((phis[0][0] - phis[1][0]).norm())
    without = gap_after(phi_round=False)
    exact = gap_after(phi_round=True)
    side = {rounds: gap_after(rounds, phi_round=False, side_phi_seed=3, error_feedback=False) for rounds in (1, 2)}
    assert without > 0.95 * before, (before, without)
    assert side[1] > 0.95 * before, (before, side)  # no estimate yet: nothing decoded
    assert exact < 0.4 * before and side[2] < 0.7 * before, (before, exact, side)


def test_phi_parities_decode_to_the_int8_codes_while_the_slow_weights_are_close() -> None:
    """The receiver's own phi is the side information: less than half an int8 step apart, the lowest bit of each
    code is enough to read the sender's int8 phi exactly; as far apart as two replicas trained alone, it mostly
    misreads it (the limit docs/algorithm-study.md measures)."""
    from noloco_node.simulate.wire_views import parity_view, through_wire

    g = torch.Generator().manual_seed(1)
    sent = torch.randn(4096, generator=g) * 0.05
    near = sent + torch.randn(4096, generator=g) * 1e-5
    assert torch.equal(parity_view(sent, near), through_wire([sent], "int8")[0])
    far = sent + torch.randn(4096, generator=g) * 0.05
    assert float((parity_view(sent, far) != through_wire([sent], "int8")[0]).float().mean()) > 0.5


def test_a_late_step_is_own_progress_now_and_the_pairs_half_of_the_last_phase() -> None:
    """The late methods: a replica steps on its own progress whole, plus beta/2 of the gap between the fast weights
    it and this step's partner held at the last outer step (as the wire delivers the partner's); nothing at the
    first step, which has no last fast weights, and nothing for a replica without a partner."""
    from noloco_node.simulate.wire_views import late_pair_steps

    g = torch.Generator().manual_seed(5)
    phis = [[torch.randn(64, 64, generator=g) * 0.05] for _ in range(3)]
    thetas = [[p[0] + torch.randn(64, 64, generator=g) * 1e-3] for p in phis]
    deltas = [[torch.randn(64, 64, generator=g) * 1e-4] for _ in phis]
    previous: list[list[torch.Tensor] | None] = [None, None, None]
    estimates: list[dict[int, torch.Tensor]] = [{}, {}, {}]
    how = {"method": "noloco-late", "seed": 1, "alpha": 0.5, "beta": 0.7, "gamma": 0.7}

    def expected(i: int, correction: torch.Tensor | float) -> torch.Tensor:
        return deltas[i][0] * 0.5 + (thetas[i][0] - phis[i][0]) * 0.7 + correction

    first = late_pair_steps([[0, 1], [2]], thetas, phis, deltas, previous, estimates, **how)  # type: ignore[arg-type]
    assert all(torch.allclose(first[i][1][0], expected(i, 0.0), atol=1e-7) for i in range(3))
    assert all(p is not None and torch.equal(p[0], t[0]) for p, t in zip(previous, thetas, strict=True))
    then = [t[0].clone() for t in thetas]
    second = late_pair_steps([[2, 0], [1]], thetas, phis, deltas, previous, estimates, **how)  # type: ignore[arg-type]
    seen_from_0 = then[0].to(torch.bfloat16).float()
    assert torch.allclose(second[2][1][0], expected(2, (seen_from_0 - then[2]) * 0.35), atol=1e-7)
    assert torch.allclose(second[1][1][0], expected(1, 0.0), atol=1e-7)
    assert torch.allclose(second[2][0][0], phis[2][0] + second[2][1][0], atol=1e-7)


def test_error_feedback_loses_nothing_over_outer_steps() -> None:
    """What was sent over several outer steps plus the residual left is all the progress there was (the
    simulator's error-feedback methods)."""
    generator = torch.Generator().manual_seed(2)
    feedback = ErrorFeedback([(4096,), (100,)])
    total_progress = [torch.zeros(4096), torch.zeros(100)]
    total_sent = [torch.zeros(4096), torch.zeros(100)]
    for _ in range(5):
        progress = [torch.randn(4096, generator=generator), torch.randn(100, generator=generator)]
        _, decoded, residual = feedback.compress(progress)
        feedback.commit(residual)
        for k in range(2):
            total_progress[k] += progress[k]
            total_sent[k] += decoded[k]
    for k in range(2):
        assert torch.allclose(total_sent[k] + feedback.residual[k], total_progress[k], atol=1e-5)
    before = [r.clone() for r in feedback.residual]
    feedback.compress([torch.ones(4096), torch.ones(100)])  # not committed: nothing changes
    assert all(torch.equal(a, b) for a, b in zip(before, feedback.residual, strict=True))
