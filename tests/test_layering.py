"""The dependency rules the code's layout promises, checked on the source: a change that breaks one
fails here instead of surfacing as an import cycle or a hidden global later."""

import ast
from pathlib import Path

import pytest

TRAINER = Path(__file__).resolve().parents[1] / "trainer"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _modules(folder: str = "") -> list[Path]:
    return sorted((TRAINER / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _modules("distributed"), ids=lambda p: p.name)
def test_distributed_never_imports_elastic(path):
    assert not {m for m in _imports(path) if m.startswith("trainer.elastic")}


def test_only_the_entry_and_the_config_package_take_the_whole_run_config():
    users = {
        str(p.relative_to(TRAINER))
        for p in _modules()
        if "RunConfig" in p.read_text() and not p.is_relative_to(TRAINER / "config")
    }
    # trainer.compile is an entry too: aot/layouts.py is its composition root (it builds the same
    # TrainSpec as run.py for each layout) and aot/alternatives.py rewrites whole configs (knob changes).
    # layout.py's `train_spec` picks the sections out of it for the trainer and trainer.compile alike.
    entries = {"run.py", "train.py", "preflight.py", "runtime/layout.py", "aot/layouts.py", "aot/alternatives.py"}
    assert users <= entries, users


def test_no_module_keeps_state_in_a_context_variable():
    assert not [p.name for p in _modules() if "contextvars" in _imports(p)]
