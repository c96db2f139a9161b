"""The Batch API's file downloads, against a store in a temporary directory: a file's content
goes out as a stream of bounded pieces with its length known; one byte range is served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fabricnode.batch import api as api_module
from fabricnode.batch import records
from fabricnode.batch.api import ApiError, BatchApi, byte_range
from fabricnode.batch.store import BatchStore
from fabricnode.dataplane.asgi_call import OWNER_SCOPE

FILE_ID = "file-" + "a" * 24


def test_one_byte_range_is_taken_and_others_send_the_whole_file() -> None:
    assert byte_range(None, 100) is None
    assert byte_range(b"bytes=0-9", 100) == (0, 10)
    assert byte_range(b"bytes=90-", 100) == (90, 10)
    assert byte_range(b"bytes=90-500", 100) == (90, 10)
    assert byte_range(b"bytes=-5", 100) == (95, 5)
    assert byte_range(b"bytes=0-1,5-6", 100) is None  # several ranges: the whole file
    assert byte_range(b"items=0-1", 100) is None
    for past in (b"bytes=100-", b"bytes=5-2", b"bytes=-0"):
        with pytest.raises(ApiError) as raised:
            byte_range(past, 100)
        assert raised.value.status == 416
        assert raised.value.headers == [(b"content-range", b"bytes */100")]


async def _get(app: BatchApi, path: str, headers: list[tuple[bytes, bytes]]) -> list[Any]:
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"method": "GET", "path": path, "headers": headers, OWNER_SCOPE: "k1"}
    await app(scope, receive, send)
    return sent


async def test_a_download_is_streamed_in_bounded_pieces_with_its_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_module, "DOWNLOAD_CHUNK_BYTES", 1000)
    store = BatchStore(tmp_path)
    content = bytes(range(256)) * 40  # 10,240 bytes
    meta = records.new_file(
        FILE_ID, owner="k1", filename="x.jsonl", purpose="batch", size=len(content), now=0.0
    )
    store.put_file(meta, content)
    app = BatchApi(store, wall_clock=lambda: 0.0, max_file_bytes=1 << 20)

    start, *pieces = await _get(app, f"/v1/files/{FILE_ID}/content", [])
    assert start["status"] == 200
    assert (b"content-length", b"10240") in start["headers"]
    assert len(pieces) == 11 and max(len(p["body"]) for p in pieces) == 1000
    assert [p["more_body"] for p in pieces] == [True] * 10 + [False]
    assert b"".join(p["body"] for p in pieces) == content

    start, *pieces = await _get(
        app, f"/v1/files/{FILE_ID}/content", [(b"range", b"bytes=2500-4999")]
    )
    assert start["status"] == 206
    assert (b"content-range", b"bytes 2500-4999/10240") in start["headers"]
    assert b"".join(p["body"] for p in pieces) == content[2500:5000]

    start, body = await _get(app, f"/v1/files/{FILE_ID}/content", [(b"range", b"bytes=20000-")])
    assert start["status"] == 416 and b"range_not_satisfiable" in body["body"]
    # someone else's file does not exist for this key
    app_other = await _get(app, "/v1/files/" + "file-" + "b" * 24 + "/content", [])
    assert app_other[0]["status"] == 404
