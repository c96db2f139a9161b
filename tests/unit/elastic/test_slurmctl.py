"""The controller's Slurm adapter: tags, squeue parsing, sbatch command lines, Slurm's refusals
and dry-run, with a recording runner instead of Slurm (the real one is in tests/slurm)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from fabricnode.elastic.slurmctl import (
    JOB_AGENT_ARGS,
    SlurmControl,
    SlurmRefused,
    Tag,
    comment_for,
    mesh_tag,
    parse_comment,
    parse_squeue,
)
from fabricnode.elastic.vocab import MIN_REPLICAS, Placement, Submit
from tests.unit.elastic.plans import plan


def submit(model: str, partition: str | None = None, gpus: int = 1, **service: object) -> Submit:
    return Submit(plan(model, gpus=gpus, **service), Placement(partition, "", gpus), MIN_REPLICAS)


MESH = mesh_tag(b"k" * 32)


def test_comments_tag_our_jobs_and_nobody_elses() -> None:
    text = comment_for(MESH, "org/Model 7B", "41")
    assert parse_comment(text, MESH) == Tag("org/Model 7B", "41")
    assert parse_comment(text, mesh_tag(b"other" * 8)) is None
    assert parse_comment("my own job", MESH) is None
    assert parse_comment(comment_for(MESH, "m"), MESH) == Tag("m")
    typed = comment_for(MESH, "m", "", "a100_80g", 4)
    assert parse_comment(typed, MESH) == Tag("m", "", "a100_80g", 4)
    assert parse_comment(comment_for(MESH, "m", "9", "", 2), MESH) == Tag("m", "9", "", 2)


def test_squeue_lines_become_jobs_with_unix_times() -> None:
    ours, pending = comment_for(MESH, "llama", "7"), comment_for(MESH, "llama")
    times = "2026-11-25T10:00:00|2026-11-25T10:00:05|2026-11-25T10:02:05"
    text = "\n".join(
        [
            f"12|RUNNING|gpu|{times}|2:00|None|{ours}",
            f"13|PENDING|gpu|2026-11-25T10:01:00|N/A|N/A|2:00|Resources|{pending}",
            "14|RUNNING|gpu|2026-11-25T10:00:00|N/A|N/A|2:00|None|somebody else's",
            "garbage",
        ]
    )
    jobs = parse_squeue(text, MESH)
    assert [j.job_id for j in jobs] == ["12", "13"]
    running, pending = jobs
    assert running.running and running.replaces == "7" and running.time_limit_s == 120
    assert running.ends_at is not None and running.started_at is not None
    assert running.ends_at - running.started_at == 120
    assert pending.pending and pending.started_at is None and pending.reason == "Resources"


class Recorder:
    def __init__(self, answers: dict[str, tuple[int, str, str]]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> tuple[int, str, str]:
        self.calls.append(list(argv))
        return self.answers.get(argv[0], (0, "", ""))


def control(runner: Recorder, dry_run: bool = False) -> SlurmControl:
    return SlurmControl(MESH, Path("/opt/fabric-serve.sbatch"), "alice", runner, dry_run)


def test_sbatch_line_carries_the_tag_resources_and_the_wrapper_arguments() -> None:
    runner = Recorder({"sbatch": (0, "4242;cluster\n", "")})
    ctl = control(runner)
    template = "vllm serve {model_path} --port {port} --tensor-parallel-size {tp}"
    llama = plan(
        "llama-3.1-8b", gpus=2, time_limit_s=7200, account="proj", qos="normal",
        sbatch_args=("--constraint=a100",), engine=template, model_path="/models/llama",
    )  # fmt: skip
    job = ctl.submit(Submit(llama, Placement("gpu-preempt", "", 2), MIN_REPLICAS, replaces="41"))
    assert job == "4242"
    argv = runner.calls[0]
    # The file's options first, the controller's after them: sbatch takes the last of two.
    assert argv[:4] == [
        "sbatch",
        "--constraint=a100",
        "--parsable",
        "--job-name=fabric-llama-3.1-8b",
    ]
    assert f"--comment={comment_for(MESH, 'llama-3.1-8b', '41', gpus=2)}" in argv
    for flag in ("--gres=gpu:2", "--partition=gpu-preempt", "--time=02:00:00",
                 "--account=proj", "--qos=normal", "--export=ALL,FABRIC_ENGINE=template",
                 "--constraint=a100"):  # fmt: skip
        assert flag in argv
    script = argv.index("/opt/fabric-serve.sbatch")
    assert argv[script + 1 :] == [
        *JOB_AGENT_ARGS, "--label", "fabric.service=llama-3.1-8b",
        "--engine-template", template, "--model-path", "llama-3.1-8b=/models/llama",
        "--", "llama-3.1-8b",
    ]  # fmt: skip
    sim = ctl.sbatch_argv(submit("m"))
    assert "--export=ALL,FABRIC_ENGINE=sim" in sim and sim[-3:] == ["fabric.service=m", "--", "m"]
    assert ctl.commands and ctl.commands[0].startswith("sbatch --constraint=a100 --parsable")


def test_slurms_refusal_is_one_error_with_its_own_words() -> None:
    runner = Recorder(
        {
            "sbatch": (1, "", "sbatch: error: invalid partition specified: nope\n"),
            "scancel": (1, "", "scancel: error: Invalid job id specified\n"),
        }
    )
    ctl = control(runner)
    with pytest.raises(SlurmRefused, match=r"^invalid partition specified: nope$"):
        ctl.submit(submit("m", "nope"))
    with pytest.raises(SlurmRefused, match="Invalid job id"):
        ctl.cancel("99")
    # slurm-wlm 22.05 over a QoS's MaxSubmitJobsPerUser (tests/slurm/test_elastic_qos.py)
    runner.answers["sbatch"] = (
        1,
        "",
        "sbatch: error: QOSMaxSubmitJobPerUserLimit\n"
        "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy"
        " (job submit limit, user's size and/or time limits)\n",
    )
    with pytest.raises(SlurmRefused) as refused:
        ctl.submit(submit("m", "high"))
    assert str(refused.value) == (
        "QOSMaxSubmitJobPerUserLimit; Batch job submission failed: Job violates accounting/QOS"
        " policy (job submit limit, user's size and/or time limits)"
    )
    runner.answers["squeue"] = (1, "", "slurm_load_jobs error: Unable to contact slurm controller")
    with pytest.raises(SlurmRefused, match="squeue failed: slurm_load_jobs error"):
        ctl.list_jobs()


def test_dry_run_records_commands_and_runs_only_squeue() -> None:
    runner = Recorder({"squeue": (0, "", "")})
    ctl = control(runner, dry_run=True)
    assert ctl.list_jobs() == []
    assert ctl.submit(submit("m")).startswith("dry-run-")
    ctl.cancel("5")
    assert [c[0] for c in runner.calls] == ["squeue"]
    assert ctl.commands[0].startswith("sbatch ") and ctl.commands[1] == "scancel --signal=TERM 5"


def test_a_short_job_gets_slurms_warning_signal_a_quarter_before_its_end() -> None:
    ctl = control(Recorder({}), dry_run=True)
    short = ctl.sbatch_argv(submit("m", time_limit_s=120))
    assert "--signal=TERM@30" in short and "--time=00:02:00" in short
    assert not any(
        a.startswith("--signal") for a in ctl.sbatch_argv(submit("m", time_limit_s=3600))
    )
