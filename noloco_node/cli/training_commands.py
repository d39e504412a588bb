"""``noloco-node simulate``, ``train`` and ``sizes``: training without a swarm (the algorithm study, a solo run, the
model sizes)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from noloco_node.config.flags import TRAIN_FLAGS, add_flags, given_settings
from noloco_node.config.models import (
    ALL_METHODS,
    MODEL_SIZES,
    WIRE_METHODS,
    DataConfig,
    OuterConfig,
    SimulateConfig,
    TrainConfig,
    model_config_for,
)


def _with_environment(given: dict[str, Any]) -> dict[str, Any]:
    """Flags over NOLOCO_* variables, for the commands that take training settings without a node."""
    from noloco_node.config.settings import _merge, env_layer

    from_env, _ = env_layer(os.environ)
    return _merge({k: v for k, v in from_env.items() if k in ("train", "outer", "data")}, given)


def add_training_parsers(commands: Any) -> None:
    simulate = commands.add_parser(
        "simulate",
        help="N replicas in one process: one method, or --compare them all",
        description="Train N replicas in one process with NoLoCo or a baseline; --compare runs every method on "
        "the same seeds, data and compute budget and prints a table.",
    )
    simulate.add_argument("--compare", action="store_true", help="run every method and print the comparison")
    simulate.add_argument(
        "--method", choices=ALL_METHODS + WIRE_METHODS, help="run one method (default with no --compare: noloco)"
    )
    simulate.add_argument(
        "--methods",
        help=f"comma-separated methods for --compare (default: {','.join(ALL_METHODS)}; also "
        f"{','.join(WIRE_METHODS)}: what each wire dtype and the stream mode cost)",
    )
    simulate.add_argument("--replicas", type=int, default=argparse.SUPPRESS, help="number of replicas")
    simulate.add_argument(
        "--seeds", type=int, help="--compare: repeat over this many seeds (from --seed) and report mean +- std"
    )
    simulate.add_argument("--replica-counts", help="--compare --seeds: replica counts to study, e.g. 4,8,16")
    simulate.add_argument("--out", type=Path, default=argparse.SUPPRESS, help="folder for metrics.json, curves.png")
    add_flags(simulate, TRAIN_FLAGS)

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
    add_flags(train, TRAIN_FLAGS)

    commands.add_parser("sizes", help="list the named model sizes and their parameter counts")


def run_simulate(args: argparse.Namespace) -> int:
    from noloco_node.simulate.simulator import compare

    given = _with_environment(given_settings(args, TRAIN_FLAGS))
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
        from noloco_node.simulate.study import seed_study

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


def run_train(args: argparse.Namespace) -> int:
    from noloco_node.training.solo import run_training

    given = _with_environment(given_settings(args, TRAIN_FLAGS))
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


def run_sizes(_args: argparse.Namespace) -> int:
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
