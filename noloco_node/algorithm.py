"""The outer updates of NoLoCo and its baselines, as pure tensor functions (no I/O, no state, no mutation).

This module is the only place the update maths lives; the simulator, the node and the tests all call it.

NoLoCo (arXiv 2506.10911, eq. 3-5, with the sign of the beta term as in the paper's code and appendix; the printed
equation has it wrong). For replica i and its group G = {i} + the peers it exchanged with this round::

    Delta_i = theta_i - phi_i                                       # fast minus slow weights
    delta_i = alpha * delta_i + beta * mean_G(Delta) - gamma * (phi_i - mean_G(phi))
    phi_i   = phi_i + delta_i                                       # heavy-ball, not torch's Nesterov SGD
    theta_i = phi_i                                                 # the next inner phase starts here

When gamma == beta the update collapses to ``delta_i = alpha * delta_i + beta * (mean_G(theta) - phi_i)``: a
replica needs only its partners' fast weights. With G = {i} alone it is a solo outer step.

DiLoCo (Douillard et al. 2023) uses the mean over *all* replicas and identical slow weights everywhere; two outer
optimizers are provided: heavy-ball (the NoLoCo paper's baseline) and torch ``SGD(nesterov=True)`` on the
pseudo-gradient ``phi - mean(theta)`` (the original DiLoCo / OpenDiLoCo setting).

All outer state (phi, delta) is fp32, whatever dtype the fast weights train in.

GRPO, the policy update of RL post-training with shared rollouts (`noloco-node rl`; SAPO, arXiv 2509.08721,
eq. 2; GRPO from DeepSeekMath, arXiv 2402.03300, eq. 3), without the KL term (SAPO's setting). For a group of G
completions o_1..o_G of one question with rewards r_1..r_G, every token of o_i gets the group-normalised advantage
``A_i = (r_i - mean(r)) / (std(r) + eps)``, and the loss is the clipped surrogate averaged over each completion's
tokens, then over completions::

    L = - mean_i (1/|o_i|) sum_t min(rho_it * A_i, clip(rho_it, 1 - eps_clip, 1 + eps_clip) * A_i)

rho is the ratio of the policy to the policy when the update began (its log-probabilities computed once, detached):
with one gradient step per round rho = 1 and the update is the plain group-normalised policy gradient. External
rollouts are treated as on-policy, as the paper does (docs/rl.md, "Off-policy"). A group whose completions all
scored the same has advantage 0 everywhere and teaches nothing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

TensorList = Sequence[torch.Tensor]

# Defaults from the paper's code (NoLoCo) and the DiLoCo papers' settings (baselines; docs/architecture.md).
NOLOCO_ALPHA = 0.5
NOLOCO_BETA = 0.7
NOLOCO_GAMMA = 0.7
DILOCO_HB_ALPHA = 0.3
DILOCO_HB_BETA = 0.7
DILOCO_NESTEROV_LR = 0.7
DILOCO_NESTEROV_MOMENTUM = 0.9


def _check_same_shapes(reference: TensorList, other: TensorList, what: str) -> None:
    if len(other) != len(reference):
        raise ValueError(f"{what} has {len(other)} tensors, expected {len(reference)}")
    for k, (ref, got) in enumerate(zip(reference, other, strict=True)):
        if got.shape != ref.shape:
            raise ValueError(f"{what}[{k}] has shape {tuple(got.shape)}, expected {tuple(ref.shape)}")


def _beside(tensor: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``tensor`` in fp32 on the device of ``where``: an outer step computes where the replica's own outer state
    lives (a GPU's memory, or the host), and what came from elsewhere (a partner's payload, on the host) is moved
    there one tensor at a time."""
    return tensor.to(device=where.device, dtype=torch.float32)


def _group_mean(own: torch.Tensor, others: Sequence[torch.Tensor], weight: float = 1.0) -> torch.Tensor:
    """fp32 mean of one tensor over the group (own first, each other counted ``weight`` times), into a fresh
    buffer on the device of ``own``."""
    total = own.to(torch.float32, copy=True)
    for other in others:
        total.add_(_beside(other, total), alpha=weight)
    return total.div_(1 + weight * len(others))


@torch.no_grad()
def noloco_outer_step(
    theta: TensorList,
    phi: TensorList,
    delta: TensorList,
    peer_thetas: Sequence[TensorList],
    peer_phis: Sequence[TensorList],
    *,
    alpha: float,
    beta: float,
    gamma: float,
    peer_weight: float = 1.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One NoLoCo outer step of one replica; returns ``(new_phi, new_delta)`` as fresh fp32 tensors on phi's device.

    Args:
        theta: this replica's fast weights after its inner phase, one tensor per parameter (any float dtype).
        phi: this replica's slow weights (the start of the inner phase).
        delta: this replica's outer momentum.
        peer_thetas: for each peer in the group, its fast weights (same order and shapes as ``theta``); may be empty.
        peer_phis: for each peer, its slow weights. May be empty when ``gamma == beta`` (the fast path needs only the
            peers' fast weights); otherwise one entry per peer.
        alpha, beta, gamma: momentum decay, step size on the group's mean fast-minus-slow, and pull towards the
            group's mean slow weights.
        peer_weight: how many replicas each peer counts as in the group's means (1: NoLoCo's plain mean; a node
            gives a partner without standing less: pairing/standing.py STRANGER_WEIGHT).

    The caller sets ``theta = new_phi`` to start the next inner phase. Inputs are never modified.
    """
    _check_same_shapes(theta, phi, "phi")
    _check_same_shapes(theta, delta, "delta")
    for p, peer in enumerate(peer_thetas):
        _check_same_shapes(theta, peer, f"peer_thetas[{p}]")
    fast_path = gamma == beta
    if not fast_path or peer_phis:
        if len(peer_phis) != len(peer_thetas):
            raise ValueError(
                f"gamma ({gamma}) != beta ({beta}) needs the peers' slow weights: got {len(peer_phis)} peer_phis "
                f"for {len(peer_thetas)} peer_thetas"
            )
        for p, peer in enumerate(peer_phis):
            _check_same_shapes(theta, peer, f"peer_phis[{p}]")

    new_phi: list[torch.Tensor] = []
    new_delta: list[torch.Tensor] = []
    for k in range(len(theta)):
        phi_k = phi[k].to(torch.float32)  # computed where phi lives; every other operand is moved there
        mean_theta = _group_mean(_beside(theta[k], phi_k), [peer[k] for peer in peer_thetas], peer_weight)
        if fast_path:
            # beta*(mean(theta) - mean(phi)) - beta*(phi - mean(phi)) == beta*(mean(theta) - phi)
            step = mean_theta.sub_(phi_k).mul_(beta)
        else:
            mean_phi = _group_mean(phi_k, [peer[k] for peer in peer_phis], peer_weight)
            mean_fast_minus_slow = mean_theta.sub_(mean_phi)
            pull = phi_k - mean_phi
            step = mean_fast_minus_slow.mul_(beta).sub_(pull, alpha=gamma)
        delta_k = step.add_(_beside(delta[k], phi_k), alpha=alpha)
        new_delta.append(delta_k)
        new_phi.append(phi_k + delta_k)
    return new_phi, new_delta


@torch.no_grad()
def noloco_pair_step(
    theta: TensorList,
    phi: TensorList,
    delta: TensorList,
    partner: tuple[TensorList, TensorList, TensorList] | None,
    *,
    alpha: float,
    beta: float,
    gamma: float,
    blend_momenta: bool = False,
    sent_theta: TensorList | None = None,
    partner_weight: float = 1.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One replica's outer step with at most one partner, as a node takes it; returns ``(new_phi, new_delta)``.

    ``partner``: its (theta, phi, delta) as received; phi may be empty on the fast path (gamma == beta) and delta
    is read only with ``blend_momenta``. None: a solo step. ``sent_theta``: the fast weights this replica sent the
    partner, when ``theta`` has moved on since (inner steps taken while waiting); default ``theta``.

    phi moves by this replica's own new delta, from its freshest ``theta`` (eq. 3-5). With ``blend_momenta``
    ("blend weights and momenta") the delta it keeps is the mean of both sides' new deltas computed from what
    the two sides *sent* each other (eq. 4 from each side), the only thetas both know: the partner computes the
    same two from the same tensors, so both keep the same momentum, up to the wire's rounding, however many steps
    either took while waiting. ``partner_weight`` < 1 (a partner without standing) counts the partner as that
    much of a replica in the group's means, on this side only: the two sides then keep different momenta.
    """
    if partner is None:
        return noloco_outer_step(theta, phi, delta, [], [], alpha=alpha, beta=beta, gamma=gamma)
    partner_theta, partner_phi, partner_delta = partner
    if blend_momenta and not (partner_phi and partner_delta):
        raise ValueError("blending momenta needs the partner's phi and delta")
    peer_phis = [partner_phi] if partner_phi else []
    weights = {"alpha": alpha, "beta": beta, "gamma": gamma, "peer_weight": partner_weight}
    new_phi, new_delta = noloco_outer_step(theta, phi, delta, [partner_theta], peer_phis, **weights)
    if not blend_momenta:
        return new_phi, new_delta
    sent = theta if sent_theta is None else sent_theta
    if sent is not theta:
        _, new_delta = noloco_outer_step(sent, phi, delta, [partner_theta], peer_phis, **weights)
    _, theirs = noloco_outer_step(
        partner_theta, partner_phi, partner_delta, [sent], [phi], alpha=alpha, beta=beta, gamma=gamma
    )
    return new_phi, [_group_mean(mine, [other], partner_weight) for mine, other in zip(new_delta, theirs, strict=True)]


@torch.no_grad()
def diloco_heavy_ball_step(
    phi: TensorList,
    delta: TensorList,
    replica_thetas: Sequence[TensorList],
    *,
    alpha: float = DILOCO_HB_ALPHA,
    beta: float = DILOCO_HB_BETA,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """DiLoCo with a heavy-ball outer optimizer: ``delta = alpha*delta + beta*mean_all(theta - phi); phi += delta``.

    Every replica shares ``phi`` and ``delta``, so this is NoLoCo's update with the group being all replicas (the
    gamma term vanishes because every phi equals the mean); it is computed by the same function.
    """
    if not replica_thetas:
        raise ValueError("DiLoCo needs at least one replica's fast weights")
    first, *rest = replica_thetas
    return noloco_outer_step(first, phi, delta, rest, [], alpha=alpha, beta=beta, gamma=beta)


@torch.no_grad()
def diloco_nesterov_step(
    phi: TensorList,
    momentum_buffer: TensorList,
    replica_thetas: Sequence[TensorList],
    *,
    lr: float = DILOCO_NESTEROV_LR,
    momentum: float = DILOCO_NESTEROV_MOMENTUM,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """DiLoCo's original outer step: torch ``SGD(lr, momentum, nesterov=True)`` on ``g = phi - mean_all(theta)``.

    Torch semantics (dampening 0): ``buf = momentum*buf + g`` (``buf = g`` on the first step, which equals this
    with a zero buffer), ``phi -= lr * (g + momentum*buf)``. Returns ``(new_phi, new_buffer)``.
    """
    if not replica_thetas:
        raise ValueError("DiLoCo needs at least one replica's fast weights")
    first, *rest = replica_thetas
    for p, replica in enumerate(replica_thetas):
        _check_same_shapes(phi, replica, f"replica_thetas[{p}]")
    _check_same_shapes(phi, momentum_buffer, "momentum_buffer")
    new_phi: list[torch.Tensor] = []
    new_buffer: list[torch.Tensor] = []
    for k in range(len(phi)):
        phi_k = phi[k].to(torch.float32)
        pseudo_grad = phi_k - _group_mean(first[k], [replica[k] for replica in rest])
        buf = momentum_buffer[k].to(torch.float32).mul(momentum).add_(pseudo_grad)
        direction = pseudo_grad.add_(buf, alpha=momentum)
        new_buffer.append(buf)
        new_phi.append(phi_k.sub(direction, alpha=lr))
    return new_phi, new_buffer


def outer_hyperparameter_warnings(alpha: float, beta: float, gamma: float, *, group_size: int = 2) -> list[str]:
    """Reasons the NoLoCo hyper-parameters fall outside the paper's stability conditions (empty when they do not).

    From the paper's analysis of a quadratic model: the replicas' mean converges when ``beta > alpha``; for pairs
    (group size 2) the spread between replicas stays bounded when ``alpha < gamma < sqrt(2 + alpha**2)``.
    Hard errors (a value no run could use) raise ValueError instead.
    """
    for name, value in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha (outer momentum) must be in [0, 1), got {alpha}")
    if beta <= 0.0:
        raise ValueError(f"beta (outer step size) must be > 0, got {beta}")
    if gamma < 0.0:
        raise ValueError(f"gamma (pull towards the group's slow weights) must be >= 0, got {gamma}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")

    reasons: list[str] = []
    if not beta > alpha:
        reasons.append(
            f"beta ({beta}) <= alpha ({alpha}): the paper's analysis needs beta > alpha for the mean "
            "of the replicas to converge"
        )
    if group_size == 2:
        upper = math.sqrt(2.0 + alpha**2)
        if not alpha < gamma < upper:
            reasons.append(
                f"gamma ({gamma}) is outside (alpha, sqrt(2 + alpha^2)) = ({alpha}, {upper:.4f}): the "
                "paper's analysis bounds the spread between paired replicas only inside that interval"
            )
    return reasons


def warn_on_unstable_hyperparameters(alpha: float, beta: float, gamma: float, *, group_size: int = 2) -> list[str]:
    """Emit a RuntimeWarning for each stability condition the hyper-parameters break; returns the reasons."""
    reasons = outer_hyperparameter_warnings(alpha, beta, gamma, group_size=group_size)
    for reason in reasons:
        warnings.warn(f"NoLoCo hyper-parameters may be unstable: {reason}", RuntimeWarning, stacklevel=2)
    return reasons


@torch.no_grad()
def mean_weights(replica_weights: Sequence[TensorList]) -> list[torch.Tensor]:
    """The equal-weight fp32 mean of several replicas' tensors, parameter by parameter (fresh tensors).

    Used for a consensus model of live peers (consensus.py).
    """
    first = replica_weights[0]
    for p, replica in enumerate(replica_weights[1:], start=1):
        _check_same_shapes(first, replica, f"replica_weights[{p}]")
    return [_group_mean(first[k], [r[k] for r in replica_weights[1:]]) for k in range(len(first))]


@torch.no_grad()
def replica_spread(replica_weights: Sequence[TensorList]) -> float:
    """Standard deviation of the weights across replicas, as the paper plots it.

    For each parameter element the (population) standard deviation across replicas; the figure is the root mean
    square of that over all elements. 0.0 when the replicas are identical or there is only one.
    """
    if len(replica_weights) < 2:
        return 0.0
    first = replica_weights[0]
    for p, replica in enumerate(replica_weights[1:], start=1):
        _check_same_shapes(first, replica, f"replica_weights[{p}]")
    squared_sum = 0.0
    count = 0
    for k in range(len(first)):
        stacked = torch.stack([replica[k].to(torch.float32) for replica in replica_weights])
        squared_sum += stacked.var(dim=0, unbiased=False).sum().item()
        count += first[k].numel()
    return math.sqrt(squared_sum / max(count, 1))


@torch.no_grad()
def projected_fast_weights(new_phi: TensorList, theta: TensorList, old_phi: TensorList) -> list[torch.Tensor]:
    """What a replica offers in overlap mode: its fast weights one phase ahead, ``phi_new + (theta - phi_old)``.

    A partner blends with this at its next outer step, one inner phase after it was made; assuming the next
    phase moves about as far as the last one (Delta), it estimates the fast weights the replica will then hold.
    """
    _check_same_shapes(new_phi, theta, "theta")
    _check_same_shapes(new_phi, old_phi, "old_phi")
    return [
        p.to(torch.float32) + (_beside(t, p) - _beside(o, p)) for p, t, o in zip(new_phi, theta, old_phi, strict=True)
    ]


@torch.no_grad()
def phase_progress(theta: TensorList, phi: TensorList) -> list[torch.Tensor]:
    """A phase's progress Delta = theta - phi in fp32, on theta's device: what stream mode sends at the outer step.
    (DiLoCo's pseudo-gradient is its negative, phi - mean(theta): this project says progress for theta - phi
    throughout.)"""
    _check_same_shapes(theta, phi, "phi")
    return [t.to(torch.float32) - _beside(p, t) for t, p in zip(theta, phi, strict=True)]


@torch.no_grad()
def fast_weights_from(
    phi: TensorList, progress: TensorList, out: Sequence[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """A partner's fast weights theta = phi + Delta, rebuilt in fp32 from its slow weights and its progress as the
    wire delivered them (each may have been rounded: bf16 phi, quantized Delta), into ``out`` when given."""
    _check_same_shapes(phi, progress, "progress")
    targets = out if out is not None else [torch.empty(p.shape, dtype=torch.float32) for p in phi]
    return [t.copy_(p).add_(_beside(d, t)) for t, p, d in zip(targets, phi, progress, strict=True)]


# The share c of its own left-out progress Delta_i - D_i that a sparse run blends as its estimate of the partner's
# (compressed_partner_weights): the two correlate (the replicas train one model on one distribution), and 0.5
# measured best of 0, 0.25, 0.5, 0.75 and 1 (docs/algorithm-study.md, "Sparse progress").
OWN_LEFT_OUT_WEIGHT = 0.5


@torch.no_grad()
def compressed_partner_weights(
    partner_phi: TensorList,
    partner_sent: TensorList,
    own_left_out: TensorList,
    own_left_out_weight: float = 1.0,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The partner's fast weights as a compressed exchange lets this node blend with them (the ``sparse`` wire
    dtype): phi_j + D_j + (Delta_i - D_i), fp32.

    D_j is the partner's compressed progress and ``own_left_out`` = Delta_i - D_i what this node's own compressed
    progress left out. Each side blends its own progress whole, and adds what its compressed view of the pair lacks,
    so the pair's sum moves as in uncompressed NoLoCo (eq. 3-5): i blends theta_i with
    phi_j + D_j + Delta_i - D_i, j with phi_i + D_i + Delta_j - D_j, and the two means add up to theta_i + theta_j,
    exactly when each side's phi arrives as the other holds it; a phi sent rounded (int8) adds its rounding to the
    sum, once per phi it sends.
    Only how fast the two approach each other depends on the compression: compressed gossip with error feedback
    (CHOCO-gossip, arXiv 1902.00340). Blending the partner's D_j alone would weigh this node's own progress
    against a fraction of the partner's and halve the outer step; blending both compressed progresses would throw
    away most of a phase's own progress every outer step.

    ``own_left_out_weight`` c < 1 takes c * (Delta_i - D_i) for the partner's left-out part instead: its
    least-squares estimate when the two left-out parts correlate at c, which trades the pair's sum (only
    (1 + c) / 2 of what the codes leave out moves the pair) for less of a single replica's progress in the step
    (the simulator's ``noloco-sparse-side``, c = 0.5: docs/algorithm-study.md, "Sparse progress").

    Into ``out`` when given (fp32 tensors of the same shapes, which may be ``partner_sent``'s own: the node computes
    it in the received progress's buffers)."""
    _check_same_shapes(partner_phi, partner_sent, "partner progress")
    _check_same_shapes(partner_phi, own_left_out, "own left-out progress")
    targets = out if out is not None else [torch.empty(p.shape, dtype=torch.float32) for p in partner_phi]
    return [
        t.copy_(d).add_(_beside(p, t)).add_(_beside(c, t), alpha=own_left_out_weight)
        for t, p, d, c in zip(targets, partner_phi, partner_sent, own_left_out, strict=True)
    ]


# ------------------------------------------------------------------------------------------ GRPO (rl/)

ADVANTAGE_EPSILON = 1e-4


def group_advantages(groups: Sequence[Sequence[float]]) -> torch.Tensor:
    """Each group's rewards -> one advantage per completion, normalised within its group (unbiased std, as GRPO),
    concatenated in order. Groups may differ in size: a peer may sample another G."""
    advantages = []
    for rewards in groups:
        if len(rewards) < 2:
            raise ValueError(f"a group needs at least 2 completions to normalise within, not {len(rewards)}")
        values = torch.tensor(rewards, dtype=torch.float32)
        advantages.append((values - values.mean()) / (values.std() + ADVANTAGE_EPSILON))
    return torch.cat(advantages) if advantages else torch.zeros(0)


def clipped_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float = 0.2,
) -> torch.Tensor:
    """The GRPO loss over completions: ``logprobs``, ``old_logprobs`` and ``mask`` are (completions, tokens),
    ``advantages`` is (completions,). Tokens where ``mask`` is 0 (padding) count for nothing."""
    ratio = torch.exp(logprobs - old_logprobs)
    advantage = advantages.unsqueeze(1)
    surrogate = torch.minimum(ratio * advantage, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * advantage)
    lengths = mask.sum(dim=1).clamp(min=1.0)
    per_completion = (surrogate * mask).sum(dim=1) / lengths
    return -per_completion.mean()
