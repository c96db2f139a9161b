"""The controller's hands on Slurm: submit, list and cancel the jobs it owns, or only say so.

Rules
-----
* Every job the controller submits is tagged in its Slurm *comment*:
  ``fabric-elastic mesh=<mesh id> model=<model, %-quoted> [replaces=<job id>]``. The mesh id
  (``mesh_tag``) keeps two meshes run by one user apart; the
  model says which service the job serves; ``replaces`` links a time-limit successor to the
  job it takes over from. ``list_jobs`` lists the user's jobs with ``squeue`` and keeps only
  ours, so decisions always start from Slurm's own view, never from the controller's memory.
* ``submit`` runs ``sbatch --parsable`` around the ``fabric-serve.sbatch`` wrapper for a pass's
  ``vocab.Submit`` (the placement's partition and GPUs; the service's account, QoS, time limit
  and extra options, a short job's warning signal), and returns the job id
  or a ``SlurmRefused`` carrying sbatch's own words, all its error lines (unknown partition,
  QoS limit, ...). The job's agent is labelled ``fabric.service=<model>``; it runs the
  simulated engine (``FABRIC_ENGINE=sim``) or renders the service's engine template itself
  (``FABRIC_ENGINE=template``, ``fabric start --engine-template T --serve MODEL``).
* ``dry_run`` records every command it would run (``commands``) and runs nothing but the
  read-only ``squeue``.
* Blocking: call from a worker thread (``trio.to_thread.run_sync``).
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote

from fabricnode.elastic.jobs import Job as Job
from fabricnode.elastic.servicefile import ModelService
from fabricnode.elastic.vocab import Submit
from fabricnode.errors import FabricError
from fabricnode.host.hostcmd import run_full
from fabricnode.host.slurm import parse_sbatch_job_id, parse_slurm_time, parse_time_limit
from fabricnode.mesh.schema import SERVICE_LABEL

TAG = "fabric-elastic"
SQUEUE_FIELDS = (
    "%i|%T|%P|%V|%S|%e|%l|%r|%k"  # id state partition submit start end limit reason comment
)
COMMAND_TIMEOUT_S = 30.0

# argv -> (exit status, stdout, stderr); a missing command is 127
Runner = Callable[[Sequence[str]], tuple[int, str, str]]


class SlurmRefused(FabricError):
    """sbatch or scancel said no; the message is Slurm's own."""


def run(argv: Sequence[str]) -> tuple[int, str, str]:
    return run_full(argv, COMMAND_TIMEOUT_S)


def mesh_tag(seed: bytes) -> str:
    """A short, stable id of a mesh from something every agent of it shares (the agent uses
    its ``$FABRIC_HOME`` path, which the jobs share for the rendezvous file; not the cluster
    key, which an operator may rotate)."""
    return hashlib.sha256(b"fabric/elastic/mesh/v1\0" + seed).hexdigest()[:12]


# The jobs' agents take any free ports (they announce them in the registry): several jobs
# starting at once on one node must not race for the wrapper's preferred 8080/7946.
JOB_AGENT_ARGS = ("--http", "0.0.0.0:0", "--gossip", "0.0.0.0:0")
MAX_SIGNAL_LEAD_S = 120  # the wrapper's --signal=TERM@120


def signal_args(time_limit_s: int | None) -> tuple[str, ...]:
    """Slurm's warning signal (the agent leaves on it) at most a quarter of a short job
    before its end, not the wrapper's 120 s that would end a 2-minute job at once."""
    if time_limit_s is not None and time_limit_s < 4 * MAX_SIGNAL_LEAD_S:
        return (f"--signal=TERM@{max(10, time_limit_s // 4)}",)
    return ()


def agent_args(service: ModelService) -> tuple[str, ...]:
    """The job's ``fabric start`` options before the service's own (engine, label, model)."""
    if service.sleep_after_s is None:
        return JOB_AGENT_ARGS
    return (*JOB_AGENT_ARGS, "--sleep-after", f"{service.sleep_after_s:g}")


@dataclass(frozen=True)
class Tag:
    """What a job's comment says of it (``comment_for``)."""

    model: str
    replaces: str = ""
    gres_type: str = ""
    gpus: int | None = None


def comment_for(
    mesh: str, model: str, replaces: str = "", gres_type: str = "", gpus: int | None = None
) -> str:
    text = f"{TAG} mesh={mesh} model={quote(model, safe='')}"
    if gpus is not None:
        text += f" gpu={quote(gres_type, safe='')}:{gpus}"
    return text + (f" replaces={replaces}" if replaces else "")


def parse_comment(comment: str, mesh: str) -> Tag | None:
    """The tag of one of this mesh's jobs, or None for any other job."""
    words = comment.split()
    if not words or words[0] != TAG:
        return None
    fields = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    if fields.get("mesh") != mesh or not fields.get("model"):
        return None
    gres_type, gpus = "", None
    kind, sep, count = fields.get("gpu", "").rpartition(":")
    if sep and count.isdigit():
        gres_type, gpus = unquote(kind), int(count)
    return Tag(unquote(fields["model"]), fields.get("replaces", ""), gres_type, gpus)


def parse_squeue(text: str, mesh: str) -> list[Job]:
    jobs: list[Job] = []
    for line in text.splitlines():
        parts = line.strip().split("|", 8)
        if len(parts) != 9:
            continue
        job_id, state, partition, submit, start, end, limit, reason, comment = parts
        ours = parse_comment(comment, mesh)
        if ours is None or not job_id.strip():
            continue
        jobs.append(
            Job(
                job_id.strip(),
                ours.model,
                state.strip(),
                partition.strip(),
                parse_slurm_time(submit.strip()),
                parse_slurm_time(start.strip()),
                parse_slurm_time(end.strip()),
                parse_time_limit(limit.strip()),
                "" if reason.strip() == "None" else reason.strip(),
                ours.replaces,
                ours.gres_type,
                ours.gpus,
            )
        )
    return jobs


@dataclass
class SlurmControl:
    mesh: str
    script: Path
    user: str  # whose jobs squeue lists (the agent's user)
    runner: Runner = run
    dry_run: bool = False
    output: str | None = None  # the jobs' batch output (Slurm's %j allowed); None: sbatch's
    commands: list[str] = field(default_factory=list)  # what ran (or would have, dry-run)

    def list_jobs(self) -> list[Job]:
        # every state: a job that ended lately (within slurmctld's MinJobAge) shows how it ended
        # (PREEMPTED, TIMEOUT, NODE_FAIL...), which names the cause of its replacement
        argv = [
            "squeue", "--noheader", "--states=all", "-u", self.user, f"--format={SQUEUE_FIELDS}",
        ]  # fmt: skip
        rc, out, err = self.runner(argv)
        if rc != 0:
            raise SlurmRefused(f"squeue failed: {(err or out).strip() or f'exit status {rc}'}")
        return parse_squeue(out, self.mesh)

    def sbatch_argv(self, s: Submit) -> list[str]:
        service, place = s.plan.service, s.placement
        # The service's own options first and the controller's after them: sbatch takes the
        # last of an option given twice, so the tag, size and environment the controller
        # counts its jobs by are its own whatever the file says (which is checked for those
        # options by sbatch's own spelling rules too: ``servicevalues``).
        argv = ["sbatch", *service.sbatch_args, "--parsable"]
        argv.append(f"--job-name=fabric-{_slug(service.name)}")
        comment = comment_for(self.mesh, service.name, s.replaces, place.gres_type, place.gpus)
        argv.append(f"--comment={comment}")
        if place.gpus > 0:
            kind = f"{place.gres_type}:" if place.gres_type else ""
            argv.append(f"--gres=gpu:{kind}{place.gpus}")
        if self.output:
            argv.append(f"--output={self.output}")
        for flag, value in (
            ("--partition", place.partition),
            ("--time", service.time_limit),
            ("--account", service.account),
            ("--qos", service.qos),
        ):
            if value:
                argv.append(f"{flag}={value}")
        agent = [*agent_args(service), "--label", f"{SERVICE_LABEL}={service.name}"]
        if service.engine.strip() == "sim":
            argv.append("--export=ALL,FABRIC_ENGINE=sim")
        else:  # the job's agent renders the template for the model (fabric start --serve)
            argv.append("--export=ALL,FABRIC_ENGINE=template")
            agent += ["--engine-template", service.engine]
            if service.model_path:
                agent += ["--model-path", f"{service.name}={service.model_path}"]
        return [
            *argv,
            *signal_args(service.time_limit_s),
            str(self.script),
            *agent,
            "--",
            service.name,
        ]

    def submit(self, s: Submit) -> str:
        """The new job's id; ``SlurmRefused`` with sbatch's message when it says no."""
        argv = self.sbatch_argv(s)
        self.commands.append(shlex.join(argv))
        if self.dry_run:
            return f"dry-run-{len(self.commands)}"
        rc, out, err = self.runner(argv)
        job_id = parse_sbatch_job_id(out) if rc == 0 else None
        if job_id is None:
            raise SlurmRefused(_slurm_words(err or out) or f"sbatch exit status {rc}")
        return job_id

    def preempted(self, job_id: str) -> bool:
        """Whether Slurm preempted the job: a preempted job that leaves within its grace time
        ends COMPLETED, but its record keeps ``PreemptTime`` (while squeue still lists it)."""
        argv = ["squeue", "--noheader", "--states=all", "-j", job_id, "-O", "PreemptTime"]
        rc, out, err = self.runner(argv)
        if rc != 0:
            raise SlurmRefused(f"squeue failed: {(err or out).strip() or f'exit status {rc}'}")
        return parse_slurm_time(out.strip()) is not None

    def cancel(self, job_id: str, hard: bool = False) -> None:
        """SIGTERM to the job's step, the agent (it leaves and drains its requests, then exits,
        and the job ends with it); ``hard``: cancel the job outright (a drain that hangs)."""
        argv = ["scancel", job_id] if hard else ["scancel", "--signal=TERM", job_id]
        self.commands.append(shlex.join(argv))
        if self.dry_run:
            return
        rc, out, err = self.runner(argv)
        if rc != 0:
            raise SlurmRefused(_slurm_words(err or out) or f"scancel exit status {rc}")


def _slug(model: str) -> str:
    base = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in base)[:40]


def _slurm_words(text: str) -> str:
    """What a refusing sbatch or scancel said, on one line: its error lines joined with "; "
    (sbatch says why and then what, e.g. ``QOSMaxSubmitJobPerUserLimit; Batch job submission
    failed: Job violates accounting/QOS policy (...)``), else its first line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [
        line.split(": error: ", 1)[1]
        for line in lines
        if line.startswith(("sbatch: error: ", "scancel: error: "))
    ]
    return "; ".join(errors) if errors else (lines[0] if lines else "")
