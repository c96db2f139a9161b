"""``Failed``: what a failed attempt says, as a kind the callers ask about, not as words.

An attempt on a node ends with its answer relayed (``None``) or failed before the client had a
byte of it. Three callers read a failure, each for a question of its own:

* the prefill clocks (``relay``): did the engine get the prompt (``sent``)? A refused or
  timed-out connect, or an own engine that could not be used, sent nothing, so the prompt's
  place on that node's clock is given back;
* the poison-request guard (``failover``): did the engine fail *on this request*
  (``engine_failure``)? The connection broke or the answer was malformed before its head, no
  head came in time, the node or its engine went down meanwhile, or a serving agent said its
  engine failed (502) or timed out (504). A 503 is not one: a node that is leaving, draining or
  full says so before it takes the request;
* the retry metric's ``reason`` label (``retry_reason``).

Before this module each caller matched prefixes of the error's message; a reworded message
silently changed what the guard counted. Now the place that fails says what kind of failure it
is, and the message is only for people (logs and the 502's text).

Pure: no I/O, compiled with the rest of the data plane. A plain class, not a dataclass (the
compiled data plane runs a plain class's ``__init__`` natively).
"""

from __future__ import annotations

# The kinds of failure (``Failed.kind``).
REFUSED = "refused"  # the connect was refused: nothing reached the node
CONNECT_TIMEOUT = "connect_timeout"  # no connection in time: nothing reached the node
UNUSABLE = "unusable"  # our own engine could not be used (not serving, no address, asleep)
BROKEN = "broken"  # sent; the connection closed or failed before the response head
MALFORMED = "malformed"  # sent; the response head could not be parsed
NO_RESPONSE = "no_response"  # sent; no response head within the first-byte timeout
DOWN = "down"  # sent; the node or its engine went down while the request waited
STATUS = "status"  # answered with a status the ingress fails over (``RETRYABLE_STATUS``)
HEAD_OUT = "head_out"  # a continuation or held stream got an answer that cannot follow its head
LEAVING = "leaving"  # sent; our own engine's exchange was handed over (the node drains)
# answered by another agent than the one asked (its address taken over by a new agent since
# the registry said where the node was): nothing reached the node meant
MISDIRECTED = "misdirected"
# Not failures of the node: the attempt ends for another reason and the loop goes on.
RESUME = "resume"  # the stream broke mid-answer and a continuation is ready
PREEMPTED = "preempted"  # the batch gate took the attempt back under interactive pressure

NOT_SENT = frozenset({REFUSED, CONNECT_TIMEOUT, UNUSABLE, MISDIRECTED})
# An engine that fails on the request itself; a status counts when it is one of these.
_ENGINE_FAILURES = frozenset({BROKEN, MALFORMED, NO_RESPONSE, DOWN})
_ENGINE_FAILURE_STATUS = frozenset({502, 504})


class Failed:
    """A failed attempt: its ``kind`` (the constants above), the words for people, and the
    status a node answered (``STATUS``; 0 otherwise)."""

    __slots__ = ("kind", "status", "text")

    def __init__(self, kind: str, text: str, status: int = 0) -> None:
        self.kind = kind
        self.text = text
        self.status = status

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Failed({self.kind!r}, {self.text!r})"

    @property
    def sent(self) -> bool:
        """Whether the request may have reached an engine (so its prompt counts there)."""
        return self.kind not in NOT_SENT

    @property
    def engine_failure(self) -> bool:
        """Whether an engine failed on this request itself (what the poison guard counts)."""
        if self.kind == STATUS:
            return self.status in _ENGINE_FAILURE_STATUS
        return self.kind in _ENGINE_FAILURES

    @property
    def retry_reason(self) -> str:
        """The ``reason`` label of the retry that follows: status, timeout or connect."""
        if self.kind == STATUS or self.kind == HEAD_OUT:
            return "status"
        if self.kind == NO_RESPONSE or self.kind == CONNECT_TIMEOUT:
            return "timeout"
        return "connect"


def answered(status: int) -> Failed:
    """A node answered ``status``, one the ingress fails over."""
    return Failed(STATUS, f"node answered {status}", status)


# Why the watchdog broke off an exchange with our own engine at the drain's deadline
# (``Relay.hand_over``): the exchange fails as ``LEAVING``, not as an engine that went down.
HANDED_OVER = "handed over: the node is leaving"

# The two outcomes that are not a node's failure, made once and compared by identity.
RESUMED = Failed(RESUME, "the stream broke; a continuation is ready")
TAKEN_BACK = Failed(PREEMPTED, "taken back by the batch gate")
