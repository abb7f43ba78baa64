"""Linear recurrences that rival attention: gated linear attention (retention) and Mamba's selective scan.

Both keep a fixed-size state instead of a growing KV cache, so a generated token costs the same at
any context length. Each comes in a recurrent form (one step at a time: how it decodes) and a
parallel form (how it trains), and the two are equal.

- ``gated_linear_attention_step`` / ``_recurrent`` / ``_chunked`` / ``_quadratic``: the state
  S_t = g_t S_{t-1} + k_t^T v_t (d_head x d_v per head), out o_t = q_t S_t, with a scalar gate g_t in
  (0, 1] per head and step. A fixed g per head is RetNet's retention (Sun et al. 2023, eq. 1-6); a
  gate computed from the input is the scalar-gate form of Gated Linear Attention (Yang et al. 2024),
  the one Mamba-2 and Gated DeltaNet use. (GLA proper gates each of the d_head rows of the state with
  its own g; that per-channel gate is left out here.) g = 1 is notebook 09's causal linear attention
  (``tfedu.flash.linear_attention``) with the identity feature map and no normaliser.
- ``selective_scan_step`` / ``_sequential`` / ``_parallel``: Mamba's S6 (Gu & Dao 2023, Algorithm 2,
  sec. 3), h_t = exp(Delta_t A) h_{t-1} + Delta_t B_t x_t, y_t = C_t h_t + D x_t, with Delta, B and C
  computed from the input. The parallel form is a Hillis-Steele scan over (a, b) pairs.
- ``MambaLayer``: the whole Mamba mixer (in_proj, causal depthwise conv, SiLU, x_proj, dt_proj with
  softplus, the scan, the SiLU(z) gate, out_proj), with ``transformers``' ``MambaMixer`` parameter
  names and shapes, so a state_dict copies across (``MambaLayer.from_hf``); ``step`` decodes one
  token from a ``MambaState`` of constant size.
- ``LinearAttentionLayer`` and ``GatedLinearAttentionLayer``: notebook 09's causal linear attention and gated
  linear attention as layers shaped like attention (W_Q, W_K, W_V, W_O, heads), which ``ModelConfig.layer_types``
  ("linear", "gla") puts in place of a block's attention; "mamba" puts a ``MambaLayer`` there.

Built by hand in notebooks/19_beyond_attention.ipynb: the GLA step (exercise 19.1), the chunked form (19.2) and the
selective scan step (19.3).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from tfedu.delta_rule import GatedRMSNorm
from tfedu.flash import linear_attention

SCANS = ("sequential", "parallel")

# ----------------------------------------------------------------------------- checks


def _expect(name: str, value: object, shape: tuple[int | None, ...], expected: str) -> Tensor:
    """A floating-point tensor whose sizes match ``shape`` (None: any size); else a clear error."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} should be a torch.Tensor of shape {expected}, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} should be a floating-point tensor of shape {expected}, got dtype {value.dtype}")
    if value.dim() != len(shape) or any(want is not None and got != want for got, want in zip(value.shape, shape)):
        raise ValueError(f"{name} should have shape {expected}, got {tuple(value.shape)}")
    return value


def _check_gate(name: str, g: Tensor) -> None:
    # g = 0 would make log g = -inf in the chunked form, and g > 1 makes the state grow without bound.
    if not bool(((g > 0) & (g <= 1)).all()):
        raise ValueError(f"{name} must lie in (0, 1] (a decay per head and step), got values in [{g.min()}, {g.max()}]")


def _check_chunk(chunk: object) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int (positions per chunk), got {chunk!r}")
    return chunk


def _check_qkvg(q: object, k: object, v: object, g: object) -> tuple[int, int, int, int, int]:
    q = _expect("q", q, (None, None, None, None), "(batch, n_heads, pos, d_head)")
    batch, n_heads, pos, d_head = q.shape
    _expect("k", k, (batch, n_heads, pos, d_head), f"({batch}, {n_heads}, {pos}, {d_head}) like q")
    v = _expect("v", v, (batch, n_heads, pos, None), f"({batch}, {n_heads}, {pos}, d_v)")
    g = _expect("g", g, (batch, n_heads, pos), f"({batch}, {n_heads}, {pos}): one gate per head and step")
    _check_gate("g", g)
    return batch, n_heads, pos, d_head, v.shape[-1]


def _initial_state(state: Tensor | None, q: Tensor, d_v: int) -> Tensor:
    batch, n_heads, _, d_head = q.shape
    if state is None:
        return q.new_zeros(batch, n_heads, d_head, d_v)
    return _expect("state", state, (batch, n_heads, d_head, d_v), f"({batch}, {n_heads}, {d_head}, {d_v})")


# ----------------------------------------------------------------------------- gated linear attention


def gated_linear_attention_step(
    state: Float[Tensor, "batch n_heads d_head d_v"],
    q_t: Float[Tensor, "batch n_heads d_head"],
    k_t: Float[Tensor, "batch n_heads d_head"],
    v_t: Float[Tensor, "batch n_heads d_v"],
    g_t: Float[Tensor, "batch n_heads"],
) -> tuple[Float[Tensor, "batch n_heads d_v"], Float[Tensor, "batch n_heads d_head d_v"]]:
    """One step of gated linear attention: S_t = g_t S_{t-1} + k_t^T v_t, o_t = q_t S_t.

    The state S is a (d_head, d_v) matrix per head: the sum of the outer products k_s^T v_s of every
    step so far, each shrunk by the gates of the steps since (g in (0, 1]: old memories fade). Reading
    it with q_t gives sum_s (g_{s+1} ... g_t) (q_t . k_s) v_s: attention without the softmax, with a
    decay in place of a mask. Returns (o_t, new_state); the step costs O(d_head d_v), whatever t is.
    Retention (Sun et al. 2023, eq. 1) with g fixed per head; Gated Linear Attention (Yang et al. 2024,
    eq. 3) with g from the input.

    >>> S = torch.zeros(1, 1, 2, 1)
    >>> q = k = torch.tensor([[[1.0, 0.0]]]); g = torch.tensor([[0.5]])
    >>> o, S = gated_linear_attention_step(S, q, k, torch.tensor([[[4.0]]]), g)
    >>> o, S = gated_linear_attention_step(S, q, k, torch.tensor([[[2.0]]]), g)
    >>> o  # 0.5 * 4 + 2
    tensor([[[4.]]])
    """
    q_t = _expect("q_t", q_t, (None, None, None), "(batch, n_heads, d_head)")
    batch, n_heads, d_head = q_t.shape
    _expect("k_t", k_t, (batch, n_heads, d_head), f"({batch}, {n_heads}, {d_head}) like q_t")
    v_t = _expect("v_t", v_t, (batch, n_heads, None), f"({batch}, {n_heads}, d_v)")
    _expect("g_t", g_t, (batch, n_heads), f"({batch}, {n_heads}): one gate per head")
    _check_gate("g_t", g_t)
    d_v = v_t.shape[-1]
    _expect("state", state, (batch, n_heads, d_head, d_v), f"({batch}, {n_heads}, {d_head}, {d_v})")
    new_state = g_t[..., None, None] * state + k_t[..., :, None] * v_t[..., None, :]  # (batch, n_heads, d_head, d_v)
    o_t = (q_t[..., None, :] @ new_state)[..., 0, :]  # (batch, n_heads, d_v)
    return o_t, new_state


def gated_linear_attention_recurrent(
    q: Float[Tensor, "batch n_heads pos d_head"],
    k: Float[Tensor, "batch n_heads pos d_head"],
    v: Float[Tensor, "batch n_heads pos d_v"],
    g: Float[Tensor, "batch n_heads pos"],
    state: Float[Tensor, "batch n_heads d_head d_v"] | None = None,
    *,
    step: Callable[..., tuple[Tensor, Tensor]] = gated_linear_attention_step,
) -> tuple[Float[Tensor, "batch n_heads pos d_v"], Float[Tensor, "batch n_heads d_head d_v"]]:
    """Gated linear attention one position at a time (``gated_linear_attention_step`` in a loop).

    ``state`` is the state before the first position (zeros if None). Returns (out, final state).
    ``step`` replaces ``gated_linear_attention_step`` (same arguments and result): notebook 19 runs a learner's.

    >>> q = k = torch.ones(1, 1, 3, 1); v = torch.ones(1, 1, 3, 1); g = torch.full((1, 1, 3), 0.5)
    >>> gated_linear_attention_recurrent(q, k, v, g)[0].flatten()  # 1, 0.5 + 1, 0.75 + 1
    tensor([1.0000, 1.5000, 1.7500])
    """
    _, _, pos, _, d_v = _check_qkvg(q, k, v, g)
    S = _initial_state(state, q, d_v)
    outs = []
    for t in range(pos):
        o_t, S = step(S, q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t])
        outs.append(o_t)
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)  # (batch, n_heads, pos, d_v)
    return out, S


def _decay_mask(log_g: Tensor) -> Tensor:
    """D[t, s] = g_{s+1} ... g_t = exp(b_t - b_s) for s <= t, else 0, where b = cumsum(log g).

    Built from differences of cumulative log-gates rather than products of gates, so nothing
    overflows; the upper triangle (b_t - b_s >= 0 there, possibly large) is set to -inf before the exp.
    """
    b = log_g.cumsum(dim=-1)  # (..., pos)
    diff = b[..., :, None] - b[..., None, :]  # (..., pos, pos): b_t - b_s
    causal = torch.ones(diff.shape[-2:], dtype=torch.bool, device=diff.device).tril()
    return diff.masked_fill(~causal, -math.inf).exp()


def gated_linear_attention_quadratic(
    q: Float[Tensor, "batch n_heads pos d_head"],
    k: Float[Tensor, "batch n_heads pos d_head"],
    v: Float[Tensor, "batch n_heads pos d_v"],
    g: Float[Tensor, "batch n_heads pos"],
) -> Float[Tensor, "batch n_heads pos d_v"]:
    """Gated linear attention as one (pos, pos) matrix: out = ((Q K^T) * D) V, D the decay mask.

    D[t, s] = g_{s+1} ... g_t for s <= t and 0 above the diagonal: the causal mask with a decay
    (RetNet's "parallel representation", Sun et al. 2023, eq. 5). O(pos^2) time and memory; the
    oracle the recurrent and chunked forms are tested against. Starts from a zero state.

    >>> q = k = v = torch.ones(1, 1, 3, 1); g = torch.full((1, 1, 3), 0.5)
    >>> gated_linear_attention_quadratic(q, k, v, g).flatten()
    tensor([1.0000, 1.5000, 1.7500])
    """
    _check_qkvg(q, k, v, g)
    scores = q @ k.transpose(-2, -1)  # (batch, n_heads, query_pos, key_pos)
    return (scores * _decay_mask(g.log())) @ v


def gated_linear_attention_chunked(
    q: Float[Tensor, "batch n_heads pos d_head"],
    k: Float[Tensor, "batch n_heads pos d_head"],
    v: Float[Tensor, "batch n_heads pos d_v"],
    g: Float[Tensor, "batch n_heads pos"],
    chunk: int = 64,
    state: Float[Tensor, "batch n_heads d_head d_v"] | None = None,
) -> tuple[Float[Tensor, "batch n_heads pos d_v"], Float[Tensor, "batch n_heads d_head d_v"]]:
    """Gated linear attention chunk by chunk: quadratic inside a chunk, the state carried across.

    With b_t = sum of log g over the chunk up to t (and S_0 the state entering the chunk):
      o_t = exp(b_t) q_t S_0 + sum_{s <= t in chunk} exp(b_t - b_s) (q_t . k_s) v_s,
      S_end = exp(b_last) S_0 + sum_s exp(b_last - b_s) k_s^T v_s.
    The first term reads the earlier chunks through the state; the second is
    ``gated_linear_attention_quadratic`` on the chunk. Cost O(pos chunk d + pos d_head d_v): matrix
    products, as a GPU likes, and only pos / chunk sequential steps (the training form of RetNet's
    "chunkwise recurrent representation", Sun et al. 2023, eq. 7; Yang et al. 2024, sec. 3).
    Equal to ``gated_linear_attention_recurrent`` up to rounding; returns (out, final state).

    >>> g0 = torch.Generator().manual_seed(0)
    >>> q, k, v = torch.randn(3, 1, 2, 10, 4, generator=g0, dtype=torch.float64)
    >>> g = torch.rand(1, 2, 10, generator=g0, dtype=torch.float64) * 0.5 + 0.5
    >>> a, _ = gated_linear_attention_chunked(q, k, v, g, chunk=4)
    >>> b, _ = gated_linear_attention_recurrent(q, k, v, g)
    >>> torch.allclose(a, b)
    True
    """
    _, _, pos, _, d_v = _check_qkvg(q, k, v, g)
    chunk = _check_chunk(chunk)
    S = _initial_state(state, q, d_v)
    log_g = g.log()
    outs = []
    for c0 in range(0, pos, chunk):
        c1 = min(c0 + chunk, pos)
        q_c, k_c, v_c, lg_c = q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1], log_g[:, :, c0:c1]
        b = lg_c.cumsum(dim=-1)  # (batch, n_heads, c): log of the decay from the chunk's start to t
        inside = ((q_c @ k_c.transpose(-2, -1)) * _decay_mask(lg_c)) @ v_c  # (batch, n_heads, c, d_v)
        from_state = b.exp()[..., None] * (q_c @ S)  # (batch, n_heads, c, d_v)
        outs.append(inside + from_state)
        # Each key's outer product decays from its own step to the chunk's end: exp(b_last - b_s) <= 1.
        to_end = (b[..., -1:] - b).exp()  # (batch, n_heads, c)
        S = b[..., -1].exp()[..., None, None] * S + (k_c * to_end[..., None]).transpose(-2, -1) @ v_c
    out = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape)  # (batch, n_heads, pos, d_v)
    return out, S


# ----------------------------------------------------------------------------- selective scan (Mamba S6)


def _check_scan_inputs(x: object, delta: object, A: object, B: object, C: object, D: object) -> None:
    x = _expect("x", x, (None, None, None), "(batch, d_inner, pos)")
    batch, d_inner, pos = x.shape
    _expect("delta", delta, (batch, d_inner, pos), f"({batch}, {d_inner}, {pos}) like x")
    A = _expect("A", A, (d_inner, None), f"({d_inner}, d_state)")
    d_state = A.shape[1]
    _expect("B", B, (batch, pos, d_state), f"({batch}, {pos}, {d_state}): (batch, pos, d_state)")
    _expect("C", C, (batch, pos, d_state), f"({batch}, {pos}, {d_state}): (batch, pos, d_state)")
    _expect("D", D, (d_inner,), f"({d_inner},)")
    _check_delta(delta)


def _check_delta(delta: Tensor) -> None:
    if not bool(((delta >= 0) & delta.isfinite()).all()):
        raise ValueError(f"delta (the step size, softplus of dt) must be finite and >= 0, got min {delta.min()}")


def _initial_h(h0: Tensor | None, x: Tensor, d_state: int) -> Tensor:
    batch, d_inner = x.shape[:2]
    if h0 is None:
        return x.new_zeros(batch, d_inner, d_state)
    return _expect("h0", h0, (batch, d_inner, d_state), f"({batch}, {d_inner}, {d_state})")


def selective_scan_step(
    h: Float[Tensor, "batch d_inner d_state"],
    x_t: Float[Tensor, "batch d_inner"],
    delta_t: Float[Tensor, "batch d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B_t: Float[Tensor, "batch d_state"],
    C_t: Float[Tensor, "batch d_state"],
    D: Float[Tensor, " d_inner"],
) -> tuple[Float[Tensor, "batch d_inner"], Float[Tensor, "batch d_inner d_state"]]:
    """One step of Mamba's selective SSM: h_t = exp(Delta_t A) h_{t-1} + Delta_t B_t x_t, y_t = C_t h_t + D x_t.

    Each of the d_inner channels runs its own d_state-dimensional linear system h' = A h + B x in
    continuous time (A diagonal, stored as a (d_inner, d_state) matrix of its diagonals, negative so
    the state decays). Discretised with step Delta (Gu & Dao 2023, eq. 4 and sec. 3.5.2):
    A_bar = exp(Delta A) (zero-order hold) and B_bar x = Delta B x (the Euler simplification of ZOH's
    (Delta A)^-1 (exp(Delta A) - 1) Delta B that Mamba's code uses). What makes it *selective*
    (Algorithm 2): Delta_t, B_t and C_t are computed from the input at step t, so the model chooses
    what to write (large Delta: forget the past, take x_t) and what to read. Returns (y_t, new h).

    >>> h = torch.zeros(1, 1, 1); A = torch.tensor([[-1.0]]); one = torch.ones(1, 1); D = torch.zeros(1)
    >>> y, h = selective_scan_step(h, one, torch.full((1, 1), 0.5), A, one, one, D)
    >>> y, h = selective_scan_step(h, one, torch.full((1, 1), 0.5), A, one, one, D)
    >>> round(y.item(), 4)  # exp(-0.5) * 0.5 + 0.5
    0.8033
    """
    x_t = _expect("x_t", x_t, (None, None), "(batch, d_inner)")
    batch, d_inner = x_t.shape
    _expect("delta_t", delta_t, (batch, d_inner), f"({batch}, {d_inner}) like x_t")
    A = _expect("A", A, (d_inner, None), f"({d_inner}, d_state)")
    d_state = A.shape[1]
    _expect("B_t", B_t, (batch, d_state), f"({batch}, {d_state})")
    _expect("C_t", C_t, (batch, d_state), f"({batch}, {d_state})")
    _expect("D", D, (d_inner,), f"({d_inner},)")
    _expect("h", h, (batch, d_inner, d_state), f"({batch}, {d_inner}, {d_state})")
    _check_delta(delta_t)
    A_bar = torch.exp(delta_t[..., None] * A)  # (batch, d_inner, d_state)
    Bx = delta_t[..., None] * B_t[:, None, :] * x_t[..., None]  # (batch, d_inner, d_state)
    h = A_bar * h + Bx
    y_t = (h * C_t[:, None, :]).sum(dim=-1) + D * x_t  # (batch, d_inner)
    return y_t, h


def selective_scan_sequential(
    x: Float[Tensor, "batch d_inner pos"],
    delta: Float[Tensor, "batch d_inner pos"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos d_state"],
    C: Float[Tensor, "batch pos d_state"],
    D: Float[Tensor, " d_inner"],
    h0: Float[Tensor, "batch d_inner d_state"] | None = None,
) -> tuple[Float[Tensor, "batch d_inner pos"], Float[Tensor, "batch d_inner d_state"]]:
    """The selective scan one position at a time (``selective_scan_step`` in a loop; Gu & Dao 2023, Alg. 2).

    Layout as in ``transformers``' Mamba: channels before positions for x and delta, (batch, pos,
    d_state) for B and C. ``delta`` is the step after the softplus. Returns (y, last state).

    >>> x = delta = torch.ones(1, 1, 2); A = torch.tensor([[-1.0]]); B = C = torch.ones(1, 2, 1)
    >>> selective_scan_sequential(x, delta, A, B, C, torch.zeros(1))[0]  # 1, then exp(-1) + 1
    tensor([[[1.0000, 1.3679]]])
    """
    _check_scan_inputs(x, delta, A, B, C, D)
    h = _initial_h(h0, x, A.shape[1])
    ys = []
    for t in range(x.shape[-1]):
        y_t, h = selective_scan_step(h, x[..., t], delta[..., t], A, B[:, t], C[:, t], D)
        ys.append(y_t)
    y = torch.stack(ys, dim=-1) if ys else x.new_zeros(x.shape)  # (batch, d_inner, pos)
    return y, h


def selective_scan_parallel(
    x: Float[Tensor, "batch d_inner pos"],
    delta: Float[Tensor, "batch d_inner pos"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch pos d_state"],
    C: Float[Tensor, "batch pos d_state"],
    D: Float[Tensor, " d_inner"],
    h0: Float[Tensor, "batch d_inner d_state"] | None = None,
) -> tuple[Float[Tensor, "batch d_inner pos"], Float[Tensor, "batch d_inner d_state"]]:
    """The selective scan as a parallel prefix scan (Hillis & Steele 1986) over (a, b) pairs.

    h_t = a_t h_{t-1} + b_t (a_t = exp(Delta_t A), b_t = Delta_t B_t x_t) composes: doing step 1 then
    step 2 is one step with (a_2 a_1, a_2 b_1 + b_2), an associative operation. So every h_t is a
    prefix "sum" under it, and a prefix scan computes them all in ceil(log2 pos) rounds of
    elementwise work over all positions at once (round r combines each position with the one 2^r
    back), instead of pos sequential steps: what Mamba's kernel does on a GPU (Gu & Dao 2023,
    sec. 3.3.2; they use Blelloch's work-efficient variant). Keeps every h_t: O(pos d_inner d_state)
    memory, which the fused kernel avoids. Equal to ``selective_scan_sequential`` up to rounding.

    >>> g0 = torch.Generator().manual_seed(0)
    >>> x, delta = torch.randn(2, 3, 7, generator=g0), torch.rand(2, 3, 7, generator=g0)
    >>> A, B, C = -torch.rand(3, 4, generator=g0), torch.randn(2, 7, 4, generator=g0), torch.randn(2, 7, 4, generator=g0)
    >>> D = torch.randn(3, generator=g0)
    >>> torch.allclose(selective_scan_parallel(x, delta, A, B, C, D)[0],
    ...                selective_scan_sequential(x, delta, A, B, C, D)[0], atol=1e-6)
    True
    """
    _check_scan_inputs(x, delta, A, B, C, D)
    h = _initial_h(h0, x, A.shape[1])
    pos = x.shape[-1]
    a = torch.exp(delta[..., None] * A[:, None, :])  # (batch, d_inner, pos, d_state)
    b = delta[..., None] * B[:, None, :, :] * x[..., None]  # (batch, d_inner, pos, d_state)
    if pos:
        b = torch.cat([a[:, :, :1] * h[:, :, None] + b[:, :, :1], b[:, :, 1:]], dim=2)  # h0 enters step 0
    shift = 1
    while shift < pos:
        # (a, b)_t <- (a, b)_{t-shift} then (a, b)_t; positions < shift already hold their full prefix.
        b = torch.cat([b[:, :, :shift], a[:, :, shift:] * b[:, :, :-shift] + b[:, :, shift:]], dim=2)
        a = torch.cat([a[:, :, :shift], a[:, :, shift:] * a[:, :, :-shift]], dim=2)
        shift *= 2
    # Now b_t is h_t, every t.
    y = (b * C[:, None, :, :]).sum(dim=-1) + D[:, None] * x  # (batch, d_inner, pos)
    return y, (b[:, :, -1] if pos else h)


# ----------------------------------------------------------------------------- the Mamba layer


@dataclass
class MambaState:
    """What ``MambaLayer.step`` carries from token to token: the same size at any context length.

    conv_state: the last d_conv - 1 inputs of the causal convolution, (batch, d_inner, d_conv - 1);
    ssm_state: the scan's h, (batch, d_inner, d_state).
    """

    conv_state: Float[Tensor, "batch d_inner d_conv_minus_1"]
    ssm_state: Float[Tensor, "batch d_inner d_state"]


class MambaLayer(nn.Module):
    """Mamba's mixer (Gu & Dao 2023, Fig. 3): a gated MLP with a causal conv and a selective scan inside.

    x, z = in_proj(u) (two halves of width d_inner); x = SiLU(depthwise causal conv1d(x));
    Delta, B, C = x_proj(x) split (dt_rank, d_state, d_state); Delta = softplus(dt_proj(Delta)) (a
    low-rank projection back to d_inner, with a bias); y = selective_scan(x, Delta, A, B, C, D),
    A = -exp(A_log); out = out_proj(y * SiLU(z)).

    Parameter names and shapes follow ``transformers``' ``MambaMixer`` (in_proj, conv1d, x_proj,
    dt_proj, A_log, D, out_proj), so its state_dict loads unchanged (``from_hf``). Computes in the
    input's dtype (the reference kernels keep the scan in float32 for half precision; not done here).

    >>> layer = MambaLayer(d_model=8, d_inner=16, d_state=4)
    >>> layer(torch.randn(2, 5, 8)).shape
    torch.Size([2, 5, 8])
    """

    def __init__(
        self,
        d_model: int,
        d_inner: int,
        d_state: int = 16,
        d_conv: int = 4,
        dt_rank: int | None = None,
        bias: bool = False,
        conv_bias: bool = True,
    ) -> None:
        super().__init__()
        dt_rank = math.ceil(d_model / 16) if dt_rank is None else dt_rank  # Mamba's default, "auto"
        sizes = {"d_model": d_model, "d_inner": d_inner, "d_state": d_state, "d_conv": d_conv, "dt_rank": dt_rank}
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        self.d_model, self.d_inner, self.d_state, self.d_conv, self.dt_rank = d_model, d_inner, d_state, d_conv, dt_rank
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=bias)
        # groups=d_inner: one kernel per channel (depthwise). Padding is done by hand, on the left only.
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, bias=conv_bias)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        # S4D-real initialisation (Gu et al. 2022): A = -(1, 2, ..., d_state) in every channel.
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(d_inner, 1))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=bias)
        # The scan ``forward`` runs when not told: equal results; on one CPU thread "sequential" is 3-5x faster
        # (the parallel scan keeps every h_t), so CPU experiments set it here for every Mamba layer of a model.
        self.scan = "parallel"
        self.reset_dt_bias()

    @torch.no_grad()
    def reset_dt_bias(self) -> None:
        """Steps Delta log-uniform in [1e-3, 1e-1] (Gu & Dao 2023, sec. 3.6): dt_proj's bias is softplus^-1 of them.

        Called by ``__init__``, and by ``tfedu.model``'s initialisation after it has zeroed every bias.
        """
        dt = torch.exp(torch.rand(self.d_inner) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    @classmethod
    def from_hf(cls, mixer: nn.Module) -> MambaLayer:
        """A copy of a ``transformers`` ``MambaMixer`` (its sizes read from its layers, its weights copied)."""
        missing = [name for name in ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj") if not hasattr(mixer, name)]
        if missing:
            raise TypeError(f"from_hf expects a transformers MambaMixer; {type(mixer).__name__} has no {', '.join(missing)}")
        layer = cls(
            d_model=mixer.in_proj.in_features,
            d_inner=mixer.conv1d.in_channels,
            d_state=mixer.A_log.shape[1],
            d_conv=mixer.conv1d.kernel_size[0],
            dt_rank=mixer.dt_proj.in_features,
            bias=mixer.in_proj.bias is not None,
            conv_bias=mixer.conv1d.bias is not None,
        )
        # Cast first, so a float64 mixer's weights arrive without a round trip through float32.
        layer = layer.to(device=mixer.A_log.device, dtype=mixer.A_log.dtype)
        layer.load_state_dict(mixer.state_dict())
        return layer

    def _ssm_inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """From the conv's output x (batch, d_inner, pos): Delta (batch, d_inner, pos), A, B, C (batch, pos, d_state)."""
        dt, B, C = self.x_proj(x.transpose(1, 2)).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(self.dt_proj(dt)).transpose(1, 2)  # (batch, d_inner, pos)
        return delta, -torch.exp(self.A_log), B, C

    def forward(
        self, u: Float[Tensor, "batch pos d_model"], scan: str | None = None, return_state: bool = False
    ) -> Float[Tensor, "batch pos d_model"] | tuple[Float[Tensor, "batch pos d_model"], MambaState]:
        """The layer over a whole sequence; ``scan`` is "parallel" or "sequential" (equal results; None: ``self.scan``).

        With ``return_state=True`` also returns the ``MambaState`` after the last position, from which
        ``step`` continues (prefill, then decode).
        """
        scan = self.scan if scan is None else scan
        if scan not in SCANS:
            raise ValueError(f"scan must be one of {SCANS}, got {scan!r}")
        u = _expect("u", u, (None, None, self.d_model), f"(batch, pos, {self.d_model})")
        x, z = self.in_proj(u).transpose(1, 2).chunk(2, dim=1)  # each (batch, d_inner, pos)
        x_in = x
        x = F.silu(self.conv1d(F.pad(x, (self.d_conv - 1, 0))))  # pad the past only: causal
        delta, A, B, C = self._ssm_inputs(x)
        run = selective_scan_parallel if scan == "parallel" else selective_scan_sequential
        y, h = run(x, delta, A, B, C, self.D)  # (batch, d_inner, pos)
        out = self.out_proj((y * F.silu(z)).transpose(1, 2))  # (batch, pos, d_model)
        if not return_state:
            return out
        past = F.pad(x_in, (self.d_conv - 1, 0))[..., x_in.shape[-1] :]  # last d_conv - 1 inputs, zeros before the start
        return out, MambaState(conv_state=past, ssm_state=h)

    def empty_state(self, batch: int) -> MambaState:
        """The state before the first token: zeros."""
        p = self.A_log
        return MambaState(
            conv_state=p.new_zeros(batch, self.d_inner, self.d_conv - 1),
            ssm_state=p.new_zeros(batch, self.d_inner, self.d_state),
        )

    def step(
        self, u_t: Float[Tensor, "batch d_model"], state: MambaState, *,
        rule: Callable[..., tuple[Tensor, Tensor]] = selective_scan_step,
    ) -> tuple[Float[Tensor, "batch d_model"], MambaState]:
        """One token in, one out, in O(d_inner (d_conv + d_state)) time and memory whatever the position.

        Equal, token by token, to ``forward`` over the whole sequence. ``rule`` replaces ``selective_scan_step``
        (same arguments and result): notebook 19 decodes with a learner's.
        """
        u_t = _expect("u_t", u_t, (None, self.d_model), f"(batch, {self.d_model})")
        batch = u_t.shape[0]
        conv_shape = (batch, self.d_inner, self.d_conv - 1)
        _expect("state.conv_state", state.conv_state, conv_shape, str(conv_shape))
        ssm_shape = (batch, self.d_inner, self.d_state)
        _expect("state.ssm_state", state.ssm_state, ssm_shape, str(ssm_shape))
        x_t, z_t = self.in_proj(u_t).chunk(2, dim=-1)  # each (batch, d_inner)
        window = torch.cat([state.conv_state, x_t[..., None]], dim=-1)  # (batch, d_inner, d_conv)
        x_t = (window * self.conv1d.weight[:, 0]).sum(dim=-1)  # the conv at one position
        if self.conv1d.bias is not None:
            x_t = x_t + self.conv1d.bias
        x_t = F.silu(x_t)
        delta, A, B, C = self._ssm_inputs(x_t[..., None])
        y_t, h = rule(state.ssm_state, x_t, delta[..., 0], A, B[:, 0], C[:, 0], self.D)
        out = self.out_proj(y_t * F.silu(z_t))  # (batch, d_model)
        return out, MambaState(conv_state=window[..., 1:], ssm_state=h)


# ----------------------------------------------------------------------------- attention-shaped layers

GATE_TEMPERATURE = 16.0  # GLA's tau (Yang et al. 2024, sec. 4.4): sigmoid(.) ** (1 / 16) starts the gates near 1
MIN_LOG_GATE = -60.0  # log g floored here, so that g never rounds to 0 (whose log, -inf, the chunked form takes)
FORMS = ("chunked", "recurrent")


def _split_heads(x: Tensor, n_heads: int) -> Tensor:
    return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)  # (batch, n_heads, pos, d_head)


class _HeadsLayer(nn.Module):
    """What the two layers below share: W_Q, W_K, W_V (n_heads heads of d_head), W_O and the hook point hook_z."""

    def __init__(self, d_model: int, n_heads: int, d_head: int | None, bias: bool, chunk: int) -> None:
        super().__init__()
        d_head = d_model // n_heads if d_head is None else d_head
        for name, size in (("d_model", d_model), ("n_heads", n_heads), ("d_head", d_head)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        self.d_model, self.n_heads, self.d_head, self.chunk = d_model, n_heads, d_head, _check_chunk(chunk)
        self.W_Q = nn.Linear(d_model, n_heads * d_head, bias=bias)
        self.W_K = nn.Linear(d_model, n_heads * d_head, bias=bias)
        self.W_V = nn.Linear(d_model, n_heads * d_head, bias=bias)
        self.W_O = nn.Linear(n_heads * d_head, d_model, bias=bias)
        # Per-head outputs (batch, pos, n_heads, d_head) before W_O, as tfedu.layers.Attention's hook_z: there is no
        # attention pattern to hook (it is never formed), but the heads' outputs exist.
        self.hook_z = nn.Identity()

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = _expect("x", x, (None, None, self.d_model), f"(batch, pos, {self.d_model})")
        return tuple(_split_heads(W(x), self.n_heads) for W in (self.W_Q, self.W_K, self.W_V))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, d_head={self.d_head}, chunk={self.chunk}"


class LinearAttentionLayer(_HeadsLayer):
    """Notebook 09's causal linear attention (Katharopoulos et al. 2020) as a layer that can replace attention.

    q, k, v = W_Q x, W_K x, W_V x split into heads; each head runs ``tfedu.flash.linear_attention(q, k, v,
    causal=True)`` (feature map elu + 1 and the normaliser phi(q) . sum phi(k), chunk by chunk); the heads are
    joined and W_O maps them back to d_model. Its state per head, sum phi(k) v^T and sum phi(k), only ever grows
    (no gate, no forgetting): the layer ``GatedLinearAttentionLayer`` and Gated DeltaNet improve on.
    x (batch, pos, d_model) -> (batch, pos, d_model); causal always.

    >>> layer = LinearAttentionLayer(d_model=16, n_heads=4)
    >>> layer(torch.randn(2, 5, 16)).shape
    torch.Size([2, 5, 16])

    Built by hand in notebooks/09_efficient_attention.ipynb (the function); a layer of notebooks/19's hybrids.
    """

    def __init__(self, d_model: int, n_heads: int, d_head: int | None = None, *, bias: bool = True, chunk: int = 64,
                 eps: float = 1e-6) -> None:
        super().__init__(d_model, n_heads, d_head, bias, chunk)
        self.eps = eps

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        q, k, v = self._qkv(x)  # each (batch, n_heads, pos, d_head)
        z = linear_attention(q, k, v, causal=True, chunk=self.chunk, eps=self.eps)  # (batch, n_heads, pos, d_head)
        z = self.hook_z(z.transpose(1, 2))  # (batch, pos, n_heads, d_head)
        return self.W_O(z.flatten(2))


class GatedLinearAttentionLayer(_HeadsLayer):
    """Gated linear attention as a layer: linear attention whose state fades by a gate computed from the input.

    For x (batch, pos, d_model), per head:
      q = W_Q x / sqrt(d_head), k = W_K x, v = W_V x (no feature map, no normaliser: GLA's and RetNet's choice);
      g_t = sigmoid(W_gate x_t + b) ** (1 / tau), tau = 16, computed as exp(logsigmoid(.) / tau);
      o = ``gated_linear_attention_chunked(q, k, v, g)`` (S_t = g_t S_{t-1} + k_t^T v_t, o_t = q_t S_t);
      out = W_O(RMSNorm(o) * SiLU(W_G x)), the norm per head over d_head, one gain shared by the heads.

    The gate is a **per-head scalar** (``W_gate`` has n_heads outputs), the form of Mamba-2 and Gated DeltaNet;
    GLA proper (Yang et al. 2024, sec. 4.4) gates each of the d_head rows of the state with a low-rank
    (d_model -> 16 -> d_head) projection, with the same sigmoid ** (1/16). The temperature keeps the initial
    gates near 1 (sigmoid(0) ** (1/16) = 0.958: a memory of about 24 steps). The output norm and gate are GLA's
    (``GroupNorm`` per head in the paper, RMSNorm in its code, flash-linear-attention) and RetNet's (Sun et al.
    2023, eq. 8: GroupNorm per head, then swish(X W_G)); here ``tfedu.delta_rule.GatedRMSNorm``, Gated
    DeltaNet's. ``form="recurrent"`` runs the step-by-step recurrence instead of the chunks (equal results).

    >>> layer = GatedLinearAttentionLayer(d_model=16, n_heads=4)
    >>> layer(torch.randn(2, 5, 16)).shape
    torch.Size([2, 5, 16])

    A layer of notebooks/19_beyond_attention.ipynb's hybrids (its recurrence built by hand there).
    """

    def __init__(self, d_model: int, n_heads: int, d_head: int | None = None, *, bias: bool = True, chunk: int = 64,
                 temperature: float = GATE_TEMPERATURE, eps: float = 1e-6) -> None:
        super().__init__(d_model, n_heads, d_head, bias, chunk)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature must be a positive number (GLA: 16), got {temperature!r}")
        self.temperature = float(temperature)
        self.W_gate = nn.Linear(d_model, n_heads, bias=True)  # one forget gate per head and step
        self.W_G = nn.Linear(d_model, n_heads * self.d_head, bias=bias)  # the output gate, SiLU(W_G x)
        self.norm = GatedRMSNorm(self.d_head, eps)

    def gates(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch n_heads pos"]:
        """g_t = sigmoid(W_gate x_t + b) ** (1 / temperature), per head, in (0, 1)."""
        log_g = F.logsigmoid(self.W_gate(x)) / self.temperature  # (batch, pos, n_heads)
        return log_g.clamp(min=MIN_LOG_GATE).exp().transpose(1, 2)

    def forward(self, x: Float[Tensor, "batch pos d_model"], form: str = "chunked", *,
                rule: Callable[..., tuple[Tensor, Tensor]] | None = None) -> Float[Tensor, "batch pos d_model"]:
        """``rule`` replaces the form's function: with "chunked" one called like ``gated_linear_attention_chunked(q,
        k, v, g, chunk)``, with "recurrent" one like ``gated_linear_attention_step`` (notebook 19 runs a learner's)."""
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        q, k, v = self._qkv(x)  # each (batch, n_heads, pos, d_head)
        q = q * self.d_head**-0.5
        g = self.gates(x)  # (batch, n_heads, pos)
        if form == "chunked":
            o, _ = (rule or gated_linear_attention_chunked)(q, k, v, g, self.chunk)
        else:
            o, _ = gated_linear_attention_recurrent(q, k, v, g, step=rule or gated_linear_attention_step)
        gate = self.W_G(x).unflatten(-1, (self.n_heads, self.d_head))  # (batch, pos, n_heads, d_head)
        z = self.hook_z(self.norm(o.transpose(1, 2), gate))  # (batch, pos, n_heads, d_head)
        return self.W_O(z.flatten(2))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, temperature={self.temperature}"
