"""The `fabric` command: keys management, error exits, configuration from flags and environment,
and the read commands against a real agent."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app, run
from fabricnode.config import load_config, parse_labels
from fabricnode.errors import ConfigError
from fabricnode.identity import ProviderKey
from fabricnode.keyring import Keyring
from fabricnode.localmesh import AgentProcess, LocalMesh, agent_command

ENV_KEYS = ("FABRIC_HOME", "FABRIC_CLUSTER_KEY", "FABRIC_JOIN", "FABRIC_AGENT")


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("FABRIC_HOME", str(tmp_path / "home"))
    return CliRunner()


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# -- keys -----------------------------------------------------------------------------------------


def test_new_cluster_writes_a_private_keyring_in_fabric_home(
    runner: CliRunner, tmp_path: Path
) -> None:
    result = runner.invoke(app, ["keys", "new-cluster"])
    assert result.exit_code == 0, result.output
    path = tmp_path / "home" / "cluster.key"
    ring = Keyring.load(path)
    assert ring.primary.hex() in result.stdout
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_new_cluster_refuses_to_overwrite_without_force(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "k.key"
    assert runner.invoke(app, ["keys", "new-cluster", str(path)]).exit_code == 0
    before = Keyring.load(path).primary
    result = runner.invoke(app, ["keys", "new-cluster", str(path)])
    assert result.exit_code == 1
    assert "--force" in one_error_line(result.stderr)
    assert Keyring.load(path).primary == before
    result = runner.invoke(app, ["keys", "new-cluster", str(path), "--force"])
    assert result.exit_code == 0
    assert Keyring.load(path).primary != before


def test_rotation_add_use_remove(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "ring.key"
    runner.invoke(app, ["keys", "new-cluster", str(path)])
    old = Keyring.load(path).primary.hex()

    added = runner.invoke(app, ["keys", "add", "--cluster-key", str(path)])
    assert added.exit_code == 0
    new = added.stdout.strip()
    assert len(new) == 8 and new != old
    ring = Keyring.load(path)
    assert ring.key_ids() == sorted([old, new])
    assert ring.primary.hex() == old, "a new key is not primary until `keys use`"

    result = runner.invoke(app, ["keys", "remove", new, "--cluster-key", str(path)])
    assert result.exit_code == 0
    added = runner.invoke(app, ["keys", "add", "--cluster-key", str(path)])
    new = added.stdout.strip()

    refused = runner.invoke(app, ["keys", "remove", old, "--cluster-key", str(path)])
    assert refused.exit_code == 1
    assert "primary" in one_error_line(refused.stderr)

    assert runner.invoke(app, ["keys", "use", new, "--cluster-key", str(path)]).exit_code == 0
    assert Keyring.load(path).primary.hex() == new
    assert runner.invoke(app, ["keys", "remove", old, "--cluster-key", str(path)]).exit_code == 0
    assert Keyring.load(path).key_ids() == [new]

    listed = runner.invoke(app, ["keys", "list", "--cluster-key", str(path), "--json"])
    assert json.loads(listed.stdout) == {"path": str(path), "primary": new, "keys": [new]}
    listed = runner.invoke(app, ["keys", "list", "--cluster-key", str(path)])
    assert listed.stdout.strip() == f"{new} primary"


def test_keys_commands_default_to_fabric_cluster_key(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "from-env.key"
    monkeypatch.setenv("FABRIC_CLUSTER_KEY", str(path))
    assert runner.invoke(app, ["keys", "new-cluster"]).exit_code == 0
    assert runner.invoke(app, ["keys", "add"]).exit_code == 0
    assert len(Keyring.load(path).keys) == 2


def test_unknown_key_id_fails_and_malformed_key_id_is_bad_usage(
    runner: CliRunner, tmp_path: Path
) -> None:
    path = tmp_path / "ring.key"
    runner.invoke(app, ["keys", "new-cluster", str(path)])
    unknown = runner.invoke(app, ["keys", "use", "00000000", "--cluster-key", str(path)])
    assert unknown.exit_code == 1
    assert "00000000" in one_error_line(unknown.stderr)
    malformed = runner.invoke(app, ["keys", "use", "xyz", "--cluster-key", str(path)])
    assert malformed.exit_code == 2


def test_missing_keyring_names_the_command_that_creates_it(
    runner: CliRunner, tmp_path: Path
) -> None:
    path = tmp_path / "absent.key"
    result = runner.invoke(app, ["keys", "add", "--cluster-key", str(path)])
    assert result.exit_code == 1
    assert f"fabric keys new-cluster {path}" in one_error_line(result.stderr)


def test_new_provider_key_is_loadable_and_not_overwritten(
    runner: CliRunner, tmp_path: Path
) -> None:
    path = tmp_path / "provider.key"
    result = runner.invoke(app, ["keys", "new-provider", str(path), "--provider", "alice"])
    assert result.exit_code == 0, result.output
    key = ProviderKey.load(path)
    assert key.provider == "alice"
    assert key.fingerprint in result.stdout
    again = runner.invoke(app, ["keys", "new-provider", str(path), "--provider", "alice"])
    assert again.exit_code == 1
    assert ProviderKey.load(path).fingerprint == key.fingerprint


# -- start: refusals before anything runs ---------------------------------------------------------


def test_start_refuses_an_engine_command_whose_port_it_cannot_tell(runner: CliRunner) -> None:
    result = runner.invoke(app, ["start", "--", "my-server", "--model", "m"])
    assert result.exit_code == 2
    line = one_error_line(result.stderr)
    assert "cannot tell which port the engine listens on" in line
    assert "--engine-url" in line


def test_start_refuses_a_malformed_sim_gpu(runner: CliRunner) -> None:
    result = runner.invoke(app, ["start", "--sim-gpu", "H100:lots"])
    assert result.exit_code == 2
    assert "--sim-gpu" in one_error_line(result.stderr)


def test_start_without_a_cluster_key_says_how_to_create_one(
    runner: CliRunner, tmp_path: Path
) -> None:
    path = tmp_path / "nokey"
    result = runner.invoke(app, ["start", "--http", "127.0.0.1:0", "--cluster-key", str(path)])
    assert result.exit_code == 1
    assert f"`fabric keys new-cluster {path}`" in one_error_line(result.stderr)


@pytest.mark.parametrize(
    "args",
    [
        ["--http", "nowhere"],
        ["--gossip", "127.0.0.1:99999"],
        ["--join", "host-without-port"],
        ["--label", "novalue"],
        ["--log-level", "loud"],
    ],
)
def test_start_rejects_bad_flags_as_usage_errors(runner: CliRunner, args: list[str]) -> None:
    result = runner.invoke(app, ["start", *args])
    assert result.exit_code == 2
    assert args[0] in one_error_line(result.stderr)


def test_start_reports_a_busy_port_in_one_line(tmp_path: Path) -> None:
    mesh = LocalMesh(tmp_path)  # only for its cluster key and environment
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            agent_command(
                *("--http", f"127.0.0.1:{port}", "--gossip", "127.0.0.1:0"),
                *("--cluster-key", str(mesh.key_path)),
            ),
            env=mesh.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert f"127.0.0.1:{port}" in one_error_line(result.stderr)
    assert result.stdout == ""


# -- read commands: failures ----------------------------------------------------------------------


def test_unreachable_agent_is_one_line_and_exit_1(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--agent", "http://127.0.0.1:9", "nodes"])
    assert result.exit_code == 1
    line = one_error_line(result.stderr)
    assert "cannot reach the agent at http://127.0.0.1:9" in line


def test_agent_url_comes_from_fabric_agent(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FABRIC_AGENT", "http://127.0.0.1:9")
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 1
    assert "http://127.0.0.1:9" in one_error_line(result.stderr)


@pytest.mark.parametrize("args", [["nodes", "--state", "asleep"], ["nodes", "--label", "x"]])
def test_bad_filters_are_usage_errors(runner: CliRunner, args: list[str]) -> None:
    assert runner.invoke(app, args).exit_code == 2


def test_run_prints_usage_errors_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert run(["nodes", "--no-such-option"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("fabric nodes: error:")
    assert "--no-such-option" in line
    assert run(["no-such-command"]) == 2
    assert run(["--help"]) == 0
    assert "keys" in capsys.readouterr().out


def test_run_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    from fabricnode.errors import AgentApiError

    with pytest.raises(AgentApiError):
        run(["--debug", "--agent", "http://127.0.0.1:9", "nodes"])


# -- configuration: flags win over environment ----------------------------------------------------


def test_defaults_come_from_fabric_home(tmp_path: Path) -> None:
    env = {"FABRIC_HOME": str(tmp_path), "USER": "erin"}
    config = load_config(env=env)
    assert (config.http_host, config.http_port) == ("0.0.0.0", 8080)
    assert (config.gossip_host, config.gossip_port) == ("0.0.0.0", 7946)
    assert config.cluster_key_path == tmp_path / "cluster.key"
    assert config.rendezvous_path == tmp_path / "rendezvous"
    assert config.provider == "erin"
    assert config.admin_bind is None
    assert config.join == ()
    assert config.advertise_host  # this host's primary address, or 127.0.0.1


def test_flags_win_over_environment(tmp_path: Path) -> None:
    env = {
        "FABRIC_HOME": str(tmp_path),
        "FABRIC_CLUSTER_KEY": str(tmp_path / "env.key"),
        "FABRIC_JOIN": "10.0.0.1:7946, 10.0.0.2:7946",
        "USER": "erin",
    }
    assert load_config(env=env).cluster_key_path == tmp_path / "env.key"
    assert load_config(env=env).join == ("10.0.0.1:7946", "10.0.0.2:7946")
    config = load_config(
        env=env,
        cluster_key=str(tmp_path / "flag.key"),
        join=["10.0.0.3:7000"],
        provider="frank",
        rendezvous="",
    )
    assert config.cluster_key_path == tmp_path / "flag.key"
    assert config.join == ("10.0.0.3:7000",)
    assert config.provider == "frank"
    assert config.rendezvous_path is None


def test_a_loopback_bind_advertises_loopback() -> None:
    config = load_config(http="127.0.0.1:0", gossip="127.0.0.1:0", env={"USER": "u"})
    assert config.advertise_host == "127.0.0.1"
    assert config.gossip_port == 0
    explicit = load_config(gossip="127.0.0.1:0", advertise="node7.cluster", env={"USER": "u"})
    assert explicit.advertise_host == "node7.cluster"


def test_labels_parse_and_reject_malformed_pairs() -> None:
    assert parse_labels(["b=2", "a=1=x", "b=3", "empty="]) == (
        ("a", "1=x"),
        ("b", "3"),
        ("empty", ""),
    )
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_labels(["=v"])


# -- read commands against a real agent -----------------------------------------------------------


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    with LocalMesh(tmp_path / "mesh", provider="cli-test") as mesh:
        yield mesh.start("solo", args=["--label", "team=cli"])


@pytest.mark.slow
def test_nodes_and_node_show_a_real_agent(runner: CliRunner, agent: AgentProcess) -> None:
    url = agent.http_url
    listed = runner.invoke(app, ["--agent", url, "nodes", "--json"])
    assert listed.exit_code == 0, listed.output
    nodes = json.loads(listed.stdout)["nodes"]
    assert [n["session_id"] for n in nodes] == [agent.session_id]
    assert nodes[0]["labels"] == {"fabric.name": "solo", "team": "cli"}

    table = runner.invoke(app, ["--agent", url, "nodes"])
    assert table.exit_code == 0
    assert agent.session_id[:12] in table.stdout
    assert "cli-test" in table.stdout

    filtered = runner.invoke(app, ["--agent", url, "nodes", "--label", "team=other", "--json"])
    assert json.loads(filtered.stdout) == {"nodes": []}

    one = runner.invoke(app, ["--agent", url, "node", agent.session_id[:6], "--json"])
    assert one.exit_code == 0
    assert json.loads(one.stdout)["session_id"] == agent.session_id
    human = runner.invoke(app, ["--agent", url, "node", agent.session_id[:6]])
    assert f"addresses.gossip       {agent.gossip_addr}" in human.stdout

    missing = runner.invoke(app, ["--agent", url, "node", "ffffffffffff0000"])
    assert missing.exit_code == 1
    assert "no node with session id" in one_error_line(missing.stderr)

    models = runner.invoke(app, ["--agent", url, "models", "--json"])
    assert json.loads(models.stdout) == {"models": []}
