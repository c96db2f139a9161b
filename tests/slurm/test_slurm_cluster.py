"""The throw-away Slurm of tests/support/slurmcluster.py does what the real-Slurm tests need.

Jobs, GPUs and concurrency, and the three ways an agent running as a job step learns that it
must leave: ``scancel``, a ``--signal`` before the time limit, and partition-priority
preemption. Each measures how long the SIGTERM took (printed; run with ``-s`` to see them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabricnode.host.slurm import parse_slurm_time
from tests.support import REPO
from tests.support.slurmcluster import (
    SlurmCluster,
    cluster_root,
    kill_stale_clusters,
    processes_under,
)

pytestmark = pytest.mark.slow

# One step that writes when it started and when it got SIGTERM ($MARKS/<job>.up, .term: epoch
# seconds), then exits; `exec` so that the job ends when the step does, as the agent's job will.
STEP_SCRIPT = """#!/bin/bash
exec srun bash -c '
  trap "date +%s.%N > $MARKS/$SLURM_JOB_ID.term; kill \\$! 2>/dev/null; exit 0" TERM
  date +%s.%N > $MARKS/$SLURM_JOB_ID.up
  sleep 600 & wait'
"""


def wait_mark(marks: Path, job_id: int, what: str, timeout_s: float) -> float:
    """The time written in ``<job>.<what>`` once it exists (epoch seconds)."""
    path = marks / f"{job_id}.{what}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return float(text)
        time.sleep(0.05)
    raise AssertionError(f"no {path} after {timeout_s} s")


def start_step_job(
    slurm: SlurmCluster, marks: Path, *options: str, timeout_s: float = 20
) -> tuple[int, float]:
    """Submit STEP_SCRIPT; its job id and when its step started."""
    job_id = slurm.sbatch(STEP_SCRIPT, *options, env={"MARKS": str(marks)})
    slurm.wait_state(job_id, "RUNNING", timeout_s)
    return job_id, wait_mark(marks, job_id, "up", timeout_s)


def test_batch_job_runs_and_its_output_lands(slurm: SlurmCluster) -> None:
    t0 = time.monotonic()
    job_id = slurm.sbatch('echo "hello from job $SLURM_JOB_ID on $SLURMD_NODENAME"')
    assert slurm.wait_state(job_id, ["COMPLETED", "FAILED"], 30) == "COMPLETED"
    print(f"\nslurm: a batch job ran and completed {time.monotonic() - t0:.2f} s after sbatch")
    assert slurm.output(job_id).strip() == f"hello from job {job_id} on localhost"
    record = slurm.job(job_id)
    assert record is not None and record["Partition"] == "low" and record["ExitCode"] == "0:0"


def test_gres_gpu_2_sets_cuda_visible_devices_to_two_ids(slurm: SlurmCluster) -> None:
    job_id = slurm.sbatch('echo "CVD=$CUDA_VISIBLE_DEVICES"', "--gres=gpu:2")
    assert slurm.wait_state(job_id, ["COMPLETED", "FAILED"], 30) == "COMPLETED"
    out = slurm.output(job_id).strip()
    assert out.startswith("CVD="), out
    ids = out.removeprefix("CVD=").split(",")
    assert len(ids) == 2 and len(set(ids)) == 2 and all(i.isdigit() for i in ids), out


def test_three_one_cpu_jobs_run_at_once_on_a_two_core_machine(slurm: SlurmCluster) -> None:
    jobs = [slurm.sbatch("sleep 120") for _ in range(3)]
    for job_id in jobs:
        slurm.wait_state(job_id, "RUNNING", 20)
    assert {j["State"] for j in slurm.squeue() if int(j["JobId"]) in jobs} == {"RUNNING"}


def test_scancel_sends_sigterm_to_the_step_at_once(slurm: SlurmCluster, tmp_path: Path) -> None:
    job_id, _ = start_step_job(slurm, tmp_path)
    t0 = time.time()
    slurm.scancel(job_id)
    delay = wait_mark(tmp_path, job_id, "term", 10) - t0
    print(f"\nslurm: scancel -> SIGTERM in the step after {delay:.3f} s")
    assert delay < 2
    assert slurm.wait_state(job_id, "CANCELLED", 10) == "CANCELLED"


def test_time_limit_signal_reaches_the_step_before_the_limit(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # The shortest limit is a minute. sbatch(1) on --signal: "Due to the resolution of event
    # handling by Slurm, the signal may be sent up to 60 seconds earlier than specified", and
    # slurmctld looks at limits periodically: a step asking for SIGTERM 50 s before the end
    # gets it at some look after the job's start (seen from 8.4 s to 40 s) and well before the
    # limit. The job's StartTime, not the step's: on a node still busy with the ends of earlier
    # jobs the batch step may begin seconds after its job started.
    job_id, up = start_step_job(slurm, tmp_path, "--time=1", "--signal=TERM@50")
    record = slurm.job(job_id)
    assert record is not None and record["TimeLimit"] == "00:01:00"
    started = parse_slurm_time(record["StartTime"])
    assert started is not None, record
    term = wait_mark(tmp_path, job_id, "term", 50)
    print(
        f"\nslurm: --time=1 --signal=TERM@50 -> SIGTERM {term - started:.1f} s after the job "
        f"started ({term - up:.1f} s after its step began)"
    )
    assert -1 <= term - started <= 46  # StartTime is in whole seconds
    assert slurm.wait_state(job_id, ["COMPLETED", "TIMEOUT"], 10) == "COMPLETED"  # drained


def test_high_partition_job_preempts_a_low_one_whose_step_gets_sigterm_at_once(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    gpus = slurm.config.gpus
    low, _ = start_step_job(slurm, tmp_path, "-p", "low", f"--gres=gpu:{gpus}")
    t0 = time.time()
    high = slurm.sbatch("echo high", "-p", "high", "--gres=gpu:1")
    term = wait_mark(tmp_path, low, "term", 15) - t0
    slurm.wait_state(high, ["RUNNING", "COMPLETED"], 15)
    started = time.time() - t0
    record = slurm.job(high)
    print(
        f"\nslurm: preemption -> SIGTERM in the low job's step after {term:.2f} s;"
        f" the high job started {started:.2f} s after its sbatch"
        f" (by the {record and record['Scheduler']} scheduler; the step drained at once)"
    )
    assert term < 5
    # Its step drained within the grace time, so the job completed instead of being killed.
    assert slurm.wait_state(low, ["PREEMPTED", "COMPLETED", "CANCELLED"], 10) == "COMPLETED"
    # ...but its record keeps the preemption: what the elastic controller reads to say so
    shown = slurm.run("squeue", "-h", "--states=all", "-j", str(low), "-O", "PreemptTime").stdout
    print(f"slurm: squeue -O PreemptTime of the preempted job: {shown.strip()!r}")
    assert parse_slurm_time(shown.strip()) is not None
    shown = slurm.run("squeue", "-h", "--states=all", "-j", str(high), "-O", "PreemptTime").stdout
    assert parse_slurm_time(shown.strip()) is None, shown
    assert slurm.wait_state(high, ["COMPLETED", "FAILED"], 15) == "COMPLETED"


def test_close_leaves_no_process_behind_and_spares_other_clusters(
    slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = set(processes_under(slurm.root))
    with SlurmCluster(cluster_root(tmp_path_factory)) as cluster:
        marks = cluster.root / "marks"
        marks.mkdir()
        start_step_job(cluster, marks)
        assert len(processes_under(cluster.root)) >= 5  # 3 daemons, slurmstepd, the step
    assert processes_under(cluster.root) == []
    assert other <= set(processes_under(slurm.root))


CRASHING_OWNER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.support.slurmcluster import SlurmCluster
cluster = SlurmCluster(Path(sys.argv[2]))
cluster.start()
job_id = cluster.sbatch("srun sleep 600")
cluster.wait_state(job_id, "RUNNING")
print("running", flush=True)
time.sleep(600)
"""


def test_a_crashed_runs_cluster_is_killed_and_a_live_one_is_not(
    slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = cluster_root(tmp_path_factory)
    owner = subprocess.Popen(
        [sys.executable, "-c", CRASHING_OWNER, str(REPO), str(root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "running"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        time.sleep(0.5)  # the step's own `sleep` starts a moment after RUNNING
        orphans = processes_under(root)
        assert len(orphans) >= 5, orphans  # the daemons outlive their owner
        live = set(processes_under(slurm.root))
        killed = kill_stale_clusters()
        assert set(orphans) <= set(killed)
        assert processes_under(root) == []
        assert not live & set(killed)
        assert slurm.job_ids() == [] and slurm.sbatch("true") > 0  # the live cluster still works
    finally:
        owner.kill()
        owner.wait()
        for pid in processes_under(root):
            os.kill(pid, signal.SIGKILL)
