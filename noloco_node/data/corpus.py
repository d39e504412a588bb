"""Tokens in: the corpora a run trains on, and a disjoint, seeded shard of windows per replica.

Sources (``DataConfig.source``), tokenized with ``DataConfig.tokenizer`` (tokenizer.py; bytes by default):

- ``stdlib``, the embedded default: the ``.py`` sources of the running interpreter's standard library (real text
  that every machine with Python has; test suites and site-packages excluded), capped at ``max_bytes``. The
  train/validation split is by file (a stable hash of the path), and the tokenized result is cached on disk because
  reading thousands of files is slow.
- a folder written by ``noloco-node data prepare`` (token_store.py): memory-mapped token shards, its own tokenizer;
- a text, ``.jsonl`` or ``.parquet`` file, or a folder of them (documents.py): streamed through the same pipeline
  into a prepared folder in the cache (at most ``max_bytes`` of text), then memory-mapped;
- a pre-tokenized token file, memory-mapped: ``.npy`` (1-D, uint16/uint32) or raw ``.bin``/``.u16``/``.u32``.

Sharding: the training tokens are cut into fixed-size blocks; a seeded permutation deals the blocks round-robin to
replicas, so shards are disjoint and balanced whatever the file sizes. Each replica walks its own windows in a
fresh seeded order every epoch; its position is two integers, so a checkpoint resumes the data stream exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from noloco_node.config.models import DataConfig
from noloco_node.data.documents import dataset_files, iter_documents
from noloco_node.data.token_store import PREPARED_FORMAT, TokenShards, is_prepared, load_prepared, prepare_corpus
from noloco_node.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from noloco_node.errors import DataError

# Part of the cache key: bump it whenever the selection or split of the default corpus changes.
CORPUS_FORMAT = 2


__all__ = ["ByteTokenizer", "Corpus", "DataError", "ReplicaShard", "load_corpus", "validation_batches"]


# A stream of token ids: an array in memory, or prepared shards memory-mapped as one (data/token_store.py).
TokenStream = np.ndarray | TokenShards


@dataclass(frozen=True)
class Corpus:
    """Train and validation token streams (possibly memory-mapped) and what they came from."""

    train: TokenStream
    validation: TokenStream
    vocab_size: int
    description: str
    fingerprint: str
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)


# ---------------------------------------------------------------------------------------------------- sources


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> Corpus:
    """The corpus named by ``cfg.source``, tokenized with ``tokenizer`` (default: ``cfg.tokenizer``; a model's own
    tokenizer when eval reads text for it); raises DataError naming the file when it cannot be used."""
    explicit = tokenizer is not None or cfg.tokenizer is not None
    tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
    if cfg.source == "stdlib":
        if not explicit or tokenizer.fingerprint == "bytes":
            return load_stdlib_corpus(cfg)
        root, files = stdlib_source_files()
        ordered = sorted(files, key=lambda p: hashlib.sha256(b"order:" + str(p.relative_to(root)).encode()).digest())
        return _prepared_in_cache(ordered, cfg, tokenizer, f"Python {sys.version.split()[0]} standard library")
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise DataError(f"data source {str(path)!r} does not exist (use 'stdlib' for the embedded default corpus)")
    if is_prepared(path):
        prepared = load_prepared(path)
        if explicit and tokenizer.fingerprint != prepared.tokenizer.fingerprint:
            raise DataError(
                f"the tokenizer given ({tokenizer.fingerprint}) is not the one {str(path)!r} was prepared with "
                f"({prepared.tokenizer.fingerprint}); leave data.tokenizer unset: a prepared corpus carries its own"
            )
        return Corpus(
            prepared.train,
            prepared.validation,
            prepared.vocab_size,
            prepared.description,
            prepared.fingerprint,
            prepared.tokenizer,
        )
    if path.is_file() and (path.suffix in TOKEN_FILE_SUFFIXES or cfg.token_dtype is not None):
        return load_token_file(path, cfg)
    kind = "folder" if path.is_dir() else "file"
    return _prepared_in_cache(dataset_files(path), cfg, tokenizer, f"{kind} {path}")


def _prepared_in_cache(files: list[Path], cfg: DataConfig, tokenizer: Tokenizer, description: str) -> Corpus:
    """Stream text files through the prepare pipeline once into the cache (keyed by the files' names, sizes and
    times, the tokenizer and the split), then memory-map the result like any prepared corpus."""
    listing = []
    for path in files:
        try:
            stat = path.stat()
        except OSError as error:
            raise DataError(f"cannot read {str(path)!r}: {error.strerror}") from error
        listing.append((str(path.resolve()), stat.st_size, stat.st_mtime_ns))
    key_material = json.dumps(
        [PREPARED_FORMAT, listing, tokenizer.fingerprint, cfg.text_field, cfg.validation_fraction, cfg.max_bytes]
    )
    cache = _cache_dir(cfg) / f"prepared-{hashlib.sha256(key_material.encode()).hexdigest()[:16]}"
    if not is_prepared(cache):
        prepare_corpus(
            iter_documents(files, text_field=cfg.text_field),
            cache,
            tokenizer,
            files=len(files),
            description=description,
            validation_fraction=cfg.validation_fraction,
            max_bytes=cfg.max_bytes,
            overwrite_race_ok=True,
        )
    prepared = load_prepared(cache)
    return Corpus(
        prepared.train,
        prepared.validation,
        prepared.vocab_size,
        f"{description}, {len(files)} files, tokenized into {cache}",
        prepared.fingerprint,
        prepared.tokenizer,
    )


def stdlib_source_files() -> tuple[Path, list[Path]]:
    """The standard library directory and its .py files, excluding test suites and installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [
        path
        for path in root.rglob("*.py")
        if not excluded.intersection(path.relative_to(root).parts[:-1]) and path.is_file()
    ]
    return root, files


def load_stdlib_corpus(cfg: DataConfig) -> Corpus:
    """The embedded default corpus (the interpreter's own standard library sources), cached once tokenized."""
    root, files = stdlib_source_files()
    if not files:
        raise DataError(f"no .py files found in the standard library at {root}")
    listing = sorted((str(f.relative_to(root)), f.stat().st_size) for f in files)
    key_material = json.dumps(
        [CORPUS_FORMAT, sys.version, str(root), listing, cfg.max_bytes, cfg.validation_fraction],
        separators=(",", ":"),
    )
    key = hashlib.sha256(key_material.encode()).hexdigest()[:16]
    cache = _cache_dir(cfg) / f"stdlib-{key}"
    description = f"Python {sys.version.split()[0]} standard library ({root})"
    try:
        train = np.load(cache / "train.npy", mmap_mode="r")
        validation = np.load(cache / "validation.npy", mmap_mode="r")
        meta = json.loads((cache / "meta.json").read_text())
        return Corpus(train, validation, 256, f"{meta['description']} (cached in {cache})", key)
    except (OSError, ValueError, KeyError):
        pass  # not cached yet, or a partial cache: rebuild it
    corpus = _text_corpus_from_files(files, root, cfg, description=description)
    _write_cache(cache, corpus, {"description": corpus.description})
    return Corpus(corpus.train, corpus.validation, 256, corpus.description, key)


def _cache_dir(cfg: DataConfig) -> Path:
    if cfg.cache_dir is not None:
        return cfg.cache_dir
    env = os.environ.get("NOLOCO_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "noloco-node"


def _write_cache(cache: Path, corpus: Corpus, meta: dict[str, object]) -> None:
    """Write the cache into a temporary folder and rename it into place, so readers never see half of it."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
    assert isinstance(corpus.train, np.ndarray) and isinstance(corpus.validation, np.ndarray)  # cached: in memory
    np.save(staging / "train.npy", corpus.train)
    np.save(staging / "validation.npy", corpus.validation)
    (staging / "meta.json").write_text(json.dumps(meta))
    try:
        staging.rename(cache)
    except OSError:  # another process won the race: its cache is as good as ours
        for child in staging.iterdir():
            child.unlink()
        staging.rmdir()


def _choose_validation_files(sizes: dict[str, int], fraction: float) -> set[str]:
    """Whole files, picked in a stable hash order of their paths, until they hold ``fraction`` of the bytes.

    Picking by bytes rather than by a per-file coin keeps the split at the asked fraction even when a few files are
    very large; the order depends only on the paths, not on the machine or the listing order.
    """
    budget = fraction * sum(sizes.values())
    chosen: set[str] = set()
    used = 0
    for name in sorted(sizes, key=lambda n: hashlib.sha256(b"validation:" + n.encode()).digest()):
        if used + sizes[name] <= budget:
            chosen.add(name)
            used += sizes[name]
    return chosen


def _text_corpus_from_files(files: list[Path], root: Path, cfg: DataConfig, *, description: str) -> Corpus:
    """Read up to ``max_bytes`` of text files (a path-hash order, so the cap samples evenly) and split by file."""
    ordered = sorted(files, key=lambda p: hashlib.sha256(b"order:" + str(p.relative_to(root)).encode()).digest())
    contents: dict[str, bytes] = {}
    total = 0
    for path in ordered:
        if total >= cfg.max_bytes:
            break
        try:
            content = path.read_bytes()
        except OSError as error:
            raise DataError(f"cannot read {str(path)!r}: {error.strerror}") from error
        if content:
            contents[str(path.relative_to(root))] = content + b"\n"
            total += len(content) + 1
    if total == 0:
        raise DataError(f"{description}: the corpus is empty (no non-empty files)")
    validation_names = _choose_validation_files({n: len(c) for n, c in contents.items()}, cfg.validation_fraction)
    described = f"{description}, {len(contents)} files"
    if not validation_names or len(validation_names) == len(contents):
        # Too few files for a split by file: fall back to a split by position.
        return _split_by_position(np.frombuffer(b"".join(contents.values()), dtype=np.uint8), cfg, described)
    train = np.frombuffer(b"".join(c for n, c in contents.items() if n not in validation_names), dtype=np.uint8)
    validation = np.frombuffer(b"".join(c for n, c in contents.items() if n in validation_names), dtype=np.uint8)
    fingerprint = hashlib.sha256(train[:65536].tobytes() + validation[:65536].tobytes()).hexdigest()[:16]
    return Corpus(train, validation, 256, described, fingerprint)


def _split_by_position(tokens: np.ndarray, cfg: DataConfig, description: str, vocab_size: int = 256) -> Corpus:
    if len(tokens) < 64:
        raise DataError(f"{description}: only {len(tokens)} tokens, too few to train on")
    cut = len(tokens) - max(1, int(len(tokens) * cfg.validation_fraction))
    fingerprint = hashlib.sha256(np.asarray(tokens[:65536]).tobytes()).hexdigest()[:16]
    return Corpus(tokens[:cut], tokens[cut:], vocab_size, description, fingerprint)


TOKEN_FILE_SUFFIXES = {".npy", ".bin", ".u16", ".u32"}


def load_token_file(path: Path, cfg: DataConfig) -> Corpus:
    """A memory-mapped, pre-tokenized 1-D stream of uint16/uint32 token ids; the tail is validation."""
    try:
        if path.suffix == ".npy":
            tokens = np.load(path, mmap_mode="r")
        else:
            dtype = cfg.token_dtype or {".u16": "uint16", ".u32": "uint32"}.get(path.suffix)
            if dtype is None:
                raise DataError(f"token file {str(path)!r}: set data.token_dtype (uint16 or uint32) for raw .bin files")
            if path.stat().st_size % np.dtype(dtype).itemsize:
                raise DataError(f"token file {str(path)!r}: size is not a multiple of {dtype}")
            tokens = np.memmap(path, dtype=dtype, mode="r")
    except (OSError, ValueError) as error:
        if isinstance(error, DataError):
            raise
        raise DataError(f"cannot read token file {str(path)!r}: {error}") from error
    if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.uint32):
        raise DataError(
            f"token file {str(path)!r}: expected a 1-D uint16/uint32 array, got {tokens.dtype}{list(tokens.shape)}"
        )
    if len(tokens) == 0:
        raise DataError(f"token file {str(path)!r} is empty")
    largest = max(int(tokens[i : i + 2**24].max()) for i in range(0, len(tokens), 2**24))
    vocab_size = cfg.vocab_size or largest + 1
    if largest >= vocab_size:
        raise DataError(f"token file {str(path)!r} holds token id {largest}, outside data.vocab_size {vocab_size}")
    return _split_by_position(tokens, cfg, f"token file {path}", vocab_size=max(vocab_size, 2))


# ---------------------------------------------------------------------------------------------------- sharding


def _block_tokens(seq_len: int) -> int:
    """Size of the blocks dealt to replicas: big enough for several windows, small enough to balance shards."""
    return max(8192, 8 * (seq_len + 1))


class ReplicaShard:
    """One replica's disjoint slice of the training tokens, served as (inputs, targets) batches.

    Blocks of the training stream are dealt to replicas by a permutation seeded with ``seed``; the windows of a
    replica's blocks are visited in a fresh order each epoch, seeded by (seed, replica, epoch). ``position``
    (epoch, cursor) is all the state there is.
    """

    def __init__(self, tokens: TokenStream, *, replica: int, num_replicas: int, seq_len: int, seed: int) -> None:
        if not 0 <= replica < num_replicas:
            raise ValueError(f"replica {replica} is not in [0, {num_replicas})")
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.replica = replica
        block = _block_tokens(seq_len)
        num_blocks = len(tokens) // block
        if num_blocks < num_replicas:
            raise DataError(
                f"the training corpus has {len(tokens)} tokens: {num_blocks} blocks of {block}, fewer than the "
                f"{num_replicas} replicas; use a larger corpus or fewer replicas"
            )
        dealt = np.random.default_rng([seed, 0x5EED]).permutation(num_blocks)
        self.block_starts = np.sort(dealt[replica::num_replicas]) * block
        self.windows_per_block = (block - 1) // seq_len
        self.num_windows = len(self.block_starts) * self.windows_per_block
        self.epoch = 0
        self.cursor = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, self.replica, epoch]).permutation(self.num_windows)

    @property
    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def seek(self, position: dict[str, int]) -> None:
        self.epoch, self.cursor = int(position["epoch"]), int(position["cursor"])
        if not 0 <= self.cursor <= self.num_windows:
            raise ValueError(f"data position {position} is outside this shard ({self.num_windows} windows)")
        self._order = self._epoch_order(self.epoch)

    def window_start(self, window: int) -> int:
        block, offset = divmod(int(window), self.windows_per_block)
        return int(self.block_starts[block]) + offset * self.seq_len

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for _ in range(batch_size):
            if self.cursor == self.num_windows:
                self.epoch += 1
                self.cursor = 0
                self._order = self._epoch_order(self.epoch)
            start = self.window_start(self._order[self.cursor])
            rows.append(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
            self.cursor += 1
        batch = torch.from_numpy(np.stack(rows))
        return batch[:, :-1], batch[:, 1:]


def validation_batches(
    tokens: TokenStream, *, seq_len: int, batch_size: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches, evenly spaced over the validation stream, the same for every replica."""
    available = (len(tokens) - 1) // seq_len
    wanted = batch_size * num_batches
    if available < 1:
        raise DataError(f"the validation split has {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}")
    starts = np.linspace(0, (available - 1) * seq_len, num=min(wanted, available)).astype(np.int64) // seq_len
    rows = [np.asarray(tokens[s * seq_len : s * seq_len + seq_len + 1], dtype=np.int64) for s in starts]
    batches = []
    for i in range(0, len(rows), batch_size):
        chunk = torch.from_numpy(np.stack(rows[i : i + batch_size]))
        batches.append((chunk[:, :-1], chunk[:, 1:]))
    return batches
