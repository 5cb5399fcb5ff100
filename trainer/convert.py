"""CLI: convert between Hugging Face checkpoints (Qwen3, Qwen3-MoE, Llama 3) and this trainer's; print logits.

    python -m trainer.convert hf-to-trainer --hf-dir D --output-dir O [--weight-dtype float32]
        D: config.json + *.safetensors (sharded with model.safetensors.index.json or not; never pickle).
        O: a params-only checkpoint to train from (load_parameters_path=O), plus O/model.yml, the model
        config derived from config.json (model=O/model.yml), O/hf_config.json (the source config.json)
        and O/tokenizer.json when D has one (model.yml then points tokenizer_path at it).
    python -m trainer.convert trainer-to-hf --checkpoint C --output-dir O [--dtype bfloat16]
        C: a training checkpoint step dir (<run>/checkpoints/<step>; its config is in metadata/metadata)
        or an hf-to-trainer output (its config is C/model.yml); --model PRESET_OR_YAML for any other.
        O: config.json + model.safetensors (or model-0000k-of-0000n.safetensors + index past
        --max-shard-gb) that transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM / LlamaForCausalLM
        load (the checkpoint's model_family picks which), and the checkpoint's tokenizer.json
        (tokenizer_type=huggingface) with a tokenizer_config.json that AutoTokenizer loads to the same
        token ids; a sentencepiece tokenizer is left out (a warning).
    python -m trainer.convert lora-to-peft --checkpoint C --output-dir O
        C: a LoRA run's checkpoint step (lora_rank > 0). O: adapter_config.json + adapter_model.safetensors
        that peft.PeftModel.from_pretrained loads over the base's trainer-to-hf export. trainer-to-hf of
        the same C writes the merged full model instead (the base, read from its recorded
        load_parameters_path and checked against its recorded content hash, plus lora_alpha / r * A B).
    python -m trainer.convert logits (--checkpoint C | --hf-dir D) --input-ids IDS --output out.npy
        float32 logits [batch, seq, vocab] of int token ids [batch, seq] (or [seq]); the model runs in
        float32 and, if MoE, dropless (as HF does), whatever the training dtype and capacity factor.
        IDS: a .npy integer array, or a text file of integer ids separated by spaces or commas, one
        sequence per line (all the same length).

Paths may be relative (to the working directory), start with ~, or (inputs) be gs:// URIs; outputs
are local. Errors a user can fix (a missing or wrong input directory, a run directory given for a
step, an unsupported architecture or config key, an invalid config.json, a truncated safetensors
file, a missing, misshapen or unexpected tensor, a checkpoint that does not match --model, unusable
ids, an existing or unwritable output) print one line `python -m trainer.convert: error: ...` naming
the file, key or tensor and the fix, and exit 2; they are found from headers and metadata, before any
tensor is read. Outputs are built in a hidden staging directory next to O and moved into place only
when complete, so a failure never leaves O behind; an existing O is refused, or with --overwrite
replaced only by a complete new one.

Memory. Both directions stream one tensor at a time and never hold the model twice:
- hf-to-trainer: each param leaf is allocated once in weight_dtype and filled tensor by tensor (stacked
  layers and experts included) from memory-mapped safetensors, then saved with
  `save_parameters(in_place=True)`, which skips Orbax's defensive copy and zstd buffers. Peak =
  params + one tensor (anonymous) + source pages the OS maps in (file-backed, reclaimable).
- trainer-to-hf: the checkpoint is restored once; our own safetensors writer writes the header, then
  each transposed tensor, dropping it before the next. Peak = params + Orbax's transient read buffers
  + one output tensor.
Measured peak RSS for a 468M-param model (1.87 GB float32, 0.94 GB bf16 source; ~0.2 GB is the runtime):
hf-to-trainer 2.97 GB (4.6 GB with a default Orbax save); trainer-to-hf --dtype bfloat16 3.08 GB.
The tracemalloc bounds are asserted in tests/test_hf_interop.py.
"""

# The CLI only: it parses the arguments, calls the library in trainer/hf/ (to_trainer.py, to_hf.py,
# logits.py) and maps its errors to one line and exit 2 (trainer.errors.tool_main). The docstring above
# is the --help epilog.

from __future__ import annotations

import argparse
import logging
import sys

from trainer.errors import UserInputError, tool_main
from trainer.hf.logits import logits_command
from trainer.hf.lora_export import lora_to_peft
from trainer.hf.safetensors_io import ST_DTYPES
from trainer.hf.to_hf import trainer_to_hf
from trainer.hf.to_trainer import hf_to_trainer

PROG = "python -m trainer.convert"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = p.add_subparsers(dest="command", required=True)
    overwrite = {"action": "store_true", "help": "replace an existing output (only once the new one is complete)"}
    a = sub.add_parser("hf-to-trainer", help="Hugging Face directory -> params-only checkpoint + model.yml")
    a.add_argument("--hf-dir", required=True)
    a.add_argument("--output-dir", required=True)
    a.add_argument("--overwrite", **overwrite)
    a.add_argument(
        "--dtype", choices=sorted(ST_DTYPES), help="activation dtype in model.yml (default: config.json's dtype)"
    )
    a.add_argument("--weight-dtype", choices=sorted(ST_DTYPES), default="float32", help="stored params dtype")
    a.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stacked layer layout (scan_layers=true) or layers/0, layers/1, ...",
    )
    a.add_argument(
        "--moe-capacity-factor",
        type=float,
        help="MoE capacity factor in model.yml (default: experts / top_k, dropless like HF)",
    )
    b = sub.add_parser("trainer-to-hf", help="checkpoint -> config.json + safetensors for transformers")
    b.add_argument("--checkpoint", required=True, help="<run>/checkpoints/<step>, or an hf-to-trainer output")
    b.add_argument("--output-dir", required=True)
    b.add_argument("--overwrite", **overwrite)
    b.add_argument("--model", help="model preset or YAML, if the checkpoint does not record its config")
    b.add_argument("--dtype", choices=sorted(ST_DTYPES), help="output dtype (default: the params' dtype)")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="split the safetensors past this size")
    lo = sub.add_parser("lora-to-peft", help="LoRA checkpoint -> PEFT adapter directory")
    lo.add_argument("--checkpoint", required=True, help="<run>/checkpoints/<step> of a run with lora_rank > 0")
    lo.add_argument("--output-dir", required=True)
    lo.add_argument("--overwrite", **overwrite)
    c = sub.add_parser("logits", help="float32 logits of token ids, from a checkpoint or an HF directory")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint")
    src.add_argument("--hf-dir")
    c.add_argument("--model", help="model preset or YAML, if the checkpoint does not record its config")
    c.add_argument(
        "--input-ids",
        required=True,
        help="int ids [batch, seq] or [seq]: a .npy file, or text with "
        "ids separated by spaces or commas, one sequence per line",
    )
    c.add_argument("--output", required=True, help=".npy to write float32 [batch, seq, vocab]")
    c.add_argument("--overwrite", **overwrite)
    return p


def _run(args) -> int:
    if args.command == "hf-to-trainer":
        out = hf_to_trainer(
            args.hf_dir,
            args.output_dir,
            dtype=args.dtype,
            weight_dtype=args.weight_dtype,
            scan_layers=args.scan_layers,
            moe_capacity_factor=args.moe_capacity_factor,
            overwrite=args.overwrite,
        )
        print(f"wrote {out}: train or decode with model={out / 'model.yml'} load_parameters_path={out}")
    elif args.command == "trainer-to-hf":
        if not args.max_shard_gb > 0:
            raise UserInputError(f"--max-shard-gb {args.max_shard_gb} must be > 0")
        out = trainer_to_hf(
            args.checkpoint,
            args.output_dir,
            model=args.model,
            dtype=args.dtype,
            max_shard_bytes=int(args.max_shard_gb * 2**30),
            overwrite=args.overwrite,
        )
        print(f"wrote {out}")
    elif args.command == "lora-to-peft":
        out = lora_to_peft(args.checkpoint, args.output_dir, overwrite=args.overwrite)
        print(f"wrote {out}")
    else:
        out = logits_command(
            ckpt=args.checkpoint,
            hf_dir=args.hf_dir,
            model=args.model,
            input_ids=args.input_ids,
            output=args.output,
            overwrite=args.overwrite,
        )
        print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s] %(message)s", stream=sys.stderr)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return tool_main(PROG, lambda: _run(args))


if __name__ == "__main__":
    sys.exit(main())
