"""Server-sent events as the data plane reads them from engines' streams.

Owns the framing shared by the stream readers: the value of one ``data:`` line and the data of
one whole event. ``usage.StreamUsage`` frames a relayed stream incrementally (it is fed pieces
split anywhere); ``resume`` reads back the whole events a client received. Writing events is
each endpoint's (``endpoints.stream_error_events``, ``resume.Splicer``).
"""

from __future__ import annotations


def sse_data(line: bytes) -> bytes:
    """The value of an SSE ``data:`` line (one leading space dropped, as the SSE format says)."""
    return line[6:] if line[5:6] == b" " else line[5:]


def event_data(event: bytes) -> bytes | None:
    """The data of one whole event (its lines split on ``\\n``): its ``data:`` lines' values
    joined with ``\\n``, None when it has none (a comment, or only ``event:``/``id:`` lines)."""
    lines = [line for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    parts = [sse_data(line) for line in lines]
    return parts[0] if len(parts) == 1 else b"\n".join(parts)
