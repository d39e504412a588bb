"""`noloco-node bench race`: time to quality. NoLoCo swarms against DiLoCo on emulated internet links.

A user choosing between this node and DiLoCo asks which reaches a given loss sooner on their links and machines.
This bench trains the same model on the same shards from the same seed with every method, each host a process in
its own network namespace behind a link shaped to a bandwidth and a round-trip time (shaped_network.py: tc tbf and
the delaying router), every inner step taking a mean time T times a log-normal factor of spread sigma (the
straggler model of the paper's Fig. 5B; node.fault_injection), and reports validation loss against wall-clock:

- ``noloco-sync``: real `noloco-node join` processes (LocalSwarm on the shaped network), ``--mode sync``, bf16;
- ``noloco-stream``: the same with ``--mode stream --wire-dtype int4`` (the phase's slow weights stream during
  the phase, only the int4 progress waits at the outer step);
- ``noloco-sparse``: ``--mode stream --wire-dtype sparse`` (the progress as top-k per 4,096 values with error
  feedback, phi in int8 once every 8 outer steps: wire/sparse.py);
- ``diloco-H`` and ``diloco-2H``: DiLoCo (diloco_worker.py): a global barrier, a gloo ring all-reduce of the
  pseudo-gradient in bf16 and the heavy-ball outer step, every H and every 2H inner steps;
- ``hivemind-H``: the same DiLoCo at H with hivemind's DecentralizedAverager doing the all-reduce (fp16 on the
  wire, a group of every replica; OpenDiLoCo's setup). Its DHT and its all-reduce cross the shaped links, and its
  matchmaking time is hivemind's default 5 s, scaled like every other duration.

Scaling. 2 CPU cores cannot train a 125m model, so the race trains ``tiny`` and keeps what decides the race: the
ratio of a pairwise exchange's time to an inner phase's time. The target deployment (:class:`Deployment`: a model,
its batch, an accelerator's datasheet peak at an assumed MFU, a link) gives a step time and an exchange time; the
emulation keeps H, picks an emulated step time T (slow enough that N processes on this machine's cores keep it),
scales every duration by T / T_target, and sets the link's rate so that tiny's bf16 payload crosses it in the
scaled exchange time. A pairwise round and a ring all-reduce are then measured on those links before the race,
and the ratio achieved is printed next to the target's.

The DHT (records and lookups) crosses an unshaped control link of its own (shaped_network.py's control plane):
its volume does not shrink with the emulated model. An 8-node swarm's DHT moves about 55 KB/s per node between
outer steps; at the deployment's 100 Mbit/s that is under 0.5% of a link, but on the emulated 0.33 Mbit/s link it
is more than the link carries, and the first races, with the DHT on the shaped links, timed out its lookups and
paired 2 of 32 outer steps. The gRPC traffic (exchanges, Info calls of the status page) stays on the shaped links.

Each NoLoCo run's curve is the mean over its nodes of their validation loss (each node's own slow weights,
evaluated on the same batches after its outer step) at each multiple of H, at the mean time the nodes got there;
DiLoCo's replicas share their slow weights, evaluated on the same batches. Time starts when training starts
(nodes wait for each other with --wait-for-peers; DiLoCo's ranks at a barrier), so start-up is not raced.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from noloco_bench.shaped_network import ShapedNetwork, shaped_network
from noloco_bench.sync import measure_rounds
from noloco_node.config.models import DataConfig, TrainConfig, model_config_for
from noloco_node.launcher.local_swarm import LocalSwarm
from noloco_node.model.decoder import parameter_count
from noloco_node.node.fault_injection import Drill

# The NoLoCo methods: their pairing mode and wire dtype
NOLOCO_METHODS = {
    "noloco-sync": ("sync", "bf16"),
    "noloco-stream": ("stream", "int4"),
    "noloco-sparse": ("stream", "sparse"),
}
METHODS = (*NOLOCO_METHODS, "diloco-H", "diloco-2H", "hivemind-H")
DILOCO_PORT = 29600
STARTUP_ALLOWANCE = 120.0  # seconds a method may take to start before its time cap counts
HIVEMIND_MATCHMAKING_SECONDS = 5.0  # DecentralizedAverager's default min_matchmaking_time, scaled like every duration
BF16 = 2  # bytes per value on the wire


@dataclass(frozen=True)
class Deployment:
    """The deployment the race stands for: its exchange-to-phase time ratio is what the emulation keeps."""

    model: str = "125m"
    vocab_size: int = 32_000
    tokens_per_step: int = 524_288  # 0.5M tokens per step: GPT-3 Small's batch
    peak_tflops: float = 989.0  # H100 SXM, dense bf16, datasheet
    mfu: float = 0.40  # assumed (nanoGPT-class single-GPU training)
    rate_mbit: float = 100.0
    rtt_ms: float = 50.0

    @property
    def params(self) -> int:
        return parameter_count(model_config_for(self.model, vocab_size=self.vocab_size, max_seq_len=1024))

    @property
    def step_seconds(self) -> float:
        return 6 * self.params * self.tokens_per_step / (self.peak_tflops * 1e12 * self.mfu)

    def exchange_seconds(self) -> float:
        """A pairwise exchange: one bf16 model each way at once, over the link, plus a round trip."""
        return self.params * BF16 * 8 / (self.rate_mbit * 1e6) + self.rtt_ms / 1000

    def ring_seconds(self, hosts: int) -> float:
        """A ring all-reduce's latency-bandwidth model: 2(N-1) steps, each moving 1/N of the model and waiting for
        the previous step's data to arrive."""
        return 2 * (hosts - 1) * (self.params * BF16 * 8 / (hosts * self.rate_mbit * 1e6) + self.rtt_ms / 2000)

    def describe(self, inner_steps: int) -> str:
        phase = inner_steps * self.step_seconds
        return (
            f"target deployment: {self.model} ({self.params / 1e6:.0f}M parameters with a {self.vocab_size:,} "
            f"vocabulary), {self.tokens_per_step:,} tokens per inner step on one accelerator of "
            f"{self.peak_tflops:g} TFLOPS bf16 peak at {self.mfu:.0%} MFU: {self.step_seconds:.3f} s per step, "
            f"H = {inner_steps}: a {phase:.1f} s inner phase; links {self.rate_mbit:g} Mbit/s, RTT {self.rtt_ms:g} "
            f"ms: a bf16 pairwise exchange {self.exchange_seconds():.1f} s, "
            f"exchange / phase = {self.exchange_seconds() / phase:.2f}"
        )


@dataclass(frozen=True)
class Emulation:
    """The race as this machine runs it: every duration of the deployment times ``scale``."""

    deployment: Deployment
    model: str
    step_seconds: float
    inner_steps: int

    @property
    def payload_bytes(self) -> int:
        vocab = _run_vocab_size()
        return parameter_count(model_config_for(self.model, vocab_size=vocab, max_seq_len=128)) * BF16

    @property
    def scale(self) -> float:
        return self.step_seconds / self.deployment.step_seconds

    @property
    def rtt_ms(self) -> float:
        return self.deployment.rtt_ms * self.scale

    @property
    def exchange_seconds(self) -> float:
        return self.deployment.exchange_seconds() * self.scale

    @property
    def rate_mbit(self) -> float:
        """The link rate at which this model's bf16 payload takes the scaled exchange time (less its round trip)."""
        transfer = self.exchange_seconds - self.rtt_ms / 1000
        return self.payload_bytes * 8 / transfer / 1e6

    @property
    def phase_seconds(self) -> float:
        return self.inner_steps * self.step_seconds

    def describe(self) -> str:
        return (
            f"emulated: {self.model} ({self.payload_bytes / 1e3:.0f} KB in bf16), {self.step_seconds:g} s per step "
            f"(time scale {self.scale:.3f}), H = {self.inner_steps}: a {self.phase_seconds:.1f} s phase; links "
            f"{self.rate_mbit:.3f} Mbit/s, RTT {self.rtt_ms:.1f} ms: a bf16 exchange {self.exchange_seconds:.2f} s, "
            f"exchange / phase = {self.exchange_seconds / self.phase_seconds:.2f} by the model"
        )


@functools.cache
def _run_vocab_size() -> int:
    from noloco_node.model.run_model import load_run_corpus

    return load_run_corpus(DataConfig(), TrainConfig()).vocab_size


Curve = list[tuple[float, int, float]]  # (seconds since training started, inner step, validation loss)


@dataclass
class MethodRun:
    name: str
    inner_steps: int
    curve: Curve
    wall_seconds: float
    blends: int = 0  # NoLoCo: outer steps with a partner
    outer_steps: int = 0
    waited: float = 0.0  # mean fraction of wall time waiting at outer steps (NoLoCo) or in the barrier (DiLoCo)
    failed_rounds: int = 0  # hivemind: replica-rounds that found no full group and stepped on their own progress
    stopped: bool = False  # stopped at the race's time cap before its last step: the curve so far
    megabytes_sent: float = math.nan  # mean over the hosts of what each sent on its shaped link during the run
    megabytes_sent_per_host: list[float] = field(default_factory=list)  # each host's, in host order

    @property
    def final_loss(self) -> float:
        return self.curve[-1][2]

    def time_to(self, target: float) -> float | None:
        """When the curve first reaches ``target`` (linear between evaluations), or None if it never does."""
        previous: tuple[float, int, float] | None = None
        for point in self.curve:
            if point[2] <= target:
                if previous is None or previous[2] == point[2]:
                    return point[0]
                t0, _, l0 = previous
                t1, _, l1 = point
                return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
            previous = point
        return None


@dataclass
class RaceResult:
    nodes: int
    steps: int
    sigma: float
    emulation: Emulation
    pairwise_seconds: float = math.nan  # measured on the race's links before the race
    ring_seconds: float = math.nan
    runs: dict[str, MethodRun] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # method -> why it did not finish

    def report(self) -> str:
        emulation, deployment = self.emulation, self.emulation.deployment
        phase = emulation.phase_seconds
        lines = [
            deployment.describe(emulation.inner_steps),
            emulation.describe(),
            f"measured on these links, {self.nodes} hosts: a pairwise round {self.pairwise_seconds:.2f} s "
            f"(exchange / phase = {self.pairwise_seconds / phase:.2f}, the target's "
            f"{deployment.exchange_seconds() / (emulation.inner_steps * deployment.step_seconds):.2f}); a ring "
            f"all-reduce {self.ring_seconds:.2f} s (ring / phase = {self.ring_seconds / phase:.2f}, the target's "
            f"model {deployment.ring_seconds(self.nodes) / (emulation.inner_steps * deployment.step_seconds):.2f})",
            f"{self.nodes} replicas, {self.steps} inner steps each, step times x log-normal(sigma {self.sigma:g}, "
            "mean 1)",
        ]
        targets = {name: run.final_loss for name, run in self.runs.items() if name.startswith("diloco")}
        header = "| method | H | outer steps | blends | waiting | MB sent per host | final val loss | wall s |"
        rule = "|---|---:|---:|---:|---:|---:|---:|---:|"
        for name, target in targets.items():
            header += f" to {name}'s final {target:.4f}: s | sooner than {name} |"
            rule += "---:|---:|"
        # A fixed time budget: every method's loss when the first of them finished.
        budget = min((run.wall_seconds for run in self.runs.values()), default=0.0)
        header += f" val loss at {budget:.0f} s |"
        rule += "---:|"
        lines += [header, rule]
        for name, run in self.runs.items():
            blends = f"{run.blends}/{run.outer_steps}" if name.startswith("noloco") else "-"
            wall = f"{run.wall_seconds:.0f}" + (" (stopped)" if run.stopped else "")
            row = (
                f"| {name} | {run.inner_steps} | {run.outer_steps} | {blends} | {run.waited:.0%} | "
                f"{run.megabytes_sent:.1f} | {run.final_loss:.4f} | {wall} |"
            )
            for diloco, target in targets.items():
                reached, reference = run.time_to(target), self.runs[diloco].time_to(target)
                if reached is None:
                    row += f" not reached ({_loss_at(run, self.runs[diloco].wall_seconds)}) | - |"
                else:
                    ratio = f"{reference / reached:.2f}x" if reference else "-"
                    row += f" {reached:.0f} | {ratio} |"
            by_then = [loss for t, _, loss in run.curve if t <= budget + 1e-9]
            row += f" {by_then[-1]:.4f} |" if by_then else " - |"
            lines.append(row)
        lines.append(
            "sooner than X: X's time to its own final loss / this method's time to the same loss (above 1: sooner); "
            "val loss at T: each method's last evaluation by the time the first method finished"
        )
        lines += [
            f"{name}: {run.failed_rounds} of {self.nodes * run.outer_steps} replica-rounds found no full group and "
            "stepped on their own progress"
            for name, run in self.runs.items()
            if name.startswith("hivemind")
        ]
        lines += [
            f"{name}: stopped at the time cap after {run.curve[-1][1] if run.curve else 0} of {self.steps} inner "
            "steps; its final val loss is its last evaluation's"
            for name, run in self.runs.items()
            if run.stopped
        ]
        lines += [f"{name}: did not finish: {why}" for name, why in self.failed.items()]
        lines += [
            f"{name}: MB each host put on its shaped link: "
            + ", ".join(f"{megabytes:.2f}" for megabytes in run.megabytes_sent_per_host)
            for name, run in self.runs.items()
            if run.megabytes_sent_per_host
        ]
        return "\n".join(lines)


def _loss_at(run: MethodRun, seconds: float) -> str:
    """A run's loss at a time, for a method that never reached a target: what it had by then, or what it ended
    with if it finished sooner (its last loss is not a loss "at" a time it never ran to)."""
    if run.curve and run.curve[-1][0] < seconds:
        return f"{run.final_loss:.4f} at its end, {run.curve[-1][0]:.0f} s"
    before = [point for point in run.curve if point[0] <= seconds]
    return f"{before[-1][2]:.4f} at {seconds:.0f} s" if before else f"nothing by {seconds:.0f} s"


def swarm_curve(statuses: Sequence[dict], inner_steps: int) -> tuple[Curve, float]:
    """The swarm's curve (mean loss and mean time over the nodes at each outer step that at least half of them
    evaluated; a node that caught up skipped some) and the time its last node finished, from training's start."""
    started = min(s["training_started_at"] for s in statuses if s.get("training_started_at"))
    # By outer step, not by inner step: steps borrowed while waiting (--train-while-waiting) put a node's inner
    # step at its k-th outer step a few past k * H.
    points: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for status in statuses:
        for entry in status.get("history", []):
            points[entry["outer_step"]].append((entry["time"] - started, entry["val_loss"]))
    quorum = max(1, len(statuses) // 2)
    curve = [
        (statistics.fmean(t for t, _ in values), outer * inner_steps, statistics.fmean(loss for _, loss in values))
        for outer, values in sorted(points.items())
        if len(values) >= quorum
    ]
    finished = max(s["history"][-1]["time"] for s in statuses if s.get("history")) - started
    return curve, finished


def _node_args(result: RaceResult, method: str) -> list[str]:
    emulation = result.emulation
    mode, wire_dtype = NOLOCO_METHODS[method]
    link_bytes_per_second = emulation.rate_mbit * 1e6 / 8
    args = [
        "--model", emulation.model, "--steps", str(result.steps), "--inner-steps", str(emulation.inner_steps),
        "--log-every", "100000", "--wait-for-peers", str(result.nodes - 1), "--mode", mode,
        # deadlines: a transfer may run at a quarter of the link's rate before it counts as stalled; a partner is
        # waited for as long as a few exchanges take on this link
        "--min-link-rate", f"{link_bytes_per_second / 4:.0f}",
        "--pair-timeout", f"{max(10.0, 4 * emulation.exchange_seconds):.1f}", "--wire-dtype", wire_dtype,
    ]  # fmt: skip
    return args


def _noloco_run(net: ShapedNetwork, base: Path, result: RaceResult, method: str, deadline: float) -> MethodRun:
    drill = Drill(step_time_seconds=result.emulation.step_seconds, step_time_sigma=result.sigma).environment()
    args = _node_args(result, method)
    swarm = LocalSwarm(base, result.nodes, args, network=net, per_node_env=[drill] * result.nodes)
    try:
        while time.monotonic() < deadline and swarm.running():
            time.sleep(1.0)
        stopped = bool(swarm.running())
    finally:
        swarm.stop()
    statuses = [swarm.status(slot) or {} for slot in swarm.slots]
    unfinished = [slot.index for slot, s in zip(swarm.slots, statuses, strict=True) if not s.get("history")]
    if unfinished or swarm.slots[0].crashes:
        tail = swarm.logs(swarm.slots[unfinished[0] if unfinished else 0])[-3000:]
        raise RuntimeError(f"bench race: {method} node(s) {unfinished} did not train:\n{tail}")
    curve, finished = swarm_curve(statuses, result.emulation.inner_steps)
    histories = [s["history"] for s in statuses]
    waited = statistics.fmean(sum(h["wait_seconds"] for h in history) / finished for history in histories)
    return MethodRun(
        method,
        result.emulation.inner_steps,
        curve,
        finished,
        blends=sum(1 for history in histories for h in history if h["partner"]),
        outer_steps=sum(len(history) for history in histories),
        waited=waited,
        stopped=stopped,
    )


def _diloco_run(
    net: ShapedNetwork,
    base: Path,
    result: RaceResult,
    inner_steps: int,
    name: str,
    deadline: float,
    all_reduce: str = "gloo",
) -> MethodRun:
    emulation = result.emulation
    rendezvous = base / "rendezvous"
    shutil.rmtree(rendezvous, ignore_errors=True)
    rendezvous.mkdir(parents=True)
    common = [
        "--world", str(result.nodes), "--port", str(DILOCO_PORT), "--address", net.address(0),
        "--model", emulation.model, "--steps", str(result.steps), "--inner-steps", str(inner_steps),
        "--step-time-seconds", str(emulation.step_seconds), "--step-time-sigma", str(result.sigma),
        "--eval-batches", str(TrainConfig().eval_batches), "--all-reduce", all_reduce,
        "--rendezvous", str(rendezvous),
        "--matchmaking-seconds", f"{max(0.5, HIVEMIND_MATCHMAKING_SECONDS * emulation.scale):.2f}",
    ]  # fmt: skip
    base.mkdir(parents=True, exist_ok=True)
    logs = [(base / f"rank{rank}.log").open("w") for rank in range(result.nodes)]
    result_path = base / "rank0.json"
    workers: list[subprocess.Popen] = []
    try:
        for rank in range(result.nodes):
            command = [*net.exec_prefix(rank), sys.executable, "-m", "noloco_bench.diloco_worker"]
            command += ["--rank", str(rank), "--iface", net.device(rank), "--host", net.address(rank), *common]
            stdout = result_path.open("w") if rank == 0 else logs[rank]
            # a session of its own: hivemind's DHT and averager are child processes, and none may outlive the run
            workers.append(subprocess.Popen(command, stdout=stdout, stderr=logs[rank], start_new_session=True))
            if rank == 0:
                stdout.close()
        while time.monotonic() < deadline and any(w.poll() is None for w in workers):
            time.sleep(0.5)
        stopped = any(w.poll() is None for w in workers)
        codes = [0 if stopped else w.returncode for w in workers]
    finally:
        for worker in workers:  # on a timeout or an interrupt too: the rank and whatever it started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        for log in logs:
            log.close()
    if any(codes):
        failed = next(rank for rank, code in enumerate(codes) if code)
        raise RuntimeError(f"bench race: {name} rank {failed} exited {codes[failed]}:\n" + (
            (base / f"rank{failed}.log").read_text()[-3000:]))  # fmt: skip
    lines = [json.loads(line) for line in result_path.read_text().splitlines() if line.startswith("{")]
    points = [line for line in lines if "point" in line]
    if not stopped:
        measured = lines[-1]
        started = measured["started_at"]
        curve = [(t - started, step, loss) for t, step, loss in measured["curve"]]
        return MethodRun(
            name,
            inner_steps,
            curve,
            measured["seconds"],
            outer_steps=len(curve),
            waited=measured["barrier_seconds"] / measured["seconds"],
            failed_rounds=measured["failed_rounds"],
        )
    if not points:
        raise RuntimeError(f"bench race: {name} reached no outer step before the time cap")
    started = points[0]["started_at"]
    curve = [(t - started, step, loss) for t, step, loss in (line["point"] for line in points)]
    return MethodRun(  # rank 0's view of the time in the barrier: the others' totals are never printed
        name,
        inner_steps,
        curve,
        curve[-1][0],
        outer_steps=len(curve),
        waited=points[-1]["barrier_seconds"] / curve[-1][0],
        stopped=True,
    )


def run_race(
    nodes: int,
    steps: int,
    *,
    sigma: float = 1.0,
    inner_steps: int = 25,
    step_seconds: float = 0.3,
    model: str = "tiny",
    deployment: Deployment | None = None,
    methods: Sequence[str] = METHODS,
    out_dir: Path | None = None,
    progress: bool = True,
    time_cap_factor: float = 2.0,
) -> RaceResult:
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown race method(s) {unknown}; choose from {', '.join(METHODS)}")
    if not time_cap_factor > 0:
        raise ValueError(f"--time-cap-factor must be above 0, not {time_cap_factor}")
    emulation = Emulation(deployment or Deployment(), model, step_seconds, inner_steps)
    result = RaceResult(nodes, steps, sigma, emulation)

    def say(message: str) -> None:
        if progress:
            print(message, file=sys.stderr, flush=True)

    with (
        shaped_network(
            nodes, rate_mbit=emulation.rate_mbit, rtt_ms=emulation.rtt_ms, mtu=1500, prefix="nlr", control_plane=True
        ) as net,
        tempfile.TemporaryDirectory(prefix="noloco-race-") as tmp,
    ):
        work = out_dir / f"race-{nodes}-logs" if out_dir is not None else Path(tmp)  # kept: the nodes' logs
        say(emulation.describe())
        (row,) = measure_rounds(net, [emulation.payload_bytes / 2**20], warm_rounds=1, ring_rounds=1)
        result.pairwise_seconds, result.ring_seconds = row.pairwise_warm, row.ring
        say(f"links measured: a pairwise round {row.pairwise_warm:.2f} s, a ring all-reduce {row.ring:.2f} s")
        for method in methods:
            started = time.monotonic()
            # The time cap: a method still training after time_cap_factor x the longest run so far (start-up
            # allowed for) is stopped, and its curve so far is what it reached by then.
            finished = [run.wall_seconds for run in result.runs.values()]
            deadline = started + (time_cap_factor * max(finished) + STARTUP_ALLOWANCE if finished else 7200)
            sent_before = [net.bytes_sent(host) for host in range(nodes)]
            try:
                if method in NOLOCO_METHODS:
                    run = _noloco_run(net, work / method, result, method, deadline)
                else:
                    h = 2 * inner_steps if method.endswith("-2H") else inner_steps
                    all_reduce = "hivemind" if method.startswith("hivemind") else "gloo"
                    run = _diloco_run(net, work / method, result, h, method, deadline, all_reduce)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                # One method that cannot run at this size (hivemind's averager on too few cores, say) is reported
                # as such; the others' curves, an hour of measurement, are kept.
                why = str(error).strip().splitlines()
                result.failed[method] = f"{why[0] if why else type(error).__name__} (logs: {work / method})"
                say(f"{method}: did not finish: {str(error)[-3000:]}")
                continue
            sent = [net.bytes_sent(host) - before for host, before in enumerate(sent_before)]
            run.megabytes_sent = statistics.fmean(sent) / 1e6
            run.megabytes_sent_per_host = [host / 1e6 for host in sent]
            result.runs[method] = run
            say(f"{method}: final val loss {run.final_loss:.4f}, {run.wall_seconds:.0f} s of training "
                f"({time.monotonic() - started:.0f} s with start-up)")  # fmt: skip
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"race-{nodes}.json").write_text(
            json.dumps(
                {
                    "nodes": nodes,
                    "steps": steps,
                    "sigma": sigma,
                    "report": result.report(),
                    "runs": {name: run.curve for name, run in result.runs.items()},
                },
                indent=2,
            )
        )
        plot_race(result, out_dir / f"race-{nodes}.png")
    return result


def plot_race(result: RaceResult, path: Path) -> None:
    """Validation loss against wall-clock for every method, with DiLoCo's final losses as the targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, run in result.runs.items():
        times = [t for t, _, _ in run.curve]
        losses = [loss for _, _, loss in run.curve]
        line = ax.plot(times, losses, marker=".", label=f"{name} (H {run.inner_steps})")[0]
        if name.startswith("diloco"):
            ax.axhline(run.final_loss, color=line.get_color(), linestyle=":", linewidth=1)
    finals = [run.final_loss for run in result.runs.values()]
    ax.set_ylim(min(finals) - 0.1, max(finals) + 0.9)
    ax.set(
        xlabel="wall-clock since training started (s, emulated)",
        ylabel="validation loss (nats/token)",
        title=f"bench race: {result.nodes} replicas, sigma {result.sigma:g}, "
        f"exchange/phase {result.pairwise_seconds / result.emulation.phase_seconds:.2f}",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
