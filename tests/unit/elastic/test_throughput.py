"""The capacity learner (``elastic.throughput``) under a fake clock: it learns only from windows
in which every replica was saturated throughout, within its bounds, exactly what a saturated
replica did; and without evidence it says the prior."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.elastic.policy import LoadSample, ReplicaCapacity, TokenDemand
from fabricnode.elastic.throughput import LearnerConfig, ThroughputLearner, saturated
from fabricnode.errors import ConfigError

PRIOR = ReplicaCapacity(prefill_tokens_per_s=2000.0, decode_tokens_per_s=400.0)
PASS_S = 2.0  # the controller's pass: a load sample each
POLL_S = 10.0  # the request logs' poll: a served window each


def busy(replicas: int) -> LoadSample:
    return LoadSample((0.5,) * replicas, (3,) * replicas)


class Clocked:
    """A learner fed as the controller feeds it: a load sample per pass, a served window per
    poll, on a fake clock."""

    def __init__(self, config: LearnerConfig | None = None) -> None:
        self.learner = ThroughputLearner(config)
        self.now = 1000.0
        self.polled = self.now

    def run(self, polls: int, load: LoadSample, per_replica: TokenDemand) -> list[bool]:
        """``polls`` windows of the same load, each replica ending ``per_replica`` tokens/s."""
        learned = []
        n = len(load.waiting)
        for _ in range(polls):
            for _ in range(round(POLL_S / PASS_S)):
                self.now += PASS_S
                self.learner.observe_load(self.now, load)
            prompt = round(per_replica.prefill_tokens_per_s * n * POLL_S)
            output = round(per_replica.decode_tokens_per_s * n * POLL_S)
            learned.append(
                self.learner.observe_served(self.now, self.polled, 5 * n, prompt, output)
            )
            self.polled = self.now
        return learned


def test_without_evidence_the_prior_is_the_capacity() -> None:
    learner = ThroughputLearner()
    assert learner.factor(PRIOR) is None and learner.capacity(PRIOR) == PRIOR
    # a window with no load sample at all teaches nothing
    assert not learner.observe_served(10.0, 0.0, 100, 10_000, 10_000)
    assert learner.capacity(PRIOR) == PRIOR


def test_a_saturated_replica_slower_than_the_prior_is_learned() -> None:
    """The simulated engine slowed down: one replica, always a queue, ends 100 prompt and 20
    output tokens/s, a tenth of the prior's work (100/2000 + 20/400)."""
    run = Clocked()
    learned = run.run(4, busy(1), TokenDemand(100.0, 20.0))
    assert learned == [True] * 4
    assert run.learner.factor(PRIOR) == pytest.approx(0.1, rel=1e-3)
    got = run.learner.capacity(PRIOR)
    assert got.prefill_tokens_per_s == pytest.approx(200.0, rel=1e-3)
    assert got.work(TokenDemand(100.0, 20.0)) == pytest.approx(1.0, rel=1e-3)


def test_an_unsaturated_replica_teaches_nothing() -> None:
    """Idle replicas serve what the demand asks, not what they could: their throughput is
    never taken for a capacity below the prior."""
    run = Clocked()
    idle = LoadSample((0.2, 0.1), (0, 0))
    assert run.run(20, idle, TokenDemand(10.0, 2.0)) == [False] * 20
    assert run.learner.capacity(PRIOR) == PRIOR
    # one of two replicas idle: the model is not saturated either
    mixed = LoadSample((0.2, 0.5), (0, 4))
    assert run.run(20, mixed, TokenDemand(10.0, 2.0)) == [False] * 20
    assert run.learner.capacity(PRIOR) == PRIOR


def test_a_window_with_an_unseen_stretch_or_a_new_replica_teaches_nothing() -> None:
    run = Clocked()
    run.run(3, busy(2), TokenDemand(100.0, 20.0))
    before = run.learner.statistics().windows
    run.now += 3 * POLL_S  # no load report for 30 s
    run.learner.observe_load(run.now, busy(2))
    assert not run.learner.observe_served(run.now, run.polled, 10, 10_000, 1_000)
    run.polled = run.now
    # the count of replicas changed within the window
    run.now += PASS_S
    run.learner.observe_load(run.now, busy(3))
    run.now += PASS_S
    run.learner.observe_load(run.now, busy(3))
    assert not run.learner.observe_served(run.now, run.polled, 10, 10_000, 1_000)
    assert run.learner.statistics().windows == before


def test_a_kv_cache_full_replica_counts_as_saturated() -> None:
    assert saturated(LoadSample((0.95,), (0,)), kv_full=0.9)
    assert not saturated(LoadSample((0.5,), (0,)), kv_full=0.9)
    assert not saturated(LoadSample((), ()), kv_full=0.9)


def test_lumpy_windows_are_averaged_by_their_sums() -> None:
    """Long requests end in bunches: windows with none and windows with several are one ratio
    of sums, not the last window alone."""
    run = Clocked(LearnerConfig(min_requests=0))
    run.run(2, busy(1), TokenDemand(0.0, 0.0))  # nothing ended
    run.run(1, busy(1), TokenDemand(300.0, 60.0))  # three windows' worth at once
    run.run(1, busy(1), TokenDemand(0.0, 0.0))
    # 4 saturated windows, three windows' worth of a tenth of the prior's work in one
    assert run.learner.statistics().windows == 4
    assert run.learner.factor(PRIOR) == pytest.approx(0.3 / 4, rel=0.02)


@given(
    k=st.floats(min_value=1e-3, max_value=1e3),
    replicas=st.integers(min_value=1, max_value=8),
    prefill_share=st.floats(min_value=0.0, max_value=1.0),
    polls=st.integers(min_value=3, max_value=12),
)
def test_law_saturated_replicas_doing_k_times_the_prior_are_learned_as_k(
    k: float, replicas: int, prefill_share: float, polls: int
) -> None:
    per_replica = TokenDemand(
        k * prefill_share * PRIOR.prefill_tokens_per_s,
        k * (1 - prefill_share) * PRIOR.decode_tokens_per_s,
    )
    run = Clocked(LearnerConfig(min_requests=0))
    run.run(polls, busy(replicas), per_replica)
    factor = run.learner.factor(PRIOR)
    assert factor is not None
    # token counts are whole: the rounding of a window's tokens is the only error
    assert factor == pytest.approx(k, rel=0.01, abs=1e-3)


@given(
    loads=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=8.0),  # seconds since the previous sample
            st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 5)), max_size=4),
        ),
        max_size=40,
    ),
    served=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=30.0),
            st.integers(0, 100),
            st.integers(0, 10**7),
            st.integers(0, 10**7),
        ),
        max_size=10,
    ),
)
def test_law_the_factor_is_bounded_and_only_saturated_windows_count(
    loads: list[tuple[float, list[tuple[float, int]]]],
    served: list[tuple[float, int, int, int]],
) -> None:
    cfg = LearnerConfig(min_replica_s=0.0, min_requests=0)
    learner = ThroughputLearner(cfg)
    now = 0.0
    samples: list[tuple[float, LoadSample]] = []
    for dt, rows in loads:
        now += dt
        load = LoadSample(tuple(kv for kv, _ in rows), tuple(w for _, w in rows))
        learner.observe_load(now, load)
        samples.append((now, load))
    for window, requests, prompt, output in served:
        since = now - window
        learned = learner.observe_served(now, since, requests, prompt, output)
        if learned:  # every sample over the window saturated
            over = [load for at, load in samples if since - cfg.max_gap_s <= at <= now]
            assert over and all(saturated(load, cfg.kv_full) for load in over)
    factor = learner.factor(PRIOR)
    if factor is not None:
        assert 1 / cfg.max_factor <= factor <= cfg.max_factor
    if learner.statistics().windows == 0:
        assert learner.capacity(PRIOR) == PRIOR


@given(
    n=st.integers(min_value=1, max_value=2000),
    step=st.floats(min_value=0.01, max_value=5.0),
)
def test_law_memory_is_bounded(n: int, step: float) -> None:
    learner = ThroughputLearner()
    for i in range(n):
        learner.observe_load(i * step, busy(1))
    assert len(learner._samples) <= 512


def test_invalid_knobs_are_refused() -> None:
    for bad in (
        {"max_gap_s": 0.0},
        {"half_life_s": float("inf")},
        {"kv_full": 1.5},
        {"min_requests": -1},
        {"max_factor": 0.5},
    ):
        with pytest.raises(ConfigError):
            LearnerConfig(**bad)  # type: ignore[arg-type]
