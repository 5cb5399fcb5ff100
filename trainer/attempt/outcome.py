"""How an attempt's train loop ended (`trainer.attempt.loop.train_loop`): one type per ending, at a step
boundary; the supervisor decides what follows. Only a failure (a lost slice, a bug) leaves the loop as an
exception instead.

    Finished       every step ran (and the final checkpoint, if any, is committed)
    Preempted      a stop was requested (SIGTERM); a final checkpoint was saved
    ScaleUp        slices in `returning` came back after `step`; `state` is the live state at `step`
    Rollback       `step` must be undone: restore the newest saved state before it (see `cause`)
    TargetReached  the eval at `step` gave `eval_loss` <= target_eval_loss; a checkpoint was saved
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from trainer.failures import corruption, nonfinite, spike

FINISHED, PREEMPTED, SCALE_UP, ROLLBACK = "finished", "preempted", "scale_up", "rollback"
TARGET_REACHED = "target_eval_loss_reached"
NON_FINITE, LOSS_SPIKE, SDC = nonfinite.CAUSE, spike.CAUSE, corruption.CAUSE  # a rollback's causes


@dataclasses.dataclass(frozen=True)
class Finished:
    kind: ClassVar[str] = FINISHED
    step: int


@dataclasses.dataclass(frozen=True)
class Preempted:
    kind: ClassVar[str] = PREEMPTED
    step: int


@dataclasses.dataclass(frozen=True)
class ScaleUp:
    kind: ClassVar[str] = SCALE_UP
    step: int
    state: Any
    returning: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Rollback:
    """`step` must be undone. `cause`: NON_FINITE (its update was not finite and nan_policy=rollback),
    LOSS_SPIKE (its loss spiked: trainer.attempt.loss_spikes) or SDC (the replay check of `step` failed:
    trainer.attempt.sdc, naming the `suspects`); `not_after`, when set, bounds the state restored (the
    newest verified clean)."""

    kind: ClassVar[str] = ROLLBACK
    step: int
    cause: str = NON_FINITE
    suspects: tuple[int, ...] = ()
    not_after: int | None = None


@dataclasses.dataclass(frozen=True)
class TargetReached:
    kind: ClassVar[str] = TARGET_REACHED
    step: int
    eval_loss: float


Outcome = Finished | Preempted | ScaleUp | Rollback | TargetReached
