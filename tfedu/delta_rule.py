"""The delta rule and the gated delta rule: linear attention that overwrites instead of adding.

Causal linear attention keeps a matrix state S = sum_j k_j^T v_j (d_head, d_v) and reads it with
o_t = q_t S (notebooks/09_efficient_attention.ipynb). Writing only ever *adds*: store v under a
key k, then v' under the same key, and reading k returns v + v', a blur that grows with the
length. That is why plain linear attention fails at associative recall.

The delta rule (Widrow and Hoff 1960; as a linear transformer: Schlag et al. 2021, "Linear
Transformers Are Secretly Fast Weight Programmers") first reads what the state holds under k_t,
then writes only the difference, scaled by a step size beta_t:

    S_t = S_{t-1} + beta_t k_t^T (v_t - k_t S_{t-1})  =  (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t

The gated delta rule (Yang et al. 2025, "Gated Delta Networks") also lets the state fade, by a
gate alpha_t = exp(g_t) in (0, 1] (g_t is the log-gate, <= 0):

    S_t = alpha_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,        o_t = q_t S_t

**Convention** (the one of flash-linear-attention and transformers' Qwen3-Next): vectors are rows;
the state of a head is S of shape (d_head, d_v), keys index its rows, a read is the row vector
q_t S; the output at t reads the state *after* step t's write. Queries are not scaled here: the
layer (``GatedDeltaNet``) scales them by 1/sqrt(d_head) and l2-normalises q and k itself.

- ``delta_rule_step``: one step of the recurrence.
- ``delta_rule_recurrent``: the recurrence over a whole sequence, one position at a time.
- ``delta_rule_chunked``: the same function, chunk by chunk, with the WY / UT representation
  (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence
  Length"): inside a chunk a triangular solve replaces the sequential steps; only the state
  crosses chunk boundaries.
- ``GatedDeltaNet``: the layer as Qwen3-Next builds it (projections, short causal convolution,
  gates, the gated delta rule, a gated RMSNorm), with transformers' parameter names, and a
  constant-memory decoding ``step``.

The gated delta rule's step is built by hand in notebooks/19_beyond_attention.ipynb (exercise 19.4, with the gate given
as the decay exp(g) rather than g).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

BETA_RANGE = (0.0, 2.0)  # with unit keys, I - beta k^T k has eigenvalue 1 - beta along k: |1 - beta| <= 1
L2NORM_EPS = 1e-6  # inside the square root, as flash-linear-attention (and so transformers) has it


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32, float16 and bfloat16 run the recurrence in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__


def _check_inputs(q, k, v, beta, g, state, *, per_step: bool) -> None:
    """Shapes, dtypes and ranges of the delta rule's inputs, each error naming the shape it expected."""
    axes = "batch, n_heads" if per_step else "batch, n_heads, pos"
    dims = 3 if per_step else 4
    for name, x, last in (("q", q, "d_head"), ("k", k, "d_head"), ("v", v, "d_v")):
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() != dims:
            raise ValueError(f"{name} should be a floating-point tensor of shape ({axes}, {last}), got {_describe(x)}")
    if k.shape != q.shape:
        raise ValueError(f"k should have q's shape {tuple(q.shape)} ({axes}, d_head), got {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v should have shape {(*q.shape[:-1], 'd_v')} ({axes}, d_v), got {tuple(v.shape)}")
    lead = tuple(q.shape[:-1])
    for name, x in (("beta", beta), ("g", g)):
        if x is None and name == "g":
            continue
        if not isinstance(x, Tensor) or not x.is_floating_point() or tuple(x.shape) != lead:
            raise ValueError(f"{name} should be a floating-point tensor of shape {lead} ({axes}), got {_describe(x)}")
    low, high = BETA_RANGE
    if not bool(((beta >= low) & (beta <= high)).all()):  # NaN fails the test too
        raise ValueError(
            f"beta should lie in [{low}, {high}] (the delta rule's step size; outside it the state can grow "
            f"without bound), got values from {beta.min().item():.4g} to {beta.max().item():.4g}"
        )
    if g is not None and not bool((torch.isfinite(g) & (g <= 0)).all()):
        raise ValueError(
            f"g should hold finite log-gates <= 0 (alpha = exp(g) in (0, 1]), got values up to {g.max().item():.4g}"
        )
    if state is not None:
        expected = (*q.shape[:2], q.shape[-1], v.shape[-1])
        if not isinstance(state, Tensor) or not state.is_floating_point() or tuple(state.shape) != expected:
            raise ValueError(
                f"state should be a floating-point tensor of shape {expected} (batch, n_heads, d_head, d_v), "
                f"got {_describe(state)}"
            )


def _step(S: Tensor, q_t: Tensor, k_t: Tensor, v_t: Tensor, beta_t: Tensor, g_t: Tensor | None):
    """One gated delta-rule step on tensors already checked and in the accumulation dtype."""
    if g_t is not None:
        S = g_t.exp()[..., None, None] * S  # forget first: alpha_t S_{t-1}
    v_old = einops.einsum(k_t, S, "b h dk, b h dk dv -> b h dv")  # what the state returns for k_t now
    S = S + einops.einsum(k_t, beta_t[..., None] * (v_t - v_old), "b h dk, b h dv -> b h dk dv")
    o_t = einops.einsum(q_t, S, "b h dk, b h dk dv -> b h dv")  # read after the write
    return o_t, S


def delta_rule_step(
    state: Float[Tensor, "batch n_heads d_head d_v"],
    q_t: Float[Tensor, "batch n_heads d_head"],
    k_t: Float[Tensor, "batch n_heads d_head"],
    v_t: Float[Tensor, "batch n_heads d_v"],
    beta_t: Float[Tensor, "batch n_heads"],
    g_t: Float[Tensor, "batch n_heads"] | None = None,
) -> tuple[Float[Tensor, "batch n_heads d_v"], Float[Tensor, "batch n_heads d_head d_v"]]:
    """One step of the (gated) delta rule: return (o_t, S_t).

        S' = alpha_t S_{t-1}                       (alpha_t = exp(g_t); no gate when g_t is None)
        S_t = S' + beta_t k_t^T (v_t - k_t S')    o_t = q_t S_t

    Why it *replaces*: k_t S' is the value the state now returns for key k_t. The write adds
    beta_t k_t^T (v_t - k_t S'), so afterwards, for a unit key (k_t k_t^T = 1), reading k_t gives
    k_t S' + beta_t (v_t - k_t S') = (1 - beta_t) (old value) + beta_t v_t: with beta_t = 1 the
    old value is gone and v_t stands in its place, and keys orthogonal to k_t read what they read
    before. Linear attention's write k_t^T v_t reads back as old + v_t: everything ever stored
    under similar keys piles up, which is why it fails at recall (notebook 09). Equivalently,
    S_t = (I - beta_t k_t^T k_t) S' + beta_t k_t^T v_t: one step of gradient descent with rate
    beta_t on the loss 1/2 ||k_t S - v_t||^2 (Schlag et al. 2021; Yang et al. 2025 add the gate).

    Shapes: state (batch, n_heads, d_head, d_v), rows indexed by the key; q_t, k_t (batch,
    n_heads, d_head); v_t (batch, n_heads, d_v); beta_t, g_t (batch, n_heads). beta_t must lie in
    [0, 2] and g_t <= 0. Keys should have unit length for the state to stay bounded (the layer
    l2-normalises them). Computed in float32 for half-precision input; o_t has q_t's dtype, the
    state the accumulation dtype.

    >>> k = torch.tensor([[[1.0, 0.0]]]); one = torch.ones(1, 1)
    >>> S = torch.zeros(1, 1, 2, 1)
    >>> o, S = delta_rule_step(S, k, k, torch.tensor([[[3.0]]]), one)   # store 3 under k
    >>> o, S = delta_rule_step(S, k, k, torch.tensor([[[5.0]]]), one)   # then 5 under the same k
    >>> o  # linear attention would read 3 + 5 = 8
    tensor([[[5.]]])
    """
    _check_inputs(q_t, k_t, v_t, beta_t, g_t, state, per_step=True)
    acc = _accumulation_dtype(q_t.dtype)
    g_t = None if g_t is None else g_t.to(acc)
    o_t, S = _step(state.to(acc), q_t.to(acc), k_t.to(acc), v_t.to(acc), beta_t.to(acc), g_t)
    return o_t.to(q_t.dtype), S


def delta_rule_recurrent(
    q: Float[Tensor, "batch n_heads pos d_head"],
    k: Float[Tensor, "batch n_heads pos d_head"],
    v: Float[Tensor, "batch n_heads pos d_v"],
    beta: Float[Tensor, "batch n_heads pos"],
    g: Float[Tensor, "batch n_heads pos"] | None = None,
    state: Float[Tensor, "batch n_heads d_head d_v"] | None = None,
) -> tuple[Float[Tensor, "batch n_heads pos d_v"], Float[Tensor, "batch n_heads d_head d_v"]]:
    """The (gated) delta rule over a sequence, one ``delta_rule_step`` per position: (o, final state).

    The reference form: pos sequential steps, each O(d_head d_v) per head, and a state of constant
    size. ``state`` is the state before the first position (zeros when None). The oracle that
    ``delta_rule_chunked`` is tested against; both equal transformers' Qwen3-Next
    ``torch_recurrent_gated_delta_rule`` when given its already-scaled queries.

    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = torch.randn(3, 1, 2, 5, 4, generator=g)
    >>> k = F.normalize(k, dim=-1); beta = torch.rand(1, 2, 5, generator=g)
    >>> o, S = delta_rule_recurrent(q, k, v, beta)
    >>> o.shape, S.shape
    (torch.Size([1, 2, 5, 4]), torch.Size([1, 2, 4, 4]))
    """
    _check_inputs(q, k, v, beta, g, state, per_step=False)
    out_dtype, acc = q.dtype, _accumulation_dtype(q.dtype)
    q, k, v, beta = (x.to(acc) for x in (q, k, v, beta))
    g = None if g is None else g.to(acc)
    S = q.new_zeros((*q.shape[:2], q.shape[-1], v.shape[-1])) if state is None else state.to(acc)
    out = []
    for t in range(q.shape[2]):
        o_t, S = _step(S, q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], None if g is None else g[:, :, t])
        out.append(o_t)
    o = torch.stack(out, dim=2) if out else v.new_zeros(v.shape)  # (batch, n_heads, pos, d_v)
    return o.to(out_dtype), S


def _chunked(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor | None, chunk: int, state: Tensor | None):
    """``delta_rule_chunked`` on checked inputs; returns the output in the accumulation dtype."""
    acc = _accumulation_dtype(q.dtype)
    batch, n_heads, n, d_head = q.shape
    d_v = v.shape[-1]
    q, k, v, beta = (x.to(acc) for x in (q, k, v, beta))
    g = torch.zeros_like(beta) if g is None else g.to(acc)
    S = q.new_zeros((batch, n_heads, d_head, d_v)) if state is None else state.to(acc)

    # Pad to whole chunks with steps that change nothing (k = 0, beta = 0, alpha = 1); they come
    # after every real position, so no real output sees them.
    pad = -n % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    q, k, v = (einops.rearrange(x, "b h (n c) d -> b h n c d", c=chunk) for x in (q, k, v))
    beta, g = (einops.rearrange(x, "b h (n c) -> b h n c", c=chunk) for x in (beta, g))

    # Inside a chunk, write gamma_t for the product of the gates from the chunk's start to t.
    # Unrolling S_t = alpha_t S_{t-1} + k_t^T u_t, with the "pseudo-value" u_t = beta_t (v_t - k_t alpha_t S_{t-1}):
    #   S_t = gamma_t S_0 + sum_{i<=t} (gamma_t / gamma_i) k_i^T u_i            (S_0: the state before the chunk)
    #   u_t = beta_t v_t - beta_t gamma_t k_t S_0 - sum_{i<t} beta_t (gamma_t / gamma_i) (k_t . k_i) u_i
    # so (I + A) U = diag(beta) V - diag(beta gamma) K S_0, with A = tril(diag(beta) (K K^T * Gamma), -1) and
    # Gamma[t, i] = gamma_t / gamma_i. T = (I + A)^-1 is the UT transform (Yang et al. 2024, sec. 3): solve once per
    # chunk, for all chunks at once, for the two parts that do not depend on S_0:
    #   U = T diag(beta) V  -  T diag(beta gamma) K S_0  =  W_v - W_k S_0.
    log_gamma = g.cumsum(dim=-1)  # (b, h, n, c)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # Gamma[t, i] for i <= t; above the diagonal exp of a positive number could overflow: mask before the exp.
    Gamma = (log_gamma[..., :, None] - log_gamma[..., None, :]).masked_fill(~causal, -math.inf).exp()  # (b, h, n, c, c)
    A = (beta[..., None] * (k @ k.mT) * Gamma).tril(-1)  # (b, h, n, c, c)
    I_plus_A = A + torch.eye(chunk, dtype=acc, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * log_gamma.exp())[..., None] * k], dim=-1)  # (b, h, n, c, d_v + d_k)
    W_v, W_k = torch.linalg.solve_triangular(I_plus_A, rhs, upper=False, unitriangular=True).split([d_v, d_head], -1)
    P = (q @ k.mT) * Gamma  # within-chunk "attention": o_t gets (gamma_t / gamma_i) (q_t . k_i) u_i   (b, h, n, c, c)
    q_read = log_gamma.exp()[..., None] * q  # o_t reads S_0 faded by gamma_t
    k_write = (log_gamma[..., -1:] - log_gamma).exp()[..., None] * k  # u_i enters S_C faded by gamma_C / gamma_i

    out = []
    for c in range(q.shape[2]):  # only the state crosses chunks: a scan of n / chunk steps
        U = W_v[:, :, c] - W_k[:, :, c] @ S  # (b, h, c, d_v)
        out.append(q_read[:, :, c] @ S + P[:, :, c] @ U)
        S = log_gamma[:, :, c, -1, None, None].exp() * S + k_write[:, :, c].mT @ U
    o = torch.cat(out, dim=2) if out else v.new_zeros((batch, n_heads, 0, d_v))
    return o[:, :, :n], S


def delta_rule_chunked(
    q: Float[Tensor, "batch n_heads pos d_head"],
    k: Float[Tensor, "batch n_heads pos d_head"],
    v: Float[Tensor, "batch n_heads pos d_v"],
    beta: Float[Tensor, "batch n_heads pos"],
    g: Float[Tensor, "batch n_heads pos"] | None = None,
    chunk: int = 64,
    state: Float[Tensor, "batch n_heads d_head d_v"] | None = None,
) -> tuple[Float[Tensor, "batch n_heads pos d_v"], Float[Tensor, "batch n_heads d_head d_v"]]:
    """The (gated) delta rule chunk by chunk, with the UT transform: equal to ``delta_rule_recurrent``.

    The recurrence needs pos sequential steps of small matrix-vector work. Yang et al. (2024) cut
    the sequence into chunks of ``chunk`` positions. Inside a chunk the pseudo-values
    u_t = beta_t (v_t - k_t alpha_t S_{t-1}) obey a unit lower-triangular system
    (I + tril(diag(beta) (K K^T * Gamma), -1)) U = diag(beta) V - diag(beta gamma) K S_0, where
    gamma_t is the product of the gates since the chunk's start and Gamma[t, i] = gamma_t / gamma_i
    (Gamma = 1 without gates, Yang et al. 2025 add it). Its inverse T (the UT transform, a compact
    WY representation of the product of Householder-like factors I - beta_t k_t^T k_t) is applied
    to V and K for all chunks at once by ``torch.linalg.solve_triangular``: matrix multiplies,
    no per-position loop. Then a scan over chunks carries only the state: U = W_v - W_k S_0,
    O = diag(gamma) Q S_0 + (Q K^T * Gamma) U, S_C = gamma_C S_0 + (diag(gamma_C / gamma) K)^T U.

    ``pos`` need not be a multiple of ``chunk`` (padded with steps that change nothing). Same
    shapes, ranges and convention as ``delta_rule_recurrent``; equal to transformers' Qwen3-Next
    ``torch_chunk_gated_delta_rule`` given its already-scaled queries.

    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = torch.randn(3, 1, 2, 10, 4, generator=g, dtype=torch.float64)
    >>> k = F.normalize(k, dim=-1); beta = torch.rand(1, 2, 10, generator=g, dtype=torch.float64)
    >>> gates = -torch.rand(1, 2, 10, generator=g, dtype=torch.float64)
    >>> o, S = delta_rule_chunked(q, k, v, beta, gates, chunk=4)
    >>> o_ref, S_ref = delta_rule_recurrent(q, k, v, beta, gates)
    >>> torch.allclose(o, o_ref, atol=1e-12), torch.allclose(S, S_ref, atol=1e-12)
    (True, True)
    """
    _check_inputs(q, k, v, beta, g, state, per_step=False)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk should be a positive int (positions per chunk), got {chunk!r}")
    o, S = _chunked(q, k, v, beta, g, chunk, state)
    return o.to(q.dtype), S


def l2_normalize(x: Float[Tensor, "*batch d"], eps: float = L2NORM_EPS) -> Float[Tensor, "*batch d"]:
    """x / sqrt(sum x^2 + eps) along the last axis (eps inside the root, as flash-linear-attention has it).

    >>> l2_normalize(torch.tensor([3.0, 4.0]), eps=0.0)
    tensor([0.6000, 0.8000])
    """
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x, then gated: weight * x / sqrt(mean(x^2) + eps) * SiLU(z), over the last axis.

    The output gate of Gated DeltaNet (Yang et al. 2025, fig. 1; Qwen3-Next's ``RMSNormGated``):
    the normalisation runs in float32 (float64 stays), the result has x's dtype.

    >>> norm = GatedRMSNorm(2)
    >>> x = torch.tensor([[3.0, -3.0]])  # root mean square 3: normalised to [1, -1]
    >>> open_gate, shut_gate = torch.tensor([[100.0, 100.0]]), torch.tensor([[-100.0, -100.0]])
    >>> norm(x, open_gate).detach().round(), norm(x, shut_gate).detach().abs()
    (tensor([[ 100., -100.]]), tensor([[0., 0.]]))
    """

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: Float[Tensor, "*batch d"], z: Float[Tensor, "*batch d"]) -> Float[Tensor, "*batch d"]:
        acc = _accumulation_dtype(x.dtype)
        h = x.to(acc)
        h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (self.weight * h.to(x.dtype) * F.silu(z.to(acc))).to(x.dtype)


@dataclass
class GatedDeltaNetCache:
    """What ``GatedDeltaNet`` carries from one token to the next: constant in size, whatever the length.

    conv_state: (batch, conv_dim, conv_kernel - 1), the last inputs of the short convolution;
    state: (batch, n_heads, d_head_k, d_head_v), the delta rule's state.
    """

    conv_state: Tensor
    state: Tensor


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} should be a positive int, got {value!r}")
    return value


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet layer as Qwen3-Next builds it (Yang et al. 2025), in plain PyTorch.

    For x (batch, pos, d_model):
      1. project to q, k (n_key_heads heads of d_head_k), v, z (n_heads heads of d_head_v), and
         b, a (one number per value head) with ``in_proj_qkvz`` and ``in_proj_ba``;
      2. a causal depthwise convolution of width ``conv_kernel`` over q, k, v, then SiLU;
      3. q, k l2-normalised, q scaled by 1/sqrt(d_head_k); each key head serves n_heads /
         n_key_heads consecutive value heads (grouped, like grouped-query attention);
      4. beta = sigmoid(b) in (0, 1); log-gate g = -exp(A_log) * softplus(a + dt_bias) < 0
         (Mamba's discretisation: A < 0 times a positive step, Gu and Dao 2023);
      5. the gated delta rule (``delta_rule_chunked``), 6. ``GatedRMSNorm`` with z as the gate,
         7. ``out_proj`` back to d_model.

    Parameter names and shapes are transformers' ``Qwen3NextGatedDeltaNet``'s, so its state_dict
    loads unchanged (``from_hf``). Its fused ``in_proj_qkvz`` rows are grouped by key head: for
    each key head its q (d_head_k), k (d_head_k), then the v and z of the value heads it serves;
    ``in_proj_ba`` likewise (b's, then a's, per key head). ``step`` decodes one token from a
    ``GatedDeltaNetCache`` in constant memory; ``prefill`` runs a prompt and returns the cache.

    >>> torch.manual_seed(0) and None
    >>> layer = GatedDeltaNet(d_model=16, n_heads=4, d_head_k=8, d_head_v=6, n_key_heads=2)
    >>> layer(torch.randn(2, 10, 16)).shape
    torch.Size([2, 10, 16])
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_head_k: int,
        d_head_v: int,
        n_key_heads: int | None = None,
        conv_kernel: int = 4,
        eps: float = 1e-6,
        chunk: int = 64,
    ) -> None:
        super().__init__()
        n_key_heads = n_heads if n_key_heads is None else n_key_heads
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("d_head_k", d_head_k),
                            ("d_head_v", d_head_v), ("n_key_heads", n_key_heads), ("conv_kernel", conv_kernel),
                            ("chunk", chunk)):  # fmt: skip
            _positive_int(name, value)
        if n_heads % n_key_heads:
            raise ValueError(f"n_heads ({n_heads}) should be a multiple of n_key_heads ({n_key_heads})")
        self.d_model, self.n_heads, self.n_key_heads = d_model, n_heads, n_key_heads
        self.d_head_k, self.d_head_v, self.conv_kernel, self.chunk = d_head_k, d_head_v, conv_kernel, chunk
        self.key_dim, self.value_dim = n_key_heads * d_head_k, n_heads * d_head_v
        self.conv_dim = 2 * self.key_dim + self.value_dim  # q, k and v go through the convolution; z does not

        self.in_proj_qkvz = nn.Linear(d_model, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(d_model, 2 * n_heads, bias=False)
        # Left padding is done by hand (from the cache's conv_state), so the module's own padding stays 0.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        # Mamba's initialisation: decay rates A in [1, 16], steps dt log-uniform in [1e-3, 1e-1] through
        # softplus(dt_bias) = dt (Gu and Dao 2023), so the gates start near 1 and fade slowly.
        self.A_log = nn.Parameter(torch.empty(n_heads).uniform_(1, 16).log())
        dt = torch.empty(n_heads).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus
        self.norm = GatedRMSNorm(d_head_v, eps)
        self.out_proj = nn.Linear(self.value_dim, d_model, bias=False)

    @classmethod
    def from_hf(cls, module: nn.Module, chunk: int = 64) -> GatedDeltaNet:
        """A copy of transformers' ``Qwen3NextGatedDeltaNet`` (its sizes read off, its weights loaded)."""
        if getattr(module, "activation", "silu") != "silu":
            raise ValueError(f"only SiLU after the convolution is built here, got {module.activation!r}")
        layer = cls(module.hidden_size, module.num_v_heads, module.head_k_dim, module.head_v_dim,
                    n_key_heads=module.num_k_heads, conv_kernel=module.conv_kernel_size,
                    eps=module.layer_norm_epsilon, chunk=chunk)  # fmt: skip
        layer.load_state_dict(module.state_dict())
        return layer.to(next(module.parameters()).dtype)

    def empty_cache(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None):
        """The cache before the first token: zeros (the convolution's left padding; an empty memory)."""
        dtype = dtype or self.out_proj.weight.dtype
        return GatedDeltaNetCache(
            conv_state=torch.zeros(batch, self.conv_dim, self.conv_kernel - 1, device=device, dtype=dtype),
            state=torch.zeros(batch, self.n_heads, self.d_head_k, self.d_head_v, device=device,
                              dtype=_accumulation_dtype(dtype)),
        )  # fmt: skip

    def _mix(self, x: Tensor, conv_state: Tensor):
        """Steps 1-4 of the class docstring for x (batch, pos, d_model): q, k, v, z, beta, g and the new conv_state."""
        per_key_head = self.n_heads // self.n_key_heads
        qkvz = einops.rearrange(self.in_proj_qkvz(x), "b p (kh f) -> b p kh f", kh=self.n_key_heads)
        q, k, v, z = qkvz.split([self.d_head_k, self.d_head_k, per_key_head * self.d_head_v,
                                 per_key_head * self.d_head_v], dim=-1)  # fmt: skip
        ba = einops.rearrange(self.in_proj_ba(x), "b p (kh f) -> b p kh f", kh=self.n_key_heads)
        b, a = (einops.rearrange(t, "b p kh g -> b (kh g) p") for t in ba.split([per_key_head, per_key_head], -1))
        z = einops.rearrange(z, "b p kh (g dv) -> b p (kh g) dv", dv=self.d_head_v)

        mixed = torch.cat([einops.rearrange(t, "b p kh f -> b (kh f) p") for t in (q, k, v)], dim=1)  # (b, conv_dim, p)
        padded = torch.cat([conv_state.to(mixed.dtype), mixed], dim=-1)  # the past inputs, then these
        new_conv_state = padded[..., padded.shape[-1] - (self.conv_kernel - 1) :]
        mixed = F.silu(F.conv1d(padded, self.conv1d.weight, groups=self.conv_dim))  # causal: window ends at t
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=1)
        q, k = (einops.rearrange(t, "b (kh dk) p -> b kh p dk", dk=self.d_head_k) for t in (q, k))
        v = einops.rearrange(v, "b (h dv) p -> b h p dv", dv=self.d_head_v)

        q = l2_normalize(q) * self.d_head_k**-0.5
        k = l2_normalize(k)
        q, k = (t.repeat_interleave(per_key_head, dim=1) for t in (q, k))  # key head j: value heads j*g .. j*g+g-1
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp()[:, None] * F.softplus(a.float() + self.dt_bias[:, None])  # (b, h, p), float32
        return q, k, v, z, beta, g, new_conv_state

    def _out(self, o: Tensor, z: Tensor) -> Tensor:
        o = einops.rearrange(o.to(z.dtype), "b h p dv -> b p h dv")
        return self.out_proj(einops.rearrange(self.norm(o, z), "b p h dv -> b p (h dv)"))

    def prefill(
        self, x: Float[Tensor, "batch pos d_model"], cache: GatedDeltaNetCache | None = None
    ) -> tuple[Float[Tensor, "batch pos d_model"], GatedDeltaNetCache]:
        """Run a whole prompt (chunked form) from ``cache`` (empty when None); return the output and the new cache."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x should have shape (batch, pos, {self.d_model}), got {_describe(x)}")
        cache = cache or self.empty_cache(x.shape[0], x.device, x.dtype)
        q, k, v, z, beta, g, conv_state = self._mix(x, cache.conv_state)
        o, state = _chunked(q, k, v, beta, g, self.chunk, cache.state)
        return self._out(o, z), GatedDeltaNetCache(conv_state, state)

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        return self.prefill(x)[0]

    def step(
        self, x_t: Float[Tensor, "batch d_model"], cache: GatedDeltaNetCache, *, rule: Callable | None = None,
    ) -> tuple[Float[Tensor, "batch d_model"], GatedDeltaNetCache]:
        """Decode one token: the recurrent form (``delta_rule_step``'s update), O(1) time and memory in the length.

        ``rule(state, q_t, k_t, v_t, beta_t, decay_t) -> (o_t, state)`` replaces the update, with the gate given as
        the decay alpha_t = exp(g_t) in (0, 1] (notebook 19's exercise takes it so).
        """
        if not isinstance(x_t, Tensor) or x_t.dim() != 2 or x_t.shape[-1] != self.d_model:
            raise ValueError(f"x_t should have shape (batch, {self.d_model}), got {_describe(x_t)}")
        q, k, v, z, beta, g, conv_state = self._mix(x_t[:, None], cache.conv_state)
        acc = cache.state.dtype
        q_t, k_t, v_t, beta_t, g_t = (t[:, :, 0].to(acc) for t in (q, k, v, beta, g))
        if rule is None:
            o_t, state = _step(cache.state, q_t, k_t, v_t, beta_t, g_t)
        else:
            o_t, state = rule(cache.state, q_t, k_t, v_t, beta_t, g_t.exp())
        return self._out(o_t[:, :, None], z)[:, 0], GatedDeltaNetCache(conv_state, state)
