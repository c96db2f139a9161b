"""The request log: one JSON line per answered request, written by the ingress and read back
by the admin API, the elastic controller and the planner.

Owns the file format on disk, writing and rotating it, reading it whole or after a cursor, and
the sums over its records (the planner's workload, the controller's recent demand with its TTFT
histogram). The data plane appends to it once per answered request (``writer.RequestLog``,
built by the agent and handed to the ingress); everything else runs in worker threads or in
the admin API, off the request path. Reading token usage from responses, and the totals per
key and model behind ``/metrics``, are the data plane's (``dataplane.usage``).

May import: ``fabricnode.errors`` and itself. Sits below ``dataplane``, ``control`` and
``elastic``, which import it; never imports them (checked by ``make lint``). Not compiled with
mypyc (``fabricnode.native`` compiles the ``dataplane`` folder): the per-request calls into it
are ``RequestLog.append``, ``format.opt_int`` and ``ttft.ttft_bucket``.

Modules, in reading order:

* ``format``  one line: ``TraceRecord``, the ``RawTrace`` tuple the ingress hands over, how
              each is written and read back (the format is described there).
* ``ttft``    the TTFT histogram's buckets and quantiles (also the dashboard's latency scale).
* ``writer``  ``RequestLog``: the bounded buffer the ingress appends to, the flush that writes
              it from a worker thread, rotation by size.
* ``reader``  the log's files (live and rotated) and all their records.
* ``cursor``  the cursor protocol: what the log gained after ``<inode>:<offset>``.
* ``sums``    per-model sums of records: workload rates and token moments, mergeable sums, the
              recent sums with a TTFT histogram the elastic controller polls.

docs/architecture.md ("The data plane": bookkeeping off the client's path) says when the
ingress appends; docs/operators.md what operators do with the log.
"""
