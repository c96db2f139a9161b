"""The controller's reasons: each decision's metric label comes from its ``Reason``, never from
the sentence, and the labels are the public ones (docs/services.md, "How the controller
decides"; docs/operators.md)."""

from __future__ import annotations

from fabricnode.elastic.jobs import END_CAUSES
from fabricnode.elastic.vocab import END_REASONS, Decision, Reason, Why

# fabric_controller_decisions_total{action_reason} as docs/services.md lists them
DOCUMENTED = {
    "submit:preempted": (Reason.PREEMPTED, "replaces job 12 (preempted)"),
    "submit:time limit": (Reason.TIME_LIMIT, "time limit of job 12 in 95 s"),
    "submit:node failure": (Reason.NODE_FAILURE, "replaces job 12 (node failure)"),
    "submit:forecast": (Reason.FORECAST, "forecast: 3 replicas for the demand expected in 95 s"),
    "submit:load": (Reason.LOAD, "load: 2 replicas, KV caches 97% used"),
    "submit:objective": (Reason.OBJECTIVE, "objective: 2 replicas, p95 TTFT 3.10 s over 2 s"),
    "cancel:scale down": (Reason.SCALE_DOWN, "scale down to 1: low-demand: 1 replica"),
    "cancel:pending": (Reason.PENDING, "pending 301 s on partition gpu-preempt"),
    "refused:sbatch": (Reason.SBATCH, "sbatch at partition gpu: invalid partition specified"),
}


def test_documented_labels_come_from_the_reason() -> None:
    for label, (reason, text) in DOCUMENTED.items():
        action = label.split(":", 1)[0]
        decision = Decision(0.0, "m", action, Why(reason, text), "7")
        assert ":".join(decision.key) == label
        assert decision.line() == f"{action} m job 7: {text}"


def test_the_label_does_not_depend_on_the_words() -> None:
    """Slurm's own words once made the label (``Batch job submission failed`` read as
    ``failed``): the reason decides it now."""
    words = "sbatch at partition gpu: QOSMaxSubmitJobPerUserLimit; Batch job submission failed"
    assert Decision(0.0, "m", "refused", Why(Reason.SBATCH, words)).key == ("refused", "sbatch")
    ended = Why(Reason.ENDED, "replaces job 12 (ended)")
    assert Decision(0.0, "m", "submit", ended).key == ("submit", "ended")


def test_the_labels_of_the_other_reasons_are_the_ones_reported_so_far() -> None:
    assert {r.label for r in Reason} >= {
        "failed", "out of memory", "cancelled outside", "gone from the queue", "min replicas",
        "scale from zero", "active recently", "demand", "low-demand", "bounds", "no longer",
        "scancel",
    }  # fmt: skip
    assert len({r.label for r in Reason}) == len(Reason)


def test_every_end_state_with_a_cause_of_its_own_has_its_reason() -> None:
    for state, reason in END_REASONS.items():
        assert state in END_CAUSES
        assert END_CAUSES[state].startswith(reason.label)
