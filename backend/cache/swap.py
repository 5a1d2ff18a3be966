"""Ordering of device<->host page copies, with a small swap buffer for when both tiers are full.

An admission may offload device pages to host (`Move`: device page d -> host page h) and load host pages
to the device (`Load`: host page h -> device page d) in one step. A page may only be written once its old
content has been copied away, so an offload into h waits for the load that empties h, and a load into d
waits for the offload that empties d. Copies whose destination is already free run first; when only
cycles are left (both tiers full), up to `len(buffer)` pending offloads are written into reserved host
buffer pages instead. Their pages are renamed: the buffer page becomes the offloaded page's host home, and
the host page it was headed for joins the buffer once its own load has run (the paper's chunked swap:
"the CPU blocks emptied this way become the buffer for the next chunk"). No page is copied twice.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from backend.cache.types import Handle, Tier


class Transfer(NamedTuple):
    """Copy one page of KV from `src` in `src_tier` to `dst` in `dst_tier`; run in list order."""

    src_tier: Tier
    src: Handle
    dst_tier: Tier
    dst: Handle


def order_transfers(
    moves: list[tuple[Handle, Handle]], loads: list[tuple[Handle, Handle]], buffer: list[Handle]
) -> tuple[list[Transfer], dict[Handle, Handle]]:
    """Order offloads `(device, host)` and loads `(host, device)` so that no page is overwritten early.

    `buffer` (free host pages) is updated in place: pages lent to broken cycles leave it and the host
    pages they stood in for join it. Returns the transfers and the renames `{planned host page: buffer
    page}` the caller applies to offloaded pages. Raises RuntimeError if a cycle remains and the buffer is
    empty (the caller sized the eviction wrongly).
    """
    load_sources = {h for h, _ in loads}
    move_sources = {d for d, _ in moves}
    if len(load_sources) != len(loads) or len(move_sources) != len(moves):
        raise RuntimeError("a page appears twice in one swap")
    loads_into = {d: (h, d) for h, d in loads if d in move_sources}
    moves_into: dict[Handle, list[tuple[Handle, Handle]]] = {}
    for move in moves:
        moves_into.setdefault(move[1], []).append(move)
    ready_moves = deque(m for m in moves if m[1] not in load_sources)
    ready_loads = deque(ld for ld in loads if ld[1] not in move_sources)
    waiting_moves = deque(m for m in moves if m[1] in load_sources)
    renamed: dict[Handle, Handle] = {}
    out: list[Transfer] = []
    done_moves = 0

    def offload(d: Handle, dst: Handle) -> None:
        out.append(Transfer(Tier.DEVICE, d, Tier.HOST, dst))
        move_sources.discard(d)
        if d in loads_into:
            ready_loads.append(loads_into.pop(d))

    while ready_moves or ready_loads or done_moves < len(moves):
        if ready_moves:
            d, h = ready_moves.popleft()
            offload(d, h)
            done_moves += 1
        elif ready_loads:
            h, d = ready_loads.popleft()
            out.append(Transfer(Tier.HOST, h, Tier.DEVICE, d))
            load_sources.discard(h)
            if h in renamed:
                buffer.append(h)
            ready_moves.extend(m for m in moves_into.pop(h, []) if m[1] not in renamed)
        else:
            if not buffer:
                raise RuntimeError("swap cycle with an empty buffer: both tiers full and no buffer pages")
            for _ in range(len(buffer)):
                while waiting_moves and waiting_moves[0][1] not in load_sources:
                    waiting_moves.popleft()
                if not waiting_moves:
                    break
                d, h = waiting_moves.popleft()
                stand_in = buffer.pop()
                renamed[h] = stand_in
                offload(d, stand_in)
                done_moves += 1
    if load_sources:
        raise RuntimeError("loads left waiting after the swap schedule")
    return out, renamed
