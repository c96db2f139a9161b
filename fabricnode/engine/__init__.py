"""One node's engine: the supervised child process (vLLM, SGLang, any OpenAI server, or the
simulated engine), as the mesh sees it.

Owns the engine's lifecycle: reading the engine command, running the child without orphans,
probing readiness, scraping its load, re-reading its model list (adapters come and go), and
moving the node's signed entry JOIN -> SERVING -> DOWN. On a JOIN-only node it also follows
the operator's plan: an assignment for this node is rendered through the engine template and
launched like an engine given after ``--``.

May import: ``fabricnode.mesh`` (the node's entry and its load reports), ``fabricnode.errors``,
``fabricnode.addr``, ``fabricnode.simengine.model`` (the GPU types the ``sim`` template can
simulate) and ``fabricnode.kvevents`` (the engine's KV-cache events). Not the data plane,
``control`` or ``agent``; it reads no environment (only ``fabricnode.config`` does) and builds
no other service (only ``fabricnode.agent`` does).

Modules, in reading order:

* ``command``   what an engine argv says: kind, model, URL (pure).
* ``metrics``   engine load from its Prometheus ``/metrics`` page, vLLM and SGLang (pure).
* ``models``    the engine's ``/v1/models`` (LoRA adapters with their ``parent``) read into
                what the entry may carry, with a reason for every model left out (pure).
* ``template``  the engine command a JOIN-only node renders for an assignment
                (``--engine-template``).
* ``process``   the child: its own process group, parent-death signal, pidfd, output pump,
                ``wait_ready``.
* ``sleep``     idle sleep: ``IdleSleep`` (pure) says when, ``EngineSleep`` puts the engine to
                sleep (vLLM's ``/sleep``) and wakes it for the next request, marking the entry
                ``fabric.sleeping``.
* ``liveness``  ``EngineLiveness`` (pure): a missed health check weighed against the engine's
              progress (CPU, token counters): healthy, busy (stays SERVING) or hung.
* ``drain``     ``Drain`` (pure): a leaving node's drain: stop accepting, let the engine's
                requests finish, hand the rest over at the deadline, stop the engine, close
                the doors after what the ingress still relays.
* ``kvreader``  the engine's KV-cache events on a localhost ZMQ socket, applied to its block
               index (``fabricnode.kvevents``); turned on for engines the agent starts.
* ``service``   ``EngineService``: spawn, SERVING, load scraping, DOWN on exit or hang,
                restarts; start reading here. Every change to the node's entry goes through
                the gossip service, which sends it at once.
* ``follower``  ``AssignmentFollower``: a JOIN-only node waits for the signed assignment for
                it (``fabricnode.mesh.assignment``), renders it with ``template`` and reports
                the outcome as ``fabric.plan*`` labels; the agent launches the command.

docs/researcher-guide.md says how to run an engine under an agent; docs/scheduler.md how a plan
is applied.
"""
