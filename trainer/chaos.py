"""Kill a virtual slice of a running job from outside, like deleting a TPU worker pod.

    python -m trainer.chaos kill-slice --run-dir runs/my_run --slice 1 [--down-s 5]

--slice is an index in [0, num_slices) of the run's config.yml; --down-s is the seconds the slice stays
unhealthy, finite and >= 0 (default 0). Drops a request file into <run dir>/chaos/; the running trainer
picks it up at its next step boundary (within one step) and the step after fails with the slice-down
error. Exit 0 when the request is written, 2 (one line naming the input and the fix) when refused.

Only a live run is accepted, so a request cannot wait in the directory for a later run:
- live means the newest `start` event in <run dir>/events.jsonl has no `finish` after it and its `pid`
  is a running process on this host (the tool only reaches trainers on the machine it runs on, and
  local virtual slices exist only there);
- the request names that attempt (`target`: the start event's pid and time). The trainer honours only a
  request naming itself (trainer.elastic.faults), so one the attempt never read, because it ended
  between this check and its next step, is ignored by every later (resumed) run of the directory.
  The pid alone would not do: a container restarts its trainer with the same pid.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

from trainer.errors import UserInputError, tool_main
from trainer.failures.chaos_requests import attempt_of, request_kill
from trainer.io.jsonl import read_jsonl
from trainer.io.paths import is_remote, resolve
from trainer.observe import catalogue

PROG = "python -m trainer.chaos"
EVENTS_FILE, CONFIG_FILE = "events.jsonl", "config.yml"


# ---- validation: every check names the bad input and what to do instead ---------------------------------


def check_down_s(down_s: float) -> None:
    if not (math.isfinite(down_s) and down_s >= 0):
        raise UserInputError(
            f"--down-s {down_s}: the seconds the slice stays down must be a finite number >= 0 "
            f"(0 = it is healthy again at once, after failing one step)"
        )


def local_run_dir(text: str) -> Path:
    """--run-dir as an absolute local path. Requests are files the trainer polls on its own disk: for a run
    on an object store, that is the local mirror its logs are written to (trainer.observe.rundir)."""
    if is_remote(text):
        from trainer.observe.rundir import run_paths

        base, _, name = text.rstrip("/").rpartition("/")
        return run_paths(base, name).local
    return Path(os.fspath(resolve(text)))


def check_run_dir(run_dir: Path, given: str) -> None:
    where = f"--run-dir {given}" + (
        "" if str(run_dir) == os.path.abspath(os.path.expanduser(given)) else f" (local mirror {run_dir})"
    )
    if not run_dir.is_dir():
        raise UserInputError(
            f"{where}: no such directory on this host; give <base_output_directory>/<run_name> "
            f"of a trainer running here"
        )
    missing = [n for n in (EVENTS_FILE, CONFIG_FILE) if not (run_dir / n).is_file()]
    if missing:
        raise UserInputError(
            f"{where}: not a run directory (no {' or '.join(missing)}); give "
            f"<base_output_directory>/<run_name> of a trainer running here"
        )


def num_slices(run_dir: Path) -> int:
    """The run's slice count from its config.yml; refuses runs whose trainer reads no chaos requests."""
    from trainer.config import load_resolved

    cfg = load_resolved(run_dir / CONFIG_FILE)
    cluster = cfg.distributed.cluster
    if cluster == "pathways" or (cluster == "auto" and cfg.mesh.enable_single_controller):
        given = "cluster=pathways" if cluster == "pathways" else "enable_single_controller=true"
        raise UserInputError(
            f"--run-dir {run_dir}: the run uses {given} (Pathways), whose slices are real; delete a worker "
            "pod instead"
        )
    if cluster == "processes" or any(run_dir.glob("process_*/" + EVENTS_FILE)):
        raise UserInputError(
            f"--run-dir {run_dir}: a multi-process job, whose slices are processes; kill one "
            f"(kill -9 PID; scripts/launch_local.py starts a replacement)"
        )
    return cfg.mesh.num_slices


def check_slice(slice_index: int, slices: int | None) -> None:
    """`slices` None: only the lower bound (before the run's config is read)."""
    if slice_index < 0 or (slices is not None and slice_index >= slices):
        bound = (
            f"this run has num_slices={slices}: give an index in [0, {slices})"
            if slices is not None
            else "give an index in [0, num_slices) of the run's config.yml"
        )
        raise UserInputError(f"--slice {slice_index}: {bound}")


def pid_running(pid: Any) -> bool:
    """True when `pid` is a process on this host that has not exited (a zombie, dead but not yet reaped
    by its parent, counts as exited)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (macOS): the signal check is all there is
    return state not in ("Z", "X")


def live_attempt(run_dir: Path) -> dict[str, Any]:
    """The identity of the trainer running in `run_dir` now (see the module docstring)."""
    events = read_jsonl(run_dir / EVENTS_FILE)
    starts = [i for i, e in enumerate(events) if e.get("event") == catalogue.START]
    if not starts:
        raise UserInputError(
            f"--run-dir {run_dir}: no trainer has started in it yet (no start event in "
            f"{EVENTS_FILE}); request the kill once it trains"
        )
    start = events[starts[-1]]
    finish = [e for e in events[starts[-1] + 1 :] if e.get("event") == catalogue.FINISH]
    if finish:
        raise UserInputError(
            f"--run-dir {run_dir}: the run has ended (status {finish[-1].get('status', '?')}); "
            f"kill-slice acts on a running trainer: resume the run (the same training command) "
            f"and request the kill while it trains"
        )
    pid = start.get("pid")
    if not pid_running(pid):
        raise UserInputError(
            f"--run-dir {run_dir}: the run is not running: its trainer (pid {pid}) wrote no "
            f"finish event but no such process runs on this host (it was killed, or runs on "
            f"another machine, which kill-slice cannot reach); resume the run first"
        )
    return attempt_of(start)


def kill_slice(run_dir_arg: str, slice_index: int, down_s: float) -> Path:
    """Validate everything, then write the request for the live attempt."""
    check_down_s(down_s)
    check_slice(slice_index, None)
    run_dir = local_run_dir(run_dir_arg)
    check_run_dir(run_dir, run_dir_arg)
    check_slice(slice_index, num_slices(run_dir))
    return request_kill(run_dir, slice_index, down_s, live_attempt(run_dir))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    kill = sub.add_parser(
        "kill-slice",
        help="take a virtual slice of a running trainer down",
        description="Take a virtual slice of a running trainer (on this host) down: its next "
        "step fails with the slice-down error. Refused, with exit 2, for a run "
        "that is not running or an index or duration out of range.",
    )
    kill.add_argument(
        "--run-dir",
        required=True,
        type=str,
        metavar="DIR",
        help="the running trainer's <base_output_directory>/<run_name> (for a gs:// run, the "
        "trainer's local mirror of it is used)",
    )
    kill.add_argument(
        "--slice",
        required=True,
        type=int,
        metavar="INDEX",
        help="index of the slice to kill, in [0, num_slices) of the run's config.yml",
    )
    kill.add_argument(
        "--down-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="seconds the slice stays unhealthy, a finite number >= 0 (default 0: it fails one "
        "step and is healthy again at once)",
    )
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)

    def body() -> int:
        path = kill_slice(args.run_dir, args.slice, args.down_s)
        print(f"requested: kill slice {args.slice} for {args.down_s}s ({path})")
        return 0

    return tool_main(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
