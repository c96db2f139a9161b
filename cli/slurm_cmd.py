"""``fabric slurm ...``: serve a model from a Slurm job without writing a batch script.

``fabric slurm submit`` submits ``slurm/fabric-serve.sbatch`` (the researcher wrapper, which a
researcher may also ``sbatch`` by hand) with the options given here, and prints the job id,
where its logs go and how to watch it. Exit status: 0 submitted, 1 sbatch missing or failed,
2 bad usage. ``fabric slurm ports`` (hidden) is the wrapper's helper that picks free ports.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from fabricnode.config import fabric_home
from fabricnode.host.slurm import (
    SubmitRequest,
    find_sbatch_script,
    parse_sbatch_job_id,
    parse_time_limit,
    pick_ports,
    sbatch_argv,
)
from fabricnode.mesh.schema import SLURM_JOB_LABEL

slurm_app = typer.Typer(
    help="Serve a model from a Slurm job (submit the fabric-serve.sbatch wrapper).",
    no_args_is_help=True,
    rich_markup_mode=None,
)

SBATCH_TIMEOUT_S = 60.0
UNLIMITED = ("infinite", "unlimited")
DEFAULT_HTTP_PORT = 8080
DEFAULT_GOSSIP_PORT = 7946


def _fail(command: str, message: str, code: int) -> NoReturn:
    print(f"fabric slurm {command}: error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def _fabric_bin(env: dict[str, str]) -> str | None:
    """The ``fabric`` the job should run: ``$FABRIC_BIN``, else the one installed next to this
    interpreter (same virtualenv as this command), else the first on PATH."""
    if env.get("FABRIC_BIN"):
        return env["FABRIC_BIN"]
    beside = Path(sys.executable).parent / "fabric"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("fabric")


def _log_base(env: dict[str, str]) -> Path:
    explicit = env.get("FABRIC_LOG_DIR")
    return Path(explicit).expanduser() if explicit else fabric_home(env) / "logs"


@slurm_app.command(
    "submit",
    help="Submit a Slurm job that serves MODEL as a node of the mesh: "
    "fabric start -- <engine> MODEL --tensor-parallel-size <GPUs> --port <free> [ENGINE ARGS]. "
    "Prints the job id, where its logs go and how to watch it.",
)
def submit(
    engine_args: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="-- ENGINE_ARGS",
            help="Passed to the engine after ours, e.g. -- --max-model-len 8192.",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str, typer.Option(metavar="MODEL", help="Model to serve (required).", show_default=False)
    ] = "",
    gpus: Annotated[
        int, typer.Option(metavar="N", min=0, max=1024, help="GPUs (--gres=gpu:N; 0 = none).")
    ] = 1,
    partition: Annotated[
        str | None, typer.Option(metavar="P", help="Slurm partition (site default).")
    ] = None,
    time: Annotated[
        str | None,
        typer.Option(metavar="T", help="Time limit: MM, HH:MM:SS, D-HH:MM... (site default)."),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            metavar="E",
            help="vllm|sglang|sim or a command prefix (default $FABRIC_ENGINE, else vllm).",
        ),
    ] = None,
    job_name: Annotated[
        str | None, typer.Option(metavar="NAME", help="Job name (fabric-<model>).")
    ] = None,
    label: Annotated[
        list[str] | None, typer.Option(metavar="KEY=VALUE", help="Node label (repeatable).")
    ] = None,
    leave_before_end: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS", help="Start leaving this long before the time limit (120; 0 = off)."
        ),
    ] = None,
    sbatch_arg: Annotated[
        list[str] | None,
        typer.Option(
            metavar="ARG", help="Extra sbatch option, verbatim (repeatable): --sbatch-arg=--qos=x."
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the sbatch command instead of running it.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    env = dict(os.environ)
    if not model.strip():
        _fail("submit", "--model MODEL is required", 2)
    if time is not None and time.lower() not in UNLIMITED and parse_time_limit(time) is None:
        _fail("submit", f"--time {time!r}: expected MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM[:SS]", 2)
    if engine is not None and not engine.strip():
        _fail("submit", "--engine: expected vllm, sglang, sim or a command", 2)
    agent_args: list[str] = []
    for item in label or []:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            _fail("submit", f"--label {item!r}: expected KEY=VALUE", 2)
        agent_args += ["--label", item]
    if leave_before_end is not None:
        if not 0 <= leave_before_end <= 7 * 86400:
            _fail("submit", f"--leave-before-end {leave_before_end:g}: expected 0..604800", 2)
        agent_args += ["--leave-before-end", f"{leave_before_end:g}"]

    script = find_sbatch_script(env)
    if script is None:
        _fail(
            "submit",
            f"cannot find slurm/fabric-serve.sbatch next to {Path(__file__).parent}: "
            "set FABRIC_SBATCH_SCRIPT=/path/to/fabric-serve.sbatch",
            1,
        )
    fabric = _fabric_bin(env)
    if fabric is None:
        _fail("submit", "cannot find the fabric command for the job: set FABRIC_BIN", 1)
    job_env = {"FABRIC_BIN": fabric}
    if engine is not None:
        job_env["FABRIC_ENGINE"] = engine.strip()
    log_base = _log_base(env)
    request = SubmitRequest(
        model=model.strip(),
        gpus=gpus,
        partition=partition,
        time_limit=time,
        job_name=job_name,
        engine_args=tuple(engine_args or ()),
        agent_args=tuple(agent_args),
        sbatch_args=tuple(sbatch_arg or ()),
        output=str(log_base / "slurm-%j.out"),
    )
    sbatch = shutil.which("sbatch", path=env.get("PATH"))
    argv = sbatch_argv(request, script, sbatch or "sbatch")
    if dry_run:
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(job_env.items()))
        print(f"{assignments} {shlex.join(argv)}")
        return
    if sbatch is None:
        _fail("submit", "sbatch not found on PATH: run this where Slurm's commands are", 1)
    try:
        log_base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _fail("submit", f"cannot create the log directory {log_base}: {exc.strerror}", 1)
    try:
        done = subprocess.run(
            argv,
            env={**env, **job_env},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=SBATCH_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        _fail("submit", f"sbatch did not answer in {SBATCH_TIMEOUT_S:g} s", 1)
    except OSError as exc:
        _fail("submit", f"cannot run {sbatch}: {exc.strerror or exc}", 1)
    job_id = parse_sbatch_job_id(done.stdout) if done.returncode == 0 else None
    if job_id is None:
        why = " | ".join(line.strip() for line in done.stderr.strip().splitlines() if line.strip())
        _fail("submit", f"sbatch failed (exit {done.returncode}): {why or done.stdout.strip()}", 1)
    job_logs = log_base / job_id
    output = log_base / f"slurm-{job_id}.out"
    if as_json:
        doc = {
            "job_id": job_id,
            "model": request.model,
            "log_dir": str(job_logs),
            "output": str(output),
            "command": argv,
        }
        print(json.dumps(doc, indent=2))
        return
    where = f" on partition {partition}" if partition else ""
    print(f"submitted job {job_id}: {request.model} on {gpus} GPU{'s' * (gpus != 1)}{where}")
    print(f"logs:  {job_logs}/ (agent.log, engine.log); batch output {output}")
    print(f"watch: squeue -j {job_id}    fabric nodes --label {SLURM_JOB_LABEL}={job_id}")
    print(f"stop:  scancel {job_id}  (the node leaves the mesh gracefully)")


@slurm_app.command("ports", hidden=True, help="Print free HTTP, gossip and engine ports.")
def ports(
    host: Annotated[str, typer.Option(metavar="HOST", help="Where they must be free.")] = "0.0.0.0",
) -> None:
    chosen = pick_ports([DEFAULT_HTTP_PORT, DEFAULT_GOSSIP_PORT, None], host)
    print(" ".join(str(p) for p in chosen))
