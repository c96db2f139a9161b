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
5. A key may be limited to sites (``sites``: data residency, ``residency``): its requests are
   served only by nodes of those sites. A file holding such a key is written as version 2
   (``SITES_FILE_VERSION``), which agents that predate residency refuse as a whole, keeping
   the keys they last loaded: such an agent never serves a site-limited key it could not
   limit (the key is unknown to it: 401). A version 1 file may not hold ``sites``.
6. A key has a ``weight`` (a number > 0, default 1): its share of the batch tier when several
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

The key record, its validation, the bearer-token parser and the ``RateLimiter`` live in the
pure ``keytable`` (the request decoder uses them without this file store) and are re-exported
here; ``ApiKeyStore`` is the ``keytable.KeyTable`` the ingress hands the decoder.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from fabricnode.dataplane.keytable import DEFAULT_WEIGHT as DEFAULT_WEIGHT
from fabricnode.dataplane.keytable import KEY_ID_HEX
from fabricnode.dataplane.keytable import MAX_NAME_CHARS as MAX_NAME_CHARS
from fabricnode.dataplane.keytable import MAX_WEIGHT as MAX_WEIGHT
from fabricnode.dataplane.keytable import ApiKey as ApiKey
from fabricnode.dataplane.keytable import RateLimit as RateLimit
from fabricnode.dataplane.keytable import RateLimiter as RateLimiter
from fabricnode.dataplane.keytable import RateLimiterStats as RateLimiterStats
from fabricnode.dataplane.keytable import bearer_token as bearer_token
from fabricnode.dataplane.keytable import check_key_name as check_key_name
from fabricnode.dataplane.keytable import check_weight as check_weight
from fabricnode.dataplane.residency import check_sites
from fabricnode.errors import ConfigError, KeyFileError
from fabricnode.mesh.identity import write_private
from fabricnode.mesh.keyring import file_signature

FILE_FORMAT = "fabric-api-keys"
FILE_VERSION = 1
SITES_FILE_VERSION = 2  # a file with a site-limited key (rule 5)
TOKEN_PREFIX = "fab-"
SECRET_BYTES = 32
SECRET_CHARS = 43  # unpadded urlsafe base64 of 32 bytes
TOKEN_CHARS = len(TOKEN_PREFIX) + KEY_ID_HEX + 1 + SECRET_CHARS
KEY_ID_DOMAIN = b"fabric/api-key-id/v1\0"

_SECRET_START = len(TOKEN_PREFIX) + KEY_ID_HEX + 1
_KEY_ID_RE = re.compile(r"[0-9a-f]{8}")
# Compared against when the key id is unknown, so that path costs the same as a wrong secret.
_NO_SUCH_KEY = hashlib.sha256(b"fabric: no such key").digest()


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
        version = doc.get("version")
        if version not in (FILE_VERSION, SITES_FILE_VERSION) or isinstance(version, bool):
            raise ValueError(f"unsupported version {version!r}")
        records = doc.get("keys")
        if not isinstance(records, list):
            raise ValueError('"keys" must be a list')
        keys: dict[str, ApiKey] = {}
        for record in records:
            key = ApiKey.from_record(record)
            if key.key_id in keys:
                raise ValueError(f"key id {key.key_id} appears twice")
            if key.sites is not None and version == FILE_VERSION:
                raise ValueError(
                    f"key {key.key_id} has sites: a file with site-limited keys is version "
                    f"{SITES_FILE_VERSION}"
                )
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
        sites: Iterable[str] | None = None,
        now: float | None = None,
    ) -> tuple[str, ApiKey]:
        """Create a key and save the file; returns (token, record). The token exists only here.
        ``sites``: the only sites that may serve its requests (None: any)."""
        check_key_name(name)
        weight = check_weight(weight)
        limited: frozenset[str] | None = None
        if sites is not None:
            try:
                limited = check_sites([s.strip() for s in sites], "the key's sites")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
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
            sites=limited,
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
        keys = self.list()
        limited = any(k.sites is not None for k in keys)
        doc = {
            "format": FILE_FORMAT,
            "version": SITES_FILE_VERSION if limited else FILE_VERSION,
            "keys": [k.to_record() for k in keys],
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
