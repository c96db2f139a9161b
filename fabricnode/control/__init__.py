"""The agent's control surface: the admin API, its JSON views, its metrics, and its client.

Owns everything that is not the ``/v1`` data plane on the HTTP side: a raw ASGI app
(``/health``, ``/ready``, ``/fabric/v1/...``, ``/metrics``) served inline by the ingress on the
public port, or by hypercorn's trio worker on its own port with ``--admin``; the JSON shape of
registry entries that the API and ``fabric --json`` show; the Prometheus families read from
live objects at scrape time; and the synchronous httpx client the CLI and the tests use.

May import: ``fabricnode.mesh``, ``fabricnode.dataplane`` (the request log it summarises),
``fabricnode.errors``, ``fabricnode.addr`` and itself. Not ``engine``, ``host``, ``config`` or
``agent``: the agent builds the app and passes in what it reads.

Modules, in reading order:

* ``views``          JSON views of registry entries and models (stable keys, SPEC order).
* ``metricfamilies`` prometheus-client families and collectors over live objects; a registry
                     per app, never the global one.
* ``asgi``           serving a raw ASGI app with hypercorn's trio worker on a socket we bound.
* ``app``            ``AdminApp``: the endpoints; start reading here.
* ``client``         ``AdminClient`` (httpx, synchronous): the admin API for the CLI, the demo
                     and the tests.

docs/admin-guide.md and docs/operators.md describe the endpoints and metrics.
"""
