"""The batch worker's numbers on the agent's ``/metrics`` page (read at scrape time from
``BatchWorker.statistics()``; ``metricfamilies`` explains the pattern)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from fabricnode.batch.worker import BatchWorkerStatistics
from fabricnode.metricfamilies import counter, counters_by, gauge, registry_of


class BatchCollector(Collector):
    def __init__(self, statistics: Callable[[], BatchWorkerStatistics]) -> None:
        self.statistics = statistics

    def collect(self) -> Iterator[Metric]:
        s = self.statistics()
        yield from counters_by(
            "fabric_batch_lines_total",
            "Batch request lines this agent's worker answered, by outcome (an error answer "
            "goes to the batch's error file)",
            "outcome",
            {"completed": s.lines_completed, "failed": s.lines_failed},
        )
        yield counter(
            "fabric_batch_retries_total",
            "Batch requests sent again after a transient answer (503, 429, 502, 504, no "
            "connection)",
            s.transient_retries,
        )
        yield from counters_by(
            "fabric_batch_shards_total",
            "Shards of batches this worker took, by how: new, resumed (taken over with results "
            "of a worker that died or stalled in it) or lost (taken over from us)",
            "how",
            {"taken": s.shards_taken, "resumed": s.shards_resumed, "lost": s.shards_lost},
        )
        yield from counters_by(
            "fabric_batch_batches_total",
            "Batches this worker validated or finalized",
            "step",
            {"validated": s.batches_validated, "finalized": s.batches_finalized},
        )
        yield gauge(
            "fabric_batch_inflight", "Batch requests in flight from this worker", s.inflight
        )
        yield gauge("fabric_batch_queued", "Batch request lines this worker holds, not sent yet",
                    s.queued)  # fmt: skip


def render(statistics: Callable[[], BatchWorkerStatistics]) -> Callable[[], bytes]:
    registry = registry_of(BatchCollector(statistics))
    return lambda: generate_latest(registry)
