"""The batch store's crash-safety rules, without processes: leases, torn result lines, the
exactly-once merge of segments written by several workers."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.batch import records
from fabricnode.batch import store as store_module
from fabricnode.batch.store import BatchStore, Plan, ShardCounts, valid_id
from fabricnode.batch.validate import request_line, validate_input

NEVER_GONE = staticmethod(lambda holder: False)


def _store(tmp_path: Path) -> tuple[BatchStore, str]:
    store = BatchStore(tmp_path / "batches")
    record = records.new_batch(
        "batch_" + "a" * 24,
        owner="k1",
        endpoint="/v1/chat/completions",
        input_file_id="file-" + "b" * 24,
        completion_window="24h",
        metadata=None,
        now=1000.0,
    )
    store.create_batch(record)
    return store, record["id"]


def _result(cid: str, status: int = 200) -> bytes:
    return json.dumps(
        {
            "id": "batch_req_x",
            "custom_id": cid,
            "error": None,
            "response": {"status_code": status, "request_id": "", "body": {}},
        }
    ).encode()


def test_ids_that_could_name_other_paths_are_refused(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    for bad in ("../etc", "batch_../../x", "file-abc/def", "batch_", "", "batch_a b c d e f"):
        assert not valid_id(bad)
        assert store.read_batch(bad) is None
        assert store.file_meta(bad) is None
    with pytest.raises(ValueError):
        store.batch_dir("batch_../../../tmp")


def test_a_lease_is_exclusive_until_it_expires_or_its_holder_is_gone(tmp_path: Path) -> None:
    store, bid = _store(tmp_path)
    assert store.take_lease(bid, "shard-0", "w1", now=0.0, ttl_s=10, is_gone=lambda h: False)
    assert not store.take_lease(bid, "shard-0", "w2", now=5.0, ttl_s=10, is_gone=lambda h: False)
    # ours again: fine (a worker re-taking its own unit)
    assert store.take_lease(bid, "shard-0", "w1", now=5.0, ttl_s=10, is_gone=lambda h: False)
    # its holder is gone from the mesh: taken over before the expiry
    assert store.take_lease(bid, "shard-0", "w2", now=6.0, ttl_s=10, is_gone=lambda h: h == "w1")
    assert not store.renew_lease(bid, "shard-0", "w1", now=7.0, ttl_s=10)
    assert store.renew_lease(bid, "shard-0", "w2", now=7.0, ttl_s=10)
    # expired: anyone may take it
    assert store.take_lease(bid, "shard-0", "w3", now=100.0, ttl_s=10, is_gone=lambda h: False)
    assert store.live_leases(bid, "shard-", now=101.0, is_gone=lambda h: False) == 1
    store.release_lease(bid, "shard-0", "w2")  # not the holder: nothing happens
    assert store.lease(bid, "shard-0") is not None
    store.release_lease(bid, "shard-0", "w3")
    assert store.live_leases(bid, "shard-", now=101.0, is_gone=lambda h: False) == 0


def test_results_of_several_workers_count_each_custom_id_once(tmp_path: Path) -> None:
    store, bid = _store(tmp_path)
    first = store.segment_path(bid, 0, "w1")
    # w1 answered a and b, and was killed in the middle of writing c
    first.write_bytes(_result("a") + b"\n" + _result("b", 400) + b"\n" + _result("c")[:20])
    # w2 took the shard over; it ran b again (its answer came before w1's line was visible)
    second = store.segment_path(bid, 0, "w2")
    second.write_bytes(_result("b") + b"\n" + _result("c") + b"\n")
    found = store.read_results(bid, 0)
    assert sorted(found) == ["a", "b", "c"]
    assert json.loads(found["b"])["response"]["status_code"] == 400  # w1's, the first
    with store.shard_results(bid, 0) as indexed:
        assert indexed.counts() == ShardCounts(2, 1)
    plan = Plan((0, 1, 2, 3), shard_size=8)
    # Polls read the workers' progress files, not the results: the most advanced one counts.
    assert store.counts(bid, plan) == ShardCounts(0, 0)
    store.write_progress(bid, 0, "w1", ShardCounts(1, 1))
    store.write_progress(bid, 0, "w2", ShardCounts(2, 1))
    assert store.counts(bid, plan) == ShardCounts(2, 1)
    store.mark_done(bid, 0, ShardCounts(2, 1))
    assert store.done_shards(bid) == {0: ShardCounts(2, 1)}
    assert store.counts(bid, plan) == ShardCounts(2, 1)


def test_cancel_is_recorded_once(tmp_path: Path) -> None:
    store, bid = _store(tmp_path)
    assert store.cancel_requested(bid) is None
    assert store.request_cancel(bid, 50.0) == 50.0
    assert store.request_cancel(bid, 60.0) == 50.0
    assert store.cancel_requested(bid) == 50.0
    shown = records.public_batch(store.read_batch(bid) or {}, None, 50.0)
    assert shown["status"] == "validating" or shown["status"] == "cancelling"
    assert "owner" not in shown


def _line(cid: str, *, url: str = "/v1/chat/completions", model: str = "m") -> str:
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": "x"}]},
        }
    )


def test_validation_plans_the_lines_and_skips_blank_ones() -> None:
    data = ("\n".join([_line("a"), "", _line("b"), _line("c")]) + "\n").encode()
    plan = validate_input(data, "/v1/chat/completions", known_model=lambda m: True, shard_size=2)
    assert isinstance(plan, Plan)
    assert plan.lines == 3 and plan.shards == 2
    assert [json.loads(request_line(data, plan, i))["custom_id"] for i in range(3)] == [
        "a",
        "b",
        "c",
    ]
    assert list(plan.shard_lines(1)) == [2]


def test_validation_names_every_problem_by_line() -> None:
    data = "\n".join(
        [
            _line("a"),
            "[1, 2]",
            _line("a"),
            _line("b", url="/v1/embeddings"),
            _line("c", model="nope"),
            json.dumps(
                {
                    "custom_id": "d",
                    "method": "GET",
                    "url": "/v1/chat/completions",
                    "body": {"model": "m"},
                }
            ),
        ]
    ).encode()
    problems = validate_input(
        data, "/v1/chat/completions", known_model=lambda m: m == "m", shard_size=8
    )
    assert isinstance(problems, list)
    assert [(p.line, p.code) for p in problems] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_endpoint"),
        (5, "model_not_found"),
        (6, "invalid_method"),
    ]
    assert (
        validate_input(b"\n\n", "/v1/chat/completions", known_model=lambda m: True, shard_size=8)[
            0
        ].code
        == "empty_file"
    )  # type: ignore[index]
    many = ("\n".join(_line(str(i)) for i in range(5)) + "\n").encode()
    over = validate_input(
        many, "/v1/chat/completions", known_model=lambda m: True, shard_size=8, max_lines=3
    )
    assert isinstance(over, list) and over[0].code == "too_many_requests" and over[0].line == 4


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(st.sampled_from([b"", b"a", b"bb\n", b"\n", b"c" * 15, b"x\n\n"]), max_size=20),
    chunk=st.integers(min_value=1, max_value=9),
)
def test_lines_read_in_small_chunks_are_the_lines_of_the_file(
    pieces: list[bytes], chunk: int
) -> None:
    data = b"".join(pieces)
    expected = []
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        stop = len(data) if nl < 0 else nl
        expected.append((pos, data[pos:stop]))
        pos = stop + 1
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        with patch.object(store_module, "CHUNK_BYTES", chunk):
            assert list(store_module.iter_lines(f.fileno())) == expected


def test_a_shards_input_lines_are_read_by_range_not_the_whole_file(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    data = ("\n".join(_line(f"c{i}") for i in range(100)) + "\n").encode()
    plan = validate_input(data, "/v1/chat/completions", known_model=lambda m: True, shard_size=8)
    assert isinstance(plan, Plan)
    file_id = "file-" + "c" * 24
    store.put_file({"id": file_id}, data)
    reads: list[int] = []
    real_pread = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        reads.append(n)
        return real_pread(fd, n, offset)

    fd = store.open_file(file_id)
    assert fd is not None
    try:
        with patch.object(os, "pread", pread):
            got = store_module.read_lines(fd, plan, plan.shard_lines(3))
    finally:
        os.close(fd)
    assert [json.loads(raw)["custom_id"] for raw in got] == [f"c{i}" for i in range(24, 32)]
    assert sum(reads) == plan.offsets[32] - plan.offsets[24] < len(data) / 10


def test_a_file_written_as_a_stream_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    file_id = "file-" + "d" * 24
    with patch.object(store_module, "CHUNK_BYTES", 10), store.file_writer(file_id) as w:
        for i in range(50):
            w.write_line(b"line %d" % i)
            assert store.read_file(file_id) is None  # nothing under the name until committed
        w.commit()
    assert store.read_file(file_id) == b"".join(b"line %d\n" % i for i in range(50))
    assert w.size == len(store.read_file(file_id) or b"") and w.lines == 50
    with pytest.raises(RuntimeError), store.file_writer("file-" + "e" * 24) as w:
        w.write_line(b"half")
        raise RuntimeError("the finalizer died")
    assert store.read_file("file-" + "e" * 24) is None
    assert not [p for p in store.files_dir.iterdir() if p.name.endswith(".tmp")]
