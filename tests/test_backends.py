"""Process bootstrap: the trainer asks XLA for deterministic GPU kernels (bitwise replays after recovery),
and an XLA_FLAGS that already decides wins."""

from __future__ import annotations

import os

from trainer.backends import deterministic_gpu_ops


def test_deterministic_gpu_ops_are_added_to_the_flags_given():
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    assert deterministic_gpu_ops(env)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_gpu_deterministic_ops=true"
    empty: dict = {}
    assert deterministic_gpu_ops(empty) and empty["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=true"


def test_flags_that_already_decide_win():
    env = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=false"}
    assert not deterministic_gpu_ops(env)
    assert env["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=false"


def test_the_train_cli_adds_them(monkeypatch, capsys):
    from trainer.train import main

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert main(["base.yml", "--print-config"]) == 0

    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=8",
        "--xla_gpu_deterministic_ops=true",
    ]
    assert "steps:" in capsys.readouterr().out
