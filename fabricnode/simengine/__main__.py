"""``python -m fabricnode.simengine --model NAME --port PORT ...``: run the simulated engine.

Prints one line ``simengine ready url=http://HOST:PORT model=NAME gpu=GPU`` to stdout once it
listens (port 0 picks a free port; the line tells which; ``--fd N`` serves on a bound socket
inherited from the agent, which holds the port across restarts), and exits 0 on SIGTERM or
SIGINT after in-flight requests finish (bounded by ``--shutdown-grace-s``). Bad flags: one line
on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import socket
import sys

import trio

from fabricnode.addr import join_hostport
from fabricnode.asgi import bind_http_socket
from fabricnode.errors import ConfigError
from fabricnode.simengine.kvpublish import parse_config
from fabricnode.simengine.lora import parse_lora_module
from fabricnode.simengine.model import (
    ADMISSION_MODES,
    GPU_PROFILES,
    SCHEDULING_POLICIES,
    EngineConfig,
    gpu_profile,
)
from fabricnode.simengine.responses import DEFAULT_STORE_MAX_RESPONSES
from fabricnode.simengine.server import DEFAULT_WAKE_UP_S, FaultConfig, SimConfig, serve

log = logging.getLogger("fabricnode.simengine")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fabric sim-engine",
        description="A simulated OpenAI-compatible LLM engine (vLLM-like API and metrics).",
    )
    p.add_argument("--model", required=True, help="model id to serve")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port; 0 picks a free one")
    p.add_argument(
        "--fd",
        type=int,
        default=None,
        help="serve on this inherited bound socket instead of --host/--port (the agent's way)",
    )
    p.add_argument(
        "--gpu", default="H100", help=f"GPU profile: {', '.join(GPU_PROFILES)} (default H100)"
    )
    p.add_argument("--params-b", type=float, default=None, help="parameters in billions")
    p.add_argument("--speed", type=float, default=1.0, help="time speed-up factor (default 1)")
    p.add_argument("--max-model-len", type=int, default=8192, help="context length in tokens")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV-cache capacity in tokens")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running batch size limit")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="tokens computed per step at most (vLLM's flag; default 8192)",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action="store_true",
        help="compute a prompt over as many steps as the token budget needs, the running "
        "requests first, as vLLM's v1 engine does (default: a prompt in one step)",
    )
    p.add_argument(
        "--admission",
        choices=ADMISSION_MODES,
        default="optimistic",
        help="optimistic: admit when the prompt's KV blocks fit, grow on demand and preempt the "
        "newest request when blocks run out (vLLM); reserve: reserve prompt + max_tokens at "
        "admission, never preempt (default optimistic)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="fcfs: first come, first served (a request's non-zero priority is refused with 400);"
        " priority: waiting requests by (priority, arrival), lower first, and the highest "
        "priority value is preempted first (vLLM's flag; default fcfs)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for output text and faults")
    p.add_argument("--crash-after-requests", type=int, default=None, metavar="N")
    p.add_argument("--crash-after-s", type=float, default=None, metavar="T")
    p.add_argument("--hang-after-s", type=float, default=None, metavar="T")
    p.add_argument("--slowdown", type=float, default=1.0, metavar="X", help="step time factor")
    p.add_argument("--error-rate", type=float, default=0.0, metavar="P", help="500 probability")
    p.add_argument("--shutdown-grace-s", type=float, default=5.0)
    p.add_argument(
        "--wake-up-s",
        type=float,
        default=DEFAULT_WAKE_UP_S,
        metavar="T",
        help="sleep mode: how long POST /wake_up takes (default %(default)g)",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (as vLLM's flag): /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter, adapters in /v1/models",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters loaded at start (needs --enable-lora); NAME=PATH or vLLM's JSON form",
    )
    p.add_argument(
        "--responses-store-max",
        type=int,
        default=DEFAULT_STORE_MAX_RESPONSES,
        metavar="N",
        help="stored /v1/responses kept, the oldest evicted first (default %(default)s)",
    )
    p.add_argument(
        "--step-log",
        default=None,
        metavar="PATH",
        help="append one JSON line per engine step to PATH: when it started, its duration, the "
        "prompts it admitted (priority, tokens, seconds queued), the queue, KV use (for "
        "experiments: it costs a write per step)",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish the prefix cache's KV-cache events over ZMQ, as vLLM's flag (its JSON: "
        "enable_kv_cache_events, publisher, endpoint, topic, hwm)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage says the prompt tokens found in the prefix cache (as vLLM's flag: "
        "prompt_tokens_details.cached_tokens)",
    )
    p.add_argument(
        "--kv-events-encoding",
        choices=("tagged", "positional"),
        default="tagged",
        help="the events as vLLM 0.32 encodes them (tagged maps) or as the vLLM before mid-2026 "
        "(positional arrays)",
    )
    p.add_argument("--log-level", default="WARNING")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The ``SimConfig`` for parsed flags; ``ConfigError`` names the bad flag."""
    try:
        gpu = gpu_profile(args.gpu)
    except ValueError as exc:
        raise ConfigError(f"--gpu: {exc}") from None
    positive = {
        "--speed": args.speed,
        "--slowdown": args.slowdown,
        "--max-model-len": args.max_model_len,
        "--max-num-seqs": args.max_num_seqs,
        "--max-num-batched-tokens": args.max_num_batched_tokens,
    }
    for flag, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{flag}: must be positive, got {value}")
    if args.params_b is not None and args.params_b <= 0:
        raise ConfigError(f"--params-b: must be positive, got {args.params_b}")
    if args.kv_tokens is not None and args.kv_tokens < 16:
        raise ConfigError(f"--kv-tokens: must be at least 16, got {args.kv_tokens}")
    if not 0.0 <= args.error_rate <= 1.0:
        raise ConfigError(f"--error-rate: must be in 0..1, got {args.error_rate}")
    if args.crash_after_requests is not None and args.crash_after_requests < 1:
        raise ConfigError("--crash-after-requests: must be at least 1")
    for flag, value in (
        ("--crash-after-s", args.crash_after_s),
        ("--hang-after-s", args.hang_after_s),
        ("--wake-up-s", args.wake_up_s),
    ):
        if value is not None and value < 0:
            raise ConfigError(f"{flag}: must not be negative")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: {args.port} is not a port number")
    kv_events = None
    if args.kv_events_config is not None:
        kv_events = parse_config(args.kv_events_config, args.kv_events_encoding)
    engine = EngineConfig(
        model=args.model,
        gpu=gpu,
        params_b=args.params_b,
        speed=args.speed,
        max_model_len=args.max_model_len,
        kv_tokens=args.kv_tokens,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill=args.enable_chunked_prefill,
        seed=args.seed,
        admission=args.admission,
        scheduling_policy=args.scheduling_policy,
        kv_events=kv_events is not None,
    )
    faults = FaultConfig(
        crash_after_requests=args.crash_after_requests,
        crash_after_s=args.crash_after_s,
        hang_after_s=args.hang_after_s,
        slowdown=args.slowdown,
        error_rate=args.error_rate,
    )
    if not math.isfinite(args.wake_up_s) or args.wake_up_s > 3600:
        raise ConfigError(f"--wake-up-s: expected 0..3600 seconds, got {args.wake_up_s}")
    if args.lora_modules and not args.enable_lora:
        raise ConfigError("--lora-modules: LoRA adapters need --enable-lora")
    modules = tuple(parse_lora_module(text) for text in args.lora_modules)
    for name, _ in modules:
        if name == args.model:
            raise ConfigError(f"--lora-modules: {name!r} is the base model's name")
    if args.responses_store_max < 1:
        raise ConfigError(
            f"--responses-store-max: must be at least 1, got {args.responses_store_max}"
        )
    return SimConfig(
        engine,
        faults,
        shutdown_grace_s=args.shutdown_grace_s,
        wake_up_s=args.wake_up_s,
        enable_lora=args.enable_lora,
        lora_modules=modules,
        responses_store_max=args.responses_store_max,
        step_log=args.step_log,
        kv_events=kv_events,
        prompt_tokens_details=args.enable_prompt_tokens_details,
    )


def listen_socket(host: str, port: int, fd: int | None) -> socket.socket:
    """The socket to serve on: the inherited ``--fd``, else a new one on ``--host``/``--port``."""
    if fd is None:
        return bind_http_socket(host, port, "--port")
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ConfigError(f"--fd {fd}: not an inherited socket: {exc.strerror or exc}") from None
    if sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise ConfigError(f"--fd {fd}: not a TCP socket")
    return sock


async def run(config: SimConfig, sock: socket.socket) -> None:
    host, port = sock.getsockname()[:2]
    url = f"http://{join_hostport(host, port)}"
    shutdown = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch_signals() -> None:
                async for signum in signals:
                    log.info("signal %d: shutting down", signum)
                    shutdown.set()

            nursery.start_soon(watch_signals)
            async with trio.open_nursery() as server:
                await server.start(serve, config, sock, shutdown)
                engine = config.engine
                print(
                    f"simengine ready url={url} model={engine.model} gpu={engine.gpu.name}",
                    flush=True,
                )
            # serve() has returned: SIGTERM came and hypercorn drained the in-flight requests.
            nursery.cancel_scope.cancel()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = config_from_args(args)
        sock = listen_socket(args.host, args.port, args.fd)
        trio.run(run, config, sock)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
