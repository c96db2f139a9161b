"""The OpenAI Batch API on the mesh, with the official `openai` client against real agents and
simulated engines: upload, create, poll, download; cancel mid-way; validation naming the bad
lines; owners' isolation; and a worker killed with SIGKILL mid-batch, after which the batch
completes from another agent with every custom_id in its output exactly once."""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.dataplane.apikeys import ApiKeyStore
from tests.support.batchfill import fill_done_batch
from tests.support.meshview import state_is

pytestmark = pytest.mark.slow

MODEL = "m"


def batch_file(n: int, *, model: str = MODEL, max_tokens: int = 4, prefix: str = "r") -> bytes:
    lines = [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"line {i}: say something"}],
                "max_tokens": max_tokens,
            },
        }
        for i in range(n)
    ]
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


def wait_for_batch(client: openai.OpenAI, batch_id: str, states: set[str], timeout_s: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in states:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}: {batch}"
        time.sleep(0.2)


def results(client: openai.OpenAI, file_id: str | None) -> list[dict]:  # type: ignore[type-arg]
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture
def fronts(mesh: LocalMesh) -> Iterator[tuple[AgentProcess, list[AgentProcess]]]:
    """An ingress without an engine, and two simulated nodes serving ``MODEL``."""
    front = mesh.start("front")
    nodes = [mesh.start(f"node{i}", args=["--sim", MODEL]) for i in range(2)]
    for node in nodes:
        assert wait_until(lambda n=node: state_is(front, n.session_id, "serving"), 30)
    yield front, nodes


def test_a_2000_line_batch_completes_with_the_openai_client(
    fronts: tuple[AgentProcess, list[AgentProcess]],
) -> None:
    front, nodes = fronts
    client = openai.OpenAI(base_url=front.http_url + "/v1", api_key="unused", max_retries=0)
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(batch_file(2000))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "label"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "label"}
    # any agent answers for any batch
    other = openai.OpenAI(base_url=nodes[0].http_url + "/v1", api_key="unused", max_retries=0)
    assert other.batches.retrieve(batch.id).id == batch.id

    done = wait_for_batch(client, batch.id, {"completed", "failed"}, 240)
    assert done.status == "completed", done.errors
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (2000, 2000)
    assert done.request_counts.failed == 0 and done.error_file_id is None
    out = results(client, done.output_file_id)
    assert [r["custom_id"] for r in out] == [f"r-{i}" for i in range(2000)]  # input order
    first = out[0]
    assert first["response"]["status_code"] == 200 and first["error"] is None
    assert first["response"]["body"]["choices"][0]["message"]["content"]
    assert first["id"].startswith("batch_req_")
    assert any(b.id == batch.id for b in client.batches.list())


def test_cancel_mid_way_keeps_the_completed_lines(
    fronts: tuple[AgentProcess, list[AgentProcess]],
) -> None:
    front, _ = fronts
    client = openai.OpenAI(base_url=front.http_url + "/v1", api_key="unused", max_retries=0)
    # long answers, so that the batch is still running when it is cancelled
    data = batch_file(3000, max_tokens=64)
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def some_done() -> bool:
        counts = client.batches.retrieve(batch.id).request_counts
        return counts is not None and counts.completed >= 50

    assert wait_until(some_done, 120)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for_batch(client, batch.id, {"cancelled"}, 120)
    assert done.cancelled_at is not None and done.cancelling_at is not None
    out = results(client, done.output_file_id)
    assert done.request_counts is not None
    assert 50 <= done.request_counts.completed == len(out) < 3000
    ids = [r["custom_id"] for r in out]
    assert len(ids) == len(set(ids))
    assert all(r["response"]["status_code"] == 200 for r in out)


def test_validation_fails_the_batch_and_names_each_bad_line(
    fronts: tuple[AgentProcess, list[AgentProcess]],
) -> None:
    front, _ = fronts
    client = openai.OpenAI(base_url=front.http_url + "/v1", api_key="unused", max_retries=0)
    good = json.loads(batch_file(1).decode())
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({**good, "custom_id": "x3", "url": "/v1/embeddings"}),
        json.dumps({**good, "custom_id": "x4", "body": {**good["body"], "model": "no-such-model"}}),
        json.dumps(good),  # custom_id r-0 again
        json.dumps({k: v for k, v in good.items() if k != "custom_id"}),
    ]
    uploaded = client.files.create(
        file=("bad.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    failed = wait_for_batch(client, batch.id, {"failed", "completed"}, 60)
    assert failed.status == "failed" and failed.failed_at is not None
    assert failed.errors is not None and failed.errors.data is not None
    found = {(e.line, e.code) for e in failed.errors.data}
    assert found == {
        (2, "invalid_json_line"),
        (3, "mismatched_endpoint"),
        (4, "model_not_found"),
        (5, "duplicate_custom_id"),
        (6, "missing_custom_id"),
    }

    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_0123456789abcdef01234567")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")


def test_a_batch_survives_its_worker_killed_with_sigkill(mesh: LocalMesh) -> None:
    """Only one agent works batches at first (the others run --batch-concurrency 0); it is
    killed mid-batch; a second worker that joins finishes it from where the first stopped."""
    front = mesh.start("front", args=["--batch-concurrency", "0"])
    nodes = [
        mesh.start(f"node{i}", args=["--sim", MODEL, "--batch-concurrency", "0"]) for i in range(2)
    ]
    for node in nodes:
        assert wait_until(lambda n=node: state_is(front, n.session_id, "serving"), 30)
    worker = mesh.start("worker", args=["--batch-concurrency", "16"])
    client = openai.OpenAI(base_url=front.http_url + "/v1", api_key="unused", max_retries=0)
    n = 1500
    uploaded = client.files.create(
        file=("in.jsonl", io.BytesIO(batch_file(n, max_tokens=16))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def progressed() -> bool:
        counts = client.batches.retrieve(batch.id).request_counts
        return counts is not None and counts.completed >= 300

    assert wait_until(progressed, 120)
    worker.kill()  # SIGKILL: leases held, segments possibly with a torn last line
    mid = client.batches.retrieve(batch.id)
    assert mid.status == "in_progress" and mid.request_counts is not None
    assert mid.request_counts.completed < n

    mesh.start("worker2", args=["--batch-concurrency", "16"])
    done = wait_for_batch(client, batch.id, {"completed", "failed"}, 240)
    assert done.status == "completed"
    out = results(client, done.output_file_id) + results(client, done.error_file_id)
    counted = Counter(r["custom_id"] for r in out)
    assert set(counted) == {f"r-{i}" for i in range(n)}  # none lost
    assert max(counted.values()) == 1  # none twice
    assert done.request_counts is not None and done.request_counts.completed == n


def test_a_batch_belongs_to_the_key_that_created_it(mesh: LocalMesh) -> None:
    """With API keys on, the worker runs a key's batch as that key; another key neither sees,
    reads nor cancels it, and a request without a key gets 401."""
    store = ApiKeyStore(mesh.workdir / "api-keys.json", enabled=True)
    alice, bob = store.new_key("alice")[0], store.new_key("bob")[0]
    store.save()
    front = mesh.start("front")
    node = mesh.start("node", args=["--sim", MODEL])
    a = openai.OpenAI(base_url=front.http_url + "/v1", api_key=alice, max_retries=0)
    # the registry needs an admin key: an ordinary key sees the model list
    assert wait_until(lambda: [m.id for m in a.models.list().data] == [MODEL], 30)
    assert node.session_id
    b = openai.OpenAI(base_url=front.http_url + "/v1", api_key=bob, max_retries=0)
    nobody = openai.OpenAI(base_url=front.http_url + "/v1", api_key="not-a-key", max_retries=0)

    uploaded = a.files.create(file=("in.jsonl", io.BytesIO(batch_file(40))), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        b.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    batch = a.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        b.batches.cancel(batch.id)
    assert [x.id for x in b.batches.list()] == []
    with pytest.raises(openai.AuthenticationError):
        nobody.batches.list()

    done = wait_for_batch(a, batch.id, {"completed", "failed"}, 120)
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == 40
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id or "")
    assert len(results(a, done.output_file_id)) == 40


def test_two_keys_batches_complete_at_equal_rates_whatever_their_size(mesh: LocalMesh) -> None:
    """Key a submits ten times key b's lines; while both batches run, the worker's round robin
    over owners and the gate's fair queue give them the same completion rate."""
    store = ApiKeyStore(mesh.workdir / "api-keys.json", enabled=True)
    key_a, key_b = store.new_key("a")[0], store.new_key("b")[0]
    store.save()
    front = mesh.start("front", args=["--batch-concurrency", "32"])
    # four sequences at once: the engine queues beyond them, so batch lines wait in the gate
    node = mesh.start(
        "node", args=["--sim", MODEL, "--sim-args", "--max-num-seqs 4", "--batch-concurrency", "0"]
    )
    a = openai.OpenAI(base_url=front.http_url + "/v1", api_key=key_a, max_retries=0)
    b = openai.OpenAI(base_url=front.http_url + "/v1", api_key=key_b, max_retries=0)
    assert wait_until(lambda: [m.id for m in a.models.list().data] == [MODEL], 30)
    assert node.session_id

    def submit(client: openai.OpenAI, n: int, prefix: str) -> str:
        data = batch_file(n, max_tokens=16, prefix=prefix)
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        return client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id

    big, small = submit(a, 2000, "a"), submit(b, 200, "b")

    def done(client: openai.OpenAI, batch_id: str) -> int:
        counts = client.batches.retrieve(batch_id).request_counts
        return counts.completed if counts is not None else 0

    assert wait_until(lambda: done(a, big) >= 20 and done(b, small) >= 20, 60)
    a0, b0 = done(a, big), done(b, small)
    assert wait_until(lambda: done(b, small) >= b0 + 100, 120)  # b still backlogged here
    a1, b1 = done(a, big), done(b, small)
    got_a, got_b = a1 - a0, b1 - b0
    print(f"completions while both batches ran: a {got_a}, b {got_b}")
    assert abs(got_a - got_b) <= 0.2 * max(got_a, got_b), (got_a, got_b)
    assert done(a, big) < 2000  # a was backlogged all along
    a.batches.cancel(big)


def test_uploads_are_bounded_per_key_and_per_store_and_many_part_forms_refused(
    mesh: LocalMesh,
) -> None:
    """Before, uploads had no quota (1 GiB from one key in seconds) and a form of hundreds of
    thousands of tiny parts was walked on the event loop. Now a key's files and the store are
    bounded, with a 413 that says what to delete, and such a form is a 400."""
    store = ApiKeyStore(mesh.workdir / "api-keys.json", enabled=True)
    alice, bob, carol = (store.new_key(name)[0] for name in ("alice", "bob", "carol"))
    store.save()
    kib = 1024 / 1024**3  # one KiB in GB, as the flags take it
    front = mesh.start(
        "front", args=["--batch-key-quota-gb", f"{5 * kib}", "--batch-store-quota-gb", f"{8 * kib}"]
    )
    a = openai.OpenAI(base_url=front.http_url + "/v1", api_key=alice, max_retries=0)
    b = openai.OpenAI(base_url=front.http_url + "/v1", api_key=bob, max_retries=0)
    c = openai.OpenAI(base_url=front.http_url + "/v1", api_key=carol, max_retries=0)
    three_kib = b"x" * 3 * 1024

    first = a.files.create(file=("a.jsonl", io.BytesIO(three_kib)), purpose="batch")
    with pytest.raises(openai.APIStatusError) as raised:
        a.files.create(file=("b.jsonl", io.BytesIO(three_kib)), purpose="batch")
    assert raised.value.status_code == 413
    assert raised.value.body["code"] == "key_quota_exceeded"  # type: ignore[index]
    assert "DELETE /v1/files" in raised.value.body["message"]  # type: ignore[index]
    b.files.create(file=("c.jsonl", io.BytesIO(three_kib)), purpose="batch")  # 6 KiB in all
    with pytest.raises(openai.APIStatusError) as raised:  # carol's first, but the store is full
        c.files.create(file=("d.jsonl", io.BytesIO(three_kib)), purpose="batch")
    assert raised.value.status_code == 413
    assert raised.value.body["code"] == "store_quota_exceeded"  # type: ignore[index]
    a.files.delete(first.id)  # room again, for alice
    a.files.create(file=("e.jsonl", io.BytesIO(three_kib)), purpose="batch")

    boundary = "b0undary"
    tiny = f'--{boundary}\r\nContent-Disposition: form-data; name="x"\r\n\r\n1\r\n' * 100_000
    purpose = f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    form = tiny + purpose + f"--{boundary}--\r\n"
    r = httpx.post(
        front.http_url + "/v1/files",
        content=form.encode(),
        headers={
            "authorization": f"Bearer {alice}",
            "content-type": f"multipart/form-data; boundary={boundary}",
        },
        timeout=30,
    )
    assert r.status_code == 400 and "more than 16 parts" in r.json()["error"]["message"]


def test_a_large_output_is_finalized_and_downloaded_whole_through_the_ingress(
    mesh: LocalMesh,
) -> None:
    """Before, finalizing joined every result in memory and a download was assembled whole by
    the ingress. Now both stream: a batch whose shards are all answered (written in the store's
    layout, some answers twice) is finalized by an agent's worker, and its output and error
    files come back byte for byte through the ingress, whole or by range."""
    filled = fill_done_batch(mesh.workdir / "batches", lines=2000, result_bytes=3000)
    assert filled.output_bytes > 5 * 1024 * 1024
    front = mesh.start("front")
    client = openai.OpenAI(base_url=front.http_url + "/v1", api_key="unused", max_retries=0)
    done = wait_for_batch(client, filled.batch_id, {"completed", "failed", "expired"}, 60)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (
        filled.completed,
        filled.failed,
    )
    assert done.output_file_id and done.error_file_id
    output = client.files.content(done.output_file_id).content
    assert len(output) == filled.output_bytes
    assert hashlib.sha256(output).hexdigest() == filled.output_sha256
    errors = client.files.content(done.error_file_id).content
    assert hashlib.sha256(errors).hexdigest() == filled.error_sha256

    url = f"{front.http_url}/v1/files/{done.output_file_id}/content"
    with httpx.Client(timeout=30) as http:
        with http.stream("GET", url) as r:
            assert r.headers["content-length"] == str(len(output))
            assert b"".join(r.iter_bytes()) == output
        part = http.get(url, headers={"range": "bytes=1000000-2999999"})
        assert part.status_code == 206 and part.content == output[1_000_000:3_000_000]
        assert part.headers["content-range"] == f"bytes 1000000-2999999/{len(output)}"
        # the connection still serves requests after the streamed answers
        assert http.get(f"{front.http_url}/v1/batches/{filled.batch_id}").status_code == 200
