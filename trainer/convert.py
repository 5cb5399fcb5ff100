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

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import math
import os
import re
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from etils import epath

from trainer.checkpoint.checks import check_checkpoint_dir, check_params_match
from trainer.errors import UserInputError, tool_main
from trainer.io.paths import is_remote, local_copy, resolve
from trainer.io.staging import check_writable, staged_dir, staged_file

PROG = "python -m trainer.convert"
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports include; recomputed, never loaded
_NPY_MAGIC = b"\x93NUMPY"

log = logging.getLogger("trainer.convert")


def np_dtype(name: str) -> np.dtype:
    """numpy dtype of a config dtype name (bfloat16 via ml_dtypes)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


class InputError(UserInputError):
    """Token ids the model cannot take (unreadable, empty, wrong rank, dtype or range)."""


class MissingInput(UserInputError, FileNotFoundError):
    """A path the user named does not exist, or lacks the file the command reads there. Still a
    FileNotFoundError for callers that catch that; a UserInputError for the CLI (one line, exit 2)."""


# ---------------------------------------------------------------------------------------------------
# Reading a Hugging Face directory


class SafetensorsDir:
    """The tensors of a directory of *.safetensors files: names, shapes and dtypes from the headers;
    `read(name)` returns one tensor (memory-mapped file, one copy of that tensor).

    Every header is parsed up front, so a truncated or corrupt file (an interrupted download) is named
    before anything is read or written. Remote files (gs://) are read from a verified local copy."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = hf_dir if isinstance(hf_dir, epath.Path) else Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({self.dir / f for f in _index_weight_map(index).values()}, key=str)
        else:
            files = sorted(self.dir.glob("*.safetensors"), key=str)
        if not files:
            raise MissingInput(
                f"no *.safetensors in {self.dir} (only safetensors are read, never pickled .bin/.pt files)"
            )
        self._handles = []
        self._where = {}
        self._meta = {}
        for f in files:
            if not f.is_file():
                raise MissingInput(f"{f} is listed in {index} but does not exist")
            handle = _open_safetensors(f)
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


def _index_weight_map(index) -> dict[str, str]:
    """The tensor -> file map of model.safetensors.index.json, or an error naming the file."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise _hf_error(
            f"{index} is not a valid safetensors index (JSON with a 'weight_map' object): "
            f"{_why(e)}; download it again, or delete it if the directory holds a single "
            f"model.safetensors"
        ) from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise _hf_error(f"{index}: 'weight_map' must map tensor names to file names")
    return weight_map


def _open_safetensors(path):
    from safetensors import safe_open

    try:
        return safe_open(str(local_copy(path)), framework="numpy")
    except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError (not an OSError) for a bad header
        raise _hf_error(
            f"{path} is not a readable safetensors file ({_why(e)}); it may be truncated "
            f"(an interrupted download or copy): download it again"
        ) from None


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e).strip().splitlines()[0]


def _hf_error(message: str) -> Exception:
    """trainer.model.hf.HfFormatError, imported when raised: the CLI's input checks stay free of jax."""
    from trainer.model.hf import HfFormatError

    return HfFormatError(message)


def read_hf_config(hf_dir) -> dict:
    """config.json of a Hugging Face directory as a dict; a missing or unparsable file is an error
    naming it."""
    hf_dir = hf_dir if isinstance(hf_dir, epath.Path) else Path(hf_dir)
    path = hf_dir / "config.json"
    if not hf_dir.exists():
        raise MissingInput(f"--hf-dir {hf_dir} does not exist")
    if not path.is_file():
        raise MissingInput(f"{path} not found (a Hugging Face model directory has config.json)")
    try:
        hf = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise _hf_error(f"{path} is not valid JSON ({_why(e)}); download it again") from None
    if not isinstance(hf, dict):
        raise _hf_error(f"{path} holds a JSON {type(hf).__name__}, not an object of config keys")
    return hf


def model_config_from_hf(
    hf: dict,
    *,
    dtype: str,
    weight_dtype: str,
    scan_layers: bool = True,
    moe_capacity_factor: float | None = None,
    source: str = "config.json",
):
    """ModelConfig of a config.json; MoE capacity dropless (HF semantics) unless given."""
    from trainer.config.schema import ModelConfig
    from trainer.model.hf import dropless_capacity_factor, model_keys_from_hf

    keys = model_keys_from_hf(hf, source)
    if keys.get("num_experts", 1) > 1:
        keys["moe_capacity_factor"] = moe_capacity_factor or dropless_capacity_factor(
            keys["num_experts"], keys["num_experts_per_tok"]
        )
    return ModelConfig(**keys, dtype=dtype, weight_dtype=weight_dtype, scan_layers=scan_layers)


def check_tensors(reader: SafetensorsDir, plan, tied: bool) -> None:
    """Every tensor the plan needs is there with the shape config.json implies, and nothing else is."""
    expected = {p.hf_name: p.hf_shape(leaf.piece_shape(p)) for leaf in plan for p in leaf.pieces}
    for name, shape in expected.items():
        if name not in reader:
            raise _hf_error(
                f"tensor {name!r} is missing from {reader.dir} (config.json implies shape {list(shape)})"
            )
        if reader.shape(name) != shape:
            raise _hf_error(
                f"tensor {name!r} has shape {list(reader.shape(name))} in {reader.dir}, but "
                f"config.json implies {list(shape)}"
            )
        if reader.dtype(name) not in _TORCH_DTYPES:
            raise _hf_error(
                f"tensor {name!r} has dtype {reader.dtype(name)}; only floating-point "
                f"F32/BF16/F16/F64 tensors are read"
            )
    extra = [
        n
        for n in reader.names()
        if n not in expected and not n.endswith(_IGNORED_SUFFIXES) and not (tied and n == "lm_head.weight")
    ]  # tied: HF ignores a stored head too
    if extra:
        raise _hf_error(
            f"{len(extra)} tensor(s) in {reader.dir} are not part of the model config.json "
            f"describes, e.g. {extra[:4]}"
        )


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


def open_hf(
    hf_dir,
    *,
    dtype: str | None,
    weight_dtype: str,
    scan_layers: bool = True,
    moe_capacity_factor: float | None = None,
):
    """(ModelConfig, reader, plan) of a Hugging Face directory: config.json and every safetensors header
    checked against each other, no tensor read yet, so every format error comes before the heavy work.
    dtype None: the activation dtype config.json records."""
    from trainer.model.hf import tensor_plan

    hf = read_hf_config(hf_dir)
    cfg = model_config_from_hf(
        hf,
        dtype=dtype or _activation_dtype(hf),
        weight_dtype=weight_dtype,
        scan_layers=scan_layers,
        moe_capacity_factor=moe_capacity_factor,
        source=str(hf_dir / "config.json" if isinstance(hf_dir, epath.Path) else Path(hf_dir) / "config.json"),
    )
    reader = SafetensorsDir(hf_dir)
    plan = tensor_plan(cfg)
    check_tensors(reader, plan, tied=cfg.logits_via_embedding)
    return cfg, reader, plan


def load_hf(
    hf_dir, *, dtype: str, weight_dtype: str, scan_layers: bool = True, moe_capacity_factor: float | None = None
):
    """(ModelConfig, numpy params) of a Hugging Face directory, checked against its config.json."""
    cfg, reader, plan = open_hf(
        hf_dir,
        dtype=dtype,
        weight_dtype=weight_dtype,
        scan_layers=scan_layers,
        moe_capacity_factor=moe_capacity_factor,
    )
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
        header[t.name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
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


def checkpoint_model_config(ckpt, model: str | None = None):
    """The ModelConfig of a checkpoint: --model if given, else the training run's resolved config
    (metadata/metadata), else model.yml next to an hf-to-trainer checkpoint."""
    from trainer.config import ConfigError, build, load_config

    if model:
        return load_config("base.yml", [f"model={model}"]).model
    ckpt = resolve(ckpt)
    meta = ckpt / "metadata" / "metadata"
    if meta.is_file():
        try:
            return build(json.loads(meta.read_text())["config"]).model
        except (ValueError, KeyError, TypeError) as e:  # ConfigError is a ValueError
            kind = "ConfigError" if isinstance(e, ConfigError) else "unreadable"
            raise UserInputError(
                f"{meta}: the run config recorded in the checkpoint does not load "
                f"({kind}: {_why(e)}); pass --model PRESET_OR_YAML of the model it was "
                f"trained with"
            ) from None
    if (ckpt / "model.yml").is_file():
        return load_config("base.yml", [f"model={ckpt / 'model.yml'}"]).model
    raise UserInputError(
        f"cannot tell the model config of {ckpt}: it has no metadata/metadata (a training "
        f"checkpoint step dir) and no model.yml (hf-to-trainer); pass --model PRESET_OR_YAML"
    )


def load_checkpoint_params(ckpt, cfg) -> dict:
    """Params of a checkpoint (full or params-only) on the host CPU device."""
    import jax

    from trainer.checkpoint import load_parameters
    from trainer.model import abstract_params

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu), abstract_params(cfg))
    try:
        return load_parameters(resolve(ckpt), target)
    except ValueError as e:  # the pre-check missed it (no metadata): Orbax's shape check, reworded
        found = re.search(r"Requested shape: (\(.*?\)) is not compatible with the stored shape: (\(.*?\))", str(e))
        if not found:
            raise
        raise UserInputError(
            f"{resolve(ckpt)} does not match the model config: a tensor is stored as "
            f"{found.group(2)} but the model config needs {found.group(1)}; the model config "
            f"must be the one the checkpoint was trained with"
        ) from None


def check_output(path, *, overwrite: bool, flag: str, inputs=()) -> Path:
    """The resolved local output path, refused before any heavy work when it cannot be written: it exists
    (without --overwrite), it would replace one of `inputs`, it is remote, or its nearest existing
    ancestor is a file or not writable. staged_dir / staged_file write it later (aside, then swapped)."""
    if is_remote(path):
        raise UserInputError(
            f"{flag} {path}: outputs are written to local disk; write them locally, then copy "
            f"them up (e.g. `gcloud storage cp -r`)"
        )
    dest = Path(os.fspath(resolve(path)))
    for src in inputs:
        if src is not None and not is_remote(src):
            src = Path(os.fspath(resolve(src)))
            if src == dest or dest in src.parents:
                raise UserInputError(f"{flag} {dest} would replace the input {src}; choose another output")
    return check_writable(dest, overwrite=overwrite, name=flag)


def _save_params(staging: Path, params) -> None:
    """Orbax creates the checkpoint directory itself (through a `<dir>.orbax-checkpoint-tmp-*` sibling it
    renames), so the empty staging directory is handed over to it, and a failed save's sibling, which
    staged_dir does not know about, is removed here."""
    from trainer.checkpoint import save_parameters

    staging.rmdir()
    try:
        save_parameters(staging, params, in_place=True)  # numpy params: no second copy
    except BaseException:
        for leftover in staging.parent.glob(f"{staging.name}.orbax-checkpoint-tmp*"):
            shutil.rmtree(leftover, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------------
# Commands


def hf_to_trainer(
    hf_dir,
    output_dir,
    *,
    dtype: str | None = None,
    weight_dtype: str = "float32",
    scan_layers: bool = True,
    moe_capacity_factor: float | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the params-only checkpoint + model.yml of a Hugging Face directory; returns output_dir.

    Order: output writable, config.json and every safetensors header checked, then the tensors read and
    written aside; the output appears (or replaces the old one, with overwrite) only when complete."""
    hf_dir = resolve(hf_dir)
    output_dir = check_output(output_dir, overwrite=overwrite, flag="--output-dir", inputs=[hf_dir])
    cfg, reader, plan = open_hf(
        hf_dir,
        dtype=dtype,
        weight_dtype=weight_dtype,
        scan_layers=scan_layers,
        moe_capacity_factor=moe_capacity_factor,
    )
    params = read_hf_params(reader, plan, weight_dtype)
    with staged_dir(output_dir, overwrite=overwrite) as staging:
        _save_params(staging, params)
        del params
        tokenizer = None
        if (hf_dir / "tokenizer.json").is_file():
            (staging / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
            tokenizer = output_dir / "tokenizer.json"
        (staging / "hf_config.json").write_bytes((hf_dir / "config.json").read_bytes())
        yml = model_yaml(cfg, source=hf_dir, output_dir=output_dir, tokenizer=tokenizer)
        (staging / "model.yml").write_text(yml)
    return output_dir


def _activation_dtype(hf: dict) -> str:
    stored = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return stored if stored in _ST_DTYPES else "float32"


def model_yaml(cfg, *, source, output_dir: Path, tokenizer: Path | None) -> str:
    import yaml

    arch = [
        "base_num_decoder_layers",
        "base_emb_dim",
        "base_num_query_heads",
        "base_num_kv_heads",
        "head_dim",
        "base_mlp_dim",
        "vocab_size",
        "rope_max_timescale",
        "normalization_layer_epsilon",
        "use_qk_norm",
        "logits_via_embedding",
    ]
    if cfg.num_experts > 1:
        arch += [
            "num_experts",
            "num_experts_per_tok",
            "base_moe_mlp_dim",
            "norm_topk_prob",
            "load_balance_loss_weight",
        ]

    def dump(keys):
        return yaml.safe_dump({k: getattr(cfg, k) for k in keys}, sort_keys=False).rstrip()

    lines = [
        f"# Model config derived from {resolve(source) / 'config.json'}",
        "# by `python -m trainer.convert hf-to-trainer`. Train or decode from the converted weights with",
        f"#   model={output_dir / 'model.yml'} load_parameters_path={output_dir}",
        dump(arch),
        "# dtype: activations (from config.json); weight_dtype: the params as stored in this checkpoint;",
        "# scan_layers: the layer layout the params are stored in (stacked or not): keep it.",
        dump(["dtype", "weight_dtype", "scan_layers"]),
    ]
    if cfg.num_experts > 1:
        lines += [
            "# Dropless, as in Hugging Face (experts / top_k): the first losses match HF exactly. Lower",
            "# it to save memory and time; routed tokens past an expert's capacity are then dropped.",
            dump(["moe_capacity_factor"]),
        ]
    if tokenizer is not None:
        lines += [
            "# The checkpoint's own tokenizer (copied from the source directory).",
            yaml.safe_dump(
                {"tokenizer_path": str(tokenizer), "tokenizer_type": "huggingface"}, sort_keys=False
            ).rstrip(),
        ]
    return "\n".join(lines) + "\n"


def trainer_to_hf(
    ckpt,
    output_dir,
    *,
    model: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
) -> Path:
    """Write config.json + safetensors of a checkpoint; returns output_dir.

    Everything that can be checked without reading an array is, first: the checkpoint directory, the
    output, the model config and its HF equivalent, and the stored shapes against that config."""
    from trainer.model.hf import hf_config, tensor_plan

    ckpt = check_checkpoint_dir(ckpt)
    output_dir = check_output(output_dir, overwrite=overwrite, flag="--output-dir", inputs=[ckpt])
    cfg = checkpoint_model_config(ckpt, model)
    dtype = dtype or cfg.weight_dtype
    config = hf_config(cfg, dtype)  # raises before anything is written if cfg has no HF equivalent
    plan = tensor_plan(cfg)
    check_params_match(ckpt, cfg, fix=_MODEL_FIX if model else _RECORDED_FIX)
    params = load_checkpoint_params(ckpt, cfg)
    with staged_dir(output_dir, overwrite=overwrite) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        write_hf_safetensors(staging, hf_tensors(params, plan, dtype), max_shard_bytes)
        if (ckpt / "tokenizer.json").is_file():
            (staging / "tokenizer.json").write_bytes((ckpt / "tokenizer.json").read_bytes())
    return output_dir


_MODEL_FIX = (
    "--model must be the model the checkpoint was trained with (omit --model to use the config "
    "the checkpoint records)"
)
_RECORDED_FIX = "the config recorded with the checkpoint does not describe its params; pass --model explicitly"


def read_input_ids(path) -> np.ndarray:
    """Token ids [batch, seq] (int64) from `path`: a .npy integer array [batch, seq] or [seq], or a text file
    of integer ids separated by whitespace or commas, one sequence per line (all the same length). The
    format is told by the content (a .npy starts with its magic bytes), not the name. Never unpickles."""
    path = resolve(path)
    if not path.is_file():
        raise MissingInput(
            f"--input-ids {path} does not exist"
            if not path.exists()
            else f"--input-ids {path} is a directory; give a .npy or text file of token ids"
        )
    data = path.read_bytes()
    if data.startswith(_NPY_MAGIC):
        try:
            ids = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise InputError(
                f"--input-ids {path} is not a readable .npy array ({_why(e)}); save the ids "
                f"with np.save(path, np.asarray(ids, np.int32))"
            ) from None
    elif path.suffix == ".npy":
        raise InputError(
            f"--input-ids {path} is not a .npy file (no NumPy header); save it with np.save, "
            f"or give a text file of integer ids"
        )
    else:
        ids = _text_ids(data, path)
    if ids.ndim not in (1, 2) or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(
            f"--input-ids {path}: token ids must be integers [batch, seq] or [seq], got "
            f"{ids.dtype} {list(ids.shape)}"
        )
    if ids.size == 0:
        raise InputError(f"--input-ids {path} is empty: no token ids (shape {list(ids.shape)}); give at least one")
    return (ids[None] if ids.ndim == 1 else ids).astype(np.int64)


def _text_ids(data: bytes, path) -> np.ndarray:
    expected = (
        "expected a .npy integer array, or text with integer ids separated by spaces or commas, "
        "one sequence per line"
    )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"--input-ids {path} is neither a .npy file nor text; {expected}") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        tokens = [t for t in re.split(r"[\s,]+", line.strip()) if t]
        if not tokens:
            continue
        try:
            row = [int(t) for t in tokens]
        except ValueError:
            bad = next(t for t in tokens if not re.fullmatch(r"[+-]?\d+", t))
            raise InputError(
                f"--input-ids {path} line {n}: {bad!r} is not an integer token id; {expected}"
            ) from None
        if rows and len(row) != len(rows[0][1]):
            raise InputError(
                f"--input-ids {path} line {n} has {len(row)} ids but line {rows[0][0]} has "
                f"{len(rows[0][1])}: the sequences form one batch, so they must be the same length"
            )
        rows.append((n, row))
    if not rows:
        raise InputError(f"--input-ids {path} is empty: no token ids; {expected}")
    try:
        return np.asarray([row for _, row in rows], np.int64)
    except OverflowError:
        raise InputError(f"--input-ids {path}: a token id does not fit in 64 bits") from None


def check_ids(ids: np.ndarray, vocab_size: int, source: str = "input ids") -> None:
    """Ids the model can take: non-empty integers [batch, seq] in [0, vocab_size)."""
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{source} must be integers [batch, seq] or [seq], got {ids.dtype} {list(ids.shape)}")
    if ids.size == 0:
        raise InputError(f"{source} are empty (shape {list(ids.shape)}); give at least one token id")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise InputError(
            f"{source} must be in [0, {vocab_size}) (the model's vocab_size), got [{ids.min()}, {ids.max()}]"
        )


def compute_logits(params: dict, cfg, input_ids: np.ndarray) -> np.ndarray:
    """float32 logits [B, T, V] of int ids [B, T]: float32 activations, MoE dropless."""
    import jax
    import jax.numpy as jnp

    from trainer.model import forward, logits_from_hidden
    from trainer.model.generation import for_inference

    cfg = for_inference(dataclasses.replace(cfg, dtype="float32"))
    ids = np.asarray(input_ids)
    ids = ids[None] if ids.ndim == 1 else ids
    check_ids(ids, cfg.vocab_size)
    ids = jnp.asarray(ids, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)

    @jax.jit
    def run(p, tokens):
        hidden, _ = forward(p, cfg, tokens, positions, jnp.ones_like(tokens))
        return logits_from_hidden(p, cfg, hidden)

    return np.asarray(run(params, ids), np.float32)


def logits_command(
    *, ckpt=None, hf_dir=None, model: str | None = None, input_ids, output, overwrite: bool = False
) -> Path:
    """Write the float32 logits of the ids in `input_ids` to the .npy `output`; returns its path. The ids,
    the output and the model source are checked before any weight is read."""
    output = check_output(output, overwrite=overwrite, flag="--output", inputs=[input_ids, ckpt, hf_dir])
    ids = read_input_ids(input_ids)
    if hf_dir is not None:
        cfg, reader, plan = open_hf(resolve(hf_dir), dtype="float32", weight_dtype="float32")
        check_ids(ids, cfg.vocab_size, f"--input-ids {resolve(input_ids)}")
        params = read_hf_params(reader, plan, "float32")
    else:
        ckpt = check_checkpoint_dir(ckpt)
        cfg = checkpoint_model_config(ckpt, model)
        check_ids(ids, cfg.vocab_size, f"--input-ids {resolve(input_ids)}")
        check_params_match(ckpt, cfg, fix=_MODEL_FIX if model else _RECORDED_FIX)
        params = load_checkpoint_params(ckpt, cfg)
    logits = compute_logits(params, cfg, ids)
    with staged_file(output, overwrite=overwrite) as tmp, open(tmp, "wb") as f:
        np.save(f, logits)  # a file object: np.save would append .npy to a path
    return output


# ---------------------------------------------------------------------------------------------------
# CLI


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
        "--dtype", choices=sorted(_ST_DTYPES), help="activation dtype in model.yml (default: config.json's dtype)"
    )
    a.add_argument("--weight-dtype", choices=sorted(_ST_DTYPES), default="float32", help="stored params dtype")
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
    b.add_argument("--dtype", choices=sorted(_ST_DTYPES), help="output dtype (default: the params' dtype)")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="split the safetensors past this size")
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
