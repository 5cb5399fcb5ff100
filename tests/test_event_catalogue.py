"""Events as a typed contract: trainer/observe/catalogue.py lists every event of events.jsonl, emitters and
readers name events only by its entries, EventLog refuses any other name, and docs/architecture.md's
event table is the catalogue's rendering.

The scan is of the source (trainer/, scripts/, benchmarks/), by AST: no string literal is passed as an
event name to `emit` / `_emit` / an `on_event` or `events` callback, and none is compared with, or looked
up as, an event name (`e["event"] == "x"`, `e.get("event") in ("x", ...)`, a helper whose parameter is
compared with `e["event"]` called with "x", a loop over literal names, a dict keyed by `e["event"]` read
with `.get("x")`). The launcher (scripts/launch_local.py) stays free of trainer imports: its literal
names are checked against the catalogue's LAUNCHER section instead.
"""

from __future__ import annotations

import ast
import json
import pickle
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from trainer.observe import catalogue
from trainer.observe.events import EventLog, UnknownEvent, read_events

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("trainer", "scripts", "benchmarks")
CATALOGUE_FILE = REPO / "trainer" / "observe" / "catalogue.py"
LAUNCHER_FILE = REPO / "scripts" / "launch_local.py"
DOCS = REPO / "docs" / "architecture.md"
EMITTERS = {"emit", "_emit", "on_event", "_on_event", "events", "event_log"}


# ---- the scan ---------------------------------------------------------------------------------------------


def _literals(node: ast.AST | None) -> list[ast.AST]:
    """The string literals `node` is or holds (a tuple, list or set of names)."""
    if (isinstance(node, ast.Constant) and isinstance(node.value, str)) or isinstance(node, ast.JoinedStr):
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [x for elt in node.elts for x in _literals(elt)]
    return []


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _params(fn: ast.FunctionDef) -> dict[str, int | None]:
    """{parameter: its position in a call (None: keyword-only)}."""
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    names = names[1:] if names and names[0] in ("self", "cls") else names
    return {n: i for i, n in enumerate(names)} | {a.arg: None for a in fn.args.kwonlyargs}


class _File:
    """One source file: what its event names are and where literals stand in for them."""

    def __init__(self, path: Path, tree: ast.Module):
        self.path, self.tree = path, tree
        self.rel = path.relative_to(REPO)
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.modules: set[str] = set()  # local names of the catalogue module
        self.entries: dict[str, str] = {}  # local name -> catalogue attribute (from ... import X)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "trainer.observe":
                self.modules |= {a.asname or a.name for a in node.names if a.name == "catalogue"}
            elif isinstance(node, ast.ImportFrom) and node.module == "trainer.observe.catalogue":
                self.entries |= {a.asname or a.name: a.name for a in node.names}
            elif isinstance(node, ast.Import):
                self.modules |= {
                    a.asname for a in node.names if a.name == "trainer.observe.catalogue" and a.asname
                }
        self.keyed: set[str] = set()  # names of dicts keyed by event names (set by `scan`)
        self.tainted: set[str] = set()  # names bound to an event's name: `name = e["event"]`
        for _ in range(2):
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and self.is_event(node.value):
                    self.tainted |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    def at(self, node: ast.AST, what: str) -> str:
        return f"{self.rel}:{node.lineno}: {what}"

    def entry(self, node: ast.AST) -> str | None:
        """The catalogue attribute `node` names (`catalogue.START` or an imported `START`), else None."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in self.modules:
            return node.attr
        if isinstance(node, ast.Name) and node.id in self.entries:
            return self.entries[node.id]
        return None

    def is_event(self, node: ast.AST) -> bool:
        """`x["event"]`, `x.get("event")`, or a name bound to one."""
        if isinstance(node, ast.Subscript):
            s = node.slice
            return isinstance(s, ast.Constant) and s.value == "event"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "event"
        return isinstance(node, ast.Name) and node.id in self.tainted

    def functions(self, node: ast.AST) -> list[ast.FunctionDef]:
        out = []
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                out.append(node)
        return out


def _files() -> list[_File]:
    out = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            if path != CATALOGUE_FILE:
                out.append(_File(path, ast.parse(path.read_text(), str(path))))
    return out


def scan(files: list[_File]) -> tuple[list[str], list[tuple[_File, ast.Call, str]]]:
    """(violations, emit sites as (file, call, catalogue attribute)) over `files`."""
    bad: list[str] = []
    emits: list[tuple[_File, ast.Call, str]] = []
    event_params: dict[str, set[tuple[int | None, str]]] = defaultdict(set)  # helper -> its event-name parameters
    keyed_attrs: set[str] = set()  # attributes holding dicts keyed by event names (`summary.recorded`)
    per_file = []
    for f in files:
        variables: set[str] = set()  # names compared with an event's name
        for node in ast.walk(f.tree):
            # Emit sites: a catalogue entry, or a parameter passed through (a checkpointer's _emit(name)).
            if isinstance(node, ast.Call) and _callee(node) in EMITTERS and node.args:
                first = node.args[0]
                if _literals(first):
                    bad.append(f.at(node, f"{_callee(node)}() given the literal name {ast.unparse(first)}"))
                elif (name := f.entry(first)) is not None:
                    emits.append((f, node, name))
                elif isinstance(first, ast.Name):
                    params = {
                        a.arg for fn in f.functions(node) for a in ast.walk(fn.args) if isinstance(a, ast.arg)
                    }
                    if first.id not in params:
                        bad.append(
                            f.at(node, f"{_callee(node)}() given {first.id}, neither an entry nor a parameter")
                        )
            # Comparisons with an event's name.
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(f.is_event(x) for x in operands):
                    for x in operands:
                        if not f.is_event(x):
                            bad += [
                                f.at(lit, f"event name compared with {ast.unparse(lit)}") for lit in _literals(x)
                            ]
                            if isinstance(x, ast.Name) and f.entry(x) is None:
                                variables.add(x.id)
                                for fn in f.functions(node):
                                    if isinstance(fn, ast.FunctionDef) and x.id in _params(fn):
                                        event_params[fn.name].add((_params(fn)[x.id], x.id))
            # `name.startswith("wandb_run")` and the like.
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and f.is_event(node.func.value):
                bad += [
                    f.at(lit, f"event name matched with {ast.unparse(lit)}")
                    for a in node.args
                    for lit in _literals(a)
                ]
        per_file.append((f, variables))

    for f, variables in per_file:
        keyed: set[str] = set()  # names of dicts keyed by event names
        for node in ast.walk(f.tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "setdefault"
            ):
                if node.args and (f.is_event(node.args[0]) or ast.unparse(node.args[0]) in variables):
                    if isinstance(node.func.value, ast.Name):
                        keyed.add(node.func.value.id)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.DictComp):
                key = node.value.key
                if f.is_event(key) or (isinstance(key, ast.Name) and key.id in variables):
                    keyed |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(f.tree):
            if isinstance(node, ast.Call):
                keyed_attrs.update(
                    k.arg for k in node.keywords if isinstance(k.value, ast.Name) and k.value.id in keyed
                )
        # Where an event-name variable gets its value: `name = "x"`, `for name in ("x", "y")`.
        for node in ast.walk(f.tree):
            if isinstance(node, ast.Assign):
                targets = [t for tgt in node.targets for t in ast.walk(tgt) if isinstance(t, ast.Name)]
                if any(t.id in variables for t in targets):
                    bad += [f.at(lit, f"event name given as {ast.unparse(lit)}") for lit in _literals(node.value)]
            if isinstance(node, (ast.For, ast.comprehension)):
                if any(isinstance(t, ast.Name) and t.id in variables for t in ast.walk(node.target)):
                    bad += [
                        f.at(lit, f"event names iterated as {ast.unparse(lit)}") for lit in _literals(node.iter)
                    ]
        f.keyed = keyed

    for f in files:
        for node in ast.walk(f.tree):
            # A helper comparing a parameter with e["event"], called with a literal for it.
            if isinstance(node, ast.Call) and _callee(node) in event_params:
                for index, name in event_params[_callee(node)]:
                    given = [node.args[index]] if index is not None and index < len(node.args) else []
                    given += [k.value for k in node.keywords if k.arg == name]
                    bad += [
                        f.at(lit, f"{_callee(node)}() given the event name {ast.unparse(lit)}")
                        for g in given
                        for lit in _literals(g)
                    ]
            # A dict keyed by event names, read with a literal.
            container = None
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "pop")
            ):
                container, keys = node.func.value, node.args[:1]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                container, keys = node.value, [node.slice]
            if container is not None:
                named = isinstance(container, ast.Name) and container.id in f.keyed
                attributed = isinstance(container, ast.Attribute) and container.attr in keyed_attrs
                if named or attributed:
                    bad += [
                        f.at(lit, f"event-keyed {ast.unparse(container)} read with {ast.unparse(lit)}")
                        for k in keys
                        for lit in _literals(k)
                    ]
    return bad, emits


@pytest.fixture(scope="module")
def scanned():
    return scan(_files())


def _snippet(code: str) -> list[_File]:
    path = REPO / "trainer" / "snippet.py"
    return [_File(path, ast.parse(textwrap.dedent(code)))]


# ---- (a) no literal names outside the catalogue -----------------------------------------------------------


def test_no_event_name_is_a_string_literal_at_emit_sites_or_in_readers(scanned):
    bad, _ = scanned
    assert not bad, "name events by their trainer/observe/catalogue.py entry:\n" + "\n".join(bad)


def test_the_scan_finds_every_way_of_spelling_a_name():
    """The checks above are only as good as the scan: each pattern it must catch, caught."""
    bad, emits = scan(
        _snippet(
            """
            from trainer.observe import catalogue

            def spans(events, start, end):
                return [e for e in events if e["event"] == start or e["event"] == end]

            def run(events, ev, on_event, prefix):
                events.emit("start", step=1)                                  # 1
                on_event("checkpoint_save_start", {"step": 1})                # 2
                events.emit(f"{prefix}checkpoint_save_blocked", step=1)       # 3
                [e for e in ev if e["event"] == "finish"]                     # 4
                [e for e in ev if e.get("event") in ("wait_start", "wait_end")]  # 5, 6
                name = ev[0]["event"]
                name.startswith("wandb_run")                                  # 7
                if name != "attempt_start": pass                              # 8
                spans(ev, "restore_start", end="restore_end")                 # 9, 10
                recorded = {n: e for e in ev for n in ("goodput",) if e["event"] == n}  # 11
                recorded.get("goodput")                                       # 12
                by = {}
                for e in ev:
                    by.setdefault(e["event"], []).append(e)
                by["finish"]                                                  # 13
                summary = dict(recorded=recorded)
                summary.recorded.get("elastic_summary")                       # 14
                events.emit(catalogue.START, step=1)
                events.emit(prefix, step=1)
            """
        )
    )
    assert len(bad) == 14, "\n".join(bad)
    assert [name for _, _, name in emits] == ["START"]


# ---- (b) the catalogue is the set of events emitted -------------------------------------------------------


def test_every_emitted_event_is_in_the_catalogue_and_every_entry_is_emitted(scanned):
    _, emits = scanned
    used = {name for _, _, name in emits}
    entries = {k for k, v in vars(catalogue).items() if isinstance(v, catalogue.Event) and v in catalogue.ALL}
    assert used <= entries, f"emitted but not catalogued (or a LAUNCHER entry): {sorted(used - entries)}"
    assert entries <= used, f"catalogued but never emitted: {sorted(entries - used)}"
    assert len(emits) >= 60


def test_emit_sites_pass_the_catalogued_fields(scanned):
    _, emits = scanned
    bad = []
    for f, call, name in emits:
        event = getattr(catalogue, name)
        given = [k.arg for k in call.keywords]
        if len(call.args) > 1 and isinstance(call.args[-1], ast.Dict):  # on_event(name, {...})
            given += [k.value for k in call.args[-1].keys if isinstance(k, ast.Constant)]
        spread = None in given or (
            len(call.args) > 1 and isinstance(call.args[-1], ast.Dict) and None in call.args[-1].keys
        )
        fields = [g for g in given if g is not None]
        if unknown := [g for g in fields if g not in event.fields]:
            bad.append(f.at(call, f"{event.name} given fields the catalogue lacks: {unknown}"))
        if not spread and (missing := [r for r in event.required if r not in fields]):
            bad.append(f.at(call, f"{event.name} without its required fields {missing}"))
    assert not bad, "\n".join(bad)


def test_the_launchers_own_events_are_the_catalogues_launcher_section():
    """scripts/launch_local.py imports nothing of the trainer (it starts trainers in any directory): its
    literal names and fields are held to catalogue.LAUNCHER, which its readers use."""
    tree = ast.parse(LAUNCHER_FILE.read_text())
    sites = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _callee(n) == "event" and n.args]
    launched = {}
    for call in sites:
        assert isinstance(call.args[0], ast.Constant), ast.unparse(call)
        launched.setdefault(call.args[0].value, set()).update(k.arg for k in call.keywords)
    assert launched == {e.name: set(e.fields) for e in catalogue.LAUNCHER}


def test_entries_are_unique_and_described():
    names = [e.name for e in catalogue.ALL + catalogue.LAUNCHER]
    assert len(names) == len(set(names))
    assert catalogue.catalogue() == catalogue.ALL and catalogue.NAMES == {e.name for e in catalogue.ALL}
    for e in catalogue.ALL + catalogue.LAUNCHER:
        assert e.meaning and "|" not in e.meaning and len(set(e.fields)) == len(e.fields), e.name
        assert e.optional <= set(e.fields), e.name
    assert all(catalogue.by_name(e.name) is e for e in catalogue.ALL)
    with pytest.raises(KeyError):
        catalogue.by_name("spawn")  # the launcher's, not events.jsonl's


def test_an_entry_is_its_name():
    e = catalogue.ATTEMPT_START
    assert e == "attempt_start" and "attempt_start" == e and {"attempt_start": 1}[e] == 1
    assert str(e) == e.name == "attempt_start" and type(str(e)) is str
    assert json.dumps({"event": e}) == '{"event": "attempt_start"}'
    assert pickle.loads(pickle.dumps(e)) is e
    assert e.required == e.fields and catalogue.FINISH.required == ("status", "exit_code")


# ---- (c) EventLog takes catalogued names only -------------------------------------------------------------


def test_event_log_writes_the_plain_name_and_refuses_an_unknown_one(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", clock=lambda: 12.5)
    record = log.emit(catalogue.STOP_AGREED, step=4, proposed_here=True, at_step=2)
    assert type(record["event"]) is str
    log("checkpoint_save_start", {"step": 3})  # a plain str name is fine when it is catalogued
    with pytest.raises(UnknownEvent, match="catalogue"):
        log.emit("checkpoint_save_begun", step=3)
    with pytest.raises(UnknownEvent):
        log("spawn", {"process": 1})
    log.close()
    events = read_events(tmp_path / "events.jsonl")
    assert [(e["event"], e["time"]) for e in events] == [("stop_agreed", 12.5), ("checkpoint_save_start", 12.5)]
    assert events[0] == {"event": "stop_agreed", "time": 12.5, "pid": events[0]["pid"], "step": 4,
                         "proposed_here": True, "at_step": 2}  # fmt: skip


# ---- (d) the docs' table is the catalogue ----------------------------------------------------------------


def test_the_docs_event_table_is_the_rendered_catalogue():
    assert catalogue.documented_table(DOCS.read_text()) == catalogue.render_table(), (
        "docs/architecture.md's event table drifted from trainer/observe/catalogue.py: "
        "run python -m trainer.observe.catalogue docs/architecture.md"
    )


def test_the_module_prints_and_rewrites_the_table(tmp_path, capsys):
    catalogue.main([])  # python -m trainer.observe.catalogue
    assert capsys.readouterr().out == catalogue.render_table()
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{catalogue.BEGIN}| stale |\n{catalogue.END}\nafter\n")
    catalogue.main([str(doc)])
    assert doc.read_text() == f"before\n{catalogue.BEGIN}{catalogue.render_table()}{catalogue.END}\nafter\n"
