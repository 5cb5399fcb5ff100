"""The backend a job runs on, chosen once from `cluster` (trainer.elastic.backends): `auto` resolves as it
always did, a job that cannot be the backend its config asks for stops before compute (exit 2, naming the
key and the fix), and what differs between backends is each backend's answer. No JAX backend is started:
choosing reads the config and the environment only."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from trainer.config import ConfigError, load_config
from trainer.config.schema import AUTO, UNPLANNED_CHECKPOINT_PERIOD
from trainer.distributed import resolve_settings
from trainer.elastic.backends import BACKENDS, resolve
from trainer.elastic.backends.local import LocalBackend
from trainer.elastic.backends.pathways import PathwaysBackend
from trainer.elastic.backends.processes import ProcessesBackend
from trainer.elastic.cluster import Cluster
from trainer.elastic.periods import PeriodKeys
from trainer.observe.rundir import run_paths
from trainer.run import backend_for

TWO = ["num_processes=2", "process_id=1", "coordinator_address=localhost:1234"]


def _backend(*overrides: str):
    return backend_for(load_config("base.yml", list(overrides)))


def test_auto_resolves_several_processes_then_the_single_controller_flag_then_local():
    one = resolve_settings(load_config("base.yml").distributed)
    two = resolve_settings(load_config("base.yml", TWO).distributed)
    assert resolve("auto", one, single_controller=False) == "local"
    assert resolve("auto", one, single_controller=True) == "pathways"
    assert resolve("auto", two, single_controller=True) == "processes"
    assert resolve("processes", one, single_controller=False) == "processes"  # given: itself
    assert type(_backend()) is LocalBackend
    assert type(_backend("enable_single_controller=true")) is PathwaysBackend
    assert type(_backend(*TWO)) is ProcessesBackend
    assert set(BACKENDS) == {"local", "pathways", "processes"}


def test_a_job_that_cannot_be_the_backend_asked_for_stops_naming_the_key_and_the_fix(monkeypatch):
    with pytest.raises(ConfigError, match=r"cluster=processes needs several processes.*set cluster=local"):
        _backend("cluster=processes")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")  # the environment's count, which the config cannot check
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
    with pytest.raises(
        ConfigError, match=r"cluster=local runs one process, but this job has 2.*cluster=processes"
    ):
        _backend("cluster=local")
    with pytest.raises(ConfigError, match=r"cluster=pathways runs one process"):
        _backend("cluster=pathways")
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pathwaysutils" else real(name)
    )
    with pytest.raises(
        ConfigError, match=r"cluster=auto \(enable_single_controller=true: pathways\) needs pathwaysutils"
    ):
        _backend("enable_single_controller=true")


def test_keys_that_contradict_the_cluster_are_config_errors():
    with pytest.raises(ConfigError, match="enable_single_controller=true asks for Pathways' one controller"):
        load_config("base.yml", ["cluster=local", "enable_single_controller=true"])
    with pytest.raises(ConfigError, match="cluster=local runs one process but num_processes=2"):
        load_config("base.yml", ["cluster=local", *TWO])
    with pytest.raises(ConfigError, match="cluster=processes needs several processes but num_processes=1"):
        load_config("base.yml", ["cluster=processes", "num_processes=1"])
    with pytest.raises(ConfigError, match="cluster='slurm' is not one of"):
        load_config("base.yml", ["cluster=slurm"])


def test_one_controller_plans_every_period_and_runs_the_replay_check(tmp_path):
    backend = _backend()
    keys = PeriodKeys(snapshot=AUTO, local=AUTO, checkpoint=AUTO)
    assert backend.allowed_periods(keys, elastic_enabled=True) == keys
    assert backend.sdc_unavailable is None and backend.freeze_bound_s == 0.0 and backend.process_id == 0
    paths = run_paths(str(tmp_path), "r")
    assert backend.log_paths(paths) is paths


def test_several_processes_take_numbered_periods_no_replay_check_and_write_under_their_own_directory(tmp_path):
    backend = _backend(*TWO, "heartbeat_timeout_seconds=4")
    assert backend.allowed_periods(PeriodKeys(AUTO, 5, AUTO), elastic_enabled=True) == PeriodKeys(
        0, 5, UNPLANNED_CHECKPOINT_PERIOD
    )
    with pytest.raises(ConfigError, match="local_checkpoint_period=auto needs one controller"):
        backend.allowed_periods(PeriodKeys(3, AUTO, 100), elastic_enabled=True)
    assert "this job has 2 processes" in backend.sdc_unavailable
    # A frozen process is fenced once its peers' checkpoint barriers gave up on it: one bound for both.
    assert backend.freeze_bound_s == backend.spec.settings.peer_dead_after_s == 3 * 4 + 5
    paths = backend.log_paths(run_paths(str(tmp_path), "r", local_checkpoint_directory=str(tmp_path / "node")))
    assert (
        paths.local == tmp_path / "r" / "process_1"
        and paths.checkpoints == run_paths(str(tmp_path), "r").checkpoints
    )
    assert str(paths.local_checkpoints).endswith("node/r/process_1")
    assert backend.process_id == 1


def test_a_cluster_states_what_it_lacks_by_the_contracts_defaults_and_must_state_the_rest():
    """Every capability the supervisor uses is in the `Cluster` contract, so none is probed for: a
    cluster that lacks one (quarantine, compiling ahead, a stop to propose) answers with the default."""

    class Minimal(Cluster):
        num_slices = 1

        def wait_for_slices(self, min_slices):
            return [0]

    minimal = Minimal()
    assert minimal.quarantine(0) is False and minimal.compiles_ahead is False
    assert minimal.fail(RuntimeError("own")) is None and minimal.propose_stop(3) is None
    assert minimal.at_step_boundary(1) is None and minimal.hand_over(None) is None and minimal.close() is None
    with pytest.raises(NotImplementedError, match="Minimal does not state slice_down_cause"):
        minimal.slice_down_cause(RuntimeError("?"))


def test_the_cli_stops_before_compute_with_exit_2_when_the_job_cannot_be_the_backend(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "cluster=processes", f"base_output_directory={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "STATUS: config_error"
    assert "cluster=processes needs several processes" in proc.stderr
    assert not list(tmp_path.iterdir()), "nothing is written before the backend is chosen"
