"""JAX and Orbax are pinned and checked (`trainer/distributed/internals.py`, constraints/).

- The window the internals were checked in is pyproject.toml's ranges, and every constraints file pins
  jax and orbax-checkpoint inside it; the Dockerfile and .ci/run install from constraints files that exist.
- `check_versions` refuses a version outside the window (exit 2, naming the version, the window and the
  fix), through the real CLI too: a fake installed distribution on PYTHONPATH makes the installed metadata
  name another version, the way pip would have left it. Inside the window (this repo's venvs) it passes.
- `check_pathways_image` refuses a Pathways image whose tag names another JAX release than the client's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from trainer.distributed import internals
from trainer.distributed.internals import (
    CHECKED_VERSIONS,
    VersionError,
    check_pathways_image,
    check_versions,
    in_window,
    install_command,
    installed_versions,
    pathways_image_jax,
)
from trainer.errors import EXIT_BAD_INPUT, UserInputError, exit_code_for

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints"
FLAVOURS = ("cpu", "cuda12", "tpu")
PYTHONS = ("3.11", "3.12")  # CI's two, and the Pythons the Dockerfile pins a base for
PATHWAYS_SERVER = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/server"


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _range(requirement: str, name: str) -> str | None:
    """The version specifier of `name` in a requirement line (None if the line is about another package)."""
    m = re.fullmatch(rf"{re.escape(name)}(\[[^\]]*\])?\s*([<>=!~][^;]*?)\s*(;.*)?", requirement.strip())
    return None if m is None else m.group(2).replace(" ", "")


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line.strip())
        assert m, f"{path.name}: {line!r} is not an exact pin name==version"
        name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        assert name not in pins, f"{path.name} pins {name} twice"
        pins[name] = m.group(2)
    return pins


# ------------------------------------------------------------------------------------------------
# The window, pyproject.toml and the constraints files agree.
# ------------------------------------------------------------------------------------------------
def test_the_checked_window_is_pyprojects_range():
    project = _pyproject()
    requirements = list(project["dependencies"]) + list(project["optional-dependencies"]["tpu"])
    for name, (low, high) in CHECKED_VERSIONS.items():
        ranges = {r for r in (_range(req, name) for req in requirements) if r is not None}
        assert ranges == {f">={low},<{high}"}, f"pyproject.toml's {name} ranges {ranges} != {low}..{high}"


@pytest.mark.parametrize(
    "version, inside",
    [
        ("0.7.0", True),
        ("0.10.2", True),
        ("0.12.0.1", True),  # a fourth release number
        ("0.10.2+cuda12", True),  # a local label
        ("0.13.9.post1", True),
        ("0.10.3.dev20250101", True),  # a nightly between two releases
        ("0.6.2", False),
        ("0.7.0rc1", False),  # a pre-release of the lowest is below it
        ("0.14", False),
        ("0.14.0", False),
        ("0.14.0rc1", False),  # pip never picks a pre-release of the upper bound for <0.14
        ("1.0.0", False),
    ],
)
def test_the_window_reads_versions_as_pip_does(version, inside):
    assert in_window(version, "0.7.0", "0.14") is inside


def test_every_constraints_file_pins_jax_and_orbax_inside_the_window():
    files = sorted(CONSTRAINTS.glob("*.txt"))
    assert {f.name for f in files} >= {f"{k}-py{p}.txt" for k in (*FLAVOURS, "ci") for p in PYTHONS}
    for path in files:
        pins = _pins(path)
        for name, (low, high) in CHECKED_VERSIONS.items():
            assert name in pins, f"{path.name} does not pin {name}"
            assert in_window(pins[name], low, high), f"{path.name}: {name}=={pins[name]} outside {low}..{high}"
        assert pins["jaxlib"] == pins["jax"], f"{path.name}: jaxlib and jax differ"
    for python in PYTHONS:  # the image sets share CI's tested versions of what they have in common
        ci = _pins(CONSTRAINTS / f"ci-py{python}.txt")
        for flavour in FLAVOURS:
            image = _pins(CONSTRAINTS / f"{flavour}-py{python}.txt")
            differ = {n: (v, ci[n]) for n, v in image.items() if n in ci and ci[n] != v}
            assert not differ, f"{flavour}-py{python}.txt differs from ci-py{python}.txt: {differ}"
    for flavour, plugin in (("cuda12", "jax-cuda12-plugin"), ("tpu", "libtpu")):
        for python in PYTHONS:
            assert plugin in _pins(CONSTRAINTS / f"{flavour}-py{python}.txt")


def test_the_dockerfile_installs_from_the_constraints_of_its_flavour_and_python():
    text = (REPO / "Dockerfile").read_text()
    ops = [l.split()[0] for l in text.splitlines() if l.strip() and not l.startswith((" ", "#"))]
    assert "COPY constraints ./constraints" in text
    install = text.index('pip install -c "${pins}"')
    assert text.index("COPY constraints ./constraints") < install < text.index("COPY trainer ./trainer")
    assert ops.count("FROM") == 1
    # The file name the RUN builds, for each flavour and Python the image may be built with.
    m = re.search(r"pins=\"(constraints/\$\{JAX_EXTRA\}-py)\$\(python -c '(.+)'\)(\.txt)\"", text)
    assert m, "the Dockerfile names constraints/${JAX_EXTRA}-py<X.Y>.txt"
    prefix, python_code, suffix = m.groups()
    here = subprocess.run([sys.executable, "-c", python_code], capture_output=True, text=True, check=True)
    assert here.stdout.strip() == f"{sys.version_info.major}.{sys.version_info.minor}"
    # Every Python the Dockerfile names a pinned base for (its default and the one its comment gives).
    based_on = set(re.findall(r"BASE_IMAGE=python:(\d+\.\d+)-slim@sha256:", text))
    assert based_on == set(PYTHONS), based_on
    for flavour in FLAVOURS:
        for python in PYTHONS:
            name = prefix.replace("${JAX_EXTRA}", flavour) + python + suffix
            assert (REPO / name).is_file(), f"the Dockerfile would install from {name}, which is missing"


def test_ci_installs_each_venv_from_the_constraints_of_its_python():
    text = (REPO / ".ci" / "run").read_text()
    installs = [l.strip() for l in text.splitlines() if re.search(r"pip install .*-e ", l)]
    assert len(installs) == 2, installs
    files = [re.search(r"-c (\S+)", l) for l in installs]
    assert all(files), f"every project install in .ci/run names its constraints: {installs}"
    assert [f.group(1) for f in files] == ["constraints/ci-py3.11.txt", "constraints/ci-py3.12.txt"]
    assert text.index(installs[1]) > text.index('"${PY312}" -m venv .venv312') > text.index(installs[0])
    for f in files:
        assert (REPO / f.group(1)).is_file()


def _generator():
    spec = importlib.util.spec_from_file_location("constraints_compile", CONSTRAINTS / "compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generator_asks_for_what_ci_and_the_dockerfile_install():
    compile_ = _generator()
    ci = (REPO / ".ci" / "run").read_text()
    assert f'-e ".[{",".join(compile_.CI_EXTRAS)}]"' in ci
    assert f'"{compile_.DOCKER_SETUPTOOLS}" "jax[${{JAX_EXTRA}}]${{jax_pin}}"' in (REPO / "Dockerfile").read_text()
    assert "jax[tpu]>=0.7.0,<0.14" in compile_.requirements("tpu")
    freeze = "# comment\n-e /work/main\nelastic_trainer==0.1.0\njax==0.10.2\npkg @ file:///x.whl\nNumPy==2.0\n"
    assert compile_.preferred(freeze) == ["jax==0.10.2", "NumPy==2.0"]


def test_each_constraints_file_pins_every_package_its_install_asks_for():
    """A requirement added to pyproject.toml fails here until the files are regenerated (README.md)."""
    compile_ = _generator()
    for flavour in (*FLAVOURS, "ci"):
        names = {
            re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", r).group()).lower()
            for r in compile_.requirements(flavour)
        }
        for python in PYTHONS:
            missing = names - set(_pins(CONSTRAINTS / f"{flavour}-py{python}.txt"))
            assert not missing, f"{flavour}-py{python}.txt pins none of {sorted(missing)}: regenerate it"


# ------------------------------------------------------------------------------------------------
# The start-up check.
# ------------------------------------------------------------------------------------------------
def test_this_environment_is_inside_the_window():
    found = installed_versions()
    assert found["jax"] and found["orbax-checkpoint"]
    assert check_versions() == found


def test_a_jax_outside_the_window_is_refused_naming_version_window_and_fix():
    fix = install_command(python="3.11", flavour="cpu")
    assert fix == 'pip install -c constraints/cpu-py3.11.txt -e . "jax[cpu]"'
    with pytest.raises(VersionError) as e:
        check_versions({"jax": "0.6.2", "orbax-checkpoint": "0.12.8"}, fix=fix)
    message = str(e.value)
    assert "jax 0.6.2 is outside the supported window jax>=0.7.0,<0.14" in message
    assert fix in message and "orbax" not in message.split(":")[0]
    assert isinstance(e.value, UserInputError) and exit_code_for(e.value) == EXIT_BAD_INPUT


@pytest.mark.parametrize(
    "found, says",
    [
        ({"jax": "0.14.0", "orbax-checkpoint": "0.12.8"}, "jax 0.14.0 is outside"),
        (
            {"jax": "0.10.2", "orbax-checkpoint": "0.12.2"},
            "orbax-checkpoint 0.12.2 is outside the supported window ",
        ),
        ({"jax": "0.10.2", "orbax-checkpoint": "0.14.1"}, "orbax-checkpoint>=0.12.3,<0.14"),
        ({"jax": None, "orbax-checkpoint": "0.12.8"}, "jax is not installed"),
        ({"jax": "nightly", "orbax-checkpoint": "0.12.8"}, "jax nightly is outside"),
    ],
)
def test_versions_outside_the_window_are_refused(found, says):
    with pytest.raises(VersionError, match=re.escape(says)):
        check_versions(found, fix="pip install ...")


@pytest.mark.parametrize(
    "found", [{"jax": "0.10.2", "orbax-checkpoint": "0.12.8"}, {"jax": "0.12.0.1", "orbax-checkpoint": "0.12.8"}]
)
def test_the_repos_own_versions_pass(found):
    assert check_versions(found) == found


def test_the_fix_names_the_installed_flavour(monkeypatch):
    for plugins, flavour in (
        ({}, "cpu"),
        ({"libtpu": "0.0.42.1"}, "tpu"),
        ({"jax-cuda12-plugin": "0.10.2"}, "cuda12"),
    ):
        monkeypatch.setattr(internals, "installed_versions", lambda names, p=plugins: {n: p.get(n) for n in names})
        command = install_command(python="3.12")
        assert command == f'pip install -c constraints/{flavour}-py3.12.txt -e . "jax[{flavour}]"'
        assert (REPO / command.split()[3]).is_file()


def _fake_installed(root: Path, name: str, version: str) -> Path:
    """A directory that, first on PYTHONPATH, makes the installed metadata of `name` say `version`."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


def _cli(tmp_path: Path, *args: str, pythonpath: Path | None = None):
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "trainer.train", "base.yml", f"base_output_directory={tmp_path / 'runs'}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_the_cli_refuses_a_jax_outside_the_window_with_exit_2(tmp_path):
    proc = _cli(tmp_path, "steps=1", pythonpath=_fake_installed(tmp_path / "site", "jax", "0.6.2"))
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "STATUS: input_error"
    assert "input error: jax 0.6.2 is outside the supported window jax>=0.7.0,<0.14" in proc.stderr
    assert "Fix, from the repository root: pip install -c constraints/" in proc.stderr
    assert "started run" not in proc.stderr and not (tmp_path / "runs").exists(), "refused before anything else"


@pytest.mark.slow
def test_the_cli_refuses_an_orbax_outside_the_window(tmp_path):
    site = _fake_installed(tmp_path / "site", "orbax-checkpoint", "0.11.0")
    proc = _cli(tmp_path, "--print-config", pythonpath=site)
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    assert "orbax-checkpoint 0.11.0 is outside the supported window orbax-checkpoint>=0.12.3,<0.14" in proc.stderr


@pytest.mark.slow
def test_the_cli_starts_inside_the_window(tmp_path):
    proc = _cli(tmp_path, "--print-config")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "outside the supported window" not in proc.stderr


# ------------------------------------------------------------------------------------------------
# Pathways: the client's JAX against the image's.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "image, version",
    [
        (f"{PATHWAYS_SERVER}:jax-0.10.2", "0.10.2"),
        (f"{PATHWAYS_SERVER}:jax-0.12.0", "0.12.0"),
        (f"{PATHWAYS_SERVER}:jax-0.10.2@sha256:{'0' * 64}", "0.10.2"),
        (f"{PATHWAYS_SERVER}:jax-0.10.2-rc1", "0.10.2"),
        (f"{PATHWAYS_SERVER}:latest", None),
        (f"{PATHWAYS_SERVER}@sha256:{'0' * 64}", None),
        ("localhost:5000/pathways/server", None),  # a registry port, no tag
        ("localhost:5000/pathways/server:jax-0.7.1", "0.7.1"),
        (f"{PATHWAYS_SERVER}:nightly-jax-0.10.2", None),
    ],
)
def test_the_pathways_image_tag_names_its_jax(image, version):
    assert pathways_image_jax(image) == version


def test_a_pathways_image_for_another_jax_is_refused():
    image = f"{PATHWAYS_SERVER}:jax-0.10.2"
    with pytest.raises(VersionError) as e:
        check_pathways_image(image, "0.12.0.1")
    message = str(e.value)
    assert image in message and "JAX 0.10.2" in message and "JAX 0.12.0.1" in message
    assert "--pathways-version=jax-0.12.0" in message and "jax==0.10.2" in message
    assert exit_code_for(e.value) == EXIT_BAD_INPUT


def test_a_pathways_image_for_the_clients_jax_passes():
    assert check_pathways_image(f"{PATHWAYS_SERVER}:jax-0.10.2", "0.10.2") == "0.10.2"
    assert check_pathways_image(f"{PATHWAYS_SERVER}:jax-0.12.0", "0.12.0.1") == "0.12.0"  # same X.Y.Z
    assert check_pathways_image(f"{PATHWAYS_SERVER}:latest", "0.6.0") is None  # nothing to compare


def test_the_renderers_default_pathways_images_name_the_trainers_jax(monkeypatch):
    """The renderer's default images are tagged jax-<the trainer image's JAX> (the pin of the Dockerfile's TPU
    build), so the check passes for it and refuses another client JAX; --pathways-version=jax-X.Y.Z pins
    another."""
    monkeypatch.syspath_prepend(str(REPO))
    from scripts.deploy.params import DeployParams
    from scripts.deploy.pathways import default_trainer_jax

    default = DeployParams(slices=1, image="trainer:tpu", run_name="r", output_dir="gs://b/o")
    for image in (default.image_server, default.image_proxy):
        assert pathways_image_jax(image) == default_trainer_jax()
        assert check_pathways_image(image, default_trainer_jax()) == default_trainer_jax()
    pinned = DeployParams(
        slices=1, image="trainer:tpu", run_name="r", output_dir="gs://b/o", pathways_version="jax-0.10.2"
    )
    for image in (pinned.image_server, pinned.image_proxy):
        assert check_pathways_image(image, "0.10.2") == "0.10.2"
        with pytest.raises(VersionError):
            check_pathways_image(image, "0.12.0.1")
