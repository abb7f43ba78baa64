"""Counting the reads and writes of GPU main memory (HBM) that attention makes, step by step.

A GPU computes in small on-chip memory (SRAM; on an A100, 192 KB of combined L1 cache and shared
memory per streaming multiprocessor, about 20 MB over its 108, plus the register files) and keeps
tensors in large off-chip memory (HBM: 40-80 GB). FlashAttention's claim
(Dao et al. 2022) is about the traffic between the two: standard attention writes the n x n
scores and probabilities to HBM and reads them back, FlashAttention keeps each tile of them
in SRAM. The counts here follow the algorithms as the papers write them, in elements (multiply
by the bytes per element, 2 in fp16), for one head; multiply by batch * heads for a layer.

What is counted: every tensor an algorithm's step loads from or stores to HBM, as written in
the paper (standard attention: the paper's Algorithm 0 and its backward; FlashAttention: the
tiled loops of FlashAttention-1, Algorithms 1 and 4, and FlashAttention-2's reordered loops).
What is not: caches (L2 can serve a repeated read), the attention mask and dropout unless
asked for (each then reads and writes the n x n matrix once more per pass), causal tile
skipping (the counts are for full attention). Profilers measure more than this model; it is
for orders of magnitude and for how each term grows with n, d and the block size.

Built in notebooks/09_efficient_attention.ipynb, where the counts are compared with deck 000's
table (FlashAttention paper, Figure 2: GPT-2 medium, n = 1024, d = 64, 16 heads, batch 64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class Traffic:
    """HBM elements read and written by one algorithm, with the steps that read and write them."""

    steps: tuple[tuple[str, int, int], ...] = field(default=())  # (what, elements read, elements written)

    @property
    def reads(self) -> int:
        return sum(r for _, r, _ in self.steps)

    @property
    def writes(self) -> int:
        return sum(w for _, _, w in self.steps)

    @property
    def total(self) -> int:
        return self.reads + self.writes

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.steps + other.steps)

    def gigabytes(self, heads: int = 1, bytes_per_element: int = 2) -> float:
        """The total in GB (10^9 bytes) for ``heads`` heads (batch * n_heads) at ``bytes_per_element``."""
        return self.total * _count("heads", heads) * _count("bytes_per_element", bytes_per_element) / 1e9


def matmul_traffic(m: int, k: int, n: int) -> Traffic:
    """(m, k) @ (k, n) from HBM and back: read both inputs once, write the (m, n) product once.

    Deck 004 gives "n x m (reading A) + m x k (reading B) + n x m (writing AB)" for A (n, m) @
    B (m, k); the product is n x k, so its last term should be n x k:

    >>> matmul_traffic(2, 3, 4).total  # 2*3 + 3*4 + 2*4
    26
    """
    m, k, n = _count("m", m), _count("k", k), _count("n", n)
    return Traffic((("read A and B", m * k + k * n, 0), ("write AB", 0, m * n)))


def standard_attention_traffic(n: int, d: int, *, backward: bool = False, mask: bool = False,
                               dropout: bool = False) -> Traffic:
    """Standard attention, each step a separate kernel that reads its inputs from HBM and writes its output.

    Forward (FlashAttention paper, Algorithm 0): S = Q K^T, P = softmax(S), O = P V. Backward
    (its Appendix B.2): dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dP * P)), dQ = dS K, dK = dS^T Q.
    ``mask`` and ``dropout`` add a pass each over the n x n matrix (read and write), forward and backward.

    >>> standard_attention_traffic(1024, 64).total == 4 * 1024 * 64 + 4 * 1024**2
    True
    """
    n, d = _count("n", n), _count("d", d)
    nn, nd = n * n, n * d
    steps = [("S = Q K^T: read Q, K; write S", 2 * nd, nn)]
    if mask:
        steps.append(("mask S: read S; write S", nn, nn))
    steps.append(("P = softmax(S): read S; write P", nn, nn))
    if dropout:
        steps.append(("dropout P: read P; write P", nn, nn))
    steps.append(("O = P V: read P, V; write O", nn + nd, nd))
    if backward:
        steps += [
            ("dV = P^T dO: read P, dO; write dV", nn + nd, nd),
            ("dP = dO V^T: read dO, V; write dP", 2 * nd, nn),
        ]
        if dropout:
            steps.append(("dropout backward: read dP; write dP", nn, nn))
        steps.append(("dS = P * (dP - D): read P, dP; write dS", 2 * nn, nn))
        if mask:
            steps.append(("mask backward: read dS; write dS", nn, nn))
        steps += [
            ("dQ = dS K: read dS, K; write dQ", nn + nd, nd),
            ("dK = dS^T Q: read dS, Q; write dK", nn + nd, nd),
        ]
    return Traffic(tuple(steps))


def flash_attention_traffic(n: int, d: int, *, block: int, backward: bool = False, version: int = 1) -> Traffic:
    """FlashAttention's HBM traffic with ``block``-row tiles (full attention, no causal skip).

    ``block`` is the tile size that sets the count: the K/V block (B_c) for version 1, whose
    traffic does not depend on the Q block, and the Q block for version 2. FlashAttention-1 sets
    B_c = ceil(M / 4d) for an SRAM of M elements (its Algorithm 1, line 1): 384 for d = 64 and
    an A100's 192 KB of fp16 (M = 98,304).

    Version 1 (Algorithm 1): the outer loop runs over the n / block tiles of K and V, each read
    once; the inner loop reads every tile of Q and of the running O, l, m, and writes O, l, m
    back, once per outer step. Version 2 swaps the loops: each Q tile is read once and its O
    written once, and K, V are read once per Q tile. The backward recomputes S and P tile by tile
    from Q, K and the saved row statistics instead of reading an n x n matrix.

    >>> heads = 64 * 16  # batch 64, 16 heads: deck 000's GPT-2 medium
    >>> round(flash_attention_traffic(1024, 64, block=384, backward=True).gigabytes(heads), 1)
    4.6
    >>> round(standard_attention_traffic(1024, 64, backward=True).gigabytes(heads), 1)
    25.2
    """
    n, d, block = _count("n", n), _count("d", d), _count("block", block)
    if version not in (1, 2):
        raise ValueError(f"version must be 1 or 2 (FlashAttention-1 or -2), got {version!r}")
    tiles = math.ceil(n / block)
    nd = n * d
    if version == 1:
        steps = [
            ("initialise O, l, m in HBM", 0, nd + 2 * n),
            ("read K, V once (outer loop)", 2 * nd, 0),
            (f"read Q, O, l, m once per K/V tile ({tiles} tiles)", tiles * (2 * nd + 2 * n), 0),
            (f"write O, l, m once per K/V tile ({tiles} tiles)", 0, tiles * (nd + 2 * n)),
        ]
        if backward:
            steps += [
                ("initialise dQ, dK, dV in HBM", 0, 3 * nd),
                ("read K, V once (outer loop)", 2 * nd, 0),
                (f"read Q, O, dO, dQ, l, m once per K/V tile ({tiles} tiles)", tiles * (4 * nd + 2 * n), 0),
                (f"write dQ once per K/V tile ({tiles} tiles)", 0, tiles * nd),
                ("write dK, dV once per K/V tile", 0, 2 * nd),
            ]
        return Traffic(tuple(steps))
    steps = [
        ("read Q once (outer loop)", nd, 0),
        (f"read K, V once per Q tile ({tiles} tiles)", tiles * 2 * nd, 0),
        ("write O and the log-sum-exp L", 0, nd + n),
    ]
    if backward:
        steps += [
            ("D = rowsum(dO * O): read dO, O; write D", 2 * nd, n),
            ("read K, V once (outer loop)", 2 * nd, 0),
            (f"read Q, dO, L, D once per K/V tile ({tiles} tiles)", tiles * (2 * nd + 2 * n), 0),
            (f"add into dQ (read and write) once per K/V tile ({tiles} tiles)", tiles * nd, tiles * nd),
            ("write dK, dV", 0, 2 * nd),
        ]
    return Traffic(tuple(steps))
