"""The ``fabric`` command (typer): parses, calls library code, renders. Nothing else lives here.

Owns the user's side of the product: the command line, its exit statuses (0 success, 1 a failed
operation, 2 bad usage) and its output, tables or ``--json``. The work is done by ``fabricnode``
and ``scheduler``; a command turns flags into a call and the answer into lines.

May import: ``fabricnode`` (through its public modules: ``agent``, ``config``,
``control.client``, the key modules, ...), ``scheduler`` and itself. Nothing in ``fabricnode``
or ``scheduler`` imports ``cli`` (checked by ``make lint``); the tests and benches use
``cli.localmesh`` to run real agents.

Modules, in reading order:

* ``main``          the typer app, entry point ``fabric`` (``cli.main:main``): global options,
                    the command list, one-line errors and exit statuses.
* ``common``        what every command shares: ``--agent``/``--debug``, ``handled``, output.
* ``start_cmd``     ``fabric start -- ENGINE_CMD``: run an agent.
* ``registry_cmd``  ``fabric nodes``, ``node``, ``models``.
* ``plan_cmd``      ``fabric plan``; ``planning`` reads inventory and workload from the mesh
                    and follows ``--apply``.
* ``keys_cmd``      ``fabric keys ...``: cluster, provider, operator and ingress API keys.
* ``slurm_cmd``     ``fabric slurm submit`` around ``slurm/fabric-serve.sbatch``; ``slurm ports``.
* ``services_cmd`` ``fabric services``: the mesh's service file, desired against actual.
* ``batch_cmd``     ``fabric batch ...``: the mesh's Batch API from the shell.
* ``demo_cmd``      ``fabric demo`` and ``fabric sim-engine``.
* ``localmesh``     ``LocalMesh``: real ``fabric start`` subprocesses on 127.0.0.1, always reaped.
* ``demo``          ``fabric demo``: a local mesh shown step by step (registry, requests, a
                    crash, a graceful leave).

docs/admin-guide.md describes every command.
"""
