"""A real-text corpus every machine has, with no download: the Python standard library's own top-level
modules and the installed packages' descriptions and licence texts (their *.dist-info METADATA and
LICENSE files). benchmarks/spike_false_positives.py trains on it; benchmarks/prepare_throughput.py
prepares it.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path


def text_inputs() -> list[str]:
    """The corpus: the standard library's top-level modules and the packages' METADATA and licences."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    files = sorted(stdlib.glob("*.py"))
    files += sorted(site.glob("*.dist-info/METADATA")) + sorted(site.glob("*.dist-info/LICEN[CS]E*"))
    files += sorted(site.glob("*.dist-info/licenses/*"))
    return [str(f) for f in files if f.is_file()]
