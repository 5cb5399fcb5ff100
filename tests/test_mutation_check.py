"""scripts/mutation_check.py's own logic: applying a breakage, reading pytest's verdict, the exit status.

No breakage is run here (that is the script's job): pytest runs are replaced by canned results."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "mutation_check.py"
_spec = importlib.util.spec_from_file_location("mutation_check", _PATH)
mc = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("mutation_check", mc)
_spec.loader.exec_module(mc)

SUMMARY = """\
....F
=========================== short test summary info ============================
FAILED tests/test_recovery_units.py::test_restore_order[3-3-snapshot] - AssertionError: assert 'a' == 'b'
ERROR tests/test_checkpoint.py::test_a_save_of_an_older_attempt_is_fenced_and_never_commits - RuntimeError: setup
FAILED tests/test_lease.py::test_old_generations_are_pruned
!!!!!!!!!!!!!!!!!!!!!!!!!! stopping after 1 failures !!!!!!!!!!!!!!!!!!!!!!!!!!!
1 failed, 4 passed in 5.94s
"""


def _breakage(old="a = 1\n", file="pkg/mod.py", name="b"):
    return mc.Breakage(name=name, file=file, old=old, new="a = 2\n", tests=("tests/test_x.py",), why="w")


def test_failing_ids_are_the_short_summarys_failed_and_error_lines_in_order():
    assert mc.failing_ids(SUMMARY) == [
        "tests/test_recovery_units.py::test_restore_order[3-3-snapshot]",
        "tests/test_checkpoint.py::test_a_save_of_an_older_attempt_is_fenced_and_never_commits",
        "tests/test_lease.py::test_old_generations_are_pruned",
    ]
    assert mc.failing_ids("3 passed in 1.0s\n") == []


def test_a_breakage_replaces_its_old_text_exactly_once(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("x = 0\na = 1\n")
    mc.apply_breakage(_breakage(), tmp_path)
    assert (tmp_path / "pkg" / "mod.py").read_text() == "x = 0\na = 2\n"


@pytest.mark.parametrize(
    "text, match", [("x = 0\n", "not found"), ("a = 1\na = 1\n", "found 2 times"), (None, "does not exist")]
)
def test_old_text_missing_twice_or_in_a_missing_file_is_stale(tmp_path, text, match):
    if text is not None:
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / "mod.py").write_text(text)
    with pytest.raises(mc.StaleBreakage, match=match):
        mc.apply_breakage(_breakage(), tmp_path)
    if text is not None:
        assert (tmp_path / "pkg" / "mod.py").read_text() == text, "a stale breakage changes nothing"


def test_a_stale_breakage_is_an_error_without_running_pytest(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("a = 1\na = 1\n")
    monkeypatch.setattr(mc, "run_pytest", lambda *a, **k: pytest.fail("pytest must not run"))
    r = mc.check_breakage(_breakage(), tmp_path, timeout_s=1)
    assert r.status == "error" and "found 2 times" in r.detail
    assert r.line().startswith("error  b  (old text found 2 times")


@pytest.mark.parametrize(
    "rc, output, status, detail",
    [
        (0, "1 passed\n", "missed", ""),
        (
            1,
            SUMMARY,
            "caught",
            "tests/test_recovery_units.py::test_restore_order[3-3-snapshot]",
        ),
        (1, "Killed\n", "error", "without a FAILED line"),
        (2, "ERROR tests/test_x.py - SyntaxError: bad\n", "error", "ERROR tests/test_x.py - SyntaxError"),
        (3, "INTERNALERROR> boom\n", "error", "internal error"),
        (4, "ERROR: file or directory not found: tests/test_gone.py\n", "error", "not found: tests/test_gone.py"),
        (5, "no tests ran\n", "error", "no tests collected"),
    ],
)
def test_exit_1_is_caught_0_missed_and_every_other_exit_an_error(rc, output, status, detail):
    r = mc.verdict("b", rc, output)
    assert r.status == status and detail in r.detail


def test_lines_and_the_summary():
    assert mc.Result("caught", "n", "t::a, t::b").line() == "caught  n  (by t::a, t::b)"
    assert mc.Result("missed", "n").line() == "missed  n"
    assert mc.Result("error", "n", "why").line() == "error  n  (why)"
    s = mc.summary([mc.Result("caught", "a"), mc.Result("missed", "b")], 3.2)
    assert s.startswith("FAIL: 1 caught, 1 missed, 0 error of 2 breakages")


def _main(monkeypatch, tmp_path, capsys, outcomes: dict[str, mc.Result], *argv):
    """main() with canned results per breakage name (nothing copied, no pytest run)."""
    breakages = [_breakage(name=n) for n in outcomes]
    monkeypatch.setattr(mc, "repository_files", lambda repo: [])
    monkeypatch.setattr(mc, "check_breakage", lambda b, *a, **k: outcomes[b.name])
    rc = mc.main(["--no-baseline", *argv], breakages=breakages, repo=tmp_path)
    return rc, capsys.readouterr().out.splitlines()


def test_exit_0_only_when_every_breakage_is_caught(monkeypatch, tmp_path, capsys):
    caught = {n: mc.Result("caught", n, "t::x", ("t::x",)) for n in ("one", "two")}
    rc, out = _main(monkeypatch, tmp_path, capsys, caught)
    assert rc == 0 and out[:2] == ["caught  one  (by t::x)", "caught  two  (by t::x)"] and out[2].startswith("OK")
    for bad in (mc.Result("missed", "two"), mc.Result("error", "two", "timed out after 1 s")):
        rc, out = _main(monkeypatch, tmp_path, capsys, {**caught, "two": bad})
        assert rc == 1 and out[1] == bad.line() and out[2].startswith("FAIL") and len(out) == 3


def test_only_runs_the_named_breakages_and_an_unknown_name_is_a_usage_error(monkeypatch, tmp_path, capsys):
    outcomes = {"one": mc.Result("missed", "one"), "two": mc.Result("caught", "two", "t::x", ("t::x",))}
    rc, out = _main(monkeypatch, tmp_path, capsys, outcomes, "--only", "two")
    assert rc == 0 and out == ["caught  two  (by t::x)", out[1]]
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, tmp_path, capsys, outcomes, "--only", "three")
    assert e.value.code == 2


def test_a_catching_test_that_fails_without_the_breakage_makes_it_an_error(monkeypatch, tmp_path):
    results = [mc.Result("caught", "a", "t::x", ("t::x",)), mc.Result("caught", "b", "t::y", ("t::y",))]
    monkeypatch.setattr(mc, "make_copy", lambda snapshot, dest: None)
    monkeypatch.setattr(mc, "run_pytest", lambda copy, ids, timeout, **k: (1, "FAILED t::y - AssertionError\n"))
    got = mc.baseline(results, tmp_path, 1)
    assert [r.status for r in got] == ["caught", "error"]
    assert got[1].detail == "t::y fails without the breakage too"


def test_every_declared_breakage_is_well_formed():
    names = [b.name for b in mc.BREAKAGES]
    assert len(names) == len(set(names))
    for b in mc.BREAKAGES:
        assert b.old != b.new and b.tests and b.why and "\n" not in b.why
        assert (Path(mc.REPO) / b.file).suffix == ".py"


def test_trainer_modules_from_outside_the_copy_are_named(tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    assert mc.foreign_trainer_modules(copy) == ["<no probe output>"]
    inside, outside = str(copy / "trainer" / "__init__.py"), "/work/main/trainer/commit.py"
    (copy / mc.PROBE_OUTPUT).write_text(
        json.dumps({"root": str(copy), "modules": {"trainer": inside, "trainer.x": outside, "trainer.ns": ""}})
    )
    assert mc.foreign_trainer_modules(copy) == [outside]
