"""The batch worker's settings (``BatchConfig``): what ``fabricnode.config`` builds for it.

Apart from the worker so that the configuration (``fabricnode.config``, the one place settings
are made) imports the settings and not the worker they are handed to, as the data plane's
``ingress_config`` is apart from the ingress.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchConfig:
    """The batch worker's knobs, with units in the names."""

    concurrency: int = 64  # requests this agent's worker has in flight at once (0: no worker)
    # The store's bounds (``api``): the bytes of the files one key may keep, and all keys
    # together; an upload past either is refused with 413 and what to delete.
    key_quota_bytes: int = 4 * 1024**3
    store_quota_bytes: int = 64 * 1024**3
    shard_size: int = 128  # lines per unit of work a worker takes
    max_shards_per_batch: int = 4  # held by one worker at once
    # The request lines of the shards a worker holds (read by range when it takes a shard,
    # dropped as each is sent): past this it takes no more shards until some are sent.
    input_buffer_bytes: int = 64 * 1024 * 1024
    lease_ttl_s: float = 20.0
    scan_interval_s: float = 0.5
    backoff_min_s: float = 0.25
    backoff_max_s: float = 10.0
    request_timeout_s: float = 1800.0  # a non-streamed answer comes whole: it may take long
    max_response_bytes: int = 64 * 1024 * 1024
    max_server_errors: int = 3  # a line answered 500 this many times gets that as its result
