"""Every run event, in one place: its name, its fields and what it means.

events.jsonl holds one JSON object per event, `{"event", "time", "pid", ...fields}` (`trainer.observe.events`).
Each entry below is an `Event`: a `str` equal to the event's name, so it is what emitters pass
(`events.emit(catalogue.ATTEMPT_START, attempt=...)`, `on_event(catalogue.CHECKPOINT_SAVE_START, {...})`)
and what readers compare with (`e["event"] == catalogue.ATTEMPT_START`); the JSON written is the plain
name. `EventLog.emit` refuses a name that is not here, and tests/test_event_catalogue.py checks that every
event the code emits is here, that no emitter or reader spells a name as a string literal, and that the
table in docs/architecture.md is `render_table()`:

    python -m trainer.observe.catalogue                        # prints the table
    python -m trainer.observe.catalogue docs/architecture.md   # rewrites it between the doc's markers

Fields are listed in the order emitters pass them; `?` marks one that is present only sometimes. The
launcher's own log (scripts/launch_local.py --events FILE) is another file with its own events: `LAUNCHER`.
"""

from __future__ import annotations

import sys


class Event(str):
    """An event's name (a `str`: `Event("start", ...) == "start"`) with its fields and meaning."""

    fields: tuple[str, ...]  # every field, in emit order (optional ones included)
    optional: frozenset[str]  # the fields present only sometimes
    meaning: str

    def __new__(cls, name: str, fields: str, meaning: str) -> Event:
        self = super().__new__(cls, name)
        spec = fields.split()
        self.fields = tuple(f.removesuffix("?") for f in spec)
        self.optional = frozenset(f.removesuffix("?") for f in spec if f.endswith("?"))
        self.meaning = meaning
        return self

    @property
    def name(self) -> str:
        return str(self)

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(f for f in self.fields if f not in self.optional)

    def __reduce__(self):  # pickles (and copies) as the catalogue's own entry
        return _entry, (str(self),)


# ---- a process of the run (trainer/process_root.py) -------------------------------------------------------
START = Event(
    "start",
    "run_name model steps resume_step argv host_hugepages",
    "a trainer process started on the run directory: the first event of every process and restart",
)
LEASE_ACQUIRED = Event(
    "lease_acquired",
    "generation owner previous_owner? taken_over?",
    "process 0 took the run directory's lease (from `previous_owner`, because `taken_over`, when it had one)",
)
LOAD_PATH_UNUSED = Event(
    "load_path_unused",
    "key path resume_step",
    "a load_*_path was given but the run resumes from its own saved step, so it is not read",
)
GOODPUT = Event(
    "goodput",
    "goodput wall_s productive_s badput_s",
    "where the whole run's wall time went (trainer.observe.goodput), just before `finish`",
)
FINISH = Event(
    "finish",
    "status exit_code step? phase? error?",
    "the process ended with this STATUS and exit code: its last event",
)

# ---- one attempt (trainer/attempt/) ----------------------------------------------------------------------
COMPILE_DONE = Event(
    "compile_done",
    "seconds eval_seconds devices micro_steps",
    "the train (and eval) step compiled for this attempt's set of devices",
)
COMPILE_AHEAD = Event(
    "compile_ahead",
    "devices micro_steps seconds",
    "the train and eval steps of a slice set the run may resize onto were compiled in the background",
)
COMPILE_CACHED = Event(
    "compile_cached",
    "devices micro_steps",
    "this attempt's set of devices reuses the steps compiled by an earlier attempt",
)
RESTORE_START = Event("restore_start", "", "the attempt starts building its train state (restore or init)")
RESTORE_END = Event(
    "restore_end",
    "source seconds bytes",
    "the train state is on the devices; `source`: the restore order's pick (checkpoint:N, snapshot:N, init, ...)",
)
CHECKPOINT_SAVE_BLOCKED = Event(
    "checkpoint_save_blocked",
    "step seconds waited_for_step_s",
    "the loop was blocked starting a checkpoint save (`waited_for_step_s` of it waiting for the step itself)",
)
TARGET_EVAL_LOSS_REACHED = Event(
    "target_eval_loss_reached",
    "step eval_loss",
    "an evaluation reached target_eval_loss: the run saves and stops",
)
PREEMPTED = Event("preempted", "step", "a stop was requested (SIGTERM): the loop saved this step and stopped")
NONFINITE_STEP = Event(
    "nonfinite_step",
    "step policy loss grad_norm",
    "a step's loss or gradient norm was not finite; `policy` (nan_policy) says what follows",
)

# ---- the persistent checkpoint tier (trainer/checkpoint/checkpointer.py) ----------------------------------
CHECKPOINT_SAVE_START = Event("checkpoint_save_start", "step", "a checkpoint save of this step started")
CHECKPOINT_SAVE_COMMITTED = Event(
    "checkpoint_save_committed",
    "step seconds bytes",
    "the save committed (seen by the checkpointer `seconds` after it started)",
)
CHECKPOINT_SAVE_FAILED = Event(
    "checkpoint_save_failed", "step error", "a save failed or was abandoned; it never counts"
)
CHECKPOINT_SAVE_FENCED = Event(
    "checkpoint_save_fenced",
    "step error",
    "a save was refused at its commit: an earlier attempt's, or the run's lease was lost",
)
CHECKPOINT_RESTORE_START = Event("checkpoint_restore_start", "step", "a restore of this committed step started")
CHECKPOINT_RESTORE_DONE = Event(
    "checkpoint_restore_done",
    "step seconds bytes read_bytes",
    "this step was restored: `bytes` of state (one replica), `read_bytes` this process read meanwhile "
    "(/proc/self/io rchar; null where unknown)",
)
CHECKPOINT_RESTORE_FAILED = Event(
    "checkpoint_restore_failed",
    "step error transient attempt",
    "a restore of this step failed (`transient`: retried, else set aside)",
)
CHECKPOINT_SET_ASIDE = Event(
    "checkpoint_set_aside",
    "step path check reason",
    "a committed step whose own files failed verification (`check`), or one newer than the state a "
    "silent-data-corruption rollback restores (`check` unverified), was renamed to `path`",
)
CHECKPOINT_PARTIAL_REMOVED = Event(
    "checkpoint_partial_removed", "path", "an unfinished write of this trainer's was removed"
)
CHECKPOINT_FOREIGN_STEP = Event(
    "checkpoint_foreign_step", "path", "a marker-less step directory that is not this trainer's: left alone"
)

# ---- host snapshots and the local tier (trainer/elastic/snapshot.py, shared_snapshots.py, local_store.py)
SNAPSHOT_STARTED = Event(
    "snapshot_started",
    "step persist",
    "a copy of this step's train state to host memory began (`persist`: also to the local tier)",
)
SNAPSHOT_TAKEN = Event(
    "snapshot_taken",
    "step bytes seconds blocking memory host_bytes replicas?",
    "the train state of this step was copied to host memory (`blocking`: the loop waited for it; `memory`: "
    "pinned_host, each device's shard in its own host's memory, or numpy, in this process; `host_bytes`: "
    "what this process converted to numpy for it; `replicas`: the copies along the data axis)",
)
SNAPSHOT_RESTORED = Event(
    "snapshot_restored",
    "step bytes seconds origin memory? replicas? host_bytes?",
    "the attempt's state was put back from the host snapshot (`origin`: snapshot or local; pinned_host "
    "`memory`: from the surviving `replicas`, `host_bytes` converted to numpy on the way)",
)
SNAPSHOT_SHARED = Event(
    "snapshot_shared",
    "step source_processes origin bytes seconds",
    "processes without the newest snapshot received it from `source_processes`",
)
SNAPSHOT_SKIPPED = Event(
    "snapshot_skipped",
    "step reason",
    "no slice's processes all hold the newest snapshot: it is not used (`reason`)",
)
PERIODS_PLANNED = Event(
    "periods_planned",
    "step snapshot_period local_checkpoint_period checkpoint_period recommended mode mtbf_per_slice_s "
    "process_kill_share rate failures costs expected_goodput?",
    "the auto periods were planned (trainer.elastic.periods.AutoPeriods): the periods now used, the model's "
    "`recommended` ones, the recovery `mode`, the failure rate it planned for (`rate`: expected, the config's, or "
    "observed), the share of failures taken to kill the process, the measured `costs` it weighed, and the "
    "model's `expected_goodput` of the run at the periods now used",
)
LOCAL_CHECKPOINT_SAVE_START = Event(
    "local_checkpoint_save_start", "step", "a local-tier write of this step's host snapshot started"
)
LOCAL_CHECKPOINT_SAVE_BLOCKED = Event(
    "local_checkpoint_save_blocked", "step seconds", "the loop was blocked starting the local-tier write"
)
LOCAL_CHECKPOINT_SAVE_COMMITTED = Event(
    "local_checkpoint_save_committed",
    "step bytes seconds removed",
    "the local-tier step committed (`removed`: older local steps pruned)",
)
LOCAL_CHECKPOINT_SAVE_FAILED = Event(
    "local_checkpoint_save_failed", "step error", "a local-tier write failed; the run carries on without it"
)
LOCAL_CHECKPOINT_PARTIAL_REMOVED = Event(
    "local_checkpoint_partial_removed", "directories", "unfinished local-tier writes of a killed process removed"
)
LOCAL_CHECKPOINT_READ = Event(
    "local_checkpoint_read", "step bytes seconds", "a local-tier step newer than RAM became the host snapshot"
)
LOCAL_CHECKPOINT_SKIPPED = Event(
    "local_checkpoint_skipped",
    "step reason",
    "a local-tier step cannot be used (`reason`); an older one is tried (none left and nothing else saved: the "
    "run stops with exit 2 rather than start over)",
)

# ---- recovery across attempts (trainer/elastic/) ----------------------------------------------------------
ATTEMPT_START = Event(
    "attempt_start",
    "attempt slices start_step source steps_rewound global_batch_size micro_steps lr_scale",
    "an attempt starts training on `slices` from `start_step`",
)
RESTART_RESUMED = Event(
    "restart_resumed",
    "last_step start_step source steps_lost",
    "a restarted process resumed a run that had trained to `last_step` (emitted right before `attempt_start`)",
)
SLICE_KILLED = Event(
    "slice_killed",
    "slice step down_s down_steps cause",
    "an injected fault took this slice down (fault_schedule, random faults or trainer.chaos)",
)
HOST_STALLED = Event(
    "host_stalled",
    "step seconds cause",
    "an injected stall (fault_schedule slow_s) slept the host after this step",
)
HANG_INJECTED = Event(
    "hang_injected",
    "step seconds cause",
    "an injected hang (fault_schedule hang_s) blocks this step's dispatch for `seconds`, raising nothing",
)
HANG_DETECTED = Event(
    "hang_detected",
    "phase step seconds timeout_s stacks",
    "the progress watchdog saw no progress in `phase` for `seconds` (over `timeout_s`) after step `step`: "
    "every thread's stack is in the log and in `stacks`; the process exits 75 (restart the same command)",
)
NAN_INJECTED = Event("nan_injected", "step", "an injected fault made this step's loss NaN")
SPIKE_INJECTED = Event(
    "spike_injected",
    "step factor",
    "an injected fault (fault_schedule spike) multiplied this step's loss and update by `factor`",
)
FAULT_INJECTED = Event(
    "fault_injected",
    "step process error",
    "an injected error (fault_schedule: `oom` or a bug) is raised in this process's step",
)
SLICE_DOWN_DETECTED = Event(
    "slice_down_detected",
    "attempt last_step slices error cause failures time teardown_s",
    "the attempt failed on a lost slice or peer (`time`: when the error was seen, `teardown_s` after it)",
)
FATAL_ERROR = Event("fatal_error", "error", "this process's own error: it ends every process of the job")
WAIT_START = Event("wait_start", "min_slices total_slices", "waiting for at least `min_slices` healthy slices")
WAIT_END = Event("wait_end", "active seconds", "enough slices are healthy: `active`")
WAIT_TIMEOUT = Event(
    "wait_timeout", "seconds error", "too few healthy slices within elastic_timeout_seconds: the run ends"
)
FORMATION = Event(
    "formation",
    "key mesh_order incarnations fresh_clients",
    "the live processes agreed on a formation (several processes)",
)
FIRST_STEP_AFTER_RECOVERY = Event(
    "first_step_after_recovery",
    "step seconds_since_detection slices",
    "the first step after a failure completed",
)
SCALE_UP_REQUESTED = Event(
    "scale_up_requested",
    "step returning active",
    "slices came back: the live state was snapshotted for a larger attempt",
)
SCALE_UP = Event("scale_up", "step detail", "the next attempt runs on the larger set of slices")
ROLLBACK = Event(
    "rollback",
    "step last_step cause? not_after?",
    "the next attempt restores the newest saved state (of at most step `not_after`, when set: the newest "
    "verified clean): nan_policy=rollback skips this step's batch; cause `loss_spike`: "
    "loss_spike_threshold, see loss_spike_rollback; cause `silent_data_corruption`: see sdc_detected",
)
SDC_DETECTED = Event(
    "sdc_detected",
    "step slices mismatched kind verified_step seconds",
    "the silent-data-corruption check of `step` (before it ran) found a mismatch, `kind` replicas_differ "
    "(the replicas' copies of the parameters differ: `mismatched` slices hold copies unlike the majority's) "
    "or replay_differs (the results for the rows of the `mismatched` slices differ between two slices "
    "computing them); `slices` are the suspects; the run rolls back to the newest state of at most "
    "`verified_step`, the state the last passing check started from (null: none passed yet)",
)
SDC_INJECTED = Event(
    "sdc_injected",
    "step slice where persistent?",
    "an injected fault made `slice` compute wrong numbers at `step` (fault_schedule corrupt=1; "
    "corrupt=persistent: from `step` on, `persistent` true), seen by `where`: the replay check or the step "
    "itself; or changed `slice`'s copy of the parameters after `step` (flip=1, `where` memory)",
)
SDC_PERSISTS = Event(
    "sdc_persists",
    "step last_rollback_step slices devices processes fix",
    "the check of `step` found corruption again on devices the rollback from `last_rollback_step` blamed, "
    "with no progress past that step: a broken chip; the run stops (exit 3, gave_up) instead of rolling "
    "back again. `devices`: the suspect slices' device ids; `processes`: the JAX process ids that hold them; "
    "`fix`: replace or drain those hosts (or sdc_quarantine=true), then rerun",
)
SDC_PERIOD_PLANNED = Event(
    "sdc_period_planned",
    "step period step_s check_s measured",
    "sdc_check_period auto: the check now runs every `period` steps, planned from the median step time "
    "`step_s` and a check's cost `check_s` (`measured` false: assumed two steps until a check ran)",
)
SDC_QUARANTINED = Event(
    "sdc_quarantined",
    "step slice",
    "sdc_quarantine: the slice the check named is treated as lost from now on",
)
LOSS_SPIKE_ROLLBACK = Event(
    "loss_spike_rollback",
    "step loss median restored_step skipped_steps fingerprints",
    "the loss of `step` exceeded loss_spike_threshold x the recent `median`: the run restored "
    "`restored_step` and never trains the batches of the steps after it through the spike again (their "
    "`fingerprints`, also after a restart)",
)
STOP_AGREED = Event(
    "stop_agreed",
    "step proposed_here at_step",
    "every process stops after `step` (a stop proposed by one of them; several processes)",
)
ELASTIC_SUMMARY = Event(
    "elastic_summary", "failures steps_lost downtime_s", "the supervisor's count of failures and their cost"
)

# ---- observation (trainer/observe/) -----------------------------------------------------------------------
PROFILER_START = Event("profiler_start", "step logdir", "a profiler trace started before this step")
PROFILER_STOP = Event(
    "profiler_stop", "step complete", "the trace stopped (`complete`: its window ended, else the attempt did)"
)
SLOW_STEP = Event(
    "slow_step",
    "step step_time_s median_s factor process slowest_process host_time_s",
    "a step took more than `factor` times the recent median (monitor_step_time_deviation)",
)
WANDB_RUN = Event(
    "wandb_run", "run_id project name resumed", "the W&B run that this process logs to (enable_wandb)"
)
CONTROL_REQUEST = Event(
    "control_request",
    "action accepted status remote reason?",
    "a request to the control endpoint (metrics_port, trainer.control): an `accepted` one (202) is queued for "
    "the next step boundary; a refused one (401 no token, 403 a wrong one, 405 not POST, 404 no such action, "
    "409 not for this run, 503 still starting; its `reason`) changes nothing",
)
CONTROL_APPLIED = Event(
    "control_applied",
    "action",
    "the training thread took an accepted control request at a step boundary: `checkpoint` saves the next "
    "step, `drain` stops as SIGTERM does (save, exit 42), `replan` plans the auto periods at the next step",
)
WANDB_RUN_CLOSED = Event("wandb_run_closed", "run_id", "the W&B sink logged everything before this event")
WANDB_UNAVAILABLE = Event(
    "wandb_unavailable",
    "during error project? step?",
    "W&B failed to start, log or finish (not the user's doing): the run trains on without it",
)

# ---- the local launcher's own log (scripts/launch_local.py --events FILE), not events.jsonl --------------
LAUNCHER_SPAWN = Event("spawn", "process pid incarnation port", "the launcher started a trainer process")
LAUNCHER_EXIT = Event("exit", "process pid rc incarnation", "a trainer process exited")
LAUNCHER_DONE = Event("done", "rc", "the job ended with this exit code")
LAUNCHER_JOB_RESTART = Event("job_restart", "number delay_s", "process 0 died: the whole job restarts")
LAUNCHER_RESTART_REFUSED = Event("restart_refused", "process", "a dead process is not restarted (--max-restarts)")
LAUNCHER_RESPAWN_SCHEDULED = Event("respawn_scheduled", "process delay_s", "a dead process restarts after a delay")

ALL: tuple[Event, ...] = tuple(
    v for k, v in list(globals().items()) if isinstance(v, Event) and not k.startswith("LAUNCHER_")
)
LAUNCHER: tuple[Event, ...] = tuple(
    v for k, v in list(globals().items()) if isinstance(v, Event) and k.startswith("LAUNCHER_")
)
NAMES: frozenset[str] = frozenset(e.name for e in ALL)
_BY_NAME = {e.name: e for e in ALL}


def _entry(name: str) -> Event:
    return _BY_NAME.get(name) or next(e for e in LAUNCHER if e.name == name)


def catalogue() -> tuple[Event, ...]:
    """Every event of events.jsonl, in the order of this module."""
    return ALL


def by_name(name: str) -> Event:
    """The entry of an events.jsonl event name; KeyError for a name that is not one."""
    return _BY_NAME[name]


BEGIN, END = "<!-- events:begin -->\n", "<!-- events:end -->"


def render_table() -> str:
    """The markdown table of docs/architecture.md (between its `events:begin` / `events:end` markers)."""
    lines = ["| event | fields (`?`: sometimes) | meaning |", "| --- | --- | --- |"]
    for e in ALL:
        fields = ", ".join(f"`{f}`?" if f in e.optional else f"`{f}`" for f in e.fields) or "(none)"
        lines.append(f"| `{e.name}` | {fields} | {e.meaning} |")
    return "\n".join(lines) + "\n"


def documented_table(text: str) -> str:
    """What a document holds between the markers (ValueError without them)."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end]


def with_table(text: str) -> str:
    """`text` with the rendered table between its markers."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + render_table() + text[end:]


def main(argv: list[str]) -> None:
    """No arguments: print the table. Paths: rewrite the table between each one's markers."""
    for path in argv:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(with_table(text))
    if not argv:
        sys.stdout.write(render_table())


if __name__ == "__main__":
    main(sys.argv[1:])
