"""What every ``fabric`` command shares: the global options, one-line errors, output helpers.

The root callback in ``cli.main`` stores ``--agent`` and ``--debug`` in a context variable;
commands read them through ``state()``. ``handled`` is the decorator that turns an expected
failure (a ``FabricError`` or an ``OSError``) into ``fabric: error: ...`` and exit status 1;
``usage_error`` is exit status 2 (bad usage), as the module docstring of ``cli.main`` promises.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer
from rich.console import Console

from fabricnode.control.client import AdminClient, BatchClient, agent_base_url
from fabricnode.errors import ConfigError, FabricError

DEFAULT_AGENT = "http://127.0.0.1:8080"

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class CliState:
    agent_url: str = DEFAULT_AGENT
    api_key: str | None = None  # sent to the agent (needed once API keys are on)
    debug: bool = False


# The global options of the command being run (set by the root callback, read by commands).
STATE: ContextVar[CliState] = ContextVar("fabric_cli_state")


def command_group(help_text: str | None = None) -> typer.Typer:
    """A typer app holding some of ``fabric``'s commands, with the root app's settings.

    Without a name, ``cli.main`` merges its commands into ``fabric`` itself (``fabric nodes``);
    with one, they form a group (``fabric keys ...``).
    """
    return typer.Typer(help=help_text, no_args_is_help=True, rich_markup_mode=None)


def state() -> CliState:
    return STATE.get(CliState())


def error(message: str) -> None:
    print(f"fabric: error: {message}", file=sys.stderr)


def usage_error(command: str, message: str) -> NoReturn:
    print(f"fabric {command}: error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def handled(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn expected failures into one line on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (FabricError, OSError) as exc:
            if state().debug:
                raise
            if isinstance(exc, OSError) and not isinstance(exc, FabricError):
                where = f"{exc.filename}: " if exc.filename else ""
                error(f"{where}{exc.strerror or exc}")
            else:
                error(str(exc))
            raise typer.Exit(1) from None

    return wrapper


def console() -> Console:
    # Wide when piped, so tables are not wrapped at 80 columns in logs and scripts.
    return Console(width=None if sys.stdout.isatty() else 200, highlight=False)


JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def agent_client(command: str) -> AdminClient:
    """A client of the agent named by --agent / $FABRIC_AGENT; a malformed URL is bad usage."""
    return AdminClient(_agent_url(command), api_key=state().api_key)


def batch_client(command: str) -> BatchClient:
    """A client of the Batch API of the agent named by --agent / $FABRIC_AGENT, with the key of
    --api-key / $FABRIC_API_KEY (the batches it sees are that key's)."""
    return BatchClient(_agent_url(command), api_key=state().api_key)


def _agent_url(command: str) -> str:
    try:
        return agent_base_url(state().agent_url)
    except ConfigError as exc:
        usage_error(command, f"--agent: {exc}")


def check_labels(labels: list[str] | None) -> list[str]:
    for label in labels or []:
        key, sep, _ = label.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{label!r}: expected KEY=VALUE", param_hint="--label")
    return labels or []
