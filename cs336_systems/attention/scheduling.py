"""Program order of the attention kernels: which (tile, head) programs run together.

Every program of one head streams the same operands (K and V for the forward and dQ kernels; Q, dO and the
``[L; D]`` row pair for dK/dV). If the programs running at once belong to few heads, those operands stay in
L2 and are read from memory about once; spread over all heads, each program reads them again. The kernels
therefore run the heads in groups sized here (decoded by ``flash_common._tile_and_head`` and the Gluon
forward alike): every tile of a group, heads fastest inside it, before the next group starts.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence

import torch

from . import options

#: L2 bytes assumed where the device cannot be asked (CPU tensors under the interpreter): an H100's 50 MiB.
_NOMINAL_L2_BYTES = 50 * 2**20


@functools.cache
def _l2_bytes(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).L2_cache_size)


def heads_per_l2_group(n_bh: int, streamed_bytes_per_head: int, device: torch.device) -> int:
    """How many of ``n_bh`` (batch, head) pairs the kernels run as one group, every tile of the group before
    the next (``flash_common._tile_and_head``): as many as fit their streamed operands (K and V for the
    forward and dQ, Q, dO and [L; D] for dK/dV) in ``options.current().l2_share`` of the L2 cache, at least
    one; all of them (no grouping) when the share is None.

    Why: every program of a head streams the same K and V. With heads fastest over the whole grid, a wave of
    132 programs at (4, 32, 4096, 128) touches 128 heads' K and V, 256 MiB that no L2 holds, so each program
    reads them from memory: 32 query tiles x 256 MiB, 2.6 ms at the H100's data-sheet 3.35 TB/s, longer than
    cuDNN's whole forward there (docs/flash_attention/l2_head_groups.md)."""
    share = options.current().l2_share
    if share is None:
        return n_bh
    if device.type == "cuda":
        l2 = _l2_bytes(device.index if device.index is not None else torch.cuda.current_device())
    else:
        l2 = _NOMINAL_L2_BYTES
    return max(1, min(n_bh, int(share * l2) // max(1, streamed_bytes_per_head)))


#: SMs assumed where the device cannot be asked (CPU tensors under the interpreter): one, so that a persistent
#: grid there is ``options.persistent`` programs and each takes several items.
_NOMINAL_SMS = 1


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent grid on ``device`` (``options.current().persistent`` per SM), or 0 when the
    kernels run one program per (tile, head) item."""
    per_sm = options.current().persistent
    return per_sm * sm_count(device) if per_sm else 0


def sm_count(device: torch.device) -> int:
    """The SMs of ``device`` (:data:`_NOMINAL_SMS` for CPU tensors under the interpreter)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return _NOMINAL_SMS


def grid(items: int, programs: int) -> tuple[int]:
    """The 1-D grid for ``items`` (tile, head) items: one program each, or at most ``programs`` programs that
    take them in turn (a persistent grid, ``programs`` > 0)."""
    return (min(items, programs) if programs else items,)


#: What a persistent program pays per item beyond its key tiles (the Q copy, the epilogue, the barrier hand-offs),
#: in key tiles: the weight :func:`list_schedule` adds to each item.
ITEM_OVERHEAD_TILES = 1


def item_key_tiles(n_bh: int, n_tiles_m: int, head_group: int, n_keys: int, block_m: int, block_n: int,
                   causal: bool) -> list[int]:
    """The key tiles of each (query tile, head) item, in the one-program-per-item order
    (``flash_common._tile_and_head``, ``flash_fwd_sm90._item``): groups of ``head_group`` heads, inside a group
    heads fastest, and causal the longest tiles first."""
    full = -(-n_keys // block_n)
    tiles = []
    for first in range(0, n_bh, head_group):
        heads = min(head_group, n_bh - first)
        for t in range(n_tiles_m):
            m = n_tiles_m - 1 - t if causal else t
            tiles += [-(-min((m + 1) * block_m, n_keys) // block_n) if causal else full] * heads
    return tiles


def list_schedule(weights: Sequence[float], programs: int) -> tuple[list[int], list[int]]:
    """Items dealt in order, each to the program that frees first (ties: the lower program), as ``(offsets,
    items)``: program ``p`` takes ``items[offsets[p]:offsets[p + 1]]`` in turn.

    Why: a persistent grid that deals items ``p, p + programs, ...`` leaves a tail where the items' lengths
    differ. Causal rows in head groups put up to a third more work on the busiest program than on the average one
    (docs/flash_attention/persistent.md). The hardware's dispatch of a one-item grid is this greedy rule on real
    run times, whose busiest program ends within one item of the average; planned here on the host, once per
    shape and on estimated weights, it keeps the one-item order (and so the L2 head groups) for a grid of one
    program per SM."""
    if programs < 1:
        raise ValueError(f"a schedule needs at least one program, got {programs}")
    free = [(0.0, p) for p in range(programs)]
    taken: list[list[int]] = [[] for _ in range(programs)]
    for item, weight in enumerate(weights):
        busy, p = heapq.heappop(free)
        taken[p].append(item)
        heapq.heappush(free, (busy + weight, p))
    offsets, items = [0], []
    for mine in taken:
        items += mine
        offsets.append(len(items))
    return offsets, items


def key_tile_query_steps(n_bh: int, n_tiles_n: int, head_group: int, n_queries: int, block_m: int, block_n: int,
                         causal: bool) -> list[int]:
    """The query tiles each (key tile, head) item of the dK/dV kernels streams, in their one-program-per-item order
    (``flash_common._item_tile_and_head`` without ``HEAVY_LAST``: causal key tiles come first-to-last already, the
    first seeing the most queries): a causal key tile starts at the query tile holding its first key."""
    tiles = []
    for first in range(0, n_bh, head_group):
        heads = min(head_group, n_bh - first)
        for j in range(n_tiles_n):
            lo = min((j * block_n // block_m) * block_m, n_queries) if causal else 0
            tiles += [-(-(n_queries - lo) // block_m)] * heads
    return tiles


def schedule_table(weights: Sequence[float], programs: int) -> torch.Tensor:
    """A persistent kernel's item plan as an int32 ``(programs, row)`` table: row ``p`` holds program ``p``'s item
    count, then its items in turn, as :func:`list_schedule` deals the items of ``weights``."""
    offsets, items = list_schedule(weights, programs)
    counts = [offsets[p + 1] - offsets[p] for p in range(programs)]
    table = torch.zeros(programs, 1 + max(counts), dtype=torch.int32)
    for p, count in enumerate(counts):
        table[p, 0] = count
        table[p, 1:1 + count] = torch.tensor(items[offsets[p]:offsets[p + 1]], dtype=torch.int32)
    return table
