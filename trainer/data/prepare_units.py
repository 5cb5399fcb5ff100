"""The work units of a data preparation: fixed by the inputs, run by worker processes, each kept on disk.

`plan_units` cuts the inputs into units fixed by the inputs and `unit_bytes` alone, never by the worker
count: one per input file, and an uncompressed file with one record per line (JSONL/NDJSON, plain text
with text_unit "line") larger than `unit_bytes` cut into byte ranges that start at line starts
(readers.LineRange), so that one big file still spreads over the workers. `run_unit` reads a unit,
tokenizes its records and encodes each exactly as the shards hold it (one JSON text per line) into
`<units>/uNNNNNN.records`, then writes its summary beside it (`uNNNNNN.json`: records, tokens, bad
records by reason, the first bad ones with their location, the range's line count). Both are written
aside and renamed (the records synced first), the summary last: a unit whose summary exists and names
its records file's size is complete (`finished`), and a rerun skips it. A bad record of a range is
located by its line within the range; the merge (trainer/data/shards.py) adds the line counts of the
file's earlier ranges, so every location is the same file:line one reader of the whole file reports.

`run_units` runs units in spawned worker processes (the readers and the tokenizer only: never JAX), each
loading the tokenizer once; with one worker, or one unit, in this process.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from trainer.data.formatting import RecordError, encode_chat
from trainer.data.preference_records import PreferenceRecordError, is_preference, preference_tokens
from trainer.data.readers import LineRange, line_starts, read_records, splittable
from trainer.data.tokenizer import Tokenizer
from trainer.io import paths

UNIT_BYTES = 64 << 20  # default byte range of a split file: big enough that a unit's overhead is nothing
MAX_EXAMPLES = 5  # bad records kept with their location, per unit and in the whole summary
# For tests only: every unit waits this many seconds before it starts, so that a test can kill a
# preparation midway (some units complete, others not).
TEST_DELAY_ENV = "TRAINER_PREPARE_TEST_UNIT_DELAY_S"


@dataclass(frozen=True)
class Unit:
    """One input file, or bytes [start, end) of one (`end` None: the whole file, read by its format)."""

    index: int
    path: str
    start: int = 0
    end: int | None = None

    @property
    def name(self) -> str:
        return f"u{self.index:06d}"


@dataclass(frozen=True)
class Job:
    """How every unit is read and encoded (pickled to each worker: a Tokenizer pickles as its path)."""

    tokenizer: Tokenizer | None
    text_field: str = "text"
    messages_field: str = "messages"
    text_unit: str = "paragraph"


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a container or taskset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def tokenize_record(record: dict, tok: Tokenizer) -> dict:
    """The pre-tokenized form of a normalized record; a preference record stays as it is (the trainer
    renders and tokenizes each pair)."""
    if is_preference(record):
        return record
    return _encode(record, tok)


def record_tokens(record: dict, tok: Tokenizer) -> int:
    """The tokens of a record `tokenize_record` returned: a preference pair's are those of both sequences
    it becomes (preference_records.preference_tokens)."""
    return preference_tokens(record, tok) if is_preference(record) else len(record["input_ids"])


def _encode(record: dict, tok: Tokenizer) -> dict:
    if "messages" in record:
        ids, mask = encode_chat(record["messages"], tok)
        return {"input_ids": ids, "assistant_mask": mask}
    return {"input_ids": tok.encode(record["text"])}


def reason_key(err: RecordError) -> str:
    """Group bad records by the message without its details (e.g. the JSON error position)."""
    return str(err).split(" (")[0]


def input_identity(path: str) -> tuple[int, str]:
    """(size, version) of an input: the modification time in ns locally, the generation on gs://. A
    changed input changes the preparation's work directory, so no unit of the old bytes is reused."""
    if not paths.is_remote(path):
        st = os.stat(path)
        return st.st_size, str(st.st_mtime_ns)
    import fsspec

    fs, name = fsspec.core.url_to_fs(path)
    info = fs.info(name)
    return int(info["size"]), str(info.get("generation") or info.get("mtime") or info.get("updated") or "")


def plan_units(files: list[str], sizes: list[int], text_unit: str, unit_bytes: int) -> list[Unit]:
    """The units of `files` (of `sizes` bytes), in input order."""
    units: list[Unit] = []
    for path, size in zip(files, sizes, strict=True):
        if size <= unit_bytes or not splittable(path, text_unit):
            units.append(Unit(len(units), path))
            continue
        bounds = line_starts(path, size, unit_bytes)
        units += [Unit(len(units) + i, path, a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return units


def finished(units_dir: Path, unit: Unit) -> dict | None:
    """The summary of a unit an earlier run completed (its records file whole), else None."""
    try:
        summary = json.loads((units_dir / f"{unit.name}.json").read_text())
        size = (units_dir / f"{unit.name}.records").stat().st_size
    except (FileNotFoundError, ValueError):  # ValueError: a summary cut short (JSON, UTF-8)
        return None
    complete = isinstance(summary, dict) and summary.get("bytes") == size and summary.get("index") == unit.index
    return summary if complete else None


def _records(unit: Unit, job: Job) -> tuple[Iterator[tuple[str | int, dict | RecordError]], LineRange | None]:
    fields = {"text_field": job.text_field, "messages_field": job.messages_field, "text_unit": job.text_unit}
    if unit.end is None:
        return read_records(unit.path, **fields), None
    lines = LineRange(unit.path, unit.start, unit.end)
    return lines.records(**fields), lines


def run_unit(unit: Unit, units_dir: Path, job: Job) -> dict:
    """Read, tokenize and encode one unit into `units_dir`; returns its summary (also written there)."""
    delay = float(os.environ.get(TEST_DELAY_ENV) or 0)
    if delay:
        time.sleep(delay)
    found, line_range = _records(unit, job)
    records, tokens, bad, examples = 0, 0, collections.Counter(), []
    refused = None  # the first bad preference record: [where, message]
    first = {}  # "preference" / "other": where the unit's first such record is
    tmp = units_dir / f".{unit.name}.records.{os.getpid()}.tmp"
    with open(tmp, "wb") as out:
        for where, record in found:
            if isinstance(record, dict) and job.tokenizer is not None:
                try:
                    record = tokenize_record(record, job.tokenizer)
                    tokens += record_tokens(record, job.tokenizer)
                except RecordError as e:
                    record = e
            if isinstance(record, RecordError):
                bad[reason_key(record)] += 1
                if len(examples) < MAX_EXAMPLES:
                    examples.append([where, str(record)])
                if refused is None and isinstance(record, PreferenceRecordError):
                    refused = [where, str(record)]
                continue
            first.setdefault("preference" if is_preference(record) else "other", where)
            out.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
            records += 1
        out.flush()
        os.fsync(out.fileno())
        size = out.tell()
    os.replace(tmp, units_dir / f"{unit.name}.records")
    summary = {
        "index": unit.index,
        "records": records,
        "tokens": tokens if job.tokenizer is not None else None,
        "bad": dict(bad),  # in order of first occurrence, as the merged summary counts them
        "examples": examples,  # [file:line, or line within the range, message]
        "refused": refused,  # the first bad preference record, located as the examples are
        "first": first,  # where its first preference record and its first other record are
        "lines": None if line_range is None else line_range.lines,
        "bytes": size,
    }
    # The summary says the unit is complete, so it comes last: written aside and renamed (not synced:
    # after a lost machine, an empty or cut summary does not parse, or names another size, and the
    # unit runs again; the records file was synced before it).
    tmp = units_dir / f".{unit.name}.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(summary))
    os.replace(tmp, units_dir / f"{unit.name}.json")
    return summary


# -- worker processes ------------------------------------------------------------------------------------

_WORKER_JOB: Job | None = None


def _exit_when_orphaned(parent: int) -> None:
    """A worker whose preparation was killed (kill -9 included) exits instead of waiting for work forever."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _start_worker(job: Job, parent: int) -> None:
    global _WORKER_JOB
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops handing out units
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    _WORKER_JOB = job  # unpickled once per worker: the tokenizer loads here


def _run_in_worker(unit: Unit, units_dir: Path) -> dict:
    return run_unit(unit, units_dir, _WORKER_JOB)


def run_units(units: list[Unit], units_dir: Path, job: Job, workers: int) -> Iterator[dict]:
    """Run `units`, yielding each summary as its unit completes (in about unit order). Close the
    iterator (contextlib.closing): closed early, the units in flight are stopped, the others never start."""
    if workers <= 1 or len(units) <= 1:
        for unit in units:
            yield run_unit(unit, units_dir, job)
        return
    pool = ProcessPoolExecutor(
        min(workers, len(units)),
        mp_context=multiprocessing.get_context("spawn"),  # a fresh interpreter: no JAX, no inherited state
        initializer=_start_worker,
        initargs=(job, os.getpid()),
    )
    complete = False
    try:
        futures = [pool.submit(_run_in_worker, unit, units_dir) for unit in units]
        for future in as_completed(futures):
            yield future.result()
        complete = True
    finally:
        if not complete:  # stopped (Ctrl-C, an error): end the units in flight now, not once they finish
            for process in list((pool._processes or {}).values()):
                process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
