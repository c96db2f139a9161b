"""Stateful requests across sites with real agents on loopback: site A (a gateway and an
ingress with API keys on), site C (a gateway, an ingress and a simulated node), each its own
cluster key and mesh. A Responses conversation with a model only C serves is continued from
A (the response is stored at C, its id names C), only by the key that started it; reading it
is answered at C and refused at A with where it is; a batch at A for that model completes
through the gateways."""

from __future__ import annotations

import io
import re
from pathlib import Path

import httpx
import pytest

from cli.localmesh import LocalMesh, wait_until
from fabricnode.dataplane.apikeys import ApiKeyStore
from fabricnode.federation.keygen import generate_site_key
from tests.support.meshview import free_port
from tests.system.test_batch_api import batch_file, results, wait_for_batch
from tests.system.test_federation import gateway_args, peer_dir, sites_of

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow
MODEL = "sim-remote"


def test_a_conversation_and_a_batch_with_a_model_only_another_site_serves(
    tmp_path: Path,
) -> None:
    key_a = generate_site_key("A", tmp_path / "key-A")
    key_c = generate_site_key("C", tmp_path / "key-C")
    port_a, port_c = free_port(), free_port()
    keys_path = tmp_path / "a-api-keys.json"
    store = ApiKeyStore(keys_path, enabled=True)
    alice = store.new_key("alice")[0]
    bob = store.new_key("bob")[0]
    store.save()
    with LocalMesh(tmp_path / "site-a") as site_a, LocalMesh(tmp_path / "site-c") as site_c:
        c_node = site_c.start("c-node", args=["--site", "C", "--sim", MODEL])
        c_ingress = site_c.start("c-ingress", args=["--site", "C"])
        site_c.start(
            "c-gateway",
            args=gateway_args(
                key_c, peer_dir(tmp_path, "C", key_a), port_c, f"A=127.0.0.1:{port_a}"
            ),
        )
        gw_a = site_a.start(
            "a-gateway",
            args=gateway_args(
                key_a, peer_dir(tmp_path, "A", key_c), port_a, f"C=127.0.0.1:{port_c}"
            ),
        )
        ingress = site_a.start("a-ingress", args=["--site", "A", "--api-keys", str(keys_path)])

        def c_serves() -> bool:
            row = sites_of(gw_a).get("C")
            models = (row or {}).get("summary", {}) or {}
            return bool(row and row["routable"] and models.get("models", {}).get(MODEL))

        assert wait_until(c_serves, 40), sites_of(gw_a)

        def client(key: str, url: str = ingress.http_url) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)

        # A gateway is known to A's ingress once its entry arrived: wait for the first answer.
        def answered() -> bool:
            try:
                client(alice).responses.create(model=MODEL, input="ping", max_output_tokens=1)
            except openai.APIStatusError:
                return False
            return True

        assert wait_until(answered, 20)

        # a conversation: stored at C (its id names C), continued from A by its own key
        raw = client(alice).responses.with_raw_response.create(
            model=MODEL, input="hello from A", max_output_tokens=4
        )
        first = raw.parse()
        assert raw.headers["x-fabric-site"] == "C" and raw.headers["x-fabric-node"] == (
            c_node.session_id
        )
        assert first.id.endswith("_C") and first.id[5:37] == c_node.session_id
        assert first.output_text.strip()
        follow = client(alice).responses.create(
            model=MODEL, input="and then?", previous_response_id=first.id, max_output_tokens=4
        )
        assert follow.previous_response_id == first.id and follow.id.endswith("_C")
        streamed = client(alice).responses.create(
            model=MODEL,
            input="stream it",
            previous_response_id=follow.id,
            max_output_tokens=4,
            stream=True,
        )
        kinds = [event.type for event in streamed]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds

        # another key of A may not continue it: the 404 of an unknown id, decided at C
        with pytest.raises(openai.NotFoundError) as refused:
            client(bob).responses.create(
                model=MODEL, input="mine now", previous_response_id=first.id, max_output_tokens=2
            )
        assert "not found" in str(refused.value)

        # reading it: at C's ingress (keys off there: no owners), not at A, which says where
        stored = client("none", c_ingress.http_url).responses.retrieve(first.id)
        assert stored.id == first.id and stored.output_text == first.output_text
        with pytest.raises(openai.NotFoundError) as elsewhere:
            client(alice).responses.retrieve(first.id)
        assert "stored at site 'C'" in str(elsewhere.value)

        # a batch at A for the model only C serves: every line answered through the gateways,
        # each by C's node (the forwards its agent took)
        before = c_served(c_node.http_url)
        batches = client(alice)
        uploaded = batches.files.create(
            file=("in.jsonl", io.BytesIO(batch_file(20, model=MODEL))), purpose="batch"
        )
        batch = batches.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_for_batch(batches, batch.id, {"completed", "failed", "expired"}, 60)
        assert done.status == "completed", done
        assert done.request_counts is not None and done.request_counts.completed == 20, done
        rows = results(batches, done.output_file_id)
        assert sorted(r["custom_id"] for r in rows) == sorted(f"r-{i}" for i in range(20))
        assert {r["response"]["status_code"] for r in rows} == {200}
        assert c_served(c_node.http_url) - before == 20


def c_served(url: str) -> int:
    """Requests that reached a node (every forward its agent took)."""
    page = httpx.get(f"{url}/metrics", timeout=5).text
    found = re.findall(r"^fabric_forward_requests_total\{[^}]*\} (\S+)$", page, re.M)
    return int(sum(float(v) for v in found))
