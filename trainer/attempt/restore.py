"""Which saved state an attempt starts from: the one restore order, for every source and every run.

    host snapshot  \
    local tier      } the newest of the three; a tie goes to the faster read (snapshot, then local)
    checkpoint     /  (the newest committed step of this run's persistent checkpoints)
    load_full_state_path, then load_parameters_path   (a new run started from other weights)
    init           fresh parameters

`choose_source` is that rule as a pure function; `restore_state` applies it. A run whose only saved
steps are local ones that all fail to read is never started over (`LocalStepsAllUnusable`, exit 2), as
a persistent tier whose steps were all set aside is not (`RunStepsAllCorrupt`). The local tier reaches
the order through the snapshot source: a local step is a host snapshot written to node-local disk, and a
process that starts without one in RAM reads the newest local step back as its snapshot
(`trainer.checkpoint.local_store`). Single- and multi-process runs differ only in their
`SnapshotSource`: one process reads its own host copy (`trainer.elastic.snapshot.HostSnapshots`),
several agree on the newest copy any of them holds and send it to the ones without
(`trainer.elastic.shared_snapshots.SharedSnapshots`), so a replacement process on a fresh node (an
empty local directory) gets the state from a peer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from trainer.errors import UserInputError

SNAPSHOT, LOCAL, CHECKPOINT, FULL_STATE, PARAMETERS, INIT = (
    "snapshot",
    "local",
    "checkpoint",
    "load_full_state_path",
    "load_parameters_path",
    "init",
)


def choose_source(
    *,
    snapshot_step: int | None,
    checkpoint_step: int | None,
    local_step: int | None = None,
    load_full_state_path: str = "",
    load_parameters_path: str = "",
) -> str:
    """The restore order (see the module doc) for what exists now."""
    saved = [
        (step, rank, source)
        for rank, (step, source) in enumerate(
            [(snapshot_step, SNAPSHOT), (local_step, LOCAL), (checkpoint_step, CHECKPOINT)]
        )
        if step is not None
    ]
    if saved:
        return max(saved, key=lambda s: (s[0], -s[1]))[2]  # newest step; on a tie the faster read
    if load_full_state_path:
        return FULL_STATE
    if load_parameters_path:
        return PARAMETERS
    return INIT


class LocalStepsAllUnusable(UserInputError):
    """Every step of the local checkpoint tier failed to read and the run saved nothing else: like a
    persistent tier whose steps were all set aside (`RunStepsAllCorrupt`), the run is not silently
    restarted (exit 2)."""


def refuse_to_start_over(snapshots: SnapshotSource | None) -> None:
    """Raise LocalStepsAllUnusable when restore_state found no saved state but the local tier holds steps:
    each of them was read and skipped as unusable (`SnapshotSource.unusable_local_steps`)."""
    if snapshots is not None and (steps := snapshots.unusable_local_steps()):
        raise LocalStepsAllUnusable(
            f"every local checkpoint step ({', '.join(map(str, steps))}, in local_checkpoint_directory) is "
            "unusable (the local_checkpoint_skipped events say why) and the run has no other saved state: it "
            "is not restarted from scratch. Inspect them (and delete them to start over), or start a new "
            "run: another run_name=..."
        )


class SnapshotSource(Protocol):
    """Host snapshots (in RAM, or read back from the local tier) as a restore source (every process
    of the attempt calls both, in order)."""

    def newest_step(self, abstract_state, checkpoint_step: int | None, not_after: int | None = None) -> int | None:
        """The step of the newest snapshot the attempt can restore (the same on every process); the
        abstract state names the attempt's mesh. With `not_after`, snapshots of later steps are dropped
        (a rollback to a verified state) and the newest of at most that step is the one."""

    def origin(self) -> str:
        """Where that snapshot was: SNAPSHOT (host RAM) or LOCAL (the local checkpoint tier)."""

    def unusable_local_steps(self) -> list[int]:
        """After `newest_step` found no snapshot: the local steps it read and skipped as unusable (none
        when it holds a snapshot or keeps no local tier)."""

    def load(self, abstract_state) -> tuple[Any, dict]:
        """(state on the shardings of `abstract_state`, data-iterator state) of that snapshot."""


class SavedState(Protocol):
    """What restore needs of the run's checkpoints (`trainer.checkpoint.open_checkpointer`)."""

    def cleanup_partial(self) -> list[str]: ...

    def committed_steps(self) -> list[int]: ...

    def set_aside_after(self, step: int, why: str) -> list[int]: ...

    def restore(self, abstract_state, step: int | None = None): ...


@dataclasses.dataclass(frozen=True)
class Restored:
    state: Any
    data_state: dict | None  # None: the data iterator starts from the beginning
    label: str  # "snapshot:120", "checkpoint:100", "load_parameters_path", "init", ...


def restore_state(
    abstract_state,
    *,
    checkpoints: SavedState,
    snapshots: SnapshotSource | None,
    load_full_state_path: str,
    load_parameters_path: str,
    fresh_state: Callable[[Any], Any],
    not_after: int | None = None,
) -> Restored:
    """The attempt's starting state by `choose_source`. `fresh_state(params or None)`: a full train state
    around loaded params (new optimizer state, step 0), or wholly initialised when None.

    `not_after`: a rollback to the newest state verified clean (trainer.attempt.sdc): saved states of later
    steps are unverified, so they are set aside (checkpoints) or dropped (snapshots, local steps) before
    the order above picks among the rest."""
    checkpoints.cleanup_partial()
    if not_after is not None:
        checkpoints.set_aside_after(not_after, f"newer than step {not_after}, the newest state verified clean")
    checkpoint_step = checkpoints.latest_committed_step()
    bound = {} if not_after is None else {"not_after": not_after}
    snapshot_step = None if snapshots is None else snapshots.newest_step(abstract_state, checkpoint_step, **bound)
    local = snapshot_step is not None and snapshots.origin() == LOCAL
    source = choose_source(
        snapshot_step=None if local else snapshot_step,
        local_step=snapshot_step if local else None,
        checkpoint_step=checkpoint_step,
        load_full_state_path=load_full_state_path,
        load_parameters_path=load_parameters_path,
    )
    if source in (FULL_STATE, PARAMETERS, INIT):
        refuse_to_start_over(snapshots)  # a run whose saved steps are all unusable never silently starts over
    if source in (SNAPSHOT, LOCAL):
        state, data_state = snapshots.load(abstract_state)
        return Restored(state, data_state, f"{source}:{snapshot_step}")
    if source == CHECKPOINT:
        restored = checkpoints.restore(abstract_state)
        return Restored(restored.state, restored.data_state, f"checkpoint:{restored.step}")
    if source == FULL_STATE:
        from trainer.checkpoint import load_full_state

        return Restored(load_full_state(load_full_state_path, abstract_state), None, FULL_STATE)
    if source == PARAMETERS:
        from trainer.checkpoint import load_parameters

        params = load_parameters(load_parameters_path, abstract_state["params"])
        return Restored(fresh_state(params), None, PARAMETERS)
    return Restored(fresh_state(None), None, INIT)
