"""Loss curves through failures, on real text: the uninterrupted run against the same run with a slice lost
and back, with a replica-resize, and killed with SIGKILL and restarted, step by step and bit by bit.

    python benchmarks/curves_through_failures.py [--steps 80] [--image PATH] [key=value ...]
    python benchmarks/curves_through_failures.py --replot     # the image again, from the record

Real text that every machine has (benchmarks/corpus.py: the standard library's modules, its language and
library reference and its licence, one record per paragraph, tokenized with the bundled sentencepiece
tokenizer by `python -m trainer.data.prepare`). The model is qwen3-tiny with the tokenizer's vocabulary
(8192) on rows of 128 tokens, on 3 virtual slices of one CPU device each (global batch 6 rows), elastic
with `elastic_resize_bitwise=true`, a checkpoint every steps/4 and a snapshot every steps/16. Four runs of
the same command:

- uninterrupted;
- pause-and-resume: slice 1 is lost at step steps/5 and back 2 s later; the run waits for it;
- replica-resize: slice 2 is lost at step 9 steps/20 for steps/8 steps, with `elastic_min_slice_count=2`:
  the run goes on with 2 slices (`keep_global`: the same 6 rows a step) and grows back;
- kill -9: the trainer and its data worker are killed with SIGKILL once step 7 steps/8 is recorded (its
  process group, as a lost pod takes every process in it), and the same command is run again, as a
  JobSet restarts it: it resumes from its newest committed checkpoint and trains the lost steps again.

From each run's metrics.jsonl, every loss recorded for each step (a step trained again after a rewind has
several) against the uninterrupted run's, as the bits of the float; from its events.jsonl, where the
failure happened. Writes the table to the record benchmarks/records/curves_through_failures.json and
the picture (the curves overlaid, the failures marked, and each run's difference from the uninterrupted
loss) to docs/images/curves_through_failures.png. TRAINER_SMOKE=1 runs it all at minimal sizes, draws the
picture into a temporary directory and records nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import records  # noqa: E402
from cli_runs import (  # noqa: E402
    SMOKE_SHAPE,
    SMOKE_SHAPE_TEXT,
    announce_smoke,
    env_with_devices,
    read_jsonl,
    run,
    smoke,
    smoke_cap,
    smoke_overrides,
    step_records,
    trainer_cmd,
)
from corpus import prepare as prepare_corpus  # noqa: E402

from trainer.observe import catalogue  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BENCHMARK = "curves_through_failures"
TOKENIZER = REPO / "data" / "tokenizer" / "fc_sp8k.model"
IMAGE = REPO / "docs" / "images" / "curves_through_failures.png"
SLICES = 3
RUNS = ("uninterrupted", "pause-and-resume", "replica-resize", "kill -9 and restart")


def prepare(out: Path) -> dict:
    corpus = prepare_corpus(out, tokenizer=TOKENIZER, limit=20 if smoke() else None)
    return {k: corpus[k] for k in ("files", "fingerprint", "records", "tokens")}


def plan(steps: int) -> dict:
    """The save periods and the failure moments, as fractions of the run (with floors for a smoke run)."""
    return {
        "checkpoint_period": max(3, steps // 4),
        "snapshot_period": max(2, steps // 16),
        "pause_step": max(3, steps // 5),
        "pause_down_s": 2,
        "resize_step": max(5, 9 * steps // 20),
        "resize_down_steps": max(1, steps // 8),
        "kill_after": max(9, 7 * steps // 8),
    }


def kill_after(root: Path, name: str, overrides: list[str], step: int) -> None:
    """Start the run; once step `step`'s record is written, SIGKILL its process group (the trainer and its
    Grain worker, as a lost pod takes every process in it)."""
    proc = subprocess.Popen(
        trainer_cmd(root, name, overrides),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env_with_devices(SLICES),
        start_new_session=True,
    )
    try:
        deadline = time.time() + 1800  # a hang guard
        while time.time() < deadline and proc.poll() is None:
            metrics = root / name / "metrics.jsonl"
            if metrics.exists() and any(r["step"] >= step for r in step_records(root / name)):
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
        proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != -signal.SIGKILL:
        sys.exit(f"run {name} ended before step {step} (exit {proc.returncode})")


def losses(run_dir: Path) -> list[list]:
    """[step, loss] of every step record in file order (a step trained again appears again)."""
    return [[r["step"], r["loss"]] for r in step_records(run_dir)]


def failures(run_dir: Path) -> dict:
    """What the run's events say happened: the slices lost, the attempts, the steps on fewer slices, a restart."""
    events = read_jsonl(run_dir / "events.jsonl")
    pick = {
        catalogue.SLICE_KILLED: ("slice", "step", "down_s", "down_steps"),
        catalogue.ATTEMPT_START: ("attempt", "slices", "start_step", "source", "global_batch_size"),
        catalogue.SCALE_UP: ("step",),
        catalogue.RESTART_RESUMED: ("last_step", "start_step", "source", "steps_lost"),
    }
    seen = {n: [{k: e.get(k) for k in keys} for e in events if e["event"] == n] for n, keys in pick.items()}
    seen["steps_on_fewer_slices"] = sorted({r["step"] for r in step_records(run_dir) if r["devices"] < SLICES})
    seen["pids"] = len({r["pid"] for r in step_records(run_dir)})
    return seen


def compare(clean: list[list], got: list[list]) -> dict:
    """How `got`'s losses stand against the uninterrupted run's, bit for bit (float.hex)."""
    want = {s: x for s, x in clean}
    by_step: dict[int, list[float]] = {}
    for s, x in got:
        by_step.setdefault(s, []).append(x)
    differ = [s for s in sorted(want) if {float(x).hex() for x in by_step.get(s, [])} != {float(want[s]).hex()}]
    last = {s: xs[-1] for s, xs in by_step.items()}
    return {
        "steps": len(want),
        "records": len(got),
        "trained_again": len(got) - len(by_step),
        "bitwise_equal_steps": len(want) - len(differ),
        "first_differing_step": differ[0] if differ else None,
        "max_abs_diff": max((abs(last[s] - want[s]) for s in last if s in want), default=0.0),
    }


def check(name: str, f: dict) -> None:
    """Exit unless the run's events show its failure as planned: a benchmark of failures must fail."""
    full = list(range(SLICES))
    slices = [a["slices"] for a in f[catalogue.ATTEMPT_START]]
    killed, resumed = f[catalogue.SLICE_KILLED], f[catalogue.RESTART_RESUMED]
    happened = {
        RUNS[0]: slices == [full] and not killed,
        RUNS[1]: len(killed) == 1 and slices == [full, full],
        RUNS[2]: len(killed) == 1 and slices == [full, full[:-1], full] and f["steps_on_fewer_slices"],
        RUNS[3]: len(resumed) == 1 and resumed[0]["steps_lost"] > 0 and f["pids"] == 2,
    }[name]
    if not happened:
        sys.exit(f"{name}: the run's events do not show its failure as planned: {json.dumps(f)}")


def describe(name: str, f: dict) -> str:
    if name == "pause-and-resume":
        k = f[catalogue.SLICE_KILLED][0]
        return f"slice {k['slice']} lost at step {k['step']}, back after {k['down_s']:g} s; waited for it"
    if name == "replica-resize":
        k, on = f[catalogue.SLICE_KILLED][0], f["steps_on_fewer_slices"]
        span = f"steps {on[0]}-{on[-1]}" if on else "no step"
        return f"slice {k['slice']} lost at step {k['step']} for {k['down_steps']} steps; {span} on 2 slices"
    if name.startswith("kill"):
        r = f[catalogue.RESTART_RESUMED][0]
        return f"SIGKILL after step {r['last_step']}; the rerun resumed from {r['source']}"
    return "none"


def table(out: dict) -> str:
    cfg = out["config"]
    lines = [
        f"| {cfg['model']}, real text, {SLICES} slices, {cfg['steps']} steps | failure | steps trained again "
        "| steps whose every loss is the uninterrupted run's, bit for bit | first step that differs "
        "| largest difference in loss |",
        "|---|---|---|---|---|---|",
    ]
    for name in RUNS:
        r = out["runs"][name]
        c = r["compare"]
        first = "none" if c["first_differing_step"] is None else str(c["first_differing_step"])
        lines.append(
            f"| {name} | {r['failure']} | {c['trained_again']} | {c['bitwise_equal_steps']} of {c['steps']} "
            f"| {first} | {c['max_abs_diff']:.2g} |"
        )
    return "\n".join(lines)


def draw(out: dict, path: Path) -> None:
    """The curves overlaid with the failures marked (top) and each run's loss minus the uninterrupted run's
    at every step (bottom; 0 is bit for bit). Built without pyplot, saved with the Agg renderer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = {RUNS[0]: "0.55", RUNS[1]: "tab:blue", RUNS[2]: "tab:orange", RUNS[3]: "tab:red"}
    styles = {RUNS[0]: "-", RUNS[1]: (0, (5, 3)), RUNS[2]: (0, (2, 2)), RUNS[3]: (0, (8, 3, 2, 3))}
    fig = Figure(figsize=(11, 7.4), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1.3))
    clean = {s: x for s, x in out["runs"][RUNS[0]]["losses"]}
    for name in RUNS:
        r = out["runs"][name]
        last = {s: x for s, x in r["losses"]}
        steps = sorted(last)
        width = 3.0 if name == RUNS[0] else 1.4
        c = r["compare"]
        label = name if name == RUNS[0] else f"{name}: {c['bitwise_equal_steps']}/{c['steps']} steps bit for bit"
        top.plot(steps, [last[s] for s in steps], color=colors[name], ls=styles[name], lw=width, label=label)
        final = {s: i for i, (s, _) in enumerate(r["losses"])}  # the index of each step's last record
        superseded = [(s, x) for i, (s, x) in enumerate(r["losses"]) if final[s] != i]
        if superseded:
            top.scatter(*zip(*superseded), marker="x", s=22, color=colors[name], zorder=3)
        if name != RUNS[0]:
            bottom.plot(steps, [last[s] - clean[s] for s in steps], color=colors[name], ls=styles[name], lw=1.4)
    _mark_failures(top, bottom, out, colors)
    top.set_ylabel("training loss")
    top.set_title(
        f"{out['config']['model']} on real text, {SLICES} slices: the uninterrupted run and three failure runs "
        "(x: a loss recorded before a rewind, trained again)",
        fontsize=10,
    )
    fig.legend(*top.get_legend_handles_labels(), loc="outside upper center", ncols=2, fontsize=9, frameon=False)
    bottom.set_yscale("symlog", linthresh=1e-6)
    top_diff = max([1e-5] + [r["compare"]["max_abs_diff"] for r in out["runs"].values()])
    bottom.set_ylim(-3 * top_diff, 3 * top_diff)
    bottom.set_yticks([t * 10.0**e for t in (-1, 1) for e in range(-6, 1, 2) if 10.0**e <= 3 * top_diff] + [0.0])
    bottom.axhline(0.0, color="0.3", lw=0.8)
    bottom.set_ylabel("loss − uninterrupted")
    bottom.set_xlabel("step")
    bottom.set_title(
        "difference from the uninterrupted run's loss, last record of each step (0: the same bits)", fontsize=10
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})


def _mark_failures(top, bottom, out: dict, colors: dict) -> None:
    """A line at each failure and a band over the steps it touched: the pause's lost step, the resize's
    steps on 2 slices, the steps the killed process had trained past its newest checkpoint."""
    runs = out["runs"]
    lost = runs[RUNS[1]]["failures"]["slice_killed"][0]
    on_two = runs[RUNS[2]]["failures"]["steps_on_fewer_slices"]
    restart = runs[RUNS[3]]["failures"]["restart_resumed"][0]
    first, last = restart["start_step"] + 1, restart["last_step"]
    marks = [
        (RUNS[1], lost["step"], lost["step"], f"pause: slice {lost['slice']} lost, step {lost['step']}"),
        (RUNS[3], first, last, f"kill -9 after step {last}: steps {first}-{last} again"),
    ]
    if on_two:
        marks.append((RUNS[2], on_two[0], on_two[-1], f"resize: steps {on_two[0]}-{on_two[-1]} on 2 slices"))
    for name, lo, hi, text in marks:
        for ax in (top, bottom):
            ax.axvspan(lo - 0.5, hi + 0.5, color=colors[name], alpha=0.12, lw=0)
            ax.axvline(lo - 0.5, color=colors[name], lw=1.0)
        top.annotate(
            text, (lo - 0.5, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -4), textcoords="offset points",
            va="top", fontsize=8, color=colors[name], rotation=90,
        )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--image", type=Path, default=IMAGE, help="where the picture goes")
    p.add_argument("--replot", action="store_true", help="draw the picture from the record; run nothing")
    p.add_argument("extra", nargs="*", help="more key=value for the trainer")
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    if args.replot:
        draw(records.load(BENCHMARK)["figures"], args.image)
        print(f"image written: {args.image}")
        return
    steps = smoke_cap(args.steps, 12)
    shape = {k: v for k, v in SMOKE_SHAPE.items() if k != "vocab_size"}  # the tokenizer's 8192 ids must fit
    announce_smoke(f"{steps} steps, {SMOKE_SHAPE_TEXT} (vocabulary: the tokenizer's)")
    at = plan(steps)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = prepare(root / "text")
        common = smoke_overrides(
            [
                f"model={args.model}",
                "vocab_size=8192",  # the tokenizer's ids; the preset's 32768 would cost 4x the logits for nothing
                "max_target_length=128",
                f"steps={steps}",
                f"num_slices={SLICES}",
                "elastic_enabled=true",
                "elastic_resize_bitwise=true",  # the resize keeps the bits too (ordered group sums)
                f"checkpoint_period={at['checkpoint_period']}",
                f"snapshot_period={at['snapshot_period']}",
                "elastic_poll_interval_seconds=0.05",
                "elastic_timeout_seconds=300",
                "dataset_type=arrayrecord",
                f"tokenizer_path={TOKENIZER}",
                f"grain_train_files={root / 'text' / '*.arrayrecord'}",
                "log_period=10",
                *args.extra,
            ],
            **shape,
        )
        pause = f"fault_schedule=step={at['pause_step']},slice=1,down_s={at['pause_down_s']}"
        resize = f"fault_schedule=step={at['resize_step']},slice=2,down_steps={at['resize_down_steps']}"
        dirs = {}
        for name, overrides in (
            (RUNS[0], []),
            (RUNS[1], [pause]),
            (RUNS[2], ["elastic_min_slice_count=2", resize]),
        ):
            print(f"run {name} ({steps} steps)", file=sys.stderr, flush=True)
            dirs[name] = run(root, f"run{len(dirs)}", [*common, *overrides], devices=SLICES)
        print(f"run {RUNS[3]} ({steps} steps, killed after step {at['kill_after']})", file=sys.stderr, flush=True)
        kill_after(root, "run3", common, at["kill_after"])
        dirs[RUNS[3]] = run(root, "run3", common, devices=SLICES)  # the same command again
        clean = losses(dirs[RUNS[0]])
        out = {
            "config": {"model": args.model, "steps": steps, "slices": SLICES, **at},
            "overrides": [o for o in common if not o.startswith(("grain_train_files=", "tokenizer_path="))],
            "corpus": corpus,
            "runs": {},
        }
        for name in RUNS:
            f = failures(dirs[name])
            check(name, f)
            got = losses(dirs[name])
            out["runs"][name] = {"failure": describe(name, f), "failures": f, "compare": compare(clean, got)}
            out["runs"][name]["losses"] = got
    tables = {"losses": table(out)}
    print(tables["losses"])
    image = Path(tempfile.mkdtemp()) / IMAGE.name if smoke() else args.image
    if smoke():  # the figures a smoke run does not record, beside its picture
        image.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    draw(out, image)
    print(f"image written: {image}", file=sys.stderr)
    records.write_record(BENCHMARK, BENCHMARK, argv, tables=tables, figures=out)


if __name__ == "__main__":
    main()
