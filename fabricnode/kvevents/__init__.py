"""What the engines' KV caches hold, from their own KV-cache events (issue 42). Pure.

vLLM (with prefix caching and ``--kv-events-config``) publishes, over a ZMQ PUB socket, one
multipart message per engine step: ``(topic, 8-byte big-endian sequence number, msgpack
batch)``, the batch ``[ts, events, data_parallel_rank]``, each event a ``BlockStored``,
``BlockRemoved`` or ``AllBlocksCleared``. The agent beside the engine reads them; this package
is what it reads them with, free of sockets and clocks:

* ``wire``    the strict, bounded decoder of one message (both event encodings vLLM has used:
              positional arrays, and tagged maps since mid-2026) into ``Batch`` and its events,
              and the encoder the simulated engine publishes with
* ``stream``  ``EventStream``: the sequence of one publisher, gaps (ask the replay socket, or
              start over), duplicates, and a publisher that restarted (its sequence begins
              again)
* ``index``   ``BlockIndex``: the blocks one engine holds, bounded, and the longest prefix of
              a token sequence it holds (the walk down its chain of blocks)

Where the socket is: vLLM's publisher *binds* an endpoint that has a ``*`` (all interfaces)
and *connects* to any other (``ZmqEventPublisher._is_bind_endpoint``). So the agent binds its
SUB socket on 127.0.0.1 at a free port and gives the engine that endpoint: nothing of the
engine's listens beyond localhost, and a subscriber that is gone costs the engine nothing (a
PUB drops what no one receives).
"""
