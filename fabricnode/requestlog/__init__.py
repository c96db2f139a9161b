"""The request log: one JSON line per answered request, written by the ingress and read back
by the admin API, the elastic controller and the planner.

Owns the file format on disk, writing and rotating it, reading it whole or after a cursor, and
the sums over its records (the planner's workload, the controller's recent demand with its TTFT
histogram). The data plane appends to it once per answered request (``writer.RequestLog``,
built by the agent and handed to the ingress); everything else runs in worker threads or in
the admin API, off the request path. Reading token usage from responses, and the totals per
key and model behind ``/metrics``, are the data plane's (``dataplane.usage``).

May import: ``fabricnode.errors`` and itself. Sits below ``dataplane``, ``control`` and
``elastic``, which import it; never imports them (checked by ``make lint``). ``format``,
``ttft`` and ``writer`` are compiled with mypyc beside the data plane
(``fabricnode.native.COMPANIONS``): the request path calls ``RequestLog.append``,
``format.opt_int`` and ``ttft.ttft_bucket`` per answered request, and the flush thread formats
every line. Their extension modules load the data plane's shared library, so importing one
imports ``fabricnode.dataplane``'s ``__init__`` (only ``fabricnode.native``): not an import of
the data plane's code.

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

from pathlib import Path as _Path

from fabricnode import native as _native

# The compiled companions of the data plane, when built from the current sources.
_native.activate(__path__, _Path(__file__).resolve().parent / "_native")
