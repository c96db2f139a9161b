"""A simulated OpenAI-compatible LLM engine, so a mesh runs without GPUs.

Owns an engine that behaves like vLLM where the mesh can see it: continuous batching under a
paged KV cache with a prefix cache, timed by a roofline model of a GPU type; vLLM's HTTP surface
and metric names; injectable faults (crash, hang, slow-down, errors). ``fabric start --sim``,
the ``sim`` engine template, ``fabric demo``, the system tests and ``bench/routing.py`` run it
as a child engine (``python -m fabricnode.simengine``), supervised like any other.

May import: ``fabricnode.control`` (ASGI serving and metric families), ``fabricnode.errors``,
``fabricnode.addr``, ``fabricnode.kvevents`` (the KV-cache events' wire form) and itself;
``model`` imports nothing of fabricnode but ``kvevents.wire``. Never the mesh,
the data plane or the agent: to them it is just an engine behind a URL.

Modules, in reading order:

* ``model``       the pure scheduler: admission, preemption, prefix cache, roofline step times;
                  ``GPU_PROFILES``.
* ``httpio``      the HTTP plumbing: the error type and its OpenAI and Anthropic shapes, bounded
                  bodies, JSON and server-sent events.
* ``lora``        the served names: the base model and the LoRA adapters.
* ``generation``  running a prompt on the engine for an endpoint (the chat prompt, max_tokens).
* ``responses``   ``/v1/responses`` and its bounded store.
* ``messages``    Anthropic's ``/v1/messages`` and ``count_tokens``.
* ``pooling``     rerank, score, pooling, classify, tokenize, detokenize.
* ``audio``       ``/v1/audio/transcriptions`` and ``translations`` (multipart WAV uploads).
* ``kvpublish``   ``--kv-events-config``: the prefix cache's KV-cache events on a ZMQ PUB
                  socket, as vLLM publishes them.
* ``driver``      the trio driver of the scheduler: steps it in trio time, tokens to channels;
                  the step log; the KV-cache events after each step.
* ``server``      the raw ASGI app routing vLLM's endpoints, its metrics, sleep and faults.
* ``__main__``    the command line: flags, the ready line, graceful exit on SIGTERM.
"""
