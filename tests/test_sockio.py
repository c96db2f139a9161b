"""LoopClock: the data plane's reading of trio's clock."""

from __future__ import annotations

import trio
import trio.testing

from fabricnode.sockio import LoopClock


def test_bound_to_the_system_clock_it_reads_the_same_time_as_trio() -> None:
    async def main() -> None:
        clock = LoopClock()
        clock.bind()
        before = trio.current_time()
        mine = clock.now()
        after = trio.current_time()
        assert before <= mine <= after
        await trio.sleep(0.01)
        assert clock.now() - mine >= 0.01

    trio.run(main)


def test_bound_to_a_mock_clock_it_follows_the_mock() -> None:
    mock = trio.testing.MockClock()

    async def main() -> None:
        clock = LoopClock()
        clock.bind()
        start = clock.now()
        assert start == trio.current_time()
        mock.jump(5.0)
        assert clock.now() == start + 5.0

    trio.run(main, clock=mock)


def test_unbound_or_bound_in_another_run_it_asks_trio() -> None:
    clock = LoopClock()

    async def main() -> None:
        assert clock.now() == trio.current_time()

    trio.run(main, clock=trio.testing.MockClock())
    trio.run(main, clock=trio.testing.MockClock())
