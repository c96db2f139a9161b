"""The dashboard in a real headless browser (Debian's Chromium, through Selenium) against a live
local mesh of agents with simulated engines at two sites: every view shows what the mesh holds,
nodes are shown by site, a node killed with SIGKILL turns dead on the page, the playground
streams an answer, nothing logs an error.

Screenshots of each view go to ``$FABRIC_SCREENSHOTS`` (``make screenshots`` sets it to
docs/screenshots, where the current ones are committed), else to the test's temporary folder.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from tests.support.browser import console_errors, screenshot

pytestmark = pytest.mark.slow

LLAMA = "llama-3-8b"
QWEN = "qwen2.5-7b"
# SWIM's detection here: probes every 0.4 s, then suspicion; the page polls every 2 s.
DEAD_ON_PAGE_S = 20.0


def shots_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chosen = os.environ.get("FABRIC_SCREENSHOTS")
    return Path(chosen) if chosen else tmp_path_factory.mktemp("screenshots")


class Mesh:
    def __init__(self, local: LocalMesh, shots: Path) -> None:
        self.local = local
        self.shots = shots
        self.page = local.start("page", wait=False, args=["--sim", LLAMA, "--sim-gpu", "H100:2"])
        self.twin = local.start("twin", wait=False, args=["--sim", LLAMA, "--sim-gpu", "L40S"])
        self.other = local.start(
            "other", wait=False, args=["--sim", QWEN, "--sim-gpu", "A100-80G", "--site", "B"]
        )
        for agent in self.agents:
            agent.wait_ready(30.0)

    @property
    def agents(self) -> list[AgentProcess]:
        return [self.page, self.twin, self.other]

    @property
    def url(self) -> str:
        return self.page.http_url

    def nodes(self) -> list[dict[str, Any]]:
        try:
            r = httpx.get(f"{self.url}/fabric/v1/nodes", timeout=2.0)
        except httpx.HTTPError:
            return []
        return list(r.json()["nodes"]) if r.status_code == 200 else []


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    local = LocalMesh(tmp_path_factory.mktemp("ui-mesh"), provider="lab")
    try:
        m = Mesh(local, shots_dir(tmp_path_factory))

        def settled() -> bool:
            found = m.nodes()
            return len(found) == 3 and all(
                n["state"] == "serving" and n["liveness"] == "alive" and n["load"] for n in found
            )

        assert wait_until(settled, 40.0), "the 3 agents did not converge, all serving"
        yield m
    finally:
        local.close()


@pytest.fixture
def page(chromium: Any, mesh: Mesh) -> Iterator[Any]:
    """The browser, its console drained before the test and checked after it."""
    console_errors(chromium)
    yield chromium
    assert console_errors(chromium) == []


def wait_for(driver: Any, predicate: Any, timeout_s: float, what: str) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(predicate, what)


ROWS_JS = """
const out = {};
for (const row of document.querySelectorAll('#mesh-groups tr[data-session]')) {
  out[row.dataset.session] = {
    state: row.querySelector('.state').textContent,
    liveness: row.querySelector('.live').textContent,
  };
}
return out;
"""


def texts(driver: Any, css: str) -> list[str]:
    """The text of every element ``css`` selects, read in one script: the page rebuilds its
    tables and figures on every poll, so an element found in one call may be gone (stale) by
    the next."""
    found = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((e) => e.textContent)", css
    )
    return [str(t) for t in found]


def rows(driver: Any) -> dict[str, dict[str, str]]:
    """The mesh table's rows by session id: state and liveness as the page writes them (read in
    one script, as the page redraws the table on every poll)."""
    return dict(driver.execute_script(ROWS_JS))


def test_the_mesh_view_lists_every_node(page: Any, mesh: Mesh) -> None:
    page.get(f"{mesh.url}/ui")
    sessions = {a.session_id for a in mesh.agents}
    wait_for(page, lambda d: set(rows(d)) == sessions, 15, "every node listed")
    shown = rows(page)
    assert all(r == {"state": "serving", "liveness": "alive"} for r in shown.values())
    groups = {
        g.get_attribute("data-group"): len(g.find_elements("css selector", "tr[data-session]"))
        for g in page.find_elements("css selector", "#mesh-groups .group")
    }
    assert groups == {LLAMA: 2, QWEN: 1}  # grouped by model
    assert "3 nodes: 3 serving" in page.find_element("id", "mesh-summary").text
    screenshot(page, mesh.shots / "mesh.png")


def test_the_filters_narrow_the_list_like_the_cli(page: Any, mesh: Mesh) -> None:
    page.get(f"{mesh.url}/ui#/mesh")
    wait_for(page, lambda d: len(rows(d)) == 3, 15, "every node listed")
    page.find_element("css selector", "#mesh-filters input[name=model]").send_keys(QWEN)
    wait_for(page, lambda d: set(rows(d)) == {mesh.other.session_id}, 10, "only the qwen node")
    page.find_element("css selector", "#mesh-filters input[name=model]").clear()
    from selenium.webdriver.support.ui import Select

    Select(page.find_element("css selector", "#mesh-filters select[name=group]")).select_by_value(
        "host"
    )
    wait_for(page, lambda d: len(rows(d)) == 3, 10, "every node again")


SITES_JS = """
const out = {};
for (const section of document.querySelectorAll('#mesh-groups > section.site')) {
  out[section.dataset.site] = [...section.querySelectorAll('tr[data-session]')]
    .map((row) => row.dataset.session).sort();
}
return out;
"""

GROUPS_JS = """
const out = {};
for (const group of document.querySelectorAll('#mesh-groups .group')) {
  out[group.dataset.group] = group.querySelectorAll('tr[data-session]').length;
}
return out;
"""


def test_nodes_of_two_sites_are_shown_by_site(page: Any, mesh: Mesh) -> None:
    from selenium.webdriver.support.ui import Select

    page.get(f"{mesh.url}/ui#/mesh")
    group = Select(page.find_element("css selector", "#mesh-filters select[name=group]"))
    group.select_by_value("model")
    default = sorted([mesh.page.session_id, mesh.twin.session_id])
    by_site = {"default": default, "B": [mesh.other.session_id]}
    # A section per site, and inside each the groups chosen: the model's.
    wait_for(
        page,
        lambda d: (
            d.execute_script(SITES_JS) == by_site
            and d.execute_script(GROUPS_JS) == {LLAMA: 2, QWEN: 1}
        ),
        15,
        "a section per site, grouped by model",
    )
    assert "; 2 sites" in page.find_element("id", "mesh-summary").text
    # Grouped by site: one group per site, no sections.
    group.select_by_value("site")
    wait_for(
        page,
        lambda d: (
            d.execute_script(GROUPS_JS) == {"B": 1, "default": 2}
            and d.execute_script(SITES_JS) == {}
        ),
        10,
        "one group per site",
    )
    # The site filter, as `fabric nodes --site B`: one site left, named in the summary.
    site = page.find_element("css selector", "#mesh-filters input[name=site]")
    site.send_keys("B")
    wait_for(page, lambda d: set(rows(d)) == {mesh.other.session_id}, 10, "only site B")
    assert "; site B" in page.find_element("id", "mesh-summary").text
    site.clear()
    group.select_by_value("model")
    wait_for(page, lambda d: len(rows(d)) == 3, 10, "every node again")


def send_load(url: str, model: str, stop: threading.Event) -> int:
    sent = 0
    with httpx.Client(base_url=url, timeout=30.0) as client:
        while not stop.is_set():
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"count to {sent}"}],
                "max_tokens": 8,
                "stream": True,
            }
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                for _ in r.iter_bytes():
                    pass
            sent += 1
    return sent


def test_the_models_view_shows_rates_under_load(page: Any, mesh: Mesh) -> None:
    stop = threading.Event()
    # Through two agents: the page adds up every agent's counts.
    workers = [
        threading.Thread(target=send_load, args=(agent.http_url, LLAMA, stop), daemon=True)
        for agent in (mesh.page, mesh.twin)
    ]
    for w in workers:
        w.start()
    try:
        page.get(f"{mesh.url}/ui#/models")
        card = f'[data-model="{LLAMA}"]'

        def busy(d: Any) -> bool:
            found = texts(d, f'{card} [data-figure="requests_per_s"]')
            return bool(found) and found[0] not in ("", "\u2013", "0")

        # The summary is the last complete 10-second bucket onwards: up to 20 s.
        wait_for(page, busy, 40, "a non-zero request rate for the loaded model")

        def buckets_with_requests() -> int:
            r = httpx.get(f"{mesh.url}/fabric/v1/stats", timeout=5.0)
            series = r.json()["models"].get(LLAMA, {}).get("series", {})
            return sum(1 for v in series.get("requests_per_s", []) if v)

        # Two buckets, so the charts draw lines, and the page's next poll after that.
        assert wait_until(lambda: buckets_with_requests() >= 2, 30.0)
        status = page.find_element("id", "status").text
        wait_for(page, lambda d: d.find_element("id", "status").text != status, 15, "a new poll")
        (ttft,) = texts(page, f'{card} [data-figure="ttft"]')
        assert "ms" in ttft or " s" in ttft
        charts = page.find_elements("css selector", f"{card} .chart canvas")
        assert len(charts) == 2  # throughput and latency, drawn by the vendored library
        (serving,) = texts(page, f'{card} [data-figure="serving"]')
        assert serving == "2 of 2"
        screenshot(page, mesh.shots / "models.png")
    finally:
        stop.set()
        for w in workers:
            w.join(30)


def test_the_node_view_shows_one_entry_in_full(page: Any, mesh: Mesh) -> None:
    page.get(f"{mesh.url}/ui#/mesh")
    sid = mesh.twin.session_id
    link = wait_for(
        page,
        lambda d: d.find_elements("css selector", f'tr[data-session="{sid}"] a'),
        15,
        "the twin's row",
    )
    link[0].click()
    wait_for(
        page,
        lambda d: d.find_elements("css selector", f'#node-detail [data-node="{sid}"]'),
        10,
        "the node's detail",
    )
    text = page.find_element("id", "node-detail").text
    assert sid in text and "L40S" in text and LLAMA in text and "sim" in text
    assert "site\ndefault" in text or "site default" in text
    # The engine's command, which only the node's own agent knows: asked of it.
    assert "fabricnode.simengine" in text and "--model llama-3-8b" in text
    wait_for(
        page,
        lambda d: d.find_elements("css selector", '#node-detail [data-chart="load"] canvas'),
        15,
        "the node's recent load",
    )
    screenshot(page, mesh.shots / "node.png")


def chat(driver: Any, *, models: int, model: str | None = None) -> str:
    """On the playground: wait for its ``models`` choices, send the message with ``model`` (or
    the first), wait for the whole answer; the line under it (who served, how fast)."""
    from selenium.webdriver.support.ui import Select

    wait_for(
        driver,
        lambda d: len(d.find_elements("css selector", "#chat-model option")) == models,
        10,
        "the model list",
    )
    if model is not None:
        Select(driver.find_element("id", "chat-model")).select_by_value(model)
    driver.find_element("id", "chat-send").click()
    wait_for(
        driver,
        lambda d: d.find_element("id", "chat-meta").get_attribute("data-done") == "1",
        20,
        "the whole answer",
    )
    return str(driver.find_element("id", "chat-meta").text)


def test_the_playground_streams_an_answer_and_names_the_node(page: Any, mesh: Mesh) -> None:
    page.get(f"{mesh.url}/ui#/playground")
    meta = chat(page, models=2, model=QWEN)
    assert page.find_element("id", "chat-output").text.strip()
    assert f"served by {mesh.other.session_id[:12]}" in meta and "first token after" in meta
    screenshot(page, mesh.shots / "playground.png")


def test_the_controller_view_says_when_there_is_none(page: Any, mesh: Mesh) -> None:
    page.get(f"{mesh.url}/ui#/controller")
    wait_for(
        page,
        lambda d: "No controller runs" in d.find_element("id", "controller-detail").text,
        10,
        "the controller view",
    )
    screenshot(page, mesh.shots / "controller-none.png")


def test_a_phone_screen_gets_one_column(page: Any, mesh: Mesh) -> None:
    page.set_window_size(390, 844)
    try:
        page.get(f"{mesh.url}/ui#/mesh")
        wait_for(page, lambda d: len(rows(d)) == 3, 15, "every node listed")
        # Nothing wider than the screen but the tables' own scrolling boxes.
        overflow = page.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0
        screenshot(page, mesh.shots / "mesh-phone.png")
    finally:
        page.set_window_size(1280, 900)


def test_a_killed_node_turns_dead_on_the_page(page: Any, mesh: Mesh) -> None:
    page.get(f"{mesh.url}/ui#/mesh")
    sid = mesh.twin.session_id
    wait_for(page, lambda d: rows(d).get(sid, {}).get("liveness") == "alive", 15, "twin alive")
    os.kill(mesh.twin.pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(
        page,
        lambda d: rows(d).get(sid, {}).get("liveness") == "dead",
        DEAD_ON_PAGE_S,
        "the killed node shown dead",
    )
    print(f"\nui: SIGKILLed node shown dead after {time.monotonic() - killed:.1f} s")
    row = page.find_element("css selector", f'tr[data-session="{sid}"]')
    assert "dead" in (row.get_attribute("class") or "")
    screenshot(page, mesh.shots / "mesh-dead.png")
