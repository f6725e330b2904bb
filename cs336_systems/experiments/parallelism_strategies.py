"""§2.5 Analyzing parallelism strategies (the 2026 handout's §8, which replaces communication accounting):
when a SwiGLU FFN under DP, FSDP, TP and FSDP × TP stops being compute bound, in closed form.

Analytic: it runs anywhere, in seconds. The closed forms live in :mod:`cs336_systems.parallelism_calcs` as
``sympy`` expressions. This section writes them as LaTeX (``formulas``), checks each against a simulation
(``ring_check``: ring collectives on arrays; ``strategy_check``: DP, FSDP and TP run device by device, FLOPs
counted by ``torch.utils.flop_counter``, gradients against the unsharded FFN's), and evaluates the device
bounds at example numbers (``bounds``, ``bounds_vs_batch``). ``figures/parallelism_strategies/`` is written
only when asked to publish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import sympy as sp
import torch

from cs336_systems import parallelism_calcs as pc
from cs336_systems.experiments.section import Section, check_positive, param
from cs336_systems.results import ResultWriter


@dataclass(frozen=True)
class Params:
    flops: float = param(989e12, "C: FLOP/s per device (H100 SXM, bf16 dense)")
    egress: float = param(450e9, "W: egress bytes/s per device (H100 NVLink 4: 900 GB/s both ways)")
    batch_tokens: int = param(2 * 32768, "B: tokens in the batch (the 2026 leaderboard: 2 x 32768)")
    shapes: list[list[int]] = param([[1600, 6400], [2560, 10240], [4096, 11008], [16384, 53248]],
                                    "(D, D_FF) of the FFNs evaluated: 2025 xl, 2026 xl, the 8B leaderboard, xxl")
    ring_devices: list[int] = param([2, 3, 4, 5, 8], "device counts the ring simulation runs")
    ring_elements: int = param(24, "elements of each device's tensor in the ring simulation")
    ffn_devices: list[int] = param([2, 4], "device counts the sharded FFN steps run")
    ffn_shape: list[int] = param([8, 6, 12], "(B, D, D_FF) of the simulated FFN (float64)")

    def check(self) -> None:
        check_positive(flops=self.flops, egress=self.egress, batch_tokens=self.batch_tokens,
                       ring_elements=self.ring_elements)
        if any(len(s) != 2 or min(s) < 1 for s in self.shapes):
            raise ValueError(f"shapes are [D, D_FF] pairs of positive integers, got {self.shapes}")
        if min(self.ring_devices, default=2) < 2 or min(self.ffn_devices, default=2) < 2:
            raise ValueError("ring_devices and ffn_devices need at least 2 devices each")
        if len(self.ffn_shape) != 3 or min(self.ffn_shape) < 1:
            raise ValueError(f"ffn_shape is [B, D, D_FF], got {self.ffn_shape}")
        b, _, f = self.ffn_shape
        bad = [n for n in self.ffn_devices if b % n or f % n]
        if bad:
            raise ValueError(f"ffn_shape {self.ffn_shape}: B and D_FF must split over {bad[0]} devices")


PRESETS = {"full": Params(), "quick": Params(), "smoke": Params(ring_devices=[2, 3], ffn_devices=[2])}


def _latex(expr: sp.Expr) -> str:
    return sp.latex(sp.factor(expr)) if isinstance(expr, sp.Expr) else str(expr)


def formula_rows() -> list[dict[str, str]]:
    """Every deliverable's closed form, with the bound re-derived by sympy from its two times (``derived``:
    whether ``bound_from_times`` agrees with the hand-derived bound)."""
    rows = [{"problem": "alternate_ring_all_reduce", "quantity": "time", "pass": "",
             "latex": _latex(pc.ALTERNATE_ALL_REDUCE), "derived": ""}]
    for s in pc.STRATEGIES:
        problem = {"dp": "data_parallel_calcs", "fsdp": "fsdp_calcs", "tp": "tp_calcs"}[s.name]
        derived = pc.bound_from_times(s.comm_time, s.compute_time, s.devices)
        agrees = sp.simplify(derived - s.bound) == 0
        dev = sp.latex(s.devices)
        rows += [
            {"problem": problem, "quantity": "FLOPs per device", "pass": s.pass_, "latex": _latex(s.flops),
             "derived": ""},
            {"problem": problem, "quantity": "communication time", "pass": s.pass_, "latex": _latex(s.comm_time),
             "derived": ""},
            {"problem": problem, "quantity": "compute bound while", "pass": s.pass_,
             "latex": f"{dev} \\leq {sp.latex(s.bound)}", "derived": "yes" if agrees else "NO"},
        ]
    t = pc.FSDP_TP
    best, split = pc.shared_network_bound()
    rows += [
        {"problem": "fsdp_tp_calcs", "quantity": "FLOPs per device", "pass": "forward", "latex": _latex(t["flops"]),
         "derived": ""},
        {"problem": "fsdp_tp_calcs", "quantity": "communication time", "pass": "forward",
         "latex": f"\\max\\left({_latex(t['fsdp_axis'])},\\ {_latex(t['tp_axis'])}\\right)", "derived": ""},
        {"problem": "fsdp_tp_calcs", "quantity": "compute bound while (overlapped)", "pass": "forward",
         "latex": f"N \\leq {sp.latex(t['bound_overlapped'])} \\approx {sp.latex(t['bound_overlapped_large_n'])}",
         "derived": ""},
        {"problem": "fsdp_tp_calcs", "quantity": "compute bound while (shared network)", "pass": "forward",
         "latex": (f"N \\leq {sp.latex(t['bound_shared_large_n'])}"
                   f"\\ \\mathrm{{at}}\\ N_{{FSDP}} = {sp.latex(t['best_split_shared']['N_FSDP'])},"
                   f"\\ N_{{TP}} = {sp.latex(t['best_split_shared']['N_TP'])}"),
         "derived": "yes" if sp.simplify(best - t["bound_shared_large_n"]) == 0
         and all(sp.simplify(split[k] - v) == 0 for k, v in t["best_split_shared"].items()) else "NO"},
    ]
    return rows


def ring_rows(devices: list[int], elements: int) -> pd.DataFrame:
    """Ring all-reduce and the alternate all-reduce simulated on random arrays: correct sums, and the time
    in units of S/W against the formulas."""
    rng = np.random.default_rng(0)
    rows = []
    for n in devices:
        inputs = [rng.standard_normal(elements * n) for _ in range(n)]
        total = np.sum(inputs, axis=0)
        size = inputs[0].nbytes
        for kind, formula in (("all_reduce", pc.ring_all_reduce(pc.N, pc.S) / pc.S * pc.W),
                              ("alternate_all_reduce", pc.ALTERNATE_ALL_REDUCE / pc.S * pc.W)):
            outs, elapsed = pc.simulate_ring(kind, inputs)
            rows.append({"collective": kind, "devices": n, "correct": all(np.allclose(o, total) for o in outs),
                         "simulated_S_over_W": elapsed / size, "formula_S_over_W": float(formula.subs(pc.N, n))})
    return pd.DataFrame(rows)


def strategy_rows(devices: list[int], shape: list[int]) -> pd.DataFrame:
    """DP, FSDP and TP run device by device on a float64 FFN: FLOPs per device (counted) against the formulas,
    and the largest difference of outputs and gradients from the unsharded step."""
    b, d, f = shape
    gen = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(b, d, generator=gen, dtype=torch.float64) for _ in range(2))
    w1, w2 = (torch.randn(d, f, generator=gen, dtype=torch.float64) for _ in range(2))
    w3 = torch.randn(f, d, generator=gen, dtype=torch.float64)
    y, dx, grads = pc.ffn_step(x, w1, w2, w3, dy)
    rows = []
    for name in ("dp", "fsdp", "tp"):
        for n in devices:
            step = pc.sharded_ffn_step(name, n, x, w1, w2, w3, dy)
            values = {pc.B: b, pc.D: d, pc.F: f}
            expected = {}
            for s in pc.STRATEGIES:
                if s.name == name:
                    expected[s.pass_] = float(s.flops.subs({**values, s.devices: n}))
            if "forward" not in expected:  # DP's forward is the unsharded forward on B / N rows
                expected["forward"] = float(pc.strategy("fsdp", "forward").flops.subs({**values, pc.N_FSDP: n}))
            error = max(float((a - e).abs().max()) for a, e in zip((step.y, step.dx, *step.grads), (y, dx, *grads),
                                                                    strict=True))
            rows.append({"strategy": name, "devices": n,
                         "forward_flops": max(step.forward_flops), "forward_formula": expected["forward"],
                         "backward_flops": max(step.backward_flops), "backward_formula": expected["backward"],
                         "collective_bytes": sum(step.collective_bytes.values()), "max_abs_error": error})
    return pd.DataFrame(rows)


BOUND_COLUMNS = {"DP": ("dp", "backward"), "FSDP fwd": ("fsdp", "forward"), "FSDP bwd": ("fsdp", "backward"),
                 "TP fwd": ("tp", "forward"), "TP bwd": ("tp", "backward")}


def bound_rows(p: Params, shapes: list[list[int]], b: int) -> pd.DataFrame:
    """The largest compute-bound device count of every strategy, at ``p``'s C and W, per (D, D_FF) shape."""
    rows = []
    for d, f in shapes:
        at = {"batch": b, "d_model": d, "d_ff": f, "flops": p.flops, "egress": p.egress}
        row: dict[str, Any] = {"D": d, "D_FF": f, "B": b}
        for label, (name, pass_) in BOUND_COLUMNS.items():
            row[label] = pc.max_devices(pc.strategy(name, pass_).bound, **at)
        row["FSDP x TP overlapped"] = pc.max_devices(pc.FSDP_TP["bound_overlapped"], **at)
        row["FSDP x TP shared"] = pc.max_devices(pc.FSDP_TP["bound_shared_large_n"], **at)
        rows.append(row)
    return pd.DataFrame(rows)


def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """The closed forms, their simulated checks, and the bounds at example numbers."""
    formulas = pd.DataFrame(formula_rows())
    out.table(formulas, "formulas")
    ring = ring_rows(p.ring_devices, p.ring_elements)
    out.table(ring, "ring_check")
    strategies = strategy_rows(p.ffn_devices, p.ffn_shape)
    out.table(strategies, "strategy_check")
    bounds = bound_rows(p, p.shapes, p.batch_tokens)
    out.table(bounds, "bounds", extra={"C": p.flops, "W": p.egress})
    batches = np.geomspace(1024, 4 * 1024 * 1024, 25).round().astype(int)
    d, f = p.shapes[min(1, len(p.shapes) - 1)]
    sweep = pd.concat([bound_rows(p, [[d, f]], int(b)) for b in batches], ignore_index=True)
    out.table(sweep, "bounds_vs_batch", extra={"C": p.flops, "W": p.egress})
    fig = plot_bounds(sweep, d, f)
    out.figure(fig, "bounds_vs_batch")
    plt.close(fig)
    return {"formulas": formulas, "ring_check": ring, "strategy_check": strategies, "bounds": bounds,
            "bounds_vs_batch": sweep}


def plot_bounds(sweep: pd.DataFrame, d: int, f: int) -> plt.Figure:
    """Largest compute-bound device count against the batch, one line per strategy and pass."""
    long = sweep.melt(id_vars=["D", "D_FF", "B"], var_name="strategy", value_name="devices")
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(data=long, x="B", y="devices", hue="strategy", ax=ax)
    ax.set(xscale="log", yscale="log", xlabel="batch B (tokens)", ylabel="largest compute-bound N",
           title=f"FFN D={d}, D_FF={f}")
    ax.legend(fontsize=8)
    return fig


# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report import fmt  # noqa: E402
from cs336_systems.report.answers import question  # noqa: E402
from cs336_systems.report.data import SectionData  # noqa: E402
from cs336_systems.report.document import BEYOND_HANDOUT, Block, Equation, Text  # noqa: E402


def _large_n(row: Any, meta: dict[str, Any]) -> float:
    """(c)'s large-N FSDP × TP bound at a bounds row's shape and the run's C and W (NaN where the run recorded
    neither): what the shared-network bound is a quarter of."""
    if "C" not in meta or "W" not in meta:
        return float("nan")
    return pc.max_devices(pc.FSDP_TP["bound_overlapped_large_n"], batch=row["B"], d_model=row["D"], d_ff=row["D_FF"],
                          flops=meta["C"], egress=meta["W"])


def _eq(formulas: pd.DataFrame | None, problem: str, quantity: str, pass_: str = "",
        part: str = "") -> Equation | None:
    """The formula of ``quantity`` for ``pass_``, labelled with the handout's ``part`` letter and the pass."""
    if formulas is None:
        return None
    sel = formulas[(formulas["problem"] == problem) & (formulas["quantity"] == quantity)
                   & (formulas["pass"].fillna("") == pass_)]
    if not len(sel):
        return None
    words = " ".join(w for w in (f"({part})" if part else "", pass_) if w).replace(" ", "\\ ")
    label = f"\\mathrm{{{words}}}:\\quad " if words else ""
    return Equation([label + str(sel["latex"].iloc[0])])


def _parts(fx: pd.DataFrame | None, problem: str,
           parts: list[tuple[str, tuple[str, ...], str]], first: str = "a") -> list[Block | None]:
    """Per (quantity, passes, justification), the handout's parts from letter ``first`` on: the quantity's
    equation for each pass, then the justification."""
    blocks: list[Block | None] = []
    for i, (quantity, passes, why) in enumerate(parts):
        part = chr(ord(first) + i)
        blocks += [_eq(fx, problem, quantity, p, part) for p in passes]
        blocks.append(Text(f"({part}) {why}"))
    return blocks


def answer(d: SectionData) -> list[Block]:
    fx = d.frame("formulas")  # shown as equations; the table itself is in figures/index.html
    ring = d.frame("ring_check")
    checks = d.frame("strategy_check")
    bounds = d.frame("bounds")
    ring_text = None
    if ring is not None and len(ring):
        alt = ring[ring["collective"] == "alternate_all_reduce"]
        gap = (alt["simulated_S_over_W"] - alt["formula_S_over_W"]).abs().max()
        agree = bool(gap < 1e-9) and bool(alt["correct"].all())
        ring_text = Text(f"Simulated on {', '.join(str(int(n)) for n in alt['devices'])} devices, the algorithm sums "
                         "correctly and takes " + ("exactly" if agree else "NOT") + " the predicted time "
                         "(the appendix has the table).")
    check_text = None
    if checks is not None and len(checks):
        exact = bool(((checks["forward_flops"] == checks["forward_formula"])
                      & (checks["backward_flops"] == checks["backward_formula"])).all())
        check_text = Text("Each strategy run device by device (float64) counts " + ("exactly" if exact else "NOT")
                          + " the FLOPs per device of these formulas, and reproduces the unsharded outputs and "
                          f"gradients to {fmt.sig(checks['max_abs_error'].max())} at most (table: the appendix).")
    bound_text = None
    if bounds is not None and len(bounds):
        meta = d.meta("bounds").get("extra", {})
        c, w = (fmt.tex_sig(meta.get(k, float("nan"))) for k in ("C", "W"))
        r = bounds.iloc[min(1, len(bounds) - 1)]
        large, shared = _large_n(r, meta), fmt.sig(r["FSDP x TP shared"])
        combined = (f"(the exact bound; its large-$N$ form gives {fmt.sig(large)}, and a quarter of that, {shared}, "
                    "when the two axes share the network)." if large == large else
                    f"({shared} when the two axes share the network).")
        bound_text = Text(
            f"At $C = {c}$ FLOP/s, $W = {w}$ B/s"
            + (" (an H100's bf16 dense peak and NVLink egress; the handout leaves them symbolic) "
               if (meta.get("C"), meta.get("W")) == (989e12, 450e9) else " ")
            + f"and $B = {int(r['B']):,}$ tokens, an FFN with $D = {int(r['D'])}$, $D_{{FF}} = {int(r['D_FF'])}$ stays "
            f"compute bound up to {fmt.sig(r['DP'])} devices under DP or FSDP, {fmt.sig(r['TP fwd'])} (forward) and "
            f"{fmt.sig(r['TP bwd'])} (backward) under TP, and {fmt.sig(r['FSDP x TP overlapped'])} under FSDP × TP "
            + combined)
    just = {
        "dp_a": "On its $B/N_{DP}$ rows each device runs the backward's six matmuls of "
                "$2 (B/N_{DP}) D D_{FF}$ FLOPs each: $dz$, $dW_3$, the two products summed into $dx$, $dW_1$ and "
                "$dW_2$.",
        "dp_b": "The three weight gradients ($6 D D_{FF}$ bytes in 16 bits) are ring all-reduced, which takes "
                "$2 (N_{DP}-1)/N_{DP}$ times their size over $W$; the batch does not enter.",
        "dp_c": "Compute time shrinks as $1/N_{DP}$ while communication stays near $12 D D_{FF}/W$, so they "
                "cross where $12 B D D_{FF}/(N_{DP} C) = 12 (N_{DP}-1) D D_{FF}/(N_{DP} W)$.",
        "fsdp_a": "The same matmuls as DP on $B/N_{FSDP}$ rows: three in the forward, six in the backward; the "
                  "gathered weights are full size.",
        "fsdp_b": "The forward all-gathers the three weights; the backward gathers them again and "
                  "reduce-scatters their gradients: two ring collectives of the same size, each "
                  "$(N_{FSDP}-1)/N_{FSDP} \\cdot 2 D D_{FF}/W$ per weight.",
        "fsdp_c": "Both passes have communication proportional to their compute, 1:2 in each, so both cross at "
                  "the same device count, the DP one.",
        "tp_b": "Each device owns $D_{FF}/N_{TP}$ of the hidden units and runs every matmul on that slice for "
                "the whole batch.",
        "tp_c": "Only activations move: one all-reduce of the $(B, D)$ output $y$ in the forward and one of "
                "$dx$ in the backward; the weight gradients stay local.",
        "tp_d": "The all-reduce's time is independent of $N_{TP}$ for large $N_{TP}$ while compute shrinks as "
                "$1/N_{TP}$; the batch cancels, so only $D_{FF} W/C$ limits TP (the backward has twice the "
                "compute for the same communication).",
        "2d_a": "Every device multiplies a $B/N_{FSDP}$ batch shard by $D_{FF}/N_{TP}$-wide weight shards: the "
                "forward's $6 B D D_{FF}$ split $N$ ways.",
        "2d_b": "Along the FSDP axis each device gathers its TP slices of the three weights "
                "($2 D D_{FF}/N_{TP}$ bytes each); along the TP axis it all-reduces its batch shard's output "
                "($2 B D/N_{FSDP}$ bytes); overlapped, the longer one counts.",
        "2d_c": "Each axis must stay compute bound on its own, which gives the DP bound for $N_{FSDP}$ and the TP "
                "forward bound for $N_{TP}$: $N_{FSDP} \\leq 1 + BW/C$ and $N_{TP} \\leq 1 + 3 D_{FF} W/(2C)$. "
                "$N$ is at most their product, and for large $N$ that is "
                "$\\frac{3}{2} B D_{FF} W^2 / C^2$.",
        "2d_d": "With the sum of both times under the compute time, maximizing $N_{FSDP} N_{TP}$ (Lagrange "
                "conditions, re-derived by sympy) balances the two terms: $3 D_{FF} N_{FSDP} = 2 B N_{TP}$, "
                "each axis at half its overlapped limit, so $N$ is a quarter of (c)'s large-$N$ bound.",
    }
    fwd, bwd, both = ("forward",), ("backward",), ("forward", "backward")
    return [
        question(d, "alternate_ring_all_reduce", "How long does the alternate all-reduce take?", [
            _eq(fx, "alternate_ring_all_reduce", "time"),
            Text("In each of the $N-1$ steps every device forwards a whole input of $S$ bytes (not a $1/N$ chunk), "
                 "so the algorithm takes $N/2$ times as long as the ring all-reduce."),
            ring_text,
        ], what=None if ring_text else "the collective simulation"),
        question(d, "data_parallel_calcs", "Data parallel: backward FLOPs, backward communication time, and the "
                 "largest $N_{DP}$ that stays compute bound.", [
            *_parts(fx, "data_parallel_calcs", [("FLOPs per device", bwd, just["dp_a"]),
                                                ("communication time", bwd, just["dp_b"]),
                                                ("compute bound while", bwd, just["dp_c"])]),
        ]),
        question(d, "fsdp_calcs", "FSDP: FLOPs and communication time of both passes, and the largest "
                 "$N_{FSDP}$ for each.", [
            *_parts(fx, "fsdp_calcs", [("FLOPs per device", both, just["fsdp_a"]),
                                       ("communication time", both, just["fsdp_b"]),
                                       ("compute bound while", both, just["fsdp_c"])]),
        ]),
        question(d, "tp_calcs", "Tensor parallel: the backward pass, FLOPs and communication of both passes, and "
                 "the largest $N_{TP}$ for each.", [
            Text("(a) Per device $i$, with $dy$ replicated:"),
            Equation([r"dz^{(i)} = dy\,W_3^{(i)\top},\quad dx_2^{(i)} = dz^{(i)} * f(x_1^{(i)}),"
                      r"\quad dx_1^{(i)} = dz^{(i)} * f'(x_1^{(i)}) * x_2^{(i)}",
                      r"dW_3^{(i)} = z^{(i)\top} dy,\quad dW_2^{(i)} = x^\top dx_2^{(i)},\quad "
                      r"dW_1^{(i)} = x^\top dx_1^{(i)},",
                      r"dx = \mathrm{AllReduce}_i\left(dx_1^{(i)} W_1^{(i)\top} + dx_2^{(i)} W_2^{(i)\top}\right)"]),
            *_parts(fx, "tp_calcs", [("FLOPs per device", both, just["tp_b"]),
                                     ("communication time", both, just["tp_c"]),
                                     ("compute bound while", both, just["tp_d"])], first="b"),
            check_text,
        ], what=None if check_text else "the strategy simulation"),
        question(d, "fsdp_tp_calcs", "FSDP × TP: forward FLOPs and communication time, and the largest "
                 "$N = N_{FSDP} N_{TP}$ with overlapped and with shared collectives.", [
            *_parts(fx, "fsdp_tp_calcs", [("FLOPs per device", fwd, just["2d_a"]),
                                          ("communication time", fwd, just["2d_b"]),
                                          ("compute bound while (overlapped)", fwd, just["2d_c"]),
                                          ("compute bound while (shared network)", fwd, just["2d_d"])]),
            bound_text,
            d.table("bounds", caption="The largest compute-bound device count of each strategy at the example "
                    "numbers, per FFN shape. FSDP x TP overlapped is the exact bound; FSDP x TP shared is a quarter "
                    "of its large-$N$ form, the optimum of the shared-network condition, so the two columns differ "
                    "by more than a factor of four where the exact and large-$N$ bounds differ."),
        ], what="the bounds"),
        Text("", role=BEYOND_HANDOUT),  # the simulations that check the formulas, and the bounds plotted
        question(d, "alternate_ring_all_reduce", "The simulation that checks the formula.", [
            d.table("ring_check", caption="The ring and alternate all-reduce simulated on arrays: sums correct, and "
                    "time in units of S/W against the formula.")]),
        question(d, "tp_calcs", "DP, FSDP and TP run device by device against the formulas.", [
            d.table("strategy_check", caption="DP, FSDP and TP run device by device: the most FLOPs any device "
                    "counts against the formula, collective bytes, and the largest difference from the unsharded "
                    "outputs and gradients.")]),
        question(d, "fsdp_tp_calcs", "The bounds against the batch.", [
            d.figure("bounds_vs_batch", caption="The same bounds against the batch, for one FFN shape.")]),
    ]


SECTION = Section(
    name="parallelism_strategies", number="2.5", title="Analyzing parallelism strategies (2026 handout)",
    problems=("alternate_ring_all_reduce", "data_parallel_calcs", "fsdp_calcs", "tp_calcs", "fsdp_tp_calcs"),
    answer=answer, presets=PRESETS, run=run, gpus=0, depends=("cs336_systems/parallelism_calcs.py",),
)
