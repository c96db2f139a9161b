"""Batch inference: the OpenAI Batch API on every agent, worked by every agent.

``store`` keeps files and batches on the filesystem all jobs share (``$FABRIC_HOME/batches``),
crash-safe and exactly-once; ``validate`` checks an input file; ``records`` holds OpenAI's
object shapes and the batch states; ``api`` is the ASGI app the data plane calls for
``/v1/files*`` and ``/v1/batches*``; ``worker`` runs the lines of every batch through this
agent's own ingress as batch-tier requests (``dataplane.tiers``), so they use only the room
interactive traffic leaves and keys share it fairly. ``prepare`` is the client's side: it turns
a researcher's file of prompts or request bodies into an input file (``fabric batch submit``).
``upload`` reads an uploaded file out of a ``multipart/form-data`` body (``POST /v1/files``);
``worker_config`` holds the worker's settings (``BatchConfig``, built by ``fabricnode.config``);
``metrics`` puts the worker's numbers on the agent's ``/metrics`` page.
"""
