"""Peak dense bf16 TFLOP/s per device, for MFU. Public spec-sheet numbers (dense, no sparsity)."""

from __future__ import annotations

# Matched against jax's device_kind, most specific first.
PEAK_TFLOPS = (
    ("TPU v6 lite", 918.0),  # v6e (Trillium)
    ("TPU v6e", 918.0),
    ("TPU v5 lite", 197.0),  # v5e
    ("TPU v5e", 197.0),
    ("TPU v5p", 459.0),
    ("TPU v5", 459.0),  # v5p reports "TPU v5"
    ("TPU v4", 275.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100", 989.0),  # SXM; PCIe parts are slower: pass peak_tflops_per_device
)


def peak_tflops(device_kind: str, override: float = 0.0) -> float | None:
    """The override if set, else the table's entry for this device kind, else None (e.g. CPU)."""
    if override > 0:
        return override
    for name, tflops in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return tflops
    return None
