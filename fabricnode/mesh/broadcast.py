"""Transmit-limited broadcast queue (piggybacked gossip), after SWIM §4 and memberlist.

Each record we want the cluster to learn is queued under a *key*; a newer record with the same
key replaces the older one (there is no point spreading superseded news). Every outgoing packet
is topped up with the least-transmitted records that fit (newest first among equals), and a
record is retired after ``limit`` transmissions, ``limit`` being
``retransmit_mult * ceil(log10(N + 1))``: enough for epidemic spread to reach all N members with
high probability, few enough to keep bandwidth flat.

A heap ordered by (transmissions, -age) with lazy deletion keeps ``take`` at O(k log n) for k
records taken, whatever the queue length (a bootstrap can queue thousands).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass

from fabricnode.mesh import codec
from fabricnode.mesh.wire import Message

# Skip the rest of a packet once less than this many bytes are left: no record is that small.
MIN_RECORD_BYTES = 40


@dataclass
class _Item:
    message: Message
    size: int
    order: int
    transmits: int = 0


class BroadcastQueue:
    def __init__(self) -> None:
        self._items: dict[Hashable, _Item] = {}
        self._heap: list[tuple[int, int, int, Hashable]] = []  # transmits, -order, order, key
        self._counter = itertools.count()

    def put(self, key: Hashable, message: Message) -> None:
        item = _Item(message, len(codec.pack(message.to_wire())), next(self._counter))
        self._items[key] = item
        heapq.heappush(self._heap, (0, -item.order, item.order, key))

    def discard(self, key: Hashable) -> None:
        self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)

    def take(self, budget_bytes: int, limit: int) -> tuple[list[Message], int]:
        """Records for one packet, fewest transmissions first."""
        if not self._items or budget_bytes < MIN_RECORD_BYTES:
            return [], 0
        chosen: list[Message] = []
        requeue: list[tuple[int, int, int, Hashable]] = []
        used = 0
        heap = self._heap
        while heap and budget_bytes - used >= MIN_RECORD_BYTES:
            transmits, neg_order, order, key = heapq.heappop(heap)
            item = self._items.get(key)
            if item is None or item.order != order or item.transmits != transmits:
                continue  # superseded or retired
            if used + item.size > budget_bytes:
                requeue.append((transmits, neg_order, order, key))
                if len(requeue) > 16:
                    break
                continue
            chosen.append(item.message)
            used += item.size
            item.transmits += 1
            if item.transmits >= limit:
                del self._items[key]
            else:
                requeue.append((item.transmits, neg_order, order, key))
        for entry in requeue:
            heapq.heappush(heap, entry)
        if len(heap) > 4 * len(self._items) + 64:
            self._heap = [(it.transmits, -it.order, it.order, k) for k, it in self._items.items()]
            heapq.heapify(self._heap)
        return chosen, used
