"""``load_config``: what the agent takes from the environment, read once and only here."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabricnode.config import (
    ConnectionLimits,
    TierLimits,
    default_api_keys_path,
    load_config,
)
from fabricnode.engine.command import connect_host
from fabricnode.errors import ConfigError


def env_in(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"FABRIC_HOME": str(tmp_path), "USER": "alice", **extra}


def test_default_api_keys_path_is_in_fabric_home(tmp_path: Path) -> None:
    assert default_api_keys_path(env_in(tmp_path)) == tmp_path / "api-keys.json"
    assert load_config(env=env_in(tmp_path)).api_keys_path == tmp_path / "api-keys.json"


@pytest.mark.parametrize("variable", ["SLURM_JOB_ID", "SLURM_JOBID"])
def test_job_id_names_the_request_log_under_either_spelling(tmp_path: Path, variable: str) -> None:
    config = load_config(env=env_in(tmp_path, **{variable: "4242"}))
    assert config.job_id == "4242"
    assert config.request_log_path is not None
    assert config.request_log_path.name.startswith("requests-4242-")


def test_outside_slurm_the_job_is_local(tmp_path: Path) -> None:
    config = load_config(env=env_in(tmp_path))
    assert config.job_id == "local"
    assert config.request_log_path is not None
    assert config.request_log_path.name.startswith("requests-local-")


def test_the_environment_is_captured_for_host_discovery(tmp_path: Path) -> None:
    env = env_in(tmp_path, CUDA_VISIBLE_DEVICES="1,3", SLURMD_NODENAME="gpu17")
    config = load_config(env=env)
    assert config.host_env == env
    env["CUDA_VISIBLE_DEVICES"] = "0"  # a later change of the caller's mapping is not seen
    assert config.host_env["CUDA_VISIBLE_DEVICES"] == "1,3"


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "[::]", "*"])
def test_a_wildcard_bind_is_never_advertised(tmp_path: Path, wildcard: str) -> None:
    config = load_config(http=f"{wildcard}:0", gossip=f"{wildcard}:0", env=env_in(tmp_path))
    assert config.advertise_host not in {"", "0.0.0.0", "::", "[::]", "*"}


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "[::]", "*", ""])
def test_an_engine_bound_to_a_wildcard_is_reached_on_loopback(wildcard: str) -> None:
    assert connect_host(wildcard) == "127.0.0.1"


def test_sim_args_reach_the_simulated_engine_after_the_agents_own_flags(tmp_path: Path) -> None:
    config = load_config(sim="m1", sim_args="--slowdown 10 --seed=3", env=env_in(tmp_path))
    assert config.engine is not None and config.engine.listener is not None
    argv = config.engine.argv
    assert argv[-3:] == ("--slowdown", "10", "--seed=3")
    assert argv[argv.index("--fd") + 1] == str(config.engine.listener.fileno())
    config.engine.listener.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sim_args": "--slowdown 2"}, "--sim-args needs --sim MODEL"),
        ({"sim": "m1", "sim_args": "--port 9000"}, "--port is set by the agent"),
        ({"sim": "m1", "sim_args": "--fd=7"}, "--fd is set by the agent"),
        ({"sim": "m1", "sim_args": "--seed 'unclosed"}, "--sim-args: No closing quotation"),
    ],
)
def test_bad_sim_args_are_one_config_error(
    tmp_path: Path, kwargs: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env=env_in(tmp_path), **kwargs)  # type: ignore[arg-type]


def test_connection_and_body_bounds_come_from_the_flags(tmp_path: Path) -> None:
    default = load_config(env=env_in(tmp_path)).ingress
    assert (default.max_connections, default.max_connections_per_client) == (4096, 1024)
    assert default.max_buffered_body_bytes == 512 * 1024 * 1024
    limits = ConnectionLimits(max_buffered_body_mb=64, max_connections=200)
    ingress = load_config(env=env_in(tmp_path), max_body_mb=8, limits=limits).ingress
    assert ingress.max_buffered_body_bytes == 64 * 1024 * 1024
    assert ingress.max_connections == 200
    assert ingress.max_connections_per_client == 200  # the default, capped by the total
    assert ingress.busy_connections == 150


@pytest.mark.parametrize(
    ("limits", "names"),
    [
        (ConnectionLimits(max_buffered_body_mb=4), "--max-buffered-body-mb"),  # < --max-body-mb
        (ConnectionLimits(max_connections=8), "--max-connections"),
        (ConnectionLimits(max_connections=100, max_connections_per_client=101), "per-client"),
    ],
)
def test_bounds_that_cannot_work_are_one_config_error(
    tmp_path: Path, limits: ConnectionLimits, names: str
) -> None:
    with pytest.raises(ConfigError, match=names):
        load_config(env=env_in(tmp_path), max_body_mb=16, limits=limits)


def test_the_batch_tiers_thresholds_come_from_the_flags(tmp_path: Path) -> None:
    default = load_config(env=env_in(tmp_path)).ingress
    assert (default.batch_kv_threshold, default.batch_max_waiting) == (0.7, 0)
    assert (default.batch_max_inflight_per_node, default.max_batch_waiting) == (32, 4096)
    assert (default.batch_max_wait_s, default.batch_priority) == (600.0, 1)
    limits = TierLimits(0.8, 2, 3, 100, 30.0, 5)
    ingress = load_config(env=env_in(tmp_path), tiers=limits).ingress
    assert (ingress.batch_kv_threshold, ingress.batch_max_waiting) == (0.8, 2)
    assert (ingress.batch_max_inflight_per_node, ingress.max_batch_waiting) == (3, 100)
    assert (ingress.batch_max_wait_s, ingress.batch_priority) == (30.0, 5)


@pytest.mark.parametrize(
    ("limits", "flag"),
    [
        (TierLimits(batch_kv_threshold=0.0), "--batch-kv-threshold"),
        (TierLimits(batch_kv_threshold=1.5), "--batch-kv-threshold"),
        (TierLimits(batch_kv_threshold=float("nan")), "--batch-kv-threshold"),
        (TierLimits(batch_max_waiting=-1), "--batch-max-waiting"),
        (TierLimits(batch_max_inflight_per_node=0), "--batch-max-inflight-per-node"),
        (TierLimits(max_batch_waiting=0), "--max-batch-waiting"),
        (TierLimits(batch_max_wait_s=0.0), "--batch-max-wait"),
        (TierLimits(batch_priority=0), "--batch-priority"),
    ],
)
def test_batch_thresholds_that_cannot_work_are_one_config_error(
    tmp_path: Path, limits: TierLimits, flag: str
) -> None:
    with pytest.raises(ConfigError, match=flag):
        load_config(env=env_in(tmp_path), tiers=limits)


def test_sleep_after_is_off_by_default_checked_and_opens_vllms_sleep_endpoints(
    tmp_path: Path,
) -> None:
    from fabricnode.config import engine_env

    assert load_config(env=env_in(tmp_path)).sleep_after_s is None
    for bad in (0.0, -1.0, float("nan"), 8 * 86400.0):
        with pytest.raises(ConfigError, match="--sleep-after"):
            load_config(env=env_in(tmp_path), sleep_after_s=bad)
    vllm = ["vllm", "serve", "m", "--enable-sleep-mode", "--port", "8001"]
    config = load_config(env=env_in(tmp_path), sleep_after_s=30.0, engine_cmd=vllm)
    assert config.sleep_after_s == 30.0 and config.engine is not None
    assert config.engine.argv == tuple(vllm)  # passed through exactly
    env = engine_env(config, config.engine)
    assert env is not None and env["VLLM_SERVER_DEV_MODE"] == "1" and env["USER"] == "alice"
    own = load_config(
        env=env_in(tmp_path, VLLM_SERVER_DEV_MODE="0"), sleep_after_s=30.0, engine_cmd=vllm
    )
    assert own.engine is not None and engine_env(own, own.engine) is None  # theirs stands
    sim = load_config(env=env_in(tmp_path), sleep_after_s=30.0, sim="m")
    assert sim.engine is not None and engine_env(sim, sim.engine) is None
    off = load_config(env=env_in(tmp_path), engine_cmd=vllm)
    assert off.engine is not None and engine_env(off, off.engine) is None


@pytest.mark.parametrize(
    "flag", ["a..b", "-node", "node-", "gpu 17", "0.0.0.0", "*", "x" * 64 + ".org", "a/b", "[::1]"]
)
def test_an_advertised_host_peers_would_drop_is_refused_at_start(tmp_path: Path, flag: str) -> None:
    """Every peer drops an entry naming a host no lookup can encode (``addr``): an agent
    started with one would serve, unlisted, without a word. It does not start."""
    with pytest.raises(ConfigError, match="--advertise"):
        load_config(advertise=flag, env=env_in(tmp_path))


@pytest.mark.parametrize("flag", ["gpu017", "gpu_17.cluster.example", "10.1.2.3", "::1"])
def test_host_names_and_addresses_are_advertised(tmp_path: Path, flag: str) -> None:
    assert load_config(advertise=flag, env=env_in(tmp_path)).advertise_host == flag


@pytest.mark.parametrize(
    "url", ["http://a..b:8000", "http://0.0.0.0:8000", "http://gpu 1:8000", "http://h:99999"]
)
def test_an_engine_url_no_one_can_connect_to_is_refused(tmp_path: Path, url: str) -> None:
    with pytest.raises(ConfigError, match="--engine-url"):
        load_config(engine_cmd=["vllm", "serve", "m"], engine_url=url, env=env_in(tmp_path))


@pytest.mark.parametrize("item", ["team=a\nb", "team=a\x85b", "te\u2028am=x", "team=\x1b[2J"])
def test_a_label_that_is_not_printable_is_refused_at_start(tmp_path: Path, item: str) -> None:
    with pytest.raises(ConfigError, match="--label"):
        load_config(labels=[item], env=env_in(tmp_path))


def test_the_batch_workers_input_buffer_is_set_in_mib_and_bounded(tmp_path: Path) -> None:
    config = load_config(env=env_in(tmp_path), batch_input_buffer_mb=8)
    assert config.batch.input_buffer_bytes == 8 * 1024 * 1024
    assert load_config(env=env_in(tmp_path)).batch.input_buffer_bytes == 64 * 1024 * 1024
    for bad in (0.5, float("nan"), 1e9):
        with pytest.raises(ConfigError, match="--batch-input-buffer-mb"):
            load_config(env=env_in(tmp_path), batch_input_buffer_mb=bad)


# -- the site -------------------------------------------------------------------------------------


def test_outside_slurm_without_a_site_the_agent_is_of_the_default_site(tmp_path: Path) -> None:
    assert load_config(env=env_in(tmp_path)).site == "default"
    assert load_config(env=env_in(tmp_path, FABRIC_SITE="  ")).site == "default"


def test_in_a_slurm_job_the_site_defaults_to_the_clusters_name(tmp_path: Path) -> None:
    env = env_in(tmp_path, SLURM_JOB_ID="7", SLURM_CLUSTER_NAME="alps")
    assert load_config(env=env).site == "alps"


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        ("C-2", {"FABRIC_SITE": "B", "SLURM_CLUSTER_NAME": "alps"}, "C-2"),
        (None, {"FABRIC_SITE": "B", "SLURM_CLUSTER_NAME": "alps"}, "B"),
        (None, {"FABRIC_SITE": " B ", "SLURM_CLUSTER_NAME": "bad name"}, "B"),
        (" lumi_c ", {}, "lumi_c"),
    ],
)
def test_the_site_flag_wins_over_the_environment_which_wins_over_slurm(
    tmp_path: Path, flag: str | None, env: dict[str, str], expected: str
) -> None:
    assert load_config(site=flag, env=env_in(tmp_path, SLURM_JOB_ID="7", **env)).site == expected


@pytest.mark.parametrize(
    ("flag", "env", "source"),
    [
        ("", {}, "--site ''"),
        ("a b", {}, "--site 'a b'"),
        ("-east", {}, "--site '-east'"),
        ("x" * 33, {}, "--site 'xxx"),
        ("zürich", {}, "--site 'zürich'"),
        (None, {"FABRIC_SITE": "a.b"}, "FABRIC_SITE 'a.b'"),
        (None, {"SLURM_CLUSTER_NAME": "a.b"}, "SLURM_CLUSTER_NAME 'a.b'"),
    ],
)
def test_a_site_name_that_breaks_the_rules_is_one_config_error_naming_its_source(
    tmp_path: Path, flag: str | None, env: dict[str, str], source: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(site=flag, env=env_in(tmp_path, SLURM_JOB_ID="7", **env))
    line = str(caught.value)
    assert line.startswith(source) and "\n" not in line
    if "SLURM" in source:
        assert "--site NAME" in line


def test_the_site_label_is_not_an_operator_label(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--site"):
        load_config(labels=["fabric.site=alps"], env=env_in(tmp_path))


def test_labels_leave_room_for_the_fabrics_own_and_the_site(tmp_path: Path) -> None:
    many = [f"k{i}=v" for i in range(33)]
    assert len(load_config(labels=many[:32], env=env_in(tmp_path)).labels) == 32
    with pytest.raises(ConfigError, match="at most 32"):
        load_config(labels=many, env=env_in(tmp_path))
