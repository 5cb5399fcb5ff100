"""Weighted data mixtures (`grain_train_files="a,0.7;b,0.3"`): parsing, realised proportions, exact resume
(saved state, other loader-process counts, a changed global batch, kill -9 of the real CLI), bad weights.

Source A's records read "recA0007 ...", source B's "recB0007 ...", so a test can tell which source and
record every packed document came from. B's documents are longer than A's on purpose: a mixture must
keep its proportions in documents even when one source fills rows faster.

Stated tolerance: over a run of n >= 500 documents the share of each source is within 0.02 of its weight
(the order is exact to +-1 document per 256-example window; what remains is the part-read last window
and the rows' ragged ends).
"""

from __future__ import annotations

import collections
import json
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from array_record.python import array_record_module
from cli_harness import assert_same_data_order, assert_same_params, cli_env, command, metrics, run_cli
from helpers import loader_processes

from trainer.config.mixture import Source, parse_mixture
from trainer.config.schema import DataConfig
from trainer.data.batch import BATCH_KEYS, fingerprint
from trainer.data.errors import DataError
from trainer.data.grain_pipeline import make_arrayrecord_iterator
from trainer.data.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizer" / "fc_sp8k.model"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TOKENIZER)


def write_source(path: Path, tag: str, n: int, words: int) -> str:
    writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
    for i in range(n):
        writer.write(json.dumps({"text": f"rec{tag}{i:04d} " + " ".join(["alpha"] * words)}).encode())
    writer.close()
    return str(path)


def two_sources(tmp: Path, a: int = 60, b: int = 60) -> tuple[str, str]:
    return write_source(tmp / "a.arrayrecord", "A", a, 1), write_source(tmp / "b.arrayrecord", "B", b, 9)


def config(files: str, **overrides) -> DataConfig:
    base = dict(
        dataset_type="arrayrecord",
        grain_train_files=files,
        tokenizer_path=str(TOKENIZER),
        max_target_length=32,
        grain_worker_count=0,
    )
    return DataConfig(**{**base, **overrides})


def documents(batch: dict, tok: Tokenizer) -> list[tuple[str, int]]:
    """(source tag, record number) of every document in the batch."""
    out = []
    for row in range(batch["inputs"].shape[0]):
        seg = batch["segment_ids"][row]
        for s in range(1, seg.max() + 1):
            text = tok.decode(batch["inputs"][row][seg == s])
            out += [(t, int(n)) for t, n in re.findall(r"rec([AB])(\d{4})", text)]
    return out


# ---- parsing ------------------------------------------------------------------------------------


def test_a_mixture_is_parsed_into_normalised_weights_and_a_zero_weight_turns_a_source_off():
    assert parse_mixture("a/*,3;b/*,1") == [Source("a/*", 0.75), Source("b/*", 0.25)]
    assert parse_mixture("a/*,x/*,1;b/*,0;") == [Source("a/*,x/*", 1.0)]
    assert parse_mixture("a/*,b/*") == [Source("a/*,b/*", 1.0)], "without ';' commas separate globs"


@pytest.mark.parametrize(
    "text, message",
    [
        ("a/*,0.7;b/*,-0.3", "entry 'b/*,-0.3': weight -0.3 is negative"),
        ("a/*,0;b/*,0", "every weight is 0"),
        ("a/*,0.7;b/*,lots", "entry 'b/*,lots' is not '<glob>,<weight>'"),
        ("a/*,0.7;b/*", "entry 'b/*' is not '<glob>,<weight>'"),
        ("a/*,0.7;b/*,nan", "entry 'b/*,nan'"),
    ],
)
def test_a_bad_weight_is_a_data_error_naming_the_entry(text, message):
    with pytest.raises(DataError) as info:
        parse_mixture(text)
    assert message in str(info.value)


def test_cli_exits_2_naming_the_bad_entry_before_any_compute(tmp_path):
    a, b = two_sources(tmp_path, 5, 5)
    mixture = f"grain_train_files={a},0.5;{b},-1"
    proc = run_cli(tmp_path, "bad", "dataset_type=arrayrecord", "vocab_size=8192", mixture)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"grain_train_files entry '{b},-1': weight -1 is negative" in proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "STATUS: config_error"
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


# ---- the order ----------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_a", [0.7, 0.5])
def test_realised_proportions_match_the_weights(tmp_path, tok, weight_a):
    a, b = two_sources(tmp_path)
    it = make_arrayrecord_iterator(
        config(f"{a},{weight_a};{b},{1 - weight_a}"), vocab_size=32768, global_batch_size=4
    )
    counts = collections.Counter(tag for _ in range(120) for tag, _ in documents(next(it), tok))
    total = counts["A"] + counts["B"]
    assert total >= 500
    assert abs(counts["A"] / total - weight_a) <= 0.02, counts


def test_every_row_stream_reads_both_sources_even_when_the_weights_are_equal(tmp_path, tok):
    """Grain's 0.5/0.5 interleave is ABAB...; without the window shuffle row j of an even-sized batch
    would read one source only, for the whole run."""
    a, b = two_sources(tmp_path)
    it = make_arrayrecord_iterator(config(f"{a},1;{b},1"), vocab_size=32768, global_batch_size=4)
    rows = [set() for _ in range(4)]
    for _ in range(10):
        batch = next(it)
        for r in range(4):
            rows[r] |= {tag for tag, _ in documents({k: v[r : r + 1] for k, v in batch.items()}, tok)}
    assert all(tags == {"A", "B"} for tags in rows), rows


def test_a_mixture_resumes_exactly_on_any_loader_process_count(tmp_path):
    a, b = two_sources(tmp_path)
    cfg = config(f"{a},0.7;{b},0.3")
    it = make_arrayrecord_iterator(cfg, vocab_size=32768, global_batch_size=4)
    reference = [next(it) for _ in range(9)]
    state, step = None, 0
    for processes in (1, 2, 4):
        loaders = loader_processes(cfg, processes, global_batch_size=4, state=state)
        for _ in range(3):
            parts = [next(loader) for loader in loaders]
            union = {k: np.concatenate([p[k] for p in parts]) for k in BATCH_KEYS}
            assert fingerprint(union) == fingerprint(reference[step]), f"step {step} on {processes} processes"
            step += 1
        states = [loader.get_state() for loader in loaders]
        assert all(s == states[0] for s in states)
        state = json.loads(json.dumps(states[0]))  # what a checkpoint stores


def test_a_changed_global_batch_repeats_no_document_of_either_source(tmp_path, tok):
    a, b = two_sources(tmp_path, 300, 300)
    cfg = config(f"{a},0.6;{b},0.4")
    it = make_arrayrecord_iterator(cfg, vocab_size=32768, global_batch_size=4)
    before = [d for _ in range(4) for d in documents(next(it), tok)]
    smaller = make_arrayrecord_iterator(cfg, vocab_size=32768, global_batch_size=2)
    smaller.set_state(it.get_state())
    after = [d for _ in range(4) for d in documents(next(smaller), tok)]
    assert {t for t, _ in after} == {"A", "B"}
    assert not set(before) & set(after)
    assert len(after) == len(set(after))


def test_one_epoch_ends_when_the_first_source_is_used_up_and_repeats_nothing(tmp_path, tok):
    a, b = two_sources(tmp_path, 256, 1024)
    it = make_arrayrecord_iterator(config(f"{a},0.5;{b},0.5", num_epoch=1), vocab_size=32768, global_batch_size=4)
    seen = [d for batch in it for d in documents(batch, tok)]
    assert len(seen) == len(set(seen)), "no document repeats within one epoch"
    assert sum(t == "A" for t, _ in seen) == 256 and sum(t == "B" for t, _ in seen) == 256
    with pytest.raises(StopIteration):
        next(it)


def test_resuming_with_other_weights_is_refused(tmp_path):
    a, b = two_sources(tmp_path, 5, 5)
    it = make_arrayrecord_iterator(config(f"{a},0.7;{b},0.3"), vocab_size=32768, global_batch_size=2)
    next(it)
    other = make_arrayrecord_iterator(config(f"{a},0.5;{b},0.5"), vocab_size=32768, global_batch_size=2)
    with pytest.raises(DataError, match="data mixture was .* resume with the grain_train_files it was saved with"):
        other.set_state(it.get_state())
    single = make_arrayrecord_iterator(config(f"{a},{b}"), vocab_size=32768, global_batch_size=2)
    with pytest.raises(DataError, match="mixture"):
        single.set_state(it.get_state())


# ---- the real CLI: kill -9 mid-run, restart, compare with an uninterrupted run --------------------

STEPS = 8


@pytest.mark.slow
def test_a_two_source_mixture_resumes_bitwise_after_kill_9(tmp_path, tok):
    a, b = two_sources(tmp_path, 40, 40)
    run = [
        f"steps={STEPS}",
        "checkpoint_period=2",
        "num_slices=1",
        "dataset_type=arrayrecord",
        "vocab_size=8192",
        "grain_worker_count=0",
        f"grain_train_files={a},0.7;{b},0.3",
    ]
    baseline = run_cli(tmp_path, "base", *run, devices=1)
    assert baseline.returncode == 0, baseline.stderr[-3000:]
    proc = subprocess.Popen(
        command(tmp_path, "k", *run), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=cli_env(1)
    )
    try:
        deadline = time.time() + 300  # a hang guard, not a speed claim
        path = tmp_path / "k" / "metrics.jsonl"
        while time.time() < deadline and proc.poll() is None:
            if path.exists() and len(metrics(tmp_path / "k")) >= 5:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the run finished before the kill point was reached"
    resumed = run_cli(tmp_path, "k", *run, devices=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step" in resumed.stdout + resumed.stderr
    assert_same_data_order(tmp_path / "k", tmp_path / "base", STEPS)
    assert_same_params(tmp_path / "k", tmp_path / "base")
