"""`fault_schedule` parsed once into a typed plan: which faults the run injects.

The schedule is entries separated by ';', each a comma-separated list of key=value pairs. An entry belongs
to the kind whose `keys` it uses (`trainer.failures.kind`; one with no kind's key is the fallback kind's,
`step=N,slice=K`); that kind's `parse` types it. The config parses it at validation
(its `faults`), so a bad entry stops the run before any compute, and every part of the run reads
the same `FaultPlan`: the slice injector, a process's own errors, the checkpointer's storage failures.
"""

from __future__ import annotations

import dataclasses

from trainer.errors import ConfigError
from trainer.failures.kind import PROCESSES, SLICES, FailureKind, entry_error
from trainer.failures.registry import KINDS, Fault, kind_of


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    """The typed faults of a schedule, in schedule order, each with the entry it came from."""

    faults: tuple[Fault, ...] = ()
    entries: tuple[str, ...] = ()

    def of(self, *types: type) -> tuple:
        """The faults of these types, in schedule order."""
        return tuple(f for f in self.faults if isinstance(f, types))

    def for_kind(self, kind: FailureKind) -> tuple:
        return self.of(*kind.faults)

    def check_processes(self, count: int, kinds: tuple[FailureKind, ...] = KINDS) -> FaultPlan:
        """This plan, or a ConfigError when it does not fit a job of `count` processes: one process takes
        no process entry; several take no slice entry (a lost process is a kill from outside), and each
        names a process below `count`."""
        for fault, entry in zip(self.faults, self.entries, strict=True):
            scope = kind_of(fault, kinds).scope
            if scope == PROCESSES and count == 1:
                raise entry_error(
                    entry, "it injects an error into one process of a multi-process job; this run has one process"
                )
            if scope == SLICES and count > 1:
                raise entry_error(
                    entry,
                    f"this job has {count} processes: the schedule injects a process's own error "
                    "(step=N,process=P,error=oom|bug) or a slow snapshot copy; lose a process by killing it "
                    "(scripts/launch_local.py)",
                )
            if scope == PROCESSES and not 0 <= fault.process < count:
                raise entry_error(entry, f"process must be in [0, {count})")
        return self


def entry_fields(entry: str) -> dict[str, str]:
    fields = {}
    for part in entry.split(","):
        k, sep, v = part.strip().partition("=")
        if not sep:
            raise entry_error(entry, f"{part!r} is not key=value")
        fields[k.strip()] = v.strip()
    return fields


def parse_plan(text: str, num_slices: int, kinds: tuple[FailureKind, ...] = KINDS) -> FaultPlan:
    """'step=40,slice=1,down_s=5; step=90,nan=1; storage=save' -> a FaultPlan, or a ConfigError naming the
    bad entry."""
    faults, entries = [], []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        fields = entry_fields(entry)
        claimed = [k for k in kinds if k.keys & fields.keys()]
        if len(claimed) > 1:
            names = " and ".join(k.name for k in claimed)
            raise entry_error(entry, f"it mixes the keys of {names} failures; give each its own entry")
        kind = claimed[0] if claimed else next(k for k in kinds if k.fallback)
        faults.append(kind.parse(entry, fields, num_slices))
        entries.append(entry)
    scopes = {kind_of(f, kinds).scope for f in faults}
    if {SLICES, PROCESSES} <= scopes:
        raise ConfigError(
            f"fault_schedule {text!r} mixes entries for one controller's slices with entries for one process "
            "of several (process=P): a run is one or the other"
        )
    return FaultPlan(tuple(faults), tuple(entries))
