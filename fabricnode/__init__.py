"""fabricnode: a peer-to-peer agent that turns Slurm GPU jobs into one OpenAI-compatible service.

One agent (``fabric start``) runs per Slurm job. Agents gossip a signed registry of who serves
what, watch each other's liveness, and route OpenAI requests to each other: every agent is an
ingress. The map of the agent, in reading order:

Packages:

* ``mesh``       the replicated registry, membership and gossip: a pure protocol core
                 (``mesh.core.MeshCore``) and its trio shell (``mesh.service``).
* ``dataplane``  the ``/v1`` ingress on trio + httptools: decode, route, forward, fail over,
                 account; compiled with mypyc when built.
* ``requestlog`` the request log: its line format, the writer the ingress appends to, reading
                 it whole or after a cursor, the sums the planner and the controller read.
* ``federation`` one fabric across sites: site keys, signed site summaries, the view of peer
                 sites and the gateways' mutual-TLS link.
* ``engine``     the supervised engine child and the node's lifecycle JOIN -> SERVING -> DOWN;
                 following an operator's assignments.
* ``host``       GPUs, the Slurm job and its lease, the rendezvous file.
* ``control``    the admin API (raw ASGI on hypercorn), JSON views, metric families, the client.
* ``elastic``    the elastic fabric: declared models (the service file) kept served through
                 Slurm jobs and scaled with demand by the controller.
* ``batch``      the OpenAI Batch API: files and batches on the shared filesystem, worked by
                 every agent through its own ingress as batch-tier requests.
* ``simengine``  a simulated vLLM-like engine for machines without GPUs.
* ``kvevents``   the engines' KV-cache events (vLLM's ZMQ messages): the strict decoder, the
                 encoder the simulated engine publishes with, a publisher's sequence.
* ``ui``         the dashboard's static files (``GET /ui``) and their loader.
* ``testing``    seeded fake networks for tests and benches (never imported by the agent).

Top-level modules:

* ``agent``         the composition root: builds every service from one ``AgentConfig`` and
                    owns them in one trio nursery; the only module that builds services. It
                    wires behaviours that live in their packages (``host.lease``,
                    ``engine.follower``, ``host.rendezvous``, ``control.memberlog``).
* ``config``        ``AgentConfig`` from CLI flags and the environment: the only reader of the
                    environment (but for ``FABRIC_NATIVE``, which ``native`` reads at import).
* ``errors``        the one exception tree (``FabricError`` and its subclasses).
* ``addr``          ``HOST:PORT`` strings, IPv6 in brackets.
* ``asgi``          serving a raw ASGI app with hypercorn's trio worker on a socket we bound
                    (the admin app and the simulated engine).
* ``metricfamilies`` prometheus-client families and collectors over live objects; a registry
                    per app, never the global one.
* ``logs``          log lines to stderr, tagged with the short session id.
* ``native``        the switch between the compiled data plane and its sources (``FABRIC_NATIVE``).
* ``native_build``  builds the compiled data plane: ``python -m fabricnode.native_build``.

Layers: the mesh imports only itself, ``errors`` and ``addr``; the data plane never imports
``engine``, ``host``, ``control``, ``config`` or ``agent``; ``requestlog`` sits below the data
plane, ``control`` and ``elastic``, which import it; nothing here imports ``testing``,
``cli`` or ``bench``. ``make lint`` checks these rules (CONTRIBUTING.md). docs/architecture.md
explains the design.
"""

__version__ = "0.1.0"
