"""§1.2–1.3: naive PyTorch attention at scale, torch.compile, and FlashAttention-2 in Triton."""

from __future__ import annotations

from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Equation, Text
from cs336_systems.report.sections.common import question


def pytorch_attention(d: SectionData) -> list[Block]:
    return [
        question(d, "timings", "Forward and backward time and memory of naive attention (batch 8, one head) over "
                 "$d \\in \\{16, 32, 64, 128\\}$ and sequence lengths 256–16384.",
                 [d.table("*attention*", "*timing*", "*sweep*")], what="the attention sweep"),
        question(d, "memory", "Memory accounting for the smallest configuration that runs out of memory, and how "
                 "to remove that cost.", [
                     Text("Eager attention saves, per head and batch element, the $T\\times T$ score matrix "
                          "$S = QK^\\top/\\sqrt{d}$ and its softmax $P$ for the backward pass, besides $Q, K, V$ "
                          "and the output $O$ ($T\\times d$ each). In fp32 the memory saved for backward is"),
                     Equation([r"M_{\mathrm{saved}}(T, d) \approx 4\,B\,(2T^2 + 4Td)\ \mathrm{bytes},"]),
                     Text("quadratic in the sequence length: doubling $T$ quadruples it. Recomputing $S$ and $P$ "
                          "block by block in the backward pass, as FlashAttention does, keeps only $O$ and the "
                          "row-wise log-sum-exp $L$ ($T$ values), so the saved memory becomes linear in $T$."),
                     d.table("*oom*", "*memory*"),
                 ]),
    ]


def torch_compile(d: SectionData) -> list[Block]:
    return [
        question(d, "a", "Compiled versus eager attention, forward and backward.",
                 [d.table("*attention*compile*", "*compile*attention*", "*attention*")],
                 what="compiled vs eager attention timings"),
        question(d, "b", "The compiled Transformer end to end: forward, and forward + backward + optimizer step.",
                 [d.table("*model*", "*end_to_end*", "*transformer*")], what="compiled vs eager model timings"),
    ]


def flash_attention(d: SectionData) -> list[Block]:
    return [
        question(d, "flash_forward", "FlashAttention-2 forward in PyTorch and in Triton, with a causal flag.", [
            Text("The forward pass tiles $Q$ into row blocks of $B_q$ rows and streams $K, V$ in column blocks of "
                 "$B_k$ rows, keeping a running row maximum $m$, normalizer $\\ell$ and unnormalized output "
                 "$\\tilde O$ in on-chip memory; per key block $j$:"),
            Equation([
                r"S^{(j)} = Q_i K_j^\top/\sqrt{d},\quad m^{(j)} = \max\left(m^{(j-1)}, \mathrm{rowmax}\,S^{(j)}\right),"
                r"\quad \tilde P^{(j)} = \exp\left(S^{(j)} - m^{(j)}\right)",
                r"\ell^{(j)} = e^{m^{(j-1)} - m^{(j)}}\,\ell^{(j-1)} + \mathrm{rowsum}\,\tilde P^{(j)},\quad "
                r"\tilde O^{(j)} = \mathrm{diag}\left(e^{m^{(j-1)} - m^{(j)}}\right)\tilde O^{(j-1)} + \tilde P^{(j)} V_j",
                r"O_i = \mathrm{diag}\left(\ell\right)^{-1}\tilde O,\qquad L_i = m + \log \ell",
            ]),
            Text("With the causal flag, key blocks entirely above the diagonal are skipped and the diagonal block "
                 "is masked with $-10^6$ before the maximum."),
        ]),
        question(d, "flash_backward", "The backward pass by recomputation (compiled PyTorch).", [
            Text("Only $O$ and $L$ are saved. With $D = \\mathrm{rowsum}(O \\circ dO)$ the backward recomputes "
                 "$P = \\exp(S - L)$ tile by tile:"),
            Equation([
                r"dV = P^\top dO,\quad dP = dO\,V^\top,\quad dS = P \circ (dP - D),",
                r"dQ = dS\,K/\sqrt{d},\quad dK = dS^\top Q/\sqrt{d}",
            ]),
        ]),
        question(d, "flash_benchmarking", "Triton FlashAttention-2 versus PyTorch attention (batch 1, causal) over "
                 "sequence lengths $2^7$–$2^{16}$, head sizes $2^4$–$2^7$, bf16 and fp32: forward, backward and "
                 "forward + backward latency.", [d.table("*flash*", "*benchmark*", "*latenc*")],
                 what="the FlashAttention benchmark sweep"),
        question(d, "leaderboard", "Leaderboard timing: forward + backward, batch 1, $T = 16384$, $d_{\\mathrm{model}} "
                 "= 1024$ in 16 heads, bf16, causal.", [d.table("*leaderboard*")], what="the leaderboard timing"),
    ]
