"""An ingress whose forward reaches another agent than the node it meant (the node left, a new
agent took its port before the registry said so) tries another node: the agent that refused
names itself (``X-Fabric-Node``), and a refusal by the node meant is the client's answer."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.system.dataplane.test_batch_gate import gate

pytestmark = pytest.mark.slow

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def post(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(url, json=BODY)


@pytest.mark.trio
async def test_a_forward_refused_by_another_agent_at_the_address_fails_over(
    tmp_path: Path,
) -> None:
    async with gate(tmp_path, nodes=2) as g:
        g.nodes[0].refusing_as = "f" * 32  # not node 0's session: another agent at its port
        answers = [await post(g.url) for _ in range(8)]
        assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
        assert g.nodes[0].received, "the ingress never tried the misdirected address"
        assert all(r.headers["x-fabric-node"] == g.sids[1] for r in answers)


@pytest.mark.trio
async def test_a_forward_refused_by_the_node_meant_is_the_clients_answer(tmp_path: Path) -> None:
    async with gate(tmp_path, nodes=1) as g:
        g.nodes[0].refusing_as = g.sids[0]  # the node itself refuses: no other node is tried
        r = await post(g.url)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forward_refused"
