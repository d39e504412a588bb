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
every method starts from the same initial weights. ``compare`` prints a table of final validation loss and
perplexity, the paper's relative metric ``(ppl_diloco - ppl_noloco) / ppl_ddp`` at the end and over training
(its Fig. 3A), the weight spread across replicas and its Pearson correlation with the inner learning rate (its
Fig. 3B), and writes the metrics as JSON and the curves as a PNG.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from noloco_node import algorithm
from noloco_node.config.models import WIRE_METHODS, SimulateConfig
from noloco_node.data.corpus import Corpus, ReplicaShard, validation_batches
from noloco_node.model.run_model import load_run_corpus, model_source
from noloco_node.training.loop import InnerLoop
from noloco_node.training.replica import Replica, resolve_device
from noloco_node.wire import quantize

ProgressFn = Callable[[str], None]


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class MethodResult:
    """Curves of one method; each list has one entry per evaluation (step 0, then after every outer step)."""

    method: str
    replicas: int
    steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)  # mean over replicas
    val_loss_min: list[float] = field(default_factory=list)
    val_loss_max: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)  # mean over replicas and the phase's steps
    spread: list[float] = field(default_factory=list)  # RMS std of the weights across replicas
    # noloco-stale: per outer step, how far the offers' projected fast weights are from the fast weights they
    # stand for, relative to the phase's own progress: ||theta_projected - theta|| / ||theta - phi||, mean over
    # replicas (0: a perfect projection; 1: as wrong as the progress is large)
    projection_error: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)  # the inner learning rate at each evaluation
    inner_steps: int = 0  # H: this method's inner steps between outer steps
    seconds: float = 0.0

    @property
    def final_val_loss(self) -> float:
        return self.val_loss[-1]

    @property
    def final_val_ppl(self) -> float:
        return math.exp(self.final_val_loss)

    @property
    def final_spread(self) -> float:
        return self.spread[-1]


DILOCO_METHODS = ("diloco", "diloco-nesterov")  # their H is OuterConfig.diloco_h: twice NoLoCo's by default


def random_groups(num_replicas: int, rng: np.random.Generator) -> list[list[int]]:
    """A fresh random pairing of replicas; with an odd count, the one left over forms a group of its own."""
    order = [int(i) for i in rng.permutation(num_replicas)]
    groups = [order[i : i + 2] for i in range(0, num_replicas - 1, 2)]
    if num_replicas % 2:
        groups.append([order[-1]])
    return groups


def _through_wire(tensors: list[torch.Tensor], wire_dtype: str) -> list[torch.Tensor]:
    """What a receiver reads of ``tensors`` sent in ``wire_dtype``: exact in fp32, rounded in bf16, blockwise
    quantized and decoded in int8/int4 (wire/quantize.py, the node's own codec)."""
    if wire_dtype == "fp32":
        return tensors
    if wire_dtype == "bf16":
        return [t.to(torch.bfloat16).to(torch.float32) for t in tensors]
    return [quantize.dequantize(quantize.quantize(t, wire_dtype), t.numel(), wire_dtype).view_as(t) for t in tensors]


def partner_view(
    method: str, theta: list[torch.Tensor], phi: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The (fast, slow) weights a partner blends with, as the method's wire delivers them.

    - ``noloco``: exact (the maths alone); ``noloco-bf16/int8/int4``: the sync mode, theta (and phi) sent whole
      in that wire dtype.
    - ``noloco-stream[-int8|-int4]``: the stream mode: phi, fixed during the phase, streamed in bf16 while the
      replicas train, and at the outer step only Delta = theta - phi (bf16 or the quantized dtype); the receiver
      rebuilds theta as phi + Delta.
    """
    sync_wire, stream_wire = WIRE_OF_METHOD[method]
    if stream_wire is None:
        return _through_wire(list(theta), sync_wire), _through_wire(list(phi), sync_wire)
    seen_phi = _through_wire(list(phi), "bf16")
    seen_delta = _through_wire(algorithm.phase_progress(theta, phi), stream_wire)
    return algorithm.fast_weights_from(seen_phi, seen_delta), seen_phi


# Per NoLoCo method: the wire dtype of theta and phi sent whole (sync), or of Delta when phi is streamed (stream).
WIRE_OF_METHOD: dict[str, tuple[str, str | None]] = {
    "noloco": ("fp32", None),
    "noloco-momentum": ("fp32", None),
    "noloco-bf16": ("bf16", None),
    "noloco-int8": ("int8", None),
    "noloco-int4": ("int4", None),
    "noloco-stream": ("bf16", "bf16"),
    "noloco-stream-int8": ("bf16", "int8"),
    "noloco-stream-int4": ("bf16", "int4"),
}


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
        corpus.validation, seq_len=train.seq_len, batch_size=train.batch_size, num_batches=train.eval_batches
    )
    if method.startswith("noloco"):
        algorithm.warn_on_unstable_hyperparameters(cfg.outer.alpha, cfg.outer.beta, cfg.outer.effective_gamma)
    offers: list[Offer | None] = [None] * len(replicas)
    pair_rng = np.random.default_rng([train.seed, 0x9A1])
    h = cfg.outer.diloco_h(train.inner_steps) if method in DILOCO_METHODS else train.inner_steps
    result = MethodResult(method=method, replicas=cfg.replicas, inner_steps=h)
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
        phase_losses = [loss for phase in phases for loss in phase.losses]
        step = phases[0].end_step
        if method == "noloco" or method in WIRE_METHODS or method == "noloco-momentum":
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


def model_label(cfg: SimulateConfig) -> str:
    """The model's name in tables and plots: the named size, or the --init-from folder's name."""
    return cfg.train.model_size if cfg.train.init_from is None else cfg.train.init_from.name


def relative_metrics(results: Mapping[str, MethodResult]) -> dict[str, float]:
    """The paper's metric ``(ppl_diloco - ppl_noloco) / ppl_ddp`` (positive: NoLoCo better) for each DiLoCo
    variant, keyed by the variant for ``noloco`` and by ``"<diloco variant> vs <noloco variant>"`` for the others."""
    relative: dict[str, float] = {}
    if "ddp" not in results:
        return relative
    ddp = results["ddp"].final_val_ppl
    for noloco in ("noloco", "noloco-stale", "noloco-momentum"):
        for diloco in ("diloco", "diloco-nesterov"):
            if noloco in results and diloco in results:
                key = diloco if noloco == "noloco" else f"{diloco} vs {noloco}"
                relative[key] = (results[diloco].final_val_ppl - results[noloco].final_val_ppl) / ddp
    return relative


def relative_metric_curves(results: Mapping[str, MethodResult]) -> dict[str, list[tuple[int, float]]]:
    """The paper's metric over training (its Fig. 3A): ``(ppl_diloco - ppl_noloco) / ppl_ddp`` at every step where
    all three were evaluated (the multiples of DiLoCo's H), keyed as :func:`relative_metrics` keys its finals."""
    curves: dict[str, list[tuple[int, float]]] = {}
    if "ddp" not in results:
        return curves
    ppl = {name: dict(zip(r.steps, map(math.exp, r.val_loss), strict=True)) for name, r in results.items()}
    for noloco in ("noloco", "noloco-stale", "noloco-momentum"):
        for diloco in DILOCO_METHODS:
            if noloco in results and diloco in results:
                key = diloco if noloco == "noloco" else f"{diloco} vs {noloco}"
                common = sorted(set(ppl[noloco]) & set(ppl[diloco]) & set(ppl["ddp"]) - {0})
                curves[key] = [(s, (ppl[diloco][s] - ppl[noloco][s]) / ppl["ddp"][s]) for s in common]
    return curves


def spread_lr_correlation(result: MethodResult) -> float | None:
    """Pearson correlation of the weight spread across replicas with the inner learning rate over training (the
    paper's Fig. 3B reports 0.91-0.97 for NoLoCo), from the first outer step on; None for fewer than 3 points or
    a constant series (one replica, a method whose replicas never differ)."""
    spread, lr = np.array(result.spread[1:]), np.array(result.lr[1:])
    if len(spread) < 3 or spread.std() == 0 or lr.std() == 0:
        return None
    return float(np.corrcoef(spread, lr)[0, 1])


@dataclass
class Comparison:
    results: Mapping[str, MethodResult]
    relative_metric: dict[str, float]  # "(ppl_X - ppl_noloco) / ppl_ddp" for each DiLoCo variant X

    def table(self) -> str:
        """A Markdown table: the form the README quotes."""
        ddp = self.results.get("ddp")
        rows = [
            "| method | H | val loss | val ppl | ppl vs DDP | weight spread | spread-lr Pearson r | wall s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in self.results.items():
            versus = f"{(r.final_val_ppl / ddp.final_val_ppl - 1) * 100:+.2f}%" if ddp else "n/a"
            pearson = spread_lr_correlation(r)
            rows.append(
                f"| {name} | {r.inner_steps} | {r.final_val_loss:.4f} | {r.final_val_ppl:.3f} | {versus} | "
                f"{r.final_spread:.2e} | {'n/a' if pearson is None else f'{pearson:.2f}'} | {r.seconds:.0f} |"
            )
        lines = ["\n".join(rows)]
        curves = relative_metric_curves(self.results)
        for key, value in self.relative_metric.items():
            diloco, _, noloco = key.partition(" vs ")
            noloco = noloco or "noloco"
            verdict = f"{noloco} better" if value > 0 else f"{noloco} worse" if value < 0 else "tie"
            over = curve_summary(curves.get(key, []))
            lines.append(
                f"(ppl_{diloco} - ppl_{noloco}) / ppl_ddp = {value * 100:+.2f}%  ({verdict})"
                + (f"; over training: {over}" if over else "")
            )
        return "\n".join(lines)


def curve_summary(curve: list[tuple[int, float]]) -> str:
    """A relative-metric curve at about a quarter, half, three quarters and the end of training."""
    if not curve:
        return ""
    last = curve[-1][0]
    picked: dict[tuple[int, float], None] = {}
    for fraction in (0.25, 0.5, 0.75, 1.0):
        picked[min(curve, key=lambda point: abs(point[0] - fraction * last))] = None
    return ", ".join(f"step {step} {value * 100:+.2f}%" for step, value in picked)


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


def write_outputs(comparison: Comparison, cfg: SimulateConfig, corpus: Corpus) -> None:
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": cfg.model_dump(mode="json"),
        "corpus": corpus.description,
        "model_parameters": sum(math.prod(shape) for _, shape in model_source(cfg.train, corpus.vocab_size).layout()),
        "results": {
            name: {**asdict(r), "final_val_loss": r.final_val_loss, "final_val_ppl": r.final_val_ppl}
            for name, r in comparison.results.items()
        },
        "relative_metric": comparison.relative_metric,
        "relative_metric_curves": relative_metric_curves(comparison.results),
        "table": comparison.table(),
    }
    (cfg.out_dir / "metrics.json").write_text(json.dumps(payload, indent=2))
    plot_curves(comparison, cfg.out_dir / "curves.png", title=f"{cfg.replicas} replicas, {model_label(cfg)} model")


def plot_curves(comparison: Comparison, path: Path, *, title: str) -> None:
    """Validation loss and weight spread against inner steps, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = relative_metric_curves(comparison.results)
    fig, axes = plt.subplots(1, 3 if curves else 2, figsize=(18 if curves else 12, 4.5))
    loss_ax, spread_ax = axes[0], axes[1]
    if curves:
        plot_relative_metric(axes[2], curves)
    for name, r in comparison.results.items():
        loss_ax.plot(r.steps, r.val_loss, label=name, marker=".")
        if any(s > 0 for s in r.spread):
            spread_ax.plot(r.steps[1:], r.spread[1:], label=name, marker=".")
    loss_ax.set(xlabel="inner steps per replica", ylabel="validation loss (nats/token)", title=title)
    finals = [r.final_val_loss for r in comparison.results.values()]
    loss_ax.set_ylim(min(finals) - 0.1, max(finals) + 0.8)
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    spread_ax.set(
        xlabel="inner steps per replica",
        ylabel="weight std across replicas (RMS)",
        yscale="log",
        title="replica spread",
    )
    if spread_ax.lines:
        spread_ax.legend()
    spread_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_relative_metric(ax: Any, curves: Mapping[str, list[tuple[int, float]]]) -> None:
    """The paper's Fig. 3A: (ppl_diloco - ppl_noloco) / ppl_ddp against inner steps (above 0: NoLoCo ahead)."""
    for key, curve in curves.items():
        if curve:
            ax.plot([s for s, _ in curve], [100 * v for _, v in curve], label=key, marker=".")
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set(xlabel="inner steps per replica", ylabel="(ppl_diloco - ppl_noloco) / ppl_ddp (%)", title="relative metric")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


# ---------------------------------------------------------------------------------------------------- seed study
