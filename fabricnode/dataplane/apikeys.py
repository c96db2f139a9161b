"""API keys for the ingress: who may send requests, to which providers, and how fast.

Rules
-----
1. A token is ``fab-<key id>-<secret>``: the key id is 8 hex digits, the secret 32 random bytes
   in unpadded urlsafe base64 (43 characters). The key id is public (it names the key in logs
   and in ``fabric keys api-list``); only the secret authenticates.
2. The keys file (JSON, mode 0600, default ``$FABRIC_HOME/api-keys.json``) holds one record per
   key with the SHA-256 of its secret, never the secret itself: a leaked file does not let
   anyone in, and the token is shown exactly once, by ``fabric keys api-new``.
3. No keys file means the ingress runs open (no auth), which is what a single researcher on
   their own allocation wants. Once a file exists, auth is on, even if every key in it is
   revoked, and it stays on while the agent runs: a keys file that disappears (or is edited
   into something unreadable) keeps the keys last loaded, because a typo or a deleted file
   must never open the ingress to everyone. Restart the agent to go back to an open ingress.
   For the same reason an agent refuses to start on a malformed file, and an open agent that
   sees a malformed file appear turns auth on with no key (nobody gets in until it is fixed).
4. A key may restrict which providers serve its requests (names or verified provider-key
   fingerprints) and carry a token-bucket rate limit (requests per second and a burst).
5. A key has a ``weight`` (a number > 0, default 1): its share of the batch tier when several
   keys' batch requests wait at an ingress (``tiers``: a key of weight 2 is released twice as
   often as one of weight 1 while both have requests waiting).

Theory of operation
-------------------
``ApiKeyStore.lookup`` is on the request hot path: split the token at fixed offsets, one dict
lookup by key id, one SHA-256 of 43 bytes and one ``hmac.compare_digest`` (constant time, so
response timing does not reveal how much of a guessed hash matched) -- a couple of
microseconds. Unknown key ids still pay the hash and the compare. The agent calls
``maybe_reload`` every second; it costs one ``stat`` unless the file changed, and a reload swaps
the lookup table in one assignment, so a concurrent lookup sees either the old or the new keys.

``RateLimiter`` is pure: callers pass ``now`` (a monotonic clock), as everywhere in the core.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fabricnode.errors import ConfigError, KeyFileError
from fabricnode.mesh.identity import write_private
from fabricnode.mesh.keyring import file_signature

FILE_FORMAT = "fabric-api-keys"
FILE_VERSION = 1
TOKEN_PREFIX = "fab-"
KEY_ID_HEX = 8
SECRET_BYTES = 32
SECRET_CHARS = 43  # unpadded urlsafe base64 of 32 bytes
TOKEN_CHARS = len(TOKEN_PREFIX) + KEY_ID_HEX + 1 + SECRET_CHARS
MAX_NAME_CHARS = 64
DEFAULT_WEIGHT = 1.0
MAX_WEIGHT = 1_000_000.0
KEY_ID_DOMAIN = b"fabric/api-key-id/v1\0"

_SECRET_START = len(TOKEN_PREFIX) + KEY_ID_HEX + 1
_KEY_ID_RE = re.compile(r"[0-9a-f]{8}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# Compared against when the key id is unknown, so that path costs the same as a wrong secret.
_NO_SUCH_KEY = hashlib.sha256(b"fabric: no such key").digest()


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
        }

    def to_record(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "name": self.name,
            "secret_sha256": self.secret_sha256.hex(),
            "created_at": self.created_at,
            "providers": list(self.providers) if self.providers is not None else None,
            "rate_per_s": self.rate.rate_per_s if self.rate else None,
            "burst": self.rate.burst if self.rate else None,
            "disabled": self.disabled,
            "revoked_at": self.revoked_at,
            "admin": self.admin,
            "weight": self.weight,
        }

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
        )


@dataclass(frozen=True)
class ApiKeyStoreStats:
    enabled: bool
    keys: int
    active_keys: int
    reloads: int
    reload_errors: int
    last_error: str
    lookups_ok: int
    lookups_failed: int


def _hash_secret(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("ascii")).digest()


def _key_id_for(secret: str) -> str:
    return hashlib.sha256(KEY_ID_DOMAIN + secret.encode("ascii")).hexdigest()[:KEY_ID_HEX]


def _parse_file(text: str, source: str) -> dict[str, ApiKey]:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise KeyFileError(f"{source} is not a valid fabric API keys file: not JSON") from exc
    try:
        if not isinstance(doc, dict) or doc.get("format") != FILE_FORMAT:
            raise ValueError(f'"format" is not "{FILE_FORMAT}"')
        if doc.get("version") != FILE_VERSION:
            raise ValueError(f"unsupported version {doc.get('version')!r}")
        records = doc.get("keys")
        if not isinstance(records, list):
            raise ValueError('"keys" must be a list')
        keys: dict[str, ApiKey] = {}
        for record in records:
            key = ApiKey.from_record(record)
            if key.key_id in keys:
                raise ValueError(f"key id {key.key_id} appears twice")
            keys[key.key_id] = key
    except ValueError as exc:
        raise KeyFileError(f"{source} is not a valid fabric API keys file: {exc}") from None
    return keys


def _read_file(path: Path) -> dict[str, ApiKey] | None:
    """The keys in ``path``; None when there is no file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise KeyFileError(f"cannot read API keys file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise KeyFileError(f"{path} is not a valid fabric API keys file: not UTF-8") from exc
    return _parse_file(text, str(path))


class ApiKeyStore:
    """The API keys of one keys file: hot-path lookup, live reload, and management."""

    def __init__(self, path: Path, keys: Iterable[ApiKey] = (), *, enabled: bool = False) -> None:
        self.path = path
        self._by_id: dict[str, ApiKey] = {k.key_id: k for k in keys}
        self._enabled = enabled or bool(self._by_id)
        self._signature: tuple[int, int] | None = None
        self._reloads = 0
        self._reload_errors = 0
        self._last_error = ""
        self._lookups_ok = 0
        self._lookups_failed = 0

    @classmethod
    def load(cls, path: Path) -> ApiKeyStore:
        """Read ``path``; a missing file gives an empty store that is not ``enabled``.

        Raises KeyFileError (one line, naming the file and the problem) if it is unreadable or
        malformed: an agent must not start open because its keys file has a typo.
        """
        signature = file_signature(path)
        keys = _read_file(path)
        store = cls(path, keys.values() if keys else (), enabled=keys is not None)
        store._signature = signature
        return store

    @property
    def enabled(self) -> bool:
        """Is auth on? False only while no keys file has ever been loaded."""
        return self._enabled

    # -- hot path ---------------------------------------------------------------------------

    def lookup(self, token: str) -> ApiKey | None:
        """The active key a bearer token authenticates, else None (bad, unknown or revoked)."""
        if (
            len(token) != TOKEN_CHARS
            or not token.startswith(TOKEN_PREFIX)
            or token[_SECRET_START - 1] != "-"
            or not token.isascii()
        ):
            self._lookups_failed += 1
            return None
        key = self._by_id.get(token[len(TOKEN_PREFIX) : _SECRET_START - 1])
        digest = hashlib.sha256(token[_SECRET_START:].encode("ascii")).digest()
        expected = key.secret_sha256 if key is not None else _NO_SUCH_KEY
        if not hmac.compare_digest(expected, digest) or key is None or key.disabled:
            self._lookups_failed += 1
            return None
        self._lookups_ok += 1
        return key

    # -- live reload ------------------------------------------------------------------------

    def maybe_reload(self) -> bool:
        """Re-read the file if it changed since last read; True if new keys were adopted.

        A file that became unreadable, malformed or absent keeps the keys we have (counted in
        ``statistics().reload_errors``, described in ``last_error``), and never turns auth off;
        the next change of the file is tried again. Sync and small: the agent may call it from
        a worker thread.
        """
        signature = file_signature(self.path)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            keys = _read_file(self.path)
        except KeyFileError as exc:
            self._reload_errors += 1
            self._last_error = str(exc)
            # Someone meant to turn auth on: with no readable key, nobody gets in.
            self._enabled = True
            return False
        if keys is None:
            if self._enabled:
                self._reload_errors += 1
                self._last_error = (
                    f"API keys file {self.path} disappeared; keeping the keys last loaded "
                    "(restart the agent to run without auth)"
                )
            return False
        self._by_id = keys
        self._enabled = True
        self._reloads += 1
        self._last_error = ""
        return True

    # -- management (the CLI) ---------------------------------------------------------------

    def list(self) -> list[ApiKey]:
        """All keys, revoked ones included, oldest first."""
        return sorted(self._by_id.values(), key=lambda k: (k.created_at, k.key_id))

    def get(self, key_id: str) -> ApiKey | None:
        return self._by_id.get(key_id)

    def new_key(
        self,
        name: str,
        providers: Iterable[str] | None = None,
        rate_per_s: float | None = None,
        burst: int | None = None,
        *,
        admin: bool = False,
        weight: float = DEFAULT_WEIGHT,
        now: float | None = None,
    ) -> tuple[str, ApiKey]:
        """Create a key and save the file; returns (token, record). The token exists only here."""
        check_key_name(name)
        weight = check_weight(weight)
        if _KEY_ID_RE.fullmatch(name):
            raise ConfigError(f"API key name {name!r} looks like a key id; choose another")
        allow: tuple[str, ...] | None = None
        if providers is not None:
            allow = tuple(dict.fromkeys(p.strip() for p in providers if p.strip()))
            if not allow:
                raise ConfigError("the provider allowlist is empty (omit it to allow any)")
        rate: RateLimit | None = None
        if rate_per_s is not None:
            rate = RateLimit.of(rate_per_s, burst)
        elif burst is not None:
            raise ConfigError("a burst needs a rate (requests per second)")
        while True:
            secret = base64.urlsafe_b64encode(secrets.token_bytes(SECRET_BYTES)).decode()
            secret = secret.rstrip("=")
            key_id = _key_id_for(secret)
            if key_id not in self._by_id:
                break
        key = ApiKey(
            key_id=key_id,
            name=name,
            secret_sha256=_hash_secret(secret),
            created_at=round(time.time() if now is None else now, 3),
            providers=allow,
            rate=rate,
            admin=admin,
            weight=weight,
        )
        self._by_id = {**self._by_id, key_id: key}
        self._enabled = True
        self.save()
        return f"{TOKEN_PREFIX}{key_id}-{secret}", key

    def revoke(self, key_id_or_name: str, *, now: float | None = None) -> tuple[ApiKey, bool]:
        """Disable a key by id, or by owner name if that names one active key; saves the file.

        Returns (record, changed): revoking a revoked key (or a name whose keys are all
        revoked) changes nothing. The record stays in
        the file (marked ``disabled`` with ``revoked_at``) so ``api-list`` still explains it.
        """
        key = self._by_id.get(key_id_or_name)
        if key is None:
            every = [k for k in self.list() if k.name == key_id_or_name]
            if not every:
                raise KeyFileError(
                    f"no API key with id or name {key_id_or_name!r} in {self.path} "
                    "(see `fabric keys api-list`)"
                )
            named = [k for k in every if not k.disabled]
            if not named:
                return every[-1], False
            if len(named) > 1:
                ids = ", ".join(k.key_id for k in named)
                raise KeyFileError(
                    f"{key_id_or_name!r} has {len(named)} active keys ({ids}); revoke by key id"
                )
            key = named[0]
        if key.disabled:
            return key, False
        revoked = replace(
            key, disabled=True, revoked_at=round(time.time() if now is None else now, 3)
        )
        self._by_id = {**self._by_id, key.key_id: revoked}
        self.save()
        return revoked, True

    def to_json(self) -> str:
        doc = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "keys": [k.to_record() for k in self.list()],
        }
        return json.dumps(doc, indent=2) + "\n"

    def save(self) -> None:
        """Write the file atomically (temp file + rename), readable by its owner only."""
        write_private(self.path, self.to_json().encode())
        self._signature = file_signature(self.path)
        self._enabled = True

    def statistics(self) -> ApiKeyStoreStats:
        keys = self._by_id
        return ApiKeyStoreStats(
            enabled=self._enabled,
            keys=len(keys),
            active_keys=sum(1 for k in keys.values() if not k.disabled),
            reloads=self._reloads,
            reload_errors=self._reload_errors,
            last_error=self._last_error,
            lookups_ok=self._lookups_ok,
            lookups_failed=self._lookups_failed,
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
