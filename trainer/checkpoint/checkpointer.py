"""`Checkpointer`: one per training attempt, over an Orbax CheckpointManager.

Saves are period / final / continuous (`should_save`), asynchronous when configured, and kept to the
newest `max_num_checkpoints_to_keep`. Restores take the newest committed step and fall back to older
committed steps when one fails to read; they reshard onto whatever mesh the abstract state names.
Every outcome is a log line and an `on_event(name, fields)` call:

    checkpoint_save_start {step}         checkpoint_save_committed {step, seconds, bytes}
    checkpoint_restore_start {step}      checkpoint_restore_done {step, seconds, bytes}
    checkpoint_save_failed {step, error}      checkpoint_restore_failed {step, error, transient, attempt}
    checkpoint_partial_removed {path}         checkpoint_set_aside {step, path, check, reason}
    checkpoint_save_fenced {step, error}      checkpoint_foreign_step {path}

Restore failures are classified (`restore`): a step that does not fit the config's train state raises
`CheckpointMismatch` (exit 2, nothing changed); a device or peer failure propagates; anything else is
set aside only when the step's own files fail verification (`trainer.checkpoint.verify`), and
otherwise retried, then raised as `CheckpointRestoreTransient` (exit 75, nothing changed).

`seconds` of a save runs from `save()` to the moment this object saw the commit; an async commit is
seen at the next `should_save`/`save`/`wait`, so call `should_save` every step. `bytes` counts the
arrays of the train state (in memory, not on disk).

Errors of a save are never swallowed: a save that fails while `save()` runs raises at once; one that
fails in the background is logged and emitted when seen, then raised by the next `save()` (which
starts nothing; the call after it saves normally) or by `wait()`. `close()` is the exception to the
rule, so that tearing down an attempt after a failure never masks that failure: it reports, it does
not raise. End every successful run with `wait()`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental.multihost_utils import ProcessFailureError

from trainer.checkpoint import commit, single_replica, verify
from trainer.checkpoint.compat import CheckpointMismatch, leaf_differences, signature, stored_orbax_signature
from trainer.checkpoint.fence import FencedWrite, SaveFence, fenced_path_class
from trainer.config.schema import UNPLANNED_CHECKPOINT_PERIOD, CheckpointConfig
from trainer.errors import TransientError, UserInputError
from trainer.failures.storage import StorageFaults
from trainer.io.nbytes import tree_nbytes
from trainer.observe import catalogue, procio

log = logging.getLogger(__name__)


def _no_events(name: str, fields: dict) -> None:
    """The default `on_event`: nothing listens, so the checkpointer's own log line is the record."""


# The items of a step directory (each is a subdirectory of <step>/).
STATE, DATA, METADATA = "state", "data", "metadata"
_POLL_S = 0.05
RESTORE_TRIES = 3  # reads of one step before a failure that is not corruption is given up on
RESTORE_BACKOFF_S = 0.5  # doubled after each failed read
# Saves abandoned by a closed checkpointer: (directory, Orbax manager, step). Their writer thread may still
# be writing the step's directory, so cleanup leaves that step alone until the writer has ended (fenced).
_ABANDONED: list[tuple[str, Any, int]] = []
_ABANDONED_LOCK = threading.Lock()


class CheckpointSaveError(TransientError):
    """A checkpoint save failed (storage error, disk full, permission, ...); the cause is chained. Nothing
    committed is affected: the run resumes from the newest committed step."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


class CheckpointRestoreError(RuntimeError):
    """None of the committed checkpoints could be restored; the newest one's error is chained."""


class CheckpointRestoreTransient(CheckpointRestoreError, TransientError):
    """A committed step could not be read, but its files verify: storage, a peer or memory failed, not the
    step. Nothing was changed; the same command resumes."""


class RunStepsAllCorrupt(CheckpointRestoreError, UserInputError):
    """Every committed step failed verification and was set aside: the run is not silently restarted."""


@dataclasses.dataclass(frozen=True)
class RestoredStep:
    step: int
    state: Any
    data_state: dict
    metadata: dict
    bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class _InFlight:
    step: int
    started: float
    nbytes: int


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


def open_checkpointer(
    directory: epath.PathLike,
    cfg: CheckpointConfig,
    *,
    on_event: Callable[[str, dict], None] = _no_events,
    multiprocessing: ocp.options.MultiprocessingOptions | None = None,
    barrier_sync_fn: Callable | None = None,
    fence: SaveFence | None = None,
    storage_faults: StorageFaults | None = None,
    due: Callable[[int], bool] | None = None,
):
    """The run's checkpoints: a `Checkpointer`, or `NoCheckpoints` under enable_checkpointing=false
    (the one place that setting is read)."""
    if not cfg.enable_checkpointing:
        return NoCheckpoints()
    return Checkpointer(
        directory,
        cfg,
        on_event=on_event,
        multiprocessing=multiprocessing,
        barrier_sync_fn=barrier_sync_fn,
        fence=fence,
        storage_faults=storage_faults,
        due=due,
    )


def every(period: int) -> Callable[[int], bool]:
    """Due at the steps divisible by `period` (auto, -1: by UNPLANNED_CHECKPOINT_PERIOD)."""
    period = period if period > 0 else UNPLANNED_CHECKPOINT_PERIOD
    return lambda step: step % period == 0


class NoCheckpoints:
    """enable_checkpointing=false: nothing is saved, and there is never a checkpoint to restore."""

    def should_save(self, step: int, *, final: bool) -> bool:
        return False

    def save(self, step: int, state, data_state: dict, metadata: dict, *, force: bool = False) -> bool:
        return False

    def wait(self) -> None:
        pass

    def close(self, *, timeout_s: float | None = None) -> None:
        pass

    def cleanup_partial(self) -> list[str]:
        return []

    def latest_committed_step(self) -> int | None:
        return None

    def committed_steps(self) -> list[int]:
        return []

    def set_aside_after(self, step: int, why: str) -> list[int]:
        return []

    def restore(self, abstract_state, step: int | None = None):
        raise CheckpointRestoreError("enable_checkpointing=false: this run keeps no checkpoints")


class Checkpointer:
    """Saves and restores {state, data_state, metadata} under `directory`/<step>/ (see the package doc).

    Not thread-safe (nor is Orbax's CheckpointManager): call it from the train loop's thread."""

    def __init__(
        self,
        directory: epath.PathLike,
        cfg: CheckpointConfig,
        *,
        on_event: Callable[[str, dict], None] = _no_events,
        clock: Callable[[], float] = time.monotonic,
        multiprocessing: ocp.options.MultiprocessingOptions | None = None,
        barrier_sync_fn: Callable | None = None,
        fence: SaveFence | None = None,
        storage_faults: StorageFaults | None = None,
        sleep: Callable[[float], None] = time.sleep,
        due: Callable[[int], bool] | None = None,
    ):
        """`barrier_sync_fn`: Orbax's barriers between processes (trainer.distributed.heartbeat.Barrier,
        which ends with ProcessFailureError when a peer dies); None: the coordination service's.
        `fence`: the process's save fence (one per process; this checkpointer advances it, so saves of
        earlier checkpointers can no longer commit). `storage_faults`: injected storage failures.
        `due(step)`: whether a periodic save falls on `step` (a period planned by
        trainer.elastic.periods.AutoPeriods); default every checkpoint_period steps."""
        self._manager = None  # first, so that close() works on a half-built object
        self._barrier = barrier_sync_fn
        self.directory = epath.Path(directory)
        self._cfg = cfg
        self._due = due or every(cfg.checkpoint_period)
        self._on_event = on_event
        self._clock = clock
        self._sleep = sleep
        self._faults = storage_faults or StorageFaults()
        self._inflight: _InFlight | None = None
        self._failure: CheckpointSaveError | None = None  # newest failed save, not raised yet
        self._foreign_reported: set[str] = set()
        self._fence = fence or SaveFence()
        epoch = self._fence.advance()
        keep = cfg.max_num_checkpoints_to_keep
        subset = multiprocessing is not None and multiprocessing.active_processes is not None
        if subset:  # Orbax leaves the root directory to us when only some processes take part
            self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            create=not subset,
            max_to_keep=keep if keep > 0 else None,
            enable_async_checkpointing=cfg.async_checkpointing,
            # Create the step's directory inside save(), not in the background: a broken path then
            # fails save() at once, whereas a failed background creation leaves Orbax's other writer
            # threads waiting minutes for a signal that never comes.
            async_options=ocp.AsyncOptions(
                create_directories_asynchronously=False, barrier_sync_fn=barrier_sync_fn
            ),
            # Several processes: which of them take part, and which one writes shared files (primary).
            multiprocessing_options=multiprocessing or ocp.options.MultiprocessingOptions(),
            # The commit runs the fence and records the step's files (trainer.checkpoint.fence, .verify).
            temporary_path_class=fenced_path_class(
                self.directory, check=partial(self._fence_check, epoch), record=verify.record
            ),
        )
        self._primary_host = options.multiprocessing_options.primary_host
        # The state item is a plain Orbax pytree checkpoint (what StandardSave writes too); its handler is
        # explicit so that compression is a choice, and so that a restore can read one replica.
        # Every handler gets the manager's multi-process options, as Orbax's default handlers would.
        mp = options.multiprocessing_options
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                STATE: ocp.PyTreeCheckpointHandler(
                    use_compression=cfg.checkpoint_compression,
                    multiprocessing_options=mp,
                    type_handler_registry=single_replica.type_handler_registry(),
                ),
                DATA: ocp.JsonCheckpointHandler(multiprocessing_options=mp),
                METADATA: ocp.JsonCheckpointHandler(multiprocessing_options=mp),
            },
        )

    # ---- what is on storage ----------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending, read from storage now (Orbax's step cache is not consulted)."""
        return commit.committed_steps(self.directory)

    def latest_committed_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def set_aside_after(self, step: int, why: str) -> list[int]:
        """Set aside every committed step after `step` (`_set_aside`: kept for inspection, saved again when
        training reaches it): states a rollback to `step` found unverified (`why`)."""
        self._finish_inflight()
        newer = [s for s in self.committed_steps() if s > step]
        for s in newer:
            self._set_aside(s, RuntimeError(why), "unverified")
        return newer

    def cleanup_partial(self) -> list[str]:
        """Remove this trainer's own unfinished writes (`commit.partial_step_paths`: Orbax's tmp dirs, and
        step dirs whose in-flight marker says this trainer was writing them), every one, not only the
        newest; return their paths. Left alone: the step this object is writing, a step an abandoned save
        of an earlier attempt may still be writing (removed once its writer ended), a partial that cannot
        be removed yet (kept for the next call), and step directories of other tools (reported once)."""
        if not self._is_primary():
            return []  # several processes share the directory: only the primary host deletes
        busy = {self._inflight.step} if self._inflight is not None else set()
        busy |= _abandoned_writing(str(self.directory))
        removed = []
        for step, path in commit.partial_step_paths(self.directory):
            if step in busy:
                continue
            try:
                if path.is_dir():
                    path.rmtree()
                else:
                    path.unlink()
            except OSError as e:
                log.warning("checkpoint partial not removed yet path=%s: %s", path, _describe(e))
                continue
            if not path.name.endswith(commit.SAVING_SUFFIX):
                removed.append(str(path))
                self._emit(catalogue.CHECKPOINT_PARTIAL_REMOVED, logging.WARNING, path=str(path))
        for path in commit.foreign_step_paths(self.directory):
            if str(path) not in self._foreign_reported:
                self._foreign_reported.add(str(path))
                self._emit(catalogue.CHECKPOINT_FOREIGN_STEP, logging.WARNING, path=str(path))
        if removed:
            self._manager.reload()  # Orbax may have listed a marker-less step dir as a checkpoint
        return removed

    def _is_primary(self) -> bool:
        return self._primary_host is None or jax.process_index() == self._primary_host

    def _fence_check(self, epoch: int, step: int) -> None:
        """Run at the step's commit, on Orbax's thread (trainer.checkpoint.fence)."""
        try:
            self._fence.check(epoch, step)
        except FencedWrite as e:
            self._emit(catalogue.CHECKPOINT_SAVE_FENCED, logging.WARNING, step=step, error=str(e))
            raise

    # ---- saving -----------------------------------------------------------------------------------

    def should_save(self, step: int, *, final: bool) -> bool:
        """Whether to save after `step` optimizer steps: when the period is due (`due`) and at the final
        step; in continuous mode whenever no save is still being written. Call it every step: it is
        also where a finished async save is noticed."""
        self._poll()
        if self._inflight is not None and self._inflight.step == step:
            return False
        if final:
            return True
        if self._cfg.enable_continuous_checkpointing:
            return self._inflight is None
        return self._due(step)

    def save(self, step: int, state, data_state: dict, metadata: dict, *, force: bool = False) -> bool:
        """Start saving `state` (a pytree of jax.Arrays), `data_state` and `metadata` (JSON-able) as `step`.

        The caller decides when (should_save). Returns False, saving nothing, when `step` is already
        committed or being written. First waits for the previous save; if that one failed, raises its
        CheckpointSaveError instead of saving (the next call saves), unless `force` (the SIGTERM save: a
        fresh checkpoint matters more; the failure stays logged). Returns once the arrays are copied off
        the devices (async) or once committed (sync).
        """
        self._poll()
        if self._inflight is not None and self._inflight.step == step:
            return False
        self._finish_inflight()  # Orbax would wait for the previous save anyway; this reports how it ended
        if self._failure is not None and not force:
            self._raise_failure()
        started = self._clock()
        items = {
            STATE: ocp.args.PyTreeSave(state),
            DATA: ocp.args.JsonSave(data_state),
            METADATA: ocp.args.JsonSave(metadata),
        }
        try:  # every storage access is inside: a broken path is a failed save, like any other
            if step in self.committed_steps():
                log.info("checkpoint step=%d is already committed; not saving it again", step)
                return False
            self._manager.reload()  # retention and "step exists" use Orbax's cache: refresh it
            self._emit(catalogue.CHECKPOINT_SAVE_START, step=step)
            self._faults.fire("save", f"step {step}")
            if self._is_primary():  # ours, for cleanup: written before the step's directory exists
                commit.saving_marker(self.directory, step).write_text(str(time.time()))
            self._blocking(lambda: self._manager.save(step, args=ocp.args.Composite(**items), force=True))
        except ProcessFailureError:
            raise  # a peer died during the save: a slice-down event, not a failed save
        except Exception as e:
            self._record_failure(step, e)
            self._raise_failure()
        self._inflight = _InFlight(step, started, tree_nbytes(state))
        if not self._cfg.async_checkpointing:
            self.wait()
        return True

    def _saving(self, manager, timeout_s: float) -> bool | None:
        """Whether a save is in progress; None when several processes are saving and the question did not
        answer in time (see _saving_in_progress). One process: asked directly (no barrier behind it)."""
        if self._barrier is None:
            return bool(manager.is_saving_in_progress())
        return _saving_in_progress(manager, timeout_s)

    def _blocking(self, fn: Callable[[], Any]) -> Any:
        """Run Orbax work that waits for other processes. With a barrier that watches them (several
        processes), it runs in a daemon thread while the barrier watches the peers' heartbeats, so that a
        peer lost meanwhile raises ProcessFailureError here instead of leaving this thread in one of
        Orbax's own barriers until its timeout."""
        barrier = self._barrier
        if barrier is None:
            return fn()
        result: list = []

        def work():
            try:
                result.append((True, fn()))
            except BaseException as e:  # handed to the caller below
                result.append((False, e))

        thread = threading.Thread(target=work, name="checkpoint-save", daemon=True)
        thread.start()
        barrier.wait(thread, "checkpoint save")
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def wait(self) -> None:
        """Block until the in-flight save is committed; raise CheckpointSaveError if a save failed."""
        self._finish_inflight()
        self._raise_failure()

    def close(self, *, timeout_s: float | None = None) -> None:
        """Settle the in-flight save and release Orbax's threads. Safe on a half-built object; never
        raises a save's error (it is logged and emitted; wait() is what raises).

        `timeout_s` bounds the wait, for tearing down an attempt after a slice failure: a save still
        writing after that is abandoned (reported as checkpoint_save_failed) and Orbax's background
        thread is left to end on its own, within Orbax's async timeout (20 min by default). Until then
        it may still commit its step (and, as every commit does, apply retention). If a later
        Checkpointer's cleanup_partial removes its tmp directory under it, it fails, or at worst
        commits a step with missing chunks, which restore() reports and falls back from. Orbax's own
        cancel() is not used: a cancelled save still applies retention, so with
        max_num_checkpoints_to_keep=1 it would delete the only committed checkpoint.
        """
        manager = getattr(self, "_manager", None)
        if manager is None:
            return
        self._manager = None
        try:
            if not self._finish_inflight(timeout_s, manager=manager):
                step = self._inflight.step
                self._inflight = None
                with _ABANDONED_LOCK:  # its writer may go on; the fence refuses its commit
                    _ABANDONED.append((str(self.directory), manager, step))
                self._emit(
                    catalogue.CHECKPOINT_SAVE_FAILED,
                    logging.ERROR,
                    step=step,
                    error=f"abandoned: still writing after {timeout_s} s",
                )
                return
            if self._failure is not None:
                log.error("closing with an unraised checkpoint failure (wait() raises it): %s", self._failure)
                self._failure = None
            manager.close()
        except Exception as e:  # a teardown must not mask the error that caused it
            log.exception("checkpoint manager close failed: %s", _describe(e))

    # ---- restoring --------------------------------------------------------------------------------

    def restore(self, abstract_state, step: int | None = None) -> RestoredStep | None:
        """Restore the newest committed step (or `step`, which must be committed) onto the shardings of
        `abstract_state` (jax.ShapeDtypeStruct leaves with .sharding, any mesh). Returns None if there is
        no committed step. A failed read is classified:
        - a device or slice failure (JaxRuntimeError, ProcessFailureError) propagates at once;
        - a step whose stored tree does not fit `abstract_state` raises CheckpointMismatch (exit 2);
        - a step whose own files fail verification is set aside (`_set_aside`, naming the failed check:
          saved again when training reaches it) and the next older step is tried;
        - anything else is retried (RESTORE_TRIES reads, backing off), then raised as
          CheckpointRestoreTransient: nothing on storage changes.
        If every committed step was set aside, raises RunStepsAllCorrupt (the run never silently
        starts over)."""
        self._finish_inflight()
        steps = self.committed_steps()
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(
                    f"step {step} is not a committed checkpoint in {self.directory} (committed: {steps})"
                )
            steps = [s for s in steps if s <= step]
        if not steps:
            return None
        aside = []
        for candidate in reversed(steps):
            restored, failed_check = self._restore_or_verify(candidate, abstract_state)
            if restored is not None:
                return restored
            aside.append(f"{candidate} ({failed_check})")
        raise RunStepsAllCorrupt(
            f"every committed step of {self.directory} failed verification and was set aside: "
            f"{', '.join(aside)}; the run is not restarted from scratch. Inspect them (and delete them to "
            "start over), or start a new run: another run_name=..."
        )

    def _restore_or_verify(self, step: int, abstract_state) -> tuple[RestoredStep | None, str | None]:
        """(restored, None), or (None, the failed check) once the step was proven corrupt and set aside."""
        for attempt in range(1, RESTORE_TRIES + 1):
            try:
                self._faults.fire("restore", f"step {step}")
                return self._restore_step(step, abstract_state), None
            except (jax.errors.JaxRuntimeError, ProcessFailureError):
                raise
            except Exception as e:
                failed_check = verify.verify_step(commit.step_dir(self.directory, step))
                mismatch = [] if failed_check else self._mismatch(step, abstract_state)
                if mismatch:
                    raise CheckpointMismatch(
                        f"cannot restore {commit.step_dir(self.directory, step)}: the train state this config "
                        f"builds does not match it: {'; '.join(mismatch)}. Resume with the config it was "
                        "saved with, or start a new run (another run_name=...); nothing was changed"
                    ) from e
                self._emit(
                    catalogue.CHECKPOINT_RESTORE_FAILED,
                    logging.ERROR,
                    step=step,
                    error=_describe(e),
                    transient=failed_check is None,
                    attempt=attempt,
                )
                if failed_check is not None:
                    self._set_aside(step, e, failed_check)
                    return None, failed_check
                if attempt == RESTORE_TRIES:
                    raise CheckpointRestoreTransient(
                        f"restoring checkpoint step {step} failed {RESTORE_TRIES} times, and its files verify "
                        f"(so storage, memory or a peer failed, not the step): {_describe(e)}; nothing was "
                        "changed: the same command resumes"
                    ) from e
                self._sleep(RESTORE_BACKOFF_S * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def _mismatch(self, step: int, abstract_state) -> list[str]:
        """The leaves where the step's stored tree differs from `abstract_state` ([] if it fits, or its
        metadata cannot tell)."""
        stored = stored_orbax_signature(commit.step_dir(self.directory, step))
        if stored is None:
            return []
        return leaf_differences(signature(abstract_state, orbax_layout=True), stored)

    def _set_aside(self, step: int, error: Exception, check: str) -> None:
        """Move a committed step whose own files failed verification (`check`) to
        `<step>.unreadable-<unix time>` (kept for inspection; no longer a step, partial or committed), so
        the run saves that step again when it reaches it instead of skipping it as "already committed".
        Only the primary host moves it."""
        if not self._is_primary():
            return
        path = commit.step_dir(self.directory, step)
        aside = path.parent / f"{path.name}{commit.UNREADABLE_SUFFIX}{int(time.time())}"
        try:
            path.rename(aside)
        except OSError as e:  # another process moved it, or storage refuses: restore goes on regardless
            log.warning("unreadable checkpoint step=%d not moved aside: %s", step, _describe(e))
            return
        self._manager.reload()
        self._emit(
            catalogue.CHECKPOINT_SET_ASIDE,
            logging.WARNING,
            step=step,
            path=str(aside),
            check=check,
            reason=_describe(error),
        )

    def _restore_step(self, step: int, abstract_state) -> RestoredStep:
        self._emit(catalogue.CHECKPOINT_RESTORE_START, step=step)
        started, read_before = self._clock(), procio.read_bytes()
        restore_args = single_replica.restore_args(abstract_state)  # several processes: one replica reads
        items = {
            STATE: ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args),
            DATA: ocp.args.JsonRestore(),
            METADATA: ocp.args.JsonRestore(),
        }
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        state = jax.block_until_ready(out[STATE])  # read errors surface here, inside the fallback
        seconds, nbytes = self._clock() - started, tree_nbytes(state)
        read_after = procio.read_bytes()
        read = None if read_before is None or read_after is None else read_after - read_before
        self._emit(
            catalogue.CHECKPOINT_RESTORE_DONE, step=step, seconds=round(seconds, 4), bytes=nbytes, read_bytes=read
        )
        return RestoredStep(step, state, out[DATA], out[METADATA], nbytes, seconds)

    # ---- the in-flight save -------------------------------------------------------------------------

    def _poll(self) -> None:
        """Report the in-flight save if it has ended; never blocks."""
        if self._inflight is not None and self._saving(self._manager, _POLL_S) is False:
            self._finish_inflight()

    def _finish_inflight(self, timeout_s: float | None = None, *, manager=None) -> bool:
        """Wait (at most timeout_s) for the in-flight save and report how it ended. False: still writing."""
        inflight, manager = self._inflight, manager or self._manager
        if inflight is None:
            return True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is not None:
            saving = self._saving(manager, max(0.0, deadline - time.monotonic()))
            if saving is False:
                break
            if saving is None or time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        self._inflight = None
        try:
            manager.wait_until_finished()  # raises the background error
            if not commit.is_committed(commit.step_dir(self.directory, inflight.step)):
                raise RuntimeError("Orbax finished the save but the step directory is not committed")
        except Exception as e:
            self._record_failure(inflight.step, e)
            return True
        self._failure = None  # a newer committed checkpoint supersedes an earlier failure
        self._drop_marker(inflight.step)
        self._emit(
            catalogue.CHECKPOINT_SAVE_COMMITTED,
            step=inflight.step,
            seconds=round(self._clock() - inflight.started, 4),
            bytes=inflight.nbytes,
        )
        return True

    def _drop_marker(self, step: int) -> None:
        if not self._is_primary():
            return
        try:
            commit.saving_marker(self.directory, step).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:  # a stale marker beside a committed step is harmless; cleanup removes it
            log.warning("in-flight marker of step %d not removed: %s", step, _describe(e))

    def _record_failure(self, step: int, error: Exception) -> None:
        failure = CheckpointSaveError(step, f"checkpoint save of step {step} failed: {_describe(error)}")
        failure.__cause__ = error
        self._failure = failure
        self._emit(catalogue.CHECKPOINT_SAVE_FAILED, logging.ERROR, step=step, error=_describe(error))

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _emit(self, name: catalogue.Event, level: int = logging.INFO, **fields) -> None:
        # An event log given as on_event logs the event itself: this line is then only for debugging.
        quiet = self._on_event is not _no_events
        log.log(logging.DEBUG if quiet else level, "%s %s", name, " ".join(f"{k}={v}" for k, v in fields.items()))
        self._on_event(name, fields)


def _abandoned_writing(directory: str) -> set[int]:
    """Steps under `directory` that a save abandoned by an earlier checkpointer may still be writing
    (finished ones are forgotten)."""
    with _ABANDONED_LOCK:
        alive = [entry for entry in _ABANDONED if _saving_in_progress(entry[1], _POLL_S) is not False]
        _ABANDONED[:] = alive
        return {step for d, _, step in alive if d == directory}


def _saving_in_progress(manager, timeout_s: float) -> bool | None:
    """`manager.is_saving_in_progress()`, or None when it does not answer within `timeout_s`.

    With several processes Orbax keeps that flag in a value synchronised across processes, whose lock its
    finalize thread holds while it waits in a barrier for every process; when a peer died during the save,
    that barrier (and any caller of the flag) waits for Orbax's async timeout. So the question is asked
    from a daemon thread, which is left behind if it does not answer."""
    answer: list[bool] = []
    done = threading.Event()

    def ask():
        try:
            answer.append(bool(manager.is_saving_in_progress()))
        except Exception:  # a closed or broken manager: nothing to wait for
            answer.append(False)
        done.set()

    threading.Thread(target=ask, name="checkpoint-saving-in-progress", daemon=True).start()
    return answer[0] if done.wait(timeout_s) else None
