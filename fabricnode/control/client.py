"""Small synchronous clients of an agent, for the CLI, the demo and tests: ``AdminClient`` for
its admin API (the registry, assignments, services), ``BatchClient`` for its OpenAI Batch API
(``/v1/files``, ``/v1/batches``; ``fabricnode.batch.api``).

Every failure becomes ``AgentApiError`` with one line a user can act on: the agent is not
reachable (with the URL tried, why, and how to point elsewhere), it did not answer in time, the
port does not serve the agent endpoints (``fabric start --admin`` moved them) or the Batch API
(it is on the ``--http`` port), an API key is needed, an unknown or ambiguous session id (with
the candidates), an unknown batch or file, or any other error answer (the message of its
OpenAI-shaped error body). ``agent_base_url`` turns what a user typed as ``--agent`` into a base
URL, or raises ``ConfigError``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Self
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from fabricnode.errors import AgentApiError, ConfigError
from fabricnode.mesh.assignment import ASSIGNMENTS_PATH
from fabricnode.mesh.servicedoc import SERVICES_PATH

Json = dict[str, Any]

AGENT_PATH_PREFIX = "/fabric/v1/"
BATCH_PATH_PREFIXES = ("/v1/files", "/v1/batches")


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


class _AgentClient:
    """The plumbing both clients share: one ``httpx.Client``, errors as ``AgentApiError``."""

    # What a 401/403 answer asks the user for.
    key_hint = "give an admin key (fabric --api-key KEY, or $FABRIC_API_KEY)"

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

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
        if body is None:
            return self._send("GET", path, params=tuple(params or ()))
        return self._send("POST", path, json=body)

    def _send(
        self, method: str, path: str, *, timeout_s: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        """One request; its answer if it succeeded, else AgentApiError."""
        with self._transport_errors(timeout_s):
            response = self._http.request(
                method, path, timeout=timeout_s or self.timeout_s, **kwargs
            )
        self._check(path, response)
        return response

    @contextmanager
    def _transport_errors(self, timeout_s: float | None = None) -> Iterator[None]:
        try:
            yield
        except httpx.ConnectError as exc:
            raise AgentApiError(
                f"cannot reach the agent at {self.base_url}: {_reason(exc)} (is `fabric start` "
                "running there? choose another with --agent URL or FABRIC_AGENT)"
            ) from None
        except httpx.TimeoutException:
            raise AgentApiError(
                f"the agent at {self.base_url} did not answer within "
                f"{timeout_s or self.timeout_s:g} s"
            ) from None
        except httpx.HTTPError as exc:
            raise AgentApiError(f"request to {self.base_url} failed: {exc}") from None

    def _check(self, path: str, response: httpx.Response) -> None:
        """AgentApiError for an error answer (its body read already)."""
        if response.is_success:
            return
        message = _error_message(response)
        unserved = (
            response.status_code == 404
            and _error_code(response) == "not_found"
            and "no such endpoint" in message
        )
        if unserved and path.startswith(AGENT_PATH_PREFIX):
            raise AgentApiError(
                f"{self.base_url} does not serve the agent endpoints (an agent started with "
                "--admin HOST:PORT serves them on that port: point --agent there)",
                404,
            )
        if unserved and path.startswith(BATCH_PATH_PREFIXES):
            raise AgentApiError(
                f"{self.base_url} does not serve the Batch API (the --admin port of an agent "
                "serves only the agent endpoints: point --agent at its --http port)",
                404,
            )
        if response.status_code in (401, 403):
            raise AgentApiError(
                f"{message}; the agent's API keys are on: {self.key_hint}", response.status_code
            )
        raise AgentApiError(message, response.status_code)


class AdminClient(_AgentClient):
    """The agent endpoints (``/fabric/v1/...``) and ``/metrics``."""

    # -- endpoints --------------------------------------------------------------------------

    def nodes(
        self,
        *,
        state: str | None = None,
        model: str | None = None,
        gpu: str | None = None,
        labels: Iterable[str] = (),
        site: str | None = None,
    ) -> list[Json]:
        params: list[tuple[str, str]] = []
        for key, value in (("state", state), ("model", model), ("gpu", gpu), ("site", site)):
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
        return self.get_json(ASSIGNMENTS_PATH)

    def post_assignments(self, assignments: list[Json]) -> list[Json]:
        """Hand operator-signed assignments to the agent; each one's outcome."""
        doc = self.post_json(ASSIGNMENTS_PATH, {"assignments": assignments})
        results: list[Json] = doc.get("results", [])
        return results

    def services(self) -> Json:
        return self.get_json(SERVICES_PATH)

    def post_services(self, signed: Json) -> Json:
        """Hand an operator-signed service file to the agent; its outcome."""
        return self.post_json(SERVICES_PATH, signed)

    def workload(self, window_s: float) -> Json:
        return self.get_json("/fabric/v1/workload", [("window", f"{window_s:g}")])


class BatchClient(_AgentClient):
    """The OpenAI Batch API of an agent (any agent answers for any batch of the mesh).

    Files and batches belong to the API key that created them (``api_key``; none when the
    ingress runs open): another key's are unknown here, as if they did not exist. Uploads and
    downloads get ``transfer_timeout_s``; everything else ``timeout_s``.
    """

    key_hint = "give your API key (fabric --api-key KEY, or $FABRIC_API_KEY)"

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 10.0,
        transfer_timeout_s: float = 120.0,
        transport: httpx.BaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        super().__init__(base_url, timeout_s=timeout_s, transport=transport, api_key=api_key)
        self.transfer_timeout_s = transfer_timeout_s

    def upload(self, filename: str, content: bytes) -> Json:
        """``POST /v1/files`` (multipart, ``purpose=batch``): the file object."""
        path = "/v1/files"
        response = self._send(
            "POST",
            path,
            files={"file": (filename, content, "application/jsonl")},
            data={"purpose": "batch"},
            timeout_s=self.transfer_timeout_s,
        )
        return self._json(path, response)

    def create(self, input_file_id: str, endpoint: str, metadata: dict[str, str] | None) -> Json:
        """``POST /v1/batches`` with the 24 h completion window: the batch, ``validating``."""
        body: Json = {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": "24h",
        }
        if metadata:
            body["metadata"] = metadata
        return self.post_json("/v1/batches", body)

    def batch(self, batch_id: str) -> Json:
        return self._about_batch(batch_id, lambda path: self.get_json(path))

    def cancel(self, batch_id: str) -> Json:
        return self._about_batch(batch_id, lambda path: self.post_json(path + "/cancel", {}))

    def batches(self, *, limit: int = 20, after: str | None = None) -> Json:
        """``GET /v1/batches``: a page of this key's batches, newest first (OpenAI's list)."""
        params = [("limit", str(limit))]
        if after is not None:
            params.append(("after", after))
        return self.get_json("/v1/batches", params)

    def download(self, file_id: str, write: Callable[[bytes], object]) -> int:
        """``GET /v1/files/{id}/content``, handed to ``write`` as it arrives; its size."""
        path = f"/v1/files/{quote(file_id, safe='')}/content"
        size = 0
        with (
            self._transport_errors(self.transfer_timeout_s),
            self._http.stream("GET", path, timeout=self.transfer_timeout_s) as response,
        ):
            if not response.is_success:
                response.read()
                if response.status_code == 404 and _error_code(response) == "file_not_found":
                    raise AgentApiError(
                        f"no file {file_id!r} at {self.base_url} (deleted, or created with "
                        "another API key)",
                        404,
                    )
                self._check(path, response)
            for chunk in response.iter_bytes():
                write(chunk)
                size += len(chunk)
        return size

    def _about_batch(self, batch_id: str, call: Callable[[str], Json]) -> Json:
        if not batch_id:
            raise AgentApiError("no batch id given", 400)
        try:
            return call(f"/v1/batches/{quote(batch_id, safe='')}")
        except AgentApiError as exc:
            if exc.status == 404 and str(exc).startswith("no batch "):
                raise AgentApiError(
                    f"no batch {batch_id!r} at {self.base_url}: batches belong to the API key "
                    "that created them (see `fabric batch list`)",
                    404,
                ) from None
            raise


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
