"""Fit, memory, collectives and estimated MFU of the presets on real TPU targets, compiled on this machine.

    python benchmarks/compile_presets.py [--only NAME ...] [--json-out presets.json]

Runs `python -m trainer.compile ... --json` (libtpu, no TPU) once per row below and prints a markdown
table per compiled layout: fits or not, per-chip memory (params + optimizer from the shardings; the
compiler's total against HBM), collective bytes per step and chip (ICI, DCN) and the roofline MFU.
Every row uses the presets' defaults (bf16 compute, float32 weights and Adam state, remat full,
per_device_batch_size 2, sequence 2048). It writes the record benchmarks/records/compile_presets.json,
from which docs/running_at_scale.md's table is rendered (benchmarks/compile_vs_maxtext.py compares the
seed's job with MaxText's). TRAINER_SMOKE=1 compiles one tiny row instead (a check that the script works,
not a measurement) and records nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import write_record  # noqa: E402

GIB = 1 << 30
# (name, trainer.compile arguments). The seed's job: qwen3-0.6b on 3 x v5e-16 with its checkpoint and
# elastic settings; elastic_min_slice_count=2 adds its replica-resize layout (2 surviving slices).
ROWS = [
    (
        "seed: qwen3-0.6b",
        [
            "model=qwen3-0.6b",
            "compile_topology=v5e-16",
            "compile_topology_num_slices=3",
            "elastic_enabled=true",
            "elastic_min_slice_count=2",
            "checkpoint_period=100",
        ],
    ),
    ("qwen3-4b", ["model=qwen3-4b", "compile_topology=v5e-16", "compile_topology_num_slices=3"]),
    ("qwen3-8b", ["model=qwen3-8b", "compile_topology=v5p-32"]),
    ("qwen3-8b", ["model=qwen3-8b", "compile_topology=v6e-16"]),
    ("qwen3-32b", ["model=qwen3-32b", "compile_topology=v5p-128"]),
    ("qwen3-32b", ["model=qwen3-32b", "compile_topology=v6e-64"]),
]
SMOKE_ROWS = [("smoke: qwen3-tiny", ["model=qwen3-tiny", "max_target_length=64", "compile_topology=v5e-4"])]


def compile_row(args: list[str]) -> tuple[int, dict, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.compile", "base.yml", *args, "--json"], capture_output=True, text=True
    )
    if proc.returncode not in (0, 4):
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"trainer.compile {' '.join(args)} exited {proc.returncode}")
    return proc.returncode, json.loads(proc.stdout), time.perf_counter() - t0


def _gb_sum(collectives: dict, network: str) -> str:
    """Collective buffer bytes per step and chip on one network, in GB (1e9 bytes)."""
    return f"{sum(v['bytes'] for v in collectives.get(network, {}).values()) / 1e9:.3f}"


def _largest_row(layout: dict) -> str:
    c = layout["largest_collectives"][0] if layout.get("largest_collectives") else None
    return "" if c is None else f"{c['network'].upper()} {c['kind']} `{c['shape']}` x{c['executions']}"


def table_rows(name: str, report: dict) -> list[str]:
    rows = []
    for layout in report["layouts"]:
        m, e, c = layout["memory"], layout["estimate"], layout["collectives"]
        where = report["target"] if layout["label"] == "all slices" else f"{report['target']}, {layout['label']}"

        mfu = "n/a" if not e or e.get("mfu") is None else f"{100 * e['mfu']:.0f}%"
        rows.append(
            f"| {name} | {where} | {'yes' if m['fits'] else '**no**'} | {m['params'] / GIB:.2f} + "
            f"{m['optimizer'] / GIB:.2f} | {m['total'] / 1e6:,.0f} / {m['hbm'] / GIB:.0f} GiB | "
            f"{_gb_sum(c, 'ici')} | {_gb_sum(c, 'dcn')} | {layout['global_batch_size']} x "
            f"{layout['micro_steps']} | {e.get('bound_by', '')} | {mfu} | {_largest_row(layout)} |"
        )
    for a in report["alternatives"]:
        if a["fits"]:
            rows.append(
                f"| | fits with {' '.join(a['overrides'])} | yes | | {a['total_bytes'] / 1e6:,.0f} | | | "
                f"{a['global_batch_size']} | | | |"
            )
    return rows


HEADER = (
    "| preset | target | fits | params + optimizer (GiB per chip) | compiler total per chip (MB) / HBM | "
    "ICI (GB per step and chip) | DCN (GB per step and chip) | global batch x micro-steps | roofline bound by | "
    "est. MFU ≤ | largest collective |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="rows whose name contains one of these")
    p.add_argument("--json-out", help="also write every report here")
    argv = sys.argv[1:]
    args = p.parse_args()
    rows = SMOKE_ROWS if os.environ.get("TRAINER_SMOKE") == "1" else ROWS
    if args.only:
        rows = [r for r in rows if any(o in r[0] for o in args.only)]
    print(HEADER, flush=True)
    reports, lines = [], [HEADER]
    for name, row_args in rows:  # each row printed (and saved) as soon as it is compiled: rows take minutes
        code, report, seconds = compile_row(row_args)
        print(f"{name} {' '.join(row_args)}: exit {code} in {seconds:.0f} s", file=sys.stderr, flush=True)
        reports.append({"name": name, "args": row_args, "exit": code, "seconds": round(seconds), "report": report})
        lines += table_rows(name, report)
        print("\n".join(table_rows(name, report)), flush=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(reports, f, indent=1)
    if not args.only:
        write_record(
            "compile_presets", "compile_presets", argv, tables={"layouts": "\n".join(lines)}, figures=reports
        )


if __name__ == "__main__":
    main()
