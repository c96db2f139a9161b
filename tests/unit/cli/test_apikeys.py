"""`fabric keys api-new/api-list/api-revoke`: ingress API keys from the command line."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from fabricnode.dataplane.apikeys import ApiKeyStore

ENV_KEYS = ("FABRIC_HOME", "FABRIC_CLUSTER_KEY", "FABRIC_JOIN", "FABRIC_AGENT")


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("FABRIC_HOME", str(tmp_path / "home"))
    return CliRunner()


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    return tmp_path / "home" / "api-keys.json"


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_api_new_prints_the_token_once_and_stores_only_its_hash(
    runner: CliRunner, keys_file: Path
) -> None:
    result = runner.invoke(app, ["keys", "api-new", "alice"])
    assert result.exit_code == 0, result.output
    token = result.stdout.strip()
    key = ApiKeyStore.load(keys_file).lookup(token)
    assert key is not None and key.name == "alice"
    assert key.key_id in result.stderr and "only" in result.stderr and "once" in result.stderr
    assert token[13:] not in keys_file.read_text()
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600


def test_api_new_records_providers_and_rate(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    options = ["--providers", "alice, carol", "--rate", "2.5", "--burst", "5", "--json"]
    result = runner.invoke(app, ["keys", "api-new", "bob", *options, "--keys-file", str(path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["providers"], doc["rate_per_s"], doc["burst"]) == (["alice", "carol"], 2.5, 5)
    key = ApiKeyStore.load(path).lookup(doc["token"])
    assert key is not None and key.key_id == doc["key_id"] and key.allows_provider("carol")


@pytest.mark.parametrize(
    "args",
    [
        ["--rate", "0"],
        ["--rate", "-1"],
        ["--burst", "3"],
        ["--rate", "1", "--burst", "0"],
        ["--providers", "a,,b"],
        ["--rate", "fast"],
        ["--weight", "0"],
        ["--weight", "-2"],
        ["--weight", "nan"],
    ],
)
def test_api_new_bad_options_are_usage_errors(
    runner: CliRunner, keys_file: Path, args: list[str]
) -> None:
    result = runner.invoke(app, ["keys", "api-new", "alice", *args])
    assert result.exit_code == 2
    assert not keys_file.exists()


def test_api_new_records_the_batch_weight(runner: CliRunner, keys_file: Path) -> None:
    heavy = runner.invoke(app, ["keys", "api-new", "heavy", "--weight", "2.5", "--json"])
    plain = runner.invoke(app, ["keys", "api-new", "plain", "--json"])
    assert heavy.exit_code == plain.exit_code == 0, heavy.output + plain.output
    assert json.loads(heavy.stdout)["weight"] == 2.5 and json.loads(plain.stdout)["weight"] == 1
    by_name = {k.name: k.weight for k in ApiKeyStore.load(keys_file).list()}
    assert by_name == {"heavy": 2.5, "plain": 1.0}
    listed = runner.invoke(app, ["keys", "api-list"])
    assert "WEIGHT" in listed.stdout and "2.5" in listed.stdout


def test_api_new_bad_weight_is_one_clear_line(runner: CliRunner) -> None:
    result = runner.invoke(app, ["keys", "api-new", "alice", "--weight", "0"])
    assert result.exit_code == 2
    assert "weight" in one_error_line(result.stderr)


def test_api_new_bad_name_is_a_usage_error(runner: CliRunner) -> None:
    result = runner.invoke(app, ["keys", "api-new", " alice"])
    assert result.exit_code == 2
    assert "name" in one_error_line(result.stderr)


def test_api_list_never_shows_hashes_or_secrets(runner: CliRunner, keys_file: Path) -> None:
    tokens = [runner.invoke(app, ["keys", "api-new", n]).stdout.strip() for n in ("a1", "b2")]
    hashes = [k.secret_sha256.hex() for k in ApiKeyStore.load(keys_file).list()]
    listed = runner.invoke(app, ["keys", "api-list", "--json"])
    assert listed.exit_code == 0
    plain = runner.invoke(app, ["keys", "api-list"])
    assert plain.exit_code == 0
    for output in (listed.stdout, plain.stdout):
        for secret in [t[13:] for t in tokens] + hashes:
            assert secret not in output
    doc = json.loads(listed.stdout)
    assert doc["enabled"] is True
    assert [k["name"] for k in doc["keys"]] == ["a1", "b2"]
    assert (
        "a1" in plain.stdout and "active" in plain.stdout and "2 active keys of 2" in plain.stdout
    )


def test_api_list_without_a_file_says_the_ingress_is_open(runner: CliRunner) -> None:
    plain = runner.invoke(app, ["keys", "api-list"])
    assert plain.exit_code == 0 and "no auth" in plain.stdout
    doc = json.loads(runner.invoke(app, ["keys", "api-list", "--json"]).stdout)
    assert doc["enabled"] is False and doc["keys"] == []


def test_api_revoke_by_id_or_name(runner: CliRunner, keys_file: Path) -> None:
    alice = runner.invoke(app, ["keys", "api-new", "alice"]).stdout.strip()
    bob = runner.invoke(app, ["keys", "api-new", "bob"]).stdout.strip()
    result = runner.invoke(app, ["keys", "api-revoke", "alice"])
    assert result.exit_code == 0 and "revoked" in result.stdout
    bob_id = bob.split("-")[1]
    assert runner.invoke(app, ["keys", "api-revoke", bob_id]).exit_code == 0
    store = ApiKeyStore.load(keys_file)
    assert store.lookup(alice) is None and store.lookup(bob) is None
    again = runner.invoke(app, ["keys", "api-revoke", bob_id])
    assert again.exit_code == 0 and "already revoked" in again.stdout
    listed = runner.invoke(app, ["keys", "api-list"])
    assert "revoked" in listed.stdout and "0 active keys of 2" in listed.stdout


def test_api_revoke_of_an_unknown_key_is_one_line_and_exit_1(runner: CliRunner) -> None:
    missing = runner.invoke(app, ["keys", "api-revoke", "alice"])
    assert missing.exit_code == 1
    assert "no API keys file" in one_error_line(missing.stderr)
    runner.invoke(app, ["keys", "api-new", "alice"])
    unknown = runner.invoke(app, ["keys", "api-revoke", "nobody"])
    assert unknown.exit_code == 1
    assert "api-list" in one_error_line(unknown.stderr)


def test_a_malformed_keys_file_is_one_line_and_exit_1(runner: CliRunner, keys_file: Path) -> None:
    keys_file.parent.mkdir(parents=True)
    keys_file.write_text("{oops")
    for args in (["api-list"], ["api-new", "alice"], ["api-revoke", "alice"]):
        result = runner.invoke(app, ["keys", *args])
        assert result.exit_code == 1
        assert str(keys_file) in one_error_line(result.stderr)
    assert keys_file.read_text() == "{oops"


def test_api_revoke_json_says_whether_it_changed_anything(
    runner: CliRunner, keys_file: Path
) -> None:
    runner.invoke(app, ["keys", "api-new", "alice"])
    first = runner.invoke(app, ["keys", "api-revoke", "alice", "--json"])
    assert first.exit_code == 0, first.output
    doc = json.loads(first.stdout)
    assert doc["changed"] is True and doc["disabled"] is True and doc["name"] == "alice"
    assert doc["path"] == str(keys_file) and isinstance(doc["revoked_at"], float)
    assert set(doc) == {"path", "changed", *ApiKeyStore.load(keys_file).list()[0].public()}
    again = json.loads(runner.invoke(app, ["keys", "api-revoke", doc["key_id"], "--json"]).stdout)
    assert again["changed"] is False and again["key_id"] == doc["key_id"]


def test_api_new_records_the_sites_and_api_list_shows_them(
    runner: CliRunner, keys_file: Path
) -> None:
    eu = runner.invoke(app, ["keys", "api-new", "eu", "--sites", "eu-1, A", "--json"])
    anywhere = runner.invoke(app, ["keys", "api-new", "anywhere", "--json"])
    assert eu.exit_code == anywhere.exit_code == 0, eu.output + anywhere.output
    assert json.loads(eu.stdout)["sites"] == ["A", "eu-1"]
    assert json.loads(anywhere.stdout)["sites"] is None
    by_name = {k.name: k.sites for k in ApiKeyStore.load(keys_file).list()}
    assert by_name == {"eu": frozenset({"A", "eu-1"}), "anywhere": None}
    listed = runner.invoke(app, ["keys", "api-list", "--json"])
    assert [k["sites"] for k in json.loads(listed.stdout)["keys"]] == [["A", "eu-1"], None]
    table = runner.invoke(app, ["keys", "api-list"]).stdout.splitlines()
    assert "SITES" in table[0]
    assert "A, eu-1" in next(line for line in table if " eu " in line)


@pytest.mark.parametrize("sites", ["", "A,,B", "a b", "-A"])
def test_api_new_bad_sites_are_one_line_usage_errors(
    runner: CliRunner, keys_file: Path, sites: str
) -> None:
    result = runner.invoke(app, ["keys", "api-new", "eu", "--sites", sites])
    assert result.exit_code == 2
    assert "--sites" in one_error_line(result.stderr)
    assert not keys_file.exists()
