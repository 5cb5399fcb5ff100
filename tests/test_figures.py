"""Documented figures come from benchmark records that still measure the code as it is.

Every `<!-- figures: RECORD TABLE -->` block of README.md and docs/*.md must be the rendering of an
existing record (`python -m scripts.figures`), and the record's digest of the modules its benchmark
measures must match them now: a change to those modules makes the figure stale until the benchmark is
run again (its command is in the record).
"""

from __future__ import annotations

import json

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
