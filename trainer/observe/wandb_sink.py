"""Weights & Biases sink (`enable_wandb=true`; `pip install 'elastic-trainer[wandb]'`).

What goes to W&B:
- the same scalars as TensorBoard: `train/<field>` for every numeric field of a step row, `eval/<field>`
  for an eval row, plotted against `trainer_step` (the run's step). W&B's own step counter only grows, but
  a rewound run replays steps; logging against `trainer_step` keeps replayed steps instead of dropping them.
- the run's events (slice failures, recoveries, rewinds, checkpoints, slow steps, ...) as annotations:
  each event is a point `events/<event>` = 1 at its step on the same axis (so failures line up with the
  loss curve), and at the end of the process one table `events` lists them all with their fields (JSON).
  Events are read from the run's events.jsonl as it grows, starting with this process's first event, so
  the sink needs no hook into the code that emits them.
- the resolved config as the W&B run's config.

One W&B run per training run: its id is chosen once and recorded in events.jsonl (event `wandb_run`),
which lives in the run directory and follows it to and from a bucket; every later start of the same run
(restart, resume after kill -9, a new pod) finds it there and continues that W&B run (resume="allow").
Only process 0 of a multi-process job logs. WANDB_MODE=offline writes the run under <run dir>/wandb for
a later `wandb sync`.

W&B is optional to training: a start that W&B refuses for the user's own reason (no API key, a key it
rejects, a bad setting) stops the run before any compute (exit 2); any other failure to start (the
service unreachable or slow, a network blip) or to log later is one warning and a `wandb_unavailable`
event, and the run trains on without W&B (metrics.jsonl and TensorBoard have everything).
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

from trainer.errors import UserInputError
from trainer.io.jsonl import read_jsonl
from trainer.observe import catalogue

log = logging.getLogger(__name__)
SKIP = ("step", "time", "pid", "batch_fingerprint", "kind")
STEP_METRIC = "trainer_step"
INSTALL_HINT = "pip install 'elastic-trainer[wandb]' (or pip install wandb), or set enable_wandb=false"


def available() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard tags and values of one metrics row."""
    is_eval = record.get("kind") == "eval"
    out = {}
    for k, v in record.items():
        if k not in SKIP and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"eval/{k.removeprefix('eval_')}" if is_eval else f"train/{k}"] = v
    return out


def recorded_run_id(events_path: Path) -> str | None:
    """The W&B run id an earlier start of this run recorded, if any."""
    ids = [
        e["run_id"] for e in read_jsonl(events_path) if e.get("event") == catalogue.WANDB_RUN and e.get("run_id")
    ]
    return ids[-1] if ids else None


def users_to_fix(error: BaseException) -> bool:
    """Whether W&B refused to start for a reason the user fixes (no or a rejected API key, a bad setting),
    as opposed to W&B being unreachable or failing."""
    import wandb.errors

    return isinstance(error, (wandb.errors.UsageError, wandb.errors.AuthenticationError))


class WandbSink:
    """Metrics rows and events of this run into one W&B run (see the module docstring)."""

    def __init__(self, run_dir: Path, events, *, project: str, name: str, config: dict[str, Any]):
        import wandb

        self.events_path = Path(run_dir) / "events.jsonl"
        run_id = recorded_run_id(self.events_path)
        resumed = run_id is not None
        run_id = run_id or uuid.uuid4().hex[:12]  # W&B ids: lowercase letters and digits
        self.run = None
        self._event_log = events
        try:
            self.run = wandb.init(
                project=project,
                name=name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=config,
                settings=wandb.Settings(console="off", quiet=True),
            )
        except Exception as e:  # noqa: BLE001 - the user's to fix (exit 2), or W&B is away (train on)
            if users_to_fix(e):
                raise UserInputError(
                    f"enable_wandb=true but W&B refused to start ({type(e).__name__}: {e}); log in (wandb login "
                    "or WANDB_API_KEY), set WANDB_MODE=offline to write the run to files only, or set "
                    "enable_wandb=false"
                ) from None
            self._unavailable("start", e, project=project)
            return
        self.run.define_metric(STEP_METRIC)
        for prefix in ("train/*", "eval/*", "events/*"):
            self.run.define_metric(prefix, step_metric=STEP_METRIC)
        self._table_cls = wandb.Table
        self._offset = self._first_unlogged_event()
        self._last_step = 0
        self._events: list[list] = []
        self.run_id = run_id
        events.emit(catalogue.WANDB_RUN, run_id=run_id, project=project, name=name, resumed=resumed)

    def _first_unlogged_event(self) -> int:
        """Byte offset in events.jsonl where the events no earlier sink logged begin: after the last
        `wandb_run_closed` (a sink that closed logged everything before it), else after the last
        `wandb_run` (a killed sink: what it logged after starting is logged again), else the start."""
        offset, after_closed, after_started = 0, None, 0
        try:
            with open(self.events_path, "rb") as f:
                for line in f:
                    offset += len(line)
                    try:
                        name = json.loads(line).get("event")
                    except ValueError:
                        continue
                    if name == catalogue.WANDB_RUN_CLOSED:
                        after_closed = offset
                    elif name == catalogue.WANDB_RUN:
                        after_started = offset
        except FileNotFoundError:
            return 0
        return after_started if after_closed is None or after_started > after_closed else after_closed

    def _unavailable(self, during: str, error: BaseException, **fields) -> None:
        """W&B failed (not the user's doing): one event, logged as a warning (trainer.observe.console); the
        sink logs nothing more."""
        self.run = None
        text = f"{type(error).__name__}: {error}".splitlines()[0]
        self._event_log.emit(catalogue.WANDB_UNAVAILABLE, during=during, error=text, **fields)

    def write(self, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            self._log_new_events()
            self._last_step = record["step"]
            self.run.log({STEP_METRIC: record["step"], **scalars(record)})
        except Exception as e:  # noqa: BLE001 - an optional sink never ends training
            self._unavailable("log", e, step=record.get("step"))

    def _log_new_events(self) -> None:
        try:
            with open(self.events_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self._offset += end
        for line in data[:end].splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            name = event.get("event")
            if not name or name in (catalogue.WANDB_RUN, catalogue.WANDB_RUN_CLOSED):
                continue
            step = event.get("step") if isinstance(event.get("step"), int) else self._last_step
            fields = {k: v for k, v in event.items() if k not in ("event", "time", "pid")}
            self._events.append([step, name, event.get("time"), json.dumps(fields, default=str)])
            self.run.log({STEP_METRIC: step, f"events/{name}": 1})

    def close(self) -> None:
        if self.run is None:
            return
        try:
            try:
                self._log_new_events()
                if self._events:
                    table = self._table_cls(columns=["step", "event", "time", "fields"], data=self._events)
                    self.run.log({STEP_METRIC: self._last_step, "events": table})
            finally:
                self.run.finish()
        except Exception as e:  # noqa: BLE001 - an optional sink never ends training
            self._unavailable("finish", e)
            return
        self._event_log.emit(catalogue.WANDB_RUN_CLOSED, run_id=self.run_id)
