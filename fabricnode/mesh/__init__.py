"""The mesh: one node's replica of the signed registry, its liveness view, and gossip.

Owns who is in the cluster and what each node says about itself: session and provider keys,
the cluster keyring, the wire format, the registry CRDT, SWIM membership, the broadcast queue,
operator assignments, and the protocol core that ties them together. Everything but
``service`` is pure (sans-IO, in the manner of h11): it takes bytes and ``now`` and returns
bytes to send, so the same core runs on real sockets, on a fake network under trio's
MockClock and in a discrete-event simulator (``fabricnode.testing``).

May import: itself, ``fabricnode.errors`` and ``fabricnode.addr`` (and third-party libraries
such as msgpack and cryptography). Only ``service`` imports trio, ``socket`` or ``time``; no
other module here reads a clock or touches the network. Every other package may import the
mesh; the mesh imports none of them (checked by ``make lint``).

Modules, in reading order:

* ``identity``    Ed25519 session keys (self-certifying session ids), provider certificates,
                  canonical signed bytes, the verification cache.
* ``keyring``     cluster keys: AEAD on every datagram and frame, a keyring for rotation.
* ``codec``       strict, bounded msgpack decoding shared by every wire-facing module.
* ``wire``        the versioned packet and message formats; the replay guard.
* ``sites``       site names (their rules, the default) and how an entry carries its site.
* ``registry``    the CRDT of owner-signed entries: rank, merge, leases, tombstones.
* ``schema``      the registry's label keys (what each means, who writes and reads it) and
                  ``standing``: the one verdict on whether a node is routable, alive or gone.
* ``membership``  SWIM + Lifeguard: each node's local liveness view (alive, suspect, dead).
* ``broadcast``   the transmit-limited queue of piggybacked gossip.
* ``assignment``  operator-signed engine assignments, a second CRDT beside the registry.
* ``servicedoc``  the operator-signed service file, replicated to every agent.
* ``signed``      what the operator-signed records (assignments, the service file) share.
* ``core``        ``MeshCore``: the whole protocol of one node, ``receive``/``tick``/
                  ``take_outbound``; start reading here for the behaviour, its parts above.
* ``join``        ``JoinTracker``: when this node counts as joined (``/ready``), clock passed in.
* ``service``     the trio shell: ``GossipService`` drives a ``MeshCore`` with real time over
                  a ``Transport`` (``UdpTcpTransport``: UDP datagrams, TCP frames). Its
                  ``update_self``/``relabel``/``publish_load``/``bootstrap``/``new_session``
                  change the core and wake the timer loop, so changes leave at once.

docs/architecture.md explains the registry lattice, the trust model and failure detection.
"""
