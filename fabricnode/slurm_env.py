"""Slurm job facts: job id, partition, node list and when the job ends.

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
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, tzinfo

from fabricnode.hostcmd import Runner, run_command


@dataclass(frozen=True)
class SlurmJob:
    """One Slurm job; ``end_time`` in unix seconds, ``time_limit_s`` None when unlimited."""

    job_id: str
    partition: str = ""
    node_list: str = ""
    end_time: float | None = None
    time_limit_s: int | None = None


# -- environment -------------------------------------------------------------------------------


def job_from_env(env: Mapping[str, str]) -> SlurmJob | None:
    """What the environment says about the job, None outside Slurm."""
    job_id = (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip()
    if not job_id:
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
