"""What the acting controller learned of its jobs' start-up times, kept in the mesh so that a
controller taking over starts from it (issue: "what a controller remembers survives a
takeover, in the mesh").

The acting controller labels its own entry ``fabric.controller.start_up`` (and ``.1`` ...,
``START_UP_LABEL``: under the controller label's prefix, so one relabel writes them together)
with its learned time from ``sbatch`` to SERVING per model and partition (``Memory.lead``),
as space-separated items ``<model>@<partition>=<seconds>``. The entry is owner-signed and
gossiped like any other; when the controller dies its last entry stays in the registries for a
while, dead. The candidate that acts next (the one that became a candidate the latest before
itself: the most recent one to act) reads them at its first pass (``seed``), takes them as its
own learned times, and does not learn again from the jobs it inherits already serving: the
first controller learned those. Without labels (the first controller, or one of a version
without them), the new one learns from the agents' ``fabric.serving_since`` as before.

Peer input: every item is checked (a model without spaces, a partition without ``=``, seconds
finite and within a day), at most ``MAX_START_UP_LABELS`` labels within the registry's value
limit; what does not parse is left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from fabricnode.elastic.leader import candidate_since
from fabricnode.mesh.registry import MAX_LABEL_VALUE
from fabricnode.mesh.schema import CONTROLLER_LABEL

START_UP_LABEL = f"{CONTROLLER_LABEL}.start_up"
MAX_START_UP_LABELS = 8
MAX_START_UP_S = 86400.0


def start_up_labels(lead: Mapping[tuple[str, str], float]) -> tuple[tuple[str, str], ...]:
    """The labels for ``lead`` ((model, partition) -> seconds), items sorted, each value within
    the registry's limit, at most ``MAX_START_UP_LABELS`` labels (the rest left out)."""
    values: list[str] = []
    for (model, partition), seconds in sorted(lead.items()):
        if not (0 < seconds <= MAX_START_UP_S) or "@" in partition or " " in model + partition:
            continue
        item = f"{model}@{partition}={seconds:.1f}"
        if len(item) > MAX_LABEL_VALUE:
            continue
        if values and len(values[-1]) + 1 + len(item) <= MAX_LABEL_VALUE:
            values[-1] += " " + item
        elif len(values) < MAX_START_UP_LABELS:
            values.append(item)
    keys = [START_UP_LABEL] + [f"{START_UP_LABEL}.{i}" for i in range(1, MAX_START_UP_LABELS)]
    return tuple(zip(keys, values, strict=False))


def parse_start_ups(labels: Iterable[tuple[str, str]]) -> dict[tuple[str, str], float]:
    """(model, partition) -> seconds from an entry's start-up labels (peer input)."""
    out: dict[tuple[str, str], float] = {}
    keys = {START_UP_LABEL} | {f"{START_UP_LABEL}.{i}" for i in range(1, MAX_START_UP_LABELS)}
    for key, value in labels:
        if key not in keys:
            continue
        for item in value.split():
            head, sep, seconds = item.rpartition("=")
            model, at, partition = head.rpartition("@")
            if not (sep and at and model):
                continue
            try:
                s = float(seconds)
            except ValueError:
                continue
            if math.isfinite(s) and 0 < s <= MAX_START_UP_S:
                out[(model, partition)] = s
    return out


def inherited_start_ups(
    entries: Iterable[tuple[str, Iterable[tuple[str, str]]]], me: str, my_since: float
) -> dict[tuple[str, str], float]:
    """The start-up times of the controller that acted last before ``me`` (session id) from
    ``entries`` ((session id, labels) of the registry, dead ones included): of the other
    candidates that became one before ``my_since`` and label start-ups, the latest to become
    one (the earlier ones acted before it, and died before it did); {} without one."""
    best: tuple[float, dict[tuple[str, str], float]] | None = None
    for session_id, labels in entries:
        labels = tuple(labels)
        since = candidate_since(labels)
        if session_id == me or since is None or since >= my_since:
            continue
        found = parse_start_ups(labels)
        if found and (best is None or since > best[0]):
            best = (since, found)
    return best[1] if best is not None else {}
