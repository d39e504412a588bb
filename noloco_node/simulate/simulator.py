"""N replicas in one process: NoLoCo against its baselines on the same seeds, data and compute budget.

Methods (outer updates from algorithm.py, inner loop from training/loop.py):

- ``noloco``: every outer step the replicas are paired at random (pairs re-drawn each time); each replica blends
  with its partner with ``algorithm.noloco_outer_step`` (arXiv 2506.10911, eq. 3-5). With an odd count one
  replica is left without a partner and takes a solo outer step, as a swarm node does when nobody answers. This
  is the maths of the node's ``sync`` pairing mode.
- ``noloco-stale``: the maths of the ``overlap`` mode: at its outer step a replica blends its fresh state with the
  snapshot its partner published one outer phase earlier (the partner's phi then, and its fast weights projected
  one phase ahead, ``algorithm.projected_fast_weights``); the first outer step has no snapshots and is solo.
- ``noloco-momentum``: ``noloco``, then the pair also averages its new outer momenta (delta): "blend weights and
  momenta", the node's ``--blend-momenta`` (both through ``algorithm.noloco_pair_step``).
- ``noloco-bf16``, ``noloco-int8``, ``noloco-int4``: ``noloco`` with the partner's weights as the node's ``sync``
  mode sends them in that wire dtype (``noloco`` itself blends exact fp32 weights).
- ``noloco-stream``, ``noloco-stream-int8``, ``noloco-stream-int4``: the maths of the ``stream`` mode: the partner's
  phi arrives in bf16 during the phase and its Delta = theta - phi at the outer step (bf16, int8 or int4); the
  blend is NoLoCo's, up to that rounding.
- ``diloco``: DiLoCo with the heavy-ball outer optimizer on the mean over all replicas (an all-reduce), at its
  own H (``--diloco-inner-steps``; twice NoLoCo's by default, the paper's terms).
- ``diloco-nesterov``: DiLoCo with torch's Nesterov SGD outer optimizer (the original DiLoCo setting).
- ``ddp``: one set of weights, gradients averaged over one batch of every replica's shard each step.
- ``solo``: each replica trains on its own shard with no communication at all (the floor to beat).

Each replica sees only its own shard, every method runs the same number of inner steps on the same batches, and
every method starts from the same initial weights. ``compare`` runs them and reports (results.py): a table of
final validation loss and perplexity, the paper's relative metric ``(ppl_diloco - ppl_noloco) / ppl_ddp`` at the
end and over training (its Fig. 3A), the weight spread across replicas and its Pearson correlation with the inner
learning rate (its Fig. 3B), the metrics as JSON and the curves as a PNG.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from noloco_node import algorithm
from noloco_node.config.models import WIRE_METHODS, SimulateConfig
from noloco_node.data.corpus import Corpus, ReplicaShard, validation_batches
from noloco_node.model.run_model import load_run_corpus, model_source
from noloco_node.simulate.results import (
    DILOCO_METHODS,
    Comparison,
    MethodResult,
    model_label,
    relative_metrics,
    write_outputs,
)
from noloco_node.simulate.wire_views import (
    LATE_WIRE,
    NO_FEEDBACK,
    OWN_LEFT_OUT_WEIGHT,
    PARITY_PHI,
    PHI_EVERY,
    SIDE_PHI,
    SIGN_RESIDUAL,
    ErrorFeedback,
    bytes_per_parameter,
    late_pair_steps,
    partner_view,
    sparse_pair_steps,
)
from noloco_node.training.loop import InnerLoop
from noloco_node.training.replica import Replica, resolve_device

ProgressFn = Callable[[str], None]


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def random_groups(num_replicas: int, rng: np.random.Generator) -> list[list[int]]:
    """A fresh random pairing of replicas; with an odd count, the one left over forms a group of its own."""
    order = [int(i) for i in rng.permutation(num_replicas)]
    groups = [order[i : i + 2] for i in range(0, num_replicas - 1, 2)]
    if num_replicas % 2:
        groups.append([order[-1]])
    return groups


def _noloco_round(
    replicas: list[Replica],
    rng: np.random.Generator,
    cfg: SimulateConfig,
    *,
    method: str = "noloco",
    blend_momenta: bool = False,
) -> None:
    """One NoLoCo outer step of every replica, each blending with its partner's pre-step state as the method's
    wire delivers it (its own state exact)."""
    outer = cfg.outer
    results = {}
    groups = random_groups(len(replicas), rng)
    seen = {
        i: partner_view(method, list(replicas[i].fast_weights()), list(replicas[i].phi))
        for group in groups
        if len(group) > 1
        for i in group
    }
    for group in groups:
        for i in group:
            partner = next(((*seen[j], replicas[j].delta) for j in group if j != i), None)
            results[i] = algorithm.noloco_pair_step(
                replicas[i].fast_weights(),
                replicas[i].phi,
                replicas[i].delta,
                partner,
                alpha=outer.alpha,
                beta=outer.beta,
                gamma=outer.effective_gamma,
                blend_momenta=blend_momenta,
            )
    # Apply only once every replica's update is computed from the state before the round.
    for i, (new_phi, new_delta) in results.items():
        replicas[i].apply_outer_step(new_phi, new_delta)


def _outer_states(
    replicas: list[Replica],
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Every replica's (fast weights, slow weights, outer momentum) before the round, as lists."""
    return [r.fast_weights() for r in replicas], [list(r.phi) for r in replicas], [list(r.delta) for r in replicas]


def _sparse_noloco_round(
    replicas: list[Replica],
    rng: np.random.Generator,
    cfg: SimulateConfig,
    method: str,
    feedback: list[ErrorFeedback],
    gap_estimates: list[dict[int, torch.Tensor]],
) -> None:
    """One outer step of a sparse method (simulate/wire_views.py): compressed Deltas (error-fed unless the method
    drops the residual), and phi every PHI_EVERY[method] outer steps or, in the side-information code, at every
    one."""
    every = PHI_EVERY[method]
    outer = cfg.outer
    results = sparse_pair_steps(
        random_groups(len(replicas), rng),
        *_outer_states(replicas),
        feedback,
        phi_round=every is not None and replicas[0].outer_step % every == 0,
        sign_residual=method in SIGN_RESIDUAL,
        side_phi_seed=replicas[0].outer_step if method in SIDE_PHI else None,
        gap_estimates=gap_estimates,
        error_feedback=method not in NO_FEEDBACK,
        own_left_out_weight=OWN_LEFT_OUT_WEIGHT.get(method, 1.0),
        parity_phi=method in PARITY_PHI,
        alpha=outer.alpha,
        beta=outer.beta,
        gamma=outer.effective_gamma,
    )
    for i, (new_phi, new_delta) in results.items():
        replicas[i].apply_outer_step(new_phi, new_delta)


def _late_noloco_round(
    replicas: list[Replica],
    rng: np.random.Generator,
    cfg: SimulateConfig,
    method: str,
    previous: list[list[torch.Tensor] | None],
    gap_estimates: list[dict[int, torch.Tensor]],
) -> None:
    """One outer step of a late method (simulate/wire_views.py): own progress now, the pair's half a phase late."""
    outer = cfg.outer
    results = late_pair_steps(
        random_groups(len(replicas), rng),
        *_outer_states(replicas),
        previous,
        gap_estimates,
        method=method,
        seed=replicas[0].outer_step,
        alpha=outer.alpha,
        beta=outer.beta,
        gamma=outer.effective_gamma,
    )
    for i, (new_phi, new_delta) in results.items():
        replicas[i].apply_outer_step(new_phi, new_delta)


Offer = tuple[list[torch.Tensor], list[torch.Tensor]]  # (projected fast weights, slow weights) a replica published


def _stale_noloco_round(
    replicas: list[Replica], rng: np.random.Generator, cfg: SimulateConfig, offers: list[Offer | None]
) -> float | None:
    """The overlap mode: blend with the partner's snapshot of one phase ago, then publish a new one. Returns the
    offers' mean projection error (MethodResult.projection_error), None when there were none yet."""
    outer = cfg.outer
    errors = []
    for replica, offer in zip(replicas, offers, strict=True):
        if offer is not None:
            theta, phi = replica.fast_weights(), replica.phi
            miss = sum(float((o - t.float()).norm() ** 2) for o, t in zip(offer[0], theta, strict=True))
            progress = sum(float((t.float() - p).norm() ** 2) for t, p in zip(theta, phi, strict=True))
            errors.append(math.sqrt(miss / max(progress, 1e-30)))
    results = {}
    for group in random_groups(len(replicas), rng):
        for i in group:
            partner_offers = [offer for j in group if j != i and (offer := offers[j]) is not None]
            results[i] = algorithm.noloco_outer_step(
                replicas[i].fast_weights(),
                replicas[i].phi,
                replicas[i].delta,
                [offer[0] for offer in partner_offers],
                [offer[1] for offer in partner_offers],
                alpha=outer.alpha,
                beta=outer.beta,
                gamma=outer.effective_gamma,
            )
    for i, (new_phi, new_delta) in results.items():
        theta, old_phi = replicas[i].fast_weights(), replicas[i].phi
        offers[i] = (algorithm.projected_fast_weights(new_phi, theta, old_phi), [p.clone() for p in new_phi])
        replicas[i].apply_outer_step(new_phi, new_delta)
    return float(np.mean(errors)) if errors else None


def _diloco_round(replicas: list[Replica], cfg: SimulateConfig, *, nesterov: bool) -> None:
    """One DiLoCo outer step: the all-replica mean, the same new slow weights everywhere."""
    outer = cfg.outer
    thetas = [r.fast_weights() for r in replicas]
    shared = replicas[0]  # phi and the outer momentum are identical on every replica
    if nesterov:
        new_phi, new_state = algorithm.diloco_nesterov_step(
            shared.phi, shared.delta, thetas, lr=outer.nesterov_lr, momentum=outer.nesterov_momentum
        )
    else:
        new_phi, new_state = algorithm.diloco_heavy_ball_step(
            shared.phi, shared.delta, thetas, alpha=outer.diloco_alpha, beta=outer.diloco_beta
        )
    for replica in replicas:
        replica.apply_outer_step(new_phi, new_state)


def run_method(
    method: str,
    cfg: SimulateConfig,
    corpus: Corpus,
    *,
    progress: ProgressFn = print_progress,
) -> MethodResult:
    """Train ``cfg.replicas`` replicas with one method and record its curves."""
    train = cfg.train
    source = model_source(train, corpus.vocab_size)
    device = resolve_device(train.device)
    shards = [
        ReplicaShard(corpus.train, replica=r, num_replicas=cfg.replicas, seq_len=train.seq_len, seed=train.seed)
        for r in range(cfg.replicas)
    ]
    if method == "ddp":
        replicas = [Replica(source, train, shards, device=device)]
    else:
        replicas = [Replica(source, train, [shard], device=device) for shard in shards]
    val = validation_batches(
        corpus.validation, seq_len=train.seq_len, batch_size=train.eval_batch_size, num_batches=train.eval_batches
    )
    if method.startswith("noloco"):
        algorithm.warn_on_unstable_hyperparameters(cfg.outer.alpha, cfg.outer.beta, cfg.outer.effective_gamma)
    offers: list[Offer | None] = [None] * len(replicas)
    pair_rng = np.random.default_rng([train.seed, 0x9A1])
    h = cfg.outer.diloco_h(train.inner_steps) if method in DILOCO_METHODS else train.inner_steps
    result = MethodResult(method=method, replicas=cfg.replicas, inner_steps=h)
    result.bytes_per_parameter = bytes_per_parameter(
        method, [tuple(p.shape) for p in replicas[0].phi], sends_phi=cfg.outer.effective_gamma != cfg.outer.beta
    )
    feedback = [ErrorFeedback([p.shape for p in r.phi]) for r in replicas] if method in PHI_EVERY else []
    gap_estimates: list[dict[int, torch.Tensor]] = [{} for _ in replicas]  # side-information methods' (wire_views.py)
    late_previous: list[list[torch.Tensor] | None] = [None] * len(replicas)  # the late methods' last fast weights
    started = time.perf_counter()

    def record(step: int, train_losses: list[float]) -> None:
        losses = [r.evaluate(val) for r in replicas]
        result.steps.append(step)
        result.val_loss.append(float(np.mean(losses)))
        result.val_loss_min.append(min(losses))
        result.val_loss_max.append(max(losses))
        result.train_loss.append(float(np.mean(train_losses)) if train_losses else float("nan"))
        result.spread.append(algorithm.replica_spread([r.fast_weights() for r in replicas]))
        result.lr.append(replicas[0].current_lr)
        progress(
            f"[{method:>15}] step {step:5d}/{train.total_steps}  val {result.val_loss[-1]:.4f} "
            f"(ppl {math.exp(result.val_loss[-1]):7.3f})  train {result.train_loss[-1]:.4f}  "
            f"spread {result.spread[-1]:.2e}  lr {replicas[0].current_lr:.2e}  {time.perf_counter() - started:6.1f}s"
        )

    record(0, [])
    # The one inner loop per replica (training/loop.py), advanced in lockstep: the outer step runs across them.
    loops = [InnerLoop(r, total_steps=train.total_steps, inner_steps=h).phases() for r in replicas]
    for phases in zip(*loops, strict=True):
        phase_losses = [float(loss) for phase in phases for loss in phase.losses]
        step = phases[0].end_step
        if method in LATE_WIRE:
            _late_noloco_round(replicas, pair_rng, cfg, method, late_previous, gap_estimates)
        elif method in PHI_EVERY:
            _sparse_noloco_round(replicas, pair_rng, cfg, method, feedback, gap_estimates)
        elif method == "noloco" or method in WIRE_METHODS or method == "noloco-momentum":
            _noloco_round(replicas, pair_rng, cfg, method=method, blend_momenta=method == "noloco-momentum")
        elif method == "noloco-stale":
            error = _stale_noloco_round(replicas, pair_rng, cfg, offers)
            if error is not None:
                result.projection_error.append(error)
                progress(f"[{method:>15}] projection error of the offers at step {step}: {error:.3f}")
        elif method in DILOCO_METHODS:
            _diloco_round(replicas, cfg, nesterov=method == "diloco-nesterov")
        record(step, phase_losses)
    result.seconds = time.perf_counter() - started
    return result


def compare(cfg: SimulateConfig, *, progress: ProgressFn = print_progress) -> Comparison:
    """Run every method in ``cfg.methods`` on the same seeds and data; write metrics.json and curves.png."""
    corpus = load_run_corpus(cfg.data, cfg.train)
    progress(
        f"corpus: {corpus.description}: {len(corpus.train):,} train / {len(corpus.validation):,} validation "
        f"tokens; {cfg.replicas} replicas, model {model_label(cfg)}, {cfg.train.total_steps} inner steps, "
        f"H = {cfg.train.inner_steps}"
    )
    results: dict[str, MethodResult] = {
        method: run_method(method, cfg, corpus, progress=progress) for method in cfg.methods
    }
    comparison = Comparison(results, relative_metrics(results))
    write_outputs(comparison, cfg, corpus)
    return comparison
