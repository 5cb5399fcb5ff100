"""A process other than 0 keeps its own compiled executables (JAX's persistent cache serves process 0
only): the second compile of the same program loads the first one's executable, which computes the
same, donation included; a torn entry is compiled again and replaced; process 0 and single-process
runs leave it to JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.executable_cache import compile_lowered


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
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1 and entries[0].name.endswith(".p1")
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
    assert len(list(tmp_path.iterdir())) == 4


def test_a_torn_entry_is_compiled_again_and_replaced(tmp_path):
    devices = jax.devices()[:1]
    compile_lowered(_lowered(), devices, process=(1, 2), directory=tmp_path)
    (entry,) = tmp_path.iterdir()
    entry.write_bytes(b"torn")
    compiled = compile_lowered(_lowered(), devices, process=(1, 2), directory=tmp_path)
    assert _run(compiled)[1] == 1.0
    assert entry.read_bytes() != b"torn"


@pytest.mark.parametrize("process", [(0, 2), (0, 1)])
def test_process_0_and_single_process_runs_leave_it_to_jax(tmp_path, process):
    compile_lowered(_lowered(), jax.devices()[:1], process=process, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []
