"""The report figure of one run, or of two runs overlaid: five panels on one matplotlib Figure.

Top left, loss, held-out eval loss (circles, when the run evaluates) and learning rate vs step; top
right, step time and tokens/s vs step. Both use the step axis because that is how the loss curve is
read; steps that a rewind threw away and recomputed are shaded (with their count) and their
superseded losses drawn as crosses.

Middle, progress over wall clock: the step reached vs seconds since the run started, with the
elastic phases as shaded bands (startup, blocking checkpoint saves, evaluations, and per failure: down →
detected, waiting for slices, restoring, restored → first step). These bands use wall-clock time
because during them no step runs: on a step axis they would collapse to a single point, while here
their length is visible and a rewind shows as the step count falling back (annotated with the steps
lost). Bands shorter than 0.4 % of the axis are widened to that so they stay visible; the exact
seconds are in the recovery panel and the printed summary.

Bottom left, one bar per failure on its own clock (seconds since the slice was killed), the same
phases as the bands, so short recoveries in a long run are readable. Bottom right, goodput and
badput by cause as one stacked bar per run (percent of wall time).

With two runs (`--compare`), the loss, step-time and progress panels overlay both, the bands and
rewind marks are those of the first run, and the recovery and goodput panels show a row per run.
The Figure is built without pyplot (no global state, no display) and saved with the Agg renderer.
"""

from __future__ import annotations

from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter
from matplotlib.transforms import blended_transform_factory

from trainer.observe import catalogue
from trainer.observe.goodput import CAUSES
from trainer.observe.runlog import (
    DOWN,
    RESTORING,
    TO_FIRST_STEP,
    WAITING,
    RunLog,
    RunSummary,
    recovery_phases,
    summarize,
)

TITLE_LOSS = "Loss and learning rate"
TITLE_STEP_TIME = "Step time and throughput"
TITLE_STEP_TIME_COMPARE = "Step time"
TITLE_PROGRESS = "Progress over wall clock, with elastic phases"
TITLE_RECOVERY = "Recovery timeline per failure"
TITLE_GOODPUT = "Goodput and badput by cause"

RUN_COLORS = ("tab:blue", "black")
RUN_STYLES = ("-", "--")  # the second run dashed, so identical curves (same seed, exact resume) both show
STARTUP, CHECKPOINT, EVAL = "startup + compile", "checkpoint save (blocking)", "eval"
EVAL_COLORS = ("tab:orange", "tab:red")
GAP = "teardown, recompile (between phases)"
BAND_COLORS = {
    STARTUP: "#7f7f7f",
    CHECKPOINT: "#17becf",
    EVAL: "#e377c2",
    DOWN: "#d62728",
    WAITING: "#ff7f0e",
    RESTORING: "#9467bd",
    TO_FIRST_STEP: "#bcbd22",
}
CAUSE_COLORS = {
    "productive": "#2ca02c",
    "startup_compile": BAND_COLORS[STARTUP],
    "checkpoint_save": BAND_COLORS[CHECKPOINT],
    "restore": BAND_COLORS[RESTORING],
    "wasted_progress": "#8c564b",
    "waiting_for_slices": BAND_COLORS[WAITING],
    "eval": BAND_COLORS[EVAL],
    "sdc_check": "#17becf",
    "rollback": "#bcbd22",
    "hang": "#e377c2",
    "other": "#c7c7c7",
}
REWIND_COLOR = "#d62728"
MIN_BAND_FRACTION = 0.004
BELOW = dict(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4)  # legend under the x label


def render_report(runs: list[RunLog], summaries: list[RunSummary] | None = None) -> Figure:
    """The whole report figure for one run, or two overlaid (the first is the one under study)."""
    summaries = summaries or [summarize(r) for r in runs]
    labels = _labels(runs)
    fig = Figure(figsize=(16, 13), layout="constrained")
    FigureCanvasAgg(fig)  # the raster renderer, attached to this figure only: no pyplot, no display
    grid = fig.add_gridspec(3, 2, height_ratios=[1.0, 1.0, 0.8])
    plot_loss(fig.add_subplot(grid[0, 0]), runs, labels)
    plot_step_time(fig.add_subplot(grid[0, 1]), runs, labels)
    plot_progress(fig.add_subplot(grid[1, :]), runs, labels)
    plot_recoveries(fig.add_subplot(grid[2, 0]), runs, labels)
    plot_goodput(fig.add_subplot(grid[2, 1]), summaries, labels)
    fig.suptitle(_headline(summaries, labels), fontsize=14)
    return fig


def plot_loss(ax: Axes, runs: list[RunLog], labels: list[str]) -> None:
    compare = len(runs) > 1
    lr_ax = ax.twinx()
    for run, label, color, ls, eval_color in zip(runs, labels, RUN_COLORS, RUN_STYLES, EVAL_COLORS):
        suffix = f" ({label})" if compare else ""
        ax.plot(
            _col(run.surviving, "step"),
            _col(run.surviving, "loss"),
            color=color,
            ls=ls,
            lw=1.6,
            label="loss" + suffix,
        )
        if run.evals:
            ax.plot(
                _col(run.evals, "step"),
                _col(run.evals, "eval_loss"),
                color=eval_color,
                ls=ls,
                lw=1.2,
                marker="o",
                ms=5,
                label="eval loss (held out)" + suffix,
            )
        if run.superseded:
            ax.scatter(
                _col(run.superseded, "step"),
                _col(run.superseded, "loss"),
                marker="x",
                s=22,
                color=color,
                alpha=0.6,
                label="loss of rewound steps" + suffix,
            )
        lr_ax.plot(
            _col(run.surviving, "step"),
            _col(run.surviving, "learning_rate"),
            color=color,
            lw=1.0,
            ls=":",
            alpha=0.8,
            label="learning rate" + suffix,
        )
    _shade_rewinds(ax, runs[0])
    ax.set(title=TITLE_LOSS, xlabel="step", ylabel="loss")
    lr_ax.set_ylabel("learning rate")
    lr_ax.yaxis.set_major_formatter(_sci())
    _legend(ax, lr_ax, **BELOW)
    _no_data_note(ax, runs)


def plot_step_time(ax: Axes, runs: list[RunLog], labels: list[str]) -> None:
    """Step time (left axis) per run; tokens/s on the right axis for a single run only (it is the
    inverse of step time, and four overlaid lines would hide the comparison)."""
    compare = len(runs) > 1
    for run, label, color, ls in zip(runs, labels, RUN_COLORS, RUN_STYLES):
        ax.plot(
            _col(run.surviving, "step"),
            _col(run.surviving, "step_time_s"),
            color=color,
            ls=ls,
            lw=1.4,
            marker=".",
            ms=4,
            label="step time" + (f" ({label})" if compare else ""),
        )
        slow = [e for e in run.events if e["event"] == catalogue.SLOW_STEP]
        if slow:  # monitor_step_time_deviation's events, on the step-time curve
            ax.scatter(
                [e["step"] for e in slow],
                [e["step_time_s"] for e in slow],
                s=60,
                facecolors="none",
                edgecolors="tab:red",
                zorder=5,
                label="slow step" + (f" ({label})" if compare else ""),
            )
    handles_ax = ax
    if not compare:
        tok_ax = ax.twinx()
        run = runs[0]
        tok_ax.plot(
            _col(run.surviving, "step"),
            _col(run.surviving, "tokens_per_s"),
            color="tab:green",
            lw=1.0,
            ls="--",
            label="tokens/s",
        )
        tok_ax.set_ylabel("tokens/s")
        tok_ax.set_ylim(bottom=0)
        handles_ax = tok_ax
    _shade_rewinds(ax, runs[0])
    ax.set(title=TITLE_STEP_TIME_COMPARE if compare else TITLE_STEP_TIME, xlabel="step", ylabel="step time (s)")
    ax.set_ylim(bottom=0)
    _legend(ax, handles_ax if handles_ax is not ax else None, **BELOW)
    _no_data_note(ax, runs)


def plot_progress(ax: Axes, runs: list[RunLog], labels: list[str]) -> None:
    compare = len(runs) > 1
    for run, label, color, ls in zip(runs, labels, RUN_COLORS, RUN_STYLES):
        for i, attempt in enumerate(_attempt_segments(run.records)):
            ax.plot(
                [r["time"] - run.t0 for r in attempt],
                _col(attempt, "step"),
                color=color,
                ls=ls,
                lw=1.4,
                marker=".",
                ms=3,
                label=("step reached" + (f" ({label})" if compare else "")) if i == 0 else None,
            )
    run = runs[0]
    span = max(max(r.t_end - r.t0 for r in runs), 1e-6)
    for name, a, b in _bands(run):
        a, b = _visible(a - run.t0, b - run.t0, MIN_BAND_FRACTION * span)
        ax.axvspan(a, b, color=BAND_COLORS[name], alpha=0.35 if name != STARTUP else 0.15, lw=0, label=name)
    for t, _ in recovery_phases(run):
        if t.get("steps_rewound") is None:
            continue
        note = (
            f"slice {t['slice']} lost at step {t['last_step']}\n"
            f"−{t['steps_rewound']} steps (resume {t['resumed_from_step']})"
        )
        ax.annotate(
            note,
            xy=(t["detected"] - run.t0, t["last_step"]),
            xytext=(-12, 22),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            color=REWIND_COLOR,
            arrowprops=dict(arrowstyle="->", color=REWIND_COLOR, lw=0.8),
        )
    ax.set(
        title=TITLE_PROGRESS + (f" (bands: {labels[0]})" if compare else ""),
        xlabel="seconds since the run started (wall clock)",
        ylabel="step",
    )
    ax.set_xlim(0, span * 1.01)
    ax.set_ylim(bottom=0)
    _legend(ax, None, loc="upper left", ncol=2)


def plot_recoveries(ax: Axes, runs: list[RunLog], labels: list[str]) -> None:
    compare = len(runs) > 1
    rows = [(label, t, phases) for run, label in zip(runs, labels) for t, phases in recovery_phases(run)]
    ax.set_title(TITLE_RECOVERY)
    if not rows:
        ax.text(0.5, 0.5, "no slice failures", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set(xticks=[], yticks=[])
        return
    origin = [t["killed"] if t["killed"] is not None else t["detected"] for _, t, _ in rows]
    right = max(max((b - o for _, _, b in phases), default=0.0) for o, (_, _, phases) in zip(origin, rows)) or 1.0
    for i, ((_label, t, phases), o) in enumerate(zip(rows, origin)):
        if phases:  # what no named phase covers (teardown, recompile) shows as the grey underneath
            start, stop = min(a for _, a, _ in phases) - o, max(b for _, _, b in phases) - o
            ax.barh(i, stop - start, left=start, height=0.55, color="#e0e0e0", label=GAP)
        for name, a, b in phases:
            a, b = _visible(a - o, b - o, 0.006 * right)
            ax.barh(i, b - a, left=a, height=0.55, color=BAND_COLORS[name], label=name)
        end = max((b - o for _, _, b in phases), default=0.0)
        ax.text(end + 0.02 * right, i, _recovery_note(t), va="center", fontsize=8)
    ax.set_yticks(
        range(len(rows)),
        [f"{label + ' ' if compare else ''}#{k}: slice {t['slice']}" for k, (label, t, _) in enumerate(rows, 1)],
    )
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first failure on top
    ax.set_xlim(0, right * 1.75)
    ax.set_xlabel("seconds since the slice was killed (or detected, when the kill time is unknown)")
    _legend(ax, None, **BELOW)


def plot_goodput(ax: Axes, summaries: list[RunSummary], labels: list[str]) -> None:
    """Productive time then each badput cause, as % of wall time. The parts can add up to more than
    100 % (account() can count a span under two headings); the axis then extends past a line at 100 %."""
    total = 100.0
    for i, s in enumerate(summaries):
        g = s.goodput
        wall = g["wall_s"] or 1e-9
        parts = [("productive", g["productive_s"])] + [(c, g["badput_s"][c]) for c in CAUSES]
        left = 0.0
        for cause, seconds in parts:
            pct = 100.0 * seconds / wall
            ax.barh(
                i,
                pct,
                left=left,
                height=0.55,
                color=CAUSE_COLORS[cause],
                edgecolor="white",
                lw=0.5,
                label=cause.replace("_", " "),
            )
            if pct >= 6:
                ax.text(
                    left + pct / 2,
                    i,
                    f"{pct:.0f}%",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if cause in ("productive", "wasted_progress", "restore") else "black",
                )
            left += pct
        total = max(total, left)
    if total > 100.5:
        ax.axvline(100, color="black", lw=0.8, ls="--")
        ax.text(100, -0.45, "100 % ", ha="right", va="top", fontsize=8)
    ax.set_yticks(
        range(len(summaries)),
        [f"{label}\n{s.goodput['wall_s']:.0f} s wall" for label, s in zip(labels, summaries)],
    )
    ax.set_ylim(len(summaries) - 0.5, -0.5)
    ax.set(title=TITLE_GOODPUT, xlabel="% of wall time", xlim=(0, max(100, total)))
    _legend(ax, None, **BELOW)


# ---- helpers -------------------------------------------------------------------------------------------


def _labels(runs: list[RunLog]) -> list[str]:
    names = [r.name for r in runs]
    if len(set(names)) < len(names):
        return [f"{n} ({k})" for n, k in zip(names, "AB")]
    return names


def _headline(summaries: list[RunSummary], labels: list[str]) -> str:
    parts = []
    for s, label in zip(summaries, labels):
        gp = s.goodput["goodput"]
        planned = f"/{s.steps_planned}" if s.steps_planned else ""
        parts.append(
            f"{label}: {s.status}, step {s.steps_done}{planned}, {s.failures} failure"
            f"{'' if s.failures == 1 else 's'}, goodput {'n/a' if gp is None else f'{gp:.1%}'}"
        )
    return "   vs   ".join(parts)


def _recovery_note(t: dict[str, Any]) -> str:
    first = t["relative_s"].get("first_step")
    rewound = t.get("steps_rewound")
    if rewound is None:
        return "recovering…"
    return f"−{rewound} steps, from {t.get('restore_source')}" + (
        "" if first is None else f"\nfirst step at +{first:.2f} s"
    )


def _bands(run: RunLog) -> list[tuple[str, float, float]]:
    """Startup, blocking checkpoint saves and every recovery phase, as (name, start, end) wall times."""
    first_attempt = next((e["time"] for e in run.events if e["event"] == catalogue.ATTEMPT_START), None)
    out = [(STARTUP, run.t0, first_attempt)] if first_attempt is not None else []
    out += [
        (CHECKPOINT, e["time"] - e.get("seconds", 0.0) + e.get("waited_for_step_s", 0.0), e["time"])
        for e in run.events
        if e["event"] == catalogue.CHECKPOINT_SAVE_BLOCKED
    ]
    out += [(EVAL, r["time"] - r.get("eval_time_s", 0.0), r["time"]) for r in run.eval_records]
    out += [p for _, phases in recovery_phases(run) for p in phases]
    return out


def _attempt_segments(records: list[dict]) -> list[list[dict]]:
    """Split the records where the step falls back (a rewind), so no line joins two attempts."""
    segments: list[list[dict]] = []
    for r in records:
        if not segments or r["step"] <= segments[-1][-1]["step"]:
            segments.append([])
        segments[-1].append(r)
    return segments


def _shade_rewinds(ax: Axes, run: RunLog) -> None:
    """Shade on the step axis the steps each rewind recomputed, with their count at the bottom (the top
    right holds the legend; loss falls and step times sit well above 0, so the bottom is usually free)."""
    bottom = blended_transform_factory(ax.transData, ax.transAxes)
    for e in run.events:
        n = e.get("steps_rewound") or 0
        if e["event"] != catalogue.ATTEMPT_START or n <= 0:
            continue
        lo, hi = e["start_step"] + 0.5, e["start_step"] + n + 0.5
        ax.axvspan(lo, hi, color=REWIND_COLOR, alpha=0.12, lw=0, label="steps rewound")
        ax.text(
            (lo + hi) / 2,
            0.02,
            f"−{n}",
            transform=bottom,
            ha="center",
            va="bottom",
            fontsize=8,
            color=REWIND_COLOR,
        )


def _visible(a: float, b: float, min_width: float) -> tuple[float, float]:
    if b - a >= min_width:
        return a, b
    mid = (a + b) / 2
    return mid - min_width / 2, mid + min_width / 2


def _legend(ax: Axes, other: Axes | None, **kwargs) -> None:
    """One legend for an axes and its twin, one entry per label."""
    handles, names = ax.get_legend_handles_labels()
    if other is not None:
        h2, n2 = other.get_legend_handles_labels()
        handles, names = handles + h2, names + n2
    unique = dict(zip(names, handles))
    if unique:
        ax.legend(unique.values(), unique.keys(), fontsize=8, framealpha=0.85, **kwargs)


def _no_data_note(ax: Axes, runs: list[RunLog]) -> None:
    if not any(r.records for r in runs):
        ax.text(0.5, 0.5, "no step records yet", ha="center", va="center", transform=ax.transAxes, color="gray")


def _col(records: list[dict], key: str) -> list:
    return [r.get(key) for r in records]


def _sci() -> ScalarFormatter:
    f = ScalarFormatter(useMathText=True)
    f.set_powerlimits((-2, 3))
    return f
