"""`noloco-node bench sapo`: SAPO's comparison (arXiv 2509.08721, section 4) at CPU scale, with real RL node
processes (`noloco-node rl`) sharing rollouts through a real DHT and gRPC on 127.0.0.1.

**The mix.** N nodes, I + J = 8 rollouts per update in each configuration (8/0, 6/2, 4/4, 2/6 by default), the
same node seeds and tasks in every configuration, over several seeds: each node's cumulative reward (the sum over
rounds of the mean reward of its own completions, the paper's measure) per configuration, the mean over nodes
and seeds, its spread over seeds, and the gain against 8/0 measured in the same run. A plot of the mean reward
per round of each configuration.

**Different families.** Half the nodes train on one task family, half on another; every node is evaluated
(greedy answers to held-out questions) on both. With sharing (I/J = 4/4) against without (8/0): does a family a
node never generated for, nor warmed up on, improve on it only when peers' rollouts of it reach it?

What it measures is a ~100k-parameter decoder warmed up for a few hundred supervised steps, over tens of rounds:
not the paper's Qwen2.5-0.5B over thousands. docs/rl.md says what that does and does not show.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from noloco_node.launcher.local_swarm import launch_node, stop_together, wait_or_kill
from noloco_node.node.bootstrap import start_bootstrap_process
from noloco_node.observability.status_file import read_status_document

MIXES = ((8, 0), (6, 2), (4, 4), (2, 6))


@dataclass
class NodeOutcome:
    cumulative_reward: float
    rewards: list[float]  # mean local reward per round
    external_per_round: float
    evaluations: dict[str, float]  # family -> the last held-out greedy reward
    answer_nll: dict[str, float]  # family -> the reference answers' NLL per token at the last evaluation
    families: list[str]


@dataclass
class RunOutcome:
    label: str
    seed: int
    nodes: list[NodeOutcome]
    seconds: float

    @property
    def mean_cumulative(self) -> float:
        return statistics.fmean(n.cumulative_reward for n in self.nodes)


@dataclass
class SapoResult:
    nodes: int
    rounds: int
    seeds: list[int]
    mixes: dict[str, list[RunOutcome]] = field(default_factory=dict)
    families: dict[str, list[RunOutcome]] = field(default_factory=dict)
    family_split: tuple[str, str] = ("chain_sum", "spell_backward")

    def report(self) -> str:
        lines = [
            f"SAPO at CPU scale: {self.nodes} RL nodes (tiny decoder), {self.rounds} rounds, 8 rollouts per update, "
            f"seeds {self.seeds}",
            "",
            "cumulative reward per node (sum over rounds of the mean reward of its own completions):",
            f"{'I/J':>6}  {'mean':>7}  {'std over seeds':>14}  {'per seed':<28}  {'vs 8/0':>7}  {'J used/round':>12}",
        ]
        reference = None
        for label, runs in self.mixes.items():
            per_seed = [r.mean_cumulative for r in runs]
            mean = statistics.fmean(per_seed)
            spread = statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0
            reference = mean if reference is None else reference
            used = statistics.fmean(n.external_per_round for r in runs for n in r.nodes)
            gain = f"{100 * (mean / reference - 1):+.1f}%" if reference else "n/a"
            seeds = ", ".join(f"{x:.2f}" for x in per_seed)
            lines.append(f"{label:>6}  {mean:7.2f}  {spread:14.2f}  {seeds:<28}  {gain:>7}  {used:12.2f}")
        if self.families:
            a, b = self.family_split
            lines += [
                "",
                f"different families: nodes 0..{self.nodes // 2 - 1} train on {a}, the others on {b}; on 32 held-out "
                "questions of each family after the last round, the greedy reward and the reference answers' NLL per "
                "token (mean over nodes and seeds, the spread over seeds):",
            ]
            for label, runs in self.families.items():
                rows: dict[str, list[list[float]]] = {"never-trained": [[], []], "own": [[], []]}
                for run in runs:
                    this_seed: dict[str, list[list[float]]] = {"never-trained": [[], []], "own": [[], []]}
                    for node in run.nodes:
                        own = node.families[0]
                        for which, family in (("never-trained", b if own == a else a), ("own", own)):
                            this_seed[which][0].append(node.evaluations.get(family, float("nan")))
                            this_seed[which][1].append(node.answer_nll.get(family, float("nan")))
                    for which, (rewards, nlls) in this_seed.items():
                        rows[which][0].append(statistics.fmean(rewards))
                        rows[which][1].append(statistics.fmean(nlls))
                for which, (rewards, nlls) in rows.items():
                    spread = statistics.stdev(nlls) if len(nlls) > 1 else 0.0
                    lines.append(
                        f"{label:>14}, {which + ' family':<22} reward {statistics.fmean(rewards):.3f}, "
                        f"answer NLL {statistics.fmean(nlls):.3f} +- {spread:.3f}"
                    )
        return "\n".join(lines)

    def to_json(self) -> dict:
        def runs(table: dict[str, list[RunOutcome]]) -> dict:
            return {
                label: [
                    {"seed": r.seed, "seconds": r.seconds, "nodes": [n.__dict__ for n in r.nodes]} for r in outcomes
                ]
                for label, outcomes in table.items()
            }

        return {"nodes": self.nodes, "rounds": self.rounds, "seeds": self.seeds, "mixes": runs(self.mixes),
                "families": runs(self.families)}  # fmt: skip


def _run_swarm(
    maddrs: list[str],
    scratch: Path,
    label: str,
    seed: int,
    node_args: list[list[str]],
    *,
    timeout: float,
) -> RunOutcome:
    started = time.monotonic()
    run_dir = scratch / f"{label.replace('/', '-')}-seed{seed}"
    processes, dirs = [], []
    for index, args in enumerate(node_args):
        data_dir = run_dir / f"node{index}"
        dirs.append(data_dir)
        processes.append(
            launch_node(
                maddrs,
                data_dir,
                ["--run-name", f"sapo-{run_dir.name}", "--seed", str(seed * 100 + index), *args],
                run_dir / f"node{index}.log",
                work="rl",
            )
        )
    try:
        for process in processes:
            wait_or_kill(process, max(1.0, timeout - (time.monotonic() - started)))
    finally:
        stop_together(processes, 30)
    nodes = []
    for index, data_dir in enumerate(dirs):
        status = read_status_document(data_dir)
        if status is None or not status.get("rewards"):
            log_tail = (run_dir / f"node{index}.log").read_text()[-2000:]
            raise RuntimeError(f"{label} seed {seed}: node {index} wrote no rounds; its log ends:\n{log_tail}")
        rewards = [p["local_reward"] or 0.0 for p in status["rewards"]]
        evaluations, answer_nll = {}, {}
        for point in status.get("evaluations", []):
            evaluations[point["family"]] = point["reward"]
            answer_nll[point["family"]] = point["answer_nll"]
        nodes.append(
            NodeOutcome(
                cumulative_reward=status["cumulative_local_reward"],
                rewards=rewards,
                external_per_round=statistics.fmean(p["external_groups"] for p in status["rewards"]),
                evaluations=evaluations,
                answer_nll=answer_nll,
                families=status["families"],
            )
        )
    return RunOutcome(label, seed, nodes, time.monotonic() - started)


def run_sapo_bench(
    *,
    nodes: int = 4,
    rounds: int = 40,
    seeds: list[int],
    mixes: tuple[tuple[int, int], ...] = MIXES,
    families: bool = True,
    format_steps: int = 200,
    group_size: int = 8,
    out: Path | None = None,
) -> SapoResult:
    result = SapoResult(nodes=nodes, rounds=rounds, seeds=seeds)
    common = [
        "--rounds", str(rounds), "--group-size", str(group_size), "--format-steps", str(format_steps),
        "--eval-questions", "32",
    ]  # fmt: skip
    timeout = 600.0 + 15.0 * rounds
    with tempfile.TemporaryDirectory(prefix="noloco-sapo-") as scratch_dir:
        scratch = Path(scratch_dir)
        bootstrap, maddrs = start_bootstrap_process(scratch / "bootstrap.log")
        try:
            for local, external in mixes:
                label = f"{local}/{external}"
                for seed in seeds:
                    args = [[*common, "--local", str(local), "--external", str(external)] for _ in range(nodes)]
                    run = _run_swarm(maddrs, scratch, label, seed, args, timeout=timeout)
                    result.mixes.setdefault(label, []).append(run)
                    print(f"  {label} seed {seed}: mean cumulative reward {run.mean_cumulative:.2f} "
                          f"({run.seconds:.0f} s)", flush=True)  # fmt: skip
            if families:
                a, b = result.family_split
                for label, (local, external) in (("sharing 4/4", (4, 4)), ("no sharing 8/0", (8, 0))):
                    for seed in seeds:
                        args = [
                            [
                                *common, "--local", str(local), "--external", str(external),
                                "--tasks", a if index < nodes // 2 else b, "--eval-tasks", a, b,
                                "--eval-every", str(rounds),
                            ]
                            for index in range(nodes)
                        ]  # fmt: skip
                        run = _run_swarm(maddrs, scratch, label, seed, args, timeout=timeout)
                        result.families.setdefault(label, []).append(run)
                        print(f"  {label} seed {seed}: {run.seconds:.0f} s", flush=True)
        finally:
            stop_together([bootstrap], 20)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sapo.json").write_text(json.dumps(result.to_json(), indent=1))
        if result.mixes:
            plot(result, out / "sapo-mixes.png")
    return result


def plot(result: SapoResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = list(result.mixes)
    for label, runs in result.mixes.items():
        length = min(len(n.rewards) for r in runs for n in r.nodes)
        mean = [statistics.fmean(n.rewards[i] for r in runs for n in r.nodes) for i in range(length)]
        window = 5
        smooth = [statistics.fmean(mean[max(0, i - window + 1) : i + 1]) for i in range(length)]
        curves.plot(range(1, length + 1), smooth, label=f"I/J = {label}")
    curves.set_xlabel("round")
    curves.set_ylabel("mean reward of own completions (5-round mean)")
    curves.legend()
    means = [statistics.fmean(r.mean_cumulative for r in result.mixes[label]) for label in labels]
    spreads = [
        statistics.stdev([r.mean_cumulative for r in result.mixes[label]]) if len(result.mixes[label]) > 1 else 0.0
        for label in labels
    ]
    bars.bar(labels, means, yerr=spreads, capsize=6, color="#4c72b0")
    bars.set_xlabel("local / external rollouts per update")
    bars.set_ylabel("cumulative reward per node (mean, std over seeds)")
    figure.suptitle(f"{result.nodes} RL nodes sharing rollouts, {result.rounds} rounds, seeds {result.seeds}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
