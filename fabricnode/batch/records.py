"""The Batch API's objects in OpenAI's shapes, and the states a batch goes through. Pure.

A batch's stored record is OpenAI's batch object plus ``owner`` (the API key id that created
it, ``-`` when the ingress runs open); ``public_batch`` drops the owner and adds what is read at
answer time: ``request_counts`` and ``cancelling`` (a cancel asked, not yet carried out).

States (OpenAI's): ``validating`` → ``in_progress`` → ``finalizing`` → ``completed``;
``failed`` (the input file did not validate); ``cancelling`` → ``cancelled``; ``expired`` (the
24 h completion window passed: what ran is kept, the rest is reported ``batch_expired``).
"""

from __future__ import annotations

from typing import Any

from fabricnode.batch.store import ShardCounts

Json = dict[str, Any]

VALIDATING = "validating"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
FAILED = "failed"
CANCELLING = "cancelling"
CANCELLED = "cancelled"
EXPIRED = "expired"
FINAL = frozenset({COMPLETED, FAILED, CANCELLED, EXPIRED})

COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_METADATA_PAIRS = 16  # OpenAI's limits on ``metadata``
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def new_batch(
    batch_id: str,
    *,
    owner: str,
    endpoint: str,
    input_file_id: str,
    completion_window: str,
    metadata: dict[str, str] | None,
    now: float,
) -> Json:
    created = int(now)
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": completion_window,
        "status": VALIDATING,
        "output_file_id": None,
        "error_file_id": None,
        "created_at": created,
        "in_progress_at": None,
        "expires_at": created + COMPLETION_WINDOWS[completion_window],
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
        "owner": owner,
    }


def public_batch(record: Json, counts: ShardCounts | None, cancel_at: float | None) -> Json:
    """The batch object a client sees."""
    out = {k: v for k, v in record.items() if k != "owner"}
    if counts is not None and out.get("status") not in FINAL:
        total = out["request_counts"]["total"]
        out["request_counts"] = {
            "total": total,
            "completed": counts.completed,
            "failed": counts.failed,
        }
    if cancel_at is not None and out.get("status") in (VALIDATING, IN_PROGRESS):
        out["status"] = CANCELLING
        out["cancelling_at"] = int(cancel_at)
    return out


def file_object(meta: Json) -> Json:
    return {k: v for k, v in meta.items() if k != "owner"}


def new_file(
    file_id: str, *, owner: str, filename: str, purpose: str, size: int, now: float
) -> Json:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": int(now),
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
        "owner": owner,
    }


def metadata_problem(metadata: Any) -> str | None:
    """Why ``metadata`` is not OpenAI's shape (at most 16 string pairs), None if it is."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        return "'metadata' must be an object of string values"
    if len(metadata) > MAX_METADATA_PAIRS:
        return f"'metadata' has more than {MAX_METADATA_PAIRS} keys"
    for key, value in metadata.items():
        if not isinstance(value, str):
            return f"metadata value of {key!r} must be a string"
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            return (
                f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                f"{MAX_METADATA_VALUE}"
            )
    return None
