"""`fabric batch` against real agents and simulated engines: a file of plain prompts submitted
with --wait --output comes back with a result for every line; status, list, cancel and results;
a file the agents refuse names its bad lines; Ctrl-C stops only the waiting; with API keys on,
a batch is its key's alone."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from cli.main import app
from fabricnode.dataplane.apikeys import ApiKeyStore
from tests.support.meshview import fabric, state_is

pytestmark = pytest.mark.slow

MODEL = "m"


@dataclass
class Mesh:
    local: LocalMesh
    front: AgentProcess  # an ingress without an engine
    node: AgentProcess  # a simulated engine serving MODEL

    @property
    def url(self) -> str:
        return self.front.http_url


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """One mesh for the module: every test makes its own batches (the ingress runs open, so
    they all belong to the same owner, ``-``)."""
    local = LocalMesh(tmp_path_factory.mktemp("batch-cli"))
    try:
        front = local.start("front")
        node = local.start("node0", args=["--sim", MODEL])
        assert wait_until(lambda: state_is(front, node.session_id, "serving"), 30)
        yield Mesh(local, front, node)
    finally:
        local.close()
        for agent in local.agents:
            print(f"--- {agent.name} (exit {agent.proc.returncode}) ---\n{agent.stderr_tail(20)}")


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for key in ("FABRIC_AGENT", "FABRIC_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    return CliRunner()


def batch_cmd(runner: CliRunner, url: str, *args: str) -> Result:
    return runner.invoke(app, ["--agent", url, "batch", *args])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_prompts(path: Path, n: int) -> Path:
    path.write_text("".join(f"Question {i}: say something.\n" for i in range(n)))
    return path


def submitted(runner: CliRunner, url: str, *args: str) -> str:
    result = batch_cmd(runner, url, "submit", *args)
    assert result.exit_code == 0, result.output
    batch_id = result.stdout.strip()
    assert batch_id.startswith("batch_"), result.stdout
    return batch_id


def status_of(runner: CliRunner, url: str, batch_id: str) -> dict[str, Any]:
    result = batch_cmd(runner, url, "status", batch_id, "--json")
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def test_plain_prompts_with_wait_and_output_come_back_one_result_per_line(
    sim: Mesh, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "What is the capital of France?\n"
        "\n"  # blank: no request, and the numbering goes on
        '"A JSON string is a prompt too"\n'
        '{"messages": [{"role": "user", "content": "a body"}], "custom_id": "mine"}\n'
        + "".join(f"Prompt number {i}\n" for i in range(40))
    )
    out = tmp_path / "results.jsonl"
    # as a researcher runs it: a subprocess, stderr not a terminal (one status line per state)
    done = fabric(
        sim.local,
        sim.front,
        *("batch", "submit", str(prompts), "--model", MODEL, "--max-tokens", "8"),
        *("--metadata", "project=demo", "--wait", "--output", str(out)),
        timeout_s=180,
    )
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.strip()
    assert batch_id.startswith("batch_")
    assert "43 requests (42 of them prompts)" in done.stderr
    assert f"{batch_id}: completed, 43/43 done, 0 failed" in done.stderr
    assert f"43 results in {out}" in done.stderr

    results = read_jsonl(out)
    expected = {"line-1", "line-3", "mine", *(f"line-{i + 5}" for i in range(40))}
    assert {r["custom_id"] for r in results} == expected and len(results) == 43
    for r in results:
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["model"] == MODEL and body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] <= 8
    assert not (tmp_path / "results.errors.jsonl").exists()

    doc = status_of(CliRunner(), sim.url, batch_id)
    assert doc["metadata"] == {"project": "demo"} and doc["status"] == "completed"


def test_status_list_and_results_of_a_batch(
    sim: Mesh, runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch_id = submitted(
        runner, sim.url, str(write_prompts(tmp_path / "p.txt", 30)), "--model", MODEL
    )
    first = status_of(runner, sim.url, batch_id)
    assert first["id"] == batch_id and first["endpoint"] == "/v1/chat/completions"
    assert first["status"] in ("in_progress", "finalizing", "completed"), "validated by then"

    waited = batch_cmd(runner, sim.url, "status", batch_id, "--wait")
    assert waited.exit_code == 0, waited.output
    rows = dict(line.split(None, 1) for line in waited.stdout.strip().splitlines())
    assert rows["status"] == "completed" and rows["requests"] == "30/30 done, 0 failed"
    assert rows["output_file"].startswith("file-") and rows["error_file"] == "-"

    table = batch_cmd(runner, sim.url, "list")
    assert table.exit_code == 0, table.output
    lines = table.stdout.strip().splitlines()
    assert lines[0].split() == [
        "ID", "STATUS", "ENDPOINT", "COMPLETED", "FAILED", "TOTAL", "CREATED"
    ]  # fmt: skip
    row = next(line.split() for line in lines if line.startswith(batch_id))
    assert row[1:6] == ["completed", "/v1/chat/completions", "30", "0", "30"]
    assert lines[-1].endswith("batches") or lines[-1].endswith("batch")
    listed = json.loads(batch_cmd(runner, sim.url, "list", "--json", "--limit", "100").stdout)
    assert list(listed) == ["batches", "has_more"]
    assert batch_id in [b["id"] for b in listed["batches"]]
    one = json.loads(batch_cmd(runner, sim.url, "list", "--json", "--limit", "1").stdout)
    assert len(one["batches"]) == 1

    # results: to stdout (the count on stderr), then to a file
    shown = batch_cmd(runner, sim.url, "results", batch_id)
    assert shown.exit_code == 0, shown.output
    assert len(shown.stdout.strip().splitlines()) == 30
    assert f"batch {batch_id} completed: 30 succeeded, 0 failed" in shown.stderr
    out = tmp_path / "r.jsonl"
    saved = batch_cmd(runner, sim.url, "results", batch_id, "--output", str(out), "--json")
    assert saved.exit_code == 0, saved.output
    assert json.loads(saved.stdout) == {
        "id": batch_id,
        "status": "completed",
        "output": {"path": str(out), "lines": 30},
        "errors": None,
    }
    assert sorted(r["custom_id"] for r in read_jsonl(out)) == sorted(
        f"line-{i + 1}" for i in range(30)
    )

    # any agent answers for any batch, and $FABRIC_AGENT names it
    monkeypatch.setenv("FABRIC_AGENT", sim.node.http_url)
    assert runner.invoke(app, ["batch", "status", batch_id, "--json"]).exit_code == 0


def test_cancel_keeps_what_ran_and_a_cancelled_wait_exits_1(
    sim: Mesh, runner: CliRunner, tmp_path: Path
) -> None:
    # long answers, so that the batch is still running when it is cancelled
    batch_id = submitted(
        runner,
        sim.url,
        *(str(write_prompts(tmp_path / "long.txt", 1500)), "--model", MODEL),
        *("--max-tokens", "256"),
    )

    def some_done() -> bool:
        return int(status_of(runner, sim.url, batch_id)["request_counts"]["completed"]) >= 10

    assert wait_until(some_done, 120)
    cancelled = batch_cmd(runner, sim.url, "cancel", batch_id)
    assert cancelled.exit_code == 0, cancelled.output
    assert cancelled.stdout.startswith(f"cancelling batch {batch_id}: ") or (
        cancelled.stdout.startswith(f"batch {batch_id} is cancelled")
    )

    waited = batch_cmd(runner, sim.url, "status", batch_id, "--wait", "--json")
    assert waited.exit_code == 1, "a wait that ends cancelled is not a success"
    final = json.loads(waited.stdout)
    assert final["status"] == "cancelled"
    completed = final["request_counts"]["completed"]
    assert 10 <= completed < 1500

    out = tmp_path / "partial.jsonl"
    saved = batch_cmd(runner, sim.url, "results", batch_id, "--output", str(out))
    assert saved.exit_code == 0, saved.output
    results = read_jsonl(out)
    assert len(results) == completed
    assert all(r["response"]["status_code"] == 200 for r in results)

    again = batch_cmd(runner, sim.url, "cancel", batch_id)
    assert again.exit_code == 0 and again.stdout.startswith(f"batch {batch_id} is cancelled")


def test_a_file_the_agents_refuse_names_its_lines_and_exits_1(
    sim: Mesh, runner: CliRunner, tmp_path: Path
) -> None:
    good = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    }
    path = tmp_path / "batch.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps(good),
                json.dumps({**good, "custom_id": "b", "url": "/v1/embeddings"}),
                "",
                json.dumps({**good, "custom_id": "a"}),  # a again
                json.dumps({**good, "custom_id": "c", "body": {**good["body"], "model": "nope"}}),
            ]
        )
        + "\n"
    )
    result = batch_cmd(runner, sim.url, "submit", str(path))
    assert result.exit_code == 1, result.output
    batch_id = result.stdout.strip()
    assert batch_id.startswith("batch_"), "the batch was created, then failed validation"
    lines = result.stderr.strip().splitlines()
    assert lines[-4] == (
        f"fabric: error: batch {batch_id} failed: its input file did not validate (3 problems):"
    )
    assert lines[-3].startswith(f"  {path}:2: 'url' '/v1/embeddings' is not the batch's endpoint")
    assert lines[-2] == f"  {path}:4: custom_id 'a' is used by an earlier line"
    assert lines[-1].startswith(f"  {path}:5: model 'nope' is not served")

    # the same problems from status (exit 0: it read the batch) and results (exit 1)
    shown = batch_cmd(runner, sim.url, "status", batch_id)
    assert shown.exit_code == 0
    assert re.search(r"^status +failed$", shown.stdout, re.MULTILINE), shown.stdout
    assert "  line 4: custom_id 'a' is used by an earlier line" in shown.stdout
    refused = batch_cmd(runner, sim.url, "results", batch_id)
    assert refused.exit_code == 1 and "line 2:" in refused.stderr

    # --wait on a batch that fails exits 1 too
    waited = fabric(sim.local, sim.front, "batch", "submit", str(path), "--wait", timeout_s=60)
    assert waited.returncode == 1 and f"{path}:5: model 'nope'" in waited.stderr


def test_unknown_batches_and_refusals_are_one_line_and_exit_1(
    sim: Mesh, runner: CliRunner, tmp_path: Path
) -> None:
    for args in (["status", "batch_0123456789abcdef01234567"], ["cancel", "batch_nope"]):
        result = batch_cmd(runner, sim.url, *args)
        assert result.exit_code == 1
        (line,) = result.stderr.strip().splitlines()
        assert f"no batch {args[1]!r} at {sim.url}" in line and "fabric batch list" in line

    batch_id = submitted(
        runner, sim.url, str(write_prompts(tmp_path / "p.txt", 3)), "--model", MODEL
    )
    assert wait_until(lambda: status_of(runner, sim.url, batch_id)["status"] == "completed", 60)
    refused = batch_cmd(runner, sim.url, "cancel", batch_id)
    assert refused.exit_code == 1
    (line,) = refused.stderr.strip().splitlines()
    assert "is completed and cannot be cancelled" in line


def _as_in_a_terminal() -> None:
    """In the child: SIGINT as a terminal delivers it. A test run started in the background
    (``make test &``) ignores SIGINT, its children inherit that, and Python then never turns
    Ctrl-C into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_the_waiting_and_the_batch_goes_on(sim: Mesh, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.txt", 600)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "--agent", sim.url, "batch", "submit", str(prompts),
         "--model", MODEL, "--max-tokens", "256", "--wait"],
        env=sim.local.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_in_a_terminal,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        batch_id = proc.stdout.readline().strip()  # printed before the waiting starts
        assert batch_id.startswith("batch_")
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"stopped waiting; batch {batch_id} goes on. Follow it again: fabric batch status "
        f"{batch_id} --wait; cancel it: fabric batch cancel {batch_id}"
    )
    resumed = fabric(sim.local, sim.front, "batch", "status", batch_id, "--wait", timeout_s=240)
    assert resumed.returncode == 0, resumed.stderr
    assert "requests     600/600 done, 0 failed" in resumed.stdout


def test_with_api_keys_a_batch_is_its_keys_alone(mesh: LocalMesh, runner: CliRunner) -> None:
    keys = mesh.workdir / "api-keys.json"
    store = ApiKeyStore(keys, enabled=True)
    alice, _ = store.new_key("alice")
    bob, _ = store.new_key("bob")
    agent = mesh.start("solo", args=["--sim", MODEL, "--api-keys", str(keys)])

    def serving() -> bool:
        headers = {"authorization": f"Bearer {alice}"}
        listed = httpx.get(f"{agent.http_url}/v1/models", headers=headers, timeout=2.0).json()
        return MODEL in [m["id"] for m in listed["data"]]

    assert wait_until(serving, 30)
    prompts = write_prompts(mesh.workdir / "p.txt", 2)

    nokey = batch_cmd(runner, agent.http_url, "submit", str(prompts), "--model", MODEL)
    assert nokey.exit_code == 1
    (line,) = nokey.stderr.strip().splitlines()
    assert "(HTTP 401)" in line and "give your API key (fabric --api-key KEY" in line

    as_alice = runner.invoke(
        app,
        ["--agent", agent.http_url, "--api-key", alice, "batch", "submit", str(prompts),
         "--model", MODEL, "--wait"],
    )  # fmt: skip
    assert as_alice.exit_code == 0, as_alice.output
    batch_id = as_alice.stdout.strip()

    def as_bob(*args: str) -> Result:
        return runner.invoke(app, ["--agent", agent.http_url, "batch", *args], env={
            "FABRIC_API_KEY": bob})  # fmt: skip

    assert as_bob("status", batch_id).exit_code == 1
    assert "no batch" in as_bob("results", batch_id).stderr
    assert batch_id not in as_bob("list", "--json").stdout
    mine = runner.invoke(
        app, ["--agent", agent.http_url, "batch", "list", "--json"], env={"FABRIC_API_KEY": alice}
    )
    assert [b["id"] for b in json.loads(mine.stdout)["batches"]] == [batch_id]
