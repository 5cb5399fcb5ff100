"""The skip policy: which skipped tests are expected, and where. A proof that skips says nothing, so every
skip of a run is checked against `EXPECTED` at its end (tests/conftest.py installs this plugin):

- an expected skip is counted in one line of the terminal summary (`expected skips: ...`);
- any other skip is listed loudly, with its reason, and fails the run under `CI=true` (CI sets it) or with
  `--strict-skips`: a run that otherwise passed exits 1.

An entry matches a skip by its reason (a regular expression searched in the reason text) and, where the
reason alone is too general, by the test's node id (prefixes). Entries with `on_ci=False` cover what CI
installs (the `tpu` and `wandb` extras, bash): under CI those tests must run, so their skips are
unexpected there. Works under pytest-xdist: the controller receives every worker's skips through
`pytest_runtest_logreport` (skips at run time) and `pytest_collectreport` (a module's skip at import).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import platform
import re
import sys

import pytest

# libtpu publishes wheels for Linux x86-64 only: elsewhere the `tpu` extra does not install.
LIBTPU_INSTALLS = sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64")


@dataclasses.dataclass(frozen=True)
class Expected:
    label: str  # short name in the summary line
    reason: str  # regular expression, searched in the skip's reason
    why: str  # why this skip is right where it is allowed
    nodeids: tuple[str, ...] = ()  # node id prefixes it is limited to; empty: any test
    on_ci: bool = True  # allowed under CI=true too
    here: bool = True  # allowed on this platform at all

    def applies(self, ci: bool) -> bool:
        return self.here and (self.on_ci or not ci)

    def matches(self, nodeid: str, reason: str) -> bool:
        in_scope = not self.nodeids or nodeid.startswith(self.nodeids)
        return in_scope and re.search(self.reason, reason) is not None


EXPECTED: tuple[Expected, ...] = (
    Expected(
        "no CUDA GPU",
        r"^needs a CUDA GPU$",
        "needs a CUDA GPU: there is none on CI or on most developers' machines (README: GPU tests)",
    ),
    Expected(
        "root",
        r"^root can write into a read-only directory$",
        "root can write into a read-only directory: CI runs as root",
    ),
    Expected(
        "TPU attached",
        r"^a TPU is attached$",
        "checks libtpu without a TPU: on a TPU VM the premise does not hold",
    ),
    Expected(
        "no libtpu wheel",
        r"^needs libtpu\b",
        "libtpu has wheels for Linux x86-64 only; CI installs the tpu extra, so there the TPU guards must run",
        on_ci=False,
        here=not LIBTPU_INSTALLS,
    ),
    Expected(
        "no wandb extra",
        r"^could not import 'wandb'",
        "the optional wandb extra is not installed; CI installs it, so there the W&B sink's tests must run",
        nodeids=("tests/test_live_metrics.py",),
        on_ci=False,
    ),
    Expected(
        "no bash",
        r"^bash not installed$",
        "the deploy scripts' tests run them with bash; CI runs under bash, so there they must run",
        on_ci=False,
    ),
)


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def skip_reason(report) -> str:
    """The reason text of a skipped test or collector report, without pytest's 'Skipped: ' prefix."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


class SkipPolicy:
    def __init__(self, expected: tuple[Expected, ...], ci: bool, strict: bool):
        self.expected = [e for e in expected if e.applies(ci)]
        self.ci, self.strict = ci, strict or ci
        self.skips: dict[str, str] = {}  # node id -> reason, in the order they were reported

    def _record(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.setdefault(report.nodeid, skip_reason(report))

    def pytest_runtest_logreport(self, report) -> None:
        self._record(report)

    def pytest_collectreport(self, report) -> None:
        self._record(report)

    def classify(self) -> tuple[collections.Counter, list[tuple[str, str]]]:
        allowed, unexpected = collections.Counter(), []
        for nodeid, reason in self.skips.items():
            entry = next((e for e in self.expected if e.matches(nodeid, reason)), None)
            if entry is None:
                unexpected.append((nodeid, reason))
            else:
                allowed[entry.label] += 1
        return allowed, unexpected

    def pytest_sessionfinish(self, session) -> None:
        _, unexpected = self.classify()
        passed = session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if unexpected and self.strict and passed:  # a run that otherwise passed (or ran nothing) fails
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        allowed, unexpected = self.classify()
        tr = terminalreporter
        if unexpected:
            title = f"{len(unexpected)} unexpected skip(s): tests that should have run"
            tr.write_sep("!", title, red=True, bold=True)
            for nodeid, reason in unexpected:
                tr.write_line(f"UNEXPECTED SKIP {nodeid}: {reason}", red=True, bold=True)
            tr.write_line(
                "Install what they need (the extras: pip install -e '.[test,tpu,wandb]'), or, where skipping is"
                " right, add the skip with its reason to EXPECTED in tests/skip_policy.py."
            )
            if self.strict:
                why = "CI=true" if self.ci else "--strict-skips"
                tr.write_line(f"skip policy: the run fails ({why})", red=True, bold=True)
            else:
                tr.write_line("skip policy: reported only; CI=true or --strict-skips makes them fail the run")
        if allowed:
            counts = ", ".join(f"{n} {label}" for label, n in allowed.most_common())
            tr.write_line(f"expected skips: {sum(allowed.values())} ({counts}; tests/skip_policy.py)")


def addoption(parser) -> None:
    parser.addoption(
        "--strict-skips",
        action="store_true",
        help="fail the run when a test skips that tests/skip_policy.py does not expect (CI=true implies it)",
    )


def install(config) -> None:
    """Register the policy on the controller (or the only process); xdist workers report to it."""
    if hasattr(config, "workerinput"):
        return
    policy = SkipPolicy(EXPECTED, ci=on_ci(), strict=config.getoption("strict_skips"))
    config.pluginmanager.register(policy, "skip_policy")
