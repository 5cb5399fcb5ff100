"""Test-wide setup. XLA reads the host device count once, when JAX first initialises its backend, so
the flag must be in the environment before anything imports jax: 8 CPU devices let the sharding,
resharding and virtual-slice tests build real multi-device meshes. Single-device tests use
jax.devices()[:1]."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()


import pytest  # noqa: E402
import skip_policy  # noqa: E402


def pytest_addoption(parser):
    """--strict-skips: tests/skip_policy.py (unexpected skips fail the run; CI=true implies it)."""
    skip_policy.addoption(parser)


def pytest_configure(config):
    skip_policy.install(config)
    _use_compilation_cache()


# JAX's persistent compilation cache for the tests that compile in this process: many build the same
# micro-model programs (a fresh state, a step on one device), and the xdist workers and later runs share
# what one compiled. The cache key is the program without debug info plus the compile options, XLA flags,
# backend and JAX version, so a changed program always compiles. The CLI's runs keep their own
# (`jax_cache_dir`). TRAINER_TEST_JAX_CACHE names another directory; empty turns it off.
_CACHE_DIR = os.environ.get("TRAINER_TEST_JAX_CACHE", os.path.expanduser("~/.cache/elastic-trainer/jax-tests"))
_CACHE_BYTES = 2 << 30  # least recently used entries go beyond this


@pytest.fixture
def without_compilation_cache():
    """JAX's persistent compilation cache off for one test (on again after it): for tests of what a
    process compiles itself, such as one other than process 0 keeping its own executables."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()


def _use_compilation_cache():
    if not _CACHE_DIR:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_compilation_cache_max_size", _CACHE_BYTES)


@pytest.fixture(scope="session")
def gcs_server():
    """A real Google Cloud Storage JSON API (fake-gcs-server) for this session (each xdist worker has its
    own): tests/gcs_server.py. Tests take a fresh bucket with `gcs_server.new_bucket()`."""
    from gcs_server import GCSServer

    with GCSServer() as server:
        yield server
