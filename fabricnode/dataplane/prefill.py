"""Prefill clocks: how long each node still needs, by this ingress's account, to prefill the
prompts it was sent. A routing signal (``routing.load_score``'s ``prefill_s``).

Why
---
An engine computes a prompt's prefill in one step (or a few chunks). A request that arrives
while another prompt is being prefilled waits for that step: with prompts of ~1,000 tokens, a
tenth of a second on an A100 for an 8B model. Counts of waiting and running requests do not see
this: a node running thirty batch requests in decode is nearly free for a new prompt, and a node
running two that were just sent is not. The ingress does know what it just sent, and when, so it
keeps, per node, a *virtual clock* of the prefill work it has sent there: sending a prompt of T
(estimated) tokens moves the node's clock to ``max(clock, now) + T / rate``, and
``backlog(node, now) = max(0, clock - now)`` is the prefill time still ahead of a new request.
Routing prefers nodes with no backlog; measured on ``bench/tiers.py``
(docs/benchmarks-history.md), this is what keeps interactive requests off the nodes that are
prefilling batch work.

The rate is learned per node, in the units the ingress estimates tokens in (prompt bytes / 4),
so a systematic error of that estimate cancels. A sample is a streamed request sent while the
node's clock showed no backlog: ``tokens / time to its first byte``. That time also holds the
step in progress when it arrived and the engine's overheads, which make a sample low; a prompt
whose prefix the engine had cached makes it far too high. So the rate is a robust upper
quantile, the ``QUANTILE`` of the last ``WINDOW`` samples: a quarter of them may be outliers
either way. Short prompts say more about overheads than about the rate and are not sampled.
Until a node has a sample it gets ``default_rate``. (The first byte of a vLLM stream comes with
the first token: the role chunk is sent on the generator's first iteration.)

Under load the rate alone runs the clock ahead of the engine: each step also decodes the running
requests, and an engine that schedules by priority computes a later interactive prompt before an
earlier batch one. So every stream corrects the clock when its first token comes: a prompt whose
first token comes later than the end of its slot on the clock says the node is that much behind,
and the node's clock moves on by the difference (``first_token``). Corrections are only ever
forward and are not counted twice: a slot's end is read with the corrections made since it was
given (``_shift``), so two prompts held up by the same delay push the clock once.

A batch prompt also waits, in an engine that schedules by priority, behind every interactive
prompt that arrives while it is queued: it gets only what they leave of the node's rate (a
low-priority job's service rate in a priority queue). So its slot is its tokens over
``rate * (1 - interactive load)``, the load being the interactive prompt tokens sent to the
node over the last ``LOAD_WINDOW_S`` (exponentially decayed) as a share of the rate, and at
least ``MIN_BATCH_SHARE`` of it. This counts the interactive prompts twice (each also adds its
own slot when sent): the clock errs late for batch work, which only ever waits the longer.

Pure: no I/O and no clock reads; every call takes ``now`` (the ingress's monotonic clock). State
is bounded by the number of nodes: ``forget`` drops a node that left the routing table.
"""

from __future__ import annotations

import math
from collections import deque

DEFAULT_RATE = 10_000.0  # estimated tokens per second before a node has a sample
MIN_SAMPLE_TOKENS = 256  # shorter prompts are not sampled: overheads would dominate
WINDOW = 32  # samples kept per node
QUANTILE = 0.75  # the rate: this quantile of the samples kept
MIN_RATE = 10.0
LOAD_WINDOW_S = 10.0  # the interactive load a batch prompt's slot allows for (decay time)
MIN_BATCH_SHARE = 0.25  # a batch prompt's slot assumes at least this share of the rate
MAX_RATE = 10_000_000.0


class PrefillClocks:
    """Per-node virtual prefill clocks and learned prefill rates (see the module docstring)."""

    __slots__ = ("_load", "_rate", "_samples", "_shift", "_until", "default_rate")

    def __init__(self, default_rate: float = DEFAULT_RATE) -> None:
        if not MIN_RATE <= default_rate <= MAX_RATE:
            raise ValueError(f"prefill default rate {default_rate!r}: must be in [10, 1e7]")
        self.default_rate = default_rate
        self._until: dict[str, float] = {}
        self._rate: dict[str, float] = {}
        self._samples: dict[str, deque[float]] = {}
        # Per node, the corrections made so far (seconds, growing): a slot's end as given is
        # read as ``due + _shift`` (see ``first_token``).
        self._shift: dict[str, float] = {}
        # Per node, interactive prompt tokens sent, decayed over LOAD_WINDOW_S: (sum, as of).
        self._load: dict[str, tuple[float, float]] = {}

    def backlog(self, sid: str, now: float) -> float:
        """Seconds of prefill this ingress sent to ``sid`` that are (estimated) still ahead."""
        until = self._until.get(sid)
        if until is None or until <= now:
            return 0.0
        return until - now

    def sent(self, sid: str, tokens: int, now: float, batch: bool = False) -> bool:
        """A prompt of ``tokens`` went to ``sid`` at ``now`` (``batch``: of the batch tier).
        True if the node had no backlog (the request's time to first token is then a sample of
        the rate)."""
        until = self._until.get(sid, now)
        idle = until <= now
        start = now if idle else until
        tokens = max(tokens, 1)
        rate = self.rate(sid)
        if batch:
            share = max(MIN_BATCH_SHARE, 1.0 - self.interactive_load(sid, now))
            self._until[sid] = start + tokens / (rate * share)
            return idle
        self._until[sid] = start + tokens / rate
        self._load[sid] = (self._decayed(sid, now) + tokens, now)
        return idle

    def unsent(
        self, sid: str, tokens: int, sent_at: float, now: float, batch: bool = False
    ) -> None:
        """The prompt of ``tokens`` ``sent`` to ``sid`` at ``sent_at`` was not prefilled: the
        engine answered it at once with an error (a 404 for its model, a 400 for its length) or
        never got it. Its slot is given back: the clock moves back by the slot's length
        (computed as ``sent`` did, with the rate as it is now), never before ``now``, and an
        interactive prompt's tokens leave the load (as much of them as is left after their
        decay). Without this, an 8 MiB prompt refused in a millisecond held the node's clock for
        seconds, and the batch tier waited it out."""
        until = self._until.get(sid)
        if until is None or until <= now:
            return
        tokens = max(tokens, 1)
        rate = self.rate(sid)
        if batch:
            share = max(MIN_BATCH_SHARE, 1.0 - self.interactive_load(sid, now))
            length = tokens / (rate * share)
        else:
            length = tokens / rate
            left = tokens * math.exp(-max(0.0, now - sent_at) / LOAD_WINDOW_S)
            self._load[sid] = (max(0.0, self._decayed(sid, now) - left), now)
        self._until[sid] = max(now, until - length)

    def interactive_load(self, sid: str, now: float) -> float:
        """The interactive prompt tokens sent to ``sid`` lately as a share of its rate."""
        return self._decayed(sid, now) / (LOAD_WINDOW_S * self.rate(sid))

    def _decayed(self, sid: str, now: float) -> float:
        found = self._load.get(sid)
        if found is None:
            return 0.0
        total, at = found
        return total * math.exp(-max(0.0, now - at) / LOAD_WINDOW_S)

    def due(self, sid: str) -> float:
        """The end of the slot ``sent`` just gave ``sid``'s last prompt, as a handle for
        ``first_token`` (in the node's frame before its corrections)."""
        return self._until.get(sid, 0.0) - self._shift.get(sid, 0.0)

    def first_token(self, sid: str, due: float, at: float) -> float:
        """The prompt ``sent`` to ``sid`` with slot ``due`` got its first token at ``at``: if
        that is later than the slot's end (with the corrections made since), the node is that
        much behind this clock and the clock moves on by as much. Returns the correction."""
        until = self._until.get(sid)
        if until is None:
            return 0.0
        shift = self._shift.get(sid, 0.0)
        late = at - (due + shift)
        if not late > 0.0:  # on time, early (a cached prefix), or NaN
            return 0.0
        self._until[sid] = until + late
        self._shift[sid] = shift + late
        return late

    def observe(self, sid: str, tokens: int, ttft_s: float) -> None:
        """A request sent to ``sid`` with no backlog there got its first token after
        ``ttft_s`` seconds: one sample of the node's rate."""
        if tokens < MIN_SAMPLE_TOKENS or not ttft_s > 0.0:  # NaN fails too
            return
        sample = min(MAX_RATE, max(MIN_RATE, tokens / ttft_s))
        samples = self._samples.get(sid)
        if samples is None:
            self._samples[sid] = samples = deque(maxlen=WINDOW)
        samples.append(sample)
        ordered = sorted(samples)
        self._rate[sid] = ordered[int(QUANTILE * (len(ordered) - 1))]

    def soonest_end(self, now: float) -> float | None:
        """The earliest time after ``now`` a node's backlog runs out (None: none has one)."""
        ahead = [until for until in self._until.values() if until > now]
        return min(ahead) if ahead else None

    def rate(self, sid: str) -> float:
        return self._rate.get(sid, self.default_rate)

    def learned(self) -> dict[str, float]:
        """The rates learned so far, by node (for /metrics)."""
        return dict(self._rate)

    def forget(self, sid: str) -> None:
        self._until.pop(sid, None)
        self._rate.pop(sid, None)
        self._samples.pop(sid, None)
        self._shift.pop(sid, None)
        self._load.pop(sid, None)

    def __len__(self) -> int:
        return len(self._until)
