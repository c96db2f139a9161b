"""The simulated engine's pure scheduler (batching, KV capacity, prefix cache, timing, output),
and its driver and app in process on a mock clock."""

from __future__ import annotations

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from fabricnode.simengine.model import (
    BLOCK_TOKENS,
    GPU_PROFILES,
    EngineConfig,
    PrefixCache,
    Scheduler,
    block_hashes,
    detokenize,
    embedding,
    gpu_profile,
    params_from_name,
    run_until_idle,
    tokenize,
)
from fabricnode.simengine.server import EngineDriver, SimConfig, SimEngineApp


def prompt(n: int, base: int = 0) -> list[int]:
    return [(base + i) % 32_000 for i in range(n)]


def config(**kw: object) -> EngineConfig:
    defaults: dict[str, object] = {"model": "llama-3-8b", "kv_tokens": 100_000, "seed": 7}
    defaults.update(kw)
    return EngineConfig(**defaults)  # type: ignore[arg-type]


def ttfts(s: Scheduler) -> list[float]:
    return [
        r.first_token_at - r.arrived_at for r in s.requests.values() if r.first_token_at is not None
    ]


def test_saturation_raises_waiting_count_and_time_to_first_token() -> None:
    light = Scheduler(config(kv_tokens=4096))
    heavy = Scheduler(config(kv_tokens=4096))
    for i in range(2):
        light.submit(prompt(512, i * 1000), 128, 0.0)
    for i in range(40):
        heavy.submit(prompt(512, i * 1000), 128, 0.0)
    light.step(0.0)
    heavy.step(0.0)
    assert light.statistics().waiting == 0
    assert heavy.statistics().waiting > 20  # 4096 tokens hold 6 requests of 640
    assert heavy.statistics().running == 4096 // 640
    run_until_idle(light, 0.0)
    run_until_idle(heavy, 0.0)
    assert max(ttfts(heavy)) > 5 * max(ttfts(light))
    assert heavy.statistics().requests_finished == 40


def test_kv_capacity_is_never_exceeded() -> None:
    s = Scheduler(config(kv_tokens=2000))
    for i in range(30):
        s.submit(prompt(100 + 10 * i, i * 997), 50 + i, 0.0)
    now = 0.0
    while (step := s.step(now)) is not None:
        stats = s.statistics()
        assert stats.kv_tokens_reserved <= 2000
        assert 0.0 <= stats.kv_cache_usage <= 1.0
        now = step.ends_at
    assert s.statistics().requests_finished == 30
    assert s.statistics().kv_tokens_reserved == 0


def test_requests_that_can_never_fit_are_refused() -> None:
    s = Scheduler(config(kv_tokens=1000, max_model_len=4096))
    with pytest.raises(ValueError, match="capacity"):
        s.submit(prompt(900), 200, 0.0)
    with pytest.raises(ValueError, match="maximum context length"):
        Scheduler(config(max_model_len=512)).submit(prompt(500), 100, 0.0)
    with pytest.raises(ValueError):
        s.submit([], 10, 0.0)


def test_repeated_prefixes_raise_hit_rate_and_cut_prefill_time() -> None:
    system = prompt(1024, 5)
    s = Scheduler(config())
    s.submit([*system, 1, 2, 3], 1, 0.0)
    first = s.step(0.0)
    assert first is not None and first.prefill_tokens == 1027
    s.submit([*system, 4, 5, 6], 1, 1.0)
    second = s.step(1.0)
    assert second is not None
    assert second.prefill_tokens == 3
    assert second.duration_s < first.duration_s / 2
    stats = s.statistics()
    assert stats.prefix_cache_hits == 1024
    assert stats.prefix_cache_queries == 2 * 1027


def test_only_a_shared_prefix_hits_the_cache() -> None:
    cache = PrefixCache(100)
    tokens = prompt(64)
    cache.insert(tokens)
    changed_first_block = [99_999 % 32_000, *tokens[1:]]
    assert cache.lookup(changed_first_block) == 0
    assert cache.lookup(tokens[:40]) == 32  # two whole blocks
    assert cache.lookup(tokens) == 63  # the last token is always recomputed


def test_prefix_cache_evicts_least_recently_used_blocks() -> None:
    cache = PrefixCache(4)
    a, b = prompt(64, 0), prompt(64, 5000)
    cache.insert(a)
    assert len(cache) == 4
    cache.insert(b)
    assert len(cache) == 4
    assert cache.lookup(a) == 0
    assert cache.lookup(b) == 63


def test_output_is_deterministic_and_seeded() -> None:
    def outputs(seed: int) -> list[list[int]]:
        s = Scheduler(config(seed=seed))
        for i in range(3):
            s.submit(prompt(20, i), 10, 0.0)
        events: dict[int, list[int]] = {}
        now = 0.0
        while (step := s.step(now)) is not None:
            for e in step.events:
                events.setdefault(e.request_id, []).append(e.token)
            now = step.ends_at
        return [events[i] for i in sorted(events)]

    assert outputs(1) == outputs(1)
    assert outputs(1) != outputs(2)
    assert all(len(o) == 10 for o in outputs(1))
    assert tokenize("Hello, world") == tokenize("Hello, world")
    assert len(tokenize("Hello, world")) == 3
    assert detokenize(5).startswith(" ")
    assert embedding(0, "x", 8) == embedding(0, "x", 8) != embedding(0, "y", 8)


def test_decode_is_bandwidth_bound_and_prefill_compute_bound() -> None:
    h100 = Scheduler(config(gpu=GPU_PROFILES["H100"]))
    l40s = Scheduler(config(gpu=GPU_PROFILES["L40S"]))
    # Decode: ratio of step times follows bandwidth (3350 vs 864 GB/s), ignoring the overhead.
    ratio = (l40s.step_time(0, 1, 100) - 0.002) / (h100.step_time(0, 1, 100) - 0.002)
    assert ratio == pytest.approx(3350 / 864, rel=0.01)
    # Prefill: a long prompt costs far more than a decode step, and follows compute.
    assert h100.step_time(8000, 0, 0) > 5 * h100.step_time(0, 1, 0)
    fast = Scheduler(config(speed=100.0))
    assert fast.step_time(1000, 4, 4000) == pytest.approx(h100.step_time(1000, 4, 4000) / 100)


def test_profiles_and_names() -> None:
    assert gpu_profile("h100").name == "H100"
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu_profile("TPU")
    assert params_from_name("llama-3-8b") == 8.0
    assert params_from_name("Qwen2.5-0.5B-Instruct") == 0.5
    assert params_from_name("tiny") == 1.0
    assert {"H100", "A100-80G", "L40S", "RTX-3090", "cpu"} <= set(GPU_PROFILES)
    # Derived capacity: an 8B model on an 80 GB GPU holds hundreds of thousands of tokens.
    assert 200_000 < EngineConfig("llama-3-8b").kv_capacity() < 1_000_000


def test_abort_frees_the_reservation() -> None:
    s = Scheduler(config(kv_tokens=1000))
    a = s.submit(prompt(450), 100, 0.0)
    b = s.submit(prompt(450, 9), 100, 0.0)
    s.step(0.0)
    assert s.statistics().running == 1 and s.statistics().waiting == 1
    s.abort(a)
    s.step(1.0)
    assert s.statistics().running == 1 and s.requests[b].admitted_at == 1.0
    s.abort(b)
    assert s.step(2.0) is None


# A 1,000-token shared prefix: its first 62 blocks (992 tokens) are full; block 62 mixes the
# prefix's last 8 tokens with each request's own suffix, so it is not shared.
SYSTEM = prompt(1000, 5)
SHARED = 992


def with_system(i: int) -> list[int]:
    """A 1,024-token prompt: the shared system prefix and a suffix of its own."""
    return [*SYSTEM, *prompt(24, 20_000 + 100 * i)]


def recomputed_reservation(s: Scheduler) -> int:
    """Distinct KV tokens the running set reserves, from scratch."""
    blocks = {h for r in s.running.values() for h in block_hashes(r.prompt)}
    private = sum(len(r.prompt) % BLOCK_TOKENS + r.max_tokens for r in s.running.values())
    return BLOCK_TOKENS * len(blocks) + private


def test_requests_sharing_a_prefix_run_together_where_unshared_copies_would_not_fit() -> None:
    # Each request alone needs 1,024 + 100 = 1,124 tokens; two unshared copies need 2,248.
    shared = Scheduler(config(kv_tokens=1500))
    shared.submit(with_system(0), 100, 0.0)
    shared.submit(with_system(1), 100, 0.0)
    shared.step(0.0)
    stats = shared.statistics()
    assert stats.running == 2 and stats.waiting == 0
    # The prefix once, then each request's prompt tail (32) and max_tokens (100).
    assert stats.kv_tokens_reserved == SHARED + 2 * (32 + 100) == recomputed_reservation(shared)

    distinct = Scheduler(config(kv_tokens=1500))
    distinct.submit(prompt(1024, 0), 100, 0.0)
    distinct.submit(prompt(1024, 5000), 100, 0.0)
    distinct.step(0.0)
    assert distinct.statistics().running == 1 and distinct.statistics().waiting == 1
    assert distinct.statistics().kv_tokens_reserved == 1124


def test_a_shared_prefix_lets_more_requests_run_at_once() -> None:
    shared, distinct = Scheduler(config(kv_tokens=4000)), Scheduler(config(kv_tokens=4000))
    for i in range(10):
        shared.submit(with_system(i), 100, 0.0)
        distinct.submit(prompt(1024, 1500 * i), 100, 0.0)
    for now in (0.0, 1.0):  # the per-step token budget admits 8 uncached prompts at a time
        shared.step(now)
        distinct.step(now)
    assert shared.statistics().running == 10
    assert distinct.statistics().running == 4000 // 1124
    run_until_idle(shared, 0.0)
    run_until_idle(distinct, 0.0)
    assert max(ttfts(shared)) < max(ttfts(distinct)) / 2


def test_only_a_shared_prefix_shares_kv_blocks() -> None:
    # The same 1,000 tokens after a different first token share no block (the hash chain).
    s = Scheduler(config(kv_tokens=1500))
    s.submit(with_system(0), 100, 0.0)
    s.submit([31_999, *with_system(1)[1:]], 100, 0.0)
    s.step(0.0)
    assert s.statistics().running == 1 and s.statistics().waiting == 1


def test_kv_cache_usage_counts_shared_blocks_once() -> None:
    s = Scheduler(config(kv_tokens=1500))
    s.submit(with_system(0), 100, 0.0)
    s.submit(with_system(1), 100, 0.0)
    s.step(0.0)
    # One output token each: prompt tail 32 + 1 rounds up to 48 private tokens per request.
    assert s.statistics().kv_cache_usage == pytest.approx((SHARED + 2 * 48) / 1500)


def test_shared_blocks_stay_reserved_until_the_last_sharer_goes() -> None:
    s = Scheduler(config(kv_tokens=1300))
    a = s.submit(with_system(0), 100, 0.0)
    b = s.submit(with_system(1), 100, 0.0)
    s.step(0.0)
    assert s.statistics().kv_tokens_reserved == SHARED + 2 * 132
    s.abort(a)
    assert s.statistics().kv_tokens_reserved == SHARED + 132 == recomputed_reservation(s)
    # The prefix is still pinned by b: another sharer costs only its private 132 tokens, while
    # a request with no common prefix (1,124 tokens) does not fit beside b.
    c = s.submit(with_system(2), 100, 1.0)
    d = s.submit(prompt(1024, 9000), 100, 1.0)
    s.step(1.0)
    assert set(s.running) == {b, c} and [r.id for r in s.waiting] == [d]
    s.abort(b)
    s.abort(c)
    assert s.statistics().kv_tokens_reserved == 0
    assert s.statistics().kv_cache_usage == 0.0
    s.step(2.0)
    assert set(s.running) == {d}
    s.abort(d)
    assert s.statistics().kv_tokens_reserved == 0


def test_reservation_returns_to_zero_when_sharers_finish() -> None:
    s = Scheduler(config(kv_tokens=2000, max_batched_tokens=2048))
    arrivals = [(0.1 * i, with_system(i % 4), 20 + 10 * i) for i in range(12)]
    arrivals += [(0.05, prompt(700, 12_000), 30), (0.3, [*SYSTEM[:500], 7, 8], 40)]
    now = 0.0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or s.has_work():
        while pending and pending[0][0] <= now:
            at, tokens, max_tokens = pending.pop(0)
            s.submit(tokens, max_tokens, at)
        step = s.step(now)
        assert s.statistics().kv_tokens_reserved == recomputed_reservation(s) <= 2000
        now = step.ends_at if step is not None else pending[0][0]
    stats = s.statistics()
    assert stats.requests_finished == 14
    assert stats.kv_tokens_reserved == 0 and stats.kv_cache_usage == 0.0


def test_aborting_a_finished_request_before_delivery_is_harmless() -> None:
    s = Scheduler(config())
    rid = s.submit(prompt(20), 1, 0.0)
    step = s.step(0.0)
    assert step is not None and step.events[0].finish_reason == "length"
    s.abort(rid)  # the client left while the driver waited for step.ends_at
    assert rid not in s.requests and s.statistics().kv_tokens_reserved == 0


_PREFIXES = [prompt(200, 0), prompt(200, 5000), prompt(200, 9000)]
# (what, prefix or abort index, prefix length, suffix length, max_tokens)
_OP = st.tuples(
    st.sampled_from(["submit", "step", "abort"]),
    st.integers(0, 40),
    st.integers(0, 200),
    st.integers(0, 40),
    st.integers(1, 80),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(_OP, max_size=60), st.integers(150, 1500))
def test_shared_reservation_never_exceeds_capacity_and_matches_the_running_set(
    ops: list[tuple[str, int, int, int, int]], kv_tokens: int
) -> None:
    s = Scheduler(config(kv_tokens=kv_tokens, max_batched_tokens=256))
    submitted: list[int] = []
    now = 0.0

    def check_invariants() -> None:
        stats = s.statistics()
        assert stats.kv_tokens_reserved == recomputed_reservation(s) <= kv_tokens
        held = {h for r in s.running.values() for h in block_hashes(r.prompt)}
        private = sum(
            -(-(len(r.prompt) % BLOCK_TOKENS + len(r.output)) // BLOCK_TOKENS) * BLOCK_TOKENS
            for r in s.running.values()
        )
        usage = min(1.0, (BLOCK_TOKENS * len(held) + private) / kv_tokens)
        assert stats.kv_cache_usage == pytest.approx(usage)

    for i, (what, which, prefix_len, suffix_len, max_tokens) in enumerate(ops):
        if what == "submit":
            # Suffixes are distinct; an empty one repeats a prefix exactly.
            tokens = [*_PREFIXES[which % 3][:prefix_len], *prompt(suffix_len, 20_000 + 50 * i)]
            if tokens and len(tokens) + max_tokens <= kv_tokens:
                submitted.append(s.submit(tokens, max_tokens, now))
        elif what == "step":
            step = s.step(now)
            if step is not None:
                now = step.ends_at
        elif submitted:
            s.abort(submitted[which % len(submitted)])
        check_invariants()
    while (step := s.step(now)) is not None:
        now = step.ends_at
        check_invariants()
    stats = s.statistics()
    assert stats.running == stats.waiting == stats.kv_tokens_reserved == 0


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 60), st.floats(0, 2)), min_size=1, max_size=25
    ),
    st.integers(400, 3000),
)
def test_every_request_finishes_with_exactly_max_tokens(
    shape: list[tuple[int, int, float]], kv_tokens: int
) -> None:
    s = Scheduler(config(kv_tokens=kv_tokens, max_batched_tokens=512))
    arrivals = [(at, prompt(n, i * 311), m) for i, (n, m, at) in enumerate(shape)]
    arrivals = [a for a in arrivals if len(a[1]) + a[2] <= kv_tokens]
    run_until_idle(s, 0.0, arrivals)
    done = list(s.requests.values())
    assert len(done) == len(arrivals)
    for r in done:
        assert len(r.output) == r.max_tokens and r.finish_reason == "length"
        assert r.first_token_at is not None and r.first_token_at > r.arrived_at
    stats = s.statistics()
    assert stats.waiting == stats.running == stats.kv_tokens_reserved == 0
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries
    assert BLOCK_TOKENS == 16


async def test_driver_and_app_run_in_process_on_a_mock_clock(autojump_clock: MockClock) -> None:
    cfg = config()
    driver = EngineDriver(cfg)
    app = SimEngineApp(SimConfig(cfg), driver, wall_clock=lambda: 1_750_000_000.0)
    transport = httpx.ASGITransport(app=app)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(driver.run)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            start = trio.current_time()
            body = {"model": "llama-3-8b", "prompt": "a b c d", "max_tokens": 10}
            response = await client.post("/v1/completions", json=body)
            elapsed = trio.current_time() - start
        nursery.cancel_scope.cancel()
    assert response.status_code == 200
    assert response.json()["created"] == 1_750_000_000
    reference = Scheduler(cfg)
    reference.submit(tokenize("a b c d"), 10, 0.0)
    assert elapsed == pytest.approx(run_until_idle(reference, 0.0))
