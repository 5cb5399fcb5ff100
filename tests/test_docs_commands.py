"""The documentation is executable: every command README.md and docs/*.md print runs as printed.

Each document's commands run in order, in one fresh copy of the repository (what a user has after
cloning it), with a scratch HOME that holds a small Qwen3 checkpoint where the docs name a downloaded
one (`~/Qwen3-0.6B`). Only two things shorten them: `TRAINER_SMOKE=1` (benchmarks and demos run
their full path at minimal sizes) and a trailing `steps=20` on a training command that asks for more.
Commands that need a cluster are not run; the artefacts they deploy come from
`python -m scripts.deploy.render`, which runs here, and tests/test_deploy.py validates them.
"""

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_harness import cli_env
from doc_commands import REPO, all_commands, commands, docs, without_assignments

from trainer.config.schema import TrainConfig

MAX_STEPS = 20
# The CLI's default persistent compilation cache (`jax_cache_dir`), under HOME.
JAX_CACHE = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "jax_cache_dir")
STATUS_OK = re.compile(r"^STATUS: (finished|preempted)\b", re.M)
TRAINED = re.compile(r"^STATUS: finished step=\d+ trained=(\d+)", re.M)


def test_every_documented_command_has_a_kind():
    found = all_commands()  # raises on an unclassified program
    assert {c.kind for c in found} >= {"setup", "suite", "local"}
    assert any(c.doc == "README.md" and c.text == "python -m pytest -n 2" for c in found)
    # `# needs:` keeps the MaxText comparison (it needs a MaxText install) out of the docs tier.
    assert [c.kind for c in found if "compile_vs_maxtext" in c.text] == ["external"]


def test_the_readme_setup_commands_are_the_ones_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    suite = [c for c in commands(REPO / "README.md") if c.kind == "suite"]
    assert suite and all(c.text in ci for c in suite)


def test_documented_python_modules_and_scripts_exist():
    for c in all_commands():
        if c.kind != "local":
            continue
        argv = c.program
        if argv[1] == "-m":
            module = REPO / argv[2].replace(".", "/")
            found = module.with_suffix(".py").is_file() or (module / "__main__.py").is_file()  # module or package
            assert found, f"{c.doc}:{c.line}: no module {argv[2]}"
        elif argv[1] != "-c":
            assert (REPO / argv[1]).is_file(), f"{c.doc}:{c.line}: no script {argv[1]}"


def _shorten(text: str) -> str:
    """A training command asking for more than MAX_STEPS steps (or the default 100) gets steps=MAX_STEPS."""
    argv = without_assignments(shlex.split(text))
    if argv[:3] != ["python", "-m", "trainer.train"]:
        return text
    given = [int(float(a.split("=", 1)[1])) for a in argv if a.startswith("steps=")]
    return text if given and given[-1] <= MAX_STEPS else f"{text} steps={MAX_STEPS}"


def _scratch_home(tmp: Path) -> Path:
    """HOME with `~/Qwen3-0.6B`: a 2-layer Qwen3 checkpoint in HF layout and a small tokenizer.json."""
    home = tmp / "home"
    model = home / "Qwen3-0.6B"
    shutil.copytree(
        REPO / "tests" / "fixtures" / "hf" / "dense_tied", model, ignore=shutil.ignore_patterns("expected.npz")
    )
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    words = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "Hello", "world"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(vocab_size - len(words))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model / "tokenizer.json"))
    # The compiled programs are the machine's, as on a user's machine that ran the commands before: the
    # default `jax_cache_dir` is this user's, shared by every document; the rest of HOME is scratch.
    cache = Path(os.path.expanduser(JAX_CACHE))
    cache.mkdir(parents=True, exist_ok=True)
    (home / JAX_CACHE.removeprefix("~/")).parent.mkdir(parents=True)
    (home / JAX_CACHE.removeprefix("~/")).symlink_to(cache, target_is_directory=True)
    return home


def _fresh_clone(tmp: Path) -> Path:
    """The repository's tracked files, as a fresh clone has them."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    clone = tmp / "clone"
    for rel in filter(None, files.stdout.split("\0")):
        src = REPO / rel
        if src.is_file():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, clone / rel)
    return clone


def _expectation_met(cmd, proc) -> str:
    """'' when the command ended as documented, else what went wrong."""
    out = proc.stdout + proc.stderr
    if cmd.expect_fail:
        if cmd.expect_fail.startswith("exit "):
            want = int(cmd.expect_fail.split()[1])
            return "" if proc.returncode == want else f"exit {proc.returncode}, documented {want}"
        if proc.returncode == 0 or cmd.expect_fail.split(";")[0] not in out:
            return f"exit {proc.returncode}; documented to fail with {cmd.expect_fail!r}"
        return ""
    if proc.returncode != 0:
        return f"exit {proc.returncode}"
    if cmd.trains:
        if not STATUS_OK.search(proc.stdout):
            return "no 'STATUS: finished' line"
        trained = TRAINED.search(proc.stdout)
        finished = proc.stdout.count("STATUS: finished")
        if finished and not trained:
            return "its 'STATUS: finished' line does not say how many steps it trained (trained=N)"
        if trained and int(trained.group(1)) == 0 and not cmd.resumes:
            return "it trained no step: it resumed a finished run (give it its own run_name, or say `# resumes`)"
    return ""


def test_a_documented_training_command_that_trains_nothing_fails_unless_it_says_it_resumes():
    from types import SimpleNamespace

    from doc_commands import Command

    def proc(line):
        return SimpleNamespace(returncode=0, stdout=f"metrics\n{line}\n", stderr="")

    train = Command("README.md", 1, "python -m trainer.train base.yml steps=30", "local")
    resumed = "STATUS: finished step=50 trained=0 (resumed at step 50: nothing left to train) run_dir=runs/x"
    assert "trained no step" in _expectation_met(train, proc(resumed))
    assert _expectation_met(dataclasses.replace(train, resumes=True), proc(resumed)) == ""
    assert _expectation_met(train, proc("STATUS: finished step=30 trained=30 run_dir=runs/x")) == ""
    assert "trained=N" in _expectation_met(train, proc("STATUS: finished step=30 run_dir=runs/x"))
    assert _expectation_met(train, proc("STATUS: preempted step=12: checkpoint saved")) == ""


def test_a_training_command_is_recognised_behind_variable_assignments():
    from doc_commands import Command

    assert Command("README.md", 1, "XLA_FLAGS=--x=1 python -m trainer.train base.yml", "local").trains
    assert not Command("README.md", 2, "python benchmarks/process_loss.py", "local").trains


def _scripts(runnable) -> list[tuple]:
    """(command, the bash script that runs it after the document's exports), in order. A command printed
    twice (its section and the benchmark list) runs once, unless it trains: a repeat resumes its run."""
    exports: list[str] = []
    ran: set[str] = set()
    out = []
    for cmd in runnable:
        if cmd.kind == "shell":
            exports.append(cmd.text)
            continue
        script = "; ".join([*exports, _shorten(cmd.text)])
        if script in ran and not cmd.trains:
            continue
        ran.add(script)
        out.append((cmd, script))
    return out


def test_a_repeated_command_runs_once_unless_it_trains():
    from doc_commands import Command

    bench = Command("README.md", 1, "python benchmarks/process_loss.py", "local")
    train = Command("README.md", 2, "python -m trainer.train base.yml steps=5", "local")
    export = Command("README.md", 3, "export X=1", "shell")
    scripts = [s for _, s in _scripts([bench, train, bench, train, export, bench])]
    assert scripts == [bench.text, train.text, train.text, f"export X=1; {bench.text}"]


def _docs_with_local_commands() -> list[str]:
    return [str(d.relative_to(REPO)) for d in docs() if any(c.kind == "local" for c in commands(d))]


def test_the_readme_and_the_scale_guide_have_commands_to_run():
    assert {"README.md", "docs/running_at_scale.md"} <= set(_docs_with_local_commands())


@pytest.mark.docs
@pytest.mark.timeout(3000)  # every command of a document in turn (each has its own 900 s bound)
@pytest.mark.parametrize("doc", _docs_with_local_commands())
def test_documented_commands_run_as_printed(doc, tmp_path, record_property):
    runnable = [c for c in commands(REPO / doc) if c.kind in ("local", "shell")]
    clone, home = _fresh_clone(tmp_path), _scratch_home(tmp_path)
    env = cli_env(1)
    env.update(HOME=str(home), TRAINER_SMOKE="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    for cmd, script in _scripts(runnable):
        started = time.monotonic()
        proc = subprocess.run(
            ["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=900
        )
        # Each command's seconds, in the JUnit XML CI keeps (`.ci/run`): where the tier's time goes.
        record_property(f"{doc}:{cmd.line} seconds", round(time.monotonic() - started, 1))
        problem = _expectation_met(cmd, proc)
        assert not problem, (
            f"{doc}:{cmd.line}: `{cmd.text}` ({problem})\n--- stdout\n{proc.stdout[-3000:]}"
            f"\n--- stderr\n{proc.stderr[-5000:]}"
        )
