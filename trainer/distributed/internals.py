"""Every JAX and XLA internal the trainer relies on, in one place to audit on an upgrade, and the version
window both internals modules were checked in.

Elastic multi-process training on CPU/GPU needs a few things no public API offers. Each is wrapped here,
with what it assumes; the Orbax internals the checkpointer relies on are wrapped likewise in
`trainer/io/orbax_internals.py`, and nothing else in trainer/ touches a private module
(`tests/test_layering.py` checks both).

JAX (checked against 0.10 and 0.12):
- `jax._src.distributed.global_state.client`: the coordination-service client (key-value store,
  GetAliveTasks), for membership rounds, barriers, the agreed stop step and fatal errors.
- `jax._src.xla_bridge.backends_are_initialized`: joining a job must precede any backend.
- `jax.experimental.multihost_utils.live_devices.devices`: the previous round's {device: incarnation},
  which `live_devices` compares against; read to learn the newest round, reset when the CPU client is
  renewed (its device objects are new), and set to the survivors' round after a formation.
- XLA's gloo key names in the coordination service (`cpu:gloo/...` rendezvous keys, the
  `cpu:global_topology` key process 0 publishes): deleted so that renewed communicators meet afresh.

Versions: `CHECKED_VERSIONS` is the window of JAX and Orbax releases the internals (here and in
trainer/io/orbax_internals.py) are supported on, pyproject.toml's ranges (tests/test_versions.py keeps the
two equal); constraints/ pins one tested set per image flavour and Python. `check_versions` refuses any
other JAX or Orbax before the trainer does anything (`python -m trainer.train` calls it first; exit 2), and
`check_pathways_image` a Pathways image built for another JAX than the client's.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from trainer.errors import UserInputError

GLOO_RENDEZVOUS_DIR = "cpu:gloo"  # gloo's rendezvous keys: cpu:gloo/<device ids>/<rank>
CPU_TOPOLOGY_KEY = "cpu:global_topology"  # published by process 0 when its CPU client is created


def coordination_client():
    """The coordination-service client of this process (None before `jax.distributed.initialize`)."""
    from jax._src import distributed

    return distributed.global_state.client


def backends_initialized() -> bool:
    """Whether JAX has created its backends (after which XLA_FLAGS and distributed settings are fixed)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def newest_round() -> dict[int, int]:
    """What `live_devices` saw last: {process index: incarnation}."""
    from jax.experimental.multihost_utils import live_devices

    return {d.process_index: int(i) for d, i in (live_devices.devices or {}).items()}


def no_round_yet() -> bool:
    from jax.experimental.multihost_utils import live_devices

    return live_devices.devices is None


def set_round(devices: dict) -> None:
    """Make `live_devices` compare its next round with `devices` ({device: incarnation}; None: none)."""
    from jax.experimental.multihost_utils import live_devices

    live_devices.devices = devices


def renew_cpu_client() -> list:
    """Drop this process's CPU client (communicators, compiled executables) and create a new one; returns
    the new devices. `live_devices`' memory of the old device objects is dropped with it."""
    import jax
    from jax.extend import backend

    jax.clear_caches()
    backend.clear_backends()
    set_round(None)
    return jax.devices()


# ---------------------------------------------------------------------------------------------------
# Versions: the window the internals above and trainer/io/orbax_internals.py's were checked in, [low, high)
# per distribution.
# ---------------------------------------------------------------------------------------------------
CHECKED_VERSIONS = {"jax": ("0.7.0", "0.14"), "orbax-checkpoint": ("0.12.3", "0.14")}
_PATHWAYS_JAX_TAG = re.compile(r"jax-(\d+(?:\.\d+)+)(?![\d.])")


class VersionError(UserInputError):
    """JAX or Orbax outside the versions the internals were checked against, or a Pathways image built
    for another JAX than the client's."""


def in_window(version: str, low: str, high: str) -> bool:
    """`low <= version < high` as pip reads `>=low,<high` (PEP 440): a pre-release of `low` is below it, and
    `<high` excludes pre-releases of `high`; a local label ("+cuda") is ignored."""
    return SpecifierSet(f">={low},<{high}").contains(Version(version), prereleases=True)


def installed_versions(names=tuple(CHECKED_VERSIONS)) -> dict[str, str | None]:
    """{distribution: installed version, None if not installed}, read from the installed packages'
    metadata (what pip installed, and what `pip install -c` changes) without importing them."""
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def install_command(python: str | None = None, flavour: str | None = None) -> str:
    """The pip command that installs a checked set: the project and jax[<flavour>] constrained by
    constraints/<flavour>-py<X.Y>.txt, the flavour guessed from the installed accelerator plugin
    (jax-cuda12-plugin: cuda12, libtpu: tpu, else cpu)."""
    if python is None:
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if flavour is None:
        plugins = installed_versions(("jax-cuda12-plugin", "libtpu"))
        flavour = "cuda12" if plugins["jax-cuda12-plugin"] else "tpu" if plugins["libtpu"] else "cpu"
    return f'pip install -c constraints/{flavour}-py{python}.txt -e . "jax[{flavour}]"'


def check_versions(found: Mapping[str, str | None] | None = None, *, fix: str | None = None) -> dict:
    """Refuse (VersionError, exit 2) a JAX or Orbax outside `CHECKED_VERSIONS`; returns the versions found.
    `found` defaults to the installed versions, `fix` to `install_command()`."""
    found = installed_versions() if found is None else dict(found)
    problems = []
    for name, (low, high) in CHECKED_VERSIONS.items():
        version, window = found.get(name), f"{name}>={low},<{high}"
        if version is None:
            problems.append(f"{name} is not installed (supported: {window})")
            continue
        try:
            inside = in_window(version, low, high)
        except InvalidVersion:
            inside = False
        if not inside:
            problems.append(f"{name} {version} is outside the supported window {window}")
    if problems:
        fix = fix or install_command()
        raise VersionError(
            "; ".join(problems)
            + ": the trainer patches JAX and Orbax internals (trainer/distributed/internals.py, "
            "trainer/io/orbax_internals.py) that were "
            f"checked against these versions only. Fix, from the repository root: {fix} (constraints/README.md "
            "lists the files for each flavour and Python)"
        )
    return found


def pathways_image_jax(image: str) -> str | None:
    """The JAX version a Pathways image's tag names (".../pathways/server:jax-0.5.3" -> "0.5.3"); None when
    the tag names none ("latest", no tag, a digest only)."""
    name, _, tag = image.partition("@")[0].rpartition(":")
    if not name or "/" in tag:  # no tag ("host:5000/repo" is a registry port)
        return None
    m = _PATHWAYS_JAX_TAG.match(tag)
    return m.group(1) if m else None


def check_pathways_image(image: str, jax_version: str) -> str | None:
    """Refuse (VersionError) a Pathways image whose tag names another JAX release (X.Y.Z) than the client's
    `jax_version`: the client and the Pathways servers must run the same JAX. Returns the image's JAX
    version; None when its tag names none (nothing to compare)."""
    server = pathways_image_jax(image)
    if server is None:
        return None
    server_release, client_release = ((Version(v).release + (0, 0))[:3] for v in (server, jax_version))
    if server_release != client_release:
        client = ".".join(str(p) for p in client_release)
        raise VersionError(
            f"the Pathways image {image} is built for JAX {server}, but the trainer (the Pathways client) runs "
            f"JAX {jax_version}: both sides must run the same JAX release. Fix: use the images tagged "
            f"jax-{client} (render.py --pathways-version=jax-{client}), or build the trainer image with "
            f"jax=={server}"
        )
    return server
