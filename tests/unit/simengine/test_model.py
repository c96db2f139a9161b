"""The simulated engine's pure scheduler (batching, KV capacity, prefix cache, timing, output),
and its driver and app in process on a mock clock."""

from __future__ import annotations

import httpx
import pytest
import trio
from hypothesis import event, example, given, settings, target
from hypothesis import strategies as st
from trio.testing import MockClock

from fabricnode.kvevents.wire import Cleared, Removed, Stored
from fabricnode.simengine.model import (
    ADMISSION_MODES,
    BLOCK_TOKENS,
    GPU_PROFILES,
    EngineConfig,
    PrefixCache,
    Scheduler,
    Step,
    TokenEvent,
    block_hashes,
    detokenize,
    embedding,
    gpu_profile,
    output_token,
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


def fits(s: Scheduler, prompt_len: int, max_tokens: int) -> bool:
    try:
        s.check(prompt_len, max_tokens)
    except ValueError:
        return False
    return True


def drive(s: Scheduler, now: float = 0.0) -> tuple[float, list[Step]]:
    """Step until idle; the final time and every step."""
    steps: list[Step] = []
    while (step := s.step(now)) is not None:
        steps.append(step)
        now = step.ends_at
    return now, steps


def events_by_request(steps: list[Step]) -> dict[int, list[TokenEvent]]:
    by_request: dict[int, list[TokenEvent]] = {}
    for step in steps:
        for e in step.events:
            by_request.setdefault(e.request_id, []).append(e)
    return by_request


@pytest.mark.parametrize(
    ("admission", "running"),
    [
        ("reserve", 4096 // 640),  # prompt + max_tokens reserved: 6 requests of 640 tokens
        ("optimistic", 7),  # 33 blocks each (32 of prompt, 1 for the first token) of 256 - 2
    ],
)
def test_saturation_raises_waiting_count_and_time_to_first_token(
    admission: str, running: int
) -> None:
    light = Scheduler(config(kv_tokens=4096, admission=admission))
    heavy = Scheduler(config(kv_tokens=4096, admission=admission))
    for i in range(2):
        light.submit(prompt(512, i * 1000), 128, 0.0)
    for i in range(40):
        heavy.submit(prompt(512, i * 1000), 128, 0.0)
    light.step(0.0)
    heavy.step(0.0)
    assert light.statistics().waiting == 0
    assert heavy.statistics().waiting > 20
    assert heavy.statistics().running == running
    run_until_idle(light, 0.0)
    run_until_idle(heavy, 0.0)
    assert max(ttfts(heavy)) > 5 * max(ttfts(light))
    assert heavy.statistics().requests_finished == 40


@pytest.mark.parametrize("admission", ADMISSION_MODES)
def test_kv_capacity_is_never_exceeded(admission: str) -> None:
    s = Scheduler(config(kv_tokens=2000, admission=admission))
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
    # Optimistic mode counts whole blocks: 150 tokens hold 9 blocks (144 tokens).
    optimistic, reserve = (Scheduler(config(kv_tokens=150, admission=a)) for a in ADMISSION_MODES)
    with pytest.raises(ValueError, match="10 KV blocks of 16 tokens; capacity is 9"):
        optimistic.submit(prompt(100), 50, 0.0)
    reserve.submit(prompt(100), 50, 0.0)
    optimistic.submit(prompt(100), 44, 0.0)
    with pytest.raises(ValueError, match="admission"):
        config(admission="eager")


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


def test_the_prefix_cache_records_what_vllm_publishes_as_kv_events() -> None:
    """``events``: a run of new blocks is one ``Stored`` (its parent the block before it, its
    tokens), a block evicted a ``Removed``, a clear a ``Cleared``; and what the events say is
    what the cache holds (replayed into a set, they give its blocks)."""
    cache = PrefixCache(6, events=True)
    a, b = prompt(64, 0), prompt(40, 5000)
    ha, hb = block_hashes(a), block_hashes(b)
    cache.insert_hashes(ha[:2], a)
    cache.insert_hashes(ha, a)  # blocks 2 and 3 are new: parent block 1
    first, second = cache.take_events()
    assert first == Stored(tuple(ha[:2]), None, tuple(a[:32]), BLOCK_TOKENS, "GPU")
    assert second == Stored(tuple(ha[2:]), ha[1], tuple(a[32:64]), BLOCK_TOKENS, "GPU")
    assert cache.take_events() == []
    cache.insert_hashes(hb, b)  # 2 more blocks: 6 in all, nothing evicted
    cache.insert_hashes(block_hashes(prompt(32, 9000)), prompt(32, 9000))  # evicts a's first two
    events = cache.take_events()
    assert [type(e) for e in events] == [Stored, Stored, Removed, Removed]
    assert [e.hashes for e in events[2:]] == [(ha[0],), (ha[1],)]  # type: ignore[union-attr]
    cache.clear()
    assert cache.take_events() == [Cleared()]
    assert PrefixCache(4).take_events() == []  # without events: nothing recorded


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 5)), min_size=1, max_size=20))
def test_replaying_the_events_gives_the_cache_s_blocks(inserts: list[tuple[int, int]]) -> None:
    cache = PrefixCache(8, events=True)
    held: set[bytes] = set()
    for base, blocks in inserts:
        tokens = prompt(blocks * BLOCK_TOKENS + 3, base * 1000)
        cache.insert_hashes(block_hashes(tokens), tokens)
        for e in cache.take_events():
            if isinstance(e, Stored):
                assert len(e.token_ids) == len(e.hashes) * BLOCK_TOKENS
                held.update(e.hashes)  # type: ignore[arg-type]
            elif isinstance(e, Removed):
                held.difference_update(e.hashes)  # type: ignore[arg-type]
    assert held == set(cache._blocks)


def test_a_scheduler_with_kv_events_reports_its_prompts_blocks() -> None:
    s = Scheduler(config(kv_events=True))
    s.submit(prompt(50), 4, 0.0)
    drive(s)
    events = s.take_kv_events()
    assert events and isinstance(events[0], Stored) and len(events[0].hashes) == 3
    assert Scheduler(config()).take_kv_events() == []


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
    assert {"H100", "A100-80G", "L40S", "L4", "RTX-3090", "cpu"} <= set(GPU_PROFILES)
    l4 = gpu_profile("l4")
    assert (l4.tflops, l4.bandwidth_gbs, l4.memory_gb) == (121.0, 300.0, 24.0)
    # Derived capacity: an 8B model on an 80 GB GPU holds hundreds of thousands of tokens.
    assert 200_000 < EngineConfig("llama-3-8b").kv_capacity() < 1_000_000


@pytest.mark.parametrize("admission", ADMISSION_MODES)
def test_abort_frees_the_reservation(admission: str) -> None:
    # Each request alone takes 700 of 1,000 tokens reserved, or 38 of 62 blocks at admission.
    s = Scheduler(config(kv_tokens=1000, admission=admission))
    a = s.submit(prompt(600), 100, 0.0)
    b = s.submit(prompt(600, 9), 100, 0.0)
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


def blocks_of(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def recomputed_reservation(s: Scheduler) -> int:
    """Distinct KV tokens the running set holds (optimistic) or reserves (reserve), from scratch."""
    blocks = {h for r in s.running.values() for h in block_hashes(r.prompt)}
    if s.optimistic:
        private = sum(
            BLOCK_TOKENS * blocks_of(len(r.prompt) % BLOCK_TOKENS + len(r.output))
            for r in s.running.values()
        )
    else:
        private = sum(len(r.prompt) % BLOCK_TOKENS + r.max_tokens for r in s.running.values())
    return BLOCK_TOKENS * len(blocks) + private


@pytest.mark.parametrize(
    ("admission", "private", "alone"),
    [
        # The prompt tail (32) and max_tokens (100); 1,024 + 100 for one unshared request.
        ("reserve", 32 + 100, 1124),
        # The prompt tail and the first output token in whole blocks; 1,025 tokens in blocks.
        ("optimistic", 48, 1040),
    ],
)
def test_requests_sharing_a_prefix_run_together_where_unshared_copies_would_not_fit(
    admission: str, private: int, alone: int
) -> None:
    # Each request alone needs 1,124 tokens reserved or 65 blocks (of 93) to be admitted: two
    # unshared copies do not fit, two sharing the 992-token prefix do.
    shared = Scheduler(config(kv_tokens=1500, admission=admission))
    shared.submit(with_system(0), 100, 0.0)
    shared.submit(with_system(1), 100, 0.0)
    shared.step(0.0)
    stats = shared.statistics()
    assert stats.running == 2 and stats.waiting == 0
    assert stats.kv_tokens_reserved == SHARED + 2 * private == recomputed_reservation(shared)

    distinct = Scheduler(config(kv_tokens=1500, admission=admission))
    distinct.submit(prompt(1024, 0), 100, 0.0)
    distinct.submit(prompt(1024, 5000), 100, 0.0)
    distinct.step(0.0)
    assert distinct.statistics().running == 1 and distinct.statistics().waiting == 1
    assert distinct.statistics().kv_tokens_reserved == alone


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


@pytest.mark.parametrize(("admission", "private"), [("reserve", 132), ("optimistic", 48)])
def test_shared_blocks_stay_reserved_until_the_last_sharer_goes(
    admission: str, private: int
) -> None:
    s = Scheduler(config(kv_tokens=1300, admission=admission))
    a = s.submit(with_system(0), 100, 0.0)
    b = s.submit(with_system(1), 100, 0.0)
    s.step(0.0)
    assert s.statistics().kv_tokens_reserved == SHARED + 2 * private
    s.abort(a)
    assert s.statistics().kv_tokens_reserved == SHARED + private == recomputed_reservation(s)
    # The prefix is still pinned by b: another sharer costs only its private part, while a
    # request with no common prefix (1,124 tokens, or 65 of 81 blocks) does not fit beside b.
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


@pytest.mark.parametrize("admission", ADMISSION_MODES)
def test_reservation_returns_to_zero_when_sharers_finish(admission: str) -> None:
    s = Scheduler(config(kv_tokens=2000, max_batched_tokens=2048, admission=admission))
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
    st.integers(1, 200),
)


class TokenLog:
    """Every token a scheduler produced, checked as it arrives: per request, indexes 0, 1, 2 ...
    with no gap and no duplicate (preemptions included), the seeded token for each index, and
    nothing after the last token or an abort."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.keys: dict[int, bytes] = {}
        self.max_tokens: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}
        self.done: set[int] = set()
        self.aborted: set[int] = set()

    def submit(self, tokens: list[int], max_tokens: int, now: float) -> int:
        rid = self.s.submit(tokens, max_tokens, now)
        self.keys[rid] = self.s.requests[rid].prompt_key
        self.max_tokens[rid] = max_tokens
        self.tokens[rid] = []
        return rid

    def abort(self, rid: int) -> None:
        self.s.abort(rid)
        if rid not in self.done:
            self.aborted.add(rid)

    def record(self, step: Step) -> None:
        assert len({e.request_id for e in step.events}) == len(step.events)
        # The step's time counts a decode token for every request that sampled one, and only
        # those (a chunked prompt still prefilling samples none).
        assert step.decode_tokens == len(step.events)
        for e in step.events:
            rid = e.request_id
            assert rid not in self.done and rid not in self.aborted
            seen = self.tokens[rid]
            assert e.index == len(seen)
            assert e.token == output_token(self.s.config.seed, self.keys[rid], e.index)
            seen.append(e.token)
            last = len(seen) == self.max_tokens[rid]
            assert (e.finish_reason == "length") == last
            if last:
                self.done.add(rid)

    def check_all_finished(self) -> None:
        assert self.done | self.aborted == set(self.tokens)
        for rid in self.done:
            assert len(self.tokens[rid]) == self.max_tokens[rid]


def check_accounting(s: Scheduler) -> None:
    """The admission accounting equals a recount from the running set and stays in capacity."""
    stats = s.statistics()
    capacity = BLOCK_TOKENS * s.num_blocks if s.optimistic else s.kv_capacity
    assert stats.kv_tokens_reserved == recomputed_reservation(s) <= capacity
    held = {h for r in s.running.values() for h in block_hashes(r.prompt)}
    private = sum(
        BLOCK_TOKENS * blocks_of(len(r.prompt) % BLOCK_TOKENS + len(r.output))
        for r in s.running.values()
    )
    used = BLOCK_TOKENS * len(held) + private
    if s.optimistic:
        assert used == stats.kv_tokens_reserved
    else:  # a reservation rounded up to whole blocks covers what is held
        assert used <= stats.kv_tokens_reserved + (BLOCK_TOKENS - 1) * len(s.running)
    usage = min(1.0, used / s.kv_capacity)
    assert stats.kv_cache_usage == pytest.approx(usage)
    assert stats.waiting == len(s.waiting) and stats.running == len(s.running)
    if not s.optimistic:
        assert stats.num_preemptions == 0


# Found by this test (optimistic admission, chunked prefill): a prompt whose last chunk filled
# its last block took a block the preemption check had not counted, one past capacity. Hypothesis
# met it about once in a few thousand examples and then shrank it for tens of minutes, which
# looked like a hang of the suite.
ONE_BLOCK_OVER = [
    *[
        ("submit", 1, 28, 0, 30),
        ("submit", 1, 28, 0, 30),
        ("submit", 7, 160, 37, 89),
        ("submit", 4, 188, 31, 109),
        ("submit", 0, 122, 40, 58),
        ("abort", 14, 4, 13, 113),
        ("submit", 20, 88, 30, 190),
        ("submit", 20, 88, 30, 190),
        ("submit", 15, 1, 33, 143),
        ("submit", 5, 30, 34, 61),
    ]
    * 2,
    ("submit", 25, 133, 37, 7),
    ("step", 3, 36, 31, 190),
    ("abort", 15, 170, 15, 100),
    ("step", 13, 183, 27, 95),
    ("submit", 4, 178, 37, 20),
    ("abort", 29, 39, 33, 141),
    ("abort", 19, 69, 20, 137),
    ("step", 36, 185, 34, 171),
    ("step", 13, 107, 29, 157),
    ("submit", 12, 37, 1, 73),
    ("submit", 26, 76, 14, 190),
    ("abort", 37, 179, 5, 88),
]


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("admission", ADMISSION_MODES)
@settings(max_examples=100, deadline=None)
@given(st.lists(_OP, max_size=60), st.integers(150, 800))
@example(ONE_BLOCK_OVER, 726)
def test_shared_accounting_never_exceeds_capacity_and_every_token_comes_once(
    admission: str, chunked: bool, ops: list[tuple[str, int, int, int, int]], kv_tokens: int
) -> None:
    s = Scheduler(
        config(
            kv_tokens=kv_tokens,
            max_batched_tokens=256 if not chunked else 64,
            admission=admission,
            chunked_prefill=chunked,
        )
    )
    log = TokenLog(s)
    submitted: list[int] = []
    now = 0.0
    for i, (what, which, prefix_len, suffix_len, max_tokens) in enumerate(ops):
        if what == "submit":
            # Suffixes are distinct; an empty one repeats a prefix exactly.
            tokens = [*_PREFIXES[which % 3][:prefix_len], *prompt(suffix_len, 20_000 + 50 * i)]
            if tokens and fits(s, len(tokens), max_tokens):
                submitted.append(log.submit(tokens, max_tokens, now))
        elif what == "step":
            step = s.step(now)
            if step is not None:
                log.record(step)
                now = step.ends_at
        elif submitted:
            log.abort(submitted[which % len(submitted)])
        check_accounting(s)
    while (step := s.step(now)) is not None:
        log.record(step)
        now = step.ends_at
        check_accounting(s)
    log.check_all_finished()
    stats = s.statistics()
    assert stats.running == stats.waiting == stats.kv_tokens_reserved == 0
    target(float(stats.num_preemptions))  # steer towards workloads that preempt
    event(f"preempted: {stats.num_preemptions > 0}")


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("admission", ADMISSION_MODES)
@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 200), st.floats(0, 2)),
        min_size=1,
        max_size=25,
    ),
    st.integers(400, 2000),
)
def test_every_request_finishes_with_exactly_max_tokens(
    admission: str, chunked: bool, shape: list[tuple[int, int, float]], kv_tokens: int
) -> None:
    s = Scheduler(
        config(
            kv_tokens=kv_tokens,
            max_batched_tokens=512 if not chunked else 100,
            admission=admission,
            chunked_prefill=chunked,
        )
    )
    arrivals = [(at, prompt(n, i * 311), m) for i, (n, m, at) in enumerate(shape)]
    arrivals = [a for a in arrivals if fits(s, len(a[1]), a[2])]
    run_until_idle(s, 0.0, arrivals)
    done = list(s.requests.values())
    assert len(done) == len(arrivals)
    for r in done:
        assert len(r.output) == r.max_tokens and r.finish_reason == "length"
        assert r.first_token_at is not None and r.first_token_at > r.arrived_at
    stats = s.statistics()
    assert stats.waiting == stats.running == stats.kv_tokens_reserved == 0
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries
    assert stats.num_preemptions == sum(r.preemptions for r in done)
    assert stats.generation_tokens == sum(r.max_tokens for r in done)
    target(float(stats.num_preemptions))
    event(f"preempted: {stats.num_preemptions > 0}")
    assert BLOCK_TOKENS == 16


# -- chunked prefill ----------------------------------------------------------------------------


def test_a_chunked_prompt_is_computed_over_several_steps_and_samples_once_computed() -> None:
    s = Scheduler(config(max_batched_tokens=2048, chunked_prefill=True))
    rid = s.submit(prompt(5000), 3, 0.0)
    _, steps = drive(s)
    assert [st.prefill_tokens for st in steps[:3]] == [2048, 2048, 904]
    assert [len(st.events) for st in steps] == [0, 0, 1, 1, 1]
    assert s.requests[rid].first_token_at == steps[2].ends_at


def test_running_requests_keep_decoding_while_a_prompt_is_chunked() -> None:
    s = Scheduler(config(max_batched_tokens=1024, chunked_prefill=True))
    first = s.submit(prompt(100), 20, 0.0)
    step = s.step(0.0)
    assert step is not None and [e.request_id for e in step.events] == [first]
    s.submit(prompt(3000, 7), 5, step.ends_at)
    now = step.ends_at
    for expected_prefill in (1023, 1023, 954):  # the budget less one token for the decoder
        step = s.step(now)
        assert step is not None and step.prefill_tokens == expected_prefill
        assert first in [e.request_id for e in step.events]
        now = step.ends_at


def test_a_step_admitting_a_short_prompt_behind_a_long_one_holds_only_the_budget() -> None:
    """Without chunking, an interactive prompt admitted with a waiting batch prompt shares its
    whole step with it; with chunking the step holds at most the budget."""
    for chunked, budget, computed in ((False, 8192, 500 + 3000), (True, 2048, 2048)):
        s = Scheduler(
            config(max_batched_tokens=budget, chunked_prefill=chunked, scheduling_policy="priority")
        )
        batch = s.submit(prompt(3000, 5), 4, 0.0, priority=1)
        short = s.submit(prompt(500, 9), 4, 0.0)
        step = s.step(0.0)
        assert step is not None and step.admitted == (short, batch)
        assert step.prefill_tokens == computed
        sampled = [e.request_id for e in step.events]
        assert sampled == ([short, batch] if not chunked else [short])


# -- optimistic admission and preemption ------------------------------------------------------


def test_optimistic_admission_admits_more_than_reserve_with_long_max_tokens() -> None:
    # Ten 256-token prompts asking for up to 2,048 tokens each, in 4,096 KV tokens (256 blocks).
    running = {}
    for admission in ADMISSION_MODES:
        s = Scheduler(config(kv_tokens=4096, admission=admission))
        for i in range(10):
            s.submit(prompt(256, 1000 * i), 2048, 0.0)
        s.step(0.0)
        running[admission] = s.statistics().running
        drive(s)
        assert s.statistics().requests_finished == 10
    # Reserve: 256 + 2,048 tokens each, one at a time. Optimistic: 17 blocks each at admission.
    assert running == {"reserve": 1, "optimistic": 10}


def test_decode_growth_that_exhausts_kv_preempts_and_the_request_resumes_where_it_left_off() -> (
    None
):
    # 32 blocks; each request takes 11 at admission (160 prompt tokens and the first output
    # token) and grows a block every 16 tokens: both together outgrow the cache at 96 tokens.
    s = Scheduler(config(kv_tokens=512))
    log = TokenLog(s)
    a = log.submit(prompt(160, 0), 200, 0.0)
    b = log.submit(prompt(160, 5000), 200, 0.0)
    now = 0.0
    steps: list[Step] = []
    while not steps or not steps[-1].preempted:
        step = s.step(now)
        assert step is not None
        log.record(step)
        steps.append(step)
        now = step.ends_at
    preempting = steps[-1]
    assert preempting.preempted == (b,) and preempting.admitted == ()
    assert [e.request_id for e in preempting.events] == [a]  # b produced nothing this step
    assert list(s.running) == [a] and s.waiting[0].id == b
    resumed = s.requests[b]
    assert len(resumed.output) == 96 and resumed.preemptions == 1
    stats = s.statistics()
    assert stats.num_preemptions == 1 and stats.waiting == 1 and stats.running == 1
    assert stats.kv_tokens_reserved == recomputed_reservation(s) <= 512
    # b waits for a to finish (17 blocks to resume beside a's 17 to 23), then resumes: its 256
    # tokens of prompt and output are prefilled again, all but the last from the prefix cache.
    while (step := s.step(now)) is not None:
        log.record(step)
        steps.append(step)
        now = step.ends_at
        if b in step.admitted:
            assert resumed.cached_tokens == 255
            assert step.prefill_tokens == 1
            assert s.requests[a].finished_at is not None
    log.check_all_finished()
    assert log.done == {a, b} and len(log.tokens[b]) == 200
    assert s.statistics().num_preemptions == 1
    assert s.statistics().generation_tokens == 400
    assert s.statistics().prompt_tokens == 320  # a resumed request's prompt is not counted again


def test_the_most_recently_admitted_request_is_preempted_first() -> None:
    # 40 blocks. a (320-token prompt) holds the most, but c was admitted last: c goes first.
    s = Scheduler(config(kv_tokens=640))
    log = TokenLog(s)
    now = 0.0
    order = []
    for n, base in ((320, 0), (64, 5000), (64, 9000)):
        order.append(log.submit(prompt(n, base), 200, now))
        step = s.step(now)
        assert step is not None and step.admitted == (order[-1],)
        log.record(step)
        now = step.ends_at
    a, b, c = order
    preempted: list[int] = []
    while (step := s.step(now)) is not None:
        log.record(step)
        preempted.extend(step.preempted)
        if step.admitted:
            assert step.admitted == (b, c)  # in queue order
        now = step.ends_at
        check_accounting(s)
    # c, the newest, goes first; then b, while the oldest, a, keeps running. Each preempted
    # request goes to the head of the queue, so b (older) is ahead of c when they resume.
    assert preempted == [c, b]
    assert s.requests[b].admitted_at == s.requests[c].admitted_at == s.requests[a].finished_at
    assert s.requests[b].finished_at is not None and s.requests[c].finished_at is not None
    assert s.statistics().num_preemptions == len(preempted)
    log.check_all_finished()


def test_admission_leaves_the_watermark_free_unless_nothing_runs() -> None:
    # 100 blocks; 31 per request at admission (480 prompt tokens, then the first output token).
    # Three fit (93), but not while keeping 10 blocks free.
    running = {}
    for fraction in (0.0, 0.1):
        s = Scheduler(config(kv_tokens=1600, kv_watermark_fraction=fraction))
        for i in range(4):
            s.submit(prompt(480, 1000 * i), 16, 0.0)
        s.step(0.0)
        running[fraction] = s.statistics().running
    assert running == {0.0: 3, 0.1: 2}
    # A lone request that needs nearly the whole cache is admitted: the watermark is waived.
    alone = Scheduler(config(kv_tokens=1600, kv_watermark_fraction=0.1))
    alone.submit(prompt(1500, 0), 100, 0.0)
    alone.step(0.0)
    assert alone.statistics().running == 1


@pytest.mark.parametrize("admission", ADMISSION_MODES)
def test_only_optimistic_admission_preempts(admission: str) -> None:
    s = Scheduler(config(kv_tokens=3000, admission=admission))
    log = TokenLog(s)
    for i in range(30):
        log.submit(prompt(100 + 37 * i % 400, 700 * i), 40 + 53 * i % 300, 0.01 * i)
    _, steps = drive(s)
    for step in steps:
        log.record(step)
    log.check_all_finished()
    preemptions = sum(len(step.preempted) for step in steps)
    assert s.statistics().num_preemptions == preemptions
    if admission == "reserve":
        assert preemptions == 0
    else:
        assert preemptions > 0


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


async def test_the_driver_delivers_each_token_once_across_a_preemption(
    autojump_clock: MockClock,
) -> None:
    driver = EngineDriver(config(kv_tokens=512))  # b is preempted at 96 tokens (see above)
    received: dict[int, list[int]] = {}

    async def collect(rid: int, channel: trio.MemoryReceiveChannel[TokenEvent]) -> None:
        async for token in channel:
            received[rid].append(token.index)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(driver.run)
        async with trio.open_nursery() as readers:
            for base in (0, 5000):
                rid, channel = driver.submit(prompt(160, base), 200)
                received[rid] = []
                readers.start_soon(collect, rid, channel)
        nursery.cancel_scope.cancel()
    assert list(received.values()) == [list(range(200))] * 2
    assert driver.scheduler.statistics().num_preemptions == 1
