"""Input files read as records: JSONL, JSON, Parquet, ArrayRecord shards and plain text (+ .gz).

`read_records(path)` yields (where, record or RecordError) for every record of one file, `where` being
file:line (or file#row), and a record {"text": ...}, {"messages": [...]} or a preference record
{"prompt", "chosen", "rejected"}; a record that cannot be
used (invalid JSON, not UTF-8, a missing field) is a RecordError with its reason, never dropped
silently. The format is told by the extension (before .gz); any other file is plain text, one record
per paragraph, line or file. `check_inputs` refuses, from the first few KiB, a file that cannot be read
at all (binary, a broken .gz, Parquet without pyarrow). Shared by scripts/prepare_data.py
(trainer/data/shards.py writes the records) and scripts/train_tokenizer.py.

A big file with one record per line (`splittable`: uncompressed JSONL, or plain text read line by line)
can also be read in byte ranges that start at line starts (`line_starts`, `LineRange`), each by another
process; a range numbers its lines from 1 and counts them, so the caller can locate a record at the
file's line. Read range by range, the file gives the same records as read whole.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import itertools
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from typing import IO

from trainer.data.errors import DataError
from trainer.data.formatting import RecordError, check_messages
from trainer.data.preference_records import FIELDS as PREFERENCE_FIELDS
from trainer.data.preference_records import check_preference, is_preference
from trainer.io import paths

SHARD_SUFFIX = ".arrayrecord"  # the shards trainer/data/shards.py writes, read back as an input format
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
SNIFF_BYTES = 8192
_NON_SPACE = re.compile(r"[^ \t\r\n]")
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # a byte that was not UTF-8, kept by surrogateescape


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


def _decode(raw: bytes, line_no: int, bom: bool = True) -> str:
    """One line as text; RecordError naming the first byte that is not UTF-8 (the caller adds file:line).
    A UTF-8 byte-order mark is dropped from the file's first line (`bom`: line 1 is the file's first)."""
    if bom and line_no == 1:
        raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError(
            f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); re-encode "
            "the file as UTF-8, e.g. `iconv -f latin1 -t utf-8`"
        ) from None


def normalize(obj, *, text_field: str, messages_field: str) -> dict:
    """A raw JSON value -> {"messages": [...]}, {"text": "..."} or a preference record {"prompt",
    "chosen", "rejected"} (trainer/data/preference_records.py), or RecordError with the reason."""
    if not isinstance(obj, dict):
        raise RecordError(f"not a JSON object ({type(obj).__name__})")
    if is_preference(obj):
        return check_preference(obj)
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


def splittable(path: str, text_unit: str) -> bool:
    """Whether `path` may be read in byte ranges (`LineRange`): an uncompressed file with one record per
    line (JSONL, NDJSON; plain text with text_unit "line"). Every other file is read whole."""
    if path.endswith(".gz"):
        return False
    kind = _kind(path)
    return kind == "jsonl" or (kind == "text" and text_unit == "line")


def line_starts(path: str, size: int, range_bytes: int) -> list[int]:
    """Offsets [0, b1, ..., size] cutting a `size`-byte file into ranges of at least `range_bytes` (the
    last may be shorter), each starting at a line start: fixed by the file's bytes and `range_bytes`."""
    bounds = [0]
    with _open_bytes(path) as f:
        while bounds[-1] + range_bytes < size:
            f.seek(bounds[-1] + range_bytes - 1)
            f.readline()  # to the end of the line holding that byte
            if f.tell() >= size:
                break
            bounds.append(f.tell())
    return [*bounds, size]


class LineRange:
    """The lines in bytes [start, end) of a `splittable` file, `start` at a line start, as records:
    (line number within the range, record or RecordError). After `records` is exhausted, `lines` holds
    the range's line count, so that the next range's line numbers continue from this one's."""

    def __init__(self, path: str, start: int, end: int):
        self.path, self.start, self.end = path, start, end
        self.lines = 0

    def records(
        self, *, text_field: str = "text", messages_field: str = "messages", text_unit: str = "line"
    ) -> Iterator[tuple[int, dict | RecordError]]:
        bom = self.start == 0  # a byte-order mark is dropped from the file's first line only
        fields = {"text_field": text_field, "messages_field": messages_field}
        if _kind(self.path) == "jsonl":
            found = _jsonl_records("", self._lines(), fields, bom)
        else:
            assert text_unit == "line", "only line-per-record text is read in ranges"
            found = _text_line_units("", "line", self._lines(), bom)
        for where, record in found:  # where is ":<line>" (no path)
            yield int(where[1:]), record

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        with _open_bytes(self.path) as f:
            f.seek(self.start)
            left = self.end - self.start
            while left > 0:
                raw = f.readline()
                if not raw:
                    break
                left -= len(raw)
                self.lines += 1
                yield self.lines, raw


def _jsonl_records(path: str, lines: Iterable[tuple[int, bytes]], fields: dict, bom: bool = True):
    for line_no, raw in lines:
        if not raw.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            yield where, normalize(json.loads(_decode(raw, line_no, bom)), **fields)
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
    with _open_bytes(path) as f:
        yield from _text_line_units(path, unit, enumerate(f, start=1))


def _text_line_units(path: str, unit: str, lines: Iterable[tuple[int, bytes]], bom: bool = True):
    start, pieces, error = 0, [], None
    for line_no, raw in lines:
        try:
            line, bad = _decode(raw, line_no, bom), None
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
    names = table.schema_arrow.names
    preference = [c for c in PREFERENCE_FIELDS if c in names] if {"chosen", "rejected"} & set(names) else []
    columns = [c for c in (text_field, messages_field) if c in names] + preference
    if not columns:
        raise DataError(
            f"input {path}: no column {text_field!r} or {messages_field!r}, nor 'chosen'/'rejected' for "
            f"preference pairs (columns: {names}); pass --text-field/--messages-field"
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
