"""The agent's control surface: the admin API, its JSON views, its metrics, and its client.

Owns everything that is not the ``/v1`` data plane on the HTTP side: a raw ASGI app
(``/health``, ``/ready``, ``/fabric/v1/...``, ``/metrics``) served inline by the ingress on the
public port, or by hypercorn's trio worker on its own port with ``--admin``; the JSON shape of
registry entries that the API and ``fabric --json`` show; the Prometheus families read from
live objects at scrape time; and the synchronous httpx client the CLI and the tests use.

May import: ``fabricnode.mesh``, ``fabricnode.requestlog`` (the request log it summarises),
``fabricnode.dataplane`` (error bodies, the dashboard's recent figures, and the key record and
scope names ``access`` decides with), ``fabricnode.elastic`` (the controller it reports on),
the shared top-level modules (``errors``, ``addr``, ``asgi``, ``metricfamilies``) and itself.
Not ``engine``, ``host``, ``config`` or ``agent``: the agent builds the app and passes in what
it reads. Serving it with hypercorn
(``fabricnode.asgi``) and the prometheus-client helpers (``fabricnode.metricfamilies``) are
top-level shared modules, because the simulated engine serves its own HTTP API with them.

Modules, in reading order:

* ``views``   JSON views of registry entries and models (stable keys, in the order of
              docs/admin-guide.md's JSON reference).
* ``app``     ``AdminApp``: the endpoints; start reading here.
* ``access``  which control paths need an admin key when the ingress serves the app with API
              keys on (it passes the caller's key in the scope), and ``/ui/session``.
* ``client``  ``AdminClient`` (httpx, synchronous): the admin API for the CLI, the demo
              and the tests.
* ``memberlog`` the agent's log of member joins and state/liveness changes.
* ``meshstats`` the mesh's rates and latencies per model over the last minutes
              (``GET /fabric/v1/stats``).
* ``loadhistory`` each node's recent load, for the dashboard's node view.
* ``enginecmd`` a node's engine command, for the dashboard's node view.
* ``redact``  hiding the secrets of an engine command by the engines' argument grammar, in
              JSON values and in URLs.
* ``fleet``   what the elastic controller is doing, from any agent (``GET /fabric/v1/fleet``).
* ``peers``   asking other agents' read-only JSON APIs on behalf of a dashboard.
* ``peerauth`` how one agent proves to another that it holds the cluster key when it asks
              (a signed header bound to the agent asked, the path and the time): a client's
              key never travels between agents.

docs/admin-guide.md and docs/operators.md describe the endpoints and metrics.
"""
