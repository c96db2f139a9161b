"""Scale from zero at the ingress, with real agents: a request for a model the service file
declares but no node serves waits while a replica starts (here a simulated one started by the
test where the controller would submit a job), and is answered once it serves, JSON and
streamed through the official `openai` client with default settings. While it waits the
ingress labels its entry `fabric.wanted=<model>=<held>` (what the acting controller acts on), the
stream gets SSE comments, `/v1/models` lists the model as scaled to zero; past the hold time the
answer is 503 with Retry-After (a stream: the error event). An undeclared model is still 404."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.control.client import AdminClient
from fabricnode.mesh.identity import OperatorKey
from tests.support.meshview import fabric

pytestmark = pytest.mark.slow

SERVICE = """
[limits]
max_jobs = 4
max_gpus = 4

[[model]]
name = "cold"
engine = "sim"
min_replicas = 0
max_replicas = 1
hold_requests = "{hold}"
"""
MESSAGES = [{"role": "user", "content": "hello from zero"}]


def apply(mesh: LocalMesh, agent: AgentProcess, text: str, tmp_path: Path) -> None:
    path = tmp_path / "services.toml"
    path.write_text(text)
    done = fabric(mesh, agent, "services", "apply", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


def wanted(agent: AgentProcess) -> str:
    with AdminClient(agent.http_url) as client:
        return str((client.self_entry().get("labels") or {}).get("fabric.wanted", ""))


@pytest.fixture
def cold_mesh(mesh: LocalMesh, tmp_path: Path) -> tuple[LocalMesh, AgentProcess]:
    key = OperatorKey.generate()
    key.save(mesh.workdir / "operator.key")
    ingress = mesh.start("ingress", args=["--trust-operator", key.fingerprint])
    apply(mesh, ingress, SERVICE.format(hold="60s"), tmp_path)
    assert wait_until(lambda: b'"cold"' in httpx.get(ingress.http_url + "/v1/models").content, 10)
    return mesh, ingress


def test_requests_wait_for_a_replica_and_are_answered_json_and_streamed(
    cold_mesh: tuple[LocalMesh, AgentProcess],
) -> None:
    mesh, ingress = cold_mesh
    listed = httpx.get(ingress.http_url + "/v1/models").json()["data"]
    (cold,) = [m for m in listed if m["id"] == "cold"]
    assert cold["fabric_scaled_to_zero"] is True and cold["fabric_nodes"] == 0
    client = openai.OpenAI(base_url=ingress.http_url + "/v1", api_key="unused")  # defaults
    results: dict[str, Any] = {}

    def ask_json() -> None:
        r = client.chat.completions.create(model="cold", messages=MESSAGES, max_tokens=8)
        results["json"] = r

    def ask_stream() -> None:
        with httpx.stream(
            "POST", ingress.http_url + "/v1/chat/completions", timeout=120,
            json={"model": "cold", "messages": MESSAGES, "max_tokens": 8, "stream": True},
        ) as r:  # fmt: skip
            results["stream_status"] = r.status_code
            results["stream_lines"] = [line for line in r.iter_lines() if line]

    def ask_openai_stream() -> None:
        chunks = client.chat.completions.create(
            model="cold", messages=MESSAGES, max_tokens=8, stream=True
        )
        results["openai_stream"] = [c for c in chunks]

    threads = [threading.Thread(target=f) for f in (ask_json, ask_stream, ask_openai_stream)]
    for t in threads:
        t.start()
    # what the controller acts on: the model and the requests held for it
    assert wait_until(lambda: wanted(ingress) == "cold=3", 10)
    time.sleep(11)  # long enough for an SSE comment (every 10 s)
    started = time.monotonic()
    mesh.start("replica", args=["--sim", "cold", "--sim-gpu", "H100"])
    for t in threads:
        t.join(60)
    print(f"answered {time.monotonic() - started:.1f} s after the replica was started")
    assert results["json"].choices[0].message.content
    assert results["stream_status"] == 200
    lines = results["stream_lines"]
    assert lines[0].startswith(": waiting for a replica of cold")
    assert lines[-1] == "data: [DONE]"
    assert any(line.startswith("data: {") for line in lines)
    chunks = results["openai_stream"]
    assert chunks and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert wait_until(lambda: wanted(ingress) == "", 10)


def test_past_the_hold_time_the_answer_is_503_and_undeclared_models_are_404(
    cold_mesh: tuple[LocalMesh, AgentProcess], tmp_path: Path
) -> None:
    mesh, ingress = cold_mesh
    apply(mesh, ingress, SERVICE.format(hold="2s"), tmp_path)
    time.sleep(1)
    r = httpx.post(
        ingress.http_url + "/v1/chat/completions",
        json={"model": "cold", "messages": MESSAGES, "max_tokens": 4}, timeout=30,
    )  # fmt: skip
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "replica_starting"
    assert "is starting" in r.json()["error"]["message"]
    with httpx.stream(
        "POST", ingress.http_url + "/v1/chat/completions", timeout=30,
        json={"model": "cold", "messages": MESSAGES, "max_tokens": 4, "stream": True},
    ) as s:  # fmt: skip
        lines = [line for line in s.iter_lines() if line]
    assert s.status_code == 200 and "replica_starting" in lines[-1]
    r = httpx.post(
        ingress.http_url + "/v1/chat/completions",
        json={"model": "nobody", "messages": MESSAGES}, timeout=10,
    )  # fmt: skip
    assert r.status_code == 404
    assert wanted(ingress) == ""
