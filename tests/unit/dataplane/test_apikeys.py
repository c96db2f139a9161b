"""Ingress API keys: token lookup, the hashed keys file, live reload, and rate limiting."""

from __future__ import annotations

import hmac
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from fabricnode.dataplane.apikeys import (
    TOKEN_CHARS,
    ApiKeyStore,
    RateLimiter,
    bearer_token,
)
from fabricnode.errors import ConfigError, KeyFileError


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "home" / "api-keys.json"


def bump_mtime(path: Path, seconds: int = 10) -> None:
    """Make an edit visible to ``file_signature`` whatever the filesystem's mtime granularity."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 1_000_000_000))


# -- lookup -----------------------------------------------------------------------------------


def test_good_token_finds_its_key(path: Path) -> None:
    store = ApiKeyStore.load(path)
    token, key = store.new_key("alice", now=1000.0)
    assert len(token) == TOKEN_CHARS and token.startswith(f"fab-{key.key_id}-")
    assert store.lookup(token) == key
    assert key.name == "alice" and key.created_at == 1000.0
    reloaded = ApiKeyStore.load(path)
    assert reloaded.lookup(token) == key


def test_wrong_secret_and_unknown_key_id_are_rejected(path: Path) -> None:
    store = ApiKeyStore.load(path)
    token, key = store.new_key("alice")
    last = "A" if token[-1] != "A" else "B"
    assert store.lookup(token[:-1] + last) is None
    other_id = "00000000" if key.key_id != "00000000" else "11111111"
    assert store.lookup(token.replace(key.key_id, other_id)) is None
    other_token, _ = ApiKeyStore(path.with_name("other.json")).new_key("alice")
    assert store.lookup(other_token) is None
    stats = store.statistics()
    assert (stats.lookups_ok, stats.lookups_failed) == (0, 3)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda t: "",
        lambda t: t[:-1],
        lambda t: t + "A",
        lambda t: "xyz" + t[3:],
        lambda t: t[:12] + "_" + t[13:],
        lambda t: t[:-1] + "é",
        lambda t: t.upper(),
        lambda t: "Bearer " + t,
        lambda t: t * 1000,
    ],
    ids=["empty", "short", "long", "prefix", "separator", "non-ascii", "case", "scheme", "huge"],
)
def test_malformed_tokens_are_rejected(path: Path, mangle: Callable[[str], str]) -> None:
    store = ApiKeyStore.load(path)
    token, _ = store.new_key("alice")
    assert store.lookup(mangle(token)) is None


def test_revoked_key_no_longer_authenticates(path: Path) -> None:
    store = ApiKeyStore.load(path)
    token, key = store.new_key("alice")
    revoked, changed = store.revoke(key.key_id, now=2000.0)
    assert changed and revoked.disabled and revoked.revoked_at == 2000.0
    assert store.lookup(token) is None
    assert ApiKeyStore.load(path).lookup(token) is None
    again, changed = store.revoke(key.key_id)
    assert not changed and again == revoked


def test_lookup_compares_hashes_in_constant_time(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ApiKeyStore.load(path)
    token, key = store.new_key("alice")
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # apikeys calls hmac.compare_digest
    assert store.lookup(token) == key
    assert calls[-1][0] == key.secret_sha256
    unknown_id = "0" * 8 if key.key_id != "0" * 8 else "1" * 8
    assert store.lookup(f"fab-{unknown_id}{token[12:]}") is None
    assert store.lookup(token[:-1] + ("A" if token[-1] != "A" else "B")) is None
    assert len(calls) == 3, "unknown key ids pay the same compare as wrong secrets"


def test_bearer_token_parses_the_authorization_header() -> None:
    assert bearer_token("Bearer fab-x") == "fab-x"
    assert bearer_token("bearer   fab-x ") == "fab-x"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer") is None
    assert bearer_token(None) is None


# -- the keys file ----------------------------------------------------------------------------


def test_keys_file_never_contains_the_secret_and_is_private(path: Path) -> None:
    store = ApiKeyStore.load(path)
    tokens = [store.new_key(f"user{i}", ["alice"], 5.0, 10)[0] for i in range(3)]
    text = path.read_text()
    for token in tokens:
        assert token[13:] not in text, "the secret part of a token is never stored"
    doc = json.loads(text)
    assert doc["format"] == "fabric-api-keys"
    assert {"secret_sha256", "key_id", "name"} <= set(doc["keys"][0])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temp file left behind"


def test_allowlist_and_rate_limit_round_trip_through_the_file(path: Path) -> None:
    store = ApiKeyStore.load(path)
    _, key = store.new_key("alice", ["bob", "0123456789abcdef"], 2.5)
    loaded = ApiKeyStore.load(path).get(key.key_id)
    assert loaded == key
    assert loaded.providers == ("bob", "0123456789abcdef")
    assert loaded.rate is not None and (loaded.rate.rate_per_s, loaded.rate.burst) == (2.5, 3)
    assert loaded.allows_provider("bob")
    assert loaded.allows_provider("mallory", fingerprint="0123456789abcdef")
    assert not loaded.allows_provider("mallory", fingerprint="fedcba9876543210")
    _, open_key = store.new_key("carol")
    assert open_key.allows_provider("anyone")


def test_public_view_holds_no_hash(path: Path) -> None:
    _, key = ApiKeyStore.load(path).new_key("alice")
    public = json.dumps(key.public())
    assert key.secret_sha256.hex() not in public and "sha256" not in public


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "not JSON"),
        ("[]", "format"),
        ('{"format": "fabric-api-keys", "version": 9, "keys": []}', "version"),
        ('{"format": "fabric-api-keys", "version": 1, "keys": {}}', "list"),
        ('{"format": "fabric-api-keys", "version": 1, "keys": [{"key_id": "XYZ"}]}', "key_id"),
        (
            '{"format": "fabric-api-keys", "version": 1, "keys": [{"key_id": "0badc0de", '
            '"name": "a", "secret_sha256": "00"}]}',
            "secret_sha256",
        ),
    ],
)
def test_malformed_keys_file_is_one_clear_line(path: Path, content: str, reason: str) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(KeyFileError) as info:
        ApiKeyStore.load(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and reason in message


def test_record_with_a_bad_rate_is_refused(path: Path) -> None:
    store = ApiKeyStore.load(path)
    store.new_key("alice", rate_per_s=1.0)
    doc = json.loads(path.read_text())
    doc["keys"][0]["rate_per_s"] = -1
    path.write_text(json.dumps(doc))
    with pytest.raises(KeyFileError, match="rate"):
        ApiKeyStore.load(path)


def test_a_keys_weight_round_trips_and_a_file_without_weights_means_one(path: Path) -> None:
    store = ApiKeyStore.load(path)
    _, heavy = store.new_key("heavy", weight=3)
    _, plain = store.new_key("plain")
    assert ApiKeyStore.load(path).get(heavy.key_id).weight == 3.0  # type: ignore[union-attr]
    assert heavy.public()["weight"] == 3.0 and plain.public()["weight"] == 1.0
    doc = json.loads(path.read_text())
    for record in doc["keys"]:
        del record["weight"]  # a file written before keys had weights
    path.write_text(json.dumps(doc))
    assert {k.weight for k in ApiKeyStore.load(path).list()} == {1.0}


@pytest.mark.parametrize("weight", [0, -1, "2", True, None, 1e300])
def test_record_with_a_bad_weight_is_one_clear_line(path: Path, weight: object) -> None:
    store = ApiKeyStore.load(path)
    _, key = store.new_key("alice")
    doc = json.loads(path.read_text())
    doc["keys"][0]["weight"] = weight
    path.write_text(json.dumps(doc))
    with pytest.raises(KeyFileError) as info:
        ApiKeyStore.load(path)
    message = str(info.value)
    assert "\n" not in message and key.key_id in message and "weight" in message


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "a", "weight": 0}, "weight"),
        ({"name": "a", "weight": float("inf")}, "weight"),
        ({"name": ""}, "name"),
        ({"name": "a\nb"}, "name"),
        ({"name": "deadbeef"}, "key id"),
        ({"name": "a", "providers": [" "]}, "allowlist"),
        ({"name": "a", "rate_per_s": 0.0}, "rate"),
        ({"name": "a", "rate_per_s": 1.0, "burst": 0}, "burst"),
        ({"name": "a", "burst": 3}, "rate"),
    ],
)
def test_new_key_refuses_bad_settings(path: Path, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ApiKeyStore.load(path).new_key(**kwargs)  # type: ignore[arg-type]
    assert not path.exists()


# -- enabled ----------------------------------------------------------------------------------


def test_no_keys_file_means_the_ingress_runs_open(path: Path) -> None:
    store = ApiKeyStore.load(path)
    assert not store.enabled
    assert store.lookup("fab-00000000-" + "A" * 43) is None


def test_revoking_every_key_keeps_auth_on(path: Path) -> None:
    store = ApiKeyStore.load(path)
    store.new_key("alice")
    store.revoke("alice")
    reloaded = ApiKeyStore.load(path)
    assert reloaded.enabled and reloaded.statistics().active_keys == 0


def test_revoke_by_name_needs_exactly_one_active_key(path: Path) -> None:
    store = ApiKeyStore.load(path)
    t1, k1 = store.new_key("alice", now=1.0)
    t2, k2 = store.new_key("alice", now=2.0)
    with pytest.raises(KeyFileError, match=f"{k1.key_id}, {k2.key_id}"):
        store.revoke("alice")
    store.revoke(k1.key_id)
    revoked, changed = store.revoke("alice")
    assert changed and revoked.key_id == k2.key_id
    assert store.lookup(t1) is None and store.lookup(t2) is None
    _, changed = store.revoke("alice")
    assert not changed
    with pytest.raises(KeyFileError, match="api-list"):
        store.revoke("nobody")


# -- live reload ------------------------------------------------------------------------------


def test_reload_adopts_keys_another_process_added(path: Path) -> None:
    agent = ApiKeyStore.load(path)
    assert not agent.maybe_reload()
    token, _ = ApiKeyStore.load(path).new_key("alice")  # the CLI, elsewhere
    assert agent.maybe_reload()
    assert agent.enabled and agent.lookup(token) is not None
    assert not agent.maybe_reload(), "an unchanged file is not read again"


def test_broken_edit_keeps_old_keys_and_counts_an_error(path: Path) -> None:
    agent = ApiKeyStore.load(path)
    token, key = agent.new_key("alice")
    good = path.read_text()
    path.write_text(good.replace('"version": 1', '"version": 1,,'))
    bump_mtime(path)
    assert not agent.maybe_reload()
    assert agent.lookup(token) == key
    stats = agent.statistics()
    assert stats.reload_errors == 1 and str(path) in stats.last_error
    assert not agent.maybe_reload()
    assert agent.statistics().reload_errors == 1, "a broken file is reported once, not per poll"

    cli = ApiKeyStore(path, [key], enabled=True)
    cli.revoke(key.key_id)  # the fixed file: now with the key revoked
    bump_mtime(path, 20)
    assert agent.maybe_reload()
    assert agent.lookup(token) is None
    assert agent.statistics().last_error == ""


def test_deleted_keys_file_does_not_open_the_ingress(path: Path) -> None:
    agent = ApiKeyStore.load(path)
    token, key = agent.new_key("alice")
    path.unlink()
    assert not agent.maybe_reload()
    assert agent.enabled and agent.lookup(token) == key
    assert "disappeared" in agent.statistics().last_error


def test_a_malformed_file_appearing_on_an_open_agent_lets_nobody_in(path: Path) -> None:
    agent = ApiKeyStore.load(path)
    assert not agent.enabled
    path.parent.mkdir(parents=True)
    path.write_text('{"format": "fabric-api-keys", "version": 1, "keys": [oops]}')
    assert not agent.maybe_reload()
    assert agent.enabled and agent.statistics().keys == 0


# -- rate limiting ----------------------------------------------------------------------------


def test_rate_limiter_allows_a_burst_then_says_when_to_retry() -> None:
    limiter = RateLimiter()
    assert [limiter.check("k", 2.0, 3, now=100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.check("k", 2.0, 3, now=100.0) == pytest.approx(0.5)
    assert limiter.check("k", 2.0, 3, now=100.25) == pytest.approx(0.25)
    assert limiter.check("k", 2.0, 3, now=100.5) == 0.0, "one token after 1/rate seconds"
    assert limiter.check("k", 2.0, 3, now=100.5) == pytest.approx(0.5)
    stats = limiter.statistics()
    assert (stats.allowed, stats.limited) == (4, 3)


def test_rate_limiter_refills_up_to_the_burst_only() -> None:
    limiter = RateLimiter()
    for _ in range(3):
        limiter.check("k", 1.0, 3, now=0.0)
    allowed = [limiter.check("k", 1.0, 3, now=1000.0) for _ in range(5)]
    assert allowed[:3] == [0.0, 0.0, 0.0] and allowed[3] == pytest.approx(1.0)


def test_rate_limits_are_per_key() -> None:
    limiter = RateLimiter()
    assert limiter.check("a", 1.0, 1, now=0.0) == 0.0
    assert limiter.check("a", 1.0, 1, now=0.0) > 0
    assert limiter.check("b", 1.0, 1, now=0.0) == 0.0


def test_rate_limiter_forgets_refilled_buckets_first() -> None:
    limiter = RateLimiter(max_keys=10)
    limiter.check("busy", 0.001, 1, now=0.0)  # empty for the next ~1000 s
    for i in range(50):
        limiter.check(f"k{i}", 100.0, 1, now=1.0 + i)
    stats = limiter.statistics()
    assert stats.buckets <= 10 and stats.evicted == 0
    assert limiter.check("busy", 0.001, 1, now=60.0) > 0, "its empty bucket was kept"


def test_rate_limiter_memory_is_bounded_when_every_key_is_busy() -> None:
    limiter = RateLimiter(max_keys=10)
    for i in range(50):
        limiter.check(f"k{i}", 0.001, 1, now=0.0)
    stats = limiter.statistics()
    assert stats.buckets <= 10 and stats.evicted >= 40
    assert limiter.check("k49", 0.001, 1, now=0.0) > 0, "the most recent keys are kept"


def test_a_keys_sites_round_trip_and_make_the_file_version_2(path: Path) -> None:
    store = ApiKeyStore.load(path)
    _, anywhere = store.new_key("anywhere")
    assert json.loads(path.read_text())["version"] == 1  # no key has sites: as before
    _, key = store.new_key("eu", sites=[" eu-1", "A"])
    assert key.sites == frozenset({"eu-1", "A"})
    doc = json.loads(path.read_text())
    assert doc["version"] == 2
    assert [k.get("sites") for k in doc["keys"]] == [None, ["A", "eu-1"]]
    loaded = ApiKeyStore.load(path)
    assert loaded.get(key.key_id) == key and loaded.get(anywhere.key_id) == anywhere
    assert key.public()["sites"] == ["A", "eu-1"] and anywhere.public()["sites"] is None


def test_a_version_1_file_may_not_hold_sites(path: Path) -> None:
    """An agent that predates residency reads version 1 files and would ignore ``sites``: a
    site-limited key is only ever in a version 2 file, which such an agent refuses whole."""
    store = ApiKeyStore.load(path)
    store.new_key("eu", sites=["A"])
    doc = json.loads(path.read_text())
    doc["version"] = 1
    path.write_text(json.dumps(doc))
    with pytest.raises(KeyFileError, match="has sites: a file with site-limited keys is version 2"):
        ApiKeyStore.load(path)


@pytest.mark.parametrize(
    ("sites", "reason"),
    [
        ("A", "sites must be a list"),
        ([1], "sites must be a list"),
        ([], "no site named"),
        (["a b"], "ASCII letters"),
        (["x" * 33], "at most 32"),
    ],
)
def test_record_with_bad_sites_is_one_clear_line(path: Path, sites: object, reason: str) -> None:
    store = ApiKeyStore.load(path)
    store.new_key("eu", sites=["A"])
    doc = json.loads(path.read_text())
    doc["keys"][0]["sites"] = sites
    path.write_text(json.dumps(doc))
    with pytest.raises(KeyFileError, match=reason) as caught:
        ApiKeyStore.load(path)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("sites", [[], ["a b"], ["A", ""]])
def test_new_key_refuses_bad_sites(path: Path, sites: list[str]) -> None:
    with pytest.raises(ConfigError, match="sites"):
        ApiKeyStore.load(path).new_key("eu", sites=sites)
    assert not path.exists()
