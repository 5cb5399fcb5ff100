"""The tables the benchmarks record for the docs, built from made-up figures: a wrong column or row would
otherwise show only when a benchmark runs for real (smoke runs record nothing)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _benchmark(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is not a package; its modules import cli_runs, records)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _column(model: str, tier: str, **figures) -> dict:
    return {
        "model": model,
        "tier": tier,
        "checkpoint_period": 100,
        "save_every": 20,
        "steps": 65,
        "extra": [],
        "baseline_step_time_s": 0.36,
        "median_loop_blocked_per_save_s": 0.034,
        "median_of_which_waiting_for_the_step_s": 0.0002 if tier == "persistent" else None,
        "median_async_save_s": 0.76,
        "extra_step_time_per_save_s": [0.4, 0.43, 0.43],
        "step_time_overhead_at_period": 0.0119,
        "checkpoint_bytes": 138_000_000,
        "restore_s": 0.29,
        "restore_mb_per_s": 475.9,
        "disk_write_mb_per_s_fsync": 638.0,
        "disk_read_mb_per_s": 10_000.0,
        **figures,
    }


def test_checkpoint_overhead_has_a_column_per_model_and_the_shared_tier_in_the_corner():
    co = _benchmark("checkpoint_overhead")
    lines = co.table([_column("qwen3-tiny", "persistent"), _column("qwen3-mini", "persistent")]).splitlines()
    assert lines[0] == "| persistent tier only, a save every 20 steps, 65 steps | qwen3-tiny | qwen3-mini |"
    overhead = next(line for line in lines if "overhead at period 100" in line)
    assert overhead.endswith("| **1.2%** | **1.2%** |")
    assert "| 34.0 ms (0.2 ms) |" in lines[3] and not any("A/B" in line for line in lines)
    assert co.record_id(["persistent"]) == "checkpoint_overhead"


def test_checkpoint_overhead_has_a_column_per_tier_and_the_model_and_trainer_arguments_in_the_corner():
    co = _benchmark("checkpoint_overhead")
    extra = {"extra": ["checkpoint_compression=false"], "ab_step_time_overhead": -0.017}
    cols = [_column("qwen3-tiny", tier, **extra) for tier in ("local", "local-wait", "persistent")]
    lines = co.table(cols).splitlines()
    assert lines[0] == (
        "| qwen3-tiny, a save every 20 steps, 65 steps, checkpoint_compression=false | local tier (default) | "
        "local tier, `local_checkpoint_wait_for_write=true` | persistent tier only |"
    )
    assert "| 34.0 ms (—) | 34.0 ms (—) | 34.0 ms (0.2 ms) |" in lines[3]
    assert lines[-1].endswith("| -1.7% | -1.7% | -1.7% |")
    assert co.record_id(["local", "local-wait", "persistent"]) == "checkpoint_overhead-tiers"


def test_process_loss_has_a_column_per_setting():
    pl = _benchmark("process_loss")
    setting = {
        "kills_at_steps": [31, 143],
        "steps_lost_per_kill": [31, 43],
        "mean_steps_lost": 37.0,
        "max_steps_lost": 43,
        "median_restore_s_by_source": {"checkpoint": 0.49},
        "median_start_to_first_step_s": 7.1,
    }
    local = setting | {"steps_lost_per_kill": [1, 3], "mean_steps_lost": 2.0, "max_steps_lost": 3}
    out = {"model": "qwen3-tiny", "max_target_length": 256, "steps": 300, "checkpoint_period": 100}
    out |= {"local_period": 10, "persistent_only": setting, "with_local_tier": local}
    lines = pl.table(out).splitlines()
    assert lines[0].endswith("| persistent tier only | persistent + local tier |")
    assert (
        lines[3]
        == "| steps lost per kill -9 at steps 31, 143 | 31, 43 (mean 37.0, max 43) | 1, 3 (mean 2.0, max 3) |"
    )
    assert "| 0.49 s (checkpoint) |" in lines[2]


def test_attention_comparison_has_a_row_per_length_and_says_what_did_not_run():
    am = _benchmark("attention_memory")
    rows = [
        {
            "attention": a,
            "length": n,
            "compiled_mib": m,
            "temp_mib": m,
            "rss_mib": 500.0,
            "step_s": s,
            "compile_s": 3.0,
        }
        for a, n, m, s in [
            ("dot_product", 1024, 480.0, 20.7),
            ("flash", 1024, 480.0, 16.7),
            ("flash", 16384, 2400.0, None),
        ]
    ]
    speed = [{"length": 1024, "steps": 4, "dot_product": 20.0, "flash": 16.0, "ratio": 0.8}]
    assert "| flash | 16384 | 2400 | 2400 | 500 | not run | 3.0 |" in am.memory_table(rows)
    lines = am.comparison_table(rows, speed).splitlines()
    assert lines[2:] == [
        "| 1024 | 1.00× | 4 | 20.000 | 16.000 | **0.80×** |",
        "| 16384 | not compiled | not run | not run | not run | not run |",
    ]


@pytest.mark.parametrize("share, error", [(0.7014, "+0.0014"), (0.6932, "-0.0068")])
def test_mixture_proportions_has_a_row_per_case(share, error):
    mp = _benchmark("mixture_proportions")
    row = {"weight": 0.7, "steps": 200, "rows": 8, "documents": 2880, "share_of_a": share}
    assert mp.table([row]).splitlines()[2] == f"| 0.70 | 200 x 8 | 2880 | {share:.4f} | {error} |"
