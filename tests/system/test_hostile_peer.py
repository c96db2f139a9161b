"""A cluster-key holder sends a real agent what no agent would: one sealed datagram each.

Each packet used to make the agent exit: a PingReq whose target host no lookup can encode
(``a..b``: ``UnicodeError``, not ``OSError``), an Alive that advertises such a gossip address,
and a SERVING entry whose HTTP address is ``http://a..b:80`` (the ingress exited when it routed
a request there). Now each is refused where it is decoded: counted as dropped, and the agent
serves on.
"""

from __future__ import annotations

import dataclasses
import socket
import time

import httpx
import pytest

from cli.localmesh import LocalMesh, wait_until
from fabricnode.addr import split_hostport
from fabricnode.mesh.identity import Identity
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.registry import Addresses, EngineInfo, ModelInfo, State
from fabricnode.mesh.wire import Alive, EntryMsg, Message, Packet, PingReq, encode_packet
from fabricnode.testing.simnet import make_body
from tests.support.meshview import metrics

pytestmark = pytest.mark.slow

BAD_HOST = "a..b"


def send_sealed(keyring: Keyring, gossip_addr: str, message: Message) -> None:
    sender = Identity.generate()
    packet = Packet(sender.session_id, 1, int(time.time() * 1000), (message,))
    host, port = split_hostport(gossip_addr)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(keyring.seal(encode_packet(packet)), (host, port))


def dropped(url: str) -> float:
    return metrics(url).get('fabric_gossip_dropped_total{reason="DecodeError"}', 0.0)


def serves_m1(url: str) -> bool:
    try:
        return any(m["id"] == "m1" for m in httpx.get(f"{url}/v1/models", timeout=2).json()["data"])
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def test_packets_naming_a_host_no_lookup_can_encode_are_dropped(mesh: LocalMesh) -> None:
    agent = mesh.start("target", args=["--sim", "m1", "--sim-gpu", "H100"])
    keyring = Keyring.load(mesh.key_path)
    url = agent.http_url
    assert wait_until(lambda: serves_m1(url), 20), "the agent never served m1"
    liar = Identity.generate()
    now = time.time()
    phantom = dataclasses.replace(
        make_body(liar, f"{BAD_HOST}:7946", now, 60.0),
        state=State.SERVING,
        addresses=Addresses(f"http://{BAD_HOST}:80", ""),
        engine=EngineInfo("vllm", "0", f"http://{BAD_HOST}:8000"),
        models=(ModelInfo("phantom", 512, None),),
    )
    hostile: list[Message] = [
        PingReq(1, agent.session_id, f"{BAD_HOST}:1"),
        Alive.make(liar, 1, f"{BAD_HOST}:7946"),
        EntryMsg(phantom.sign(liar)),
    ]
    before = dropped(url)
    for message in hostile:
        send_sealed(keyring, agent.gossip_addr, message)
    assert wait_until(lambda: dropped(url) >= before + len(hostile), 10), metrics(url)
    assert agent.running
    # The phantom entry never reached the registry: its model is unknown, and the agent
    # still routes its own.
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "phantom", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert r.status_code == 404, r.text
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert agent.running
