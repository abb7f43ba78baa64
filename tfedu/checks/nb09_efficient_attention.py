"""Checkers for notebooks/09_efficient_attention.ipynb: the online softmax, a tiled matmul, FlashAttention.

Seven exercises, each checked against tfedu's reference after first trying the known mistakes:

- 9.1 ``online_softmax_step(m, l, x_block) -> (m_new, l_new)``: the running sum not rescaled when
  the max grows, the exponent taken before the max is updated (exp(x - m_old)), the rescale
  factor upside down (exp(m_new - m)), the block's own max only (the old m forgotten), the block
  not added, exp of the raw scores (overflow), the max of the whole tensor instead of each row,
  (l, m) returned in the wrong order, the inputs changed in place. Compared with
  ``tfedu.softmax.online_softmax_step`` step by step, from m = -inf, l = 0.
- 9.2 ``tiled_matmul(A, B, tile) -> C``: a partial product written over instead of added, edge
  tiles dropped when a size is not a multiple of ``tile``, whole matrices multiplied instead of
  tiles (recorded with tfedu.flash.MatmulOperands: no torch matmul may see an operand wider than
  ``tile``). Compared with ``A @ B``.
- 9.3 ``flash_tile_update(m, l, o, s, v) -> (m_new, l_new, o_new)``: o not rescaled when the max
  grows, o divided by l inside the loop (too early), a softmax of each tile on its own, l not
  rescaled, the tile's weights taken against the old max, the factor upside down. Compared with
  ``tfedu.flash.tile_update`` on single steps and through a whole tiled attention against
  ``F.scaled_dot_product_attention``.
- 9.4 ``flash_attention_forward(q, k, v, causal, block_q, block_k) -> (o, lse)``: the output not divided by l,
  no 1/sqrt(d) scale, lse without the max or the max alone, the state carried across query blocks, the
  diagonal hidden or one future key shown, a causal mask in tile coordinates, blocks the diagonal crosses
  skipped, short last blocks dropped; with MatmulOperands, the whole score matrix at once and causal
  attention that skips nothing. Compared with ``tfedu.flash.flash_forward``, SDPA and ``torch.logsumexp``.
- 9.5 ``flash_attention_backward(q, k, v, o, lse, do, causal, block_q, block_k) -> (dq, dk, dv)``: D left out or
  summed over everything, the weights from the raw scores, no scale in dq and dk, an unmasked causal tile, dq or
  dk and dv overwritten instead of accumulated, crossed tiles skipped, nothing skipped. Compared with autograd
  through SDPA in float64.
- 9.6 ``linear_attention_recurrent(q, k, v, eps)`` and ``linear_attention_cumsum(q, k, v, eps)``: causal linear
  attention as a recurrence and with cumulative sums, each against ``linear_attention_quadratic(causal=True)`` and
  the two against each other; the own key left out, no feature map, no normaliser, every key seen, the
  cumulative sum along the features.
- 9.7 the loop of a Triton kernel ``flash_kernel(Q, K, V, O, N, scale, D_HEAD, BLOCK_M, BLOCK_N)`` (full attention,
  the set-up and the store given), launched by ``launch_flash_kernel`` through Triton's interpreter on a CPU or
  compiled on a GPU, against SDPA: the accumulator or l not rescaled, the max never updated, keys past N not
  masked, no scale (a variant kernel with a MISTAKE switch makes each).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tfedu.checks.core import (
    CheckFailure,
    Hints,
    Probe,
    call_on_copies,
    checker,
    compare,
    describe,
    expect,
    global_names,
    names_bound,
)
from tfedu.checks.building_blocks import ACTIVATIONS, ELEMENTARY
from tfedu.checks.probes import CLEANUP, HELPERS, as_array, compare_outputs
from tfedu.flash import MatmulOperands, flash_backward, flash_forward, linear_attention_quadratic, tile_update
from tfedu.softmax import online_softmax_step

NEG_INF = float("-inf")


def _rows_max(x: torch.Tensor) -> torch.Tensor:
    return x.amax(dim=-1)


def _exps_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x - m[..., None]).exp().sum(dim=-1)


# ----------------------------------------------------------------------------- 9.1 online_softmax_step

HINT_L_NOT_RESCALED = (
    "your running sum l is not rescaled when the max grows: every term already in l is exp(x_j - m_old), so "
    "before adding the new block's terms multiply l by exp(m_old - m_new), which turns each old term into "
    "exp(x_j - m_new)"
)
HINT_EXP_BEFORE_MAX = (
    "you took the exponent before updating the max (exp(x - m) with the old m): when the block holds a larger "
    "score than m, that exponent is above 1 and can overflow, and at the first step m = -inf gives exp(+inf). "
    "Take m_new = max(m, max of the block) first, then exp(x - m_new)"
)
HINT_FACTOR_INVERTED = (
    "your rescale factor is upside down: exp(m_new - m) >= 1 grows the old sum; the old terms must shrink "
    "to be relative to the larger max, so multiply by exp(m - m_new) <= 1"
)
HINT_BLOCK_MAX_ONLY = (
    "your new max is the block's max alone: the running max is the larger of the old max and the block's, "
    "row by row; a block of small scores must not lower it"
)
HINT_BLOCK_NOT_ADDED = "your new sum leaves out the block: add sum(exp(x_block - m_new)) over the block's last dim"
HINT_RAW_EXP = (
    "NaN or Inf with scores around 1000: you exponentiated the raw scores. Every exponent must be taken "
    "relative to the running max, exp(x - m_new), which keeps it <= 0"
)
HINT_GLOBAL_MAX = (
    "you took the max over the whole block tensor, not each row: every row keeps its own running max, so take "
    "the block's max along its last axis only, one max per row of shape (*rows)"
)
HINT_SWAPPED = "you returned (l_new, m_new): return the max first, (m_new, l_new)"
HINT_BLOCK_OWN_MAX = (
    "you took the block's exponentials against the block's own max: every term of l_new must be relative to the "
    "same max, m_new, so add sum(exp(x_block - m_new)), not sum(exp(x_block - max of the block))"
)
HINT_NO_MAX = (
    "you added exp of the raw scores, exp(x_block), with no max subtracted: l is a sum of exp(x_j - m), each "
    "exponent taken relative to the running max, so add sum(exp(x_block - m_new))"
)
HINT_STEP_SHORTCUT = (
    "your online_softmax_step calls {name}: the exercise is to keep the running max and sum yourself, with "
    "torch.maximum, torch.exp and a sum (a softmax or logsumexp function does the whole row at once)"
)
STEP_SHORTCUTS = ("softmax", "log_softmax", "logsumexp")
HINT_STEP_MUTATED = (
    "your online_softmax_step changed the caller's `{name}` in place: return new tensors and leave m and l as "
    "they were"
)
HINT_STEP_CALL = (
    "online_softmax_step(m, l, x_block): m and l have shape (*rows), x_block (*rows, block); return the pair "
    "(m_new, l_new), each of shape (*rows)"
)


def _step_mistakes(m: torch.Tensor, l: torch.Tensor, x: torch.Tensor) -> list[tuple[str, tuple[torch.Tensor, torch.Tensor]]]:
    m_new = torch.maximum(m, _rows_max(x))
    with np.errstate(all="ignore"):
        mistakes = [
            (HINT_NO_MAX, (m_new, l + x.exp().sum(dim=-1))),  # before the exponent-first mistakes: both overflow
            (HINT_NO_MAX, (m_new, l * (m - m_new).exp() + x.exp().sum(dim=-1))),
            (HINT_L_NOT_RESCALED, (m_new, l + _exps_sum(x, m_new))),
            (HINT_EXP_BEFORE_MAX, (m_new, l + _exps_sum(x, m))),
            (HINT_EXP_BEFORE_MAX, (m_new, l * (m - m_new).exp() + _exps_sum(x, m))),
            (HINT_FACTOR_INVERTED, (m_new, l * (m_new - m).exp() + _exps_sum(x, m_new))),
            (HINT_BLOCK_MAX_ONLY, (_rows_max(x), l * (m - _rows_max(x)).exp() + _exps_sum(x, _rows_max(x)))),
            (HINT_BLOCK_NOT_ADDED, (m_new, l * (m - m_new).exp())),
            (HINT_BLOCK_OWN_MAX, (m_new, l * (m - m_new).exp() + _exps_sum(x, _rows_max(x)))),
        ]
    big = torch.maximum(m, x.amax().expand_as(m))
    mistakes.append((HINT_GLOBAL_MAX, (big, l * (m - big).exp() + _exps_sum(x, big))))
    return mistakes


def _pair(got: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    expect(isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got),
           f"{what} should return a pair of tensors (m_new, l_new), got {describe(got)}")
    return got[0], got[1]


def _same(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Equal shapes and values, with -inf matching -inf (torch.allclose treats equal infinities as close)."""
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=False))


def _same_or_both_bad(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, NaN and Inf in the same places (Inf of the same sign), the finite entries close."""
    if not (a.shape == b.shape and a.is_floating_point() and b.is_floating_point()):
        return False
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb) or not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False
    inf = torch.isinf(a)
    return torch.equal(a[inf], b[inf]) and _same(a[fa], b[fb])


def _check_step_call(fn: Any, m: torch.Tensor, l: torch.Tensor, x: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    got = call_on_copies(fn, {"m": m, "l": l, "x_block": x}, name="online_softmax_step",
                         mutated_hint=HINT_STEP_MUTATED, error_hint=HINT_STEP_CALL)
    got_m, got_l = _pair(got, what)
    want_m, want_l = online_softmax_step(m, l, x)
    if _same(got_m, want_l) and _same(got_l, want_m) and not _same(want_m, want_l):
        raise CheckFailure(HINT_SWAPPED)
    overflowed = got_l.shape == want_l.shape and got_l.is_floating_point() and not bool(torch.isfinite(got_l).all())
    if overflowed and bool(torch.isinf(x.exp()).any()):  # only scores this large make a raw exp overflow
        raise CheckFailure(HINT_RAW_EXP)
    for hint, (wrong_m, wrong_l) in _step_mistakes(m, l, x):
        if _same_or_both_bad(got_m, wrong_m) and _same_or_both_bad(got_l, wrong_l) and not (
                _same(wrong_m, want_m) and _same(wrong_l, want_l)):
            raise CheckFailure(hint)
    if overflowed:
        raise CheckFailure(f"{what}: l_new holds NaN or Inf where the reference is finite. {HINT_EXP_BEFORE_MAX}")
    compare(got_m, want_m, what=f"{what}: m_new")
    compare(got_l, want_l, what=f"{what}: l_new")
    return got_m, got_l


def _run_steps(fn: Any, x: torch.Tensor, block: int, label: str) -> None:
    """Fold ``x`` into the running state block by block, checking every step against the reference."""
    m = torch.full(x.shape[:-1], NEG_INF)
    l = torch.zeros(x.shape[:-1])
    for step, start in enumerate(range(0, x.shape[-1], block)):
        what = f"{label}, step {step + 1} (block of columns {start}..{min(start + block, x.shape[-1]) - 1})"
        _check_step_call(fn, m, l, x[..., start:start + block], what)
        m, l = online_softmax_step(m, l, x[..., start:start + block])  # go on from the reference's state


def rising_scores(seed: int, *shape: int) -> torch.Tensor:
    """Scores whose later blocks hold larger values in some rows: the running max must grow mid-row."""
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(*shape, generator=g)
    return x + torch.linspace(0.0, 6.0, shape[-1]) * (torch.rand(*shape[:-1], 1, generator=g) > 0.4)


@checker("the online softmax step")
def check_online_softmax_step(online_softmax_step) -> None:
    """Check a learner's ``online_softmax_step(m, l, x_block) -> (m_new, l_new)``.

    From the start (m = -inf, l = 0) through every block of rows whose max grows partway, with
    blocks of 1 (deck 000's loop), 3 and 4 columns, one row (0-d m and l) and a batch of rows,
    and scores around 1000 (where exp overflows unless every exponent is taken against the max).
    A softmax or logsumexp call is refused: the running max and sum are the exercise.
    """
    used = sorted(global_names(online_softmax_step) & set(STEP_SHORTCUTS))
    expect(not used, HINT_STEP_SHORTCUT.format(name=", ".join(used)))
    _run_steps(online_softmax_step, rising_scores(0, 12), 1, "one row of 12 scores, one score per step")
    _run_steps(online_softmax_step, rising_scores(1, 5, 12), 4, "5 rows of 12 scores, blocks of 4")
    _run_steps(online_softmax_step, rising_scores(2, 2, 3, 10), 3, "a (2, 3, 10) batch, blocks of 3")
    _run_steps(online_softmax_step, rising_scores(3, 4, 8) * 50 + 900, 4, "scores around 1000, blocks of 4")


# ----------------------------------------------------------------------------- 9.2 tiled_matmul

HINT_TILE_OVERWRITE = (
    "your C holds only the last partial product of each tile: a tile of C is the sum, over the tiles k of the "
    "shared dim, of (tile i, k of A) times (tile k, j of B), so add each product into C's tile, do not assign "
    "over it"
)
HINT_TILE_EDGES = (
    "the last rows or columns of C are wrong when a size is not a multiple of tile ({shape}): the last tile is "
    "smaller; starting a tile every tile rows (or columns) and taking up to tile of them covers it (a slice "
    "that runs past the end simply stops there)"
)
HINT_TILE_WHOLE = (
    "a torch matrix multiply saw an operand of shape {shape}, wider than tile = {tile}: multiply tile by tile "
    "(a block of at most tile rows and tile columns of A times one of B), which is the point of the exercise"
)
HINT_TILE_NO_MATMUL = (
    "your tiled_matmul made no torch matrix multiply: multiply each pair of tiles with @ (or torch.matmul), "
    "tile (i, k) of A times tile (k, j) of B; the tile products are what the notebook counts next"
)
HINT_TILE_MUTATED = "your tiled_matmul changed the caller's `{name}` in place: write into a new C (torch.zeros)"
HINT_TILE_CALL = (
    "tiled_matmul(A, B, tile): A (n, m), B (m, p), tile an int; return C = A @ B (n, p) built from products of "
    "tile x tile blocks"
)

def _tiled_reference(A: torch.Tensor, B: torch.Tensor, tile: int, *, edges: bool = True, accumulate: bool = True) -> torch.Tensor:
    n, m = A.shape
    p = B.shape[1]
    C = torch.zeros(n, p, dtype=torch.promote_types(A.dtype, B.dtype))
    limit = (lambda size: size) if edges else (lambda size: size - size % tile)
    for i in range(0, limit(n), tile):
        for j in range(0, limit(p), tile):
            for k in range(0, limit(m), tile):
                part = A[i:i + tile, k:k + tile] @ B[k:k + tile, j:j + tile]
                if accumulate:
                    C[i:i + tile, j:j + tile] += part
                else:
                    C[i:i + tile, j:j + tile] = part
    return C


def _check_tiled(fn: Any, A: torch.Tensor, B: torch.Tensor, tile: int) -> None:
    what = f"tiled_matmul(A, B, tile={tile}) with A {tuple(A.shape)} and B {tuple(B.shape)}"
    with MatmulOperands() as widths:
        got = call_on_copies(fn, {"A": A, "B": B, "tile": tile}, name="tiled_matmul", mutated_hint=HINT_TILE_MUTATED,
                             error_hint=HINT_TILE_CALL)
    if widths.widest and max(widths.widest) > tile:
        raise CheckFailure(HINT_TILE_WHOLE.format(shape=widths.widest, tile=tile))
    expect(bool(widths.shapes), HINT_TILE_NO_MATMUL)
    mistakes = {HINT_TILE_OVERWRITE: _tiled_reference(A, B, tile, accumulate=False)}
    if any(size % tile for size in (*A.shape, B.shape[1])):
        mistakes[HINT_TILE_EDGES.format(shape=f"A {tuple(A.shape)}, B {tuple(B.shape)}")] = _tiled_reference(
            A, B, tile, edges=False)
    compare(got, A @ B, what=what, mistakes=mistakes, check_dtype=False)


def deck_matrices() -> tuple[torch.Tensor, torch.Tensor]:
    """Deck 000's 4 x 4 example of tiled multiplication (its A and B, in 2 x 2 tiles)."""
    A = torch.tensor([[1, 2, 0, 5], [4, 8, 2, -1], [3, 1, 6, 3], [-7, 5, 0, 8]], dtype=torch.float32)
    B = torch.tensor([[3, 1, 6, 3], [-7, 5, 0, 8], [1, 2, 0, 5], [0, 3, 5, 1]], dtype=torch.float32)
    return A, B


@checker("tiled matrix multiply")
def check_tiled_matmul(tiled_matmul) -> None:
    """Check a learner's ``tiled_matmul(A, B, tile) -> Float[Tensor, "n p"]``.

    Deck 000's 4 x 4 example in 2 x 2 tiles, then random matrices whose sizes are not multiples
    of the tile (edge tiles), a rectangular product, tile 1 and a tile larger than the matrices;
    every torch matrix multiply inside must see operands no wider than the tile.
    """
    A, B = deck_matrices()
    _check_tiled(tiled_matmul, A, B, 2)
    g = torch.Generator().manual_seed(0)
    for (n, m, p), tile in (((7, 5, 6), 3), ((9, 4, 11), 4), ((3, 2, 5), 1), ((4, 6, 3), 8)):
        _check_tiled(tiled_matmul, torch.randn(n, m, generator=g), torch.randn(m, p, generator=g), tile)


# ----------------------------------------------------------------------------- 9.3 flash_tile_update

HINT_O_NOT_RESCALED = (
    "your o is not rescaled when the max grows: o is a sum of exp(s - m_old) * v, so multiply it by "
    "exp(m - m_new) before adding the new tile's p @ v, exactly as l is"
)
HINT_DIVIDED_EARLY = (
    "you divided by l inside the update (too early): o stays unnormalised, a running sum of exp(s - m) * v, "
    "and is divided by l once, after the last tile. Divided each step, the next step rescales and adds to "
    "an output that is already an average, and the weights no longer add up"
)
HINT_LOCAL_SOFTMAX = (
    "you took a softmax of each tile on its own and added the results: each tile's weights then sum to 1 "
    "however small its scores are. Keep the running max and sum across tiles: take the tile's exponentials "
    "against the new running max, and rescale the old l and o by exp(m - m_new)"
)
HINT_P_OLD_MAX = (
    "the tile's weights were taken against the old running max: take them against the new one, the max that "
    "l_new and o_new are relative to (against the old max, -inf before the first tile, they overflow to inf)"
)
HINT_TILE_FACTOR_INVERTED = (
    "your rescale factor is upside down: exp(m_new - m) >= 1 grows the old sums; shrink them with exp(m - m_new)"
)
HINT_TILE_SUM_NOT_RESCALED = (
    "your l is not rescaled when the max grows: multiply the old l by exp(m - m_new) before adding the tile's row sums"
)
HINT_TILE_MUTATED = "your flash_tile_update changed the caller's `{name}` in place: return new tensors"
HINT_TILE_UPDATE_CALL = (
    "flash_tile_update(m, l, o, s, v): m and l (*rows), o (*rows, d_v), s (*rows, block), v (*batch, block, d_v); "
    "return (m_new, l_new, o_new) in those shapes"
)
HINT_TILE_TRIPLE = "flash_tile_update should return a triple of tensors (m_new, l_new, o_new), got {got}"


def _tile_variant(m, l, o, s, v, *, o_rescaled=True, l_rescaled=True, divide=False, local=False, old_max=False,
                  inverted=False):
    m_new = torch.maximum(m, s.amax(dim=-1))
    if local:
        return m_new, l + s.softmax(dim=-1).sum(dim=-1), o + s.softmax(dim=-1) @ v
    p = torch.exp(s - (m if old_max else m_new)[..., None])
    alpha = torch.exp(m_new - m) if inverted else torch.exp(m - m_new)
    l_new = (alpha * l if l_rescaled else l) + p.sum(dim=-1)
    o_new = (alpha[..., None] * o if o_rescaled else o) + p @ v
    if divide:
        o_new = o_new / l_new[..., None]
    return m_new, l_new, o_new


def _tile_mistakes(m, l, o, s, v) -> list[tuple[str, tuple]]:
    return [
        (HINT_O_NOT_RESCALED, _tile_variant(m, l, o, s, v, o_rescaled=False)),
        (HINT_DIVIDED_EARLY, _tile_variant(m, l, o, s, v, divide=True)),
        (HINT_LOCAL_SOFTMAX, _tile_variant(m, l, o, s, v, local=True)),
        (HINT_TILE_SUM_NOT_RESCALED, _tile_variant(m, l, o, s, v, l_rescaled=False)),
        (HINT_P_OLD_MAX, _tile_variant(m, l, o, s, v, old_max=True)),
        (HINT_TILE_FACTOR_INVERTED, _tile_variant(m, l, o, s, v, inverted=True)),
    ]


def _triple(got: Any) -> tuple[torch.Tensor, ...]:
    if not (isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
        raise CheckFailure(HINT_TILE_TRIPLE.format(got=describe(got)))
    return tuple(got)


def _check_tile_step(fn: Any, state: tuple, s: torch.Tensor, v: torch.Tensor, what: str) -> None:
    m, l, o = state
    got = _triple(call_on_copies(fn, {"m": m, "l": l, "o": o, "s": s, "v": v}, name="flash_tile_update",
                                 mutated_hint=HINT_TILE_MUTATED, error_hint=HINT_TILE_UPDATE_CALL))
    want = tile_update(m, l, o, s, v)
    matches = lambda a, b: all(_same(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(a, b))  # noqa: E731
    if not matches(got, want):
        for hint, wrong in _tile_mistakes(m, l, o, s, v):
            if matches(got, wrong) and not matches(wrong, want):
                raise CheckFailure(hint)
    for name, g, w in zip(("m_new", "l_new", "o_new"), got, want):
        compare(g, w, what=f"{what}: {name}", nan_hint=f"{what}: {name} holds NaN or Inf. {HINT_P_OLD_MAX}")


def _tile_sequence(seed: int, rows: int, blocks: int, block: int, d_v: int, batch: tuple[int, ...] = ()):
    """Scores whose max grows in a later tile for some rows, the tiles' values, and the start state."""
    g = torch.Generator().manual_seed(seed)
    s = 2 * torch.randn(*batch, rows, blocks * block, generator=g)
    s = s + 3.0 * (torch.arange(blocks * block) >= block) * (torch.rand(*batch, rows, 1, generator=g) > 0.5)
    v = torch.randn(*batch, blocks * block, d_v, generator=g)
    start = (torch.full((*batch, rows), NEG_INF), torch.zeros(*batch, rows), torch.zeros(*batch, rows, d_v))
    return s, v, start


@checker("FlashAttention's tile update")
def check_flash_tile_update(flash_tile_update) -> None:
    """Check a learner's ``flash_tile_update(m, l, o, s, v) -> (m_new, l_new, o_new)``.

    Step by step from the start state (m = -inf, l = 0, o = 0) through tiles whose max grows,
    for one block of queries and for a (batch, heads) batch of them; then a whole tiled attention
    run through ``tfedu.flash.flash_forward(..., update=flash_tile_update)``, causal and not,
    against ``F.scaled_dot_product_attention``.
    """
    for seed, rows, blocks, block, d_v, batch in ((0, 4, 3, 5, 3, ()), (1, 3, 4, 2, 2, (2, 2))):
        s, v, state = _tile_sequence(seed, rows, blocks, block, d_v, batch)
        for t in range(blocks):
            s_t, v_t = s[..., t * block:(t + 1) * block], v[..., t * block:(t + 1) * block, :]
            _check_tile_step(flash_tile_update, state, s_t, v_t,
                             f"tile {t + 1} of {blocks} ({rows} queries, {block} keys per tile, batch {batch or 'none'})")
            state = tile_update(*state, s_t, v_t)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 20, 8, generator=g) for _ in range(3))
    for causal in (False, True):
        got, _ = flash_forward(q, k, v, causal=causal, block_q=8, block_k=6, update=flash_tile_update)
        compare(got, F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                what=f"tiled attention run with your update (causal={causal}, 20 positions, tiles of 8 x 6)")


# ----------------------------------------------------------------------------- 9.4 flash_attention_forward

HINT_FF_NOT_NORMALISED = (
    "your output is the unnormalised sum: after the last key block each query's o is still the sum of exp(s - m) "
    "times the values; divide it by that query's l once, at the end of the key loop"
)
HINT_FF_NO_SCALE = (
    "the scores were not scaled: each tile of scores is Q_i K_j^T divided by sqrt(d_head) before it goes into the "
    "update, as in F.scaled_dot_product_attention"
)
HINT_FF_LSE_NO_MAX = (
    "your lse leaves out the running max: l sums exp(s - m), so the log of the row's sum of exp(s) is m plus the log "
    "of l"
)
HINT_FF_LSE_MAX_ONLY = (
    "your lse is the row's max alone: the log-sum-exp of a row is its max m plus the log of l, the sum of exp(s - m)"
)
HINT_FF_STATE_KEPT = (
    "the running m, l and o were carried from one block of queries into the next: they belong to one block of "
    "queries and start again (m = -inf, l = 0, o = 0) for every block"
)
HINT_FF_DIAGONAL = (
    "the causal mask hides the diagonal too: query i may attend to keys 0 to i, itself included (hide key j only "
    "where j > i); the first query then has no key at all and its row is 0 / 0"
)
HINT_FF_PEEK = (
    "the causal mask lets each query see one key too many: query i attends to keys 0 to i, so hide every key j > i "
    "(with positions counted in the whole sequence)"
)
HINT_FF_LOCAL_MASK = (
    "the causal mask compares positions within the tile instead of in the sequence: query i0 + a and key j0 + b are "
    "hidden when j0 + b > i0 + a, which differs from b > a whenever the blocks start at different positions"
)
HINT_FF_DIAGONAL_TILE_ONLY = (
    "only the tile that starts on the diagonal (key block start = query block start) was masked: when block_q and "
    "block_k differ, the diagonal crosses other tiles too, and in each of them the keys after a query must be "
    "hidden; mask every tile you compute, by positions in the sequence"
)
HINT_FF_SKIP_TOO_MUCH = (
    "you skipped key blocks that the diagonal crosses: a key block can be skipped only when it starts after the last "
    "query of the block (every key in it lies in every query's future); the blocks the diagonal crosses are "
    "computed, then masked"
)
HINT_FF_EDGES = (
    "the last, shorter block was dropped: when a length is not a multiple of the block size, the final block of "
    "queries (or keys) is shorter, and its slice simply stops at the end"
)
HINT_FF_SKIP_TOO_LITTLE = (
    "causal attention computed {got} tiles of scores where {want} are needed: key blocks that start after the last "
    "query of their query block (all future) were computed and masked instead of skipped; the first such block "
    "ends the key loop"
)
HINT_FF_NO_SKIP = (
    "causal attention here ran as many score tiles as the full one ({full} matrix products both times): key blocks "
    "that start after the last query of a query block lie wholly in the future and must be skipped, not computed "
    "and masked"
)
HINT_FF_WHOLE = (
    "a matrix product saw an operand of shape {shape}, wider than the blocks ({bq} queries x {bk} keys): compute one "
    "(block_q, block_k) tile of scores at a time, never the whole score matrix"
)
HINT_FF_PAIR = (
    "flash_attention_forward should return (o, lse): the output (*batch, query_pos, d_v) and each query's log-sum-exp "
    "of its scores (*batch, query_pos), got {got}"
)
HINT_FF_MUTATED = "your flash_attention_forward changed the caller's `{name}` in place: slice and build new tensors"
HINT_FF_CALL = (
    "flash_attention_forward(q, k, v, causal=False, block_q=64, block_k=64): q (*batch, query_pos, d_head), k "
    "(*batch, key_pos, d_head), v (*batch, key_pos, d_v); it may call your flash_tile_update (exercise 9.3) "
    "with a tile of scores (*batch, bq, bk) and the tile's values (*batch, bk, d_v)"
)

FF_MISTAKES = (  # (hint, the variant of _ff_variant that makes it)
    (HINT_FF_NOT_NORMALISED, "not-normalised"), (HINT_FF_NO_SCALE, "no-scale"), (HINT_FF_LSE_NO_MAX, "lse-no-max"),
    (HINT_FF_LSE_MAX_ONLY, "lse-max-only"), (HINT_FF_STATE_KEPT, "state-kept"), (HINT_FF_DIAGONAL, "diagonal"),
    (HINT_FF_PEEK, "peek"), (HINT_FF_LOCAL_MASK, "local-mask"), (HINT_FF_LOCAL_MASK, "local-mask-crossing"),
    (HINT_FF_DIAGONAL_TILE_ONLY, "diagonal-tile-only"), (HINT_FF_SKIP_TOO_MUCH, "skip-too-much"),
    (HINT_FF_SKIP_TOO_MUCH, "skip-at-diagonal"), (HINT_FF_SKIP_TOO_MUCH, "skip-past-end"),
    (HINT_FF_SKIP_TOO_MUCH, "skip-last-query"), (HINT_FF_EDGES, "edges"), (HINT_FF_EDGES, "edges-q"),
    (HINT_FF_EDGES, "edges-k"),
)


def _ff_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, block_q: int, block_k: int,
                mistake: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2's forward loops around the reference tile update, right or with one known mistake."""
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 if mistake == "no-scale" else d ** -0.5
    last_q = n_q - n_q % block_q if mistake in ("edges", "edges-q") and n_q % block_q else n_q
    last_k = n_k - n_k % block_k if mistake in ("edges", "edges-k") and n_k % block_k else n_k
    o = torch.zeros(*q.shape[:-1], v.shape[-1])
    lse = torch.zeros(q.shape[:-1])
    state = None
    for i0 in range(0, last_q, block_q):
        i1 = min(i0 + block_q, n_q)
        if state is None or mistake != "state-kept":
            state = (torch.full(q[..., i0:i1, 0].shape, NEG_INF), torch.zeros(q[..., i0:i1, 0].shape),
                     torch.zeros(*q[..., i0:i1, 0].shape, v.shape[-1]))
        for j0 in range(0, last_k, block_k):
            j1 = min(j0 + block_k, n_k)
            skip = {"skip-too-much": j0 > i0, "skip-at-diagonal": j0 >= i0, "skip-past-end": j1 > i1,
                    "skip-last-query": j0 >= i1 - 1}.get(mistake, j0 >= i1)
            if causal and skip:
                break
            s = scale * (q[..., i0:i1, :] @ k[..., j0:j1, :].transpose(-2, -1))
            if causal and (mistake != "diagonal-tile-only" or j0 == i0) and (mistake != "local-mask-crossing" or j1 > i0):
                rows, cols = torch.arange(i0, i1)[:, None], torch.arange(j0, j1)
                if mistake in ("local-mask", "local-mask-crossing", "diagonal-tile-only"):  # positions within the tile
                    rows, cols = rows - i0, cols - j0
                future = {"diagonal": cols >= rows, "peek": cols > rows + 1}.get(mistake, cols > rows)
                s = s.masked_fill(future, NEG_INF)
            if s.shape[-2] != state[0].shape[-1]:  # "state-kept" into a shorter last block: start that one afresh
                state = tuple(t[..., : s.shape[-2]] if t.dim() == s.dim() - 1 else t[..., : s.shape[-2], :] for t in state)
            state = tile_update(*state, s, v[..., j0:j1, :])
        m, l, acc = state
        o[..., i0:i1, :] = acc if mistake == "not-normalised" else acc / l[..., None]
        lse[..., i0:i1] = {"lse-no-max": torch.log(l), "lse-max-only": m}.get(mistake, m + torch.log(l))
    return o, lse


def _ff_mistakes(q, k, v, causal, block_q, block_k) -> list[tuple[str, tuple[torch.Tensor, torch.Tensor]]]:
    return [(hint, _ff_variant(q, k, v, causal, block_q, block_k, variant)) for hint, variant in FF_MISTAKES]


def reference_flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                                      block_q: int = 64, block_k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The exercise's answer, as tfedu.flash.flash_forward computes it."""
    return flash_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)


def _ff_pair(got: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        raise CheckFailure(HINT_FF_PAIR.format(got=describe(got)))
    return tuple(got)


def _ff_close(got: tuple, want: tuple) -> bool:
    """Equal to rounding, NaN where the other has NaN (a row with every key hidden is 0 / 0 in both)."""
    return all(g.shape == w.shape and torch.allclose(g.detach().float(), w.float(), rtol=1e-4, atol=1e-5, equal_nan=True)
               for g, w in zip(got, want))


def _ff_call(fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, block_q: int, block_k: int
             ) -> tuple[tuple[torch.Tensor, torch.Tensor], MatmulOperands]:
    with MatmulOperands() as seen:
        got = call_on_copies(fn, {"q": q, "k": k, "v": v, "kw:causal": causal, "kw:block_q": block_q,
                                  "kw:block_k": block_k}, name="flash_attention_forward",
                             mutated_hint=HINT_FF_MUTATED, error_hint=HINT_FF_CALL)
    return _ff_pair(got), seen


def _check_ff(fn: Any, q, k, v, causal: bool, block_q: int, block_k: int) -> MatmulOperands:
    what = (f"flash_attention_forward(q, k, v, causal={causal}, block_q={block_q}, block_k={block_k}) with q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    got, seen = _ff_call(fn, q, k, v, causal, block_q, block_k)
    widest = max((shape[-2:] for shape in seen.shapes if len(shape) >= 2), key=lambda s: s[0] * s[1], default=None)
    if widest is not None and widest[0] * widest[1] > max(block_q, block_k, q.shape[-1], v.shape[-1]) ** 2:
        raise CheckFailure(HINT_FF_WHOLE.format(shape=widest, bq=block_q, bk=block_k))
    want = reference_flash_attention_forward(q, k, v, causal, block_q, block_k)
    if not _ff_close(got, want):
        for hint, wrong in _ff_mistakes(q, k, v, causal, block_q, block_k):
            if all(g.shape == w.shape for g, w in zip(got, wrong)) and _ff_close(got, wrong) and not _ff_close(wrong, want):
                raise CheckFailure(hint)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    compare(got[0], exact, what=f"{what}: o (against F.scaled_dot_product_attention)", check_dtype=False,
            nan_hint=f"{what}: o holds NaN or Inf (a row whose keys are all hidden?)")
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), NEG_INF)
    compare(got[1], torch.logsumexp(scores, dim=-1), what=f"{what}: lse (against torch.logsumexp of the scores)",
            check_dtype=False)
    return seen


# The checker's calls: (seed, batch, query_pos, key_pos, d_head, d_v, block_q, block_k). Lengths that are not
# multiples of the blocks, blocks of different sizes (so a mask in tile coordinates shows), batch and head dims.
FF_CALLS = ((0, (), 13, 11, 8, 5, 4, 3), (1, (2, 3), 10, 10, 8, 8, 4, 4), (2, (2,), 14, 14, 6, 4, 5, 3))


def _ff_inputs(seed: int, batch: tuple, n_q: int, n_k: int, d: int, d_v: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(*batch, n_q, d, generator=g), 2 * torch.randn(*batch, n_k, d, generator=g),
            torch.randn(*batch, n_k, d_v, generator=g))


@checker("FlashAttention-2's forward pass")
def check_flash_attention_forward(flash_attention_forward) -> None:
    """Check a learner's ``flash_attention_forward(q, k, v, causal=False, block_q=64, block_k=64) -> (o, lse)``.

    Against ``tfedu.flash.flash_forward`` and, for o, ``F.scaled_dot_product_attention`` and, for lse,
    ``torch.logsumexp`` of the scores: full attention with lengths that are not multiples of the blocks, then causal
    attention with blocks of different sizes, with and without batch dims. Recorded with MatmulOperands: no
    product wider than a tile, and causal attention doing fewer tile products than full attention (key blocks
    wholly in the future skipped). Named: o not divided by l, no 1/sqrt(d) scale, lse without m or m alone, the
    state carried across query blocks, the diagonal hidden or one future key shown, a mask in tile coordinates,
    blocks the diagonal crosses skipped, the last short blocks dropped.
    """
    namespace = getattr(flash_attention_forward, "__globals__", None)
    standins = {"flash_tile_update": tile_update} if isinstance(namespace, dict) else {}
    with names_bound(namespace if standins else {}, standins):  # a wrong 9.3 costs only 9.3
        _check_all_ff(flash_attention_forward)


def _check_all_ff(flash_attention_forward: Any) -> None:
    _full_then_causal(FF_CALLS, lambda seed, q, k, v, causal, bq, bk: _check_ff(flash_attention_forward, q, k, v, causal,
                                                                                bq, bk), HINT_FF_NO_SKIP,
                      HINT_FF_SKIP_TOO_LITTLE)


def _tile_count(n: int, block_q: int, block_k: int, causal: bool) -> int:
    """The (query block, key block) tiles attention over n positions visits; causal: those not wholly in the future."""
    return sum(sum(1 for j0 in range(0, n, block_k) if not causal or j0 < min(i0 + block_q, n))
               for i0 in range(0, n, block_q))


def skip_problem(full_products: int, causal_products: int, n: int, block_q: int, block_k: int, no_skip_hint: str,
                 too_little_hint: str) -> str | None:
    """What is wrong with the causal call's count of matrix-product operands against the full call's, if anything.

    The same count means nothing was skipped. Otherwise, when the full call's count is a whole number per tile, the
    causal call must not exceed that number times the tiles on or below the diagonal: more means some tiles wholly
    in the future were computed (a product outside the tile loops makes the per-tile count fractional: not judged).
    """
    if not full_products:
        return None
    if causal_products >= full_products:
        return no_skip_hint.format(full=full_products)
    tiles, needed = _tile_count(n, block_q, block_k, False), _tile_count(n, block_q, block_k, True)
    per_tile, uneven = divmod(full_products, tiles)
    if uneven or not per_tile or causal_products % per_tile or causal_products <= per_tile * needed:
        return None
    return too_little_hint.format(got=causal_products // per_tile, want=needed)


def _full_then_causal(calls: Sequence[tuple], check_one: Callable[..., MatmulOperands], no_skip_hint: str,
                      too_little_hint: str) -> None:
    """``check_one(seed, q, k, v, causal, block_q, block_k)`` on each call's inputs, full attention; where the lengths
    match, causal too, which must skip exactly the tiles wholly above the diagonal (:func:`skip_problem`)."""
    for seed, batch, n_q, n_k, d, d_v, block_q, block_k in calls:
        q, k, v = _ff_inputs(seed, batch, n_q, n_k, d, d_v)
        full = check_one(seed, q, k, v, False, block_q, block_k)
        if n_q == n_k:
            causal = check_one(seed, q, k, v, True, block_q, block_k)
            problem = skip_problem(len(full.shapes), len(causal.shapes), n_q, block_q, block_k, no_skip_hint,
                                   too_little_hint)
            if problem:
                raise CheckFailure(problem)


# ----------------------------------------------------------------------------- 9.5 flash_attention_backward

HINT_FB_NO_D = (
    "your dS leaves out D: the softmax's backward is dS = P * (dP - D), where D (one number per query) is the sum "
    "over its keys of P * dP; it equals rowsum(dO * O), which needs no tile"
)
HINT_FB_D_WHOLE = (
    "your D is one number for the whole input: it is one number per query, the sum of dO * O over that query's "
    "output features (the last axis) only"
)
HINT_FB_D_PER_TILE = (
    "your D was summed within each tile: D is one number per query, the sum of P * dP over all of its keys, every "
    "key block included; a tile holds only some of them. It equals rowsum(dO * O), which needs no tile: compute it "
    "once, before the loops"
)
HINT_FB_P_TILE_SOFTMAX = (
    "your P is a softmax over the tile alone: a tile holds only some of a query's keys, so its weights would sum to 1 "
    "in every tile instead of over the whole row; the forward's weights are exp(S - lse), with lse the whole row's "
    "log-sum-exp"
)
HINT_FB_P_RAW = (
    "your P is the exponential of the raw scores: the softmax weights are exp(S - lse), each row's scores less its "
    "log-sum-exp from the forward pass, which makes every row sum to 1"
)
HINT_FB_NO_SCALE = (
    "dq or dk is missing the scale: the scores are S = Q K^T / sqrt(d_head), so the chain rule multiplies both dS K "
    "and dS^T Q by 1 / sqrt(d_head)"
)
HINT_FB_LOCAL_MASK = (
    "the causal mask of a recomputed tile compares positions within the tile instead of in the sequence: query "
    "i0 + a and key j0 + b are hidden when j0 + b > i0 + a, as in the forward pass"
)
HINT_FB_UNMASKED = (
    "in the causal case the recomputed tile of scores was not masked: P must be the forward's weights, with the "
    "future keys at exp(-inf) = 0, so mask the tiles the diagonal crosses before taking exp(S - lse)"
)
HINT_FB_DQ_OVERWRITE = (
    "dq was written over by each key block: a query's gradient gathers a contribution from every key block it "
    "attends to, so add each block's dS K into dq instead of assigning it"
)
HINT_FB_DKV_OVERWRITE = (
    "dk or dv kept only the last block of queries: a key's gradient gathers a contribution from every query "
    "block that attends to it, so add each one up over the query loop"
)
HINT_FB_SKIP_TOO_MUCH = (
    "you skipped tiles that the diagonal crosses: in the causal case a (query block, key block) tile can be "
    "skipped only when every key of the block comes after every query of it"
)
HINT_FB_SKIP_TOO_LITTLE = (
    "causal attention computed {got} tiles where {want} are needed: tiles whose keys all come after all their "
    "queries (the key block starts at or after the query block's end) were computed instead of skipped"
)
HINT_FB_NO_SKIP = (
    "causal attention here ran as many tile products as the full one ({full} both times): tiles whose keys all "
    "come after all their queries hold only zeros in P and must be skipped, not computed"
)
HINT_FB_TRIPLE = (
    "flash_attention_backward should return (dq, dk, dv), shaped like q, k and v, got {got}"
)
HINT_FB_MUTATED = "your flash_attention_backward changed the caller's `{name}` in place: build new tensors"
HINT_FB_CALL = (
    "flash_attention_backward(q, k, v, o, lse, do, causal=False, block_q=64, block_k=64): o and lse from the "
    "forward pass, do the gradient of the output (*batch, query_pos, d_v); returns (dq, dk, dv)"
)

FB_MISTAKES = {
    HINT_FB_NO_D: "no-D", HINT_FB_D_WHOLE: "D-whole", HINT_FB_P_RAW: "P-raw", HINT_FB_NO_SCALE: "no-scale",
    HINT_FB_UNMASKED: "unmasked", HINT_FB_DQ_OVERWRITE: "dq-overwrite", HINT_FB_DKV_OVERWRITE: "dkv-overwrite",
    HINT_FB_SKIP_TOO_MUCH: "skip-too-much", HINT_FB_D_PER_TILE: "D-per-tile", HINT_FB_P_TILE_SOFTMAX: "P-tile-softmax",
    HINT_FB_LOCAL_MASK: "local-mask",
}
FB_MISTAKES_MORE = (  # further variants that share a hint above
    (HINT_FB_NO_SCALE, "no-scale-dq"), (HINT_FB_NO_SCALE, "no-scale-dk"), (HINT_FB_DKV_OVERWRITE, "dk-overwrite"),
    (HINT_FB_DKV_OVERWRITE, "dv-overwrite"), (HINT_FB_SKIP_TOO_MUCH, "skip-last-query"),
)


def _fb_variant(q, k, v, o, lse, do, causal: bool = False, block_q: int = 64, block_k: int = 64,
                mistake: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2's backward by recomputation, right or with one known mistake (float64 throughout)."""
    q, k, v, o, lse, do = (t.double() for t in (q, k, v, o, lse, do))
    n_q, n_k, scale = q.shape[-2], k.shape[-2], q.shape[-1] ** -0.5
    D = (do * o).sum() * torch.ones(o.shape[:-1], dtype=q.dtype) if mistake == "D-whole" else (do * o).sum(dim=-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for j0 in range(0, n_k, block_k):
        j1 = min(j0 + block_k, n_k)
        for i0 in range(0, n_q, block_q):
            i1 = min(i0 + block_q, n_q)
            skip = {"skip-too-much": i0 < j0, "skip-last-query": i1 - 1 <= j0}.get(mistake, i1 <= j0)
            if causal and skip:
                continue
            s = scale * (q[..., i0:i1, :] @ k[..., j0:j1, :].transpose(-2, -1))
            if causal and mistake == "local-mask":
                s = s.masked_fill(torch.arange(j1 - j0) > torch.arange(i1 - i0)[:, None], NEG_INF)
            elif causal and mistake != "unmasked":
                s = s.masked_fill(torch.arange(j0, j1) > torch.arange(i0, i1)[:, None], NEG_INF)
            if mistake == "P-tile-softmax":
                p = torch.softmax(s, dim=-1)
            else:
                p = torch.exp(s) if mistake == "P-raw" else torch.exp(s - lse[..., i0:i1, None])
            dp = do[..., i0:i1, :] @ v[..., j0:j1, :].transpose(-2, -1)
            D_i = (p * dp).sum(dim=-1) if mistake == "D-per-tile" else D[..., i0:i1]
            ds = p * dp if mistake == "no-D" else p * (dp - D_i[..., None])
            factor_q = 1.0 if mistake in ("no-scale", "no-scale-dq") else scale
            factor_k = 1.0 if mistake in ("no-scale", "no-scale-dk") else scale
            if mistake == "dq-overwrite":
                dq[..., i0:i1, :] = factor_q * (ds @ k[..., j0:j1, :])
            else:
                dq[..., i0:i1, :] += factor_q * (ds @ k[..., j0:j1, :])
            parts = (factor_k * (ds.transpose(-2, -1) @ q[..., i0:i1, :]), p.transpose(-2, -1) @ do[..., i0:i1, :])
            if mistake in ("dkv-overwrite", "dk-overwrite"):
                dk[..., j0:j1, :] = parts[0]
            else:
                dk[..., j0:j1, :] += parts[0]
            if mistake in ("dkv-overwrite", "dv-overwrite"):
                dv[..., j0:j1, :] = parts[1]
            else:
                dv[..., j0:j1, :] += parts[1]
    return dq, dk, dv


def _fb_mistake_list() -> list[tuple[str, str]]:
    return list(FB_MISTAKES.items()) + list(FB_MISTAKES_MORE)


def reference_flash_attention_backward(q, k, v, o, lse, do, causal: bool = False, block_q: int = 64,
                                       block_k: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exercise's answer, as tfedu.flash.flash_backward computes it."""
    return flash_backward(q, k, v, o, lse, do, causal=causal, block_q=block_q, block_k=block_k)


def autograd_gradients(q, k, v, do, causal: bool) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) by autograd through standard attention (float64): the oracle."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    return torch.autograd.grad(out, leaves, do.double())


def _fb_close(got: tuple, want: tuple) -> bool:
    return all(isinstance(g, torch.Tensor) and g.shape == w.shape and
               torch.allclose(g.detach().double(), w.double(), rtol=1e-3, atol=1e-4, equal_nan=True)
               for g, w in zip(got, want))


def _check_fb(fn: Any, q, k, v, do, causal: bool, block_q: int, block_k: int) -> MatmulOperands:
    what = (f"flash_attention_backward(q, k, v, o, lse, do, causal={causal}, block_q={block_q}, block_k={block_k}) "
            f"with q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    o, lse = flash_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    with MatmulOperands() as seen:
        got = call_on_copies(fn, {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do, "kw:causal": causal,
                                  "kw:block_q": block_q, "kw:block_k": block_k}, name="flash_attention_backward",
                             mutated_hint=HINT_FB_MUTATED, error_hint=HINT_FB_CALL)
    if not (isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
        raise CheckFailure(HINT_FB_TRIPLE.format(got=describe(got)))
    want = autograd_gradients(q, k, v, do, causal)
    if not _fb_close(got, want):
        for hint, variant in _fb_mistake_list():
            wrong = _fb_variant(q, k, v, o, lse, do, causal, block_q, block_k, variant)
            if _fb_close(got, wrong) and not _fb_close(wrong, want):
                raise CheckFailure(hint)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        compare(g.double(), w, what=f"{what}: {name} (against autograd through standard attention)", check_dtype=False,
                rtol=1e-3, atol=1e-4)
    return seen


# (seed, batch, query_pos, key_pos, d_head, d_v, block_q, block_k), as for 9.4.
FB_CALLS = ((3, (), 11, 13, 6, 5, 4, 3), (4, (2, 2), 13, 13, 8, 6, 5, 3), (5, (3,), 12, 12, 4, 4, 4, 4))


@checker("FlashAttention-2's backward pass")
def check_flash_attention_backward(flash_attention_backward) -> None:
    """Check a learner's ``flash_attention_backward(q, k, v, o, lse, do, causal, block_q, block_k) -> (dq, dk, dv)``.

    Against autograd through ``F.scaled_dot_product_attention`` in float64, with o and lse from
    ``tfedu.flash.flash_forward`` and a random upstream gradient: full attention with lengths apart, then causal
    attention with and without batch dims, blocks of unequal sizes. Causal attention must do fewer tile products
    than full attention (D, one dot product per query over whole rows, may take any form). Named: D left out or summed over everything, P from
    the raw scores, no scale in dq and dk, the causal tile unmasked, dq or dk and dv overwritten instead of
    accumulated, tiles skipped that the diagonal crosses.
    """
    def check_one(seed: int, q, k, v, causal: bool, block_q: int, block_k: int) -> MatmulOperands:
        do = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(seed + 50))  # dO
        return _check_fb(flash_attention_backward, q, k, v, do, causal, block_q, block_k)

    _full_then_causal(FB_CALLS, check_one, HINT_FB_NO_SKIP, HINT_FB_SKIP_TOO_LITTLE)


# ----------------------------------------------------------------------------- 9.6 causal linear attention, two ways

HINT_LA_STATE_LATE = (
    "{fn}: each position's output left out its own key: query i sums over keys 0 to i, itself included, so add key "
    "i's terms to the running sums before reading them for query i"
)
HINT_LA_NO_PHI = (
    "{fn}: the feature map is missing: linear attention compares phi(q) . phi(k) with phi(x) = elu(x) + 1, which is "
    "positive, so every weight is positive and the normaliser cannot cross zero; raw q . k can"
)
HINT_LA_NO_NORMALISER = (
    "{fn}: the output was not normalised: divide phi(q_i) . S_i by phi(q_i) . z_i + eps, so that the weights of "
    "each query sum to 1 (z_i is the running sum of phi(k_j))"
)
HINT_LA_NOT_CAUSAL = (
    "{fn}: every query saw every key: causal attention sums only over keys j <= i, a running (prefix) sum along "
    "the positions, not the total"
)
HINT_LA_WRONG_AXIS = (
    "{fn}: the cumulative sum ran along the wrong axis: the running sums accumulate over the positions (axis -3 of "
    "the (..., pos, d_head, d_v) outer products, axis -2 of phi(k)), not over the features"
)
HINT_LA_S_AXIS = (
    "{fn}: the running sum of the outer products phi(k_j) v_j^T ran along a feature axis: it accumulates over the "
    "positions (axis -3 of the (..., pos, d_head, d_v) products); the normaliser's running sum is right"
)
HINT_LA_Z_AXIS = (
    "{fn}: the normaliser's running sum of phi(k_j) ran along the features: it accumulates over the positions "
    "(axis -2 of phi(k)); the outer products' running sum is right"
)
HINT_LA_DIFFER = (
    "your two functions disagree (largest difference {gap:.2e}): the recurrence and the cumulative sums compute the "
    "same outputs, up to rounding; the one that differs from the reference is named above when it is a known slip"
)
HINT_LA_CALL = (
    "{fn}(q, k, v, eps=1e-6): q and k (*batch, pos, d_head), v (*batch, pos, d_v); returns (*batch, pos, d_v), "
    "causal linear attention with phi(x) = elu(x) + 1"
)
HINT_LA_MUTATED = "your {fn} changed the caller's `{{name}}` in place: build new tensors"

LA_MISTAKES = {HINT_LA_STATE_LATE: "state-late", HINT_LA_NO_PHI: "no-phi", HINT_LA_NO_NORMALISER: "no-normaliser",
               HINT_LA_NOT_CAUSAL: "not-causal", HINT_LA_WRONG_AXIS: "wrong-axis", HINT_LA_S_AXIS: "S-axis",
               HINT_LA_Z_AXIS: "z-axis"}
LA_MISTAKES_MORE = ((HINT_LA_S_AXIS, "S-axis-head"), (HINT_LA_WRONG_AXIS, "wrong-axis-head"))


def reference_causal_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Causal linear attention (phi = elu + 1), computed the quadratic way: the oracle of both answers."""
    return linear_attention_quadratic(q, k, v, causal=True, eps=eps)


def _la_variant(q, k, v, eps: float = 1e-6, mistake: str | None = None) -> torch.Tensor:
    """Causal linear attention by cumulative sums in float64, right or with one known mistake."""
    q, k, v = q.double(), k.double(), v.double()
    phi_q, phi_k = (q, k) if mistake == "no-phi" else (F.elu(q) + 1, F.elu(k) + 1)
    outer = phi_k[..., :, None] * v[..., None, :]  # (..., pos, d_head, d_v)
    if mistake == "not-causal":
        S, z = outer.sum(-3, keepdim=True).expand_as(outer), phi_k.sum(-2, keepdim=True).expand_as(phi_k)
    elif mistake in ("wrong-axis", "S-axis", "z-axis", "S-axis-head", "wrong-axis-head"):
        S = {"z-axis": outer.cumsum(-3), "S-axis-head": outer.cumsum(-2), "wrong-axis-head": outer.cumsum(-2)}.get(
            mistake, outer.cumsum(-1))
        z = phi_k.cumsum(-2) if mistake in ("S-axis", "S-axis-head") else phi_k.cumsum(-1)
    else:
        S, z = outer.cumsum(-3), phi_k.cumsum(-2)
        if mistake == "state-late":  # the sums before position i: key i left out
            S, z = S - outer, z - phi_k
    numerator = (phi_q[..., :, None] * S).sum(-2)  # (..., pos, d_v)
    denominator = (phi_q * z).sum(-1, keepdim=True)  # (..., pos, 1)
    return numerator if mistake == "no-normaliser" else numerator / (denominator + eps)


def _la_call(fn: Any, name: str, q, k, v) -> torch.Tensor:
    got = call_on_copies(fn, {"q": q, "k": k, "v": v}, name=name, mutated_hint=HINT_LA_MUTATED.format(fn=name),
                         error_hint=HINT_LA_CALL.format(fn=name))
    expect(isinstance(got, torch.Tensor), f"{name} should return a tensor (*batch, pos, d_v), got {describe(got)}")
    return got


def _check_la_one(fn: Any, name: str, q, k, v, what: str) -> torch.Tensor:
    got = _la_call(fn, name, q, k, v)
    want = reference_causal_linear_attention(q, k, v)
    if not (got.shape == want.shape and torch.allclose(got.double(), want.double(), rtol=1e-4, atol=1e-5)):
        for hint, variant in (*LA_MISTAKES.items(), *LA_MISTAKES_MORE):
            wrong = _la_variant(q, k, v, mistake=variant)
            if got.shape == wrong.shape and torch.allclose(got.double(), wrong, rtol=1e-4, atol=1e-5, equal_nan=True) \
                    and not torch.allclose(wrong, want.double(), rtol=1e-4, atol=1e-5):
                raise CheckFailure(hint.format(fn=name))
    compare(got, want, what=f"{name}(q, k, v) {what}", check_dtype=False, rtol=1e-4, atol=1e-5)
    return got


# (seed, batch, pos, d_head, d_v): keys drawn so that phi(q) . phi(k) varies a lot, and pos past d_head.
LA_CALLS = ((0, (), 9, 4, 3), (1, (2, 3), 12, 5, 6))


@checker("causal linear attention, two ways")
def check_linear_attention_two_ways(linear_attention_recurrent, linear_attention_cumsum) -> None:
    """Check a learner's ``linear_attention_recurrent(q, k, v, eps=1e-6)`` and ``linear_attention_cumsum(q, k, v,
    eps=1e-6)``: each against ``tfedu.flash.linear_attention_quadratic(causal=True)`` and against each other.

    Named, for either: the own key left out, no feature map, no normaliser, every key seen, a cumulative sum along
    the features; then the two must agree.
    """
    for seed, batch, pos, d, d_v in LA_CALLS:
        g = torch.Generator().manual_seed(seed)
        q, k, v = 1.5 * torch.randn(*batch, pos, d, generator=g), 1.5 * torch.randn(*batch, pos, d, generator=g), \
            torch.randn(*batch, pos, d_v, generator=g)
        what = f"with q, k {tuple(q.shape)} and v {tuple(v.shape)}"
        recurrent = _check_la_one(linear_attention_recurrent, "linear_attention_recurrent", q, k, v, what)
        cumulative = _check_la_one(linear_attention_cumsum, "linear_attention_cumsum", q, k, v, what)
        gap = (recurrent.double() - cumulative.double()).abs().max().item()
        expect(gap < 1e-4, HINT_LA_DIFFER.format(gap=gap))


# ----------------------------------------------------------------------------- 9.7 the Triton kernel's loop

HINT_TK_NO_RESCALE = (
    "the accumulator was not rescaled: when a key block raises a row's max, acc (the running sum of p times v) was "
    "summed against the old max, so multiply it by alpha, row by row, before adding this block's p times v"
)
HINT_TK_L_NOT_RESCALED = (
    "l was not rescaled: the running sum of p was taken against the old max, so multiply it by alpha before adding "
    "this block's row sums"
)
HINT_TK_MAX_KEPT = (
    "the running max never moved: after the update, the row's max for the next block is the new one (m_i takes the "
    "value of m_new at the end of each step)"
)
HINT_TK_NO_KEY_MASK = (
    "the last key block reads past the end: the masked load gives zeros there, and a key of zeros still scores 0 and "
    "takes a share of the weight. Set the scores of key positions at or past N to -inf"
)
HINT_TK_NO_SCALE = "the scores were not scaled: multiply q k^T by scale (1 / sqrt(d_head)) before the softmax"
HINT_TK_RAISED = "your kernel raised {error}"
HINT_TK_UNAVAILABLE = (
    "this exercise runs your Triton kernel, and Triton cannot run here ({why}). On Colab, or on Linux with "
    "pip install triton, it runs on the CPU through Triton's interpreter"
)
HINT_TK_CALL = (
    "keep the kernel's signature flash_kernel(Q, K, V, O, N, scale, D_HEAD, BLOCK_M, BLOCK_N) and decorate it with "
    "@triton.jit; the checker launches it on a grid of (cdiv(N, BLOCK_M), batch * heads) programs"
)

# Each mistake's number in the variant kernel (a constexpr, so the interpreter and the compiler see plain code).
TK_MISTAKES = {HINT_TK_NO_RESCALE: 1, HINT_TK_L_NOT_RESCALED: 2, HINT_TK_MAX_KEPT: 3, HINT_TK_NO_KEY_MASK: 4,
               HINT_TK_NO_SCALE: 5}
_variant_kernels: list = []


def _variant_kernel() -> Any:
    """The exercise's kernel with a MISTAKE switch, defined on first use (after tfedu.kernels chose the interpreter)."""
    if _variant_kernels:
        return _variant_kernels[0]
    import tfedu.kernels  # noqa: F401 - first: it switches on the interpreter without a GPU, before triton loads
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(Q, K, V, O, N, scale, D_HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               MISTAKE: tl.constexpr):
        start_m = tl.program_id(0) * BLOCK_M
        head = tl.program_id(1).to(tl.int64) * N * D_HEAD
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_HEAD)
        q = tl.load(Q + head + offs_m[:, None] * D_HEAD + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, D_HEAD], 0.0, tl.float32)
        for start_n in range(0, N, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kv = head + offs_n[:, None] * D_HEAD + offs_d[None, :]
            k = tl.load(K + kv, mask=offs_n[:, None] < N, other=0.0)
            v = tl.load(V + kv, mask=offs_n[:, None] < N, other=0.0)
            s = tl.dot(q, tl.trans(k))
            if MISTAKE != 5:
                s = s * scale
            if MISTAKE != 4:
                s = tl.where(offs_n[None, :] < N, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            if MISTAKE == 2:
                l_i = l_i + tl.sum(p, 1)
            else:
                l_i = l_i * alpha + tl.sum(p, 1)
            if MISTAKE == 1:
                acc = acc + tl.dot(p, v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v)
            if MISTAKE != 3:
                m_i = m_new
        tl.store(O + head + offs_m[:, None] * D_HEAD + offs_d[None, :], acc / l_i[:, None], mask=offs_m[:, None] < N)

    _variant_kernels.append(kernel)
    return kernel


def launch_flash_kernel(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_m: int = 16,
                        block_n: int = 16, **constants: Any) -> torch.Tensor:
    """Run a kernel of the exercise's signature on (batch, heads, N, d_head) inputs: its output O.

    One program per block of BLOCK_M queries of one (batch, head): a grid of (cdiv(N, BLOCK_M), batch * heads).
    """
    import triton

    batch, heads, n, d = q.shape
    q, k, v = (t.contiguous() for t in (q, k, v))
    o = torch.empty_like(q)
    kernel[(triton.cdiv(n, block_m), batch * heads)](q, k, v, o, n, 1 / math.sqrt(d), D_HEAD=d, BLOCK_M=block_m,
                                                     BLOCK_N=block_n, **constants)
    return o


def reference_flash_kernel_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_m: int = 16,
                                  block_n: int = 16) -> torch.Tensor:
    """What a right kernel writes: the variant kernel with no mistake."""
    return launch_flash_kernel(_variant_kernel(), q, k, v, block_m=block_m, block_n=block_n, MISTAKE=0)


def _run_learner_kernel(kernel: Any, q, k, v, block_m: int, block_n: int) -> torch.Tensor:
    if not hasattr(kernel, "__getitem__"):
        raise CheckFailure(HINT_TK_CALL)
    try:
        return launch_flash_kernel(kernel, q, k, v, block_m=block_m, block_n=block_n)
    except Exception as err:  # the interpreter wraps what the kernel raised (InterpreterError)
        text = str(err)
        if "NotImplementedError" in text:
            raise NotImplementedError from None
        first = next((line for line in text.splitlines() if line.strip()), type(err).__name__)
        raise CheckFailure(f"{HINT_TK_RAISED.format(error=f'{type(err).__name__}: {first[:300]}')} ({HINT_TK_CALL})") from None


# (seed, batch, heads, N, d_head, BLOCK_M, BLOCK_N): N not a multiple of the blocks, then a multiple.
TK_CALLS = ((0, 1, 2, 40, 16, 16, 16), (1, 2, 1, 32, 16, 16, 16))


@checker("FlashAttention in Triton")
def check_flash_kernel(flash_kernel) -> None:
    """Check a learner's Triton kernel ``flash_kernel(Q, K, V, O, N, scale, D_HEAD, BLOCK_M, BLOCK_N)``: full attention,
    one program per query block, launched on small inputs (Triton's interpreter on a CPU, compiled on a GPU) against
    ``F.scaled_dot_product_attention``. Named: the accumulator or l not rescaled, the max never updated, the keys
    past N not masked, no scale.
    """
    from tfedu import kernels

    usable, why = kernels.available()
    if not usable:
        raise CheckFailure(HINT_TK_UNAVAILABLE.format(why=why))
    device = "cuda" if torch.cuda.is_available() and not kernels.INTERPRETED else "cpu"
    tolerance = 2e-3 if device == "cuda" else 1e-4  # on a GPU tl.dot rounds float32 to TF32
    for seed, batch, heads, n, d, block_m, block_n in TK_CALLS:
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(batch, heads, n, d, generator=g).to(device) for _ in range(3))
        what = f"your kernel on q, k, v of shape {(batch, heads, n, d)} with BLOCK_M = {block_m}, BLOCK_N = {block_n}"
        got = _run_learner_kernel(flash_kernel, q, k, v, block_m, block_n)
        want = F.scaled_dot_product_attention(q, k, v)
        if not torch.allclose(got, want, rtol=tolerance, atol=tolerance):
            for hint, number in TK_MISTAKES.items():
                wrong = launch_flash_kernel(_variant_kernel(), q, k, v, block_m=block_m, block_n=block_n, MISTAKE=number)
                if torch.allclose(got, wrong, rtol=tolerance, atol=tolerance, equal_nan=True) and not torch.allclose(
                        wrong, want, rtol=tolerance, atol=tolerance):
                    raise CheckFailure(hint)
        compare(got.cpu(), want.cpu(), what=f"{what}: O (against F.scaled_dot_product_attention)", rtol=tolerance,
                atol=tolerance)


# ----------------------------------------------------------------------------- probes

# Every step starts from the reference's state (drawn with the inputs), so one wrong step is one failure.
STEP_PROBE_RUN = HELPERS + """\
_results = [_call(online_softmax_step, torch.from_numpy(_m), torch.from_numpy(_l), torch.from_numpy(_x))
            for _m, _l, _x in zip(inputs['m'], inputs['l'], inputs['blocks'])]
_pair = lambda _r: isinstance(_r, (tuple, list)) and len(_r) == 2
outputs = {'returned': [_kind(_r) for _r in _results], 'mutated': _MUTATED,
           'm': [_array(_r[0]) if _pair(_r) else None for _r in _results],
           'l': [_array(_r[1]) if _pair(_r) else None for _r in _results]}
del _results, _pair
""" + CLEANUP


def _step_probe_inputs(rng: np.random.Generator) -> dict:
    rows = tuple(int(r) for r in rng.integers(1, 5, size=int(rng.integers(1, 3))))
    n, block = int(rng.integers(6, 20)), int(rng.integers(1, 5))
    x = rng.standard_normal((*rows, n)) * rng.uniform(1, 4)
    x += np.linspace(0, rng.uniform(3, 8), n) * (rng.random((*rows, 1)) > 0.4)  # the max grows partway
    x += rng.choice([0.0, 900.0], size=(*rows, 1))  # some rows around 1000: exp overflows without the max
    x = x.astype(np.float32)
    blocks = [x[..., i:i + block] for i in range(0, n, block)]
    m, l = torch.full(rows, NEG_INF), torch.zeros(rows)
    ms, ls = [], []
    for block_scores in blocks:
        ms.append(as_array(m))
        ls.append(as_array(l))
        m, l = online_softmax_step(m, l, torch.from_numpy(block_scores))
    return {"m": ms, "l": ls, "blocks": blocks}


def _step_reference(inputs: dict) -> dict:
    ms, ls, mistakes = [], [], []
    for step, (m, l, block) in enumerate(zip(inputs["m"], inputs["l"], inputs["blocks"])):
        m, l, x = torch.from_numpy(m), torch.from_numpy(l), torch.from_numpy(block)
        for hint, (wrong_m, wrong_l) in _step_mistakes(m, l, x):
            mistakes.append([hint, step, as_array(wrong_m), as_array(wrong_l)])
        m_new, l_new = online_softmax_step(m, l, x)
        ms.append(as_array(m_new))
        ls.append(as_array(l_new))
    return {"returned": ["a tuple of two tensors"] * len(ms), "m": ms, "l": ls, "mistakes": mistakes}


def _close(a: Any, b: Any) -> bool:
    """Equal shapes and values; NaN matches NaN and infinities match (a mistake's output may hold them)."""
    return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and bool(
        np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-4, atol=1e-5, equal_nan=True))


def _compare_step(outputs: dict, expected: dict) -> str | None:
    kinds = {"list of Tensor, Tensor": HINT_STEP_CALL}
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="online_softmax_step",
                              kind_hints=kinds)
    if problem:
        return problem
    for step, (got_m, got_l, want_m, want_l) in enumerate(zip(outputs.get("m") or [], outputs.get("l") or [],
                                                               expected["m"], expected["l"])):
        if _close(got_m, want_m) and _close(got_l, want_l):
            continue
        if _close(got_m, want_l) and _close(got_l, want_m):
            return HINT_SWAPPED
        for hint, at, wrong_m, wrong_l in expected["mistakes"]:
            if at == step and _close(got_m, wrong_m) and _close(got_l, wrong_l):
                return hint
        if isinstance(got_l, np.ndarray) and not np.isfinite(got_l).all():
            return HINT_RAW_EXP
        return (f"online_softmax_step differs from the reference at step {step + 1} of the hidden test "
                f"(m_new {'right' if _close(got_m, want_m) else 'wrong'}, l_new {'right' if _close(got_l, want_l) else 'wrong'})")
    if len(outputs.get("m") or []) != len(expected["m"]):
        return "online_softmax_step's hidden test did not run every step"
    return None


TILED_PROBE_RUN = HELPERS + """\
from tfedu.flash import MatmulOperands as _Widths
_results, _widest = [], []
for _a, _b, _t in zip(inputs['A'], inputs['B'], inputs['tiles']):
    with _Widths() as _w:
        _results.append(_call(tiled_matmul, torch.from_numpy(_a), torch.from_numpy(_b), _t))
    _widest.append(max(_w.widest, default=0) if _w.shapes else -1)
outputs = {'returned': [_kind(_r) for _r in _results], 'mutated': _MUTATED, 'C': [_array(_r) for _r in _results],
           'widest': _widest}
del _Widths, _results, _widest, _a, _b, _t, _w
""" + CLEANUP


def _tiled_probe_inputs(rng: np.random.Generator) -> dict:
    A, B, tiles = [], [], []
    for _ in range(3):
        n, m, p = (int(x) for x in rng.integers(2, 12, size=3))
        tile = int(rng.integers(1, 6))
        A.append(rng.integers(-5, 6, (n, m)).astype(np.float32))  # integers: every sum is exact
        B.append(rng.integers(-5, 6, (m, p)).astype(np.float32))
        tiles.append(tile)
    return {"A": A, "B": B, "tiles": tiles}


def _tiled_probe_reference(inputs: dict) -> dict:
    products, mistakes = [], []
    for a, b, tile in zip(inputs["A"], inputs["B"], inputs["tiles"]):
        A, B = torch.from_numpy(a), torch.from_numpy(b)
        products.append(as_array(A @ B))
        mistakes.append([[HINT_TILE_OVERWRITE, as_array(_tiled_reference(A, B, tile, accumulate=False))],
                         [HINT_TILE_EDGES.format(shape=f"A {a.shape}, B {b.shape}"),
                          as_array(_tiled_reference(A, B, tile, edges=False))]])
    return {"returned": ["tensor"] * len(products), "C": products, "mistakes": mistakes}


def _compare_tiled(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="tiled_matmul")
    if problem:
        return problem
    for widest, tile in zip(outputs.get("widest") or [], expected.get("tiles", [])):
        if widest == -1:
            return HINT_TILE_NO_MATMUL
        if widest > tile:
            return HINT_TILE_WHOLE.format(shape=f"with a dim of {widest}", tile=tile)
    for i, (got, want) in enumerate(zip(outputs.get("C") or [], expected["C"])):
        if _close(got, want):
            continue
        for hint, wrong in expected["mistakes"][i]:
            if _close(got, wrong) and not _close(wrong, want):
                return hint
        return f"tiled_matmul differs from A @ B in the hidden test's product {i + 1}"
    return None


def _tiled_reference_with_tiles(inputs: dict) -> dict:
    return {**_tiled_probe_reference(inputs), "tiles": list(inputs["tiles"])}


TILE_PROBE_RUN = HELPERS + """\
_results = [_call(flash_tile_update, *(torch.from_numpy(_a) for _a in _state), torch.from_numpy(_s), torch.from_numpy(_v))
            for _state, _s, _v in zip(inputs['states'], inputs['s'], inputs['v'])]
_ok = lambda _r: isinstance(_r, (tuple, list)) and len(_r) == 3
outputs = {'returned': ['a triple' if _ok(_r) else _kind(_r) for _r in _results], 'mutated': _MUTATED,
           'm': [_array(_r[0]) if _ok(_r) else None for _r in _results],
           'l': [_array(_r[1]) if _ok(_r) else None for _r in _results],
           'o': [_array(_r[2]) if _ok(_r) else None for _r in _results]}
del _results, _ok
""" + CLEANUP


def _tile_probe_inputs(rng: np.random.Generator) -> dict:
    batch = tuple(int(b) for b in rng.integers(1, 3, size=int(rng.integers(0, 3))))
    rows, block, d_v, blocks = (int(x) for x in (rng.integers(1, 6), rng.integers(1, 6), rng.integers(1, 5),
                                                 rng.integers(2, 5)))
    s = rng.standard_normal((*batch, rows, blocks * block)) * rng.uniform(1, 3)
    s += 3.0 * (np.arange(blocks * block) >= block) * (rng.random((*batch, rows, 1)) > 0.4)
    v = rng.standard_normal((*batch, blocks * block, d_v))
    tiles_s = [s[..., t * block:(t + 1) * block].astype(np.float32) for t in range(blocks)]
    tiles_v = [v[..., t * block:(t + 1) * block, :].astype(np.float32) for t in range(blocks)]
    state = (torch.full((*batch, rows), NEG_INF), torch.zeros(*batch, rows), torch.zeros(*batch, rows, d_v))
    states = []
    for s_t, v_t in zip(tiles_s, tiles_v):
        states.append([as_array(t) for t in state])
        state = tile_update(*state, torch.from_numpy(s_t), torch.from_numpy(v_t))
    return {"states": states, "s": tiles_s, "v": tiles_v}


def _tile_reference(inputs: dict) -> dict:
    out = {"returned": [], "m": [], "l": [], "o": [], "mistakes": []}
    for step, (state, s, v) in enumerate(zip(inputs["states"], inputs["s"], inputs["v"])):
        state = tuple(torch.from_numpy(a) for a in state)
        s, v = torch.from_numpy(s), torch.from_numpy(v)
        for hint, wrong in _tile_mistakes(*state, s, v):
            out["mistakes"].append([hint, step, [as_array(t) for t in wrong]])
        out["returned"].append("a triple")
        for key, t in zip("mlo", tile_update(*state, s, v)):
            out[key].append(as_array(t))
    return out


def _compare_tile(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="flash_tile_update",
                              kind_hints={k: HINT_TILE_UPDATE_CALL for k in ("tensor", "a tuple of two tensors")})
    if problem:
        return problem
    for step in range(len(expected["m"])):
        got = [(outputs.get(key) or [None] * (step + 1))[step] for key in "mlo"]
        want = [expected[key][step] for key in "mlo"]
        if all(_close(g, w) for g, w in zip(got, want)):
            continue
        for hint, at, wrong in expected["mistakes"]:
            if at == step and all(_close(g, w) for g, w in zip(got, wrong)):
                return hint
        names = [name for name, g, w in zip(("m_new", "l_new", "o_new"), got, want) if not _close(g, w)]
        return f"flash_tile_update differs from the reference at tile {step + 1} of the hidden test ({', '.join(names)} wrong)"
    return None


# flash_attention_forward: fresh q, k, v of drawn shapes and blocks, full and causal; the number of matrix products
# of each call (causal must do fewer), and the widest operand.

# Run in the kernel before a tiled answer: the operands' shapes of every matrix product it makes (the job of
# tfedu.flash.MatmulOperands, which the answer's own module may not be seen calling).
RECORDER_CODE = """\
from torch.overrides import TorchFunctionMode as _Mode

_PRODUCTS = {torch.matmul, torch.mm, torch.bmm, torch.einsum, torch.tensordot, torch.inner, torch.mv, torch.dot,
             torch.addmm, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
             torch.Tensor.bmm, torch.Tensor.mv, torch.Tensor.dot, torch.Tensor.inner, torch.Tensor.addmm,
             torch.nn.functional.linear}


class _MatmulOperands(_Mode):  # the operands' shapes of every matrix product (tfedu.flash.MatmulOperands' job)
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _PRODUCTS:
            self.shapes += [tuple(_a.shape) for _a in (*args, *(kwargs or {}).values()) if isinstance(_a, torch.Tensor)]
        return func(*args, **(kwargs or {}))
"""
RECORDER_CLEANUP = "del _Mode, _PRODUCTS, _MatmulOperands\n"

FF_PROBE_RUN = HELPERS + RECORDER_CODE + """\
_results, _products, _widest = [], [], []
for _q, _k, _v, _causal, _bq, _bk in zip(inputs['q'], inputs['k'], inputs['v'], inputs['causal'], inputs['block_q'],
                                         inputs['block_k']):
    with _MatmulOperands() as _seen:
        _r = _call(flash_attention_forward, torch.from_numpy(_q), torch.from_numpy(_k), torch.from_numpy(_v), _causal,
                   _bq, _bk)
    _results.append(_r)
    _products.append(len(_seen.shapes))
    _widest.append(max([_s[-2] * _s[-1] for _s in _seen.shapes if len(_s) >= 2], default=0))
_ok = lambda _r: isinstance(_r, (tuple, list)) and len(_r) == 2 and all(isinstance(_t, torch.Tensor) for _t in _r)
outputs = {'returned': ['a pair' if _ok(_r) else _kind(_r) for _r in _results], 'mutated': _MUTATED,
           'o': [_array(_r[0]) if _ok(_r) else None for _r in _results],
           'lse': [_array(_r[1]) if _ok(_r) else None for _r in _results], 'products': _products, 'widest': _widest}
del _results, _products, _widest, _q, _k, _v, _causal, _bq, _bk, _seen, _r, _ok
""" + RECORDER_CLEANUP + CLEANUP


def _ff_probe_inputs(rng: np.random.Generator) -> dict:
    """One full call (lengths apart) and the same causal sequence twice, full and causal, with blocks of two sizes."""
    batch = tuple(int(b) for b in rng.integers(1, 3, size=int(rng.integers(0, 3))))
    d, d_v = int(rng.integers(2, 9)), int(rng.integers(2, 9))
    block_q, block_k = int(rng.integers(3, 7)), int(rng.integers(2, 6))
    n_q, n_k, n = int(rng.integers(7, 20)), int(rng.integers(7, 20)), int(rng.integers(3, 6)) * block_q + int(rng.integers(1, block_q))
    draw = lambda *shape: (2 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    q_c, k_c, v_c = draw(*batch, n, d), draw(*batch, n, d), draw(*batch, n, d_v) / 2
    return {"q": [draw(*batch, n_q, d), q_c, q_c], "k": [draw(*batch, n_k, d), k_c, k_c],
            "v": [draw(*batch, n_k, d_v) / 2, v_c, v_c], "causal": [False, False, True],
            "block_q": [block_q] * 3, "block_k": [block_k] * 3}


def _ff_probe_reference(inputs: dict) -> dict:
    out = {"returned": [], "o": [], "lse": [], "mistakes": [], "inputs": inputs}
    for call, (q, k, v, causal, bq, bk) in enumerate(zip(inputs["q"], inputs["k"], inputs["v"], inputs["causal"],
                                                          inputs["block_q"], inputs["block_k"])):
        q, k, v = (torch.from_numpy(a) for a in (q, k, v))
        o, lse = reference_flash_attention_forward(q, k, v, causal, bq, bk)
        out["returned"].append("a pair")
        out["o"].append(as_array(o))
        out["lse"].append(as_array(lse))
        for hint, (wo, wl) in _ff_mistakes(q, k, v, causal, bq, bk):
            out["mistakes"].append([hint, call, as_array(wo), as_array(wl)])
    return out


def _ff_probe_close(a: Any, b: Any) -> bool:
    return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
            and np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True))


def _compare_ff(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="flash_attention_forward",
                              kind_hints={k: HINT_FF_CALL for k in ("tensor", "a tuple of two tensors")})
    if problem:
        return problem
    inputs = expected["inputs"]
    for call in range(len(expected["o"])):
        got = [(outputs.get(key) or [None] * (call + 1))[call] for key in ("o", "lse")]
        want = [expected["o"][call], expected["lse"][call]]
        if all(_ff_probe_close(g, w) for g, w in zip(got, want)):
            continue
        for hint, at, *wrong in expected["mistakes"]:
            if at == call and all(_ff_probe_close(g, w) for g, w in zip(got, wrong)) and not all(
                    _ff_probe_close(w, r) for w, r in zip(wrong, want)):
                return hint
        names = [name for name, g, w in zip(("o", "lse"), got, want) if not _ff_probe_close(g, w)]
        return (f"flash_attention_forward differs from the reference in the hidden test's call {call + 1} (causal="
                f"{inputs['causal'][call]}; {' and '.join(names)} wrong)")
    bq, bk = inputs["block_q"][0], inputs["block_k"][0]
    limit = max(bq, bk, inputs["q"][0].shape[-1], inputs["v"][0].shape[-1]) ** 2
    widest = outputs.get("widest") or [0]
    if max(widest) > limit:
        return HINT_FF_WHOLE.format(shape=f"of {max(widest)} elements", bq=bq, bk=bk)
    products = outputs.get("products") or [0, 0, 0]
    return skip_problem(products[1], products[2], inputs["q"][1].shape[-2], inputs["block_q"][1], inputs["block_k"][1],
                        HINT_FF_NO_SKIP, HINT_FF_SKIP_TOO_LITTLE)


# flash_attention_backward: the same drawn calls as 9.4's probe, with o and lse from the reference forward and a
# random upstream gradient; the products counted.

FB_PROBE_RUN = HELPERS + RECORDER_CODE + """\
_results, _products, _widest = [], [], []
for _c in range(len(inputs['q'])):
    _args = [torch.from_numpy(inputs[_key][_c]) for _key in ('q', 'k', 'v', 'o', 'lse', 'do')]
    with _MatmulOperands() as _seen:
        _r = _call(flash_attention_backward, *_args, inputs['causal'][_c], inputs['block_q'][_c], inputs['block_k'][_c])
    _results.append(_r)
    _products.append(len(_seen.shapes))
    _widest.append(max([_s[-2] * _s[-1] for _s in _seen.shapes if len(_s) >= 2], default=0))
_ok = lambda _r: isinstance(_r, (tuple, list)) and len(_r) == 3 and all(isinstance(_t, torch.Tensor) for _t in _r)
outputs = {'returned': ['a triple' if _ok(_r) else _kind(_r) for _r in _results], 'mutated': _MUTATED,
           'grads': [[_array(_t) for _t in _r] if _ok(_r) else None for _r in _results],
           'products': _products, 'widest': _widest}
del _results, _products, _widest, _c, _args, _seen, _r, _ok
""" + RECORDER_CLEANUP + CLEANUP


def _fb_probe_inputs(rng: np.random.Generator) -> dict:
    inputs = _ff_probe_inputs(rng)
    inputs["o"], inputs["lse"], inputs["do"] = [], [], []
    for q, k, v, causal, bq, bk in zip(inputs["q"], inputs["k"], inputs["v"], inputs["causal"], inputs["block_q"],
                                       inputs["block_k"]):
        o, lse = flash_forward(*(torch.from_numpy(a) for a in (q, k, v)), causal=causal, block_q=bq, block_k=bk)
        inputs["o"].append(as_array(o))
        inputs["lse"].append(as_array(lse))
        inputs["do"].append(rng.standard_normal(o.shape).astype(np.float32))
    return inputs


def _fb_probe_reference(inputs: dict) -> dict:
    out = {"returned": [], "grads": [], "mistakes": [], "inputs": inputs}
    for c, causal in enumerate(inputs["causal"]):
        q, k, v, o, lse, do = (torch.from_numpy(inputs[key][c]) for key in ("q", "k", "v", "o", "lse", "do"))
        bq, bk = inputs["block_q"][c], inputs["block_k"][c]
        out["returned"].append("a triple")
        out["grads"].append([as_array(t.float()) for t in autograd_gradients(q, k, v, do, causal)])
        for hint, variant in _fb_mistake_list():
            out["mistakes"].append([hint, c, [as_array(t.float()) for t in _fb_variant(q, k, v, o, lse, do, causal, bq, bk,
                                                                                   variant)]])
    return out


def _fb_probe_close(got: Any, want: list) -> bool:
    return isinstance(got, list) and len(got) == 3 and all(
        isinstance(g, np.ndarray) and g.shape == w.shape and np.allclose(g, w, rtol=1e-3, atol=1e-4, equal_nan=True)
        for g, w in zip(got, want))


def _compare_fb(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="flash_attention_backward",
                              kind_hints={k: HINT_FB_CALL for k in ("tensor", "a tuple of two tensors")})
    if problem:
        return problem
    inputs = expected["inputs"]
    for c, want in enumerate(expected["grads"]):
        got = (outputs.get("grads") or [None] * (c + 1))[c]
        if _fb_probe_close(got, want):
            continue
        for hint, at, wrong in expected["mistakes"]:
            if at == c and _fb_probe_close(got, wrong) and not _fb_probe_close(wrong, want):
                return hint
        return (f"flash_attention_backward's gradients differ from autograd's in the hidden test's call {c + 1} "
                f"(causal={inputs['causal'][c]})")
    products = outputs.get("products") or [0, 0, 0]  # (D over whole rows is fine here: no width limit, as in 9.4)
    return skip_problem(products[1], products[2], inputs["q"][1].shape[-2], inputs["block_q"][1], inputs["block_k"][1],
                        HINT_FB_NO_SKIP, HINT_FB_SKIP_TOO_LITTLE)


# The two linear attentions: fresh q, k, v of drawn shapes, each function called on each; the reference and the
# mistakes worked out here.

LA_PROBE_RUN = HELPERS + """\
_outs = {}
for _name, _fn in (('recurrent', linear_attention_recurrent), ('cumsum', linear_attention_cumsum)):
    _results = [_call(_fn, torch.from_numpy(_q), torch.from_numpy(_k), torch.from_numpy(_v))
                for _q, _k, _v in zip(inputs['q'], inputs['k'], inputs['v'])]
    _outs[_name] = [_array(_r) for _r in _results]
    _outs['returned_' + _name] = [_kind(_r) for _r in _results]
outputs = {**_outs, 'returned': _outs['returned_recurrent'] + _outs['returned_cumsum'], 'mutated': _MUTATED}
del _outs, _name, _fn, _results
""" + CLEANUP


def _la_probe_inputs(rng: np.random.Generator) -> dict:
    calls = []
    for _ in range(2):
        batch = tuple(int(b) for b in rng.integers(1, 3, size=int(rng.integers(0, 3))))
        pos, d, d_v = int(rng.integers(6, 16)), int(rng.integers(2, 7)), int(rng.integers(2, 7))
        calls.append([(rng.uniform(1, 2) * rng.standard_normal((*batch, pos, d))).astype(np.float32),
                      (rng.uniform(1, 2) * rng.standard_normal((*batch, pos, d))).astype(np.float32),
                      rng.standard_normal((*batch, pos, d_v)).astype(np.float32)])
    return {"q": [c[0] for c in calls], "k": [c[1] for c in calls], "v": [c[2] for c in calls]}


def _la_probe_reference(inputs: dict) -> dict:
    out = {"returned": ["tensor"] * (2 * len(inputs["q"])), "want": [], "mistakes": []}
    for c, arrays in enumerate(zip(inputs["q"], inputs["k"], inputs["v"])):
        q, k, v = (torch.from_numpy(a) for a in arrays)
        out["want"].append(as_array(reference_causal_linear_attention(q, k, v)))
        for hint, variant in (*LA_MISTAKES.items(), *LA_MISTAKES_MORE):
            out["mistakes"].append([hint, c, as_array(_la_variant(q, k, v, mistake=variant).float())])
    return out


def _compare_la(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="your linear attention")
    if problem:
        return problem
    close = lambda a, b: (isinstance(a, np.ndarray) and a.shape == b.shape  # noqa: E731
                          and np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True))
    for key, name in (("recurrent", "linear_attention_recurrent"), ("cumsum", "linear_attention_cumsum")):
        for c, want in enumerate(expected["want"]):
            got = (outputs.get(key) or [None] * (c + 1))[c]
            if close(got, want):
                continue
            for hint, at, wrong in expected["mistakes"]:
                if at == c and close(got, wrong) and not close(wrong, want):
                    return hint.format(fn=name)
            return f"{name} differs from causal linear attention in the hidden test's call {c + 1}"
    return None


# The Triton kernel: fresh inputs of drawn sizes (N rarely a multiple of the blocks), launched in the kernel's
# process; the reference (SDPA) and the mistakes' outputs (the variant kernel) worked out here.

TK_PROBE_RUN = """\
from tfedu.checks.nb09_efficient_attention import launch_flash_kernel as _launch
import torch as _torch

_device = 'cuda' if _torch.cuda.is_available() and __import__('os').environ.get('TRITON_INTERPRET') != '1' else 'cpu'
outputs = {'o': []}
for _q, _k, _v in zip(inputs['q'], inputs['k'], inputs['v']):
    _q, _k, _v = (_torch.from_numpy(_a).to(_device) for _a in (_q, _k, _v))
    outputs['o'].append(_launch(flash_kernel, _q, _k, _v).float().cpu().numpy())
del _launch, _torch, _device, _q, _k, _v
"""


def _tk_probe_inputs(rng: np.random.Generator) -> dict:
    """Small launches (the interpreter runs every program in Python): one or two heads, N past one block."""
    calls = []
    for _ in range(2):
        heads, n = int(rng.integers(1, 3)), int(rng.integers(17, 33))
        calls.append([rng.standard_normal((1, heads, n, 16)).astype(np.float32) for _ in range(3)])
    return {"q": [c[0] for c in calls], "k": [c[1] for c in calls], "v": [c[2] for c in calls]}


def _tk_probe_reference(inputs: dict) -> dict:
    """SDPA's output for each launch; the mistakes' outputs are worked out only for a wrong answer (_compare_tk)."""
    return {"want": [as_array(F.scaled_dot_product_attention(*(torch.from_numpy(a) for a in arrays)))
                     for arrays in zip(inputs["q"], inputs["k"], inputs["v"])], "inputs": inputs}


def _compare_tk(outputs: dict, expected: dict) -> str | None:
    got_all = outputs.get("o") if isinstance(outputs, dict) else None
    if not isinstance(got_all, list) or len(got_all) != len(expected["want"]):
        return "the hidden test's outputs should hold the kernel's output for each launch"
    close = lambda a, b: (isinstance(a, np.ndarray) and a.shape == b.shape  # noqa: E731
                          and np.allclose(a, b, rtol=2e-3, atol=2e-3, equal_nan=True))
    for c, (got, want) in enumerate(zip(got_all, expected["want"])):
        if close(got, want):
            continue
        q, k, v = (torch.from_numpy(expected["inputs"][key][c]) for key in ("q", "k", "v"))
        for hint, number in TK_MISTAKES.items():
            wrong = as_array(launch_flash_kernel(_variant_kernel(), q, k, v, MISTAKE=number))
            if close(got, wrong) and not close(wrong, want):
                return hint
        return f"your kernel's output differs from attention's in the hidden test's launch {c + 1} (N = {want.shape[-2]})"
    return None


# The reference tile update, bound in place of the learner's flash_tile_update while 9.4 is graded.
FF_STANDINS = """\
def flash_tile_update(m, l, o, s, v):
    m_new = torch.maximum(m, s.amax(dim=-1))
    p = torch.exp(s - m_new[..., None])
    alpha = torch.exp(m - m_new)
    return m_new, alpha * l + p.sum(dim=-1), alpha[..., None] * o + p @ v
"""


PROBES = {
    "check_online_softmax_step": Probe(
        exercise="ex_online_step", make_inputs=_step_probe_inputs, run=STEP_PROBE_RUN, reference=_step_reference,
        compare=_compare_step, forbidden=("tfedu.softmax", "tfedu.flash", "torch.softmax", "torch.logsumexp",
                                          "torch.Tensor.logsumexp", "torch.nn.functional.softmax")),
    "check_tiled_matmul": Probe(
        exercise="ex_tiled_matmul", make_inputs=_tiled_probe_inputs, run=TILED_PROBE_RUN,
        reference=_tiled_reference_with_tiles, compare=_compare_tiled,
        forbidden=("numpy.matmul", "numpy.dot", "numpy.einsum", "numpy.tensordot", "numpy.inner")),
    "check_flash_tile_update": Probe(
        exercise="ex_tile_update", make_inputs=_tile_probe_inputs, run=TILE_PROBE_RUN, reference=_tile_reference,
        compare=_compare_tile, forbidden=("tfedu.flash", "tfedu.softmax", "torch.nn.functional.scaled_dot_product_attention")),
    "check_flash_attention_forward": Probe(
        exercise="ex_flash_forward", make_inputs=_ff_probe_inputs, run=FF_PROBE_RUN, reference=_ff_probe_reference,
        compare=_compare_ff, standins=FF_STANDINS,
        forbidden=("tfedu.flash", "tfedu.softmax", "tfedu.attention", "torch.nn.functional.scaled_dot_product_attention",
                   "torch.softmax", "torch.nn.functional.softmax", "torch.logsumexp", "torch.Tensor.logsumexp")),
    "check_linear_attention_two_ways": Probe(
        exercise="ex_linear_attention", make_inputs=_la_probe_inputs, run=LA_PROBE_RUN, reference=_la_probe_reference,
        compare=_compare_la, forbidden=("tfedu.flash", "tfedu.attention"),
        builds=ELEMENTARY | ACTIVATIONS | frozenset({"torch.nn.functional.elu"})),
    "check_flash_kernel": Probe(
        exercise="ex_flash_kernel", make_inputs=_tk_probe_inputs, run=TK_PROBE_RUN, reference=_tk_probe_reference,
        compare=_compare_tk, builds=None,  # Triton's language, not torch's operations
        forbidden=("tfedu.flash", "tfedu.kernels.flash_attention", "tfedu.kernels.flash_forward",
                   "torch.nn.functional.scaled_dot_product_attention")),
    "check_flash_attention_backward": Probe(
        exercise="ex_flash_backward", make_inputs=_fb_probe_inputs, run=FB_PROBE_RUN, reference=_fb_probe_reference,
        compare=_compare_fb,
        forbidden=("tfedu.flash", "tfedu.softmax", "tfedu.attention", "torch.nn.functional.scaled_dot_product_attention",
                   "torch.autograd", "torch.Tensor.backward", "torch.softmax", "torch.nn.functional.softmax")),
}


def tiled_matmul_reference(A: torch.Tensor, B: torch.Tensor, tile: int) -> torch.Tensor:
    """A @ B one tile x tile block product at a time: what notebook 09's switch runs in place of a failing answer."""
    return _tiled_reference(A, B, tile)


HINTS = {
    "ex_online_step": Hints(
        number="9.1",
        check="check_online_softmax_step",
        idea=(
            "A row's running state is its max m so far and the sum l of exp(x_j - m) over the scores seen so far. "
            "A new block can only raise the max. When it does, every term already in l was taken against the old "
            "max; multiplying l by exp(m_old - m_new), a number at most 1, turns each of them into "
            "exp(x_j - m_new), the same max that the block's own terms are taken against. Every exponent then stays "
            "at most 0, so nothing overflows, and the start m = -inf, l = 0 needs no special case."
        ),
        approach=(
            "Two lines, vectorised over the rows. (1) The new max: each row's largest score in the block (a max "
            "over the block's last axis, shape (*rows)), then the elementwise larger of that and the old m "
            "(torch.maximum), still (*rows). (2) The new sum: the old l times exp(m - m_new), plus the sum over "
            "the block's last axis of exp(x_block - m_new), where m_new needs a trailing axis of size 1 to "
            "broadcast against (*rows, block). Return the pair, the max first. No softmax or logsumexp, and no "
            "in-place change to m or l."
        ),
        skeleton=(
            "def online_softmax_step(m, l, x_block):\n"
            "    m_new = torch.maximum(m, ____)  # (*rows): the max can only grow\n"
            "    l_new = l * ____ + torch.exp(____).sum(dim=-1)  # rescale the old sum, then add the block's terms\n"
            "    return m_new, l_new\n"
        ),
    ),
    "ex_tiled_matmul": Hints(
        number="9.2",
        check="check_tiled_matmul",
        idea=(
            "A product C = A @ B can be built block by block: the tile of C at block-row i and block-column j is "
            "the sum, over the blocks k of the shared dimension, of (tile i, k of A) times (tile k, j of B). Each "
            "small product is an ordinary matrix multiply of operands at most tile x tile, and the partial "
            "products of one tile of C are added up, not written over each other. When a size is not a multiple "
            "of tile, the last tiles are simply smaller."
        ),
        approach=(
            "Start from a C of zeros, shape (n, p), in A's dtype. Three nested loops, each stepping by tile: i "
            "over the rows of A (0 up to n), j over the columns of B (0 up to p), k over the shared dimension (0 "
            "up to m). Innermost: take the block of A at rows from i and columns from k (at most tile of each), "
            "the block of B at rows from k and columns from j, multiply them with @, and add the product into the "
            "block of C at rows from i and columns from j. A slice that runs past the end just stops there, so "
            "the edge tiles need no special case. Return C; write into C only, never into A or B."
        ),
        skeleton=(
            "def tiled_matmul(A, B, tile):\n"
            "    n, m = A.shape\n"
            "    p = ____  # the number of columns of B\n"
            "    C = ____  # (n, p) zeros, in A's dtype\n"
            "    for i in range(____):  # the first row of each block-row of C\n"
            "        for j in range(____):  # the first column of each block-column of C\n"
            "            for k in range(____):  # the start of each block along the shared dimension\n"
            "                C[i:i + tile, j:j + tile] += ____ @ ____\n"
            "    return C\n"
        ),
    ),
    "ex_tile_update": Hints(
        number="9.3",
        check="check_flash_tile_update",
        idea=(
            "It is exercise 9.1 with an output attached. Per query the state is the running max m, the running "
            "sum l of exp(s - m), and an unnormalised output o, the running sum of exp(s - m) times the value "
            "vectors. A new tile may raise the max; then everything summed so far, l and o alike, was taken "
            "against the old max and shrinks by the same factor exp(m_old - m_new). The tile's own weights are "
            "taken against the new max. o is never divided by l here: that happens once, after the last tile."
        ),
        approach=(
            "Shapes: m and l (*rows); o (*rows, d_v); s (*rows, block_k); v (*batch, block_k, d_v). (1) m_new: "
            "the larger of m and each row's max of s over its last axis, (*rows). (2) The tile's weights: exp of "
            "s minus m_new, with m_new given a trailing axis to broadcast, (*rows, block_k). (3) The rescale "
            "factor: exp of m minus m_new, (*rows). (4) l_new: the factor times l, plus the weights summed over "
            "their last axis. (5) o_new: the factor, with a trailing axis so that it scales each row of o, times "
            "o, plus the weights times v (a batched (block_q, block_k) @ (block_k, d_v) product), (*rows, d_v). "
            "Return (m_new, l_new, o_new), with no division by l and nothing changed in place."
        ),
        skeleton=(
            "def flash_tile_update(m, l, o, s, v):\n"
            "    m_new = torch.maximum(m, ____)  # (*rows)\n"
            "    p = torch.exp(____)  # (*rows, block): the tile's weights, against which max?\n"
            "    alpha = ____  # (*rows): shrinks what was summed against the old max\n"
            "    l_new = ____ + p.sum(dim=-1)\n"
            "    o_new = ____ + p @ v  # (*rows, d_v): rescale the old o row by row first\n"
            "    return m_new, l_new, o_new\n"
        ),
    ),
    "ex_flash_forward": Hints(
        number="9.4",
        check="check_flash_attention_forward",
        idea=(
            "FlashAttention-2's forward pass is two loops around exercise 9.3's update. The outer loop takes one "
            "block of queries at a time and gives it a fresh running state (max -inf, sum 0, output 0); the inner "
            "loop visits the key blocks in order, computes that one tile of scaled scores, hides the future keys "
            "if the attention is causal, and folds the tile in. After the last key block the block's output is its "
            "running output divided by its running sum, and each query's log-sum-exp is its max plus the log of "
            "its sum. A causal key block that starts after the block's last query is all future: skip it and every "
            "later one."
        ),
        approach=(
            "Prepare o (*batch, query_pos, d_v) and lse (*batch, query_pos) to fill block by block, and the scale "
            "1 / sqrt(d_head). Outer loop: i0 steps by block_q; the block ends at the smaller of i0 + block_q and "
            "query_pos (the last block may be short). Start m at -inf and l at 0 with the block's (*batch, bq) "
            "shape, and the running output at 0, (*batch, bq, d_v). Inner loop: j0 steps by block_k; when causal "
            "and j0 is at or past the block's end, stop the inner loop. Take the key and value blocks, the scores "
            "(*batch, bq, bk) as the query block times the key block transposed, times the scale. When causal, "
            "compare the keys' positions j0 .. j1 - 1 with the queries' i0 .. i1 - 1 (positions in the sequence, "
            "not in the tile) and fill -inf where the key's position is larger. Update the state with "
            "flash_tile_update. After the inner loop, write the block's output divided by l (with a trailing axis) "
            "and its m plus log l."
        ),
        skeleton=(
            "def flash_attention_forward(q, k, v, causal=False, block_q=64, block_k=64):\n"
            "    n_q, n_k, scale = q.shape[-2], k.shape[-2], ____\n"
            "    o = ____  # (*batch, query_pos, d_v), filled block by block\n"
            "    lse = ____  # (*batch, query_pos)\n"
            "    for i0 in range(____):  # the first query of each block\n"
            "        i1 = ____\n"
            "        m = ____  # (*batch, bq) of -inf\n"
            "        l = ____  # (*batch, bq) of zeros\n"
            "        acc = ____  # (*batch, bq, d_v) of zeros\n"
            "        for j0 in range(____):  # the first key of each block\n"
            "            if causal and ____:\n"
            "                break  # this key block and the later ones are all in the future\n"
            "            j1 = ____\n"
            "            s = ____  # (*batch, bq, bk): scaled scores of this tile\n"
            "            if causal:\n"
            "                future = ____  # (bq, bk): key position > query position\n"
            "                s = ____  # -inf where future\n"
            "            m, l, acc = flash_tile_update(m, l, acc, s, ____)\n"
            "        o[..., i0:i1, :] = ____\n"
            "        lse[..., i0:i1] = ____\n"
            "    return o, lse\n"
        ),
    ),
    "ex_flash_backward": Hints(
        number="9.5",
        check="check_flash_attention_backward",
        idea=(
            "The backward pass keeps no matrix of weights from the forward pass: it rebuilds each tile of P from "
            "the scores and the saved log-sum-exp, P = exp(S - lse). With O = P V, the value gradient is P^T dO "
            "and the weights' gradient dP = dO V^T. The softmax's backward is dS = P * (dP - D), where D, one "
            "number per query, is the sum of P * dP over its keys, which equals the sum of dO * O over its "
            "features: computed once, before the loops. Since S = Q K^T / sqrt(d), dQ gathers dS K / sqrt(d) and "
            "dK gathers dS^T Q / sqrt(d), summed over every tile each query or key takes part in."
        ),
        approach=(
            "First D, the sum over the last axis of do times o, (*batch, query_pos). Start dq, dk, dv as zeros shaped"
            " like q, k, v. Loop over key blocks (j0 by block_k) and, inside, query blocks (i0 by block_q); in the "
            "causal case skip a tile whose keys all come after its queries (the key block starts at or after the "
            "query block's end). Per tile: the scores as in the forward pass, scaled, and masked by sequence "
            "positions when causal; the weights P, exp of the scores less lse (the query block's, with a trailing "
            "axis); dv's key block gains P transposed times do's query block; the weights' gradient dP is do's block "
            "times v's block transposed; the scores' gradient dS is P times (dP minus the block's D with a trailing "
            "axis); dq's query block gains the scale times dS times k's block; dk's key block gains the scale times "
            "dS transposed times q's block. Add, never assign: each block receives contributions from many tiles."
        ),
        skeleton=(
            "def flash_attention_backward(q, k, v, o, lse, do, causal=False, block_q=64, block_k=64):\n"
            "    n_q, n_k, scale = q.shape[-2], k.shape[-2], ____\n"
            "    D = ____  # (*batch, query_pos)\n"
            "    dq, dk, dv = ____, ____, ____\n"
            "    for j0 in range(____):\n"
            "        j1 = ____\n"
            "        for i0 in range(____):\n"
            "            i1 = ____\n"
            "            if causal and ____:\n"
            "                continue  # every key of this tile comes after every query of it\n"
            "            s = ____  # scaled (and, when causal, masked) scores of the tile\n"
            "            p = ____  # the forward's weights, rebuilt from lse\n"
            "            dv[..., j0:j1, :] += ____\n"
            "            dp = ____\n"
            "            ds = ____\n"
            "            dq[..., i0:i1, :] += ____\n"
            "            dk[..., j0:j1, :] += ____\n"
            "    return dq, dk, dv\n"
        ),
    ),
    "ex_linear_attention": Hints(
        number="9.6",
        check="check_linear_attention_two_ways",
        idea=(
            "With phi(x) = elu(x) + 1 in place of the exponential, query i's output is phi(q_i) times S_i, divided by "
            "phi(q_i) times z_i plus eps, where S_i is the sum over keys j up to i of the outer products phi(k_j) "
            "v_j^T, a (d_head, d_v) matrix, and z_i the sum of phi(k_j), a d_head vector. Both are running sums along "
            "the positions. The recurrence keeps them as a state and adds one position's terms at each step, before "
            "reading the state for that position; the cumulative sums form every position's outer product and add "
            "them up along the positions in one call."
        ),
        approach=(
            "Apply phi to q and k first. Recurrent: start S at zeros (*batch, d_head, d_v) and z at zeros (*batch, "
            "d_head); for each position i, add the outer product of phi(k_i) and v_i to S and phi(k_i) to z, then "
            "the output at i is phi(q_i) times S (a vector-matrix product, d_v) over phi(q_i) dotted with z plus "
            "eps; stack the outputs along the positions. Cumulative: the outer products of every position at once, "
            "(*batch, pos, d_head, d_v) (a trailing axis on phi(k), a d_head axis on v), their cumulative sum along "
            "the positions axis, and the cumulative sum of phi(k) along its positions; then the same numerator and "
            "denominator for all positions together, with sums over d_head."
        ),
        skeleton=(
            "def linear_attention_recurrent(q, k, v, eps=1e-6):\n"
            "    phi_q, phi_k = ____, ____\n"
            "    S = ____  # (*batch, d_head, d_v)\n"
            "    z = ____  # (*batch, d_head)\n"
            "    outputs = []\n"
            "    for i in range(____):  # every position, in order\n"
            "        S = S + ____  # the outer product of phi(k_i) and v_i\n"
            "        z = z + ____\n"
            "        outputs.append(____ / (____ + eps))\n"
            "    return torch.stack(outputs, dim=____)\n"
            "\n"
            "\n"
            "def linear_attention_cumsum(q, k, v, eps=1e-6):\n"
            "    phi_q, phi_k = ____, ____\n"
            "    S = (____ * ____).cumsum(dim=____)  # (*batch, pos, d_head, d_v)\n"
            "    z = phi_k.cumsum(dim=____)  # (*batch, pos, d_head)\n"
            "    return ____ / (____ + eps)\n"
        ),
    ),
    "ex_flash_kernel": Hints(
        number="9.7",
        check="check_flash_kernel",
        idea=(
            "It is exercise 9.3's update, on tiles that the kernel loads itself. For each block of keys the program "
            "builds the block's row offsets, loads the key and value tiles (rows past N masked, reading zeros), "
            "computes the tile of scaled scores with one tile product, hides the key positions at or past N (-inf), "
            "and folds the tile into its running max, sum and accumulator: the new max, the factor that shrinks "
            "what was summed against the old max, the tile's weights, the rescaled sums plus the tile's. The loop "
            "variables are reassigned each step; the running max takes the new max at the end."
        ),
        approach=(
            "(1) The key rows of this block: a range of BLOCK_N plus start_n. (2) Their pointers' offsets: head, "
            "plus the rows times D_HEAD as a column, plus offs_d as a row: a (BLOCK_N, D_HEAD) tile of offsets. "
            "(3) Load k and v from K and V at those offsets with the mask rows < N as a column and other 0. (4) The "
            "scores: q times k transposed with tl.dot, times scale, (BLOCK_M, BLOCK_N); then tl.where with the "
            "mask rows < N as a row, keeping the scores or -inf. (5) The new max: tl.maximum of m_i and the row "
            "max of the scores (tl.max over axis 1). (6) alpha, the exp of m_i minus the new max; the weights, the "
            "exp of the scores minus the new max as a column. (7) l_i becomes l_i times alpha plus the weights' "
            "row sums; acc becomes acc times alpha as a column plus tl.dot of the weights and v; m_i becomes the "
            "new max."
        ),
        skeleton=(
            "for start_n in range(____):  # as in the cell: one block of keys per step\n"
            "    offs_n = ____  # (BLOCK_N,): this block's key rows\n"
            "    kv = ____  # (BLOCK_N, D_HEAD) offsets of the key and value tiles\n"
            "    k = tl.load(K + kv, mask=____, other=0.0)\n"
            "    v = tl.load(V + kv, mask=____, other=0.0)\n"
            "    s = ____  # (BLOCK_M, BLOCK_N): scaled scores\n"
            "    s = tl.where(____, s, float(\"-inf\"))  # keys at or past N do not exist\n"
            "    m_new = ____\n"
            "    alpha = ____\n"
            "    p = ____\n"
            "    l_i = ____\n"
            "    acc = ____\n"
            "    m_i = m_new\n"
        ),
    ),
}
