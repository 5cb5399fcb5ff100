"""The pieces of `trainer.compile` that need no libtpu: topology names, HLO collective parsing, the
resize layouts, the knob search, and the CPU pin for machines with libtpu but no TPU."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from trainer.aot import alternatives, context, hlo
from trainer.aot.layouts import layout_slice_counts
from trainer.aot.topology import parse_topology
from trainer.backends import tpu_attached
from trainer.config import ConfigError, load_config

HLO = """HloModule jit_train_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_gather (p: bf16[4,128]) -> bf16[16,128] {
  %p = bf16[4,128]{1,0} parameter(0)
  ROOT %all-gather.1 = bf16[16,128]{1,0:T(8,128)(2,1)} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %c = s32[]{:T(128)} constant(6)
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = bf16[4,128]{1,0} constant({...})
  %k = f32[8]{0} custom-call(%x), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "",
"xprof_metadata":"{\\"block_q\\": 128}"
}}, metadata={op_name="splash"}
  %g = bf16[16,128]{1,0} fusion(%x), kind=kCustom, calls=%fused_gather
  ROOT %t = (s32[], f32[8]) tuple(%i, %v)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body
  %rs = f32[2,128]{1,0} reduce-scatter(%y), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %ar = (f32[64]{0}, f32[32]{0}) all-reduce(%a1, %a2), channel_id=3, replica_groups={{0,1},{2,3}}, to_apply=%add
  %send = (f32[48,8]{1,0}, u32[], token[]) send(%z, %tok), channel_id=4, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="all-reduce.64_0"}
  %recv = (f32[48,8]{1,0}, u32[], token[]) recv(%tok), channel_id=5, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime"}
  ROOT %out = f32[8]{0} copy(%x)
}
"""  # noqa: E501


def test_collectives_are_counted_per_step_with_loop_trips_sizes_and_network():
    found = hlo.summarize(hlo.collectives(HLO, devices_per_slice=4, num_slices=3))
    # The all-gather sits in a fusion inside a 6-trip while body: 6 per step, 16x128 bf16 each (after a
    # Pallas kernel whose config spans lines, one of them starting with "}}").
    assert found["ici"]["all-gather"] == {"count": 6, "bytes": 6 * 16 * 128 * 2, "traffic_bytes": 6 * 3 * 1024}
    # A reduce-scatter's buffer is its input: the 2x128 f32 result times the group of 4.
    assert found["ici"]["reduce-scatter"]["bytes"] == 2 * 128 * 4 * 4
    # A tuple all-reduce moves every element; a ring sends 2 (n-1)/n of it (n = 2 here).
    assert found["ici"]["all-reduce"] == {"count": 1, "bytes": 96 * 4, "traffic_bytes": 96 * 4}
    # The megascale send is the cross-slice (DCN) all-reduce; its recv is the same exchange, not counted twice.
    assert found["dcn"] == {
        "all-reduce": {"count": 1, "bytes": 48 * 8 * 4, "traffic_bytes": int(48 * 8 * 4 * 4 / 3)}
    }


@pytest.mark.parametrize(
    "groups",
    [
        "{{0,2},{1,3}}",  # explicit
        "[2,2]<=[2,2]T(1,0)",  # iota, transposed
        "mesh['data'=2,'fsdp'=2,'tensor'=1] {'data'}",  # named mesh axes (newer XLA on CPU)
    ],
)
def test_replica_groups_read_the_same_from_every_form_xla_prints(groups):
    line = f"  %ar = f32[64]{{0}} all-reduce(%a), channel_id=1, replica_groups={groups}, to_apply=%add"
    assert hlo.replica_groups(line) == [[0, 2], [1, 3]]
    found = hlo.collectives(
        f"HloModule m\n\nENTRY %main () -> f32[64] {{\n{line}\n}}\n", devices_per_slice=4, num_slices=1
    )
    assert [c.group_size for c in found] == [2]


def test_a_module_without_collectives_has_none():
    text = "HloModule m\n\nENTRY %main (x: f32[8]) -> f32[8] {\n  ROOT %x = f32[8]{0} parameter(0)\n}\n"
    assert hlo.summarize(hlo.collectives(text, devices_per_slice=1, num_slices=1)) == {}


@pytest.mark.parametrize(
    "name, slices, layout, chips, label",
    [
        ("v5e-16", 3, "4x4", 16, "3x v5e-16"),
        ("v5e:2x4", 1, "2x4", 8, "v5e-8"),
        ("v5e-1", 1, "1x1", 1, "v5e-1"),
        ("v6e-8", 2, "2x4", 8, "2x v6e-8"),
        ("v5p-32", 1, "2x2x4", 16, "v5p-32"),
        ("V5P:2x2x2", 1, "2x2x2", 8, "v5p-16"),
    ],
)
def test_topology_names_map_to_chip_layouts(name, slices, layout, chips, label):
    target = parse_topology(name, slices)
    assert (target.layout, target.chips_per_slice, target.name) == (layout, chips, label)


@pytest.mark.parametrize(
    "name, message",
    [("tpu-8", "unknown TPU"), ("v5e-12", "one of v5e-1"), ("v5p:2x2", "3 dimensions"), ("v6e-x", "a number")],
)
def test_bad_topology_names_say_what_is_accepted(name, message):
    with pytest.raises(ConfigError, match=message):
        parse_topology(name, 1)


@pytest.mark.parametrize("low, counts", [(-1, [3]), (2, [3, 2]), (1, [3, 2, 1])])
def test_replica_resize_compiles_every_survivor_count(low, counts):
    cfg = load_config("base.yml", ["num_slices=3", f"elastic_min_slice_count={low}"])
    assert layout_slice_counts(cfg) == counts


def test_knob_search_keeps_the_math_first_and_stops_at_the_first_fit():
    cfg = load_config("base.yml", ["per_device_batch_size=8", "ici_data_parallelism=2", "ici_fsdp_parallelism=-1"])
    families = [[k.family for k in f] for f in alternatives.knob_families(cfg)]
    assert families == [["more fsdp"], ["remat_policy"], ["micro-steps"] * 3, ["per_device_batch_size"] * 3]
    # Pretend only 4 micro-steps (per_device_batch_size=2) or more fits.
    fits = {"per_device_batch_size=2", "per_device_batch_size=1"}
    tried = alternatives.search(cfg, lambda knob: SimpleNamespace(fits=knob.overrides[0] in fits))
    assert [k.overrides for k, _ in tried][-1] == ("per_device_batch_size=2", "gradient_accumulation_steps=4")
    assert len(tried) == 4  # fsdp, remat, micro x2, micro x4; the batch-size family is never compiled


@pytest.mark.parametrize(
    "overrides, chips, expected",
    [
        # context 4 x fsdp 2 on 8 chips: a sequence per 4 chips, so 0.25 is the smallest batch size
        (["per_device_batch_size=2", "ici_context_parallelism=4"], 8, [(2, "1"), (4, "0.5"), (8, "0.25")]),
        (["per_device_batch_size=0.5", "ici_context_parallelism=4"], 8, [(2, "0.25")]),
        # context 2 x fsdp 4: 0.5 is already one sequence per context group
        (["per_device_batch_size=0.5", "ici_context_parallelism=2"], 8, []),
        # the slice unknown: whole batch sizes only
        (["per_device_batch_size=0.5", "ici_context_parallelism=4"], 0, []),
        (["per_device_batch_size=6"], 0, [(2, "3")]),
    ],
)
def test_smaller_batch_knobs_are_whole_or_fractions_that_still_give_whole_sequences(overrides, chips, expected):
    cfg = load_config("base.yml", overrides)
    assert alternatives.smaller_batches(cfg, chips) == expected
    micro = [f for f in alternatives.knob_families(cfg, chips) if f[0].family == "micro-steps"]
    acc = cfg.optim.gradient_accumulation_steps
    assert [k.overrides for k in (micro[0] if micro else [])] == [
        (f"per_device_batch_size={text}", f"gradient_accumulation_steps={acc * k}") for k, text in expected
    ]


@pytest.mark.parametrize(
    "overrides, chips, expected",
    [
        # The fill axis gives up the chips for a context axis twice as wide.
        (["ici_context_parallelism=2"], 8, [("context_parallel_strategy=ring",), ("ici_context_parallelism=4",)]),
        (
            ["ici_context_parallelism=2", "context_parallel_strategy=ring", "ici_fsdp_parallelism=4"],
            8,
            [("context_parallel_strategy=all_gather",), ("ici_context_parallelism=4", "ici_fsdp_parallelism=2")],
        ),
        # A slice of 4 chips has no room for a context axis of 8... nor a sequence of 16 for 2 x 8 chunks.
        (["ici_context_parallelism=4"], 4, [("context_parallel_strategy=ring",)]),
        (["ici_context_parallelism=4", "max_target_length=8"], 8, [("context_parallel_strategy=ring",)]),
        ([], 8, []),
    ],
)
def test_context_alternatives_are_the_other_strategy_and_a_wider_axis_that_fits_the_slice(
    overrides, chips, expected
):
    cfg = load_config("base.yml", overrides)
    assert [k.overrides for k in alternatives.context_knobs(cfg, chips)] == expected
    families = [f[0].family for f in alternatives.knob_families(cfg, chips)]
    assert families[: len(expected)] == ["context strategy", "wider context"][: len(expected)]


def test_context_split_counts_every_chip_sequences_so_tokens_per_chip_do_not_fall_with_the_axis():
    for n in (2, 4):
        cfg = load_config("base.yml", [f"ici_context_parallelism={n}", "max_target_length=1024"])
        split = context.context_split(cfg, chips=8, global_batch_size=16, micro_steps=1, backend="tpu")
        assert split == {
            "axis": n,
            "strategy": "all_gather",
            "kernel": "flash",  # autoselected on TPU is splash, which does not run on a split sequence
            "sequence_tokens_per_chip": 1024 // n,
            "sequences_per_chip": 2 * n,
            "tokens_per_chip": 2 * 1024,
        }
    # per_device_batch_size=1/N: one sequence per context group of N chips, 1024 / N of its tokens per chip
    for n in (2, 4):
        cfg = load_config("base.yml", [f"ici_context_parallelism={n}", "max_target_length=1024"])
        split = context.context_split(cfg, chips=8, global_batch_size=8 // n, micro_steps=1, backend="tpu")
        assert (split["sequences_per_chip"], split["tokens_per_chip"]) == (1, 1024 // n)
        assert type(split["tokens_per_chip"]) is int
    ring = load_config("base.yml", ["ici_context_parallelism=2", "context_parallel_strategy=ring"])
    assert context.kernel_under_context(ring, backend="tpu") == context.RING_KERNEL
    assert (
        context.context_split(
            load_config("base.yml", []), chips=8, global_batch_size=16, micro_steps=1, backend="tpu"
        )
        == {}
    )


def test_the_context_pick_is_the_fitting_candidate_with_the_least_memory():
    candidates = [
        {"overrides": ["a"], "total_bytes": 5, "fits": True},
        {"overrides": ["b"], "total_bytes": 3, "fits": True},
        {"overrides": ["c"], "total_bytes": 1, "fits": False},
    ]
    assert context.pick(candidates)["overrides"] == ["b"]
    assert context.pick(candidates[2:]) is None


def test_tpu_is_recognised_on_the_pci_bus_by_device_not_vendor(tmp_path):
    def device(name, vendor, dev):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "device").write_text(dev + "\n")

    device("0000:00:04.0", "0x1ae0", "0x0042")  # gVNIC: Google's vendor id, not a TPU
    assert not tpu_attached(tmp_path)
    device("0000:00:05.0", "0x1ae0", "0x0063")  # a v5e chip
    assert tpu_attached(tmp_path)


@pytest.mark.skipif(tpu_attached(), reason="a TPU is attached")
def test_an_installed_libtpu_without_a_tpu_keeps_jax_on_cpu_and_quiet():
    pytest.importorskip("libtpu", reason="needs libtpu: pip install -e '.[tpu]'")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "import trainer, jax; print(jax.config.jax_platforms, jax.devices()[0].platform)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["cpu", "cpu"]
    assert "TPU" not in proc.stderr  # libtpu never started: none of its environment warnings
    pinned = subprocess.run(
        [sys.executable, "-c", "import trainer, jax; print(jax.config.jax_platforms)"],
        env=env | {"JAX_PLATFORMS": "proxy"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pinned.stdout.strip() == "proxy"  # an explicit choice (Pathways) is left alone


def test_tile_padding_counts_whole_tiles_of_the_two_minor_dimensions():
    from trainer.aot.analysis import tiled_bytes

    f32_tiles = SimpleNamespace(major_to_minor=(0, 1, 2), tiling=((8, 128),))
    # head_dim 64 in the minor dimension: padded to 128 lanes, twice the bytes.
    assert tiled_bytes((8, 64, 64), 4, f32_tiles) == 8 * 64 * 128 * 4
    # The minor dimension is the layout's, not the shape's last: (8, 1536, 64) stored with 1536 minor.
    assert tiled_bytes((8, 1536, 64), 4, SimpleNamespace(major_to_minor=(0, 2, 1), tiling=((8, 128),))) == (
        8 * 1536 * 64 * 4
    )
    assert tiled_bytes((3, 5), 4, f32_tiles) == 3 * 5 * 4  # a layout of another rank: no claim
    assert tiled_bytes((3, 5), 4, None) == 60
    assert tiled_bytes((5,), 4, SimpleNamespace(major_to_minor=(0,), tiling=((512,),))) == 512 * 4


def test_the_roofline_never_takes_less_than_the_model_plus_its_recompute_nor_less_than_one_state_update():
    from trainer.aot.analysis import roofline
    from trainer.aot.topology import CHIPS
    from trainer.model import recompute_flops_per_token, training_flops_per_token

    chip = CHIPS["v5p"]
    cfg = load_config("base.yml", ["model=qwen3-8b"]).model
    tokens = 2 * 2048  # per chip: per_device_batch_size 2
    model, recompute = training_flops_per_token(cfg, 2048) * tokens, recompute_flops_per_token(cfg, 2048) * tokens
    assert 0.30 < recompute / model < 0.34  # remat full: the forward again, a third of forward + backward
    # The compiler counted a scanned layer once: far fewer FLOPs and bytes than the step needs.
    est = roofline(
        hlo_cost={"flops": model / 30, "bytes_accessed": 1.0},
        collective_summary={},
        model_flops_per_chip=model,
        recompute_flops_per_chip=recompute,
        state_bytes_per_chip=1e9,
        chip=chip,
    )
    assert est["bound_by"] == "compute" and est["mfu"] == pytest.approx(model / (model + recompute), abs=1e-4)
    assert est["hbm_s"] == pytest.approx(2e9 / chip.hbm_bandwidth, rel=1e-3)  # rounded to microseconds
    none = load_config("base.yml", ["model=qwen3-8b", "remat_policy=none"]).model
    assert recompute_flops_per_token(none, 2048) == 0.0


@pytest.mark.parametrize(
    "message, required_gib",
    [
        ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (27.11G) "
         "exceeds available HBM (15.75G)", 27.11),
        ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory in "
         "memory space hbm. Used 15.75G of 15.75G hbm. Exceeded hbm capacity by 2.5G.\n"
         "Total hbm usage >= 18.25G: reserved 2.00M program 7.39G arguments 10.86G", 18.25),
    ],
)  # fmt: skip
def test_a_refused_program_requires_what_the_compiler_says_it_needed(message, required_gib):
    from trainer.aot.analysis import out_of_memory

    chip = SimpleNamespace(hbm_bytes=16 << 30)
    memory = out_of_memory(message, {"params": {}, "opt_state": {}}, chip)
    assert memory.required == pytest.approx(required_gib * (1 << 30), rel=1e-3)
    assert not memory.fits and memory.total == memory.required
