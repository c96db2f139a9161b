"""The `fabric` command: keys management, error exits, configuration from flags and environment,
and the read commands against a real agent."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from cli.localmesh import AgentProcess, LocalMesh, agent_command, wait_until
from cli.main import app, run
from fabricnode.config import load_config, parse_labels
from fabricnode.control.client import AdminClient
from fabricnode.errors import AgentApiError, ConfigError
from fabricnode.mesh.identity import ProviderKey
from fabricnode.mesh.keyring import Keyring
from tests.support.meshview import ENTRY_KEYS

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
    gossip = rf"^addresses\.gossip +{re.escape(agent.gossip_addr)}$"
    assert re.search(gossip, human.stdout, re.MULTILINE), human.stdout

    missing = runner.invoke(app, ["--agent", url, "node", "ffffffffffff0000"])
    assert missing.exit_code == 1
    assert "no node with session id" in one_error_line(missing.stderr)

    models = runner.invoke(app, ["--agent", url, "models", "--json"])
    assert json.loads(models.stdout) == {"models": []}


# -- read commands against a real mesh: tables, --json, filters, errors -------------------------

MODEL_KEYS = [
    "id",
    "nodes",
    "serving",
    "asleep",
    "gpu_types",
    "gpus",
    "max_model_len",
    "parent",
    "quantizations",
    "providers",
    "load",
    "sites",
]


@dataclass
class SimMesh:
    """Three agents: ``llama`` (2xH100, team=a), ``qwen`` (1xL40S, team=b), both SERVING a
    simulated engine, and ``bare`` (no engine: JOIN, team=a) whose agent endpoints are on a
    separate ``--admin`` port."""

    llama: AgentProcess
    qwen: AgentProcess
    bare: AgentProcess

    @property
    def url(self) -> str:
        return self.llama.http_url

    def all(self) -> list[AgentProcess]:
        return [self.llama, self.qwen, self.bare]


@pytest.fixture(scope="module")
def sim_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimMesh]:
    local = LocalMesh(tmp_path_factory.mktemp("cli-mesh"), provider="lab")
    try:
        sim = SimMesh(
            local.start(
                "llama",
                wait=False,
                args=["--sim", "llama-3-8b", "--sim-gpu", "H100:2", "--label", "team=a"],
            ),
            local.start(
                "qwen",
                wait=False,
                args=["--sim", "qwen2.5-7b", "--sim-gpu", "L40S", "--label", "team=b"],
            ),
            local.start("bare", wait=False, args=["--label", "team=a", "--admin", "127.0.0.1:0"]),
        )
        for agent in sim.all():
            agent.wait_ready(30.0)

        def settled() -> bool:
            try:
                with AdminClient(sim.url, timeout_s=2.0) as client:
                    found = client.nodes()
            except AgentApiError:
                return False
            states = sorted(n["state"] for n in found if n["liveness"] == "alive")
            return states == ["join", "serving", "serving"] and all(
                n["load"] is not None for n in found if n["state"] == "serving"
            )

        assert wait_until(settled, 30.0), "the 3 agents did not converge with 2 engines serving"
        yield sim
    finally:
        local.close()


def invoke(runner: CliRunner, url: str, *args: str) -> Result:
    return runner.invoke(app, ["--agent", url, *args])


@pytest.mark.slow
def test_nodes_table_shows_every_column_for_every_node(
    runner: CliRunner, sim_mesh: SimMesh
) -> None:
    result = invoke(runner, sim_mesh.url, "nodes")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].split() == [
        "SESSION", "SITE", "PROVIDER", "STATE", "LIVENESS", "HOST", "GPUS", "MODELS", "LOAD", "AGE"
    ]  # fmt: skip
    assert lines[-1] == "3 nodes"
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert {row.pop(1) for row in rows.values()} == {"default"}
    llama = rows[sim_mesh.llama.session_id[:12]]
    assert llama[1:4] == ["lab", "serving", "alive"]
    assert llama[5:7] == ["2xH100", "llama-3-8b"]
    assert re.fullmatch(r"w\d+ r\d+ kv\d+%", " ".join(llama[7:10]))
    assert re.fullmatch(r"\d+[smhd]", llama[10])
    bare = rows[sim_mesh.bare.session_id[:12]]
    assert bare[1:4] == ["lab", "join", "alive"]
    assert bare[5:] == ["-", "-", "-", bare[-1]], "no GPU, model or load: dashes"


@pytest.mark.slow
def test_nodes_json_has_the_documented_keys(runner: CliRunner, sim_mesh: SimMesh) -> None:
    result = invoke(runner, sim_mesh.url, "nodes", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert list(doc) == ["nodes"]
    by_sid = {n["session_id"]: n for n in doc["nodes"]}
    assert sorted(by_sid) == sorted(a.session_id for a in sim_mesh.all())
    for entry in doc["nodes"]:
        assert list(entry) == ENTRY_KEYS
        assert list(entry["addresses"]) == ["http", "gossip"]
        assert list(entry["hardware"]) == ["gpu_type", "gpu_count", "gpu_memory_gb", "host"]
        assert list(entry["engine"]) == ["kind", "version", "url"]
    llama = by_sid[sim_mesh.llama.session_id]
    assert llama["hardware"]["gpu_type"] == "H100" and llama["hardware"]["gpu_count"] == 2
    assert [list(m) for m in llama["models"]] == [["id", "max_model_len", "quantization", "parent"]]
    assert list(llama["load"]) == ["waiting", "running", "kv_usage", "inflight", "updated_at"]
    # Its own labels, and the time its engine first served (mesh.schema.SERVING_SINCE_LABEL).
    labels = dict(llama["labels"])
    assert float(labels.pop("fabric.serving_since")) > 0
    assert labels == {"fabric.name": "llama", "team": "a"}
    assert by_sid[sim_mesh.bare.session_id]["load"] is None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--state", "serving"], ["llama", "qwen"]),
        (["--state", "JOIN"], ["bare"]),
        (["--state", "left"], []),
        (["--model", "qwen2.5-7b"], ["qwen"]),
        (["--model", "no-such-model"], []),
        (["--gpu", "h100"], ["llama"]),
        (["--label", "team=a"], ["bare", "llama"]),
        (["--label", "team=a", "--label", "fabric.name=bare"], ["bare"]),
        (["--label", "team=a", "--state", "serving", "--gpu", "H100"], ["llama"]),
    ],
)
def test_nodes_filters_combine(
    runner: CliRunner, sim_mesh: SimMesh, args: list[str], expected: list[str]
) -> None:
    result = invoke(runner, sim_mesh.url, "nodes", *args, "--json")
    assert result.exit_code == 0, result.output
    names = sorted(n["labels"]["fabric.name"] for n in json.loads(result.stdout)["nodes"])
    assert names == expected
    table = invoke(runner, sim_mesh.url, "nodes", *args)
    assert table.exit_code == 0
    count = len(expected)
    assert table.stdout.strip().splitlines()[-1] == f"{count} node{'s' if count != 1 else ''}"


@pytest.mark.slow
def test_node_shows_one_entry_by_unique_prefix(runner: CliRunner, sim_mesh: SimMesh) -> None:
    sid = sim_mesh.qwen.session_id
    for prefix in (sid, sid[:8], sid[:8].upper()):
        result = invoke(runner, sim_mesh.url, "node", prefix, "--json")
        assert result.exit_code == 0, result.output
        entry = json.loads(result.stdout)
        assert entry["session_id"] == sid and list(entry) == ENTRY_KEYS
    human = invoke(runner, sim_mesh.url, "node", sid[:8])
    assert human.exit_code == 0
    fields = dict(line.split(None, 1) for line in human.stdout.strip().splitlines())
    assert fields["session_id"] == sid
    assert fields["models[0].id"] == "qwen2.5-7b"
    assert fields["hardware.gpu_type"] == "L40S"
    assert fields["labels.team"] == "b"
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(\d+[smhd] ago\)", fields["started_at"]
    )
    assert re.fullmatch(r".* UTC \(in \d+[smhd]\)", fields["expires_at"])


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["ffffffffffff0000", "not-hex"])
def test_node_with_an_unknown_id_is_one_line_and_exit_1(
    runner: CliRunner, sim_mesh: SimMesh, prefix: str
) -> None:
    result = invoke(runner, sim_mesh.url, "node", prefix)
    assert result.exit_code == 1
    line = one_error_line(result.stderr)
    assert f"no node with session id {prefix!r}" in line and "fabric nodes" in line
    assert result.stdout == ""


@pytest.mark.slow
def test_models_show_nodes_gpu_types_and_aggregate_load(
    runner: CliRunner, sim_mesh: SimMesh
) -> None:
    result = invoke(runner, sim_mesh.url, "models", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert list(doc) == ["models"]
    assert [m["id"] for m in doc["models"]] == ["llama-3-8b", "qwen2.5-7b"]
    llama, qwen = doc["models"]
    for m in (llama, qwen):
        assert list(m) == MODEL_KEYS
        assert list(m["load"]) == ["waiting", "running", "inflight", "kv_usage"]
        assert (m["nodes"], m["serving"], m["asleep"], m["providers"]) == (1, 1, 0, ["lab"])
        assert m["sites"] == [
            {"site": "default", "nodes": 1, "serving": 1, "asleep": 0, "gpus": m["gpus"]}
        ]
    assert (llama["gpu_types"], llama["gpus"]) == (["H100"], 2)
    assert (qwen["gpu_types"], qwen["gpus"]) == (["L40S"], 1)

    table = invoke(runner, sim_mesh.url, "models")
    assert table.exit_code == 0
    lines = table.stdout.strip().splitlines()
    assert lines[0].split() == [
        "MODEL", "NODES", "SERVING", "ASLEEP", "SITES", "GPU", "TYPES", "GPUS", "WAITING",
        "RUNNING", "KV",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["llama-3-8b"][1:7] == ["1", "1", "0", "default:1", "H100", "2"]
    assert rows["qwen2.5-7b"][1:7] == ["1", "1", "0", "default:1", "L40S", "1"]


@pytest.mark.slow
def test_any_agent_answers_and_agent_urls_are_forgiving(
    runner: CliRunner, sim_mesh: SimMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    views = []
    for url in (sim_mesh.llama.http_url, sim_mesh.qwen.http_url, sim_mesh.bare.addrs.admin_url):
        result = invoke(runner, str(url), "nodes", "--json")
        assert result.exit_code == 0, result.output
        views.append(sorted(n["session_id"] for n in json.loads(result.stdout)["nodes"]))
    assert views[0] == views[1] == views[2]

    hostport = sim_mesh.qwen.http_url.removeprefix("http://")
    for form in (hostport, f"{sim_mesh.qwen.http_url}/v1", f"{sim_mesh.qwen.http_url}/v1/"):
        result = invoke(runner, form, "models", "--json")
        assert result.exit_code == 0, (form, result.output)
    monkeypatch.setenv("FABRIC_AGENT", hostport)
    assert runner.invoke(app, ["node", sim_mesh.llama.session_id[:10], "--json"]).exit_code == 0


@pytest.mark.slow
def test_a_port_without_the_agent_endpoints_says_where_they_are(
    runner: CliRunner, sim_mesh: SimMesh
) -> None:
    for args in (["nodes"], ["node", sim_mesh.bare.session_id[:8]], ["models"]):
        result = invoke(runner, sim_mesh.bare.http_url, *args)
        assert result.exit_code == 1
        assert "--admin" in one_error_line(result.stderr)


@pytest.mark.parametrize("agent", ["http://[bad", "ftp://host:8080", "http://:8080", "", "h:0"])
def test_a_malformed_agent_url_is_a_usage_error(runner: CliRunner, agent: str) -> None:
    result = runner.invoke(app, ["--agent", agent, "nodes"])
    assert result.exit_code == 2
    assert "--agent" in one_error_line(result.stderr)


def test_an_empty_session_id_is_a_usage_error(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--agent", "http://127.0.0.1:9", "node", ""])
    assert result.exit_code == 2
    assert "SESSION_ID" in one_error_line(result.stderr)


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["keys", "list", "--help"], 0),
        (["--agent", "http://127.0.0.1:9", "nodes"], 1),
        (["--agent", "http://127.0.0.1:9", "node", "abc"], 1),
        (["--agent", "http://127.0.0.1:9", "models", "--json"], 1),
        (["--agent", "http://[bad", "models"], 2),
        (["nodes", "--state", "asleep"], 2),
        (["node"], 2),
        (["models", "extra-arg"], 2),
        (["demo", "--nodes", "1"], 2),
        (["keys", "use", "nothex"], 2),
    ],
)
def test_exit_codes_of_the_console_script(
    argv: list[str], code: int, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run(argv) == code
    err = capsys.readouterr().err
    if code == 1:
        assert one_error_line(err).startswith("fabric: error: ")
    elif code == 2:
        assert "Traceback" not in err and err.strip()


def test_unreachable_agent_names_the_reason(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--agent", "http://127.0.0.1:9", "nodes", "--json"])
    assert result.exit_code == 1
    assert "connection refused" in one_error_line(result.stderr).lower()
    assert result.stdout == ""


@pytest.mark.slow
def test_an_ambiguous_prefix_lists_every_candidate(runner: CliRunner, mesh: LocalMesh) -> None:
    # Session ids are random: start agents until two share a first hex digit (at most 17).
    agents = mesh.start_many(4)
    while True:
        firsts: dict[str, list[AgentProcess]] = {}
        for a in agents:
            firsts.setdefault(a.session_id[0], []).append(a)
        clash = next((group for group in firsts.values() if len(group) > 1), None)
        if clash is not None:
            break
        agents.append(mesh.start())
    watcher = agents[0]
    wanted = {a.session_id for a in clash}

    def sees_them() -> bool:
        result = invoke(runner, watcher.http_url, "nodes", "--json")
        seen = {n["session_id"] for n in json.loads(result.stdout or '{"nodes": []}')["nodes"]}
        return wanted <= seen

    assert wait_until(sees_them, 20.0)
    prefix = clash[0].session_id[0]
    result = invoke(runner, watcher.http_url, "node", prefix)
    assert result.exit_code == 1
    line = one_error_line(result.stderr)
    assert f"session id prefix {prefix!r} is ambiguous" in line
    for a in clash:
        assert a.session_id[:12] in line
    assert "give more characters" in line
    longer = invoke(runner, watcher.http_url, "node", clash[0].session_id[:12], "--json")
    assert longer.exit_code == 0
    assert json.loads(longer.stdout)["session_id"] == clash[0].session_id


# -- keys: --json -------------------------------------------------------------------------------


def test_keys_commands_print_stable_json(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "ring.key"
    key = ["--cluster-key", str(path)]

    def doc(*args: str) -> dict[str, object]:
        result = runner.invoke(app, ["keys", *args, "--json"])
        assert result.exit_code == 0, result.output
        parsed: dict[str, object] = json.loads(result.stdout)
        return parsed

    created = doc("new-cluster", str(path))
    old = Keyring.load(path).primary.hex()
    assert created == {"path": str(path), "primary": old, "keys": [old]}
    added = doc("add", *key)
    new = str(added["added"])
    assert added == {"path": str(path), "primary": old, "keys": sorted([old, new]), "added": new}
    assert doc("use", new, *key) == {"path": str(path), "primary": new, "keys": sorted([old, new])}
    removed = doc("remove", old, *key)
    assert removed == {"path": str(path), "primary": new, "keys": [new], "removed": old}
    assert doc("list", *key) == {"path": str(path), "primary": new, "keys": [new]}

    provider_path = tmp_path / "p.key"
    provider = doc("new-provider", str(provider_path), "--provider", "lab-a")
    assert provider == {
        "path": str(provider_path),
        "provider": "lab-a",
        "fingerprint": ProviderKey.load(provider_path).fingerprint,
    }


# -- plan: models from a config.json or a model directory ----------------------------------------

REPO = Path(__file__).resolve().parents[2]

# A dense GQA model that is not in the built-in catalog: 40 layers of 5120, 40 query and 8 KV
# heads, a 100k vocabulary (about 14 B parameters), as its config.json would give it.
LAB_CODER_14B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "max_position_embeddings": 16384,
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 100352,
}


def plan_files(tmp_path: Path, model: str) -> list[str]:
    inventory = tmp_path / "inv.toml"
    inventory.write_text("[gpus]\nA100-80G = 4\n")
    workload = tmp_path / "wl.toml"
    workload.write_text(
        f'[[model]]\nname = "{model}"\nrate = 2\ninput_mean = 800\noutput_mean = 150\n'
    )
    return ["--inventory", str(inventory), "--workload", str(workload)]


def fabric_plan(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``fabric plan ARGS`` in a real process run from ``cwd`` (on this checkout's sources)."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env["FABRIC_HOME"] = str(cwd / "home")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "plan", "--time-limit", "2", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("catalog", "workload_name"),
    [
        ("models/lab-coder-14b/config.json", "lab-coder-14b"),
        ("models/lab-coder-14b/", "lab-coder-14b"),
        ("{dir}", "{dir}"),
        (None, "{dir}/"),  # no --catalog: the workload's path is read
    ],
)
def test_plan_places_a_model_given_by_its_config_json_or_directory(
    tmp_path: Path, catalog: str | None, workload_name: str
) -> None:
    directory = tmp_path / "models" / "lab-coder-14b"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(LAB_CODER_14B))
    extra = [] if catalog is None else ["--catalog", catalog.format(dir=directory)]
    files = plan_files(tmp_path, workload_name.format(dir=directory))
    result = fabric_plan(tmp_path, *files, *extra, "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert {a["model"] for a in doc["allocations"]} == {str(directory)}
    assert [w["model"] for w in doc["workload"]] == [str(directory)]
    assert doc["unservable"] == []


@pytest.mark.slow
def test_plan_with_a_broken_config_json_names_the_field_in_one_line(tmp_path: Path) -> None:
    directory = tmp_path / "lab-coder-14b"
    directory.mkdir()
    broken = {**LAB_CODER_14B, "num_hidden_layers": "40"}
    (directory / "config.json").write_text(json.dumps(broken))
    for given in (directory, directory / "config.json"):
        result = fabric_plan(
            tmp_path, *plan_files(tmp_path, "lab-coder-14b"), "--catalog", str(given)
        )
        assert result.returncode == 1
        line = one_error_line(result.stderr)
        assert line == (
            f"fabric: error: {directory / 'config.json'}: field 'num_hidden_layers' must be a "
            'positive integer, got "40"'
        )
        assert result.stdout == ""
    (directory / "config.json").unlink()
    result = fabric_plan(tmp_path, *plan_files(tmp_path, "x"), "--catalog", str(directory))
    assert result.returncode == 1
    assert one_error_line(result.stderr).endswith(
        "lab-coder-14b: no config.json in this directory (a Hugging Face model directory holds one)"
    )
