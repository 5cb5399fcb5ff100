"""The layers the code's layout promises, declared once and checked on every import of trainer/ (imports
inside functions included): a change that breaks one fails here instead of surfacing as an import cycle,
a tool that drags the runtime in, or a hidden global later.

A layer is a list of units: the packages directly under trainer/ and trainer/'s top-level modules. A module
is in its unit's layer (`trainer.elastic.backends.local` in `trainer.elastic`'s), except the command-line
entries inside lower packages (`CLI_ENTRIES`), which are at the top so that nothing imports them."""

import ast
import re
from pathlib import Path

import pytest

TRAINER = Path(__file__).resolve().parents[1] / "trainer"

# Lowest first. A module may import modules of its own layer or of a lower one, never of a higher one; and
# no two units import each other (the unit graph has no cycle), within a layer too.
LAYERS = [
    # the exit-code contract and its errors; one path layer and the rest of I/O (JSONL, staging, the byte
    # count of a tree of arrays, the Orbax internals); process bootstrap that needs nothing else
    ("foundation", ["trainer.errors", "trainer.logevents", "trainer.io", "trainer.hostmem", "trainer.backends"]),
    # what a run records and reads back: the event catalogue, event log, sinks, run directory, goodput,
    # timelines and plots; none of it needs the config
    ("observation", ["trainer.observe"]),
    # the typed config, and the failure kinds its fault schedule names (each kind's grammar, injector and
    # declarations, the chaos request protocol)
    ("config", ["trainer.config", "trainer.failures"]),
    # services with no model: the mesh and sharding rules, multi-process JAX, SIGTERM and the watchdog
    ("services", ["trainer.parallel", "trainer.distributed", "trainer.process"]),
    # the model and the input pipelines
    ("math and data", ["trainer.model", "trainer.data"]),
    # what runs on the devices and its layout on a set of slices (what trainer.compile measures); state on
    # storage
    ("program and storage", ["trainer.program", "trainer.checkpoint"]),
    # one attempt (restore, build, loop, the policies it applies); the libraries of trainer.compile and of
    # trainer.convert
    ("attempt", ["trainer.attempt", "trainer.aot", "trainer.hf"]),
    # recovery across attempts, and the planner that models it
    ("recovery", ["trainer.elastic", "trainer.plan"]),
    # the composition root, the process root and the checks before them
    ("composition", ["trainer.run", "trainer.process_root", "trainer.preflight"]),
    # command-line tools
    (
        "cli",
        [
            "trainer",
            "trainer.train",
            "trainer.compile",
            "trainer.convert",
            "trainer.decode",
            "trainer.evaluate",
            "trainer.report",
            "trainer.chaos",
            "trainer.control",
        ],
    ),
]
# Command-line entries inside lower packages: at the CLI layer.
CLI_ENTRIES = ["trainer.plan.__main__", "trainer.data.prepare", "trainer.config.render_base"]
CLI = len(LAYERS) - 1
LAYER_OF = {unit: index for index, (_, units) in enumerate(LAYERS) for unit in units}


def _name(path: Path) -> str:
    parts = list(path.relative_to(TRAINER.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(TRAINER.rglob("*.py"))}


def _unit(module: str) -> str:
    """The package directly under trainer/ that holds `module`, or the top-level module itself."""
    return ".".join(module.split(".")[:2])


def _layer(module: str) -> int | None:
    """The layer of `module`: the CLI layer for a command-line entry, else its unit's."""
    return CLI if module in CLI_ENTRIES else LAYER_OF.get(_unit(module))


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """Every trainer module `module` imports, anywhere in its body (inside functions too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name) for a in node.names if a.name.startswith("trainer")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if not base.startswith("trainer"):
                continue
            for alias in node.names:  # `from trainer.x import y`: the submodule y if there is one, else x
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else _resolve(base))
    return {m for m in found if m and m != module}


GRAPH = {m: _imports(m) for m in MODULES}
# The unit graph: a unit imports another when one of its modules imports one of the other's.
EDGES: dict[tuple[str, str], list[str]] = {}  # (unit, unit) -> the module imports that make the edge
for _m, _deps in GRAPH.items():
    for _d in _deps:
        if _unit(_m) != _unit(_d):
            EDGES.setdefault((_unit(_m), _unit(_d)), []).append(f"{_m} -> {_d}")
UNITS = {_unit(m) for m in MODULES}
UNIT_GRAPH = {u: {b for a, b in EDGES if a == u} for u in UNITS}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each back edge of a depth-first walk (none: the graph is acyclic)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_the_import_graph_sees_top_level_imports_imports_inside_functions_and_submodules():
    assert "trainer.attempt.outcome" in GRAPH["trainer.elastic.supervisor"]  # from ... import ...
    assert "trainer.failures.plan" in GRAPH["trainer.config.schema"]  # inside a function
    assert (
        "trainer.checkpoint.verify" in GRAPH["trainer.checkpoint.checkpointer"]
    )  # from trainer.checkpoint import verify
    assert _layer("trainer.run") > _layer("trainer.attempt.loop") > _layer("trainer.config.schema")
    assert _unit("trainer.elastic.backends.local") == "trainer.elastic" and _unit("trainer.run") == "trainer.run"
    assert ("trainer.elastic", "trainer.attempt") in EDGES  # supervisor.py imports attempt/outcome.py


def test_every_module_belongs_to_a_declared_layer():
    assert not [m for m in MODULES if _layer(m) is None]


def test_each_declared_unit_and_entry_exists_and_is_declared_once():
    declared = [unit for _, units in LAYERS for unit in units]
    assert sorted(declared) == sorted(UNITS), sorted(set(declared) ^ UNITS)
    assert set(CLI_ENTRIES) <= set(MODULES), sorted(set(CLI_ENTRIES) - set(MODULES))


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
        for m, deps in GRAPH.items()
        for d in deps
        if _layer(d) > _layer(m)
    ]
    assert not upward, "\n".join(sorted(upward))


def test_there_is_no_import_cycle():
    cycles = _cycles(GRAPH)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_two_packages_import_each_other():
    pairs = [
        f"{a} <-> {b}: {'; '.join(sorted(EDGES[a, b]))} / {'; '.join(sorted(EDGES[b, a]))}"
        for a, b in sorted(EDGES)
        if a < b and (b, a) in EDGES
    ]
    assert not pairs, "\n".join(pairs)


def test_the_package_graph_has_no_cycle():
    cycles = [
        " -> ".join(c) + " (" + "; ".join(EDGES[a, b][0] for a, b in zip(c, c[1:])) + ")"
        for c in _cycles(UNIT_GRAPH)
    ]
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("trainer.distributed")))
def test_distributed_never_imports_elastic(module):
    assert not {m for m in GRAPH[module] if m.startswith("trainer.elastic")}


# Where each library's private modules may be used: one module for JAX's, one for Orbax's.
INTERNALS = {
    "jax": ("trainer.distributed.internals", re.compile(r"\bjax\._src(\.|\s+import\b)")),
    "orbax": ("trainer.io.orbax_internals", re.compile(r"\borbax\.checkpoint\._src(\.|\s+import\b)")),
}


@pytest.mark.parametrize("library", sorted(INTERNALS))
def test_jax_internals_are_used_in_one_module_and_orbax_internals_in_one_other(library):
    home, used = INTERNALS[library]
    # A module that names "jax._src" as a string (the CLIs quiet its loggers) imports nothing from it.
    users = sorted(m for m, p in MODULES.items() if used.search(p.read_text()))
    assert users == [home], users


def test_only_the_entry_and_the_config_package_take_the_whole_run_config():
    users = {
        str(p.relative_to(TRAINER))
        for p in MODULES.values()
        if "RunConfig" in p.read_text() and not p.is_relative_to(TRAINER / "config")
    }
    # trainer.compile is an entry too: aot/layouts.py is its composition root (it builds the same
    # TrainSpec as run.py for each layout) and aot/alternatives.py rewrites whole configs (knob changes);
    # program/layout.py's `train_spec` picks the sections out of it for the trainer and trainer.compile alike.
    entries = {"run.py", "train.py", "preflight.py", "program/layout.py", "aot/layouts.py", "aot/alternatives.py"}
    assert users <= entries, users


def test_no_module_keeps_state_in_a_context_variable():
    assert not [m for m, p in MODULES.items() if "contextvars" in p.read_text()]


def test_no_function_in_trainer_is_longer_than_100_lines():
    long = [
        f"{m}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for m, p in MODULES.items()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100
    ]
    assert not long, long
