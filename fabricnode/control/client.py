"""A small synchronous client of an agent's admin API, for the CLI, the demo and tests.

Every failure becomes ``AgentApiError`` with one line a user can act on: the agent is not
reachable (with the URL tried, why, and how to point elsewhere), it did not answer in time, the
port does not serve the agent endpoints (``fabric start --admin`` moved them), an unknown or
ambiguous session id (with the candidates), or any other error answer (the message of its
OpenAI-shaped error body). ``agent_base_url`` turns what a user typed as ``--agent`` into a base
URL, or raises ``ConfigError``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from fabricnode.errors import AgentApiError, ConfigError

Json = dict[str, Any]

AGENT_PATH_PREFIX = "/fabric/v1/"


def agent_base_url(text: str) -> str:
    """``--agent`` as typed -> base URL: ``http://`` is added when no scheme is given, and a
    trailing ``/v1`` (the OpenAI base URL of the same agent) is dropped. ConfigError if it is not
    an http(s) URL with a host."""
    raw = text.strip()
    if not raw:
        raise ConfigError("empty agent URL (expected e.g. http://HOST:8080)")
    if "://" not in raw:
        raw = "http://" + raw
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{text!r} is not a valid agent URL ({exc})") from None
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not re.fullmatch(r"[\w.:-]+", host):
        raise ConfigError(f"{text!r} is not an agent URL (expected http://HOST:PORT)")
    if port == 0:
        raise ConfigError(f"{text!r}: port 0 is not a port an agent listens on")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class AdminClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 5.0,
        transport: httpx.BaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        self._http = httpx.Client(
            base_url=self.base_url, timeout=timeout_s, transport=transport, headers=headers
        )

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
        """One entry by session id or unique prefix; AgentApiError 404 unknown, 409 ambiguous
        (naming every candidate)."""
        if not session_id:
            raise AgentApiError("no session id given", 400)
        try:
            return self.get_json(f"/fabric/v1/nodes/{quote(session_id, safe='')}")
        except AgentApiError as exc:
            if exc.status == 404 and str(exc).startswith("no node with session id"):
                raise AgentApiError(
                    f"no node with session id {session_id!r} in the registry of "
                    f"{self.base_url} (see `fabric nodes`)",
                    404,
                ) from None
            if exc.status == 409:
                raise AgentApiError(self._ambiguous(session_id), 409) from None
            raise

    def _ambiguous(self, prefix: str) -> str:
        wanted = prefix.lower()
        try:
            found = [n for n in self.nodes() if n["session_id"].startswith(wanted)]
        except AgentApiError:
            found = []
        shown = ", ".join(
            f"{n['session_id'][:12]} ({n['provider']}@{n['hardware']['host'] or '?'})"
            for n in found
        )
        matches = f"it matches {len(found)} nodes: {shown}" if found else "it matches several"
        return f"session id prefix {prefix!r} is ambiguous: {matches}; give more characters"

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

    def assignments(self) -> Json:
        return self.get_json("/fabric/v1/assignments")

    def post_assignments(self, assignments: list[Json]) -> list[Json]:
        """Hand operator-signed assignments to the agent; each one's outcome."""
        doc = self.post_json("/fabric/v1/assignments", {"assignments": assignments})
        results: list[Json] = doc.get("results", [])
        return results

    def services(self) -> Json:
        return self.get_json("/fabric/v1/services")

    def post_services(self, signed: Json) -> Json:
        """Hand an operator-signed service file to the agent; its outcome."""
        return self.post_json("/fabric/v1/services", signed)

    def workload(self, window_s: float) -> Json:
        return self.get_json("/fabric/v1/workload", [("window", f"{window_s:g}")])

    # -- plumbing ---------------------------------------------------------------------------

    def get_json(self, path: str, params: list[tuple[str, str]] | None = None) -> Json:
        return self._json(path, self._request(path, params))

    def post_json(self, path: str, body: Json) -> Json:
        return self._json(path, self._request(path, body=body))

    def _json(self, path: str, response: httpx.Response) -> Json:
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

    def _request(
        self,
        path: str,
        params: list[tuple[str, str]] | None = None,
        *,
        body: Json | None = None,
    ) -> httpx.Response:
        try:
            if body is None:
                response = self._http.get(path, params=tuple(params or ()))
            else:
                response = self._http.post(path, json=body)
        except httpx.ConnectError as exc:
            raise AgentApiError(
                f"cannot reach the agent at {self.base_url}: {_reason(exc)} (is `fabric start` "
                "running there? choose another with --agent URL or FABRIC_AGENT)"
            ) from None
        except httpx.TimeoutException:
            raise AgentApiError(
                f"the agent at {self.base_url} did not answer within {self.timeout_s:g} s"
            ) from None
        except httpx.HTTPError as exc:
            raise AgentApiError(f"request to {self.base_url} failed: {exc}") from None
        if response.is_success:
            return response
        if response.status_code == 404 and path.startswith(AGENT_PATH_PREFIX):
            code = _error_code(response)
            if code == "not_found" and "no such endpoint" in _error_message(response):
                raise AgentApiError(
                    f"{self.base_url} does not serve the agent endpoints (an agent started with "
                    "--admin HOST:PORT serves them on that port: point --agent there)",
                    404,
                )
        if response.status_code in (401, 403):
            raise AgentApiError(
                f"{_error_message(response)}; the agent's API keys are on: give an admin key "
                "(fabric --api-key KEY, or $FABRIC_API_KEY)",
                response.status_code,
            )
        raise AgentApiError(_error_message(response), response.status_code)


def _reason(exc: Exception) -> str:
    """``[Errno 111] Connection refused`` -> ``connection refused``."""
    text = re.sub(r"^\[Errno -?\d+\]\s*", "", str(exc).strip()) or type(exc).__name__
    return text[:1].lower() + text[1:]


def _error_code(response: httpx.Response) -> str | None:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


def _error_message(response: httpx.Response) -> str:
    try:
        err = response.json()["error"]
        message = str(err["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:200] or response.reason_phrase
    return f"{message} (HTTP {response.status_code})"
