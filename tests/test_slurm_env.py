"""Slurm job facts from the environment and from `scontrol show job` text (no Slurm needed)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from fabricnode.hostcmd import Runner
from fabricnode.slurm_env import (
    SlurmJob,
    discover_job,
    job_from_env,
    job_from_scontrol,
    parse_scontrol_jobs,
    parse_scontrol_record,
    parse_slurm_time,
    parse_time_limit,
    scontrol_argv,
)

# `scontrol show job -o 4242` for a running two-node job (Slurm 23.11).
RUNNING_ONE_LINE = (
    "JobId=4242 JobName=fabric serve UserId=alice(1001) GroupId=alice(1001) MCS_label=N/A "
    "Priority=4294901758 Nice=0 Account=research QOS=normal JobState=RUNNING Reason=None "
    "Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:12:03 "
    "TimeLimit=02:00:00 TimeMin=N/A SubmitTime=2026-11-22T07:58:10 "
    "EligibleTime=2026-11-22T07:58:10 AccrueTime=2026-11-22T07:58:10 "
    "StartTime=2026-11-22T08:00:00 EndTime=2026-11-22T10:00:00 Deadline=N/A SuspendTime=None "
    "SecsPreSuspend=0 LastSchedEval=2026-11-22T08:00:00 Scheduler=Main Partition=gpu "
    "AllocNode:Sid=login01:12345 ReqNodeList=(null) ExcNodeList=(null) NodeList=gpu-node-[07-08] "
    "BatchHost=gpu-node-07 NumNodes=2 NumCPUs=64 NumTasks=2 CPUs/Task=32 ReqB:S:C:T=0:0:*:* "
    "ReqTRES=cpu=64,mem=512G,node=2,billing=64,gres/gpu=8 "
    "AllocTRES=cpu=64,mem=512G,node=2,billing=64,gres/gpu=8 Socks/Node=* "
    "NtasksPerN:B:S:C=1:0:*:* CoreSpec=* MinCPUsNode=32 MinMemoryNode=256G MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) "
    "Network=(null) Command=/home/alice/serve.sh WorkDir=/home/alice "
    "StdErr=/home/alice/slurm-4242.out StdIn=/dev/null StdOut=/home/alice/slurm-4242.out Power= "
    "TresPerNode=gres:gpu:4\n"
)

# The same job without -o: indented continuation lines.
RUNNING_MULTI_LINE = """\
JobId=4242 JobName=fabric serve
   UserId=alice(1001) GroupId=alice(1001) MCS_label=N/A
   Priority=4294901758 Nice=0 Account=research QOS=normal
   JobState=RUNNING Reason=None Dependency=(null)
   RunTime=00:12:03 TimeLimit=02:00:00 TimeMin=N/A
   SubmitTime=2026-11-22T07:58:10 EligibleTime=2026-11-22T07:58:10
   StartTime=2026-11-22T08:00:00 EndTime=2026-11-22T10:00:00 Deadline=N/A
   Partition=gpu AllocNode:Sid=login01:12345
   NodeList=gpu-node-[07-08]
   BatchHost=gpu-node-07
   TRES=cpu=64,mem=512G,node=2,billing=64,gres/gpu=8
   Command=/home/alice/serve.sh

"""

PENDING = (
    "JobId=4243 JobName=wait JobState=PENDING Reason=Priority TimeLimit=1-00:00:00 "
    "StartTime=Unknown EndTime=Unknown Partition=gpu,gpu-long NodeList=(null)\n"
)
UNLIMITED = (
    "JobId=77 JobName=forever JobState=RUNNING TimeLimit=UNLIMITED "
    "StartTime=2026-11-22T08:00:00 EndTime=Unknown Partition=debug NodeList=n1\n"
)
ARRAY = (
    "JobId=501 ArrayJobId=500 ArrayTaskId=1 JobName=a TimeLimit=00:30:00 "
    "StartTime=2026-11-22T08:00:00 EndTime=2026-11-22T08:30:00 Partition=gpu NodeList=n1\n"
    "JobId=502 ArrayJobId=500 ArrayTaskId=2 JobName=a TimeLimit=00:30:00 "
    "StartTime=2026-11-22T08:05:00 EndTime=2026-11-22T08:35:00 Partition=gpu NodeList=n2\n"
)

TEN_UTC = datetime(2026, 11, 22, 10, 0, 0, tzinfo=UTC).timestamp()


def fake_run(output: str | None) -> tuple[list[tuple[str, ...]], Runner]:
    calls: list[tuple[str, ...]] = []

    def run(argv: Sequence[str]) -> str | None:
        calls.append(tuple(argv))
        return output

    return calls, run


# -- environment ---------------------------------------------------------------------------------


def test_outside_slurm_there_is_no_job() -> None:
    calls, run = fake_run(RUNNING_ONE_LINE)
    assert job_from_env({}) is None
    assert discover_job({"HOME": "/home/alice"}, run) is None
    assert calls == []


def test_env_with_end_time_needs_no_scontrol() -> None:
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_PARTITION": "gpu",
        "SLURM_JOB_NODELIST": "gpu-node-[07-08]",
        "SLURM_JOB_END_TIME": "1795341600",
    }
    calls, run = fake_run(None)
    assert discover_job(env, run) == SlurmJob("4242", "gpu", "gpu-node-[07-08]", 1795341600.0)
    assert calls == []


def test_old_env_names_are_understood() -> None:
    job = job_from_env({"SLURM_JOBID": "9", "SLURM_NODELIST": "n[1-2]"})
    assert job == SlurmJob("9", "", "n[1-2]", None)


@pytest.mark.parametrize("value", ["", "0", "soon", "-5"])
def test_unusable_env_end_time_is_ignored(value: str) -> None:
    job = job_from_env({"SLURM_JOB_ID": "9", "SLURM_JOB_END_TIME": value})
    assert job is not None and job.end_time is None


# -- scontrol parsing ----------------------------------------------------------------------------


def test_one_line_record_parses_keys_with_odd_characters_and_spaces() -> None:
    rec = parse_scontrol_record(RUNNING_ONE_LINE.strip())
    assert rec["JobId"] == "4242"
    assert rec["JobName"] == "fabric serve"
    assert rec["AllocNode:Sid"] == "login01:12345"
    assert rec["ReqTRES"] == "cpu=64,mem=512G,node=2,billing=64,gres/gpu=8"
    assert rec["Socks/Node"] == "*"
    assert rec["NtasksPerN:B:S:C"] == "1:0:*:*"
    assert rec["Power"] == ""
    assert rec["TresPerNode"] == "gres:gpu:4"


def test_multi_line_and_one_line_forms_agree() -> None:
    one = parse_scontrol_jobs(RUNNING_ONE_LINE)
    multi = parse_scontrol_jobs(RUNNING_MULTI_LINE)
    assert len(one) == len(multi) == 1
    for key in ("JobId", "JobName", "TimeLimit", "StartTime", "EndTime", "Partition", "NodeList"):
        assert one[0][key] == multi[0][key]


def test_job_from_scontrol_reads_end_time_in_the_given_zone() -> None:
    job = job_from_scontrol(RUNNING_ONE_LINE, "4242", tz=UTC)
    assert job == SlurmJob("4242", "gpu", "gpu-node-[07-08]", TEN_UTC, 7200)
    berlin = job_from_scontrol(RUNNING_MULTI_LINE, "4242", tz=ZoneInfo("Europe/Berlin"))
    assert berlin is not None and berlin.end_time == TEN_UTC - 3600  # CET is UTC+1 in November


def test_pending_job_has_no_end_time_but_a_limit() -> None:
    job = job_from_scontrol(PENDING, "4243", tz=UTC)
    assert job == SlurmJob("4243", "gpu,gpu-long", "", None, 86400)


def test_unlimited_job_has_no_end_time() -> None:
    job = job_from_scontrol(UNLIMITED, "77", tz=UTC)
    assert job is not None and job.end_time is None and job.time_limit_s is None


def test_missing_end_time_is_start_plus_limit() -> None:
    text = "JobId=5 TimeLimit=01:30:00 StartTime=2026-11-22T08:30:00 Partition=p\n"
    job = job_from_scontrol(text, "5", tz=UTC)
    assert job is not None and job.end_time == TEN_UTC


def test_array_output_picks_the_asked_job() -> None:
    job = job_from_scontrol(ARRAY, "502", tz=UTC)
    assert job is not None and job.node_list == "n2"
    first = job_from_scontrol(ARRAY, "999", tz=UTC)
    assert first is not None and first.job_id == "501"


@pytest.mark.parametrize(
    "text",
    ["", "slurm_load_jobs error: Invalid job id specified\n", "garbage without keys"],
)
def test_scontrol_errors_give_no_job(text: str) -> None:
    assert job_from_scontrol(text, "1") is None


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 1800),
        ("30:15", 1815),
        ("02:00:00", 7200),
        ("1-00:00:00", 86400),
        ("2-12", 216000),
        ("1-02:03", 93780),
        ("0-00:00:45", 45),
        ("UNLIMITED", None),
        ("Partition_Limit", None),
        ("INVALID", None),
        ("", None),
    ],
)
def test_time_limit_formats(text: str, seconds: int | None) -> None:
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", ["Unknown", "None", "N/A", "", "2026-13-40T99:00:00"])
def test_unparseable_slurm_times_are_none(text: str) -> None:
    assert parse_slurm_time(text) is None


def test_slurm_time_fixed_offset() -> None:
    tz = timezone(timedelta(hours=-5))
    assert parse_slurm_time("2026-11-22T05:00:00", tz) == TEN_UTC


@pytest.fixture
def utc_plus_nine() -> Iterator[None]:
    old = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Tokyo"
    time.tzset()
    try:
        yield
    finally:
        if old is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = old
        time.tzset()


@pytest.mark.usefixtures("utc_plus_nine")
def test_slurm_time_defaults_to_local_time() -> None:
    assert parse_slurm_time("2026-11-22T19:00:00") == TEN_UTC


# -- discovery -----------------------------------------------------------------------------------


def test_discover_asks_scontrol_when_env_lacks_end_time() -> None:
    calls, run = fake_run(RUNNING_ONE_LINE)
    job = discover_job({"SLURM_JOB_ID": "4242", "SLURM_JOB_PARTITION": "gpu-x"}, run, tz=UTC)
    assert calls == [scontrol_argv("4242")] == [("scontrol", "show", "job", "-o", "4242")]
    # The environment's own values win; scontrol fills the rest.
    assert job == SlurmJob("4242", "gpu-x", "gpu-node-[07-08]", TEN_UTC, 7200)


@pytest.mark.parametrize("output", [None, "", "slurm_load_jobs error: Invalid job id specified"])
def test_discover_without_working_scontrol_keeps_env_facts(output: str | None) -> None:
    _, run = fake_run(output)
    job = discover_job({"SLURM_JOB_ID": "4242", "SLURM_JOB_PARTITION": "gpu"}, run)
    assert job == SlurmJob("4242", "gpu", "", None)


def test_discover_with_real_runner_tolerates_missing_scontrol() -> None:
    job = discover_job({"SLURM_JOB_ID": "4242"})
    assert job is not None and job.job_id == "4242"
