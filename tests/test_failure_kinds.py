"""Failure kinds: one module each, one registration, one parse of the schedule, hooks in a fixed order.

What each kind declares (`trainer.failures.kind.FailureKind`) is checked against the code it names, so a
declaration cannot drift from the injector, detector or planner term it points at; a kind defined here,
outside the package, shows that adding one touches nothing but its module and the registration.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import itertools
import pkgutil
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import trainer.failures
from trainer.attempt import loop
from trainer.config import ConfigError, load_config
from trainer.elastic.faults import FaultInjector
from trainer.failures import plan as plan_module
from trainer.failures.kind import ANY, PROCESSES, SLICES, FailureKind, Injection, entry_error
from trainer.failures.plan import FaultPlan, parse_plan
from trainer.failures.registry import KINDS, kind_of
from trainer.failures.slice_loss import Outages
from trainer.observe import catalogue
from trainer.observe.goodput import CAUSES

REPO = Path(__file__).resolve().parents[1]
NOT_KINDS = {"kind", "plan", "registry", "chaos_requests"}  # the package's own machinery, slice_loss's protocol


class Events:
    def __init__(self):
        self.emitted: list[tuple[str, dict]] = []

    def emit(self, name, **fields):
        self.emitted.append((name, fields))

    def of(self, name: str) -> list[dict]:
        return [fields for n, fields in self.emitted if n == name]


def _resolve(reference: str):
    module, _, attr = reference.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# ---- the registry and the declarations ------------------------------------------------------------------


def test_every_kind_module_is_registered_once_and_every_fault_type_belongs_to_one_kind():
    modules = {m.name for m in pkgutil.iter_modules(trainer.failures.__path__)} - NOT_KINDS
    declared = {importlib.import_module(f"trainer.failures.{m}").KIND for m in modules}
    assert set(KINDS) == declared and len(KINDS) == len(modules), "a kind module without its registration"
    assert len({k.name for k in KINDS}) == len(KINDS)
    types = [t for k in KINDS for t in k.faults]
    assert len(types) == len(set(types)), "a fault type claimed by two kinds"
    for t in types:
        assert dataclasses.is_dataclass(t) and t.__dataclass_params__.frozen, t


def test_an_entry_belongs_to_one_kind_by_its_keys():
    for a, b in itertools.combinations(KINDS, 2):
        assert not a.keys & b.keys, f"{a.name} and {b.name} share keys {a.keys & b.keys}"
    assert [k.name for k in KINDS if k.fallback] == ["slice_loss"]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_each_declaration_names_code_that_exists(kind):
    references = [kind.injected_by, kind.detected_by] + ([kind.planner_term] if kind.planner_term else [])
    for reference in references:
        assert callable(_resolve(reference)), reference
    assert kind.goodput_cause in CAUSES
    assert kind.scope in (SLICES, PROCESSES, ANY)
    assert kind.events and all(isinstance(e, catalogue.Event) for e in kind.events)
    assert kind.outcome and kind.grammar
    if kind.injection is not None:  # the class or factory named as its injector is what it builds
        built = kind.injection(tuple(), _context())
        assert built is None or isinstance(built, _resolve(kind.injected_by))


VALUES = {"N": "3", "K": "1", "S": "2", "M": "2", "R": "0.5", "D": "1", "F": "5", "P": "1"}


def _forms(grammar: str):
    """Every entry a grammar line allows: each alternative, with and without its optional parts, each
    choice of a value (`a|b`), the placeholders filled in."""
    for alternative in grammar.split(" | "):
        for text in (re.sub(r"\[[^\]]*\]", "", alternative), alternative.replace("[", "").replace("]", "")):
            parts = []
            for part in text.split(","):
                k, _, v = part.partition("=")
                parts.append([f"{k}={VALUES.get(choice, choice)}" for choice in v.split("|")])
            yield from (",".join(p) for p in itertools.product(*parts))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_form_of_a_kinds_grammar_parses_into_its_faults(kind):
    forms = sorted(set(_forms(kind.grammar)))
    assert forms
    for entry in forms:
        (fault,) = parse_plan(entry, num_slices=3).faults
        assert kind_of(fault) is kind and isinstance(fault, kind.faults), entry


def test_an_entry_mixing_two_kinds_or_two_kinds_of_run_is_refused_naming_it():
    with pytest.raises(ConfigError, match="'step=3,slice=1,nan=1'"):
        parse_plan("step=3,slice=1,nan=1", num_slices=2)
    with pytest.raises(ConfigError, match="mixes the keys of slice_loss and silent_data_corruption"):
        parse_plan("step=3,slice=1,corrupt=1,down_s=2", num_slices=2)
    with pytest.raises(ConfigError, match="a run is one or the other"):
        parse_plan("step=3,slice=1; step=4,process=1,error=oom", num_slices=2)
    with pytest.raises(ConfigError, match="'step3' is not key=value"):
        parse_plan("step3", num_slices=2)


# ---- parsed once, at validation -------------------------------------------------------------------------


def test_the_schedule_is_parsed_once_at_validation_and_the_config_carries_the_plan(monkeypatch):
    calls = []
    real = plan_module.parse_plan
    monkeypatch.setattr(plan_module, "parse_plan", lambda *a, **k: calls.append(a) or real(*a, **k))
    cfg = load_config("base.yml", ["num_slices=2", "fault_schedule=step=4,slice=1; step=6,spike=20"])
    assert len(calls) == 1, "validation parses the schedule"
    assert isinstance(cfg.faults, FaultPlan) and cfg.faults is cfg.faults
    assert [type(f).__name__ for f in cfg.faults.faults] == ["SliceLoss", "LossSpike"]
    assert len(calls) == 1, "the run reads the plan validation made"
    with pytest.raises(ConfigError, match=r"slice must be in \[0, 2\)"):
        load_config("base.yml", ["num_slices=2", "fault_schedule=step=4,slice=2"])


def test_no_module_but_the_config_parses_the_schedule():
    callers = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if name == "parse_plan":
                    callers.append(path.relative_to(REPO).as_posix())
    assert callers == ["trainer/config/schema.py"]


# ---- the hooks, in registry order -----------------------------------------------------------------------


def _context():
    from trainer.failures.kind import InjectionContext

    return InjectionContext(Events(), Outages(), None, once_per_run=lambda name: True)


def _state():
    return {"params": {"w": jnp.ones(4)}}


def _step(state, batch):
    params = {"w": state["params"]["w"] + 1.0}
    return dict(state, params=params), {"loss": jnp.float32(2.0), "grad_norm": jnp.float32(1.0), "finite": True}


def test_a_fault_due_at_a_step_that_fails_on_a_lost_slice_fires_at_the_step_that_runs(tmp_path):
    """A lost slice raises before any other kind's hook: a spike scheduled for the same step is not spent
    on a step that never ran, it lands on the retried step."""
    events = Events()
    plan = parse_plan("step=3,slice=1; step=3,spike=10", num_slices=2)
    injector = FaultInjector(plan, Outages(), tmp_path / "chaos", events)
    two = {0: [jax.devices()[0]], 1: [jax.devices()[1]]}
    injector.at_step_boundary(3)
    with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS"):
        injector.guard(_step, two)(_state(), {})
    assert events.of(catalogue.SPIKE_INJECTED) == []
    injector.at_step_boundary(3)  # the next attempt, on the surviving slice, trains step 3 again
    restored = {"params": {"w": jnp.full(4, 5.0)}}
    state, metrics = injector.guard(_step, {0: two[0]})(restored, {})
    assert events.of(catalogue.SPIKE_INJECTED) == [{"step": 3, "factor": 10.0}]
    assert float(metrics["loss"]) == 20.0
    assert jnp.allclose(state["params"]["w"], 5.0 + 10.0 * 1.0)  # the restored params, the update times 10


# ---- adding a kind: one module and one registration -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ZeroLoss:
    step: int


class ZeroLossInjection(Injection):
    def __init__(self, faults, context):
        self.steps = {f.step for f in faults}

    def after_step(self, step, state, metrics, slices):
        return state, (dict(metrics, loss=metrics["loss"] * 0.0) if step in self.steps else metrics)


def _parse_zero_loss(entry, fields, num_slices):
    if set(fields) != {"step", "zero_loss"}:
        raise entry_error(entry, "a zeroed loss is step=N,zero_loss=1")
    return ZeroLoss(int(fields["step"]))


ZERO_LOSS = FailureKind(
    name="zero_loss",
    keys=frozenset({"zero_loss"}),
    parse=_parse_zero_loss,
    faults=(ZeroLoss,),
    grammar="step=N,zero_loss=1",
    scope=SLICES,
    injection=lambda faults, context: ZeroLossInjection(faults, context) if faults else None,
    injected_by="tests.test_failure_kinds:ZeroLossInjection",
    detected_by="trainer.attempt.nonfinite:NonFinitePolicy",
    outcome="none: a test kind",
    events=(catalogue.NAN_INJECTED,),
    goodput_cause="other",
)


def test_a_new_kind_is_its_declaration_plus_a_registration(tmp_path):
    with pytest.raises(ConfigError, match="step=N,slice=K"):  # not registered: nobody's entry
        parse_plan("step=2,zero_loss=1", num_slices=2)
    kinds = (*KINDS, ZERO_LOSS)
    plan = parse_plan("step=2,zero_loss=1; step=5,slice=1", num_slices=2, kinds=kinds)
    assert [type(f).__name__ for f in plan.faults] == ["ZeroLoss", "SliceLoss"]
    injector = FaultInjector(plan, Outages(), tmp_path / "chaos", Events(), kinds=kinds)
    slices = {0: [jax.devices()[0]], 1: [jax.devices()[1]]}
    step = injector.guard(_step, slices)
    losses = []
    for n in (1, 2, 3):
        injector.at_step_boundary(n)
        losses.append(float(step(_state(), {})[1]["loss"]))
    assert losses == [2.0, 0.0, 2.0]


# ---- the loop's one end path ----------------------------------------------------------------------------


def test_the_train_loop_ends_through_one_return():
    tree = ast.parse(inspect.getsource(loop.train_loop)).body[0]

    def returns(node) -> int:
        nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        own = [c for c in ast.iter_child_nodes(node) if not isinstance(c, nested)]
        return sum(isinstance(c, ast.Return) + returns(c) for c in own)

    assert returns(tree) == 1
