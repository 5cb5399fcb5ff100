"""Huge-page host malloc: when the CLI re-executes itself with glibc's hugetlb tunable, and that it does."""

import json
import os
import subprocess
import sys

import pytest

from trainer import hostmem

GLIBC = (2, 36)


def test_adds_the_tunable_to_an_environment_without_it():
    env = hostmem.hugepage_environ({"PATH": "/bin"}, glibc=GLIBC, thp_mode="madvise")
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def test_keeps_other_tunables():
    env = hostmem.hugepage_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, glibc=GLIBC, thp_mode="always")
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


@pytest.mark.parametrize(
    "environ, glibc, thp",
    [
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, GLIBC, "madvise"),  # the user chose: never overridden
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, GLIBC, "madvise"),  # already on: no exec loop
        ({hostmem.OPT_OUT: "0"}, GLIBC, "madvise"),
        ({}, (2, 34), "madvise"),  # the tunable does not exist before glibc 2.35
        ({}, None, "madvise"),  # not glibc (musl, macOS)
        ({}, GLIBC, "never"),  # the kernel would ignore the advice
        ({}, GLIBC, None),  # no THP support at all
    ],
)
def test_nothing_to_do(environ, glibc, thp):
    assert hostmem.hugepage_environ(environ, glibc=glibc, thp_mode=thp) is None


def test_whether_the_cli_takes_huge_pages_ignores_the_callers_tunables_but_not_the_opt_out(monkeypatch):
    monkeypatch.setattr(hostmem, "_glibc_version", lambda: GLIBC)
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: "madvise")
    assert hostmem.cli_takes_hugepages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert not hostmem.cli_takes_hugepages({hostmem.OPT_OUT: "0"})
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: "never")
    assert not hostmem.cli_takes_hugepages({})


def test_the_cli_reexecutes_itself_with_the_tunable_keeping_its_pid(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hostmem.OPT_OUT)}
    cmd = [
        sys.executable,
        "-m",
        "trainer.train",
        "base.yml",
        "model=qwen3-tiny",
        "steps=1",
        "max_target_length=16",
        "base_num_decoder_layers=1",
        "vocab_size=256",
        "enable_checkpointing=false",
        "enable_tensorboard=false",
        f"base_output_directory={tmp_path}",
        "run_name=hp",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    start = json.loads((tmp_path / "hp" / "events.jsonl").read_text().splitlines()[0])
    expected = hostmem.cli_takes_hugepages({})
    assert start["event"] == "start" and start["host_hugepages"] is expected
    assert start["pid"] == proc.pid, "exec must keep the PID the launcher sees"
    assert out.strip().splitlines()[-1].startswith("STATUS: finished step=1")
