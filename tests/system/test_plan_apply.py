"""`fabric plan` against real agents: inventory and workload from the mesh, `--apply` turning
JOIN-only nodes (simulated GPUs and engines) into serving nodes through operator-signed
assignments, and the ways it refuses."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import openai
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.control.client import AdminClient
from fabricnode.elastic.observe import AgentClient
from fabricnode.mesh.identity import OperatorKey
from scheduler.node_assign import NodePlan
from tests.support import meshview

WORKLOAD = """
[[model]]
name = "llama-2-7b"
rate = 6
input_mean = 600
output_mean = 120

[[model]]
name = "llama-3-8b"
rate = 4
input_mean = 900
output_mean = 200
"""


def fabric(mesh: LocalMesh, agent: AgentProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return meshview.fabric(mesh, agent, *args, timeout_s=180)  # plans can take a while


def operator(mesh: LocalMesh) -> OperatorKey:
    key = OperatorKey.generate()
    key.save(mesh.workdir / "operator.key")  # $FABRIC_HOME/operator.key of the mesh's env
    return key


def gpu_node(mesh: LocalMesh, name: str, gpus: str, key: OperatorKey, *extra: str) -> AgentProcess:
    return mesh.start(
        name, args=["--sim-gpu", gpus, "--trust-operator", key.fingerprint, *extra], wait=False
    )


def test_apply_turns_join_nodes_into_serving_nodes_that_answer_requests(
    mesh: LocalMesh, tmp_path: Path
) -> None:
    key = operator(mesh)
    ingress = mesh.start("ingress", args=["--trust-operator", key.fingerprint])
    nodes = [
        gpu_node(mesh, "a100", "A100-80G:2", key, "--engine-template", "sim"),
        gpu_node(mesh, "h100", "H100:2", key, "--engine-template", "sim"),
    ]
    for n in nodes:
        n.wait_ready()
    client = AdminClient(ingress.http_url)
    assert wait_until(lambda: len(client.nodes(state="join")) == 3, 15)
    workload = tmp_path / "workload.toml"
    workload.write_text(WORKLOAD)

    started = time.monotonic()
    done = fabric(mesh, ingress, "plan", "--workload", str(workload), "--apply", "--json",
                  "--wait", "60", "--time-limit", "5")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"plan + apply until both nodes served: {time.monotonic() - started:.1f} s")
    doc = json.loads(done.stdout)
    assert doc["inventory"] == {"A100-80G": 2, "H100-SXM": 2}
    assert all(a["tp"] <= 2 for a in doc["allocations"])  # no replica wider than a node
    applied = doc["apply"]
    assert set(applied["status"].values()) == {"serving"}
    assert len(applied["status"]) == 2  # both models got a node
    by_model = {a["model"]: a["session_id"] for a in applied["assignments"]}
    assert set(by_model) == {"llama-2-7b", "llama-3.1-8b"}
    # planned on the agents themselves: each replica's node is the agent it was assigned to
    assert {(e["model"], e["node"]) for e in doc["nodes"]} == set(by_model.items())
    for row in doc["allocations"]:
        assert row["nodes"] == [by_model[row["model"]]]

    # The registry shows who serves what and under which plan; the ingress routes to them.
    for model, sid in by_model.items():
        entry = client.node(sid)
        assert entry["state"] == "serving" and [m["id"] for m in entry["models"]] == [model]
        assert entry["labels"]["fabric.plan"] == applied["plan_id"]
    api = openai.OpenAI(base_url=f"{ingress.http_url}/v1", api_key="none", max_retries=0)
    for model, sid in by_model.items():
        raw = api.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert raw.headers["x-fabric-node"] == sid
    # The assignments stay in every agent's table until they expire; nothing more happens.
    held = client.assignments()
    assert {a["target"] for a in held["assignments"]} == set(by_model.values())
    assert held["trusted_operators"] == [key.fingerprint]


def logged(agent: AgentProcess, window_s: float) -> float:
    """Requests in ``agent``'s request log over the last ``window_s``, as its workload endpoint
    reads them (what the log has flushed)."""
    return sum(AgentClient().requests_in(agent.http_url, window_s).values())


def test_plan_reads_the_workload_from_the_agents_request_logs(mesh: LocalMesh) -> None:
    ingress = mesh.start("ingress")
    serving = mesh.start("serving", args=["--sim", "llama-2-7b", "--sim-gpu", "A100-80G:1"])
    client = AdminClient(ingress.http_url)
    assert wait_until(lambda: len(client.nodes(state="serving")) == 1, 20)
    api = openai.OpenAI(base_url=f"{ingress.http_url}/v1", api_key="none", max_retries=0)
    for _ in range(12):
        api.completions.create(model="llama-2-7b", prompt="x " * 300, max_tokens=8)
    assert wait_until(lambda: logged(ingress, 60) == 12, 10)  # the log is flushed every second

    done = fabric(mesh, ingress, "plan", "--window", "60", "--json", "--time-limit", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    (w,) = doc["workload"]
    assert w["model"] == "llama-2-7b" and w["rate"] == pytest.approx(12 / 60)
    assert w["input_mean"] > 100 and 1 <= w["output_mean"] <= 8
    assert doc["inventory"] == {"A100-80G": 1}
    assert doc["allocations"] == [
        {"model": "llama-2-7b", "gpu": "A100-80G", "pool": "A100-80G", "gpus": 1, "tp": 1,
         "dp": 1, "nodes": [serving.session_id]}
    ]  # fmt: skip
    assert serving.running
    # Human output: the allocation table, the comparison with memP.
    text = fabric(mesh, ingress, "plan", "--window", "60", "--time-limit", "3")
    assert text.returncode == 0, text.stderr
    assert "llama-2-7b" in text.stdout and "memP" in text.stdout


def test_nodes_refuse_what_they_cannot_or_must_not_do(mesh: LocalMesh, tmp_path: Path) -> None:
    key = operator(mesh)
    ingress = mesh.start("ingress", args=["--trust-operator", key.fingerprint])
    bare = gpu_node(mesh, "bare", "H100:1", key)  # trusts the operator, has no template
    bare.wait_ready()
    client = AdminClient(ingress.http_url)
    assert wait_until(lambda: len(client.nodes(state="join")) == 2, 15)
    workload = tmp_path / "workload.toml"
    workload.write_text(
        WORKLOAD.split("[[model]]")[0] + "[[model]]" + WORKLOAD.split("[[model]]")[1]
    )

    done = fabric(mesh, ingress, "plan", "--workload", str(workload), "--apply", "--json",
                  "--wait", "20", "--time-limit", "3")  # fmt: skip
    assert done.returncode == 1
    status = json.loads(done.stdout)["apply"]["status"]
    assert status == {bare.session_id: "refused: no engine template"}

    # Another operator's key: the agent refuses it and the CLI says how to trust it.
    OperatorKey.generate().save(tmp_path / "other.key")
    done = fabric(mesh, ingress, "plan", "--workload", str(workload), "--apply",
                  "--operator-key", str(tmp_path / "other.key"), "--wait", "1")  # fmt: skip
    assert done.returncode == 1
    assert "refused it (untrusted)" in done.stdout and "--trust-operator" in done.stdout

    # No operator key at all: one line, before any solving.
    (mesh.workdir / "operator.key").unlink()
    done = fabric(mesh, ingress, "plan", "--workload", str(workload), "--apply")
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "fabric keys new-operator" in done.stderr


def test_admin_api_refuses_malformed_assignment_posts(mesh: LocalMesh) -> None:
    import httpx

    agent = mesh.start("one")
    url = f"{agent.http_url}/fabric/v1/assignments"
    for body, status in [
        (b"not json", 400),
        (b'{"assignments": []}', 400),
        (b'{"assignments": [{"signed": "AAAA", "signature": "AAAA"}]}', 400),
        (b"x" * (2 * 1024 * 1024), 413),
    ]:
        r = httpx.post(url, content=body, timeout=10)
        assert r.status_code == status, (body[:40], r.text)
        assert "error" in r.json()
    r = httpx.put(url, content=b"{}", timeout=10)
    assert r.status_code == 405 and "use GET or POST" in r.json()["error"]["message"]
    assert agent.running


def test_node_plan_json_shape_is_stable() -> None:
    assert set(NodePlan((), {}, (), ()).to_json()) == {
        "assignments",
        "already_serving",
        "unplaced",
        "idle_nodes",
    }


def test_the_controller_reads_what_a_real_agents_request_log_gained(mesh: LocalMesh) -> None:
    """``workload?after=``: a cursor at the end, then only the requests logged since, with
    their tokens and the streams' first tokens, as the elastic controller's poller reads it."""
    ingress = mesh.start("ingress")
    mesh.start("serving", args=["--sim", "llama-2-7b", "--sim-gpu", "A100-80G:1"])
    client = AdminClient(ingress.http_url)
    assert wait_until(lambda: len(client.nodes(state="serving")) == 1, 20)
    api = openai.OpenAI(base_url=f"{ingress.http_url}/v1", api_key="none", max_retries=0)
    api.completions.create(model="llama-2-7b", prompt="x " * 100, max_tokens=4)
    assert wait_until(lambda: logged(ingress, 60) == 1, 10)  # the log is flushed every second
    cursor, before = AgentClient().after(ingress.http_url, "end")
    assert before == {}  # what was logged before the first ask does not count
    for _ in range(3):
        stream = api.completions.create(
            model="llama-2-7b",
            prompt="x " * 300,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert len(list(stream)) > 1
    assert wait_until(lambda: logged(ingress, 60) == 4, 10)
    cursor, gained = AgentClient().after(ingress.http_url, cursor)
    sums = gained["llama-2-7b"]
    assert sums.requests == 3 and sums.output_tokens == 3 * 8
    assert sums.prompt_known == 3 and sums.prompt_tokens >= 3 * 300
    assert sum(sums.ttft.values()) == 3
    assert AgentClient().after(ingress.http_url, cursor) == (cursor, {})
