"""An agent reads its engine's KV-cache events (issue 42, item 1) on real processes: ``fabric
start --sim`` turns the simulated engine's events on with a localhost port the agent binds,
and the agent's block index follows the engine's prefix cache (``/metrics``); a killed engine
that the agent restarts starts an empty index; ``--no-kv-events`` adds nothing."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from tests.support.meshload import engine_process, serving_count, sim_engine_args

pytestmark = pytest.mark.slow

MODEL = "sim-kv"
SHARED = "rules: answer briefly and cite your sources. " * 20  # ~900 characters


def metric(agent: AgentProcess, name: str, labels: str = "") -> float | None:
    page = httpx.get(f"{agent.http_url}/metrics", timeout=5).text
    found = re.search(rf"^{re.escape(name + labels)} (\S+)$", page, re.M)
    return float(found.group(1)) if found else None


def blocks_after_asking(agent: AgentProcess, prompt: str) -> bool:
    """Ask once; whether the agent's index holds blocks now (the engine's publisher connects
    as it starts, so its first events may be sent before the connection is up)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    done = httpx.post(f"{agent.http_url}/v1/completions", json=body, timeout=30)
    assert done.status_code == 200, done.text
    return (metric(agent, "fabric_engine_kv_blocks") or 0) > 0


def test_the_agent_holds_its_engines_cached_blocks_and_starts_over_with_a_new_engine(
    mesh: LocalMesh,
) -> None:
    node = mesh.start("kv", args=["--restart", "on-failure", *sim_engine_args(MODEL, "H100")])
    assert wait_until(lambda: serving_count(node, MODEL) == 1, 30)
    assert wait_until(lambda: blocks_after_asking(node, SHARED), 15)
    blocks = metric(node, "fabric_engine_kv_blocks")
    assert blocks is not None and blocks >= 10  # the prompt's whole 16-token blocks
    applied = metric(node, "fabric_engine_kv_event_messages_total", '{outcome="applied"}')
    assert applied is not None and applied >= 1
    malformed = metric(node, "fabric_engine_kv_event_messages_total", '{outcome="malformed"}')
    assert not malformed
    engine = engine_process(node)
    assert engine is not None
    os.kill(engine.pid, signal.SIGKILL)  # the agent restarts it: what it cached is gone
    assert wait_until(lambda: metric(node, "fabric_engine_kv_blocks") == 0.0, 30)
    assert wait_until(lambda: serving_count(node, MODEL) == 1, 30)
    assert wait_until(lambda: blocks_after_asking(node, "another prompt entirely " * 40), 15)
    off = mesh.start("off", args=["--no-kv-events", *sim_engine_args(MODEL, "A100-80G")])
    assert wait_until(lambda: serving_count(off, MODEL) == 2, 30)  # its engine serves too
    assert metric(off, "fabric_engine_kv_blocks") is None
