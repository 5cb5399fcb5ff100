"""What a failure kind declares, and the hooks through which its faults are injected.

A failure kind is one module of `trainer.failures` with one `KIND = FailureKind(...)` and one line in
`trainer.failures.registry.KINDS`. It declares:

- its schedule entries: `keys` (the keys that mark an entry as this kind's; an entry with no kind's key
  is the `fallback` kind's), `parse` (the entry -> one typed fault, or a ConfigError naming the entry),
  `faults` (the fault types it parses into; each type belongs to one kind), `grammar` (the entry forms,
  for messages) and `scope` (whether its entries are for one controller's slices, for one process of
  several, or for either);
- its injector: `injection(faults, context)` -> an `Injection` (the hooks below) for a run on one
  controller's local slices, or None where its faults take effect elsewhere (`injected_by` names where);
- where it is detected (`detected_by`), what the run does about it (`outcome`), the events it emits
  (`events`), the badput cause its cost is counted in (`goodput_cause`, one of
  `trainer.observe.goodput.CAUSES`) and the planner's term for it (`planner_term`, "" when the planner
  does not model it). `detected_by`, `injected_by` and `planner_term` are "module:attribute" references
  that tests resolve, so a declaration cannot point at code that is gone.

`trainer.elastic.faults.FaultInjector` calls every registered kind's hooks in registry order; it names no
kind itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError
from trainer.observe.catalogue import Event

Fields = Mapping[str, str]  # one schedule entry's key=value pairs
SLICES, PROCESSES, ANY = "slices", "processes", "any"  # which runs a kind's entries are for


@dataclasses.dataclass(frozen=True)
class Kill:
    """A slice failure due at a step boundary: `slice` fails its next step and stays down `down_s` seconds
    and `down_steps` more steps; `cause` says who asked (the schedule entry, a random source, a request)."""

    slice: int
    down_s: float
    cause: str
    down_steps: int = 0


@dataclasses.dataclass
class InjectionContext:
    """What the injectors of one run share: the run's events, its virtual slices' outages, the run's chaos
    directory (outside requests, and the markers that make a fault fire once per run), `once_per_run`."""

    events: Any
    outages: Any  # trainer.failures.slice_loss.Outages
    chaos_dir: Path | None
    once_per_run: Callable[[str], bool]


class Injection:
    """The hooks of one kind's injector; each defaults to doing nothing. `slices` maps each active slice to
    its devices; `step` is the step about to run (or just run)."""

    def attempt_started(self) -> None:
        """A new attempt wrapped its step (state that belongs to one attempt is dropped here)."""

    def at_boundary(self, next_step: int) -> list[Kill]:
        """Before `next_step`: side effects due there (a stall, a hang) and the slice failures due."""
        return []

    def before_step(self, step: int, state, batch, slices: Mapping[int, list]):
        """Before the compiled step runs: may raise (a lost slice) or return a changed batch."""
        return batch

    def after_step(self, step: int, state, metrics: dict, slices: Mapping[int, list]):
        """After the compiled step: the (state, metrics) as the failure leaves them."""
        return state, metrics

    def replay_batch(self, step: int, batch, slices: Mapping[int, list]):
        """The batch as the replay check (trainer.attempt.sdc) of `step` computes on it on the slices."""
        return batch


@dataclasses.dataclass(frozen=True)
class FailureKind:
    name: str
    keys: frozenset[str]
    parse: Callable[[str, Fields, int], Any]  # (entry, fields, num_slices) -> a typed fault
    faults: tuple[type, ...]
    grammar: str
    scope: str  # SLICES, PROCESSES or ANY
    injection: Callable[[tuple, InjectionContext], Injection | None] | None
    injected_by: str
    detected_by: str
    outcome: str
    events: tuple[Event, ...]
    goodput_cause: str
    planner_term: str = ""
    fallback: bool = False


def step_and_number(entry: str, fields: Fields, key: str, form: str) -> tuple[int, float]:
    """(N, V) of a `step=N,<key>=V` entry with exactly those keys, or a ConfigError showing `form`."""
    try:
        if set(fields) != {"step", key}:
            raise ValueError
        return int(fields["step"]), float(fields[key])
    except ValueError:
        raise entry_error(entry, form) from None


def entry_error(entry: str, message: str) -> ConfigError:
    """The ConfigError for a bad schedule entry: it names the entry and the fix."""
    return ConfigError(f"fault_schedule entry {entry!r}: {message}")
