"""When to give up: failures faster than the run progresses (exit 3), never failures spread over a run.

A long run on many chips sees failures as a matter of course (the planner's table expects tens to
hundreds per run at 10,000-50,000 chips), so a budget over the whole run would end healthy runs. The
budget is a rate instead: a failure counts against `elastic_max_retries` until the run has made
`elastic_retry_window_steps` steps of net progress (its furthest step) since it. A run that keeps
failing before it gets anywhere (every recovery rewound, or failures faster than recoveries) exhausts
it; one that progresses between failures never does. The supervisor applies this rule and
`trainer.plan` models it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RetryBudget:
    max_retries: int = 10  # elastic_max_retries
    window_steps: int = 50  # elastic_retry_window_steps

    def counting(self, marks: list[int], furthest: int) -> int:
        """The failures that still count (`marks`: the run's furthest step at each failure)."""
        return sum(1 for mark in marks if furthest - mark < self.window_steps)

    def exhausted(self, marks: list[int], furthest: int) -> bool:
        return self.counting(marks, furthest) > self.max_retries
