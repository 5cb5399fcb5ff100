"""Mutation check of the recovery-critical lines: each one, broken on purpose, must fail a named test.

    python scripts/mutation_check.py                 # every breakage, one at a time
    python scripts/mutation_check.py --list          # what each breakage breaks, and its tests
    python scripts/mutation_check.py --only NAME ... # a subset (repeatable); --jobs N runs N at once

For each breakage in `BREAKAGES` the script copies the repository's files (git's tracked and untracked,
not ignored, files; no .venv, no .git) into a temporary directory, replaces the breakage's `old` text
by its `new` text in that copy, and runs the breakage's tests there with this interpreter:
`python -m pytest -q -x -p no:cacheprovider -rfE <tests>`, cwd the copy and the copy first on
PYTHONPATH, so `import trainer` is the mutated copy and not the editable install of the checkout (a
probe plugin, `-p _mutation_check_probe`, records where every `trainer` module came from; one from
outside the copy is an error).
The checkout is copied once at the start (a consistent snapshot while others edit it) and is never
modified. One line per breakage, in declaration order:

    caught  NAME  (by FAILING NODE IDS)   the tests failed (pytest exit 1): the protection is tested
    missed  NAME                          the tests passed with the line broken: nothing guards it
    error   NAME  (WHY)                   the check could not decide: `old` is not in the file exactly
                                          once (a stale breakage), a test id is not found (exit 4), no
                                          test ran (5), collection failed, pytest was interrupted or
                                          failed internally (2, 3), the run passed `--timeout`, `trainer` came from
                                          outside the copy, or a catching test fails without the
                                          breakage too (the baseline run)

then a summary line. The exit status is 0 only when every selected breakage is caught. The failing ids
come from pytest's short summary (its FAILED and ERROR lines); since `-x` stops at the first failure,
that is usually one id. After the breakages, the ids that caught them run once more on an unmodified
copy (`--no-baseline` skips this): a test that fails there caught nothing, and its breakage is an error.
Per-breakage runtimes go to stderr (with `--show-output`, each run's pytest output too: check there that
a new breakage fails its test's assertion, not an unrelated crash).

Adding a breakage: append a `Breakage` to `BREAKAGES` with
- `name`: unique, kebab-case, says what is broken;
- `file`: the path from the repository root;
- `old`: text that occurs exactly once in that file (include enough of the line to make it unique);
  when the code changes so it no longer matches, the check reports `error`, never `missed`/`caught`;
- `new`: the replacement: one small change that genuinely disables the protection (a test that fails
  only because the code no longer imports or runs does not count: keep it valid Python);
- `tests`: the fewest, fastest pytest node ids that must catch it (unit tests over CLI runs; a
  function id runs all its parametrizations);
- `why`: one line, the protection this breaks.
Then run `python scripts/mutation_check.py --only NAME` and keep it only if it says `caught`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT_S = 300.0
PROBE_MODULE = "_mutation_check_probe"
PROBE_OUTPUT = ".mutation_check_probe.json"


@dataclasses.dataclass(frozen=True)
class Breakage:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str


_RESTORE = "tests/test_recovery_units.py::"
_CHECKPOINT = "tests/test_checkpoint.py::"

BREAKAGES: tuple[Breakage, ...] = (
    Breakage(
        name="commit-rule-ignores-marker",
        file="trainer/checkpoint/commit.py",
        old="return TMP_SUFFIX not in path.name and (path / COMMIT_MARKER).exists()",
        new="return TMP_SUFFIX not in path.name",
        tests=(
            _CHECKPOINT
            + "test_cleanup_removes_its_own_partial_steps_leaves_other_tools_steps_and_restore_reads_neither",
        ),
        why="a step directory without Orbax's commit marker (an unfinished save) counts as committed",
    ),
    Breakage(
        name="restore-prefers-older-source",
        file="trainer/attempt/restore.py",
        old="return max(saved, key=lambda s: (s[0], -s[1]))[2]",
        new="return min(saved, key=lambda s: (s[0], -s[1]))[2]",
        tests=(_RESTORE + "test_one_restore_order_for_every_source",),
        why="the restore order picks the oldest saved state instead of the newest",
    ),
    Breakage(
        name="restore-ignores-snapshot",
        file="trainer/attempt/restore.py",
        old="[(snapshot_step, SNAPSHOT), (local_step, LOCAL), (checkpoint_step, CHECKPOINT)]",
        new="[(local_step, LOCAL), (checkpoint_step, CHECKPOINT)]",
        tests=(_RESTORE + "test_one_restore_order_for_every_source",),
        why="a newer host snapshot is never restored: the attempt falls back to an older checkpoint",
    ),
    Breakage(
        name="restore-tie-goes-to-slower-read",
        file="trainer/attempt/restore.py",
        old="return max(saved, key=lambda s: (s[0], -s[1]))[2]",
        new="return max(saved, key=lambda s: (s[0], s[1]))[2]",
        tests=(_RESTORE + "test_one_restore_order_for_every_source",),
        why="at equal steps the checkpoint is read instead of the host snapshot or local tier",
    ),
    Breakage(
        name="fence-hook-never-checks",
        file="trainer/checkpoint/fence.py",
        old="                check(int(final.name))\n",
        new="                pass  # check(int(final.name))\n",
        tests=(_CHECKPOINT + "test_a_save_of_an_older_attempt_is_fenced_and_never_commits",),
        why="Orbax's commit of a step no longer asks the fence: a fenced save commits",
    ),
    Breakage(
        name="fence-ignores-newer-attempt",
        file="trainer/checkpoint/fence.py",
        old="if epoch != current:",
        new="if False:",
        tests=(_CHECKPOINT + "test_a_save_of_an_older_attempt_is_fenced_and_never_commits",),
        why="a save of an older attempt commits after a newer attempt has started",
    ),
    Breakage(
        name="fence-ignores-lost-lease",
        file="trainer/checkpoint/fence.py",
        old="if self.lease is not None and not self.lease.still_ours():",
        new="if False:",
        tests=("tests/test_lease.py::test_a_holder_taken_over_while_frozen_finds_out_and_its_saves_are_fenced",),
        why="a holder frozen past its lease, whose run was taken over, still commits saves",
    ),
    Breakage(
        name="local-tier-commit-not-a-rename",
        file="trainer/checkpoint/local_store.py",
        old="os.rename(partial, final)  # the commit",
        new="shutil.copytree(partial, final)  # the commit",
        tests=("tests/test_local_tier.py::test_a_partial_write_never_counts_and_is_removed",),
        why="a local step is committed by a non-atomic copy, not the atomic rename of its .partial directory",
    ),
    Breakage(
        name="lease-create-not-exclusive",
        file="trainer/checkpoint/lease.py",
        old="os.link(os.fspath(tmp), os.fspath(path))",
        new="os.replace(os.fspath(tmp), os.fspath(path))",
        tests=("tests/test_lease_race.py::test_of_jobs_racing_for_one_local_lease_exactly_one_wins",),
        why="taking the lease overwrites a generation another job just created: two jobs both win the race",
    ),
    Breakage(
        name="lease-create-overwrites-on-gcs",
        file="trainer/checkpoint/lease.py",
        old='fs.pipe_file(key, data, mode="create")',
        new="fs.pipe_file(key, data)",
        tests=("tests/test_lease_race.py::test_of_jobs_racing_for_one_gcs_lease_exactly_one_wins",),
        why="on Cloud Storage the lease's generation is written without its create precondition: two winners",
    ),
    Breakage(
        name="replica-digests-never-differ",
        file="trainer/attempt/sdc.py",
        old="    if len(counts) == 1:\n        return Verdict((), ())",
        new="    if len(counts) >= 1:\n        return Verdict((), ())",
        tests=(
            "tests/test_sdc.py::test_a_flipped_bit_in_one_slices_copy_of_the_params_is_found_and_names_that_slice",
        ),
        why="replicas whose copies of the parameters differ (a memory fault that landed) are never found",
    ),
    Breakage(
        name="sdc-rollback-to-newest-not-verified",
        file="trainer/attempt/loop.py",
        old="suspects=verdict.suspects, not_after=sdc.verified_step)",
        new="suspects=verdict.suspects, not_after=None)",
        tests=(
            "tests/test_sdc.py::test_a_flipped_replica_lands_is_named_rolled_back_to_a_verified_state_and_ends_bitwise_equal",
        ),
        why="a corruption rollback restores the newest saved state, which may hold the corruption",
    ),
    Breakage(
        name="sdc-rollbacks-unbounded",
        file="trainer/attempt/sdc.py",
        old="        if not persists(last, new):\n            return",
        new="        if not persists(last, new) or True:\n            return",
        tests=(
            "tests/test_sdc.py::test_the_guard_ends_the_run_with_exit_3_and_one_event_naming_the_devices_and_their_hosts",
        ),
        why="corruption that persists on the same devices rolls back forever instead of ending the run (exit 3)",
    ),
    Breakage(
        name="context-attention-gathers-every-row",
        file="trainer/model/context_attention.py",
        old="    rows = batch_axes(shard, q.shape[0])",
        new="    rows = None",
        tests=(
            "tests/test_context_parallel.py::test_each_device_moves_the_keys_and_values_of_its_own_batch_rows_only",
        ),
        why="context parallelism gathers every row of the global batch's keys and values, not the device's own",
    ),
    Breakage(
        name="replay-checksums-all-zero",
        file="trainer/program/step.py",
        old='row = jnp.stack([parts["ce_sum"], parts["z_sum"], parts["tokens"], *sums])',
        new='row = 0.0 * jnp.stack([parts["ce_sum"], parts["z_sum"], parts["tokens"], *sums])',
        tests=("tests/test_sdc.py::test_replay_checksums_differ_per_replica_and_change_with_one_devices_numbers",),
        why="the silent-data-corruption replay compares constants: a corrupted replica always matches",
    ),
    Breakage(
        name="nonfinite-update-applied",
        file="trainer/program/step.py",
        old="return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)",
        new="return new",
        tests=("tests/test_nonfinite.py::test_a_non_finite_update_is_never_applied",),
        why="a step with a non-finite loss or gradient writes its update into params and optimizer state",
    ),
    Breakage(
        name="nonfinite-never-detected",
        file="trainer/program/step.py",
        old="finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)",
        new="finite = jnp.isfinite(jnp.zeros(()))",
        tests=("tests/test_nonfinite.py::test_a_non_finite_update_is_never_applied",),
        why="a non-finite step is reported finite: it is applied and nan_policy never acts",
    ),
    Breakage(
        name="loss-spike-reference-is-max",
        file="trainer/attempt/loss_spikes.py",
        old="median = statistics.median(self._losses)",
        new="median = max(self._losses)",
        tests=("tests/test_loss_spikes.py::test_a_loss_over_threshold_times_the_running_median_is_a_spike",),
        why="a spike is measured against the window's largest loss, so one earlier outlier hides every spike",
    ),
    Breakage(
        name="loss-spike-threshold-inclusive",
        file="trainer/attempt/loss_spikes.py",
        old="if loss <= self.threshold * median:",
        new="if loss < self.threshold * median:",
        tests=("tests/test_loss_spikes.py::test_a_loss_over_threshold_times_the_running_median_is_a_spike",),
        why="a loss exactly at threshold x median (not over it) triggers a rollback",
    ),
    Breakage(
        name="local-tier-counts-partial-with-manifest",
        file="trainer/checkpoint/local_store.py",
        old="return sorted(int(n) for n in names if n.isdigit() and (Path(root) / n / MANIFEST).is_file())",
        new='return sorted(int(n.split(".")[0]) for n in names if n.split(".")[0].isdigit() '
        "and (Path(root) / n / MANIFEST).is_file())",
        tests=(
            "tests/test_local_tier.py::test_a_write_killed_just_before_its_commit_rename_never_counts_and_is_removed",
        ),
        why="a local write killed after its manifest but before its commit rename counts as a committed step",
    ),
    Breakage(
        name="nonfinite-ignores-gradients",
        file="trainer/program/step.py",
        old="finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)",
        new="finite = jnp.isfinite(loss)",
        tests=("tests/test_nonfinite.py::test_a_finite_loss_with_non_finite_gradients_is_never_applied",),
        why="a step whose loss is finite but whose gradients are not is applied: the params turn nan",
    ),
    Breakage(
        name="commit-rule-accepts-orbax-tmp-dir",
        file="trainer/checkpoint/commit.py",
        old="return TMP_SUFFIX not in path.name and (path / COMMIT_MARKER).exists()",
        new="return (path / COMMIT_MARKER).exists()",
        tests=(
            _CHECKPOINT + "test_an_orbax_tmp_directory_is_never_committed_even_with_every_file_and_the_marker",
        ),
        why="an Orbax tmp directory holding the marker (a save killed before its rename) counts as committed",
    ),
    Breakage(
        name="restore-starts-over-when-local-steps-unusable",
        file="trainer/attempt/restore.py",
        old="        refuse_to_start_over(snapshots)  # a run whose saved steps are all unusable",
        new="        pass  # a run whose saved steps are all unusable",
        tests=(
            "tests/test_local_tier.py::test_a_run_whose_local_steps_are_all_unusable_is_not_restarted_from_scratch",
        ),
        why="a run whose only saved steps are unusable local ones silently starts over from init",
    ),
    Breakage(
        name="emergency-write-waits-for-a-missing-row",
        file="trainer/elastic/snapshot.py",
        old="if why is None and not self.store.has_row(snap.step):",
        new="if why is None and False:",
        tests=(
            "tests/test_local_tier.py::"
            "test_the_emergency_write_of_a_snapshot_without_its_metrics_row_writes_nothing_and_says_why_at_once",
        ),
        why="a hang's emergency write of a snapshot whose metrics row never comes waits until the stop bound",
    ),
    Breakage(
        name="spike-hook-before-lost-slice",
        file="trainer/failures/registry.py",
        old="    slice_loss.KIND,\n    spike.KIND,\n",
        new="    spike.KIND,\n    slice_loss.KIND,\n",
        tests=(
            "tests/test_failure_kinds.py::test_a_fault_due_at_a_step_that_fails_on_a_lost_slice_fires_at_the_step_that_runs",
        ),
        why="a fault due at a step that fails on a lost slice is spent on that step, which never ran",
    ),
    Breakage(
        name="process-schedule-fits-any-job",
        file="trainer/failures/plan.py",
        old="        for fault, entry in zip(self.faults, self.entries, strict=True):",
        new="        for fault, entry in zip((), (), strict=True):",
        tests=(
            "tests/test_membership.py::test_a_process_error_schedule_is_checked_before_any_compute_and_only_runs_with_several_processes",
        ),
        why="a process's error scheduled for a process the job does not have (or a one-process run) never fires",
    ),
    Breakage(
        name="validation-skips-fault-schedule",
        file="trainer/config/validate.py",
        old="        _ = cfg.faults  # fault_schedule parsed",
        new="        _ = None  # fault_schedule parsed",
        tests=(
            "tests/test_failure_kinds.py::test_the_schedule_is_parsed_once_at_validation_and_the_config_carries_the_plan",
        ),
        why="a bad fault_schedule entry passes validation and stops the run only after start-up work",
    ),
    Breakage(
        name="start-up-version-check-skipped",
        file="trainer/train.py",
        old="        check_versions()  # a JAX or Orbax outside",
        new="        pass  # a JAX or Orbax outside",
        tests=("tests/test_versions.py::test_the_cli_refuses_a_jax_outside_the_window_with_exit_2",),
        why="a JAX outside the versions the patched internals were checked against runs, and may break recovery",
    ),
    Breakage(
        name="preemption-budget-rule-dropped",
        file="scripts/deploy/failure_policy.py",
        old="            *preemption_budget_rule(p, trainer_job),\n",
        new="",
        tests=(
            "tests/test_manifest_semantics.py::test_the_preemption_budget_is_enforced_the_n_plus_1th_preemption_fails_the_jobset",
        ),
        why="a trainer Job past its --max-preemptions budget restarts the JobSet (fresh budget), no failure",
    ),
    Breakage(
        name="preemption-budget-not-counted",
        file="scripts/deploy/failure_policy.py",
        old='    preempted = "Count" if budget else "Ignore"',
        new='    preempted = "Ignore"',
        tests=(
            "tests/test_manifest_semantics.py::test_the_preemption_budget_is_enforced_the_n_plus_1th_preemption_fails_the_jobset",
        ),
        why="with --max-preemptions the preemptions and evictions are still ignored: the budget bounds nothing",
    ),
    Breakage(
        name="spot-stop-fit-never-checked",
        file="scripts/deploy/graceful_stop.py",
        old="    if p.spot and pod_grace(p, stop_timeout_seconds) > p.spot_grace_seconds:",
        new="    if False:",
        tests=("tests/test_manifest_semantics.py::test_under_spot_the_trainers_stop_fits_the_notice",),
        why="under --capacity spot a stop whose grace exceeds Spot's notice renders: SIGKILL before exit 42",
    ),
    Breakage(
        name="lease-never-waits-for-a-silent-holder",
        file="trainer/checkpoint/lease.py",
        old="        if beat_again or age <= SILENT_BEATS * interval:\n",
        new="        if True:\n",
        tests=(
            "tests/test_lease.py::test_a_holder_on_another_host_that_stopped_beating_is_waited_out_then_taken_over",
        ),
        why="a job started after its holder was killed on another host exits 2 instead of waiting it out",
    ),
    Breakage(
        name="lease-wait-misses-a-live-beat",
        file="trainer/checkpoint/lease.py",
        old="        beat_again = waited_on is not None and waited_on != (generation, heartbeat)\n",
        new="        beat_again = False\n",
        tests=(
            "tests/test_lease.py::test_a_holder_that_beats_again_while_waited_on_is_live_and_the_start_is_refused",
        ),
        why="a holder that renews (its clock behind ours) is waited on as if silent: two jobs on one run",
    ),
    Breakage(
        name="watchdog-exit-keeps-the-lease",
        file="trainer/process_root.py",
        old="        if self.lease is not None:\n            releasing",
        new="        if False:\n            releasing",
        tests=(
            "tests/test_watchdog.py::test_a_watchdog_exit_releases_the_lease_first_and_a_hung_store_does_not_hold_the_exit",
            "tests/test_watchdog.py::test_a_hung_step_exits_75_within_the_bound_and_the_same_command_resumes_bitwise",
        ),
        why="a hang (or the stop deadline) exits with the run's lease held: another job waits out the bound",
    ),
    Breakage(
        name="storage-failure-exits-2",
        file="trainer/errors.py",
        old="    if transient_cause(error) is not None:\n        return EXIT_TRANSIENT\n",
        new="",
        tests=("tests/test_transient_errors.py",),
        why="a data shard or run directory the store could not serve ends the run as bad input: never retried",
    ),
    Breakage(
        name="run-files-not-live-on-the-bucket",
        file="trainer/process_root.py",
        old="        self.upload = _live_upload(paths, events)\n",
        new="        self.upload = None\n",
        tests=(
            "tests/test_live_run_files.py::test_a_gs_run_killed_9_after_a_committed_checkpoint_has_its_logs_in_the_bucket_through_it",
        ),
        why="a gs:// run killed -9 has none of its logs since the last attempt's end in the bucket",
    ),
    Breakage(
        name="run-files-sync-sends-torn-lines",
        file="trainer/observe/rundir.py",
        old='            new = new[: new.rfind(b"\\n") + 1]',
        new="            pass",
        tests=("tests/test_live_run_files.py::test_new_log_lines_are_appended_by_composition_whole_lines_only",),
        why="a log line still being written goes to the bucket torn, and its rest is appended after it",
    ),
    Breakage(
        name="wandb-away-ends-the-run",
        file="trainer/observe/wandb_sink.py",
        old='            self._unavailable("start", e, project=project)\n            return\n',
        new="            raise\n",
        tests=(
            "tests/test_live_metrics.py::test_a_wandb_service_that_cannot_be_reached_is_a_warning_and_the_sink_logs_nothing",
        ),
        why="an unreachable W&B (a network blip) stops the run instead of a warning",
    ),
    Breakage(
        name="data-restore-skips-a-document",
        file="trainer/data/grain_pipeline.py",
        old='            self.base, self.cursors = int(state["base"]), cursors\n',
        new='            self.base, self.cursors = int(state["base"]), cursors + 1\n',
        tests=(
            "tests/test_curves_through_failures.py::"
            "test_a_slice_lost_and_back_pauses_resumes_and_keeps_every_loss_bit_for_bit",
        ),
        why="a restored real-text iterator skips one document per row: the resumed run trains other tokens",
    ),
    Breakage(
        name="data-workers-outlive-a-killed-trainer",
        file="trainer/data/grain_pipeline.py",
        old="worker_init_fn=exit_with_parent,",
        new="worker_init_fn=None,",
        tests=("tests/test_data_pipeline.py::test_a_killed_trainer_leaves_no_data_worker_behind",),
        why="a trainer killed by SIGKILL or the OOM killer leaves its Grain workers running, holding memory",
    ),
    Breakage(
        name="control-accepts-a-wrong-token",
        file="trainer/observe/control.py",
        old="if not hmac.compare_digest(given.strip().encode(), self.token.encode()):",
        new="if False:",
        tests=(
            "tests/test_control_endpoint.py::test_a_missing_or_wrong_token_is_refused_queues_nothing_and_is_an_event",
        ),
        why="anyone who reaches the metrics port can checkpoint, drain or re-plan a run without its token",
    ),
    Breakage(
        name="control-drain-never-stops-the-run",
        file="trainer/elastic/control.py",
        old='self.stop.request("drain (control endpoint)")',
        new="pass",
        tests=(
            "tests/test_control_endpoint.py::test_checkpoint_now_commits_drain_exits_42_saved_and_a_bad_token_changes_nothing",
        ),
        why="an operator's drain is accepted but the run trains on: no save, no exit 42 before the node goes",
    ),
    Breakage(
        name="lora-resumes-over-another-base",
        file="trainer/checkpoint/base_identity.py",
        old="    if saved is None or saved == now:\n",
        new="    if True:\n",
        tests=(
            "tests/test_lora.py::test_the_base_is_named_by_its_content_and_another_content_is_refused",
            "tests/test_lora.py::test_a_local_tier_step_records_its_base_and_a_resume_over_another_is_refused",
        ),
        why="adapters trained over one base resume over another: the run trains on, its adapters meaningless",
    ),
    Breakage(
        name="eval-scores-drop-the-last-continuation-token",
        file="trainer/evaluate/batching.py",
        old="        scored[r, n - n_scored : n] = True\n",
        new="        scored[r, n - n_scored : n - 1] = True\n",
        tests=("tests/test_evaluate.py::test_scores_equal_one_unpadded_forward_per_request_on_a_two_device_mesh",),
        why="lm-eval log-likelihoods leave out an answer's last token: accuracies no longer match the HF backend",
    ),
    Breakage(
        name="prepare-passes-a-bad-preference-pair",
        file="trainer/data/readers.py",
        old="        return check_preference(obj)\n",
        new="        return obj\n",
        tests=(
            "tests/test_preference_data.py::test_preparation_writes_pairs_through_and_refuses_a_bad_one_at_its_line",
        ),
        why="a malformed preference pair reaches the shards, and a DPO run that reads them fails or trains on it",
    ),
    Breakage(
        name="dpo-reference-drifts-with-the-policy",
        file="trainer/program/step.py",
        old="    reference_logps, _ = row_logps(jax.lax.stop_gradient(reference), cfg, batch, shard=shard)\n",
        new="    reference_logps, _ = row_logps(policy, cfg, batch, shard=shard)\n",
        tests=("tests/test_dpo.py::test_the_steps_dpo_loss_and_gradient_equal_an_independent_autodiff",),
        why="the DPO reference moves with the policy: every log-ratio is 0, the loss log 2 and the gradient 0",
    ),
    Breakage(
        name="dpo-pair-split-across-micro-steps",
        file="trainer/program/layout.py",
        old="        if global_batch % micro == 0 and rows % (batch_shards * rows_per_example) == 0:\n",
        new="        if global_batch % micro == 0 and rows % batch_shards == 0:\n",
        tests=(
            "tests/test_dpo.py::test_no_layout_micro_step_or_survivor_mesh_splits_a_pair",
            "tests/test_dpo.py::test_a_batch_that_cannot_hold_whole_pairs_is_refused",
        ),
        why="a mesh whose shards cannot hold whole pairs is run anyway: chosen and rejected land on different "
        "devices and the loss pairs rows of different records",
    ),
    Breakage(
        name="dpo-pair-rows-not-adjacent",
        file="trainer/data/grain_pipeline.py",
        old='            local = ((e["own"] - self.own.start)[:, None] * per + np.arange(per)).reshape(-1)\n',
        new=(
            '            local = ((e["own"] - self.own.start)[:, None]'
            " + len(self.own) * np.arange(per)).reshape(-1)\n"
        ),
        tests=(
            "tests/test_dpo.py::test_a_pair_is_rows_2k_and_2k_plus_1_masked_on_its_replies_and_resumes_exactly",
        ),
        why="a pair's two rows are not rows 2k and 2k + 1: the loss pairs a chosen reply with another prompt's",
    ),
    Breakage(
        name="dpo-counts-pairs-without-replies",
        file="trainer/program/preference.py",
        old="    counted = ((tc > 0) & (tr > 0)).astype(jnp.float32)  # both replies present (module doc)\n",
        new="    counted = jnp.ones_like(tc)\n",
        tests=(
            "tests/test_dpo.py::test_a_pair_without_both_replies_adds_nothing_to_the_loss_its_gradient_or_the_metrics",
        ),
        why="padding pairs and pairs whose reply was cut count: held-out accuracy and loss are diluted by "
        "pairs that compare nothing, and a half-cut pair trains its one reply alone",
    ),
    Breakage(
        name="fractional-batch-rounds-to-whole-sequences",
        file="trainer/program/batch_rows.py",
        old="    if abs(exact - rows) > _TOLERANCE * max(1.0, abs(exact)):\n",
        new="    if False:\n",
        tests=(
            "tests/test_batch_rows.py::"
            "test_a_fraction_that_is_not_whole_sequences_names_the_key_the_devices_and_the_smallest_fraction",
        ),
        why="per_device_batch_size=0.3 on 8 devices trains 2 sequences a step instead of the 2.4 asked for, "
        "silently: the batch, the learning-rate math and the tokens per step are not what the config says",
    ),
    Breakage(
        name="fractional-batch-counts-every-slices-shards",
        file="trainer/program/layout.py",
        old="    return shards // slices if DATA_AXIS in axes and mesh.shape[DATA_AXIS] % slices == 0 "
        "else shards\n",
        new="    return shards\n",
        tests=("tests/test_batch_rows.py::test_on_two_slices_a_fraction_counts_the_batch_shards_of_one_slice",),
        why="a multi-slice run checks a slice's sequences against the batch shards of every slice: a valid "
        "fraction (one sequence per context group) is refused with exit 2",
    ),
    Breakage(
        name="bitwise-resize-adds-groups-in-replica-order",
        file="trainer/program/step.py",
        old="        return groups.swapaxes(0, 1).reshape(x.shape)\n",
        new="        return x\n",
        tests=("tests/test_bitwise_resize.py::test_the_step_has_the_same_bits_on_every_replica_count",),
        why="each replica runs its own contiguous rows, so the groups are added in an order that depends on "
        "the replica count: a replica-resize changes the update's bits under elastic_resize_bitwise",
    ),
    Breakage(
        name="bitwise-resize-accepts-scale",
        file="trainer/config/validate.py",
        old='    if e.elastic_resize_bitwise and e.elastic_resize_batch_policy != "keep_global":\n',
        new="    if False:\n",
        tests=("tests/test_bitwise_resize.py::test_the_key_needs_keep_global",),
        why="elastic_resize_bitwise=true with elastic_resize_batch_policy=scale starts: the survivors change the "
        "batch and the learning rate, so the promised bits cannot hold, and nothing says so",
    ),
    Breakage(
        name="bitwise-resize-fuses-across-groups",
        file="trainer/program/step.py",
        old="            out = jax.lax.optimization_barrier("
        "group_sums(params, jax.lax.optimization_barrier(group), inner))\n",
        new="            out = group_sums(params, group, inner)\n",
        tests=("tests/test_bitwise_resize.py::test_the_step_has_the_same_bits_on_every_replica_count[fsdp]",),
        why="the compiler fuses a group's gradient with the gathering around it, which differs with the "
        "replica count: the group's bits, and so the update's, change on a resize to one replica",
    ),
)


@dataclasses.dataclass(frozen=True)
class Result:
    status: str  # "caught", "missed" or "error"
    name: str
    detail: str = ""  # caught: the failing node ids; error: why
    failing: tuple[str, ...] = ()
    seconds: float = 0.0

    def line(self) -> str:
        if self.status == "caught":
            return f"caught  {self.name}  (by {self.detail})"
        if self.status == "error":
            return f"error  {self.name}  ({self.detail})"
        return f"missed  {self.name}"


class StaleBreakage(Exception):
    """The breakage's `old` text is not in its file exactly once (or the file is gone)."""


def apply_breakage(breakage: Breakage, root: Path) -> None:
    """Replace `old` by `new` in `root/file`; StaleBreakage unless `old` occurs there exactly once."""
    path = root / breakage.file
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise StaleBreakage(f"{breakage.file} does not exist") from None
    count = text.count(breakage.old)
    if count != 1:
        where = "not found" if count == 0 else f"found {count} times"
        raise StaleBreakage(f"old text {where} in {breakage.file}: the breakage is stale")
    path.write_text(text.replace(breakage.old, breakage.new))


_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S.*?)(?: - .*)?$")


def failing_ids(output: str) -> list[str]:
    """Node ids of pytest's short test summary (`-rfE`): its FAILED and ERROR lines, in order, unique."""
    ids: list[str] = []
    for line in output.splitlines():
        m = _SUMMARY.match(line.rstrip())
        if m and m.group(2) not in ids:
            ids.append(m.group(2))
    return ids


def _reason(output: str, fallback: str) -> str:
    """A one-line reason from pytest's output: its `ERROR:` usage lines, else the last line."""
    usage = [ln.strip() for ln in output.splitlines() if ln.startswith("ERROR: ")]
    if usage:
        return "; ".join(usage)
    errors = [ln.strip() for ln in output.splitlines() if _SUMMARY.match(ln.rstrip())]
    if errors:
        return f"{fallback}: " + "; ".join(errors)
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return f"{fallback}: {lines[-1]}" if lines else fallback


def verdict(name: str, returncode: int, output: str, seconds: float = 0.0) -> Result:
    """caught (exit 1), missed (exit 0) or error (any other exit) from one pytest run's exit and output."""
    if returncode == 0:
        return Result("missed", name, seconds=seconds)
    if returncode == 1:
        ids = failing_ids(output)
        if not ids:
            return Result("error", name, _reason(output, "pytest exited 1 without a FAILED line"), seconds=seconds)
        return Result("caught", name, ", ".join(ids), tuple(ids), seconds=seconds)
    reasons = {
        2: "pytest was interrupted (a collection error?)",
        3: "pytest internal error",
        4: "pytest usage error (a test id not found?)",
        5: "no tests collected (deselected by a marker?)",
    }
    why = reasons.get(returncode, f"pytest exited {returncode}")
    return Result("error", name, why if returncode == 5 else _reason(output, why), seconds=seconds)


def repository_files(repo: Path) -> list[str]:
    """Paths (relative to `repo`) of git's tracked and untracked-but-not-ignored files that exist; without
    git, every file outside .git, virtualenvs, caches and build outputs."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout.decode()
        names = sorted({n for n in out.split("\0") if n})
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", ".venv312", "build", "__pycache__", ".pytest_cache", ".ruff_cache"}
        names = []
        for dirpath, dirnames, filenames in os.walk(repo):
            dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
            names += [os.path.relpath(os.path.join(dirpath, f), repo) for f in filenames]
    return [n for n in names if os.path.lexists(repo / n) and not (repo / n).is_dir()]


_PROBE = f'''"""Written by scripts/mutation_check.py: records where the `trainer` modules of this run came from."""
import json, os, sys


def pytest_sessionfinish(session, exitstatus):
    root = os.path.dirname(os.path.realpath(__file__))
    mods = {{
        n: getattr(m, "__file__", None) or "" for n, m in list(sys.modules.items())
        if n == "trainer" or n.startswith("trainer.")
    }}
    with open(os.path.join(root, {PROBE_OUTPUT!r}), "w") as f:
        json.dump({{"root": root, "modules": mods}}, f)
'''


def snapshot_repository(repo: Path, files: Iterable[str], dest: Path) -> None:
    """Copy `files` of `repo` into `dest`: the one state of the checkout every run starts from (others may
    edit the checkout while the check runs)."""
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, target, follow_symlinks=False)


def make_copy(snapshot: Path, dest: Path) -> None:
    """A private copy of `snapshot` in `dest`, with the probe plugin beside its files."""
    shutil.copytree(snapshot, dest, symlinks=True)
    (dest / f"{PROBE_MODULE}.py").write_text(_PROBE)


def foreign_trainer_modules(copy: Path) -> list[str]:
    """`trainer` modules the run imported from outside `copy` (per the probe); ['<no probe output>'] when
    the probe did not write."""
    try:
        probe = json.loads((copy / PROBE_OUTPUT).read_text())
    except (OSError, ValueError):
        return ["<no probe output>"]
    root = os.path.realpath(copy) + os.sep
    return sorted(f for f in probe["modules"].values() if f and not os.path.realpath(f).startswith(root))


def pytest_command(tests: Sequence[str], *, stop_first: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", PROBE_MODULE, "-rfE"]
    return cmd + (["-x"] if stop_first else []) + list(tests)


_RUNNING: set[subprocess.Popen] = set()  # pytest runs in flight (their process groups end on Ctrl-C)


_STOPPING = threading.Event()  # set on Ctrl-C: no new run starts


def _end_running() -> None:
    _STOPPING.set()
    for proc in list(_RUNNING):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_pytest(
    copy: Path, tests: Sequence[str], timeout_s: float, *, stop_first: bool = True
) -> tuple[int | None, str]:
    """(exit status, stdout+stderr) of pytest on `tests` in `copy`; status None on timeout."""
    if _STOPPING.is_set():
        raise KeyboardInterrupt
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.Popen(
        pytest_command(tests, stop_first=stop_first),
        cwd=copy,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout ends the tests' subprocesses too
    )
    _RUNNING.add(proc)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out
    finally:
        _RUNNING.discard(proc)
    return proc.returncode, out


def check_breakage(breakage: Breakage, snapshot: Path, timeout_s: float, *, show_output: bool = False) -> Result:
    """Apply `breakage` in a fresh copy of `snapshot` and run its tests there (`show_output`: pytest's
    output to stderr)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutation-{breakage.name}-") as tmp:
        copy = Path(tmp) / "repo"
        make_copy(snapshot, copy)
        try:
            apply_breakage(breakage, copy)
        except StaleBreakage as e:
            return Result("error", breakage.name, str(e), seconds=time.perf_counter() - t0)
        rc, out = run_pytest(copy, breakage.tests, timeout_s)
        seconds = time.perf_counter() - t0
        if show_output:
            print(f"----- {breakage.name}: pytest output -----\n{out}", file=sys.stderr, flush=True)
        if rc is None:
            return Result("error", breakage.name, f"timed out after {timeout_s:g} s", seconds=seconds)
        result = verdict(breakage.name, rc, out, seconds)
        foreign = foreign_trainer_modules(copy)
        if result.status != "error" and foreign:
            return Result(
                "error", breakage.name, f"trainer imported from outside the copy: {foreign[0]}", seconds=seconds
            )
        return result


def baseline(results: list[Result], snapshot: Path, timeout_s: float) -> list[Result]:
    """Run the ids that caught breakages on an unmodified copy; a breakage whose catching test fails
    there too becomes an error."""
    ids = sorted({i for r in results if r.status == "caught" for i in r.failing})
    if not ids:
        return results
    with tempfile.TemporaryDirectory(prefix="mutation-baseline-") as tmp:
        copy = Path(tmp) / "repo"
        make_copy(snapshot, copy)
        rc, out = run_pytest(copy, ids, timeout_s * 2, stop_first=False)
    if rc == 0:
        return results
    if rc != 1:
        why = "timed out" if rc is None else _reason(out, f"exited {rc}")
        return [
            dataclasses.replace(r, status="error", detail=f"the baseline run of {r.detail} {why}", failing=())
            if r.status == "caught"
            else r
            for r in results
        ]
    broken = set(failing_ids(out))
    out_results = []
    for r in results:
        bad = [i for i in r.failing if i in broken]
        if r.status == "caught" and bad:
            r = dataclasses.replace(
                r, status="error", detail=f"{bad[0]} fails without the breakage too", failing=()
            )
        out_results.append(r)
    return out_results


def summary(results: Sequence[Result], seconds: float) -> str:
    counts = {s: sum(r.status == s for r in results) for s in ("caught", "missed", "error")}
    verdict_ = "OK" if counts["caught"] == len(results) else "FAIL"
    return (
        f"{verdict_}: {counts['caught']} caught, {counts['missed']} missed, {counts['error']} error "
        f"of {len(results)} breakages in {seconds:.0f} s"
    )


def main(argv: Sequence[str] | None = None, breakages: Sequence[Breakage] = BREAKAGES, repo: Path = REPO) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="run this breakage only (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the breakages and exit")
    parser.add_argument("--jobs", type=int, default=1, help="breakages checked at once (default 1)")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per breakage; past it: error"
    )
    parser.add_argument("--show-output", action="store_true", help="print each run's pytest output to stderr")
    parser.add_argument("--no-baseline", action="store_true", help="skip re-running the catching tests unmodified")
    args = parser.parse_args(argv)

    names = [b.name for b in breakages]
    if len(set(names)) != len(names):
        parser.error("breakage names are not unique")
    unknown = [n for n in args.only or [] if n not in names]
    if unknown:
        parser.error(f"unknown breakage {', '.join(unknown)} (--list names them)")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    selected = [b for b in breakages if not args.only or b.name in args.only]

    if args.list:
        for b in selected:
            print(f"{b.name}  {b.file}  {' '.join(b.tests)}\n    {b.why}")
        return 0

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as tmp:
        snapshot = Path(tmp) / "repo"
        snapshot_repository(repo, repository_files(repo), snapshot)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs)
        try:
            futures = {
                b.name: pool.submit(check_breakage, b, snapshot, args.timeout, show_output=args.show_output)
                for b in selected
            }
            for done, fut in enumerate(concurrent.futures.as_completed(futures.values()), 1):
                r = fut.result()
                progress = f"[{done}/{len(selected)}] {r.status} {r.name} in {r.seconds:.1f} s"
                print(progress, file=sys.stderr, flush=True)
            results = [futures[b.name].result() for b in selected]
            if not args.no_baseline:
                results = baseline(results, snapshot, args.timeout)
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            _end_running()  # the runs in flight end: no pytest outlives the check
            raise
        finally:
            pool.shutdown(wait=True)
    for r in results:
        print(r.line())
    print(summary(results, time.perf_counter() - t0))
    return 0 if all(r.status == "caught" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
