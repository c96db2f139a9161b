"""Sites with real agents: three agents of two sites (one named by ``--site``, one by
``$FABRIC_SITE``, one by the Slurm cluster's name), seen through ``fabric nodes --site``,
``fabric models`` and the admin API of any agent, and named in the request log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from cli.main import app
from fabricnode.control.client import AdminClient
from fabricnode.errors import AgentApiError
from tests.support.meshview import ENTRY_KEYS

pytestmark = pytest.mark.slow

LLAMA = "llama-3-8b"
QWEN = "qwen2.5-7b"


@dataclass
class Sites:
    """``a`` serves llama at site A (``--site``); ``b`` llama at B (``FABRIC_SITE``); ``c``
    qwen at B (``SLURM_CLUSTER_NAME``). ``a`` keeps a request log."""

    a: AgentProcess
    b: AgentProcess
    c: AgentProcess
    request_log: Path

    def all(self) -> list[AgentProcess]:
        return [self.a, self.b, self.c]

    def names(self, nodes: list[dict[str, Any]]) -> list[str]:
        by_sid = {agent.session_id: agent.name for agent in self.all()}
        return sorted(by_sid[n["session_id"]] for n in nodes)


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sites]:
    local = LocalMesh(tmp_path_factory.mktemp("sites"), provider="lab")
    log_path = local.workdir / "a-requests.jsonl"
    try:
        mesh = Sites(
            local.start(
                "a",
                wait=False,
                args=[
                    *("--sim", LLAMA, "--sim-gpu", "H100:2", "--site", "A"),
                    *("--request-log", str(log_path)),
                ],
            ),
            local.start(
                "b",
                wait=False,
                args=["--sim", LLAMA, "--sim-gpu", "L40S"],
                env={"FABRIC_SITE": "B"},
            ),
            local.start(
                "c",
                wait=False,
                args=["--sim", QWEN, "--sim-gpu", "A100-80G"],
                env={"SLURM_CLUSTER_NAME": "B"},
            ),
            log_path,
        )
        for agent in mesh.all():
            agent.wait_ready(30.0)

        def settled() -> bool:
            try:
                with AdminClient(mesh.a.http_url, timeout_s=2.0) as client:
                    found = client.nodes()
            except AgentApiError:
                return False
            return len(found) == 3 and all(
                n["state"] == "serving" and n["liveness"] == "alive" for n in found
            )

        assert wait_until(settled, 40.0), "the 3 agents did not converge, all serving"
        yield mesh
    finally:
        local.close()
        for agent in local.agents:
            print(f"--- {agent.name} ---\n{agent.stderr_tail(10)}")


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for key in ("FABRIC_AGENT", "FABRIC_SITE", "SLURM_CLUSTER_NAME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("FABRIC_HOME", str(tmp_path / "home"))
    return CliRunner()


def fabric(runner: CliRunner, agent: AgentProcess, *args: str) -> Result:
    result = runner.invoke(app, ["--agent", agent.http_url, *args])
    assert result.exit_code == 0, result.output
    return result


def test_every_agent_shows_each_nodes_site(runner: CliRunner, sites: Sites) -> None:
    for watcher in sites.all():
        doc = json.loads(fabric(runner, watcher, "nodes", "--json").stdout)
        assert all(list(n) == ENTRY_KEYS for n in doc["nodes"])
        shown = {n["session_id"]: n["site"] for n in doc["nodes"]}
        assert shown == {sites.a.session_id: "A", sites.b.session_id: "B", sites.c.session_id: "B"}
        assert not any("fabric.site" in n["labels"] for n in doc["nodes"])
    for agent, site in ((sites.a, "A"), (sites.b, "B"), (sites.c, "B")):
        assert httpx.get(f"{agent.http_url}/fabric/v1/self").json()["site"] == site


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--site", "A"], ["a"]),
        (["--site", "B"], ["b", "c"]),
        (["--site", "B", "--model", LLAMA], ["b"]),
        (["--site", "a"], []),  # names are compared exactly
        (["--site", "default"], []),
    ],
)
def test_fabric_nodes_site_filters(
    runner: CliRunner, sites: Sites, args: list[str], expected: list[str]
) -> None:
    doc = json.loads(fabric(runner, sites.b, "nodes", *args, "--json").stdout)
    assert sites.names(doc["nodes"]) == expected
    lines = fabric(runner, sites.b, "nodes", *args).stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["SESSION", "SITE", "PROVIDER"]
    assert sorted(line.split()[1] for line in lines[1:-1]) == sorted(
        {"a": "A", "b": "B", "c": "B"}[name] for name in expected
    )
    assert lines[-1] == f"{len(expected)} node{'s' if len(expected) != 1 else ''}"


def test_the_admin_api_filters_by_site_and_refuses_a_name_no_site_has(sites: Sites) -> None:
    url = f"{sites.c.http_url}/fabric/v1/nodes"
    r = httpx.get(url, params={"site": "A"})
    assert r.status_code == 200
    assert [n["session_id"] for n in r.json()["nodes"]] == [sites.a.session_id]
    r = httpx.get(url, params={"site": "A B"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_parameter"


def test_a_bad_site_is_a_usage_error_for_fabric_nodes(runner: CliRunner, sites: Sites) -> None:
    result = runner.invoke(app, ["--agent", sites.a.http_url, "nodes", "--site", "a b"])
    assert result.exit_code == 2
    assert "--site" in result.stderr and "Traceback" not in result.stderr


def test_fabric_models_counts_nodes_per_site(runner: CliRunner, sites: Sites) -> None:
    doc = json.loads(fabric(runner, sites.a, "models", "--json").stdout)
    models = {m["id"]: m for m in doc["models"]}
    one = {"nodes": 1, "serving": 1, "asleep": 0}
    assert models[LLAMA]["nodes"] == 2
    assert models[LLAMA]["sites"] == [
        {"site": "A", **one, "gpus": 2},
        {"site": "B", **one, "gpus": 1},
    ]
    assert models[QWEN]["sites"] == [{"site": "B", **one, "gpus": 1}]
    lines = fabric(runner, sites.a, "models").stdout.strip().splitlines()
    header = lines[0].split()
    column = header.index("SITES")
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows[LLAMA][column] == "A:1,B:1"
    assert rows[QWEN][column] == "B:1"


def test_the_request_log_names_the_serving_nodes_site(sites: Sites) -> None:
    """Through ``a`` (site A) to the only qwen node, ``c`` at site B."""
    body = {"model": QWEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(f"{sites.a.http_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["x-fabric-node"] == sites.c.session_id

    def records() -> list[dict[str, Any]]:
        if not sites.request_log.exists():
            return []
        lines = sites.request_log.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    assert wait_until(lambda: any(r["M"] == QWEN for r in records()), 10.0)
    mine = next(r for r in records() if r["M"] == QWEN)
    assert (mine["node"], mine["site"], mine["status"]) == (sites.c.session_id, "B", 200)


@pytest.mark.parametrize(
    ("args", "env", "source"),
    [
        (["--site", "no spaces"], {}, "--site"),
        ([], {"FABRIC_SITE": "x" * 40}, "FABRIC_SITE"),
        ([], {"SLURM_CLUSTER_NAME": "a.b"}, "SLURM_CLUSTER_NAME"),
    ],
)
def test_an_agent_with_a_bad_site_does_not_start(
    runner: CliRunner,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    env: dict[str, str],
    source: str,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = runner.invoke(
        app, ["start", "--http", "127.0.0.1:0", "--gossip", "127.0.0.1:0", *args]
    )
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and source in lines[0] and "site" in lines[0]
