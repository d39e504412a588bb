"""The ``noloco-node`` commands for data in and models out: ``data prepare``, ``data tokenizer``, ``export``,
``eval`` and ``generate`` (main.py holds the node commands and the shared flag tables)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from noloco_node.config.flags import NODE_FLAGS, TRAIN_FLAGS, add_flags
from noloco_node.config.models import DataConfig


def add_parsers(commands: Any, add_secret_refusal: Any) -> None:
    data = commands.add_parser(
        "data",
        help="tokenize a corpus once into memory-mapped shards, or train a tokenizer on it",
        description="`data prepare` streams .txt/.jsonl/.parquet files (or folders of them) through a tokenizer "
        "into token shards every node memory-maps (--data DIR); `data tokenizer` trains a byte-level BPE "
        "tokenizer.json on local text.",
    )
    data_commands = data.add_subparsers(dest="data_command", required=True)
    prepare = data_commands.add_parser("prepare", help="tokenize a corpus into a prepared folder")
    prepare.add_argument("source", help="a .txt/.jsonl/.parquet file or a folder of them ('stdlib': the default)")
    prepare.add_argument("--out", type=Path, required=True, help="the prepared folder to write (must not exist)")
    prepare.add_argument("--tokenizer", type=Path, help="a tokenizers tokenizer.json (default: UTF-8 bytes)")
    prepare.add_argument("--text-field", default="text", help="the .jsonl field or .parquet column with the text")
    prepare.add_argument("--validation-fraction", type=float, default=0.05, help="share of documents held out")
    prepare.add_argument("--max-bytes", type=int, help="stop after this many bytes of text (default: all)")
    prepare.add_argument("--shard-tokens", type=int, default=2**28, help="largest token count of one shard file")

    tokenizer = data_commands.add_parser("tokenizer", help="train a byte-level BPE tokenizer.json on local text")
    tokenizer.add_argument("source", help="a .txt/.jsonl/.parquet file or a folder of them ('stdlib': the default)")
    tokenizer.add_argument("--out", type=Path, required=True, help="the tokenizer.json to write")
    tokenizer.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size (bytes + merges + 1)")
    tokenizer.add_argument("--text-field", default="text", help="the .jsonl field or .parquet column with the text")
    tokenizer.add_argument("--max-bytes", type=int, default=256 * 2**20, help="text read to learn the merges")

    export = commands.add_parser(
        "export",
        help="write a model (safetensors + Llama config) from a checkpoint or a consensus of live peers",
        description="Write model.safetensors, config.json (LlamaForCausalLM), noloco.json and the tokenizer. "
        "--from self: one replica's checkpoint (--checkpoint, default the node's --data-dir). --from swarm: the "
        "equal-weight average of --peers K live peers' slow weights, found through --bootstrap with the run's "
        "settings (the same --config and flags as `join`).",
    )
    export.add_argument("--from", dest="source", choices=["self", "swarm"], default="self")
    export.add_argument("--out", type=Path, required=True, help="the folder to write (must not exist)")
    export.add_argument("--checkpoint", type=Path, help="--from self: a checkpoint.pt or a folder with one")
    export.add_argument(
        "--weights", choices=["slow", "fast"], default="slow", help="--from self: phi (slow) or theta (fast)"
    )
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="dtype of the file")
    export.add_argument("--peers", type=int, default=3, help="--from swarm: how many live peers to average")
    export.add_argument("--wait", type=float, default=30.0, help="--from swarm: seconds to wait for enough peers")
    export.add_argument(
        "--eval", action="store_true", help="--from swarm: also evaluate every member and the consensus"
    )
    export.add_argument("--config", type=Path, help="the run's TOML or YAML settings file (as for join)")
    export.add_argument(
        "--url", help="--from swarm: a running node's status endpoint: its DHT addresses are used as --bootstrap"
    )
    add_flags(export, NODE_FLAGS)
    add_flags(export, TRAIN_FLAGS)
    add_secret_refusal(export)

    evaluate = commands.add_parser(
        "eval",
        help="validation loss and perplexity of an exported model or a checkpoint on a dataset",
        description="Evaluate MODEL (an exported folder, a checkpoint.pt or a node's data dir) on the validation "
        "split of --data (default: the embedded corpus), tokenized with the model's own tokenizer.",
    )
    evaluate.add_argument("model", type=Path, help="an exported folder, a checkpoint.pt, or a folder with one")
    evaluate.add_argument("--weights", choices=["slow", "fast"], default="slow", help="for a checkpoint")
    evaluate.add_argument("--data", default="stdlib", help="a prepared folder, .txt/.jsonl/.parquet, or stdlib")
    evaluate.add_argument("--text-field", default="text", help="the .jsonl field or .parquet column with the text")
    evaluate.add_argument("--split", choices=["validation", "train"], default="validation")
    evaluate.add_argument("--seq-len", type=int, help="tokens per window (default: the model's max_seq_len)")
    evaluate.add_argument("--batch-size", type=int, default=8)
    evaluate.add_argument("--batches", type=int, default=32, help="windows evaluated = batches x batch size")
    evaluate.add_argument("--device", default="auto")
    evaluate.add_argument("--cache-dir", type=Path, help="where a text source's tokens are cached")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")

    generate = commands.add_parser(
        "generate", help="sample text from an exported model or a checkpoint (temperature, top-k)"
    )
    generate.add_argument("model", type=Path, help="an exported folder, a checkpoint.pt, or a folder with one")
    generate.add_argument("--prompt", default="", help="text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=200)
    generate.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    generate.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--samples", type=int, default=1, help="independent continuations to print")
    generate.add_argument("--weights", choices=["slow", "fast"], default="slow", help="for a checkpoint")
    generate.add_argument("--device", default="auto")


def run_data(args: argparse.Namespace) -> int:
    from noloco_node.data.documents import dataset_files, iter_documents
    from noloco_node.data.tokenizer import load_tokenizer, train_bpe_tokenizer

    if args.source == "stdlib":
        from noloco_node.data.corpus import stdlib_source_files

        _, files = stdlib_source_files()
        files = sorted(files)
        described = "the Python standard library"
    else:
        files = dataset_files(Path(args.source))
        described = args.source
    if args.data_command == "tokenizer":
        texts = _capped_texts(iter_documents(files, text_field=args.text_field), args.max_bytes)
        trained = train_bpe_tokenizer(texts, vocab_size=args.vocab_size, out=args.out)
        print(f"wrote {args.out}: byte-level BPE, vocabulary {trained.vocab_size}, from {described}")
        return 0
    from noloco_node.data.token_store import prepare_corpus

    if not 0 < args.validation_fraction < 0.5:
        raise SystemExit("noloco-node data prepare: --validation-fraction must be in (0, 0.5)")
    summary = prepare_corpus(
        iter_documents(files, text_field=args.text_field),
        args.out,
        load_tokenizer(args.tokenizer),
        files=len(files),
        description=described,
        validation_fraction=args.validation_fraction,
        max_bytes=args.max_bytes,
        shard_tokens=args.shard_tokens,
    )
    print(summary.report())
    print(f"train on it with: noloco-node join --data {args.out} ...  (every node reads the same folder)")
    return 0


def _capped_texts(pieces: Any, max_bytes: int) -> Any:
    used = 0
    for _, text in pieces:
        if used >= max_bytes:
            return
        used += len(text)
        yield text


def run_export(args: argparse.Namespace, resolve: Any) -> int:
    from noloco_node.model.export import ExportedWeights, checkpoint_weights, write_export

    settings, _ = resolve(args)
    if args.source == "self":
        weights = checkpoint_weights(args.checkpoint or settings.node.data_dir, weights=args.weights)
        write_export(args.out, weights, dtype=args.dtype)
        print(
            f"wrote {args.out}: {weights.provenance['weights']} of {weights.provenance['source']} "
            f"(outer step {weights.provenance['outer_step']}, inner step {weights.provenance['inner_step']})"
        )
        return 0
    from noloco_node.model.run_model import load_run_corpus
    from noloco_node.node.consensus import ConsensusError, fetch_consensus
    from noloco_node.node.run_layout import RunLayout

    corpus = load_run_corpus(settings.data, settings.train)
    layout = RunLayout.of(settings.node, settings.train, settings.outer, corpus)
    source, fingerprint = layout.source, layout.run_fingerprint
    node_cfg = settings.node
    if args.url:
        from noloco_node.observability.status_client import fetch_status

        status = fetch_status(args.url)
        if status.run_fingerprint != fingerprint:
            raise SystemExit(
                f"noloco-node export: the node at {args.url} trains run {status.run_fingerprint}, these settings "
                f"give run {fingerprint}: pass the run's --config (or its --model, --seq-len, --seed, --run-name, "
                "--data/--tokenizer and its run-wide training settings: --steps, --inner-steps, --lr, ...)"
            )
        node_cfg = node_cfg.model_copy(update={"bootstrap": list(node_cfg.bootstrap) or list(status.dht_maddrs)})
    print(f"run {fingerprint}: model {source.name}, {corpus.description}", flush=True)
    try:
        consensus = fetch_consensus(
            node_cfg,
            source,
            fingerprint,
            start=layout.start,
            peers=args.peers,
            wait=args.wait,
            progress=_flushed_print,
        )
    except ConsensusError as error:
        raise SystemExit(f"noloco-node export: {error}") from None
    weights = ExportedWeights(source, consensus.names, consensus.tensors, corpus.tokenizer)
    if args.eval:
        _evaluate_consensus(consensus, weights, corpus, settings.train)
    weights.provenance = {**consensus.provenance(), "run_fingerprint": fingerprint}
    print(consensus.report())
    write_export(args.out, weights, dtype=args.dtype)
    print(f"wrote {args.out}")
    return 0


def _flushed_print(line: str) -> None:
    print(line, flush=True)


def _evaluate_consensus(consensus: Any, weights: Any, corpus: Any, train_cfg: Any) -> None:
    from noloco_node.model.export import ExportedWeights
    from noloco_node.model.inference import evaluate

    def loss_of(candidate: ExportedWeights) -> float:
        return evaluate(
            candidate.model(),
            corpus,
            seq_len=train_cfg.seq_len,
            batch_size=train_cfg.batch_size,
            num_batches=train_cfg.eval_batches,
        ).loss

    for member, tensors in zip(consensus.members, consensus.member_weights, strict=True):
        member.val_loss = loss_of(ExportedWeights(weights.source, weights.names, tensors, weights.tokenizer))
    consensus.val_loss = loss_of(weights)


def _load_model(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from noloco_node.model.export import load_any
    from noloco_node.training.replica import resolve_device

    loaded = load_any(args.model, weights=args.weights)
    return loaded, loaded.model(), resolve_device(args.device)


def run_eval(args: argparse.Namespace) -> int:
    from noloco_node.data.corpus import load_corpus
    from noloco_node.model.inference import check_compatible, evaluate

    loaded, model, device = _load_model(args)
    seq_len = args.seq_len or model.max_seq_len
    data_cfg = DataConfig(source=args.data, text_field=args.text_field, cache_dir=args.cache_dir)
    corpus = load_corpus(data_cfg, tokenizer=loaded.tokenizer)
    check_compatible(model, loaded.tokenizer, corpus, seq_len)
    result = evaluate(
        model,
        corpus,
        seq_len=seq_len,
        batch_size=args.batch_size,
        num_batches=args.batches,
        split=args.split,
        device=device,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(args.model),
                    "data": corpus.description,
                    "split": result.split,
                    "loss": result.loss,
                    "perplexity": result.perplexity,
                    "tokens": result.tokens,
                }
            )
        )
    else:
        print(f"model {args.model} on {corpus.description}")
        print(result.report())
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from noloco_node.model.inference import generate

    loaded, model, device = _load_model(args)
    for sample in range(args.samples):
        text = generate(
            model,
            loaded.tokenizer,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            seed=args.seed + sample,
            device=device,
        )
        if args.samples > 1:
            print(f"--- sample {sample + 1} (seed {args.seed + sample})")
        print(args.prompt + text)
    return 0
