"""A real-text corpus every machine has, with no download: the Python standard library's own top-level
modules, its language reference and library topics (pydoc_data/topics.py, English prose) and its licence.
It depends on the CPython version alone, never on what else is installed, so the same interpreter always
gives the same text (`fingerprint` names it in the records). The loss-parity, curves-through-failures and
spike benchmarks train on it (`prepare`); benchmarks/prepare_throughput.py times its preparation.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def text_inputs() -> list[str]:
    """The corpus's files, in a fixed order: the standard library's top-level modules, then
    pydoc_data/topics.py and LICENSE.txt where the installation has them."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py")) + [stdlib / "pydoc_data" / "topics.py", stdlib / "LICENSE.txt"]
    return [str(f) for f in files if f.is_file()]


def fingerprint(files: list[str]) -> str:
    """sha256 over the files' contents, in order (their paths left out): equal fingerprints, equal text."""
    h = hashlib.sha256()
    for f in files:
        data = Path(f).read_bytes()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def prepare(out: Path, *, tokenizer: Path | None = None, limit: int | None = None) -> dict:
    """The corpus (its first `limit` files) as 2 ArrayRecord shards of paragraphs in `out`, by
    `python -m trainer.data.prepare` (tokenized with `tokenizer`, else text records); exits on failure.
    Returns the shards' glob, the input files' count and fingerprint, and the records and tokens the
    preparation counted."""
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
        "fingerprint": fingerprint(inputs)[:16],
        "records": info.get("records"),
        "tokens": info.get("tokens"),
    }
