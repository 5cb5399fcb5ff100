"""One layout path: the trainer (`AttemptBuilder`) and the AOT tool (`python -m trainer.compile`) layout and
lower the train and eval steps through `trainer.program.layout` alone, so the tool measures the program a run
executes; and the tool never imports the runtime (`trainer.run`: distributed, elastic, the attempt and its
loop)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers import NANO_MODEL

import trainer.program.layout
from trainer import compile as compile_cli
from trainer.aot import layouts
from trainer.attempt.builder import AttemptBuilder
from trainer.config import load_config
from trainer.observe.events import EventLog
from trainer.parallel.mesh import group_into_slices
from trainer.program.layout import lower_step, slice_layout, train_spec

TRAINER = Path(__file__).resolve().parents[1] / "trainer"
AOT_TOOL = [TRAINER / "compile.py", *sorted((TRAINER / "aot").glob("*.py"))]
RUNTIME = (
    "trainer.run",
    "trainer.attempt",
    "trainer.elastic",
    "trainer.distributed",
)
# Two slices, gradient accumulation and an eval step: every part of the layout that differs between runs.
MICRO = [
    *NANO_MODEL,
    "gradient_accumulation_steps=2",
    "eval_interval=5",
    "eval_steps=1",
    "enable_checkpointing=false",
]


def _imported(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function (`from trainer import run` counts as
    trainer.run)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _is_runtime(name: str) -> bool:
    return any(name == r or name.startswith(r + ".") for r in RUNTIME)


@pytest.mark.parametrize("path", AOT_TOOL, ids=lambda p: str(p.relative_to(TRAINER)))
def test_the_aot_tool_never_imports_the_runtime(path):
    imported = _imported(path)
    assert not {m for m in imported if _is_runtime(m)}, "import trainer.program.layout instead"


def test_importing_the_aot_tool_loads_no_runtime_module():
    code = (
        "import sys, trainer.compile, trainer.program.layout\n"
        "from trainer.aot import alternatives, analysis, hlo, layouts, topology\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('trainer.'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = proc.stdout.split()
    assert "trainer.program.layout" in loaded and not [m for m in loaded if _is_runtime(m)], loaded


def test_the_layout_module_holds_no_device_data_threads_or_files():
    imported = _imported(TRAINER / "program" / "layout.py")
    forbidden = ("threading", "concurrent", "os", "pathlib", "trainer.checkpoint", "trainer.data.pipeline")
    assert not {m for m in imported if _is_runtime(m) or any(m == f or m.startswith(f + ".") for f in forbidden)}


class _Lowered(Exception):
    """Raised in place of compiling once the steps of one layout are lowered."""


@pytest.fixture
def lowered_steps(monkeypatch):
    """Every program handed to the compiler, as text; the compile itself is skipped (stops after the
    train and eval steps of the first layout)."""
    texts: list[str] = []

    def capture(lowered, devices):
        texts.append(lowered.as_text())
        if len(texts) == 2:
            raise _Lowered
        return object()

    monkeypatch.setattr(trainer.program.layout, "compile_lowered", capture)
    return texts


def _trainer_path(cfg, slices, tmp_path, texts) -> list[str]:
    build = AttemptBuilder(train_spec(cfg), checkpoint_dir=tmp_path / "ckpt", events=EventLog(None))
    with pytest.raises(_Lowered):
        build(slices)
    found = list(texts)
    texts.clear()
    return found


def _compile_cli_path(overrides, texts) -> list[str]:
    args = compile_cli._parse_args(["base.yml", *overrides])
    with pytest.raises(_Lowered):
        compile_cli.run(args)
    found = list(texts)
    texts.clear()
    return found


def test_the_trainer_and_the_compile_cli_lower_the_same_steps(tmp_path, monkeypatch, lowered_steps):
    slices = group_into_slices(jax.devices()[:4], 2)
    cfg = load_config("base.yml", [*MICRO, "num_slices=2"])
    trained = _trainer_path(cfg, slices, tmp_path, lowered_steps)
    # The CLI on the same devices: only where its devices come from (libtpu's topology) is replaced.
    monkeypatch.setattr(compile_cli, "_libtpu_env", lambda target: None)
    monkeypatch.setattr(layouts, "survivor_slices", lambda target, k: slices[:k])
    compiled = _compile_cli_path(
        [*MICRO, "compile_topology=v5e-4", "compile_topology_num_slices=2"], lowered_steps
    )
    assert len(trained) == len(compiled) == 2
    assert trained[0].startswith("module @jit_train_step") and trained[1].startswith("module @jit_eval_step")
    assert trained == compiled
    # And both are what trainer.program.layout lowers for that layout.
    spec = train_spec(cfg)
    layout = slice_layout(spec, slices)
    assert [lower_step(spec, layout, "train").as_text(), lower_step(spec, layout, "eval").as_text()] == trained


@pytest.fixture
def restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_on_a_tpu_topology_the_trainer_and_the_compile_cli_lower_the_same_steps(
    tmp_path, lowered_steps, restore_environ
):
    pytest.importorskip("libtpu", reason="needs libtpu: pip install -e '.[tpu]'")
    from trainer.aot.topology import parse_topology

    overrides = [*MICRO, "max_target_length=128"]  # sequence 128: the TPU kernels (splash) too
    target = parse_topology("v5e-4", 2)
    compile_cli._libtpu_env(target)
    compiled = _compile_cli_path(
        [*overrides, "compile_topology=v5e-4", "compile_topology_num_slices=2"], lowered_steps
    )
    cfg = load_config("base.yml", [*overrides, "num_slices=2"])
    trained = _trainer_path(cfg, layouts.survivor_slices(target, 2), tmp_path, lowered_steps)
    assert len(trained) == 2 and trained == compiled
