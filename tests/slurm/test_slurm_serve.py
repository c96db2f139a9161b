"""The researcher's path: `slurm/fabric-serve.sbatch` and `fabric slurm submit`.

Fast tests run the wrapper with a fake ``srun`` and ``fabric`` on PATH (the exact command line
it builds) and ``fabric slurm submit`` with a fake ``sbatch``. The slow ones run the wrapper on
the throw-away Slurm of tests/support/slurmcluster.py with the simulated engine
(``FABRIC_ENGINE=sim``) next to agents this test starts: the job joins and serves through
another agent; ``scancel`` makes it LEFT everywhere and leaves no process behind; a job reaching
its time limit leaves before it is killed; a preempted job drains without losing a request.
Timings are printed (run with ``-s``). The time-limit job needs about 35 s (slurmctld's shortest
limit is a minute), so it is submitted first and checked last, while the other scenarios run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh
from cli.main import run as fabric_cli
from fabricnode.agent import AgentAddresses, parse_ready_lines
from fabricnode.control.client import AdminClient
from fabricnode.errors import AgentApiError
from tests.support import REPO
from tests.support.meshload import run_load, run_streams, sim_engine_args
from tests.support.slurmcluster import CLUSTER_NAME, SlurmCluster

WRAPPER = REPO / "slurm" / "fabric-serve.sbatch"
FABRIC = Path(sys.executable).parent / "fabric"
HERMETIC = ("--http", "127.0.0.1:0", "--gossip", "127.0.0.1:0")  # agent options, then --

# -- the wrapper's command line, without Slurm -------------------------------------------------

FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$ARGV_OUT"
"""
FAKE_FABRIC = """#!/bin/bash
[[ "$1 $2" == "slurm ports" ]] && echo "8080 7946 40001" && exit 0
exit 3
"""


def run_wrapper(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run the wrapper as the batch script of job 77; its result and the srun argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("fabric", FAKE_FABRIC)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    argv_out = tmp_path / "srun.argv"
    argv_out.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FABRIC_"))}
    full_env = {
        **base,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),
        "ARGV_OUT": str(argv_out),
        "SLURM_JOB_ID": "77",
        "SLURM_CPUS_ON_NODE": "6",
        **(env or {}),
    }
    done = subprocess.run(
        ["bash", str(WRAPPER), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    srun = argv_out.read_text().split("\0")[:-1] if argv_out.exists() else []
    return done, srun


def test_wrapper_runs_fabric_start_with_vllm_on_the_jobs_gpus_as_one_job_step(
    tmp_path: Path,
) -> None:
    done, srun = run_wrapper(
        tmp_path, "meta/Llama-3.1-8B", "--max-model-len", "8192", env={"SLURM_GPUS_ON_NODE": "2"}
    )
    assert done.returncode == 0, done.stderr
    logs = tmp_path / "home" / ".config" / "fabric" / "logs" / "77"
    assert srun == [
        "--nodes=1",
        "--ntasks=1",
        "--cpus-per-task=6",
        f"--output={logs}/agent.log",
        str(tmp_path / "bin" / "fabric"),
        "start",
        "--http",
        "0.0.0.0:8080",
        "--gossip",
        "0.0.0.0:7946",
        "--",
        "vllm",
        "serve",
        "meta/Llama-3.1-8B",
        "--tensor-parallel-size",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        "40001",
        "--max-model-len",  # the researcher's engine args come last: they win
        "8192",
    ]
    assert logs.is_dir()
    assert f"logs: {logs}/agent.log" in done.stdout
    assert "rendezvous file" in done.stdout


def test_wrapper_passes_agent_options_and_counts_gpus_from_job_gpu_ids(tmp_path: Path) -> None:
    done, srun = run_wrapper(
        tmp_path,
        "--label",
        "project=x",
        "--",
        "m",
        env={"SLURM_JOB_GPUS": "0,3,5", "FABRIC_ENGINE": "sglang", "FABRIC_LOG_DIR": "/x/y"},
    )
    assert done.returncode == 0, done.stderr
    start = srun.index("start")
    sep = srun.index("--")
    assert srun[3] == "--output=/x/y/77/agent.log"
    ours = ["--http", "0.0.0.0:8080", "--gossip", "0.0.0.0:7946"]
    assert srun[start + 1 : sep] == [*ours, "--label", "project=x"]
    assert srun[sep + 1 :] == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "m",
        "--tp-size",
        "3",
        "--host",
        "127.0.0.1",
        "--port",
        "40001",
    ]


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        (
            "sim",
            [
                *("{fabric}", "sim-engine", "--model", "m", "--gpu", "L4"),
                *("--port", "40001"),
            ],
        ),
        (
            "uv run vllm serve",
            ["uv", "run", "vllm", "serve", "m", "--host", "127.0.0.1", "--port", "40001"],
        ),
        ("my-server --flag", ["my-server", "--flag", "m", "--port", "40001"]),
    ],
)
def test_wrapper_engine_choice(tmp_path: Path, engine: str, expected: list[str]) -> None:
    done, srun = run_wrapper(tmp_path, "m", env={"FABRIC_ENGINE": engine, "FABRIC_SIM_GPU": "L4"})
    assert done.returncode == 0, done.stderr
    fabric = str(tmp_path / "bin" / "fabric")
    assert srun[srun.index("--") + 1 :] == [w.format(fabric=fabric) for w in expected]
    if engine == "sim":  # no GPUs in the job: the simulated one announces one L4
        assert srun[srun.index("start") + 5 : srun.index("--")] == ["--sim-gpu", "L4"]


def test_wrapper_template_mode_lets_the_agent_render_its_template(tmp_path: Path) -> None:
    """FABRIC_ENGINE=template (the elastic controller's jobs): no engine command after --, the
    agent serves MODEL with its own --engine-template."""
    template = "vllm serve {model_path} --port {port} --tensor-parallel-size {tp}"
    done, srun = run_wrapper(
        tmp_path, "--engine-template", template, "--", "m", env={"FABRIC_ENGINE": "template"}
    )
    assert done.returncode == 0, done.stderr
    assert "--" not in srun
    start = srun.index("start")
    assert srun[start + 1 :] == [
        "--http", "0.0.0.0:8080", "--gossip", "0.0.0.0:7946", "--serve", "m",
        "--engine-template", template,
    ]  # fmt: skip
    done, srun = run_wrapper(
        tmp_path, "--engine-template", template, "--", "m", "--extra",
        env={"FABRIC_ENGINE": "template"},
    )  # fmt: skip
    assert done.returncode == 2 and "takes no ENGINE ARGS" in done.stderr and srun == []


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {}, "usage: sbatch"),
        (("--label", "a=b", "m"), {}, "agent options must end with --"),
        (("m",), {"FABRIC_BIN": "/nonexistent/fabric"}, "cannot find the fabric command"),
        (("m",), {"SLURM_JOB_ID": ""}, "not inside a Slurm job"),
    ],
)
def test_wrapper_refuses_bad_use_with_one_line(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    done, srun = run_wrapper(tmp_path, *args, env=env)
    assert done.returncode in (1, 2)
    assert srun == []
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fabric-serve: error: ") and message in lines[0]


# -- fabric slurm submit, with a fake sbatch ---------------------------------------------------

FAKE_SBATCH = """#!/bin/bash
printf '%s\\0' "$@" > "$ARGV_OUT"
printf '%s' "$FABRIC_ENGINE" > "$ARGV_OUT.engine"
if [[ -n $SBATCH_FAIL ]]; then echo "sbatch: error: $SBATCH_FAIL" >&2; exit 1; fi
echo "4242;fabrictest"
"""


@pytest.fixture
def fake_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "sbin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin:/bin")
    monkeypatch.setenv("ARGV_OUT", str(tmp_path / "sbatch.argv"))
    monkeypatch.setenv("FABRIC_HOME", str(tmp_path / "fh"))
    for name in ("FABRIC_LOG_DIR", "FABRIC_ENGINE", "FABRIC_SBATCH_SCRIPT", "SBATCH_FAIL"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "sbatch.argv"


def test_submit_builds_the_wrapper_job_and_says_how_to_watch_it(
    fake_sbatch: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = fabric_cli(
        [
            *("slurm", "submit", "--model", "org/Big-Model", "--gpus", "4", "--partition", "gpu"),
            *("--time", "2:00:00", "--engine", "sim", "--label", "team=a"),
            *("--leave-before-end", "300", "--", "--max-model-len", "4096"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    logs = tmp_path / "fh" / "logs"
    assert fake_sbatch.read_text().split("\0")[:-1] == [
        "--parsable",
        "--job-name=fabric-Big-Model",
        "--gres=gpu:4",
        "--partition=gpu",
        "--time=2:00:00",
        f"--output={logs}/slurm-%j.out",
        str(WRAPPER),
        "--label",
        "team=a",
        "--leave-before-end",
        "300",
        "--",
        "org/Big-Model",
        "--max-model-len",
        "4096",
    ]
    assert Path(f"{fake_sbatch}.engine").read_text() == "sim"
    assert "submitted job 4242" in out
    assert f"{logs}/4242/" in out
    assert "squeue -j 4242" in out and "fabric nodes --label slurm.job_id=4242" in out


def test_submit_dry_run_prints_the_command_and_submits_nothing(
    fake_sbatch: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fabric_cli(["slurm", "submit", "--model", "m", "--gpus", "0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "FABRIC_BIN=" in out and "--parsable" in out and str(WRAPPER) in out
    assert "--gres" not in out
    assert not fake_sbatch.exists()


def test_submit_shows_sbatchs_error_in_one_line_and_exits_1(
    fake_sbatch: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SBATCH_FAIL", "invalid partition specified: nope")
    assert fabric_cli(["slurm", "submit", "--model", "m", "--partition", "nope"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "fabric slurm submit: error: sbatch failed (exit 1): "
        "sbatch: error: invalid partition specified: nope"
    ]


def test_submit_without_sbatch_exits_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert fabric_cli(["slurm", "submit", "--model", "m"]) == 1
    assert capsys.readouterr().err.strip() == (
        "fabric slurm submit: error: sbatch not found on PATH: run this where Slurm's commands are"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--gpus", "1"],  # no model
        ["--model", "m", "--time", "soon"],
        ["--model", "m", "--label", "novalue"],
        ["--model", "m", "--gpus", "-1"],
        ["--model", "m", "--leave-before-end", "-5"],
        ["--model", "m", "--max-model-len", "4"],  # engine args need --
    ],
)
def test_submit_bad_usage_exits_2_with_one_line(
    fake_sbatch: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert fabric_cli(["slurm", "submit", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0], err
    assert not fake_sbatch.exists()


# -- on a real Slurm -----------------------------------------------------------------------------

MODEL = "sim-7b"
JOIN_WITHIN_S = 30.0
LEFT_WITHIN_S = 5.0
slow = pytest.mark.slow


@dataclass
class ServeJob:
    """One job of the wrapper: its id, and its agent's addresses once it printed them."""

    job_id: int
    log_dir: Path
    addrs: AgentAddresses | None = None

    @property
    def agent_log(self) -> str:
        path = self.log_dir / "agent.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_agent(self, cluster: SlurmCluster, timeout_s: float = JOIN_WITHIN_S) -> AgentAddresses:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            addrs = parse_ready_lines(self.agent_log)
            if addrs is not None:
                self.addrs = addrs
                return addrs
            time.sleep(0.1)
        raise AssertionError(
            f"job {self.job_id} ({cluster.job_state(self.job_id)}) printed no addresses in "
            f"{timeout_s:g} s:\n{cluster.output(self.job_id)}\n{self.agent_log[-3000:]}"
        )

    def wait_logged(self, text: str, timeout_s: float = LEFT_WITHIN_S) -> None:
        """Wait for ``text`` in the agent's log: the agent logs some events a moment after
        they are visible elsewhere (its member log polls once a second)."""
        deadline = time.monotonic() + timeout_s
        while text not in self.agent_log:
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not logged in {timeout_s:g} s:\n{self.agent_log}")
            time.sleep(0.1)

    @property
    def session_id(self) -> str:
        assert self.addrs is not None
        return self.addrs.session_id


class Jobs:
    """Submits wrapper jobs for one mesh, and cancels (only) them at the end."""

    def __init__(self, cluster: SlurmCluster, mesh: LocalMesh) -> None:
        self.cluster = cluster
        self.mesh = mesh
        self.ids: list[int] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "FABRIC_HOME": str(self.mesh.workdir),  # the mesh's cluster key and rendezvous file
            "FABRIC_BIN": str(FABRIC),
            "FABRIC_ENGINE": "sim",
            "FABRIC_JOIN": "",
            "FABRIC_CLUSTER_KEY": "",
            "FABRIC_LOG_DIR": "",
            "FABRIC_RENDEZVOUS": "",
            "FABRIC_LEAVE_BEFORE_END": "",
        }
        return {**env, **extra}

    def submit(
        self,
        *options: str,
        agent: tuple[str, ...] = HERMETIC,
        engine_args: tuple[str, ...] = (),
        model: str = MODEL,
        **env: str,
    ) -> ServeJob:
        args = [*agent, "--"] if agent else []
        job_id = self.cluster.sbatch(
            WRAPPER, *options, args=[*args, model, *engine_args], env=self.env(**env)
        )
        self.ids.append(job_id)
        return ServeJob(job_id, self.mesh.workdir / "logs" / str(job_id))

    def track(self, job_id: int) -> ServeJob:
        self.ids.append(job_id)
        return ServeJob(job_id, self.mesh.workdir / "logs" / str(job_id))

    def cancel(self) -> None:
        live = set(self.cluster.job_ids()) & set(self.ids)
        if live:
            self.cluster.run("scancel", *map(str, live), check=False)
            deadline = time.monotonic() + 20
            while set(self.cluster.job_ids()) & live and time.monotonic() < deadline:
                time.sleep(0.2)


def nodes_of(url: str) -> dict[str, dict[str, Any]] | None:
    try:
        with AdminClient(url, timeout_s=2.0) as client:
            return {n["session_id"]: n for n in client.nodes()}
    except AgentApiError:
        return None


def state_of(watcher: AgentProcess, sid: str) -> str | None:
    view = nodes_of(watcher.http_url)
    entry = None if view is None else view.get(sid)
    return None if entry is None else str(entry["state"])


def wait_state(watchers: list[AgentProcess], sid: str, state: str, timeout_s: float) -> float:
    """Seconds until every watcher shows ``sid`` in ``state``; AssertionError after timeout."""
    t0 = time.monotonic()
    seen: list[str | None] = []
    while time.monotonic() - t0 < timeout_s:
        seen = [state_of(w, sid) for w in watchers]
        if all(s == state for s in seen):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{sid[:8]} is {seen}, not {state}, after {timeout_s:g} s")


def job_processes(workdir: Path, job_id: int) -> list[str]:
    """Command lines of live processes of the job (its environment names both)."""
    home = b"FABRIC_HOME=" + os.fsencode(workdir)
    job = f"SLURM_JOB_ID={job_id}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if home in environ and job in environ and stat[0] != "Z":
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


def wait_gone(workdir: Path, job_id: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while job_processes(workdir, job_id):
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"left behind: {job_processes(workdir, job_id)}")
        time.sleep(0.1)
    return time.monotonic() - t0


def chat(i: int, max_tokens: int = 16) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i} " + "lorem ipsum " * 10}],
        "max_tokens": max_tokens,
    }


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    """Two local agents (no engine): the ingress clients use, and a witness."""
    local = LocalMesh(tmp_path_factory.mktemp("slurm-serve") / "mesh")
    try:
        local.start("ingress", wait=False)
        local.start("witness", wait=False)
        for agent in local.agents:
            agent.wait_ready()
        yield local
    finally:
        local.close()
        for agent in local.agents:
            print(f"--- {agent.name} (exit {agent.proc.returncode}) ---\n{agent.stderr_tail(15)}")


def report(jobs: Jobs) -> None:
    """Cancel the jobs, then print their last lines (pytest shows them when a test failed)."""
    cluster = jobs.cluster
    jobs.cancel()
    for job_id in jobs.ids:
        tail = "\n".join(cluster.output(job_id).splitlines()[-5:])
        log = jobs.mesh.workdir / "logs" / str(job_id) / "agent.log"
        agent = log.read_text(errors="replace").splitlines()[-12:] if log.exists() else []
        print(f"--- job {job_id} ---\n{tail}\n" + "\n".join(agent))
    for daemon in ("slurmctld", "slurmd"):
        errors = cluster.log_errors(daemon)
        if errors:
            print(f"--- {daemon}.log (errors) ---\n{errors}")


@pytest.fixture
def jobs(slurm_cluster: SlurmCluster, mesh: LocalMesh) -> Iterator[Jobs]:
    """This test's jobs, cancelled after it (and only they: the time-limit job runs on)."""
    if not FABRIC.exists():
        pytest.skip(f"no fabric console script next to {sys.executable}")
    found = Jobs(slurm_cluster, mesh)
    try:
        yield found
    finally:
        report(found)


@pytest.fixture(scope="module")
def time_limit_job(
    slurm_cluster: SlurmCluster, mesh: LocalMesh
) -> Iterator[tuple[Jobs, ServeJob, float, LeftWatch]]:
    """Submitted before the other scenarios so its minute runs alongside them: partition
    ``high`` (never preempted), ``--time=1``, a 40 s margin, and Slurm's own warning replaced by
    a harmless signal so that the leave is the agent's own. A ``LeftWatch`` notes when each
    agent of the mesh sees it leave, whenever the test that checks it gets its turn."""
    if not FABRIC.exists():
        pytest.skip(f"no fabric console script next to {sys.executable}")
    jobs = Jobs(slurm_cluster, mesh)
    try:
        job = jobs.submit(
            *("-p", "high", "--time=1", "--signal=URG@1"),
            model="sim-limit",
            FABRIC_LEAVE_BEFORE_END="40",
        )
        # The mesh's agents now; one a later scenario starts may join after the entry is gone.
        with LeftWatch(list(mesh.agents), job) as watch:
            yield jobs, job, time.time(), watch
    finally:
        report(jobs)


class LeftWatch:
    """When each watcher first saw ``job``'s agent LEFT (Unix time), polled in a thread.

    The LEFT entry is collected when the node's lease ends, at the job's time limit; the test
    that checks the leave runs after other scenarios, which on a busy machine may be later than
    that, so the leave is watched while it is visible, not looked up afterwards."""

    def __init__(self, watchers: list[AgentProcess], job: ServeJob) -> None:
        self.watchers, self.job = watchers, job
        self.seen_left: dict[str, float] = {}  # watcher name -> first time it saw LEFT
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LeftWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        addrs = None
        while addrs is None and not self._stop.wait(0.2):
            addrs = parse_ready_lines(self.job.agent_log)
        while addrs is not None and len(self.seen_left) < len(self.watchers):
            for w in self.watchers:
                if w.name not in self.seen_left and state_of(w, addrs.session_id) == "left":
                    self.seen_left[w.name] = time.time()
            if self._stop.wait(0.05):
                return

    def wait_all(self, timeout_s: float) -> dict[str, float]:
        """When each watcher saw the leave; AssertionError if one has not after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while len(self.seen_left) < len(self.watchers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.seen_left) == len(self.watchers), f"LEFT seen only by {self.seen_left}"
        return dict(self.seen_left)


@slow
def test_wrapper_job_joins_the_mesh_and_serves_through_another_agent(
    jobs: Jobs, mesh: LocalMesh, time_limit_job: tuple[Jobs, ServeJob, float, LeftWatch]
) -> None:
    ingress = mesh.agents[0]
    t0 = time.monotonic()
    job = jobs.submit("--gres=gpu:2", engine_args=("--max-model-len", "4096", "--slowdown", "5"))
    jobs.cluster.wait_state(job.job_id, "RUNNING", 20)
    job.wait_agent(jobs.cluster)
    joined = wait_state(mesh.agents, job.session_id, "serving", JOIN_WITHIN_S)
    took = time.monotonic() - t0
    print(f"\nslurm-serve: sbatch -> SERVING in every agent's view in {took:.1f} s")

    entry = nodes_of(ingress.http_url)[job.session_id]  # type: ignore[index]
    labels = dict(entry["labels"])
    assert labels["slurm.job_id"] == str(job.job_id) and labels["slurm.partition"] == "low"
    assert entry["site"] == CLUSTER_NAME  # the site's default: Slurm's SLURM_CLUSTER_NAME
    assert entry["hardware"]["gpu_count"] == 2 and entry["hardware"]["gpu_type"] == "H100"
    assert entry["models"] == [
        {"id": MODEL, "max_model_len": 4096, "quantization": None, "parent": None}
    ]

    from openai import OpenAI

    client = OpenAI(base_url=ingress.http_url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello from the test"}], max_tokens=8
    )
    answer = raw.parse()
    assert raw.headers["x-fabric-node"] == job.session_id
    assert answer.choices[0].message.content and answer.usage is not None
    assert answer.usage.completion_tokens == 8
    # Where the logs are: the agent's (ready lines and log lines) and the engine's, per job.
    assert (job.log_dir / "engine.log").stat().st_size > 0
    job.wait_logged("ready: joined the mesh")
    assert f"logs: {job.log_dir}/agent.log" in jobs.cluster.output(job.job_id)
    assert joined < JOIN_WITHIN_S


@slow
def test_submit_then_scancel_leaves_everywhere_within_seconds_and_no_process_behind(
    jobs: Jobs, mesh: LocalMesh
) -> None:
    # `fabric slurm submit` this time, with the wrapper's defaults (0.0.0.0, fabric's ports
    # when free, the host's primary address advertised).
    done = subprocess.run(
        [
            *(str(FABRIC), "slurm", "submit", "--model", MODEL, "--gpus", "1", "--engine", "sim"),
            *("--json", "--", "--slowdown", "5"),
        ],
        env={**jobs.cluster.env, **jobs.env()},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    job = jobs.track(int(doc["job_id"]))
    assert Path(doc["log_dir"]) == job.log_dir
    jobs.cluster.wait_state(job.job_id, "RUNNING", 20)
    job.wait_agent(jobs.cluster)
    wait_state(mesh.agents, job.session_id, "serving", JOIN_WITHIN_S)
    assert job_processes(mesh.workdir, job.job_id)  # batch script, srun, agent, engine

    t0 = time.monotonic()
    jobs.cluster.scancel(job.job_id)
    left = wait_state(mesh.agents, job.session_id, "left", LEFT_WITHIN_S)
    gone = wait_gone(mesh.workdir, job.job_id, jobs.cluster.config.kill_wait_s + 10)
    print(
        f"\nslurm-serve: scancel -> LEFT in every agent's view in {left:.2f} s;"
        f" the job's processes all gone {time.monotonic() - t0:.2f} s after scancel"
    )
    assert jobs.cluster.wait_state(job.job_id, ["CANCELLED", "COMPLETED"], 15)
    assert "left the mesh" in job.agent_log  # a clean exit, not Slurm's SIGKILL
    assert gone >= 0 and not Path(doc["output"]).read_text().count("Traceback")


@slow
def test_preempted_job_drains_its_requests_and_users_fail_over(jobs: Jobs, mesh: LocalMesh) -> None:
    ingress = mesh.agents[0]
    backup = mesh.start("backup", args=sim_engine_args(MODEL, "A100-80G", "--slowdown", "30"))
    gpus = jobs.cluster.config.gpus
    job = jobs.submit(f"--gres=gpu:{gpus}", "-p", "low", engine_args=("--slowdown", "30"))
    jobs.cluster.wait_state(job.job_id, "RUNNING", 20)
    job.wait_agent(jobs.cluster)
    wait_state([ingress], job.session_id, "serving", JOIN_WITHIN_S)
    wait_state([ingress], backup.session_id, "serving", JOIN_WITHIN_S)

    # In flight on the job's node for sure: streams pinned to its GPU type, each started.
    pinned: list[dict[str, Any]] = []
    started = threading.Semaphore(0)

    def pinned_stream(i: int) -> None:
        result: dict[str, Any] = {"chunks": 0, "finish": None, "node": None}
        body = {**chat(i, max_tokens=24), "stream": True}
        headers = {"X-Fabric-Require": "gpu=H100"}
        try:
            with (
                httpx.Client(timeout=30) as http,
                http.stream(
                    "POST", ingress.http_url + "/v1/chat/completions", json=body, headers=headers
                ) as r,
            ):
                result["status"] = r.status_code
                result["node"] = r.headers.get("x-fabric-node")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        result["error"] = event["error"]
                        break
                    result["chunks"] += 1
                    if result["chunks"] == 1:
                        started.release()
                    finish = event["choices"][0].get("finish_reason") if event["choices"] else None
                    result["finish"] = finish or result["finish"]
        except httpx.HTTPError as exc:
            result["error"] = repr(exc)
        finally:
            pinned.append(result)
            started.release()

    streams = [threading.Thread(target=pinned_stream, args=(i,)) for i in range(4)]
    stop = threading.Event()
    load: list[Counter[str]] = []
    loader = threading.Thread(target=lambda: load.append(run_load(ingress.http_url, 4, stop, chat)))
    for t in streams:
        t.start()
    for _ in streams:
        assert started.acquire(timeout=20)
    loader.start()
    time.sleep(1.0)

    t0 = time.time()
    high = jobs.track(jobs.cluster.sbatch("sleep 2", "-p", "high", "--gres=gpu:1"))
    left = wait_state([ingress], job.session_id, "left", 10)
    for t in streams:
        t.join(30)
    state = jobs.cluster.wait_state(job.job_id, ["COMPLETED", "PREEMPTED", "CANCELLED"], 30)
    ended = time.time() - t0
    time.sleep(1.0)  # the load keeps going on the backup after the node is gone
    stop.set()
    loader.join(60)
    outcomes = load[0]
    print(
        f"\nslurm-serve: preemption -> LEFT at the ingress in {left:.2f} s; the job's step"
        f" drained and the job ended ({state}) {ended:.1f} s after the high job's sbatch"
        f" (GraceTime {jobs.cluster.config.grace_time_s} s); load outcomes {dict(outcomes)}"
    )
    assert [p.get("status") for p in pinned] == [200] * 4, pinned
    assert all(p["node"] == job.session_id for p in pinned), pinned
    assert all("error" not in p and p["finish"] == "length" for p in pinned), pinned
    assert all(p["chunks"] >= 24 for p in pinned), pinned  # every token (and the role chunk)
    assert set(outcomes) == {"200"} and outcomes["200"] >= 4, outcomes
    assert state == "COMPLETED"  # the agent finished draining within the grace time
    jobs.cluster.wait_state(high.job_id, ["RUNNING", "COMPLETED"], 20)
    wait_gone(mesh.workdir, job.job_id, 15)


TOKENS = 70  # about 20 s a stream, ten at once, on the test machine


@slow
def test_scancel_signal_term_of_a_job_streaming_ten_answers_finishes_all_ten(
    jobs: Jobs, mesh: LocalMesh
) -> None:
    """Issue 39: the elastic controller drains a replica with ``scancel --signal=TERM``; Slurm
    signals every process of the step, the engine too. Ten streams (five through another
    agent's ingress, five through the job's own) of about 20 s each, which outlast what used to
    end them (the engine, refusing connections once signalled, taken for hung and killed 10 s
    later): every one ends whole on the job's node. The drain deadline is raised to 60 s so
    that a slow machine does not turn this into the hand-over case."""
    ingress = mesh.agents[0]
    job = jobs.submit(
        "--gres=gpu:1",
        *("-p", "high"),
        agent=(*HERMETIC, "--drain-timeout", "60"),
        engine_args=("--slowdown", "40"),
    )
    jobs.cluster.wait_state(job.job_id, "RUNNING", 20)
    addrs = job.wait_agent(jobs.cluster)
    wait_state([ingress], job.session_id, "serving", JOIN_WITHIN_S)
    urls = [ingress.http_url] * 5 + [addrs.http_url] * 5
    # On the job's node for sure (the module's mesh may have a backup of the model on A100s).
    pinned = {"X-Fabric-Require": "gpu=H100"}
    threads, results = run_streams(urls, MODEL, max_tokens=TOKENS, headers=pinned)

    t0 = time.monotonic()
    jobs.cluster.scancel(job.job_id, signal="TERM")
    wait_state([ingress], job.session_id, "left", LEFT_WITHIN_S)
    for t in threads:
        t.join(90)
    took = time.monotonic() - t0
    state = jobs.cluster.wait_state(job.job_id, ["COMPLETED", "CANCELLED"], 60)
    print(f"\nslurm-serve: scancel --signal=TERM -> 10 streams whole in {took:.1f} s; job {state}")
    for r in results:
        assert r.status == 200 and r.node == job.session_id, r
        assert r.done and not r.errors and r.words == TOKENS, r
    job.wait_logged("left the mesh", 30)
    assert "SIGKILL" not in job.agent_log
    assert "10 requests were in flight to the engine, 0 of them handed over" in job.agent_log


@slow
def test_job_reaching_its_time_limit_leaves_before_it_is_killed(
    mesh: LocalMesh, time_limit_job: tuple[Jobs, ServeJob, float, LeftWatch]
) -> None:
    jobs, job, submitted, watch = time_limit_job
    job.wait_agent(jobs.cluster, 60)
    record = jobs.cluster.job(job.job_id)
    assert record is not None and record["TimeLimit"] == "00:01:00"
    start = time.mktime(time.strptime(record["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    end = start + 60  # Slurm kills it at its first time-limit check from then on
    # Other tests ran meanwhile: the agent's log says when it served and when it left.
    state = jobs.cluster.wait_state(job.job_id, ["COMPLETED", "TIMEOUT", "CANCELLED"], 90)
    log = job.agent_log
    served = log_time(log, "engine ready at")
    leaving = log_time(log, "leaving the mesh before it is killed")
    seen = watch.wait_all(LEFT_WITHIN_S)
    assert max(seen.values()) - leaving <= LEFT_WITHIN_S, (leaving, seen)
    print(
        f"\nslurm-serve: --time=1 with a 40 s margin: the node served from {served - start:.1f} s"
        f" and left {leaving - start:.1f} s after the job started, {end - leaving:.1f} s before"
        f" its time limit ({time.time() - submitted:.1f} s after its sbatch); the job ended {state}"
    )
    assert "SIGTERM received" not in log  # the agent's own leave, not Slurm's
    assert served < leaving
    assert end - leaving >= 20
    assert state == "COMPLETED"  # it exited on its own, never TIMEOUT
    wait_gone(mesh.workdir, job.job_id, 15)


def log_time(log: str, text: str) -> float:
    """Unix time of the first agent log line containing ``text`` (its local-time stamp)."""
    for line in log.splitlines():
        if text in line:
            stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", line)
            assert stamp is not None, line
            whole = time.mktime(time.strptime(stamp[1], "%Y-%m-%d %H:%M:%S"))
            return whole + int(stamp[2]) / 1000
    raise AssertionError(f"no {text!r} in the agent's log:\n{log[-3000:]}")


@slow
def test_extended_time_limit_moves_the_lease_so_peers_keep_the_node_past_the_old_end(
    jobs: Jobs, mesh: LocalMesh
) -> None:
    """``scontrol update TimeLimit=`` on a running job: the agent notices (it asks scontrol at
    half the time left), re-signs its entry with the new end, and the mesh keeps routing to it
    after the old time limit instead of dropping the entry when its lease would have ended."""
    # Slurm's own warning is replaced by a harmless signal, and the agent's leave plan is off:
    # the lease alone decides how long peers keep the entry.
    job = jobs.submit(
        *("-p", "high", "--time=1", "--signal=URG@1"),
        model="sim-extend",
        FABRIC_LEAVE_BEFORE_END="0",
    )
    job.wait_agent(jobs.cluster, 60)
    record = jobs.cluster.job(job.job_id)
    assert record is not None and record["TimeLimit"] == "00:01:00"
    start = time.mktime(time.strptime(record["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    old_end = start + 60
    jobs.cluster.run("scontrol", "update", f"JobId={job.job_id}", "TimeLimit=3")
    new_end = start + 180
    witness = mesh.agents[1]

    def entry() -> dict[str, Any] | None:
        view = nodes_of(witness.http_url)
        return None if view is None else view.get(job.session_id)

    deadline = old_end + 10
    while time.time() < deadline:
        seen = entry()
        if seen is not None and seen["labels"].get("fabric.job_end") == f"{new_end:.0f}":
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the entry never showed the new end: {entry()}\n{job.agent_log}")
    moved_at = time.time() - start
    # Past the old end (plus a lease's worth of slack): still there, still serving.
    while time.time() < old_end + 8:
        time.sleep(0.5)
    seen = entry()
    assert seen is not None and seen["state"] == "serving", seen
    assert seen["expires_at"] > old_end
    r = httpx.post(
        mesh.agents[0].http_url + "/v1/chat/completions",
        json={**chat(0), "model": "sim-extend"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    print(
        f"\nslurm-serve: time limit 1 -> 3 min; the entry carried the new end {moved_at:.1f} s"
        " after the job started and was still serving past the old limit"
    )
