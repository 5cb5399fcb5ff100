"""Run a resolved config: runtime setup -> devices grouped into slices -> the supervisor runs the attempts.

The composition root: the only module below `trainer.train` that reads the whole RunConfig. It hands
each part its own section (attempts get a `TrainSpec`, the supervisor `ElasticConfig`, the profiler
`ObserveConfig`) and wires the parts together.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TextIO

import jax

from trainer.checkpoint.checkpointer import UNPLANNED_CHECKPOINT_PERIOD
from trainer.checkpoint.fence import SaveFence
from trainer.checkpoint.local_store import LocalStore
from trainer.config.errors import ConfigError
from trainer.config.loader import to_flat_dict
from trainer.config.schema import AUTO, ElasticConfig, RunConfig
from trainer.distributed import DistributedSettings, coordination_client, initialize, leave, resolve_settings
from trainer.distributed.communicators import (
    forget_rendezvous,
    fresh_cpu_client,
    mesh_cliques,
    needs_fresh_communicators,
)
from trainer.distributed.heartbeat import Heartbeat
from trainer.distributed.stop import CoordinatedStop
from trainer.elastic.cluster import Cluster, FixedCluster
from trainer.elastic.faults import FaultInjector
from trainer.elastic.local_cluster import LocalCluster
from trainer.elastic.membership import Membership
from trainer.elastic.pinned_snapshots import PinnedSnapshots
from trainer.elastic.process_cluster import ProcessCluster
from trainer.elastic.snapshot import HostSnapshots
from trainer.elastic.supervisor import Supervisor
from trainer.failures.process_death import ProcessFaultInjector, copy_delays
from trainer.failures.slice_loss import Outages
from trainer.failures.storage import StorageFaults
from trainer.io.jsonl import LineCounter, read_jsonl
from trainer.io.paths import resolve
from trainer.observe import catalogue
from trainer.observe.profiler import StepProfiler
from trainer.observe.rundir import RunPaths
from trainer.observe.sinks import JsonlSink, LogSink, ProgressSink, RecordedSteps, Sinks, TensorBoardSink
from trainer.observe.slowsteps import CoordinationHostTimes, HostTimes, SlowStepMonitor
from trainer.parallel.mesh import build_mesh, group_into_slices
from trainer.plan import model as plan_model
from trainer.plan.auto import AutoPeriods, FixedPeriods
from trainer.runtime import watchdog
from trainer.runtime.attempt import AttemptBuilder
from trainer.runtime.layout import train_spec
from trainer.runtime.loop import train_loop
from trainer.runtime.loss_spikes import LossSpikePolicy, skipped_fingerprints
from trainer.runtime.nonfinite import NonFinitePolicy
from trainer.runtime.outcome import Outcome
from trainer.runtime.preemption import StopSignal
from trainer.runtime.sdc import SdcCheck

log = logging.getLogger(__name__)

# The auto periods measure the run from the first and the last this many bytes of its logs.
MEASURE_WINDOW_BYTES = 1 << 18
LOG_SYNC_INTERVAL_S = 30.0  # a remote run's logs go up after an attempt at most this often (and at the end)


def make_sinks(
    cfg: RunConfig,
    run_dir: Path,
    *,
    stderr: TextIO | None = None,
    events=None,
    process_index: int = 0,
    host_times: HostTimes | None = None,
    recorded: RecordedSteps | None = None,
) -> Sinks:
    """metrics.jsonl always (then `recorded`, which tracks the rows written); a live progress line when
    stderr is a terminal, else a log line every log_period steps; TensorBoard when enabled. Given the
    run's event log: slow-step events (monitor_step_time_deviation) and, on process 0, Weights & Biases
    (enable_wandb)."""
    stderr = sys.stderr if stderr is None else stderr
    console = ProgressSink(cfg.train.steps, stream=stderr) if stderr.isatty() else LogSink(cfg.observe.log_period)
    sinks = [JsonlSink(run_dir / "metrics.jsonl"), *([recorded] if recorded is not None else []), console]
    if cfg.observe.enable_tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    o = cfg.observe
    if events is not None and o.monitor_step_time_deviation > 0:
        sinks.append(
            SlowStepMonitor(
                o.monitor_step_time_deviation, events, process_index=process_index, host_times=host_times
            )
        )
    if events is not None and o.enable_wandb and process_index == 0:
        from trainer.observe.wandb_sink import WandbSink

        name = o.wandb_run_name or cfg.train.run_name or run_dir.name
        sinks.append(WandbSink(run_dir, events, project=o.wandb_project, name=name, config=to_flat_dict(cfg)))
    return Sinks(sinks, writable=lambda: not watchdog.fenced())


def setup_runtime(cfg: RunConfig) -> DistributedSettings:
    """Process-wide JAX setup, once, before any device is touched (several processes: join the job first)."""
    settings = resolve_settings(cfg.distributed)
    if settings.multi_process:
        initialize(settings, fault_tolerant=cfg.elastic.elastic_enabled)
    if cfg.mesh.enable_single_controller:
        import pathwaysutils

        pathwaysutils.initialize()  # Pathways proxy backend: one controller sees every slice
    if cfg.train.jax_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(resolve(cfg.train.jax_cache_dir)))
        # Cache the train step, init and snapshot copies, not every small eager op.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    return settings


def build_supervisor(
    cfg: RunConfig,
    slices: list[list],
    *,
    paths: RunPaths,
    events,
    sinks: Sinks,
    stop_requested: Callable[[int], bool],
    membership=None,
    heartbeat_dead_after_s: float = 10.0,
    recorded: RecordedSteps | None = None,
    fence: SaveFence | None = None,
    interrupt_eval: Callable[[], bool] | None = None,
) -> Supervisor:
    """The supervisor with every part it drives, each built from its own section of the config.
    `recorded`: the rows metrics.jsonl holds (the local tier commits behind them); `fence`: the process's
    save fence (trainer.checkpoint.fence), holding the run's lease on process 0; `membership` and
    `heartbeat_dead_after_s`: see `build_cluster`."""
    cluster = build_cluster(
        cfg,
        slices,
        paths=paths,
        events=events,
        stop_requested=stop_requested,
        membership=membership,
        heartbeat_dead_after_s=heartbeat_dead_after_s,
    )
    periods = save_periods(cfg, slices, paths, events)
    run_loop = partial(
        train_loop,
        steps=cfg.train.steps,
        sinks=sinks,
        events=events,
        nonfinite=NonFinitePolicy(cfg.observe.nan_policy, events),
        peak_tflops_per_device=cfg.observe.peak_tflops_per_device,
        stop_requested=stop_requested,
        interrupt_eval=interrupt_eval or (lambda: False),
        spikes=loss_spikes(cfg, paths, events),
        sdc=sdc_check(cfg, cluster, events),
    )
    return Supervisor(
        cfg.elastic,
        cluster,
        attempts=AttemptBuilder(
            train_spec(cfg),
            checkpoint_dir=paths.checkpoints,
            events=events,
            fence=fence or SaveFence(),
            storage_faults=StorageFaults.of(cfg.faults.faults),
            checkpoint_due=periods.checkpoint_due,
        ),
        run_loop=run_loop,
        events=events,
        profiler=StepProfiler(cfg.observe, paths.local / "profile", events),
        snapshots=snapshot_store(cfg, paths, events, recorded),
        sync=partial(paths.sync, min_interval_s=LOG_SYNC_INTERVAL_S),
        periods=periods,
        wait_for_local_write=cfg.checkpoint.local_checkpoint_wait_for_write,
        previous_last_step=last_recorded_step(paths.local / "metrics.jsonl"),
    )


def loss_spikes(cfg: RunConfig, paths: RunPaths, events) -> LossSpikePolicy:
    """Loss-spike rollback (off at loss_spike_threshold=0), skipping the batches the run's earlier processes
    rolled back from (their loss_spike_rollback events)."""
    o = cfg.observe
    skipped = skipped_fingerprints(read_jsonl(paths.local / "events.jsonl")) if o.loss_spike_threshold else ()
    return LossSpikePolicy(
        o.loss_spike_threshold,
        o.loss_spike_window,
        o.loss_spike_max_rollbacks,
        o.loss_spike_rollback_window,
        events,
        skipped=skipped,
    )


def sdc_check(cfg: RunConfig, cluster: Cluster, events) -> SdcCheck | None:
    """The silent-data-corruption check (sdc_check_period, `auto` planned here); one controller only: the
    check moves each slice's rows to another slice, which several processes would have to exchange."""
    e = cfg.elastic
    single = jax.process_count() == 1
    if e.sdc_check_period == 0 or (e.sdc_check_period == AUTO and (cluster.num_slices < 2 or not single)):
        return None
    if not single:
        raise ConfigError(
            f"sdc_check_period={e.sdc_check_period} needs one controller (Pathways or one local "
            f"process); this job has {jax.process_count()} processes: set sdc_check_period=0"
        )
    return SdcCheck(e.sdc_check_period, events, plan=sdc_period_plan(e, chips=jax.device_count()))


def sdc_period_plan(e: ElasticConfig, *, chips: int):
    """`plan(step_s, check_s) -> period` of an auto sdc_check_period: the planner's best period for the
    expected rate of bad chips, but at least as often as the checks cost `auto_sdc_max_overhead`."""
    rate = chips / (e.expected_sdc_mtbf_per_chip_hours * 3600.0)

    def plan(step_s: float, check_s: float) -> int:
        best = plan_model.sdc_check_period(step_s, check_s, rate)
        if e.auto_sdc_max_overhead > 0:
            best = min(best, max(1, math.ceil(check_s / (e.auto_sdc_max_overhead * step_s))))
        return best

    return plan


def build_cluster(
    cfg: RunConfig,
    slices: list[list],
    *,
    paths: RunPaths,
    events,
    stop_requested: Callable[[int], bool],
    membership=None,
    heartbeat_dead_after_s: float = 10.0,
) -> Cluster:
    """The machines the supervisor retries on (trainer.elastic.cluster): several processes with a
    `membership` (elastic: `ProcessCluster`; a checkpoint barrier gives up on a peer whose heartbeat stopped
    `heartbeat_dead_after_s` ago), several without one (`FixedCluster`), else one controller
    (`LocalCluster`: Pathways, or local virtual slices with the fault injector)."""
    e = cfg.elastic
    stop = stop_requested if isinstance(stop_requested, CoordinatedStop) else None  # several processes
    if membership is not None:  # a process's own error is injected; lost processes are killed from outside
        faults = cfg.faults.check_processes(jax.process_count()).faults
        return ProcessCluster(
            membership,
            events=events,
            timeout_s=e.elastic_timeout_seconds,
            poll_s=e.elastic_poll_interval_seconds,
            dead_after_s=heartbeat_dead_after_s,
            process_faults=ProcessFaultInjector(faults, jax.process_index(), events),
            stop=stop,
        )
    if jax.process_count() > 1:
        return FixedCluster(slices, stop=stop)
    single_controller = cfg.mesh.enable_single_controller
    outages = injector = None
    if not single_controller:
        outages = Outages()  # local virtual slices: which are down
        injector = FaultInjector(cfg.faults.check_processes(1), outages, paths.local / "chaos", events)
    return LocalCluster(
        slices,
        timeout_s=e.elastic_timeout_seconds,
        poll_s=e.elastic_poll_interval_seconds,
        outages=outages,
        injector=injector,
        single_controller=single_controller,
    )


def save_periods(cfg: RunConfig, slices: list[list], paths: RunPaths, events) -> FixedPeriods | AutoPeriods:
    """The snapshot and local-tier periods: the numbers given, or planned from this run's own measured
    costs (`trainer.plan.auto`) where they are `auto`."""
    e, c = cfg.elastic, cfg.checkpoint
    local = c.local_checkpoint_period if paths.local_checkpoints else 0
    checkpoint = c.checkpoint_period
    if checkpoint == AUTO and not (e.elastic_enabled and c.enable_checkpointing and jax.process_count() == 1):
        # Not planned: the checkpointer's fixed default (several processes: they must save the same steps).
        checkpoint = UNPLANNED_CHECKPOINT_PERIOD
        if e.elastic_enabled and jax.process_count() > 1:
            log.info("checkpoint_period=auto with %d processes: every %d steps", jax.process_count(), checkpoint)
    if AUTO in (e.snapshot_period, local) and jax.process_count() > 1:
        # Each process would measure its own costs and could plan its own period, and the processes'
        # snapshots must be of the same steps: with several processes periods are numbers.
        if local == AUTO:
            raise ConfigError(
                "local_checkpoint_period=auto needs one controller; with several processes give a number "
                "(every process saves the same steps)"
            )
        log.info("snapshot_period=auto with %d processes: no snapshots (give a number)", jax.process_count())
        return FixedPeriods(0, local)
    if AUTO not in (e.snapshot_period, local, checkpoint):
        return FixedPeriods(e.snapshot_period, local)
    if not e.elastic_enabled:
        mode = "full_restart"
    elif e.elastic_min_slice_count in (-1, len(slices)):
        mode = "pause_resume"
    else:
        mode = "replica_resize"

    # Failures of the whole run (earlier processes' too), counted as events.jsonl grows; the costs come
    # from the run's start and its recent past only, so planning stays cheap after thousands of recoveries.
    failures = LineCounter(paths.local / "events.jsonl", lambda e: e.get("event") == catalogue.SLICE_DOWN_DETECTED)

    def measure():
        from trainer.observe.runlog import load_run
        from trainer.plan.costs import measure as measure_run

        costs, _ = measure_run(load_run(paths.local, window_bytes=MEASURE_WINDOW_BYTES))
        return costs, failures()

    return AutoPeriods(
        snapshot=e.snapshot_period,
        local=local,
        checkpoint=checkpoint,
        steps=cfg.train.steps,
        slices=len(slices),
        devices_per_slice=len(slices[0]),
        mode=mode,
        mtbf_per_chip_s=e.expected_mtbf_per_chip_hours * 3600.0,
        process_kill_share=e.expected_process_kill_share,
        max_overhead=e.auto_snapshot_max_overhead,
        events=events,
        measure=measure,
    )


def snapshot_store(cfg: RunConfig, paths: RunPaths, events, recorded: RecordedSteps | None = None):
    """One controller (Pathways, one local process): snapshots pinned on the devices' hosts, never
    through the controller. Several processes: each keeps its own devices' blocks in its own RAM (its
    JAX client, and so any device buffer, is rebuilt when the formation changes)."""
    store = local_store(cfg, paths, events, recorded)
    if jax.process_count() == 1:
        return PinnedSnapshots(events, store=store)
    return HostSnapshots(events, store=store, copy_delay=copy_delay(cfg))


def copy_delay(cfg: RunConfig):
    """This process's injected slow snapshot copies (fault_schedule step=N,process=P,slow_snapshot_s=S)."""
    if jax.process_count() == 1:
        return lambda step: 0.0
    return copy_delays(cfg.faults.check_processes(jax.process_count()).faults, jax.process_index())


def local_store(
    cfg: RunConfig, paths: RunPaths, events, recorded: RecordedSteps | None = None
) -> LocalStore | None:
    """This process's local checkpoint tier (None when off); a step commits once `recorded` has its row."""
    if paths.local_checkpoints is None:
        return None
    return LocalStore(
        paths.local_checkpoints,
        keep=cfg.checkpoint.max_num_local_checkpoints_to_keep,
        events=events,
        config=to_flat_dict(cfg),
        recorded=recorded,
    )


def last_recorded_step(metrics: Path) -> int | None:
    """The last step an earlier process of this run wrote to metrics.jsonl (None for a new run)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(tail):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by the seek or by a kill
        if isinstance(record, dict) and isinstance(record.get("step"), int) and "loss" in record:
            return record["step"]
    return None


def process_slices(cfg: RunConfig, settings: DistributedSettings, events):
    """Several processes: (devices of each slice, Membership or None). Slices are groups of
    processes_per_slice processes; the Membership (live processes, rounds, mesh orders) only when
    elastic_enabled."""
    client = coordination_client()
    fresh = needs_fresh_communicators() and cfg.elastic.elastic_enabled
    membership = Membership(
        jax.devices(),
        settings.processes_per_slice,
        process_index=jax.process_index(),
        client=client,
        events=events,
        fresh_devices=partial(fresh_cpu_client, client, process_index=jax.process_index()) if fresh else None,
        forget_rendezvous=partial(forget_rendezvous, client) if fresh else None,
        cliques_of=lambda slices: mesh_cliques(build_mesh(cfg.mesh, slices)),
    )
    if cfg.mesh.num_slices != membership.num_slices:
        raise ConfigError(
            f"num_slices={cfg.mesh.num_slices} but {settings.num_processes} processes with "
            f"processes_per_slice={settings.processes_per_slice} form {membership.num_slices} "
            f"slices; set num_slices={membership.num_slices}"
        )
    if cfg.checkpoint.local_checkpoint_directory and settings.processes_per_slice > 1:
        raise ConfigError(
            f"the local checkpoint tier needs every process to hold a whole replica of the train state "
            f"(processes_per_slice=1); with processes_per_slice={settings.processes_per_slice} leave "
            "local_checkpoint_directory unset"
        )
    cfg.faults.check_processes(settings.num_processes)  # a schedule for another kind of job stops here
    return membership.slice_devices(), (membership if cfg.elastic.elastic_enabled else None)


def run(
    cfg: RunConfig,
    *,
    paths: RunPaths,
    events,
    stop_requested: Callable[[int], bool] = lambda step: False,
    fence: SaveFence | None = None,
    stop: StopSignal | None = None,
) -> Outcome:
    """Train `cfg` to the end (or until stopped); returns how it ended. `fence`: the process's save fence
    (with the run's lease on process 0); `stop`: the process's SIGTERM handling (its emergency save is the
    supervisor's; one process also ends an evaluation early on it)."""
    settings = setup_runtime(cfg)
    membership = heartbeat = None
    try:
        if settings.multi_process:  # one slice per group of processes; membership agreed across them
            slices, membership = process_slices(cfg, settings, events)
            if membership is not None:  # checkpoint barriers watch it (trainer/distributed/heartbeat.py)
                heartbeat = Heartbeat(coordination_client(), jax.process_index())
            # A SIGTERM to any process stops all of them at one step (trainer/distributed/stop.py).
            stop_requested = CoordinatedStop(stop_requested, coordination_client(), events)
        else:
            slices = group_into_slices(jax.devices(), cfg.mesh.num_slices)
        host_times = (
            CoordinationHostTimes(coordination_client(), jax.process_index()) if settings.multi_process else None
        )
        recorded = RecordedSteps() if paths.local_checkpoints is not None else None
        sinks = make_sinks(
            cfg,
            paths.local,
            events=events,
            process_index=jax.process_index(),
            host_times=host_times,
            recorded=recorded,
        )
        with contextlib.closing(sinks):
            supervisor = build_supervisor(
                cfg,
                slices,
                paths=paths,
                events=events,
                sinks=sinks,
                stop_requested=stop_requested,
                membership=membership,
                heartbeat_dead_after_s=3.0 * settings.heartbeat_timeout_seconds + 5.0 if heartbeat else 10.0,
                recorded=recorded,
                fence=fence,
                interrupt_eval=None if stop is None or settings.multi_process else (lambda: stop.requested),
            )
            if stop is not None:
                stop.add_saver(supervisor.emergency_save)
            return supervisor.run()
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if settings.multi_process:
            leave(settings)  # process 0 last: its exit takes the coordination service down
