"""What ``simulate`` reports: each method's curves, the paper's relative metric (arXiv 2506.10911, Fig. 3A:
``(ppl_diloco - ppl_noloco) / ppl_ddp``), the weight spread's correlation with the learning rate (its Fig. 3B),
the Markdown table, metrics.json and the plots. The methods themselves run in simulator.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from noloco_node.config.models import SimulateConfig
from noloco_node.data.corpus import Corpus
from noloco_node.model.run_model import model_source

DILOCO_METHODS = ("diloco", "diloco-nesterov")  # their H is OuterConfig.diloco_h: twice NoLoCo's by default


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
    # What one replica sends its partner per parameter per outer step, (in all, on the critical path, peak); None for
    # methods without pairs (simulate/wire_views.py)
    bytes_per_parameter: tuple[float, float, float] | None = None
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
            "| method | H | val loss | val ppl | ppl vs DDP | weight spread | spread-lr Pearson r | B/param/outer step "
            "(all, critical path, peak) | wall s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in self.results.items():
            versus = f"{(r.final_val_ppl / ddp.final_val_ppl - 1) * 100:+.2f}%" if ddp else "n/a"
            pearson = spread_lr_correlation(r)
            sent = bytes_label(r.bytes_per_parameter)
            rows.append(
                f"| {name} | {r.inner_steps} | {r.final_val_loss:.4f} | {r.final_val_ppl:.3f} | {versus} | "
                f"{r.final_spread:.2e} | {'n/a' if pearson is None else f'{pearson:.2f}'} | {sent} | {r.seconds:.0f} |"
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


def bytes_label(sent: tuple[float, float, float] | None) -> str:
    """Bytes per parameter per outer step, in all (the mean), on the critical path and at the peak (the most in any
    one outer step), as the tables print them."""
    return "n/a" if sent is None else f"{sent[0]:.3f}, {sent[1]:.3f}, {sent[2]:.3f}"


def curve_summary(curve: list[tuple[int, float]]) -> str:
    """A relative-metric curve at about a quarter, half, three quarters and the end of training."""
    if not curve:
        return ""
    last = curve[-1][0]
    picked: dict[tuple[int, float], None] = {}
    for fraction in (0.25, 0.5, 0.75, 1.0):
        picked[min(curve, key=lambda point: abs(point[0] - fraction * last))] = None
    return ", ".join(f"step {step} {value * 100:+.2f}%" for step, value in picked)


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
