"""Kill a virtual slice of a running job from outside, like deleting a TPU worker pod.

    python -m trainer.chaos kill-slice --run-dir runs/my_run --slice 1 [--down-s 5]

Drops a request file into <run dir>/chaos/; the running trainer picks it up at its next step
boundary (within one step) and the step after fails with the slice-down error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def request_kill(run_dir: Path, slice_index: int, down_s: float) -> Path:
    chaos = Path(run_dir) / "chaos"
    chaos.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns()}-kill-slice-{slice_index}"
    tmp = chaos / f"{name}.tmp"
    tmp.write_text(json.dumps({"slice": slice_index, "down_s": down_s, "requested_at": time.time()}))
    final = chaos / f"{name}.json"
    os.replace(tmp, final)  # atomic: the trainer never reads a half-written request
    return final


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.chaos", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    kill = sub.add_parser("kill-slice", help="take a virtual slice down")
    kill.add_argument("--run-dir", required=True, type=Path)
    kill.add_argument("--slice", required=True, type=int)
    kill.add_argument("--down-s", type=float, default=0.0, help="seconds until the slice is healthy again")
    args = p.parse_args(argv)
    if not (args.run_dir / "events.jsonl").is_file():
        print(f"error: {args.run_dir} is not a run directory (no events.jsonl)", file=sys.stderr)
        return 2
    path = request_kill(args.run_dir, args.slice, args.down_s)
    print(f"requested: kill slice {args.slice} for {args.down_s}s ({path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
