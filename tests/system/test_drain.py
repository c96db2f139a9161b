"""A serving agent drained the way Slurm drains it (issue 39): SIGTERM to the agent and to its
engine at the same moment (Slurm signals every process of the job step), while streams run
through another agent's ingress and through the drained agent's own. Every stream ends whole:
finished on the drained node, or handed over at the drain deadline and resumed on another."""

from __future__ import annotations

import os
import signal
import time

import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from tests.support.meshload import engine_process, run_streams, serving_count, sim_engine_args

pytestmark = pytest.mark.slow

MODEL = "m1"
SLOW = ("--slowdown", "60")  # about 6 tokens a second per stream on the simulated H100
LONG = 120


def sigterm_like_slurm(node: AgentProcess) -> None:
    """SIGTERM to the agent and to its engine at once, as ``scancel --signal=TERM`` does."""
    engine = engine_process(node)
    assert engine is not None
    node.proc.send_signal(signal.SIGTERM)
    os.kill(engine.pid, signal.SIGTERM)


def test_a_drained_node_finishes_every_stream_its_engine_has(mesh: LocalMesh) -> None:
    ingress = mesh.start("ingress")
    node = mesh.start("drained", args=sim_engine_args(MODEL, "H100", *SLOW))
    assert wait_until(lambda: serving_count(ingress, MODEL) == 1, 30)
    # Five through another agent's ingress (forwarded to the node), five through its own.
    urls = [ingress.http_url] * 5 + [node.http_url] * 5
    # Long enough (about 20 s) to outlast what used to end them: the engine, which stops
    # answering its health checks once it has SIGTERM, was taken for hung after about 4 s
    # and killed 10 s later.
    threads, results = run_streams(urls, MODEL, max_tokens=LONG)

    t0 = time.monotonic()
    sigterm_like_slurm(node)
    for t in threads:
        t.join(60)
    took = time.monotonic() - t0
    assert node.wait(30) == 0
    print(f"\ndrain: 10 streams finished {took:.1f} s after SIGTERM")
    for s in results:
        assert s.status == 200 and s.node == node.session_id, s
        assert s.done and not s.errors and s.words == LONG, s  # whole, on the drained node
    log = node.stderr_tail(400)
    assert "SIGKILL" not in log and "10 requests were in flight to the engine, 0 of" in log


def test_streams_still_running_at_the_drain_deadline_are_resumed_elsewhere(
    mesh: LocalMesh,
) -> None:
    ingress = mesh.start("ingress")
    node = mesh.start(
        "drained", args=["--drain-timeout", "3", *sim_engine_args(MODEL, "H100", *SLOW)]
    )
    backup = mesh.start("backup", args=sim_engine_args(MODEL, "A100-80G", *SLOW))
    for agent in (ingress, node):
        assert wait_until(lambda a=agent: serving_count(a, MODEL) == 2, 30)  # type: ignore[misc]
    urls = [ingress.http_url] * 5 + [node.http_url] * 5
    threads, results = run_streams(urls, MODEL, max_tokens=40)

    sigterm_like_slurm(node)
    for t in threads:
        t.join(60)
    assert node.wait(30) == 0
    on_drained = [s for s in results if s.node == node.session_id]
    for s in results:
        assert s.status == 200 and s.done and not s.errors and s.words == 40, s
    log = node.stderr_tail(400)
    assert "SIGKILL" not in log
    handed = [line for line in log.splitlines() if "handed over to other nodes" in line]
    print(f"\ndrain: {len(on_drained)} of 10 streams on the drained node; {handed}")
    assert on_drained and handed  # resumed on the backup, whole
    assert backup.running


def test_a_node_whose_requests_end_while_it_signs_left_exits_at_once(mesh: LocalMesh) -> None:
    """Requests in flight at the SIGTERM that end within the second the node spends signing
    LEFT: nothing changes after that to wake the drain, which must see the count is zero and
    stop the engine then, not at its 30 s deadline (a time-limited job held its GPU 18 s so,
    and a SIGTERMed agent of test_failover was not gone in 15 s)."""
    ingress = mesh.start("ingress")
    node = mesh.start("drained", args=sim_engine_args(MODEL, "H100", "--slowdown", "10"))
    assert wait_until(lambda: serving_count(ingress, MODEL) == 1, 30)
    # About half a second each (36 tokens a second): in flight at the signal, ended well
    # within the one-second linger of LEFT
    threads, results = run_streams([ingress.http_url] * 2, MODEL, max_tokens=16)
    time.sleep(0.1)  # the streams have begun (what is asserted is the exit, not a timing)
    t0 = time.monotonic()
    node.terminate()  # the agent alone, as when it leaves before its job's time limit: its
    # engine is signalled by nobody else, so only the drain stops it
    assert node.wait(40) == 0
    took = time.monotonic() - t0
    for t in threads:
        t.join(30)
    for s in results:
        assert s.status == 200 and s.done and not s.errors, s
    log = node.stderr_tail(400)
    drained = [line for line in log.splitlines() if "drained in" in line]
    print(f"\nexited {took:.1f} s after SIGTERM: {drained}")
    assert drained and "drain deadline" not in log, log
    assert took < 15.0, drained  # the deadline is 30 s: the drain ended on the count, not it
