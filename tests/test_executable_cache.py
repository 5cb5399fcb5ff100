"""A process other than 0 keeps its own compiled executables (JAX's persistent cache serves process 0
only): the second compile of the same program loads the first one's executable, which computes the
same, donation included; a torn or tampered entry is compiled again and replaced; a directory others
can write is never loaded from; process 0 and single-process runs leave it to JAX."""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.program import executable_cache
from trainer.program.executable_cache import DIGEST_SUFFIX, compile_lowered

# A process other than 0 compiles what it keeps: JAX's persistent cache (which the tests share) would hand
# this process-0 test process executables loaded from it.
pytestmark = pytest.mark.usefixtures("without_compilation_cache")


def _lowered(scale: float = 2.0):
    def step(state, batch):
        return {"w": state["w"] * scale + jnp.sum(batch["x"])}, jnp.mean(batch["x"])

    jitted = jax.jit(step, donate_argnums=(0,))
    return jitted.lower(
        {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}, {"x": jax.ShapeDtypeStruct((3,), jnp.float32)}
    )


def _run(compiled):
    state, loss = compiled({"w": jnp.arange(4.0)}, {"x": jnp.ones(3)})
    return np.asarray(state["w"]), float(loss)


def test_a_second_compile_on_the_same_process_loads_the_first(tmp_path, monkeypatch):
    devices = jax.devices()[:1]
    first = compile_lowered(_lowered(), devices, process=(1, 2), directory=tmp_path)
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert len(entries) == 2 and entries[0].endswith(".p1") and entries[1] == entries[0] + DIGEST_SUFFIX
    lowered = _lowered()
    monkeypatch.setattr(type(lowered), "compile", lambda self: pytest.fail("compiled again despite the cache"))
    again = compile_lowered(lowered, devices, process=(1, 2), directory=tmp_path)
    assert [x.tobytes() if isinstance(x, np.ndarray) else x for x in _run(again)] == [
        x.tobytes() if isinstance(x, np.ndarray) else x for x in _run(first)
    ]


def test_another_program_process_or_device_set_is_another_entry(tmp_path):
    compile_lowered(_lowered(2.0), jax.devices()[:1], process=(1, 2), directory=tmp_path)
    compile_lowered(_lowered(3.0), jax.devices()[:1], process=(1, 2), directory=tmp_path)
    compile_lowered(_lowered(2.0), jax.devices()[:1], process=(2, 3), directory=tmp_path)
    compile_lowered(_lowered(2.0), jax.devices()[1:2], process=(1, 2), directory=tmp_path)
    assert len([p for p in tmp_path.iterdir() if not p.name.endswith(DIGEST_SUFFIX)]) == 4


@pytest.mark.parametrize("damage", ["torn", "tampered"])
def test_a_torn_or_tampered_entry_is_never_loaded_compiled_again_and_replaced(tmp_path, monkeypatch, damage):
    devices = jax.devices()[:1]
    compile_lowered(_lowered(), devices, process=(1, 2), directory=tmp_path)
    (entry,) = [p for p in tmp_path.iterdir() if not p.name.endswith(DIGEST_SUFFIX)]
    if damage == "torn":
        entry.write_bytes(entry.read_bytes()[:100])
    else:  # a whole, unpicklable-by-design payload: loading it would run code
        entry.write_bytes(b"cos\nsystem\n(S'false'\ntR.")
        monkeypatch.setattr(executable_cache.pickle, "loads", lambda data: pytest.fail("unverified entry loaded"))
    compiled = compile_lowered(_lowered(), devices, process=(1, 2), directory=tmp_path)
    assert _run(compiled)[1] == 1.0
    assert entry.read_bytes()[:4] != b"cos\n" and len(entry.read_bytes()) > 100


def test_a_directory_others_can_write_is_never_loaded_from_nor_written(tmp_path, monkeypatch, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    compile_lowered(_lowered(), jax.devices()[:1], process=(1, 2), directory=shared / "processes")
    lowered = _lowered()
    compiled_again = []
    monkeypatch.setattr(type(lowered), "compile", lambda self: compiled_again.append(1) or "compiled")
    with caplog.at_level(logging.WARNING):
        assert compile_lowered(lowered, jax.devices()[:1], process=(1, 2), directory=shared / "processes") == (
            "compiled"
        )
    assert compiled_again == [1] and list((shared / "processes").iterdir()) == []
    assert "writable by its group or others" in caplog.text


def test_a_gs_cache_dir_stays_an_object_store_path():
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", "gs://bucket/cache")
    try:
        assert str(executable_cache.cache_dir()) == "gs://bucket/cache/processes"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.parametrize("process", [(0, 2), (0, 1)])
def test_process_0_and_single_process_runs_leave_it_to_jax(tmp_path, process):
    compile_lowered(_lowered(), jax.devices()[:1], process=process, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []
