"""The ``fabric`` command: parses, calls library code, renders. Nothing else lives here.

Exit status: 0 success, 1 a failed operation (agent unreachable, key file missing, unknown
node, ...), 2 bad usage (unknown option, malformed value). Errors are one line on stderr,
``fabric: error: ...``; ``--debug`` shows the traceback instead.

``fabric start -- ENGINE_CMD`` supervises the engine command (argv passed through exactly).

This module is the entry point: the global options, the command list and the error handling
of a run. The commands live one family per module (``start_cmd``, ``registry_cmd``,
``plan_cmd``, ``demo_cmd``, ``keys_cmd``, ``slurm_cmd``, ``services_cmd``, ``batch_cmd``), their
shared helpers in ``common``.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from cli import demo_cmd, plan_cmd, registry_cmd, start_cmd
from cli.batch_cmd import batch_app
from cli.common import DEFAULT_AGENT, STATE, CliState, error
from cli.keys_cmd import keys_app
from cli.services_cmd import services_app
from cli.slurm_cmd import slurm_app

app = typer.Typer(
    name="fabric",
    help="Peer-to-peer OpenAI-compatible LLM serving mesh for Slurm clusters.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
# In the order `fabric --help` lists them; the unnamed ones are merged into `fabric` itself.
app.add_typer(start_cmd.commands)
app.add_typer(registry_cmd.commands)
app.add_typer(plan_cmd.commands)
app.add_typer(demo_cmd.commands)
app.add_typer(keys_app, name="keys")
app.add_typer(slurm_app, name="slurm")
app.add_typer(services_app, name="services")
app.add_typer(batch_app, name="batch")


@app.callback()
def _root(
    ctx: typer.Context,
    agent: Annotated[
        str,
        typer.Option(
            "--agent",
            metavar="URL",
            envvar="FABRIC_AGENT",
            help="Agent to talk to (default $FABRIC_AGENT, else http://127.0.0.1:8080).",
            show_envvar=False,
        ),
    ] = DEFAULT_AGENT,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            metavar="KEY",
            envvar="FABRIC_API_KEY",
            help="API key sent to the agent once API keys are on (default $FABRIC_API_KEY): "
            "an admin key (`fabric keys api-new NAME --admin`) for the registry views, your "
            "own for `fabric batch` (batches belong to the key that created them).",
            show_envvar=False,
        ),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    chosen = ctx.obj if isinstance(ctx.obj, CliState) else CliState()
    chosen.agent_url = agent
    chosen.api_key = api_key or None
    chosen.debug = debug
    ctx.obj = chosen
    STATE.set(chosen)


def run(argv: list[str]) -> int:
    """Run the CLI on ``argv``; returns the exit status (one-line errors, see module doc)."""
    state = CliState()
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="fabric", obj=state, standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        return 130
    except Exception as exc:
        code = getattr(exc, "exit_code", None)
        if isinstance(code, int) and hasattr(exc, "format_message"):  # click's usage errors
            return _show_click_error(exc, code)
        if state.debug:
            raise
        error(f"internal error: {type(exc).__name__}: {exc} (run with --debug for details)")
        return 1
    return int(result) if isinstance(result, int) else 0


def _show_click_error(exc: Exception, code: int) -> int:
    ctx = getattr(exc, "ctx", None)
    where = getattr(ctx, "command_path", "") or "fabric"
    if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
        print(ctx.get_help(), file=sys.stderr)
        return code
    hint = f" (see `{where} --help`)" if code == 2 else ""
    message = getattr(exc, "format_message", lambda: str(exc))()
    print(f"{where}: error: {message}{hint}", file=sys.stderr)
    return code


def main() -> None:
    """Console entry point of ``fabric``."""
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
