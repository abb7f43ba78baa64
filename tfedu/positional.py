"""Positional encodings: giving order back to attention, which on its own cannot see it.

- ``binary_positions``: position t written in binary, one bit per dimension (the naive code).
- ``frequencies`` / ``sinusoidal``: the fixed sine/cosine table of Vaswani et al. (2017, sec. 3.5),
  sin on even and cos on odd dimensions, frequencies falling from 1 to 1/base along the vector.
- ``rotation_matrix``: the block-diagonal M(k) with ``sinusoidal(...)[t + k] == M(k) @ sinusoidal(...)[t]``.
- ``LearnedPositions``: a trained table with one row per position (GPT-2), and nothing past its end.
- ``alibi_slopes`` / ``alibi_bias``: Attention with Linear Biases (Press et al. 2022, "Train Short,
  Test Long", arXiv:2108.12409): no position vectors at all, a penalty ``-m_h * distance`` added to
  each head's attention scores.
- ``rope_angles`` / ``apply_rope``: Rotary Position Embedding (Su et al. 2021, RoFormer,
  arXiv:2104.09864, eq. 34): rotate each pair of query and key dimensions by ``position * theta_i``,
  so that ``<f(q, m), f(k, n)>`` depends only on ``m - n``. Both pair layouts found in checkpoints:
  ``"interleaved"`` (the paper's pairs (0, 1), (2, 3), ...) and ``"half"`` (GPT-NeoX and Hugging
  Face Llama's ``rotate_half``: pairs (i, i + d_head / 2)); ``half_layout_permutation`` maps one
  onto the other.

Everything takes ``device`` and ``dtype`` (or follows its input's) and computes angles in float64
before rounding, so a float32 table is the float64 table rounded once.

Built by hand in notebooks/06_positional_encoding.ipynb.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

Layout = Literal["interleaved", "half"]
LAYOUTS = ("interleaved", "half")


# ----------------------------------------------------------------------------- argument checks


def _expect_int(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _expect_even(name: str, value: object) -> None:
    _expect_int(name, value, 2)
    if value % 2:  # type: ignore[operator]
        raise ValueError(
            f"{name} must be even: dimensions come in (sin, cos) or rotation pairs, one pair per frequency; "
            f"got {name}={value}"
        )


def _expect_base(base: object) -> None:
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1:
        raise ValueError(
            f"base must be a finite number > 1 (the paper uses 10000.0): the frequencies are base ** (-2i / d), "
            f"which must fall from 1 towards 0 along the vector; got base={base!r}"
        )


# ----------------------------------------------------------------------------- binary codes


def binary_positions(
    n_positions: int, n_bits: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> Float[Tensor, "pos n_bits"]:
    """Row t is t written in binary with ``n_bits`` bits, most significant bit first.

    The last column flips at every step, the one before it every 2 steps, then every 4, ...:
    the same "fast to slow" ladder as the sinusoids, but in jumps of 0 and 1.

    >>> binary_positions(4, 3).int()
    tensor([[0, 0, 0],
            [0, 0, 1],
            [0, 1, 0],
            [0, 1, 1]], dtype=torch.int32)
    """
    _expect_int("n_positions", n_positions, 0)
    _expect_int("n_bits", n_bits, 1)
    if n_positions > 2**n_bits:
        raise ValueError(
            f"{n_bits} bits give only 2**{n_bits} = {2**n_bits} distinct codes, fewer than n_positions={n_positions}"
        )
    positions = torch.arange(n_positions, device=device)  # (pos,)
    # int64 holds place values up to 2^62 only (2^63 wraps to a negative number, 2^64 to 0), and
    # every position fits in 63 bits, so any bits above those are leading zeros.
    low = min(n_bits, 63)
    place = 2 ** torch.arange(low - 1, -1, -1, device=device)  # (low,): 2^(low-1) ... 2, 1
    bits = (positions[:, None] // place) % 2  # (pos, low)
    leading = torch.zeros(n_positions, n_bits - low, dtype=bits.dtype, device=device)  # (pos, n_bits - low)
    return torch.cat([leading, bits], dim=-1).to(dtype)  # (pos, n_bits)


# ----------------------------------------------------------------------------- sinusoids


def frequencies(
    d: int, base: float = 10000.0, *, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> Float[Tensor, " half_d"]:
    """The angular frequencies ``omega_i = base ** (-2i / d)`` for i = 0 .. d/2 - 1, in radians per position.

    omega_0 = 1 (a period of 2 pi positions); the last is just above 1 / base. They *decrease*
    along the vector.

    >>> frequencies(4)
    tensor([1.0000, 0.0100], dtype=torch.float64)
    """
    _expect_even("d", d)
    _expect_base(base)
    i = torch.arange(d // 2, dtype=torch.float64, device=device)  # (half_d,)
    return (float(base) ** (-2 * i / d)).to(dtype)


def sinusoidal(
    n_positions: int,
    d_model: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Float[Tensor, "pos d_model"]:
    """The fixed positional table of "Attention Is All You Need" (sec. 3.5).

    ``P[t, 2i] = sin(t * omega_i)`` and ``P[t, 2i + 1] = cos(t * omega_i)`` with
    ``omega_i = base ** (-2i / d_model)``; positions count from 0, so row 0 is (0, 1, 0, 1, ...).

    >>> sinusoidal(2, 4)
    tensor([[0.0000, 1.0000, 0.0000, 1.0000],
            [0.8415, 0.5403, 0.0100, 0.9999]])
    """
    _expect_int("n_positions", n_positions, 0)
    _expect_even("d_model", d_model)
    angles = torch.arange(n_positions, dtype=torch.float64, device=device)[:, None] * frequencies(
        d_model, base, device=device
    )  # (pos, d_model / 2)
    table = torch.stack([angles.sin(), angles.cos()], dim=-1)  # (pos, d_model / 2, 2): the (sin, cos) pairs
    return table.reshape(n_positions, d_model).to(dtype)


def rotation_matrix(
    k: int | float,
    d_model: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Float[Tensor, "d_model d_model"]:
    """The block-diagonal M(k) that moves every sinusoidal position k steps on: ``P[t + k] = M(k) @ P[t]``.

    One 2x2 block per frequency, acting on the pair (sin(t w), cos(t w)):
    ``[[cos(k w), sin(k w)], [-sin(k w), cos(k w)]]`` (the angle-sum identities). M(k) does not
    depend on t: the encoding of "k steps later" is the same linear map everywhere.

    >>> P = sinusoidal(10, 4, dtype=torch.float64); M = rotation_matrix(3, 4, dtype=torch.float64)
    >>> torch.allclose(M @ P[2], P[5])
    True
    """
    _expect_even("d_model", d_model)
    angles = float(k) * frequencies(d_model, base, device=device)  # (d_model / 2,)
    cos, sin = angles.cos(), angles.sin()
    blocks = torch.stack([torch.stack([cos, sin], -1), torch.stack([-sin, cos], -1)], -2)  # (d_model / 2, 2, 2)
    return torch.block_diag(*blocks).to(dtype)


# ----------------------------------------------------------------------------- learned table


class LearnedPositions(nn.Module):
    """A trainable table ``W_pos`` of shape ``(n_ctx, d_model)``: row t is added to the token at position t.

    GPT-2 and BERT do this. Initialised like GPT-2 (normal, std 0.02). The table has exactly
    ``n_ctx`` rows, so a position >= n_ctx has no vector at all: the model cannot run on longer
    inputs, which is the hard length limit of learned absolute positions.

    >>> pos = LearnedPositions(n_ctx=8, d_model=4)
    >>> pos(torch.arange(3)).shape
    torch.Size([3, 4])
    """

    def __init__(self, n_ctx: int, d_model: int, *, init_std: float = 0.02) -> None:
        super().__init__()
        _expect_int("n_ctx", n_ctx, 1)
        _expect_int("d_model", d_model, 1)
        self.n_ctx, self.d_model = n_ctx, d_model
        self.W_pos = nn.Parameter(torch.randn(n_ctx, d_model) * init_std)

    def forward(self, positions: Int[Tensor, "*batch pos"]) -> Float[Tensor, "*batch pos d_model"]:
        if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
            got = positions.dtype if isinstance(positions, Tensor) else type(positions).__name__
            raise TypeError(f"positions must be an integer tensor of shape (..., pos), got {got}")
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.n_ctx):
            raise IndexError(
                f"a learned position table has n_ctx={self.n_ctx} rows (positions 0..{self.n_ctx - 1}); "
                f"got positions {int(positions.min())}..{int(positions.max())}. Nothing was trained for "
                f"later positions, so this model cannot read sequences longer than {self.n_ctx}"
            )
        return self.W_pos[positions]


# ----------------------------------------------------------------------------- ALiBi


def alibi_slopes(
    n_heads: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> Float[Tensor, " n_heads"]:
    """The per-head slopes m_h of ALiBi (Press et al. 2022, sec. 3).

    For a power of two n, the geometric sequence that starts at ``2 ** (-8 / n)`` with that same
    ratio: for 8 heads 1/2, 1/4, ..., 1/256. For other n (the paper's footnote and its code), the
    slopes of the nearest power of two below n, then every other slope of twice that power for
    the remaining heads.

    >>> alibi_slopes(4)
    tensor([0.2500, 0.0625, 0.0156, 0.0039])
    >>> alibi_slopes(3).tolist() == [2 ** -4, 2 ** -8, 2 ** -2]
    True
    """
    _expect_int("n_heads", n_heads, 1)

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    below = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(below) + geometric(2 * below)[0::2][: n_heads - below]
    return torch.tensor(slopes, dtype=torch.float64, device=device).to(dtype)


def alibi_bias(
    n_heads: int,
    n_query: int,
    n_key: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Float[Tensor, "n_heads query_pos key_pos"]:
    """The additive ALiBi bias ``-m_h * |i - j|``, aligned to the end like ``tfedu.attention.causal_mask``.

    Add it to the scores ``q k^T / sqrt(d_head)`` before the softmax. Query i sits at absolute
    position ``i + n_key - n_query`` (the last query is the newest token, as with a KV cache), key j
    at position j. Keys after the query are hidden by the causal mask in a decoder; they get the
    symmetric penalty too, so the bias also makes sense without a mask.

    >>> alibi_bias(1, 2, 3) / alibi_slopes(1)  # minus the distance; query 0 sits at position 1
    tensor([[[-1.,  0., -1.],
             [-2., -1.,  0.]]])
    """
    _expect_int("n_heads", n_heads, 1)
    _expect_int("n_query", n_query, 0)
    _expect_int("n_key", n_key, 0)
    query_at = torch.arange(n_query, dtype=torch.float64, device=device) + (n_key - n_query)  # (query_pos,)
    key_at = torch.arange(n_key, dtype=torch.float64, device=device)  # (key_pos,)
    distance = (query_at[:, None] - key_at[None, :]).abs()  # (query_pos, key_pos)
    slopes = alibi_slopes(n_heads, dtype=torch.float64, device=device)  # (n_heads,)
    # (+ 0.0 turns the -0.0 on the diagonal into 0.0, which prints and compares more plainly)
    return (-slopes[:, None, None] * distance + 0.0).to(dtype)  # (n_heads, query_pos, key_pos)


# ----------------------------------------------------------------------------- RoPE


def rope_angles(
    positions: Int[Tensor, "*batch pos"] | Float[Tensor, "*batch pos"],
    d_head: int,
    base: float = 10000.0,
) -> Float[Tensor, "*batch pos half_d_head"]:
    """The rotation angle of each dimension pair at each position: ``positions[..., None] * theta``.

    ``theta_i = base ** (-2i / d_head)`` for i = 0 .. d_head/2 - 1 (RoFormer eq. 15), the sinusoids'
    frequencies. Returned in float64, since angles reach ``n_ctx`` radians and float32 keeps only
    about 7 digits of them.

    >>> rope_angles(torch.tensor([0, 1, 2]), 4)
    tensor([[0.0000, 0.0000],
            [1.0000, 0.0100],
            [2.0000, 0.0200]], dtype=torch.float64)
    """
    if not isinstance(positions, Tensor) or positions.dtype == torch.bool or positions.is_complex():
        got = positions.dtype if isinstance(positions, Tensor) else type(positions).__name__
        raise TypeError(f"positions must be a real tensor of shape (..., pos) (integers, usually), got {got}")
    _expect_even("d_head", d_head)
    theta = frequencies(d_head, base, device=positions.device)  # (d_head / 2,)
    return positions.to(torch.float64)[..., None] * theta  # (..., pos, d_head / 2)


def half_layout_permutation(d_head: int) -> Int[Tensor, " d_head"]:
    """The dimension order that turns an interleaved-pair vector into a half-split one.

    ``x[..., perm]`` puts the first members of the pairs (0, 2, 4, ...) in the first half and the
    second members (1, 3, 5, ...) in the second, so for every x:
    ``apply_rope(x[..., perm], p, layout="half") == apply_rope(x, p, layout="interleaved")[..., perm]``.
    (This is how Llama checkpoints are converted to Hugging Face's layout: the rows of W_Q and
    W_K are permuted once.)

    >>> half_layout_permutation(6)
    tensor([0, 2, 4, 1, 3, 5])
    """
    _expect_even("d_head", d_head)
    return torch.cat([torch.arange(0, d_head, 2), torch.arange(1, d_head, 2)])


def apply_rope(
    x: Float[Tensor, "*batch pos d_head"],
    positions: Int[Tensor, "*#batch pos"],
    *,
    base: float = 10000.0,
    layout: Layout = "interleaved",
) -> Float[Tensor, "*batch pos d_head"]:
    """Rotate each pair of dimensions of x at position m by the angle ``m * theta_i`` (RoFormer eq. 34).

    Apply it to queries and keys (never to values): then the score between a query at m and a key
    at n is ``<R(m) q, R(n) k> = <q, R(n - m) k>``, a function of the offset alone.

    ``positions`` holds one position per row of x: shape ``(pos,)`` or anything that broadcasts to
    ``x.shape[:-1]`` (e.g. ``(batch, 1, pos)`` for per-sequence offsets against
    ``(batch, n_heads, pos, d_head)``). ``layout`` says which dimensions form a pair:
    ``"interleaved"`` (2i, 2i + 1), the paper's, or ``"half"`` (i, i + d_head/2), GPT-NeoX's and
    Hugging Face Llama's ``rotate_half``. The result has x's dtype; the angles' cos and sin are taken
    in float64 and rounded once.

    >>> x = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    >>> apply_rope(x, torch.tensor([0]))  # position 0: no rotation
    tensor([[1., 0., 1., 0.]])
    >>> apply_rope(x, torch.tensor([1]))  # pair 0 turns by 1 radian, pair 1 by 0.01
    tensor([[0.5403, 0.8415, 0.9999, 0.0100]])
    """
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 2:
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"x must be a floating-point tensor of shape (..., pos, d_head), got {got}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    d_head = x.shape[-1]
    if d_head % 2:
        raise ValueError(f"x's last dimension d_head={d_head} must be even: RoPE rotates dimensions in pairs")
    if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
        got = positions.dtype if isinstance(positions, Tensor) else type(positions).__name__
        raise TypeError(f"positions must be an integer tensor of shape (pos,) or broadcastable to x.shape[:-1], got {got}")
    try:
        fits = torch.broadcast_shapes(positions.shape, x.shape[:-1]) == x.shape[:-1]
    except RuntimeError:
        fits = False
    if not fits or positions.dim() == 0:
        raise ValueError(
            f"positions of shape {tuple(positions.shape)} do not match x of shape (..., pos, d_head) = {tuple(x.shape)}: "
            f"give one position per row, shape (pos,) = ({x.shape[-2]},) or a shape that broadcasts to "
            f"x.shape[:-1] = {tuple(x.shape[:-1])}"
        )
    if positions.device != x.device:
        raise ValueError(f"positions are on {positions.device} but x is on {x.device}")
    angles = rope_angles(positions, d_head, base)  # (..., pos, d_head / 2), float64
    dtype = x.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = angles.cos().to(compute), angles.sin().to(compute)
    x = x.to(compute)
    if layout == "interleaved":
        first, second = x[..., 0::2], x[..., 1::2]  # (..., pos, d_head / 2) each
    else:
        first, second = x[..., : d_head // 2], x[..., d_head // 2 :]
    # The 2-D rotation [[cos, -sin], [sin, cos]] applied to every (first, second) pair.
    rotated_first = first * cos - second * sin
    rotated_second = first * sin + second * cos
    if layout == "interleaved":
        out = torch.stack([rotated_first, rotated_second], dim=-1).flatten(-2)  # pairs back side by side
    else:
        out = torch.cat([rotated_first, rotated_second], dim=-1)
    return out.to(dtype)
