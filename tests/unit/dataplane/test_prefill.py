"""Prefill clocks (``fabricnode.dataplane.prefill``): the backlog a node still has of what this
ingress sent it, and the per-node rate learned from streamed requests' first tokens."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.dataplane.prefill import (
    DEFAULT_RATE,
    MIN_BATCH_SHARE,
    MIN_SAMPLE_TOKENS,
    WINDOW,
    PrefillClocks,
)


def test_a_node_nothing_was_sent_to_has_no_backlog() -> None:
    clocks = PrefillClocks()
    assert clocks.backlog("a", 100.0) == 0.0
    assert len(clocks) == 0


def test_a_prompt_adds_its_tokens_over_the_rate_and_the_backlog_runs_down() -> None:
    clocks = PrefillClocks(default_rate=1000.0)
    assert clocks.sent("a", 500, 10.0)  # the node was idle
    assert clocks.backlog("a", 10.0) == pytest.approx(0.5)
    assert clocks.backlog("a", 10.2) == pytest.approx(0.3)
    assert clocks.backlog("a", 10.5) == 0.0
    assert clocks.backlog("b", 10.2) == 0.0  # per node


def test_prompts_sent_while_one_is_ahead_queue_behind_it() -> None:
    clocks = PrefillClocks(default_rate=1000.0)
    clocks.sent("a", 500, 10.0)
    assert not clocks.sent("a", 1000, 10.1)  # 0.4 s still ahead: not idle
    assert clocks.backlog("a", 10.1) == pytest.approx(1.4)


def test_idle_time_gives_no_credit() -> None:
    clocks = PrefillClocks(default_rate=1000.0)
    clocks.sent("a", 100, 10.0)
    assert clocks.sent("a", 100, 50.0)  # long idle: the clock starts again from now
    assert clocks.backlog("a", 50.0) == pytest.approx(0.1)


def test_the_rate_is_an_upper_quantile_of_the_recent_samples() -> None:
    clocks = PrefillClocks()
    assert clocks.rate("a") == DEFAULT_RATE
    clocks.observe("a", 1000, 0.5)  # 2,000 tokens/s
    assert clocks.rate("a") == pytest.approx(2000.0)
    for ttft in (0.25, 1.0, 0.5):  # 4,000, 1,000 and 2,000 tokens/s
        clocks.observe("a", 1000, ttft)
    # The samples are 1,000, 2,000, 2,000, 4,000: the 0.75 quantile of four (index 2).
    assert clocks.rate("a") == pytest.approx(2000.0)
    clocks.sent("a", 2000, 0.0)
    assert clocks.backlog("a", 0.0) == pytest.approx(1.0)  # the learned rate is used


def test_a_few_outliers_either_way_do_not_move_the_rate() -> None:
    # A prompt the engine had cached answers at once (a far too high sample); one that found a
    # long step in progress answers late (a low one). A quarter of the window may be either.
    clocks = PrefillClocks()
    for _ in range(WINDOW):
        clocks.observe("a", 1000, 0.1)  # 10,000 tokens/s
    for i in range(WINDOW // 4 - 1):
        clocks.observe("a", 1000, 0.0001 if i % 2 else 5.0)
    assert clocks.rate("a") == pytest.approx(10_000.0)


def test_old_samples_leave_the_window() -> None:
    clocks = PrefillClocks()
    for _ in range(WINDOW):
        clocks.observe("a", 1000, 0.1)
    for _ in range(WINDOW):
        clocks.observe("a", 1000, 0.2)  # the node got slower (a shared GPU, a longer model)
    assert clocks.rate("a") == pytest.approx(5000.0)


def test_a_first_token_later_than_its_slot_moves_the_clock_on_by_the_delay() -> None:
    clocks = PrefillClocks(default_rate=1000.0)
    clocks.sent("a", 500, 10.0)  # slot ends at 10.5
    due = clocks.due("a")
    clocks.sent("a", 500, 10.0)  # queued behind it: the clock ends at 11.0
    # The engine was busy with other work: the first prompt's first token came at 10.8.
    assert clocks.first_token("a", due, 10.8) == pytest.approx(0.3)
    assert clocks.backlog("a", 10.8) == pytest.approx(0.5)  # the second is still all ahead


def test_one_delay_seen_by_two_prompts_moves_the_clock_once() -> None:
    clocks = PrefillClocks(default_rate=1000.0)
    clocks.sent("a", 500, 10.0)
    first = clocks.due("a")  # 10.5
    clocks.sent("a", 500, 10.0)
    second = clocks.due("a")  # 11.0
    assert clocks.first_token("a", first, 10.8) == pytest.approx(0.3)
    # The second prompt came 0.3 s after its slot too: that is the same delay, already counted.
    assert clocks.first_token("a", second, 11.3) == 0.0
    assert clocks.backlog("a", 11.3) == 0.0
    # Later than that is news: the node fell further behind.
    clocks.sent("a", 500, 20.0)
    third = clocks.due("a")
    assert clocks.first_token("a", third, 20.7) == pytest.approx(0.2)


@pytest.mark.parametrize("at", [10.2, 10.5, math.nan], ids=["early", "on-time", "nan"])
def test_a_first_token_on_time_or_early_leaves_the_clock(at: float) -> None:
    # Early is a prefix the engine had cached, or a prompt it put ahead of others by priority:
    # the clock is never pulled back (what it holds may still be ahead).
    clocks = PrefillClocks(default_rate=1000.0)
    clocks.sent("a", 500, 10.0)
    due = clocks.due("a")
    assert clocks.first_token("a", due, at) == 0.0
    assert clocks.backlog("a", 10.0) == pytest.approx(0.5)


def test_a_first_token_from_a_forgotten_node_is_ignored() -> None:
    clocks = PrefillClocks(default_rate=1000.0)
    clocks.sent("a", 500, 10.0)
    due = clocks.due("a")
    clocks.forget("a")
    assert clocks.first_token("a", due, 99.0) == 0.0
    assert len(clocks) == 0


@pytest.mark.parametrize(
    ("tokens", "ttft"),
    [(MIN_SAMPLE_TOKENS - 1, 0.01), (1000, 0.0), (1000, -1.0), (1000, math.nan)],
    ids=["short-prompt", "zero-time", "negative-time", "nan-time"],
)
def test_samples_that_say_nothing_of_the_rate_are_ignored(tokens: int, ttft: float) -> None:
    clocks = PrefillClocks()
    clocks.observe("a", tokens, ttft)
    assert clocks.rate("a") == DEFAULT_RATE


def test_forget_drops_a_node() -> None:
    clocks = PrefillClocks(default_rate=1000.0)
    clocks.sent("a", 1000, 0.0)
    clocks.observe("a", 1000, 0.01)
    clocks.forget("a")
    assert len(clocks) == 0
    assert clocks.backlog("a", 0.0) == 0.0
    assert clocks.rate("a") == 1000.0


@pytest.mark.parametrize("rate", [0.0, -5.0, math.nan, math.inf])
def test_a_nonsense_default_rate_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="prefill default rate"):
        PrefillClocks(default_rate=rate)


@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.integers(0, 100_000),
            st.floats(0.0, 5.0),
            st.one_of(st.floats(-1.0, 100.0), st.just(math.nan)),
        ),
        max_size=40,
    )
)
def test_backlog_and_rate_stay_finite_and_bounded(
    events: list[tuple[str, int, float, float]],
) -> None:
    # Whatever a client sends (any size) and however the engine answers, the signal stays a
    # finite, non-negative number of seconds and the rate stays in its bounds.
    clocks = PrefillClocks()
    now = 0.0
    for sid, tokens, gap, ttft in events:
        now += gap
        clocks.sent(sid, tokens, now, batch=tokens % 2 == 1)
        clocks.first_token(sid, clocks.due(sid), now + ttft)
        clocks.observe(sid, tokens, ttft)
        for node in ("a", "b"):
            backlog = clocks.backlog(node, now)
            assert math.isfinite(backlog) and backlog >= 0.0
            assert 10.0 <= clocks.rate(node) <= 10_000_000.0


def test_a_batch_prompt_gets_what_the_interactive_load_leaves_of_the_rate() -> None:
    clocks = PrefillClocks(default_rate=1000.0)
    # No interactive load: a batch prompt's slot is its tokens over the rate.
    clocks.sent("a", 500, 0.0, batch=True)
    assert clocks.backlog("a", 0.0) == pytest.approx(0.5)
    # 5,000 interactive tokens sent to b; 5 s later (their slot is over) what is left of them
    # over the load window (10 s) is the share of b's rate they take.
    clocks.sent("b", 5000, 100.0)
    load = 5000 * math.exp(-5 / 10) / (10 * 1000)
    assert clocks.interactive_load("b", 105.0) == pytest.approx(load)
    clocks.sent("b", 500, 105.0, batch=True)
    assert clocks.backlog("b", 105.0) == pytest.approx(500 / (1000 * (1 - load)))
    # The load decays: a minute later, nearly nothing is left of it.
    assert clocks.interactive_load("b", 160.0) < 0.01


def test_a_batch_prompt_s_slot_assumes_at_least_a_quarter_of_the_rate() -> None:
    clocks = PrefillClocks(default_rate=1000.0)
    clocks.sent("a", 100_000, 0.0)  # far more interactive work than the node can do
    ahead = clocks.backlog("a", 1.0)
    clocks.sent("a", 1000, 1.0, batch=True)
    assert clocks.backlog("a", 1.0) - ahead == pytest.approx(1000 / (1000 * MIN_BATCH_SHARE))


def test_a_prompt_the_engine_refused_at_once_gives_its_slot_back() -> None:
    """An 8 MiB prompt (2M estimated tokens) answered 404 in a millisecond: before, the node's
    clock kept it for minutes and the batch tier waited; now its slot is given back, and the
    prompts around it keep theirs."""
    clocks = PrefillClocks(default_rate=1000.0)
    clocks.sent("a", 500, 10.0)
    clocks.sent("a", 2_000_000, 10.0)
    assert clocks.backlog("a", 10.0) == pytest.approx(2000.5)
    clocks.unsent("a", 2_000_000, 10.0, 10.001)
    assert clocks.backlog("a", 10.001) == pytest.approx(0.499)
    assert clocks.interactive_load("a", 10.001) == pytest.approx(500 / (10 * 1000), rel=1e-3)
    clocks.unsent("a", 2_000_000, 10.0, 10.002)  # never before now
    assert clocks.backlog("a", 10.002) == 0.0
    clocks.unsent("b", 10, 1.0, 1.0)  # a node with no clock: nothing
    assert clocks.backlog("b", 1.0) == 0.0
    clocks.sent("a", 100_000, 20.0, batch=True)
    clocks.unsent("a", 100_000, 20.0, 20.0, batch=True)
    assert clocks.backlog("a", 20.0) == 0.0


@given(st.lists(st.integers(1, 10**6), max_size=8), st.integers(1, 10**6))
def test_unsending_what_was_just_sent_restores_the_backlog(before: list[int], tokens: int) -> None:
    clocks = PrefillClocks(default_rate=1000.0)
    for n in before:
        clocks.sent("a", n, 5.0)
    backlog = clocks.backlog("a", 5.0)
    clocks.sent("a", tokens, 5.0)
    clocks.unsent("a", tokens, 5.0, 5.0)
    assert clocks.backlog("a", 5.0) == pytest.approx(backlog, abs=1e-6)
