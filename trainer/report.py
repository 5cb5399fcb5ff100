"""CLI: `python -m trainer.report RUN_DIR [--output PNG] [--compare RUN_B]`.

Reads RUN_DIR/metrics.jsonl and RUN_DIR/events.jsonl (a finished run, or one still in progress),
prints a summary (steps, loss, step time, tokens/s, failures, steps lost, downtime, goodput and
badput by cause, each recovery timeline) and writes a PNG (default RUN_DIR/report.png; the panels
are described in trainer.observe.plots). With --compare RUN_B the two runs are overlaid, e.g. one
with failures against one without. Exit codes: 0 report written, 2 RUN_DIR (or RUN_B) holds no
metrics/events.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

EXIT_OK, EXIT_NO_RUN = 0, 2


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m trainer.report", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="<base_output_directory>/<run_name> of the run to report")
    p.add_argument("--output", "-o", type=Path, default=None, help="PNG to write (default RUN_DIR/report.png)")
    p.add_argument("--compare", type=Path, default=None, metavar="RUN_B", help="a second run to overlay")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    from trainer.observe.plots import render_report
    from trainer.observe.runlog import MissingRunFiles, load_run, summarize

    try:
        runs = [load_run(d) for d in (args.run_dir, args.compare) if d is not None]
    except MissingRunFiles as e:
        print(f"report: {e}", file=sys.stderr)
        return EXIT_NO_RUN
    summaries = [summarize(r) for r in runs]
    for s in summaries:
        print(format_summary(s))
    output = args.output or args.run_dir / "report.png"
    fig = render_report(runs, summaries)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    print(f"report written to {output}")
    return EXIT_OK


def format_summary(s) -> str:
    """The printed summary of one run (a trainer.observe.runlog.RunSummary)."""
    from trainer.observe.goodput import CAUSES
    from trainer.observe.timeline import format_timeline

    g = s.goodput
    planned = f" of {s.steps_planned}" if s.steps_planned else ""
    lines = [f"run {s.name}: {s.status}",
             f"  steps done        {s.steps_done}{planned}",
             f"  final loss        {_num(s.final_loss, '.4f')}",
             f"  median step time  {_num(s.median_step_time_s, '.3f')} s",
             f"  median tokens/s   {_num(s.median_tokens_per_s, ',.1f')}",
             f"  failures          {s.failures}",
             f"  steps lost        {s.steps_lost}",
             f"  downtime          {s.downtime_s:.3f} s (failure detected -> first step, summed)",
             f"  goodput           {_pct(g['goodput'])} of {g['wall_s']:.1f} s wall ({g['productive_s']:.1f} s productive)",
             "  badput by cause"]
    wall = g["wall_s"] or 1e-9
    lines += [f"    {c:<20}{g['badput_s'][c]:9.3f} s  {g['badput_s'][c] / wall:6.1%}" for c in CAUSES]
    counted = g["productive_s"] + sum(g["badput_s"].values())
    if counted > 1.005 * wall:
        lines.append(f"  note: productive + badput = {counted / wall:.1%} of wall time; some seconds are counted "
                     f"under two headings (see trainer.observe.goodput)")
    lines += _recorded_differences(s)
    for k, t in enumerate(s.timelines, 1):
        lines.append(f"  recovery {k} (attempt {t['attempt'] - 1} -> {t['attempt']}):")
        lines.append(textwrap.indent(format_timeline(t), "  "))
    return "\n".join(lines)


def _recorded_differences(s) -> list[str]:
    """The trainer logs its own elastic_summary and goodput at the finish, for its process only; say so
    when they differ from the numbers derived over the whole file (e.g. a resumed run)."""
    out = []
    summary = s.recorded.get("elastic_summary")
    if summary and (summary.get("failures"), summary.get("steps_lost")) != (s.failures, s.steps_lost):
        out.append(f"  note: the trainer's elastic_summary says failures={summary.get('failures')} "
                   f"steps_lost={summary.get('steps_lost')} (its own process only)")
    recorded = s.recorded.get("goodput")
    if recorded and recorded.get("goodput") is not None and s.goodput["goodput"] is not None \
            and abs(recorded["goodput"] - s.goodput["goodput"]) > 0.005:
        out.append(f"  note: the trainer recorded goodput {_pct(recorded['goodput'])} at its finish")
    return out


def _num(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:.1%}"


if __name__ == "__main__":
    sys.exit(main())
