"""Capacity across sites: how many of a model's replicas our site's controller keeps when the
service file counts them over several sites (``prefer_sites``). Pure: numbers in, numbers out.

Each site runs its own controller against its own Slurm; they share no state but what the
sites' signed summaries say (``federation.summary``: per model, the replicas SERVING at each
site). A model with ``prefer_sites = [B, A]`` and ``min_replicas = 2`` wants two replicas in
all, at B first. Every site computes its own share from the same rule, so no site needs to
ask another:

* **Floor.** A site's floor is what the sites before it in the preference do not serve now:
  ``max(0, min_replicas - sum(serving at the sites listed before ours))``. The first site's
  floor is the whole ``min_replicas``: it always tries (its jobs wait in its queue, or its
  Slurm refuses and the controller retries). A later site makes up what the earlier ones do
  not serve, and only that.
* **Ceiling.** ``max_replicas`` bounds the sum over every site: ours is ``max(floor,
  max_replicas - sum(serving at every other listed site))``.

Why serving and not wanted: it makes every move make-before-break across sites. When B's
partition refuses, B serves 0 and A's floor is 2: A starts two. When B accepts again, B's
jobs start and each that serves lowers A's floor (and, with ``max_replicas = min_replicas``,
its ceiling) by one: A drains one replica per replica B serves, never before, and the model
never has fewer than ``min_replicas`` serving across the sites while each site's own
controller keeps its floor (the demand controller above the floor is each site's own).

A site not in the preference list keeps none (0, 0): the preference names where replicas go.
A site that is not routable (cut off: no summary for a while) is taken to serve nothing
(``serving`` leaves it out): a cut-off site's share is made up elsewhere, at the price of
running more than ``min_replicas`` while the cut lasts; its own controller keeps its floor
(it cannot see the others either), so each side of a partition keeps the model served.

Scale from zero at the quickest site (``dataplane.sites`` rule 8): our controller says, per
model it would start now, how long the start is expected to take (``starts_of``: the learned
start-up time, ``reconcile.Memory.start_s``; none while our Slurm refuses the model or keeps
its jobs pending too long). The gateway puts it in our site's summary, and a gateway elsewhere
sends the requests that wait for a start to the site that would serve first: its held requests
are the demand its controller starts for, so only that site starts. A model our site may not
serve (residency ``sites``) or has no room for (a ceiling of 0) has no start here.

Laws (tests/unit/elastic/test_sitespread.py, Hypothesis): a floor and a ceiling are within
``[0, max_replicas]`` and the floor never above the ceiling; when every site serves its floor,
the floors sum to ``min_replicas`` (the first site's whole floor when it serves it); a site's
floor never grows when an earlier site serves more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from fabricnode.elastic.vocab import ModelPlan


@dataclass(frozen=True)
class SiteShare:
    """Our site's bounds for one model (``floor <= ceiling``), and why."""

    floor: int
    ceiling: int
    # the replicas serving at the sites before ours in the preference, and at all the others
    before: int
    elsewhere: int

    blind: bool = False  # no view of the other sites (this controller is not a gateway)

    def describe(self, ours: str, prefer: tuple[str, ...]) -> str:
        if ours not in prefer:
            return f"site {ours} is not in prefer_sites ({', '.join(prefer)})"
        if self.blind:
            return (
                f"site {ours}'s share: {self.floor} to {self.ceiling}, blind: this controller "
                f"sees no other site (run the controller on a gateway: fabric start --gateway "
                f"... --controller)"
            )
        return (
            f"site {ours}'s share: {self.floor} to {self.ceiling} "
            f"({self.before} serving at sites preferred before it, {self.elsewhere} elsewhere)"
        )


def share(
    ours: str,
    prefer: tuple[str, ...],
    min_replicas: int,
    max_replicas: int,
    serving: Mapping[str, int],
) -> SiteShare:
    """Our site's floor and ceiling for a model placed by ``prefer`` (module docstring);
    ``serving``: the replicas serving at each other site, as its latest summary says."""
    if ours not in prefer:
        return SiteShare(0, 0, 0, sum(max(0, n) for s, n in serving.items() if s != ours))
    rank = prefer.index(ours)
    before = sum(max(0, serving.get(s, 0)) for s in prefer[:rank])
    elsewhere = sum(max(0, serving.get(s, 0)) for s in prefer if s != ours)
    floor = max(0, min(max_replicas, min_replicas - before))
    ceiling = max(floor, min(max_replicas, max_replicas - elsewhere))
    return SiteShare(floor, ceiling, before, elsewhere)


# What the other sites serve of a model: site -> replicas SERVING there, for the routable
# sites (the controller's ``serving_elsewhere``).
ServingElsewhere = Callable[[str], Mapping[str, int]]


def site_plan(
    plan: ModelPlan, ours: str, serving_elsewhere: ServingElsewhere | None
) -> tuple[ModelPlan, SiteShare | None]:
    """``plan`` as our site's controller acts on it: a model with ``prefer_sites`` gets our
    site's floor and ceiling as its ``min_replicas`` and ``max_replicas`` (with a floor of 0
    and a file's floor above it, no idle time: what the floor does not need goes at once);
    any other plan is unchanged (None). Without a view of the other sites (an agent that is
    not a gateway: ``serving_elsewhere`` None) they are taken to serve nothing."""
    service = plan.service
    prefer = service.prefer_sites
    if not prefer:
        return plan, None
    serving = serving_elsewhere(service.name) if serving_elsewhere is not None else {}
    got = share(ours, prefer, service.min_replicas, service.max_replicas, serving)
    if serving_elsewhere is None:
        got = replace(got, blind=True)
    idle = service.idle_to_zero_s if service.min_replicas == 0 else None
    bounded = replace(
        service, min_replicas=got.floor, max_replicas=got.ceiling, idle_to_zero_s=idle
    )
    return replace(plan, service=bounded), got


def may_start(plan: ModelPlan, ours: str) -> bool:
    """Whether our site's controller may start a replica of ``plan`` (as ``site_plan``
    bounds it): our site is allowed (residency) and its ceiling has room."""
    service = plan.service
    return service.max_replicas > 0 and (not service.sites or ours in service.sites)


def starts_of(
    plans: Iterable[ModelPlan], ours: str, start_s: Callable[[ModelPlan], float | None]
) -> dict[str, float]:
    """Per model our controller would start now, the seconds it expects the start to take
    (``start_s``; None: not soon here), to a tenth of a second (a summary changes only when
    a start time really does)."""
    out: dict[str, float] = {}
    for plan in plans:
        if may_start(plan, ours):
            seconds = start_s(plan)
            if seconds is not None:
                out[plan.model] = round(seconds, 1)
    return out
