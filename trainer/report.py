"""CLI: `python -m trainer.report RUN_DIR [--output PATH] [--compare RUN_B]`.

Reads RUN_DIR/metrics.jsonl and RUN_DIR/events.jsonl (a finished run, or one still in progress: a
last line cut anywhere by a killed writer is skipped), prints a summary (steps, loss, step time,
tokens/s, failures, steps lost, downtime, goodput and badput by cause, each recovery timeline) and
writes the report figure (the panels are described in trainer.observe.plots). With --compare RUN_B
the two runs are overlaid, e.g. one with failures against one without.

Where the figure goes (the path written is printed, `report written to PATH`):
- no --output: RUN_DIR/report.png;
- --output naming a directory (one that exists, or a path ending in / or without a suffix, which is
  created): DIR/report.png;
- --output with an image suffix matplotlib writes (.png, .pdf, .svg, ...): that file, in that format;
  any other suffix is refused (rather than a second suffix silently appended to it).
An existing file is replaced (the report is meant to be regenerated), and only by a complete one.
Paths may be relative to the working directory, start with ~, or be gs:// URIs.

Exit codes: 0 report written; 2 (one line `python -m trainer.report: error: ...`) RUN_DIR or RUN_B
holds no metrics/events, or --output cannot be written.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import textwrap

from trainer.elastic.periods import KEYS
from trainer.errors import EXIT_OK, UserInputError, tool_main
from trainer.io.paths import is_remote, resolve
from trainer.io.staging import check_writable, staged_file
from trainer.observe import catalogue

PROG = "python -m trainer.report"
DEFAULT_NAME = "report.png"


def _parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="<base_output_directory>/<run_name> of the run to report")
    p.add_argument(
        "--output",
        "-o",
        default=None,
        help="image file (.png, .pdf, .svg, ...) or directory to write report.png into "
        "(default RUN_DIR/report.png)",
    )
    p.add_argument("--compare", default=None, metavar="RUN_B", help="a second run to overlay")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    return tool_main(PROG, lambda: report(args.run_dir, args.output, args.compare))


def report(run_dir: str, output: str | None = None, compare: str | None = None) -> int:
    """Print the summaries and write the figure; every input is checked before anything is rendered."""
    from trainer.observe.plots import render_report
    from trainer.observe.runlog import load_run, summarize

    runs = [load_run(d) for d in (run_dir, compare) if d is not None]
    path, fmt = output_path(output, runs[0].path)
    summaries = [summarize(r) for r in runs]
    for run, s in zip(runs, summaries):
        print(format_summary(s, run.events))
    fig = render_report(runs, summaries)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=100)
    _write(path, buffer.getvalue())
    print(f"report written to {path}")
    return EXIT_OK


def output_path(output: str | None, run_dir) -> tuple:
    """(path, format) the figure is written to, by the rules in the module docstring."""
    from matplotlib.backend_bases import FigureCanvasBase

    if output is None:
        return resolve(run_dir) / DEFAULT_NAME, "png"
    text = os.fspath(output)
    path = resolve(text)
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix.lower().lstrip(".")
    if text.endswith(("/", os.sep)) or path.is_dir() or not suffix:
        path, suffix = path / DEFAULT_NAME, "png"
    elif suffix not in formats:
        raise UserInputError(
            f"--output {path}: .{suffix} is not an image format matplotlib writes; name a "
            f".png file (or one of {', '.join('.' + f for f in sorted(formats))}) or a "
            f"directory to write {DEFAULT_NAME} into"
        )
    if not is_remote(path):
        check_writable(os.fspath(path), overwrite=True, name="--output")
    return path, suffix


def _write(path, data: bytes) -> None:
    """Local: written aside and renamed (a killed report never leaves half an image). Remote: one write."""
    if is_remote(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return
    with staged_file(os.fspath(path), overwrite=True) as tmp:
        tmp.write_bytes(data)


def format_summary(s, events: list[dict] = ()) -> str:
    """The printed summary of one run (a trainer.observe.runlog.RunSummary; `events`, the run's own, add
    the silent-data-corruption detections and loss-spike rollbacks)."""
    from trainer.observe.goodput import CAUSES
    from trainer.observe.timeline import format_timeline

    g = s.goodput
    planned = f" of {s.steps_planned}" if s.steps_planned else ""
    lines = [
        f"run {s.name}: {s.status}",
        f"  steps done        {s.steps_done}{planned}",
        f"  final loss        {_num(s.final_loss, '.4f')}",
    ]
    if s.final_eval_step is not None:
        lines.append(f"  final eval loss   {_num(s.final_eval_loss, '.4f')} (step {s.final_eval_step})")
    lines += [
        f"  median step time  {_num(s.median_step_time_s, '.3f')} s",
        f"  median tokens/s   {_num(s.median_tokens_per_s, ',.1f')}",
        f"  failures          {s.failures}",
        f"  steps lost        {s.steps_lost}",
        f"  downtime          {s.downtime_s:.3f} s (failure detected -> first step, summed)",
        f"  goodput           {_pct(g['goodput'])} of {g['wall_s']:.1f} s wall "
        f"({g['productive_s']:.1f} s productive)",
        "  badput by cause",
    ]
    wall = g["wall_s"] or 1e-9
    lines += [f"    {c:<20}{g['badput_s'][c]:9.3f} s  {g['badput_s'][c] / wall:6.1%}" for c in CAUSES]
    counted = g["productive_s"] + sum(g["badput_s"].values())
    if counted > 1.005 * wall:
        lines.append(
            f"  note: productive + badput = {counted / wall:.1%} of wall time; some seconds are counted "
            f"under two headings (see trainer.observe.goodput)"
        )
    lines += _restores(s.restores)
    lines += _slow_steps(s.slow_steps)
    lines += _hangs(s.hangs)
    lines += _corruptions([e for e in events if e["event"] == catalogue.SDC_DETECTED])
    lines += _spikes([e for e in events if e["event"] == catalogue.LOSS_SPIKE_ROLLBACK])
    lines += _periods(s.periods)
    lines += _recorded_differences(s)
    for k, t in enumerate(s.timelines, 1):
        lines.append(f"  recovery {k} (attempt {t['attempt'] - 1} -> {t['attempt']}):")
        lines.append(textwrap.indent(format_timeline(t), "  "))
    return "\n".join(lines)


def _restores(restores: list[dict]) -> list[str]:
    """Where each recovery or restart resumed from (host RAM, local tier, persistent checkpoint)."""
    if not restores:
        return []
    tiers: dict[str, int] = {}
    for r in restores:
        tier = r["source"].split(":")[0]
        tiers[tier] = tiers.get(tier, 0) + 1
    restarts = sum(r["restart"] for r in restores)
    lines = [
        f"  restores          {len(restores)} ({', '.join(f'{n} from {t}' for t, n in sorted(tiers.items()))}; "
        f"{restarts} after a lost process)"
    ]
    for r in restores:
        why = "process restart" if r["restart"] else f"attempt {r['attempt']}"
        lines.append(f"    {why:<16} from {r['source']:<18} {r['steps_lost']} steps lost")
    return lines


def _slow_steps(events: list[dict], shown: int = 5) -> list[str]:
    """monitor_step_time_deviation's slow_step events: how many, and the slowest few with their process."""
    if not events:
        return []
    worst = sorted(events, key=lambda e: e["step_time_s"] / max(e["median_s"], 1e-9), reverse=True)[:shown]
    lines = [f"  slow steps        {len(events)} (step time > {events[0]['factor']:g}x the recent median)"]
    for e in sorted(worst, key=lambda e: e["step"]):
        process, ratio = e.get("slowest_process"), e["step_time_s"] / max(e["median_s"], 1e-9)
        lines.append(
            f"    step {e['step']:<8} {e['step_time_s']:.3f} s = {ratio:.1f}x median {e['median_s']:.3f} s, "
            f"slowest process {'n/a' if process is None else process}"
        )
    return lines


def _listed(events: list[dict], title: str, line) -> list[str]:
    """A count of `events` under `title`, then `line(event)` for each; nothing when there are none."""
    if not events:
        return []
    return [f"  {title:<17} {len(events)}", *(f"    {line(e)}" for e in events)]


def _hangs(events: list[dict]) -> list[str]:
    """The progress watchdog's hang_detected events: where each process stopped making progress."""
    return _listed(
        events,
        "hangs",
        lambda e: (
            f"after step {e['step']!s:<6} in {e['phase']:<16} {e['seconds']:.0f} s (bound "
            f"{e['timeout_s']:.0f} s, then exit 75); stacks: {e.get('stacks') or 'in the log'}"
        ),
    )


def _corruptions(events: list[dict]) -> list[str]:
    """sdc_detected: where the replay check found a slice computing wrong numbers (each rolled back)."""
    return _listed(
        events,
        "silent data corruption",
        lambda e: (
            f"step {e['step']:<8} suspect slice(s) {e['slices']}, rows of slices {e['mismatched']} "
            "differ: rolled back"
        ),
    )


def _spikes(events: list[dict]) -> list[str]:
    """loss_spike_rollback: each spike, where the run went back to, and how many batches it skipped."""
    return _listed(
        events,
        "loss spikes",
        lambda e: (
            f"step {e['step']:<8} loss {e['loss']:.4g} vs median {e['median']:.4g}: back to step "
            f"{e['restored_step']}, {len(e['fingerprints'])} batches never trained again"
        ),
    )


def _periods(events: list[dict]) -> list[str]:
    """The periods `auto` chose over the run (periods_planned events), with what each plan weighed."""
    if not events:
        return []
    lines = ["  auto periods (trainer.elastic.periods.AutoPeriods)"]
    for e in events:
        rate = f"MTBF/slice {e['mtbf_per_slice_s']:.3g} s ({e['rate']}, {e['failures']} failures)"
        model_s = "/".join(str(e["recommended"].get(k)) for k in KEYS.values())
        lines.append(
            f"    from step {e['step']:<8} snapshot_period={e['snapshot_period']} "
            f"local_checkpoint_period={e['local_checkpoint_period']} "
            f"checkpoint_period={e.get('checkpoint_period', '-')}  model's: {model_s}; "
            f"step {e['costs']['step_s']:.3f} s, snapshot {e['costs']['snapshot_save_s']:.3f} s, "
            f"checkpoint {e['costs'].get('checkpoint_save_s', 0.0):.3f} s; {rate}"
        )
    return lines


def _recorded_differences(s) -> list[str]:
    """The trainer logs its own elastic_summary and goodput at the finish, for its process only; say so
    when they differ from the numbers derived over the whole file (e.g. a resumed run)."""
    out = []
    summary = s.recorded.get(catalogue.ELASTIC_SUMMARY)
    if summary and (summary.get("failures"), summary.get("steps_lost")) != (s.failures, s.steps_lost):
        out.append(
            f"  note: the trainer's elastic_summary says failures={summary.get('failures')} "
            f"steps_lost={summary.get('steps_lost')} (its own process only)"
        )
    recorded = s.recorded.get(catalogue.GOODPUT)
    if (
        recorded
        and recorded.get("goodput") is not None
        and s.goodput["goodput"] is not None
        and abs(recorded["goodput"] - s.goodput["goodput"]) > 0.005
    ):
        out.append(f"  note: the trainer recorded goodput {_pct(recorded['goodput'])} at its finish")
    return out


def _num(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:.1%}"


if __name__ == "__main__":
    sys.exit(main())
