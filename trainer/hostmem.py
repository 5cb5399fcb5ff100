"""Huge pages for host memory: the CLI runs with glibc's `glibc.malloc.hugetlb=1` tunable.

Why: on the CPU backend every device buffer is malloc'd host memory, and host RAM snapshots and
checkpoint staging are host memory on every backend. glibc serves large blocks with fresh mmaps of
4 KiB pages and unmaps them on free, so each step's large temporaries, each restore and each snapshot
page-faults its whole size back in, and the TLB covers little of it. With the tunable, malloc
madvises those blocks as transparent huge pages (2 MiB): steps, restores and snapshots get faster, and
each process pays once, at start-up, for first-touch zeroing of 2 MiB pages (README, Performance:
`python benchmarks/train_throughput.py model=qwen3-tiny steps=40 --hugepages on off` measures both).

glibc reads GLIBC_TUNABLES only when a process starts, so the CLI re-executes itself once, before
importing anything heavy, with the tunable added. exec keeps the PID, the arguments and the rest of the
environment. Nothing happens when the tunable is already set (the container image sets it), when
glibc is older than 2.35 or absent, when the kernel's THP mode is `never`, or with
TRAINER_HUGEPAGE_MALLOC=0.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "TRAINER_HUGEPAGE_MALLOC"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_version() -> tuple[int, ...] | None:
    try:
        found = re.search(r"glibc (\d+)\.(\d+)", os.confstr("CS_GNU_LIBC_VERSION") or "")
    except (ValueError, OSError, AttributeError):
        return None
    return tuple(int(x) for x in found.groups()) if found else None


def _thp_mode() -> str | None:
    try:
        with open(_THP_MODE) as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return found.group(1) if found else None


def hugepage_environ(
    environ: Mapping[str, str], *, glibc: tuple[int, ...] | None, thp_mode: str | None
) -> dict[str, str] | None:
    """The environment to re-execute with, or None when there is nothing to do (see the module doc)."""
    if environ.get(OPT_OUT, "1") == "0" or glibc is None or glibc < (2, 35) or thp_mode in (None, "never"):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"}


def cli_takes_hugepages(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the CLI started with `environ` and no GLIBC_TUNABLES of the caller's runs its host malloc on
    huge pages on this machine (the rule `reexec_with_hugepages` applies: glibc 2.35+, transparent huge
    pages not `never`, no opt-out). A benchmark gives another program the same to compare like with like."""
    environ = {k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"}
    return hugepage_environ(environ, glibc=_glibc_version(), thp_mode=_thp_mode()) is not None


def hugepages_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process started with the tunable (reported in the run's start event)."""
    return f"{TUNABLE}=1" in environ.get("GLIBC_TUNABLES", "")


def reexec_with_hugepages() -> None:
    """Replace this process with the same command line plus the tunable; returns only if not needed."""
    env = hugepage_environ(os.environ, glibc=_glibc_version(), thp_mode=_thp_mode())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # argv[0] is this interpreter's own path, so a venv's python finds its venv again whatever PATH says.
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
