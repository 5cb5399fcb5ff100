"""Config values as users type them: typed by the schema, layered in a fixed order, printed so they load back."""

import subprocess
import sys

import pytest

from trainer.config import ConfigError, load_config, load_resolved
from trainer.config.loader import explain


@pytest.mark.parametrize(
    "given, expected",
    [
        ("yes", "yes"),
        ("007", "007"),
        ("0x1F", "0x1F"),
        ("12:30:00", "12:30:00"),
        ("exp #3", "exp #3"),
        ("true", "true"),
        ("[a, b]", "[a, b]"),
        ("", ""),
    ],
)
def test_a_string_key_takes_the_literal_text(given, expected):
    assert load_config("base.yml", [f"run_name={given}"]).train.run_name == expected


def test_string_keys_keep_hashes_colons_and_words_yaml_would_change():
    cfg = load_config("base.yml", ["tokenizer_path=/data/run #2/a.model", "prompt=def f(x): return x"])
    assert cfg.data.tokenizer_path == "/data/run #2/a.model"
    assert cfg.decode.prompt == "def f(x): return x"
    assert load_config("base.yml", ["prompt=yes"]).decode.prompt == "yes"


def test_string_keys_in_a_config_file_are_literal_too(tmp_path):
    own = tmp_path / "exp.yml"
    own.write_text("run_name: 007\nprompt: yes\nsteps: 010\n")
    cfg = load_config(str(own))
    assert (cfg.train.run_name, cfg.decode.prompt, cfg.train.steps) == ("007", "yes", 10)


@pytest.mark.parametrize("given, expected", [("010", 10), ("1e3", 1000), ("1_000", 1000), ("+5", 5)])
def test_integers_are_decimal_and_may_use_an_exponent(given, expected):
    assert load_config("base.yml", [f"steps={given}"]).train.steps == expected


@pytest.mark.parametrize(
    "override",
    ["learning_rate=nan", "learning_rate=inf", "learning_rate=1e400", "adam_b1=.nan", "learning_rate=-inf"],
)
def test_non_finite_numbers_are_config_errors(override):
    with pytest.raises(ConfigError, match="'(learning_rate|adam_b1)'"):
        load_config("base.yml", [override])


def test_a_key_twice_on_the_command_line_takes_the_later_value_and_says_so(caplog):
    assert load_config("base.yml", ["steps=3", "steps=5"]).train.steps == 5
    assert "steps is given twice on the command line (3, then 5)" in caplog.text


def test_the_old_dcn_key_at_its_only_legal_value_is_accepted_with_a_warning(caplog):
    cfg = load_config("base.yml", ["dcn_data_parallelism=-1"])
    assert cfg.mesh.num_slices == 1 and "deprecated" in caplog.text


def test_a_key_twice_in_one_file_is_an_error(tmp_path):
    own = tmp_path / "exp.yml"
    own.write_text("steps: 3\nsteps: 5\n")
    with pytest.raises(ConfigError, match="given twice"):
        load_config(str(own))


def test_a_non_utf8_config_file_is_a_config_error(tmp_path):
    own = tmp_path / "exp.yml"
    own.write_bytes(b"run_name: caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(str(own))


def test_the_users_file_beats_the_model_preset_and_the_command_line_beats_both(tmp_path):
    own = tmp_path / "my.yml"
    own.write_text("learning_rate: 3.0e-5\nmax_target_length: 1024\nsteps: 7\n")
    cfg = load_config(str(own))
    assert (cfg.optim.learning_rate, cfg.data.max_target_length) == (3.0e-5, 1024)  # the preset sets 1e-3, 256
    assert cfg.model.base_emb_dim == 256  # architecture from the preset
    cfg = load_config(str(own), ["max_target_length=64"])
    assert cfg.data.max_target_length == 64


def test_a_model_named_in_the_users_file_chooses_the_preset(tmp_path):
    own = tmp_path / "my.yml"
    own.write_text("model: qwen3-mini\n")
    assert load_config(str(own)).model.base_emb_dim == 512


def test_print_config_marks_the_layer_that_set_each_value(tmp_path):
    own = tmp_path / "my.yml"
    own.write_text("learning_rate: 3.0e-5\n")
    text = explain(str(own), ["steps=9"])
    lines = {line.split(":")[0]: line for line in text.splitlines() if not line.startswith("#")}
    assert lines["learning_rate"].endswith(f"# from {own}")
    assert lines["steps"].endswith("# from command line")
    assert lines["dtype"].endswith("# from model preset qwen3-tiny")
    assert "# from" not in lines["checkpoint_period"]


@pytest.mark.parametrize(
    "overrides",
    [["steps=200"], ["num_slices=2", "elastic_enabled=true"], ["run_name=007", "prompt=yes", "model=qwen3-0.6b"]],
)
def test_a_printed_config_loads_back_to_the_same_config(tmp_path, overrides):
    printed = tmp_path / "printed.yml"
    printed.write_text(explain("base.yml", overrides))
    assert load_resolved(printed) == load_config("base.yml", overrides)
    assert load_config(str(printed)) == load_config("base.yml", overrides)
    assert load_resolved(printed).optim.learning_rate_schedule_steps == -1


def test_flags_and_overrides_come_in_any_order(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "base.yml", "--print-config", "steps=3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "steps: 3  # from command line" in proc.stdout
    assert not any(tmp_path.iterdir())


def test_a_config_saved_by_an_older_version_with_the_dcn_key_still_builds():
    from trainer.config import build

    assert build({"num_slices": 2, "dcn_data_parallelism": 2}).mesh.num_slices == 2


def _cli(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "trainer.train", *args], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )


@pytest.mark.parametrize(
    "arg, line",
    [
        ("run_name=yes", "run_name: 'yes'"),
        ("run_name=007", "run_name: '007'"),
        ("run_name=0x1F", "run_name: '0x1F'"),
        ("run_name=12:30:00", "run_name: '12:30:00'"),
        ("run_name=exp #3", "run_name: 'exp #3'"),
        ("tokenizer_path=/data/run #2/a.model", "tokenizer_path: '/data/run #2/a.model'"),
        ("prompt=def f(x): return x", "prompt: 'def f(x): return x'"),
        ("prompt=yes", "prompt: 'yes'"),
        ("steps=1e3", "steps: 1000"),
        ("steps=010", "steps: 10"),
    ],
)
def test_the_cli_keeps_what_the_user_typed(tmp_path, arg, line):
    proc = _cli(tmp_path, "base.yml", arg, "--print-config")
    assert proc.returncode == 0, proc.stderr
    assert f"{line}  # from command line" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["learning_rate=nan"], "not a finite number"),
        (["learning_rate=inf"], "not a finite number"),
        (["learning_rate=1e400"], "not a finite number"),
        (["adam_b1=.nan"], "expected a number"),
        (["STEPS=4"], "did you mean 'steps'"),
        (["model=/missing.yml"], "model file not found"),
        (["fault_schedule=garbage"], "fault_schedule entry 'garbage'"),
        (["steps=1.5"], "a whole number"),
    ],
)
def test_the_cli_refuses_bad_values_with_exit_2_and_writes_nothing(tmp_path, args, message):
    proc = _cli(tmp_path, "base.yml", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "STATUS: config_error"
    assert not any(tmp_path.iterdir()), "a refused run leaves nothing behind"


def test_a_non_utf8_config_file_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "my.yml").write_bytes(b"run_name: caf\xe9\n")
    proc = _cli(tmp_path, "my.yml")
    assert proc.returncode == 2 and "not UTF-8" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("given, expected", [("0.5", 0.5), ("0.125", 0.125), ("2", 2), ("2.0", 2), ("1e0", 1)])
def test_per_device_batch_size_takes_a_fraction_and_keeps_whole_values_ints(given, expected, tmp_path):
    cfg = load_config("base.yml", [f"per_device_batch_size={given}", f"eval_per_device_batch_size={given}"])
    for value in (cfg.data.per_device_batch_size, cfg.eval.eval_per_device_batch_size):
        assert value == expected and type(value) is type(expected)
    own = tmp_path / "exp.yml"
    own.write_text(f"per_device_batch_size: {given}\n")
    from_file = load_config(str(own)).data.per_device_batch_size
    assert from_file == expected and type(from_file) is type(expected)


def test_a_whole_per_device_batch_size_prints_and_round_trips_as_an_int(tmp_path):
    from trainer.config import build, to_flat_dict, to_yaml

    cfg = load_config("base.yml", ["per_device_batch_size=2.0"])
    assert "per_device_batch_size: 2\n" in to_yaml(cfg)
    assert build({"per_device_batch_size": 2.0}).data.per_device_batch_size.__class__ is int
    path = tmp_path / "config.yml"
    path.write_text(to_yaml(load_config("base.yml", ["per_device_batch_size=0.25"])))
    assert "per_device_batch_size: 0.25\n" in path.read_text()
    assert to_flat_dict(load_resolved(path))["per_device_batch_size"] == 0.25


@pytest.mark.parametrize(
    "given, message",
    [
        ("0", "per_device_batch_size=0 must be > 0"),
        ("-1", "per_device_batch_size=-1 must be > 0"),
        ("-0.5", "per_device_batch_size=-0.5 must be > 0"),
        ("abc", "'per_device_batch_size': expected a number"),
        ("1/4", "'per_device_batch_size': expected a number"),
        ("inf", "not a finite number"),
    ],
)
def test_per_device_batch_size_refuses_zero_negatives_and_text(given, message):
    with pytest.raises(ConfigError) as info:
        load_config("base.yml", [f"per_device_batch_size={given}"])
    assert message in str(info.value)


def test_eval_per_device_batch_size_zero_still_means_the_training_value():
    assert load_config("base.yml", ["eval_per_device_batch_size=0"]).eval.eval_per_device_batch_size == 0
    with pytest.raises(ConfigError, match="eval_per_device_batch_size=-0.5 must be >= 0"):
        load_config("base.yml", ["eval_per_device_batch_size=-0.5"])
