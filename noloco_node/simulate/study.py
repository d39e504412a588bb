"""``simulate --compare --seeds N --replica-counts A,B``: the comparison repeated over seeds and replica counts,
reported as mean +- std of the final validation loss per method (simulator.py runs each comparison)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from noloco_node.config.models import SimulateConfig
from noloco_node.model.run_model import load_run_corpus
from noloco_node.simulate.results import (
    Comparison,
    MethodResult,
    bytes_label,
    curve_summary,
    model_label,
    plot_relative_metric,
    relative_metric_curves,
    relative_metrics,
    spread_lr_correlation,
)
from noloco_node.simulate.simulator import (
    ProgressFn,
    print_progress,
    run_method,
)


@dataclass
class SeedStudy:
    """``compare`` repeated over seeds (initial weights, data dealing, pairings) and replica counts."""

    seeds: list[int]
    comparisons: dict[int, list[Comparison]]  # replica count -> one comparison per seed

    def table(self) -> str:
        blocks = []
        for count, runs in self.comparisons.items():
            methods = list(runs[0].results)
            rows = [
                f"{count} replicas, {len(runs)} seeds ({', '.join(map(str, self.seeds))}): mean +- std over seeds",
                f"| method | H | final val loss | val ppl | ppl vs DDP | loss vs {methods[0]} (paired) | weight spread "
                "| spread-lr Pearson r | B/param/outer step (all, critical path, peak) |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            reference = np.array([run.results[methods[0]].final_val_loss for run in runs])
            for method in methods:
                losses = np.array([run.results[method].final_val_loss for run in runs])
                ppls = np.array([run.results[method].final_val_ppl for run in runs])
                spread = np.mean([run.results[method].final_spread for run in runs])
                versus = "n/a"
                if "ddp" in methods:
                    ratios = np.array(
                        [run.results[method].final_val_ppl / run.results["ddp"].final_val_ppl for run in runs]
                    )
                    versus = f"{(ratios.mean() - 1) * 100:+.2f}% +- {ratios.std() * 100:.2f}"
                # Per seed against the first method (same seed, data and pairings), then mean +- std: the paired
                # difference is what a wire dtype or a mode costs, free of the seed-to-seed spread.
                paired = (losses / reference - 1) * 100
                against = (
                    "reference"
                    if method == methods[0]
                    else f"{paired.mean():+.2f}% +- {paired.std():.2f} (lower in {int((paired < 0).sum())}/{len(runs)})"
                )
                pearsons = [r for run in runs if (r := spread_lr_correlation(run.results[method])) is not None]
                pearson = f"{np.mean(pearsons):.2f} ({min(pearsons):.2f}-{max(pearsons):.2f})" if pearsons else "n/a"
                rows.append(
                    f"| {method} | {runs[0].results[method].inner_steps} | {losses.mean():.4f} +- {losses.std():.4f} "
                    f"| {ppls.mean():.3f} | {versus} | {against} | {spread:.2e} | {pearson} | "
                    f"{bytes_label(runs[0].results[method].bytes_per_parameter)} |"
                )
            for method in methods:
                errors = [e for run in runs for e in run.results[method].projection_error]
                if errors:
                    rows.append(
                        f"{method}: the offers' projected fast weights missed the fast weights they stand for by "
                        f"{np.mean(errors):.2f} x the phase's progress ||theta - phi|| (mean over outer steps and "
                        f"seeds; min {np.min(errors):.2f}, max {np.max(errors):.2f})"
                    )
            for key in runs[0].relative_metric:
                values = np.array([run.relative_metric[key] for run in runs]) * 100
                diloco, _, noloco = key.partition(" vs ")
                wins = int((values > 0).sum())
                # The seed mean of the metric over training (Fig. 3A): every seed evaluates at the same steps.
                curves = [relative_metric_curves(run.results).get(key, []) for run in runs]
                mean_curve = [
                    (step, float(np.mean([c[i][1] for c in curves]))) for i, (step, _) in enumerate(curves[0])
                ]
                over = curve_summary(mean_curve)
                rows.append(
                    f"(ppl_{diloco} - ppl_{noloco or 'noloco'}) / ppl_ddp = {values.mean():+.2f}% "
                    f"+- {values.std():.2f} (min {values.min():+.2f}, max {values.max():+.2f}; NoLoCo better in "
                    f"{wins}/{len(values)} seeds)" + (f"; seed mean over training: {over}" if over else "")
                )
            blocks.append("\n".join(rows))
        return "\n\n".join(blocks)


def seed_study(
    cfg: SimulateConfig, seeds: list[int], replica_counts: list[int], *, progress: ProgressFn = print_progress
) -> SeedStudy:
    """Every method of ``cfg.methods`` for every replica count and seed; writes study.json and study.png."""
    corpus = load_run_corpus(cfg.data, cfg.train)
    comparisons: dict[int, list[Comparison]] = {}
    for count in replica_counts:
        for seed in seeds:
            run_cfg = cfg.model_copy(update={"replicas": count, "train": cfg.train.model_copy(update={"seed": seed})})
            progress(f"--- {count} replicas, seed {seed}")
            results: dict[str, MethodResult] = {
                method: run_method(method, run_cfg, corpus, progress=progress) for method in cfg.methods
            }
            comparisons.setdefault(count, []).append(Comparison(results, relative_metrics(results)))
    study = SeedStudy(list(seeds), comparisons)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": cfg.model_dump(mode="json"),
        "corpus": corpus.description,
        "seeds": list(seeds),
        "runs": {
            str(count): [
                {
                    "results": {name: asdict(r) for name, r in run.results.items()},
                    "relative_metric": run.relative_metric,
                    "relative_metric_curves": relative_metric_curves(run.results),
                }
                for run in runs
            ]
            for count, runs in comparisons.items()
        },
        "table": study.table(),
    }
    (cfg.out_dir / "study.json").write_text(json.dumps(payload, indent=2))
    plot_study(study, cfg.out_dir / "study.png", model=model_label(cfg))
    return study


def plot_study(study: SeedStudy, path: Path, *, model: str) -> None:
    """Per replica count: the seed-mean validation loss (band: min to max over seeds) and weight spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = list(study.comparisons)
    with_metric = bool(study.comparisons[counts[0]][0].relative_metric)
    columns = 3 if with_metric else 2
    fig, axes = plt.subplots(len(counts), columns, figsize=(6 * columns, 4.2 * len(counts)), squeeze=False)
    for row, count in enumerate(counts):
        runs = study.comparisons[count]
        loss_ax, spread_ax = axes[row][0], axes[row][1]
        if with_metric:
            per_seed = [relative_metric_curves(run.results) for run in runs]
            plot_relative_metric(
                axes[row][2],
                {
                    key: [(s, float(np.mean([c[key][i][1] for c in per_seed]))) for i, (s, _) in enumerate(curve)]
                    for key, curve in per_seed[0].items()
                },
            )
        finals = []
        for method in runs[0].results:
            steps = runs[0].results[method].steps
            curves = np.array([run.results[method].val_loss for run in runs])
            line = loss_ax.plot(steps, curves.mean(axis=0), label=method, marker=".")[0]
            loss_ax.fill_between(steps, curves.min(axis=0), curves.max(axis=0), color=line.get_color(), alpha=0.15)
            finals.append(curves.mean(axis=0)[-1])
            spreads = np.array([run.results[method].spread for run in runs]).mean(axis=0)
            if (spreads[1:] > 0).any():
                spread_ax.plot(steps[1:], spreads[1:], label=method, color=line.get_color(), marker=".")
        loss_ax.set(
            xlabel="inner steps per replica",
            ylabel="validation loss (nats/token)",
            title=f"{count} replicas, {model} model, {len(runs)} seeds",
        )
        loss_ax.set_ylim(min(finals) - 0.1, max(finals) + 0.8)
        loss_ax.legend(fontsize=8)
        loss_ax.grid(alpha=0.3)
        spread_ax.set(xlabel="inner steps per replica", ylabel="weight std across replicas (RMS)", yscale="log")
        if spread_ax.lines:
            spread_ax.legend(fontsize=8)
        spread_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
