"""One job per run directory: a lease taken before the first write, renewed by a heartbeat.

Two jobs that train one run directory interleave its logs, delete each other's in-flight saves and
race retention. So before writing anything, process 0 of a job takes the run's lease, and holds it
across elastic retries until the run ends:

    <run dir>/lease/<generation>.json   owner (host, pid, job, start), heartbeat time, released flag

The lease is the newest generation. Taking it writes generation g+1 *create-only* (a hard link of the
whole record on a local disk; `ifGenerationMatch=0` on Cloud Storage, which is atomic there), so of two
jobs racing for it
exactly one wins. A newer generation may be taken when the current one is
- released (its job ended: finished, preempted, failed, gave up);
- this job's own (a restarted pod or task of the same job: $TRAINER_JOB_ID, $JOBSET_NAME, or
  $SLURM_JOB_ID match), or a process of this host that no longer exists;
- stale: its heartbeat stopped for more than `run_lease_stale_seconds` (the event says so).
A holder whose heartbeat has gone silent (no renewal for `SILENT_BEATS` heartbeat intervals: its process
was killed, or its node lost, on another host) is waited out until it is stale, re-read every interval;
a holder that beats again while waited on is live. A live holder makes the start exit 2 naming the
owner. The holder renews its own generation every few seconds; a holder that finds a newer generation
(it was frozen, and its run was taken over) has lost the lease: its saves no longer commit
(`trainer.checkpoint.fence`) and it stops.

What the stores guarantee: a local or NFS disk gives create-only hard links; Cloud Storage gives
preconditioned (generation 0) creation and strongly consistent listing, which is all the protocol uses.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping

from etils import epath

from trainer.errors import UserInputError
from trainer.io.paths import is_remote
from trainer.logevents import event_extra

log = logging.getLogger(__name__)

LEASE_DIR = "lease"
_NAME = re.compile(r"(\d+)\.json")
KEEP_GENERATIONS = 4
# A holder renews every heartbeat interval; one this many intervals behind has stopped beating.
SILENT_BEATS = 3


def heartbeat_interval(stale_s: float) -> float:
    """How often a holder renews its generation: a quarter of the staleness bound, between 0.5 and 10 s."""
    return max(0.5, min(10.0, stale_s / 4))


class LeaseHeld(UserInputError):
    """Another live job holds the run directory (exit 2)."""


class LeaseLost(UserInputError):
    """This job's lease was taken over by another job while it ran (exit 2: the run is theirs now)."""


def job_identity(env: Mapping[str, str] | None = None) -> str:
    """The job a process belongs to, the same on every restart of it ('' outside any scheduler)."""
    env = os.environ if env is None else env
    if env.get("TRAINER_JOB_ID"):
        return f"trainer:{env['TRAINER_JOB_ID']}"
    if env.get("JOBSET_NAME"):
        return f"jobset:{env.get('POD_NAMESPACE', '')}/{env['JOBSET_NAME']}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}"
    return ""


def _boot_id() -> str:
    try:
        return open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> str:
    """A process's start time (clock ticks since boot), so a reused pid is not taken for its owner."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


@dataclasses.dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    job: str
    boot: str
    started: str

    @classmethod
    def this_process(cls, env: Mapping[str, str] | None = None) -> Owner:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, job_identity(env), _boot_id(), _start_ticks(pid))

    def describe(self) -> str:
        return _describe(dataclasses.asdict(self))


def _alive_here(owner: dict) -> bool | None:
    """Whether `owner` (a lease record's) is a live process of this host; None when it is not on this host."""
    if owner.get("host") != socket.gethostname() or owner.get("boot") != _boot_id():
        return None
    pid = int(owner.get("pid", 0))
    if pid <= 0:
        return False
    if owner.get("started") and _start_ticks(pid):
        return _start_ticks(pid) == owner["started"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(_start_ticks(pid)) or not os.path.isdir("/proc")


class LeaseFiles:
    """Create-only, overwrite, read, list and delete of the lease's generation files, locally or on gs://."""

    def __init__(self, run_dir: epath.PathLike):
        self.dir = epath.Path(run_dir) / LEASE_DIR
        self.remote = is_remote(str(run_dir))

    def generations(self) -> list[int]:
        try:
            names = [p.name for p in self.dir.iterdir()] if self.dir.exists() else []
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _NAME.fullmatch(n)))

    def read(self, generation: int) -> dict:
        return json.loads((self.dir / f"{generation}.json").read_text())

    def create(self, generation: int, record: dict) -> bool:
        """Write generation `generation` only if it does not exist yet; False when another writer has it."""
        data = json.dumps(record, sort_keys=True).encode()
        path = self.dir / f"{generation}.json"
        if self.remote:
            import fsspec

            fs, key = fsspec.core.url_to_fs(str(path))
            try:
                fs.pipe_file(key, data, mode="create")
            except FileExistsError:
                return False
            return True
        self.dir.mkdir(parents=True, exist_ok=True)
        # The record is written whole to a private name, then linked to the generation's name: a link
        # refuses an existing name (as O_EXCL does), and the file never appears without its record (an
        # O_EXCL file is visible empty until written, which a racing reader would take for a torn lease).
        tmp = self.dir / f".{generation}.json.{os.getpid()}.{threading.get_ident()}.new"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(os.fspath(tmp), os.fspath(path))
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def write(self, generation: int, record: dict) -> None:
        path = self.dir / f"{generation}.json"
        data = json.dumps(record, sort_keys=True)
        if self.remote:
            path.write_text(data)
            return
        tmp = self.dir / f".{generation}.json.{os.getpid()}"
        tmp.write_text(data)
        os.replace(os.fspath(tmp), os.fspath(path))

    def delete(self, generation: int) -> None:
        try:
            (self.dir / f"{generation}.json").unlink()
        except FileNotFoundError:
            pass


class RunLease:
    """The lease protocol of the module doc, for one process (process 0 of the job)."""

    def __init__(
        self,
        run_dir: epath.PathLike,
        *,
        stale_s: float,
        owner: Owner | None = None,
        files: LeaseFiles | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.run_dir = str(run_dir)
        self.stale_s = stale_s
        self.owner = owner or Owner.this_process()
        self.files = files or LeaseFiles(run_dir)
        self.clock = clock
        self.sleep = sleep
        self.generation: int | None = None
        self._record: dict = {}
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- taking it ---------------------------------------------------------------------------------

    def acquire(self) -> dict:
        """Take the lease or raise LeaseHeld; returns the event fields (generation, and whom it took over
        from and why, when there was a previous holder). A silent holder is waited out (module doc)."""
        races, waited_on = 0, None
        while True:
            generations = self.files.generations()
            current = generations[-1] if generations else 0
            previous = None
            if current:
                try:
                    previous = self.files.read(current)
                except (OSError, ValueError):
                    previous = {"heartbeat": 0.0, "owner": {}, "unreadable": True}
                why = self._takeover_reason(previous)
                if why is None:
                    waited_on = self._wait_for_silent(current, previous, waited_on)
                    continue
            record = self._new_record(current + 1)
            if self.files.create(current + 1, record):
                self.generation, self._record = current + 1, record
                self._prune(current + 1)
                fields = {"generation": current + 1, "owner": self.owner.describe()}
                if previous is not None:
                    fields.update(previous_owner=_describe(previous.get("owner", {})), taken_over=why)
                log.debug("lease_acquired %s", " ".join(f"{k}={v}" for k, v in fields.items()))
                return fields
            races += 1  # another job created it first: re-read the newest generation
            if races >= 5:
                raise LeaseHeld(
                    f"could not take the lease of {self.run_dir}: other jobs keep taking it; is one running?"
                )

    def _wait_for_silent(self, generation: int, holder: dict, waited_on: tuple | None) -> tuple:
        """The holder of `generation` is not (yet) stale: raise LeaseHeld when it is live, else sleep one
        heartbeat interval and return what was waited on (generation, heartbeat) for the next look."""
        heartbeat = float(holder.get("heartbeat", 0.0))
        age = self.clock() - heartbeat
        interval = heartbeat_interval(self.stale_s)
        beat_again = waited_on is not None and waited_on != (generation, heartbeat)
        if beat_again or age <= SILENT_BEATS * interval:
            raise LeaseHeld(self._held_message(holder))
        if waited_on is None:
            wait = {
                "run_dir": str(self.run_dir),
                "holder": _describe(holder.get("owner", {})),
                "heartbeat_age_s": round(age),
                "stale_s": self.stale_s,
                "wait_s": round(max(0.0, self.stale_s - age)),
            }
            log.warning(
                "the lease holder of %(run_dir)s (%(holder)s) stopped beating %(heartbeat_age_s)d s ago: "
                "waiting up to %(wait_s)d s for it to go stale (run_lease_stale_seconds=%(stale_s)g), "
                "then taking the run over",
                wait,
                extra=event_extra("lease_wait", wait),
            )
        self.sleep(min(interval, max(0.0, self.stale_s - age) + 0.1))
        return generation, heartbeat

    def _takeover_reason(self, previous: dict) -> str | None:
        """Why the current generation may be taken over, or None when its holder is live."""
        if previous.get("released"):
            return "released"
        if previous.get("unreadable"):
            return "unreadable"
        owner = previous.get("owner", {})
        if self.owner.job and owner.get("job") == self.owner.job:
            return "same_job"
        alive = _alive_here(owner)
        if alive is False:
            return "owner_process_gone"
        age = self.clock() - float(previous.get("heartbeat", 0.0))
        if age > self.stale_s:
            return f"stale_{age:.0f}s"
        return None

    def _held_message(self, previous: dict) -> str:
        age = self.clock() - float(previous.get("heartbeat", 0.0))
        return (
            f"the run directory {self.run_dir} is in use by {_describe(previous.get('owner', {}))} "
            f"(heartbeat {age:.0f} s ago): two jobs must not train one run. Wait for that job to end, or "
            f"give this one another run_name=...; a holder whose heartbeat stops for more than "
            f"run_lease_stale_seconds={self.stale_s:g} is taken over"
        )

    def _new_record(self, generation: int) -> dict:
        now = self.clock()
        return {
            "generation": generation,
            "owner": dataclasses.asdict(self.owner),
            "acquired": now,
            "heartbeat": now,
            "released": False,
        }

    def _prune(self, newest: int) -> None:
        for old in self.files.generations():
            if old <= newest - KEEP_GENERATIONS:
                self.files.delete(old)

    # ---- holding it --------------------------------------------------------------------------------

    def still_ours(self) -> bool:
        """Whether this process holds the newest generation (read from storage now)."""
        if self._lost.is_set():
            return False
        if self.generation is None:
            return False
        generations = self.files.generations()
        ours = bool(generations) and generations[-1] == self.generation
        if not ours:
            self._lost.set()
        return ours

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def renew(self) -> bool:
        """Refresh the heartbeat; False (and `lost`) when a newer generation exists."""
        if not self.still_ours():
            return False
        self._record = {**self._record, "heartbeat": self.clock()}
        self.files.write(self.generation, self._record)
        return True

    def start_heartbeat(self, on_lost: Callable[[], None] = lambda: None, interval_s: float | None = None) -> None:
        interval = interval_s if interval_s is not None else heartbeat_interval(self.stale_s)

        def beat():
            while not self._stop.wait(interval):
                try:
                    if not self.renew():
                        log.error(
                            "the lease on %s was lost (generation %s): another process holds the run now",
                            self.run_dir,
                            self.generation,
                            extra=event_extra(
                                "lease_lost", {"run_dir": str(self.run_dir), "generation": self.generation}
                            ),
                        )
                        on_lost()
                        return
                except Exception as e:  # noqa: BLE001 - storage blips: the next beat tries again
                    log.warning("lease heartbeat failed: %s", e)

        self._thread = threading.Thread(target=beat, name="run-lease-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """End of the run: stop the heartbeat and mark the generation released (if still ours)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.generation is None or self._lost.is_set():
            return
        try:
            if self.still_ours():
                self.files.write(self.generation, {**self._record, "heartbeat": self.clock(), "released": True})
        except Exception as e:  # noqa: BLE001 - an unreleased lease only delays the next job by the bound
            log.warning("could not release the run lease: %s", e)


def _describe(owner: dict) -> str:
    return f"job {owner.get('job') or '(none)'} on host {owner.get('host', '?')}, pid {owner.get('pid', '?')}"
