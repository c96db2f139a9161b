"""Slurm job facts from the environment and from `scontrol show job` text, when to leave before
the time limit, and the sbatch command of `fabric slurm submit` (no Slurm needed)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from fabricnode.config import load_config
from fabricnode.errors import ConfigError
from fabricnode.host.hostcmd import Runner
from fabricnode.host.slurm import (
    LeavePlan,
    SlurmJob,
    SubmitRequest,
    cluster_name_of,
    discover_job,
    find_sbatch_script,
    job_from_env,
    job_from_scontrol,
    job_name,
    move_leave,
    parse_sbatch_job_id,
    parse_scontrol_jobs,
    parse_scontrol_record,
    parse_slurm_time,
    parse_time_limit,
    pick_ports,
    plan_leave,
    query_end_time,
    sbatch_argv,
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


# -- leaving before the time limit ---------------------------------------------------------------

T0 = 1_800_000_000.0


def test_leave_plan_starts_the_margin_before_the_end() -> None:
    plan = plan_leave(T0 + 3600, 120, T0)
    assert plan == LeavePlan(T0 + 3600, T0 + 3480, 120, 120) and not plan.shortened


@pytest.mark.parametrize(("end", "margin"), [(None, 120.0), (T0 + 3600, 0.0)])
def test_no_leave_plan_without_an_end_time_or_with_the_margin_off(
    end: float | None, margin: float
) -> None:
    assert plan_leave(end, margin, T0) is None


def test_a_job_shorter_than_twice_the_margin_serves_for_half_its_time() -> None:
    plan = plan_leave(T0 + 60, 120, T0)
    assert plan is not None and plan.shortened
    assert plan.leave_at == T0 + 30 and plan.margin_s == 30 and plan.requested_margin_s == 120


def test_a_job_already_past_its_end_leaves_at_once() -> None:
    plan = plan_leave(T0 - 5, 120, T0)
    assert plan is not None and plan.leave_at == T0 - 5 and plan.margin_s == 0


def test_a_moved_end_moves_the_leave_with_the_same_margin() -> None:
    plan = plan_leave(T0 + 3600, 120, T0)
    assert plan is not None
    assert move_leave(plan, T0 + 7200) == LeavePlan(T0 + 7200, T0 + 7080, 120, 120)
    assert move_leave(plan, T0 + 1800) == LeavePlan(T0 + 1800, T0 + 1680, 120, 120)


def test_query_end_time_asks_scontrol_each_time() -> None:
    calls, run = fake_run(RUNNING_ONE_LINE)
    assert query_end_time("4242", run, tz=UTC) == TEN_UTC
    assert query_end_time("4242", run, tz=UTC) == TEN_UTC
    assert calls == [scontrol_argv("4242")] * 2
    assert query_end_time("4242", fake_run(None)[1]) is None
    assert query_end_time("4242", fake_run("")[1]) is None


def test_leave_margin_from_flag_env_or_default(tmp_path: Path) -> None:
    env = {"FABRIC_HOME": str(tmp_path), "USER": "u"}
    assert load_config(env=env).leave_before_end_s == 120
    assert load_config(env={**env, "FABRIC_LEAVE_BEFORE_END": "300"}).leave_before_end_s == 300
    flag = load_config(leave_before_end_s=0, env={**env, "FABRIC_LEAVE_BEFORE_END": "300"})
    assert flag.leave_before_end_s == 0  # the flag wins; 0 turns it off


@pytest.mark.parametrize(
    ("flag", "env_value", "message"),
    [
        (-1.0, "", "--leave-before-end -1"),
        (float("nan"), "", "--leave-before-end nan"),
        (None, "two minutes", "FABRIC_LEAVE_BEFORE_END 'two minutes'"),
        (None, "1e9", "FABRIC_LEAVE_BEFORE_END 1e+09"),
    ],
)
def test_bad_leave_margin_is_one_config_error(
    tmp_path: Path, flag: float | None, env_value: str, message: str
) -> None:
    env = {"FABRIC_HOME": str(tmp_path), "USER": "u", "FABRIC_LEAVE_BEFORE_END": env_value}
    with pytest.raises(ConfigError) as info:
        load_config(leave_before_end_s=flag, env=env)
    assert str(info.value).startswith(message)


def test_wrapper_environment_places_logs_and_rendezvous(tmp_path: Path) -> None:
    env = {"FABRIC_HOME": str(tmp_path / "h"), "USER": "u", "SLURM_JOB_ID": "9"}
    plain = load_config(env=env)
    assert plain.rendezvous_path == tmp_path / "h" / "rendezvous"
    assert plain.log_dir == tmp_path / "h" / "logs" and plain.job_log_dir is None
    assert plain.request_log_path is not None
    assert plain.request_log_path.parent == tmp_path / "h" / "logs"
    wrapped = load_config(
        env={
            **env,
            "FABRIC_RENDEZVOUS": str(tmp_path / "shared" / "rdv"),
            "FABRIC_LOG_DIR": str(tmp_path / "logs"),
            "FABRIC_JOB_LOG_DIR": str(tmp_path / "logs" / "9"),
        }
    )
    assert wrapped.rendezvous_path == tmp_path / "shared" / "rdv"
    assert wrapped.log_dir == tmp_path / "logs"
    assert wrapped.job_log_dir == tmp_path / "logs" / "9"
    assert wrapped.request_log_path == tmp_path / "logs" / "9" / "requests.jsonl"
    flag = load_config(rendezvous="", env={**env, "FABRIC_RENDEZVOUS": "/x"})
    assert flag.rendezvous_path is None  # the flag wins


# -- submitting ----------------------------------------------------------------------------------


def test_sbatch_argv_puts_sbatch_options_first_then_agent_options_then_the_model() -> None:
    request = SubmitRequest(
        model="meta-llama/Llama-3.1-8B-Instruct",
        gpus=2,
        partition="gpu",
        time_limit="04:00:00",
        engine_args=("--max-model-len", "8192"),
        agent_args=("--label", "a=b"),
        sbatch_args=("--qos=short", "--job-name=mine"),
        output="/logs/slurm-%j.out",
    )
    assert sbatch_argv(request, Path("/w/fabric-serve.sbatch")) == [
        "sbatch",
        "--parsable",
        "--job-name=fabric-Llama-3.1-8B-Instruct",
        "--gres=gpu:2",
        "--partition=gpu",
        "--time=04:00:00",
        "--output=/logs/slurm-%j.out",
        "--qos=short",
        "--job-name=mine",  # later wins in sbatch: the user's extra options override ours
        "/w/fabric-serve.sbatch",
        "--label",
        "a=b",
        "--",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--max-model-len",
        "8192",
    ]


def test_sbatch_argv_without_gpus_or_options_is_minimal() -> None:
    argv = sbatch_argv(SubmitRequest(model="m", gpus=0), Path("s"), "/usr/bin/sbatch")
    assert argv == ["/usr/bin/sbatch", "--parsable", "--job-name=fabric-m", "s", "m"]


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("org/My Model:v2", "fabric-My_Model_v2"),
        ("/models/llama/", "fabric-llama"),
        ("/", "fabric-model"),
    ],
)
def test_job_names_are_safe(model: str, name: str) -> None:
    assert job_name(model) == name


@pytest.mark.parametrize(
    ("stdout", "job_id"),
    [("4242\n", "4242"), ("4242;cluster\n", "4242"), ("", None), ("Submitted batch job 1", None)],
)
def test_parsable_sbatch_answers(stdout: str, job_id: str | None) -> None:
    assert parse_sbatch_job_id(stdout) == job_id


def test_pick_ports_takes_the_preferred_port_when_free_and_another_when_not() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        busy.listen()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        chosen = pick_ports([taken, free, None], "127.0.0.1")
    assert chosen[1] == free and chosen[0] != taken and len(set(chosen)) == 3


def test_find_sbatch_script_in_the_checkout_or_from_the_environment(tmp_path: Path) -> None:
    found = find_sbatch_script({})
    assert found is not None and found.name == "fabric-serve.sbatch"
    assert found.read_text().startswith("#!/bin/bash")
    mine = tmp_path / "serve.sh"
    mine.write_text("#!/bin/bash\n")
    assert find_sbatch_script({"FABRIC_SBATCH_SCRIPT": str(mine)}) == mine
    assert find_sbatch_script({"FABRIC_SBATCH_SCRIPT": str(tmp_path / "none")}) is None
    assert find_sbatch_script({}, checkout=tmp_path) is None


def test_the_cluster_name_is_slurms_and_absent_outside_slurm() -> None:
    assert cluster_name_of({"SLURM_JOB_ID": "1", "SLURM_CLUSTER_NAME": " alps\n"}) == "alps"
    assert cluster_name_of({"SLURM_JOB_ID": "1"}) is None
    assert cluster_name_of({"SLURM_CLUSTER_NAME": ""}) is None
    assert cluster_name_of({}) is None
