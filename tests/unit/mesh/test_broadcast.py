"""BroadcastQueue: what one packet carries, in which order, and when a record retires."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fabricnode.mesh import codec
from fabricnode.mesh.broadcast import MIN_RECORD_BYTES, BroadcastQueue
from fabricnode.mesh.wire import Message, PingReq

TARGET = "t" * 32
PLENTY = 1 << 20


def record(tag: int, size: int = 80) -> PingReq:
    """A record of exactly ``size`` packed bytes (80 to 280), told apart by ``tag``."""
    # Padding of 32 to 255 characters keeps msgpack's string header at two bytes, so every
    # size in the range is reachable.
    for pad in range(32, 256):
        message = PingReq(tag, TARGET, "a" * pad)
        if size_of(message) == size:
            return message
    raise AssertionError(f"no record of {size} bytes")


def size_of(message: Message) -> int:
    return len(codec.pack(message.to_wire()))


def tags(messages: list[Message]) -> list[int]:
    return [m.probe_id for m in messages if isinstance(m, PingReq)]


def test_an_empty_queue_gives_nothing() -> None:
    assert BroadcastQueue().take(PLENTY, 3) == ([], 0)


def test_a_budget_below_the_smallest_record_gives_nothing() -> None:
    q = BroadcastQueue()
    q.put("a", record(1))
    assert q.take(MIN_RECORD_BYTES - 1, 3) == ([], 0)
    assert len(q) == 1


def test_a_take_reports_the_bytes_it_used() -> None:
    q = BroadcastQueue()
    q.put("a", record(1, 80))
    q.put("b", record(2, 130))
    messages, used = q.take(PLENTY, 3)
    assert sorted(tags(messages)) == [1, 2]
    assert used == 80 + 130


def test_records_that_do_not_fit_are_left_for_the_next_packet() -> None:
    q = BroadcastQueue()
    q.put("small", record(1, 80))
    q.put("big", record(2, 200))  # newest: tried first, does not fit
    messages, used = q.take(150, 3)
    assert (tags(messages), used) == ([1], 80)
    messages, used = q.take(PLENTY, 3)
    assert tags(messages) == [2, 1]  # the big one has fewer transmissions now


def test_records_go_fewest_transmissions_first_then_newest_first() -> None:
    q = BroadcastQueue()
    for tag in (1, 2, 3):
        q.put(tag, record(tag))
    assert tags(q.take(PLENTY, 10)[0]) == [3, 2, 1]
    q.put(4, record(4))
    assert tags(q.take(80, 10)[0]) == [4]  # never sent beats newer-but-sent
    assert tags(q.take(PLENTY, 10)[0]) == [4, 3, 2, 1]
    assert tags(q.take(160, 10)[0]) == [4, 3]  # all sent twice: newest first


def test_a_record_retires_after_limit_transmissions() -> None:
    q = BroadcastQueue()
    q.put("a", record(1))
    q.put("b", record(2))
    for _ in range(3):
        assert sorted(tags(q.take(PLENTY, 3)[0])) == [1, 2]
    assert len(q) == 0
    assert q.take(PLENTY, 3) == ([], 0)


def test_a_newer_record_under_the_same_key_replaces_the_older() -> None:
    q = BroadcastQueue()
    q.put("k", record(1))
    q.take(PLENTY, 3)
    q.put("k", record(2))
    assert len(q) == 1
    sent = [tags(q.take(PLENTY, 3)[0]) for _ in range(4)]
    assert sent == [[2], [2], [2], []]  # the replacement starts its own count at zero


def test_a_discarded_record_is_never_sent() -> None:
    q = BroadcastQueue()
    q.put("a", record(1))
    q.put("b", record(2))
    q.discard("a")
    q.discard("nothing")  # unknown keys are fine
    assert len(q) == 1
    assert tags(q.take(PLENTY, 3)[0]) == [2]


def test_a_record_put_again_after_retiring_is_sent_again() -> None:
    q = BroadcastQueue()
    q.put("a", record(1))
    q.take(PLENTY, 1)
    assert len(q) == 0
    q.put("a", record(2))
    assert tags(q.take(PLENTY, 1)[0]) == [2]


def test_thousands_of_queued_records_fill_a_packet_without_losing_any() -> None:
    q = BroadcastQueue()
    for tag in range(3000):
        q.put(tag, record(tag, 100))
    seen: list[int] = []
    while left := len(q):
        messages, used = q.take(1400, 1)
        assert used <= 1400 and len(messages) == min(14, left)
        seen += tags(messages)
    assert sorted(seen) == list(range(3000))
    assert seen[:14] == list(range(2999, 2985, -1))  # newest first


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 7), st.integers(80, 280)),
        st.tuples(st.just("discard"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("take"), st.integers(0, 1500), st.just(0)),
    ),
    max_size=60,
)


@given(ops=_ops, limit=st.integers(1, 4))
def test_takes_respect_the_budget_and_the_transmit_limit(
    ops: list[tuple[str, int, int]], limit: int
) -> None:
    """Against a model of which record is current per key and how often it was sent."""
    q = BroadcastQueue()
    current: dict[int, PingReq] = {}  # key -> the record that may still be sent
    sent: dict[int, int] = {}  # record tag -> transmissions
    for serial, (op, arg, size) in enumerate(ops):
        if op == "put":
            current[arg] = record(serial, size)
        elif op == "discard":
            q.discard(arg)
            current.pop(arg, None)
        if op == "put":
            q.put(arg, current[arg])
            continue
        if op != "take":
            continue
        messages, used = q.take(arg, limit)
        assert used == sum(size_of(m) for m in messages) <= max(arg, 0)
        taken = tags(messages)
        assert len(taken) == len(set(taken)), "a record at most once per packet"
        live = {m.probe_id for m in current.values()}
        assert set(taken) <= live, "only the newest record of a key, never a discarded one"
        for tag in taken:
            sent[tag] = sent.get(tag, 0) + 1
            assert sent[tag] <= limit
        for key, message in list(current.items()):
            if sent.get(message.probe_id, 0) == limit:
                del current[key]  # retired
        assert len(q) == len(current)
    # Nothing current is lost: with room to spare, each goes out until it has been sent limit
    # times, then the queue is empty.
    for _ in range(limit):
        for tag in tags(q.take(PLENTY, limit)[0]):
            sent[tag] = sent.get(tag, 0) + 1
    assert all(sent.get(m.probe_id) == limit for m in current.values())
    assert len(q) == 0
