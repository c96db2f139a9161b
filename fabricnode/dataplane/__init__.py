"""The ``/v1`` data plane: every agent's OpenAI-compatible ingress, on trio + httptools.

Owns the request path: parse, authenticate, decode, filter, route, forward to a node's agent
or the local engine, fail over before the first byte, relay, account. Every module in this
folder is compiled with mypyc (``fabricnode.native``: the folder is the compiled group, no
module is listed by hand), so each is strictly typed Python that must behave the same compiled
and interpreted; ``make test`` runs the data plane's tests both ways.

May import: ``fabricnode.mesh`` (the registry, liveness and keyring it routes by),
``fabricnode.requestlog`` (the request log it appends to, the TTFT buckets of ``recent``),
``fabricnode.errors``, ``fabricnode.addr`` and itself. Never ``fabricnode.engine``, ``host``,
``control``, ``config`` or ``agent``: the agent builds the ingress and hands it what it needs
(checked by ``make lint``).

Modules, in reading order (pure first, then the shell that uses them):

* ``endpoints``       the endpoint table (path -> kind), each kind's dialect and stream error
                      events, the response ids that name the node storing them.
* ``multipart``       the text fields of a ``multipart/form-data`` body, without copying files.
* ``keytable``        API keys as the pure decoder sees them: the key record, the bearer-token
                      parser, the ``KeyTable`` protocol the keys file implements, rate limits.
* ``request``         the pure request decoder: a request and the caller's key in, its one
                      routed record (``Routed``: what routing reads, each computed once) or an
                      error (OpenAI's, or Anthropic's on its paths) out; the
                      ``X-Fabric-Require``, ``X-Fabric-Providers`` and ``X-Fabric-Priority``
                      header grammars.
* ``residency``       data residency: the sites a request may be served at (its key's, its
                      ``X-Fabric-Require: site=``, its model's in the service file), their
                      intersection, the 403's words, and the allowed set a forward carries.
* ``routing``         the pure routing core: load scores, prompt prefix hashing, the policies
                      (``make_policy``: round robin, least load, p2c, prefix, prefix-pending).
* ``prefill``         ``PrefillClocks``: the prompts sent to each node and not yet answered,
                      as an estimate of its prefill work (pure, ``now`` passed in).
* ``resume``          resuming a stream whose node died mid-answer: the pure ``Splicer``.
* ``routetable``      the registry reduced to the candidates of each model, and the filters.
* ``sites``           cross-site requests: the routes that leave the site (a gateway of ours,
                      a peer site's gateway over the link), the chooser among peer sites, the
                      no-bounce rule, the header marking a request from another site.
* ``across``          the ingress's decisions about sites (``Across``): what a peer site's
                      gateway may bring in, where a request no node of ours takes goes out,
                      residency's routes and 403s, where a Responses follow-up goes.
* ``tiers``           priority tiers: the interactive/batch headers, when a node has room for
                      batch work, fair queueing of waiting batch requests between API keys.
* ``failover``        the account of a request's attempts (nodes, time, refused connects,
                      resumed streams) and the poison-request guard: when trying stops.
* ``failure``         what a failed attempt says, as a kind (``Failed``): sent or not, an
                      engine failing on the request or not, the retry's reason.
* ``gate``            the batch gate as a sans-IO machine: offer, scan, expire, pressure, and
                      its deadline (``BatchGate``).
* ``coldstart``       waiting for a replica of a declared model (scale from zero): routes or the
                      refusal, and the wait's deadline (``ReplicaWait``, ``ReplicaRoom``).
* ``responses``       Responses pinning: the node a stored response's follow-up goes to, or why
                      not.
* ``hold``            the pending-aware hold: when a request the policy holds goes, and when to
                      ask the policy again.
* ``forward_auth``    the HMAC header that proves an agent-to-agent forward holds the cluster key.
* ``apikeys``         API keys of the ingress: lookup, the keys file, rate limits.
* ``sse``             server-sent events as read from engines: a ``data:`` line, an event's data.
* ``usage``           token usage read from each response (body or stream), totals per key
                      and model; the request log itself is ``fabricnode.requestlog``'s.
* ``metrics``         the data plane's Prometheus metrics, kept as plain counters.
* ``http1``           sans-IO HTTP/1.1 parsing with hard limits (httptools underneath).
* ``sockio``          non-blocking sockets, the reactor that waits for them, the deadline watchdog.
* ``upstream``        pooled keep-alive connections to agents and engines.
* ``ingress_config``  every limit and timeout of the data plane (``IngressConfig``).
* ``job``             ``Job``: the state of a routed request's attempts, from routing to
                      settling.
* ``clientconn``      a client connection, how response pieces and error answers are sent on it.
* ``frontdoor``       the client side of the ingress: accepting within the connection limits, one
                      task per connection reading its requests, deadlines, early refusals.
* ``settle``          the bookkeeping of answered requests, deferred off the client's path.
* ``gatewait``        the gate's trio side: its waiting tasks, the batch attempts it may take
                      back, and the one loop that wakes on events or at the gate's deadline.
* ``coldwait``        the wait for a replica's trio side: the held stream's head and comments,
                      and one wait on the mesh changing or the wait's deadline.
* ``relay``           one attempt's exchange with a node and its answer relayed to the client:
                      in-flight counts, prefill clocks, a broken stream resumed or ended.
* ``attempt``         the request each node gets (signed forward, or our own engine, woken if
                      asleep; bodies retagged or prioritized per node), and the forwards other
                      ingresses send us.
* ``asgi_call``       paths outside ``/v1/`` through the agent's ASGI control app, and the Batch
                      API's, answered inline.
* ``ingress``         ``Ingress``: builds the parts above, dispatch by the endpoint table,
                      routing and failover; start reading here for the flow.

docs/architecture.md ("The data plane") describes the design; docs/user-guide.md what clients
see; docs/benchmarks.md the measured costs.
"""

from fabricnode import native as _native

# The compiled data plane, when built from the current sources (fabricnode/native.py).
_native.activate(__path__)
