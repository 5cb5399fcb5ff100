"""Running the rendered deploy scripts against stub commands (`xpk`, `srun`, `scontrol`, ...) on PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

BASH = shutil.which("bash")


def stub(bin_dir: Path, name: str, body: str) -> None:
    """An executable `bin_dir/name` running the bash `body`."""
    bin_dir.mkdir(exist_ok=True)
    f = bin_dir / name
    f.write_text("#!/usr/bin/env bash\n" + body)
    f.chmod(0o755)


def run_xpk_script(tmp_path: Path, text: str, *args: str, cluster: tuple[str, str, str]) -> dict[str, list[str]]:
    """Run an xpk submit script (`text`) against a stub `xpk` that records its argv; the flags it passed to
    `xpk workload create-pathways`, as {flag: [values]}. `cluster`: PROJECT, ZONE, CLUSTER."""
    script = tmp_path / "submit.sh"
    script.write_text(text)
    record = tmp_path / "xpk_argv.json"
    stub(
        tmp_path / "bin",
        "xpk",
        f'python3 -c \'import json, sys; json.dump(sys.argv[1:], open("{record}", "w"))\' "$@"\n',
    )
    project, zone, name = cluster
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PROJECT": project, "ZONE": zone}
    env["CLUSTER"] = name
    out = subprocess.run([BASH, str(script), *args], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    argv = json.loads(record.read_text())
    assert argv[:2] == ["workload", "create-pathways"]
    flags: dict[str, list[str]] = {}
    for a in argv[2:]:
        k, _, v = a.partition("=")
        flags.setdefault(k, []).append(v)
    return flags
