"""How ``FlashAttentionTriton`` builds and picks its kernels, as a value.

    from cs336_systems.attention import options
    with options.use(autotune=False):               # first candidate of each list, untuned
        out = FlashAttentionTriton.apply(q, k, v, True)
    with options.use(poly_exp2="all", gluon=False):  # polynomial exp2 everywhere, Triton forward on Hopper
        ...
    options.set_options(candidates=my_tiles)        # process-wide, e.g. from a tuning harness

The setting is process-wide (a context manager restores the previous one), not thread-local: autograd runs
a CUDA backward on a thread of its own, which must see the options its forward ran with. Every launch
reads :func:`current`, so a change takes effect at the next call; tuned kernels are cached per option
set, so switching back costs nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

#: The kernels whose tiles are tuned; ``poly_exp2`` names a subset of them.
PHASES = ("forward", "dkdv", "dq")
#: Phases that exponentiate with the FMA-pipe polynomial unless a tile pins its method (see :class:`Tile`).
DEFAULT_POLY_EXP2 = frozenset({"dkdv"})


class Tile(NamedTuple):
    """One autotuning candidate of a kernel.

    ``maxnreg`` caps the registers per thread. On Hopper an SM sub-partition holds 16,384 registers, so a
    4-warp program at 169-255 registers leaves room for 2 programs per SM and one at <= 168 for 3: a cap
    just under such a cliff buys a third (or fourth) resident program for latency hiding at the price of a
    few spilled registers. ``poly`` pins how the tile exponentiates 16-bit scores (``True``: the FMA-pipe
    polynomial, ``False``: ``ex2``) so that the tuner chooses it together with the tile: which is faster
    depends on the tile's register budget (docs/flash_attention/NOTES.md). ``None`` follows the options'
    phases, and an explicit ``poly_exp2`` overrides every pin.
    """

    block_m: int
    block_n: int
    warps: int
    stages: int
    maxnreg: int | None = None
    poly: bool | None = None


#: Candidate tiles per phase: the winners on an H100 for head dims 64 and 128 plus a neighbour or two
#: (docs/flash_attention/NOTES.md; the wider lists they were chosen from live with the tuning harness,
#: ``experiments.flash_benchmarking.WIDE_CANDIDATES``). Forward and dQ keep BLOCK_M queries resident while BLOCK_N-key
#: tiles stream past; dK/dV keeps BLOCK_N keys resident while BLOCK_M-query tiles stream past. Each
#: candidate costs about 0.8 s of compile per shape class on first use; the first is the untuned default.
DEFAULT_CANDIDATES: dict[str, tuple[Tile, ...]] = {
    "forward": (Tile(128, 64, 8, 3), Tile(64, 128, 4, 3), Tile(128, 64, 4, 3), Tile(64, 64, 4, 3)),
    "dkdv": (Tile(64, 64, 4, 3, maxnreg=168, poly=False), Tile(64, 64, 4, 3), Tile(32, 64, 4, 3, maxnreg=168),
             Tile(64, 128, 8, 3), Tile(64, 128, 8, 3, poly=False)),
    "dq": (Tile(128, 64, 4, 3), Tile(128, 64, 8, 3), Tile(64, 64, 4, 3)),
}  # fmt: skip


#: Default :attr:`FlashOptions.l2_share` (docs/flash_attention/l2_head_groups.md).
DEFAULT_L2_SHARE = 0.5
#: The Gluon kernels' tiles, (BLOCK_M, BLOCK_N) choices: the forward's BLOCK_M is two or three 64-query
#: consumers, the dK/dV backward's BLOCK_N two 64-key consumers.
_GLUON_FORWARD_TILES = ((128, 192), (64, 128))
_GLUON_BACKWARD_TILES = ((64, 128), (128,))


def _gluon_tiles(value: Any, name: str = "gluon_tiles",
                 allowed: tuple[tuple[int, ...], tuple[int, ...]] = _GLUON_FORWARD_TILES,
                 ) -> tuple[tuple[int, tuple[int, int, int]], ...] | None:
    """``{head_dim: (BLOCK_M, BLOCK_N, STAGES)}`` (JSON keys may be strings) as a sorted, hashable tuple."""
    if value is None:
        return None
    items = value.items() if isinstance(value, dict) else value
    tiles = []
    for d, tile in items:
        try:
            d, tile = int(d), tuple(int(x) for x in tile)
        except (TypeError, ValueError):
            raise ValueError(f"{name} maps a head dim to (BLOCK_M, BLOCK_N, STAGES), got {d!r}: {tile!r}") \
                from None
        if d not in (64, 128) or len(tile) != 3 or tile[0] not in allowed[0] or tile[1] not in allowed[1] \
                or not 2 <= tile[2] <= 6:  # one stage would hang: a consumer frees a buffer after the next lands
            raise ValueError(f"{name}: head dim 64 or 128 to (BLOCK_M in {allowed[0]}, BLOCK_N in {allowed[1]}, "
                             f"STAGES 2-6), got {d}: {tile}")
        tiles.append((d, tile))
    return tuple(sorted(tiles))


def _phases(value: str | Sequence[str] | frozenset[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = PHASES if value == "all" else () if value == "none" else [v for v in value.split(",") if v]
    phases = frozenset(value)
    if not phases <= set(PHASES):
        raise ValueError(f"poly_exp2 names unknown phases {sorted(phases - set(PHASES))}; valid: "
                         f"{', '.join(PHASES)} (or 'all', 'none')")
    return phases


#: Keys per row below which the Gluon backward (:attr:`FlashOptions.gluon_backward`) leaves a head dim to the Triton
#: kernels. H200, fwd+bwd alternating in one process (docs/flash_attention/dq_atomic.md, "Routed by length" and
#: "From 1,000 keys at head dim 128"): at head dim 128 the fused Gluon backward is faster from 1,000 keys on, causal
#: or not, and slower at 512 and 256; at 64 only from 16,384 (slower at 12,345 and at 8,192 without the mask).
DEFAULT_GLUON_BACKWARD_MIN_KEYS = ((64, 16384), (128, 1000))


def _min_keys(value: Any) -> tuple[tuple[int, int], ...]:
    """``{head_dim: keys}`` (JSON keys may be strings) or one count for every head dim, as a sorted tuple."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = {d: value for d in (64, 128)}
    items = value.items() if isinstance(value, dict) else value
    pairs = []
    try:
        for d, keys in items:
            if isinstance(keys, bool) or int(keys) != keys or int(keys) < 0 or int(d) not in (64, 128):
                raise ValueError
            pairs.append((int(d), int(keys)))
    except (TypeError, ValueError):
        raise ValueError(f"gluon_backward_min_keys maps head dim 64 or 128 to a non-negative key count (or is one "
                         f"count for both), got {value!r}") from None
    return tuple(sorted(dict(pairs).items()))


#: Keys × head dim (halved when causal) per query row below which the Triton forward runs instead of the Gluon
#: one. H100: rows up to 64,000 ran faster on Triton's forward at every measured shape, rows from 128,000 on
#: Gluon's (or level); the threshold sits between the two.
DEFAULT_GLUON_MIN_KEY_WORK = 96 * 1024


#: Head dims at which the Gluon forward runs its persistent grid by default (``FlashOptions.gluon_persistent``). H200,
#: forward kernel time alternating with the one-item grid (docs/flash_attention/persistent.md, "the planned
#: schedule"): at d = 128 faster from 2,048 to 4,096 tokens and level at 16k; at d = 64 level at 16k and behind the
#: Triton forward at the short rows, so nothing to gain there.
DEFAULT_GLUON_PERSISTENT_HEAD_DIMS = (128,)


@dataclass(frozen=True)
class FlashOptions:
    """``autotune``: time every candidate once per shape class (else run each list's first tile that fits).
    ``candidates``: tiles per phase (default :data:`DEFAULT_CANDIDATES`; phases left out keep theirs).
    ``poly_exp2``: phases forced to the FMA-pipe polynomial exponential for 16-bit inputs (``"all"``,
    ``"none"``, ``"dkdv,dq"`` or a set); ``None`` lets each tile's pin decide, else ``dkdv``.
    ``gluon``: run the warp-specialized Gluon forward on Hopper where it applies.
    ``gluon_head_views``: let the Gluon forward also read ``(batch, heads, seq, d)`` views of
    ``(batch, seq, heads, d)`` tensors, the layout a Transformer block hands its attention. Correct on an H100
    but off by default: there it is slower than the Triton forward on such views (measured in
    docs/flash_attention/gluon_head_views.md), which therefore runs them.
    ``l2_share``: the share of the GPU's L2 cache that one group of heads' streamed operands may fill; the
    kernels run every tile of a group before the next group starts (``flash_triton.heads_per_l2_group``).
    ``None``: no grouping, heads fastest over the whole grid (the order before grouping, for A/B).
    ``gluon_tiles``: ``{head_dim: (BLOCK_M, BLOCK_N, STAGES)}`` for the Gluon forward at every length,
    replacing its per-length choice (``flash_fwd_sm90.tile_for``), e.g. for A/B.
    ``gluon_min_key_work``: the Gluon forward runs only where one query row's work, keys × head dim (halved
    when causal), is at least this; shorter rows run the Triton forward, whose lighter programs finish
    sooner (the threshold and the measurements behind it: docs/flash_attention/short_forward.md). 0: the Gluon
    forward wherever it applies.
    ``gluon_backward``: run the warp-specialized Gluon backward on Hopper where it applies (:mod:`.flash_bwd_sm90`)
    and the rows are long enough (``gluon_backward_min_keys``); elsewhere the Triton dQ and dK/dV kernels run.
    ``gluon_backward_min_keys``: ``{head_dim: keys}``, or one count for both head dims: the Gluon backward takes
    rows of at least this many keys, where it is the faster backward (:data:`DEFAULT_GLUON_BACKWARD_MIN_KEYS`). 0:
    wherever it applies.
    ``gluon_backward_tiles``: ``{head_dim: (BLOCK_M, BLOCK_N, STAGES)}`` for that kernel, e.g. for A/B.
    ``persistent``: programs per SM of a persistent grid for the Triton kernels (forward, dQ, dK/dV): where a
    call has more (tile, head) items than that many programs, each program takes items in turn
    (``flash_common._persistent_items``) instead of one program per item. 0 (the default): one program per
    item. Opt-in until measured (docs/flash_attention/persistent.md).
    ``gluon_persistent``: whether the Gluon forward runs a persistent grid, at most one program per SM, each taking
    its (query tile, head) items in turn with the next item's loads issued under the current one's last products
    and epilogue (FlashAttention-3's schedule); which items each program takes is planned on the host, once per
    shape, so that causal items of unequal length leave no tail. Same outputs as one program per item. ``None``
    (the default): at the head dims of :data:`DEFAULT_GLUON_PERSISTENT_HEAD_DIMS`, wherever the Gluon forward
    runs. ``True``: at every head dim, and it then also takes the short rows that ``gluon_min_key_work`` sends to
    the Triton forward (which stays faster at the short d = 64 rows); ``False``: never, for A/B
    (docs/flash_attention/persistent.md).
    ``gluon_q_buffers``: Q buffers of the persistent Gluon forward, 1 or 2. With one, a program loads its next
    item's Q only once every score of the current item is computed; with two, the next item's Q loads while the
    current one runs, at the price of a K/V stage where shared memory is short (at d = 128 two stages instead of
    three: ``flash_fwd_sm90.tile_for``). 1 by default until measured (docs/flash_attention/q_buffers.md).
    ``gluon_persistent_backward``: whether the Gluon dK/dV kernel, where it runs, runs a persistent grid, at most one
    program per SM taking host-planned (key tile, head) items in turn, the next item's K and V loaded while the
    consumers store the current one's dK and dV (the forward's schedule, cuDNN's backward's grid). Same outputs.
    Off by default: measured 1% slower, its extra spills in the query loop costing what the overlap gains
    (docs/flash_attention/persistent.md).
    ``dq_atomic``: whether the dK/dV kernel also accumulates dQ, adding each tile's ``dS K`` to a float32 buffer
    (five products per key and query tile instead of the two kernels' seven) while the dQ kernel only writes the
    ``[L; D]`` rows. The Gluon kernel adds by TMA bulk reductions, as FlashAttention-3 does; the Triton one by
    atomics. ``None`` (the default): wherever the Gluon kernel runs, and nowhere else (with the Triton kernel it
    measured slower). ``True``: with either kernel; ``False``: never, the Gluon dK/dV kernel then beside the
    Triton dQ kernel, for A/B (docs/flash_attention/dq_atomic.md).
    ``host_entry``: eager calls of 16-bit 4-D inputs whose launch plans are recorded run through the C++ host entry
    (:mod:`.host_entry`: no Python between the call and the GPU; compiled once per machine, torch and Python, on
    the first eager CUDA call, about half a minute); off, they replay the plans from Python, for A/B. Same kernels,
    same outputs; its host time is measured in docs/flash_attention/host_entry.md.
    """

    autotune: bool = True
    candidates: Any = None
    poly_exp2: Any = None
    gluon: bool = True
    gluon_head_views: bool = False
    l2_share: float | None = DEFAULT_L2_SHARE
    gluon_tiles: Any = None
    gluon_min_key_work: int = DEFAULT_GLUON_MIN_KEY_WORK
    gluon_backward: bool = True
    gluon_backward_tiles: Any = None
    gluon_backward_min_keys: Any = DEFAULT_GLUON_BACKWARD_MIN_KEYS
    persistent: int = 0
    gluon_persistent: bool | None = None
    gluon_q_buffers: int = 1
    gluon_persistent_backward: bool = False
    dq_atomic: bool | None = None
    host_entry: bool = True

    def __post_init__(self) -> None:
        for flag in ("autotune", "gluon", "gluon_head_views", "gluon_backward", "gluon_persistent_backward",
                     "host_entry"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        for flag, default in (("dq_atomic", "where the Gluon backward runs"),
                              ("gluon_persistent", "at the head dims where it measured faster")):
            if getattr(self, flag) is not None and not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True, False or None ({default}), got {getattr(self, flag)!r}")
        object.__setattr__(self, "gluon_backward_min_keys", _min_keys(self.gluon_backward_min_keys))
        share = self.l2_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not share > 0):
            raise ValueError(f"l2_share must be a positive number (a share of the L2 cache) or None, got {share!r}")
        work = self.gluon_min_key_work
        if isinstance(work, bool) or not isinstance(work, int) or work < 0:
            raise ValueError(f"gluon_min_key_work must be a non-negative integer (keys x head dim), got {work!r}")
        if self.gluon_q_buffers not in (1, 2) or isinstance(self.gluon_q_buffers, bool):
            raise ValueError(f"gluon_q_buffers must be 1 or 2, got {self.gluon_q_buffers!r}")
        if isinstance(self.persistent, bool) or not isinstance(self.persistent, int) or self.persistent < 0:
            raise ValueError(f"persistent must be a non-negative integer (programs per SM; 0: off), "
                             f"got {self.persistent!r}")
        object.__setattr__(self, "gluon_tiles", _gluon_tiles(self.gluon_tiles))
        object.__setattr__(self, "gluon_backward_tiles", _gluon_tiles(self.gluon_backward_tiles,
                                                                      "gluon_backward_tiles", _GLUON_BACKWARD_TILES))
        object.__setattr__(self, "poly_exp2", _phases(self.poly_exp2))
        given = dict(self.candidates or {})
        unknown = set(given) - set(PHASES)
        if unknown:
            raise ValueError(f"candidates for unknown phases {sorted(unknown)}; valid: {', '.join(PHASES)}")
        merged = {}
        for phase in PHASES:
            tiles = tuple(Tile(*t) for t in given.get(phase, DEFAULT_CANDIDATES[phase]))
            if not tiles:
                raise ValueError(f"no candidate tiles for {phase}")
            merged[phase] = tiles
        object.__setattr__(self, "candidates", tuple(merged.items()))  # hashable: the kernel cache's key

    def fuses_dq(self, gluon_backward_runs: bool) -> bool:
        """Whether the dK/dV kernel forms dQ too, given whether the Gluon backward runs the call (``dq_atomic``)."""
        return gluon_backward_runs if self.dq_atomic is None else self.dq_atomic

    def persistent_forward(self, head_dim: int) -> bool:
        """Whether the Gluon forward, where it runs, runs head dim ``head_dim`` on its persistent grid."""
        if self.gluon_persistent is None:
            return head_dim in DEFAULT_GLUON_PERSISTENT_HEAD_DIMS
        return self.gluon_persistent

    def backward_min_keys(self, head_dim: int) -> int:
        """The fewest keys per row at which the Gluon backward takes head dim ``head_dim``."""
        return dict(self.gluon_backward_min_keys).get(head_dim, 0)

    def tiles(self, phase: str) -> tuple[Tile, ...]:
        return dict(self.candidates)[phase]

    def poly_for(self, phase: str, tile: Tile) -> bool:
        """Whether ``tile`` of ``phase`` exponentiates with the polynomial (16-bit inputs only)."""
        if self.poly_exp2 is not None:
            return phase in self.poly_exp2
        return tile.poly if tile.poly is not None else phase in DEFAULT_POLY_EXP2

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for result provenance."""
        return {
            "autotune": self.autotune,
            "poly_exp2": ",".join(sorted(self.poly_exp2)) if self.poly_exp2 is not None else "tile pins, else dkdv",
            "gluon": self.gluon,
            "gluon_head_views": self.gluon_head_views,
            "l2_share": self.l2_share,
            "gluon_tiles": {d: list(t) for d, t in self.gluon_tiles} if self.gluon_tiles else None,
            "gluon_min_key_work": self.gluon_min_key_work,
            "gluon_backward": self.gluon_backward,
            "gluon_backward_tiles": ({d: list(t) for d, t in self.gluon_backward_tiles}
                                     if self.gluon_backward_tiles else None),
            "gluon_backward_min_keys": dict(self.gluon_backward_min_keys),
            "persistent": self.persistent,
            "gluon_persistent": self.gluon_persistent,
            "gluon_q_buffers": self.gluon_q_buffers,
            "gluon_persistent_backward": self.gluon_persistent_backward,
            "dq_atomic": self.dq_atomic,
            "host_entry": self.host_entry,
            "candidates": {p: len(t) for p, t in self.candidates},
            "default_candidates": all(self.tiles(p) == DEFAULT_CANDIDATES[p] for p in PHASES),
        }


_current = FlashOptions()
#: Counts option changes: launch plans (:mod:`.launch_plan`) are recorded per generation, so a replay never
#: runs kernels chosen under other options. Cheaper to compare than the options themselves.
_generation = 0


def current() -> FlashOptions:
    """The options the next launch uses."""
    return _current


def set_options(options: FlashOptions | None = None, **changes: Any) -> FlashOptions:
    """Replace the options (``options``, or the current ones with ``changes``); returns the previous."""
    global _current, _generation
    previous = _current
    _current = dataclasses.replace(options or _current, **changes)
    _generation += 1
    return previous


def generation() -> int:
    """A number that changes whenever the options are set (equal options set twice count twice)."""
    return _generation


@contextlib.contextmanager
def use(options: FlashOptions | None = None, **changes: Any) -> Iterator[FlashOptions]:
    """Run the block with ``options`` (or the current ones with ``changes``), then restore."""
    previous = set_options(options, **changes)
    try:
        yield _current
    finally:
        set_options(previous)
