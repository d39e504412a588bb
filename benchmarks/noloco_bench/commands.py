"""``noloco-node bench ...``: the benchmarks, each printing its figure next to a reference measured in the same run
(docs/benchmarks.md has the reports). The node's command line finds this through the ``noloco_node.commands``
entry point of the ``noloco-bench`` distribution (benchmarks/pyproject.toml): :data:`BENCH`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, get_args

from noloco_node.config.models import MODEL_SIZES
from noloco_node.config.node_config import DEFAULT_BUCKET_RECORDS, PairingMode

RACE_METHODS = (
    "noloco-sync",
    "noloco-stream",
    "noloco-sparse",
    "diloco-H",
    "diloco-2H",
    "hivemind-H",
)  # bench/race.py METHODS, without its imports


def add_bench_parsers(commands: Any) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print a figure next to a same-run reference")
    benches = bench.add_subparsers(dest="bench", required=True)
    exchange = benches.add_parser(
        "exchange",
        help="exchange a model's weights between two node processes, against raw TCP measured in the same run",
    )
    exchange.add_argument("--model", default="125m", choices=list(MODEL_SIZES), help="model size whose weights move")
    exchange.add_argument("--vocab-size", type=int, default=256, help="vocabulary of that model")
    exchange.add_argument(
        "--wire-dtype",
        default="bf16",
        type=_wire_dtypes,
        help="bf16, fp32, int8, int4 or sparse; several, comma-separated (e.g. bf16,int8,sparse), compares them in "
        "one run, with the bytes per parameter of each pairing mode",
    )
    exchange.add_argument("--chunk-bytes", type=int, default=2**20, help="bytes per chunk message")
    exchange.add_argument("--repeats", type=int, default=5, help="runs of each measurement (the best is kept)")
    exchange.add_argument(
        "--link-rate", help="run over a veth pair shaped with tc tbf to this rate, e.g. 1gbit (needs root)"
    )
    exchange.add_argument(
        "--rtt-ms",
        type=float,
        help="with --link-rate: two hosts of bench sync's shaped network, this round trip added by its delay router",
    )
    status_bench = benches.add_parser(
        "status",
        help="training throughput of a real node with and without a client polling /status 10 times a second",
    )
    status_bench.add_argument("--model", default="tiny", choices=list(MODEL_SIZES), help="model size the node trains")
    status_bench.add_argument("--window", type=float, default=20.0, help="seconds of each measured phase")
    status_bench.add_argument("--rounds", type=int, default=3, help="alternations of quiet and polled phases")
    status_bench.add_argument("--poll-hz", type=float, default=10.0, help="requests per second while polled")

    chaos = benches.add_parser(
        "chaos",
        help="a local swarm trains while nodes are SIGKILLed and come back; against the same run without faults",
    )
    chaos.add_argument("--minutes", type=float, default=4.0, help="length of the run without faults (and of the kills)")
    chaos.add_argument("--nodes", type=int, default=6, help="swarm size")
    chaos.add_argument("--model", default="tiny", choices=list(MODEL_SIZES), help="model size the swarm trains")
    chaos.add_argument("--kill-every", type=float, default=60.0, help="mean seconds between SIGKILLs")
    chaos.add_argument("--no-baseline", action="store_true", help="only the faulty run, for --minutes (a soak)")
    chaos.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    chaos.add_argument("--out", type=Path, help="keep logs, checkpoints and chaos.json here")

    outsider = benches.add_parser(
        "outsider",
        help="a local swarm trains while one outsider does every attack at once; against the same run without it",
    )
    outsider.add_argument("--nodes", type=int, default=3, help="honest nodes")
    outsider.add_argument("--model", default="tiny", choices=list(MODEL_SIZES), help="model size the swarm trains")
    outsider.add_argument("--steps", type=int, default=3000, help="inner steps each node trains (both runs)")
    outsider.add_argument("--inner-steps", type=int, default=50, help="H: inner steps between outer steps")
    outsider.add_argument(
        "--partition-seconds",
        type=float,
        default=0.0,
        help="cut the honest nodes into two halves this long, a tenth of the way in (network namespaces: root); "
        "give the run enough --steps to outlast it",
    )
    outsider.add_argument(
        "--namespaces",
        action="store_true",
        help="run on a network of namespaces (root): a /24 per honest node, and one for all the attackers",
    )
    outsider.add_argument(
        "--mode",
        default="sync",
        choices=["sync", "stream"],
        help="the swarm's pairing mode: stream takes the attacks on its phases (a key per node that reserves them, "
        "one that delivers progress shrinking the weights at 0.85 of the bound) instead of sync's",
    )
    outsider.add_argument("--wire-dtype", help="the swarm's wire dtype (default: the mode's)")
    outsider.add_argument("--out", type=Path, help="keep logs and checkpoints here (default: a temporary folder)")

    straggler = benches.add_parser(
        "straggler",
        help="the inner-step throughput of a swarm with one node N times slower, against the same swarm without it",
    )
    straggler.add_argument("--nodes", type=int, default=3, help="normal-speed nodes")
    straggler.add_argument("--slow-factor", type=float, default=5.0, help="how much slower the straggler is")
    straggler.add_argument("--steps", type=int, default=1000, help="inner steps each normal node trains")
    straggler.add_argument("--model", default="tiny", choices=list(MODEL_SIZES), help="model size")

    stragglers = benches.add_parser(
        "stragglers",
        help="log-normal step times: a swarm in sync and overlap mode against DiLoCo's global barrier",
    )
    stragglers.add_argument("--nodes", type=int, default=4, help="replicas in each run")
    stragglers.add_argument("--steps", type=int, default=200, help="inner steps each replica trains")
    stragglers.add_argument("--inner-steps", type=int, default=20, help="H: inner steps between outer steps")
    stragglers.add_argument("--step-seconds", type=float, default=0.1, help="mean time of one inner step")
    stragglers.add_argument("--sigma", type=float, default=0.5, help="log-normal sigma of the step times")
    stragglers.add_argument("--model", default="tiny", choices=list(MODEL_SIZES), help="model size")
    stragglers.add_argument("--modes", default="sync,overlap", help="pairing modes to measure, comma-separated")

    discovery = benches.add_parser(
        "discovery", help="one node's discovery bytes and CPU among 10, 1,000 and 10,000 live records, same run"
    )
    discovery.add_argument("--sizes", default="10,1000,10000", help="live records of each run, comma-separated")
    discovery.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    discovery.add_argument(
        "--bucket-records", type=int, default=DEFAULT_BUCKET_RECORDS, help="the runs' --bucket-records"
    )
    discovery.add_argument("--publishers", type=int, default=2, help="processes publishing each run's records")

    protocol = benches.add_parser(
        "protocol",
        help="the node's discovery, standing and pairing for 100-10,000 members in emulated time (no model)",
    )
    protocol.add_argument("--members", default="100,1000", help="honest members of each run, comma-separated")
    protocol.add_argument("--seconds", type=float, default=600.0, help="emulated seconds of each run")
    protocol.add_argument("--warmup", type=float, default=120.0, help="rounds opened before this are not counted")
    protocol.add_argument("--phase-seconds", type=float, default=30.0, help="an outer step's inner steps (s)")
    protocol.add_argument(
        "--hostile-shares", default="0.1,0", help="shares of the hosts that are hostile, a run of each, comma-separated"
    )
    protocol.add_argument("--keys-per-hostile", type=int, default=4, help="keys (records) of each hostile host")
    protocol.add_argument("--churn-per-hour", type=float, default=0.1, help="share of members leaving per hour")
    protocol.add_argument("--straggler-share", type=float, default=0.1, help="share of members that are slower")
    protocol.add_argument(
        "--bucket-records", type=int, default=DEFAULT_BUCKET_RECORDS, help="the run's --bucket-records"
    )
    protocol.add_argument(
        "--pairing",
        default="reserve,ready",
        help="how members pair, a run of each, comma-separated: reserve (draw, then meet, the node's rule: a partner "
        "asked during the phase, met at both outer steps), ready (sync mode's rule before: calls at the outer step "
        "to records flagged ready) or claimed (a candidate: reserve, a network group meeting one partner from outside "
        "it per outer step, claimed in the DHT), claimed-key (the same per key) or rendezvous (a candidate: meeting "
        "groups placed by a hash of each host's network group and the slot, each group paired by a rule every reader "
        "computes alike, one partner a host a slot)",
    )
    protocol.add_argument(
        "--partners",
        default="known,established",
        help="who is a partner on its group's share, a run of each, comma-separated: known (the node's rule: a "
        "record seen for --standing-seconds; a group once in G outer steps) or established (the node's rule before: "
        "the record seen for --standing-seconds and a blend; a group twice in 2G)",
    )
    protocol.add_argument("--seed", type=int, default=0)
    protocol.add_argument("--out", type=Path, default=None, help="folder for protocol.json and protocol.png")

    idle = benches.add_parser(
        "idle", help="the trainer's idle fraction per pairing mode in a local swarm, and a node's peak memory"
    )
    idle.add_argument("--nodes", type=int, default=4, help="nodes in the local swarm")
    idle.add_argument("--steps", type=int, default=600, help="inner steps each node trains")
    idle.add_argument("--model", default="tiny", choices=list(MODEL_SIZES), help="model size")
    idle.add_argument("--modes", default="sync,stream,overlap", help="pairing modes to measure, comma-separated")

    sync_bench = benches.add_parser(
        "sync",
        help="a NoLoCo pairwise exchange round against a ring all-reduce, N hosts on shaped links (needs root)",
    )
    sync_bench.add_argument("--nodes", default="4,8,16,32", help="host counts, comma-separated")
    sync_bench.add_argument("--sizes-mb", default="1,16,64", help="tensor sizes in MB, comma-separated")
    sync_bench.add_argument("--rate-mbit", type=float, default=100.0, help="each host's upload and download")
    sync_bench.add_argument("--rtt-ms", type=float, default=50.0, help="round-trip time between two hosts")
    sync_bench.add_argument("--jitter-ms", type=float, default=0.0, help="uniform +- jitter per packet and way")
    sync_bench.add_argument("--warm-rounds", type=int, default=2, help="pairwise rounds on pooled connections")
    sync_bench.add_argument("--ring-rounds", type=int, default=2, help="all-reduce rounds (the best is kept)")
    sync_bench.add_argument(
        "--no-hivemind", action="store_true", help="skip the hivemind all-reduce round (its matchmaking is slow)"
    )

    nat = benches.add_parser(
        "nat",
        help="the same six-member swarm without and with NATs (four members behind two home routers): blend rate, "
        "time per outer step, relayed bytes (needs root and nftables)",
    )
    nat.add_argument("--seconds", type=float, default=90.0, help="measured wall time of each swarm")
    nat.add_argument("--model", default="tiny", choices=list(MODEL_SIZES), help="model size")
    nat.add_argument("--inner-steps", type=int, default=50, help="inner steps per outer step")
    nat.add_argument("--rate-mbit", type=float, default=100.0, help="each uplink's rate")
    nat.add_argument("--rtt-ms", type=float, default=20.0, help="round-trip time between two public addresses")
    nat.add_argument("--out", type=Path, default=None, help="keep the nodes' logs and status files here")

    race = benches.add_parser(
        "race",
        help="time to quality: NoLoCo swarms against DiLoCo on shaped links scaled from a target deployment (root)",
    )
    race.add_argument("--nodes", default="16", help="replica counts, comma-separated (one race each)")
    race.add_argument("--steps", type=int, default=500, help="inner steps each replica trains")
    race.add_argument("--inner-steps", type=int, default=25, help="H of NoLoCo and of diloco-H (diloco-2H: 2H)")
    race.add_argument("--step-seconds", type=float, default=0.3, help="emulated mean time of one inner step")
    race.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the step times")
    race.add_argument("--methods", default=",".join(RACE_METHODS), help="methods to race, comma-separated")
    race.add_argument("--target-model", default="125m", choices=list(MODEL_SIZES), help="the deployment's model")
    race.add_argument(
        "--target-tokens-per-step", type=int, default=524_288, help="the deployment's tokens per inner step"
    )
    race.add_argument("--target-tflops", type=float, default=989.0, help="its accelerator's bf16 peak (H100 SXM)")
    race.add_argument("--target-mfu", type=float, default=0.40, help="the MFU assumed of the deployment")
    race.add_argument("--target-rate-mbit", type=float, default=100.0, help="the deployment's links")
    race.add_argument("--target-rtt-ms", type=float, default=50.0, help="the deployment's round-trip time")
    race.add_argument(
        "--time-cap-factor",
        type=float,
        default=2.0,
        help="stop a method still training after this many times the longest run before it (its curve so far is "
        "reported)",
    )
    race.add_argument("--out", type=Path, default=Path("runs/race"), help="race-N.json and race-N.png go here")

    sapo = benches.add_parser(
        "sapo",
        help="RL with shared rollouts (SAPO): cumulative reward per local/external mix, and a skill across families",
    )
    sapo.add_argument("--nodes", type=int, default=4, help="RL node processes in each swarm (at least 4)")
    sapo.add_argument("--rounds", type=int, default=40, help="updates each node makes")
    sapo.add_argument("--seeds", default="0,1,2", help="seeds, comma-separated (at least 3 for a spread)")
    sapo.add_argument(
        "--mixes", default="8/0,6/2,4/4,2/6", help="I/J configurations, comma-separated ('': the families only)"
    )
    sapo.add_argument("--format-steps", type=int, default=200, help="supervised warm-up steps of each node")
    sapo.add_argument("--no-families", action="store_true", help="skip the different-families configuration")
    sapo.add_argument("--out", type=Path, default=Path("runs/bench-sapo"), help="sapo.json and the plot")

    train_bench = benches.add_parser(
        "train", help="training throughput (tokens/s) and MFU of a named model size on this device"
    )
    train_bench.add_argument("--model", default="small", choices=list(MODEL_SIZES), help="model size")
    train_bench.add_argument("--steps", type=int, default=20, help="measured inner steps (after --warmup more)")
    train_bench.add_argument("--warmup", type=int, default=3, help="inner steps before the measured ones")
    _add_step_shape(train_bench)
    train_bench.add_argument("--vocab-size", type=int, default=256, help="vocabulary (32000: a real tokenizer's)")
    train_bench.add_argument("--micro-batch", type=int, default=None, help="sequences per pass (default: the plan's)")
    train_bench.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="torch.compile blocks")
    train_bench.add_argument(
        "--no-reference", action="store_true", help="skip the eager, unplanned step measured beside the plan"
    )

    outer_bench = benches.add_parser(
        "outer-step", help="an outer step and its upkeep (gather, blend, adopt, snapshot) as a share of the phase"
    )
    outer_bench.add_argument("--model", default="small", choices=list(MODEL_SIZES), help="model size")
    outer_bench.add_argument("--inner-steps", type=int, default=50, help="H: the inner steps of a phase")
    _add_step_shape(outer_bench)


def _add_step_shape(parser: argparse.ArgumentParser) -> None:
    """The inner step's shape and device, as `bench train` and `bench outer-step` take them."""
    parser.add_argument(
        "--batch-size", type=int, default=None, help="sequences per inner step (default: 256 on a GPU, 8 on a CPU)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (default: 1024 on a GPU, 256 on a CPU)"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")


def run_bench(args: argparse.Namespace) -> int:
    if args.bench == "chaos":
        from noloco_bench.chaos import run_chaos_bench

        print(f"noloco-node bench chaos: {args.nodes} nodes, model {args.model}, {os.cpu_count()} CPUs", flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
        chaos_result = run_chaos_bench(
            minutes=args.minutes,
            nodes=args.nodes,
            model=args.model,
            kill_every=args.kill_every,
            baseline=not args.no_baseline,
            seed=args.seed,
            out=args.out,
        )
        print(chaos_result.report())
        return 0
    if args.bench == "nat":
        import tempfile

        from noloco_bench.nat import report, run_nat_bench

        print(
            f"noloco-node bench nat: model {args.model}, {args.inner_steps} inner steps per outer step, "
            f"{args.rate_mbit:g} Mbit/s uplinks, {args.rtt_ms:g} ms RTT, {args.seconds:g} s measured per swarm, "
            f"{os.cpu_count()} CPUs",
            flush=True,
        )
        with tempfile.TemporaryDirectory(prefix="noloco-nat-") as scratch:
            results = run_nat_bench(
                seconds=args.seconds,
                model=args.model,
                inner_steps=args.inner_steps,
                rate_mbit=args.rate_mbit,
                rtt_ms=args.rtt_ms,
                out=args.out or Path(scratch),
            )
        print(report(results))
        return 0 if all(code == 0 for r in results for code in r.exit_codes) else 1
    if args.bench == "outsider":
        import tempfile

        from noloco_bench.outsider_swarm import SwarmShape, run_outsider_bench

        print(
            f"noloco-node bench outsider: {args.nodes} honest nodes, model {args.model}, {args.steps} inner steps, "
            f"mode {args.mode}{f', wire {args.wire_dtype}' if args.wire_dtype else ''}, {os.cpu_count()} CPUs",
            flush=True,
        )
        with tempfile.TemporaryDirectory(prefix="noloco-outsider-") as scratch:
            out = args.out or Path(scratch)
            print(
                run_outsider_bench(
                    SwarmShape(
                        args.nodes,
                        args.model,
                        args.steps,
                        args.inner_steps,
                        args.partition_seconds,
                        args.namespaces,
                        args.mode,
                        args.wire_dtype,
                    ),
                    out=out,
                ).report()
            )
        return 0
    if args.bench == "straggler":
        from noloco_bench.straggler import run_straggler_bench

        print(f"noloco-node bench straggler: {args.nodes} nodes + 1 at {args.slow_factor:g}x slower", flush=True)
        print(run_straggler_bench(args.nodes, args.slow_factor, args.steps, args.model).report())
        return 0
    if args.bench == "stragglers":
        from noloco_bench.stragglers import run_stragglers_bench

        print(f"noloco-node bench stragglers: {os.cpu_count()} CPUs", flush=True)
        stragglers_result = run_stragglers_bench(
            args.nodes,
            args.steps,
            args.inner_steps,
            args.step_seconds,
            args.sigma,
            args.model,
            modes=tuple(m for m in args.modes.split(",") if m),
        )
        print(stragglers_result.report())
        return 0
    if args.bench == "discovery":
        from noloco_bench.discovery_cost import run_discovery_bench

        sizes = sorted({int(n) for n in args.sizes.split(",") if n.strip()})
        print(f"noloco-node bench discovery: {os.cpu_count()} CPUs, runs of {', '.join(map(str, sizes))} records")
        cost = run_discovery_bench(
            sizes, seconds=args.seconds, bucket_records=args.bucket_records, publishers=args.publishers
        )
        print(cost.report())
        return 0
    if args.bench == "protocol":
        from noloco_bench.swarm_protocol import ProtocolSettings, run_protocol_bench

        settings = ProtocolSettings(
            members=0,
            seconds=args.seconds,
            warmup=args.warmup,
            phase_seconds=args.phase_seconds,
            keys_per_hostile=args.keys_per_hostile,
            churn_per_hour=args.churn_per_hour,
            straggler_share=args.straggler_share,
            bucket_records=args.bucket_records,
            seed=args.seed,
        )
        return run_protocol_bench(
            [int(n) for n in args.members.split(",") if n.strip()],
            [float(x) for x in args.hostile_shares.split(",") if x.strip()],
            [p.strip() for p in args.pairing.split(",") if p.strip()],
            [p.strip() for p in args.partners.split(",") if p.strip()],
            settings,
            args.out,
        )
    if args.bench == "idle":
        from noloco_bench.idle import run_idle_bench

        print(f"noloco-node bench idle: {os.cpu_count()} CPUs", flush=True)
        modes = tuple(m for m in args.modes.split(",") if m)
        unknown = [m for m in modes if m not in get_args(PairingMode)]
        if unknown or not modes:
            raise SystemExit(
                f"noloco-node bench idle: --modes takes {', '.join(get_args(PairingMode))} (comma-separated), "
                f"not {args.modes!r}"
            )
        print(run_idle_bench(args.nodes, args.steps, args.model, modes=modes).report())
        return 0
    if args.bench == "sync":
        from noloco_bench.sync import run_sync_bench

        print(
            f"noloco-node bench sync: {os.cpu_count()} CPUs, hosts {args.nodes}, tensors {args.sizes_mb} MB", flush=True
        )
        sync_result = run_sync_bench(
            [int(n) for n in args.nodes.split(",")],
            [float(s) for s in args.sizes_mb.split(",")],
            rate_mbit=args.rate_mbit,
            rtt_ms=args.rtt_ms,
            jitter_ms=args.jitter_ms,
            warm_rounds=args.warm_rounds,
            ring_rounds=args.ring_rounds,
            hivemind=not args.no_hivemind,
        )
        print(sync_result.report())
        return 0
    if args.bench == "race":
        from noloco_bench.race import METHODS, Deployment, run_race

        deployment = Deployment(
            model=args.target_model,
            tokens_per_step=args.target_tokens_per_step,
            peak_tflops=args.target_tflops,
            mfu=args.target_mfu,
            rate_mbit=args.target_rate_mbit,
            rtt_ms=args.target_rtt_ms,
        )
        methods = [m for m in args.methods.split(",") if m]
        unknown = sorted(set(methods) - set(METHODS))
        problem = (
            f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}"
            if unknown
            else f"--time-cap-factor must be above 0, not {args.time_cap_factor}"
            if not args.time_cap_factor > 0
            else None
        )
        if problem:  # before any namespace exists: bad input changes nothing
            print(f"noloco-node bench race: {problem}", file=sys.stderr)
            return 2
        for count in [int(n) for n in args.nodes.split(",")]:
            print(f"noloco-node bench race: {count} replicas, {os.cpu_count()} CPUs", flush=True)
            race_result = run_race(
                count,
                args.steps,
                sigma=args.sigma,
                inner_steps=args.inner_steps,
                step_seconds=args.step_seconds,
                deployment=deployment,
                methods=methods,
                out_dir=args.out,
                time_cap_factor=args.time_cap_factor,
            )
            print(race_result.report(), flush=True)
            print(f"curves: {args.out / f'race-{count}.png'}", flush=True)
        return 0
    if args.bench == "sapo":
        from noloco_bench.sapo import run_sapo_bench

        mixes = tuple(tuple(int(x) for x in mix.split("/")) for mix in args.mixes.split(",") if mix)
        seeds = [int(seed) for seed in args.seeds.split(",")]
        print(
            f"noloco-node bench sapo: {args.nodes} nodes, {args.rounds} rounds, mixes {args.mixes}, seeds {seeds}, "
            f"{os.cpu_count()} CPUs",
            flush=True,
        )
        sapo_result = run_sapo_bench(
            nodes=args.nodes,
            rounds=args.rounds,
            seeds=seeds,
            mixes=mixes,  # type: ignore[arg-type]
            families=not args.no_families,
            format_steps=args.format_steps,
            out=args.out,
        )
        print(sapo_result.report())
        plotted = f"plot: {args.out / 'sapo-mixes.png'}, " if mixes else ""
        print(f"{plotted}figures: {args.out / 'sapo.json'}", flush=True)
        return 0
    if args.bench == "train":
        from noloco_bench.train import run_train_bench

        print(f"noloco-node bench train: {os.cpu_count()} CPUs, torch {__import__('torch').__version__}", flush=True)
        train_result = run_train_bench(
            args.model,
            steps=args.steps,
            warmup=args.warmup,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            vocab_size=args.vocab_size,
            micro_batch=args.micro_batch,
            compile=args.compile,
            device=args.device,
            reference=not args.no_reference,
        )
        print(train_result.report())
        return 0
    if args.bench == "outer-step":
        from noloco_bench.outer_step import run_outer_step_bench

        outer_result = run_outer_step_bench(
            args.model,
            inner_steps=args.inner_steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            device=args.device,
        )
        print(outer_result.report())
        return 0
    if args.bench == "status":
        from noloco_bench.status import run_status_bench

        print(f"noloco-node bench status: model {args.model}, {os.cpu_count()} CPUs")
        status_result = run_status_bench(args.model, window=args.window, rounds=args.rounds, poll_hz=args.poll_hz)
        print(status_result.report())
        return 0
    if len(args.wire_dtype) > 1 or args.rtt_ms is not None:
        from noloco_bench.exchange import run_wire_dtype_comparison

        print(f"noloco-node bench exchange, {os.cpu_count()} CPUs")
        comparison = run_wire_dtype_comparison(
            args.model,
            args.wire_dtype,
            vocab=args.vocab_size,
            chunk_bytes=args.chunk_bytes,
            repeats=args.repeats,
            link_rate=args.link_rate,
            rtt_ms=args.rtt_ms,
        )
        print(comparison.report())
        return 0
    from noloco_bench.exchange import run_exchange_bench

    result = run_exchange_bench(
        args.model,
        vocab=args.vocab_size,
        wire_dtype=args.wire_dtype[0],
        chunk_bytes=args.chunk_bytes,
        repeats=args.repeats,
        link_rate=args.link_rate,
    )
    where = f"a veth pair shaped to {args.link_rate}" if args.link_rate else "loopback"
    print(f"noloco-node bench exchange over {where}, {os.cpu_count()} CPUs")
    print(result.report(args.model, args.wire_dtype[0]))
    return 0


def _wire_dtypes(text: str) -> list[str]:
    """``--wire-dtype``: one wire dtype, or several to compare."""
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [part for part in chosen if part not in ("bf16", "fp32", "int8", "int4", "sparse")]
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown wire dtype {', '.join(unknown) or text!r}: use bf16, fp32, int8, int4, sparse"
        )
    return chosen


class _BenchCommand:
    """What ``noloco-node`` asks of a command another distribution adds (noloco_node/cli/main.py)."""

    name = "bench"

    @staticmethod
    def add_parser(commands: Any) -> None:
        add_bench_parsers(commands)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        return run_bench(args)


BENCH = _BenchCommand()
