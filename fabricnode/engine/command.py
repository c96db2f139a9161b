"""What an engine command line says about the engine: its kind, model and URL.

Theory of operation
-------------------
The supervisor runs ENGINE_CMD exactly as given (an argv, never re-split); this module only
reads it. The engine is found anywhere in the argv, so launchers in front of it (``srun``,
``uv run``, ``apptainer exec IMAGE``, ``env VAR=1``) do not hide it:

- vLLM: ``vllm serve MODEL ...`` or ``python -m vllm.entrypoints.openai.api_server --model M``
- SGLang: ``python -m sglang.launch_server --model-path M ...``
- anything else is an ``openai`` engine (an OpenAI-compatible server we know nothing about).

Options are read after the engine's own start (for ``openai``, anywhere), in both ``--opt V``
and ``--opt=V`` forms, the last occurrence winning as with argparse. ``--served-model-name``
(its first name) is the model hint, else the model. The URL is ``engine_url`` when given, else
``http://HOST:PORT`` from ``--host``/``--port`` with the engine's defaults (vLLM 8000, SGLang
30000; an ``openai`` engine must say its port); wildcard hosts (``0.0.0.0``, ``::``) become
``127.0.0.1`` since the URL is for connecting. Nonsense raises ``ConfigError``.

Whether the engine orders its queue by the requests' ``priority`` field
(``EngineCommand.priority_scheduling``) is read the same way: vLLM or the simulated engine (from
``--sim``, or ``python -m fabricnode.simengine`` given as the command) with
``--scheduling-policy priority`` (vLLM's flag; the simulated engine takes it too).

The engine's own shutdown grace (``shutdown_grace_s``): what it does with the requests it runs
when it gets SIGTERM, which on Slurm comes to every process of the job step at once, the engine
as well as the agent. vLLM (0.32) aborts them at once unless ``--shutdown-timeout N`` lets them
finish for up to N s (it refuses new ones meanwhile); the simulated engine finishes them for
``--shutdown-grace-s`` (5 s by default). ``with_shutdown_grace`` adds the option to a command
that does not give it, so that the engine outlasts the agent's drain (``engine.drain``); a
command that gives it keeps its own. Other engines are left as they are.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from fabricnode.addr import WILDCARD_HOSTS, split_hostport
from fabricnode.errors import ConfigError

VLLM = "vllm"
SGLANG = "sglang"
OPENAI = "openai"
SIM = "sim"  # the built-in simulated engine (``sim_engine_command``)
SIM_MODULE = "fabricnode.simengine"
DEFAULT_PORTS = {VLLM: 8000, SGLANG: 30000}
CONNECT_HOST = "127.0.0.1"

_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9\-_.]*[A-Za-z0-9])?")


@dataclass(frozen=True)
class EngineCommand:
    """What ENGINE_CMD says: kind, model, served names, and where to reach the engine."""

    argv: tuple[str, ...]
    kind: str
    model: str | None
    served_model_names: tuple[str, ...]
    url: str
    # A socket bound for the engine, which every child of this command inherits (``--fd``):
    # the agent holds the port for as long as the command lives, so no other process can take
    # it between choosing it and the engine binding it, or between two restarts.
    listener: socket.socket | None = field(default=None, compare=False, repr=False)

    @property
    def model_hint(self) -> str | None:
        """The model id the engine should report: the first served name, else the model."""
        return self.served_model_names[0] if self.served_model_names else self.model

    @property
    def priority_scheduling(self) -> bool:
        """Does the engine serve waiting requests by their ``priority`` field (lower first, and
        preempt the highest value first)? vLLM and the simulated engine do with
        ``--scheduling-policy priority`` (either spelling, ``--opt V`` or ``--opt=V``, the last
        one winning); under their default, ``fcfs``, a non-zero priority is refused (400)."""
        _, start = detect_kind(self.argv)
        if self.kind not in (VLLM, SIM):
            start = _simengine_start(self.argv)  # the simulated engine as a plain command
            if start < 0:
                return False
        try:
            values = option_values(self.argv[start:], *_spellings("--scheduling-policy"))
        except ConfigError:
            return False
        return values is not None and values[-1] == "priority"


def detect_kind(argv: Sequence[str]) -> tuple[str, int]:
    """The engine kind and the index in ``argv`` where the engine's own arguments start."""
    for i, token in enumerate(argv):
        name = os.path.basename(token)
        if name == "vllm" and i + 1 < len(argv) and argv[i + 1] == "serve":
            return VLLM, i + 2
        module = None
        if token == "-m" and i + 1 < len(argv) and _is_python(argv[:i]):
            module = argv[i + 1]
        elif token.startswith("-m") and len(token) > 2 and _is_python(argv[:i]):
            module = token[2:]
        if module is not None:
            if module == "vllm" or module.startswith("vllm."):
                return VLLM, i + 2 if token == "-m" else i + 1
            if module == "sglang.launch_server":
                return SGLANG, i + 2 if token == "-m" else i + 1
    return OPENAI, 0


def _simengine_start(argv: Sequence[str]) -> int:
    """Where the simulated engine's own arguments start in ``argv`` when it runs it as a plain
    command (``python -m fabricnode.simengine ...``, an ``openai`` engine to the agent), else
    -1."""
    for i, token in enumerate(argv[:-1]):
        if token == "-m" and argv[i + 1] == SIM_MODULE and _is_python(argv[:i]):
            return i + 2
    return -1


def _sim_start(argv: Sequence[str]) -> int:
    """Where the simulated engine's own arguments start in ``argv`` (``--sim``, ``python -m
    fabricnode.simengine``, ``fabric sim-engine``), else -1."""
    start = _simengine_start(argv)
    if start >= 0:
        return start
    for i, token in enumerate(argv[:-1]):
        if os.path.basename(token) == "fabric" and argv[i + 1] == "sim-engine":
            return i + 2
    return -1


# The engines' shutdown options and their defaults (module docstring).
VLLM_SHUTDOWN_OPTION = "--shutdown-timeout"
SIM_SHUTDOWN_OPTION = "--shutdown-grace-s"
SIM_DEFAULT_GRACE_S = 5.0


def shutdown_grace_s(command: EngineCommand) -> float | None:
    """How long the engine lets running requests finish after SIGTERM, as its command says
    (0: it aborts them); None for an engine whose rules we do not know."""
    if command.kind == VLLM:
        _, start = detect_kind(command.argv)
        option, default = VLLM_SHUTDOWN_OPTION, 0.0
    else:
        start = _sim_start(command.argv)
        if start < 0:
            return None
        option, default = SIM_SHUTDOWN_OPTION, SIM_DEFAULT_GRACE_S
    try:
        values = option_values(command.argv[start:], option)
        return default if values is None else max(0.0, float(values[-1]))
    except (ConfigError, ValueError):
        return None


def with_shutdown_grace(command: EngineCommand, grace_s: float) -> EngineCommand:
    """``command`` with the engine's shutdown option set to ``grace_s`` (whole seconds, up)
    when it is vLLM or the simulated engine and does not set it itself."""
    if command.kind == VLLM:
        _, start = detect_kind(command.argv)
        option = VLLM_SHUTDOWN_OPTION
    else:
        start = _sim_start(command.argv)
        if start < 0:
            return command
        option = SIM_SHUTDOWN_OPTION
    try:
        if option_values(command.argv[start:], option) is not None:
            return command
    except ConfigError:
        return command
    argv = (*command.argv, option, str(math.ceil(grace_s)))
    return replace(command, argv=argv)


def _is_python(before: Sequence[str]) -> bool:
    """Whether a python interpreter appears before a ``-m`` (so ``-m`` is python's option)."""
    return any(_PYTHON.fullmatch(os.path.basename(t)) for t in before)


def option_values(args: Sequence[str], *names: str, nargs_plus: bool = False) -> list[str] | None:
    """The values of the last occurrence of any of ``names`` (``--opt V`` or ``--opt=V``); with
    ``nargs_plus`` every following token up to the next option. None when absent;
    ConfigError when present without a value."""
    found: list[str] | None = None
    i = 0
    while i < len(args):
        token = args[i]
        key, eq, inline = token.partition("=")
        if token.startswith("--") and key in names:
            if eq:
                found = [inline]
            else:
                values = []
                j = i + 1
                while j < len(args) and not _is_option(args[j]):
                    values.append(args[j])
                    j += 1
                    if not nargs_plus:
                        break
                if not values:
                    raise ConfigError(f"engine command: {key} needs a value")
                found = values
                i = j - 1
        i += 1
    return found


def _is_option(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not _looks_negative_number(token)


def _looks_negative_number(token: str) -> bool:
    return re.fullmatch(r"-\d+(\.\d+)?", token) is not None


def _one(args: Sequence[str], *names: str) -> str | None:
    values = option_values(args, *names)
    return values[-1] if values else None


def _spellings(name: str) -> tuple[str, str]:
    """``--served-model-name`` and ``--served_model_name`` (vLLM accepts both)."""
    return name, "--" + name[2:].replace("-", "_")


def parse_port(text: str) -> int:
    if not text.strip().isdigit():
        raise ConfigError(f"engine command: --port {text!r} is not a port number")
    port = int(text)
    if not 1 <= port <= 65535:
        raise ConfigError(f"engine command: --port {port} is outside 1-65535")
    return port


def connect_host(host: str) -> str:
    """The host to connect to for a server bound to ``host``; IPv6 literals bracketed."""
    host = host.strip()
    if host in WILDCARD_HOSTS:
        return CONNECT_HOST
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in bare:
        if not re.fullmatch(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9_.\-]+)?", bare):
            raise ConfigError(f"engine command: --host {host!r} is not a host name or address")
        return f"[{bare}]"
    if not _HOSTNAME.fullmatch(bare):
        raise ConfigError(f"engine command: --host {host!r} is not a host name or address")
    return bare


def normalise_engine_url(url: str) -> str:
    """An ``--engine-url`` checked and without a trailing slash."""
    url = url.strip()
    match = re.fullmatch(r"(https?)://([^/\s?#]+)(/[^\s?#]*)?", url)
    if match is None:
        raise ConfigError(f"--engine-url {url!r}: expected http://HOST:PORT or https://HOST:PORT")
    # The URL is published in the node's entry and connected to: a host no lookup can encode
    # or a wildcard is refused here, not found out by the first request.
    try:
        host, _ = split_hostport(
            match.group(2), default_port=443 if match.group(1) == "https" else 80
        )
    except ConfigError as exc:
        raise ConfigError(f"--engine-url {url!r}: {exc}") from None
    if host in WILDCARD_HOSTS:
        raise ConfigError(f"--engine-url {url!r}: {host!r} is a wildcard, not an address")
    return url.rstrip("/")


def inspect_engine_cmd(argv: Sequence[str], engine_url: str | None = None) -> EngineCommand:
    """What ``argv`` says about its engine; ``engine_url`` (``--engine-url``) overrides the URL."""
    if not argv:
        raise ConfigError("engine command is empty")
    kind, start = detect_kind(argv)
    args = list(argv[start:])

    positional = kind == VLLM and argv[start - 1] == "serve"
    if kind == VLLM and args[:1] == ["serve"]:  # python -m vllm.entrypoints.cli.main serve M
        args, positional = args[1:], True
    model = None
    if positional and args and not args[0].startswith("-"):
        model = args[0]
    if model is None:
        names = ("--model-path", "--model") if kind == SGLANG else ("--model",)
        model = _one(args, *names)
    served = tuple(
        option_values(args, *_spellings("--served-model-name"), nargs_plus=kind == VLLM) or ()
    )

    port_text = _one(args, "--port")
    port = parse_port(port_text) if port_text is not None else None
    host_text = _one(args, "--host")
    host = connect_host(host_text) if host_text is not None else CONNECT_HOST
    if engine_url is not None:
        url = normalise_engine_url(engine_url)
    else:
        if port is None:
            port = DEFAULT_PORTS.get(kind)
        if port is None:
            raise ConfigError(
                "cannot tell which port the engine listens on: "
                "give it --port in the engine command, or pass --engine-url"
            )
        url = f"http://{host}:{port}"
    return EngineCommand(tuple(argv), kind, model, served, url)


# Linux hands out ports in this range for bind(port 0) and for outgoing connections; a port
# picked below it cannot be taken by either in the moment before the engine binds it.
EPHEMERAL_RANGE_PATH = "/proc/sys/net/ipv4/ip_local_port_range"
LOW_PORTS_FROM = 10_000  # below this: well-known and registered services' fixed ports
FREE_PORT_TRIES = 64


def ephemeral_low(path: str = EPHEMERAL_RANGE_PATH) -> int | None:
    """The first port of the kernel's ephemeral range, None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = CONNECT_HOST, *, ephemeral_from: int | None = None) -> int:
    """A TCP port free on ``host`` now, for an engine we launch to bind a moment later (engines
    that can inherit a socket get ``bind_listener`` instead).

    vLLM binds its port only after it has started (16 s in the test suite's runs), and every
    port-0 bind and outgoing connection on the node in the meantime gets a port of the
    ephemeral range: a port picked there by bind(0) was taken by another process's listener
    once in a busy test run ("Address already in use"), and can be on a shared compute node.
    So the port comes from below that range (``LOW_PORTS_FROM`` up to its start), where only
    a process binding that very port could take it; bind(0) when the range is unknown or no
    low port is free."""
    low = ephemeral_low() if ephemeral_from is None else ephemeral_from
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if low is not None and low > LOW_PORTS_FROM:
        rng = random.Random()
        for _ in range(FREE_PORT_TRIES):
            port = rng.randrange(LOW_PORTS_FROM, low)
            with socket.socket(family) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def bind_listener(host: str = CONNECT_HOST, port: int = 0) -> socket.socket:
    """A TCP socket bound on ``host`` (port 0: any free one) for an engine child to inherit."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot bind a port for the engine on {host}: {exc}") from None
    return sock


def sim_engine_command(
    model: str, gpu_type: str, *extra: str, listener: socket.socket | None = None
) -> EngineCommand:
    """The built-in simulated engine as a child, serving on ``listener`` (default: a new socket
    on a free loopback port), which it inherits as ``--fd``."""
    from fabricnode.simengine.model import GPU_PROFILES  # the profiles it can simulate

    if gpu_type not in GPU_PROFILES:
        raise ConfigError(
            f"--sim-gpu {gpu_type!r}: the simulated engine knows {', '.join(GPU_PROFILES)}"
        )
    if listener is None:
        listener = bind_listener()
    port = listener.getsockname()[1]
    argv: tuple[str, ...] = (sys.executable, "-m", SIM_MODULE, "--model", model)
    argv += ("--fd", str(listener.fileno()), "--gpu", gpu_type, *extra)
    return EngineCommand(argv, SIM, model, (), f"http://{CONNECT_HOST}:{port}", listener)


# -- KV-cache events (issue 42) ----------------------------------------------------------------

KV_EVENTS_OPTION = "--kv-events-config"
KV_EVENTS_TOPIC = "kv-events"


@dataclass(frozen=True)
class KvSubscription:
    """Where the agent reads its engine's KV-cache events: the endpoint, and whether the agent
    binds it (the engine connects: vLLM's publisher connects to an endpoint without ``*``) or
    connects to it (the engine binds ``tcp://*:PORT``)."""

    endpoint: str
    bind: bool
    topic: str


def kv_events_supported(command: EngineCommand) -> bool:
    """Whether the agent reads this engine's KV-cache events: vLLM's and the simulated
    engine's (SGLang's have their own stream: not yet)."""
    return _own_options(command) >= 0


def _own_options(command: EngineCommand) -> int:
    """Where vLLM's or the simulated engine's own options start in ``command`` (-1: another
    engine, whose KV-cache events we do not read yet)."""
    if command.kind == VLLM:
        return detect_kind(command.argv)[1]
    return _sim_start(command.argv)


def given_kv_events(command: EngineCommand) -> str | None:
    """The JSON of ``command``'s own ``--kv-events-config`` (None: not given, or not vLLM nor
    the simulated engine; "": given but unreadable)."""
    start = _own_options(command)
    if start < 0:
        return None
    try:
        values = option_values(command.argv[start:], KV_EVENTS_OPTION)
    except ConfigError:
        return ""
    return None if values is None else values[-1]


def kv_subscription(text: str) -> KvSubscription | None:
    """The subscription an engine's ``--kv-events-config`` JSON asks for; None: events off, or
    an endpoint this host cannot read (another host's, an IPC path)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("enable_kv_cache_events") is not True:
        return None
    if (doc.get("publisher") or "zmq") != "zmq":
        return None
    endpoint, topic = doc.get("endpoint", "tcp://*:5557"), doc.get("topic", "")
    if not isinstance(endpoint, str) or not isinstance(topic, str):
        return None
    if endpoint.startswith("tcp://*:"):  # the engine binds all interfaces: connect to it here
        return KvSubscription(endpoint.replace("*", CONNECT_HOST, 1), False, topic)
    if endpoint.startswith(f"tcp://{CONNECT_HOST}:"):  # the engine connects: we bind it
        return KvSubscription(endpoint, True, topic)
    return None


def with_kv_events(command: EngineCommand, endpoint: str) -> EngineCommand:
    """``command`` with ``--kv-events-config`` publishing to ``endpoint`` (on localhost, which
    the agent binds: the engine connects) under the topic ``KV_EVENTS_TOPIC``, when it is vLLM
    or the simulated engine and does not give the option itself."""
    if _own_options(command) < 0 or given_kv_events(command) is not None:
        return command
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": KV_EVENTS_TOPIC}  # fmt: skip
    return replace(command, argv=(*command.argv, KV_EVENTS_OPTION, json.dumps(config)))
