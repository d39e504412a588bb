"""The outer updates of algorithm.py against hand-worked values, identities and torch's own optimizer."""

from __future__ import annotations

import math
import re

import pytest
import torch

from noloco_node import algorithm
from noloco_node.algorithm import (
    diloco_heavy_ball_step,
    diloco_nesterov_step,
    noloco_outer_step,
    outer_hyperparameter_warnings,
    replica_spread,
    warn_on_unstable_hyperparameters,
)


def t(*values: float) -> list[torch.Tensor]:
    return [torch.tensor([v]) for v in values]


def random_params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for shape in [(3, 4), (5,), (2, 2, 2)]]


# --------------------------------------------------------------------------------------------- hand-worked values


def test_pair_fast_path_matches_hand_worked_value() -> None:
    # theta 2, phi 1, delta 0.5; partner theta 4, phi 3. mean Delta = 1, mean phi = 2.
    # delta = 0.5*0.5 + 0.7*1 - 0.7*(1 - 2) = 1.65; phi = 1 + 1.65 = 2.65.
    new_phi, new_delta = noloco_outer_step(t(2.0), t(1.0), t(0.5), [t(4.0)], [t(3.0)], alpha=0.5, beta=0.7, gamma=0.7)
    assert new_delta[0].item() == pytest.approx(1.65)
    assert new_phi[0].item() == pytest.approx(2.65)


def test_pair_fast_path_needs_only_the_partners_theta() -> None:
    # Same numbers without the partner's phi: delta = 0.25 + 0.7*(mean theta 3 - phi 1) = 1.65.
    new_phi, new_delta = noloco_outer_step(t(2.0), t(1.0), t(0.5), [t(4.0)], [], alpha=0.5, beta=0.7, gamma=0.7)
    assert new_delta[0].item() == pytest.approx(1.65)
    assert new_phi[0].item() == pytest.approx(2.65)


def test_pair_general_form_matches_hand_worked_value() -> None:
    # gamma 0.3: delta = 0.25 + 0.7*1 - 0.3*(1 - 2) = 1.25; phi = 2.25.
    new_phi, new_delta = noloco_outer_step(t(2.0), t(1.0), t(0.5), [t(4.0)], [t(3.0)], alpha=0.5, beta=0.7, gamma=0.3)
    assert new_delta[0].item() == pytest.approx(1.25)
    assert new_phi[0].item() == pytest.approx(2.25)


@pytest.mark.parametrize("gamma", [0.7, 0.3])
def test_blended_momenta_hand_worked_value(gamma: float) -> None:
    # Mine: theta 2, phi 1, delta 0.5. Partner: theta 4, phi 3, delta -1. Mean theta 3, mean phi 2.
    # My new delta (as without momenta): 0.25 + 0.7*(3 - 2) - gamma*(1 - 2) = 0.95 + gamma; phi = 1.95 + gamma.
    # The partner's, as it computes it: -0.5 + 0.7*1 - gamma*(3 - 2) = 0.2 - gamma. Kept: the mean, 0.575.
    new_phi, new_delta = algorithm.noloco_pair_step(
        t(2.0), t(1.0), t(0.5), (t(4.0), t(3.0), t(-1.0)), alpha=0.5, beta=0.7, gamma=gamma, blend_momenta=True
    )
    assert new_phi[0].item() == pytest.approx(1.95 + gamma)
    assert new_delta[0].item() == pytest.approx(0.575)


def test_a_partner_without_standing_counts_as_half_a_replica_on_this_side() -> None:
    # Mine: theta 2, phi 1, delta 0.5; partner theta 4 (phi 3, delta -1), weight 0.5: mean theta (2 + 0.5*4) / 1.5.
    # delta = 0.25 + 0.7*(8/3 - 1) = 1.41667 (1.65 at full weight); the pull on phi is a third of the gap, not half.
    mine, partner = (t(2.0), t(1.0), t(0.5)), (t(4.0), t(3.0), t(-1.0))
    cfg = {"alpha": 0.5, "beta": 0.7, "gamma": 0.7}
    new_phi, new_delta = algorithm.noloco_pair_step(*mine, partner, **cfg, partner_weight=0.5)
    assert new_delta[0].item() == pytest.approx(0.25 + 0.7 * (8 / 3 - 1))
    assert new_phi[0].item() == pytest.approx(1.0 + 0.25 + 0.7 * (8 / 3 - 1))
    full_phi, _ = algorithm.noloco_pair_step(*mine, partner, **cfg)
    solo_phi, _ = algorithm.noloco_pair_step(*mine, None, **cfg)
    pull, full_pull = new_phi[0] - solo_phi[0], full_phi[0] - solo_phi[0]
    assert pull.item() == pytest.approx(0.7 * (4.0 - 2.0) / 3) and full_pull.item() == pytest.approx(0.7 * 1.0)
    # With blended momenta the partner's momentum counts half too: (mine + 0.5 * theirs) / 1.5, mine computed at
    # weight 0.5 (1.41667), theirs as the partner computes it at full weight (-0.5 + 0.7*(3 - 3) = -0.5).
    _, blended = algorithm.noloco_pair_step(*mine, partner, **cfg, blend_momenta=True, partner_weight=0.5)
    assert blended[0].item() == pytest.approx((0.25 + 0.7 * (8 / 3 - 1) + 0.5 * -0.5) / 1.5)


def test_both_sides_of_a_pair_keep_the_same_momentum_and_their_own_phi() -> None:
    mine = (random_params(1), random_params(2), random_params(3))
    theirs = (random_params(4), random_params(5), random_params(6))
    cfg = {"alpha": 0.5, "beta": 0.7, "gamma": 0.4, "blend_momenta": True}
    phi_a, delta_a = algorithm.noloco_pair_step(*mine, theirs, **cfg)
    _, delta_b = algorithm.noloco_pair_step(*theirs, mine, **cfg)
    for a, b in zip(delta_a, delta_b, strict=True):
        assert torch.equal(a, b)  # the same two states, the same sum in either order
    plain_phi, plain_delta = algorithm.noloco_pair_step(*mine, theirs, **{**cfg, "blend_momenta": False})
    for blended, plain in zip(phi_a, plain_phi, strict=True):
        assert torch.equal(blended, plain)  # phi moves by the replica's own new delta, as in plain NoLoCo
    assert any(not torch.equal(a, p) for a, p in zip(delta_a, plain_delta, strict=True))
    with pytest.raises(ValueError, match="partner's phi and delta"):
        algorithm.noloco_pair_step(*mine, (theirs[0], [], []), **cfg)


def test_replicas_that_trained_while_waiting_still_keep_the_same_momentum() -> None:
    """Each side took inner steps after it sent its theta (--train-while-waiting): its phi moves with its fresh
    theta, but the momentum both keep comes from the thetas they sent each other, the only ones both know."""
    sent_a, sent_b = random_params(1), random_params(4)
    fresh_a, fresh_b = random_params(7), random_params(8)
    a_rest, b_rest = (random_params(2), random_params(3)), (random_params(5), random_params(6))
    cfg = {"alpha": 0.5, "beta": 0.7, "gamma": 0.4, "blend_momenta": True}
    phi_a, delta_a = algorithm.noloco_pair_step(fresh_a, *a_rest, (sent_b, *b_rest), sent_theta=sent_a, **cfg)
    _, delta_b = algorithm.noloco_pair_step(fresh_b, *b_rest, (sent_a, *a_rest), sent_theta=sent_b, **cfg)
    for a, b in zip(delta_a, delta_b, strict=True):
        assert torch.equal(a, b)
    plain_phi, _ = algorithm.noloco_pair_step(fresh_a, *a_rest, (sent_b, *b_rest), **{**cfg, "blend_momenta": False})
    for blended, plain in zip(phi_a, plain_phi, strict=True):
        assert torch.equal(blended, plain)  # phi still moves by the replica's own delta from its fresh theta


def test_group_of_three_matches_hand_worked_value() -> None:
    # Deltas 1, 1, 4 -> mean 2; phis 1, 3, 2 -> mean 2. delta = 0.25 + 0.7*2 - 0.3*(1 - 2) = 1.95.
    new_phi, new_delta = noloco_outer_step(
        t(2.0), t(1.0), t(0.5), [t(4.0), t(6.0)], [t(3.0), t(2.0)], alpha=0.5, beta=0.7, gamma=0.3
    )
    assert new_delta[0].item() == pytest.approx(1.95)
    assert new_phi[0].item() == pytest.approx(2.95)


def test_solo_step_is_heavy_ball_on_own_fast_minus_slow() -> None:
    # delta = 0.5*0.5 + 0.7*(2 - 1) = 0.95 whatever gamma is (the pull towards the group mean is zero).
    for gamma in (0.7, 0.3, 1.2):
        new_phi, new_delta = noloco_outer_step(t(2.0), t(1.0), t(0.5), [], [], alpha=0.5, beta=0.7, gamma=gamma)
        assert new_delta[0].item() == pytest.approx(0.95)
        assert new_phi[0].item() == pytest.approx(1.95)


def test_sign_of_beta_term_moves_slow_weights_towards_fast_weights() -> None:
    # The paper's printed equation has -beta; with the corrected sign phi moves towards theta.
    new_phi, _ = noloco_outer_step(t(5.0), t(1.0), t(0.0), [], [], alpha=0.5, beta=0.7, gamma=0.7)
    assert 1.0 < new_phi[0].item() < 5.0


# --------------------------------------------------------------------------------------------- identities


@pytest.mark.parametrize("num_peers", [1, 2, 5])
def test_fast_path_equals_general_form_when_gamma_equals_beta(num_peers: int) -> None:
    theta, phi, delta = random_params(1), random_params(2), random_params(3)
    peer_thetas = [random_params(10 + p) for p in range(num_peers)]
    peer_phis = [random_params(20 + p) for p in range(num_peers)]
    fast = noloco_outer_step(theta, phi, delta, peer_thetas, [], alpha=0.5, beta=0.7, gamma=0.7)
    # The general form, written out from docs/architecture.md with the peers' slow weights.
    for k in range(len(theta)):
        mean_theta = (theta[k] + sum(p[k] for p in peer_thetas)) / (1 + num_peers)
        mean_phi = (phi[k] + sum(p[k] for p in peer_phis)) / (1 + num_peers)
        general_delta = 0.5 * delta[k] + 0.7 * (mean_theta - mean_phi) - 0.7 * (phi[k] - mean_phi)
        torch.testing.assert_close(fast[1][k], general_delta, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fast[0][k], phi[k] + general_delta, rtol=1e-6, atol=1e-6)
    # And the implementation's own general branch (peer_phis given) agrees with its fast path.
    with_phis = noloco_outer_step(theta, phi, delta, peer_thetas, peer_phis, alpha=0.5, beta=0.7, gamma=0.7)
    for a, b in zip(fast[0] + fast[1], with_phis[0] + with_phis[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_general_branch_with_gamma_near_beta_converges_to_fast_path() -> None:
    theta, phi, delta = random_params(1), random_params(2), random_params(3)
    peer_theta, peer_phi = random_params(4), random_params(5)
    fast = noloco_outer_step(theta, phi, delta, [peer_theta], [], alpha=0.5, beta=0.7, gamma=0.7)
    near = noloco_outer_step(theta, phi, delta, [peer_theta], [peer_phi], alpha=0.5, beta=0.7, gamma=0.7 + 1e-9)
    for a, b in zip(fast[0], near[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gamma", [0.3, 0.7, 1.1])
def test_pair_mean_moves_exactly_like_two_replica_diloco_heavy_ball(gamma: float) -> None:
    theta1, phi1, delta1 = random_params(1), random_params(2), random_params(3)
    theta2, phi2, delta2 = random_params(4), random_params(5), random_params(6)
    phi1_new, delta1_new = noloco_outer_step(theta1, phi1, delta1, [theta2], [phi2], alpha=0.5, beta=0.7, gamma=gamma)
    phi2_new, delta2_new = noloco_outer_step(theta2, phi2, delta2, [theta1], [phi1], alpha=0.5, beta=0.7, gamma=gamma)
    mean = lambda a, b: [(x + y) / 2 for x, y in zip(a, b, strict=True)]  # noqa: E731
    diloco_phi, diloco_delta = diloco_heavy_ball_step(
        mean(phi1, phi2), mean(delta1, delta2), [theta1, theta2], alpha=0.5, beta=0.7
    )
    for got, want in zip(mean(phi1_new, phi2_new), diloco_phi, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(mean(delta1_new, delta2_new), diloco_delta, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if gamma != 0.7:  # the gamma term does act on each replica: the two do not move identically
        assert not torch.allclose(phi1_new[0] - phi1[0], phi2_new[0] - phi2[0])


def test_inputs_are_not_modified() -> None:
    theta, phi, delta = random_params(1), random_params(2), random_params(3)
    peer_thetas, peer_phis = [random_params(4)], [random_params(5)]
    before = [x.clone() for x in [*theta, *phi, *delta, *peer_thetas[0], *peer_phis[0]]]
    for gamma in (0.7, 0.3):
        new_phi, new_delta = noloco_outer_step(
            theta, phi, delta, peer_thetas, peer_phis, alpha=0.5, beta=0.7, gamma=gamma
        )
        for out in new_phi + new_delta:
            assert all(out.data_ptr() != x.data_ptr() for x in [*theta, *phi, *delta])
    diloco_heavy_ball_step(phi, delta, [theta, peer_thetas[0]])
    diloco_nesterov_step(phi, delta, [theta, peer_thetas[0]])
    after = [*theta, *phi, *delta, *peer_thetas[0], *peer_phis[0]]
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


def test_bf16_fast_weights_give_fp32_outer_state() -> None:
    theta = random_params(1, torch.bfloat16)
    phi, delta = random_params(2), random_params(3)
    new_phi, new_delta = noloco_outer_step(
        theta, phi, delta, [random_params(4, torch.bfloat16)], [], alpha=0.5, beta=0.7, gamma=0.7
    )
    assert all(x.dtype == torch.float32 for x in new_phi + new_delta)


def test_mismatched_inputs_are_refused_with_the_reason() -> None:
    theta, phi, delta = random_params(1), random_params(2), random_params(3)
    with pytest.raises(ValueError, match=r"peer_thetas\[0\]\[1\] has shape"):
        bad = random_params(4)
        bad[1] = torch.zeros(6)
        noloco_outer_step(theta, phi, delta, [bad], [], alpha=0.5, beta=0.7, gamma=0.7)
    with pytest.raises(ValueError, match="needs the peers' slow weights"):
        noloco_outer_step(theta, phi, delta, [random_params(4)], [], alpha=0.5, beta=0.7, gamma=0.3)
    with pytest.raises(ValueError, match="delta has 2 tensors"):
        noloco_outer_step(theta, phi, delta[:2], [], [], alpha=0.5, beta=0.7, gamma=0.7)


# --------------------------------------------------------------------------------------------- DiLoCo baselines


def test_diloco_heavy_ball_hand_worked_value() -> None:
    # phi 1, delta 0.5, replicas' theta 2 and 4: mean Delta = 2; delta = 0.3*0.5 + 0.7*2 = 1.55; phi = 2.55.
    new_phi, new_delta = diloco_heavy_ball_step(t(1.0), t(0.5), [t(2.0), t(4.0)])
    assert new_delta[0].item() == pytest.approx(1.55)
    assert new_phi[0].item() == pytest.approx(2.55)


def test_diloco_nesterov_matches_torch_sgd_over_several_steps() -> None:
    phi = random_params(1)
    buffer = [torch.zeros_like(p) for p in phi]
    reference = [torch.nn.Parameter(p.clone()) for p in phi]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for round_ in range(4):
        thetas = [random_params(100 * round_ + r) for r in range(3)]
        phi, buffer = diloco_nesterov_step(phi, buffer, thetas, lr=0.7, momentum=0.9)
        for k, param in enumerate(reference):
            param.grad = param.detach() - sum(th[k] for th in thetas) / 3
        sgd.step()
        for mine, theirs in zip(phi, reference, strict=True):
            torch.testing.assert_close(mine, theirs.detach(), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------- stability checks


def test_paper_defaults_pass_the_stability_conditions() -> None:
    assert outer_hyperparameter_warnings(algorithm.NOLOCO_ALPHA, algorithm.NOLOCO_BETA, algorithm.NOLOCO_GAMMA) == []


@pytest.mark.parametrize(
    ("alpha", "beta", "gamma", "reason"),
    [
        (0.8, 0.7, 0.9, "beta > alpha"),
        (0.5, 0.7, 0.4, "outside (alpha, sqrt(2 + alpha^2))"),
        (0.5, 0.7, 1.6, "outside (alpha, sqrt(2 + alpha^2))"),
    ],
)
def test_unstable_hyperparameters_warn_with_the_reason(alpha: float, beta: float, gamma: float, reason: str) -> None:
    with pytest.warns(RuntimeWarning, match=re.escape(reason)):
        reasons = warn_on_unstable_hyperparameters(alpha, beta, gamma)
    assert len(reasons) == 1


def test_spread_bound_applies_to_pairs_only() -> None:
    assert outer_hyperparameter_warnings(0.5, 0.7, 1.6, group_size=4) == []


@pytest.mark.parametrize(
    ("alpha", "beta", "gamma"),
    [(-0.1, 0.7, 0.7), (1.0, 0.7, 0.7), (0.5, 0.0, 0.7), (0.5, 0.7, -1.0), (0.5, math.nan, 0.7)],
)
def test_unusable_hyperparameters_are_errors(alpha: float, beta: float, gamma: float) -> None:
    with pytest.raises(ValueError):
        outer_hyperparameter_warnings(alpha, beta, gamma)


# --------------------------------------------------------------------------------------------- spread


def test_replica_spread() -> None:
    assert replica_spread([t(0.0, 1.0), t(2.0, 3.0)]) == pytest.approx(1.0)  # per-element std 1
    assert replica_spread([t(1.0), t(1.0), t(1.0)]) == 0.0
    assert replica_spread([t(5.0)]) == 0.0


def test_projected_fast_weights_add_the_last_phase_to_the_new_slow_weights() -> None:
    (got,) = algorithm.projected_fast_weights(t(2.0), t(5.0), t(1.0))  # 2 + (5 - 1)
    assert got.item() == pytest.approx(6.0) and got.dtype == torch.float32


def test_mean_weights_is_the_elementwise_mean_in_fp32() -> None:
    from noloco_node.algorithm import mean_weights

    a = [torch.tensor([1.0, 2.0]), torch.tensor([[4.0]])]
    b = [torch.tensor([3.0, 6.0]), torch.tensor([[0.0]])]
    c = [torch.tensor([2.0, 1.0], dtype=torch.bfloat16), torch.tensor([[2.0]])]
    mean = mean_weights([a, b, c])
    assert torch.equal(mean[0], torch.tensor([2.0, 3.0])) and torch.equal(mean[1], torch.tensor([[2.0]]))
    assert mean[0].dtype == torch.float32 and mean[0].data_ptr() != a[0].data_ptr()
    with pytest.raises(ValueError):
        mean_weights([a, [torch.zeros(3), torch.zeros(1, 1)]])
