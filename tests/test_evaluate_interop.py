"""The evaluation harness against lm-eval's own Hugging Face backend: one checkpoint of a real training run,
evaluated by `python -m trainer.evaluate` and, exported with `trainer.convert trainer-to-hf`, by
`lm_eval.simple_evaluate(model="hf")` (transformers + torch, float32, the same max_length), on local tasks
of every request type (tests/fixtures/lm_eval: multiple choice -> loglikelihood, generation ->
generate_until, perplexity -> loglikelihood_rolling over several windows). The scores must be the same:
accuracy, acc_norm and exact match identical, every generated text identical, every log-likelihood
within float32 rounding.

The `interop` tier (needs the eval extra and torch + transformers; `.ci/run` installs them and runs
`python -m pytest -m interop`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_harness import cli_env, command

pytestmark = pytest.mark.interop

REPO = Path(__file__).resolve().parents[1]
TASK_DIR = REPO / "tests" / "fixtures" / "lm_eval"
TASKS = ["trainer_tiny_mc", "trainer_tiny_gen", "trainer_tiny_ppl"]
MAX_LENGTH = 64  # the run's max_target_length; the perplexity task's long document needs several windows
RUN = [
    "steps=3",
    f"max_target_length={MAX_LENGTH}",
    "logits_via_embedding=false",  # an untied head: varied greedy text (a tied one repeats its input)
    "tokenizer_type=huggingface",
    f"tokenizer_path={TASK_DIR / 'tokenizer.json'}",
]
LOGLIK_TOLERANCE = dict(rel=1e-6, abs=1e-4)  # float32 sums over up to 64 tokens, two frameworks


def _run(argv: list[str], devices: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=cli_env(devices))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """(run directory of a 3-step training run of the CLI, its checkpoint exported for transformers)."""
    root = tmp_path_factory.mktemp("interop")
    _run(command(root, "tiny", *RUN))
    exported = root / "hf"
    step = root / "tiny" / "checkpoints" / "3"
    _run(
        [
            sys.executable,
            "-m",
            "trainer.convert",
            "trainer-to-hf",
            "--checkpoint",
            str(step),
            "--output-dir",
            str(exported),
        ]
    )
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in exported.iterdir()}
    return root / "tiny", exported


@pytest.fixture(scope="module")
def ours(checkpoint, tmp_path_factory) -> dict:
    """`python -m trainer.evaluate` on the run directory, on a 2-device mesh (params and rows sharded), the
    tasks named by a glob as on lm-eval's command line."""
    out = tmp_path_factory.mktemp("ours") / "results.json"
    argv = [sys.executable, "-m", "trainer.evaluate", str(checkpoint[0]), "--tasks", "trainer_tiny_*"]  # a glob
    argv += ["--include-path", str(TASK_DIR), "--batch-size", "3", "--log-samples", "--output", str(out)]
    proc = _run(argv, devices=2)
    assert sorted(json.loads(out.read_text())["results"]) == sorted(TASKS)
    assert "|trainer_tiny_mc " in proc.stdout and "Metric" in proc.stdout  # lm-eval's table, headers included
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def theirs(checkpoint) -> dict:
    """lm-eval's Hugging Face backend on the exported checkpoint, float32 on the CPU."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args = {"pretrained": str(checkpoint[1]), "dtype": "float32", "max_length": MAX_LENGTH, "device": "cpu"}
    return lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        batch_size=4,
        log_samples=True,
        bootstrap_iters=0,
    )


def _by_doc(results: dict, task: str) -> dict[int, dict]:
    return {s["doc_id"]: s for s in results["samples"][task]}


def test_accuracies_and_exact_match_are_those_of_the_hf_backend(ours, theirs):
    for task, metrics in {
        "trainer_tiny_mc": ("acc,none", "acc_norm,none"),
        "trainer_tiny_gen": ("exact_match,none",),
    }.items():
        for metric in metrics:
            assert ours["results"][task][metric] == theirs["results"][task][metric], (task, metric)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        want = theirs["results"]["trainer_tiny_ppl"][metric]
        assert ours["results"]["trainer_tiny_ppl"][metric] == pytest.approx(want, rel=1e-5), metric


def test_every_answer_log_likelihood_and_greedy_flag_is_the_hf_backends(ours, theirs):
    mine, hf = _by_doc(ours, "trainer_tiny_mc"), _by_doc(theirs, "trainer_tiny_mc")
    assert mine.keys() == hf.keys() and len(mine) == 10
    for doc, sample in mine.items():
        got = [tuple(r[0]) for r in sample["resps"]]  # one (log-likelihood, is_greedy) per choice
        want = [tuple(r[0]) for r in hf[doc]["resps"]]
        assert [g for _, g in got] == [g for _, g in want], doc
        assert [x for x, _ in got] == pytest.approx([x for x, _ in want], **LOGLIK_TOLERANCE), doc


def test_every_generated_text_is_the_hf_backends_and_stop_sequences_cut_some(ours, theirs):
    mine, hf = _by_doc(ours, "trainer_tiny_gen"), _by_doc(theirs, "trainer_tiny_gen")
    assert mine.keys() == hf.keys() and len(mine) == 9
    for doc, sample in mine.items():
        assert sample["resps"] == hf[doc]["resps"], (doc, sample["resps"], hf[doc]["resps"])
    # The stops of trainer_tiny_gen.yaml end some of this model's generations early and not others.
    lengths = [len(s["resps"][0][0]) for s in mine.values()]
    assert min(lengths) < max(lengths)


def test_every_document_log_likelihood_over_rolling_windows_is_the_hf_backends(ours, theirs):
    mine, hf = _by_doc(ours, "trainer_tiny_ppl"), _by_doc(theirs, "trainer_tiny_ppl")
    assert mine.keys() == hf.keys() and len(mine) == 3
    for doc, sample in mine.items():
        assert sample["resps"][0][0] == pytest.approx(hf[doc]["resps"][0][0], **LOGLIK_TOLERANCE), doc
    long_doc = json.loads((TASK_DIR / "ppl.jsonl").read_text().splitlines()[1])["text"]
    from tokenizers import Tokenizer

    tokens = Tokenizer.from_file(str(TASK_DIR / "tokenizer.json")).encode(long_doc).ids
    assert len(tokens) > MAX_LENGTH  # two rolling windows or more


def test_the_registered_model_name_evaluates_the_same_checkpoint(checkpoint, ours):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import trainer.evaluate.lm  # noqa: F401  registers "elastic-trainer"

    results = lm_eval.simple_evaluate(
        model="elastic-trainer",
        model_args={"path": str(checkpoint[0]), "batch_size": 2},
        tasks=["trainer_tiny_mc"],
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        limit=4,
        log_samples=True,
        bootstrap_iters=0,
    )
    mine = _by_doc(ours, "trainer_tiny_mc")
    for doc, sample in _by_doc(results, "trainer_tiny_mc").items():
        got, want = [r[0][0] for r in sample["resps"]], [r[0][0] for r in mine[doc]["resps"]]
        assert got == pytest.approx(want, **LOGLIK_TOLERANCE), doc


def test_an_unknown_task_exits_2_naming_it_and_the_include_path(checkpoint):
    argv = [sys.executable, "-m", "trainer.evaluate", str(checkpoint[0]), "--include-path", str(TASK_DIR)]
    argv += ["--tasks", "trainer_tiny_mc,no_such_task"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, env=cli_env(1))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("python -m trainer.evaluate: error: --tasks: no task named no_such_task in")
    assert f"--include-path {TASK_DIR}" in line
