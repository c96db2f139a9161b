"""The learned start-up times kept on the acting controller's entry (``elastic.startups``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fabricnode.elastic.startups import (
    MAX_START_UP_LABELS,
    START_UP_LABEL,
    inherited_start_ups,
    parse_start_ups,
    start_up_labels,
)
from fabricnode.mesh.registry import MAX_LABEL_VALUE
from fabricnode.mesh.schema import CONTROLLER_LABEL

names = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="@="),
                min_size=1, max_size=40)  # fmt: skip
leads = st.dictionaries(
    st.tuples(names, st.one_of(st.just(""), names)),
    st.floats(min_value=0.1, max_value=86400.0).map(lambda s: round(s, 1)),
    max_size=60,
)


@given(leads)
def test_what_fits_comes_back_as_it_was_written(lead: dict[tuple[str, str], float]) -> None:
    labels = start_up_labels(lead)
    assert len(labels) <= MAX_START_UP_LABELS
    assert all(len(v) <= MAX_LABEL_VALUE and k.startswith(START_UP_LABEL) for k, v in labels)
    back = parse_start_ups(labels)
    assert all(lead[key] == seconds for key, seconds in back.items())
    written = sum(len(v.split()) for _, v in labels)
    assert len(back) == written  # every item written is read back


@given(st.lists(st.tuples(st.sampled_from([START_UP_LABEL, f"{START_UP_LABEL}.1", "x"]),
                          st.text(max_size=300)), max_size=10))  # fmt: skip
def test_any_peer_labels_parse_to_bounded_times_or_nothing(labels: list[tuple[str, str]]) -> None:
    for (model, _), seconds in parse_start_ups(labels).items():
        assert model and 0 < seconds <= 86400.0


def test_bad_items_are_left_out() -> None:
    value = "m@p=12.5 m2@=3 @p=4 m3@p=nan m4@p=-1 m5@p=1e9 m6=5 m7@p=x"
    assert parse_start_ups([(START_UP_LABEL, value)]) == {("m", "p"): 12.5, ("m2", ""): 3.0}


def test_the_controller_that_acted_last_before_me_is_the_one_taken_over() -> None:
    def entry(sid: str, since: float, lead: dict[tuple[str, str], float]) -> tuple[str, tuple]:
        return sid, ((CONTROLLER_LABEL, f"{since:.3f}"), *start_up_labels(lead))

    entries = [
        entry("a", 100.0, {("m", "p"): 10.0}),  # acted first, died
        entry("b", 150.0, {("m", "p"): 20.0}),  # acted next, died: the one taken over
        entry("me", 200.0, {("m", "p"): 99.0}),
        entry("d", 300.0, {("m", "p"): 30.0}),  # a later candidate never acted before me
        ("e", ((CONTROLLER_LABEL, "120.000"),)),  # a candidate without labels
    ]
    assert inherited_start_ups(entries, "me", 200.0) == {("m", "p"): 20.0}
    assert inherited_start_ups(entries, "a", 100.0) == {}
