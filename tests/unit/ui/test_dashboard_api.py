"""The dashboard's files and the read-only APIs behind it, on the admin app in process."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from fabricnode import ui
from fabricnode.control.app import AdminApp
from fabricnode.control.loadhistory import LoadHistory
from fabricnode.control.meshstats import MeshStats
from fabricnode.control.peers import PeerClient
from fabricnode.control.redact import redact
from fabricnode.dataplane.recent import RecentStats
from fabricnode.mesh.registry import Addresses, State
from fabricnode.mesh.wire import DEAD, Accusation, Load
from tests.unit.control.test_app import NOW, Mesh, add_entry, build_mesh, client

STATIC = Path(ui.__file__).parent / "static"


class FakePeers:
    """What other agents answer ``scope=self``: canned rows by URL (None: no answer)."""

    def __init__(self, answers: dict[str, list[dict[str, Any]] | None]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, str]] = []  # (session id, url)

    async def ask(self, sid: str, url: str, window_s: float) -> Any:
        self.asked.append((sid, url))
        return self.answers.get(url)


def make_app(mesh: Mesh, ring: RecentStats, peers: FakePeers | None = None) -> AdminApp:
    fake = peers or FakePeers({})
    own = mesh.core.self_entry.session_id
    client = PeerClient(mesh.core.keyring, own, wall_clock=lambda: NOW + 30)
    stats = MeshStats(mesh.core, ring.export, lambda: NOW + 30, client, ask=fake.ask)
    history = LoadHistory()
    history.sample(mesh.core)
    return AdminApp(mesh.core, wall_clock=lambda: NOW + 30, stats=stats, load_history=history)


@pytest.fixture
def mesh() -> Mesh:
    return build_mesh()


async def get(app: AdminApp, path: str, **headers: str) -> httpx.Response:
    async with client(app) as c:
        return await c.get(path, headers=headers)


# -- the files ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/ui", "text/html; charset=utf-8"),
        ("/ui/", "text/html; charset=utf-8"),
        ("/ui/app.js", "text/javascript; charset=utf-8"),
        ("/ui/app.css", "text/css; charset=utf-8"),
        ("/ui/vendor/uplot/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
        ("/ui/vendor/uplot/uPlot.min.css", "text/css; charset=utf-8"),
        ("/ui/vendor/uplot/LICENSE", "text/plain; charset=utf-8"),
    ],
)
async def test_every_file_is_served_with_a_strict_policy(
    mesh: Mesh, path: str, content_type: str
) -> None:
    r = await get(make_app(mesh, RecentStats()), path)
    assert r.status_code == 200
    assert r.headers["content-type"] == content_type
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["etag"]


async def test_an_unchanged_file_is_not_sent_again(mesh: Mesh) -> None:
    app = make_app(mesh, RecentStats())
    first = await get(app, "/ui/app.js")
    again = await get(app, "/ui/app.js", **{"if-none-match": first.headers["etag"]})
    assert again.status_code == 304 and again.content == b""


@pytest.mark.parametrize(
    "path",
    [
        "/ui/nope.js",
        "/ui/../pyproject.toml",
        "/ui/%2e%2e/__init__.py",
        "/ui/vendor",
        "/ui//etc/passwd",
        "/ui/__init__.py",
        "/uix",
    ],
)
async def test_nothing_but_the_shipped_files_is_served(mesh: Mesh, path: str) -> None:
    r = await get(make_app(mesh, RecentStats()), path)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


async def test_the_root_sends_a_browser_to_the_dashboard(mesh: Mesh) -> None:
    app = make_app(mesh, RecentStats())
    r = await get(app, "/", accept="text/html,application/xhtml+xml")
    assert r.status_code == 302 and r.headers["location"] == "/ui"
    assert (await get(app, "/", accept="application/json")).status_code == 404


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.inline_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_data(self, data: str) -> None:
        if getattr(self, "_in_script", False) and data.strip():
            self.inline_script = True

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False


def test_the_page_has_no_inline_code_and_loads_only_its_own_files() -> None:
    page = Tags()
    page.feed((STATIC / "index.html").read_text())
    assert not page.inline_script
    for tag, attrs in page.tags:
        assert tag != "style", "inline <style> would need 'unsafe-inline'"
        assert "style" not in attrs, f"<{tag} style=...> would need 'unsafe-inline'"
        assert not [a for a in attrs if a.startswith("on")], f"inline handler on <{tag}>"
        for attr in ("src", "href"):
            url = attrs.get(attr)
            if url and tag in ("script", "link") and attrs.get("rel") != "icon":
                assert url.startswith("/ui/"), url
    assert ui.names()  # every file referenced is shipped
    for tag, attrs in page.tags:
        url = attrs.get("src") or (attrs.get("href") if tag == "link" else None)
        if url and url.startswith("/ui/"):
            assert ui.asset(url.removeprefix("/ui/")) is not None, url


def test_the_script_builds_the_page_without_parsing_html_or_evaluating_strings() -> None:
    # Everything on the page comes from peers' entries or an engine's answer: it must only
    # ever become text. (Checked on the source, since the rule is about what the code may do.)
    source = (STATIC / "app.js").read_text()
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
    ):
        assert sink not in source, sink


def test_the_vendored_library_records_its_version_and_licence() -> None:
    record = json.loads((STATIC / "vendor" / "uplot" / "VENDORED.json").read_text())
    assert record["package"] == "uplot" and record["license"] == "MIT"
    assert re.fullmatch(r"\d+\.\d+\.\d+", record["version"])
    for name in record["files"]:
        assert (STATIC / "vendor" / "uplot" / name).stat().st_size > 0
    assert "Permission is hereby granted" in (STATIC / "vendor" / "uplot" / "LICENSE").read_text()


async def test_the_admin_port_says_no_key_is_needed(mesh: Mesh) -> None:
    r = await get(make_app(mesh, RecentStats()), "/ui/session")
    assert r.json() == {"keys_required": False, "key": None, "admin": True}


# -- the APIs behind the views --------------------------------------------------------------------


def ring_with(model: str, n: int) -> RecentStats:
    ring = RecentStats()
    for k in range(n):
        ring.add(NOW - 20 + k * 0.1, model, 200, 0.5, 0.1, 10, 4, batch=False)
    return ring


async def test_stats_of_this_agent_are_its_own_rows(mesh: Mesh) -> None:
    r = await get(make_app(mesh, ring_with("llama-3-8b", 5)), "/fabric/v1/stats?scope=self")
    doc = r.json()
    assert doc["scope"] == "self" and doc["bucket_s"] == 10
    assert sum(row["requests"] for row in doc["rows"]) == 5


async def test_stats_of_the_mesh_add_up_every_agent_that_answers(mesh: Mesh) -> None:
    for index, name in ((11, "peer-up"), (12, "peer-silent"), (13, "peer-dead"), (14, "peer-left")):
        add_entry(
            mesh,
            name,
            index,
            state=State.LEFT if name == "peer-left" else State.SERVING,
            addresses=Addresses(http=f"http://10.0.0.{index}:8080", gossip=f"10.0.0.{index}:7946"),
        )
    accuser = mesh.ids["serving-a100"]
    dead = Accusation.make(accuser, DEAD, mesh.sid("peer-dead"), 0)
    mesh.core.members.apply_accusation(dead, NOW)
    other = ring_with("llama-3-8b", 7).export(NOW + 30, 600)
    peers = FakePeers({"http://10.0.0.11:8080": other, "http://10.0.0.12:8080": None})
    app = make_app(mesh, ring_with("llama-3-8b", 5), peers)
    async with client(app) as c:
        r = await c.get("/fabric/v1/stats", headers={"authorization": "Bearer sk-admin"})
    doc = r.json()
    assert doc["scope"] == "mesh"
    # Asked: the live peers with an address (not the dead one, not the one that left).
    assert sorted(peers.asked) == sorted(
        [
            (mesh.sid("peer-up"), "http://10.0.0.11:8080"),
            (mesh.sid("peer-silent"), "http://10.0.0.12:8080"),
        ]
    )  # by session id: each request is signed for the agent it goes to, the page's key stays
    assert doc["agents"] == {"asked": 3, "answered": 2}
    summary = doc["models"]["llama-3-8b"]["summary"]
    assert summary["requests_per_s"] == pytest.approx(12 / 60)


@pytest.mark.parametrize(
    "query", ["window=abc", "window=-5", "window=nan", "scope=everything", "foo=1"]
)
async def test_bad_stats_queries_are_refused(mesh: Mesh, query: str) -> None:
    r = await get(make_app(mesh, RecentStats()), f"/fabric/v1/stats?{query}")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_parameter"


async def test_a_node_s_recent_load(mesh: Mesh) -> None:
    sid = mesh.sid("serving-a100")
    app = make_app(mesh, RecentStats())
    assert app.load_history is not None
    mesh.core.loads[sid] = Load(sid, 2, 0, 9, 0.75, 9, NOW + 5)
    app.load_history.sample(mesh.core)
    app.load_history.sample(mesh.core)  # the same report again: kept once
    r = await get(app, f"/fabric/v1/nodes/{sid[:10]}/load")
    doc = r.json()
    assert doc["session_id"] == sid
    assert [s["kv_usage"] for s in doc["samples"]] == [0.5, 0.75]
    assert (await get(app, "/fabric/v1/nodes/ffffffff/load")).status_code == 404


async def test_the_fleet_view_answers_without_a_controller(mesh: Mesh) -> None:
    r = await get(make_app(mesh, RecentStats()), "/fabric/v1/fleet")
    assert r.status_code == 200
    assert r.json() == {"services": None, "acting": None, "controller": None}


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["vllm", "serve", "m", "--api-key", "s3cret"], ["vllm", "serve", "m", "--api-key", "***"]),
        (["vllm", "serve", "--hf-token=abc", "m"], ["vllm", "serve", "--hf-token=***", "m"]),
        (["env", "HF_TOKEN=abc", "vllm"], ["env", "HF_TOKEN=***", "vllm"]),
        (["vllm", "serve", "m", "--port", "8000"], ["vllm", "serve", "m", "--port", "8000"]),
        # vLLM's --api-key takes several keys (nargs="+"): every one up to the next option.
        (
            ["vllm", "serve", "m", "--api-key", "K1", "K2", "--port", "8000"],
            ["vllm", "serve", "m", "--api-key", "***", "***", "--port", "8000"],
        ),
        (["sglang", "--api_key", "-1"], ["sglang", "--api_key", "***"]),  # a value, not a flag
        # Secrets inside JSON options, at any depth, and in URLs anywhere.
        (
            [
                "--kv-transfer-config",
                '{"kv_connector": "C", "extra": {"apiKey": "s", "url": "https://u:p@h:1/x"}}',
            ],
            [
                "--kv-transfer-config",
                '{"kv_connector":"C","extra":{"apiKey":"***","url":"https://***@h:1/x"}}',
            ],
        ),
        (["--model", "https://tok@hub.example/m"], ["--model", "https://***@hub.example/m"]),
        (
            ["--hf-overrides", "{'api_key': 'abc', 'x': 1}"],
            ["--hf-overrides", "{'api_key': '***', 'x': 1}"],
        ),
        (
            ["env", "AWS_SECRET_ACCESS_KEY=abc", "HF_TOKEN=x", "vllm"],
            ["env", "AWS_SECRET_ACCESS_KEY=***", "HF_TOKEN=***", "vllm"],
        ),
        # Names that only contain a secret-looking string are not secret: their values show.
        (
            ["--max-num-batched-tokens", "8192", "--tokenizer", "t", "--tokenizer-mode", "auto"],
            ["--max-num-batched-tokens", "8192", "--tokenizer", "t", "--tokenizer-mode", "auto"],
        ),
    ],
)
def test_secret_looking_values_of_an_engine_command_are_hidden(
    argv: list[str], shown: list[str]
) -> None:
    assert redact(argv) == shown


async def test_an_agent_tells_its_own_engine_command(mesh: Mesh) -> None:
    app = make_app(mesh, RecentStats())
    app.engine_command = lambda: ("vllm", "serve", "m", "--api-key", "x")
    me = mesh.core.self_entry.session_id
    doc = (await get(app, f"/fabric/v1/nodes/{me}/engine")).json()
    assert doc == {
        "session_id": me,
        "command": ["vllm", "serve", "m", "--api-key", "***"],
        "reason": None,
    }
    own = (await get(app, "/fabric/v1/self/engine")).json()
    assert own["command"] == doc["command"]


async def test_another_node_s_command_it_cannot_ask_is_null_with_the_reason(mesh: Mesh) -> None:
    # The test mesh's entries have no HTTP address: nothing to ask, and still a 200.
    r = await get(
        make_app(mesh, RecentStats()), f"/fabric/v1/nodes/{mesh.sid('serving-a100')}/engine"
    )
    assert r.status_code == 200
    assert r.json()["command"] is None and "no HTTP address" in r.json()["reason"]
