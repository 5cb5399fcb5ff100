"""The `fault_schedule` grammar, parsed once for every part that injects a failure.

A leaf: config validation, the elastic layer (slice failures, a process's own errors) and the
checkpointer (storage failures) all read the schedule through here, and nothing here imports them.
Entries are separated by ';':

    step=40,slice=1,down_s=5 | step=N,slice=K,down_steps=M | step=N,nan=1 | step=N,slow_s=S
    step=N,hang_s=S                                       (step N's dispatch blocks S seconds, once per run)
    step=N,spike=F                                        (step N's loss and update times F, once per run)
    step=N,slice=K,corrupt=1                              (slice K's devices compute wrong numbers in step N, once)
    step=N,slice=K,corrupt=persistent                     (... in every step from N on: a bad chip)
    step=N,slice=K,flip=1                                 (slice K's copy of the params changes after step N)
    rate=R,seed=S[,slice=K][,down_s=D][,step=N]           (local slices: trainer.elastic.faults)
    step=N,process=P,error=oom|bug                        (several processes: trainer.elastic.process_faults)
    storage=restore|save[,count=N]                        (either: trainer.checkpoint.storage_faults)
"""

from __future__ import annotations

import dataclasses

from trainer.config.errors import ConfigError

STORAGE_KINDS = ("restore", "save")


def is_storage_entry(entry: str) -> bool:
    return any(part.strip().startswith("storage=") for part in entry.split(","))


@dataclasses.dataclass(frozen=True)
class Fault:
    step: int
    slice: int = -1
    down_s: float = 0.0
    down_steps: int = 0  # also stay down until this many more steps have run (deterministic tests)
    nan: bool = False  # report the step's result as non-finite (exercises nan_policy) instead of a slice loss
    rate: float = 0.0  # > 0: a Poisson source of failures per second of wall time from `step` on (see above)
    seed: int = 0  # the Poisson source's random seed (gaps and, with slice=-1, which slice)
    slices: int = 0  # the Poisson source picks among this many slices when slice=-1
    slow_s: float = 0.0  # > 0: no failure; the host stalls this long after step `step` (a slow step)
    hang_s: float = 0.0  # > 0: no failure raised; step `step`'s dispatch blocks this long (a hang)
    spike: float = 0.0  # > 0: step `step`'s loss and update are multiplied by this (a loss spike)
    corrupt: bool = False  # slice `slice`'s devices compute wrong numbers in step `step` (silent data corruption)
    persistent: bool = False  # with corrupt: in every step from `step` on (a bad chip), not only in `step`
    flip: bool = False  # slice `slice`'s copy of the parameters changes after step `step`'s update (memory fault)


def parse_fault_schedule(text: str, num_slices: int) -> list[Fault]:
    """'step=40,slice=1,down_s=5; step=90,slice=2; rate=0.1,seed=3' -> Faults, or a ConfigError naming the
    bad entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        if is_storage_entry(entry):  # trainer.checkpoint.storage_faults parses those
            continue
        fields = {}
        for part in entry.split(","):
            k, sep, v = part.strip().partition("=")
            if not sep:
                raise ConfigError(f"fault_schedule entry {entry!r}: {part!r} is not key=value")
            fields[k.strip()] = v.strip()
        if "process" in fields:
            raise ConfigError(
                f"fault_schedule entry {entry!r}: step=N,process=P,error=E injects an error into one process "
                "of a multi-process job; this run has one process"
            )
        if "rate" in fields:
            fault = _poisson_entry(entry, fields, num_slices)
        elif stall := next((k for k in STALLS if k in fields), None):
            fault = _stall_entry(entry, fields, stall)
        elif "spike" in fields:
            fault = _spike_entry(entry, fields)
        else:
            fault = _fixed_entry(entry, fields)
        if not fault.nan and fault.slice >= num_slices:
            raise ConfigError(f"fault_schedule entry {entry!r}: slice must be in [0, {num_slices})")
        faults.append(fault)
    return faults


def _fixed_entry(entry: str, fields: dict[str, str]) -> Fault:
    if "corrupt" in fields or "flip" in fields:
        return _corrupt_entry(entry, fields)
    unknown = set(fields) - {"step", "slice", "down_s", "down_steps", "nan"}
    if unknown or "step" not in fields or ("slice" in fields) == ("nan" in fields):
        raise ConfigError(
            f"fault_schedule entry {entry!r}: use step=N,slice=K[,down_s=S], step=N,nan=1 or rate=R,seed=S"
        )
    try:
        fault = Fault(
            int(fields["step"]),
            int(fields.get("slice", -1)),
            float(fields.get("down_s", 0)),
            int(fields.get("down_steps", 0)),
            nan="nan" in fields,
        )
    except ValueError:
        raise ConfigError(f"fault_schedule entry {entry!r}: step and slice are integers, down_s seconds") from None
    if (not fault.nan and fault.slice < 0) or fault.step < 1 or fault.down_s < 0:
        raise ConfigError(f"fault_schedule entry {entry!r}: slice must be >= 0, step >= 1, down_s >= 0")
    return fault


# step=N,<key>=S entries that stall the host S seconds: key -> what the error message calls them.
#   slow_s: the host sleeps at the boundary after step N, so step N's time grows by S (what slow-step
#     detection, monitor_step_time_deviation, is for);
#   hang_s: step N's dispatch blocks and raises nothing, as a collective that never returns would (what
#     the progress watchdog, hang_timeout_seconds, is for); once per run: a restart that trains step N
#     again does not hang there again.
STALLS = {"slow_s": "a slow step", "hang_s": "a hang"}


def _stall_entry(entry: str, fields: dict[str, str], name: str) -> Fault:
    try:
        if set(fields) != {"step", name}:
            raise ValueError
        fault = Fault(int(fields["step"]), **{name: float(fields[name])})
    except ValueError:
        raise ConfigError(
            f"fault_schedule entry {entry!r}: {STALLS[name]} is step=N,{name}=S (N an integer, S seconds)"
        ) from None
    if fault.step < 1 or not 0 < getattr(fault, name) < float("inf"):
        raise ConfigError(f"fault_schedule entry {entry!r}: step must be >= 1 and {name} a number of seconds > 0")
    return fault


def _corrupt_entry(entry: str, fields: dict[str, str]) -> Fault:
    """Silent data corruption on slice K's devices (what sdc_check_period is for):
    step=N,slice=K,corrupt=1           slice K computes wrong numbers during step N, once per run;
    step=N,slice=K,corrupt=persistent  ... during every step from N on (a bad chip);
    step=N,slice=K,flip=1              slice K's copy of the parameters changes after step N's update, once
                                       per run (a memory fault: the replicas diverge)."""
    kind = "corrupt" if "corrupt" in fields else "flip"
    values = ("1", "persistent") if kind == "corrupt" else ("1",)
    try:
        if set(fields) != {"step", "slice", kind} or fields[kind] not in values:
            raise ValueError
        fault = Fault(
            int(fields["step"]),
            int(fields["slice"]),
            corrupt=kind == "corrupt",
            persistent=fields[kind] == "persistent",
            flip=kind == "flip",
        )
    except ValueError:
        raise ConfigError(
            f"fault_schedule entry {entry!r}: silent data corruption is step=N,slice=K,corrupt=1, "
            "step=N,slice=K,corrupt=persistent or step=N,slice=K,flip=1 (N, K integers)"
        ) from None
    if fault.step < 1 or fault.slice < 0:
        raise ConfigError(f"fault_schedule entry {entry!r}: step must be >= 1 and slice >= 0")
    return fault


def _spike_entry(entry: str, fields: dict[str, str]) -> Fault:
    """step=N,spike=F: step N's loss and its update to the parameters are multiplied by F, once per run
    (what loss_spike_threshold is for)."""
    try:
        if set(fields) != {"step", "spike"}:
            raise ValueError
        fault = Fault(int(fields["step"]), spike=float(fields["spike"]))
    except ValueError:
        raise ConfigError(
            f"fault_schedule entry {entry!r}: a loss spike is step=N,spike=F (N an integer, F > 1)"
        ) from None
    if fault.step < 1 or not 1 < fault.spike < float("inf"):
        raise ConfigError(f"fault_schedule entry {entry!r}: step must be >= 1 and spike a factor > 1")
    return fault


def _poisson_entry(entry: str, fields: dict[str, str], num_slices: int) -> Fault:
    unknown = set(fields) - {"rate", "seed", "slice", "down_s", "step"}
    if unknown or "seed" not in fields:
        raise ConfigError(
            f"fault_schedule entry {entry!r}: a random source is rate=R,seed=S[,slice=K][,down_s=D][,step=N] "
            f"(R failures per second, S an integer seed)"
        )
    try:
        fault = Fault(
            int(fields.get("step", 1)),
            int(fields.get("slice", -1)),
            float(fields.get("down_s", 0)),
            rate=float(fields["rate"]),
            seed=int(fields["seed"]),
            slices=num_slices,
        )
    except ValueError:
        raise ConfigError(
            f"fault_schedule entry {entry!r}: rate and down_s are numbers, seed, slice and step integers"
        ) from None
    if not (0 < fault.rate < float("inf")) or fault.step < 1 or fault.down_s < 0 or fault.slice < -1:
        raise ConfigError(
            f"fault_schedule entry {entry!r}: rate must be a finite number > 0 (failures per second), "
            f"step >= 1, down_s >= 0, slice >= 0 (or left out for a random slice)"
        )
    return fault


PROCESS_ERRORS = ("oom", "bug")


@dataclasses.dataclass(frozen=True)
class ProcessFault:
    step: int
    process: int
    error: str = ""  # oom | bug: this process's own error at step N
    slow_snapshot_s: float = 0.0  # > 0: this process's host copy of step N's snapshot takes this much longer


def parse_process_faults(text: str, num_processes: int) -> list[ProcessFault]:
    """'step=5,process=2,error=oom; step=8,process=1,slow_snapshot_s=10' -> ProcessFaults, or a ConfigError
    naming the bad entry. A slow snapshot stretches one host copy (so a test can kill a process while its
    snapshot is being taken)."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        if is_storage_entry(entry):  # trainer.checkpoint.storage_faults parses those
            continue
        try:
            fields = dict(part.strip().split("=", 1) for part in entry.split(","))
            if set(fields) == {"step", "process", "slow_snapshot_s"}:
                fault = ProcessFault(
                    int(fields["step"]), int(fields["process"]), slow_snapshot_s=float(fields["slow_snapshot_s"])
                )
                if not 0 < fault.slow_snapshot_s < float("inf"):
                    raise ValueError
            elif set(fields) == {"step", "process", "error"}:
                fault = ProcessFault(int(fields["step"]), int(fields["process"]), fields["error"].strip())
            else:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"fault_schedule entry {entry!r}: with several processes the schedule injects a process's own "
                f"error, step=N,process=P,error={'|'.join(PROCESS_ERRORS)}, or a slow snapshot copy, "
                "step=N,process=P,slow_snapshot_s=S; lose a process by killing it "
                "(scripts/launch_local.py)"
            ) from None
        bad_error = not fault.slow_snapshot_s and fault.error not in PROCESS_ERRORS
        if bad_error or fault.step < 1 or not 0 <= fault.process < num_processes:
            raise ConfigError(
                f"fault_schedule entry {entry!r}: error must be one of {list(PROCESS_ERRORS)}, step >= 1 and "
                f"process in [0, {num_processes})"
            )
        faults.append(fault)
    return faults


@dataclasses.dataclass(frozen=True)
class StorageSpec:
    """How many checkpoint restores and saves fail (`storage=...` entries)."""

    restore: int = 0
    save: int = 0


def parse_storage_faults(text: str) -> StorageSpec:
    """The storage entries of a fault_schedule ('storage=restore,count=1; step=4,slice=0'), or a ConfigError."""
    counts = {"restore": 0, "save": 0}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        if not is_storage_entry(entry):
            continue
        try:
            fields = dict(part.strip().split("=", 1) for part in entry.split(","))
            kind, count = fields.pop("storage").strip(), int(fields.pop("count", 1))
            if fields or kind not in STORAGE_KINDS or count < 1:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"fault_schedule entry {entry!r}: a storage failure is storage=restore|save[,count=N] (N >= 1)"
            ) from None
        counts[kind] += count
    return StorageSpec(**counts)
