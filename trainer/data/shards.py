"""Records written into ArrayRecord shards: the library behind scripts/prepare_data.py.

`prepare(files, output_dir, num_shards)` reads every input with trainer/data/readers.py, tokenizes the
records when given a tokenizer, writes them as JSON round-robin over the shards (equal shares) and
records the summary in dataset_info.json. Bad records are counted by reason (`Summary`), never dropped
silently. The shards are written into a hidden sibling that replaces the output directory only when
everything succeeded (trainer/io/staging.py): a failed run leaves the old output untouched.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.data.errors import DataError
from trainer.data.formatting import RecordError, encode_chat
from trainer.data.readers import SHARD_SUFFIX, TEXT_UNITS, check_inputs, read_records
from trainer.data.tokenizer import Tokenizer
from trainer.io import paths
from trainer.io.staging import staged_dir

log = logging.getLogger(__name__)

INFO_FILE = "dataset_info.json"


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
