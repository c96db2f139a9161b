"""The simulated engine's core: a continuous-batching scheduler with a paged KV cache and a
block-level prefix cache, timed by a roofline model of one GPU type. Pure: no I/O, no clock.

Rules:

* Every method that moves time takes ``now`` (seconds, any monotonic origin). Nothing here
  sleeps, reads a clock or draws unseeded randomness; the same calls give the same results.
* KV memory is counted in 16-token blocks, and running requests share their common *prefix*, as
  vLLM's block manager does. A request's full prompt blocks are pinned by their chained hash (the
  prefix cache's key), ref-counted across the running set, so a block shared by several running
  requests is counted once. The rest of a request is private: its partial last prompt block and
  its output. Finishing, aborting or being preempted releases the private part and one reference
  to each pinned block; a block is freed when its last holder goes.
* ``EngineConfig.admission`` picks one of two admission rules:

  - ``"optimistic"`` (the default; vLLM's): the engine has ``kv_capacity // 16`` blocks. A
    waiting request is admitted when the blocks for its context (its prompt, plus the output it
    already has if it was preempted, plus the one token this step samples; pinned blocks it
    shares with the running set counted once) fit in the free blocks minus a watermark of
    ``kv_watermark_fraction`` of all blocks (default 1%, the ``watermark=0.01`` of vLLM's block
    managers), waived when nothing runs. ``max_tokens`` is not reserved: a running request takes
    one more block each time its context crosses a block boundary. When a step's growth does not
    fit, the most recently admitted running requests (under the ``priority`` policy, below: the
    lowest priority first) are *preempted* (recompute mode) until it does, and that step admits
    nobody. A lone running request is never preempted: ``check``
    guarantees it fits.
  - ``"reserve"``: a request is admitted only if the distinct tokens already reserved, plus its
    private part (partial last prompt block and its whole ``max_tokens``), plus 16 per full
    prompt block not yet pinned, fit ``kv_tokens``. The reservation never exceeds ``kv_tokens``
    and nothing is ever preempted.

* Either way the distinct blocks held never exceed the capacity, and ``check`` refuses only what
  could never fit alone (``prompt + max_tokens``; in optimistic mode rounded up to whole blocks).
* ``EngineConfig.scheduling_policy`` orders the waiting queue, as vLLM's
  ``--scheduling-policy``:

  - ``"fcfs"`` (the default): arrival order. A request's ``priority`` must be 0; any other value
    is refused (``ValueError``: vLLM answers 400 "Got priority N but Priority scheduling is not
    enabled.").
  - ``"priority"``: the waiting queue is ordered by ``(priority, arrival)``, lower first (ties by
    request id), and the preemption victim is the running request with the *highest* priority
    value, the most recently admitted among equals, as vLLM's priority scheduler does. A
    waiting request never preempts a running one: priority decides who is admitted next and
    who yields when the running set's growth does not fit.

* A preempted request goes back to the waiting queue, keeping its output: at the *head* under
  ``fcfs``; under ``priority`` at its ``(priority, arrival)`` place, which is ahead of every later
  arrival of its priority. Its computed full blocks (prompt and output) are put into the prefix
  cache, as vLLM's freed blocks stay cached until reused. Re-admitted, it prefills prompt + output
  (the prefix cache may hit) and continues: its next token has the next index, and no token is
  produced twice. (The prefix cache is an LRU of ``cache_blocks`` apart from the blocks in use;
  vLLM's lives in the free blocks, so under KV pressure its hits, a resumed request's included, can
  be fewer.)
* ``kv_cache_usage`` reports the tokens actually held over the capacity, as vLLM does: the pinned
  blocks once each, plus every running request's prompt tail and generated tokens so far, rounded
  up to whole blocks. ``kv_tokens_reserved`` is the accounting the admission rule uses: in
  optimistic mode the same blocks in tokens, in reserve mode the reservation.

Theory of operation. ``submit`` hashes the prompt's full blocks once and puts the request on the
waiting queue (FIFO under ``fcfs``; under ``priority`` inserted at its place, scanning from the
tail, where a new arrival of the lowest priority in the queue belongs). ``step(now)`` plans and
executes one engine iteration, as vLLM's v1 scheduler does: in optimistic mode it first makes room
for the running requests' growth, preempting the newest (under ``priority``: the lowest priority,
then the newest) if it must; then (if nothing was preempted) it admits waiting requests in order
while their blocks (or reservations) fit and the per-step token budget allows, pinning their blocks;
looks each admitted context up in the prefix cache (full 16-token blocks, hash-chained, so only a
shared *prefix* hits), prefills the uncached rest, and decodes one token for every running request,
including the ones just admitted (prefill yields the next token, as in vLLM); requests that reach
``max_tokens`` finish and unpin. A step costs O(running requests) plus O(blocks) of the requests it
admits, preempts or finishes. The step's duration is the roofline time of that work:
``overhead + max(compute, memory)`` where compute is ``2 * params * tokens / flops`` and memory is
``(weight bytes + KV bytes read) / bandwidth``, divided by ``speed``. KV reads are per request:
each sequence's attention reads its whole context, shared blocks included, so sharing memory does
not share bandwidth. The returned ``Step`` lists the tokens it produced and the requests it
preempted; a driver makes the tokens visible at ``step.ends_at`` and steps again then.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from fabricnode.kvevents.wire import Cleared, Removed, Stored

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
        # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (1,979 TFLOPS with sparsity):
        # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
        GpuProfile("H100", 989.0, 3350.0, 80.0),
        # NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4),
        # SXM 80GB and 40GB columns: https://www.nvidia.com/content/dam/en-zz/Solutions/
        # Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
        GpuProfile("A100-80G", 312.0, 2039.0, 80.0),
        GpuProfile("A100-40G", 312.0, 1555.0, 40.0),
        # NVIDIA L40S datasheet (733 TFLOPS with sparsity):
        # https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413
        GpuProfile("L40S", 362.0, 864.0, 48.0),
        # NVIDIA L4 Tensor Core GPU datasheet: FP16 tensor 121 TFLOPS dense (242 with sparsity),
        # 300 GB/s, 24 GB: https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet
        GpuProfile("L4", 121.0, 300.0, 24.0),
        # NVIDIA Ampere GA102 GPU Architecture whitepaper, GeForce RTX 3090 (FP16 tensor with FP32
        # accumulate; 142 with FP16 accumulate): https://www.nvidia.com/content/PDF/
        # nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf
        GpuProfile("RTX-3090", 71.0, 936.0, 24.0, step_overhead_s=0.003),
        # Not a datasheet: a slow stand-in for CPU-only runs.
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


Admission = Literal["optimistic", "reserve"]
ADMISSION_MODES: tuple[Admission, ...] = ("optimistic", "reserve")
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")
# Distinct request priorities counted in ``SchedulerStatistics.requests_by_priority`` (they come
# from clients: past this many values, a new one is not counted).
MAX_PRIORITY_SERIES = 64


@dataclass(frozen=True)
class EngineConfig:
    """What the scheduler needs; ``kv_tokens=None`` derives the capacity from GPU memory.
    ``admission``, ``kv_watermark_fraction`` and ``scheduling_policy``: see the module
    docstring."""

    model: str
    gpu: GpuProfile = GPU_PROFILES["H100"]
    params_b: float | None = None
    speed: float = 1.0
    max_model_len: int = 8192
    kv_tokens: int | None = None
    prefix_cache_blocks: int | None = None
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    # Chunked prefill (vLLM's v1 engine always chunks): a prompt is computed over as many steps
    # as the per-step token budget needs, and a step's budget is shared by the running requests
    # first (one token per decoding request, the next chunk of each one still prefilling), then
    # the admissions. Off: a prompt is computed whole in its admission step.
    chunked_prefill: bool = False
    # Record the prefix cache's changes as vLLM's KV-cache events (``Scheduler.take_kv_events``;
    # ``--kv-events-config``): blocks stored, blocks evicted, the cache cleared.
    kv_events: bool = False
    seed: int = 0
    admission: Admission = "optimistic"
    kv_watermark_fraction: float = 0.01
    scheduling_policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        if self.admission not in ADMISSION_MODES:
            raise ValueError(
                f"unknown admission {self.admission!r} (known: {', '.join(ADMISSION_MODES)})"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"unknown scheduling policy {self.scheduling_policy!r} "
                f"(known: {', '.join(SCHEDULING_POLICIES)})"
            )
        if not 0.0 <= self.kv_watermark_fraction < 1.0:
            raise ValueError(
                f"kv_watermark_fraction must be in [0, 1), got {self.kv_watermark_fraction}"
            )

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


def words(text: str) -> list[str]:
    """The pieces ``tokenize`` cuts ``text`` into, one per token: words and punctuation."""
    return _WORD.findall(text)


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


def _prompt_key(tokens: Sequence[int], salt: bytes = b"") -> bytes:
    """What a request's output is a function of: its prompt, keyed by its ``salt`` (a LoRA
    adapter's; empty for the base model)."""
    data = b"".join(t.to_bytes(4, "big") for t in tokens)
    return hashlib.blake2b(data, digest_size=16, key=salt).digest()


def adapter_salt(name: str) -> bytes:
    """The salt of a LoRA adapter: its output and its KV blocks differ from the base model's
    and from every other adapter's (vLLM keys cached blocks by the adapter too)."""
    return hashlib.blake2b(name.encode(), digest_size=16, person=b"fabric-lora").digest()


# -- prefix cache -----------------------------------------------------------------------------


def block_hashes(
    tokens: Sequence[int], known: Sequence[bytes] = (), root: bytes = b""
) -> list[bytes]:
    """Hash chain over the full blocks of ``tokens``: block i's hash covers blocks 0..i.
    ``known`` is the chain of a prefix of ``tokens`` already hashed; it is extended, not redone.
    ``root`` starts the chain (a LoRA adapter's salt: its blocks are not the base model's)."""
    hashes = list(known)
    parent = hashes[-1] if hashes else root
    for start in range(
        BLOCK_TOKENS * len(hashes), len(tokens) - len(tokens) % BLOCK_TOKENS, BLOCK_TOKENS
    ):
        block = b"".join(t.to_bytes(4, "big") for t in tokens[start : start + BLOCK_TOKENS])
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Full KV blocks by chained hash, least recently used evicted beyond ``capacity_blocks``.
    Hits and queries count tokens, like vLLM's ``prefix_cache_{hits,queries}``.

    With ``events``, every change is also recorded as vLLM records it for its KV-cache events
    (``kvevents.wire``): each run of blocks that enters the cache is a ``Stored`` (the block
    before it its parent, None for a prompt's first block; their tokens when the caller gives
    them), each block evicted a ``Removed``, a clear a ``Cleared``; ``take_events`` hands them
    over in order."""

    def __init__(self, capacity_blocks: int, events: bool = False) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.hit_tokens = 0
        self.query_tokens = 0
        self.events: list[Stored | Removed | Cleared] | None = [] if events else None

    def take_events(self) -> list[Stored | Removed | Cleared]:
        """The changes recorded since the last call, oldest first ([] without ``events``)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        """Forget every block (the KV cache was freed); the counters go on."""
        self._blocks.clear()
        if self.events is not None:
            self.events.append(Cleared())

    def lookup(self, tokens: Sequence[int], hashes: Sequence[bytes] | None = None) -> int:
        """Tokens of ``tokens`` already cached (a whole-block prefix); counts the query.
        ``hashes`` is ``block_hashes(tokens)`` when the caller already has it."""
        return self.lookup_hashes(len(tokens), block_hashes(tokens) if hashes is None else hashes)

    def lookup_hashes(self, n_tokens: int, hashes: Sequence[bytes]) -> int:
        """``lookup`` of ``n_tokens`` tokens whose full blocks' chain is ``hashes``."""
        cached = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            cached += BLOCK_TOKENS
        # Like vLLM, the last token is always recomputed so there is a logit to sample from.
        cached = min(cached, max(0, n_tokens - 1))
        self.query_tokens += n_tokens
        self.hit_tokens += cached
        return cached

    def insert(self, tokens: Sequence[int], hashes: Sequence[bytes] | None = None) -> None:
        self.insert_hashes(block_hashes(tokens) if hashes is None else hashes)

    def insert_hashes(self, hashes: Sequence[bytes], tokens: Sequence[int] = ()) -> None:
        """Cache the chain ``hashes`` (block i covers ``tokens[16 i: 16 (i + 1)]``, given only
        to be recorded in ``events``)."""
        blocks = self._blocks
        events = self.events
        run = -1  # the first of a run of blocks new to the cache
        for i, h in enumerate(hashes):
            if events is not None:
                if h not in blocks:
                    run = i if run < 0 else run
                elif run >= 0:
                    events.append(_stored(hashes, tokens, run, i))
                    run = -1
            blocks[h] = None
            blocks.move_to_end(h)
        if events is not None and run >= 0:
            events.append(_stored(hashes, tokens, run, len(hashes)))
        while len(blocks) > self.capacity_blocks:
            evicted, _ = blocks.popitem(last=False)
            if events is not None:
                events.append(Removed((evicted,), MEDIUM))


MEDIUM = "GPU"  # where the simulated engine's blocks are, as vLLM names its GPU tier


def _stored(hashes: Sequence[bytes], tokens: Sequence[int], first: int, end: int) -> Stored:
    """The event of blocks ``first..end-1`` of the chain ``hashes`` entering the cache."""
    return Stored(
        tuple(hashes[first:end]),
        hashes[first - 1] if first else None,
        tuple(tokens[first * BLOCK_TOKENS : end * BLOCK_TOKENS]),
        BLOCK_TOKENS,
        MEDIUM,
    )


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
    cached_tokens: int = 0  # prefix cache hit at its latest admission
    admitted_at: float | None = None  # its latest admission
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    # Chain over the full blocks of prompt + output when it was last preempted: the blocks it
    # looks up in the prefix cache when it resumes.
    context_hashes: list[bytes] = field(default_factory=list)
    salt: bytes = b""  # its LoRA adapter's (adapter_salt); empty for the base model
    priority: int = 0  # lower is served first (``priority`` scheduling policy only)
    # Chunked prefill: context tokens admitted for computing and not computed yet; no token is
    # sampled for it until this is 0.
    prefill_left: int = 0

    @property
    def samples_into_new_block(self) -> bool:
        """The token it samples next needs a new KV block: its context fills its last one."""
        return (len(self.prompt) + len(self.output)) % BLOCK_TOKENS == 0

    @property
    def private_reservation(self) -> int:
        """Reserve mode: KV tokens reserved beside its (shareable) full prompt blocks: the partial
        last prompt block and room for all ``max_tokens``."""
        return len(self.prompt) % BLOCK_TOKENS + self.max_tokens

    @property
    def private_blocks(self) -> int:
        """Blocks held beside its full prompt blocks: for its prompt tail and output so far."""
        return -(-(len(self.prompt) % BLOCK_TOKENS + len(self.output)) // BLOCK_TOKENS)

    @property
    def private_held(self) -> int:
        """KV tokens held beside its full prompt blocks: prompt tail + output, in whole blocks."""
        return BLOCK_TOKENS * self.private_blocks

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
    cached: int = 0  # the first token's: prompt tokens its prefill found in the prefix cache


@dataclass(frozen=True)
class Step:
    started_at: float
    duration_s: float
    admitted: tuple[int, ...]
    prefill_tokens: int  # uncached context tokens computed this step (resumed: prompt + output)
    decode_tokens: int
    events: tuple[TokenEvent, ...]
    # In the order they were preempted (fcfs: newest first, now at the head of the waiting
    # queue; priority: lowest priority first, each back at its place in the queue).
    preempted: tuple[int, ...] = ()

    @property
    def ends_at(self) -> float:
        return self.started_at + self.duration_s


@dataclass(frozen=True)
class SchedulerStatistics:
    waiting: int  # preempted requests waiting to resume included, as in vLLM
    running: int
    kv_cache_usage: float  # 0..1
    # What admission counts (optimistic: the blocks held, in tokens; reserve: the reservation),
    # distinct: a block shared by running requests counts once.
    kv_tokens_reserved: int
    kv_capacity: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    prefix_cache_blocks: int
    prompt_tokens: int
    generation_tokens: int
    requests_finished: int
    steps: int
    busy_s: float
    num_preemptions: int
    # Requests submitted per priority value, ascending (at most MAX_PRIORITY_SERIES values).
    requests_by_priority: tuple[tuple[int, int], ...] = ()


class Scheduler:
    """Continuous batching over one ``EngineConfig``; see the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.kv_capacity = config.kv_capacity()
        self.num_blocks = self.kv_capacity // BLOCK_TOKENS
        self.optimistic = config.admission == "optimistic"
        self.by_priority = config.scheduling_policy == "priority"
        self.watermark_blocks = int(config.kv_watermark_fraction * self.num_blocks)
        self.cache = PrefixCache(config.cache_blocks(), events=config.kv_events)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # in admission order: the newest is last
        self.requests: dict[int, Request] = {}
        self._next_id = 0
        self._reserved = 0  # reserve mode: distinct KV tokens reserved by the running set
        self._used_blocks = 0  # optimistic mode: distinct KV blocks held by the running set
        self._pinned: dict[bytes, int] = {}  # full prompt block hash -> running requests holding it
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = 0
        self.preemptions = 0
        self.steps = 0
        self.busy_s = 0.0
        self.submitted_by_priority: dict[int, int] = {}

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
        blocks = -(-total // BLOCK_TOKENS)
        if self.optimistic and blocks > self.num_blocks:
            raise ValueError(
                f"the request needs {blocks} KV blocks of {BLOCK_TOKENS} tokens; capacity is "
                f"{self.num_blocks} ({self.kv_capacity} tokens)"
            )

    def submit(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        now: float,
        salt: bytes = b"",
        priority: int = 0,
    ) -> int:
        """Queue a request; ``salt`` (a LoRA adapter's) keys its output and its KV blocks;
        ``priority`` (lower first) needs the ``priority`` scheduling policy unless it is 0."""
        if priority != 0 and not self.by_priority:
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
        self.check(len(prompt), max_tokens)
        rid = self._next_id
        self._next_id += 1
        tokens = list(prompt)
        req = Request(
            rid,
            tokens,
            max_tokens,
            now,
            _prompt_key(tokens, salt),
            block_hashes(tokens, root=salt),
            salt=salt,
            priority=priority,
        )
        if self.by_priority:
            self._enqueue(req)
        else:
            self.waiting.append(req)
        self.requests[rid] = req
        counts = self.submitted_by_priority
        if priority in counts or len(counts) < MAX_PRIORITY_SERIES:
            counts[priority] = counts.get(priority, 0) + 1
        return rid

    def _enqueue(self, req: Request) -> None:
        """``priority`` policy: put ``req`` at its ``(priority, arrival, id)`` place in the
        waiting queue, scanning from the tail (where a new arrival usually belongs)."""
        waiting = self.waiting
        key = (req.priority, req.arrived_at, req.id)
        i = len(waiting)
        while i > 0:
            other = waiting[i - 1]
            if (other.priority, other.arrived_at, other.id) <= key:
                break
            i -= 1
        waiting.insert(i, req)

    def abort(self, rid: int) -> None:
        """Forget a request (its client went away); frees its blocks or reservation."""
        req = self.requests.pop(rid, None)
        if req is None:
            return
        if rid in self.running:
            del self.running[rid]
            self._release(req)
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
        optimistic = self.optimistic
        # Optimistic mode: blocks the running set takes this step (a context that fills its last
        # block needs a new one for the token it samples, and with chunked prefill so does a
        # prompt whose last chunk this step computes), preempting the newest until they fit.
        growth = 0
        preempted: list[Request] = []
        if optimistic and self.running:
            while (
                self._used_blocks + self._running_growth() > self.num_blocks
                and len(self.running) > 1
            ):
                if self.by_priority:
                    victim = self._lowest_priority()
                    del self.running[victim.id]
                else:
                    _, victim = self.running.popitem()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
            # The decoding requests' share; the prompts completed below add theirs.
            growth = sum(
                1 for r in self.running.values() if not r.prefill_left and r.samples_into_new_block
            )
        admitted: list[Request] = []
        chunked = cfg.chunked_prefill
        prefill = 0
        prefilled: list[Request] = []  # their prompt is computed whole by the end of this step
        prefilling = 0  # running requests whose prompt is still not computed after this step
        if chunked:
            # The running requests first, in admission order: a decoding one takes a token, a
            # prefilling one its next chunk (vLLM's v1 scheduler).
            budget = cfg.max_batched_tokens
            for r in self.running.values():
                if r.prefill_left:
                    continue
                budget -= 1
            for r in self.running.values():
                if not r.prefill_left:
                    continue
                chunk = min(r.prefill_left, max(0, budget - prefill))
                r.prefill_left -= chunk
                prefill += chunk
                if r.prefill_left:
                    prefilling += 1
                    continue
                prefilled.append(r)
                if optimistic and r.samples_into_new_block:
                    growth += 1  # it samples its first token this step
        else:
            budget = cfg.max_batched_tokens - len(self.running)
        # As vLLM's v1 scheduler: a step that had to preempt admits nobody.
        while not preempted and self.waiting and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if optimistic:
                free = self.num_blocks - self._used_blocks - growth
                if self.running:
                    free -= self.watermark_blocks
                if self._blocks_to_admit(req) > free:
                    break
            elif self._reserved + self._admission_cost(req) > self.kv_capacity:
                break
            # A resumed request recomputes its output too: its context's blocks are looked up.
            context = len(req.prompt) + len(req.output)
            cached = self.cache.lookup_hashes(context, req.context_hashes or req.block_hashes)
            uncached = context - cached
            # Chunked: any budget left takes a chunk. Whole: the first admission always goes,
            # the others only if their whole prompt fits.
            left = budget - prefill
            if (left <= 0) if chunked else (bool(admitted) and uncached > left):
                # Over the per-step token budget: undo the query, admit it next step.
                self.cache.query_tokens -= context
                self.cache.hit_tokens -= cached
                break
            self.waiting.popleft()
            req.cached_tokens = cached
            req.admitted_at = now
            self.running[req.id] = req
            self._admit(req)
            if not req.output:
                self.prompt_tokens += len(req.prompt)  # counted once, as vLLM
            if chunked:
                chunk = min(uncached, budget - prefill)
                req.prefill_left = uncached - chunk
                prefill += chunk
            else:
                prefill += uncached
            admitted.append(req)
            if req.prefill_left:
                prefilling += 1
            else:
                prefilled.append(req)
                if optimistic and req.samples_into_new_block:
                    growth += 1  # the token it samples this step needs a new block
        if not self.running:
            return None  # the head of the queue can never fit; check() prevents this
        # Every running request samples a token, but one still prefilling after this step.
        decode = len(self.running) - prefilling
        # Each sequence reads its own whole context, shared blocks included: sharing memory does
        # not share bandwidth.
        duration = self.step_time(
            prefill, decode, sum(r.context_tokens for r in self.running.values())
        )
        ends_at = now + duration
        events: list[TokenEvent] = []
        self._used_blocks += growth
        for req in list(self.running.values()):
            if req.prefill_left:
                continue  # its prompt is not computed yet: no token this step
            index = len(req.output)
            token = output_token(cfg.seed, req.prompt_key, index)
            req.output.append(token)
            self.generation_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = ends_at
            finish = "length" if len(req.output) >= req.max_tokens else None
            events.append(
                TokenEvent(req.id, token, index, finish, req.cached_tokens if index == 0 else 0)
            )
            if finish is not None:
                req.finished_at = ends_at
                req.finish_reason = finish
                del self.running[req.id]
                self._release(req)
                self.finished += 1
        for req in prefilled:  # its blocks are computed: later prompts may hit them
            self._cache_blocks(req, req.context_hashes or req.block_hashes)
        self.steps += 1
        self.busy_s += duration
        return Step(
            now,
            duration,
            tuple(r.id for r in admitted),
            prefill,
            decode,
            tuple(events),
            tuple(r.id for r in preempted),
        )

    def _running_growth(self) -> int:
        """Optimistic mode: the blocks the running set would take this step: one for each
        decoding request whose sampled token opens a block, and (chunked prefill) one for each
        prefilling request whose last chunk fits this step's budget and fills its last block.
        The chunks are given as ``step`` gives them: in admission order, after one token for
        each decoding request."""
        running = self.running.values()
        growth = sum(1 for r in running if not r.prefill_left and r.samples_into_new_block)
        if self.config.chunked_prefill:
            left = self.config.max_batched_tokens - sum(1 for r in running if not r.prefill_left)
            for r in running:
                if not r.prefill_left:
                    continue
                chunk = min(r.prefill_left, max(0, left))
                left -= chunk
                if chunk == r.prefill_left and r.samples_into_new_block:
                    growth += 1
        return growth

    def _lowest_priority(self) -> Request:
        """``priority`` policy: the preemption victim, the running request with the highest
        priority value, the most recently admitted among equals (``running`` is in admission
        order)."""
        victim: Request | None = None
        for req in self.running.values():
            if victim is None or req.priority >= victim.priority:
                victim = req
        assert victim is not None  # only called while something runs
        return victim

    def _blocks_to_admit(self, req: Request) -> int:
        """Optimistic mode: blocks admitting ``req`` takes this step: its full prompt blocks not
        yet pinned, and private blocks for its prompt tail, its output and the token it samples."""
        pinned = self._pinned
        new_blocks = sum(1 for h in req.block_hashes if h not in pinned)
        tail = len(req.prompt) % BLOCK_TOKENS + len(req.output) + 1
        return new_blocks + -(-tail // BLOCK_TOKENS)

    def _admission_cost(self, req: Request) -> int:
        """Reserve mode: tokens admitting ``req`` would add: its private reservation and its
        blocks not yet pinned."""
        pinned = self._pinned
        new_blocks = sum(1 for h in req.block_hashes if h not in pinned)
        return req.private_reservation + BLOCK_TOKENS * new_blocks

    def _admit(self, req: Request) -> None:
        pinned = self._pinned
        new_blocks = 0
        for h in req.block_hashes:
            refs = pinned.get(h, 0)
            pinned[h] = refs + 1
            if refs == 0:
                new_blocks += 1
        if self.optimistic:
            self._used_blocks += new_blocks + req.private_blocks
        else:
            self._reserved += req.private_reservation + BLOCK_TOKENS * new_blocks

    def _release(self, req: Request) -> None:
        pinned = self._pinned
        freed_blocks = 0
        for h in req.block_hashes:
            refs = pinned[h] - 1
            if refs:
                pinned[h] = refs
            else:
                del pinned[h]
                freed_blocks += 1
        if self.optimistic:
            self._used_blocks -= freed_blocks + req.private_blocks
        else:
            self._reserved -= req.private_reservation + BLOCK_TOKENS * freed_blocks

    def _cache_blocks(self, req: Request, hashes: Sequence[bytes]) -> None:
        """Put ``req``'s computed blocks into the prefix cache (with their tokens when it
        records events: the chain covers the prompt, then the output)."""
        cache = self.cache
        tokens: Sequence[int] = ()
        if cache.events is not None:
            tokens = (
                req.prompt + req.output
                if len(hashes) * BLOCK_TOKENS > len(req.prompt)
                else req.prompt
            )
        cache.insert_hashes(hashes, tokens)

    def take_kv_events(self) -> list[Stored | Removed | Cleared]:
        """The prefix cache's changes since the last call, as vLLM's KV-cache events
        (``EngineConfig.kv_events``; [] without)."""
        return self.cache.take_events()

    def _preempt(self, req: Request) -> None:
        """Recompute-mode preemption of a request already taken off the running set: free its
        blocks, cache its computed full blocks (freed blocks stay cached until reused, as in
        vLLM) and put it back at the head of the waiting queue, keeping its output."""
        self._release(req)
        known = req.context_hashes or req.block_hashes
        req.context_hashes = block_hashes(req.prompt + req.output, known, req.salt)
        # Only the blocks it computed are cached: a prompt preempted mid-prefill has the rest
        # still to compute (and computes it again, as it recomputes everything uncached).
        computed = len(req.prompt) + len(req.output) - req.prefill_left
        self._cache_blocks(req, req.context_hashes[: computed // BLOCK_TOKENS])
        req.prefill_left = 0
        req.preemptions += 1
        self.preemptions += 1
        if self.by_priority:
            self._enqueue(req)
        else:
            self.waiting.appendleft(req)

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
        if self.optimistic:
            held = reserved = BLOCK_TOKENS * self._used_blocks
        else:
            reserved = self._reserved
            held = BLOCK_TOKENS * len(self._pinned) + sum(
                r.private_held for r in self.running.values()
            )
        return SchedulerStatistics(
            waiting=len(self.waiting),
            running=len(self.running),
            kv_cache_usage=min(1.0, held / self.kv_capacity) if self.kv_capacity else 0.0,
            kv_tokens_reserved=reserved,
            kv_capacity=self.kv_capacity,
            prefix_cache_hits=self.cache.hit_tokens,
            prefix_cache_queries=self.cache.query_tokens,
            prefix_cache_blocks=len(self.cache),
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            requests_finished=self.finished,
            steps=self.steps,
            busy_s=self.busy_s,
            num_preemptions=self.preemptions,
            requests_by_priority=tuple(sorted(self.submitted_by_priority.items())),
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
