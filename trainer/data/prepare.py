"""Convert JSONL, JSON, Parquet and plain text files into ArrayRecord shards of JSON records.

  python scripts/prepare_data.py --input 'raw/*.jsonl' --output-dir data/mine --num-shards 8 \\
      [--tokenizer data/tokenizer/fc_sp8k.model]

Every input record becomes {"text": ...} or {"messages": [...]}, or with a tokenizer
{"input_ids": [...]} (+ "assistant_mask" for chats, see trainer/data/formatting.py). Records that
cannot be used (invalid JSON, not UTF-8, a missing field) are counted by reason and reported with
their file and line, never dropped silently. Shards get records round-robin, so they hold equal
shares; `dataset_info.json` records the summary. The shards are written aside and moved into place
only when the run succeeded (trainer/io/staging.py): a failed run leaves the old output untouched.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import contextlib
import gzip
import itertools
import json
import logging
import os
import re
import sys
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from trainer.data.errors import DataError
from trainer.data.formatting import RecordError, check_messages, encode_chat
from trainer.data.tokenizer import Tokenizer
from trainer.errors import tool_main
from trainer.io import paths
from trainer.io.staging import staged_dir

log = logging.getLogger(__name__)

SHARD_SUFFIX = ".arrayrecord"
# Structured formats are known by their extension; every other file is plain text.
STRUCTURED = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    SHARD_SUFFIX: "arrayrecord",
    ".array_record": "arrayrecord",
}
GZIP_KINDS = ("jsonl", "json", "text")
TEXT_UNITS = ("paragraph", "line", "file")
INFO_FILE = "dataset_info.json"
SNIFF_BYTES = 8192
_NON_SPACE = re.compile(r"[^ \t\r\n]")
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # a byte that was not UTF-8, kept by surrogateescape

INPUT_HELP = """\
inputs (--input, repeatable; comma-separated globs; local, ~ or gs:// paths):
  .jsonl, .ndjson  one JSON object per line
  .json            an array of objects, a single object, or JSON lines
  .parquet         one record per row, from the columns below (needs `pip install pyarrow`)
  .arrayrecord     shards of JSON records written by prepare_data.py (also .array_record)
  any other file   plain UTF-8 text (.txt, .md, .rst, .html, source code, no extension, ...),
                   one record per paragraph, line or file (--text-unit)
  + .gz            gzip-compressed JSONL, JSON or text
A JSON record or Parquet row needs a string field named by --text-field (default "text") or a
chat in the field named by --messages-field (default "messages": a list of {"role", "content"}).
Binary files are refused. Unusable records (invalid JSON, bytes that are not UTF-8, a missing or
empty field) are skipped, counted by reason and reported with file:line."""


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files of each glob (comma-separated allowed), in order; DataError for a glob matching nothing."""
    files: list[str] = []
    for arg in patterns:
        for pattern, matches in paths.expand_globs(arg):
            if not matches and paths.resolve_input(pattern).is_dir():
                raise DataError(
                    f"--input {pattern!r} is a directory; use '{pattern.rstrip('/')}/*' for the files in it"
                )
            if not matches:
                raise DataError(
                    f"--input {pattern!r} matches no file (looked at {paths.looked_at(pattern)}); check the path"
                )
            files += [os.fspath(m) for m in matches]
    if not files:
        raise DataError("--input names no file; pass a file or a glob such as 'raw/*.jsonl'")
    return files


def _kind(path: str) -> str:
    """How a file is read: by its extension (before .gz); anything not structured is plain text."""
    gz = path.endswith(".gz")
    stem = path[:-3] if gz else path
    kind = STRUCTURED.get(os.path.splitext(stem)[1].lower(), "text")
    if gz and kind not in GZIP_KINDS:
        raise DataError(
            f"input {path}: {kind} files cannot be read gzip-compressed; decompress it first (gunzip -k {path})"
        )
    return kind


def check_inputs(files: list[str]) -> None:
    """Fail before any work on a file that cannot be read at all: a binary file given as text, a broken
    .gz, Parquet without pyarrow. Only the first few KiB of each file are read."""
    for path in files:
        kind = _kind(path)
        if kind == "parquet":
            _parquet_module(path)
        if kind in GZIP_KINDS:
            _check_not_binary(path)


def _check_not_binary(path: str) -> None:
    """A NUL byte, or many bytes that are not UTF-8 text, in the first few KiB: not a text file. A few bad
    bytes are left to the records that hold them (reported with file:line)."""
    with _open_bytes(path) as f:
        head = f.read(SNIFF_BYTES)
    nul = head.find(b"\0")
    if nul >= 0:
        raise DataError(
            f"input {path}: binary data (a NUL byte at offset {nul}), not UTF-8 text; drop it from "
            "--input (UTF-16 text: convert it with `iconv -f UTF-16 -t UTF-8`)"
        )
    text = head.decode("utf-8", errors="replace")
    odd = sum(c == "\ufffd" or (c < " " and c not in "\t\n\r\f\v\b\x1b") for c in text)
    if odd > max(8, len(text) // 10):
        raise DataError(
            f"input {path}: not UTF-8 text ({odd} of its first {len(text)} characters are binary or "
            "in another encoding); convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or drop it "
            "from --input"
        )


@contextlib.contextmanager
def _open_bytes(path: str) -> Iterator[IO[bytes]]:
    """The bytes of a local or remote file, gunzipped for .gz; a broken .gz is a DataError."""
    with paths.resolve(path).open("rb") if paths.is_remote(path) else open(path, "rb") as raw:
        if not path.endswith(".gz"):
            yield raw
            return
        try:
            with gzip.GzipFile(fileobj=raw) as f:
                yield f
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise DataError(
                f"input {path}: not a readable gzip file ({e}); re-download or recompress it"
            ) from None


def _decode(raw: bytes, line_no: int) -> str:
    """One line as text; RecordError naming the first byte that is not UTF-8 (the caller adds file:line)."""
    if line_no == 1:
        raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError(
            f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); re-encode "
            "the file as UTF-8, e.g. `iconv -f latin1 -t utf-8`"
        ) from None


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
    if "input_ids" in obj:
        raise RecordError("pre-tokenized record (input_ids), its text is gone; use the raw inputs instead")
    names = [str(k) for k in itertools.islice(obj, 8)] + (["..."] if len(obj) > 8 else [])
    raise RecordError(
        f"missing field {text_field!r} or {messages_field!r} (fields: {', '.join(names) or 'none'}; "
        "set --text-field/--messages-field to the field that holds the text)"
    )


def read_records(
    path: str, *, text_field: str = "text", messages_field: str = "messages", text_unit: str = "paragraph"
) -> Iterator[tuple[str, dict | RecordError]]:
    """(where, record or RecordError) for every record of one input file."""
    fields = {"text_field": text_field, "messages_field": messages_field}
    kind = _kind(path)
    if kind == "jsonl":
        with _open_bytes(path) as f:
            yield from _jsonl_records(path, enumerate(f, start=1), fields)
    elif kind == "json":
        yield from _json_file_records(path, fields)
    elif kind == "text":
        yield from _text_units(path, text_unit)
    elif kind == "parquet":
        yield from _parquet_records(path, text_field, messages_field)
    else:
        yield from _arrayrecord_records(path, fields)


def _jsonl_records(path: str, lines: Iterable[tuple[int, bytes]], fields: dict):
    for line_no, raw in lines:
        if not raw.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            yield where, normalize(json.loads(_decode(raw, line_no)), **fields)
        except json.JSONDecodeError as e:
            yield where, RecordError(f"invalid JSON ({e.msg})")
        except RecordError as e:
            yield where, e


def _json_file_records(path: str, fields: dict):
    """A .json file: an array of records, one (pretty-printed) object, or, as many exports are, JSON
    lines. JSON lines are streamed; a document is read whole."""
    with _open_bytes(path) as f:
        lines = enumerate(f, start=1)
        head = []
        for line_no, raw in lines:
            head.append((line_no, raw))
            if raw.strip():
                break
        first = head[-1][1].strip().removeprefix(codecs.BOM_UTF8) if head else b""
        if first and not first.startswith(b"[") and _is_json(first):
            yield from _jsonl_records(path, itertools.chain(head, lines), fields)
            return
        data = b"".join(raw for _, raw in head) + f.read()
    text = data.removeprefix(codecs.BOM_UTF8).decode("utf-8", errors="surrogateescape")
    start = _skip_space(text, 0)
    if start == len(text):
        return
    if text[start] == "[":
        yield from _json_array(path, text, start + 1, fields)
        return
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:  # broken JSON lines: report each line that is not JSON
        yield from _jsonl_records(path, enumerate(data.splitlines(keepends=True), start=1), fields)
        return
    yield from _json_value(path, text, start, len(text), obj, fields, _line_of(text, start))


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
        return True
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def _line_of(text: str, pos: int, since: int = 0, line: int = 1) -> int:
    return line + text.count("\n", since, pos)


def _json_value(path: str, text: str, start: int, end: int, obj, fields: dict, line: int):
    where = f"{path}:{line}"
    bad = _ESCAPED_BYTE.search(text, start, end)
    if bad:
        col = bad.start() - text.rfind("\n", 0, bad.start())
        yield (
            where,
            RecordError(
                f"not UTF-8 text (byte 0x{ord(bad.group()) - 0xDC00:02x} at line "
                f"{_line_of(text, bad.start())} column {col}); re-encode the file as UTF-8"
            ),
        )
        return
    try:
        yield where, normalize(obj, **fields)
    except RecordError as e:
        yield where, e


def _json_array(path: str, text: str, pos: int, fields: dict):
    """The elements of a JSON array, each reported at its line; a syntax error ends the array there."""
    decoder = json.JSONDecoder()
    line, counted = 1, 0
    pos = _skip_space(text, pos)
    closed = text.startswith("]", pos)
    while not closed:
        line, counted = _line_of(text, pos, counted, line), pos
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            yield f"{path}:{e.lineno}", RecordError(f"invalid JSON ({e.msg}); the rest of the array is unreadable")
            return
        yield from _json_value(path, text, pos, end, obj, fields, line)
        pos = _skip_space(text, end)
        if text.startswith(",", pos):
            pos = _skip_space(text, pos + 1)
            continue
        closed = text.startswith("]", pos)
        if not closed:
            yield (
                f"{path}:{_line_of(text, pos)}",
                RecordError(
                    "invalid JSON (expected ',' or ']' after an array "
                    "element); the rest of the array is unreadable"
                ),
            )
            return
    rest = _skip_space(text, pos + 1)
    if rest < len(text):
        yield f"{path}:{_line_of(text, rest)}", RecordError("invalid JSON (extra data after the array)")


def _skip_space(text: str, pos: int) -> int:
    found = _NON_SPACE.search(text, pos)
    return found.start() if found else len(text)


def _text_units(path: str, unit: str) -> Iterator[tuple[str, dict | RecordError]]:
    """Plain text as records: one per paragraph (blank-line separated), line or whole file. A unit with
    a line that is not UTF-8 is one bad record, reported at that line; the rest of the file is used."""
    start, pieces, error = 0, [], None
    with _open_bytes(path) as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line, bad = _decode(raw, line_no), None
            except RecordError as e:
                line, bad = "", (f"{path}:{line_no}", e)
            if unit != "file" and bad is None and not line.strip():
                yield from _text_unit(path, unit, start, pieces, error)
                pieces, error = [], None
                continue
            if not pieces and error is None:
                start = line_no
            pieces.append(line)
            error = error or bad
            if unit == "line":
                yield from _text_unit(path, unit, start, pieces, error)
                pieces, error = [], None
    yield from _text_unit(path, unit, start, pieces, error)


def _text_unit(path: str, unit: str, start: int, pieces: list[str], error):
    if error is not None:
        yield error
        return
    if unit == "file":
        text = "".join(p[:-2] + "\n" if p.endswith("\r\n") else p for p in pieces)
    else:
        text = "\n".join(p.rstrip("\r\n") for p in pieces)
    if text.strip():  # blank lines separate units; they are not records
        yield f"{path}:{start}", {"text": text}


def _parquet_module(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"input {path}: reading Parquet needs pyarrow, which is not installed; "
            "run `pip install pyarrow` (it is optional, not a trainer dependency)"
        ) from None
    return pq


def _parquet_records(path: str, text_field: str, messages_field: str):
    pq = _parquet_module(path)
    try:
        table = pq.ParquetFile(paths.local_copy(paths.resolve(path)))
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError for a file that is not Parquet
        raise DataError(f"input {path}: not a readable Parquet file ({e})") from None
    columns = [c for c in (text_field, messages_field) if c in table.schema_arrow.names]
    if not columns:
        raise DataError(
            f"input {path}: no column {text_field!r} or {messages_field!r} (columns: "
            f"{table.schema_arrow.names}); pass --text-field/--messages-field"
        )
    row = 0
    for batch in table.iter_batches(columns=columns):
        for obj in batch.to_pylist():
            row += 1
            try:
                yield f"{path}#{row - 1}", normalize(obj, text_field=text_field, messages_field=messages_field)
            except RecordError as e:
                yield f"{path}#{row - 1}", e


def _arrayrecord_records(path: str, fields: dict):
    from array_record.python import array_record_module

    try:
        reader = array_record_module.ArrayRecordReader(
            str(paths.local_copy(paths.resolve(path))), "readahead_buffer_size:0"
        )
    except Exception as e:  # noqa: BLE001 - the C++ reader raises RuntimeError/ValueError
        raise DataError(f"input {path}: not a readable ArrayRecord file ({e})") from None
    try:
        for i in range(reader.num_records()):
            try:
                yield f"{path}#{i}", normalize(json.loads(reader.read([i])[0]), **fields)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield f"{path}#{i}", RecordError(f"invalid JSON ({e})")
            except RecordError as e:
                yield f"{path}#{i}", e
    finally:
        reader.close()


def tokenize_record(record: dict, tok: Tokenizer) -> dict:
    """The pre-tokenized form of a normalized record."""
    if "messages" in record:
        ids, mask = encode_chat(record["messages"], tok)
        return {"input_ids": ids, "assistant_mask": mask}
    return {"input_ids": tok.encode(record["text"])}


class Progress:
    """A one-line progress report on stderr (redrawn on a terminal, a line every 10 s otherwise)."""

    def __init__(self, total_files: int, stream=sys.stderr):
        self.total_files = total_files
        self.stream = stream
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
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] files {files_done}/{self.total_files}  "
            f"records {records:,}  bad {bad:,}  {rate:,.0f} rec/s"
        )
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
    output_dir: str = ""

    def add_bad(self, where: str, err: RecordError) -> None:
        """Count a bad record by reason; keep the first few with their file:line."""
        self.bad[_reason_key(err)] += 1
        if len(self.bad_examples) < 5:
            self.bad_examples.append(f"{where}: {err}")

    def bad_brief(self) -> str:
        """The bad records on one line: counts by reason and the first example ('' if none)."""
        if not self.bad:
            return ""
        reasons = ", ".join(f"{n:,} x {reason}" for reason, n in self.bad.most_common())
        return f"{reasons}; first: {self.bad_examples[0]}"

    def report(self) -> str:
        lines = [
            f"records: {self.records:,} written, {sum(self.bad.values()):,} bad",
            f"tokens:  {self.tokens:,}" if self.tokens is not None else "tokens:  not counted (no --tokenizer)",
            f"shards:  {len(self.shards)} ({', '.join(self.shards[:2])}{', ...' if len(self.shards) > 2 else ''})",
            f"bytes:   {self.bytes:,}",
        ]
        if self.output_dir:
            lines.append(f"output:  {self.output_dir} (with {INFO_FILE})")
        for reason, n in self.bad.most_common():
            lines.append(f"  bad: {n:,} x {reason}")
        for example in self.bad_examples:
            lines.append(f"    e.g. {example}")
        return "\n".join(lines)


def _reason_key(err: RecordError) -> str:
    """Group bad records by the message without its details (e.g. the JSON error position)."""
    return str(err).split(" (")[0]


def no_usable_record(files: list[str], summary: Summary) -> DataError:
    """The one-line error for inputs without a single usable record, saying what was wrong with them."""
    why = summary.bad_brief() or "the inputs hold no record (empty files or only blank lines)"
    return DataError(f"no usable record in {len(files)} input file(s): {why}")


def output_path(path: str | os.PathLike, flag: str) -> Path:
    """A local output path (absolute); outputs are staged and swapped locally, so not on an object store."""
    if paths.is_remote(path):
        raise DataError(
            f"{flag} {path}: this tool writes local files only; write to a local path and copy "
            "the result to the object store (e.g. `gcloud storage cp -r`)"
        )
    return Path(os.fspath(paths.resolve(path)))


def _check_output_dir(out: Path, overwrite: bool) -> bool:
    """Refuse before any work what the swap must not replace; True if an existing `out` may be replaced.

    The whole directory is swapped, so files this tool did not write in it are refused even with
    --overwrite; old shards need --overwrite, since a glob over the directory would mix old and new data.
    An empty directory is simply replaced."""
    if not out.exists():
        return overwrite
    if not out.is_dir():
        raise DataError(f"--output-dir {out} is a file, not a directory; choose another --output-dir")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return True
    foreign = [n for n in entries if not (n.endswith(SHARD_SUFFIX) or n == INFO_FILE)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise DataError(
            f"--output-dir {out} holds files this tool did not write ({shown}); the directory is "
            "replaced as a whole, so move them out or choose another --output-dir"
        )
    if not overwrite:
        shards = sum(n.endswith(SHARD_SUFFIX) for n in entries)
        raise DataError(
            f"{out} already holds {shards} {SHARD_SUFFIX} shards; a glob over it would mix old and new "
            "data: pass --overwrite (the old shards are replaced only once the new ones are written) "
            "or choose another --output-dir"
        )
    return True


def prepare(
    files: list[str],
    output_dir: str | Path,
    num_shards: int,
    *,
    tokenizer: Tokenizer | None = None,
    text_field: str = "text",
    messages_field: str = "messages",
    text_unit: str = "paragraph",
    prefix: str = "data",
    overwrite: bool = False,
    progress_stream=sys.stderr,
) -> Summary:
    """Write the usable records of `files` into `num_shards` ArrayRecord shards under `output_dir`.

    The shards and dataset_info.json are written into a hidden sibling that replaces `output_dir` only
    when everything succeeded; on any error the old output is untouched and nothing new is left."""
    if num_shards < 1:
        raise DataError(f"--num-shards={num_shards} must be >= 1")
    if text_unit not in TEXT_UNITS:
        raise DataError(f"--text-unit={text_unit!r} is not one of {', '.join(TEXT_UNITS)}")
    out = output_path(output_dir, "--output-dir")
    replace = _check_output_dir(out, overwrite)
    check_inputs(files)
    with staged_dir(out, overwrite=replace) as staging:
        summary = _write_shards(
            files,
            staging,
            num_shards,
            tokenizer=tokenizer,
            text_field=text_field,
            messages_field=messages_field,
            text_unit=text_unit,
            prefix=prefix,
            progress_stream=progress_stream,
        )
    summary.output_dir = str(out)
    log.info(
        "event=prepare_done output=%s records=%d bad=%d shards=%d",
        out,
        summary.records,
        sum(summary.bad.values()),
        len(summary.shards),
    )
    return summary


def _write_shards(
    files: list[str],
    out: Path,
    num_shards: int,
    *,
    tokenizer: Tokenizer | None,
    text_field: str,
    messages_field: str,
    text_unit: str,
    prefix: str,
    progress_stream,
) -> Summary:
    from array_record.python import array_record_module

    shard_paths = [out / f"{prefix}-{i:05d}-of-{num_shards:05d}{SHARD_SUFFIX}" for i in range(num_shards)]
    writers = [array_record_module.ArrayRecordWriter(str(p), "group_size:1") for p in shard_paths]
    summary = Summary(tokens=0 if tokenizer is not None else None)
    progress = Progress(len(files), progress_stream)
    try:
        for done, path in enumerate(files):
            for where, record in read_records(
                path, text_field=text_field, messages_field=messages_field, text_unit=text_unit
            ):
                if isinstance(record, dict) and tokenizer is not None:
                    try:
                        record = tokenize_record(record, tokenizer)
                        summary.tokens += len(record["input_ids"])
                    except RecordError as e:
                        record = e
                if isinstance(record, RecordError):
                    summary.add_bad(where, record)
                    continue
                writers[summary.records % num_shards].write(
                    json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
                )
                summary.records += 1
                progress.update(done, summary.records, sum(summary.bad.values()))
            progress.update(done + 1, summary.records, sum(summary.bad.values()))
    finally:
        for w in writers:
            w.close()
    progress.update(len(files), summary.records, sum(summary.bad.values()), force=True)
    if summary.records == 0:
        raise no_usable_record(files, summary)
    summary.shards = _drop_empty_shards(shard_paths, summary.records, prefix)
    summary.bytes = sum(os.path.getsize(out / s) for s in summary.shards)
    info = {
        "records": summary.records,
        "tokens": summary.tokens,
        "bad": dict(summary.bad),
        "shards": summary.shards,
        "bytes": summary.bytes,
        "inputs": files,
        "tokenizer": None
        if tokenizer is None
        else {"path": str(tokenizer.path), "type": tokenizer.kind, "fingerprint": tokenizer.fingerprint()},
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    return summary


def _drop_empty_shards(shard_paths: list[Path], records: int, prefix: str) -> list[str]:
    """With fewer records than shards, keep the non-empty ones, renamed -of-<kept>."""
    if records >= len(shard_paths):
        return [p.name for p in shard_paths]
    kept = []
    for i, p in enumerate(shard_paths):
        if i >= records:
            p.unlink()
            continue
        new = p.with_name(f"{prefix}-{i:05d}-of-{records:05d}{SHARD_SUFFIX}")
        p.rename(new)
        kept.append(new.name)
    return kept


EPILOG = f"""\
{INPUT_HELP}

outputs:
  <--output-dir>/<prefix>-NNNNN-of-MMMMM{SHARD_SUFFIX}  the records as JSON, round-robin over the shards
  <--output-dir>/{INFO_FILE}                    records, tokens, bad records by reason, shards, inputs
  Train on them with dataset_type=arrayrecord grain_train_files='<--output-dir>/*{SHARD_SUFFIX}'.
  --output-dir is a local directory (copy it to an object store afterwards if needed).
  The output is written aside and moved into place only when the run succeeded: a failed run leaves
  an existing output untouched and nothing new behind. An existing output is replaced only with
  --overwrite (and never a directory holding files this tool did not write).

exit codes:
  0  success (the summary is printed on stdout)
  2  bad input or arguments: a glob matching no file, a binary file, no usable record, an existing
     output without --overwrite; one line on stderr: "prepare_data.py: error: ..."
  1  a bug (with its traceback)
"""


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    """How input files become records: the options prepare_data.py and train_tokenizer.py share."""
    parser.add_argument(
        "--text-field", default="text", help="JSON field / Parquet column with the text (default: %(default)s)"
    )
    parser.add_argument(
        "--messages-field",
        default="messages",
        help="JSON field / Parquet column with a chat, a list of {role, content} (default: %(default)s)",
    )
    parser.add_argument(
        "--text-unit",
        default="paragraph",
        choices=TEXT_UNITS,
        help="plain text files: one record per paragraph (blank-line separated), line or file",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare_data.py",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input", action="append", required=True, help="file or glob (repeatable, comma-separated); formats below"
    )
    parser.add_argument("--output-dir", required=True, help="directory for the shards and dataset_info.json")
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--tokenizer", default=None, help="pre-tokenize with this tokenizer (and count tokens)")
    parser.add_argument("--tokenizer-type", default="sentencepiece", choices=("sentencepiece", "huggingface"))
    add_record_arguments(parser)
    parser.add_argument("--prefix", default="data", help="shard name prefix")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output-dir (only once the new shards are written)",
    )
    return parser


def _run(args: argparse.Namespace) -> int:
    files = expand_inputs(args.input)
    tok = Tokenizer(args.tokenizer, args.tokenizer_type) if args.tokenizer else None
    summary = prepare(
        files,
        args.output_dir,
        args.num_shards,
        tokenizer=tok,
        text_field=args.text_field,
        messages_field=args.messages_field,
        text_unit=args.text_unit,
        prefix=args.prefix,
        overwrite=args.overwrite,
    )
    print(summary.report())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s] %(message)s", stream=sys.stderr)
    return tool_main("prepare_data.py", lambda: _run(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
