"""The ``noloco-node`` command line: ``swarm``, ``join``, ``bootstrap``, ``simulate``, ``train``, ``sizes`` and the
rest (cli_models.py adds ``data``, ``export``, ``eval`` and ``generate``).

Flags only override settings; every default and bound lives in config.py, so a bad value is reported by the
pydantic model with the field's name and nothing runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from noloco_node import __version__
from noloco_node.config.flags import (
    NODE_FLAGS,
    TRAIN_FLAGS,
    Flag,
    add_flags,
    as_arguments,
    flag_names,
    given_settings,
    subset,
)
from noloco_node.config.models import (
    ALL_METHODS,
    MODEL_SIZES,
    DataConfig,
    OuterConfig,
    SimulateConfig,
    TrainConfig,
    format_validation_error,
    model_config_for,
)
from noloco_node.config.settings import SettingsError
from noloco_node.data.corpus import DataError
from noloco_node.observability.logs import configure_logging
from noloco_node.observability.status_client import StatusClientError
from noloco_node.security.auth import SecretError, load_secret

# The flags of the settings (config/flags.py, generated from the models); `swarm` passes a few on to its nodes.
_TRAIN_FLAGS = TRAIN_FLAGS
_NODE_FLAGS = NODE_FLAGS
_SWARM_NODE_FLAGS = subset(
    NODE_FLAGS,
    ("--run-name", "--mode", "--pair-timeout", "--exchange-timeout", "--max-staleness", "--wire-dtype"),
) | subset(NODE_FLAGS, ("--secret-file",))


class _RefuseSecretInClear(argparse.Action):
    """``--secret VALUE`` would put the secret in the process list and shell history: refuse it, naming the ways
    that do not (and never echo the value)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any, **__: Any) -> None:
        parser.error(
            "the swarm secret is never given on the command line (ps and shell history would show it): use "
            "--secret-file PATH, NOLOCO_SWARM_SECRET_FILE=PATH or NOLOCO_SWARM_SECRET"
        )


def _add_secret_refusal(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--secret", "--swarm-secret", action=_RefuseSecretInClear, help=argparse.SUPPRESS)


def _resolve(args: argparse.Namespace, flags: Mapping[str, Flag]) -> tuple[Any, dict]:
    """Settings of --config < NOLOCO_* < flags (settings.py), and where each value came from."""
    from noloco_node.config.settings import resolve

    return resolve(getattr(args, "config", None), os.environ, given_settings(args, flags), flag_names=flag_names(flags))


def _with_environment(given: dict[str, Any]) -> dict[str, Any]:
    """Flags over NOLOCO_* variables, for the commands that take training settings without a node."""
    from noloco_node.config.settings import _merge, env_layer

    from_env, _ = env_layer(os.environ)
    return _merge({k: v for k, v in from_env.items() if k in ("train", "outer", "data")}, given)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="noloco-node", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"noloco-node {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="text lines, or one JSON object per line"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    simulate = commands.add_parser(
        "simulate",
        help="N replicas in one process: one method, or --compare them all",
        description="Train N replicas in one process with NoLoCo or a baseline; --compare runs every method on "
        "the same seeds, data and compute budget and prints a table.",
    )
    simulate.add_argument("--compare", action="store_true", help="run every method and print the comparison")
    simulate.add_argument("--method", choices=ALL_METHODS, help="run one method (default with no --compare: noloco)")
    simulate.add_argument("--methods", help=f"comma-separated subset for --compare (default: {','.join(ALL_METHODS)})")
    simulate.add_argument("--replicas", type=int, default=argparse.SUPPRESS, help="number of replicas")
    simulate.add_argument(
        "--seeds", type=int, help="--compare: repeat over this many seeds (from --seed) and report mean +- std"
    )
    simulate.add_argument("--replica-counts", help="--compare --seeds: replica counts to study, e.g. 4,8,16")
    simulate.add_argument("--out", type=Path, default=argparse.SUPPRESS, help="folder for metrics.json, curves.png")
    add_flags(simulate, _TRAIN_FLAGS)

    train = commands.add_parser(
        "train",
        help="train one replica alone (solo outer steps), with atomic checkpoints and resume",
        description="Train one replica with NoLoCo solo outer steps (no peers), checkpointing its full state; "
        "restarted with the same --checkpoint-dir it resumes where the last checkpoint left off.",
    )
    train.add_argument("--checkpoint-dir", type=Path, required=True, help="where checkpoint.pt is kept")
    train.add_argument("--checkpoint-every", type=int, default=50, help="inner steps between checkpoints")
    train.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint and start over")
    train.add_argument("--replica-index", type=int, default=0, help="which data shard this replica trains on")
    train.add_argument("--num-replicas", type=int, default=1, help="how many shards the corpus is dealt into")
    train.add_argument("--eval-every", type=int, default=0, help="inner steps between evaluations (0: each outer)")
    add_flags(train, _TRAIN_FLAGS)

    commands.add_parser("sizes", help="list the named model sizes and their parameter counts")

    join = commands.add_parser(
        "join",
        help="run a swarm member: train, find peers through the DHT, blend with them",
        description="Run the noloco-node daemon: it trains one replica and, at every outer step, blends with a "
        "random peer of the same run found through the DHT (--bootstrap).",
    )
    join.add_argument("--config", type=Path, help="a TOML or YAML settings file (flags and NOLOCO_* override it)")
    add_flags(join, _NODE_FLAGS)
    add_flags(join, _TRAIN_FLAGS)
    _add_secret_refusal(join)

    swarm = commands.add_parser(
        "swarm",
        help="the main job: a bootstrap peer and N node processes training together on this machine",
        description="Start a DHT bootstrap peer and N `noloco-node join` processes on 127.0.0.1, show their "
        "progress, stop them gracefully on Ctrl-C, and write a summary with each node's validation loss.",
    )
    swarm.add_argument("--nodes", type=int, default=4, help="number of node processes")
    swarm.add_argument("--out", type=Path, default=Path("runs/swarm"), help="logs, checkpoints, summary.json")
    swarm.add_argument("--resume", action="store_true", help="continue the swarm in --out instead of replacing it")
    swarm.add_argument("--config", type=Path, help="a TOML or YAML settings file given to every node")
    add_flags(swarm, _SWARM_NODE_FLAGS)
    add_flags(swarm, _TRAIN_FLAGS)
    _add_secret_refusal(swarm)

    bench = commands.add_parser("bench", help="benchmarks that print a figure next to a same-run reference")
    benches = bench.add_subparsers(dest="bench", required=True)
    exchange = benches.add_parser(
        "exchange",
        help="exchange a model's weights between two node processes, against raw TCP measured in the same run",
    )
    exchange.add_argument("--model", default="125m", choices=list(MODEL_SIZES), help="model size whose weights move")
    exchange.add_argument("--vocab-size", type=int, default=256, help="vocabulary of that model")
    exchange.add_argument("--wire-dtype", default="bf16", choices=["bf16", "fp32"])
    exchange.add_argument("--chunk-bytes", type=int, default=2**20, help="bytes per chunk message")
    exchange.add_argument("--repeats", type=int, default=5, help="runs of each measurement (the best is kept)")
    exchange.add_argument(
        "--link-rate", help="run over a veth pair shaped with tc tbf to this rate, e.g. 1gbit (needs root)"
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

    idle = benches.add_parser(
        "idle", help="the trainer's idle fraction per pairing mode in a local swarm, and a node's peak memory"
    )
    idle.add_argument("--nodes", type=int, default=4, help="nodes in the local swarm")
    idle.add_argument("--steps", type=int, default=600, help="inner steps each node trains")
    idle.add_argument("--model", default="tiny", choices=list(MODEL_SIZES), help="model size")
    idle.add_argument("--modes", default="sync,overlap", help="pairing modes to measure, comma-separated")

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

    train_bench = benches.add_parser(
        "train", help="training throughput (tokens/s) and MFU of a named model size on this device"
    )
    train_bench.add_argument("--model", default="small", choices=list(MODEL_SIZES), help="model size")
    train_bench.add_argument("--steps", type=int, default=20, help="measured inner steps (after 3 of warm-up)")
    train_bench.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    train_bench.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    train_bench.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")

    status = commands.add_parser(
        "status",
        help="one node's status as a readable table (from its status endpoint or its data directory)",
        description="Read GET /status of a running node (or status.json in a data directory), check it against "
        "the schema and print it; exit 1 when the node's /healthz would answer 503.",
    )
    source = status.add_mutually_exclusive_group()
    source.add_argument("--url", default="http://127.0.0.1:8470", help="the node's status endpoint")
    source.add_argument("--data-dir", type=Path, help="read status.json from this node data directory instead")
    status.add_argument("--json", action="store_true", help="print the status document as JSON")
    status.add_argument("--schema", action="store_true", help="print the status JSON Schema and exit")

    peers = commands.add_parser(
        "peers",
        help="the swarm as seen from the DHT: live peers of a run, their steps, addresses and record age",
        description="Join the DHT as a read-only client and list the live peers of a run. The run is given by "
        "--run-fingerprint, or taken (with the bootstrap addresses) from a node's status endpoint with --url.",
    )
    peers.add_argument("--bootstrap", nargs="*", default=[], help="multiaddrs of DHT peers")
    peers.add_argument("--run-fingerprint", help="the run (printed by `noloco-node status`)")
    peers.add_argument("--url", help="a node's status endpoint: its run and DHT addresses are used")
    peers.add_argument(
        "--secret-file", type=Path, help="a private run's secret: only records its members signed are listed"
    )
    _add_secret_refusal(peers)

    config = commands.add_parser(
        "config",
        help="the effective settings (file < NOLOCO_* < flags) and a commented example file",
        description="`config show` prints the settings a `join` with the same --config, environment and flags "
        "would run with, each value with where it came from (secrets never shown); `config init` writes a "
        "commented example settings file.",
    )
    config_commands = config.add_subparsers(dest="config_command", required=True)
    config_show = config_commands.add_parser("show", help="print the effective settings and their sources")
    config_show.add_argument("--config", type=Path, help="a TOML or YAML settings file")
    add_flags(config_show, _NODE_FLAGS)
    add_flags(config_show, _TRAIN_FLAGS)
    config_init = config_commands.add_parser("init", help="write a commented example settings file")
    config_init.add_argument("path", type=Path, nargs="?", help="where to write it (default: print it)")

    tls = commands.add_parser(
        "tls",
        help="make a private CA and node certificates for gRPC over mutual TLS",
        description="`tls init DIR` writes DIR/ca.pem and DIR/ca.key (keep ca.key off the nodes) and one certificate "
        "and key per --node name, valid as server and client for --server-name and any --host.",
    )
    tls_commands = tls.add_subparsers(dest="tls_command", required=True)
    tls_init = tls_commands.add_parser("init", help="write a CA and node certificates")
    tls_init.add_argument("out", type=Path, help="directory to write into")
    tls_init.add_argument("--node", action="append", default=[], help="a node certificate to make (repeatable)")
    tls_init.add_argument("--server-name", default="noloco-node", help="the name every node certificate carries")
    tls_init.add_argument("--host", action="append", default=[], help="an extra DNS name or IP for every certificate")

    bootstrap = commands.add_parser(
        "bootstrap",
        help="run a DHT-only bootstrap peer and print the multiaddrs to pass to --bootstrap",
        description="Run a Hivemind DHT peer that trains nothing; nodes of any run join the swarm through it.",
    )
    bootstrap.add_argument(
        "--host-maddrs",
        nargs="+",
        default=["/ip4/0.0.0.0/tcp/0"],
        help="multiaddrs to listen on, e.g. /ip4/0.0.0.0/tcp/31337",
    )
    bootstrap.add_argument("--announce-maddrs", nargs="+", help="multiaddrs to advertise (public address, port)")
    bootstrap.add_argument("--initial-peers", nargs="*", default=[], help="other bootstrap peers to connect to")
    bootstrap.add_argument(
        "--http-port",
        type=int,
        help="also serve the multiaddrs at http://HOST:PORT/maddrs, for --bootstrap http://... (containers)",
    )
    bootstrap.add_argument("--http-host", default="0.0.0.0", help="address the multiaddr book binds")

    from noloco_node.cli import model_commands as cli_models

    cli_models.add_parsers(commands, _add_secret_refusal)
    return parser


def _simulate(args: argparse.Namespace) -> int:
    from noloco_node.simulate.simulator import compare

    given = _with_environment(given_settings(args, _TRAIN_FLAGS))
    if args.compare:
        methods = args.methods.split(",") if args.methods else list(ALL_METHODS)
    else:
        if args.methods:
            raise SystemExit("noloco-node simulate: --methods needs --compare (use --method for a single one)")
        methods = [args.method or "noloco"]
    settings: dict[str, Any] = {
        "methods": methods,
        "train": given.get("train", {}),
        "outer": given.get("outer", {}),
        "data": given.get("data", {}),
    }
    if hasattr(args, "replicas"):
        settings["replicas"] = args.replicas
    if hasattr(args, "out"):
        settings["out_dir"] = args.out
    cfg = SimulateConfig(**settings)
    if args.seeds or args.replica_counts:
        from noloco_node.simulate.simulator import seed_study

        if not args.compare:
            raise SystemExit("noloco-node simulate: --seeds and --replica-counts need --compare")
        counts = [int(n) for n in args.replica_counts.split(",")] if args.replica_counts else [cfg.replicas]
        seeds = [cfg.train.seed + i for i in range(args.seeds or 1)]
        study = seed_study(cfg, seeds, counts)
        print(study.table())
        print(f"\nmetrics: {cfg.out_dir / 'study.json'}\ncurves:  {cfg.out_dir / 'study.png'}")
        return 0
    comparison = compare(cfg)
    print(comparison.table())
    print(f"\nmetrics: {cfg.out_dir / 'metrics.json'}\ncurves:  {cfg.out_dir / 'curves.png'}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from noloco_node.training.solo import run_training

    given = _with_environment(given_settings(args, _TRAIN_FLAGS))
    train_cfg = TrainConfig(**given.get("train", {}))
    outer_cfg = OuterConfig(**given.get("outer", {}))
    data_cfg = DataConfig(**given.get("data", {}))
    run_training(
        train_cfg,
        outer_cfg,
        data_cfg,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        fresh=args.fresh,
        replica_index=args.replica_index,
        num_replicas=args.num_replicas,
        eval_every=args.eval_every,
    )
    return 0


def _sizes(_args: argparse.Namespace) -> int:
    from noloco_node.model.decoder import parameter_count

    print(
        f"{'size':>6} {'hidden':>6} {'layers':>6} {'heads':>5} {'ffn':>6}  {'params (bytes)':>15} "
        f"{'params (32k vocab)':>19}"
    )
    for name, shape in MODEL_SIZES.items():
        byte_level = parameter_count(model_config_for(name, vocab_size=256, max_seq_len=128))
        llama_vocab = parameter_count(model_config_for(name, vocab_size=32000, max_seq_len=128))
        print(
            f"{name:>6} {shape['hidden_size']:>6} {shape['num_layers']:>6} {shape['num_heads']:>5} "
            f"{shape['intermediate_size']:>6}  {byte_level:>15,} {llama_vocab:>19,}"
        )
    return 0


def _join(args: argparse.Namespace) -> int:
    from noloco_node.node.daemon import run_node

    settings, _ = _resolve(args, {**_TRAIN_FLAGS, **_NODE_FLAGS})
    return run_node(settings.node, settings.train, settings.outer, settings.data)


def _swarm(args: argparse.Namespace) -> int:
    from noloco_node.launcher.swarm import run_swarm

    if args.nodes < 1:
        raise SystemExit("noloco-node swarm: --nodes must be at least 1")
    flags = {**_SWARM_NODE_FLAGS, **_TRAIN_FLAGS}
    # Validate everything here, before a single process starts; each node resolves again on its own (the nodes
    # inherit the environment and get --config passed through).
    _resolve(args, flags)
    passthrough: list[str] = ["--config", str(args.config)] if args.config else []
    passthrough += as_arguments(args, flags)
    return run_swarm(args.nodes, args.out, passthrough, resume=args.resume)


def _status(args: argparse.Namespace) -> int:
    from noloco_node.observability.status_client import fetch_status, format_status, read_status_file, status_schema

    if args.schema:
        print(status_schema())
        return 0
    status = read_status_file(args.data_dir) if args.data_dir else fetch_status(args.url)
    print(status.model_dump_json(indent=2) if args.json else format_status(status))
    return 0 if status.health.ok else 1


def _peers(args: argparse.Namespace) -> int:
    from noloco_node.observability.status_client import fetch_status, format_peers, list_peers

    bootstrap, fingerprint = list(args.bootstrap), args.run_fingerprint
    if args.url:
        status = fetch_status(args.url)
        bootstrap = bootstrap or status.dht_maddrs
        fingerprint = fingerprint or status.run_fingerprint
    if not fingerprint or not bootstrap:
        raise SystemExit("noloco-node peers: give --bootstrap and --run-fingerprint, or --url of a running node")
    secret = load_secret(args.secret_file)
    print(format_peers(list_peers(bootstrap, fingerprint, secret=secret), fingerprint))
    return 0


def _config(args: argparse.Namespace) -> int:
    from noloco_node.config.settings import example, show

    if args.config_command == "init":
        if args.path is None:
            print(example(), end="")
            return 0
        if args.path.exists():
            raise SystemExit(f"noloco-node config init: {args.path} exists; not overwriting it")
        args.path.write_text(example())
        print(f"wrote {args.path}")
        return 0
    settings, sources = _resolve(args, {**_TRAIN_FLAGS, **_NODE_FLAGS})
    print(show(settings, sources), end="")
    return 0


def _tls(args: argparse.Namespace) -> int:
    from noloco_node.security.tls import write_ca, write_node_cert

    ca_pem, ca_key = write_ca(args.out)
    print(f"CA: {ca_pem} (give it to every node as --tls-ca), {ca_key} (keep it off the nodes)")
    for name in args.node or ["node"]:
        cert, key = write_node_cert(
            args.out, name, ca_dir=args.out, server_name=args.server_name, hosts=tuple(args.host)
        )
        print(f"node {name}: --tls-cert {cert} --tls-key {key}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.bench == "chaos":
        from noloco_node.bench.chaos import run_chaos_bench

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
    if args.bench == "straggler":
        from noloco_node.bench.straggler import run_straggler_bench

        print(f"noloco-node bench straggler: {args.nodes} nodes + 1 at {args.slow_factor:g}x slower", flush=True)
        print(run_straggler_bench(args.nodes, args.slow_factor, args.steps, args.model).report())
        return 0
    if args.bench == "stragglers":
        from noloco_node.bench.stragglers import run_stragglers_bench

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
    if args.bench == "idle":
        from noloco_node.bench.idle import run_idle_bench

        print(f"noloco-node bench idle: {os.cpu_count()} CPUs", flush=True)
        modes = tuple(m for m in args.modes.split(",") if m)
        unknown = [m for m in modes if m not in ("sync", "overlap")]
        if unknown or not modes:
            raise SystemExit(f"noloco-node bench idle: --modes takes sync and/or overlap, not {args.modes!r}")
        print(run_idle_bench(args.nodes, args.steps, args.model, modes=modes).report())
        return 0
    if args.bench == "sync":
        from noloco_node.bench.sync import run_sync_bench

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
    if args.bench == "train":
        from noloco_node.bench.train import run_train_bench

        print(f"noloco-node bench train: {os.cpu_count()} CPUs, torch {__import__('torch').__version__}", flush=True)
        train_result = run_train_bench(
            args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, device=args.device
        )
        print(train_result.report())
        return 0
    if args.bench == "status":
        from noloco_node.bench.status import run_status_bench

        print(f"noloco-node bench status: model {args.model}, {os.cpu_count()} CPUs")
        status_result = run_status_bench(args.model, window=args.window, rounds=args.rounds, poll_hz=args.poll_hz)
        print(status_result.report())
        return 0
    from noloco_node.bench.exchange import run_exchange_bench

    result = run_exchange_bench(
        args.model,
        vocab=args.vocab_size,
        wire_dtype=args.wire_dtype,
        chunk_bytes=args.chunk_bytes,
        repeats=args.repeats,
        link_rate=args.link_rate,
    )
    where = f"a veth pair shaped to {args.link_rate}" if args.link_rate else "loopback"
    print(f"noloco-node bench exchange over {where}, {os.cpu_count()} CPUs")
    print(result.report(args.model, args.wire_dtype))
    return 0


def _bootstrap(args: argparse.Namespace) -> int:
    from noloco_node.discovery.bootstrap import run_bootstrap_peer

    http_bind = (args.http_host, args.http_port) if args.http_port is not None else None
    run_bootstrap_peer(args.host_maddrs, args.announce_maddrs, initial_peers=args.initial_peers, http_bind=http_bind)
    print("bootstrap peer stopped", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        from noloco_node.config.settings import env_layer

        env_layer(os.environ)  # an unknown NOLOCO_* variable is a typo: say so before anything runs
    except SettingsError as error:
        print(f"noloco-node: {error}", file=sys.stderr)
        return 2
    from noloco_node.cli import model_commands as cli_models

    handlers = {
        "simulate": _simulate,
        "train": _train,
        "sizes": _sizes,
        "bootstrap": _bootstrap,
        "join": _join,
        "swarm": _swarm,
        "bench": _bench,
        "status": _status,
        "peers": _peers,
        "tls": _tls,
        "config": _config,
        "data": cli_models.run_data,
        "export": lambda a: cli_models.run_export(a, lambda args: _resolve(args, {**_TRAIN_FLAGS, **_NODE_FLAGS})),
        "eval": cli_models.run_eval,
        "generate": cli_models.run_generate,
    }
    try:
        return handlers[args.command](args)
    except ValidationError as error:
        print(f"noloco-node {args.command}: bad configuration\n{format_validation_error(error)}", file=sys.stderr)
        return 2
    except (DataError, StatusClientError, SecretError, SettingsError) as error:
        print(f"noloco-node {args.command}: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        from noloco_node.node.daemon import NodeError

        if not isinstance(error, NodeError):
            raise
        print(f"noloco-node {args.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"noloco-node {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
