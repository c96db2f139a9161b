"""The simulated engine's core: a continuous-batching scheduler with a KV-token budget and a
block-level prefix cache, timed by a roofline model of one GPU type. Pure: no I/O, no clock.

Rules:

* Every method that moves time takes ``now`` (seconds, any monotonic origin). Nothing here
  sleeps, reads a clock or draws unseeded randomness; the same calls give the same results.
* KV memory is counted in 16-token blocks, and running requests share their common *prefix*, as
  vLLM's block manager does. A request's full prompt blocks are pinned by their chained hash (the
  prefix cache's key), ref-counted across the running set, so a block shared by several running
  requests is counted once. The rest of a request is private: its partial last prompt block and,
  at admission, its whole ``max_tokens``.
* A request is admitted only if the distinct tokens already reserved, plus its private
  reservation, plus 16 per full prompt block not yet pinned, fit ``kv_tokens``. Finishing or
  aborting releases its private part and one reference to each of its blocks; a block is freed
  when its last holder goes. So the reservation never exceeds ``kv_tokens`` and nothing is ever
  preempted. ``check`` still refuses only what could never fit alone (``prompt + max_tokens``).
* ``kv_cache_usage`` reports the tokens actually held over the capacity, as vLLM does: the pinned
  blocks once each, plus every running request's prompt tail and generated tokens so far, rounded
  up to whole blocks.

Theory of operation. ``submit`` hashes the prompt's full blocks once and puts the request on the
FIFO waiting queue. ``step(now)`` plans and executes one engine iteration: it admits waiting
requests in order while their reservations fit (and the per-step token budget allows), pinning
their blocks; looks each admitted prompt up in the prefix cache (full 16-token blocks,
hash-chained, so only a shared *prefix* hits), prefills the uncached rest, and decodes one token
for every running request, including the ones just admitted (prefill yields the first token, as in
vLLM); requests that reach ``max_tokens`` finish and unpin. A step costs O(running requests) plus
O(blocks) of the requests it considers for admission or finishes. The step's duration is the
roofline time of that work: ``overhead + max(compute, memory)`` where compute is
``2 * params * tokens / flops`` and memory is ``(weight bytes + KV bytes read) / bandwidth``,
divided by ``speed``. KV reads are per request: each sequence's attention reads its whole context,
shared blocks included, so sharing memory does not share bandwidth. The returned ``Step`` lists
the tokens it produced; a driver makes them visible at ``step.ends_at`` and steps again then.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

BLOCK_TOKENS = 16
VOCAB_SIZE = 32_000

# -- hardware ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuProfile:
    """One accelerator: dense fp16 TFLOPS, memory bandwidth (GB/s) and memory (GB)."""

    name: str
    tflops: float
    bandwidth_gbs: float
    memory_gb: float
    compute_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.002


GPU_PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        GpuProfile("H100", 989.0, 3350.0, 80.0),
        GpuProfile("A100-80G", 312.0, 2039.0, 80.0),
        GpuProfile("A100-40G", 312.0, 1555.0, 40.0),
        GpuProfile("L40S", 362.0, 864.0, 48.0),
        GpuProfile("RTX-3090", 71.0, 936.0, 24.0, step_overhead_s=0.003),
        GpuProfile("cpu", 1.0, 50.0, 16.0, compute_efficiency=0.3, step_overhead_s=0.005),
    )
}


def gpu_profile(name: str) -> GpuProfile:
    """The profile named ``name`` (case-insensitive); ``ValueError`` lists the known ones."""
    for key, profile in GPU_PROFILES.items():
        if key.lower() == name.lower():
            return profile
    raise ValueError(f"unknown GPU type {name!r} (known: {', '.join(GPU_PROFILES)})")


def params_from_name(model: str, default_b: float = 1.0) -> float:
    """Parameter count in billions guessed from a model id (``llama-3-8b`` → 8.0)."""
    match = re.search(r"(\d+(?:\.\d+)?)\s*[bB](?![a-zA-Z])", model)
    return float(match.group(1)) if match else default_b


@dataclass(frozen=True)
class EngineConfig:
    """What the scheduler needs; ``kv_tokens=None`` derives the capacity from GPU memory."""

    model: str
    gpu: GpuProfile = GPU_PROFILES["H100"]
    params_b: float | None = None
    speed: float = 1.0
    max_model_len: int = 8192
    kv_tokens: int | None = None
    prefix_cache_blocks: int | None = None
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    seed: int = 0

    @property
    def params(self) -> float:
        b = self.params_b if self.params_b is not None else params_from_name(self.model)
        return b * 1e9

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params  # fp16

    @property
    def kv_bytes_per_token(self) -> float:
        # ~128 KiB per token for an 8B Llama (32 layers x 8 KV heads x 128 dims x K,V x fp16).
        return 16_384.0 * self.params / 1e9

    def kv_capacity(self) -> int:
        if self.kv_tokens is not None:
            return self.kv_tokens
        free = self.gpu.memory_gb * 1e9 * 0.9 - self.weight_bytes
        return max(self.max_model_len, int(free / self.kv_bytes_per_token))

    def cache_blocks(self) -> int:
        if self.prefix_cache_blocks is not None:
            return self.prefix_cache_blocks
        return max(1, self.kv_capacity() // BLOCK_TOKENS)


# -- tokens -----------------------------------------------------------------------------------

_WORD = re.compile(r"\w+|[^\w\s]")
_WORDS_TEXT = (
    "the of and a to in is it that for on with as was at by an be this from or which one all "
    "were are we when there can more if no out so up said what its about into than them time "
    "only new some could these two may first then do any like my now over such our man me even "
    "most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three"
)
_OUTPUT_WORDS = tuple(_WORDS_TEXT.split())


def _digest(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return int.from_bytes(h.digest(), "big")


def tokenize(text: str) -> list[int]:
    """A stable toy tokenizer: words and punctuation, each hashed into the vocabulary."""
    return [_digest(w.encode()) % VOCAB_SIZE for w in _WORD.findall(text)]


def detokenize(token: int) -> str:
    """The text of one output token (a leading space, like a BPE word piece)."""
    return " " + _OUTPUT_WORDS[token % len(_OUTPUT_WORDS)]


def output_token(seed: int, prompt_key: bytes, index: int) -> int:
    """Output token ``index`` for a prompt: a pure function of the seed and the prompt."""
    return _digest(seed.to_bytes(8, "big", signed=True), prompt_key, index.to_bytes(4, "big")) % (
        VOCAB_SIZE
    )


def embedding(seed: int, text: str, dims: int) -> list[float]:
    """A deterministic unit vector for ``text``."""
    raw = [
        (_digest(seed.to_bytes(8, "big", signed=True), text.encode(), i.to_bytes(4, "big")) >> 11)
        / float(1 << 53)
        * 2.0
        - 1.0
        for i in range(dims)
    ]
    norm = sum(x * x for x in raw) ** 0.5 or 1.0
    return [x / norm for x in raw]


def _prompt_key(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(b"".join(t.to_bytes(4, "big") for t in tokens), digest_size=16).digest()


# -- prefix cache -----------------------------------------------------------------------------


def block_hashes(tokens: Sequence[int]) -> list[bytes]:
    """Hash chain over the full blocks of ``tokens``: block i's hash covers blocks 0..i."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - len(tokens) % BLOCK_TOKENS, BLOCK_TOKENS):
        block = b"".join(t.to_bytes(4, "big") for t in tokens[start : start + BLOCK_TOKENS])
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Full KV blocks by chained hash, least recently used evicted beyond ``capacity_blocks``.
    Hits and queries count tokens, like vLLM's ``prefix_cache_{hits,queries}``."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.hit_tokens = 0
        self.query_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, tokens: Sequence[int], hashes: Sequence[bytes] | None = None) -> int:
        """Tokens of ``tokens`` already cached (a whole-block prefix); counts the query.
        ``hashes`` is ``block_hashes(tokens)`` when the caller already has it."""
        cached = 0
        for h in block_hashes(tokens) if hashes is None else hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            cached += BLOCK_TOKENS
        # Like vLLM, the last token is always recomputed so there is a logit to sample from.
        cached = min(cached, max(0, len(tokens) - 1))
        self.query_tokens += len(tokens)
        self.hit_tokens += cached
        return cached

    def insert(self, tokens: Sequence[int], hashes: Sequence[bytes] | None = None) -> None:
        for h in block_hashes(tokens) if hashes is None else hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


# -- requests and steps -----------------------------------------------------------------------


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_tokens: int
    arrived_at: float
    prompt_key: bytes = b""
    block_hashes: list[bytes] = field(default_factory=list)  # of the full prompt blocks
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None

    @property
    def private_reservation(self) -> int:
        """KV tokens reserved beside its (shareable) full prompt blocks: the partial last prompt
        block and room for all ``max_tokens``."""
        return len(self.prompt) % BLOCK_TOKENS + self.max_tokens

    @property
    def private_held(self) -> int:
        """KV tokens held beside its full prompt blocks: prompt tail + output, in whole blocks."""
        n = len(self.prompt) % BLOCK_TOKENS + len(self.output)
        return -(-n // BLOCK_TOKENS) * BLOCK_TOKENS

    @property
    def context_tokens(self) -> int:
        """Its whole context (prompt + output) in whole blocks: what its attention reads."""
        n = len(self.prompt) + len(self.output)
        return -(-n // BLOCK_TOKENS) * BLOCK_TOKENS


@dataclass(frozen=True)
class TokenEvent:
    request_id: int
    token: int
    index: int
    finish_reason: str | None  # "length" on a request's last token, else None


@dataclass(frozen=True)
class Step:
    started_at: float
    duration_s: float
    admitted: tuple[int, ...]
    prefill_tokens: int  # uncached prompt tokens computed this step
    decode_tokens: int
    events: tuple[TokenEvent, ...]

    @property
    def ends_at(self) -> float:
        return self.started_at + self.duration_s


@dataclass(frozen=True)
class SchedulerStatistics:
    waiting: int
    running: int
    kv_cache_usage: float  # 0..1
    kv_tokens_reserved: int  # distinct tokens: a block shared by running requests counts once
    kv_capacity: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    prefix_cache_blocks: int
    prompt_tokens: int
    generation_tokens: int
    requests_finished: int
    steps: int
    busy_s: float


class Scheduler:
    """Continuous batching over one ``EngineConfig``; see the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.kv_capacity = config.kv_capacity()
        self.cache = PrefixCache(config.cache_blocks())
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.requests: dict[int, Request] = {}
        self._next_id = 0
        self._reserved = 0  # distinct KV tokens reserved by the running set
        self._pinned: dict[bytes, int] = {}  # full prompt block hash -> running requests holding it
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = 0
        self.steps = 0
        self.busy_s = 0.0

    # -- requests --

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """``ValueError`` (one clear line) when a request can never be served."""
        if prompt_len < 1:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        total = prompt_len + max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.config.max_model_len} tokens; "
                f"the request needs {total} ({prompt_len} prompt + {max_tokens} completion)"
            )
        if total > self.kv_capacity:
            raise ValueError(f"the request needs {total} KV tokens; capacity is {self.kv_capacity}")

    def submit(self, prompt: Sequence[int], max_tokens: int, now: float) -> int:
        self.check(len(prompt), max_tokens)
        rid = self._next_id
        self._next_id += 1
        tokens = list(prompt)
        req = Request(rid, tokens, max_tokens, now, _prompt_key(tokens), block_hashes(tokens))
        self.waiting.append(req)
        self.requests[rid] = req
        return rid

    def abort(self, rid: int) -> None:
        """Forget a request (its client went away); frees its reservation."""
        req = self.requests.pop(rid, None)
        if req is None:
            return
        if rid in self.running:
            del self.running[rid]
            self._unpin(req)
        elif req.finished_at is None:
            self.waiting.remove(req)
        # else it finished already (its tokens not yet delivered): nothing is reserved

    def release(self, rid: int) -> None:
        """Drop a finished request's record (the driver has delivered its tokens)."""
        req = self.requests.get(rid)
        if req is not None and req.finished_at is not None:
            del self.requests[rid]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- steps --

    def step(self, now: float) -> Step | None:
        """Run one iteration starting at ``now``; ``None`` when there is nothing to do."""
        if not self.has_work():
            return None
        cfg = self.config
        admitted: list[Request] = []
        budget = cfg.max_batched_tokens - len(self.running)
        prefill = 0
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if self._reserved + self._admission_cost(req) > self.kv_capacity:
                break
            cached = self.cache.lookup(req.prompt, req.block_hashes)
            uncached = len(req.prompt) - cached
            if admitted and uncached > budget - prefill:
                # Over the per-step token budget: undo the query, admit it next step.
                self.cache.query_tokens -= len(req.prompt)
                self.cache.hit_tokens -= cached
                break
            self.waiting.popleft()
            req.cached_tokens = cached
            req.admitted_at = now
            self.running[req.id] = req
            self._pin(req)
            self.prompt_tokens += len(req.prompt)
            prefill += uncached
            admitted.append(req)
        if not self.running:
            return None  # the head of the queue can never fit; check() prevents this
        decode = len(self.running)
        # Each sequence reads its own whole context, shared blocks included: sharing memory does
        # not share bandwidth.
        duration = self.step_time(
            prefill, decode, sum(r.context_tokens for r in self.running.values())
        )
        ends_at = now + duration
        events: list[TokenEvent] = []
        for req in list(self.running.values()):
            index = len(req.output)
            token = output_token(cfg.seed, req.prompt_key, index)
            req.output.append(token)
            self.generation_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = ends_at
            finish = "length" if len(req.output) >= req.max_tokens else None
            events.append(TokenEvent(req.id, token, index, finish))
            if finish is not None:
                req.finished_at = ends_at
                req.finish_reason = finish
                del self.running[req.id]
                self._unpin(req)
                self.finished += 1
        for req in admitted:
            self.cache.insert(req.prompt, req.block_hashes)
        self.steps += 1
        self.busy_s += duration
        return Step(now, duration, tuple(r.id for r in admitted), prefill, decode, tuple(events))

    def _admission_cost(self, req: Request) -> int:
        """Tokens admitting ``req`` would add: its private part and its blocks not yet pinned."""
        pinned = self._pinned
        new_blocks = sum(1 for h in req.block_hashes if h not in pinned)
        return req.private_reservation + BLOCK_TOKENS * new_blocks

    def _pin(self, req: Request) -> None:
        pinned = self._pinned
        new_blocks = 0
        for h in req.block_hashes:
            refs = pinned.get(h, 0)
            pinned[h] = refs + 1
            if refs == 0:
                new_blocks += 1
        self._reserved += req.private_reservation + BLOCK_TOKENS * new_blocks

    def _unpin(self, req: Request) -> None:
        pinned = self._pinned
        freed_blocks = 0
        for h in req.block_hashes:
            refs = pinned[h] - 1
            if refs:
                pinned[h] = refs
            else:
                del pinned[h]
                freed_blocks += 1
        self._reserved -= req.private_reservation + BLOCK_TOKENS * freed_blocks

    def step_time(self, prefill_tokens: int, decode_tokens: int, kv_tokens_read: int) -> float:
        """Roofline time of one iteration, divided by ``speed``. ``kv_tokens_read`` sums every
        sequence's own context: a block shared in memory is still read once per sequence."""
        cfg, gpu = self.config, self.config.gpu
        flops = gpu.tflops * 1e12 * gpu.compute_efficiency
        bandwidth = gpu.bandwidth_gbs * 1e9 * gpu.bandwidth_efficiency
        compute_s = 2.0 * cfg.params * (prefill_tokens + decode_tokens) / flops
        memory_s = (cfg.weight_bytes + cfg.kv_bytes_per_token * kv_tokens_read) / bandwidth
        return (gpu.step_overhead_s + max(compute_s, memory_s)) / cfg.speed

    def statistics(self) -> SchedulerStatistics:
        held = BLOCK_TOKENS * len(self._pinned) + sum(r.private_held for r in self.running.values())
        return SchedulerStatistics(
            waiting=len(self.waiting),
            running=len(self.running),
            kv_cache_usage=min(1.0, held / self.kv_capacity) if self.kv_capacity else 0.0,
            kv_tokens_reserved=self._reserved,
            kv_capacity=self.kv_capacity,
            prefix_cache_hits=self.cache.hit_tokens,
            prefix_cache_queries=self.cache.query_tokens,
            prefix_cache_blocks=len(self.cache),
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            requests_finished=self.finished,
            steps=self.steps,
            busy_s=self.busy_s,
        )


def run_until_idle(
    scheduler: Scheduler, now: float, arrivals: Iterable[tuple[float, Sequence[int], int]] = ()
) -> float:
    """Drive ``scheduler`` in simulated time: submit each ``(at, prompt, max_tokens)`` arrival when
    the clock reaches it, step until nothing is left; returns the final time. For tests/benches."""
    pending = sorted(arrivals, key=lambda a: a[0])
    i = 0
    while True:
        while i < len(pending) and pending[i][0] <= now:
            scheduler.submit(pending[i][1], pending[i][2], pending[i][0])
            i += 1
        step = scheduler.step(now)
        if step is not None:
            now = step.ends_at
        elif i < len(pending):
            now = pending[i][0]
        else:
            return now
