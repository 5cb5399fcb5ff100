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


@pytest.fixture(scope="session")
def gcs_server():
    """A real Google Cloud Storage JSON API (fake-gcs-server) for this session (each xdist worker has its
    own): tests/gcs_server.py. Tests take a fresh bucket with `gcs_server.new_bucket()`."""
    from gcs_server import GCSServer

    with GCSServer() as server:
        yield server
