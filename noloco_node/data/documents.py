"""Documents out of text datasets on disk, streamed: nothing is read into memory whole.

Formats, by file suffix:

- ``.jsonl`` / ``.ndjson``: one JSON object per line, the document in a named string field (``text`` by default);
- ``.parquet``: one row per document, in a named string column, read a record batch at a time;
- anything else: a text file, one document per file (UTF-8; undecodable bytes become U+FFFD).

A source is one such file or a folder of them (searched recursively, hidden files skipped, files in sorted path
order, binary files skipped). Every error names the file, and the line or column where there is one.

The stream is flat: ``(starts_document, text)`` pieces. A long text file arrives in pieces of about 1 MiB cut
after a newline, so a multi-gigabyte file never sits in memory; JSONL lines and parquet rows are one piece each.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path

from noloco_node.errors import DataError

JSONL_SUFFIXES = {".jsonl", ".ndjson"}
PARQUET_SUFFIXES = {".parquet"}
PIECE_BYTES = 2**20


def dataset_files(source: Path) -> list[Path]:
    """The files of a source: the file itself, or a folder's dataset files in sorted order."""
    source = Path(source).expanduser()
    if not source.exists():
        raise DataError(f"data source {str(source)!r} does not exist")
    if source.is_file():
        return [source]
    files = sorted(
        p
        for p in source.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(source).parts)
    )
    kept = [p for p in files if p.suffix in JSONL_SUFFIXES | PARQUET_SUFFIXES or not _looks_binary(p)]
    if not kept:
        raise DataError(f"data folder {str(source)!r} contains no text, .jsonl or .parquet files")
    return kept


def _looks_binary(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return b"\0" in handle.read(8192)
    except OSError as error:
        raise DataError(f"cannot read {str(path)!r}: {error.strerror}") from error


def iter_documents(files: list[Path], *, text_field: str = "text") -> Iterator[tuple[bool, str]]:
    """``(starts_document, text)`` pieces of every document of ``files``, in order."""
    for path in files:
        if path.suffix in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, text_field)
        elif path.suffix in PARQUET_SUFFIXES:
            yield from _parquet_documents(path, text_field)
        else:
            yield from _text_document(path, single=len(files) == 1)


def _text_document(path: Path, *, single: bool) -> Iterator[tuple[bool, str]]:
    """A text file as one document: whole when under PIECE_BYTES, else in pieces of about that size, each cut
    after a newline (so that no word is split between two pieces)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    first = True
    try:
        handle = path.open("rb")
    except OSError as error:
        raise DataError(f"cannot read {str(path)!r}: {error.strerror}") from error
    with handle:
        while True:
            try:
                chunk = handle.read(PIECE_BYTES)
            except OSError as error:
                raise DataError(f"cannot read {str(path)!r}: {error.strerror}") from error
            pending += decoder.decode(chunk, final=not chunk)
            if not chunk:
                break
            while len(pending) >= 2 * PIECE_BYTES:  # keep one piece in hand: the file may end right after it
                cut = pending.rfind("\n", 0, PIECE_BYTES) + 1 or PIECE_BYTES
                yield first, pending[:cut]
                first, pending = False, pending[cut:]
    if pending:
        yield first, pending
        first = False
    if first and single:
        raise DataError(f"text file {str(path)!r} is empty")


def _jsonl_documents(path: Path, text_field: str) -> Iterator[tuple[bool, str]]:
    records = 0
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as error:
        raise DataError(f"cannot read {str(path)!r}: {error.strerror}") from error
    with handle:
        number = 0
        while True:
            try:
                line = handle.readline()
            except UnicodeDecodeError as error:
                raise DataError(f"{path}:{number + 1}: not UTF-8 ({error.reason})") from None
            except OSError as error:
                raise DataError(f"cannot read {str(path)!r}: {error.strerror}") from error
            if not line:
                break
            number += 1
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{number}: not a JSON object ({error.msg})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            if text_field not in record:
                keys = ", ".join(sorted(record)[:10]) or "none"
                raise DataError(
                    f"{path}:{number}: no field {text_field!r} (its fields: {keys}); set data.text_field / --text-field"
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise DataError(f"{path}:{number}: field {text_field!r} is {type(text).__name__}, not a string")
            records += 1
            if text:
                yield True, text
    if records == 0:
        raise DataError(f"JSONL file {str(path)!r} has no records")


def _parquet_documents(path: Path, text_field: str) -> Iterator[tuple[bool, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except OSError as error:
        raise DataError(f"cannot read {str(path)!r}: {error}") from error
    except (pa.ArrowException, ValueError) as error:
        raise DataError(f"{str(path)!r} is not a parquet file: {error}") from None
    names = table.schema_arrow.names
    if text_field not in names:
        raise DataError(
            f"parquet file {str(path)!r} has no column {text_field!r} (its columns: {', '.join(names[:10])}); "
            "set data.text_field / --text-field"
        )
    kind = table.schema_arrow.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"parquet file {str(path)!r}: column {text_field!r} holds {kind}, not strings")
    if table.metadata.num_rows == 0:
        raise DataError(f"parquet file {str(path)!r} has no rows")
    try:
        for batch in table.iter_batches(batch_size=1024, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text:
                    yield True, text
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"cannot read parquet file {str(path)!r}: {error}") from None
