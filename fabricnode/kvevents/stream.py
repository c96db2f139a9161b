"""One publisher's sequence of batches: which to apply, which are repeats, where events were
lost, and when the publisher started over. Pure: sequence numbers in, verdicts out.

vLLM numbers its batches from 0 in each process (``ZmqEventPublisher._seq_gen``), so:

* ``APPLY``: the next number, or the first one we see when it is 0 (we saw the start).
* ``DROP``: a number we already had (a replayed batch that came twice).
* ``RESTARTED``: 0 after higher numbers: a new engine process. What the index knew of the old
  one is gone with its cache: clear it, then apply the batch.
* ``GAP``: a number past the next one: batches were lost (the PUB socket drops past its
  high-water mark; a subscriber that joined late never had the first ones). ``missing`` says
  which. Lost batches may have removed blocks, so the index may claim what the engine no
  longer has. The shell then asks the engine's replay socket for ``missing`` (when it has
  one) and gives what comes back to ``accept`` in order (``APPLY``, as they are the next
  numbers), then the batch that showed the gap; when the replay cannot cover the gap, it
  clears the index and calls ``resync`` with that batch's number, which applies from there.
  An index that lost events under-claims after a clear, never over-claims: a request it no
  longer knows a cached prefix for is routed on load, as without events.

The first batch a subscriber sees with a number above 0 is a ``GAP`` from 0 (the batches
before it were published before we subscribed; an agent subscribes before its engine starts,
so this is an engine it did not start, or a restart of the agent).
"""

from __future__ import annotations

from dataclasses import dataclass

APPLY = "apply"
DROP = "drop"
RESTARTED = "restarted"
GAP = "gap"


@dataclass(frozen=True, slots=True)
class Verdict:
    action: str  # APPLY, DROP, RESTARTED or GAP
    missing: tuple[int, int] | None = None  # GAP: the lost numbers, [first, last]


@dataclass
class EventStream:
    """The expected next sequence number of one publisher, and what happened so far."""

    next_seq: int | None = None  # None: nothing seen yet
    applied: int = 0
    dropped: int = 0
    gaps: int = 0
    lost: int = 0  # batches never applied (gaps a replay did not cover)
    restarts: int = 0

    def accept(self, seq: int) -> Verdict:
        """What to do with the batch numbered ``seq`` (module docstring)."""
        expected = self.next_seq
        if seq < 0:
            raise ValueError(f"sequence number {seq} < 0")
        if (expected is None and seq == 0) or seq == expected:
            self.next_seq = seq + 1
            self.applied += 1
            return Verdict(APPLY)
        if seq == 0:  # after higher numbers: a new publisher process
            self.next_seq = 1
            self.restarts += 1
            self.applied += 1
            return Verdict(RESTARTED)
        first = 0 if expected is None else expected
        if seq < first:
            self.dropped += 1
            return Verdict(DROP)
        self.gaps += 1
        return Verdict(GAP, (first, seq - 1))

    def resync(self, seq: int) -> None:
        """The replay did not cover a gap (or there is no replay socket): the index was
        cleared, and the batch numbered ``seq`` is applied; the rest follow from it."""
        first = 0 if self.next_seq is None else self.next_seq
        self.lost += max(0, seq - first)
        self.next_seq = seq + 1
        self.applied += 1
