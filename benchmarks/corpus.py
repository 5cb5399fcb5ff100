"""A real-text corpus every machine has, with no download: the Python standard library's own top-level
modules and the installed packages' descriptions and licence texts (their *.dist-info METADATA and
LICENSE files). The loss-parity, curves-through-failures and spike benchmarks train on it (`prepare`);
benchmarks/prepare_throughput.py times its preparation.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def text_inputs() -> list[str]:
    """The corpus: the standard library's top-level modules and the packages' METADATA and licences."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    files = sorted(stdlib.glob("*.py"))
    files += sorted(site.glob("*.dist-info/METADATA")) + sorted(site.glob("*.dist-info/LICEN[CS]E*"))
    files += sorted(site.glob("*.dist-info/licenses/*"))
    return [str(f) for f in files if f.is_file()]


def prepare(out: Path, *, tokenizer: Path | None = None, limit: int | None = None) -> dict:
    """The corpus (its first `limit` files) as 2 ArrayRecord shards of paragraphs in `out`, by
    `python -m trainer.data.prepare` (tokenized with `tokenizer`, else text records); exits on failure.
    Returns the shards' glob, the input files' count, and the records and tokens the preparation counted."""
    inputs = text_inputs()[:limit]
    cmd = [sys.executable, "-m", "trainer.data.prepare", "--output-dir", str(out), "--num-shards", "2"]
    cmd += ["--tokenizer", str(tokenizer)] if tokenizer else []
    cmd += ["--text-unit", "paragraph", "--prefix", "text"]
    for f in inputs:
        cmd += ["--input", f]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"preparing the corpus failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    info = json.loads((out / "dataset_info.json").read_text())
    return {
        "glob": str(out / "*.arrayrecord"),
        "files": len(inputs),
        "records": info.get("records"),
        "tokens": info.get("tokens"),
    }
