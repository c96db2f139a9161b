"""What the ingress knows of an API key on the request path, without the keys file: pure.

``apikeys`` owns the keys file (reading, reloading, writing, looking a token up in it); this
module holds what the pure request decoder (``request``) and the batch tier (``tiers``) use of
it, so that they do not import the file store: the key record ``ApiKey`` and its validation,
the ``Authorization: Bearer`` parser, the ``KeyTable`` protocol the store implements (what a
decoder may ask of the keys: on or off, a token's key, a key id's key) and the ``RateLimiter``.

Pure: no I/O, no clock reads, no trio; the rate limiter takes ``now``. The rules of keys and
tokens are in ``apikeys``' docstring.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from fabricnode.dataplane.residency import check_sites
from fabricnode.errors import ConfigError

KEY_ID_HEX = 8
MAX_NAME_CHARS = 64
DEFAULT_WEIGHT = 1.0
MAX_WEIGHT = 1_000_000.0

_KEY_ID_RE = re.compile(r"[0-9a-f]{8}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class KeyTable(Protocol):
    """The API keys as the pure decoders see them (``apikeys.ApiKeyStore`` is one)."""

    @property
    def enabled(self) -> bool:
        """Auth is on: every request must name an active key."""
        ...

    def lookup(self, token: str) -> ApiKey | None:
        """The active key a token authenticates, else None."""
        ...

    def get(self, key_id: str) -> ApiKey | None:
        """The key of this id (active or not), else None."""
        ...


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header value, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = token.strip()
    return token or None


def check_key_name(name: str) -> str:
    """A key's owner name ends up in logs and metric labels: short, printable, one line."""
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable() or name != name.strip():
        raise ConfigError(
            f"API key name {name!r}: use 1-{MAX_NAME_CHARS} printable characters, "
            "no leading or trailing spaces"
        )
    return name


def check_weight(weight: object) -> float:
    """A key's batch-tier weight: a number > 0 (at most a million); ConfigError otherwise."""
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not math.isfinite(weight)
        or not 0 < weight <= MAX_WEIGHT
    ):
        raise ConfigError(
            f"weight {weight!r}: must be a number > 0 (the key's share of the batch tier; "
            f"default {DEFAULT_WEIGHT:g}, at most {MAX_WEIGHT:g})"
        )
    return float(weight)


@dataclass(frozen=True, slots=True)
class RateLimit:
    """Token bucket: ``rate_per_s`` requests per second on average, at most ``burst`` at once."""

    rate_per_s: float
    burst: int

    @classmethod
    def of(cls, rate_per_s: float, burst: int | None = None) -> RateLimit:
        """Validated limit; ``burst`` defaults to one second's worth (at least 1)."""
        if not (isinstance(rate_per_s, int | float) and math.isfinite(rate_per_s)):
            raise ConfigError(f"rate {rate_per_s!r}: must be a positive number of requests/s")
        if rate_per_s <= 0:
            raise ConfigError(f"rate {rate_per_s!r}: must be a positive number of requests/s")
        if burst is None:
            burst = max(1, math.ceil(rate_per_s))
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ConfigError(f"burst {burst!r}: must be a whole number of requests >= 1")
        return cls(float(rate_per_s), burst)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key record as stored in the keys file (the secret's hash, never the secret)."""

    key_id: str
    name: str
    secret_sha256: bytes
    created_at: float
    providers: tuple[str, ...] | None = None  # None: any provider may serve
    rate: RateLimit | None = None
    disabled: bool = False
    revoked_at: float | None = None
    # May read the agent's registry views and /metrics (engine addresses, every node) when
    # keys are on; an ordinary key reaches only the OpenAI endpoints.
    admin: bool = False
    # Its share of the batch tier against other keys' waiting batch requests (``tiers``).
    weight: float = DEFAULT_WEIGHT
    # Data residency (``residency``): the sites that may serve its requests; None: any site.
    sites: frozenset[str] | None = None
    _provider_set: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_provider_set", frozenset(self.providers or ()))

    def allows_provider(self, provider: str, fingerprint: str | None = None) -> bool:
        """May a node of ``provider`` (with this verified provider-key fingerprint) serve?

        Provider names are free text any node can claim; list fingerprints (``fabric keys
        new-provider`` prints them) where the allowlist is a trust boundary.
        """
        if self.providers is None:
            return True
        allowed = self._provider_set
        return provider in allowed or (fingerprint is not None and fingerprint in allowed)

    def public(self) -> dict[str, Any]:
        """Everything about the key that may be shown: no hash, no secret."""
        return {
            "key_id": self.key_id,
            "name": self.name,
            "created_at": self.created_at,
            "providers": list(self.providers) if self.providers is not None else None,
            "rate_per_s": self.rate.rate_per_s if self.rate else None,
            "burst": self.rate.burst if self.rate else None,
            "disabled": self.disabled,
            "revoked_at": self.revoked_at,
            "admin": self.admin,
            "weight": self.weight,
            "sites": sorted(self.sites) if self.sites is not None else None,
        }

    def to_record(self) -> dict[str, Any]:
        """The key as the keys file stores it: ``public()`` and the secret's hash, which the
        file keeps third (after ``key_id`` and ``name``)."""
        shown = list(self.public().items())
        return dict([*shown[:2], ("secret_sha256", self.secret_sha256.hex()), *shown[2:]])

    @classmethod
    def from_record(cls, doc: Any) -> ApiKey:
        """Parse and validate one record; ValueError names the bad field."""
        if not isinstance(doc, dict):
            raise ValueError("a key record must be an object")
        key_id = doc.get("key_id")
        if not isinstance(key_id, str) or not _KEY_ID_RE.fullmatch(key_id):
            raise ValueError(f"key_id {key_id!r} is not {KEY_ID_HEX} lowercase hex digits")
        name = doc.get("name")
        if not isinstance(name, str):
            raise ValueError(f"key {key_id}: name must be a string")
        try:
            check_key_name(name)
        except ConfigError as exc:
            raise ValueError(f"key {key_id}: {exc}") from None
        digest = doc.get("secret_sha256")
        if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
            raise ValueError(f"key {key_id}: secret_sha256 must be 64 lowercase hex digits")
        created_at = doc.get("created_at", 0.0)
        if isinstance(created_at, bool) or not isinstance(created_at, int | float):
            raise ValueError(f"key {key_id}: created_at must be Unix seconds")
        providers = doc.get("providers")
        if providers is not None and (
            not isinstance(providers, list) or not all(isinstance(p, str) and p for p in providers)
        ):
            raise ValueError(f"key {key_id}: providers must be a list of names or null")
        rate_per_s, burst = doc.get("rate_per_s"), doc.get("burst")
        rate: RateLimit | None = None
        if rate_per_s is not None:
            if isinstance(rate_per_s, bool) or not isinstance(rate_per_s, int | float):
                raise ValueError(f"key {key_id}: rate_per_s must be a number")
            try:
                rate = RateLimit.of(rate_per_s, burst)
            except ConfigError as exc:
                raise ValueError(f"key {key_id}: {exc}") from None
        elif burst is not None:
            raise ValueError(f"key {key_id}: burst without rate_per_s")
        disabled = doc.get("disabled", False)
        if not isinstance(disabled, bool):
            raise ValueError(f"key {key_id}: disabled must be true or false")
        admin = doc.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"key {key_id}: admin must be true or false")
        revoked_at = doc.get("revoked_at")
        if revoked_at is not None and (
            isinstance(revoked_at, bool) or not isinstance(revoked_at, int | float)
        ):
            raise ValueError(f"key {key_id}: revoked_at must be Unix seconds or null")
        try:
            weight = check_weight(doc.get("weight", DEFAULT_WEIGHT))
        except ConfigError as exc:
            raise ValueError(f"key {key_id}: {exc}") from None
        sites = doc.get("sites")
        if sites is not None:
            if not isinstance(sites, list) or not all(isinstance(s, str) for s in sites):
                raise ValueError(f"key {key_id}: sites must be a list of site names or null")
            sites = check_sites(sites, f"key {key_id}: sites")
        return cls(
            key_id=key_id,
            name=name,
            secret_sha256=bytes.fromhex(digest),
            created_at=float(created_at),
            providers=tuple(providers) if providers is not None else None,
            rate=rate,
            disabled=disabled,
            revoked_at=float(revoked_at) if revoked_at is not None else None,
            admin=admin,
            weight=weight,
            sites=sites,
        )


# -- rate limiting ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RateLimiterStats:
    buckets: int
    allowed: int
    limited: int
    evicted: int


class RateLimiter:
    """Token buckets per key id, in bounded memory.

    A bucket holds ``[tokens, last_seen, rate_per_s, burst]``. A new or forgotten key starts
    with a full bucket, so forgetting a bucket that has refilled (idle for ``burst / rate``)
    changes nothing; those are dropped first. Only when more than ``max_keys`` keys are busy at
    once are the least recently seen of them forgotten early (counted in ``evicted``), which
    can grant those keys one extra burst -- the price of a memory bound.
    """

    def __init__(self, max_keys: int = 10_000) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()
        self._allowed = 0
        self._limited = 0
        self._evicted = 0

    def check(self, key_id: str, rate_per_s: float, burst: int, now: float) -> float:
        """0.0 if a request may go now (and takes a token), else seconds until one may.

        ``now`` is a monotonic clock in seconds; ``rate_per_s`` must be positive.
        """
        if rate_per_s <= 0:
            raise ValueError("rate_per_s must be positive")
        cap = float(max(1, burst))
        bucket = self._buckets.get(key_id)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._make_room(now)
            bucket = [cap, now, rate_per_s, cap]
            self._buckets[key_id] = bucket
            tokens = cap
        else:
            self._buckets.move_to_end(key_id)
            elapsed = now - bucket[1]
            tokens = bucket[0] + elapsed * rate_per_s if elapsed > 0 else bucket[0]
            tokens = min(cap, tokens)
            if elapsed > 0:
                bucket[1] = now
            bucket[2], bucket[3] = rate_per_s, cap
        if tokens >= 1.0:
            bucket[0] = tokens - 1.0
            self._allowed += 1
            return 0.0
        bucket[0] = tokens
        self._limited += 1
        return (1.0 - tokens) / rate_per_s

    def _make_room(self, now: float) -> None:
        # Forget every refilled bucket, then (if that was not enough) the least recently seen,
        # down to a low-water mark so the O(n) sweep runs once per max_keys // 10 new keys.
        for key_id, (tokens, last, rate, cap) in list(self._buckets.items()):
            if tokens + max(0.0, now - last) * rate >= cap:
                del self._buckets[key_id]
        low_water = self.max_keys - max(1, self.max_keys // 10)
        while len(self._buckets) > low_water:
            self._buckets.popitem(last=False)
            self._evicted += 1

    def statistics(self) -> RateLimiterStats:
        return RateLimiterStats(
            buckets=len(self._buckets),
            allowed=self._allowed,
            limited=self._limited,
            evicted=self._evicted,
        )
