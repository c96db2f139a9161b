"""The OpenAI Batch API and the files it needs, on every agent: a raw ASGI app that the data
plane calls for ``/v1/files*`` and ``/v1/batches*`` once it has checked the caller's API key.

Endpoints (OpenAI's paths, bodies and object shapes, so the official SDK works unchanged):

* ``POST /v1/files`` (multipart: ``file``, ``purpose=batch``) → the file object;
  ``GET /v1/files`` → the caller's files; ``GET /v1/files/{id}``; ``DELETE /v1/files/{id}``;
  ``GET /v1/files/{id}/content`` → the bytes (a batch's input, output or error file), streamed
  from disk in ``DOWNLOAD_CHUNK_BYTES`` pieces with its ``content-length``; a ``Range: bytes=``
  header of one range gets ``206`` and that part (``416`` if it is past the end).
* ``POST /v1/batches`` ``{"input_file_id", "endpoint", "completion_window": "24h",
  "metadata"?}`` → the batch, ``validating``; ``GET /v1/batches?limit=&after=`` → the caller's
  batches, newest first; ``GET /v1/batches/{id}``; ``POST /v1/batches/{id}/cancel``.

Ownership: the data plane passes the caller's API key id as ``scope[OWNER_SCOPE]``
(``fabric.owner``; ``-`` when the ingress runs open). Files and batches belong to the key that
created them; any other key gets 404 for them, as if they did not exist, and never sees them
listed.

Errors are OpenAI-shaped: 400 a bad body or parameter (the message names it), 404 unknown or not
yours, 405 wrong method, 413 a file over the limit, 416 a range past a file's end. Validation
problems of an input file are not HTTP errors: the batch is created and then fails, with its
``errors`` naming the lines (``validate``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import trio

from fabricnode.batch import records
from fabricnode.batch.store import BatchStore, new_batch_id, new_file_id
from fabricnode.batch.upload import form_parts
from fabricnode.batch.validate import ENDPOINTS
from fabricnode.batch.worker_config import BatchConfig
from fabricnode.dataplane.asgi_call import OWNER_SCOPE
from fabricnode.dataplane.request import error_body

log = logging.getLogger("fabricnode.batch.api")

Json = dict[str, Any]
MAX_LIST_LIMIT = 100
_FILE_PURPOSES = ("batch",)
# A download goes out in pieces of this size: one piece per download is held at a time (the
# ingress sends each before the next is read).
DOWNLOAD_CHUNK_BYTES = 1024 * 1024
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or []


@dataclass
class Download:
    """A file's content to stream: ``length`` bytes from ``start`` of the open ``fd``."""

    fd: int
    start: int
    length: int
    size: int  # the whole file's
    partial: bool  # a Range was asked: 206 with Content-Range


def byte_range(header: bytes | None, size: int) -> tuple[int, int] | None:
    """``(start, length)`` of a ``Range`` header of one range over a file of ``size`` bytes;
    None to send it whole (no header, or one this does not take: several ranges, other
    units). ``ApiError`` 416 for a range that starts past the end."""
    if header is None:
        return None
    m = _RANGE.match(header.decode("latin-1").strip())
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.group(1), m.group(2)
    if not first:  # the last N bytes
        n = min(int(last), size)
        if n == 0:
            raise _unsatisfiable(size)
        return size - n, n
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or end < start:
        raise _unsatisfiable(size)
    return start, end - start + 1


def _unsatisfiable(size: int) -> ApiError:
    return ApiError(
        416,
        f"the range asked is not within the file's {size} bytes",
        "range_not_satisfiable",
        [(b"content-range", b"bytes */%d" % size)],
    )


class BatchApi:
    def __init__(
        self,
        store: BatchStore,
        *,
        wall_clock: Callable[[], float],
        max_file_bytes: int,
        key_quota_bytes: int = BatchConfig.key_quota_bytes,
        store_quota_bytes: int = BatchConfig.store_quota_bytes,
        poke_worker: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.wall_clock = wall_clock
        self.max_file_bytes = max_file_bytes
        self.key_quota_bytes = key_quota_bytes
        self.store_quota_bytes = store_quota_bytes
        self.poke_worker = poke_worker

    async def __call__(self, scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        owner = str(scope.get(OWNER_SCOPE, "-"))
        method = scope["method"]
        parts = [p for p in scope["path"].split("/") if p]  # ["v1", "files", ...]
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        headers = dict(scope.get("headers") or [])
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        extra: list[tuple[bytes, bytes]] = []
        try:
            routed = await self._route(method, parts[1:], query, headers, body, owner)
            if isinstance(routed, Download):
                await self._send_file(routed, send)
                return
            status, answer, content_type = routed
        except ApiError as exc:
            status, answer = exc.status, error_body(exc.status, exc.message, exc.code)
            content_type = b"application/json"
            extra = exc.headers
        except OSError as exc:
            log.warning("batch store failed: %s", exc)
            status = 503
            answer = error_body(503, f"the batch store is not available: {exc}", "store_error")
            content_type = b"application/json"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", content_type), *extra],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    async def _send_file(self, download: Download, send: Any) -> None:
        """Stream a file's content: its length known, one ``DOWNLOAD_CHUNK_BYTES`` piece read
        (in a worker thread) and handed on at a time; ``send`` returns once the piece is out,
        so a slow client holds one piece, not the file."""
        fd = download.fd
        try:
            headers = [
                (b"content-type", b"application/octet-stream"),
                (b"content-length", b"%d" % download.length),
                (b"accept-ranges", b"bytes"),
            ]
            if download.partial:
                last = download.start + download.length - 1
                headers.append(
                    (b"content-range", b"bytes %d-%d/%d" % (download.start, last, download.size))
                )
            status = 206 if download.partial else 200
            await send({"type": "http.response.start", "status": status, "headers": headers})
            pos, left = download.start, download.length
            while left > 0:
                piece = await trio.to_thread.run_sync(
                    os.pread, fd, min(DOWNLOAD_CHUNK_BYTES, left), pos
                )
                if not piece:
                    raise OSError(f"the file ended {left} bytes early")  # cannot: never truncated
                pos += len(piece)
                left -= len(piece)
                await send({"type": "http.response.body", "body": piece, "more_body": left > 0})
            if download.length == 0:
                await send({"type": "http.response.body", "body": b""})
        finally:
            os.close(fd)

    async def _route(
        self,
        method: str,
        parts: list[str],
        query: dict[str, str],
        headers: dict[bytes, bytes],
        body: bytes,
        owner: str,
    ) -> tuple[int, bytes, bytes] | Download:
        if not parts or parts[0] not in ("files", "batches") or len(parts) > 3:
            raise ApiError(404, "no such endpoint", "not_found")
        if parts[0] == "files":
            if len(parts) == 1:
                if method == "POST":
                    return _json(await self._upload(headers, body, owner))
                _allow(method, "GET")
                return _json(await self._list_files(owner))
            meta = await self._own_file(parts[1], owner)
            if len(parts) == 3:
                if parts[2] != "content":
                    raise ApiError(404, "no such endpoint", "not_found")
                _allow(method, "GET")
                return await self._download(parts[1], headers.get(b"range"))
            if method == "DELETE":
                await trio.to_thread.run_sync(self.store.delete_file, meta["id"])
                return _json({"id": meta["id"], "object": "file", "deleted": True})
            _allow(method, "GET, DELETE")
            return _json(records.file_object(meta))
        if len(parts) == 1:
            if method == "POST":
                return _json(await self._create(body, owner))
            _allow(method, "GET")
            return _json(await self._list_batches(query, owner))
        record = await self._own_batch(parts[1], owner)
        if len(parts) == 3:
            if parts[2] != "cancel":
                raise ApiError(404, "no such endpoint", "not_found")
            _allow(method, "POST")
            return _json(await self._cancel(record))
        _allow(method, "GET")
        return _json(await self._public(record))

    # -- files ------------------------------------------------------------------------------

    async def _upload(self, headers: dict[bytes, bytes], body: bytes, owner: str) -> Json:
        # Walked in a worker thread: a form of many parts must not stall the event loop.
        form = await trio.to_thread.run_sync(form_parts, body, headers.get(b"content-type", b""))
        if isinstance(form, str):
            raise ApiError(400, form, "invalid_form")
        purpose_part = form.get("purpose")
        purpose = purpose_part.content.decode("utf-8", "replace").strip() if purpose_part else ""
        if purpose not in _FILE_PURPOSES:
            raise ApiError(
                400,
                f"'purpose' must be one of {', '.join(_FILE_PURPOSES)} (got {purpose!r}): "
                "this mesh stores files for its Batch API only",
                "invalid_purpose",
            )
        file_part = form.get("file")
        if file_part is None:
            raise ApiError(400, "the form field 'file' is required", "missing_file")
        if len(file_part.content) > self.max_file_bytes:
            raise ApiError(
                413, f"the file is larger than {self.max_file_bytes} bytes", "file_too_large"
            )
        await self._within_quotas(owner, len(file_part.content))
        filename = (file_part.filename or "upload.jsonl")[:255]
        meta = records.new_file(
            new_file_id(),
            owner=owner,
            filename=filename,
            purpose=purpose,
            size=len(file_part.content),
            now=self.wall_clock(),
        )
        await trio.to_thread.run_sync(self.store.put_file, meta, file_part.content)
        return records.file_object(meta)

    async def _within_quotas(self, owner: str, size: int) -> None:
        """413 if a new file of ``size`` bytes would take ``owner``'s files past the key's
        quota, or the store past its own. Two uploads racing may both pass and overshoot by
        one file: the quota bounds the store, it is not an exact ledger."""
        metas = await trio.to_thread.run_sync(self.store.list_files)
        total = sum(_size(m) for m in metas)
        mine = sum(_size(m) for m in metas if m.get("owner") == owner)
        if mine + size > self.key_quota_bytes:
            raise ApiError(
                413,
                f"this key's files would take {mine + size} bytes, over its quota of "
                f"{self.key_quota_bytes} (delete files it no longer needs: DELETE "
                "/v1/files/{id})",
                "key_quota_exceeded",
            )
        if total + size > self.store_quota_bytes:
            raise ApiError(
                413,
                f"the batch store would hold {total + size} bytes, over its quota of "
                f"{self.store_quota_bytes}: ask the operator, or delete files",
                "store_quota_exceeded",
            )

    async def _list_files(self, owner: str) -> Json:
        metas = await trio.to_thread.run_sync(self.store.list_files)
        mine = sorted(
            (m for m in metas if m.get("owner") == owner),
            key=lambda m: (m.get("created_at", 0), m.get("id", "")),
            reverse=True,
        )
        return {"object": "list", "data": [records.file_object(m) for m in mine], "has_more": False}

    async def _download(self, file_id: str, range_header: bytes | None) -> Download:
        """The file open for streaming (open, it stays whole if deleted meanwhile)."""
        fd = await trio.to_thread.run_sync(self.store.open_file, file_id)
        if fd is None:
            raise ApiError(404, f"no file {file_id!r}", "file_not_found")
        try:
            size = os.fstat(fd).st_size
            asked = byte_range(range_header, size)
        except BaseException:
            os.close(fd)
            raise
        if asked is None:
            return Download(fd, 0, size, size, partial=False)
        return Download(fd, asked[0], asked[1], size, partial=True)

    async def _own_file(self, file_id: str, owner: str) -> Json:
        meta = await trio.to_thread.run_sync(self.store.file_meta, file_id)
        if meta is None or meta.get("owner") != owner:
            raise ApiError(404, f"no file {file_id!r}", "file_not_found")
        return meta

    # -- batches ----------------------------------------------------------------------------

    async def _create(self, body: bytes, owner: str) -> Json:
        try:
            doc = json.loads(body)
        except ValueError:
            raise ApiError(400, "request body is not valid JSON", "invalid_json") from None
        if not isinstance(doc, dict):
            raise ApiError(400, "request body must be a JSON object", "invalid_json")
        endpoint = doc.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise ApiError(
                400, f"'endpoint' must be one of {', '.join(ENDPOINTS)}", "invalid_endpoint"
            )
        window = doc.get("completion_window")
        if window not in records.COMPLETION_WINDOWS:
            raise ApiError(400, "'completion_window' must be \"24h\"", "invalid_completion_window")
        problem = records.metadata_problem(doc.get("metadata"))
        if problem is not None:
            raise ApiError(400, problem, "invalid_metadata")
        file_id = doc.get("input_file_id")
        if not isinstance(file_id, str):
            raise ApiError(400, "'input_file_id' is required", "missing_input_file_id")
        meta = await self._own_file(file_id, owner)
        if meta.get("purpose") != "batch":
            raise ApiError(400, f"file {file_id!r} was not uploaded with purpose 'batch'",
                           "invalid_input_file")  # fmt: skip
        record = records.new_batch(
            new_batch_id(),
            owner=owner,
            endpoint=endpoint,
            input_file_id=file_id,
            completion_window=window,
            metadata=doc.get("metadata"),
            now=self.wall_clock(),
        )
        await trio.to_thread.run_sync(self.store.create_batch, record)
        log.info("batch %s created from %s (%s)", record["id"], file_id, endpoint)
        self.poke_worker()
        return records.public_batch(record, None, None)

    async def _list_batches(self, query: dict[str, str], owner: str) -> Json:
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            raise ApiError(400, "'limit' must be an integer", "invalid_limit") from None
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise ApiError(400, f"'limit' must be between 1 and {MAX_LIST_LIMIT}", "invalid_limit")
        after = query.get("after")

        def mine() -> list[Json]:
            out = []
            for batch_id in self.store.batch_ids():
                record = self.store.read_batch(batch_id)
                if record is not None and record.get("owner") == owner:
                    out.append(record)
            return out

        found = sorted(
            await trio.to_thread.run_sync(mine),
            key=lambda r: (r.get("created_at", 0), r["id"]),
            reverse=True,
        )
        if after is not None:
            ids = [r["id"] for r in found]
            found = found[ids.index(after) + 1 :] if after in ids else []
        page = found[:limit]
        data = [await self._public(r) for r in page]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(found) > limit,
        }

    async def _own_batch(self, batch_id: str, owner: str) -> Json:
        record = await trio.to_thread.run_sync(self.store.read_batch, batch_id)
        if record is None or record.get("owner") != owner:
            raise ApiError(404, f"no batch {batch_id!r}", "batch_not_found")
        return record

    async def _public(self, record: Json) -> Json:
        if record.get("status") in records.FINAL:
            return records.public_batch(record, None, None)
        batch_id = record["id"]

        def read() -> tuple[Any, float | None]:
            plan = self.store.read_plan(batch_id)
            return self.store.counts(batch_id, plan), self.store.cancel_requested(batch_id)

        counts, cancel_at = await trio.to_thread.run_sync(read)
        return records.public_batch(record, counts, cancel_at)

    async def _cancel(self, record: Json) -> Json:
        if record.get("status") in records.FINAL:
            if record.get("status") == records.CANCELLED:
                return records.public_batch(record, None, None)
            raise ApiError(
                400,
                f"batch {record['id']!r} is {record.get('status')} and cannot be cancelled",
                "batch_not_cancellable",
            )
        now = self.wall_clock()
        await trio.to_thread.run_sync(self.store.request_cancel, record["id"], now)
        log.info("batch %s: cancel asked", record["id"])
        self.poke_worker()
        return await self._public(record)


def _size(meta: Json) -> int:
    size = meta.get("bytes")
    return size if isinstance(size, int) and size > 0 else 0


def _json(doc: Json) -> tuple[int, bytes, bytes]:
    return 200, json.dumps(doc).encode(), b"application/json"


def _allow(method: str, allowed: str) -> None:
    if method not in allowed.split(", "):
        raise ApiError(405, f"method not allowed; use {allowed}", "method_not_allowed")
