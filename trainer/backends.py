"""Which JAX backends a process may start: the CPU one only, when libtpu is installed but no TPU is attached.

The `tpu` extra installs libtpu so that `trainer.compile` can compile for TPU topologies on any
machine. With libtpu importable, JAX tries to start a TPU backend in every process that touches a
device, even where no TPU exists: each start then waits on a TPU that is not there and prints libtpu's
warnings about missing TPU environment variables. Ahead-of-time compilation loads libtpu on its own
(`jax.experimental.topologies`), so nothing here needs that backend. `pin_cpu_without_tpu` sets
JAX_PLATFORMS=cpu in exactly that case, before any backend starts; an explicit JAX_PLATFORMS (for
example Pathways' `proxy`), an attached TPU, or a CUDA plugin leave JAX's own choice alone.

On GPUs, XLA's scatter-add (the embedding gradient) and some reductions sum in whatever order their
atomics land, so two runs of the same step differ in the last bits, and a replay after recovery is not
bitwise. `deterministic_gpu_ops` asks XLA for its deterministic kernels before any backend starts; an
XLA_FLAGS that names the flag already (`--xla_gpu_deterministic_ops=false` for the last few percent of
speed) wins.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device ids of Cloud TPU chips (v3, v4, v5p, v5e, v6e, TPU7x and one without a public name). Other
# Google PCI devices (the gVNIC network card of every GCE VM) share the vendor id, so it is not enough.
_TPU_PCI_DEVICES = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")
_DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops"


def tpu_attached(pci_root: Path = Path("/sys/bus/pci/devices")) -> bool:
    """Whether a TPU chip is on this machine's PCI bus (how libtpu finds its chips, too)."""
    for vendor in pci_root.glob("*/vendor"):
        try:
            if vendor.read_text().strip() != _GOOGLE_PCI_VENDOR:
                continue
            if (vendor.parent / "device").read_text().strip() in _TPU_PCI_DEVICES:
                return True
        except OSError:
            continue
    return False


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def pin_cpu_without_tpu(environ=os.environ) -> bool:
    """Set JAX_PLATFORMS=cpu when libtpu is installed, no TPU is attached and nothing else decided.

    Returns whether it pinned. Safe to call after `import jax` as long as no backend has started
    (jax reads JAX_PLATFORMS at import, so the config is updated too)."""
    if "JAX_PLATFORMS" in environ or not _installed("libtpu"):
        return False
    if any(_installed(m) for m in _CUDA_PLUGINS) or tpu_attached():
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    jax = sys.modules.get("jax")
    if jax is not None and environ is os.environ:
        jax.config.update("jax_platforms", "cpu")
    return True


def deterministic_gpu_ops(environ=os.environ) -> bool:
    """Add `--xla_gpu_deterministic_ops=true` to XLA_FLAGS unless they name it already; returns whether it
    added it. XLA reads XLA_FLAGS when the first backend starts, so call it before that; other platforms
    ignore the flag."""
    flags = environ.get("XLA_FLAGS", "")
    if _DETERMINISTIC_FLAG in flags:
        return False
    environ["XLA_FLAGS"] = f"{flags} {_DETERMINISTIC_FLAG}=true".strip()
    return True
