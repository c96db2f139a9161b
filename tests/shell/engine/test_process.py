"""Engine child supervision with real processes: readiness, output, stop, no orphans."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import trio

from fabricnode.engine.command import sim_engine_command
from fabricnode.engine.process import (
    EngineError,
    EngineProcess,
    ServedModel,
    parse_models,
    wait_ready,
)
from tests.support import SUPPORT
from tests.support.meshview import free_port

STUB_ENGINE = SUPPORT / "stub_engine.py"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def engine_argv(
    tmp_path: Path, port: int, load_s: float = 0.3, ignore_term: bool = False
) -> list[str]:
    return [sys.executable, str(STUB_ENGINE), str(port), str(load_s), "1" if ignore_term else "0"]


def worker_pid(log_path: Path) -> int:
    for line in log_path.read_text().splitlines():
        if line.startswith("worker "):
            return int(line.split()[1])
    raise AssertionError("no worker line in the engine log")


async def test_engine_becomes_ready_and_stop_leaves_no_process(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "logs" / "engine.log"
    engine = EngineProcess(engine_argv(tmp_path, port), log_path=log_path, kill_after_s=5)
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        pid = await nursery.start(engine.run)
        with trio.fail_after(20):
            models = await wait_ready(f"http://127.0.0.1:{port}", client=client)
        assert models == [ServedModel("tiny-llama", 512)]
        assert "loading weights" in log_path.read_text()  # output forwarded to the job log
        worker = worker_pid(log_path)
        assert alive(pid) and alive(worker)
        code = await engine.stop()
        nursery.cancel_scope.cancel()
    assert code is not None and engine.exited.is_set()
    await trio.sleep(0.2)
    assert not alive(pid)
    assert not alive(worker)  # the whole process group went


async def test_engine_ignoring_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    port = free_port()
    engine = EngineProcess(
        engine_argv(tmp_path, port, ignore_term=True), log_path=tmp_path / "e.log", kill_after_s=0.5
    )
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        pid = await nursery.start(engine.run)
        with trio.fail_after(20):
            await wait_ready(f"http://127.0.0.1:{port}", client=client)
        t0 = time.monotonic()
        code = await engine.stop()
        assert time.monotonic() - t0 < 5
        nursery.cancel_scope.cancel()
    assert code == -signal.SIGKILL
    assert not alive(pid)


async def test_cancelling_the_supervisor_stops_the_engine(tmp_path: Path) -> None:
    port = free_port()
    engine = EngineProcess(engine_argv(tmp_path, port), log_path=tmp_path / "e.log", kill_after_s=5)
    async with trio.open_nursery() as nursery:
        pid = await nursery.start(engine.run)
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    await trio.sleep(0.2)
    assert not alive(pid)
    assert not alive(worker_pid(tmp_path / "e.log"))


async def test_wait_ready_fails_when_the_engine_exits_while_loading(tmp_path: Path) -> None:
    engine = EngineProcess([sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"])
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        await nursery.start(engine.run)
        with trio.fail_after(10), pytest.raises(EngineError, match="exited"):
            await wait_ready(f"http://127.0.0.1:{free_port()}", client=client, exited=engine.exited)
    assert engine.returncode == 3


async def test_missing_engine_binary_is_one_clear_error() -> None:
    engine = EngineProcess(["/nonexistent/vllm", "serve", "m"])
    with pytest.raises(EngineError, match="cannot start engine"):
        await engine.run()


@pytest.mark.slow
def test_engine_dies_with_an_agent_killed_by_sigkill(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    parent_code = textwrap.dedent(
        f"""
        import sys, trio
        from fabricnode.engine.process import EngineProcess
        async def main():
            engine = EngineProcess([sys.executable, "-c", "import time; time.sleep(120)"])
            async with trio.open_nursery() as n:
                pid = await n.start(engine.run)
                open({str(pidfile)!r}, "w").write(str(pid))
                await trio.sleep_forever()
        trio.run(main)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    try:
        deadline = time.monotonic() + 20
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline, "supervisor never started the child"
            time.sleep(0.05)
        child = int(pidfile.read_text())
        assert alive(child)
        parent.kill()  # kill -9: no cleanup code runs in the agent
        parent.wait()
        deadline = time.monotonic() + 5
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "engine outlived its agent"
    finally:
        parent.kill()


@pytest.mark.slow
async def test_engine_outlives_the_idle_threads_of_its_agent(tmp_path: Path) -> None:
    # The parent-death signal is tied to the thread that forked the child; trio retires idle
    # worker threads after ~10 s, which must not take a healthy engine with them.
    engine = EngineProcess([sys.executable, "-c", "import time; time.sleep(60)"])
    async with trio.open_nursery() as nursery:
        pid = await nursery.start(engine.run)
        await trio.to_thread.run_sync(time.sleep, 0.01)  # put a thread in trio's cache
        await trio.sleep(12)
        assert alive(pid), "engine killed when a worker thread exited"
        nursery.cancel_scope.cancel()
    assert not alive(pid)


def test_models_are_parsed_leniently_from_openai_lists() -> None:
    doc = {
        "data": [
            {"id": "a", "max_model_len": 4096},
            {"id": "b"},
            {"id": ""},
            {"nope": 1},
            {"id": "c", "max_model_len": True},
        ]
    }
    assert parse_models(doc) == [
        ServedModel("a", 4096),
        ServedModel("b", None),
        ServedModel("c", None),
    ]
    assert parse_models({"data": "x"}) == []
    assert parse_models([]) == []


async def test_a_restarted_simulated_engine_serves_again_on_the_port_the_agent_holds() -> None:
    # The agent binds the engine's socket once and every child inherits it (--fd): between two
    # children the port stays ours, and the second one serves at the same URL.
    command = sim_engine_command("held-port", "H100")
    assert command.listener is not None
    fds = (command.listener.fileno(),)
    async with httpx.AsyncClient() as client:
        for _ in range(2):
            engine = EngineProcess(command.argv, pass_fds=fds, kill_after_s=5)
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                with trio.fail_after(30):
                    models = await wait_ready(command.url, client=client, exited=engine.exited)
                assert [m.id for m in models] == ["held-port"]
                await engine.stop()
                nursery.cancel_scope.cancel()
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", int(command.url.rsplit(":", 1)[1])))
    command.listener.close()


async def test_wait_ready_outlasts_a_models_answer_nested_too_deep_to_parse() -> None:
    answers = iter([b"[" * 100_000 + b"]" * 100_000, b'{"data": [{"id": "m"}]}'])

    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, content=next(answers))

    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        with trio.fail_after(10):
            models = await wait_ready("http://engine", client=client, initial_delay_s=0.01)
    assert models == [ServedModel("m", None)]
