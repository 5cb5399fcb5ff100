"""Documented figures come from benchmark records that still measure the code as it is.

Every `<!-- figures: RECORD TABLE -->` block of README.md and docs/*.md must be the rendering of an
existing record (`python -m scripts.figures`), and the record's digest of the modules its benchmark
measures must match them now: a change to those modules makes the figure stale until the benchmark is
run again (its command is in the record). A table of measured figures outside such a block fails
(`hand_typed_figures` says how one is recognised).
"""

from __future__ import annotations

import json
import re

import pytest

from scripts import figures

RECORDS = figures.records_module()


def _documented() -> list[tuple[str, str, str, str]]:
    return [
        (str(doc.relative_to(figures.REPO)), rid, table, content)
        for doc in figures.documents()
        for rid, table, content in figures.blocks(doc.read_text())
    ]


def test_the_docs_quote_measured_tables():
    assert {d for d, *_ in _documented()} >= {"README.md", "docs/running_at_scale.md"}


@pytest.mark.parametrize("doc, record_id, table, content", _documented(), ids=lambda v: str(v)[:40])
def test_a_documented_table_is_its_records_rendering_and_the_record_is_current(doc, record_id, table, content):
    path = RECORDS.RECORDS / f"{record_id}.json"
    assert path.exists(), f"{doc}: figures {record_id} have no record; run the benchmark that writes it"
    record = json.loads(path.read_text())
    assert content == figures.render_block(record, table), (
        f"{doc}: the {record_id} {table} block differs from its record: run `python -m scripts.figures`"
    )
    assert record["digest"] == RECORDS.digest(record["benchmark"]), (
        f"{record_id} is stale: {', '.join(record['modules'])} changed since commit {record['commit'][:10]}; "
        f"run `{record['command']}` again"
    )


# A number with a unit of measurement: 0.36 s, 34 ms, 138 MB, 2.4 GiB, 1,702 tokens/s, 1.2%, 7.5× or 0.81x.
_UNIT = r"(?:ms|s|KiB|MiB|GiB|kB|MB|GB|MB/s|GB/s|tokens/s|GFLOP/s|TFLOP/s)"
_MEASURED_CELL = re.compile(rf"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s?{_UNIT}(?![\w/])|\s?%|[×x](?!\w))")
_UNIT_HEADER = re.compile(rf"(?:^|[\s(]){_UNIT}$")  # a column of figures in a unit: `compiled MiB`, `step s`
NOT_MEASURED = "<!-- not measured:"


def _tables(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, the non-blank line before it, its rows) of each markdown table of `text` outside
    figures blocks and code fences."""
    text = figures.BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # keeps the line numbers
    out, fenced, before = [], False, ""
    for number, line in enumerate(text.splitlines(), 1):
        row = line.strip()
        fenced ^= row.startswith("```")
        if not fenced and row.startswith("|"):
            if out and out[-1][0] + len(out[-1][2]) == number:
                out[-1][2].append(row)
            else:
                out.append((number, before, [row]))
        before = row or before
    return out


def hand_typed_figures(text: str) -> list[int]:
    """First lines of the tables of measured figures outside figures blocks.

    A table holds measured figures when a row below its header has a number with a unit (`0.36 s`,
    `34 ms`, `138 MB`, `1.2%`, `7.5×`), or when a header cell ends in a unit (`compiled MiB`, `step s`) and
    a row below has a number. A table of figures that are not measurements (a model's output, a quoted
    default) says so on the line before it: `<!-- not measured: why -->`.
    """
    found = []
    for number, before, rows in _tables(text):
        header, body = rows[0], rows[2:]
        unit_column = any(_UNIT_HEADER.search(cell.strip()) for cell in header.strip("|").split("|"))
        measured = any(_MEASURED_CELL.search(r) for r in body) or (
            unit_column and any(re.search(r"\d", r) for r in body)
        )
        if measured and not before.startswith(NOT_MEASURED):
            found.append(number)
    return found


def test_a_table_of_measured_figures_is_rendered_from_a_record():
    for doc in figures.documents():
        lines = hand_typed_figures(doc.read_text())
        assert not lines, (
            f"{doc.relative_to(figures.REPO)}, lines {lines}: a table of measured figures typed by hand; have its "
            "benchmark write it to a record (benchmarks/records.py) and put it in a "
            "`<!-- figures: RECORD TABLE -->` block, or say `<!-- not measured: why -->` on the line before it"
        )


def test_hand_typed_figures_finds_measurements_only():
    measured = "| | tiny |\n|---|---|\n| step | 0.36 s |\n"
    unit_column = "| attention | step s |\n| --- | ---: |\n| flash | 27.8 |\n"
    keys = "| code | meaning |\n| --- | --- |\n| 42 | preempted after 10 steps |\n| 2 | x 3 |\n"
    block = f"<!-- figures: r t -->\n{measured}<!-- /figures -->\n"
    exempt = f"<!-- not measured: the planner's model -->\n\n{measured}"
    fenced = f"```\n{measured}```\n"
    assert hand_typed_figures(f"text\n\n{measured}\n{unit_column}") == [3, 7]
    assert hand_typed_figures(keys + block + exempt + fenced) == []
    assert hand_typed_figures("| a | b |\n|---|---|\n| ratio | 7.5× |\n| share | 12% |\n") == [1]


def test_render_replaces_only_the_inside_of_blocks():
    record = {
        "record": "r",
        "tables": {"t": "| a |\n|---|\n| 1 |"},
        "machine": {"cpus": 2, "memory_gib": 24, "platform": "Linux", "python": "3.11", "jax": "0.10"},
        "commit": "0123456789abcdef",
        "date": "2026-12-03",
        "command": "python benchmarks/x.py",
    }
    text = "before\n<!-- figures: r t -->\nhand-typed\n<!-- /figures -->\nafter\n"
    out = figures.render(text, lambda rid: record)
    assert out.startswith(
        "before\n<!-- figures: r t -->\n| a |\n|---|\n| 1 |\n\n<sub>Measured at commit `0123456789`"
    )
    assert "hand-typed" not in out and out.endswith("<!-- /figures -->\nafter\n")
    assert "`python benchmarks/x.py`" in out
    assert figures.render(out, lambda rid: record) == out


def test_a_change_to_a_measured_module_changes_the_digest(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(RECORDS, "REPO", tmp_path)
    monkeypatch.setitem(RECORDS.MEASURES, "b", ["m"])
    before = RECORDS.digest("b")
    (tmp_path / "m" / "a.py").write_text("x = 2\n")
    assert RECORDS.digest("b") != before


def test_the_compiled_program_is_measured_through_the_runtime_modules_the_layout_imports(tmp_path, monkeypatch):
    program, attempt = tmp_path / "trainer" / "program", tmp_path / "trainer" / "attempt"
    program.mkdir(parents=True)
    attempt.mkdir()
    layout = "from trainer.program.step import f\nimport trainer.program.optim\nimport os\n"
    (program / "layout.py").write_text(layout)
    (program / "step.py").write_text("from trainer.program.state import s\n")
    (program / "state.py").write_text("from trainer.model import m\n")
    (program / "optim.py").write_text("")
    (attempt / "builder.py").write_text("from trainer.program.layout import x\n")  # builds on it, not in it
    monkeypatch.setattr(RECORDS, "REPO", tmp_path)
    assert RECORDS._runtime_imports("trainer/program/layout.py") == [
        f"trainer/program/{m}.py" for m in ("layout", "optim", "state", "step")
    ]


def test_a_record_takes_newly_declared_modules_only_if_they_did_not_change_since_it_was_measured(
    tmp_path, monkeypatch
):
    import subprocess

    def git(*args):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
        )

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.py").write_text("x = 1\n")
    (tmp_path / "m" / "b.py").write_text("y = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "measured")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout
    monkeypatch.setattr(RECORDS, "REPO", tmp_path)
    monkeypatch.setattr(RECORDS, "RECORDS", tmp_path / "records")
    monkeypatch.setitem(RECORDS.MEASURES, "bench", ["m"])
    (tmp_path / "records").mkdir()
    record = {
        "record": "r",
        "benchmark": "bench",
        "commit": commit.strip(),
        "command": "python x.py",
        "modules": ["m"],
        "digest": RECORDS.digest("bench"),
    }
    (tmp_path / "records" / "r.json").write_text(json.dumps(record))
    (tmp_path / "m" / "b.py").write_text("y = 2\n")  # a module the benchmark will stop declaring changes
    git("commit", "-qam", "b changed")
    monkeypatch.setitem(RECORDS.MEASURES, "bench", ["m/b.py"])
    with pytest.raises(SystemExit, match="re-run `python x.py`"):
        RECORDS.redeclare("r")
    monkeypatch.setitem(RECORDS.MEASURES, "bench", ["m/a.py"])  # unchanged since the record's commit
    RECORDS.redeclare("r")
    assert RECORDS.load("r")["modules"] == ["m/a.py"] and RECORDS.load("r")["digest"] == RECORDS.digest("bench")


def test_stale_lists_each_documented_record_whose_modules_changed_once(monkeypatch, capsys):
    documented = {rid for _, rid, _, _ in _documented()}
    assert figures.stale_records(RECORDS) == []  # the test above holds: nothing is stale
    changed = RECORDS.load("elastic_recovery")["benchmark"]
    real = RECORDS.digest
    monkeypatch.setattr(RECORDS, "digest", lambda b: "changed" if b == changed else real(b))
    stale = [r["record"] for r in figures.stale_records(RECORDS)]
    expected = sorted(rid for rid in documented if RECORDS.load(rid)["benchmark"] == changed)
    assert sorted(stale) == expected and "elastic_recovery" in stale and len(stale) == len(set(stale))
    monkeypatch.setattr(figures, "records_module", lambda: RECORDS)
    assert figures.main(["--stale"]) == 1
    assert "python benchmarks/elastic_recovery.py" in capsys.readouterr().out
