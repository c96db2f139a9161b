"""Real agents of several sites on the emulated sites (``tests.support.sites``): one mesh and
cluster key per site, gateways joined over the emulated WAN, clients run inside a node's
namespace. Used by tests/sites/test_federation_wan.py and bench/federation_wan.py."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cli.localmesh import AgentProcess, LocalMesh
from fabricnode.federation.sitekey import SiteKey
from tests.support.sites import Sites

FED_PORT = 7950


@dataclass
class Federation:
    """The agents of every site (by node name), their meshes, the site keys; API keys, when a
    test turns them on at an ingress (``ops``, an admin key, reads the agents' views)."""

    sites: Sites
    root: Path
    keys: dict[str, SiteKey]
    meshes: dict[str, LocalMesh] = field(default_factory=dict)
    agents: dict[str, AgentProcess] = field(default_factory=dict)
    api_keys: dict[str, str] = field(default_factory=dict)

    def start(self, node: str, *args: str) -> AgentProcess:
        n = self.sites.node(node)
        agent = self.meshes[n.site].start(
            node,
            wait=False,
            host=n.address,
            prefix=["ip", "netns", "exec", n.netns],
            args=["--site", n.site, *args],
        )
        self.agents[node] = agent
        return agent

    def gateway(self, node: str, *args: str) -> AgentProcess:
        """Start ``node`` as its site's gateway, pinning every other site of ``keys`` and
        dialing each one's first gateway."""
        n = self.sites.node(node)
        assert n.wan_address is not None
        peers = self.root / f"peers-{n.site}"
        if not peers.exists():
            peers.mkdir()
            for site, key in self.keys.items():
                if site != n.site:
                    (peers / f"{site}.pem").write_bytes(key.cert.pem)
        dial = [
            arg
            for other in self.keys
            if other != n.site
            for arg in ("--federation-peer", f"{other}={self.wan(other + '-gw0')}")
        ]
        return self.start(
            node,
            "--gateway", self.wan(node),
            "--site-key", str(self.keys[n.site].key_path),
            "--peer-sites", str(peers),
            *dial,
            *args,
        )  # fmt: skip

    def wan(self, node: str) -> str:
        return f"{self.sites.node(node).wan_address}:{FED_PORT}"

    def url(self, node: str) -> str:
        return self.agents[node].http_url

    def at(self, node: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` inside ``node``'s namespace: its sockets are that node's."""
        return self.sites.in_node(node, fn)

    def get(self, src: str, node: str, path: str) -> Any:
        """GET ``path`` of ``node``'s agent from inside ``src`` (as the ops key, if any)."""
        ops = self.api_keys.get("ops")
        headers = {"authorization": f"Bearer {ops}"} if ops else {}
        return self.at(
            src,
            lambda: httpx.get(f"{self.url(node)}{path}", headers=headers, timeout=10).json(),
        )

    def peer_sites(self, gateway: str) -> dict[str, dict[str, Any]]:
        doc = self.get(gateway, gateway, "/fabric/v1/sites")
        return {row["site"]: row for row in doc["sites"]}

    def metric(self, node: str, name: str, **labels: str) -> float:
        page = self.at(node, lambda: httpx.get(f"{self.url(node)}/metrics", timeout=10).text)
        selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
        found = re.search(rf"^{name}\{{{selector}\}} (\S+)$", page, re.M)
        return float(found.group(1)) if found else 0.0

    def close(self) -> None:
        for mesh in self.meshes.values():
            mesh.close()


def start_meshes(fed: Federation) -> None:
    """One ``LocalMesh`` (its own cluster key and rendezvous file) per site of the topology."""
    for site in fed.sites.topology.sites:
        fed.meshes[site.name] = LocalMesh(fed.root / f"site-{site.name}")


def official_answers(base: str, key: str, model: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """What the official clients get at ingress ``base`` for ``model``: the ``openai`` client's
    JSON answer (its text, and the site and node that served it) and stream, the ``anthropic``
    client's Messages answer, plain and streamed (a few tokens each)."""
    import anthropic
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=timeout_s)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "stream please"}],
            max_tokens=8,
            stream=True,
        )
    )
    aclient = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=timeout_s)
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]
    msg = aclient.messages.create(model=model, max_tokens=6, messages=messages)
    with aclient.messages.stream(model=model, max_tokens=6, messages=messages) as stream:
        streamed = "".join(stream.text_stream)
    block = msg.content[0]
    return {
        "json": raw.parse().choices[0].message.content,
        "site": raw.headers["x-fabric-site"],
        "node": raw.headers["x-fabric-node"],
        "stream": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        "messages": block.text if block.type == "text" else "",
        "messages_stream": streamed,
    }
