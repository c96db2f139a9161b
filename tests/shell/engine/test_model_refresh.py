"""The engine's model list re-read while it serves, in process under trio's MockClock against
a fake engine behind httpx's MockTransport: adapters loaded and unloaded at runtime reach the
entry at the next read, an unchanged list re-signs nothing, a list that cannot be read keeps
the last good one, and a list past the registry's limits is cut with its reasons counted."""

from __future__ import annotations

import time
from typing import Any

import httpx
import trio
import trio.testing

from fabricnode.engine.command import inspect_engine_cmd
from fabricnode.engine.models import MAX_LISTING_BYTES, Listing, ServedModel
from fabricnode.engine.service import EngineService
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.registry import MAX_MODELS, State
from fabricnode.mesh.schema import PARENTS_LABEL, SLEEPING_LABEL
from fabricnode.mesh.service import GossipService
from fabricnode.testing.simnet import make_body
from tests.support.notransport import NoTransport

BASE = {"id": "base", "object": "model", "max_model_len": 512, "parent": None}


class FakeEngine:
    """``GET /v1/models`` as vLLM answers it with ``--enable-lora``, or broken in ``mode``."""

    def __init__(self) -> None:
        self.data: list[Any] = [BASE]
        self.mode = "ok"  # ok | 500 | not-json | empty | huge | down
        self.reads = 0

    def load(self, name: str) -> None:
        self.data.append({"id": name, "object": "model", "parent": "base", "max_model_len": None})

    def unload(self, name: str) -> None:
        self.data = [m for m in self.data if m["id"] != name]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        self.reads += 1
        if self.mode == "500":
            return httpx.Response(500, json={"error": "engine busy"})
        if self.mode == "not-json":
            return httpx.Response(200, content=b"<html>")
        if self.mode == "empty":
            return httpx.Response(200, json={"object": "list", "data": []})
        if self.mode == "huge":
            return httpx.Response(200, content=b"[" * (MAX_LISTING_BYTES + 1))
        if self.mode == "down":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"object": "list", "data": self.data})


def serving_service() -> EngineService:
    me = Identity.from_seed(b"lora-refresh")
    now = time.time()
    core = MeshCore(
        me, Keyring.with_key(b"k" * 32), make_body(me, NoTransport.local_addr, now), now
    )
    g = GossipService(core, NoTransport())
    command = inspect_engine_cmd(["vllm", "serve", "/m/base", "--port", "8000"])
    service = EngineService(command, g, models_interval_s=2.0)
    first = service._models_changes(Listing((ServedModel("base", 512),), 0))
    g.update_self(state=State.SERVING, **first)
    service.state = "serving"
    return service


def models(service: EngineService) -> list[str]:
    return [m.id for m in service.gossip.core.self_entry.body.models]


def labels(service: EngineService) -> dict[str, str]:
    return dict(service.gossip.core.self_entry.body.labels)


async def test_adapters_loaded_and_unloaded_at_runtime_reach_the_entry_at_the_next_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine, service = FakeEngine(), serving_service()
    core = service.gossip.core
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(service._refresh_models, client)
        await trio.sleep(5)
        version = core.self_entry.body.version
        assert models(service) == ["base"] and PARENTS_LABEL not in labels(service)
        await trio.sleep(10)
        assert core.self_entry.body.version == version  # read five times, nothing re-signed
        assert engine.reads == 7

        engine.load("lora-a")
        engine.load("lora-b")
        service.gossip.relabel(SLEEPING_LABEL, ((SLEEPING_LABEL, "1"),))  # set meanwhile
        await trio.sleep(2)
        assert models(service) == ["base", "lora-a", "lora-b"]
        assert labels(service)[PARENTS_LABEL] == ",0,0"
        assert labels(service)[SLEEPING_LABEL] == "1"  # other labels kept

        engine.unload("lora-a")
        await trio.sleep(2)
        assert models(service) == ["base", "lora-b"] and labels(service)[PARENTS_LABEL] == ",0"
        engine.unload("lora-b")
        await trio.sleep(2)
        assert models(service) == ["base"] and PARENTS_LABEL not in labels(service)
        stats = service.statistics()
        assert stats.model_reads == engine.reads and stats.model_read_errors == 0
        assert stats.models_dropped == {}
        nursery.cancel_scope.cancel()


async def test_a_list_that_cannot_be_read_keeps_the_last_good_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine, service = FakeEngine(), serving_service()
    engine.load("lora-a")
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(service._refresh_models, client)
        await trio.sleep(3)
        assert models(service) == ["base", "lora-a"]
        version = service.gossip.core.self_entry.body.version
        for mode in ("500", "not-json", "empty", "huge", "down"):
            engine.mode = mode
            await trio.sleep(2)
            assert models(service) == ["base", "lora-a"], mode
        assert service.gossip.core.self_entry.body.version == version
        assert service.statistics().model_read_errors == 5
        engine.mode = "ok"
        engine.unload("lora-a")
        await trio.sleep(2)
        assert models(service) == ["base"]
        nursery.cancel_scope.cancel()


async def test_a_list_past_the_registry_limits_is_cut_and_the_reasons_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine, service = FakeEngine(), serving_service()
    for i in range(MAX_MODELS + 3):
        engine.load(f"lora-{i:02d}")
    engine.data += [{"id": "x" * 300}, {"id": 7}, BASE]
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(service._refresh_models, client)
        await trio.sleep(3)
        got = models(service)
        assert len(got) == MAX_MODELS and got[0] == "base"
        assert service.statistics().models_dropped == {
            "too_many": 4,
            "name_too_long": 1,
            "malformed": 1,
            "duplicate": 1,
        }
        assert service.gossip.core.self_entry.body.state == State.SERVING
        nursery.cancel_scope.cancel()
