"""Held-out evaluation end to end, through the real CLI: a run on the bundled function-calling data
(one shard trained on, the other held out) whose eval loss falls in metrics.jsonl, TensorBoard and the
report, and an elastic run that loses a slice and evaluates every interval to the same losses, bit for
bit (pause-and-resume replays the same steps on the same mesh)."""

import struct
from pathlib import Path

import pytest
from cli_harness import events, final_by_step, metrics, run_cli

from trainer.observe.records import eval_rows

FC = Path(__file__).resolve().parents[1] / "data" / "fc_sample"
STEPS = 12
EVAL = [
    f"steps={STEPS}",
    "num_slices=3",
    "elastic_enabled=true",
    "elastic_poll_interval_seconds=0.05",
    "dataset_type=arrayrecord",
    "use_sft=true",
    f"grain_train_files={FC / 'fc-00000-of-00002.arrayrecord'}",
    f"grain_eval_files={FC / 'fc-00001-of-00002.arrayrecord'}",
    "grain_worker_count=0",
    "vocab_size=8192",
    "max_target_length=128",
    "learning_rate=3e-3",
    "eval_interval=4",
    "eval_steps=2",
]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    proc = run_cli(root, "clean", *EVAL, "enable_tensorboard=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "clean"


def _evals(run_dir: Path) -> list[dict]:
    return eval_rows(metrics(run_dir))


def _tensorboard_scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of `tag` in the event files, read as TFRecords (the tensorboard reader is not installed)."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])  # length, its crc, the record, its crc
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            out += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
    return out


def test_eval_loss_on_held_out_function_calling_data_falls_in_metrics_tensorboard_and_report(clean, capsys):
    evals = _evals(clean)
    assert [r["step"] for r in evals] == [4, 8, 12]
    losses = [r["eval_loss"] for r in evals]
    assert losses[0] > losses[1] > losses[2], losses
    assert all(r["eval_tokens"] > 0 and r["eval_batches"] == 2 and r["eval_time_s"] > 0 for r in evals)
    steps = [r for r in metrics(clean) if "kind" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), "eval rows leave one step row per step"

    assert _tensorboard_scalars(clean / "tensorboard", "eval/loss") == [
        (r["step"], pytest.approx(r["eval_loss"], rel=1e-6)) for r in evals
    ]

    from trainer.report import main as report_main

    assert report_main([str(clean)]) == 0
    out = capsys.readouterr().out
    assert f"final eval loss   {losses[-1]:.4f} (step 12)" in out and "eval " in out
    assert (clean / "report.png").stat().st_size > 10_000
    goodput = [e for e in events(clean) if e["event"] == "goodput"][-1]
    assert goodput["badput_s"]["eval"] > 0


def test_a_run_that_loses_a_slice_evaluates_to_the_same_losses_and_re_evaluates_only_retrained_steps(
    clean, tmp_path
):
    # Snapshots at 3, 6, 9; slice 1 dies before step 9 runs: the run goes back to step 6 and trains
    # 7 and 8 again, so step 8 is evaluated again; step 4's eval is never repeated.
    proc = run_cli(tmp_path, "el", *EVAL, "snapshot_period=3", "fault_schedule=step=9,slice=1,down_s=0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "el"
    assert [e["source"] for e in events(run) if e["event"] == "attempt_start"] == ["init", "snapshot:6"]
    evals = _evals(run)
    assert [r["step"] for r in evals] == [4, 8, 8, 12]
    assert evals[1]["eval_loss"] == evals[2]["eval_loss"]
    clean_losses = {s: r["eval_loss"] for s, r in final_by_step(_evals(clean)).items()}
    elastic_losses = {s: r["eval_loss"] for s, r in final_by_step(evals).items()}
    assert elastic_losses == clean_losses, "pause-and-resume evaluates bit for bit like a clean run"


def test_an_eval_set_that_matches_no_shard_exits_2_before_any_compute(tmp_path):
    proc = run_cli(tmp_path, "bad", *EVAL, f"grain_eval_files={tmp_path / 'missing-*.arrayrecord'}")
    assert proc.returncode == 2
    assert "grain_eval_files=" in proc.stderr and proc.stdout.strip().splitlines()[-1] == "STATUS: data_error"
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_reaching_target_eval_loss_stops_early_with_exit_0_a_status_that_says_so_and_a_checkpoint(tmp_path):
    # The micro model starts near ln(512) = 6.2 on the synthetic stream: a target of 100 is met at once.
    proc = run_cli(tmp_path, "tg", "steps=8", "eval_interval=2", "eval_steps=1", "target_eval_loss=100", devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = proc.stdout.strip().splitlines()[-1]
    assert status.startswith("STATUS: target_eval_loss_reached step=2 eval_loss=")
    assert "<= target_eval_loss=100.0" in status
    run = tmp_path / "tg"
    assert (run / "checkpoints" / "2" / "commit_success.txt").exists()
    assert [e["status"] for e in events(run) if e["event"] == "finish"] == ["target_eval_loss_reached"]
    assert [r["step"] for r in metrics(run) if "kind" not in r] == [1, 2]
