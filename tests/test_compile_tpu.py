"""`python -m trainer.compile` end to end: the real train step compiled for TPU topologies on this CPU machine.

Each test runs the CLI in a subprocess from a fresh working directory, as a user would, and reads its
--json report. They need libtpu (the `tpu` extra, which CI installs) and skip without it. TPU compiles
cost tens of CPU-seconds each even for qwen3-tiny, so these use short sequences and few compiles; the
3-slice, no-fit and qwen3-mini ones are in the soak tier (pytest -m soak, run by .ci/run).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import jax
import pytest

from trainer.config import load_config
from trainer.errors import EXIT_DOES_NOT_FIT
from trainer.model import count_params

pytest.importorskip("libtpu", reason="needs libtpu: pip install -e '.[tpu]'")

pytestmark = pytest.mark.slow
F32 = 4
BATCH_KEYS = 5  # inputs, targets, positions, segment_ids, loss_mask: int32 [rows, length] each


def compile_cli(cwd, *args: str, timeout: int = 900) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.compile", "base.yml", *args, "--json"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    report = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    return proc.returncode, report, proc.stderr


def gradient_shard_bytes(cfg, mesh_shape: dict, *, itemsize: int = 2, lanes: int = 128) -> int:
    """One chip's shard of every gradient in the reduce dtype (bfloat16), each shard's minor dimension
    padded to whole lanes of the TPU tile, as the cross-slice transfer lays it out."""
    from types import SimpleNamespace

    from trainer.model import abstract_params, param_logical_axes
    from trainer.parallel.rules import logical_to_spec

    mesh = SimpleNamespace(shape=mesh_shape)
    total = 0
    for names, leaf in zip(
        jax.tree.leaves(param_logical_axes(cfg.model), is_leaf=lambda x: isinstance(x, tuple)),
        jax.tree.leaves(abstract_params(cfg.model)),
    ):
        spec = logical_to_spec(names, leaf.shape, mesh, cfg.mesh.logical_axis_rules)
        shard = [
            size // math.prod(mesh_shape[a] for a in ((e,) if isinstance(e, str) else e or ()))
            for size, e in zip(leaf.shape, tuple(spec) + (None,) * (len(leaf.shape) - len(spec)))
        ]
        shard[-1] = -(-shard[-1] // lanes) * lanes
        total += math.prod(shard) * itemsize
    return total


def analytic_argument_bytes(overrides: list[str], *, fsdp: int, rows_per_chip: int) -> int:
    """float32 params + Adam's two moments, sharded fsdp ways, plus this chip's rows of the batch."""
    cfg = load_config("base.yml", overrides)
    params, _ = count_params(cfg.model)
    return 3 * params * F32 // fsdp + BATCH_KEYS * rows_per_chip * cfg.data.max_target_length * 4


@pytest.mark.soak  # ~1 min of CPU each: in the soak tier, which .ci/run also runs
def test_tiny_on_three_v5e_4_slices_compiles_with_dcn_collectives_and_its_two_slice_resize_layout(tmp_path):
    model = ["model=qwen3-tiny", "max_target_length=128"]
    code, report, err = compile_cli(
        tmp_path,
        *model,
        "compile_topology=v5e-4",
        "compile_topology_num_slices=3",
        "elastic_min_slice_count=2",
        "elastic_resize_batch_policy=keep_global",
        "eval_interval=10",
        "eval_steps=1",
    )
    assert code == 0, err[-3000:]
    assert report["fits"] and report["chips"] == 12
    full, resized = report["layouts"]
    assert (full["active_slices"], resized["active_slices"]) == (3, 2)
    # The TPU-only splash kernel and the eval step compile for the target too (sequence 128 tiles).
    assert full["attention"] == "splash"
    assert full["eval"]["fits"] and full["eval"]["global_batch_size"] == 24
    # keep_global: the survivors run the same global batch, more rows per chip, so more activations.
    assert resized["global_batch_size"] == full["global_batch_size"] == 24
    assert resized["memory"]["temporaries"] > full["memory"]["temporaries"]
    for layout in (full, resized):
        rows = layout["global_batch_size"] // layout["chips"]
        expected = analytic_argument_bytes(model, fsdp=4, rows_per_chip=rows)
        assert layout["memory"]["arguments"] == pytest.approx(expected, rel=0.10)
        assert layout["memory"]["fits"] and 0 < layout["memory"]["total"] < layout["memory"]["hbm"]
        assert layout["collectives"]["ici"]["all-gather"]["count"] > 0  # fsdp gathers parameters in a slice
        # Gradients are summed across the slices over the DCN.
        assert layout["collectives"]["dcn"]["all-reduce"]["bytes"] > 0
    assert 0 < full["estimate"]["mfu"] <= 1 and full["estimate"]["step_time_s"] > 0


def test_tiny_on_one_chip_compiles_without_collectives(tmp_path):
    model = ["model=qwen3-tiny", "max_target_length=64"]
    code, report, err = compile_cli(tmp_path, *model, "compile_topology=v5e-1")
    assert code == 0, err[-3000:]
    (layout,) = report["layouts"]
    assert layout["chips"] == 1 and layout["collectives"] == {}
    expected = analytic_argument_bytes(model, fsdp=1, rows_per_chip=layout["global_batch_size"])
    mem = layout["memory"]
    assert mem["arguments"] == pytest.approx(expected, rel=0.10)
    assert mem["params"] + mem["optimizer"] <= mem["state_tiled"] < mem["arguments"]


@pytest.mark.soak  # ~1 min of CPU each: in the soak tier, which .ci/run also runs
def test_oversized_config_exits_no_fit_and_names_the_knob_that_fits(tmp_path):
    # qwen3-1.7b replicated on every chip (data parallel only): ~27 GiB per chip against v5e's 16.
    code, report, err = compile_cli(
        tmp_path,
        "model=qwen3-1.7b",
        "compile_topology=v5e-4",
        "ici_data_parallelism=4",
        "ici_fsdp_parallelism=1",
        "per_device_batch_size=1",
        "max_target_length=64",
    )
    assert code == EXIT_DOES_NOT_FIT, err[-3000:]
    (layout,) = report["layouts"]
    assert not layout["memory"]["fits"] and layout["memory"]["total"] > layout["memory"]["hbm"]
    fitting = [a for a in report["alternatives"] if a["fits"]]
    assert fitting and fitting[0]["knob"] == "more fsdp"
    assert "ici_fsdp_parallelism=-1" in fitting[0]["overrides"] and fitting[0]["saves_bytes"] > 0


@pytest.mark.soak  # ~4 min of CPU: in the soak tier, which .ci/run also runs
def test_llama3_2_1b_fits_on_v5e_16_like_any_preset(tmp_path):
    """The second model family through the same compile: fsdp over the 16 chips, splash attention."""
    model = ["model=llama3.2-1b"]
    code, report, err = compile_cli(tmp_path, *model, "compile_topology=v5e-16", "--alternatives=none")
    assert code == 0, err[-3000:]
    (layout,) = report["layouts"]
    assert report["fits"] and layout["chips"] == 16 and layout["attention"] == "splash"
    rows = layout["global_batch_size"] // layout["chips"]
    expected = analytic_argument_bytes(model, fsdp=16, rows_per_chip=rows)
    assert layout["memory"]["arguments"] == pytest.approx(expected, rel=0.10)
    assert layout["memory"]["fits"] and 0 < layout["memory"]["total"] < layout["memory"]["hbm"]


def test_text_report_names_the_knob(tmp_path):
    """The same no-fit case in the text form a user reads: exit 4, the knob and STATUS."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.compile",
            "compile_topology=v5e-1",
            "model=qwen3-1.7b",
            "--alternatives=none",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == EXIT_DOES_NOT_FIT, proc.stderr[-3000:]
    assert "DOES NOT FIT" in proc.stdout and "RESOURCE_EXHAUSTED" in proc.stdout
    assert proc.stdout.strip().endswith("STATUS: does_not_fit")


def test_context_parallel_report_names_the_split_its_strategy_and_kernel(tmp_path):
    """CP 2 on a v5p-8 (4 chips): the text report states the axis, strategy, the attention that runs under
    it (flash: splash, autoselected's TPU pick, does not run on a split sequence) and tokens per chip."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.compile",
            "model=qwen3-tiny",
            "compile_topology=v5p-8",
            "max_target_length=256",
            "ici_context_parallelism=2",
            "--alternatives=none",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 4 chips, per_device_batch_size 2: global batch 8 over 2 batch shards, each sequence split 2 ways.
    assert "mesh data=1 fsdp=2 context=2" in proc.stdout
    assert (
        "context split: axis 2, strategy all_gather, attention under it: flash; 128 tokens of each sequence "
        "per chip, 4 sequence(s) per chip, 512 tokens per chip per micro-step"
    ) in proc.stdout
    assert "attention kernel: flash" in proc.stdout


def test_context_parallel_job_that_does_not_fit_is_offered_the_other_strategy_and_a_wider_axis(tmp_path):
    """dot_product attention over 16k tokens, 16 sequences per chip: nothing fits (every compile is a quick
    refusal), and the context alternatives come first, each with the memory the compiler asked for."""
    code, report, err = compile_cli(
        tmp_path,
        "model=qwen3-tiny",
        "compile_topology=v5e-4",
        "max_target_length=16384",
        "attention=dot_product",
        "per_device_batch_size=16",
        "ici_context_parallelism=2",
    )
    assert code == EXIT_DOES_NOT_FIT, err[-3000:]
    (layout,) = report["layouts"]
    assert layout["context"]["axis"] == 2 and layout["context"]["kernel"] == "dot_product"
    first, second = report["alternatives"][:2]
    assert (first["knob"], first["overrides"]) == ("context strategy", ["context_parallel_strategy=ring"])
    assert (second["knob"], second["overrides"]) == ("wider context", ["ici_context_parallelism=4"])
    assert first["context"]["kernel"] == "ring online-softmax tiles" and second["context"]["axis"] == 4
    for alt in (first, second):
        assert not alt["fits"] and alt["total_bytes"] > layout["memory"]["hbm"]
    assert report["context_pick"] is None


@pytest.mark.soak  # three tiny compiles, ~2 min of CPU
def test_context_parallel_job_that_fits_picks_the_strategy_with_the_least_memory(tmp_path):
    code, report, err = compile_cli(
        tmp_path,
        "model=qwen3-tiny",
        "compile_topology=v5p-8",
        "max_target_length=256",
        "ici_context_parallelism=2",
        "--alternatives=all",
    )
    assert code == 0, err[-3000:]
    (layout,) = report["layouts"]
    compiled = [
        {"overrides": ["context_parallel_strategy=all_gather"], "total_bytes": layout["memory"]["total"]},
        *report["alternatives"],
    ]
    assert [a["knob"] for a in report["alternatives"]] == ["context strategy", "wider context"]
    least = min(compiled, key=lambda c: c["total_bytes"])
    assert report["context_pick"]["overrides"] == least["overrides"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["model=qwen3-tiny"], "compile_topology is required"),
        (["compile_topology=v9z-8"], "unknown TPU"),
        (["compile_topology=v5e-12"], "not a v5e slice size"),
        (["compile_topology=v5e-4", "compile_topology_num_slices=2", "num_slices=3"], "disagrees"),
        (["compile_topology=v5e-4", "learning_rat=1"], "did you mean 'learning_rate'"),
        (["compile_topology=v5e-8", "ici_fsdp_parallelism=3"], "ici parallelism"),
    ],
)
def test_bad_input_exits_2_with_the_reason(tmp_path, args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.compile", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr


@pytest.mark.soak
@pytest.mark.parametrize("topology, slices", [("v5e-8", "1"), ("v5e-4", "2")])
def test_mini_compiles_and_fits(tmp_path, topology, slices):
    model = ["model=qwen3-mini", "max_target_length=128"]
    code, report, err = compile_cli(
        tmp_path, *model, f"compile_topology={topology}", f"compile_topology_num_slices={slices}"
    )
    assert code == 0, err[-3000:]
    (layout,) = report["layouts"]
    fsdp = 8 // int(slices)
    mem = layout["memory"]
    # Per chip, the state is what its shardings give each device: at least an even fsdp split of the
    # float32 params (leaves fsdp cannot divide, like the norms, stay whole), at most a whole replica.
    params, _ = count_params(load_config("base.yml", model).model)
    assert params * F32 / fsdp <= mem["params"] <= params * F32
    batch = BATCH_KEYS * (layout["global_batch_size"] // 8) * 128 * 4
    state = mem["params"] + mem["optimizer"]
    # The compiler's argument bytes are the state in the chip's tiled layouts plus the batch. qwen3-mini's
    # head_dim of 64 is half a 128-lane tile, so its attention weights take twice their size there: on
    # one v5e-8 slice (fsdp 8, the head dimension minor) 15% more than the shardings' bytes.
    assert state <= mem["state_tiled"] <= 1.25 * state
    assert mem["arguments"] == pytest.approx(mem["state_tiled"] + batch, rel=0.10)
    assert layout["collectives"]["ici"]["all-gather"]["count"] > 0
    assert ("dcn" in layout["collectives"]) == (slices == "2")


def test_across_slices_only_the_gradient_shard_travels_and_no_logits_are_reduced(tmp_path):
    """The guard on what the step sends where: slices are data-parallel replicas, so the DCN carries the
    gradient reduction and nothing else (one gradient shard per chip per step, in the reduce dtype, as the
    transfer lays it out: minor dimensions padded to the tile's 128 lanes), and the loss never reduces
    float32 [tokens, vocab] logits over the ICI."""
    model = ["model=qwen3-tiny", "max_target_length=384"]  # 768 tokens per chip: not a multiple of emb_dim
    code, report, err = compile_cli(tmp_path, *model, "compile_topology=v5e-4", "compile_topology_num_slices=2")
    assert code == 0, err[-3000:]
    cfg = load_config("base.yml", model)
    (layout,) = report["layouts"]
    dcn = layout["collectives"]["dcn"]
    assert set(dcn) <= {"all-reduce", "reduce-scatter"}, dcn
    sent = sum(v["bytes"] for v in dcn.values())
    # Every gradient crosses (at least the shards' bytes), and nothing else (at most their lane-padded bytes;
    # the compiler packs some minor dimensions instead of padding them).
    assert (
        gradient_shard_bytes(cfg, layout["mesh"], lanes=1)
        <= sent
        <= 1.05 * gradient_shard_bytes(cfg, layout["mesh"])
    )
    vocab, emb = cfg.model.vocab_size, cfg.model.base_emb_dim
    for c in layout["largest_collectives"]:
        for array in c["shape"].split(", "):
            dims = [int(d) for d in array.partition("[")[2].rstrip("]").split(",") if d]
            if c["network"] == "ici" and c["kind"] == "all-reduce" and array.startswith("f32") and vocab in dims:
                assert all(d in (vocab, emb) for d in dims), f"logits reduced over the ICI: {c}"
