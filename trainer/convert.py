"""CLI: convert between Hugging Face Qwen3 / Qwen3-MoE checkpoints and this trainer's, and print logits.

    python -m trainer.convert hf-to-trainer --hf-dir D --output-dir O [--weight-dtype float32]
        D: config.json + *.safetensors (sharded with model.safetensors.index.json or not; never pickle).
        O: a params-only checkpoint to train from (load_parameters_path=O), plus O/model.yml, the model
        config derived from config.json (model=O/model.yml), O/hf_config.json (the source config.json)
        and O/tokenizer.json when D has one (model.yml then points tokenizer_path at it).
    python -m trainer.convert trainer-to-hf --checkpoint C --output-dir O [--dtype bfloat16]
        C: a training checkpoint step dir (<run>/checkpoints/<step>; its config is in metadata/metadata)
        or an hf-to-trainer output (its config is C/model.yml); --model PRESET_OR_YAML for any other.
        O: config.json + model.safetensors (or model-0000k-of-0000n.safetensors + index past
        --max-shard-gb) that transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM load.
    python -m trainer.convert logits (--checkpoint C | --hf-dir D) --input-ids ids.npy --output out.npy
        float32 logits [batch, seq, vocab] of int token ids [batch, seq] (or [seq]); the model runs in
        float32 and, if MoE, dropless (as HF does), whatever the training dtype and capacity factor.

Errors (unsupported architecture or config key, missing tensor, shape mismatch, unexpected tensor) name
the key or tensor, exit 2, and are found from headers before anything is written. Outputs are built in
a hidden staging directory next to O and renamed into place only when complete, so a failure never
leaves O behind (and an existing O is never touched).

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
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import struct
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator

import ml_dtypes
import numpy as np

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports include; recomputed, never loaded

log = logging.getLogger("trainer.convert")


def np_dtype(name: str) -> np.dtype:
    """numpy dtype of a config dtype name (bfloat16 via ml_dtypes)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


class InputError(ValueError):
    """Token ids the model cannot take (wrong rank, dtype or range)."""


# ---------------------------------------------------------------------------------------------------
# Reading a Hugging Face directory


class SafetensorsDir:
    """The tensors of a directory of *.safetensors files: names, shapes and dtypes from the headers;
    `read(name)` returns one tensor (memory-mapped file, one copy of that tensor)."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({self.dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.dir} (only safetensors are read, never "
                                    f"pickled .bin/.pt files)")
        self._handles, self._where, self._meta = [], {}, {}
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f} is listed in {index.name} but does not exist")
            handle = safe_open(str(f), framework="numpy")
            self._handles.append(handle)
            for name in handle.keys():
                sl = handle.get_slice(name)
                self._where[name] = handle
                self._meta[name] = (tuple(sl.get_shape()), sl.get_dtype())

    def __contains__(self, name: str) -> bool:
        return name in self._meta

    def names(self) -> list[str]:
        return sorted(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> str:
        return self._meta[name][1]

    def read(self, name: str) -> np.ndarray:
        return self._where[name].get_tensor(name)


def read_hf_config(hf_dir: Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (a Hugging Face model directory has config.json)")
    return json.loads(path.read_text())


def model_config_from_hf(hf: dict, *, dtype: str, weight_dtype: str, scan_layers: bool = True,
                         moe_capacity_factor: float | None = None):
    """ModelConfig of a config.json; MoE capacity dropless (HF semantics) unless given."""
    from trainer.config.schema import ModelConfig
    from trainer.model.hf import dropless_capacity_factor, model_keys_from_hf

    keys = model_keys_from_hf(hf)
    if keys.get("num_experts", 1) > 1:
        keys["moe_capacity_factor"] = moe_capacity_factor or dropless_capacity_factor(
            keys["num_experts"], keys["num_experts_per_tok"])
    return ModelConfig(**keys, dtype=dtype, weight_dtype=weight_dtype, scan_layers=scan_layers)


def check_tensors(reader: SafetensorsDir, plan, tied: bool) -> None:
    """Every tensor the plan needs is there with the shape config.json implies, and nothing else is."""
    from trainer.model.hf import HfFormatError

    expected = {p.hf_name: p.hf_shape(leaf.piece_shape(p)) for leaf in plan for p in leaf.pieces}
    for name, shape in expected.items():
        if name not in reader:
            raise HfFormatError(f"tensor {name!r} is missing from {reader.dir} (config.json implies shape "
                                f"{list(shape)})")
        if reader.shape(name) != shape:
            raise HfFormatError(f"tensor {name!r} has shape {list(reader.shape(name))} in {reader.dir}, but "
                                f"config.json implies {list(shape)}")
        if reader.dtype(name) not in _TORCH_DTYPES:
            raise HfFormatError(f"tensor {name!r} has dtype {reader.dtype(name)}; only floating-point "
                                f"F32/BF16/F16/F64 tensors are read")
    extra = [n for n in reader.names() if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
             and not (tied and n == "lm_head.weight")]  # tied: HF ignores a stored head too
    if extra:
        raise HfFormatError(f"{len(extra)} tensor(s) in {reader.dir} are not part of the model config.json "
                            f"describes, e.g. {extra[:4]}")


def read_hf_params(reader: SafetensorsDir, plan, weight_dtype: str) -> dict:
    """Params (numpy, weight_dtype) filled tensor by tensor: each leaf is allocated once."""
    from trainer.model.hf import set_leaf

    params: dict = {}
    dtype = np_dtype(weight_dtype)
    for leaf in plan:
        out = np.empty(leaf.shape, dtype)
        for piece in leaf.pieces:
            out[piece.index] = piece.to_ours(reader.read(piece.hf_name), leaf.piece_shape(piece))
        set_leaf(params, leaf.path, out)
    return params


def load_hf(hf_dir: Path, *, dtype: str, weight_dtype: str, scan_layers: bool = True,
            moe_capacity_factor: float | None = None):
    """(ModelConfig, numpy params) of a Hugging Face directory, checked against its config.json."""
    from trainer.model.hf import tensor_plan

    cfg = model_config_from_hf(read_hf_config(hf_dir), dtype=dtype, weight_dtype=weight_dtype,
                               scan_layers=scan_layers, moe_capacity_factor=moe_capacity_factor)
    reader = SafetensorsDir(hf_dir)
    plan = tensor_plan(cfg)
    check_tensors(reader, plan, tied=cfg.logits_via_embedding)
    return cfg, read_hf_params(reader, plan, weight_dtype)


# ---------------------------------------------------------------------------------------------------
# Writing safetensors, streaming


@dataclasses.dataclass(frozen=True)
class OutTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str  # float32 | bfloat16 | float16
    produce: Callable[[], np.ndarray]  # called once, when the tensor's bytes are written

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np_dtype(self.dtype).itemsize


def write_safetensors(path: Path, tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written header first, then each tensor as it is produced (one in memory)."""
    header, offset = {}, 0
    for t in tensors:
        header[t.name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    header["__metadata__"] = metadata or {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors:
            a = np.ascontiguousarray(t.produce(), dtype=np_dtype(t.dtype))
            if a.shape != t.shape:
                raise AssertionError(f"{t.name}: produced shape {a.shape}, header says {t.shape}")
            f.write(a.reshape(-1).view(np.uint8).data)


def write_hf_safetensors(out_dir: Path, tensors: list[OutTensor], max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000k-of-0000n.safetensors + model.safetensors.index.json."""
    tensors = sorted(tensors, key=lambda t: t.name)
    shards: list[list[OutTensor]] = [[]]
    for t in tensors:
        if shards[-1] and sum(x.nbytes for x in shards[-1]) + t.nbytes > max_shard_bytes:
            shards.append([])
        shards[-1].append(t)
    if len(shards) == 1:
        write_safetensors(out_dir / "model.safetensors", shards[0])
        return
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out_dir / name, shard)
        weight_map.update({t.name: name for t in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def hf_tensors(params: dict, plan, dtype: str) -> list[OutTensor]:
    """The HF tensors of `params`, each produced on demand from its slice of a param leaf."""
    from trainer.model.hf import get_leaf

    out = []
    for leaf in plan:
        for piece in leaf.pieces:
            def produce(leaf=leaf, piece=piece):
                return piece.to_hf(np.asarray(get_leaf(params, leaf.path)[piece.index]))

            out.append(OutTensor(piece.hf_name, piece.hf_shape(leaf.piece_shape(piece)), dtype, produce))
    return out


# ---------------------------------------------------------------------------------------------------
# Checkpoints of this trainer


def checkpoint_model_config(ckpt: Path, model: str | None = None):
    """The ModelConfig of a checkpoint: --model if given, else the training run's resolved config
    (metadata/metadata), else model.yml next to an hf-to-trainer checkpoint."""
    from trainer.config import build, load_config

    if model:
        return load_config("base.yml", [f"model={model}"]).model
    meta = Path(ckpt) / "metadata" / "metadata"
    if meta.is_file():
        return build(json.loads(meta.read_text())["config"]).model
    if (Path(ckpt) / "model.yml").is_file():
        return load_config("base.yml", [f"model={Path(ckpt) / 'model.yml'}"]).model
    raise FileNotFoundError(f"cannot tell the model config of {ckpt}: no metadata/metadata (a training "
                            f"checkpoint step dir) and no model.yml (hf-to-trainer); pass --model")


def load_checkpoint_params(ckpt: Path, cfg) -> dict:
    """Params of a checkpoint (full or params-only) on the host CPU device."""
    import jax

    from trainer.checkpoint import load_parameters
    from trainer.model import abstract_params

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu), abstract_params(cfg))
    return load_parameters(Path(ckpt).resolve(), target)


@contextlib.contextmanager
def staged_output(output_dir: Path) -> Iterator[Path]:
    """A fresh staging directory next to `output_dir`, renamed to it on success, removed on failure."""
    output_dir = Path(output_dir).resolve()
    if output_dir.exists():
        raise FileExistsError(f"{output_dir} already exists; choose a new --output-dir")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = output_dir.parent / f".{output_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        yield staging
        os.rename(staging, output_dir)
    except BaseException:
        for leftover in [staging, *output_dir.parent.glob(f"{staging.name}.orbax-checkpoint-tmp*")]:
            shutil.rmtree(leftover, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------------
# Commands


def hf_to_trainer(hf_dir: Path, output_dir: Path, *, dtype: str | None = None, weight_dtype: str = "float32",
                  scan_layers: bool = True, moe_capacity_factor: float | None = None) -> Path:
    """Write the params-only checkpoint + model.yml of a Hugging Face directory; returns output_dir."""
    from trainer.checkpoint import save_parameters

    hf_dir, output_dir = Path(hf_dir), Path(output_dir).resolve()
    hf = read_hf_config(hf_dir)
    dtype = dtype or _activation_dtype(hf)
    cfg, params = load_hf(hf_dir, dtype=dtype, weight_dtype=weight_dtype, scan_layers=scan_layers,
                          moe_capacity_factor=moe_capacity_factor)
    with staged_output(output_dir) as staging:
        save_parameters(staging, params, in_place=True)  # numpy params: no second copy
        del params
        tokenizer = None
        if (hf_dir / "tokenizer.json").is_file():
            shutil.copyfile(hf_dir / "tokenizer.json", staging / "tokenizer.json")
            tokenizer = output_dir / "tokenizer.json"
        shutil.copyfile(hf_dir / "config.json", staging / "hf_config.json")
        yml = model_yaml(cfg, source=hf_dir, output_dir=output_dir, tokenizer=tokenizer)
        (staging / "model.yml").write_text(yml)
    return output_dir


def _activation_dtype(hf: dict) -> str:
    stored = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return stored if stored in _ST_DTYPES else "float32"


def model_yaml(cfg, *, source: Path, output_dir: Path, tokenizer: Path | None) -> str:
    import yaml

    arch = ["base_num_decoder_layers", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim",
            "base_mlp_dim", "vocab_size", "rope_max_timescale", "normalization_layer_epsilon", "use_qk_norm",
            "logits_via_embedding"]
    if cfg.num_experts > 1:
        arch += ["num_experts", "num_experts_per_tok", "base_moe_mlp_dim", "norm_topk_prob",
                 "load_balance_loss_weight"]
    dump = lambda keys: yaml.safe_dump({k: getattr(cfg, k) for k in keys}, sort_keys=False).rstrip()
    lines = [f"# Model config derived from {Path(source).resolve() / 'config.json'}",
             "# by `python -m trainer.convert hf-to-trainer`. Train or decode from the converted weights with",
             f"#   model={output_dir / 'model.yml'} load_parameters_path={output_dir}", dump(arch),
             "# dtype: activations (from config.json); weight_dtype: the params as stored in this checkpoint;",
             "# scan_layers: the layer layout the params are stored in (stacked or not): keep it.",
             dump(["dtype", "weight_dtype", "scan_layers"])]
    if cfg.num_experts > 1:
        lines += ["# Dropless, as in Hugging Face (experts / top_k): the first losses match HF exactly. Lower",
                  "# it to save memory and time; routed tokens past an expert's capacity are then dropped.",
                  dump(["moe_capacity_factor"])]
    if tokenizer is not None:
        lines += ["# The checkpoint's own tokenizer (copied from the source directory).",
                  yaml.safe_dump({"tokenizer_path": str(tokenizer), "tokenizer_type": "huggingface"},
                                 sort_keys=False).rstrip()]
    return "\n".join(lines) + "\n"


def trainer_to_hf(ckpt: Path, output_dir: Path, *, model: str | None = None, dtype: str | None = None,
                  max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write config.json + safetensors of a checkpoint; returns output_dir."""
    from trainer.model.hf import hf_config, tensor_plan

    ckpt = Path(ckpt)
    cfg = checkpoint_model_config(ckpt, model)
    dtype = dtype or cfg.weight_dtype
    config = hf_config(cfg, dtype)  # raises before anything is written if cfg has no HF equivalent
    plan = tensor_plan(cfg)
    params = load_checkpoint_params(ckpt, cfg)
    with staged_output(output_dir) as staging:
        staging.mkdir()
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        write_hf_safetensors(staging, hf_tensors(params, plan, dtype), max_shard_bytes)
        if (ckpt / "tokenizer.json").is_file():
            shutil.copyfile(ckpt / "tokenizer.json", staging / "tokenizer.json")
    return Path(output_dir).resolve()


def compute_logits(params: dict, cfg, input_ids: np.ndarray) -> np.ndarray:
    """float32 logits [B, T, V] of int ids [B, T]: float32 activations, MoE dropless."""
    import jax
    import jax.numpy as jnp

    from trainer.model import forward, logits_from_hidden
    from trainer.model.decode import for_inference

    cfg = for_inference(dataclasses.replace(cfg, dtype="float32"))
    ids = np.asarray(input_ids)
    ids = ids[None] if ids.ndim == 1 else ids
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"input ids must be integers [batch, seq] or [seq], got {ids.dtype} {list(ids.shape)}")
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
        raise InputError(f"input ids must be in [0, {cfg.vocab_size}), got [{ids.min()}, {ids.max()}]")
    ids = jnp.asarray(ids, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)

    @jax.jit
    def run(p, tokens):
        hidden, _ = forward(p, cfg, tokens, positions, jnp.ones_like(tokens))
        return logits_from_hidden(p, cfg, hidden)

    return np.asarray(run(params, ids), np.float32)


def logits_command(*, ckpt: Path | None, hf_dir: Path | None, model: str | None, input_ids: Path,
                   output: Path) -> None:
    ids = np.load(input_ids, allow_pickle=False)
    if hf_dir is not None:
        cfg, params = load_hf(Path(hf_dir), dtype="float32", weight_dtype="float32")
    else:
        cfg = checkpoint_model_config(Path(ckpt), model)
        params = load_checkpoint_params(Path(ckpt), cfg)
    logits = compute_logits(params, cfg, ids)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial-{uuid.uuid4().hex[:8]}.npy")
    np.save(partial, logits)
    os.replace(partial, output)


# ---------------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.convert", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-trainer", help="Hugging Face directory -> params-only checkpoint + model.yml")
    a.add_argument("--hf-dir", required=True, type=Path)
    a.add_argument("--output-dir", required=True, type=Path)
    a.add_argument("--dtype", choices=sorted(_ST_DTYPES), help="activation dtype in model.yml "
                   "(default: config.json's dtype)")
    a.add_argument("--weight-dtype", choices=sorted(_ST_DTYPES), default="float32", help="stored params dtype")
    a.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="stacked layer layout (scan_layers=true) or layers/0, layers/1, ...")
    a.add_argument("--moe-capacity-factor", type=float, help="MoE capacity factor in model.yml "
                   "(default: experts / top_k, dropless like HF)")
    b = sub.add_parser("trainer-to-hf", help="checkpoint -> config.json + safetensors for transformers")
    b.add_argument("--checkpoint", required=True, type=Path)
    b.add_argument("--output-dir", required=True, type=Path)
    b.add_argument("--model", help="model preset or YAML, if the checkpoint does not record its config")
    b.add_argument("--dtype", choices=sorted(_ST_DTYPES), help="output dtype (default: the params' dtype)")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="split the safetensors past this size")
    c = sub.add_parser("logits", help="float32 logits of token ids, from a checkpoint or an HF directory")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path)
    src.add_argument("--hf-dir", type=Path)
    c.add_argument("--model", help="model preset or YAML, if the checkpoint does not record its config")
    c.add_argument("--input-ids", required=True, type=Path, help=".npy of int ids [batch, seq] or [seq]")
    c.add_argument("--output", required=True, type=Path, help=".npy to write float32 [batch, seq, vocab]")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s] %(message)s", stream=sys.stderr)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from trainer.config import ConfigError
    from trainer.model.hf import HfFormatError

    try:
        if args.command == "hf-to-trainer":
            out = hf_to_trainer(args.hf_dir, args.output_dir, dtype=args.dtype, weight_dtype=args.weight_dtype,
                                scan_layers=args.scan_layers, moe_capacity_factor=args.moe_capacity_factor)
            print(f"wrote {out}: train or decode with model={out / 'model.yml'} load_parameters_path={out}")
        elif args.command == "trainer-to-hf":
            out = trainer_to_hf(args.checkpoint, args.output_dir, model=args.model, dtype=args.dtype,
                                max_shard_bytes=int(args.max_shard_gb * 2**30))
            print(f"wrote {out}")
        else:
            logits_command(ckpt=args.checkpoint, hf_dir=args.hf_dir, model=args.model, input_ids=args.input_ids,
                           output=args.output)
            print(f"wrote {args.output}")
    except (HfFormatError, InputError, ConfigError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
