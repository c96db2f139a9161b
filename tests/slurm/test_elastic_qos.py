"""QoS limits on a real Slurm with accounting (``slurm_accounting_cluster``: slurmdbd, MariaDB,
limits and QoS enforced). First the cluster itself: sbatch over the submit limit of QoS
``single`` is refused at submission. Then the elastic controller: a model that asks for more
replicas than its QoS lets a user submit gets what the QoS admits; sbatch refuses the rest and
the refusal, in Slurm's words, is the model's state in ``fabric services``, a decision and a
line of the controller's log, while the admitted replica keeps serving.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.support.elasticmesh import Elastic, controller_jobs, elastic_mesh
from tests.support.meshview import fabric
from tests.support.slurmcluster import ACCOUNT, ACCOUNTING_QOS, SlurmCluster, SlurmError

MODEL = "sim-qos"
QOS = "single"
assert ACCOUNTING_QOS[QOS] == "MaxSubmitJobsPerUser=1"

SERVICE = f"""
[limits]
max_jobs = 4
max_gpus = 4

[[model]]
name = "{MODEL}"
engine = "sim"
gpus_per_replica = 1
min_replicas = 2
max_replicas = 2
partitions = ["high"]
qos = "{QOS}"
time_limit = "10:00"
"""

# What slurm-wlm 22.05 says (both lines of sbatch's stderr, joined by the controller).
QOS_REFUSAL = (
    "QOSMaxSubmitJobPerUserLimit; Batch job submission failed: Job violates accounting/QOS"
    " policy (job submit limit, user's size and/or time limits)"
)

pytestmark = pytest.mark.slow


def test_sbatch_over_the_qos_submit_limit_is_refused_at_submission(
    slurm_accounting_cluster: SlurmCluster,
) -> None:
    cluster = slurm_accounting_cluster
    try:
        first = cluster.sbatch("sleep 60", f"--qos={QOS}")
        with pytest.raises(SlurmError) as refused:
            cluster.sbatch("sleep 60", f"--qos={QOS}")
        print(f"\nsbatch over the limit: {refused.value}")
        assert "sbatch: error: QOSMaxSubmitJobPerUserLimit" in str(refused.value)
        assert QOS_REFUSAL.split("; ")[1] in str(refused.value)
        other = cluster.sbatch("sleep 60")  # the user's default QoS has no limit
        with pytest.raises(SlurmError, match="Invalid account"):
            cluster.sbatch("sleep 60", "--account=nobody")  # associations are enforced
        records = [cluster.job(first), cluster.job(other)]
        assert [(r or {}).get("QOS") for r in records] == [QOS, "normal"], records
        assert all((r or {}).get("Account") == ACCOUNT for r in records), records
    finally:
        cluster.cancel_all()  # the next test's first job must be the QoS's only one


@pytest.fixture(scope="module")
def elastic(
    slurm_accounting_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Elastic]:
    with elastic_mesh(slurm_accounting_cluster, tmp_path_factory.mktemp("elastic-qos")) as e:
        yield e


def test_sbatch_refused_over_the_qos_limit_is_reported_and_the_admitted_replica_serves(
    slurm_accounting_cluster: SlurmCluster, elastic: Elastic, tmp_path: Path
) -> None:
    cluster, mesh, ingress = slurm_accounting_cluster, elastic.mesh, elastic.ingress
    service = tmp_path / "services.toml"
    service.write_text(SERVICE)
    t0 = time.monotonic()
    done = fabric(mesh, ingress, "services", "apply", str(service))
    assert done.returncode == 0, done.stdout + done.stderr
    while True:
        doc = json.loads(fabric(mesh, ingress, "services", "--json").stdout)
        model = next((m for m in doc["models"] if m["model"] == MODEL), {})
        if model.get("state") == "refused" and model.get("serving") == 1:
            break
        assert time.monotonic() - t0 < 90, (doc, cluster.squeue())
        time.sleep(0.5)
    print(f"one replica SERVING, the other refused, {time.monotonic() - t0:.1f} s after apply")
    print(f"fabric services: {model}")

    # Slurm admitted one job, with the QoS asked for, and refused the next at submission
    ours = [
        (job_id, state) for job_id, state, tag in controller_jobs(cluster) if tag.model == MODEL
    ]
    assert len(ours) == 1 and ours[0][1] == "RUNNING", ours
    record = cluster.job(int(ours[0][0]))
    assert record is not None and record["QOS"] == QOS, record

    # the refusal in Slurm's words: the model's note, a decision, the acting controller's log
    assert model["note"].endswith(QOS_REFUSAL), model  # "Slurm refused ...: " before it
    refusals = [d["reason"] for d in doc["decisions"] if d["action"] == "refused"]
    assert f"sbatch at partition high: {QOS_REFUSAL}" in refusals, refusals
    logged = [
        line
        for agent in elastic.controllers
        for line in agent.stderr_path.read_text(errors="replace").splitlines()
        if f"controller refused {MODEL}: " in line
    ]
    assert logged and all(QOS_REFUSAL in line for line in logged), logged
    print(f"controller log: {logged[0]}")
    # no sbatch every pass, nor when the admitted replica came up: one per refusal's 60 s
    for session in {line.split()[3] for line in logged}:
        times = [_log_time(line) for line in logged if line.split()[3] == session]
        assert all(b - a >= 59 for a, b in itertools.pairwise(times)), logged

    # the admitted replica keeps serving
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    r = httpx.post(f"{ingress.http_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def _log_time(line: str) -> float:
    """The time of an agent's log line (``2026-11-25 20:46:14,946 INFO [session] ...``)."""
    return datetime.strptime(" ".join(line.split()[:2]), "%Y-%m-%d %H:%M:%S,%f").timestamp()
