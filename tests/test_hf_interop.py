"""Hugging Face interop: the converter and the model agree with transformers on its own fixtures.

tests/fixtures/hf/ holds tiny random Qwen3 / Qwen3-MoE / Llama 3 models saved by transformers, with the
float32 logits, loss and greedy continuation transformers computed for them (scripts/make_hf_fixtures.py;
no torch needed here). Contract: logits within 1e-4, the same loss and the same greedy tokens; export
-> import -> export is bitwise identical; bad inputs fail naming the tensor or key and leave nothing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from trainer import convert
from trainer.config import load_config
from trainer.hf import safetensors_io
from trainer.hf.checkpoints import checkpoint_model_config, load_checkpoint_params
from trainer.hf.load import load_hf, model_config_from_hf, read_hf_params
from trainer.hf.logits import compute_logits
from trainer.hf.safetensors_io import SafetensorsDir, write_hf_safetensors
from trainer.hf.to_hf import hf_tensors, trainer_to_hf
from trainer.hf.to_trainer import hf_to_trainer
from trainer.model import generation
from trainer.model.hf import HfFormatError, model_keys_from_hf, tensor_plan
from trainer.program.step import loss_sums

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = ["dense_tied", "dense_untied_kv1", "moe", "llama_tied", "llama_untied_kv1"]
LOGITS_ATOL = 1e-4


def _expected(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / name / "expected.npz"))


def _tensors(path: Path) -> dict[str, np.ndarray]:
    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each fixture through hf-to-trainer once: name -> checkpoint dir."""
    root = tmp_path_factory.mktemp("converted")
    return {name: hf_to_trainer(FIXTURES / name, root / name) for name in NAMES}


def _checkpoint(converted, name):
    cfg = checkpoint_model_config(converted[name])
    return cfg, load_checkpoint_params(converted[name], cfg)


# --- parity -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_converted_checkpoint_logits_match_transformers_within_1e_4(converted, name):
    cfg, params = _checkpoint(converted, name)
    expected = _expected(name)
    logits = compute_logits(params, cfg, expected["input_ids"])
    assert logits.dtype == np.float32 and logits.shape == expected["logits"].shape
    diff = float(np.abs(logits - expected["logits"]).max())
    print(f"{name}: max-abs logits diff vs transformers = {diff:.3g}")
    assert diff <= LOGITS_ATOL


@pytest.mark.parametrize("name", NAMES)
def test_training_loss_on_the_fixture_equals_transformers_loss(converted, name):
    """The trainer's own loss code (trainer.program.step.loss_sums) on inputs/targets shifted by one, as HF's
    `labels=input_ids` loss: mean next-token cross-entropy."""
    cfg, params = _checkpoint(converted, name)
    ids = jnp.asarray(_expected(name)["input_ids"])
    inputs, targets = ids[:, :-1], ids[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    batch = {
        "inputs": inputs,
        "targets": targets,
        "positions": positions,
        "segment_ids": jnp.ones_like(inputs),
        "loss_mask": jnp.ones_like(inputs),
    }
    _, parts = loss_sums(params, cfg, 0.0, batch)
    loss = float(parts["ce_sum"] / parts["tokens"])
    assert loss == pytest.approx(float(_expected(name)["loss"]), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decode_equals_transformers_greedy_continuation(converted, name):
    cfg, params = _checkpoint(converted, name)
    expected = _expected(name)
    out = generation.generate(params, cfg, expected["prompt_ids"], len(expected["greedy_ids"]))
    np.testing.assert_array_equal(out[0], expected["greedy_ids"])


def test_logits_cli_from_the_hf_dir_and_from_the_checkpoint_both_match_transformers(converted, tmp_path):
    name = "dense_untied_kv1"
    expected = _expected(name)
    np.save(tmp_path / "ids.npy", expected["input_ids"])
    for source in (["--hf-dir", str(FIXTURES / name)], ["--checkpoint", str(converted[name])]):
        out = tmp_path / f"logits{source[0]}.npy"
        assert (
            convert.main(["logits", *source, "--input-ids", str(tmp_path / "ids.npy"), "--output", str(out)]) == 0
        )
        logits = np.load(out)
        assert logits.dtype == np.float32
        assert np.abs(logits - expected["logits"]).max() <= LOGITS_ATOL


def test_decode_cli_with_prompt_ids_prints_transformers_greedy_tokens(converted, capsys):
    ckpt = converted["moe"]
    expected = _expected("moe")
    code = decode_main(
        [
            "base.yml",
            f"model={ckpt / 'model.yml'}",
            f"load_parameters_path={ckpt}",
            f"prompt_ids={expected['prompt_ids'].tolist()}",
            f"max_decode_length={len(expected['greedy_ids'])}",
        ]
    )
    assert code == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"output_ids: {expected['greedy_ids'].tolist()}"


def decode_main(argv):
    from trainer.decode import main

    return main(argv)


# --- round trips and layouts -------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_export_reproduces_every_transformers_tensor_and_export_import_export_is_bitwise_identical(
    converted, name, tmp_path
):
    first = trainer_to_hf(converted[name], tmp_path / "e1")
    assert _tensors(first / "model.safetensors").keys() == _tensors(FIXTURES / name / "model.safetensors").keys()
    for key, value in _tensors(FIXTURES / name / "model.safetensors").items():
        np.testing.assert_array_equal(_tensors(first / "model.safetensors")[key], value, err_msg=key)
    again = trainer_to_hf(hf_to_trainer(first, tmp_path / "c2"), tmp_path / "e2")
    for file in ("config.json", "model.safetensors"):
        assert (first / file).read_bytes() == (again / file).read_bytes(), file


def test_exported_config_json_describes_the_same_model():
    for name in NAMES:
        source = json.loads((FIXTURES / name / "config.json").read_text())
        cfg = model_config_from_hf(source, dtype="float32", weight_dtype="float32")
        from trainer.model.hf import hf_config

        assert model_keys_from_hf(hf_config(cfg, "float32")) == model_keys_from_hf(source)


def test_sharded_safetensors_with_an_index_read_the_same_params(tmp_path):
    """A checkpoint split over two files + model.safetensors.index.json, as large models are published."""
    src = FIXTURES / "moe"
    tensors = _tensors(src / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copyfile(src / "config.json", sharded / "config.json")
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))

    _, whole = load_hf(src, dtype="float32", weight_dtype="float32")
    _, split = load_hf(sharded, dtype="float32", weight_dtype="float32")
    for a, b in zip(_flat(whole), _flat(split)):
        np.testing.assert_array_equal(a, b)


def test_export_past_the_shard_size_writes_an_index_that_reimports_identically(converted, tmp_path):
    out = trainer_to_hf(converted["dense_tied"], tmp_path / "sharded", max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    _, original = load_hf(FIXTURES / "dense_tied", dtype="float32", weight_dtype="float32")
    _, back = load_hf(out, dtype="float32", weight_dtype="float32")
    for a, b in zip(_flat(original), _flat(back)):
        np.testing.assert_array_equal(a, b)


def test_unscanned_layer_layout_converts_to_the_same_logits(tmp_path):
    name = "dense_untied_kv1"
    ckpt = hf_to_trainer(FIXTURES / name, tmp_path / "loop", scan_layers=False)
    cfg, params = _checkpoint({name: ckpt}, name)
    assert not cfg.scan_layers and set(params["layers"]) == {"0", "1"}
    expected = _expected(name)
    logits = compute_logits(params, cfg, expected["input_ids"])
    assert np.abs(logits - expected["logits"]).max() <= LOGITS_ATOL
    loop_export = trainer_to_hf(ckpt, tmp_path / "loop_export")
    scan_export = trainer_to_hf(hf_to_trainer(FIXTURES / name, tmp_path / "scan"), tmp_path / "e2")
    assert (loop_export / "model.safetensors").read_bytes() == (scan_export / "model.safetensors").read_bytes()


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_bfloat16_export_rounds_each_weight_once_whatever_the_stored_dtype(converted, tmp_path, weight_dtype):
    import ml_dtypes

    ckpt = hf_to_trainer(FIXTURES / "moe", tmp_path / "ckpt", weight_dtype=weight_dtype)
    out = trainer_to_hf(ckpt, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    exported = _tensors(out / "model.safetensors")
    for key, value in _tensors(FIXTURES / "moe" / "model.safetensors").items():
        assert exported[key].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(exported[key], value.astype(ml_dtypes.bfloat16), err_msg=key)


def _flat(params):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(params)]


# --- derived config ----------------------------------------------------------------------------------


def test_model_yml_next_to_the_checkpoint_loads_as_model_and_equals_the_derived_config(converted):
    ckpt = converted["moe"]
    cfg = load_config("base.yml", [f"model={ckpt / 'model.yml'}"])
    derived = model_config_from_hf(
        json.loads((FIXTURES / "moe" / "config.json").read_text()), dtype="float32", weight_dtype="float32"
    )
    assert {**vars(cfg.model), "model": ""} == {**vars(derived), "model": ""}
    # dropless routing, as HF: capacity factor = experts / top_k
    assert cfg.model.moe_capacity_factor == 4 / 2


@pytest.mark.parametrize(
    "variant",
    [
        {"rope_theta": 5e5},  # transformers 4.x spelling
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},  # transformers 5.x
        {"rope_scaling": {"rope_type": "default", "rope_theta": 5e5}},
    ],
)
def test_rope_theta_is_read_at_top_level_or_under_rope_parameters(variant):
    hf = json.loads((FIXTURES / "dense_tied" / "config.json").read_text())
    hf.pop("rope_parameters", None)
    assert model_keys_from_hf({**hf, **variant})["rope_max_timescale"] == 5e5


@pytest.mark.parametrize("spelling", ["num_experts", "num_local_experts"])
def test_expert_count_is_read_under_either_name(spelling):
    hf = json.loads((FIXTURES / "moe" / "config.json").read_text())
    hf.pop("num_experts", None)
    hf.pop("num_local_experts", None)
    assert model_keys_from_hf({**hf, spelling: 6})["num_experts"] == 6


@pytest.mark.parametrize(
    "name,edit,fragment",
    [
        ("dense_tied", {"hidden_size": 48.5}, "hidden_size=48.5 must be a positive integer"),
        ("dense_tied", {"num_hidden_layers": "2"}, "num_hidden_layers='2' must be a positive integer"),
        ("dense_tied", {"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
        ("dense_tied", {"rms_norm_eps": "small"}, "rms_norm_eps='small' must be a number"),
        ("dense_tied", {"rope_parameters": "default"}, "rope_parameters='default' must be an object"),
        ("moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_local_experts=4"),
    ],
)
def test_config_json_values_of_the_wrong_type_are_named_with_the_file(name, edit, fragment):
    """int() would have truncated 48.5 or parsed "2"; a bad value is named instead, with the file."""
    hf = {**json.loads((FIXTURES / name / "config.json").read_text()), **edit}
    with pytest.raises(HfFormatError) as err:
        model_keys_from_hf(hf, "/models/q/config.json")
    assert fragment in str(err.value) and "/models/q/config.json" in str(err.value)


def test_tokenizer_json_is_copied_and_text_decoding_uses_it(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 160)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_dir = tmp_path / "hf"
    shutil.copytree(FIXTURES / "dense_tied", hf_dir)
    tok.save(str(hf_dir / "tokenizer.json"))
    ckpt = hf_to_trainer(hf_dir, tmp_path / "ckpt")
    cfg = load_config("base.yml", [f"model={ckpt / 'model.yml'}"])
    assert cfg.data.tokenizer_type == "huggingface" and Path(cfg.data.tokenizer_path) == ckpt / "tokenizer.json"

    prompt = "w5 w9 w33 w7"
    code = decode_main(
        [
            "base.yml",
            f"model={ckpt / 'model.yml'}",
            f"load_parameters_path={ckpt}",
            f"prompt={prompt}",
            "max_decode_length=6",
        ]
    )
    assert code == 0
    _, params = _checkpoint({"x": ckpt}, "x")
    want = generation.generate(params, cfg.model, [5, 9, 33, 7], 6, eos_id=0)[0].tolist()
    want = want[: want.index(0) + 1] if 0 in want else want
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"output_ids: {want}"


# --- training from, and exporting, a converted checkpoint ---------------------------------------------


def test_training_starts_from_the_converted_checkpoint_and_its_step_dir_exports_the_same_model(
    converted, tmp_path
):
    """With learning_rate=0 a run started from load_parameters_path=O saves exactly the imported weights,
    so exporting the run's checkpoint step dir (config read from its metadata) equals exporting O."""
    from cli_harness import cli_env

    ckpt = converted["dense_untied_kv1"]
    cmd = [
        sys.executable,
        "-m",
        "trainer.train",
        "base.yml",
        f"model={ckpt / 'model.yml'}",
        f"load_parameters_path={ckpt}",
        "learning_rate=0",
        "steps=1",
        "max_target_length=16",
        "per_device_batch_size=1",
        "enable_tensorboard=false",
        "async_checkpointing=false",
        f"base_output_directory={tmp_path}",
        "run_name=ft",
        "jax_cache_dir=",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cli_env(1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    step_dir = tmp_path / "ft" / "checkpoints" / "1"
    from_run = trainer_to_hf(step_dir, tmp_path / "from_run")
    from_import = trainer_to_hf(ckpt, tmp_path / "from_import")
    for file in ("config.json", "model.safetensors"):
        assert (from_run / file).read_bytes() == (from_import / file).read_bytes(), file


# --- errors ------------------------------------------------------------------------------------------


def _broken_copy(tmp_path: Path, name: str, edit_tensors=None, edit_config=None) -> Path:
    hf_dir = tmp_path / "broken"
    shutil.copytree(FIXTURES / name, hf_dir)
    if edit_tensors:
        tensors = _tensors(hf_dir / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, str(hf_dir / "model.safetensors"))
    if edit_config:
        cfg = json.loads((hf_dir / "config.json").read_text())
        edit_config(cfg)
        (hf_dir / "config.json").write_text(json.dumps(cfg))
    return hf_dir


def _assert_fails_cleanly(tmp_path: Path, hf_dir: Path, *fragments: str) -> None:
    out = tmp_path / "out" / "ckpt"
    with pytest.raises(HfFormatError) as err:
        hf_to_trainer(hf_dir, out)
    for fragment in fragments:
        assert fragment in str(err.value)
    assert not out.exists()
    assert not out.parent.exists() or list(out.parent.iterdir()) == []  # no staging leftovers either


def test_missing_tensor_is_named_and_nothing_is_written(tmp_path):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    hf_dir = _broken_copy(tmp_path, "moe", edit_tensors=lambda t: t.pop(name))
    _assert_fails_cleanly(tmp_path, hf_dir, name, "missing")


def test_shape_mismatch_is_named_and_nothing_is_written(tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    hf_dir = _broken_copy(tmp_path, "dense_tied", edit_tensors=lambda t: t.update({name: t[name][:-1]}))
    _assert_fails_cleanly(tmp_path, hf_dir, name, "[31, 48]", "[32, 48]")


def test_unexpected_tensor_is_named(tmp_path):
    hf_dir = _broken_copy(
        tmp_path,
        "dense_tied",
        edit_tensors=lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}),
    )
    _assert_fails_cleanly(tmp_path, hf_dir, "model.layers.0.self_attn.q_proj.bias")


@pytest.mark.parametrize(
    "name,edit,fragment",
    [
        ("dense_tied", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "LlamaForCausalLM"),
        ("dense_tied", {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "GemmaForCausalLM"),
        ("dense_tied", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6}}, "longrope"),
        ("dense_tied", {"attention_bias": True}, "attention_bias"),
        ("dense_tied", {"use_sliding_window": True}, "use_sliding_window"),
        ("moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ],
)
def test_unsupported_architecture_or_config_is_named_and_nothing_is_written(tmp_path, name, edit, fragment):
    hf_dir = _broken_copy(tmp_path, name, edit_config=lambda c: c.update(edit))
    _assert_fails_cleanly(tmp_path, hf_dir, fragment)


def test_cli_reports_the_tensor_and_exits_2(tmp_path, capsys):
    name = "model.norm.weight"
    hf_dir = _broken_copy(tmp_path, "dense_tied", edit_tensors=lambda t: t.pop(name))
    assert convert.main(["hf-to-trainer", "--hf-dir", str(hf_dir), "--output-dir", str(tmp_path / "o")]) == 2
    assert name in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_failure_while_writing_safetensors_leaves_no_output_and_no_staging_dir(converted, tmp_path, monkeypatch):
    def disk_full(path, tensors, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_io, "write_safetensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        trainer_to_hf(converted["dense_tied"], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_failure_inside_the_orbax_save_leaves_no_output_and_no_orbax_tmp_dir(tmp_path, monkeypatch):
    """Orbax writes `<staging>.orbax-checkpoint-tmp-*` beside the staging dir; a failed save must not
    leave it (or the staging dir) behind."""
    from trainer import checkpoint

    def killed_mid_save(path, params, *, in_place=False):
        tmp = Path(f"{path}.orbax-checkpoint-tmp-123")
        (tmp / "state").mkdir(parents=True)
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(checkpoint, "save_parameters", killed_mid_save)
    with pytest.raises(RuntimeError, match="killed mid-save"):
        hf_to_trainer(FIXTURES / "dense_tied", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_dir_is_refused_and_left_untouched(converted):
    from trainer.errors import UserInputError

    before = sorted(p.name for p in converted["dense_tied"].iterdir())
    with pytest.raises(UserInputError, match="already exists; pass --overwrite"):
        hf_to_trainer(FIXTURES / "dense_tied", converted["dense_tied"])
    assert sorted(p.name for p in converted["dense_tied"].iterdir()) == before


def test_pickle_checkpoints_are_never_read(tmp_path):
    hf_dir = tmp_path / "bin"
    hf_dir.mkdir()
    shutil.copyfile(FIXTURES / "dense_tied" / "config.json", hf_dir / "config.json")
    (hf_dir / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        hf_to_trainer(hf_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- memory ------------------------------------------------------------------------------------------


def test_import_and_export_hold_the_params_once_plus_about_one_tensor(converted):
    """Host-memory peaks measured with tracemalloc (numpy allocations): reading builds each param leaf
    once; writing produces one HF tensor at a time. Orbax's own buffers are not counted here."""
    src = FIXTURES / "moe"
    cfg = model_config_from_hf(
        json.loads((src / "config.json").read_text()), dtype="float32", weight_dtype="float32"
    )
    plan = tensor_plan(cfg)
    reader = SafetensorsDir(src)
    params_bytes = sum(int(np.prod(leaf.shape)) * 4 for leaf in plan)
    biggest = max(int(np.prod(reader.shape(n))) * 4 for n in reader.names())

    tracemalloc.start()
    params = read_hf_params(reader, plan, "float32")
    _, read_peak = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    write_hf_safetensors(converted["moe"].parent, hf_tensors(params, plan, "float32"), 1 << 40)
    _, write_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    (converted["moe"].parent / "model.safetensors").unlink()
    assert read_peak <= params_bytes + 2 * biggest + 64_000
    assert write_peak - base <= 2 * biggest + 64_000
