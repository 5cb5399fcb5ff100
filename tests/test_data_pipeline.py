"""The Grain/ArrayRecord training pipeline: packing, SFT masks, order, resume, re-sharding, errors.

Data is tiny and made here (records "rec0007 ..." so a test can tell which record a row holds); the
tokenizer is the bundled one. Worker processes (a spawn each) are used in two tests only.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from array_record.python import array_record_module
from helpers import loader_processes

from trainer.config.schema import DataConfig
from trainer.data.batch import BATCH_KEYS, check_batch, fingerprint
from trainer.data.errors import DataError
from trainer.data.grain_pipeline import make_arrayrecord_iterator
from trainer.data.packing import pack_row
from trainer.data.shards import prepare
from trainer.data.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
BUNDLED_TOKENIZER = REPO / "data" / "tokenizer" / "fc_sp8k.model"
WORDS = "alpha beta gamma delta weather paris london function call tool result answer".split()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(BUNDLED_TOKENIZER)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_shards(tmp: Path, records: list[dict], shards: int = 3) -> str:
    prepare([str(write_jsonl(tmp / "in.jsonl", records))], tmp / "shards", shards, progress_stream=io.StringIO())
    return str(tmp / "shards" / "*.arrayrecord")


def text_records(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"text": f"rec{i:04d} " + " ".join(rng.choice(WORDS, size=int(rng.integers(1, 8))))} for i in range(n)]


def chat_records(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "system", "content": "You can call tools."},
                {"role": "user", "content": f"What is the weather in city {i}?"},
                {
                    "role": "assistant",
                    "content": f'<tool_call>{{"name": "w", "arguments": {{"c": {i}}}}}</tool_call>',
                },
                {"role": "tool", "content": f'{{"temp": {i % 30}}}'},
                {"role": "assistant", "content": f"It is {i % 30} degrees in city {i}."},
            ]
        }
        for i in range(n)
    ]


def config(files: str, **overrides) -> DataConfig:
    base = dict(
        dataset_type="arrayrecord",
        grain_train_files=files,
        tokenizer_path=str(BUNDLED_TOKENIZER),
        max_target_length=32,
        grain_worker_count=0,
    )
    return DataConfig(**{**base, **overrides})


def batches(cfg: DataConfig, steps: int, *, rows: int = 4, **kw) -> list[dict]:
    it = make_arrayrecord_iterator(cfg, vocab_size=32768, global_batch_size=rows, **kw)
    out = [next(it) for _ in range(steps)]
    it.close()
    return out


def segments(batch: dict, row: int):
    """(inputs, targets, loss_mask, positions) of each document in one row."""
    seg = batch["segment_ids"][row]
    for s in range(1, seg.max() + 1):
        where = seg == s
        yield (
            batch["inputs"][row][where],
            batch["targets"][row][where],
            batch["loss_mask"][row][where],
            batch["positions"][row][where],
        )


def record_ids(batch: dict, tok: Tokenizer) -> list[int]:
    """The rec#### of every document in the batch, row by row."""
    ids = []
    for row in range(batch["inputs"].shape[0]):
        for inputs, *_ in segments(batch, row):
            ids += [int(m) for m in re.findall(r"rec(\d{4})", tok.decode(inputs))]
    return ids


# ---- packing ----------------------------------------------------------------------------------


def test_pack_row_keeps_targets_inside_each_document():
    docs = [(np.array([5, 6, 7, 2]), np.ones(4, np.int32)), (np.array([8, 9, 2]), np.ones(3, np.int32))]
    row = pack_row(docs, 8)
    assert row["inputs"].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert row["targets"].tolist() == [6, 7, 2, 9, 2, 0, 0, 0]
    assert row["segment_ids"].tolist() == [1, 1, 1, 2, 2, 0, 0, 0]
    assert row["positions"].tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert row["loss_mask"].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]


def test_packed_batches_never_cross_documents_and_positions_restart(tmp_path, tok):
    files = make_shards(tmp_path, text_records(60))
    for batch in batches(config(files), 4):
        check_batch(batch, 4, 32)
        for row in range(4):
            seg = batch["segment_ids"][row]
            used = seg > 0
            assert used.sum() == np.argmin(np.append(used, False)), "padding only at the end of a row"
            assert (batch["loss_mask"][row][~used] == 0).all()
            docs = list(segments(batch, row))
            assert len(docs) >= 1
            for inputs, targets, mask, positions in docs:
                assert positions.tolist() == list(range(len(inputs)))
                assert targets[:-1].tolist() == inputs[1:].tolist()  # next token of the same document
                assert targets[-1] == tok.eos_id  # each document ends by predicting EOS
                assert mask.all()
                assert tok.decode(inputs).startswith("rec")


def test_documents_longer_than_a_row_are_truncated_not_split(tmp_path, tok):
    files = make_shards(tmp_path, [{"text": "rec0000 " + " ".join(["alpha"] * 80)}])
    batch = batches(config(files, max_target_length=16), 2, rows=1)[1]
    assert batch["segment_ids"][0].tolist() == [1] * 16
    assert tok.decode(batch["inputs"][0]).startswith("rec0000")  # every row starts at the document start


def test_without_packing_each_row_holds_one_document(tmp_path):
    files = make_shards(tmp_path, text_records(20))
    for batch in batches(config(files, packing=False), 3):
        assert batch["segment_ids"].max(axis=1).tolist() == [1, 1, 1, 1]


# ---- SFT -----------------------------------------------------------------------------------------


def test_sft_loss_mask_covers_exactly_the_assistant_replies(tmp_path, tok):
    records = chat_records(12)
    files = make_shards(tmp_path, records, shards=2)
    cfg = config(files, use_sft=True, packing=False, max_target_length=160)
    it = make_arrayrecord_iterator(cfg, vocab_size=32768, global_batch_size=2)
    for _ in range(6):
        batch = next(it)
        for row in range(2):
            ((inputs, targets, mask, _),) = segments(batch, row)
            city = int(re.search(r"city (\d+)\?", tok.decode(inputs)).group(1))
            replies = [m["content"] for m in records[city]["messages"] if m["role"] == "assistant"]
            trained = np.split(targets, np.flatnonzero(np.diff(mask)) + 1)
            spans = [
                tok.decode(span)
                for span, m in zip(trained, np.split(mask, np.flatnonzero(np.diff(mask)) + 1))
                if m[0] == 1
            ]
            assert spans == [reply + "<|im_end|>" for reply in replies]
            assert tok.decode(inputs).startswith("<|im_start|>system\nYou can call tools.<|im_end|>\n")


def test_sft_on_text_records_names_the_missing_messages_field(tmp_path):
    files = make_shards(tmp_path, text_records(5), shards=1)
    with pytest.raises(DataError, match="use_sft=true needs a 'messages' field"):
        make_arrayrecord_iterator(config(files, use_sft=True), vocab_size=32768, global_batch_size=2)


# ---- order, resume, re-sharding, workers, epochs ---------------------------------------------


def test_shuffle_is_deterministic_by_seed_and_differs_across_seeds(tmp_path):
    files = make_shards(tmp_path, text_records(80))
    fp = lambda seed: [fingerprint(b) for b in batches(config(files, data_shuffle_seed=seed), 3)]  # noqa: E731
    assert fp(7) == fp(7)
    assert fp(7) != fp(8)


def test_resume_from_saved_state_gives_the_same_following_batches(tmp_path):
    files = make_shards(tmp_path, text_records(50))
    cfg = config(files)
    uninterrupted = [fingerprint(b) for b in batches(cfg, 12)]
    it = make_arrayrecord_iterator(cfg, vocab_size=32768, global_batch_size=4)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    resumed = make_arrayrecord_iterator(cfg, vocab_size=32768, global_batch_size=4)
    resumed.set_state(state)
    assert [fingerprint(next(resumed)) for _ in range(7)] == uninterrupted[5:]
    assert len(json.dumps(state)) < 400


def test_resharding_4_to_2_to_4_loader_processes_keeps_every_global_batch(tmp_path, tok):
    files = make_shards(tmp_path, text_records(240))
    cfg = config(files)
    reference = batches(cfg, 9, rows=8)
    state, step, seen = None, 0, []
    for processes in (4, 2, 4):
        loaders = loader_processes(cfg, processes, global_batch_size=8, state=state)
        for _ in range(3):
            parts = [next(loader) for loader in loaders]
            assert all(p["inputs"].shape == (8 // processes, 32) for p in parts)
            union = {k: np.concatenate([p[k] for p in parts]) for k in BATCH_KEYS}
            for k in BATCH_KEYS:
                np.testing.assert_array_equal(union[k], reference[step][k], err_msg=f"step {step} {k}")
            seen += record_ids(union, tok)
            step += 1
        states = [loader.get_state() for loader in loaders]
        assert all(s == states[0] for s in states), "every process saves the same global state"
        state = json.loads(json.dumps(states[0]))
    assert len(seen) == len(set(seen)), "no example repeats inside the first epoch"
    assert len(seen) > 100


def test_worker_processes_do_not_change_batches_or_resume(tmp_path):
    files = make_shards(tmp_path, text_records(60))
    in_process = [fingerprint(b) for b in batches(config(files), 6)]
    it = make_arrayrecord_iterator(config(files, grain_worker_count=2), vocab_size=32768, global_batch_size=4)
    try:
        assert [fingerprint(next(it)) for _ in range(3)] == in_process[:3]
        state = it.get_state()
        assert [fingerprint(next(it)) for _ in range(3)] == in_process[3:]
        it.set_state(state)  # restarts the workers from the saved position
        assert [fingerprint(next(it)) for _ in range(3)] == in_process[3:]
    finally:
        it.close()


def test_one_epoch_yields_every_record_once_then_stops(tmp_path, tok):
    files = make_shards(tmp_path, text_records(30))
    it = make_arrayrecord_iterator(config(files, num_epoch=1), vocab_size=32768, global_batch_size=4)
    seen = [i for batch in it for i in record_ids(batch, tok)]
    assert sorted(seen) == list(range(30))
    with pytest.raises(StopIteration):
        next(it)


def test_a_changed_global_batch_resumes_without_repeating_examples(tmp_path, tok):
    files = make_shards(tmp_path, text_records(200))
    it = make_arrayrecord_iterator(config(files), vocab_size=32768, global_batch_size=4)
    before = [i for _ in range(4) for i in record_ids(next(it), tok)]
    smaller = make_arrayrecord_iterator(config(files), vocab_size=32768, global_batch_size=2)
    smaller.set_state(it.get_state())
    after = [i for _ in range(4) for i in record_ids(next(smaller), tok)]
    assert not set(before) & set(after)
    assert len(after) == len(set(after))


# ---- errors: DataError with the file/field and the fix, at construction --------------------------


def test_a_glob_matching_nothing_raises_data_error(tmp_path):
    with pytest.raises(DataError, match=r"matches no shard.*prepare_data"):
        make_arrayrecord_iterator(
            config(str(tmp_path / "nope" / "*.arrayrecord")), vocab_size=32768, global_batch_size=2
        )


def test_empty_grain_train_files_raises_data_error():
    with pytest.raises(DataError, match="needs grain_train_files"):
        make_arrayrecord_iterator(config(""), vocab_size=32768, global_batch_size=2)


def test_a_corrupt_shard_raises_data_error_naming_it(tmp_path):
    files = make_shards(tmp_path, text_records(10), shards=1)
    bad = tmp_path / "shards" / "zz-corrupt.arrayrecord"
    bad.write_bytes(b"not an array record file" * 100)
    with pytest.raises(DataError, match="zz-corrupt.arrayrecord"):
        make_arrayrecord_iterator(config(files), vocab_size=32768, global_batch_size=2)


def write_raw_shard(path: Path, records: list[dict]) -> str:
    writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
    for record in records:
        writer.write(json.dumps(record).encode())
    writer.close()
    return str(path)


def test_an_empty_dataset_raises_data_error(tmp_path):
    no_records = write_raw_shard(tmp_path / "none.arrayrecord", [])
    with pytest.raises(DataError, match="none.arrayrecord has no readable records"):
        make_arrayrecord_iterator(config(no_records), vocab_size=32768, global_batch_size=2)
    empty_texts = write_raw_shard(tmp_path / "blank.arrayrecord", [{"text": ""}] * 5)
    with pytest.raises(DataError, match="effectively empty"):
        make_arrayrecord_iterator(config(empty_texts), vocab_size=32768, global_batch_size=2)


def test_records_missing_the_field_raise_data_error_naming_field_and_file(tmp_path):
    path = write_raw_shard(tmp_path / "raw.arrayrecord", [{"body": "hello"}])
    with pytest.raises(DataError, match=r"raw.arrayrecord record 0: record has no 'text'.*text_field"):
        make_arrayrecord_iterator(config(path), vocab_size=32768, global_batch_size=2)
    assert batches(config(path, text_field="body"), 1, rows=1)[0]["loss_mask"].sum() > 0


def test_a_tokenizer_larger_than_the_model_vocab_raises_data_error(tmp_path):
    files = make_shards(tmp_path, text_records(5), shards=1)
    with pytest.raises(DataError, match=r"8192 tokens but the model's vocab_size is 4096"):
        make_arrayrecord_iterator(config(files), vocab_size=4096, global_batch_size=2)


def test_a_missing_tokenizer_raises_data_error(tmp_path):
    files = make_shards(tmp_path, text_records(5), shards=1)
    with pytest.raises(DataError, match="tokenizer_path='missing.model' not found"):
        make_arrayrecord_iterator(
            config(files, tokenizer_path="missing.model"), vocab_size=32768, global_batch_size=2
        )


def test_a_state_from_other_data_is_refused(tmp_path):
    files = make_shards(tmp_path, text_records(20))
    state = make_arrayrecord_iterator(config(files), vocab_size=32768, global_batch_size=2).get_state()
    other = make_arrayrecord_iterator(config(files, data_shuffle_seed=1), vocab_size=32768, global_batch_size=2)
    with pytest.raises(DataError, match="same grain_train_files and data_shuffle_seed"):
        other.set_state(state)
    with pytest.raises(DataError, match="another dataset_type"):
        other.set_state({"kind": "synthetic", "next_step": 3})


# ---- the bundled sample ------------------------------------------------------------------------


def test_bundled_sample_and_default_tokenizer_produce_sft_batches(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # relative defaults resolve against the repository too
    cfg = DataConfig(
        dataset_type="arrayrecord",
        grain_train_files="data/fc_sample/*.arrayrecord",
        use_sft=True,
        max_target_length=256,
        grain_worker_count=0,
    )
    for batch in batches(cfg, 2, rows=2):
        check_batch(batch, 2, 256)
        assert 0 < batch["loss_mask"].sum() < (batch["segment_ids"] > 0).sum()
        assert batch["inputs"].max() < 8192
    sizes = sum(p.stat().st_size for p in (REPO / "data").rglob("*") if p.is_file())
    assert sizes < 2 * 1024 * 1024


def test_a_hugging_face_tokenizer_json_works_for_sft(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(
        ["What is the weather in city", "It is degrees", "tool_call name arguments"] * 20,
        trainers.BpeTrainer(
            vocab_size=400,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        ),
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    files = make_shards(tmp_path, chat_records(6), shards=1)
    cfg = config(
        files,
        tokenizer_path=str(tmp_path / "tokenizer.json"),
        tokenizer_type="huggingface",
        use_sft=True,
        packing=False,
        max_target_length=200,
    )
    tok = Tokenizer(tmp_path / "tokenizer.json", "huggingface")
    batch = batches(cfg, 1, rows=2)[0]
    ((inputs, targets, mask, _),) = segments(batch, 0)
    text = tok.decode(inputs)
    city = int(re.search(r"city (\d+)\?", text).group(1))
    assert text.startswith("<|im_start|>system\n")
    assert tok.decode(targets[mask == 1]) == "".join(
        m["content"] + "<|im_end|>" for m in chat_records(6)[city]["messages"] if m["role"] == "assistant"
    )


_LOADER_THEN_SLEEP = """
import sys, time
from trainer.config.schema import DataConfig
from trainer.data.grain_pipeline import make_arrayrecord_iterator

cfg = DataConfig(dataset_type="arrayrecord", grain_train_files=sys.argv[1], tokenizer_path=sys.argv[2],
                 max_target_length=32, grain_worker_count=2)
it = make_arrayrecord_iterator(cfg, vocab_size=32768, global_batch_size=4)
next(it)
print("ready", flush=True)
time.sleep(600)
"""


def _data_workers(parent: int) -> list[int]:
    """The live Grain worker processes `parent` spawned (not the resource tracker), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        alive = not fields.get("State", "").startswith(("Z", "X"))
        if alive and fields.get("PPid", "").strip() == str(parent) and "spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = next(
            line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State")
        )
    except (OSError, StopIteration):
        return False
    return not state.split(":", 1)[1].strip().startswith(("Z", "X"))


@pytest.mark.timeout(180)
def test_a_killed_trainer_leaves_no_data_worker_behind(tmp_path):
    """SIGKILL reaches the trainer process only (the OOM killer, a kill of its pid): its Grain worker
    processes, blocked on their full queues, end on their own within seconds instead of living on."""
    import os
    import signal
    import subprocess
    import sys
    import time

    files = make_shards(tmp_path, text_records(60))
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOADER_THEN_SLEEP, files, str(BUNDLED_TOKENIZER)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        workers = _data_workers(proc.pid)
        assert len(workers) == 2, workers
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 60
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [w for w in workers if _alive(w)]
    for w in left:
        os.kill(w, signal.SIGKILL)
    assert not left, f"data workers {left} outlived their trainer"
