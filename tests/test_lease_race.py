"""One run directory, several jobs starting at the same moment: exactly one takes the lease.

tests/test_lease.py checks the lease protocol one step at a time in one process; nothing there races,
so a store whose "create-only" write silently overwrites (no O_EXCL on a local disk, no
`ifGenerationMatch=0` on Cloud Storage) passes it. Here real OS processes, each a different job
($TRAINER_JOB_ID, so `job_identity` differs and no one may take over another as "same_job"), each alive
until all have tried (so none is "owner_process_gone"), with a fresh heartbeat and an hour's staleness
bound, race for one run directory's lease, a few rounds with a fresh run directory each:

- a start gate lines the acquire calls up, and
- a rendezvous in front of the store's create makes every racer first find the lease empty and then
  write generation 1 at the same moment (the first create of each racer waits there for the others; the
  write itself is the real `LeaseFiles.create`).

So a store that is create-only gives one winner per round and every other racer is refused with
LeaseHeld naming the winner; an overwriting store lets several (in practice all) racers win, every
round. The racers import `trainer.checkpoint.lease` without the package's `__init__` (which loads JAX
and Orbax for the checkpointer), so starting them costs little.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RACERS = 5
ROUNDS = 3
REPO = Path(__file__).resolve().parent.parent

# One racer: argv[1] is its spec (index, racers, control dir, one run dir per round). It prints one JSON
# line per round: what acquire returned, or the error it raised.
RACER = r"""
import json, os, sys, time, types

spec = json.loads(sys.argv[1])
index, racers, control = spec["index"], spec["racers"], spec["control"]

import trainer  # the package's own setup; then its checkpoint subpackage without its __init__ (JAX, Orbax)

package = types.ModuleType("trainer.checkpoint")
package.__path__ = [os.path.join(os.path.dirname(trainer.__file__), "checkpoint")]
sys.modules.setdefault("trainer.checkpoint", package)
from trainer.checkpoint.lease import LeaseFiles, LeaseHeld, Owner, RunLease
if spec["remote"]:
    import gcsfs  # noqa: F401  (imported before the race, not inside it)


def gate(name):
    # Wait until every racer has reached `name` (a marker file per racer in the control dir).
    open(os.path.join(control, f"{name}.{index}"), "x").close()
    deadline = time.monotonic() + 60
    while sum(n.startswith(name + ".") for n in os.listdir(control)) < racers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"racer {index}: not every racer reached {name}")
        time.sleep(0.0002)


class Rendezvous(LeaseFiles):
    # The real store; its first create waits until every racer is about to create.
    def __init__(self, run_dir, name):
        super().__init__(run_dir)
        self.name = name

    def create(self, generation, record):
        if self.name is not None:
            gate(self.name)
            self.name = None
        return super().create(generation, record)


owner = Owner.this_process()
assert owner.job == f"trainer:{spec['job']}", owner
for round_, run_dir in enumerate(spec["run_dirs"]):
    gate(f"start-{round_}")
    lease = RunLease(run_dir, stale_s=3600, owner=owner, files=Rendezvous(run_dir, f"create-{round_}"))
    try:
        out = {"won": lease.acquire()}
    except LeaseHeld as e:
        out = {"held": str(e)}
    print(json.dumps({"round": round_, "owner": owner.describe(), **out}), flush=True)
    gate(f"end-{round_}")  # the winner stays alive until every racer has decided
"""


def _race(tmp_path: Path, run_dirs: list[str], env: dict[str, str] | None = None) -> list[list[dict]]:
    """RACERS processes race for the lease of each of `run_dirs` in turn; per round, every racer's outcome."""
    control = tmp_path / "control"
    control.mkdir()
    procs = []
    for i in range(RACERS):
        spec = {
            "index": i,
            "racers": RACERS,
            "control": str(control),
            "run_dirs": run_dirs,
            "job": f"racer-{i}",
            "remote": run_dirs[0].startswith("gs://"),
        }
        racer_env = {**os.environ, **(env or {}), "TRAINER_JOB_ID": f"racer-{i}"}
        for other in ("JOBSET_NAME", "SLURM_JOB_ID"):
            racer_env.pop(other, None)
        with open(tmp_path / f"racer-{i}.out", "wb") as out, open(tmp_path / f"racer-{i}.err", "wb") as err:
            args = [sys.executable, "-c", RACER, json.dumps(spec)]
            procs.append(subprocess.Popen(args, stdout=out, stderr=err, cwd=REPO, env=racer_env))
    outcomes: list[list[dict]] = [[] for _ in run_dirs]
    for i, proc in enumerate(procs):
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"racer {i} did not finish in 120 s")
        err = (tmp_path / f"racer-{i}.err").read_text(errors="replace")
        assert proc.returncode == 0, f"racer {i} failed:\n{err[-3000:]}"
        for line in (tmp_path / f"racer-{i}.out").read_text().splitlines():
            result = json.loads(line)
            outcomes[result["round"]].append(result)
    return outcomes


def _exactly_one_won(round_: int, outcomes: list[dict]) -> dict:
    """The round's winner, after checking that every other racer was refused naming it."""
    assert len(outcomes) == RACERS, outcomes
    winners = [o for o in outcomes if "won" in o]
    why = ""
    if any(w["won"].get("taken_over") == "unreadable" for w in winners):
        why = "; one read another's generation while it was being written (visible before its record) and took it"
    assert len(winners) == 1, f"round {round_}: {len(winners)} of {RACERS} racers took the lease{why}: {winners}"
    [winner] = winners
    assert winner["won"]["generation"] == 1 and "previous_owner" not in winner["won"], winner
    for loser in outcomes:
        if loser is not winner:
            assert "held" in loser, loser
            assert f"is in use by {winner['owner']} (heartbeat" in loser["held"], (round_, winner, loser)
    return winner


def _record_owner(record: dict) -> str:
    owner = record["owner"]
    return f"job {owner['job']} on host {owner['host']}, pid {owner['pid']}"


def test_of_jobs_racing_for_one_local_lease_exactly_one_wins(tmp_path):
    run_dirs = [str(tmp_path / f"run-{r}") for r in range(ROUNDS)]
    for round_, outcomes in enumerate(_race(tmp_path, run_dirs)):
        winner = _exactly_one_won(round_, outcomes)
        lease_dir = Path(run_dirs[round_]) / "lease"
        assert sorted(p.name for p in lease_dir.iterdir()) == ["1.json"]
        assert _record_owner(json.loads((lease_dir / "1.json").read_text())) == winner["owner"]


def test_of_jobs_racing_for_one_gcs_lease_exactly_one_wins(gcs_server, tmp_path):
    bucket = gcs_server.new_bucket("race")
    run_dirs = [f"gs://{bucket}/runs/r{r}" for r in range(ROUNDS)]
    for round_, outcomes in enumerate(_race(tmp_path, run_dirs, env=gcs_server.env)):
        winner = _exactly_one_won(round_, outcomes)
        assert gcs_server.names(bucket, f"runs/r{round_}/") == [f"runs/r{round_}/lease/1.json"]
        record = json.loads(gcs_server.read(bucket, f"runs/r{round_}/lease/1.json"))
        assert _record_owner(record) == winner["owner"]
