"""A real Prometheus server (Debian's `prometheus` package) scrapes a training run's metrics_port every
second; its HTTP API then answers the run's step and goodput (docs/live_metrics.md)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

PROMETHEUS = shutil.which("prometheus")
STEPS = 30

pytestmark = [
    pytest.mark.interop,
    pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus binary (apt-get install prometheus)"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def query(prometheus: str, promql: str) -> list[dict]:
    """The result vector of an instant query (/api/v1/query)."""
    answer = json.loads(get(f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


@pytest.fixture
def prometheus(tmp_path: Path):
    """A Prometheus server scraping 127.0.0.1:<metrics port> every second: (its URL, the metrics port)."""
    metrics_port, web_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: trainer\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n"
    )
    log = (tmp_path / "prometheus.log").open("w")
    server = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{web_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                get(f"{url}/-/ready")
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "prometheus did not become ready within 60 s"
                time.sleep(0.2)
        yield url, metrics_port
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_prometheus_scrapes_step_and_goodput_from_a_training_run(prometheus, tmp_path):
    url, metrics_port = prometheus
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train",
            "base.yml",
            "model=qwen3-tiny",
            f"steps={STEPS}",
            "enable_tensorboard=false",
            f"base_output_directory={tmp_path}",
            "run_name=scraped",
            f"metrics_port={metrics_port}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    time.sleep(2)  # the scrapes in flight land in the database
    # The run has ended: its series are stale now, so ask for the newest sample of the run's last minutes.
    step = query(url, "max_over_time(trainer_step[10m])")
    goodput = query(url, "last_over_time(trainer_goodput[10m])")
    badput = query(url, "last_over_time(trainer_badput_seconds[10m])")
    assert step and 0 < float(step[0]["value"][1]) <= STEPS, step
    assert step[0]["metric"]["job"] == "trainer"
    assert goodput and 0 < float(goodput[0]["value"][1]) <= 1, goodput
    causes = {r["metric"]["cause"]: r["metric"]["badput_type"] for r in badput}
    assert causes["startup_compile"] == "PROGRAM_STARTUP"
