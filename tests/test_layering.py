"""The layers the code's layout promises, declared once and checked on every import of trainer/ (imports
inside functions included): a change that breaks one fails here instead of surfacing as an import cycle,
a tool that drags the runtime in, or a hidden global later."""

import ast
import fnmatch
import re
from pathlib import Path

import pytest

TRAINER = Path(__file__).resolve().parents[1] / "trainer"

# Lowest first. A module may import modules of its own layer or of a lower one, never of a higher one.
LAYERS = [
    # 0: the exit-code contract and its errors, the one path layer and the rest of I/O (the byte count of
    # a tree of arrays, the Orbax internals); process bootstrap that needs nothing else
    ("foundation", ["trainer.errors", "trainer.io", "trainer.io.*", "trainer.hostmem", "trainer.backends"]),
    # 1: the typed config and what it validates with: the small grammars (data mixtures, in config/), the
    # failure kinds its fault schedule names (each kind's grammar, injector and declarations need jax and
    # nothing of the trainer above this layer), and the declarations those use (the event catalogue, the
    # chaos protocol)
    (
        "config",
        [
            "trainer.config",
            "trainer.config.*",
            "trainer.failures",
            "trainer.failures.*",
            "trainer.observe.catalogue",
            "trainer.elastic.chaos_requests",
        ],
    ),
    # 2: services with no model: observation, processes, signals, policies
    (
        "services",
        [
            "trainer.observe",
            "trainer.observe.*",
            "trainer.parallel",
            "trainer.parallel.*",
            "trainer.distributed",
            "trainer.distributed.*",
            "trainer.runtime.preemption",
            "trainer.runtime.watchdog",
            "trainer.runtime.outcome",
            "trainer.elastic.retry_budget",
            "trainer.elastic.errors",
        ],
    ),
    # 3: the math and the data: model, train state and step, input pipelines
    (
        "math",
        [
            "trainer.model",
            "trainer.model.*",
            "trainer.data",
            "trainer.data.*",
            "trainer.runtime",
            "trainer.runtime.state",
            "trainer.runtime.step",
            "trainer.runtime.optim",
            "trainer.runtime.evaluate",
            "trainer.runtime.nonfinite",
            "trainer.runtime.loss_spikes",
            "trainer.runtime.sdc",
            "trainer.runtime.executable_cache",
        ],
    ),
    # 4: state on storage, and the layout of a run on a set of slices (what trainer.compile measures)
    (
        "storage and layout",
        ["trainer.checkpoint", "trainer.checkpoint.*", "trainer.runtime.layout", "trainer.aot"],
    ),
    ("ahead of time", ["trainer.aot.*"]),
    # 5: one attempt: restore, build, loop; Hugging Face files
    (
        "attempt",
        [
            "trainer.runtime.restore",
            "trainer.runtime.compile_ahead",
            "trainer.runtime.attempt",
            "trainer.runtime.loop",
            "trainer.hf",
            "trainer.hf.*",
        ],
    ),
    # 6: recovery across attempts, and the planner that models it
    (
        "recovery",
        [
            "trainer.elastic",
            "trainer.elastic.*",
            "trainer.plan",
            "trainer.plan.model",
            "trainer.plan.costs",
            "trainer.plan.auto",
        ],
    ),
    # 7: the composition root and the checks before it
    ("composition", ["trainer.run", "trainer.process_root", "trainer.preflight"]),
    # 8: command-line tools
    (
        "cli",
        [
            "trainer",
            "trainer.train",
            "trainer.compile",
            "trainer.convert",
            "trainer.decode",
            "trainer.evaluate",
            "trainer.evaluate.*",
            "trainer.report",
            "trainer.chaos",
            "trainer.plan.__main__",
            "trainer.data.prepare",
            "trainer.config.render_base",
        ],
    ),
]


def _name(path: Path) -> str:
    parts = list(path.relative_to(TRAINER.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(TRAINER.rglob("*.py"))}


def _layer(module: str) -> int | None:
    """The layer of `module`: the most specific pattern that matches it (an exact name beats a wildcard)."""
    best = None
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if pattern == module:
                return index
            if fnmatch.fnmatchcase(module, pattern) and best is None:
                best = index
    return best


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


def test_the_import_graph_sees_top_level_imports_imports_inside_functions_and_submodules():
    assert "trainer.runtime.outcome" in GRAPH["trainer.elastic.supervisor"]  # from ... import ...
    assert "trainer.failures.plan" in GRAPH["trainer.config.schema"]  # inside a function
    assert (
        "trainer.checkpoint.verify" in GRAPH["trainer.checkpoint.checkpointer"]
    )  # from trainer.checkpoint import verify
    assert _layer("trainer.run") > _layer("trainer.runtime.loop") > _layer("trainer.config.schema")


def test_every_module_belongs_to_a_declared_layer():
    assert not [m for m in MODULES if _layer(m) is None]


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
        for m, deps in GRAPH.items()
        for d in deps
        if _layer(d) > _layer(m)
    ]
    assert not upward, "\n".join(sorted(upward))


def test_there_is_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
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
    # runtime/layout.py's `train_spec` picks the sections out of it for the trainer and trainer.compile alike.
    entries = {"run.py", "train.py", "preflight.py", "runtime/layout.py", "aot/layouts.py", "aot/alternatives.py"}
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
