"""Config: one schema, layered loading, typed values and clear errors before any compute."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer.config import ConfigError, build, load_config, load_resolved, to_flat_dict, to_yaml
from trainer.config.loader import configs_dir, read_yaml
from trainer.config.render_base import render
from trainer.config.schema import flat_fields

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (REPO / "configs" / "models").glob("*.yml"))


def test_base_yml_is_exactly_the_rendered_schema():
    assert (REPO / "configs" / "base.yml").read_text() == render(), (
        "configs/base.yml drifted from the schema: run python -m trainer.config.render_base > configs/base.yml"
    )


def test_every_schema_key_is_documented_in_base_yml():
    text = (REPO / "configs" / "base.yml").read_text()
    for name, (_, f) in flat_fields().items():
        assert f.metadata["doc"], name
        assert f"{name}:" in text


def test_base_yml_values_equal_schema_defaults():
    cfg = build(read_yaml(REPO / "configs" / "base.yml").values)
    assert to_flat_dict(cfg) == to_flat_dict(build({}))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_shipped_preset_loads_and_validates(preset):
    cfg = load_config("base.yml", [f"model={preset}"])
    assert cfg.model.model == preset


def test_layers_apply_in_order_base_then_preset_then_cli():
    cfg = load_config("base.yml", ["model=qwen3-tiny", "max_target_length=64"])
    assert cfg.model.base_emb_dim == 256  # from the preset
    assert cfg.data.max_target_length == 64  # CLI beats the preset's 256
    assert cfg.checkpoint.checkpoint_period == build({}).checkpoint.checkpoint_period  # from base


def test_config_argument_resolves_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("base.yml", ["model=qwen3-tiny"]).model.base_num_decoder_layers == 4


def test_config_argument_accepts_a_path(tmp_path):
    own = tmp_path / "exp.yml"
    own.write_text("steps: 7\nmodel: qwen3-mini\n")
    cfg = load_config(str(own))
    assert cfg.train.steps == 7 and cfg.model.base_emb_dim == 512


def test_a_copy_of_base_yml_does_not_put_the_base_architecture_under_a_presets_name(tmp_path):
    """A user's file beats the preset: a copied base.yml with model=qwen3-0.6b would train the tiny default
    architecture named qwen3-0.6b. It stops before any compute, naming the keys and the fix."""
    copy = tmp_path / "mine.yml"
    copy.write_text((configs_dir() / "base.yml").read_text())
    with pytest.raises(ConfigError) as e:
        load_config(str(copy), ["model=qwen3-0.6b"])
    message = str(e.value)
    assert "base_emb_dim=256 (preset: 1024)" in message and "delete these keys" in message
    # The same value on the command line overrides the preset on purpose; a value of the user's own in
    # the file (not base.yml's) does too.
    assert load_config(str(copy), ["model=qwen3-tiny"]).model.base_emb_dim == 256
    own = tmp_path / "own.yml"
    own.write_text("model: qwen3-0.6b\nbase_num_decoder_layers: 2\n")
    assert load_config(str(own)).model.base_num_decoder_layers == 2
    cli = load_config("base.yml", ["model=qwen3-0.6b", "base_emb_dim=256", "head_dim=64"])
    assert cli.model.base_emb_dim == 256


def test_overrides_are_yaml_scalars():
    cfg = load_config("base.yml", ["learning_rate=1e-3", "enable_tensorboard=false", "run_name=123"])
    assert cfg.optim.learning_rate == pytest.approx(1e-3)
    assert cfg.observe.enable_tensorboard is False
    assert cfg.train.run_name == "123"


def test_values_that_follow_other_keys_stay_as_given():
    """-1 = 'follow steps' stays -1 in the config (the optimizer reads it with the run's steps), so a
    printed config does not freeze it."""
    cfg = load_config("base.yml", ["steps=40", "num_slices=2"])
    assert cfg.optim.learning_rate_schedule_steps == -1 and cfg.train.run_name == ""


@pytest.mark.parametrize(
    "override, message",
    [
        (["learning_rat=1"], "did you mean 'learning_rate'"),
        (["steps=ten"], "'steps': expected an integer"),
        (["enable_tensorboard=3"], "expected true/false"),
        (["base_num_kv_heads=3"], "not divisible by base_num_kv_heads=3"),
        (["model=qwen3-tiniest"], "unknown model preset 'qwen3-tiniest'; did you mean 'qwen3-tiny'"),
        (["remat_policy=some"], "remat_policy='some' is not one of"),
        (["ici_fsdp_parallelism=-1", "ici_tensor_parallelism=-1"], "at most one ici_*_parallelism may be -1"),
        (["elastic_min_slice_count=5", "num_slices=2"], "elastic_min_slice_count=5"),
        (["steps=0"], "steps=0 must be >= 1"),
        (["noequals"], "is not key=value"),
        (["steps=1.5"], "a whole number"),
        (["STEPS=4"], "did you mean 'steps'"),
        (["top_p=1.5"], "top_p=1.5 must be <= 1.0"),
        (["warmup_steps_fraction=2"], "must be <= 1.0"),
        (["model=/missing.yml"], "model file not found"),
        (["fault_schedule=garbage"], "fault_schedule entry 'garbage'"),
        (["dcn_data_parallelism=3", "num_slices=2"], "no longer a config key"),
        (["local_checkpoint_period=5"], "needs both local_checkpoint_directory and local_checkpoint_period"),
        (["local_checkpoint_directory=/mnt/ssd"], "needs both local_checkpoint_directory"),
        (["local_checkpoint_directory=gs://b/x", "local_checkpoint_period=5"], "must be node-local storage"),
        (
            ["dataset_type=arrayrecord", "grain_train_files=a/*,0.7;b/*,-0.3"],
            "grain_train_files entry 'b/*,-0.3': weight -0.3 is negative",
        ),
        (["dataset_type=arrayrecord", "grain_train_files=a/*,0;b/*,0"], "every weight is 0"),
        (["dataset_type=arrayrecord", "grain_train_files=a/*,0.7;b/*,most"], "entry 'b/*,most' is not"),
        (["eval_interval=0"], "eval_interval=0: set -1 (off)"),
        (["target_eval_loss=2.5"], "target_eval_loss=2.5 needs evaluation: set eval_interval"),
        (["eval_interval=10"], "eval_steps=-1 means one pass over grain_eval_files"),
        (["grain_eval_files=x/*.arrayrecord"], "is read with dataset_type=arrayrecord only"),
        (
            ["dataset_type=arrayrecord", "grain_train_files=d/*.arrayrecord", "eval_interval=10"],
            "eval_interval=10 with dataset_type=arrayrecord needs grain_eval_files",
        ),
    ],
)
def test_bad_input_raises_a_config_error_that_names_the_problem(override, message):
    with pytest.raises(ConfigError, match=None) as info:
        load_config("base.yml", override)
    assert message in str(info.value)


def test_missing_config_file_is_a_config_error():
    with pytest.raises(ConfigError, match="config file 'nope.yml' not found"):
        load_config("nope.yml")


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config("base.yml", ["model=qwen3-0.6b", "elastic_enabled=true"])
    path = tmp_path / "config.yml"
    path.write_text(to_yaml(cfg))
    assert load_resolved(path) == cfg


def test_cli_bad_key_exits_2_with_one_clear_message_before_any_compute(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train",
            "base.yml",
            "model=qwen3-tiny",
            "stepz=3",
            f"base_output_directory={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "unknown config key 'stepz'" in proc.stderr and "did you mean 'steps'" in proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "STATUS: config_error"
    assert not any(tmp_path.iterdir()), "nothing may be written for a bad config"


def test_cli_print_config_prints_the_resolved_values_and_exits_0():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train",
            "base.yml",
            "model=qwen3-0.6b",
            "elastic_enabled=true",
            "--print-config",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0
    resolved = {}
    for doc in proc.stdout.split("# ---"):
        body = doc.split("\n", 1)[1] if "\n" in doc else ""
        resolved.update(yaml.safe_load(body) or {})
    assert resolved["base_emb_dim"] == 1024 and resolved["elastic_enabled"] is True


def test_configs_dir_points_at_the_repository_configs():
    assert (configs_dir() / "base.yml").is_file()
