"""Safetensors directories, read and written one tensor at a time (never pickle, never the model twice).

Reading: `SafetensorsDir` parses every header of a directory (sharded with model.safetensors.index.json
or not) up front, so a truncated or corrupt file is named before any tensor is read; each tensor then
comes from a memory-mapped file. Writing: `write_safetensors` writes the header first and then each
tensor as it is produced, so only one output tensor is in memory; `write_hf_safetensors` splits the
tensors into shards + index the way transformers expects past a size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from etils import epath

from trainer.hf.errors import MissingInput, hf_error, why
from trainer.io.paths import local_copy

ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # what this trainer writes
TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}  # what it reads


def np_dtype(name: str) -> np.dtype:
    """numpy dtype of a config dtype name (bfloat16 via ml_dtypes)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


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
        raise hf_error(
            f"{index} is not a valid safetensors index (JSON with a 'weight_map' object): "
            f"{why(e)}; download it again, or delete it if the directory holds a single "
            f"model.safetensors"
        ) from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise hf_error(f"{index}: 'weight_map' must map tensor names to file names")
    return weight_map


def _open_safetensors(path):
    from safetensors import safe_open

    try:
        return safe_open(str(local_copy(path)), framework="numpy")
    except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError (not an OSError) for a bad header
        raise hf_error(
            f"{path} is not a readable safetensors file ({why(e)}); it may be truncated "
            f"(an interrupted download or copy): download it again"
        ) from None


@dataclasses.dataclass(frozen=True)
class OutTensor:
    """One tensor to write: its header entry, and the function that produces its data when it is written."""

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
            "dtype": ST_DTYPES[t.dtype],
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
