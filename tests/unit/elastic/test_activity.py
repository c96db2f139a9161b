"""When a model was last in demand (``elastic.activity``): the latest evidence wins whatever
order it came in, nothing seen makes a model idle sooner, and models no longer declared are
forgotten."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.elastic.activity import Activity, Evidence

EVIDENCE = st.tuples(
    st.sampled_from(["a", "b"]),
    st.sampled_from(list(Evidence)),
    st.floats(0, 1e6, allow_nan=False),
)


def test_a_model_never_seen_is_idle_and_one_seen_is_active_for_its_idle_time() -> None:
    activity = Activity()
    assert activity.idle("m", 60, 0.0) and activity.idle_at("m", 60) == -math.inf
    activity.saw("m", Evidence.STARTED, 100.0)
    assert not activity.idle("m", 60, 159.9) and activity.idle("m", 60, 160.0)
    activity.saw("m", Evidence.BUSY, 150.0)
    assert activity.idle_at("m", 60) == 210.0 and activity.why("m") is Evidence.BUSY
    activity.saw("m", Evidence.LOGGED, 120.0)  # older than what is known: no change
    assert activity.last("m") == 150.0 and activity.why("m") is Evidence.BUSY
    activity.saw("m", Evidence.WANTED, math.inf)  # not a time
    assert activity.last("m") == 150.0


@settings(max_examples=200, deadline=None)
@given(st.lists(EVIDENCE, max_size=12), st.randoms(use_true_random=False))
def test_the_verdict_does_not_depend_on_the_order_evidence_came_in(
    seen: list[tuple[str, Evidence, float]], rng: object
) -> None:
    one, two = Activity(), Activity()
    for model, evidence, at in seen:
        one.saw(model, evidence, at)
    shuffled = list(seen)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    for model, evidence, at in shuffled:
        two.saw(model, evidence, at)
    for model in ("a", "b"):
        assert one.last(model) == two.last(model)
        expected = max((at for m, _, at in seen if m == model), default=None)
        assert one.last(model) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(EVIDENCE, max_size=12), EVIDENCE, st.floats(1, 1e4))
def test_more_evidence_never_makes_a_model_idle_sooner(
    seen: list[tuple[str, Evidence, float]], more: tuple[str, Evidence, float], idle_s: float
) -> None:
    activity = Activity()
    for model, evidence, at in seen:
        activity.saw(model, evidence, at)
    before = {m: activity.idle_at(m, idle_s) for m in ("a", "b")}
    activity.saw(*more)
    assert all(activity.idle_at(m, idle_s) >= before[m] for m in ("a", "b"))


def test_models_no_longer_declared_are_forgotten() -> None:
    activity = Activity()
    activity.saw("a", Evidence.WANTED, 5.0)
    activity.saw("b", Evidence.WANTED, 5.0)
    activity.keep(["b"])
    assert activity.last("a") is None and activity.last("b") == 5.0
