"""Deterministic test doubles shipped with the package: seeded networks on virtual time.

Owns fakes of what the mesh runs on, so the gossip protocol is tested and measured without real
sockets or real time: a discrete-event network of pure ``MeshCore`` nodes, and a fake network
for the real trio gossip shell under trio's MockClock. Both are seeded and deterministic.

May import: ``fabricnode.mesh`` and trio. Nothing in fabricnode, scheduler or cli imports this
package (checked by ``make lint``); the tests and the benches do.

Modules:

* ``simnet``   ``SimNetwork``: thousands of ``MeshCore`` nodes in one process, lossy seeded
               datagrams, partitions, crashes (``tests/unit/mesh/test_core_sim.py``,
               ``bench/gossip.py``).
* ``fakenet``  ``FakeNetwork``: a seeded lossy ``Transport`` for ``GossipService`` on virtual
               time (``tests/shell/mesh/test_service_fakenet.py``).
"""
