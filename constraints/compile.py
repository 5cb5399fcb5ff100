"""Write constraints/<flavour>-py<X.Y>.txt: the exact versions pip resolves today for one install.

    python constraints/compile.py FLAVOUR [--prefer FILE]

Run it with the Python the file is for (its X.Y names the file) on Linux x86-64, the platform of the images
and of CI. FLAVOUR is what is installed:
  cpu, cuda12, tpu  the Dockerfile's step 1 with JAX_EXTRA=FLAVOUR: setuptools, jax[FLAVOUR] in jax's range
                    and pyproject.toml's dependencies
  ci                .ci/run's `pip install -e ".[test,wandb,tpu]"`: the dependencies and those extras
--prefer FILE keeps the versions FILE pins (a constraints file, or a venv's `pip freeze`) where the ranges
allow them; without it every package is the newest the ranges allow. Nothing is installed: pip resolves
with `install --dry-run --ignore-installed --report`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAVOURS = ("cpu", "cuda12", "tpu", "ci")
CI_EXTRAS = ("test", "wandb", "tpu")  # .ci/run's extras
DOCKER_SETUPTOOLS = "setuptools>=70.1"  # the Dockerfile's step 1 installs it with the dependencies
PROJECT = "elastic-trainer"


def requirements(flavour: str, pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The requirement lines the install of `flavour` asks pip for."""
    project = tomllib.loads(pyproject.read_text())["project"]
    deps = list(project["dependencies"])
    if flavour == "ci":
        extras = project["optional-dependencies"]
        return deps + [r for extra in CI_EXTRAS for r in extras[extra]]
    jax = next(d for d in deps if re.match(r"^jax[<>=! ]", d))
    return [DOCKER_SETUPTOOLS, f"jax[{flavour}]{jax[len('jax') :]}", *deps]


def preferred(text: str) -> list[str]:
    """The `name==version` lines of a constraints file or `pip freeze` (editable and URL lines, and this
    project, dropped: they are not constraints pip accepts)."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m and m.group(1).lower().replace("_", "-") != PROJECT:
            out.append(line)
    return out


def resolve(reqs: list[str], prefer: list[str]) -> list[tuple[str, str]]:
    """[(name, version)] of every package pip would install for `reqs`, sorted by name."""
    with tempfile.TemporaryDirectory() as tmp:
        req_file, pref_file, report = Path(tmp, "requirements.txt"), Path(tmp, "prefer.txt"), Path(tmp, "r.json")
        req_file.write_text("\n".join(reqs) + "\n")
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        cmd += ["--report", str(report), "-r", str(req_file)]
        if prefer:
            pref_file.write_text("\n".join(prefer) + "\n")
            cmd += ["-c", str(pref_file)]
        subprocess.run(cmd, check=True)
        installs = json.loads(report.read_text())["install"]
    pins = {(i["metadata"]["name"], i["metadata"]["version"]) for i in installs}
    return sorted(pins, key=lambda p: p[0].lower())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python constraints/compile.py", description=__doc__.split("\n")[0])
    ap.add_argument("flavour", choices=FLAVOURS)
    ap.add_argument("--prefer", type=Path, help="constraints file or pip freeze whose versions to keep")
    ap.add_argument("-o", "--output", type=Path, help="default constraints/<flavour>-py<X.Y>.txt")
    args = ap.parse_args(argv)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    out = args.output or ROOT / "constraints" / f"{args.flavour}-py{python}.txt"
    prefer = preferred(args.prefer.read_text()) if args.prefer else []
    pins = resolve(requirements(args.flavour), prefer)
    header = [
        f"# Exact versions of the {args.flavour} install on Python {python}, Linux x86-64: constraints/README.md",
        f"# Regenerate: python{python} constraints/compile.py {args.flavour} [--prefer FILE]; not by hand.",
    ]
    out.write_text("\n".join(header + [f"{name}=={version}" for name, version in pins]) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}: {len(pins)} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
