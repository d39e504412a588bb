"""The ``noloco-node`` command line: ``swarm``, ``join``, ``bootstrap``, ``simulate``, ``train``, ``sizes`` and the
rest (model_commands.py adds ``data``, ``export``, ``eval`` and ``generate``).

Flags only override settings; every default and bound lives in config/models.py and config/node_config.py, so a
bad value is reported by the pydantic model with the field's name and nothing runs.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from noloco_node import __version__
from noloco_node.cli.training_commands import add_training_parsers, run_simulate, run_sizes, run_train
from noloco_node.config.flags import (
    NODE_FLAGS,
    RL_FLAGS,
    TRAIN_FLAGS,
    Flag,
    add_flags,
    as_arguments,
    flag_names,
    given_settings,
    subset,
)
from noloco_node.config.models import format_validation_error
from noloco_node.config.settings import SettingsError
from noloco_node.data.corpus import DataError
from noloco_node.logs import configure_logging
from noloco_node.observability.status_client import StatusClientError
from noloco_node.security.auth import SecretError, load_secret

# The flags of the settings (config/flags.py, generated from the models); `swarm` passes a few on to its nodes.
_TRAIN_FLAGS = TRAIN_FLAGS
_NODE_FLAGS = NODE_FLAGS
_SWARM_NODE_FLAGS = subset(
    NODE_FLAGS,
    (
        "--run-name",
        "--mode",
        "--pair-timeout",
        "--exchange-timeout",
        "--max-staleness",
        "--wire-dtype",
        "--blend-momenta",
        "--bucket-records",
    ),
) | subset(NODE_FLAGS, ("--secret-file",))
# `rl` trains a policy, not a replica: of the training flags it takes only those that say which model, where, and
# of the node's those of the network, the identity and the status endpoint (no pairing, no checkpoints).
_RL_MODEL_FLAGS = subset(TRAIN_FLAGS, ("--model", "--init-from", "--tokenizer", "--seq-len", "--seed", "--device"))
_RL_NODE_FLAGS = subset(
    NODE_FLAGS,
    (
        "--run-name",
        "--bootstrap",
        "--bootstrap-wait",
        "--dht-host-maddrs",
        "--dht-announce-maddrs",
        "--grpc-host",
        "--grpc-port",
        "--announce-host",
        "--announce-port",
        "--data-dir",
        "--record-ttl",
        "--torch-threads",
        "--status-host",
        "--status-port",
        "--secret-file",
        "--max-clock-skew",
        "--tls-cert",
        "--tls-key",
        "--tls-ca",
        "--tls-server-name",
        "--max-calls-per-address",
    ),
)


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


def plugin_commands() -> list[Any]:
    """Commands that other installed distributions add, through the entry points of group ``noloco_node.commands``:
    the benchmarks (benchmarks/, the ``noloco-bench`` distribution) add ``bench``. Each entry point is an object
    with ``name``, ``add_parser(commands)`` and ``run(args) -> int``; without them installed the node has none."""
    from importlib.metadata import entry_points

    return [entry.load() for entry in entry_points(group="noloco_node.commands")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="noloco-node", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"noloco-node {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="text lines, or one JSON object per line"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_training_parsers(commands)
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

    rl = commands.add_parser(
        "rl",
        help="RL post-training with shared rollouts (SAPO): generate, score, share, fetch, update with GRPO",
        description="Run an RL node: it samples G completions per question of reasoning-gym tasks, scores them with "
        "the tasks' verifiers, serves them to the swarm (the DHT names the round, gRPC carries the rollouts), "
        "fetches peers' rollouts and scores them itself, and updates its own policy with GRPO on I local and J "
        "external rollouts per round (--local, --external). No weights cross; peers may run other models.",
    )
    rl.add_argument("--config", type=Path, help="a TOML or YAML settings file (flags and NOLOCO_* override it)")
    add_flags(rl, _RL_NODE_FLAGS)
    add_flags(rl, _RL_MODEL_FLAGS)
    add_flags(rl, RL_FLAGS)
    _add_secret_refusal(rl)

    doctor = commands.add_parser(
        "doctor",
        help="check what would stop `join` with these settings: bootstrap, ports, address, clock, memory, torch",
        description="Run the checks of a first join without joining: this machine (torch build and device, host and "
        "device memory for the model, disk, announced address, gRPC port) and the network (bootstrap peers, the "
        "DHT, the run's peers and whether they refuse these settings, the clock, whether peers see this machine "
        "at its announced address). Each failed check says how to fix it; exit 1 when any failed.",
    )
    doctor.add_argument("--config", type=Path, help="a TOML or YAML settings file (flags and NOLOCO_* override it)")
    doctor.add_argument("--json", action="store_true", help="print the checks as a JSON list")
    doctor.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GIB",
        help="plan the step for a GPU of this much memory (GiB) instead of this machine's: what fits on that card",
    )
    add_flags(doctor, _NODE_FLAGS)
    add_flags(doctor, _TRAIN_FLAGS)
    _add_secret_refusal(doctor)

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
    for plugin in plugin_commands():
        plugin.add_parser(commands)

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

    contributions = commands.add_parser(
        "contributions",
        help="who contributed what to a run: the ledger rebuilt from receipts both partners signed",
        description="Rebuild each member's outer steps blended, tokens, exchanges, partners and first and last "
        "seen from exchange receipts alone (each signed by both partners; docs/security.md, 'Receipts and the "
        "ledger'), and say which receipts were refused and why. Receipts are read from node data directories or "
        "receipts.jsonl files, and from the run's live members, found through the DHT (--bootstrap and "
        "--run-fingerprint, or --url of a running node) and asked over gRPC.",
    )
    contributions.add_argument("paths", nargs="*", type=Path, help="node data directories, or receipts.jsonl files")
    contributions.add_argument("--bootstrap", nargs="*", default=[], help="multiaddrs of DHT peers")
    contributions.add_argument("--run-fingerprint", help="the run (default: the run most receipts name)")
    contributions.add_argument("--url", help="a node's status endpoint: its run and DHT addresses are used")
    contributions.add_argument(
        "--secret-file", type=Path, help="a private run's secret: its members answer only calls that prove it"
    )
    _add_secret_refusal(contributions)
    contributions.add_argument("--json", action="store_true", help="print the ledger as JSON")

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


def _join(args: argparse.Namespace) -> int:
    from noloco_node.node.launch import run_node

    settings, _ = _resolve(args, {**_TRAIN_FLAGS, **_NODE_FLAGS})
    return run_node(settings.node, settings.train, settings.outer, settings.data)


def _rl(args: argparse.Namespace) -> int:
    from noloco_node.rl.node import run_rl_node

    settings, _ = _resolve(args, {**_RL_NODE_FLAGS, **_RL_MODEL_FLAGS, **RL_FLAGS})
    return run_rl_node(settings.node, settings.train, settings.data, settings.rl)


def _doctor(args: argparse.Namespace) -> int:
    import json

    from noloco_node.model.run_model import load_run_corpus
    from noloco_node.node.doctor import run_doctor
    from noloco_node.node.run_layout import RunLayout

    settings, _ = _resolve(args, {**_TRAIN_FLAGS, **_NODE_FLAGS})
    layout = RunLayout.of(settings.node, settings.train, settings.outer, load_run_corpus(settings.data, settings.train))
    if args.gpu_memory is not None and args.gpu_memory <= 0:
        raise SystemExit("noloco-node doctor: --gpu-memory must be a positive number of GiB")
    gpu_memory = int(args.gpu_memory * 2**30) if args.gpu_memory is not None else None
    checks = run_doctor(settings.node, layout, settings.train, gpu_memory)
    if args.json:
        print(json.dumps([c.__dict__ for c in checks], indent=2))
    else:
        print("\n".join(c.line() for c in checks))
    return 1 if any(c.level == "fail" for c in checks) else 0


def _swarm(args: argparse.Namespace) -> int:
    from noloco_node.launcher.swarm import run_swarm

    if args.nodes < 1:
        raise SystemExit("noloco-node swarm: --nodes must be at least 1")
    flags = {**_SWARM_NODE_FLAGS, **_TRAIN_FLAGS}
    # Validate everything here, before a single process starts; each node resolves again on its own (the nodes
    # inherit the environment and get --config passed through).
    settings, _sources = _resolve(args, flags)
    _warn_if_the_nodes_do_not_fit_together(settings, args.nodes, args.out)
    passthrough: list[str] = ["--config", str(args.config)] if args.config else []
    passthrough += as_arguments(args, flags)
    return run_swarm(args.nodes, args.out, passthrough, resume=args.resume)


def _warn_if_the_nodes_do_not_fit_together(settings: Any, nodes: int, out_dir: Path) -> None:
    """Host memory and disk for every node of a local swarm together, with the numbers (nothing is refused: each
    node checks itself alone again at start). Named sizes on the byte vocabulary only: another tokenizer's size is
    known once its corpus is read."""
    train, data = settings.train, settings.data
    if train.init_from is not None or data.tokenizer is not None or data.vocab_size is not None:
        return
    import torch

    from noloco_node.config.models import model_config_for
    from noloco_node.data.tokenizer import ByteTokenizer
    from noloco_node.model.decoder import parameter_count
    from noloco_node.node.machine_checks import nodes_together

    cfg = model_config_for(train.model_size, vocab_size=ByteTokenizer.vocab_size, max_seq_len=train.seq_len)
    on_gpu = train.device != "cpu" and torch.cuda.is_available()
    for check in nodes_together(parameter_count(cfg), on_gpu, nodes, out_dir):
        print(f"warning: {check.line()}", flush=True)


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


def _contributions(args: argparse.Namespace) -> int:
    from noloco_node.observability.ledger import (
        LedgerSourceError,
        build_ledger,
        format_ledger,
        ledger_json,
        read_receipt_files,
        read_swarm_receipts,
    )
    from noloco_node.observability.status_client import fetch_status

    bootstrap, fingerprint = list(args.bootstrap), args.run_fingerprint
    quarantined: dict[str, str] = {}
    if args.url:
        status = fetch_status(args.url)
        bootstrap = bootstrap or status.dht_maddrs
        fingerprint = fingerprint or status.run_fingerprint
        quarantined = status.quarantined_peers  # shown apart in the ledger, counted all the same
    if not args.paths and not bootstrap:
        raise SystemExit("noloco-node contributions: give data directories, --bootstrap (with the run), or --url")
    if bootstrap and not fingerprint:
        raise SystemExit("noloco-node contributions: reading the swarm needs --run-fingerprint (or --url)")
    missed: list[str] = []
    try:
        sources = list(read_receipt_files(args.paths))
        if bootstrap:
            swarm, missed = read_swarm_receipts(bootstrap, fingerprint, secret=load_secret(args.secret_file))
            sources += swarm
    except LedgerSourceError as error:
        print(f"noloco-node contributions: {error}", file=sys.stderr)
        return 2
    ledger = build_ledger(sources, run=fingerprint, quarantined=quarantined)
    print(ledger_json(ledger) if args.json else format_ledger(ledger))
    for problem in missed:  # a member not read is credited by its partners' copies: said, not fatal
        print(f"not read: {problem}", file=sys.stderr)
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


def _bootstrap(args: argparse.Namespace) -> int:
    from noloco_node.node.bootstrap import run_bootstrap_peer

    http_bind = (args.http_host, args.http_port) if args.http_port is not None else None
    run_bootstrap_peer(args.host_maddrs, args.announce_maddrs, initial_peers=args.initial_peers, http_bind=http_bind)
    print("bootstrap peer stopped", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # A crash in native code (torch, grpc) then leaves every thread's Python stack in the log: a member of a
    # 32-member local swarm died of SIGSEGV on its way out, and its log said nothing.
    if sys.__stderr__ is not None:  # the process's own stderr (a test may have replaced sys.stderr)
        faulthandler.enable(sys.__stderr__)
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
        "simulate": run_simulate,
        "train": run_train,
        "sizes": run_sizes,
        "bootstrap": _bootstrap,
        "join": _join,
        "rl": _rl,
        "doctor": _doctor,
        "swarm": _swarm,
        **{plugin.name: plugin.run for plugin in plugin_commands()},
        "status": _status,
        "peers": _peers,
        "contributions": _contributions,
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
        from noloco_node.node.catch_up import NodeError

        if not isinstance(error, NodeError):
            raise
        print(f"noloco-node {args.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"noloco-node {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
