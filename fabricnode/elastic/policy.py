"""Scaling policy: how many replicas of one model to run now, from its demand and its load.

Rules
-----
1. Pure, in the manner of h11: no I/O, no trio, no clock. Every method takes ``now``, seconds on
   the caller's monotonic clock; a ``now`` earlier than one already seen is read as the latest.
2. One policy object per model. The controller feeds it what it observes, in time order, and
   asks ``desired_replicas(now, state)`` once per tick; it then submits replicas, or cancels
   starting ones and drains serving ones, to reach ``Decision.replicas``. Observations:

   - ``observe_arrival(now, prompt_tokens)``: a request for the model reached an ingress;
   - ``observe_completion(now, output_tokens)``: a request finished (the request log);
   - ``observe_load(now, LoadSample)``: the gossiped load of the serving replicas, per replica
     the KV-cache use (vLLM's ``kv_cache_usage_perc``) and waiting requests;
   - ``observe_ttft(now, p95_s)``: the p95 time to first token the controller measured over
     its recent window;
   - ``observe_held(now, requests)`` (``ForecastPolicy`` only): requests the ingresses hold
     waiting for a replica (their ``fabric.wanted`` labels), backlog as the replicas' queues.

   A policy uses what it needs and ignores the rest, so the three policies here are
   interchangeable: ``ForecastPolicy`` (the controller's), ``ReactivePolicy`` and
   ``StaticPolicy`` (the baselines the autoscaling bench compares it with).
3. ``ReplicaState.replicas`` counts the replicas the controller holds: serving plus starting
   (submitted, not SERVING yet). Draining replicas are leaving and are not counted.
4. A decision is always within ``[min_replicas, max_replicas]``. One that changes the count says
   why (``Decision.reason``, one of ``REASONS``); one that keeps it has the reason ``""``.
5. Invalid knobs (``PolicyConfig``, ``ForecastConfig``, ``ReplicaCapacity``: they come from
   service files and the planner) raise ``ConfigError`` naming the knob; an inconsistent
   ``ReplicaState`` (the controller's own) raises ``ValueError``.

Theory of operation (``ForecastPolicy``)
----------------------------------------
Demand is token work split as PreServe splits it: prefill tokens/s (the prompt tokens of the
arrivals) and decode tokens/s (arrivals/s times the running mean of output tokens per completed
request: an arriving request's output length is unknown, the mean is not).

Forecast (``DemandForecaster``): arrivals are counted in bins of ``bin_s``; as each bin closes,
Holt's linear method updates a level and a trend per series (prompt tokens/s, requests/s). The
level is the demand in the middle of the last closed bin, so the forecast for ``now + h`` is the
level plus the trend times the bins from that middle to ``now + h`` (optionally damped). The
forecaster keeps its own score: as each bin closes it notes what it predicts for the bin ``h``
ahead and, when that bin closes, the absolute error against the level then. An exponentially
weighted mean of those errors, times 1.25 (mean absolute error to standard deviation for a
normal error), is the forecast's sigma; ``upper`` adds ``headroom_sigmas`` of it. Fixed
constants rather than a fitted model: 90 s ahead on the Azure conversation trace, statsmodels'
Holt-Winters and ETS, refitted every bin (4-17 ms a fit), were no more accurate than a plain
EWMA or a damped Holt with fixed constants. The undamped trend here is less accurate on average
than either (it overshoots after a turn); it is what lets the policy scale a cold start ahead of
a sustained ramp, and it bought attainment in the autoscaling bench
(docs/benchmarks-history.md).

Work: a replica sustains ``prefill_tokens_per_s`` doing only prefill, or ``decode_tokens_per_s``
doing only decode (``ReplicaCapacity``). It time-shares between the two, so a demand of ``p``
prefill and ``d`` decode tokens/s keeps ``p/mu_p + d/mu_d`` replicas fully busy. The controller
learns the two rates, or takes them from the planner's analytic model (its saturation rate:
``target_utilisation`` then holds the headroom the TTFT objective needs).

Scale out, for the demand the new replica will meet (``need``): a replica submitted now serves
from ``now + cold_start_s``, so the policy asks for ``ceil((work(upper forecast at now +
cold_start_s) + backlog left then / drain) / target_utilisation)`` replicas, in one decision
(reason ``forecast``, or ``backlog`` when the queue is what asks for more than the forecast
alone). The backlog is the requests waiting at the serving replicas (the fresh load) and those
the ingresses hold for a replica (``observe_held``), each the mean request's work
(``DemandForecaster.request``); what is left of it at the arrival time is what the serving
replicas cannot drain meanwhile with the capacity the current demand leaves them. The current
demand is the forecast's level, or, while the replicas have queued through the last
``GROWTH_BASE_S`` at least, the replicas fully busy plus the queue's growth over that time. A
burst that is over before then, its queue drained by the replicas there are, is no reason to
start one. Confirmation, as SageServe confirms its forecast with thresholds: when the forecast
asks for no more but the measured p95 TTFT is above the objective while a backlog would still be
left when a replica arrives (``objective``), or the KV caches are nearly full or requests queue
that would still queue when a replica arrives and have queued for a forecast bin (``load``), and
no replica is already starting, the policy adds one, at most once per ``confirm_cooldown_s``.

Saturated replicas (every serving one with requests waiting or its KV cache full, in every load
sample of the last forecast bin) do all they can: the requests ending per second over them is
what one sustains. When that is below the capacity held (a replica taken for more than it is:
the planner's or the default figure, before ``throughput`` learned better), the scale-out need
is also computed at that capacity, for a demand at least what the queue's growth shows now (the
logs count requests as they end, so the forecast cannot see above what the saturated replicas
end); when it asks for more, that is the target (reason ``load``), every pass, as the forecast's
and the backlog's are: several replicas at once, not one per cool-down.

Scale in, with hysteresis: each decision notes the count the demand (the larger of now and the
point forecast, with the backlog left as above) needs at ``scale_in_band x target_utilisation``
and remembers it for ``scale_in_hold_s``. The policy scales in to the largest count of that
window, never below what scale-out asks for now, when that is below the current count, the
window is full (no scale-out in the last ``scale_in_hold_s``), no replica is starting and the
load agrees: p95 TTFT at most ``scale_in_ttft_fraction`` of the objective, KV use below
``kv_high``, no queue (reason ``low-demand``). So scale-in and scale-out cannot alternate on a
steady demand, and a dip shorter than the hold time costs no cold start.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol

from fabricnode.elastic import need
from fabricnode.errors import ConfigError

REASONS = (
    "forecast",  # the forecast at now + cold start needs more replicas
    "backlog",  # the queue a new replica would still find when it arrives needs more replicas
    "load",  # KV caches nearly full or requests waiting, beyond what the forecast asked for
    "objective",  # the measured p95 TTFT is above the objective
    "low-demand",  # demand stayed under the scale-in band for the hold time, and load agrees
    "low-load",  # the reactive baseline's scale-in: KV use under its low threshold
    "static",  # the static baseline's fixed count
    "bounds",  # the count was outside [min_replicas, max_replicas] (the service changed)
)
_EPS = 1e-9
# The queue's growth, the demand on top of busy replicas, is measured over at least this long,
# and only while the replicas queued all along: from one sample to the next (a pass, a second)
# a queue of a few requests comes and goes with the arrivals' own burstiness, and its growth
# extrapolated over a cold start chased it (bench/autoscale.py's diurnal day: 0.90x the
# GPU-hours of the cheapest static count holding 99%, against 0.66x so).
GROWTH_BASE_S = 10.0


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a positive number, got {value!r}")


def _fraction(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ConfigError(f"{name} must be in (0, 1], got {value!r}")


# -- inputs and outputs -------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenDemand:
    """Token work per second: prompt tokens to prefill and output tokens to decode."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float


@dataclass(frozen=True)
class ReplicaCapacity:
    """What one replica sustains doing only prefill, or only decode (tokens/s): the planner's
    saturation rates, or rates the controller measured within the objective. A replica
    time-shares the two, so ``work`` adds the fractions; ``target_utilisation`` is a share of
    these rates."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float

    def __post_init__(self) -> None:
        _positive("prefill_tokens_per_s", self.prefill_tokens_per_s)
        _positive("decode_tokens_per_s", self.decode_tokens_per_s)

    def work(self, demand: TokenDemand) -> float:
        """Replicas ``demand`` keeps fully busy."""
        return (
            demand.prefill_tokens_per_s / self.prefill_tokens_per_s
            + demand.decode_tokens_per_s / self.decode_tokens_per_s
        )


def replicas_for(demand: TokenDemand, capacity: ReplicaCapacity, utilisation: float) -> int:
    """The fewest replicas that serve ``demand`` with each at most ``utilisation`` busy."""
    return max(0, math.ceil(capacity.work(demand) / utilisation - _EPS))


@dataclass(frozen=True)
class ReplicaState:
    """What the controller holds for the model, and the facts the decision depends on.

    ``replicas``: serving plus starting; ``starting``: of those, submitted but not SERVING yet;
    ``cold_start_s``: measured time from submission to SERVING; bounds from the service file;
    ``capacity``: per replica, learned by the controller or from the planner."""

    replicas: int
    starting: int
    min_replicas: int
    max_replicas: int
    cold_start_s: float
    capacity: ReplicaCapacity

    def __post_init__(self) -> None:
        if not 0 <= self.starting <= self.replicas:
            raise ValueError(f"need 0 <= starting <= replicas, got {self.starting}/{self.replicas}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, "
                f"{self.max_replicas}"
            )
        if not (self.cold_start_s >= 0 and math.isfinite(self.cold_start_s)):
            raise ValueError(f"cold_start_s must be >= 0, got {self.cold_start_s!r}")

    def clamp(self, replicas: int) -> int:
        return min(self.max_replicas, max(self.min_replicas, replicas))


@dataclass(frozen=True)
class LoadSample:
    """The gossiped load of the model's serving replicas, one entry per replica: KV-cache use
    (0..1) and requests waiting for admission."""

    kv_usage: tuple[float, ...]
    waiting: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.kv_usage) != len(self.waiting):
            raise ValueError("kv_usage and waiting need one entry per replica each")

    @property
    def mean_kv_usage(self) -> float:
        return sum(self.kv_usage) / len(self.kv_usage) if self.kv_usage else 0.0

    @property
    def waiting_per_replica(self) -> float:
        return sum(self.waiting) / len(self.waiting) if self.waiting else 0.0


@dataclass(frozen=True)
class Decision:
    """How many replicas the model should have (serving plus starting) and why it changed."""

    replicas: int
    reason: str = ""


class ScalingPolicy(Protocol):
    """The interface every policy here has (see the module docstring, rule 2)."""

    def observe_arrival(self, now: float, prompt_tokens: int) -> None: ...

    def observe_completion(self, now: float, output_tokens: int) -> None: ...

    def observe_load(self, now: float, load: LoadSample) -> None: ...

    def observe_ttft(self, now: float, p95_s: float) -> None: ...

    def desired_replicas(self, now: float, state: ReplicaState) -> Decision: ...


class _Observer:
    """Signals a policy ignores, and the clock guard (rule 1)."""

    def __init__(self) -> None:
        self._now = -math.inf

    def _clock(self, now: float) -> float:
        if now > self._now:
            self._now = now
        return self._now

    def observe_arrival(self, now: float, prompt_tokens: int) -> None:
        self._clock(now)

    def observe_completion(self, now: float, output_tokens: int) -> None:
        self._clock(now)

    def observe_load(self, now: float, load: LoadSample) -> None:
        self._clock(now)

    def observe_ttft(self, now: float, p95_s: float) -> None:
        self._clock(now)


# -- the forecaster -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ForecastConfig:
    """Holt's linear method over binned arrivals (see the module docstring).

    ``bin_s``: the bin; ``level_alpha`` / ``trend_beta``: smoothing of the level and the trend
    per bin (higher follows faster and is noisier); ``trend_damping``: the trend's weight decays
    by this factor per bin ahead (1 = undamped Holt); ``error_alpha``: smoothing of the tracked
    forecast error; ``output_tokens_prior``: mean output tokens per request before any
    completion was seen; ``output_alpha``: weight of each completion in that running mean."""

    bin_s: float = 10.0
    level_alpha: float = 0.3
    trend_beta: float = 0.05
    trend_damping: float = 1.0
    error_alpha: float = 0.05
    output_tokens_prior: float = 256.0
    output_alpha: float = 0.01
    prompt_tokens_prior: float = 1024.0  # mean prompt tokens per request before any arrival

    def __post_init__(self) -> None:
        _positive("bin_s", self.bin_s)
        _positive("output_tokens_prior", self.output_tokens_prior)
        _positive("prompt_tokens_prior", self.prompt_tokens_prior)
        for name in ("level_alpha", "trend_beta", "trend_damping", "error_alpha", "output_alpha"):
            _fraction(name, getattr(self, name))


WARMUP_BINS = 6  # bins a series must have seen before its forecasts are scored


class _Holt:
    """Holt's linear method on one series, with the absolute error of its h-bin forecasts."""

    __slots__ = ("bins", "error", "level", "pending", "scored", "trend")

    def __init__(self) -> None:
        self.level: float | None = None
        self.trend = 0.0
        self.bins = 0  # bins seen
        self.error = 0.0
        self.scored = 0  # forecasts scored so far
        self.pending: deque[tuple[int, float]] = deque()  # (bin, forecast of its level)

    def ahead(self, bins: float, damping: float) -> float:
        if self.level is None:
            return 0.0
        # the trend's weight over the bins ahead: sum of damping**k, k = 1..bins
        steps = bins if damping >= 1.0 else damping * (1.0 - damping**bins) / (1.0 - damping)
        return max(0.0, self.level + steps * self.trend)

    def update(self, b: int, value: float, cfg: ForecastConfig, horizon_bins: int) -> None:
        self.bins += 1
        if self.level is None:
            self.level = value
        else:
            prev = self.level
            phi = cfg.trend_damping
            self.level = cfg.level_alpha * value + (1 - cfg.level_alpha) * (prev + phi * self.trend)
            self.trend = (
                cfg.trend_beta * (self.level - prev) + (1 - cfg.trend_beta) * phi * self.trend
            )
        while self.pending and self.pending[0][0] <= b:
            target, predicted = self.pending.popleft()
            if target == b:
                miss = abs(self.level - predicted)
                a = max(cfg.error_alpha, 1.0 / (self.scored + 1))  # a plain mean at first
                self.error += a * (miss - self.error)
                self.scored += 1
        if self.bins >= WARMUP_BINS:  # the start-up transient is not the forecast's error
            self.pending.append((b + horizon_bins, self.ahead(horizon_bins, cfg.trend_damping)))


@dataclass(frozen=True)
class Forecast:
    """Demand now (the smoothed level), the point forecast ``horizon_s`` ahead, and that plus
    the headroom the forecaster's own tracked error asks for."""

    now: TokenDemand
    ahead: TokenDemand
    upper: TokenDemand
    horizon_s: float


class DemandForecaster:
    """Per model: prefill and decode tokens/s now and ``horizon_s`` ahead (pure; ``now`` in)."""

    def __init__(self, config: ForecastConfig | None = None) -> None:
        self.config = config or ForecastConfig()
        self._bin: int | None = None  # the open bin
        self._first_bin: int | None = None  # partly observed: not fed to the series
        self._prompt_tokens = 0.0  # in the open bin
        self._requests = 0
        self._prompt = _Holt()  # prompt tokens/s
        self._rate = _Holt()  # requests/s
        self._output_mean = self.config.output_tokens_prior
        self._completions = 0
        self._horizon_bins = 1  # until forecast() is asked for a horizon

    @property
    def output_tokens_mean(self) -> float:
        """The running mean of output tokens per completed request."""
        return self._output_mean

    def request(self) -> TokenDemand:
        """The mean request: prompt tokens (the levels' ratio of prompt tokens to requests,
        ``prompt_tokens_prior`` before any arrival) and output tokens (the running mean)."""
        prompt = self.config.prompt_tokens_prior
        if self._rate.level and self._prompt.level is not None and self._rate.level > 1e-9:
            prompt = self._prompt.level / self._rate.level
        elif self._requests:
            prompt = self._prompt_tokens / self._requests
        return TokenDemand(prompt, self._output_mean)

    def _advance(self, now: float) -> None:
        b = math.floor(now / self.config.bin_s)
        if self._bin is None:
            self._bin = self._first_bin = b
            return
        if b <= self._bin:
            return
        # close the open bin, then the empty ones up to b (after a long silence only the last
        # 1000: by then every level has long decayed to nothing)
        first = max(self._bin, b - 1000)
        for k in range(first, b):
            if k == self._first_bin:
                continue
            filled = k == self._bin
            prompt = self._prompt_tokens if filled else 0.0
            count = self._requests if filled else 0
            self._prompt.update(k, prompt / self.config.bin_s, self.config, self._horizon_bins)
            self._rate.update(k, count / self.config.bin_s, self.config, self._horizon_bins)
        self._bin = b
        self._prompt_tokens = 0.0
        self._requests = 0

    def observe_arrival(self, now: float, prompt_tokens: int) -> None:
        self._advance(now)
        self._prompt_tokens += max(0, prompt_tokens)
        self._requests += 1

    def observe_completion(self, now: float, output_tokens: int) -> None:
        self._advance(now)
        a = max(self.config.output_alpha, 1.0 / (self._completions + 1))
        self._output_mean += a * (max(0, output_tokens) - self._output_mean)
        self._completions += 1

    def forecast(self, now: float, horizon_s: float, headroom_sigmas: float = 0.0) -> Forecast:
        """Demand now and ``horizon_s`` ahead; ``upper`` adds ``headroom_sigmas`` times the
        tracked error of forecasts that far ahead (errors are tracked at the latest horizon
        asked for)."""
        self._advance(now)
        cfg = self.config
        self._horizon_bins = max(1, round(horizon_s / cfg.bin_s))
        # the level is the demand in the middle of the last closed bin: extrapolate from there
        age = 0.0 if self._bin is None else max(0.0, now / cfg.bin_s - (self._bin - 0.5))
        bins = horizon_s / cfg.bin_s + age
        out = self._output_mean
        prompt_now = self._prompt.ahead(age, cfg.trend_damping)
        rate_now = self._rate.ahead(age, cfg.trend_damping)
        prompt = self._prompt.ahead(bins, cfg.trend_damping)
        rate = self._rate.ahead(bins, cfg.trend_damping)
        k = 1.25 * headroom_sigmas
        return Forecast(
            now=TokenDemand(prompt_now, rate_now * out),
            ahead=TokenDemand(prompt, rate * out),
            upper=TokenDemand(prompt + k * self._prompt.error, (rate + k * self._rate.error) * out),
            horizon_s=horizon_s,
        )

    def observe_arrivals(self, now: float, requests: int, prompt_tokens: int) -> None:
        """``requests`` arrivals of ``prompt_tokens`` in all, at once (as that many calls of
        ``observe_arrival``): what the controller reads from the request logs per poll."""
        self._advance(now)
        self._prompt_tokens += max(0, prompt_tokens)
        self._requests += max(0, requests)

    def observe_completions(self, now: float, completions: int, output_tokens: int) -> None:
        """``completions`` requests of ``output_tokens`` in all, at once: the running mean moves
        as if each had the batch's mean output."""
        self._advance(now)
        if completions <= 0:
            return
        x = max(0, output_tokens) / completions
        alpha = self.config.output_alpha
        # a plain mean while 1/(k+1) > alpha (observe_completion's rule), alpha after that
        plain = min(completions, max(0, math.ceil(1.0 / alpha - 1.0 - 1e-9) - self._completions))
        if plain:
            k = self._completions
            self._output_mean = (self._output_mean * k + x * plain) / (k + plain)
        rest = completions - plain
        if rest:
            self._output_mean = x + (self._output_mean - x) * (1.0 - alpha) ** rest
        self._completions += completions


def _larger(a: TokenDemand, b: TokenDemand) -> TokenDemand:
    return TokenDemand(
        max(a.prefill_tokens_per_s, b.prefill_tokens_per_s),
        max(a.decode_tokens_per_s, b.decode_tokens_per_s),
    )


# -- the controller's policy --------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyConfig:
    """The knobs of ``ForecastPolicy``; docs/operators.md ("Scaling policy knobs") says what
    each trades. The defaults were chosen on the first half hour of bench/autoscale.py.

    ``ttft_objective_s``: the p95 time-to-first-token objective; ``target_utilisation``: scale
    out to keep each replica at most this busy at the forecast demand; ``headroom_sigmas``:
    forecast errors of headroom; ``scale_in_band``: scale in only to a count the demand keeps
    at most this fraction of ``target_utilisation`` busy; ``scale_in_hold_s``: how long demand
    must stay under that band; ``scale_in_ttft_fraction``: scale in only while p95 TTFT is
    under this fraction of the objective; ``kv_high`` / ``waiting_high``: KV use and waiting
    requests per replica that confirm a scale-out the forecast did not ask for;
    ``confirm_cooldown_s``: the least time between two such confirmations;
    ``signal_max_age_s``: load and TTFT samples older than this are ignored;
    ``backlog_drain_s``: a queue still there when a new replica arrives is drained over this
    long (at least the cold start; ``need``)."""

    ttft_objective_s: float = 2.0
    target_utilisation: float = 0.7
    headroom_sigmas: float = 0.5
    scale_in_band: float = 0.95
    scale_in_hold_s: float = 300.0
    scale_in_ttft_fraction: float = 0.5
    kv_high: float = 0.9
    waiting_high: float = 2.0
    confirm_cooldown_s: float = 30.0
    signal_max_age_s: float = 30.0
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    backlog_drain_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("ttft_objective_s", "signal_max_age_s", "waiting_high", "backlog_drain_s"):
            _positive(name, getattr(self, name))
        for name in ("target_utilisation", "kv_high"):
            _fraction(name, getattr(self, name))
        if not 0 < self.scale_in_band < 1:
            raise ConfigError(f"scale_in_band must be in (0, 1), got {self.scale_in_band!r}")
        if not 0 < self.scale_in_ttft_fraction <= 1:
            raise ConfigError(
                f"scale_in_ttft_fraction must be in (0, 1], got {self.scale_in_ttft_fraction!r}"
            )
        for name in ("headroom_sigmas", "scale_in_hold_s", "confirm_cooldown_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be >= 0, got {value!r}")


class ForecastPolicy(_Observer):
    """The controller's policy: token-demand forecast at the cold-start horizon, confirmed by
    load and TTFT, with scale-in hysteresis (module docstring)."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__()
        self.config = config or PolicyConfig()
        self.forecaster = DemandForecaster(self.config.forecast)
        self._load: tuple[float, LoadSample] | None = None
        self._loads: deque[tuple[float, LoadSample]] = deque()  # the last GROWTH_BASE_S of them
        self._ttft: tuple[float, float] | None = None
        self._held: tuple[float, int] | None = None
        self._saturated_since: float | None = None  # every load sample since was saturated
        self._queued_since: float | None = None  # every load sample since had requests waiting
        self._band: deque[tuple[float, int]] = deque()  # (time, need), needs decreasing
        self._band_since = -math.inf  # the window holds needs from here on
        self._first_decision = -math.inf  # the band's evidence starts here (``resume``)
        self._last_out = -math.inf
        self._last_confirm = -math.inf

    def observe_arrival(self, now: float, prompt_tokens: int) -> None:
        self.forecaster.observe_arrival(self._clock(now), prompt_tokens)

    def observe_completion(self, now: float, output_tokens: int) -> None:
        self.forecaster.observe_completion(self._clock(now), output_tokens)

    def observe_load(self, now: float, load: LoadSample) -> None:
        self._load = (self._clock(now), load)
        self._loads.append(self._load)
        # keep one sample at least GROWTH_BASE_S old: the queue's growth is measured from it
        while len(self._loads) > 1 and self._loads[1][0] <= self._load[0] - GROWTH_BASE_S:
            self._loads.popleft()
        if not self._saturated(load):
            self._saturated_since = None
        elif self._saturated_since is None:
            self._saturated_since = self._now
        if not sum(load.waiting):
            self._queued_since = None
        elif self._queued_since is None:
            self._queued_since = self._now

    def observe_ttft(self, now: float, p95_s: float) -> None:
        self._ttft = (self._clock(now), p95_s)

    def observe_held(self, now: float, requests: int) -> None:
        """Requests the ingresses hold for the model, waiting for a replica (their
        ``fabric.wanted`` labels): backlog, as the requests waiting at the replicas are."""
        self._held = (self._clock(now), max(0, requests))

    def _rate_now(self, now: float, forecast_now: float, per_request: float) -> float:
        """The demand now, in fully busy replicas: while the serving replicas have queued
        through the last ``GROWTH_BASE_S`` at least, they are busy and the queue's growth over
        that time is demand on top (a shrinking queue: demand below them); otherwise the
        forecast's level."""
        load = self._fresh_load(now)
        prev = self._loads[0] if self._loads else None
        if load is None or prev is None or not load.kv_usage:
            return forecast_now
        if not all(sum(sample.waiting) for _, sample in self._loads):
            return forecast_now  # a queue that came and went: the replicas had room
        assert self._load is not None
        dt = self._load[0] - prev[0]
        if dt < GROWTH_BASE_S or dt > self.config.signal_max_age_s + GROWTH_BASE_S:
            return forecast_now
        growth = (sum(load.waiting) - sum(prev[1].waiting)) / dt  # requests/s
        return max(0.0, len(load.kv_usage) + growth * per_request)

    def _fresh_load(self, now: float) -> LoadSample | None:
        if self._load is None or now - self._load[0] > self.config.signal_max_age_s:
            return None
        return self._load[1]

    def _fresh_ttft(self, now: float) -> float | None:
        if self._ttft is None or now - self._ttft[0] > self.config.signal_max_age_s:
            return None
        return self._ttft[1]

    def _needs(
        self, now: float, fc: Forecast, state: ReplicaState, load: LoadSample | None
    ) -> tuple[need.Need, need.Need]:
        """What a replica submitted now meets when it arrives (``need``), for scale-out (the
        forecast's upper band) and for the scale-in band (the point forecast, or now when
        higher), with the queue the fresh load shows."""
        cap = state.capacity
        per_request = cap.work(self.forecaster.request())
        fresh = self._held is not None and now - self._held[0] <= self.config.signal_max_age_s
        held = self._held[1] if self._held is not None and fresh else 0
        backlog = per_request * ((sum(load.waiting) if load is not None else 0) + held)
        serving = len(load.kv_usage) if load is not None else state.replicas - state.starting
        rate_now = self._rate_now(now, cap.work(fc.now), per_request)

        def at(rate: TokenDemand) -> need.Need:
            return need.at_arrival(
                rate=cap.work(rate),
                rate_now=rate_now,
                backlog=backlog,
                serving=serving,
                cold_start_s=state.cold_start_s,
                drain_s=self.config.backlog_drain_s,
            )

        out, band = at(fc.upper), at(_larger(fc.now, fc.ahead))
        return out, band

    def _queued_for(self, now: float) -> float:
        """How long every load sample has shown requests waiting (0: none now)."""
        return 0.0 if self._queued_since is None else now - self._queued_since

    def _saturated(self, load: LoadSample) -> bool:
        """Every serving replica has requests waiting or its KV cache full."""
        full = zip(load.waiting, load.kv_usage, strict=True)
        return bool(load.waiting) and all(w > 0 or kv >= self.config.kv_high for w, kv in full)

    def _saturated_need(
        self, now: float, fc: Forecast, state: ReplicaState, load: LoadSample | None
    ) -> int:
        """The need when every serving replica is saturated (requests waiting or its KV cache
        full): each does all it can, so the demand the logs show now (requests count when they
        end) over them is what one sustains; when that is below the capacity held, the need of
        the same arithmetic (``need``) at that capacity, for a demand that stays at least what
        the queue's growth shows now. 0 unless the fleet has been saturated for a forecast bin
        (a burst that has just arrived has not yet shown in the requests ending: the queue's
        backlog sizes it meanwhile)."""
        since = self._saturated_since
        if load is None or since is None or now - since < self.config.forecast.bin_s:
            return 0
        cap = state.capacity
        share = cap.work(fc.now) / len(load.waiting)
        if not 0 < share < 1:
            return 0
        seen = ReplicaCapacity(cap.prefill_tokens_per_s * share, cap.decode_tokens_per_s * share)
        out, _ = self._needs(now, fc, replace(state, capacity=seen), load)
        # the forecast of requests that end cannot see above what the saturated replicas end
        rate_now = self._rate_now(now, seen.work(fc.now), seen.work(self.forecaster.request()))
        steady = need.Need(max(out.rate, rate_now), out.backlog_left, out.drain_s)
        return state.clamp(need.replicas(steady, self.config.target_utilisation))

    def resume(self, since: float) -> None:
        """Count the scale-in hold from ``since`` rather than from the first decision: a
        controller that takes over passes the last scale-out as Slurm shows it (the newest job
        it started for demand). Only before the first decision. The window is full only once
        needs were seen for the whole hold as well: from the first decision, which a scaler
        that replays the request logs' history (``follow``) makes in the past, so a takeover
        keeps the hold it can show evidence for, and restarts it otherwise."""
        if self._band_since == -math.inf and math.isfinite(since):
            self._band_since = since
            self._last_out = max(self._last_out, since)

    def _remember(self, now: float, need: int) -> int:
        """Note the band need; return the largest over the hold window."""
        band = self._band
        while band and band[-1][1] <= need:
            band.pop()
        band.append((now, need))
        while band[0][0] < now - self.config.scale_in_hold_s:
            band.popleft()
        return band[0][1]

    def _scaled_out(self, now: float) -> None:
        self._last_out = now
        self._band.clear()
        self._band_since = now

    def desired_replicas(self, now: float, state: ReplicaState) -> Decision:
        now = self._clock(now)
        cfg = self.config
        cur = state.replicas
        fc = self.forecaster.forecast(now, state.cold_start_s, cfg.headroom_sigmas)
        cap = state.capacity
        load = self._fresh_load(now)
        ttft = self._fresh_ttft(now)
        out, band = self._needs(now, fc, state, load)
        out_need = state.clamp(need.replicas(out, cfg.target_utilisation))
        band_need = need.replicas(band, cfg.scale_in_band * cfg.target_utilisation)
        # never in below what scale-out asks for now: the two rules cannot alternate
        held = max(out_need, self._remember(now, state.clamp(band_need)))

        if self._band_since == -math.inf:
            self._band_since = now  # the hold window starts with the first decision (``resume``)
        if self._first_decision == -math.inf:
            self._first_decision = now
        if cur != state.clamp(cur):
            target = max(out_need, state.min_replicas) if cur < state.min_replicas else out_need
            target = state.clamp(max(target, state.clamp(cur)))
            if target > cur:
                self._scaled_out(now)
            return Decision(target, "bounds")
        saturated = self._saturated_need(now, fc, state, load)
        if max(out_need, saturated) > cur:
            self._scaled_out(now)
            if saturated > out_need:  # the capacity held is more than the replicas do
                return Decision(saturated, "load")
            by_rate = state.clamp(replicas_for(fc.upper, cap, cfg.target_utilisation))
            return Decision(out_need, "backlog" if out_need > by_rate else "forecast")

        cooled = now - max(self._last_confirm, self._last_out) >= cfg.confirm_cooldown_s
        if state.starting == 0 and cur < state.max_replicas and cooled:
            reason = ""
            if ttft is not None and ttft > cfg.ttft_objective_s and out.backlog_left > 0:
                # late first tokens of a queue the serving replicas drain before a new one
                # could arrive (a burst shorter than the cold start) are no reason either
                reason = "objective"
            elif load is not None and (
                load.mean_kv_usage >= cfg.kv_high
                or (
                    load.waiting_per_replica >= cfg.waiting_high
                    and out.backlog_left > 0
                    and self._queued_for(now) >= cfg.forecast.bin_s
                )
            ):
                # a queue the serving replicas drain before a new one could arrive is no
                # reason to start one (``need``); nor is one younger than a forecast bin: the
                # need at the capacity the saturated replicas show sizes it then, at once
                reason = "load"
            if reason:
                self._last_confirm = now
                self._scaled_out(now)
                return Decision(cur + 1, reason)

        # full: no scale-out for the hold, and needs seen for all of it (a controller that took
        # over has seen them only from its first decision, or the replayed history's)
        window_full = now - max(self._band_since, self._first_decision) >= cfg.scale_in_hold_s
        if held < cur and window_full and state.starting == 0:
            calm = (ttft is None or ttft <= cfg.scale_in_ttft_fraction * cfg.ttft_objective_s) and (
                load is None
                or (load.mean_kv_usage < cfg.kv_high and load.waiting_per_replica < 1.0)
            )
            if calm:
                return Decision(held, "low-demand")
        return Decision(cur)

    def observe_arrivals(self, now: float, requests: int, prompt_tokens: int) -> None:
        """Several arrivals at once (``DemandForecaster.observe_arrivals``)."""
        self.forecaster.observe_arrivals(self._clock(now), requests, prompt_tokens)

    def observe_completions(self, now: float, completions: int, output_tokens: int) -> None:
        """Several completions at once (``DemandForecaster.observe_completions``)."""
        self.forecaster.observe_completions(self._clock(now), completions, output_tokens)


# -- the baselines ------------------------------------------------------------------------------


class StaticPolicy(_Observer):
    """A fixed count (provisioned for the peak), clamped to the bounds."""

    def __init__(self, replicas: int) -> None:
        super().__init__()
        if replicas < 0:
            raise ConfigError(f"replicas must be >= 0, got {replicas}")
        self.replicas = replicas

    def desired_replicas(self, now: float, state: ReplicaState) -> Decision:
        self._clock(now)
        target = state.clamp(self.replicas)
        return Decision(target, "static" if target != state.replicas else "")


@dataclass(frozen=True)
class ReactiveConfig:
    """SageServe's reactive baseline: one replica out above ``scale_out_kv`` mean KV use, one
    in below ``scale_in_kv``, and ``cooldown_s`` between any two scaling events."""

    scale_out_kv: float = 0.7
    scale_in_kv: float = 0.3
    cooldown_s: float = 15.0

    def __post_init__(self) -> None:
        if not 0 <= self.scale_in_kv < self.scale_out_kv <= 1:
            raise ConfigError("need 0 <= scale_in_kv < scale_out_kv <= 1")
        if not (self.cooldown_s >= 0 and math.isfinite(self.cooldown_s)):
            raise ConfigError(f"cooldown_s must be >= 0, got {self.cooldown_s!r}")


class ReactivePolicy(_Observer):
    """Scale on the serving replicas' mean KV-cache use alone (SageServe §4's baseline)."""

    def __init__(self, config: ReactiveConfig | None = None) -> None:
        super().__init__()
        self.config = config or ReactiveConfig()
        self._load: tuple[float, LoadSample] | None = None
        self._last_event = -math.inf

    def observe_load(self, now: float, load: LoadSample) -> None:
        self._load = (self._clock(now), load)

    def desired_replicas(self, now: float, state: ReplicaState) -> Decision:
        now = self._clock(now)
        cur = state.replicas
        if cur != state.clamp(cur):
            self._last_event = now
            return Decision(state.clamp(cur), "bounds")
        if self._load is None or not self._load[1].kv_usage:
            return Decision(cur)
        if now - self._last_event < self.config.cooldown_s:
            return Decision(cur)
        usage = self._load[1].mean_kv_usage
        target, reason = cur, ""
        if usage > self.config.scale_out_kv:
            target, reason = state.clamp(cur + 1), "load"
        elif usage < self.config.scale_in_kv:
            target, reason = state.clamp(cur - 1), "low-load"
        if target == cur:
            return Decision(cur)
        self._last_event = now
        return Decision(target, reason)
