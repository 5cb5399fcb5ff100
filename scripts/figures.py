"""Render the tables of measured figures in README.md and docs/*.md from the benchmarks' records.

    python -m scripts.figures            # rewrite every figures block from benchmarks/records/
    python -m scripts.figures --check    # exit 1, naming each block, when a doc differs from its record
    python -m scripts.figures --stale    # the documented records the code has moved past, with their commands

A block in a document is

    <!-- figures: RECORD_ID TABLE -->
    (rendered: the record's table, then the commit, date, machine and command that measured it)
    <!-- /figures -->

and nothing between the markers is typed by hand. Records are written by the benchmarks
(benchmarks/records.py); whether a record is still current is the figures test's business.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- figures: (\S+) (\S+) -->\n)(.*?)(<!-- /figures -->)", re.S)


def records_module():
    """benchmarks/records.py (the benchmarks import it by path: benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("benchmark_records", REPO / "benchmarks" / "records.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(record id, table name, current content) of every figures block in `text`."""
    return [(m.group(2), m.group(3), m.group(4)) for m in BLOCK.finditer(text)]


def render_block(record: dict, table: str) -> str:
    """The block's content: the table, then who measured it where."""
    if table not in record["tables"]:
        raise KeyError(f"record {record['record']} has no table {table!r} (it has {sorted(record['tables'])})")
    m = record["machine"]
    machine = f"{m['cpus']} CPUs, {m['memory_gib']} GiB, {m['platform']}, Python {m['python']}, JAX {m['jax']}"
    return (
        f"{record['tables'][table].rstrip()}\n\n"
        f"<sub>Measured at commit `{record['commit'][:10]}` on {record['date']} ({machine}) by "
        f"`{record['command']}`.</sub>\n"
    )


def render(text: str, load, problems: list[str] | None = None) -> str:
    """`text` with every figures block re-rendered from `load(record_id)`. A block whose record or table is
    missing is left as it is and described in `problems` (raised when no list is given)."""

    def one(m: re.Match) -> str:
        try:
            return m.group(1) + render_block(load(m.group(2)), m.group(3)) + m.group(5)
        except (FileNotFoundError, KeyError) as e:
            if problems is None:
                raise
            problems.append(f"figures {m.group(2)} {m.group(3)}: {e}")
            return m.group(0)

    return BLOCK.sub(one, text)


def stale_records(records) -> list[dict]:
    """The documented records whose measured modules changed since they were measured (what the figures
    test fails on), each once, in the order the documents first quote them."""
    out: dict[str, dict] = {}
    for doc in documents():
        for record_id, _, _ in blocks(doc.read_text()):
            if record_id in out or not (records.RECORDS / f"{record_id}.json").exists():
                continue
            record = records.load(record_id)
            if record["digest"] != records.digest(record["benchmark"]):
                out[record_id] = record
    return list(out.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.figures", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is out of date")
    p.add_argument(
        "--stale",
        action="store_true",
        help="list the stale documented records and the commands that re-measure them",
    )
    args = p.parse_args(argv)
    if args.stale:
        stale = stale_records(records_module())
        for record in stale:
            print(f"{record['record']} (measured at {record['commit'][:10]}): {record['command']}")
        return 1 if stale else 0
    load = records_module().load
    stale, problems = [], []
    for doc in documents():
        text = doc.read_text()
        found: list[str] = []
        new = render(text, load, found)
        problems += [f"{doc.relative_to(REPO)}: {p} (run the benchmark that records it)" for p in found]
        if new == text:
            continue
        stale.append(str(doc.relative_to(REPO)))
        if not args.check:
            doc.write_text(new)
    for name in stale:
        print(f"{name}: {'out of date' if args.check else 'rendered'}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems or (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
