"""The live metrics endpoint (metrics_port): Prometheus / OpenMetrics text over HTTP on process 0.

`LiveMetrics` is a metric sink (`write`, one metrics row; see trainer.observe.sinks) and an event-log listener
(`on_event`, see `EventLog.subscribe`): it feeds both to a `trainer.observe.metrics.LiveState` (running counts
and a few bytes per step, not the records) and computes the values at each scrape (goodput up to the scrape's
time). `Endpoint` serves it with prometheus_client's WSGI application on a threading HTTP server, on a daemon
thread: it binds `addr:port` (an `OSError` when the port is taken); `close` stops serving. Given a control
application (`trainer.observe.control`), the server hands it the paths under `/control/`.

Metrics (every name starts with `trainer_`): step, loss, learning_rate, tokens_per_second, mfu,
step_time_seconds, goodput (0-1), predicted_goodput (0-1), wall_seconds, productive_seconds,
badput_seconds{cause, badput_type}, recoveries_total{kind}, failures_total{cause}, steps_lost_total,
seconds_since_save{tier}, slices. A value not known yet (no step, no plan, no save) is left out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

from trainer.observe.control import PATH as CONTROL_PATH
from trainer.observe.metrics import BADPUT_TYPES, LiveState, Values

log = logging.getLogger(__name__)

PREFIX = "trainer_"
PATH = "/metrics"  # prometheus_client serves every path; this is the one the manifests name


class LiveMetrics:
    """See the module docstring: the run's records in memory, and the collector that turns them into
    metrics at each scrape. `events`, `rows`: the run's records written before this process (a resumed
    run: its earlier processes' events.jsonl and metrics.jsonl); `clock`: seconds since the epoch."""

    def __init__(
        self,
        *,
        events: Iterable[dict[str, Any]] = (),
        rows: Iterable[dict[str, Any]] = (),
        clock: Callable[[], float] = time.time,
    ):
        self._lock = threading.Lock()
        self._state = LiveState()
        for e in events:
            self._state.add_event(e)
        for r in rows:
            self._state.add_row(r)
        self.clock = clock

    def write(self, record: dict[str, Any]) -> None:
        """A metrics row (the MetricSink protocol)."""
        with self._lock:
            self._state.add_row(record)

    def close(self) -> None:
        """The MetricSink protocol: nothing to release (the endpoint serving it is closed by its owner)."""

    def on_event(self, record: dict[str, Any]) -> None:
        """An event as the event log wrote it (an `EventLog.subscribe` listener)."""
        with self._lock:
            self._state.add_event(record)

    def values(self) -> Values:
        with self._lock:
            return self._state.values(self.clock())

    def collect(self) -> Iterator[Metric]:
        """The prometheus_client collector protocol."""
        yield from families(self.values())


class Endpoint:
    """`live` served over HTTP on `addr:port` (port 0: a free one, see `port`), on its own daemon thread,
    until `close`; `control`: the WSGI application of the paths under `/control/` (None: those are
    metrics paths too). Raises OSError when it cannot bind."""

    def __init__(self, live: LiveMetrics, port: int, addr: str = "0.0.0.0", control: Callable | None = None):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(live)
        metrics = make_wsgi_app(registry)

        def app(environ, start_response):
            if control is not None and environ.get("PATH_INFO", "").startswith(CONTROL_PATH):
                return control(environ, start_response)
            return metrics(environ, start_response)

        self._server = make_server(addr, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, name="metrics-endpoint", daemon=True).start()
        self.port: int = self._server.server_address[1]
        log.info("live metrics on http://%s:%d%s", addr, self.port, PATH)

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _QuietHandler(WSGIRequestHandler):
    """No access log line on stderr per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def families(v: Values) -> Iterator[Metric]:
    """The Prometheus metric families of `v`; values not known yet are left out."""
    gauges = (
        ("step", "the newest completed training step", v.step),
        ("loss", "the newest step's training loss", v.loss),
        ("learning_rate", "the newest step's learning rate", v.learning_rate),
        ("tokens_per_second", "the newest step's training tokens per second", v.tokens_per_s),
        ("mfu", "the newest step's model FLOPs utilisation (0-1)", v.mfu),
        ("step_time_seconds", "the newest step's wall time", v.step_time_s),
        ("goodput", "productive share of the run's wall time so far (0-1), measured", v.goodput),
        ("predicted_goodput", "the period planner's expected goodput for this run (0-1)", v.predicted_goodput),
        ("wall_seconds", "the run's wall time so far (every process of it)", v.wall_s),
        ("productive_seconds", "time of the steps whose results survived", v.productive_s),
        ("slices", "slices the current attempt trains on", v.slices),
    )
    for name, doc, value in gauges:
        if value is not None:
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(value))
    badput = GaugeMetricFamily(
        PREFIX + "badput_seconds",
        "unproductive wall time by cause (badput_type: ml-goodput-measurement's name)",
        labels=["cause", "badput_type"],
    )
    for cause, seconds in v.badput_s.items():
        badput.add_metric([cause, BADPUT_TYPES.get(cause, "OTHER")], float(seconds))
    yield badput
    yield _labelled(
        CounterMetricFamily, "recoveries", "attempts that resumed saved state, by kind", "kind", v.recoveries
    )
    yield _labelled(CounterMetricFamily, "failures", "failed attempts, by cause", "cause", v.failures)
    yield CounterMetricFamily(PREFIX + "steps_lost", "steps trained again after a rewind", value=v.steps_lost)
    yield _labelled(
        GaugeMetricFamily,
        "seconds_since_save",
        "seconds since the newest committed save",
        "tier",
        v.seconds_since_save,
    )


def _labelled(kind, name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
    family = kind(PREFIX + name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], float(value))
    return family
