"""Run a resolved config under its process root: the backend joins the job -> slices -> the supervisor
runs the attempts.

The composition root: the only module below `trainer.train` that reads the whole RunConfig. It hands
each part its own section (attempts get a `TrainSpec`, the supervisor `ElasticConfig`, the profiler
`ObserveConfig`, the backend a `BackendSpec`) and wires the parts together. Whatever depends on the
machines (the slices, the cluster, the snapshots, the periods the job may plan, the stop, the heartbeat,
the slow-step host times) is the backend's answer (`trainer.elastic.backends`), chosen once.
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
from typing import TYPE_CHECKING, TextIO

import jax

from trainer.attempt.builder import AttemptBuilder
from trainer.attempt.loop import train_loop
from trainer.attempt.loss_spikes import LossSpikePolicy, skipped_fingerprints
from trainer.attempt.nonfinite import NonFinitePolicy
from trainer.attempt.outcome import Outcome
from trainer.attempt.sdc import SdcCheck
from trainer.checkpoint.checkpointer import every
from trainer.checkpoint.local_store import LocalStore
from trainer.config.errors import ConfigError
from trainer.config.loader import to_flat_dict
from trainer.config.schema import AUTO, UNPLANNED_CHECKPOINT_PERIOD, ElasticConfig, RunConfig, TrainConfig
from trainer.distributed import resolve_settings
from trainer.elastic.backends import Backend, BackendSpec, open_backend
from trainer.elastic.cluster import Cluster
from trainer.elastic.control import ControlActions, refusals
from trainer.elastic.periods import AutoPeriods, FixedPeriods, PeriodKeys
from trainer.elastic.supervisor import Supervisor
from trainer.failures.storage import StorageFaults
from trainer.io.jsonl import LineCounter, read_jsonl
from trainer.io.paths import resolve
from trainer.observe import catalogue
from trainer.observe.control import ControlRequests, remove_access, write_access
from trainer.observe.metrics_server import Endpoint, LiveMetrics
from trainer.observe.profiler import StepProfiler
from trainer.observe.rundir import RunPaths
from trainer.observe.sinks import JsonlSink, LogSink, ProgressSink, RecordedSteps, Sinks, TensorBoardSink
from trainer.observe.slowsteps import HostTimes, SlowStepMonitor
from trainer.plan import model as plan_model
from trainer.plan.auto import plan as plan_periods
from trainer.program.layout import train_spec

if TYPE_CHECKING:
    from trainer.process_root import ProcessRoot

log = logging.getLogger(__name__)

# The auto periods measure the run from the first and the last this many bytes of its logs.
MEASURE_WINDOW_BYTES = 1 << 18
LOG_SYNC_INTERVAL_S = 30.0  # a remote run's logs go up after an attempt at most this often (and at the end)


def backend_for(cfg: RunConfig) -> Backend:
    """The job's backend from `cluster` (trainer.elastic.backends), chosen once, before JAX starts; a
    ConfigError (exit 2) when the job cannot be the one the config asks for."""
    spec = BackendSpec(
        cluster=cfg.distributed.cluster,
        settings=resolve_settings(cfg.distributed),
        mesh=cfg.mesh,
        elastic=cfg.elastic,
        checkpoint=cfg.checkpoint,
        faults=cfg.faults,
    )
    return open_backend(spec)


def make_sinks(
    cfg: RunConfig,
    run_dir: Path,
    *,
    stderr: TextIO | None = None,
    events=None,
    process_index: int = 0,
    host_times: HostTimes | None = None,
    recorded: RecordedSteps | None = None,
    writable: Callable[[], bool] = lambda: True,
    live: LiveMetrics | None = None,
) -> Sinks:
    """metrics.jsonl always (then `recorded`, which tracks the rows written); a live progress line when
    stderr is a terminal, else a log line every log_period steps; TensorBoard when enabled. Given the
    run's event log: slow-step events (monitor_step_time_deviation) and, on process 0, Weights & Biases
    (enable_wandb). `live`: the metrics endpoint's records (metrics_port). `writable()`: false once the
    process is fenced (it then writes nothing)."""
    stderr = sys.stderr if stderr is None else stderr
    period = cfg.observe.log_period
    if stderr.isatty():
        c = cfg.checkpoint  # auto (< 1): no countdown until the planner's periods_planned event
        saves = c.checkpoint_period if c.enable_checkpointing and not c.enable_continuous_checkpointing else None
        console = ProgressSink(cfg.train.steps, stream=stderr, period=period, save_period=saves)
        if events is not None:
            events.subscribe(console.on_event)
    else:
        console = LogSink(period)
    sinks = [JsonlSink(run_dir / "metrics.jsonl"), *([recorded] if recorded is not None else []), console]
    if cfg.observe.enable_tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if live is not None:
        sinks.append(live)
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
    return Sinks(sinks, writable=writable)


def serve_metrics(port: int, root: ProcessRoot, control: ControlRequests | None = None) -> LiveMetrics | None:
    """The live metrics endpoint (metrics_port, trainer.observe.metrics_server) on process 0 of the job,
    fed the run's records so far and every event from now on, served until the process root closes; None
    where it is off or on the other processes. A port that cannot be bound is a ConfigError (exit 2).
    `control`: the control endpoint's requests, served beside it (trainer.observe.control), with its token
    and port in the run directory while the endpoint lives."""
    if port == 0 or root.backend.process_id != 0:
        return None
    run_dir = root.paths.local
    live = LiveMetrics(events=read_jsonl(run_dir / "events.jsonl"), rows=read_jsonl(run_dir / "metrics.jsonl"))
    try:
        endpoint = Endpoint(live, port, control=None if control is None else control.app)
    except OSError as e:
        raise ConfigError(
            f"metrics_port={port}: cannot serve live metrics on 0.0.0.0:{port} ({e.strerror or e}): "
            "set metrics_port to a free port, or metrics_port=0 to turn the endpoint off"
        ) from None
    root.events.subscribe(live.on_event)
    root.hold(endpoint.close)
    if control is not None:
        write_access(run_dir, control.token, endpoint.port)
        root.hold(partial(remove_access, run_dir))
    return live


def use_compile_cache(train: TrainConfig) -> None:
    """The persistent compilation cache (jax_cache_dir), after the backend joined the job."""
    if train.jax_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(resolve(train.jax_cache_dir)))
        # Cache the train step, init and snapshot copies, not every small eager op.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def build_supervisor(
    cfg: RunConfig,
    slices: list[list],
    root: ProcessRoot,
    *,
    sinks: Sinks,
    stop_requested: Callable[[int], bool],
    recorded: RecordedSteps | None = None,
    control: ControlRequests | None = None,
) -> Supervisor:
    """The supervisor with every part it drives, each built from its own section of the config and the
    root's backend. `stop_requested`: the backend's stop over the root's signal; `recorded`: the rows
    metrics.jsonl holds (the local tier commits behind them); `control`: the control endpoint's requests
    (served: they are acted on from now on, at the step boundaries)."""
    backend, paths, events, phases = root.backend, root.paths, root.events, root.phases
    cluster = backend.cluster(slices, events=events, stop=stop_requested, chaos_dir=paths.local / "chaos")
    periods = save_periods(cfg, slices, paths, events, backend)
    checkpoint_due = periods.checkpoint_due
    if control is not None:
        actions = ControlActions(control, stop=root.stop, periods=periods, events=events)
        checkpoint_due = actions.checkpoint_due(checkpoint_due or every(cfg.checkpoint.checkpoint_period))
        root.stop.add_check(actions.at_boundary)
        control.offer(refusals(cfg.checkpoint, periods, backend.processes))
    run_loop = partial(
        train_loop,
        steps=cfg.train.steps,
        sinks=sinks,
        events=events,
        nonfinite=NonFinitePolicy(cfg.observe.nan_policy, events),
        peak_tflops_per_device=cfg.observe.peak_tflops_per_device,
        stop_requested=stop_requested,
        interrupt_eval=backend.interrupt_eval(root.stop),
        spikes=loss_spikes(cfg, paths, events),
        sdc=sdc_check(cfg, cluster, backend, events),
        phases=phases,
        beat=root.beat,
    )
    return Supervisor(
        cfg.elastic,
        cluster,
        attempts=AttemptBuilder(
            train_spec(cfg),
            checkpoint_dir=paths.checkpoints,
            events=events,
            fence=root.fence,
            storage_faults=StorageFaults.of(cfg.faults.faults),
            checkpoint_due=checkpoint_due,
            phases=phases,
        ),
        run_loop=run_loop,
        events=events,
        profiler=StepProfiler(cfg.observe, paths.local / "profile", events),
        snapshots=snapshot_store(cfg, paths, events, backend, recorded),
        sync=partial(paths.sync, min_interval_s=LOG_SYNC_INTERVAL_S),
        periods=periods,
        wait_for_local_write=cfg.checkpoint.local_checkpoint_wait_for_write,
        previous_last_step=last_recorded_step(paths.local / "metrics.jsonl"),
        phases=phases,
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


def sdc_check(cfg: RunConfig, cluster: Cluster, backend: Backend, events) -> SdcCheck | None:
    """The silent-data-corruption check (sdc_check_period, `auto` planned here), where the backend can run
    it (`Backend.sdc_unavailable`); `auto` is off on one slice or where it cannot."""
    e, unavailable = cfg.elastic, backend.sdc_unavailable
    if e.sdc_check_period == 0 or (e.sdc_check_period == AUTO and (cluster.num_slices < 2 or unavailable)):
        return None
    if unavailable:
        raise ConfigError(f"sdc_check_period={e.sdc_check_period} {unavailable}: set sdc_check_period=0")
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


def save_periods(
    cfg: RunConfig, slices: list[list], paths: RunPaths, events, backend: Backend
) -> FixedPeriods | AutoPeriods:
    """The snapshot and local-tier periods: the numbers given, or planned from this run's own measured
    costs (`trainer.elastic.periods`, with `trainer.plan.auto.plan`) where they are `auto` and the backend
    can plan them (`Backend.allowed_periods`)."""
    e, c = cfg.elastic, cfg.checkpoint
    checkpoint = c.checkpoint_period
    if checkpoint == AUTO and not (e.elastic_enabled and c.enable_checkpointing):
        checkpoint = UNPLANNED_CHECKPOINT_PERIOD  # not planned: the checkpointer's fixed default
    local = c.local_checkpoint_period if paths.local_checkpoints else 0
    given = PeriodKeys(snapshot=e.snapshot_period, local=local, checkpoint=checkpoint)
    keys = backend.allowed_periods(given, elastic_enabled=e.elastic_enabled)
    if AUTO not in (keys.snapshot, keys.local, keys.checkpoint):
        return FixedPeriods(snapshot=keys.snapshot, local=keys.local)
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
        snapshot=keys.snapshot,
        local=keys.local,
        checkpoint=keys.checkpoint,
        steps=cfg.train.steps,
        slices=len(slices),
        devices_per_slice=len(slices[0]),
        mode=mode,
        mtbf_per_chip_s=e.expected_mtbf_per_chip_hours * 3600.0,
        process_kill_share=e.expected_process_kill_share,
        max_overhead=e.auto_snapshot_max_overhead,
        events=events,
        measure=measure,
        planner=plan_periods,
    )


def snapshot_store(
    cfg: RunConfig, paths: RunPaths, events, backend: Backend, recorded: RecordedSteps | None = None
):
    """This process's host snapshots (the backend's kind), writing to the local tier when it is on."""
    return backend.snapshots(events, local_store(cfg, paths, events, recorded))


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
        lora_base=lora_base_record(cfg),
    )


def lora_base_record(cfg: RunConfig) -> dict | None:
    """A LoRA run's base identity, saved with each step (`trainer.checkpoint.base_identity`); None otherwise."""
    if not cfg.frozen_base:
        return None
    from trainer.checkpoint.base_identity import base_record

    return base_record(cfg.checkpoint.load_parameters_path, cfg.train.init_weights_seed)


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


def run(cfg: RunConfig, root: ProcessRoot) -> Outcome:
    """Train `cfg` to the end (or until stopped) under the process's root (its backend, paths, events,
    phases, stop signal and save fence); returns how it ended. The root's stop signal gets the
    supervisor's emergency save."""
    backend, events = root.backend, root.events
    control = ControlRequests(events) if cfg.observe.metrics_port else None
    live = serve_metrics(cfg.observe.metrics_port, root, control)  # before the backend joins: a bad port exits 2
    backend.join()
    try:
        use_compile_cache(cfg.train)
        slices = backend.slices(events)
        stop_requested = backend.stop(root.stop, events)
        recorded = RecordedSteps() if root.paths.local_checkpoints is not None else None
        sinks = make_sinks(
            cfg,
            root.paths.local,
            events=events,
            process_index=backend.process_index,
            host_times=backend.host_times(),
            recorded=recorded,
            writable=root.writable,
            live=live,
        )
        with contextlib.closing(sinks):
            supervisor = build_supervisor(
                cfg,
                slices,
                root,
                sinks=sinks,
                stop_requested=stop_requested,
                recorded=recorded,
                control=None if live is None else control,
            )
            root.stop.add_saver(supervisor.emergency_save)
            return supervisor.run()
    finally:
        backend.leave()
