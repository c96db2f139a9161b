"""The dashboard with API keys on: the page shows nothing of the mesh until a valid key is
entered, a key that may not read the registry is told so (and still chats), and the key goes
with every request the page makes. No request of the page is refused on the way (no console
error): the page asks ``/ui/session`` what its key may read before reading."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cli.localmesh import LocalMesh, wait_until
from fabricnode.dataplane.apikeys import ApiKeyStore
from tests.browser.test_dashboard import chat, rows, wait_for
from tests.support.browser import console_errors

pytestmark = pytest.mark.slow

MODEL = "llama-3-8b"


class KeyedMesh:
    def __init__(self, local: LocalMesh) -> None:
        store = ApiKeyStore(local.workdir / "api-keys.json", enabled=True)
        self.admin = store.new_key("ops", admin=True)[0]
        self.user = store.new_key("alice")[0]
        store.save()
        self.node = local.start("keyed", args=["--sim", MODEL])
        self.url = self.node.http_url


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedMesh]:
    local = LocalMesh(tmp_path_factory.mktemp("ui-keys"))
    try:
        mesh = KeyedMesh(local)
        import httpx

        def serving() -> bool:
            r = httpx.get(
                f"{mesh.url}/fabric/v1/self",
                headers={"authorization": f"Bearer {mesh.admin}"},
                timeout=2.0,
            )
            return r.status_code == 200 and r.json()["state"] == "serving"

        assert wait_until(serving, 30.0)
        yield mesh
    finally:
        local.close()


def forget_key(driver: Any, url: str) -> None:
    """A tab with no key: the page's storage cleared from a page of the same origin that does
    not run the dashboard (so nothing reads with the old key meanwhile)."""
    driver.get(f"{url}/health")
    driver.execute_script("sessionStorage.clear()")


def enter_key(driver: Any, key: str) -> None:
    field = wait_for(
        driver,
        lambda d: (
            d.find_element("id", "key-input")
            if d.find_element("id", "key-form").is_displayed()
            else None
        ),
        10,
        "the key form",
    )
    field.send_keys(key)
    driver.find_element("css selector", "#key-form button[type=submit]").click()


def test_nothing_shows_until_a_valid_key_is_entered(chromium: Any, keyed: KeyedMesh) -> None:
    page = chromium
    console_errors(page)
    forget_key(page, keyed.url)
    page.get(f"{keyed.url}/ui#/mesh")
    wait_for(page, lambda d: d.find_element("id", "key-form").is_displayed(), 10, "key form")
    assert rows(page) == {}
    assert page.find_element("id", "mesh-summary").text == ""

    enter_key(page, "sk-fabric-not-a-key")
    wait_for(
        page,
        lambda d: "not valid" in d.find_element("id", "status").text,
        10,
        "the bad key refused",
    )
    assert rows(page) == {}

    enter_key(page, keyed.admin)
    wait_for(page, lambda d: set(rows(d)) == {keyed.node.session_id}, 15, "the node listed")
    assert not page.find_element("id", "key-form").is_displayed()
    assert console_errors(page) == []


def test_a_key_that_may_not_read_the_registry_is_told_so_and_can_chat(
    chromium: Any, keyed: KeyedMesh
) -> None:
    page = chromium
    console_errors(page)
    forget_key(page, keyed.url)
    page.get(f"{keyed.url}/ui#/mesh")
    enter_key(page, keyed.user)
    wait_for(
        page,
        lambda d: "admin key" in d.find_element("id", "notice").text,
        10,
        "the notice that an admin key is needed",
    )
    assert rows(page) == {}
    page.get(f"{keyed.url}/ui#/playground")
    meta = chat(page, models=1)  # the model list read, and the answer sent, with the user's key
    assert keyed.node.session_id[:12] in meta
    assert console_errors(page) == []
