"""The tables the benchmarks record for the docs, built from made-up figures: a wrong column or row would
otherwise show only when a benchmark runs for real (smoke runs record nothing)."""

from __future__ import annotations

import importlib.util
import json
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


def _planner_row(period: int, measured: float, predicted: float) -> dict:
    return {
        "snapshot_period": period,
        "step_s": 0.0104,
        "failures": 24,
        "expected_failures": 28.9,
        "goodput_measured": measured,
        "goodput_predicted": predicted,
        "goodput_monte_carlo": predicted,
        "after_startup_measured": 0.958,
        "after_startup_predicted": 0.954,
        "badput_measured_s": {"startup_compile": 5.0, "wasted_progress": 0.9, "eval": 0.0},
        "badput_predicted_s": {"startup_compile": 5.0, "wasted_progress": 1.1, "eval": 0.0},
    }


def test_goodput_planner_ranks_the_settings_and_has_a_row_per_setting():
    gp = _benchmark("goodput_planner")
    rows = [_planner_row(10, 0.823, 0.820), _planner_row(100, 0.746, 0.740)]
    out = {"steps": 8000, "rate": 0.35, "seed": 1, "rows": rows}
    assert gp.judge(rows, tolerance=5.0) == {"within_tolerance": True, "ranking_agrees": True}
    lines = gp.validation_table(out).splitlines()
    assert lines[0].startswith("| snapshot_period (8000 steps, failures at 0.35/s, seed 1) | step | failures |")
    assert lines[2] == "| 10 | 10.4 ms | 24 | 28.9 | 82.3 | 82.0 | 82.0 | -0.3 | 95.8 | 95.4 | 1 / 1 |"
    assert lines[3].endswith("| -0.6 | 95.8 | 95.4 | 2 / 2 |")
    badput = gp.badput_table(out, ("startup_compile", "wasted_progress", "eval")).splitlines()
    assert badput[0] == "| snapshot_period (seconds: measured / predicted) | startup_compile | wasted_progress |"
    assert badput[2] == "| 10 | 5.0 / 5.0 | 0.9 / 1.1 |"


def test_goodput_planner_fails_a_wrong_ranking_or_a_large_error():
    gp = _benchmark("goodput_planner")
    swapped = [_planner_row(10, 0.823, 0.70), _planner_row(100, 0.746, 0.75)]
    assert gp.judge(swapped, tolerance=5.0) == {"within_tolerance": False, "ranking_agrees": False}


def test_train_throughput_without_hugepages_renders_its_records_table_as_recorded():
    tt = _benchmark("train_throughput")
    record = json.loads((BENCHMARKS / "records" / "train_throughput-qwen3-tiny.json").read_text())
    runs = record["figures"]
    assert tt.table(runs, runs[0]["matmul_peak_gflops"]) == record["tables"]["steps"]
    assert tt.record_id("qwen3-tiny", None) == "train_throughput-qwen3-tiny"


def test_train_throughput_has_a_column_per_hugepages_setting():
    tt = _benchmark("train_throughput")
    run = {
        "devices": 1,
        "global_batch_size": 2,
        "median_step_time_s": 0.444,
        "median_tokens_per_s": 1152.0,
        "model_gflops_per_device": 120.0,
        "process_start_to_first_step_s_cold_cache": 12.5,
        "process_start_to_first_step_s_warm_cache": 4.7,
    }
    lines = tt.table([run | {"hugepages": "on"}, run | {"hugepages": "off"}], None).splitlines()
    assert lines[0] == "| 1 device | huge pages on | huge pages off |"
    assert lines[3] == "| median step time | 0.444 s | 0.444 s |"
    two = [run | {"hugepages": h, "devices": d} for d in (1, 2) for h in ("on", "off")]
    assert tt.table(two, None).splitlines()[0] == (
        "| | 1 device, huge pages on | 1 device, huge pages off | 2 devices, huge pages on | "
        "2 devices, huge pages off |"
    )
    assert tt.record_id("qwen3-tiny", ["on", "off"]) == "train_throughput-hugepages"


def test_hugepage_env_turns_the_image_tunable_off_and_leaves_on_to_the_cli():
    from cli_runs import hugepage_env

    image = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "PATH": "/bin"}
    off = hugepage_env(dict(image), "off")
    assert off["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0"
    assert off["TRAINER_HUGEPAGE_MALLOC"] == "0"
    on = hugepage_env({"TRAINER_HUGEPAGE_MALLOC": "0", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "on")
    assert on == {}
    with pytest.raises(ValueError):
        hugepage_env({}, "maybe")


def _event(name: str, t: float, **fields) -> dict:
    return {"event": name, "time": t, **fields}


def test_elastic_recovery_phases_add_up_to_kill_to_first_step():
    er = _benchmark("elastic_recovery")
    failure = [
        _event("snapshot_taken", 99.0, step=10),
        _event("slice_killed", 100.0, slice=1, step=11),
        _event("slice_down_detected", 100.007, teardown_s=0.011),
        _event("wait_start", 100.019),
        _event("wait_end", 100.021),
        _event("compile_cached", 100.0215),
        _event("restore_start", 100.0255),
        _event("restore_end", 100.0885, source="snapshot:10"),
        _event("attempt_start", 100.089),
        _event("first_step_after_recovery", 100.85),
    ]
    unfinished = [_event("slice_killed", 200.0), _event("slice_down_detected", 200.01, teardown_s=0.01)]
    found = er.recovery_phases(failure + unfinished)
    assert len(found) == 1 and found[0]["source"] == "snapshot:10"
    seconds = found[0]["seconds"]
    assert seconds["detect"] == 0.007 and seconds["teardown"] == 0.011 and seconds["wait"] == 0.003
    assert seconds["total"] == 0.85
    parts = [v for k, v in seconds.items() if k != "total"]
    assert sum(parts) == pytest.approx(seconds["total"], abs=1e-3)


def test_elastic_recovery_restart_phases_are_the_new_processs_events():
    er = _benchmark("elastic_recovery")
    events = [
        _event("restore_end", 10.0, source="init"),  # the killed process's
        _event("start", 52.0),
        _event("compile_done", 53.1, seconds=0.9),
        _event("restore_start", 53.11),
        _event("restore_end", 53.5, source="checkpoint:20"),
    ]
    found = er.restart_phases(events, killed_at=50.0, first_step_at=54.5)
    assert found["source"] == "checkpoint:20"
    assert found["seconds"] == {
        "process_start": 2.0,
        "plan": 1.1,
        "open_checkpointer": 0.01,
        "restore": 0.39,
        "first_step": 1.0,
        "total": 4.5,
    }
    assert er.restart_phases(events[:2], killed_at=50.0, first_step_at=54.5) is None


def test_elastic_recovery_phases_table_has_a_row_per_phase_and_a_column_per_kind():
    er = _benchmark("elastic_recovery")
    pr = {"detect": 0.007, "teardown": 0.011, "wait": 0.003, "plan": 0.0004, "open_checkpointer": 0.004}
    pr |= {"restore": 0.063, "first_step": 0.76, "total": 0.85}
    restart = {"process_start": 1.8, "plan": 1.0, "open_checkpointer": 0.01, "restore": 0.4, "first_step": 1.0}
    restart |= {"total": 4.21}
    out = {"model": "qwen3-tiny", "max_target_length": 128, "hugepages": "off"}
    out["phases"] = {
        "pause_resume": [{"seconds": pr, "source": "snapshot:10"}] * 2,
        "full_restart": [{"seconds": restart, "source": "checkpoint:20"}],
    }
    lines = er.phases_table(out).splitlines()
    assert lines[0] == (
        "| qwen3-tiny, sequence 128, 3 virtual slices, huge pages off: one recovery by phase (each recovery's "
        "value) | pause-and-resume, immediate replacement: 2 failures | full process restart, warm compile "
        "cache: 1 kill |"
    )
    assert len(lines) == 2 + len(er.PHASES)
    assert lines[2] == "| detection: kill → the error reaches the train function | 7.0, 7.0 ms | — |"
    restore = next(line for line in lines if line.startswith("| restoring"))
    assert restore.endswith(
        "| 63.0, 63.0 ms (from snapshot) | 0.40 s (from checkpoint) |".replace("0.40 s", "400 ms")
    )
    assert lines[-1].endswith("| 850, 850 ms | 4.21 s |")
    assert er.record_id("on") == "elastic_recovery" and er.record_id("off") == "elastic_recovery-nohugepages"


def test_the_corpus_is_the_interpreters_own_text_whatever_else_is_installed(tmp_path, monkeypatch):
    """The records' corpus must not change when an extra is installed: its files come from the standard
    library alone, and a package added to site-packages leaves the file list and fingerprint unchanged."""
    import sysconfig

    corpus = _benchmark("corpus")
    before = corpus.text_inputs()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert before and all(Path(f).resolve().is_relative_to(stdlib) for f in before)
    assert any(f.endswith("topics.py") for f in before)  # the English reference prose is part of it

    site = tmp_path / "site-packages"
    (site / "extra-1.0.dist-info").mkdir(parents=True)
    (site / "extra-1.0.dist-info" / "METADATA").write_text("Name: extra\n\nAn extra package's description.\n")
    (site / "extra-1.0.dist-info" / "LICENSE").write_text("MIT\n")
    paths = dict(sysconfig.get_paths(), purelib=str(site), platlib=str(site))
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: paths)
    after = corpus.text_inputs()
    assert after == before
    assert corpus.fingerprint(after) == corpus.fingerprint(before)


def test_the_corpus_fingerprint_tells_apart_any_change_of_text(tmp_path):
    corpus = _benchmark("corpus")
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("one\n")
    b.write_text("two\n")
    first = corpus.fingerprint([str(a), str(b)])
    assert corpus.fingerprint([str(b), str(a)]) != first  # the order is part of the text
    b.write_text("two.\n")
    assert corpus.fingerprint([str(a), str(b)]) != first


def test_lora_vs_full_has_a_column_per_model_and_mode_and_the_compile_table_says_what_fits():
    lvf = _benchmark("lora_vs_full")
    run = {"steps": 30, "extra": [], "step_s": 0.5, "peak_rss_bytes": 900e6, "restore_s": 0.25}
    cols = [
        {"model": "qwen3-tiny", "mode": "full", "rank": 0, "trainable_bytes": 46e6, "optimizer_bytes": 92e6,
         "checkpoint_bytes": 120e6, **run},
        {"model": "qwen3-tiny", "mode": "lora", "rank": 8, "trainable_bytes": 0.6e6, "optimizer_bytes": 1.2e6,
         "checkpoint_bytes": 1.9e6, **run},
    ]  # fmt: skip
    lines = lvf.training_table(cols).splitlines()
    header = "| SFT on data/fc_sample, 30 steps, one CPU device | qwen3-tiny, full | qwen3-tiny, LoRA r=8 |"
    assert lines[0] == header
    assert "| optimizer state (AdamW) | 92.0 MB | 1.2 MB |" in lines
    gib = 1 << 30
    cases = [
        {"mode": mode, "model": "qwen3-8b", "target": "v5e-16", "hbm_bytes": 16 * gib, "params_bytes": p * gib,
         "optimizer_bytes": 2 * p * gib, "arguments_bytes": a * gib, "temporaries_bytes": t * gib,
         "total_bytes": (a + t) * gib, "fits": a + t < 16}
        for mode, p, a, t in (("full", 1.91, 5.8, 14.0), ("lora", 0.02, 2.0, 9.0))
    ]  # fmt: skip
    table = lvf.compile_table(cases).splitlines()
    assert table[0] == "| qwen3-8b on one v5e-16, per chip (HBM 16.00 GiB) | full | LoRA |"
    assert "| **compiler's total** (refused: what it asked for) | **19.80 GiB** | **11.00 GiB** |" in table
    refused = dict(cases[0], arguments_bytes=None, temporaries_bytes=None)  # no breakdown from a refusal
    assert "| temporaries | — | 9.00 GiB |" in lvf.compile_table([refused, cases[1]]).splitlines()
    assert table[-1] == "| fits | **no** | yes |"
