"""A small synchronous client of an agent's admin API, for the CLI, the demo and tests.

Every failure becomes ``AgentApiError`` with one line a user can act on: the agent is not
reachable (with the URL tried and how to point elsewhere), it did not answer in time, or it
answered with an error (the message of its OpenAI-shaped error body).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

import httpx

from fabricnode.errors import AgentApiError

Json = dict[str, Any]


class AdminClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, transport=transport)

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- endpoints --------------------------------------------------------------------------

    def nodes(
        self,
        *,
        state: str | None = None,
        model: str | None = None,
        gpu: str | None = None,
        labels: Iterable[str] = (),
    ) -> list[Json]:
        params: list[tuple[str, str]] = []
        for key, value in (("state", state), ("model", model), ("gpu", gpu)):
            if value:
                params.append((key, value))
        params.extend(("label", label) for label in labels)
        nodes: list[Json] = self.get_json("/fabric/v1/nodes", params)["nodes"]
        return nodes

    def node(self, session_id: str) -> Json:
        return self.get_json(f"/fabric/v1/nodes/{quote(session_id, safe='')}")

    def models(self) -> list[Json]:
        models: list[Json] = self.get_json("/fabric/v1/models")["models"]
        return models

    def self_entry(self) -> Json:
        return self.get_json("/fabric/v1/self")

    def is_ready(self) -> bool:
        try:
            return self._http.get("/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> str:
        return self._request("/metrics").text

    # -- plumbing ---------------------------------------------------------------------------

    def get_json(self, path: str, params: list[tuple[str, str]] | None = None) -> Json:
        response = self._request(path, params)
        try:
            doc = response.json()
        except ValueError:
            raise AgentApiError(
                f"{self.base_url}{path} did not answer with JSON (is it a fabric agent?)",
                response.status_code,
            ) from None
        if not isinstance(doc, dict):
            raise AgentApiError(f"{self.base_url}{path}: unexpected answer", response.status_code)
        return doc

    def _request(self, path: str, params: list[tuple[str, str]] | None = None) -> httpx.Response:
        try:
            response = self._http.get(path, params=tuple(params or ()))
        except httpx.ConnectError:
            raise AgentApiError(
                f"cannot reach the agent at {self.base_url} (is `fabric start` running there? "
                "choose another with --agent URL or FABRIC_AGENT)"
            ) from None
        except httpx.TimeoutException:
            raise AgentApiError(
                f"the agent at {self.base_url} did not answer within {self.timeout_s:g} s"
            ) from None
        except httpx.HTTPError as exc:
            raise AgentApiError(f"request to {self.base_url} failed: {exc}") from None
        if response.is_success:
            return response
        raise AgentApiError(_error_message(response), response.status_code)


def _error_message(response: httpx.Response) -> str:
    try:
        err = response.json()["error"]
        message = str(err["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:200] or response.reason_phrase
    return f"{message} (HTTP {response.status_code})"
