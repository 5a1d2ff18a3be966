"""Tests for the ordering of device<->host page copies (backend/cache/swap.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.cache.swap import Transfer, order_transfers
from backend.cache.types import Handle, Tier

H = Handle


def offload(device: int, host: int) -> Transfer:
    return Transfer(Tier.DEVICE, H(device), Tier.HOST, H(host))


def load(host: int, device: int) -> Transfer:
    return Transfer(Tier.HOST, H(host), Tier.DEVICE, H(device))


def pairs(*items: tuple[int, int]) -> list[tuple[Handle, Handle]]:
    return [(H(a), H(b)) for a, b in items]


def simulate(
    moves: list[tuple[Handle, Handle]],
    loads: list[tuple[Handle, Handle]],
    transfers: list[Transfer],
    renamed: dict[Handle, Handle],
) -> None:
    """Run `transfers` on simulated memory; every page must reach its (renamed) destination intact."""
    memory: dict[tuple[Tier, Handle], str] = {}
    for d, _ in moves:
        memory[Tier.DEVICE, d] = f"device {d}"
    for h, _ in loads:
        memory[Tier.HOST, h] = f"host {h}"
    written: set[tuple[Tier, Handle]] = set()
    for t in transfers:
        src, dst = (t.src_tier, t.src), (t.dst_tier, t.dst)
        assert src not in written, f"{t} reads a page an earlier copy overwrote"
        assert dst not in written, f"{t} writes a page a second time"
        memory[dst] = memory[src]
        written.add(dst)
    assert len(transfers) == len(moves) + len(loads), "every page is copied exactly once"
    for d, h in moves:
        assert memory[Tier.HOST, renamed.get(h, h)] == f"device {d}"
    for h, d in loads:
        assert memory[Tier.DEVICE, d] == f"host {h}"


class TestOrderTransfers:
    def test_independent_copies_run_moves_then_loads(self) -> None:
        """Without dependencies, offloads run first, then loads, each in the given order."""
        moves, loads, buffer = pairs((0, 10), (1, 11)), pairs((20, 5), (21, 6)), [H(30)]
        transfers, renamed = order_transfers(moves, loads, buffer)
        assert transfers == [offload(0, 10), offload(1, 11), load(20, 5), load(21, 6)]
        assert renamed == {}
        assert buffer == [30]

    def test_move_into_host_page_waits_for_the_load_that_empties_it(self) -> None:
        """An offload into host page h runs only after the load out of h."""
        transfers, renamed = order_transfers(pairs((0, 20)), pairs((20, 5)), [])
        assert transfers == [load(20, 5), offload(0, 20)]
        assert renamed == {}

    def test_load_into_device_page_waits_for_the_move_that_empties_it(self) -> None:
        """A load into device page d runs only after the offload out of d."""
        transfers, _ = order_transfers(pairs((5, 10)), pairs((20, 5)), [])
        assert transfers == [offload(5, 10), load(20, 5)]

    def test_chain_is_resolved_without_the_buffer(self) -> None:
        """A dependency chain that ends at a free page needs no buffer page."""
        # load 21->0 waits for move 0->20, which waits for load 20->5 (5 is free).
        moves, loads = pairs((0, 20)), pairs((20, 5), (21, 0))
        transfers, renamed = order_transfers(moves, loads, [])
        assert transfers == [load(20, 5), offload(0, 20), load(21, 0)]
        assert renamed == {}

    def test_pure_cycle_goes_through_the_buffer(self) -> None:
        """Both tiers full: the offload goes to a buffer page, which is renamed its home, and the host
        page its load emptied joins the buffer."""
        buffer = [H(30)]
        transfers, renamed = order_transfers(pairs((0, 20)), pairs((20, 0)), buffer)
        assert transfers == [offload(0, 30), load(20, 0)]
        assert renamed == {20: 30}
        assert buffer == [20]

    def test_cycles_beyond_the_buffer_run_in_chunks(self) -> None:
        """Three swapped pages through one buffer page: each chunk reuses the page the last load emptied."""
        moves, loads, buffer = pairs((0, 20), (1, 21), (2, 22)), pairs((20, 0), (21, 1), (22, 2)), [H(30)]
        transfers, renamed = order_transfers(moves, loads, buffer)
        assert transfers == [
            offload(0, 30),
            load(20, 0),
            offload(1, 20),  # host page 20, emptied by the first load, is the next chunk's buffer
            load(21, 1),
            offload(2, 21),
            load(22, 2),
        ]
        assert renamed == {20: 30, 21: 20, 22: 21}
        assert buffer == [22]

    def test_chunk_uses_every_buffer_page(self) -> None:
        """With two buffer pages, the first chunk breaks two cycles (buffer popped from its end)."""
        moves, loads = pairs((0, 20), (1, 21), (2, 22)), pairs((20, 0), (21, 1), (22, 2))
        buffer = [H(30), H(31)]
        transfers, renamed = order_transfers(moves, loads, buffer)
        assert transfers == [
            offload(0, 31),
            offload(1, 30),
            load(20, 0),
            load(21, 1),
            offload(2, 21),
            load(22, 2),
        ]
        assert renamed == {20: 31, 21: 30, 22: 21}
        assert buffer == [20, 22]

    def test_cycle_with_empty_buffer_raises(self) -> None:
        """A cycle and no buffer page: the caller sized the eviction wrongly."""
        with pytest.raises(RuntimeError, match="empty buffer"):
            order_transfers(pairs((0, 20)), pairs((20, 0)), [])

    @pytest.mark.parametrize(
        ("moves", "loads"),
        [
            pytest.param(pairs((0, 10), (0, 11)), [], id="device-page-moved-twice"),
            pytest.param([], pairs((10, 0), (10, 1)), id="host-page-loaded-twice"),
        ],
    )
    def test_page_twice_in_one_swap_raises(
        self, moves: list[tuple[Handle, Handle]], loads: list[tuple[Handle, Handle]]
    ) -> None:
        """A source page copied twice in one swap is a caller bug."""
        with pytest.raises(RuntimeError, match="twice"):
            order_transfers(moves, loads, [H(99)])


@st.composite
def swaps(
    draw: st.DrawFn,
) -> tuple[list[tuple[Handle, Handle]], list[tuple[Handle, Handle]], list[Handle]]:
    """Consistent moves and loads over small pools, so that most destinations are pages being emptied.

    Every device page is free or a move source and every host page free or a load source, so any
    injective choice of destinations is a valid swap.
    """
    num_device = draw(st.integers(1, 8))
    num_host = draw(st.integers(1, 8))
    num_moves = draw(st.integers(0, min(num_device, num_host)))
    num_loads = draw(st.integers(0, min(num_device, num_host)))
    move_src = draw(st.permutations(range(num_device)))[:num_moves]
    move_dst = draw(st.permutations(range(num_host)))[:num_moves]
    load_src = draw(st.permutations(range(num_host)))[:num_loads]
    load_dst = draw(st.permutations(range(num_device)))[:num_loads]
    buffer = [H(num_host + i) for i in range(draw(st.integers(1, 3)))]
    moves = [(H(d), H(h)) for d, h in zip(move_src, move_dst, strict=True)]
    loads = [(H(h), H(d)) for h, d in zip(load_src, load_dst, strict=True)]
    return moves, loads, buffer


@settings(max_examples=500, deadline=None)
@given(swaps())
def test_any_swap_with_a_buffer_copies_every_page_intact(
    swap: tuple[list[tuple[Handle, Handle]], list[tuple[Handle, Handle]], list[Handle]],
) -> None:
    """With at least one buffer page, every swap is ordered so that each page arrives intact and the
    buffer keeps its size, holding no page that is an offload's home."""
    moves, loads, buffer = swap
    num_buffer = len(buffer)
    host_pages = {h for _, h in moves} | {h for h, _ in loads} | set(buffer)
    transfers, renamed = order_transfers(moves, loads, buffer)
    simulate(moves, loads, transfers, renamed)
    homes = {renamed.get(h, h) for _, h in moves}
    assert len(buffer) == num_buffer
    assert len(set(buffer)) == num_buffer
    assert not homes & set(buffer)
    assert set(buffer) <= host_pages
    assert set(renamed) <= {h for _, h in moves}
