"""tests/skip_policy.py in a real pytest session (pytester, in a subprocess: the policy reads CI there):
an unexpected skip fails the run under CI=true or --strict-skips and is only reported otherwise, an expected
one passes, what CI installs may not skip under CI, and the same holds under pytest-xdist."""

from __future__ import annotations

from pathlib import Path

import pytest
from skip_policy import EXPECTED, Expected, SkipPolicy

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent
CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import skip_policy

def pytest_addoption(parser):
    skip_policy.addoption(parser)

def pytest_configure(config):
    skip_policy.install(config)
"""
TESTS_PY = """
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_gpu():
    pass

def test_bash(): pytest.skip("bash not installed")

def test_surprise(): pytest.skip("nobody expects this")
"""


@pytest.fixture
def session(pytester, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    pytester.makeconftest(CONFTEST)
    return pytester


def run(pytester, *args):
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)


def test_an_unexpected_skip_is_reported_and_fails_only_under_ci(session, monkeypatch):
    session.makepyfile(test_it=TESTS_PY)
    local = run(session)
    assert local.ret == pytest.ExitCode.OK
    local.stdout.fnmatch_lines(
        [
            "*! 1 unexpected skip(s): tests that should have run !*",
            "UNEXPECTED SKIP test_it.py::test_surprise: nobody expects this",
            "skip policy: reported only*",
            "expected skips: 2 (1 no CUDA GPU, 1 no bash; tests/skip_policy.py)",
        ]
    )
    monkeypatch.setenv("CI", "true")
    ci = run(session)
    assert ci.ret == pytest.ExitCode.TESTS_FAILED
    ci.stdout.fnmatch_lines(
        [
            "*! 2 unexpected skip(s)*",  # bash is installed on CI: its skip is unexpected there
            "UNEXPECTED SKIP test_it.py::test_bash: bash not installed",
            "UNEXPECTED SKIP test_it.py::test_surprise: nobody expects this",
            "skip policy: the run fails (CI=true)",
            "expected skips: 1 (1 no CUDA GPU; tests/skip_policy.py)",
            "*1 passed, 3 skipped*",
        ]
    )


def test_strict_skips_fails_the_run_without_ci(session):
    session.makepyfile(test_it=TESTS_PY)
    result = run(session, "--strict-skips")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["skip policy: the run fails (--strict-skips)"])


def test_expected_skips_pass_under_ci_with_one_summary_line(session, monkeypatch):
    session.makepyfile(
        test_it="""
        import os, pytest

        @pytest.mark.skipif(True, reason="needs a CUDA GPU")
        def test_gpu():
            pass

        @pytest.mark.skipif(True, reason="root can write into a read-only directory")
        def test_read_only():
            pass
        """
    )
    monkeypatch.setenv("CI", "true")
    result = run(session)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["expected skips: 2 (1 no CUDA GPU, 1 root; tests/skip_policy.py)"])
    result.stdout.no_fnmatch_line("*unexpected*")


def test_a_module_skipped_for_libtpu_fails_ci_under_xdist(session, monkeypatch):
    """libtpu's skips are never expected under CI (it installs the tpu extra), here a module-level one, as
    tests/test_compile_tpu.py has, seen by the xdist controller from its workers' collection."""
    session.makepyfile(
        test_tpu="""
        import pytest
        pytest.importorskip("no_such_libtpu", reason="needs libtpu: pip install -e '.[tpu]'")

        def test_compiles():
            pass
        """,
        test_other=TESTS_PY.replace('pytest.skip("nobody expects this")', "pass"),
    )
    monkeypatch.setenv("CI", "true")
    result = run(session, "-p", "xdist", "-n", "2")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*! 2 unexpected skip(s)*",
            "UNEXPECTED SKIP test_*: *",
            "UNEXPECTED SKIP test_*: *",
            "skip policy: the run fails (CI=true)",
            "expected skips: 1 (1 no CUDA GPU; tests/skip_policy.py)",
        ]
    )
    result.stdout.fnmatch_lines(["UNEXPECTED SKIP test_tpu.py: needs libtpu: pip install -e '.[tpu]'"])
    result.stdout.fnmatch_lines(["UNEXPECTED SKIP test_other.py::test_bash: bash not installed"])


class _Report:
    def __init__(self, nodeid: str, reason: str, **extra):
        self.nodeid, self.skipped, self.longrepr = nodeid, True, ("x.py", 1, f"Skipped: {reason}")
        self.__dict__.update(extra)


def test_the_allow_list_scopes_by_reason_node_id_ci_and_platform():
    policy = SkipPolicy(EXPECTED, ci=False, strict=False)
    for nodeid, reason in [
        ("tests/test_live_metrics.py::test_wandb", "could not import 'wandb': No module named 'wandb'"),
        ("tests/test_other.py::test_wandb", "could not import 'wandb': No module named 'wandb'"),  # out of scope
        ("tests/test_gpu.py::test_x", "needs a CUDA GPU"),
    ]:
        policy.pytest_runtest_logreport(_Report(nodeid, reason))
    policy.pytest_runtest_logreport(_Report("tests/test_x.py::test_xfail", "reason", wasxfail=""))  # not a skip
    allowed, unexpected = policy.classify()
    assert allowed == {"no wandb extra": 1, "no CUDA GPU": 1}
    assert unexpected == [("tests/test_other.py::test_wandb", "could not import 'wandb': No module named 'wandb'")]
    libtpu = Expected("libtpu", r"^needs libtpu\b", "", on_ci=False, here=True)
    assert libtpu.applies(ci=False) and not libtpu.applies(ci=True)
    assert not Expected("libtpu", r"^needs libtpu\b", "", here=False).applies(ci=False)
