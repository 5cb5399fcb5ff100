"""Each process's own compiled executables on disk, for processes other than 0 of a multi-process job.

JAX's persistent compilation cache (`jax_cache_dir`) is written by process 0 only, and on CPU its keys
include each process's topology fingerprint, so every other process misses it every time: after a
rejoin (which, on CPU, renews the processes' clients and drops their executables), process 0 loads its
train step in seconds while the others compile it again (measured on 2 cores: 3-6 s against 21-33 s
for a 2-layer model). This cache closes that gap: a process other than 0 keeps the executables it
compiled, serialized (`jax.experimental.serialize_executable`), under `<jax_cache_dir>/processes/`,
keyed by the lowered program, its devices, this process, the JAX version and the XLA flags; the next
compile of the same program on the same process loads it. An entry that cannot be read is compiled
again and rewritten.

An entry is a serialized native executable, loaded with pickle: whoever can write the directory can run
code in the trainer. So each entry is checked before it is loaded: its SHA-256 digest (stored beside it,
`<entry>.sha256`) must match, and a local directory must belong to this user and not be writable by its
group or others (it is created with mode 0700); otherwise the process warns once and compiles, keeping
nothing. A `gs://` jax_cache_dir goes through the path layer like every other path (the bucket's
permissions decide who may write it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import stat
import time

import jax
from etils import epath

from trainer.io.paths import is_remote
from trainer.logevents import event_extra

log = logging.getLogger(__name__)

SUBDIR = "processes"
DIGEST_SUFFIX = ".sha256"
_refused: set[str] = set()  # directories already warned about


def cache_dir() -> epath.Path | None:
    """Where this process keeps its executables: under JAX's compilation cache directory, if one is set."""
    root = jax.config.jax_compilation_cache_dir
    return epath.Path(root) / SUBDIR if root else None


def unsafe_reason(directory: epath.Path) -> str | None:
    """Why a local cache directory must not be trusted (another owner, group/world-writable), or None."""
    if is_remote(str(directory)):
        return None
    for path in (directory, directory.parent):
        try:
            st = os.stat(os.fspath(path))
        except FileNotFoundError:
            continue
        if st.st_uid != os.getuid():
            return f"{path} belongs to uid {st.st_uid}, not this user ({os.getuid()})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{path} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _key(lowered, devices, process: int) -> str:
    h = hashlib.sha256()
    for part in (
        lowered.as_text(),
        repr([(d.id, d.process_index) for d in devices]),
        str(process),
        jax.__version__,
        jax.lib.__version__ if hasattr(jax.lib, "__version__") else "",
        os.environ.get("XLA_FLAGS", ""),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _prepare(directory: epath.Path) -> bool:
    """Create the directory (0700 locally) and check it may be trusted; warn once when it may not."""
    try:
        if is_remote(str(directory)):
            directory.mkdir(parents=True, exist_ok=True)
        else:
            os.makedirs(os.fspath(directory), mode=0o700, exist_ok=True)
    except OSError as e:
        log.warning("executable cache %s unusable (%s); compiling", directory, e)
        return False
    reason = unsafe_reason(directory)
    if reason is not None:
        if str(directory) not in _refused:
            _refused.add(str(directory))
            log.warning(
                "the executable cache %s is refused: %s; its entries are never loaded (they are code) "
                "and this process compiles instead: use a jax_cache_dir only you can write",
                directory,
                reason,
                extra=event_extra("executable_cache_refused", {"directory": str(directory), "reason": reason}),
            )
        return False
    return True


def _load(path: epath.Path, devices):
    from jax.experimental import serialize_executable

    data = path.read_bytes()
    digest = (path.parent / (path.name + DIGEST_SUFFIX)).read_text().strip()
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError("digest mismatch")
    payload, in_tree, out_tree = pickle.loads(data)
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)


def _store(path: epath.Path, compiled) -> None:
    from jax.experimental import serialize_executable

    data = pickle.dumps(serialize_executable.serialize(compiled))
    digest = path.parent / (path.name + DIGEST_SUFFIX)
    if is_remote(str(path)):
        digest.write_text(hashlib.sha256(data).hexdigest())
        path.write_bytes(data)
        return
    for target, content in ((digest, hashlib.sha256(data).hexdigest().encode()), (path, data)):
        tmp = target.parent / f"{target.name}.tmp-{os.getpid()}"
        tmp.write_bytes(content)
        os.replace(os.fspath(tmp), os.fspath(target))  # atomic: a reader sees a whole entry or none


def compile_lowered(lowered, devices, *, process: tuple[int, int] | None = None, directory=None):
    """`lowered.compile()`, from this process's cache when it is not process 0 of several.

    `devices`: the mesh's devices in mesh order (the program's device assignment); `process`: (index,
    count), by default this process's; `directory`: by default `cache_dir()`."""
    index, count = process if process is not None else (jax.process_index(), jax.process_count())
    directory = epath.Path(directory) if directory is not None else cache_dir()
    if count == 1 or index == 0 or directory is None or not _prepare(directory):
        return lowered.compile()  # JAX's own persistent cache serves these
    devices = list(devices)
    path = directory / f"{_key(lowered, devices, index)}.p{index}"
    if path.exists():
        t0 = time.perf_counter()
        try:
            compiled = _load(path, devices)
            log.info("loaded executable %s in %.2f s", path.name[:16], time.perf_counter() - t0)
            return compiled
        except Exception as e:  # a torn, stale or tampered entry: compile again and replace it
            log.warning("executable cache entry %s unusable (%s); compiling", path.name[:16], e)
    compiled = lowered.compile()
    try:
        _store(path, compiled)
    except Exception as e:  # a full or read-only disk costs the next compile, not this run
        log.warning("could not keep executable %s: %s", path.name[:16], e)
    return compiled
