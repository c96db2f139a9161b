"""Reading an engine command line: kind, model, served name and URL."""

from __future__ import annotations

import socket

import pytest

from fabricnode.engine.command import (
    LOW_PORTS_FROM,
    OPENAI,
    SGLANG,
    VLLM,
    EngineCommand,
    detect_kind,
    ephemeral_low,
    free_port,
    inspect_engine_cmd,
    option_values,
    shutdown_grace_s,
    sim_engine_command,
    with_shutdown_grace,
)
from fabricnode.engine.service import stop_timeout_s
from fabricnode.errors import ConfigError

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def test_vllm_serve_defaults() -> None:
    argv = ["vllm", "serve", LLAMA, "--tensor-parallel-size", "4", "--max-model-len", "8192"]
    cmd = inspect_engine_cmd(argv)
    assert cmd == EngineCommand(tuple(argv), VLLM, LLAMA, (), "http://127.0.0.1:8000")
    assert cmd.model_hint == LLAMA


def test_argv_is_kept_exactly() -> None:
    argv = ["vllm", "serve", LLAMA, "--chat-template", "{% for m in messages %} x {% endfor %}"]
    assert inspect_engine_cmd(argv).argv == tuple(argv)


def test_vllm_port_host_and_served_name() -> None:
    cmd = inspect_engine_cmd(
        [
            *["vllm", "serve", LLAMA, "--host", "0.0.0.0", "--port", "8011"],
            *["--served-model-name", "llama-3-8b", "--dtype", "bfloat16"],
        ]
    )
    assert (cmd.url, cmd.model, cmd.served_model_names) == (
        "http://127.0.0.1:8011",
        LLAMA,
        ("llama-3-8b",),
    )
    assert cmd.model_hint == "llama-3-8b"


def test_equals_forms_and_last_occurrence_win() -> None:
    cmd = inspect_engine_cmd(
        ["vllm", "serve", LLAMA, "--port=9000", "--host=gpu-node-07", "--port", "9001"]
    )
    assert cmd.url == "http://gpu-node-07:9001"


def test_vllm_served_model_name_takes_several_names_first_is_the_hint() -> None:
    cmd = inspect_engine_cmd(
        ["vllm", "serve", LLAMA, "--served-model-name", "llama", "llama-8b", "--port", "8001"]
    )
    assert cmd.served_model_names == ("llama", "llama-8b")
    assert cmd.model_hint == "llama"
    underscored = inspect_engine_cmd(["vllm", "serve", LLAMA, "--served_model_name", "x"])
    assert underscored.model_hint == "x"


def test_vllm_openai_api_server_module() -> None:
    argv = [
        "/opt/venvs/vllm/bin/python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/scratch/models/tiny-llama",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--port",
        "8123",
    ]
    cmd = inspect_engine_cmd(argv)
    assert (cmd.kind, cmd.model, cmd.url) == (
        VLLM,
        "/scratch/models/tiny-llama",
        "http://127.0.0.1:8123",
    )


def test_vllm_cli_module_with_serve() -> None:
    cmd = inspect_engine_cmd(["python", "-m", "vllm.entrypoints.cli.main", "serve", LLAMA])
    assert (cmd.kind, cmd.model) == (VLLM, LLAMA)


def test_vllm_serve_with_model_flag() -> None:
    cmd = inspect_engine_cmd(["vllm", "serve", "--model", LLAMA, "--port", "8002"])
    assert (cmd.model, cmd.url) == (LLAMA, "http://127.0.0.1:8002")


def test_sglang_launch_server_defaults_and_flags() -> None:
    cmd = inspect_engine_cmd(["python3", "-m", "sglang.launch_server", "--model-path", LLAMA])
    assert (cmd.kind, cmd.model, cmd.url) == (SGLANG, LLAMA, "http://127.0.0.1:30000")
    cmd = inspect_engine_cmd(
        [
            *["python", "-m", "sglang.launch_server", "--model-path", LLAMA],
            *["--host", "::", "--port", "30001", "--tp", "2", "--served-model-name", "llama"],
        ]
    )
    assert (cmd.url, cmd.model_hint) == ("http://127.0.0.1:30001", "llama")


def test_launchers_in_front_do_not_hide_the_engine() -> None:
    srun = ["srun", "--gpus=4", "vllm", "serve", LLAMA, "--port", "8100"]
    assert inspect_engine_cmd(srun).kind == VLLM
    apptainer = ["apptainer", "exec", "--nv", "vllm.sif", "vllm", "serve", LLAMA]
    assert inspect_engine_cmd(apptainer).model == LLAMA
    uv = ["uv", "run", "python", "-m", "sglang.launch_server", "--model-path", LLAMA]
    assert inspect_engine_cmd(uv).kind == SGLANG
    assert detect_kind(["/usr/local/bin/vllm", "serve", "m"]) == (VLLM, 2)


def test_unknown_engine_is_openai_and_must_say_its_port() -> None:
    cmd = inspect_engine_cmd(["llama-server", "-m", "model.gguf", "--port", "8080"])
    assert (cmd.kind, cmd.url, cmd.model) == (OPENAI, "http://127.0.0.1:8080", None)
    with pytest.raises(ConfigError, match="--engine-url"):
        inspect_engine_cmd(["./my-server.sh"])


def test_dash_m_without_python_is_not_a_module() -> None:
    assert detect_kind(["llama-server", "-m", "vllm.gguf"])[0] == OPENAI


def test_engine_url_override_wins() -> None:
    cmd = inspect_engine_cmd(
        ["vllm", "serve", LLAMA, "--port", "8000"], engine_url="http://10.0.0.5:9999/"
    )
    assert cmd.url == "http://10.0.0.5:9999"
    assert inspect_engine_cmd(["./my-server.sh"], engine_url="https://h:1").url == "https://h:1"


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:8000"),
        ("::", "http://127.0.0.1:8000"),
        ("localhost", "http://localhost:8000"),
        ("10.1.2.3", "http://10.1.2.3:8000"),
        ("::1", "http://[::1]:8000"),
        ("[fe80::1]", "http://[fe80::1]:8000"),
    ],
)
def test_hosts_become_connectable_urls(host: str, url: str) -> None:
    assert inspect_engine_cmd(["vllm", "serve", LLAMA, "--host", host]).url == url


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["vllm", "serve", LLAMA, "--port", "eighty"], "not a port number"),
        (["vllm", "serve", LLAMA, "--port=80a"], "not a port number"),
        (["vllm", "serve", LLAMA, "--port", "-1"], "not a port number"),
        (["vllm", "serve", LLAMA, "--port", "0"], "outside 1-65535"),
        (["vllm", "serve", LLAMA, "--port", "70000"], "outside 1-65535"),
        (["vllm", "serve", LLAMA, "--port"], "--port needs a value"),
        (["vllm", "serve", LLAMA, "--port", "--host", "x"], "--port needs a value"),
        (["vllm", "serve", LLAMA, "--host", "bad host!"], "not a host"),
        ([], "empty"),
    ],
)
def test_nonsense_is_a_clear_config_error(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        inspect_engine_cmd(argv)


@pytest.mark.parametrize("url", ["10.0.0.5:9999", "ftp://h:1", "http://", "http://h:1 x"])
def test_bad_engine_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="--engine-url"):
        inspect_engine_cmd(["vllm", "serve", LLAMA], engine_url=url)


def test_option_values_absent_is_none() -> None:
    assert option_values(["vllm", "serve", "m"], "--port") is None
    assert option_values(["--portx", "1"], "--port") is None


def test_the_simulated_engine_command_holds_its_port_for_the_engine() -> None:
    # Regression: the port used to be chosen by binding port 0 and releasing it, so another
    # process could take it before the engine bound it, and every restart then failed.
    command = sim_engine_command("m", "H100")
    assert command.listener is not None
    port = command.listener.getsockname()[1]
    assert command.url == f"http://127.0.0.1:{port}"
    fd = command.argv[command.argv.index("--fd") + 1]
    assert fd == str(command.listener.fileno())
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    command.listener.close()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["vllm", "serve", LLAMA], False),
        (["vllm", "serve", LLAMA, "--scheduling-policy", "priority"], True),
        (["vllm", "serve", LLAMA, "--scheduling-policy=priority"], True),
        (["vllm", "serve", LLAMA, "--scheduling_policy", "priority"], True),
        (["vllm", "serve", LLAMA, "--scheduling-policy", "fcfs"], False),
        # the last occurrence wins, as with argparse
        (
            ["vllm", "serve", LLAMA, "--scheduling-policy=priority", "--scheduling-policy", "fcfs"],
            False,
        ),
        (
            [
                "srun",
                "python",
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                LLAMA,
                "--scheduling-policy",
                "priority",
            ],
            True,
        ),
        # a launcher's option of the same name is not the engine's
        (["tool", "--scheduling-policy", "priority", "vllm", "serve", LLAMA], False),
        # SGLang and unknown OpenAI servers: no priority field is ever sent to them
        (
            [
                "python",
                "-m",
                "sglang.launch_server",
                "--model-path",
                LLAMA,
                "--scheduling-policy",
                "priority",
            ],
            False,
        ),
        (["my-server", "--port", "9000", "--scheduling-policy", "priority"], False),
        # the simulated engine given as a plain command (an "openai" engine to the agent)
        (
            [
                "python",
                "-m",
                "fabricnode.simengine",
                "--model",
                "m",
                "--port",
                "9000",
                "--scheduling-policy",
                "priority",
            ],
            True,
        ),
        (["python3", "-m", "fabricnode.simengine", "--model", "m", "--port", "9000"], False),
    ],
)
def test_priority_scheduling_is_read_from_the_engine_command(
    argv: list[str], expected: bool
) -> None:
    assert inspect_engine_cmd(argv).priority_scheduling is expected


def test_the_simulated_engine_schedules_by_priority_when_its_flags_say_so() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        plain = sim_engine_command("m", "H100", listener=listener)
        priority = sim_engine_command(
            "m", "H100", "--scheduling-policy", "priority", listener=listener
        )
        assert not plain.priority_scheduling and priority.priority_scheduling


def test_free_port_comes_from_below_the_ephemeral_range_where_no_port_0_bind_lands() -> None:
    """A port picked for an engine that binds it later is one that bind(0) and outgoing
    connections never get: below the kernel's ephemeral range."""
    low = ephemeral_low()
    assert low is not None and low > LOW_PORTS_FROM  # Linux: 32768 by default
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert LOW_PORTS_FROM <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # and it is free


def test_free_port_skips_a_taken_low_port_and_falls_back_to_port_0_without_a_range() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", LOW_PORTS_FROM))
        # The only low port there is is taken: past its tries it binds port 0.
        port = free_port("127.0.0.1", ephemeral_from=LOW_PORTS_FROM + 1)
        assert port != LOW_PORTS_FROM and port > 0
    assert free_port("127.0.0.1", ephemeral_from=0) > 0  # no usable range: port 0
    assert ephemeral_low("/nonexistent/ip_local_port_range") is None


# -- the engine's own shutdown grace ------------------------------------------------------------


def test_vllm_aborts_on_sigterm_unless_its_shutdown_timeout_says_otherwise() -> None:
    assert shutdown_grace_s(inspect_engine_cmd(["vllm", "serve", LLAMA])) == 0.0
    given = inspect_engine_cmd(["vllm", "serve", LLAMA, "--shutdown-timeout=45"])
    assert shutdown_grace_s(given) == 45.0
    assert shutdown_grace_s(inspect_engine_cmd(["python", "-m", "sglang.launch_server"])) is None


def test_the_simulated_engine_grace_is_read_however_it_is_launched() -> None:
    sim = sim_engine_command("m", "H100")
    try:
        assert shutdown_grace_s(sim) == 5.0  # its default
    finally:
        assert sim.listener is not None
        sim.listener.close()
    wrapper = inspect_engine_cmd(
        ["/opt/bin/fabric", "sim-engine", "--model", "m", "--shutdown-grace-s", "30", "--port", "9"]
    )
    assert shutdown_grace_s(wrapper) == 30.0


def test_with_shutdown_grace_adds_the_option_only_where_the_command_lacks_it() -> None:
    plain = inspect_engine_cmd(["vllm", "serve", LLAMA, "--port", "9000"])
    added = with_shutdown_grace(plain, 40.2)
    assert added.argv == (*plain.argv, "--shutdown-timeout", "41")
    assert added.url == plain.url and added.kind == VLLM
    own = inspect_engine_cmd(["vllm", "serve", LLAMA, "--shutdown-timeout", "0"])
    assert with_shutdown_grace(own, 40.0) == own  # the researcher's choice stands
    other = inspect_engine_cmd(["python", "-m", "sglang.launch_server", "--port", "1"])
    assert with_shutdown_grace(other, 40.0) == other
    sim = sim_engine_command("m", "H100")
    try:
        assert with_shutdown_grace(sim, 40.0).argv[-2:] == ("--shutdown-grace-s", "40")
    finally:
        assert sim.listener is not None
        sim.listener.close()


def test_the_agent_waits_out_the_engines_own_grace_before_sigkill() -> None:
    assert stop_timeout_s(inspect_engine_cmd(["vllm", "serve", LLAMA])) == 10.0
    graced = inspect_engine_cmd(["vllm", "serve", LLAMA, "--shutdown-timeout", "30"])
    assert stop_timeout_s(graced) == 35.0  # not 10 s: it would undercut the engine's 30 s
