"""Silent-data-corruption check by replay (`sdc_check_period`): a chip that computes wrong numbers is caught.

Every `period` steps, before the step runs (its input state is still there: the step donates it), each
data-parallel replica computes its part of that step twice from the same state and batch
(`trainer.runtime.step.make_replica_checksums`: the objective's parts and every gradient leaf's sum, before
the reduction across replicas): once on its own rows, once with the batch rotated by one slice, so that
each slice computes the next slice's rows. Steps are bitwise deterministic, so on healthy devices the two
results for any rows are equal bit for bit wherever they were computed. Rows whose results differ were
computed by their own slice in one run and by the previous slice in the other; the slice common to every
mismatch is the suspect (with two slices both are). A mismatch emits `sdc_detected` and the loop returns a
rollback: the newest state saved before that step is restored and the run goes on (with `sdc_quarantine`
the suspect slice is treated as lost first). The check costs about two steps' forward and backward
passes per `period` steps; each checked step's record carries it as `sdc_check_s`, which goodput counts
as its own cause.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import jax
import numpy as np

from trainer.observe import catalogue

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """`slices`: the slices whose rows' results differ between the two runs; `suspects`: the slice(s)
    every mismatch implicates (empty: no mismatch)."""

    slices: tuple[int, ...]
    suspects: tuple[int, ...]


def rotate(host_batch: dict[str, np.ndarray], slices: int) -> dict[str, np.ndarray]:
    """The batch with each slice's rows moved to the previous slice (slice s gets slice s+1's rows): the
    batch's rows are laid out over the data axis slice by slice."""
    rows = next(iter(host_batch.values())).shape[0]
    return {k: np.roll(v, -(rows // slices), axis=0) for k, v in host_batch.items()}


def compare(original: np.ndarray, rotated: np.ndarray, slices: int) -> Verdict:
    """`original[r]`: replica r's results on its own rows; `rotated[r]`: on the rows of the replica one
    slice later. Compared bit for bit, per replica's rows."""
    per_slice = original.shape[0] // slices
    aligned = np.roll(rotated, per_slice, axis=0)  # aligned[r]: rows of replica r, by the previous slice
    a, b = np.ascontiguousarray(original).view(np.uint32), np.ascontiguousarray(aligned).view(np.uint32)
    bad = sorted({r // per_slice for r in range(original.shape[0]) if not np.array_equal(a[r], b[r])})
    if not bad:
        return Verdict((), ())
    suspects = set.intersection(*({s, (s - 1) % slices} for s in bad))
    return Verdict(tuple(bad), tuple(sorted(suspects)))


def corrupt_rows(results: np.ndarray, rows: range) -> np.ndarray:
    """`results` with the given replicas' rows off by one unit in the last place (an injected fault)."""
    out = np.array(results, copy=True)
    out[rows.start : rows.stop] = np.nextafter(out[rows.start : rows.stop], np.inf, dtype=out.dtype)
    return out


class SdcCheck:
    """Runs the check at the steps it is due and reports a mismatch (`sdc_detected`).

    `faulty(step)` -> the slice an injected fault makes compute wrong numbers at `step`, or None."""

    def __init__(
        self,
        period: int,
        events,
        *,
        faulty: Callable[[int], int | None] = lambda step: None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.period = period
        self.events = events
        self.faulty = faulty
        self.clock = clock

    def due(self, step: int, slices: int) -> bool:
        """Whether `step` is checked (on one slice there is nothing to compare)."""
        return self.period > 0 and step % self.period == 0 and slices > 1

    def __call__(self, attempt, params, host_batch: dict[str, np.ndarray], step: int) -> tuple[Verdict, float]:
        """Check `step` (not yet run) from `params` and its batch; returns the verdict and its seconds."""
        t0 = self.clock()
        slices = attempt.num_slices
        original = attempt.sdc_fn(params, attempt.device_batch(host_batch))
        rotated = attempt.sdc_fn(params, attempt.device_batch(rotate(host_batch, slices)))
        original, rotated = (np.asarray(x) for x in jax.device_get((original, rotated)))
        bad = self.faulty(step)
        if bad is not None:  # what that slice computed, in both runs, is wrong
            per_slice = original.shape[0] // slices
            original = corrupt_rows(original, range(bad * per_slice, (bad + 1) * per_slice))
            rotated = corrupt_rows(rotated, range(bad * per_slice, (bad + 1) * per_slice))
        verdict = compare(original, rotated, slices)
        seconds = self.clock() - t0
        if verdict.slices:
            self.events.emit(
                catalogue.SDC_DETECTED,
                step=step,
                slices=list(verdict.suspects),
                mismatched=list(verdict.slices),
                seconds=round(seconds, 4),
            )
            log.error(
                "silent data corruption at step %d: results of slices %s's rows differ; suspect slice(s) %s",
                step,
                list(verdict.slices),
                list(verdict.suspects),
            )
        return verdict, seconds
