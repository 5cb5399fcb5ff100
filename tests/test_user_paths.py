"""The trainer as users run it: a fresh working directory, no run name, relative, `~` and gs:// paths.

gs:// is a real GCS JSON API (fake-gcs-server, tests/gcs_server.py) that the CLI subprocess reaches through
environment variables alone, so the object-store code under test is the trainer's own, over gcsfs.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_harness import MICRO, cli_env

REPO = Path(__file__).resolve().parents[1]
# MICRO without a run name or output directory: the defaults are what is under test.
DATA = ["dataset_type=arrayrecord", "vocab_size=8192", "use_sft=true", "grain_worker_count=0"]

pytestmark = pytest.mark.slow


def train(cwd: Path, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    run_env = cli_env(1)
    run_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "trainer.train", "base.yml", *MICRO, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=run_env,
        timeout=timeout,
    )


def status(proc) -> str:
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_fresh_directory_trains_with_relative_defaults_and_the_same_command_resumes(tmp_path):
    first = train(tmp_path, "steps=3")
    assert (
        status(first) == f"STATUS: finished step=3 trained=3 run_dir={tmp_path / 'runs' / 'qwen3-tiny-synthetic'}"
    ), first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "qwen3-tiny-synthetic"
    assert (run_dir / "checkpoints" / "3" / "commit_success.txt").exists()
    assert "(new run;" in first.stdout
    again = train(tmp_path, "steps=3")
    assert status(again).startswith("STATUS: finished step=3 trained=0 (resumed at step 3"), again.stderr[-3000:]
    assert "(resuming from step 3;" in again.stdout
    assert [r["step"] for r in records(run_dir / "metrics.jsonl")] == [1, 2, 3], "the rerun trained again"
    longer = train(tmp_path, "steps=5")
    assert [r["step"] for r in records(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5], longer.stderr[-3000:]


def test_output_under_home_and_a_relative_load_path(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    base = train(tmp_path, "steps=2", "base_output_directory=~/exp", env={"HOME": str(home)})
    assert status(base).startswith("STATUS: finished step=2"), base.stderr[-3000:]
    ckpt = home / "exp" / "qwen3-tiny-synthetic" / "checkpoints" / "2"
    assert (ckpt / "commit_success.txt").exists()
    os.symlink(home / "exp", tmp_path / "exp")
    tuned = train(
        tmp_path,
        "steps=2",
        "run_name=tuned",
        "load_parameters_path=exp/qwen3-tiny-synthetic/checkpoints/2",
        "base_output_directory=out",
    )
    assert status(tuned).startswith("STATUS: finished step=2"), tuned.stderr[-3000:]
    starts = [e for e in records(tmp_path / "out" / "tuned" / "events.jsonl") if e["event"] == "attempt_start"]
    assert [e["source"] for e in starts] == ["load_parameters_path"]


@pytest.mark.parametrize("key", ["load_parameters_path", "load_full_state_path"])
def test_a_missing_load_path_exits_2_before_compiling_and_writes_nothing(tmp_path, key):
    proc = train(tmp_path, f"{key}=ckpt/nothing-here", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert status(proc) == "STATUS: input_error"
    assert f"{key} {tmp_path / 'ckpt' / 'nothing-here'} does not exist" in proc.stderr
    assert "compile" not in proc.stderr.lower()
    assert not (tmp_path / "runs").exists()


def test_a_load_path_of_another_model_shape_exits_2(tmp_path):
    base = train(tmp_path, "steps=1", "run_name=small")
    assert status(base).startswith("STATUS: finished"), base.stderr[-3000:]
    proc = train(tmp_path, "run_name=big", "base_emb_dim=128", "load_parameters_path=runs/small/checkpoints/1")
    assert proc.returncode == 2 and "does not match the model config: embed_tokens is [512, 64]" in proc.stderr, (
        proc.stderr[-2000:]
    )
    assert not (tmp_path / "runs" / "big").exists()


def test_resuming_a_run_with_another_model_shape_exits_2_naming_the_fix(tmp_path):
    base = train(tmp_path, "steps=1")
    assert status(base).startswith("STATUS: finished"), base.stderr[-3000:]
    proc = train(tmp_path, "steps=2", "base_num_decoder_layers=3")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "does not match it" in proc.stderr and "base_num_decoder_layers (checkpoint 2, now 3)" in proc.stderr
    assert "run_name=" in proc.stderr


def test_relative_data_and_tokenizer_paths_a_glob_over_a_prepared_directory_and_the_directory_itself(tmp_path):
    shutil.copytree(REPO / "data" / "fc_sample", tmp_path / "mydata")
    (tmp_path / "tok").mkdir()
    shutil.copy(REPO / "data" / "tokenizer" / "fc_sp8k.model", tmp_path / "tok")
    proc = train(tmp_path, "steps=2", *DATA, "grain_train_files=mydata/*", "tokenizer_path=tok/fc_sp8k.model")
    assert (
        status(proc) == f"STATUS: finished step=2 trained=2 run_dir={tmp_path / 'runs' / 'qwen3-tiny-mydata'}"
    ), proc.stderr[-3000:]
    proc = train(tmp_path, "steps=3", *DATA, "grain_train_files=mydata", "tokenizer_path=tok/fc_sp8k.model")
    assert (
        status(proc) == f"STATUS: finished step=3 trained=1 run_dir={tmp_path / 'runs' / 'qwen3-tiny-mydata'}"
    ), proc.stderr[-3000:]


def test_data_that_matches_nothing_exits_2_and_leaves_no_run_directory(tmp_path):
    proc = train(tmp_path, *DATA, "grain_train_files=nowhere/*.arrayrecord", timeout=120)
    assert proc.returncode == 2 and "matches no shard" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


def _bucket_env(server, tmp_path: Path, pod: str) -> dict:
    """A pod: the GCS server, and a local mirror of its own (a fresh node has an empty one)."""
    return {
        **server.env,
        "TRAINER_LOCAL_RUN_ROOT": str(tmp_path / pod),
        "TRAINER_CACHE_DIR": str(tmp_path / pod / "cache"),
    }


def test_data_tokenizer_and_logs_on_an_object_store_and_a_restarted_pod_continues_the_logs(gcs_server, tmp_path):
    bkt = gcs_server.new_bucket("paths")
    gcs_server.upload_tree(REPO / "data" / "fc_sample", bkt, "data")
    gcs_server.write(bkt, "tok/fc_sp8k.model", (REPO / "data" / "tokenizer" / "fc_sp8k.model").read_bytes())
    args = [
        "steps=2",
        *DATA,
        f"grain_train_files=gs://{bkt}/data/*",
        f"tokenizer_path=gs://{bkt}/tok/fc_sp8k.model",
        f"base_output_directory=gs://{bkt}/runs",
        "enable_checkpointing=false",
    ]
    first = train(tmp_path, *args, env=_bucket_env(gcs_server, tmp_path, "pod-a"))
    assert status(first) == f"STATUS: finished step=2 trained=2 run_dir=gs://{bkt}/runs/qwen3-tiny-data", (
        first.stderr[-3000:]
    )

    def remote(name: str) -> list[dict]:
        return [json.loads(line) for line in gcs_server.read(bkt, f"runs/qwen3-tiny-data/{name}").splitlines()]

    assert [r["step"] for r in remote("metrics.jsonl")] == [1, 2]
    second = train(tmp_path, *args, env=_bucket_env(gcs_server, tmp_path, "pod-b"))
    assert status(second).startswith("STATUS: finished step=2"), second.stderr[-3000:]
    assert [r["step"] for r in remote("metrics.jsonl")] == [1, 2, 1, 2], "the second pod replaced the logs"
    events = remote("events.jsonl")
    assert [e["event"] for e in events].count("start") == 2
    assert len({e["pid"] for e in events if e["event"] == "start"}) == 2


def test_a_missing_object_store_load_path_exits_2(gcs_server, tmp_path):
    bkt = gcs_server.new_bucket("paths")
    proc = train(
        tmp_path,
        f"load_parameters_path=gs://{bkt}/ckpt/none",
        env=_bucket_env(gcs_server, tmp_path, "pod"),
        timeout=120,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr[-2000:]
