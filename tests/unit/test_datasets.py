"""Real data in: a tokenizer trained here, .txt/.jsonl/.parquet documents streamed through `data prepare` into
memory-mapped shards, and a clear error naming the file for every kind of bad input."""

from __future__ import annotations

import json
import math
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from noloco_node.config.models import DataConfig, TrainConfig, model_config_for
from noloco_node.data.corpus import ReplicaShard, load_corpus, stdlib_source_files, validation_batches
from noloco_node.data.documents import dataset_files, iter_documents
from noloco_node.data.token_store import TokenShards, load_prepared, prepare_corpus
from noloco_node.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe_tokenizer
from noloco_node.errors import DataError
from noloco_node.model.source import SeededDecoder
from noloco_node.training.replica import Replica


def _documents(count: int = 120) -> list[str]:
    """Real, varied text: the bodies of standard-library modules, each cut to a few KB."""
    _, files = stdlib_source_files()
    texts = [p.read_text(errors="replace")[:3000] for p in sorted(files)[: count * 2]]
    return [t for t in texts if t.strip()][:count]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(_documents(200), vocab_size=400, out=out)
    return out


def test_a_trained_tokenizer_loads_by_path_and_round_trips(tokenizer_path: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_path)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size == 400
    text = "def héllo(x):\n    return x * 2  # ✓\n"
    ids = tokenizer.encode(text)
    assert len(ids) < len(text.encode()) and ids.max() < 400
    assert tokenizer.decode(ids) == text  # byte-level BPE is lossless
    assert tokenizer.document_separator == [tokenizer._tokenizer.token_to_id("<|endoftext|>")]
    assert load_tokenizer(tokenizer_path.parent).fingerprint == tokenizer.fingerprint  # a folder holding one
    assert tokenizer.fingerprint != ByteTokenizer().fingerprint


def _write_formats(folder: Path, docs: list[str]) -> dict[str, Path]:
    txt = folder / "txt"
    txt.mkdir()
    for i, doc in enumerate(docs):
        (txt / f"doc{i:04d}.txt").write_text(doc)
    jsonl = folder / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    parquet = folder / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), parquet, row_group_size=17)
    return {"txt": txt, "jsonl": jsonl, "parquet": parquet}


@pytest.mark.parametrize("tokenizer_kind", ["bpe", "bytes"])
def test_jsonl_and_parquet_give_the_same_token_stream_as_the_same_text_in_txt(
    tmp_path: Path, tokenizer_path: Path, tokenizer_kind: str
) -> None:
    docs = _documents(120)
    sources = _write_formats(tmp_path, docs)
    tokenizer = str(tokenizer_path) if tokenizer_kind == "bpe" else None
    corpora = {
        kind: load_corpus(
            DataConfig(source=str(path), tokenizer=tokenizer, text_field="body", cache_dir=tmp_path / "cache")
        )
        for kind, path in sources.items()
    }
    reference = corpora["txt"]
    assert len(reference.validation) > 0 and len(reference.train) > 5 * len(reference.validation)
    for kind in ("jsonl", "parquet"):
        assert np.array_equal(np.asarray(corpora[kind].train), np.asarray(reference.train)), kind
        assert np.array_equal(np.asarray(corpora[kind].validation), np.asarray(reference.validation)), kind
    # and the stream is exactly the documents, each followed by the separator, split by whole documents
    tok = reference.tokenizer
    joined = np.concatenate([np.asarray(reference.train), np.asarray(reference.validation)])
    expected_tokens = sum(len(tok.encode(d)) + len(tok.document_separator) for d in docs)
    assert len(joined) == expected_tokens
    if tokenizer_kind == "bpe":
        text = tok.decode(np.asarray(reference.train))
        train_docs = [d for d in docs if d in text]
        assert 0 < len(train_docs) < len(docs)  # each document lies wholly in one split


def test_prepare_writes_memory_mapped_shards_that_nodes_read(tmp_path: Path, tokenizer_path: Path) -> None:
    docs = _documents(150)
    tokenizer = load_tokenizer(tokenizer_path)
    summary = prepare_corpus(
        ((True, d) for d in docs), tmp_path / "prep", tokenizer, files=1, description="test", shard_tokens=5000
    )
    train_files = sorted((tmp_path / "prep").glob("train-*.bin"))
    assert len(train_files) >= 5 and summary.tokens["train"] > 20000
    assert (tmp_path / "prep" / "tokenizer.json").read_text() == tokenizer.json_text
    prepared = load_prepared(tmp_path / "prep")
    assert isinstance(prepared.train, TokenShards) and len(prepared.train) == summary.tokens["train"]
    assert prepared.train.dtype == np.uint16
    whole = np.concatenate([np.fromfile(f, dtype=np.uint16) for f in train_files])
    for start, stop in [(0, 10), (4990, 5010), (4999, 15001), (len(whole) - 7, len(whole))]:
        assert np.array_equal(prepared.train[start:stop], whole[start:stop])  # slices across shard files
    assert int(prepared.train[5000]) == int(whole[5000])
    # a node's shard of it: disjoint windows, batches of real token ids
    corpus = load_corpus(DataConfig(source=str(tmp_path / "prep")))
    assert corpus.vocab_size == 400 and corpus.tokenizer.fingerprint == tokenizer.fingerprint
    shards = [ReplicaShard(corpus.train, replica=r, num_replicas=2, seq_len=32, seed=0) for r in range(2)]
    assert not set(shards[0].block_starts) & set(shards[1].block_starts)
    inputs, _ = shards[0].next_batch(4)
    assert inputs.shape == (4, 32) and int(inputs.max()) < 400
    # a prepared folder carries its own tokenizer: another one is refused by name
    other = train_bpe_tokenizer(docs[:50], vocab_size=300, out=tmp_path / "other.json")
    with pytest.raises(DataError, match=r"not the one .* was prepared with"):
        load_corpus(DataConfig(source=str(tmp_path / "prep"), tokenizer=tmp_path / "other.json"))
    assert other.vocab_size == 300


def test_a_tokenizer_trained_in_the_test_trains_the_tiny_model(tmp_path: Path, tokenizer_path: Path) -> None:
    corpus = load_corpus(DataConfig(source="stdlib", tokenizer=tokenizer_path, max_bytes=2 * 2**20))
    assert corpus.vocab_size == 400
    train = TrainConfig(model_size="tiny", seq_len=64, batch_size=8, total_steps=150, inner_steps=50, lr=3e-3)
    model_cfg = SeededDecoder(model_config_for("tiny", vocab_size=corpus.vocab_size, max_seq_len=64), seed=0)
    shard = ReplicaShard(corpus.train, replica=0, num_replicas=1, seq_len=64, seed=0)
    replica = Replica(model_cfg, train, [shard])
    val = validation_batches(corpus.validation, seq_len=64, batch_size=8, num_batches=4)
    before = replica.evaluate(val)
    for _ in range(150):
        replica.train_step()
    after = replica.evaluate(val)
    assert before == pytest.approx(math.log(400), abs=0.3)
    assert after < before - 1.0, (before, after)


def test_prepare_streams_instead_of_loading_the_corpus(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    line = "the quick brown fox jumps over the lazy dog; " * 3 + "\n"
    with big.open("w") as handle:
        for _ in range(64 * 2**20 // len(line)):
            handle.write(line)
    tracemalloc.start()
    try:
        summary = prepare_corpus(
            iter_documents(dataset_files(big)), tmp_path / "prep", ByteTokenizer(), files=1, description="big"
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert summary.tokens["train"] + summary.tokens["validation"] == big.stat().st_size + 1
    # memory holds one batch (4 MiB of text and its ids), not the file
    assert peak < big.stat().st_size / 3, f"peak {peak / 2**20:.1f} MiB for a {big.stat().st_size / 2**20:.0f} MiB file"


def test_bad_files_get_a_clear_error_naming_the_file(tmp_path: Path, tokenizer_path: Path) -> None:
    def fails(source: Path | str, match: str, **data: object) -> None:
        with pytest.raises(DataError, match=match):
            load_corpus(DataConfig(source=str(source), cache_dir=tmp_path / "cache", **data))

    fails(tmp_path / "missing.jsonl", r"missing\.jsonl.* does not exist")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n{"text": "broken\n')
    fails(bad_json, r"bad\.jsonl:2: not a JSON object")
    wrong_field = tmp_path / "field.jsonl"
    wrong_field.write_text('{"content": "a document"}\n')
    fails(wrong_field, r"field\.jsonl:1: no field 'text' \(its fields: content\)")
    not_text = tmp_path / "number.jsonl"
    not_text.write_text('{"text": 42}\n')
    fails(not_text, r"number\.jsonl:1: field 'text' is int, not a string")
    empty_jsonl = tmp_path / "empty.jsonl"
    empty_jsonl.write_text("\n")
    fails(empty_jsonl, r"empty\.jsonl' has no records")
    empty_txt = tmp_path / "empty.txt"
    empty_txt.write_text("")
    fails(empty_txt, r"empty\.txt' is empty")
    table = tmp_path / "table.parquet"
    pq.write_table(pa.table({"body": ["a", "b"]}), table)
    fails(table, r"table\.parquet' has no column 'text' \(its columns: body\)")
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    fails(numbers, r"numbers\.parquet': column 'text' holds int64, not strings")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not a parquet file")
    fails(corrupt, r"corrupt\.parquet")
    fails("stdlib", r"nope\.json.* does not exist", tokenizer=tmp_path / "nope.json")
    garbage = tmp_path / "garbage.json"
    garbage.write_text('{"not": "a tokenizer"}')
    fails("stdlib", r"garbage\.json' is not a tokenizers tokenizer\.json", tokenizer=garbage)
    folder = tmp_path / "all-empty"
    folder.mkdir()
    (folder / "a.txt").write_text("")
    (folder / "b.txt").write_text("")
    fails(folder, r"all-empty.*no documents \(every file is empty\)")
    # nothing half-written is left behind by the failures
    assert not list((tmp_path / "cache").glob("*partial*")) if (tmp_path / "cache").exists() else True
