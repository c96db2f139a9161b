"""Our Slurm jobs as ``squeue`` shows them: the record ``reconcile`` decides from. Pure.

``slurmctl`` (the controller's hands on Slurm, which runs the commands) parses ``squeue`` into
``Job`` records; the pure reconciler reads them. The record lives here, below both, so that
``reconcile`` does not import the module that runs Slurm's commands.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    """One of our jobs as squeue shows it; times in unix seconds (None when unknown)."""

    job_id: str
    model: str
    state: str  # PENDING, RUNNING, COMPLETING, ... (squeue's long names)
    partition: str
    submitted_at: float | None
    started_at: float | None
    ends_at: float | None
    time_limit_s: int | None
    reason: str
    replaces: str = ""
    gres_type: str = ""  # the Slurm GPU type asked for ("" = any type), from the tag
    gpus: int | None = None  # GPUs asked for, from the tag (None: an older tag without it)

    @property
    def pending(self) -> bool:
        return self.state in ("PENDING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED")

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"

    @property
    def ending(self) -> bool:
        return not (self.pending or self.running)

    @property
    def end_cause(self) -> str:
        """How an ended job ended, in words ("" while it is pending or running)."""
        if not self.ending:
            return ""
        return END_CAUSES.get(self.state, self.state.lower().replace("_", " "))


# squeue's final states, as the reason of a replacement says them
END_CAUSES = {
    "PREEMPTED": "preempted",
    "TIMEOUT": "time limit reached",
    "FAILED": "failed",
    "NODE_FAIL": "node failure",
    "BOOT_FAIL": "node failure",
    "OUT_OF_MEMORY": "out of memory",
    "CANCELLED": "cancelled outside the fabric",
    "COMPLETED": "ended",
    "COMPLETING": "ended",
    "DEADLINE": "deadline reached",
}
