"""What one replica of a model sustains, learned from replicas seen saturated (pure).

Rules
-----
* Pure, in the manner of h11: numbers and ``now`` in (seconds on the caller's monotonic
  clock), a capacity out; no I/O, no clock. ``now`` earlier than one already seen is read as
  the latest.
* What is learned is a **factor** on the prior (``ReplicaCapacity``: the planner's, or
  ``capacity.DEFAULT_CAPACITY``): the share of the prior's work one replica actually does per
  second when it is saturated. The policy's arithmetic (``policy.ReplicaCapacity.work``, in
  fully busy replicas) adds prefill and decode fractions, so a measured mix of prompt and output
  tokens per second is one number of work under the prior; at saturation that number is what a
  replica does fully busy, and the prior's two rates scaled by it are the replica's capacity.
  The prior's ratio of prefill to decode speed is kept: one mix observed cannot tell them apart.
* **Evidence is a saturated window only.** The controller feeds the gossiped load of the
  model's serving replicas (``observe_load``: each pass) and, per poll of the request logs, the
  tokens of the requests that ended since the previous poll (``observe_served``). A window
  counts when every load sample over it showed every serving replica with requests waiting
  (its queue not empty: it was running all it could) or its KV cache at least ``kv_full``, the
  samples no more than ``max_gap_s`` apart and covering both ends, and the number of replicas
  the same throughout. A window with one replica unsaturated, or unseen for a while, teaches
  nothing: an unsaturated replica's throughput is the demand's, not the replica's, and is
  never taken for a capacity below the prior.
* **Ratio of sums, decayed.** The saturated windows' prompt tokens, output tokens and replica-
  seconds are summed with a half-life of ``half_life_s``; the learned rates are the token sums
  over the replica-seconds (a window in which no long request happened to end is averaged with
  the ones in which several did, instead of being taken alone). The figure is used once
  ``min_replica_s`` replica-seconds and ``min_requests`` ended requests are behind it.
* **Bounded.** The factor stays within ``[1 / max_factor, max_factor]`` of the prior; the
  load samples kept are those of the last ``max_window_s`` (at most ``MAX_SAMPLES``).
* Laws (tests/unit/elastic/test_throughput.py, Hypothesis, under a fake clock): never learns
  from a window with an unsaturated sample; the factor is within its bounds; a saturated
  replica serving exactly ``k`` times the prior's work is learned as ``k`` (within rounding);
  no evidence, the prior.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from fabricnode.elastic.policy import LoadSample, ReplicaCapacity, TokenDemand
from fabricnode.errors import ConfigError

MAX_SAMPLES = 512  # load samples kept (one per controller pass: 2 s)


@dataclass(frozen=True)
class LearnerConfig:
    """The knobs of ``ThroughputLearner`` (module docstring): ``kv_full``: KV use that counts
    as saturated without a queue; ``max_gap_s``: load samples further apart than this leave the
    time between them unknown; ``half_life_s``: the weight of a saturated window halves this
    long after it; ``min_replica_s`` / ``min_requests``: evidence before the figure is used;
    ``max_factor``: the factor's bound either way; ``max_window_s``: the longest window fed."""

    kv_full: float = 0.9
    max_gap_s: float = 6.0
    half_life_s: float = 300.0
    min_replica_s: float = 15.0
    min_requests: int = 8
    max_factor: float = 1000.0
    max_window_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("max_gap_s", "half_life_s", "max_window_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if not 0 < self.kv_full <= 1:
            raise ConfigError(f"kv_full must be in (0, 1], got {self.kv_full!r}")
        if not (self.min_replica_s >= 0 and math.isfinite(self.min_replica_s)):
            raise ConfigError(f"min_replica_s must be >= 0, got {self.min_replica_s!r}")
        if self.min_requests < 0:
            raise ConfigError(f"min_requests must be >= 0, got {self.min_requests!r}")
        if not (self.max_factor >= 1 and math.isfinite(self.max_factor)):
            raise ConfigError(f"max_factor must be >= 1, got {self.max_factor!r}")


@dataclass(frozen=True)
class LearnerStatistics:
    windows: int  # saturated windows learned from
    skipped: int  # windows fed that were not saturated throughout
    replica_s: float  # decayed replica-seconds of saturated evidence
    requests: float  # decayed requests ended in those windows


def saturated(load: LoadSample, kv_full: float) -> bool:
    """Every replica of ``load`` has requests waiting or its KV cache full (none is idle)."""
    if not load.waiting:
        return False
    return all(w > 0 or kv >= kv_full for w, kv in zip(load.waiting, load.kv_usage, strict=True))


class ThroughputLearner:
    """Per model: what one replica sustains, from its saturated windows (module docstring)."""

    def __init__(self, config: LearnerConfig | None = None) -> None:
        self.config = config or LearnerConfig()
        self._now = -math.inf
        self._samples: deque[tuple[float, int, bool]] = deque()  # (at, replicas, saturated)
        self._at = -math.inf  # when the sums were last decayed
        self._prompt = 0.0  # decayed sums of the saturated windows
        self._output = 0.0
        self._replica_s = 0.0
        self._requests = 0.0
        self._windows = 0
        self._skipped = 0

    def _clock(self, now: float) -> float:
        if now > self._now:
            self._now = now
        return self._now

    def observe_load(self, now: float, load: LoadSample) -> None:
        """The gossiped load of the model's serving replicas now."""
        now = self._clock(now)
        self._samples.append((now, len(load.waiting), saturated(load, self.config.kv_full)))
        horizon = now - self.config.max_window_s - self.config.max_gap_s
        while self._samples and (self._samples[0][0] < horizon or len(self._samples) > MAX_SAMPLES):
            self._samples.popleft()

    def observe_served(
        self, now: float, since: float, requests: int, prompt_tokens: int, output_tokens: int
    ) -> bool:
        """The requests that ended in ``[since, now]`` and their tokens (the request logs'
        poll); True when the window was saturated and was learned from."""
        now = self._clock(now)
        replicas = self._saturated_over(since, now)
        if replicas is None:
            self._skipped += 1
            return False
        self._decay(now)
        self._prompt += max(0, prompt_tokens)
        self._output += max(0, output_tokens)
        self._requests += max(0, requests)
        self._replica_s += replicas * (now - since)
        self._windows += 1
        return True

    def _saturated_over(self, since: float, now: float) -> int | None:
        """The replicas serving throughout ``[since, now]`` when every sample over it was
        saturated and they cover it (module docstring), else None."""
        cfg = self.config
        if not (0 < now - since <= cfg.max_window_s) or not math.isfinite(since):
            return None
        inside = [s for s in self._samples if since - cfg.max_gap_s <= s[0] <= now]
        if (
            not inside
            or inside[0][0] > since + cfg.max_gap_s
            or inside[-1][0] < now - cfg.max_gap_s
        ):
            return None
        replicas = inside[0][1]
        prev = inside[0][0]
        for at, n, full in inside:
            if not full or n != replicas or at - prev > cfg.max_gap_s:
                return None
            prev = at
        return replicas if replicas > 0 else None

    def _decay(self, now: float) -> None:
        if self._at > -math.inf:
            keep = 0.5 ** ((now - self._at) / self.config.half_life_s)
            self._prompt *= keep
            self._output *= keep
            self._replica_s *= keep
            self._requests *= keep
        self._at = now

    def factor(self, prior: ReplicaCapacity) -> float | None:
        """The learned share of ``prior``'s work one replica does (bounded), or None before
        enough evidence."""
        cfg = self.config
        if self._replica_s < max(cfg.min_replica_s, 1e-9) or self._requests < cfg.min_requests:
            return None
        per_replica = TokenDemand(self._prompt / self._replica_s, self._output / self._replica_s)
        work = prior.work(per_replica)
        return min(cfg.max_factor, max(1.0 / cfg.max_factor, work))

    def capacity(self, prior: ReplicaCapacity) -> ReplicaCapacity:
        """``prior`` scaled by the learned factor; ``prior`` itself before there is one."""
        k = self.factor(prior)
        if k is None:
            return prior
        return ReplicaCapacity(prior.prefill_tokens_per_s * k, prior.decode_tokens_per_s * k)

    def statistics(self) -> LearnerStatistics:
        return LearnerStatistics(self._windows, self._skipped, self._replica_s, self._requests)
