"""CLI: `python -m trainer.compile [CONFIG] compile_topology=v5e-16 compile_topology_num_slices=3 [key=value ...]`.

Ahead-of-time compiles the trainer's real train step for a TPU topology on any machine (libtpu from
the `tpu` extra; no TPU needed) and reports per chip: parameter, optimizer-state, temporary and total
bytes against the chip's HBM, the collectives of one step (ICI and DCN), and a roofline step time and
MFU. With replica-resize (1 <= elastic_min_slice_count < num_slices) every survivor layout is compiled
too. A layout that does not fit is compiled again with single knobs changed until one fits.
With ici_context_parallelism > 1 each layout reports its context split (axis, strategy, the attention
that runs under it on TPU, tokens per chip), the other strategy and a wider context axis are the first
knobs tried, and with --alternatives=all they are compiled even when the job fits; the report then
names the context setting that fits with the least memory.

Exit codes: 0 every layout fits; 4 a layout does not fit (the report names the knob that makes it
fit, if one does); 2 bad config or topology; 1 any other failure (e.g. the compiler rejected the step).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from trainer.errors import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT, EXIT_FAILED, EXIT_OK

TARGET_KEYS = ("compile_topology", "compile_topology_num_slices")
GIB = 1 << 30


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m trainer.compile",
        description="Compile the train step for a TPU topology without a TPU: memory per chip, fit, "
        "collectives, estimated step time and MFU.",
        epilog="Exit codes: 0 fits; 4 does not fit; 2 bad config or topology; 1 other failure.",
    )
    p.add_argument("config", nargs="?", default="base.yml", help="config file path or name in configs/")
    p.add_argument(
        "overrides",
        nargs="*",
        help="key=value: compile_topology (e.g. v5e-16, v5p-32, v6e:4x4), compile_topology_num_slices "
        "(default 1), and any trainer config key",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.add_argument(
        "--alternatives",
        choices=("first", "all", "none"),
        default="first",
        help="when a layout does not fit: compile knob changes until the first fits (default), try every "
        "knob family, or none; all also compiles the context-parallel alternatives of a job that fits",
    )
    args = p.parse_intermixed_args(argv)
    if "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = "base.yml"
    return args


def split_target(overrides: list[str]):
    """(compile_topology, num_slices, the trainer's own overrides). num_slices follows the target."""
    from trainer.config import ConfigError

    target, rest = {}, []
    for item in overrides:
        key, _, value = item.partition("=")
        (rest.append(item) if key not in TARGET_KEYS else target.__setitem__(key, value))
    if not target.get("compile_topology"):
        raise ConfigError("compile_topology is required, e.g. compile_topology=v5e-16 (or v5e:4x4, v5p-32, v6e-8)")
    raw = target.get("compile_topology_num_slices", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"compile_topology_num_slices={raw!r}: give a whole number >= 1")
    num_slices = int(raw)
    given = [o for o in rest if o.startswith("num_slices=")]
    if given and given[-1] != f"num_slices={num_slices}":
        raise ConfigError(
            f"{given[-1]} disagrees with compile_topology_num_slices={num_slices}; drop num_slices "
            "(it follows the target)"
        )
    return target["compile_topology"], num_slices, [*rest, f"num_slices={num_slices}"]


def _libtpu_env(target) -> None:
    """Environment for loading libtpu on a machine without a TPU, only to compile. libtpu warns about the
    TPU VM variables it cannot find (they do not matter for compiling; defaults keep stderr readable),
    and by default lets one process at a time load it (a lock file that guards the chips): with no chips
    to guard, compiles may run side by side (tests, several targets)."""
    from trainer.backends import tpu_attached

    if tpu_attached():
        return
    chips = target.chips_per_slice
    kind = {"v5e": f"v5litepod-{chips}", "v6e": f"v6e-{chips}", "v5p": f"v5p-{2 * chips}"}[target.generation]
    for key, value in (
        ("TPU_SKIP_MDS_QUERY", "1"),
        ("TPU_ACCELERATOR_TYPE", kind),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
        ("TPU_WORKER_ID", "0"),
        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
    ):
        os.environ.setdefault(key, value)


def run(args) -> tuple[int, dict]:
    from trainer.aot import alternatives
    from trainer.aot.layouts import compile_layout, compile_layouts, survivor_slices
    from trainer.aot.topology import parse_topology
    from trainer.config.loader import load_config
    from trainer.program.layout import train_spec

    topology, num_slices, overrides = split_target(args.overrides)
    target = parse_topology(topology, num_slices)
    cfg = load_config(args.config, overrides)
    _libtpu_env(target)
    layouts = compile_layouts(cfg, target)
    report = {
        "model": cfg.model.model,
        "target": target.name,
        "chip": target.chip.name,
        "chips": target.chips_per_slice * num_slices,
        "hbm_bytes": target.chip.hbm_bytes,
        "elastic_resize_batch_policy": cfg.elastic.elastic_resize_batch_policy,
        "layouts": [r.as_dict() for r in layouts],
        "fits": all(r.fits for r in layouts),
        "alternatives": [],
    }
    failing = next((r for r in layouts if not r.fits), None)
    survivors_of = failing or layouts[0]  # the layout the alternatives change: the first that does not fit

    def try_knob(knob):
        changed = load_config(args.config, [*overrides, *knob.overrides])
        survivors = survivor_slices(target, survivors_of.active_slices)
        return compile_layout(train_spec(changed), survivors, target, label=" ".join(knob.overrides))

    if failing is not None and args.alternatives != "none":
        tried = alternatives.search(
            cfg, try_knob, stop_at_first=args.alternatives == "first", chips_per_slice=target.chips_per_slice
        )
    elif failing is None and args.alternatives == "all":
        # A job that fits: the context-parallel alternatives are still compiled, to pick the strategy.
        tried = [(knob, try_knob(knob)) for knob in alternatives.context_knobs(cfg, target.chips_per_slice)]
    else:
        tried = []
    report["alternatives"] = [
        {
            "knob": knob.family,
            "overrides": list(knob.overrides),
            "layout": survivors_of.label,
            "total_bytes": result.memory.total,
            "saves_bytes": survivors_of.memory.total - result.memory.total,
            "fits": result.fits,
            "global_batch_size": result.global_batch_size,
            "mfu": result.estimate.get("mfu"),
            "context": result.context,
        }
        for knob, result in tried
    ]
    report["context_pick"] = _context_pick(cfg, survivors_of, report["alternatives"])
    return (EXIT_OK if report["fits"] else EXIT_DOES_NOT_FIT), report


def _context_pick(cfg, layout, tried: list[dict]) -> dict | None:
    """Among the configured context strategy and the compiled context alternatives, the one that fits
    with the least memory per chip ({overrides, total_bytes, fits}); None without context parallelism
    or when none of them fits."""
    from trainer.aot import context

    if cfg.mesh.ici_context_parallelism == 1:
        return None
    own = {
        "overrides": [f"context_parallel_strategy={cfg.mesh.context_parallel_strategy}"],
        "total_bytes": layout.memory.total,
        "fits": layout.fits,
    }
    candidates = [own] + [a for a in tried if a["knob"] in ("context strategy", "wider context")]
    return context.pick(candidates)


def _context_lines(ctx: dict) -> list[str]:
    if not ctx:
        return []
    return [
        f"  context split: axis {ctx['axis']}, strategy {ctx['strategy']}, attention under it: {ctx['kernel']}; "
        f"{ctx['sequence_tokens_per_chip']:,} tokens of each sequence per chip, {ctx['sequences_per_chip']:g} "
        f"sequence(s) per chip, {ctx['tokens_per_chip']:,} tokens per chip per micro-step"
    ]


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def format_report(report: dict) -> str:
    from trainer.aot.topology import CHIPS

    chip = next(c for c in CHIPS.values() if c.name == report["chip"])
    lines = [
        f"{report['model']} on {report['target']} ({report['chips']} chips, {report['chip']}, "
        f"{_gib(report['hbm_bytes'])} HBM per chip)"
    ]
    for r in report["layouts"]:
        m, e = r["memory"], r["estimate"]
        mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items())
        lines.append(
            f"[{r['label']}] {r['chips']} chips, mesh {mesh}; global batch {r['global_batch_size']}, "
            f"{r['micro_steps']} micro-step(s), lr x{r['lr_scale']:g}; compiled in {r['compile_s']:.1f} s"
        )
        lines += _context_lines(r.get("context", {}))
        if m["compiler_error"]:
            lines += [
                f"  memory per chip: params {_gib(m['params'])}, optimizer {_gib(m['optimizer'])} (from the "
                f"shardings); the compiler needs {_gib(m['total'])}: DOES NOT FIT",
                f"  the compiler refused it: {m['compiler_error']}",
            ]
            continue
        tiled = m.get("state_tiled")
        if tiled is not None and tiled > 1.02 * (m["params"] + m["optimizer"]):
            lines.append(
                f"  tile padding: params + optimizer take {_gib(tiled)} in the chip's layouts, "
                f"{100 * (tiled / (m['params'] + m['optimizer']) - 1):.0f}% over their "
                f"{_gib(m['params'] + m['optimizer'])} (dimensions that are not multiples of the tile)"
            )
        lines.append(
            f"  memory per chip: params {_gib(m['params'])}, optimizer {_gib(m['optimizer'])}, arguments "
            f"{_gib(m['arguments'])}, temporaries {_gib(m['temporaries'])}, total {_gib(m['total'])} "
            f"= {100 * m['fraction_of_hbm']:.1f}% of HBM: {'fits' if m['fits'] else 'DOES NOT FIT'}"
        )
        net = {n: sum(v["bytes"] for v in r["collectives"].get(n, {}).values()) for n in ("ici", "dcn")}
        lines.append(
            f"  per chip and step: memory {m['total'] / 1e6:,.0f} MB, ICI {net['ici'] / 1e9:.2f} GB, "
            f"DCN {net['dcn'] / 1e6:,.0f} MB (collective buffers)"
        )
        for c in r.get("largest_collectives", [])[:3]:
            lines.append(
                f"  largest: {c['network'].upper()} {c['kind']} {c['shape']} x{c['executions']} "
                f"({c['bytes'] / 1e6:,.0f} MB per step)"
            )
        if not r["collectives"]:
            lines.append("  collectives per step: none")
        for net, kinds in sorted(r["collectives"].items(), key=lambda kv: kv[0] != "ici"):
            for kind, v in sorted(kinds.items()):
                lines.append(
                    f"  {net.upper()} {kind}: {v['count']} per step, {_gib(v['bytes'])} buffers, "
                    f"{_gib(v['traffic_bytes'])} sent per chip"
                )
        lines.append(f"  attention kernel: {r['attention']}")
        ev = r["eval"]
        if ev.get("compiler_error"):
            lines.append(f"  eval step: the compiler refused it: {ev['compiler_error']}")
        elif ev:
            lines.append(
                f"  eval step: global batch {ev['global_batch_size']}, compiled in {ev['compile_s']:.1f} s, "
                f"temporaries {_gib(ev['temporaries'])}, total with the train state {_gib(ev['total'])}: "
                f"{'fits' if ev['fits'] else 'DOES NOT FIT'}"
            )
        mfu = "n/a" if e["mfu"] is None else f"{100 * e['mfu']:.1f}%"
        lines.append(
            f"  estimated step {e['step_time_s'] * 1e3:.2f} ms, bound by {e['bound_by']} (compute "
            f"{e['compute_s'] * 1e3:.2f}, HBM {e['hbm_s'] * 1e3:.2f}, ICI {e['ici_s'] * 1e3:.2f}, DCN "
            f"{e['dcn_s'] * 1e3:.2f} ms); MFU <= {mfu}"
        )
    lines.append(
        f"chip numbers used: {chip.peak_flops / 1e12:g} TFLOP/s bf16, HBM {chip.hbm_bandwidth / 1e9:g} GB/s, "
        f"ICI {chip.ici_bandwidth / 1e9:g} GB/s, DCN {chip.dcn_bandwidth / 1e9:g} GB/s per chip "
        f"({chip.source}); the estimate is a roofline (perfect overlap), so MFU is an upper bound"
    )
    for a in report["alternatives"]:
        verdict = "fits" if a["fits"] else "still does not fit"
        delta = f"{_gib(abs(a['saves_bytes']))} {'less' if a['saves_bytes'] >= 0 else 'more'} per chip"
        lines.append(
            f"alternative ({a['knob']}): {' '.join(a['overrides'])} -> total {_gib(a['total_bytes'])}, "
            f"{delta}, {verdict} (global batch {a['global_batch_size']})"
        )
    pick = report.get("context_pick")
    if pick is not None:
        lines.append(
            f"context parallelism: {' '.join(pick['overrides'])} fits with the least memory of those compiled "
            f"({_gib(pick['total_bytes'])} per chip)"
        )
    fitting = [a for a in report["alternatives"] if a["fits"]]
    if not report["fits"]:
        lines.append(
            f"does not fit; fits with: {' '.join(fitting[0]['overrides'])}"
            if fitting
            else "does not fit, and no single knob tried makes it fit"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s] %(message)s", stream=sys.stderr, force=True
    )
    for noisy in ("absl", "jax._src", "orbax", "tensorstore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from trainer.errors import UserInputError

    try:
        code, report = run(args)
    except UserInputError as e:
        print(f"config error: {e}", file=sys.stderr)
        print("STATUS: config_error", flush=True)
        return EXIT_BAD_INPUT
    except Exception as e:  # the compiler rejected the step, or another failure: traceback logged
        logging.getLogger("trainer.compile").exception("compile failed")
        print(f"STATUS: failed: {type(e).__name__}: {e}", flush=True)
        return EXIT_FAILED
    print(json.dumps(report, indent=1) if args.json else format_report(report), flush=True)
    if not args.json:
        print(f"STATUS: {'fits' if code == EXIT_OK else 'does_not_fit'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
