"""Records written into ArrayRecord shards: the library behind scripts/prepare_data.py.

`prepare(files, output_dir, num_shards)` reads every input with trainer/data/readers.py, tokenizes the
records when given a tokenizer, writes them as JSON round-robin over the shards (equal shares) and
records the summary in dataset_info.json. Bad records are counted by reason (`Summary`), never dropped
silently.

In parallel, deterministically, resumably: the inputs are cut into work units fixed by the inputs alone
(trainer/data/prepare_units.py: a file, or a byte range of a big line-per-record file), which `workers`
processes read, tokenize and encode into a work directory (trainer/data/prepare_output.py), each unit
kept once complete. This process merges the units in unit order, each record going to shard
(global record index mod num_shards), so the shards are byte-identical whatever the worker count, and
equal to what one process reading the files in order writes. A run that is stopped (kill -9 included)
and rerun with the same command skips the units already complete. The output is published only when
complete (a local directory swapped in by a rename; on gs://, the shards uploaded and dataset_info.json
last): a failed run leaves the old output untouched, and a bad input leaves nothing new behind.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.data.errors import DataError
from trainer.data.formatting import RecordError
from trainer.data.prepare_output import (
    INFO_FILE,
    MERGED,
    already_published,
    check_output,
    digest,
    locked,
    make_work_dir,
    publish,
    remove_work_dir,
    resolve_output,
    work_dir,
)
from trainer.data.prepare_units import (
    MAX_EXAMPLES,
    UNIT_BYTES,
    Job,
    Unit,
    available_cpus,
    finished,
    input_identity,
    plan_units,
    reason_key,
    run_units,
)
from trainer.data.readers import SHARD_SUFFIX, TEXT_UNITS, check_inputs
from trainer.data.tokenizer import Tokenizer
from trainer.io import paths
from trainer.logevents import event_extra

log = logging.getLogger(__name__)

# dataset_info.json's figures of the run rather than of the data: they differ between runs of one command.
RUN_FIGURES = ("workers", "seconds", "tokens_per_s", "tokens_per_s_per_core", "units_resumed")


class Progress:
    """A one-line progress report on stderr (redrawn on a terminal, a line every 10 s otherwise)."""

    def __init__(self, total_units: int, stream=sys.stderr):
        self.total_units = total_units
        self.stream = stream
        self.tty = getattr(stream, "isatty", lambda: False)()
        self.start = self.last = time.monotonic()

    def update(self, units_done: int, records: int, bad: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < (0.2 if self.tty else 10.0):
            return
        self.last = now
        width = 24
        filled = int(width * units_done / max(self.total_units, 1))
        rate = records / max(now - self.start, 1e-9)
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] units {units_done}/{self.total_units}  "
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
    # The run: its work units (and how many an earlier run of the same command completed), its worker
    # processes, its seconds, and the records and tokens of the units it read itself (the rates').
    units: int = 0
    units_resumed: int = 0
    workers: int = 0
    seconds: float = 0.0
    records_run: int = 0
    tokens_run: int = 0

    def add_bad(self, where: str, err: RecordError) -> None:
        """Count a bad record by reason; keep the first few with their file:line."""
        self.bad[reason_key(err)] += 1
        if len(self.bad_examples) < MAX_EXAMPLES:
            self.bad_examples.append(f"{where}: {err}")

    def bad_brief(self) -> str:
        """The bad records on one line: counts by reason and the first example ('' if none)."""
        if not self.bad:
            return ""
        reasons = ", ".join(f"{n:,} x {reason}" for reason, n in self.bad.most_common())
        return f"{reasons}; first: {self.bad_examples[0]}"

    def tokens_per_s(self) -> float | None:
        """Tokens this run tokenized per second of it (None without a tokenizer or a timed run)."""
        if self.tokens is None or not self.seconds:
            return None
        return self.tokens_run / self.seconds

    def speed(self) -> str:
        """tokens/s (or records/s without a tokenizer), per core, the workers and the seconds."""
        workers = max(self.workers, 1)
        rate, unit = self.tokens_per_s(), "tokens"
        if rate is None:
            rate, unit = self.records_run / max(self.seconds, 1e-9), "records"
        return (
            f"{rate:,.0f} {unit}/s, {rate / workers:,.0f} {unit}/s per core ({workers} "
            f"worker{'s' if workers > 1 else ''}), {self.seconds:,.1f} s"
        )

    def report(self) -> str:
        lines = [
            f"records: {self.records:,} written, {sum(self.bad.values()):,} bad",
            f"tokens:  {self.tokens:,}" if self.tokens is not None else "tokens:  not counted (no --tokenizer)",
            f"shards:  {len(self.shards)} ({', '.join(self.shards[:2])}{', ...' if len(self.shards) > 2 else ''})",
            f"bytes:   {self.bytes:,}",
        ]
        if self.units:
            resumed = f" ({self.units_resumed:,} completed by an earlier run, skipped)" * bool(self.units_resumed)
            lines.append(f"units:   {self.units:,}{resumed}")
        if self.seconds:
            lines.append(f"speed:   {self.speed()}")
        if self.output_dir:
            lines.append(f"output:  {self.output_dir} (with {INFO_FILE})")
        for reason, n in self.bad.most_common():
            lines.append(f"  bad: {n:,} x {reason}")
        for example in self.bad_examples:
            lines.append(f"    e.g. {example}")
        return "\n".join(lines)

    def info(self, files: list[str], tokenizer: Tokenizer | None) -> dict:
        """dataset_info.json: the data's figures, then the run's (RUN_FIGURES)."""
        rate = self.tokens_per_s()
        return {
            "records": self.records,
            "tokens": self.tokens,
            "bad": dict(self.bad),
            "shards": self.shards,
            "bytes": self.bytes,
            "inputs": files,
            "tokenizer": None
            if tokenizer is None
            else {"path": str(tokenizer.path), "type": tokenizer.kind, "fingerprint": tokenizer.fingerprint()},
            "units": self.units,
            "units_resumed": self.units_resumed,
            "workers": self.workers,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": None if rate is None else round(rate, 1),
            "tokens_per_s_per_core": None if rate is None else round(rate / max(self.workers, 1), 1),
        }

    @classmethod
    def from_merged(cls, merged: dict) -> Summary:
        """The summary a run recorded in its work directory before it was stopped."""
        info = merged["info"]
        return cls(
            records=info["records"],
            tokens=info["tokens"],
            bad=collections.Counter(info["bad"]),
            bad_examples=merged["bad_examples"],
            shards=info["shards"],
            bytes=info["bytes"],
            units=info["units"],
            units_resumed=info["units"],
            workers=info["workers"],
            seconds=info["seconds"],
            records_run=merged["records_run"],
            tokens_run=merged["tokens_run"],
        )


def no_usable_record(files: list[str], summary: Summary) -> DataError:
    """The one-line error for inputs without a single usable record, saying what was wrong with them."""
    why = summary.bad_brief() or "the inputs hold no record (empty files or only blank lines)"
    return DataError(f"no usable record in {len(files)} input file(s): {why}")


def output_path(path: str | os.PathLike, flag: str) -> Path:
    """A local output path (absolute), for tools that stage and swap locally only (not an object store)."""
    if paths.is_remote(path):
        raise DataError(
            f"{flag} {path}: this tool writes local files only; write to a local path and copy "
            "the result to the object store (e.g. `gcloud storage cp -r`)"
        )
    return Path(os.fspath(paths.resolve(path)))


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
    workers: int | None = None,
    unit_bytes: int = UNIT_BYTES,
) -> Summary:
    """Write the usable records of `files` into `num_shards` ArrayRecord shards under `output_dir` (a
    local directory or a gs:// prefix), with `workers` processes (default: the CPUs this process may
    use), over work units of about `unit_bytes` (for big line-per-record files).

    Everything is built in a work directory (prepare_output.py) and published only once complete; a
    bad input removes it (nothing new is left, the old output untouched); any other stop keeps its
    completed units, and a rerun of the same command resumes from them. Workers are spawned processes:
    a script that calls this with workers > 1 needs the `if __name__ == "__main__":` guard."""
    if num_shards < 1:
        raise DataError(f"--num-shards={num_shards} must be >= 1")
    if text_unit not in TEXT_UNITS:
        raise DataError(f"--text-unit={text_unit!r} is not one of {', '.join(TEXT_UNITS)}")
    workers = available_cpus() if workers is None else workers
    if workers < 1:
        raise DataError(f"--workers={workers} must be >= 1")
    if unit_bytes < 1:
        raise DataError(f"--unit-size={unit_bytes} must be at least 1 byte")
    start = time.monotonic()
    out = resolve_output(output_dir)
    job = Job(tokenizer, text_field, messages_field, text_unit)
    identities = [input_identity(f) for f in files]
    description = {
        "format": 2,
        "inputs": [[f, *ident] for f, ident in zip(files, identities, strict=True)],
        "output": str(out),
        "num_shards": num_shards,
        "prefix": prefix,
        "fields": [text_field, messages_field],
        "text_unit": text_unit,
        "unit_bytes": unit_bytes,
        "tokenizer": None if tokenizer is None else [tokenizer.kind, tokenizer.fingerprint()],
    }
    work = work_dir(out, digest(description))
    if not (work / MERGED).is_file():  # else an earlier run of this command built the output: publish it
        check_output(out, overwrite)
    check_inputs(files)
    created = make_work_dir(work)
    with locked(work, out):
        try:
            if (work / MERGED).is_file() and ((work / "shards").is_dir() or already_published(work, out)):
                summary = Summary.from_merged(json.loads((work / MERGED).read_text()))
            else:
                sizes = [size for size, _ in identities]
                units = plan_units(files, sizes, text_unit, unit_bytes)
                summary = _build(files, units, work, job, workers, num_shards, prefix, progress_stream, start)
            if not already_published(work, out):
                publish(work / "shards", out)
        except DataError:
            remove_work_dir(work, created)
            raise
        except BaseException:
            log.warning(
                "preparation stopped: the completed work units in %s are kept; rerun the same command "
                "to resume from them",
                work,
                extra=event_extra("prepare_stopped", {"work": str(work)}),
            )
            raise
        remove_work_dir(work)
    summary.output_dir = str(out)
    done = {
        "output": str(out),
        "records": summary.records,
        "bad": sum(summary.bad.values()),
        "shards": len(summary.shards),
        "units": summary.units,
        "resumed": summary.units_resumed,
        "workers": summary.workers,
    }
    log.info(
        "prepared %(records)d records (%(bad)d bad) into %(shards)d shards in %(output)s: %(units)d work units, "
        "%(resumed)d resumed, %(workers)d workers",
        done,
        extra=event_extra("prepare_done", done),
    )
    return summary


class _Merge:
    """The units' records into the shards in unit order, each to shard (global record index mod
    num_shards), and the units' summaries into the run's in the same order (bad records located at
    file:line: a range's lines numbered on from the file's earlier ranges)."""

    def __init__(self, units: list[Unit], units_dir: Path, built: Path, num_shards: int, prefix: str, summary):
        from array_record.python import array_record_module

        self.units, self.units_dir, self.summary = units, units_dir, summary
        names = [f"{prefix}-{i:05d}-of-{num_shards:05d}{SHARD_SUFFIX}" for i in range(num_shards)]
        self.shard_paths = [built / name for name in names]
        self.writers = [array_record_module.ArrayRecordWriter(str(p), "group_size:1") for p in self.shard_paths]
        self.merged = 0  # units merged: units[:merged]
        self.written = 0  # records written
        self.lines: dict[str, int] = {}  # lines of each split file's ranges merged so far
        self.first: dict[str, str] = {}  # "preference" / "other": where the first such record is

    def ready(self, done: dict[int, dict]) -> None:
        """Merge every unit from the next one on whose summary is in `done`."""
        while self.merged < len(self.units) and self.units[self.merged].index in done:
            unit = self.units[self.merged]
            self._merge(unit, done[unit.index])
            self.merged += 1

    def _merge(self, unit: Unit, unit_summary: dict) -> None:
        n = len(self.writers)
        with open(self.units_dir / f"{unit.name}.records", "rb") as f:
            for line in f:
                self.writers[self.written % n].write(line[:-1])
                self.written += 1
        s = self.summary
        s.records += unit_summary["records"]
        if s.tokens is not None:
            s.tokens += unit_summary["tokens"]
        for reason, count in unit_summary["bad"].items():
            s.bad[reason] += count
        before = self.lines.get(unit.path, 0)

        def located(where: str | int) -> str:
            return where if unit.end is None else f"{unit.path}:{before + where}"

        for where, message in unit_summary["examples"]:
            if len(s.bad_examples) < MAX_EXAMPLES:
                s.bad_examples.append(f"{located(where)}: {message}")
        self._check_preference(unit_summary, located)
        if unit.end is not None:
            self.lines[unit.path] = before + unit_summary["lines"]
        if self.written != s.records:
            raise RuntimeError(f"work unit {unit.name}: its records file and its summary disagree")

    def _check_preference(self, unit_summary: dict, located) -> None:
        """Refuse a bad preference record, and inputs mixing preference pairs with other records: a
        preference data set must hold pairs only, every one of them usable."""
        refused = unit_summary.get("refused")
        if refused:
            where, message = refused
            raise DataError(f"{located(where)}: {message}; fix that record or remove it from the input")
        for kind, where in unit_summary.get("first", {}).items():
            self.first.setdefault(kind, located(where))
        if len(self.first) > 1:
            raise DataError(
                f"the inputs mix preference records (the first at {self.first['preference']}) with text or "
                f"chat records (the first at {self.first['other']}); a data set holds one or the other: "
                "prepare them into separate --output-dir directories"
            )

    def close(self) -> None:
        for w in self.writers:
            w.close()


def _build(
    files: list[str],
    units: list[Unit],
    work: Path,
    job: Job,
    workers: int,
    num_shards: int,
    prefix: str,
    progress_stream,
    start: float,
) -> Summary:
    """Run the units not yet complete, merging each as soon as those before it are, into work/shards;
    then dataset_info.json, and work/merged.json to say the output there is complete."""
    (work / MERGED).unlink(missing_ok=True)
    units_dir, built = work / "units", work / "shards"
    units_dir.mkdir(exist_ok=True)
    shutil.rmtree(built, ignore_errors=True)  # a merge a stopped run left half done
    built.mkdir()
    done = {u.index: s for u in units if (s := finished(units_dir, u)) is not None}
    todo = [u for u in units if u.index not in done]
    summary = Summary(
        tokens=0 if job.tokenizer is not None else None,
        units=len(units),
        units_resumed=len(done),
        workers=max(1, min(workers, len(todo))),
    )
    progress = Progress(len(units), progress_stream)
    records = sum(s["records"] for s in done.values())
    bad = sum(sum(s["bad"].values()) for s in done.values())
    merge = _Merge(units, units_dir, built, num_shards, prefix, summary)
    try:
        merge.ready(done)
        with contextlib.closing(run_units(todo, units_dir, job, summary.workers)) as results:
            for unit_summary in results:
                done[unit_summary["index"]] = unit_summary
                summary.records_run += unit_summary["records"]
                summary.tokens_run += unit_summary["tokens"] or 0
                records += unit_summary["records"]
                bad += sum(unit_summary["bad"].values())
                merge.ready(done)
                progress.update(len(done), records, bad)
    finally:
        merge.close()
    progress.update(len(units), summary.records, sum(summary.bad.values()), force=True)
    if summary.records == 0:
        raise no_usable_record(files, summary)
    summary.shards = _drop_empty_shards(merge.shard_paths, summary.records, prefix)
    summary.bytes = sum(os.path.getsize(built / s) for s in summary.shards)
    summary.seconds = time.monotonic() - start
    info = summary.info(files, job.tokenizer)
    (built / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    merged = {
        "info": info,
        "bad_examples": summary.bad_examples,
        "records_run": summary.records_run,
        "tokens_run": summary.tokens_run,
    }
    tmp = work / f".{MERGED}.tmp"
    tmp.write_text(json.dumps(merged))
    os.replace(tmp, work / MERGED)
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
