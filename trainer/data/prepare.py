"""Convert JSONL, plain text and Parquet into ArrayRecord shards of JSON records (scripts/prepare_data.py).

Every input record becomes {"text": ...} or {"messages": [...]}, or with a tokenizer
{"input_ids": [...]} (+ "assistant_mask" for chats, see trainer/data/formatting.py). Records that
cannot be used are counted by reason and reported with their file and line, never dropped silently.
Shards get records round-robin, so they hold equal shares; `dataset_info.json` records the summary.
"""
from __future__ import annotations

import argparse
import collections
import glob as globlib
import gzip
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from trainer.data.errors import DataError
from trainer.data.formatting import RecordError, check_messages, encode_chat
from trainer.data.tokenizer import Tokenizer

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
TEXT_SUFFIXES = (".txt", ".text", ".md")
SHARD_SUFFIX = ".arrayrecord"
TEXT_UNITS = ("paragraph", "line", "file")


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files of each glob (comma-separated allowed), in order; DataError for a glob matching nothing."""
    files: list[str] = []
    for pattern in (p.strip() for arg in patterns for p in arg.split(",") if p.strip()):
        matches = sorted(m for m in globlib.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(m))
        if not matches:
            raise DataError(f"--input {pattern!r} matches no file (relative to {os.getcwd()}); check the path")
        files += matches
    return files


def _kind(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(SHARD_SUFFIX):
        return "arrayrecord"
    raise DataError(f"input {path}: unsupported file type; expected .jsonl/.ndjson/.json, .txt/.md, "
                    f".parquet or {SHARD_SUFFIX} (optionally .gz for text and JSONL)")


def _open_text(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def normalize(obj, *, text_field: str, messages_field: str) -> dict:
    """A raw JSON value -> {"messages": [...]} or {"text": "..."}, or RecordError with the reason."""
    if not isinstance(obj, dict):
        raise RecordError(f"not a JSON object ({type(obj).__name__})")
    if obj.get(messages_field) is not None:
        return {"messages": check_messages(obj[messages_field], messages_field)}
    if obj.get(text_field) is not None:
        text = obj[text_field]
        if not isinstance(text, str):
            raise RecordError(f"field {text_field!r} is a {type(text).__name__}, not a string")
        if not text.strip():
            raise RecordError(f"field {text_field!r} is empty")
        return {"text": text}
    raise RecordError(f"missing field {text_field!r} or {messages_field!r}")


def read_records(path: str, *, text_field: str = "text", messages_field: str = "messages",
                 text_unit: str = "paragraph") -> Iterator[tuple[str, dict | RecordError]]:
    """(where, record or RecordError) for every record of one input file."""
    kind = _kind(path)
    if kind == "jsonl":
        with _open_text(path) as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    yield f"{path}:{line_no}", normalize(obj, text_field=text_field, messages_field=messages_field)
                except json.JSONDecodeError as e:
                    yield f"{path}:{line_no}", RecordError(f"invalid JSON ({e.msg})")
                except RecordError as e:
                    yield f"{path}:{line_no}", e
    elif kind == "text":
        yield from _text_units(path, text_unit)
    elif kind == "parquet":
        yield from _parquet_records(path, text_field, messages_field)
    else:
        from array_record.python import array_record_module

        reader = array_record_module.ArrayRecordReader(path, "readahead_buffer_size:0")
        for i in range(reader.num_records()):
            try:
                yield f"{path}#{i}", normalize(json.loads(reader.read([i])[0]), text_field=text_field,
                                               messages_field=messages_field)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield f"{path}#{i}", RecordError(f"invalid JSON ({e})")
            except RecordError as e:
                yield f"{path}#{i}", e
        reader.close()


def _text_units(path: str, unit: str) -> Iterator[tuple[str, dict | RecordError]]:
    with _open_text(path) as f:
        text = f.read()
    if unit == "file":
        pieces = [(1, text)]
    else:
        pieces, line_no, buf, buf_start = [], 0, [], 1
        for line_no, line in enumerate(text.splitlines(), start=1):
            if unit == "line":
                pieces.append((line_no, line))
            elif line.strip():
                buf_start = buf_start if buf else line_no
                buf.append(line)
            elif buf:
                pieces.append((buf_start, "\n".join(buf)))
                buf = []
        if buf:
            pieces.append((buf_start, "\n".join(buf)))
    for line_no, piece in pieces:
        if piece.strip():  # blank lines separate units; they are not records
            yield f"{path}:{line_no}", {"text": piece}


def _parquet_records(path: str, text_field: str, messages_field: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"input {path}: reading Parquet needs pyarrow, which is not installed; "
                        "run `pip install pyarrow` (it is optional, not a trainer dependency)") from None
    table = pq.ParquetFile(path)
    columns = [c for c in (text_field, messages_field) if c in table.schema_arrow.names]
    if not columns:
        raise DataError(f"input {path}: no column {text_field!r} or {messages_field!r} (columns: "
                        f"{table.schema_arrow.names}); pass --text-field/--messages-field")
    row = 0
    for batch in table.iter_batches(columns=columns):
        for obj in batch.to_pylist():
            row += 1
            try:
                yield f"{path}#{row - 1}", normalize(obj, text_field=text_field, messages_field=messages_field)
            except RecordError as e:
                yield f"{path}#{row - 1}", e


def tokenize_record(record: dict, tok: Tokenizer) -> dict:
    """The pre-tokenized form of a normalized record."""
    if "messages" in record:
        ids, mask = encode_chat(record["messages"], tok)
        return {"input_ids": ids, "assistant_mask": mask}
    return {"input_ids": tok.encode(record["text"])}


class Progress:
    """A one-line progress report on stderr (redrawn on a terminal, a line every 10 s otherwise)."""

    def __init__(self, total_files: int, stream=sys.stderr):
        self.total_files, self.stream = total_files, stream
        self.tty = getattr(stream, "isatty", lambda: False)()
        self.start = self.last = time.monotonic()

    def update(self, files_done: int, records: int, bad: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < (0.2 if self.tty else 10.0):
            return
        self.last = now
        width = 24
        filled = int(width * files_done / max(self.total_files, 1))
        rate = records / max(now - self.start, 1e-9)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] files {files_done}/{self.total_files}  "
                f"records {records:,}  bad {bad:,}  {rate:,.0f} rec/s")
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        if force and self.tty:
            self.stream.write("\n")
        self.stream.flush()


@dataclass
class Summary:
    records: int = 0
    tokens: int | None = None
    bad: collections.Counter = field(default_factory=collections.Counter)
    bad_examples: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)
    bytes: int = 0

    def report(self) -> str:
        lines = [f"records: {self.records:,} written, {sum(self.bad.values()):,} bad",
                 f"tokens:  {self.tokens:,}" if self.tokens is not None else "tokens:  not counted (no --tokenizer)",
                 f"shards:  {len(self.shards)} ({', '.join(self.shards[:2])}{', ...' if len(self.shards) > 2 else ''})",
                 f"bytes:   {self.bytes:,}"]
        for reason, n in self.bad.most_common():
            lines.append(f"  bad: {n:,} x {reason}")
        for example in self.bad_examples:
            lines.append(f"    e.g. {example}")
        return "\n".join(lines)


def _reason_key(err: RecordError) -> str:
    """Group bad records by the message without its details (e.g. the JSON error position)."""
    return str(err).split(" (")[0]


def prepare(files: list[str], output_dir: str | Path, num_shards: int, *, tokenizer: Tokenizer | None = None,
            text_field: str = "text", messages_field: str = "messages", text_unit: str = "paragraph",
            prefix: str = "data", overwrite: bool = False, progress_stream=sys.stderr) -> Summary:
    """Write the usable records of `files` into `num_shards` ArrayRecord shards under `output_dir`."""
    from array_record.python import array_record_module

    if num_shards < 1:
        raise DataError(f"--num-shards={num_shards} must be >= 1")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(out.glob(f"*{SHARD_SUFFIX}"))
    if existing and not overwrite:
        raise DataError(f"{out} already holds {len(existing)} {SHARD_SUFFIX} shards; a glob over it would mix "
                        "old and new data: pass --overwrite or choose another --output-dir")
    for old in existing:
        old.unlink()
    paths = [out / f"{prefix}-{i:05d}-of-{num_shards:05d}{SHARD_SUFFIX}" for i in range(num_shards)]
    writers = [array_record_module.ArrayRecordWriter(str(p), "group_size:1") for p in paths]
    summary = Summary(tokens=0 if tokenizer is not None else None)
    progress = Progress(len(files), progress_stream)
    try:
        for done, path in enumerate(files):
            for where, record in read_records(path, text_field=text_field, messages_field=messages_field,
                                              text_unit=text_unit):
                if isinstance(record, dict) and tokenizer is not None:
                    try:
                        record = tokenize_record(record, tokenizer)
                        summary.tokens += len(record["input_ids"])
                    except RecordError as e:
                        record = e
                if isinstance(record, RecordError):
                    summary.bad[_reason_key(record)] += 1
                    if len(summary.bad_examples) < 5:
                        summary.bad_examples.append(f"{where}: {record}")
                    continue
                writers[summary.records % num_shards].write(
                    json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode())
                summary.records += 1
                progress.update(done, summary.records, sum(summary.bad.values()))
            progress.update(done + 1, summary.records, sum(summary.bad.values()))
    finally:
        for w in writers:
            w.close()
    progress.update(len(files), summary.records, sum(summary.bad.values()), force=True)
    if summary.records == 0:
        for p in paths:
            p.unlink()
        raise DataError(f"no usable record in {len(files)} input file(s):\n{summary.report()}")
    summary.shards = _drop_empty_shards(paths, summary.records, prefix)
    summary.bytes = sum(os.path.getsize(out / s) for s in summary.shards)
    info = {"records": summary.records, "tokens": summary.tokens, "bad": dict(summary.bad),
            "shards": summary.shards, "bytes": summary.bytes, "inputs": files,
            "tokenizer": None if tokenizer is None else {"path": str(tokenizer.path), "type": tokenizer.kind,
                                                         "fingerprint": tokenizer.fingerprint()}}
    (out / "dataset_info.json").write_text(json.dumps(info, indent=1) + "\n")
    return summary


def _drop_empty_shards(paths: list[Path], records: int, prefix: str) -> list[str]:
    """With fewer records than shards, keep the non-empty ones, renamed -of-<kept>."""
    if records >= len(paths):
        return [p.name for p in paths]
    kept = []
    for i, p in enumerate(paths):
        if i >= records:
            p.unlink()
            continue
        new = p.with_name(f"{prefix}-{i:05d}-of-{records:05d}{SHARD_SUFFIX}")
        p.rename(new)
        kept.append(new.name)
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", action="append", required=True,
                        help="file or glob (repeatable, comma-separated): .jsonl/.json, .txt/.md, .parquet")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--tokenizer", default=None, help="pre-tokenize with this tokenizer (and count tokens)")
    parser.add_argument("--tokenizer-type", default="sentencepiece", choices=("sentencepiece", "huggingface"))
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--messages-field", default="messages")
    parser.add_argument("--text-unit", default="paragraph", choices=TEXT_UNITS,
                        help="plain text files: one record per paragraph (blank-line separated), line or file")
    parser.add_argument("--prefix", default="data", help="shard name prefix")
    parser.add_argument("--overwrite", action="store_true", help="replace shards already in --output-dir")
    args = parser.parse_args(argv)
    try:
        files = expand_inputs(args.input)
        for f in files:
            _kind(f)  # unsupported types fail before any work
        tok = Tokenizer(args.tokenizer, args.tokenizer_type) if args.tokenizer else None
        summary = prepare(files, args.output_dir, args.num_shards, tokenizer=tok, text_field=args.text_field,
                          messages_field=args.messages_field, text_unit=args.text_unit, prefix=args.prefix,
                          overwrite=args.overwrite)
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    print(summary.report())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
