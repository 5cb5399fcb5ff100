"""The run report (python -m trainer.report) and the live progress line.

Most tests read a run directory written by hand: 10 steps on 2 slices, slice 1 killed during step 7,
a rewind to the snapshot of step 4 (2 steps lost), then steps 5..10 again. One test makes a real
failing run through the training CLI (~15 s on CPU) and reports it.
"""

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import report
from trainer.observe.plots import render_report
from trainer.observe.runlog import load_run, summarize
from trainer.observe.sinks import LogSink, ProgressSink

PANELS = {
    "Loss and learning rate",
    "Step time and throughput",
    "Progress over wall clock, with elastic phases",
    "Recovery timeline per failure",
    "Goodput and badput by cause",
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _event(name, time, **fields):
    return {"event": name, "time": time, "pid": 7, **fields}


def _step(step, time, loss):
    return {
        "step": step,
        "loss": loss,
        "learning_rate": 1e-3,
        "grad_norm": 1.0,
        "step_time_s": 1.0,
        "tokens_per_s": 100.0,
        "tflops_per_device": 0.01,
        "mfu": None,
        "global_batch_size": 2,
        "pid": 7,
        "time": time,
        "batch_fingerprint": f"b{step}",
        "loss_tokens": 30,
        "z_loss": 0.0,
        "aux_loss": 0.0,
        "devices": 2,
    }


def write_run(run_dir: Path, *, finished: bool = True) -> Path:
    """A run with one failure at step 7 and a rewind to step 4; `finished=False` stops it mid-way with
    torn last lines in both files, as a killed or still-running trainer leaves them."""
    run_dir.mkdir(parents=True)
    events = [
        _event("start", 1000.0, steps=10),
        _event("wait_start", 1000.5),
        _event("wait_end", 1001.0, active=[0, 1]),
        _event("compile_done", 1004.0, seconds=3.0),
        _event("restore_start", 1004.0),
        _event("restore_end", 1005.0, source="init", seconds=1.0, bytes=10),
        _event("attempt_start", 1005.0, attempt=1, slices=[0, 1], start_step=0, source="init", steps_rewound=0),
        _event("snapshot_taken", 1009.1, step=4),
        _event("slice_killed", 1011.5, slice=1, down_s=1.0, cause="fault_schedule step=7"),
        _event(
            "slice_down_detected", 1012.0, attempt=1, last_step=6, slices=[0, 1], error="DATA_LOSS", failures=1
        ),
        _event("wait_start", 1012.1),
        _event("wait_end", 1013.0, active=[0, 1], seconds=0.9),
        _event("compile_cached", 1013.05),
        _event("restore_start", 1013.1),
        _event("restore_end", 1013.6, source="snapshot:4", seconds=0.5, bytes=10),
        _event(
            "attempt_start", 1013.7, attempt=2, slices=[0, 1], start_step=4, source="snapshot:4", steps_rewound=2
        ),
        _event("first_step_after_recovery", 1013.8, step=5, seconds_since_detection=1.8, slices=[0, 1]),
    ]
    metrics = [_step(s, 1005.0 + s, 10.0 - 0.5 * s) for s in range(1, 7)]  # attempt 1: steps 1..6
    metrics += [_step(s, 1010.0 + s, 10.0 - 0.5 * s - 0.01) for s in range(5, 11)]  # attempt 2: steps 5..10
    metrics[-1]["last"] = True
    # The trainer's own tallies: 10 surviving steps of 1 s in 21 s of wall time.
    events += [
        _event("elastic_summary", 1020.9, failures=1, steps_lost=2, downtime_s=1.8),
        _event(
            "goodput",
            1021.0,
            goodput=0.4762,
            wall_s=21.0,
            productive_s=10.0,
            badput_s={
                "startup_compile": 5.0,
                "checkpoint_save": 0.0,
                "restore": 0.5,
                "wasted_progress": 2.0,
                "waiting_for_slices": 0.9,
                "other": 2.6,
            },
        ),
        _event("finish", 1021.0, status="finished", step=10),
    ]
    ev_lines = [json.dumps(e) for e in events]
    m_lines = [json.dumps(m) for m in metrics]
    if not finished:  # cut both files mid-line: metrics inside step 8's record, events after the recovery
        m_lines = m_lines[:9] + [m_lines[9][:40]]
        ev_lines = ev_lines[:-3] + [ev_lines[-3][:25]]
    (run_dir / "metrics.jsonl").write_text("\n".join(m_lines) + ("\n" if finished else ""))
    (run_dir / "events.jsonl").write_text("\n".join(ev_lines) + ("\n" if finished else ""))
    return run_dir


def _titles(fig):
    return {ax.get_title() for ax in fig.axes if ax.get_title()}


def _axes(fig, title):
    return next(ax for ax in fig.axes if ax.get_title().startswith(title))


def _legend_texts(ax):
    return {t.get_text() for t in ax.get_legend().get_texts()}


def _printed(stdout: str, label: str) -> str:
    return re.search(rf"^  {label}\s+(\S+)", stdout, re.M).group(1)


def test_report_cli_writes_a_png_into_the_run_directory_and_prints_the_summary(tmp_path, capsys):
    run_dir = write_run(tmp_path / "failing")
    assert report.main([str(run_dir)]) == 0
    png = run_dir / "report.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert out.startswith("run failing: finished") and f"report written to {png}" in out


def test_report_figure_has_every_panel_with_the_elastic_phases_and_the_rewind_marked(tmp_path):
    fig = render_report([load_run(write_run(tmp_path / "failing"))])
    assert _titles(fig) == PANELS
    progress = _axes(fig, "Progress over wall clock")
    assert {
        "down → detected",
        "waiting for slices",
        "restoring",
        "restored → first step",
        "startup + compile",
    } <= _legend_texts(progress)
    assert any("−2 steps" in t.get_text() for t in progress.texts)
    loss = _axes(fig, "Loss and learning rate")
    assert "steps rewound" in _legend_texts(loss) and any(t.get_text() == "−2" for t in loss.texts)
    recovery = _axes(fig, "Recovery timeline per failure")
    assert [t.get_text() for t in recovery.get_yticklabels()] == ["#1: slice 1"]
    assert _axes(fig, "Goodput and badput by cause").get_xlabel() == "% of wall time"


def test_summary_numbers_match_the_runs_own_elastic_summary_and_goodput_events(tmp_path, capsys):
    run = load_run(write_run(tmp_path / "failing"))
    recorded = {e["event"]: e for e in run.events}
    s = summarize(run)
    assert (s.failures, s.steps_lost) == (
        recorded["elastic_summary"]["failures"],
        recorded["elastic_summary"]["steps_lost"],
    )
    assert s.downtime_s == pytest.approx(recorded["elastic_summary"]["downtime_s"])
    assert s.goodput["goodput"] == pytest.approx(recorded["goodput"]["goodput"], abs=1e-3)
    assert (s.steps_done, s.steps_planned, s.final_loss) == (10, 10, pytest.approx(4.99))

    report.main([str(run.path)])
    out = capsys.readouterr().out
    assert _printed(out, "failures") == "1" and _printed(out, "steps lost") == "2"
    assert _printed(out, "downtime") == "1.800" and _printed(out, "goodput") == "47.6%"
    assert _printed(out, "median step time") == "1.000" and _printed(out, "median tokens/s") == "100.0"
    assert "steps rewound: 2 (last completed 6, resumed from 4)" in out  # format_timeline of the failure
    assert "note:" not in out  # derived and recorded numbers agree


def test_rewound_records_are_set_apart_from_the_surviving_trajectory(tmp_path):
    run = load_run(write_run(tmp_path / "failing"))
    assert [r["step"] for r in run.surviving] == list(range(1, 11))
    assert [r["step"] for r in run.superseded] == [5, 6]
    assert run.surviving[4]["time"] == 1015.0  # step 5 as recomputed, not as first run


def test_compare_overlays_both_runs_and_shows_both_goodput_bars(tmp_path, capsys):
    failing = write_run(tmp_path / "failing")
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "events.jsonl").write_text(
        "\n".join(
            json.dumps(e)
            for e in [
                _event("start", 0.0, steps=10),
                _event(
                    "attempt_start", 4.0, attempt=1, slices=[0, 1], start_step=0, source="init", steps_rewound=0
                ),
                _event("finish", 15.0, status="finished", step=10),
            ]
        )
        + "\n"
    )
    (clean / "metrics.jsonl").write_text(
        "\n".join(json.dumps(_step(s, 4.0 + s, 10.0 - 0.5 * s)) for s in range(1, 11)) + "\n"
    )
    out_png = tmp_path / "compare.png"
    assert report.main([str(failing), "--compare", str(clean), "--output", str(out_png)]) == 0
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    assert "run failing: finished" in capsys.readouterr().out

    fig = render_report([load_run(failing), load_run(clean)])
    assert {"loss (failing)", "loss (clean)"} <= _legend_texts(_axes(fig, "Loss and learning rate"))
    assert {"step time (failing)", "step time (clean)"} <= _legend_texts(_axes(fig, "Step time"))
    bars = _axes(fig, "Goodput and badput by cause")
    assert [t.get_text().splitlines()[0] for t in bars.get_yticklabels()] == ["failing", "clean"]


def test_a_run_in_progress_with_torn_last_lines_renders_and_reports_what_happened_so_far(tmp_path, capsys):
    run_dir = write_run(tmp_path / "running", finished=False)
    run = load_run(run_dir)
    s = summarize(run)
    assert s.status == "in progress" and s.steps_done == 7
    assert (s.failures, s.steps_lost, s.downtime_s) == (1, 2, 1.8)
    assert s.goodput["goodput"] == pytest.approx(7.0 / (1017.0 - 1000.0))  # 7 steps of 1 s; wall up to step 7
    assert report.main([str(run_dir)]) == 0
    assert (run_dir / "report.png").read_bytes()[:8] == PNG_MAGIC
    assert capsys.readouterr().out.startswith("run running: in progress")


def test_a_directory_without_metrics_or_events_exits_2_with_a_clear_message(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and "events.jsonl" in err and "run directory" in err
    assert not (tmp_path / "empty" / "report.png").exists()
    assert report.main([str(write_run(tmp_path / "failing")), "--compare", str(tmp_path / "nope")]) == 2


def test_a_real_failing_run_is_reported_with_its_failure_and_rewind(tmp_path):
    """The training CLI with a fault at step 7 and snapshots every 4 steps: steps 5 and 6 are redone."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train",
            "base.yml",
            "model=qwen3-tiny",
            "base_num_decoder_layers=2",
            "base_emb_dim=64",
            "base_num_query_heads=4",
            "base_num_kv_heads=2",
            "head_dim=16",
            "base_mlp_dim=128",
            "vocab_size=256",
            "max_target_length=16",
            "per_device_batch_size=1",
            "remat_policy=none",
            "enable_tensorboard=false",
            "steps=10",
            "num_slices=2",
            "elastic_enabled=true",
            "snapshot_period=4",
            "checkpoint_period=100",
            "elastic_poll_interval_seconds=0.05",
            "fault_schedule=step=7,slice=1,down_s=0",
            f"base_output_directory={tmp_path}",
            "run_name=real",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.report", str(tmp_path / "real")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _printed(proc.stdout, "failures") == "1" and _printed(proc.stdout, "steps lost") == "2"
    assert "state restored from snapshot:4" in proc.stdout
    assert (tmp_path / "real" / "report.png").stat().st_size > 10_000


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def _record(step, step_time=2.0):
    return {"step": step, "loss": 3.25, "tokens_per_s": 1234.0, "step_time_s": step_time}


def test_progress_sink_rewrites_one_line_with_eta_from_the_median_step_time_and_ends_it_on_close():
    term = FakeTerminal()
    sink = ProgressSink(total_steps=10, stream=term)
    for step, step_time in [(1, 2.0), (2, 2.0), (3, 30.0)]:  # the 30 s spike must not move the ETA
        sink.write(_record(step, step_time))
    written = term.getvalue()
    assert "\n" not in written and written.count("\r") == 3
    assert written.rsplit("\r", 1)[1] == "step 3/10  loss 3.2500  1,234 tokens/s  ETA 0:00:14"  # 7 steps × 2 s
    sink.close()
    assert term.getvalue().endswith("ETA 0:00:14\n")


def test_progress_sink_blanks_what_a_longer_previous_line_left_behind():
    term = FakeTerminal()
    sink = ProgressSink(total_steps=100, stream=term)
    sink.write(_record(9))
    sink.write(_record(10, 0.5))
    first, second = term.getvalue().split("\r")[1:]
    assert len(second) >= len(first)


def test_make_sinks_uses_the_progress_line_on_a_terminal_and_log_lines_otherwise(tmp_path):
    from helpers import micro_config

    from trainer.run import make_sinks

    cfg = micro_config("enable_tensorboard=false", "steps=7")
    piped = make_sinks(cfg, tmp_path, stderr=io.StringIO())
    terminal = make_sinks(cfg, tmp_path, stderr=FakeTerminal())
    try:
        assert [type(s) for s in piped.sinks][1:] == [LogSink]
        assert [type(s) for s in terminal.sinks][1:] == [ProgressSink] and terminal.sinks[1].total_steps == 7
    finally:
        piped.close()
        terminal.close()


# --- torn tails and where the figure goes ---------------------------------------------------------------


def _cut_last_line(data: bytes, keep: int) -> bytes:
    """The file's bytes with only the first `keep` bytes of its last record (and no newline): what a
    writer killed mid-write leaves."""
    data = data.rstrip(b"\n")
    return data[: data.rfind(b"\n") + 1 + keep]


def _last_line_length(data: bytes) -> int:
    data = data.rstrip(b"\n")
    return len(data) - (data.rfind(b"\n") + 1)


def test_a_last_line_cut_at_any_byte_in_either_file_never_breaks_the_report(tmp_path, capsys):
    """Every cut of metrics.jsonl's and events.jsonl's last line loads and summarizes; a random sample of
    cuts, of one file or both at once, also goes through `python -m trainer.report` (main)."""
    import random

    original = write_run(tmp_path / "original")
    names = ("metrics.jsonl", "events.jsonl")
    data = {n: (original / n).read_bytes() for n in names}
    lengths = {n: _last_line_length(data[n]) for n in names}
    run_dir = shutil.copytree(original, tmp_path / "cut")
    for name in names:
        for keep in range(lengths[name]):
            (run_dir / name).write_bytes(_cut_last_line(data[name], keep))
            summarize(load_run(run_dir))
        (run_dir / name).write_bytes(data[name])

    rng = random.Random(0)
    cuts = [{n: rng.randrange(lengths[n]) for n in rng.sample(names, rng.choice([1, 2]))} for _ in range(4)]
    for k, cut in enumerate(cuts):
        run_dir = shutil.copytree(original, tmp_path / f"sample{k}")
        for name, keep in cut.items():
            (run_dir / name).write_bytes(_cut_last_line(data[name], keep))
        assert report.main([str(run_dir)]) == 0, cut
        assert (run_dir / "report.png").read_bytes()[:8] == PNG_MAGIC
        assert capsys.readouterr().out.startswith(f"run sample{k}: ")


def test_a_cut_inside_a_multibyte_character_or_a_record_missing_its_fields_is_skipped(tmp_path):
    run_dir = write_run(tmp_path / "run")
    with open(run_dir / "events.jsonl", "ab") as f:
        f.write('{"event": "note", "time": 1021.5}\n{"event": "x", "text": "down → det'.encode()[:-2])
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"loss": 1.0}\n[1, 2]\n"str"\n')
    run = load_run(run_dir)
    assert run.events[-1]["event"] == "note" and len(run.records) == 12
    assert summarize(run).steps_done == 10


def _report_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.report", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_output_without_a_suffix_is_a_directory_and_the_printed_path_is_the_file_written(tmp_path):
    """`-o DIR` used to write DIR.png and print DIR. Now a suffix-less -o is a directory (created), the
    report is DIR/report.png, and the printed path is the one written."""
    write_run(tmp_path / "runs" / "failing")
    proc = _report_cli(tmp_path, "runs/failing", "-o", "DIR")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = Path(proc.stdout.strip().splitlines()[-1].removeprefix("report written to "))
    assert printed == tmp_path / "DIR" / "report.png"
    assert printed.read_bytes()[:8] == PNG_MAGIC
    assert not (tmp_path / "DIR.png").exists() and not (tmp_path / "runs" / "failing" / "report.png").exists()


@pytest.mark.parametrize(
    "output,written,magic",
    [
        ("existing", "existing/report.png", PNG_MAGIC),  # an existing directory
        ("new/", "new/report.png", PNG_MAGIC),  # a trailing slash
        ("figs/run.png", "figs/run.png", PNG_MAGIC),  # parents created
        ("run.pdf", "run.pdf", b"%PDF"),  # another format matplotlib writes
    ],
)
def test_output_rules_name_the_file_actually_written(tmp_path, monkeypatch, capsys, output, written, magic):
    run_dir = write_run(tmp_path / "failing")
    (tmp_path / "existing").mkdir()
    monkeypatch.chdir(tmp_path)
    assert report.main([str(run_dir), "-o", output]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == f"report written to {tmp_path / written}"
    assert (tmp_path / written).read_bytes().startswith(magic)
    assert not [p for p in tmp_path.rglob(".*staging*")]  # written aside, then renamed


def test_an_output_suffix_matplotlib_cannot_write_is_refused_before_rendering(tmp_path, capsys):
    run_dir = write_run(tmp_path / "failing")
    assert report.main([str(run_dir), "-o", str(tmp_path / "report.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m trainer.report: error: ") and "\n" not in err
    assert ".txt is not an image format" in err and ".png" in err
    assert list(tmp_path.iterdir()) == [run_dir]


def test_report_errors_are_one_line_with_exit_2_and_no_traceback(tmp_path):
    (tmp_path / "notes").write_text("a file")
    write_run(tmp_path / "failing")
    for args, fragment in [
        (["nowhere"], f"{tmp_path / 'nowhere'} does not exist"),
        (["failing", "-o", "notes/r.png"], f"{tmp_path / 'notes'} is a file"),
    ]:
        proc = _report_cli(tmp_path, *args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert (
            len(lines) == 1 and lines[0].startswith("python -m trainer.report: error: ") and fragment in lines[0]
        )


def test_the_report_says_which_tier_each_restore_came_from_and_the_steps_each_lost(tmp_path, capsys):
    """Two processes of one run: the first killed after step 13, the second resumed from the local tier."""
    run_dir = tmp_path / "restarted"
    run_dir.mkdir()
    events = [
        _event("start", 0.0, steps=20),
        _event("attempt_start", 1.0, attempt=1, source="init", steps_rewound=0, start_step=0),
        _event("start", 20.0, steps=20),
        _event("restart_resumed", 22.0, last_step=13, start_step=10, source="local:10", steps_lost=3),
        _event("attempt_start", 22.0, attempt=1, source="local:10", steps_rewound=3, start_step=10),
        _event("slice_down_detected", 30.0, attempt=1, last_step=16, failures=1, slices=[0, 1], error="x"),
        _event("attempt_start", 31.0, attempt=2, source="snapshot:16", steps_rewound=0, start_step=16),
        _event("finish", 40.0, status="finished", step=20),
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    records = [_step(s, 2.0 + s, 5.0) for s in range(1, 14)] + [_step(s, 20.0 + s, 5.0) for s in range(11, 21)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    s = summarize(load_run(run_dir))
    assert [(r["source"], r["steps_lost"], r["restart"]) for r in s.restores] == [
        ("local:10", 3, True),
        ("snapshot:16", 0, False),
    ]
    report.main([str(run_dir)])
    out = capsys.readouterr().out
    assert "restores          2 (1 from local, 1 from snapshot; 1 after a lost process)" in out
    assert re.search(r"process restart\s+from local:10\s+3 steps lost", out)
