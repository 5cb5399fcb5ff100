"""A `gs://` object store inside the test process: fsspec's `gs`/`gcs` protocol served from a directory.

etils epath reads `gs://` through fsspec (without TensorFlow), so registering this filesystem makes
every `gs://bucket/key` path the trainer opens a file under `$FAKE_GCS_ROOT/bucket/key`. The trainer's
own object-store code runs unchanged. Subprocesses get it through `sitecustomize.py` in this directory
(put the directory on PYTHONPATH and set FAKE_GCS_ROOT). Orbax's tensorstore writes bypass fsspec, so
runs against it keep checkpoints off or local.
"""

from __future__ import annotations

import os

import fsspec
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem


class FakeGCS(DirFileSystem):
    protocol = ("gs", "gcs")

    def __init__(self, *args, **kwargs):
        root = os.environ["FAKE_GCS_ROOT"]
        os.makedirs(root, exist_ok=True)
        super().__init__(path=root, fs=LocalFileSystem(auto_mkdir=True))

    @classmethod
    def _strip_protocol(cls, path):
        path = os.fspath(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                return path[len(prefix) :]
        return path


def install(root: str | os.PathLike) -> None:
    """Serve gs:// from `root` in this process (and in subprocesses that inherit FAKE_GCS_ROOT)."""
    os.environ["FAKE_GCS_ROOT"] = os.fspath(root)
    for name in ("gs", "gcs"):
        fsspec.register_implementation(name, FakeGCS, clobber=True)
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()
