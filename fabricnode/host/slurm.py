"""Slurm job facts: job id, partition, node list, cluster name and when the job ends.

Theory of operation
-------------------
Outside Slurm (no ``SLURM_JOB_ID``/``SLURM_JOBID``) there is no job: ``discover_job`` returns
None. Inside, the environment gives the id, partition and node list, and on recent Slurm also
``SLURM_JOB_END_TIME`` (unix seconds). When the end time is not in the environment,
``scontrol show job -o <id>`` (through an injectable ``Runner``) is parsed: ``EndTime``, else
``StartTime`` + ``TimeLimit``. Slurm prints times without a zone, in the local time of the
machine; ``parse_slurm_time`` takes a ``tz`` for tests and uses the local zone by default. A job
whose end cannot be found (no scontrol, ``EndTime=Unknown``, ``TimeLimit=UNLIMITED``) simply has
``end_time=None``: the registry then uses its own lease alone.

Leaving before the end
----------------------
A node should be gone from the mesh before Slurm kills its job, so users are moved to other
nodes while it can still finish what it accepted. ``plan_leave`` turns the job's end time and the
agent's margin (``--leave-before-end``) into the moment to start leaving: ``margin`` seconds
before the end, but never more than half the time the job has left when the agent starts (a job
shorter than twice the margin still serves for half its time). When scontrol
(``query_end_time``) reports a new end, later or earlier, ``move_leave`` keeps the margin before
it. All of it is pure arithmetic on unix seconds; ``fabricnode.host.lease`` owns the clock and
asks scontrol when to.

Submitting
----------
``sbatch_argv`` builds the ``sbatch`` command line of ``fabric slurm submit`` around the wrapper
script ``slurm/fabric-serve.sbatch`` (``find_sbatch_script``), ``parse_sbatch_job_id`` reads
``sbatch --parsable``'s answer, and ``pick_ports`` chooses the ports the wrapper hands to the
agent and the engine (the preferred ones when free, so ``fabric start``'s defaults keep working
on a node that runs one job, any free ones otherwise).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, tzinfo
from pathlib import Path

from fabricnode.host.hostcmd import Runner, run_command


@dataclass(frozen=True)
class SlurmJob:
    """One Slurm job; ``end_time`` in unix seconds, ``time_limit_s`` None when unlimited."""

    job_id: str
    partition: str = ""
    node_list: str = ""
    end_time: float | None = None
    time_limit_s: int | None = None


# -- environment -------------------------------------------------------------------------------


def job_id_of(env: Mapping[str, str]) -> str | None:
    """The Slurm job id, None outside Slurm (``SLURM_JOBID`` is its older spelling)."""
    return (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip() or None


def cluster_name_of(env: Mapping[str, str]) -> str | None:
    """The name of the Slurm cluster a job runs on (``SLURM_CLUSTER_NAME``, which Slurm sets
    in every job: ``ClusterName`` of slurm.conf), None when unset (outside Slurm)."""
    return env.get("SLURM_CLUSTER_NAME", "").strip() or None


def job_from_env(env: Mapping[str, str]) -> SlurmJob | None:
    """What the environment says about the job, None outside Slurm."""
    job_id = job_id_of(env)
    if job_id is None:
        return None
    end_time = None
    end_text = env.get("SLURM_JOB_END_TIME", "").strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", end_text) and float(end_text) > 0:
        end_time = float(end_text)
    return SlurmJob(
        job_id=job_id,
        partition=env.get("SLURM_JOB_PARTITION", "").strip(),
        node_list=(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "").strip(),
        end_time=end_time,
    )


# -- scontrol ----------------------------------------------------------------------------------

# A key starts a token (start of text or after whitespace); values may contain spaces and '='.
_KEY = re.compile(r"(?:(?<=\s)|^)([A-Za-z][A-Za-z0-9_:/.]*)=")


def parse_scontrol_record(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol show`` record (one line with ``-o``, or the indented
    multi-line form). The first occurrence of a key wins; text that is not ``Key=`` continues
    the previous value (``JobName=my job``)."""
    fields: dict[str, str] = {}
    matches = list(_KEY.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        fields.setdefault(match.group(1), text[match.end() : end].strip())
    return fields


def parse_scontrol_jobs(text: str) -> list[dict[str, str]]:
    """Every record of ``scontrol show job [-o]`` output (several for array or het jobs)."""
    records: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("JobId="):
            records.append([line])
        elif records and line.strip():
            records[-1].append(line)
    return [parse_scontrol_record(" ".join(lines)) for lines in records]


def parse_slurm_time(text: str, tz: tzinfo | None = None) -> float | None:
    """Unix time of ``2026-11-22T10:00:00`` read in ``tz`` (None: local time, as Slurm prints);
    None for ``Unknown``, ``None``, ``N/A`` or anything else."""
    try:
        moment = datetime.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None
    if tz is not None:
        moment = moment.replace(tzinfo=tz)
    try:
        return moment.timestamp()
    except (OverflowError, OSError, ValueError):
        return None


_LIMIT = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def parse_time_limit(text: str) -> int | None:
    """Seconds of a Slurm time limit: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``,
    ``D-HH:MM:SS``; None for ``UNLIMITED``, ``Partition_Limit`` or anything else."""
    match = _LIMIT.fullmatch(text.strip())
    if not match:
        return None
    days_t, a, b, c = match.groups()
    days = int(days_t) if days_t else 0
    if days_t is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(a), int(b or 0), int(c or 0)
    elif c is not None:  # HH:MM:SS
        hours, minutes, seconds = int(a), int(b), int(c)
    else:  # MM[:SS]
        hours, minutes, seconds = 0, int(a), int(b or 0)
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def job_from_scontrol(text: str, job_id: str, tz: tzinfo | None = None) -> SlurmJob | None:
    """The job ``job_id`` from ``scontrol show job -o`` output (the first record when none has
    that id), None when there is no record."""
    records = parse_scontrol_jobs(text)
    if not records:
        return None
    record = next((r for r in records if r.get("JobId") == job_id), records[0])
    limit = parse_time_limit(record.get("TimeLimit", ""))
    end_time = parse_slurm_time(record.get("EndTime", ""), tz)
    if end_time is None and limit is not None:
        start = parse_slurm_time(record.get("StartTime", ""), tz)
        end_time = None if start is None else start + limit
    return SlurmJob(
        job_id=record.get("JobId", job_id),
        partition=record.get("Partition", ""),
        node_list=_none_to_empty(record.get("NodeList", "")),
        end_time=end_time,
        time_limit_s=limit,
    )


def _none_to_empty(value: str) -> str:
    return "" if value in ("(null)", "None") else value


# -- discovery ---------------------------------------------------------------------------------


def scontrol_argv(job_id: str) -> tuple[str, ...]:
    return ("scontrol", "show", "job", "-o", job_id)


def discover_job(
    env: Mapping[str, str], run: Runner = run_command, tz: tzinfo | None = None
) -> SlurmJob | None:
    """This process's Slurm job, None outside Slurm. Asks scontrol only when the environment
    lacks the end time; environment values win over scontrol's. Blocks while scontrol runs."""
    job = job_from_env(env)
    if job is None or job.end_time is not None:
        return job
    output = run(scontrol_argv(job.job_id))
    if output is None:
        return job
    found = job_from_scontrol(output, job.job_id, tz)
    if found is None:
        return job
    return SlurmJob(
        job_id=job.job_id,
        partition=job.partition or found.partition,
        node_list=job.node_list or found.node_list,
        end_time=found.end_time,
        time_limit_s=found.time_limit_s,
    )


def query_end_time(
    job_id: str, run: Runner = run_command, tz: tzinfo | None = None
) -> float | None:
    """The job's end time as scontrol says now (it moves when an admin extends the time limit),
    None when scontrol cannot tell. Blocks while scontrol runs."""
    output = run(scontrol_argv(job_id))
    found = job_from_scontrol(output, job_id, tz) if output else None
    return found.end_time if found is not None else None


# -- leaving before the end --------------------------------------------------------------------

DEFAULT_LEAVE_BEFORE_END_S = 120.0


@dataclass(frozen=True)
class LeavePlan:
    """When to start leaving: ``leave_at`` (unix s), ``margin_s`` before ``end_time``.
    ``requested_margin_s`` is what was asked; ``margin_s`` is smaller for a short job."""

    end_time: float
    leave_at: float
    margin_s: float
    requested_margin_s: float

    @property
    def shortened(self) -> bool:
        return self.margin_s < self.requested_margin_s


def plan_leave(end_time: float | None, margin_s: float, now: float) -> LeavePlan | None:
    """The leave plan of a job ending at ``end_time``, seen at ``now``; None when there is
    nothing to plan (no known end, or ``margin_s`` 0: leaving is then up to signals).

    The margin is at most half the time left (a job already past its end leaves at once)."""
    if end_time is None or margin_s <= 0:
        return None
    left_s = max(0.0, end_time - now)
    margin = min(margin_s, left_s / 2)
    return LeavePlan(end_time, end_time - margin, margin, margin_s)


def move_leave(plan: LeavePlan, end_time: float) -> LeavePlan:
    """The plan for a job whose end moved to ``end_time`` (an admin changed the time limit):
    the same margin before the new end. A ``leave_at`` already past means leave now."""
    return replace(plan, end_time=end_time, leave_at=end_time - plan.margin_s)


# -- submitting --------------------------------------------------------------------------------

SBATCH_SCRIPT = "fabric-serve.sbatch"
ENGINES = ("vllm", "sglang", "sim")


def find_sbatch_script(env: Mapping[str, str], checkout: Path | None = None) -> Path | None:
    """The wrapper script: ``$FABRIC_SBATCH_SCRIPT``, else ``slurm/fabric-serve.sbatch`` of the
    checkout this package runs from; None when neither exists."""
    explicit = env.get("FABRIC_SBATCH_SCRIPT")
    if explicit:
        path = Path(explicit).expanduser()
        return path if path.is_file() else None
    root = checkout or Path(__file__).resolve().parents[2]  # fabricnode/host/slurm.py
    path = root / "slurm" / SBATCH_SCRIPT
    return path if path.is_file() else None


@dataclass(frozen=True)
class SubmitRequest:
    """What ``fabric slurm submit`` asks for (validated by the CLI)."""

    model: str
    gpus: int = 1
    partition: str | None = None
    time_limit: str | None = None
    job_name: str | None = None
    engine_args: tuple[str, ...] = ()
    agent_args: tuple[str, ...] = ()  # ``fabric start`` options, before ``--``
    sbatch_args: tuple[str, ...] = ()  # extra sbatch options, verbatim
    output: str | None = None  # the batch script's own output (Slurm's %j patterns allowed)


def sbatch_argv(request: SubmitRequest, script: Path, sbatch: str = "sbatch") -> list[str]:
    """``sbatch --parsable ... SCRIPT [AGENT OPTIONS --] MODEL [ENGINE ARGS]``.

    Options given in ``sbatch_args`` come last, so they override ours (sbatch takes the last).
    """
    argv = [sbatch, "--parsable", f"--job-name={request.job_name or job_name(request.model)}"]
    if request.gpus > 0:
        argv.append(f"--gres=gpu:{request.gpus}")
    if request.partition:
        argv.append(f"--partition={request.partition}")
    if request.time_limit:
        argv.append(f"--time={request.time_limit}")
    if request.output:
        argv.append(f"--output={request.output}")
    argv += [*request.sbatch_args, str(script)]
    if request.agent_args:
        argv += [*request.agent_args, "--"]
    return [*argv, request.model, *request.engine_args]


def job_name(model: str) -> str:
    """``fabric-<last path part of the model>``, shell- and Slurm-safe."""
    base = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    return "fabric-" + re.sub(r"[^A-Za-z0-9._-]", "_", base)[:48]


def parse_sbatch_job_id(stdout: str) -> str | None:
    """The job id in ``sbatch --parsable``'s answer (``1234`` or ``1234;cluster``)."""
    first = stdout.strip().splitlines()[0] if stdout.strip() else ""
    job_id = first.split(";", 1)[0].strip()
    return job_id if job_id.isdigit() else None


def pick_ports(prefer: Sequence[int | None], host: str = "0.0.0.0") -> list[int]:
    """One distinct port per entry: the preferred one when it is free (TCP and UDP) on
    ``host``, else any free one. Another process may take a port before its user binds it;
    the agent then fails with one clear line (port in use) instead of serving elsewhere."""
    chosen: list[int] = []
    for wanted in prefer:
        if wanted and wanted not in chosen and _free(host, wanted):
            chosen.append(wanted)
            continue
        while True:
            port = _any_free(host)
            if port not in chosen and port not in prefer:
                chosen.append(port)
                break
    return chosen


def _free(host: str, port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _any_free(host: str) -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if _free(host, port):
            return port
