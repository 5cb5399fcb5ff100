"""Held-out evaluation: the eval step, the held-out streams, the schedule, the loop's eval rows and early
stop, and how reports and goodput read eval rows."""

import contextlib
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fresh_state_on_one_device, micro_config, replace, synthetic_batch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer import model as qwen3
from trainer.attempt.builder import Attempt
from trainer.attempt.evaluate import EvalSchedule, Evaluator
from trainer.attempt.loop import train_loop
from trainer.attempt.nonfinite import NonFinitePolicy
from trainer.attempt.outcome import Finished, TargetReached
from trainer.checkpoint import NoCheckpoints
from trainer.data.batch import BATCH_KEYS
from trainer.data.pipeline import make_eval_iterator, make_train_iterator
from trainer.observe.goodput import account
from trainer.observe.records import is_eval
from trainer.observe.runlog import load_run, summarize
from trainer.program.layout import BatchLayout
from trainer.program.step import make_eval_step

REPO = Path(__file__).resolve().parents[1]
FC = REPO / "data" / "fc_sample"


def test_eval_loss_is_the_mean_cross_entropy_over_loss_masked_tokens_whole_or_in_micro_steps():
    cfg = micro_config()
    _, state = fresh_state_on_one_device(cfg)
    batch = synthetic_batch(cfg, rows=4)
    batch["loss_mask"][0] = 0  # a masked-out row counts for nothing
    params = state["params"]

    @jax.jit
    def logits_of(params, batch):
        hidden, _ = qwen3.forward(params, cfg.model, batch["inputs"], batch["positions"], batch["segment_ids"])
        return qwen3.logits_from_hidden(params, cfg.model, hidden)

    logits = np.asarray(logits_of(params, batch), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    mask = batch["loss_mask"].astype(bool)
    for micro_steps in (1, 2):
        sums = jax.jit(make_eval_step(cfg.model, micro_steps=micro_steps))(state["params"], batch)
        assert float(sums["tokens"]) == mask.sum() > 0
        np.testing.assert_allclose(float(sums["ce_sum"]) / mask.sum(), nll[mask].mean(), rtol=1e-5)


def _global_batch(it) -> dict:
    return {k: v.copy() for k, v in next(it).items()}


def test_synthetic_held_out_stream_is_not_the_training_stream_and_is_the_same_on_any_process_count():
    cfg = micro_config()
    kw = dict(vocab_size=cfg.model.vocab_size, global_batch_size=4)
    train_rows = [_global_batch(make_train_iterator(cfg.data, **kw))["inputs"]]
    held_out = make_eval_iterator(cfg.data, "", **kw)
    first = _global_batch(held_out)
    assert not any(np.array_equal(first["inputs"], t) for t in train_rows)
    halves = [make_eval_iterator(cfg.data, "", **kw, process_index=i, process_count=2) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate([next(h)["inputs"] for h in halves]), first["inputs"])
    held_out.set_state(make_eval_iterator(cfg.data, "", **kw).get_state())  # rewound: the same tokens
    np.testing.assert_array_equal(next(held_out)["inputs"], first["inputs"])


def test_arrayrecord_held_out_set_is_one_pass_with_the_sft_mask_and_rewinds_to_the_same_tokens():
    cfg = micro_config(
        "dataset_type=arrayrecord",
        f"grain_train_files={FC / 'fc-00000-of-00002.arrayrecord'}",
        "use_sft=true",
        "vocab_size=8192",
        "max_target_length=256",
    )
    it = make_eval_iterator(
        cfg.data, str(FC / "fc-00001-of-00002.arrayrecord"), vocab_size=8192, global_batch_size=8
    )
    start = it.get_state()
    batches = list(it)  # one pass, then StopIteration
    assert 1 <= len(batches) < 1000
    masks = np.concatenate([b["loss_mask"] for b in batches])
    in_docs = np.concatenate([b["segment_ids"] for b in batches]) > 0
    assert 0 < masks.sum() < in_docs.sum(), "SFT: only assistant tokens are eval targets"
    it.set_state(start)
    again = next(it)
    for k in BATCH_KEYS:
        np.testing.assert_array_equal(again[k], batches[0][k])
    it.close()


@pytest.mark.parametrize(
    "interval, start, expected",
    [(-1, 0, []), (4, 0, [4, 8, 10]), (4, 6, [8, 10]), (3, 0, [3, 6, 9, 10]), (20, 0, [10])],
)
def test_eval_schedule_every_interval_from_the_start_step_and_always_the_last_step(interval, start, expected):
    schedule = EvalSchedule(interval, start, last_step=10)
    assert [s for s in range(1, 11) if schedule.due(s)] == expected


class _Batches:
    """A finite held-out set of `n` batches; batch i holds the value i + 1 everywhere."""

    def __init__(self, n):
        self.n, self.at = n, 0

    def __next__(self):
        if self.at >= self.n:
            raise StopIteration
        self.at += 1
        return {k: np.full((2, 4), self.at, np.int32) for k in BATCH_KEYS}

    def get_state(self):
        return {"at": self.at}

    def set_state(self, state):
        self.at = state["at"]


def _fake_eval_fn(params, batch):
    """ce_sum = params * value * 8 tokens: the loss is params * value."""
    value = batch["inputs"][0, 0].astype(jnp.float32)
    return {"ce_sum": params * value * 8, "tokens": jnp.float32(8)}


def _evaluator(n, *, batches, target=0.0, interval=2, last=6):
    return Evaluator(
        eval_fn=_fake_eval_fn,
        iterator=_Batches(n),
        device_batch=lambda b: b,
        schedule=EvalSchedule(interval, 0, last),
        batches=batches,
        target_loss=target,
    )


def test_every_evaluation_starts_the_held_out_set_from_its_beginning():
    ev = _evaluator(5, batches=3)
    first, second = ev(2, jnp.float32(1.0)), ev(4, jnp.float32(1.0))
    assert first["eval_loss"] == second["eval_loss"] == (1 + 2 + 3) / 3  # batches 1..3 both times
    assert first["eval_tokens"] == 24 and first["eval_batches"] == 3 and is_eval(first)
    assert math.isclose(first["eval_perplexity"], math.exp(first["eval_loss"]))


def test_eval_steps_minus_one_runs_the_whole_held_out_set():
    assert _evaluator(5, batches=-1)(2, jnp.float32(1.0))["eval_batches"] == 5


class _TrainBatches:
    def __init__(self):
        self.yielded = 0

    def __next__(self):
        self.yielded += 1
        return {k: np.full((2, 4), 1, np.int32) for k in BATCH_KEYS}

    def get_state(self):
        return {"yielded": self.yielded}


def _attempt(evaluator, start=0):
    """A one-device attempt whose state is a float 'parameter' that each step lowers by 0.1."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    def step_fn(state, batch):
        metrics = {
            "loss": state["params"],
            "learning_rate": jnp.float32(0.1),
            "grad_norm": jnp.float32(1.0),
            "tokens": jnp.float32(8),
            "z_loss": jnp.float32(0),
            "aux_loss": jnp.float32(0),
            "finite": jnp.bool_(True),
        }
        return {"params": state["params"] - 0.1}, metrics

    class Saves(NoCheckpoints):
        def __init__(self):
            self.saved = []

        def save(self, step, state, data_state, metadata, *, force=False):
            self.saved.append(step)
            return True

    return Attempt(
        mesh=mesh,
        batch_layout=BatchLayout(2, 1, 1.0),
        state={"params": jnp.float32(1.0 - 0.1 * start)},
        start_step=start,
        restored_from="init",
        step_fn=step_fn,
        batch_sharding=NamedSharding(mesh, PartitionSpec()),
        iterator=_TrainBatches(),
        checkpointer=Saves(),
        flops_per_step=1.0,
        sequence_length=4,
        checkpoint_metadata={},
        stack=contextlib.ExitStack(),
        evaluator=evaluator,
    )


class _Sinks:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


class _Events:
    def __init__(self):
        self.log = []

    def emit(self, name, **fields):
        self.log.append((name, fields))


def _loop(attempt, steps=6):
    sinks, events = _Sinks(), _Events()
    outcome = train_loop(
        attempt, steps=steps, sinks=sinks, events=events, nonfinite=NonFinitePolicy("stop", events)
    )
    return outcome, sinks.records, events.log


def test_the_loop_writes_an_eval_row_after_each_due_step_and_keeps_one_step_row_per_step():
    outcome, records, _ = _loop(_attempt(_evaluator(1, batches=1, interval=2, last=5)), steps=5)
    assert outcome == Finished(5)
    steps = [r["step"] for r in records if not is_eval(r)]
    evals = [r for r in records if is_eval(r)]
    assert steps == [1, 2, 3, 4, 5] and [r for r in records if not is_eval(r)][-1]["last"] is True
    assert [r["step"] for r in evals] == [2, 4, 5]
    # Evaluated on the state after the step: params 1.0 - 0.1 * step (batch value 1).
    np.testing.assert_allclose([r["eval_loss"] for r in evals], [0.8, 0.6, 0.5], rtol=1e-6)


def test_an_attempt_restored_at_an_evaluated_step_does_not_evaluate_it_again():
    # Restored at step 4 (evaluated by the attempt that trained it): the first eval is step 6's.
    _, records, _ = _loop(_attempt(_evaluator(1, batches=1, interval=2, last=6), start=4))
    assert [r["step"] for r in records if is_eval(r)] == [6]


def test_reaching_target_eval_loss_saves_and_ends_the_loop_at_that_step():
    attempt = _attempt(_evaluator(1, batches=1, interval=2, last=6, target=0.65))
    outcome, records, events = _loop(attempt)
    assert isinstance(outcome, TargetReached) and outcome.step == 4
    assert outcome.eval_loss == pytest.approx(0.6)
    assert attempt.checkpointer.saved[-1] == 4, "the early stop is resumable: a checkpoint at its step"
    steps = [r for r in records if not is_eval(r)]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[-1]["last"] is True
    assert [n for n, _ in events if n == "target_eval_loss_reached"] == ["target_eval_loss_reached"]


def _write_run(run_dir: Path, metrics: list[dict], events: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _step(step, t, loss=2.0):
    return {"step": step, "loss": loss, "learning_rate": 0.1, "step_time_s": 1.0, "tokens_per_s": 10.0, "time": t}


def _eval(step, t, loss, seconds=2.0):
    return {"kind": "eval", "step": step, "eval_loss": loss, "eval_tokens": 8, "eval_time_s": seconds, "time": t}


def test_goodput_counts_eval_time_as_its_own_cause_not_as_productive():
    events = [{"event": "start", "time": 0.0}, {"event": "attempt_start", "time": 0.0}]
    events.append({"event": "finish", "time": 10.0})
    g = account(events, [_step(1, 1.0), _step(2, 2.0), _eval(2, 4.0, 1.5)])
    assert g["productive_s"] == 2.0 and g["badput_s"]["eval"] == 2.0
    assert g["badput_s"]["other"] == pytest.approx(6.0)


def test_reports_read_eval_rows_apart_from_step_rows_and_keep_the_newest_eval_of_a_step(tmp_path):
    # Steps 1-4 with evals at 2 and 4; a rewind to step 2 trains 3-4 again and evaluates 4 again.
    metrics = [_step(1, 1), _step(2, 2), _eval(2, 2.5, 3.0), _step(3, 3), _step(4, 4), _eval(4, 4.5, 2.5)]
    metrics += [_step(3, 6), _step(4, 7), _eval(4, 7.5, 2.4)]
    events = [{"event": "start", "time": 0.0, "steps": 4}, {"event": "finish", "time": 8.0, "status": "finished"}]
    _write_run(tmp_path / "r", metrics, events)
    run = load_run(tmp_path / "r")
    assert [r["step"] for r in run.surviving] == [1, 2, 3, 4] and all(not is_eval(r) for r in run.records)
    assert [(r["step"], r["eval_loss"]) for r in run.evals] == [(2, 3.0), (4, 2.4)]
    summary = summarize(run)
    assert (summary.final_eval_step, summary.final_eval_loss) == (4, 2.4)
    assert summary.goodput["badput_s"]["eval"] == pytest.approx(6.0)


def test_trainer_report_prints_the_final_eval_loss_and_draws_the_eval_curve(tmp_path, capsys):
    from trainer.observe.plots import plot_loss
    from trainer.report import format_summary

    metrics = [_step(1, 1), _step(2, 2), _eval(2, 2.5, 3.0), _step(3, 3), _step(4, 4), _eval(4, 4.5, 2.5)]
    _write_run(tmp_path / "r", metrics, [{"event": "start", "time": 0.0, "steps": 4}])
    run = load_run(tmp_path / "r")
    assert "final eval loss   2.5000 (step 4)" in format_summary(summarize(run))
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    plot_loss(ax, [run], [run.name])
    curves = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert curves["eval loss (held out)"] == [3.0, 2.5]
    assert curves["loss"] == [2.0] * 4


def test_a_config_with_eval_keeps_its_eval_section_in_the_train_spec():
    from trainer.program.layout import train_spec

    cfg = replace(micro_config("eval_interval=5", "eval_steps=2"), "eval", target_eval_loss=1.5)
    spec = train_spec(cfg)
    assert (spec.eval.eval_interval, spec.eval.eval_steps, spec.eval.target_eval_loss) == (5, 2, 1.5)
