"""``fabric demo`` and ``fabric sim-engine``: the fabric on one machine, no GPU or Slurm.

``demo`` runs a local mesh of agents with simulated engines (``cli.demo``); ``sim-engine`` runs
one simulated OpenAI-compatible engine (``fabricnode.simengine``), which ``fabric start --sim``
and the tests launch.
"""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import command_group, handled

commands = command_group()


@commands.command(
    help="Run a local mesh with simulated engines (no GPU, no Slurm): watch it converge, serve "
    "requests through several agents, survive a kill -9 and a leave, then stop it all. "
    "With --serve it stays up as an OpenAI endpoint until Ctrl-C."
)
@handled
def demo(
    nodes: Annotated[int, typer.Option("--nodes", min=3, max=32, help="How many agents.")] = 4,
    serve: Annotated[
        bool,
        typer.Option(
            "--serve", help="After the crash, keep the mesh up (prints the OpenAI base URL)."
        ),
    ] = False,
    port: Annotated[
        int | None,
        typer.Option(
            "--port",
            min=1,
            max=65535,
            metavar="PORT",
            help="HTTP port of the agent printed as the OpenAI base URL (default: a free "
            "one); 8080 lets a plain `fabric nodes` find it.",
        ),
    ] = None,
) -> None:
    from cli.demo import run_demo

    raise typer.Exit(run_demo(nodes, serve=serve, port=port))


@commands.command(
    "sim-engine",
    help="Run the simulated OpenAI-compatible engine (see `fabric sim-engine --help`).",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def sim_engine(ctx: typer.Context) -> None:
    from fabricnode.simengine.__main__ import main as sim_main

    raise typer.Exit(sim_main(list(ctx.args)))
