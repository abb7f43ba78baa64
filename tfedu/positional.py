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
- ``rope_frequencies`` / ``validate_rope_scaling``: RoPE scaling for contexts longer than the trained
  one, in transformers' ``rope_parameters`` format: linear position interpolation (Chen et al. 2023),
  NTK-aware (bloc97 2023) and its dynamic form, Llama 3.1's frequency-dependent scaling and YaRN
  (Peng et al. 2023). ``rope_angles`` and ``apply_rope`` take the scaled frequencies.

Everything takes ``device`` and ``dtype`` (or follows its input's) and computes angles in float64
before rounding, so a float32 table is the float64 table rounded once.

Built by hand in notebooks/06_positional_encoding.ipynb.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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
    *,
    inv_freq: Float[Tensor, " half_d_head"] | None = None,
) -> Float[Tensor, "*batch pos half_d_head"]:
    """The rotation angle of each dimension pair at each position: ``positions[..., None] * theta``.

    ``theta_i = base ** (-2i / d_head)`` for i = 0 .. d_head/2 - 1 (RoFormer eq. 15), the sinusoids'
    frequencies; ``inv_freq`` (shape ``(d_head / 2,)``, e.g. the scaled ones of ``rope_frequencies``)
    replaces them, and ``base`` is then unused. Returned in float64, since angles reach ``n_ctx``
    radians and float32 keeps only about 7 digits of them.

    >>> rope_angles(torch.tensor([0, 1, 2]), 4)
    tensor([[0.0000, 0.0000],
            [1.0000, 0.0100],
            [2.0000, 0.0200]], dtype=torch.float64)
    >>> rope_angles(torch.tensor([2]), 4, inv_freq=frequencies(4) / 2)  # linear interpolation by 2
    tensor([[1.0000, 0.0100]], dtype=torch.float64)
    """
    if not isinstance(positions, Tensor) or positions.dtype == torch.bool or positions.is_complex():
        got = positions.dtype if isinstance(positions, Tensor) else type(positions).__name__
        raise TypeError(f"positions must be a real tensor of shape (..., pos) (integers, usually), got {got}")
    _expect_even("d_head", d_head)
    if inv_freq is None:
        theta = frequencies(d_head, base, device=positions.device)  # (d_head / 2,)
    else:
        _expect_inv_freq(inv_freq, d_head)
        theta = inv_freq.to(device=positions.device, dtype=torch.float64)  # (d_head / 2,)
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
    scaling: Mapping[str, object] | None = None,
    inv_freq: Float[Tensor, " half_d_head"] | None = None,
    attention_scale: float = 1.0,
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

    RoPE scaling (longer contexts), either way, off by default:

    - ``scaling``: a dict in transformers' ``rope_parameters`` format (``{"rope_type": "yarn",
      "factor": 4.0, ...}``; see ``rope_frequencies``), which gives the frequencies and the attention
      scale. For ``"dynamic"`` the sequence length is ``positions.max() + 1``, as transformers does.
    - ``inv_freq`` (shape ``(d_head / 2,)``, replacing ``base``'s frequencies) and ``attention_scale``
      (cos and sin are multiplied by it, so the scores ``q . k`` by its square: YaRN's temperature).

    >>> x = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    >>> apply_rope(x, torch.tensor([0]))  # position 0: no rotation
    tensor([[1., 0., 1., 0.]])
    >>> apply_rope(x, torch.tensor([1]))  # pair 0 turns by 1 radian, pair 1 by 0.01
    tensor([[0.5403, 0.8415, 0.9999, 0.0100]])
    >>> apply_rope(x, torch.tensor([2]), scaling={"rope_type": "linear", "factor": 2.0})  # position 2 looks like 1
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
    if scaling is not None:
        if inv_freq is not None or attention_scale != 1.0:
            raise ValueError("give either scaling (a rope_parameters dict) or inv_freq and attention_scale, not both: "
                             "scaling computes the frequencies and the attention scale itself")
        # Dynamic NTK scales with the length read so far: the last position + 1 (transformers' seq_len).
        dynamic = isinstance(scaling, Mapping) and scaling.get("rope_type") == "dynamic"
        seq_len = int(positions.max()) + 1 if dynamic and positions.numel() else None
        inv_freq, attention_scale = rope_frequencies(d_head, base, scaling, seq_len=seq_len, device=x.device)
    _expect_attention_scale(attention_scale)
    angles = rope_angles(positions, d_head, base, inv_freq=inv_freq)  # (..., pos, d_head / 2), float64
    dtype = x.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = angles.cos(), angles.sin()
    if attention_scale != 1.0:
        # YaRN's temperature on both q and k, as transformers multiplies its cos and sin.
        cos, sin = cos * attention_scale, sin * attention_scale
    cos, sin = cos.to(compute), sin.to(compute)
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


# ----------------------------------------------------------------------------- RoPE scaling

ROPE_TYPES = ("default", "linear", "ntk", "dynamic", "llama3", "yarn")
# rope_type -> (required keys, optional keys), besides rope_type itself and the keys every type may carry.
_ROPE_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "ntk": (("factor",), ()),
    "dynamic": (("factor", "original_max_position_embeddings"), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
}
_ANY_TYPE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor")
_KEY_MEANING = {
    "factor": "how many times longer the new context is than the trained one",
    "original_max_position_embeddings": "the context length the model was trained on",
    "low_freq_factor": "wavelengths above original_max_position_embeddings / low_freq_factor are divided by factor",
    "high_freq_factor": "wavelengths below original_max_position_embeddings / high_freq_factor are kept",
}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _expect_inv_freq(inv_freq: object, d_head: int) -> None:
    if (not isinstance(inv_freq, Tensor) or not inv_freq.is_floating_point()
            or tuple(inv_freq.shape) != (d_head // 2,)):
        got = f"{inv_freq.dtype} of shape {tuple(inv_freq.shape)}" if isinstance(inv_freq, Tensor) else type(inv_freq).__name__
        raise ValueError(f"inv_freq must be a floating-point tensor of shape (d_head / 2,) = ({d_head // 2},), "
                         f"one frequency per rotated pair; got {got}")


def _expect_attention_scale(scale: object) -> None:
    if not _is_number(scale) or scale <= 0:
        raise ValueError(f"attention_scale must be a finite number > 0 (1.0: no scaling), got {scale!r}")


def validate_rope_scaling(scaling: object, *, base: float | None = None) -> None:
    """Raise a ValueError saying what is wrong with a RoPE-scaling dict; return None if it is usable.

    The format is transformers' ``rope_parameters`` (``transformers/modeling_rope_utils.py``):
    ``rope_type`` is one of ``ROPE_TYPES``, and each type needs its keys (``rope_frequencies`` says
    which). ``rope_theta`` may be there, and must then equal ``base``; ``partial_rotary_factor`` may
    only be 1. Two differences from transformers: ``"ntk"`` (static NTK-aware scaling) is tfedu's own
    type, and ``"dynamic"`` needs ``original_max_position_embeddings``, which transformers reads
    from ``config.max_position_embeddings`` instead. Unknown keys are refused (a typo would
    otherwise be ignored).

    >>> validate_rope_scaling({"rope_type": "linear", "factor": 4.0})
    >>> validate_rope_scaling({"rope_type": "linear"})
    Traceback (most recent call last):
    ...
    ValueError: rope_scaling of rope_type 'linear' needs 'factor' (how many times longer the new context is than the trained one)
    """
    if not isinstance(scaling, Mapping):
        raise ValueError(f"rope_scaling must be a dict like {{'rope_type': 'linear', 'factor': 4.0}} or None, "
                         f"got {type(scaling).__name__}")
    if "rope_type" not in scaling:
        old = " (transformers 4.x called it 'type')" if "type" in scaling else ""
        raise ValueError(f"rope_scaling needs a 'rope_type', one of {', '.join(map(repr, ROPE_TYPES))}{old}; "
                         f"got {dict(scaling)}")
    rope_type = scaling["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unknown rope_type {rope_type!r}: tfedu implements {', '.join(map(repr, ROPE_TYPES))} "
                         "(transformers' 'longrope' and 'proportional' are not implemented)")
    required, optional = _ROPE_KEYS[rope_type]
    missing = [key for key in required if key not in scaling]
    if missing:
        needs = ", ".join(f"{key!r} ({_KEY_MEANING[key]})" for key in missing)
        hint = (" (transformers' 'dynamic' reads it from config.max_position_embeddings: put that number in the dict)"
                if rope_type == "dynamic" and "original_max_position_embeddings" in missing else "")
        raise ValueError(f"rope_scaling of rope_type {rope_type!r} needs {needs}{hint}")
    unknown = sorted(set(scaling) - set(required) - set(optional) - set(_ANY_TYPE_KEYS))
    if unknown:
        allowed = ", ".join(map(repr, (*_ANY_TYPE_KEYS, *required, *optional)))
        raise ValueError(f"rope_scaling of rope_type {rope_type!r} has unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"it takes {allowed}")
    if "rope_theta" in scaling:
        theta = scaling["rope_theta"]
        if not _is_number(theta) or theta <= 1:
            raise ValueError(f"rope_scaling's rope_theta must be a finite number > 1, got {theta!r}")
        if base is not None and float(theta) != float(base):
            raise ValueError(f"rope_scaling's rope_theta={theta} differs from the RoPE base {base}: "
                             "leave rope_theta out or make the two equal")
    if scaling.get("partial_rotary_factor", 1) != 1:
        raise ValueError(f"partial_rotary_factor={scaling['partial_rotary_factor']!r}: tfedu rotates every "
                         "dimension of the head (only 1 is supported)")
    if "factor" in scaling and (not _is_number(scaling["factor"]) or scaling["factor"] < 1):
        raise ValueError(f"rope_scaling's factor must be a finite number >= 1 ({_KEY_MEANING['factor']}), "
                         f"got {scaling['factor']!r}")
    original = scaling.get("original_max_position_embeddings", 1)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(f"rope_scaling's original_max_position_embeddings must be an int >= 1 "
                         f"({_KEY_MEANING['original_max_position_embeddings']}), got {original!r}")
    if rope_type == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        if not (_is_number(low) and _is_number(high) and 0 < low < high):
            raise ValueError(f"llama3 scaling needs numbers 0 < low_freq_factor < high_freq_factor (Llama 3.1: 1 and 4), "
                             f"got low_freq_factor={low!r}, high_freq_factor={high!r}")
    if rope_type == "yarn":
        _validate_yarn(scaling)


def _validate_yarn(scaling: Mapping[str, object]) -> None:
    for key in ("beta_fast", "beta_slow", "attention_factor"):
        value = scaling.get(key)
        if value is not None and (not _is_number(value) or value <= 0):
            raise ValueError(f"yarn scaling's {key} must be a finite number > 0 or None (the default), got {value!r}")
    for key in ("mscale", "mscale_all_dim"):
        value = scaling.get(key)
        if value is not None and not _is_number(value):
            raise ValueError(f"yarn scaling's {key} must be a finite number or None, got {value!r}")
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    if beta_fast <= beta_slow:
        raise ValueError(f"yarn scaling needs beta_fast > beta_slow (rotations in the trained context above which a "
                         f"frequency is kept, below which it is interpolated; defaults 32 and 1), got {beta_fast} "
                         f"and {beta_slow}")
    if not isinstance(scaling.get("truncate", True), bool):
        raise ValueError(f"yarn scaling's truncate must be True or False, got {scaling['truncate']!r}")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``sqrt(1 / t) = 0.1 ln(s) + 1`` (Peng et al. 2023, sec. 3.4), with DeepSeek's multiplier on ln(s)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_ramp(
    d_head: int, base: float, original_max_position_embeddings: int, *,
    beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True,
    device: torch.device | str | None = None,
) -> Float[Tensor, " half_d_head"]:
    """YaRN's "NTK-by-parts" ramp: 0 where pair i keeps its frequency, 1 where it is divided by ``factor``.

    A pair of wavelength ``lambda_i = 2 pi / theta_i`` turns ``r_i = L / lambda_i`` times in the
    trained context L. Pairs with ``r_i > beta_fast`` (32) have seen every angle many times: kept
    (extrapolated). Pairs with ``r_i < beta_slow`` (1) never completed a turn: interpolated. The
    paper (Peng et al. 2023, eq. 18) writes the ramp in r; its released code, and transformers, make
    it linear in the pair index i between the (fractional) indices where ``r = beta_fast`` and
    ``r = beta_slow``, ``i(r) = d ln(L / (2 pi r)) / (2 ln base)``, rounded outwards when
    ``truncate`` (floor and ceil). That is followed here, clamps and all.

    >>> yarn_ramp(16, 10000.0, 2048)  # pairs 0-2 turn > 32 times in 2048 positions: kept; 6 and 7 < once
    tensor([0.0000, 0.0000, 0.0000, 0.2500, 0.5000, 0.7500, 1.0000, 1.0000], dtype=torch.float64)
    """
    _expect_even("d_head", d_head)
    _expect_base(base)
    _expect_int("original_max_position_embeddings", original_max_position_embeddings, 1)
    if not (_is_number(beta_fast) and _is_number(beta_slow) and 0 < beta_slow < beta_fast):
        raise ValueError(f"yarn_ramp needs numbers 0 < beta_slow < beta_fast (defaults 1 and 32), got "
                         f"beta_slow={beta_slow!r}, beta_fast={beta_fast!r}")

    def index_of(rotations: float) -> float:  # the fractional pair index where r_i == rotations
        return d_head * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = index_of(beta_fast), index_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_head - 1)  # (d_head - 1, not d_head / 2 - 1: as the reference code)
    if low == high:
        high += 0.001  # (the reference code's guard against 0 / 0)
    i = torch.arange(d_head // 2, dtype=torch.float64, device=device)  # (d_head / 2,)
    return ((i - low) / (high - low)).clamp(0, 1)


def rope_frequencies(
    d_head: int,
    base: float = 10000.0,
    scaling: Mapping[str, object] | None = None,
    *,
    seq_len: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[Float[Tensor, " half_d_head"], float]:
    """RoPE's inverse frequencies (float64, shape ``(d_head / 2,)``) and attention scale for a scaling method.

    Why scale: pair i turns by ``m * theta_i``, with wavelength ``lambda_i = 2 pi / theta_i =
    2 pi base^(2i/d)``. Trained on L positions, the pairs whose wavelength is longer than L never
    completed a turn: past L they meet angles never seen in training, and perplexity explodes.
    Each method slows some frequencies down so that angles at the new length s*L (s = ``factor``)
    stay in the trained range, and keeps the fast ones (which tell neighbours apart) as they are.
    ``scaling`` is a dict in transformers' ``rope_parameters`` format (``validate_rope_scaling``):

    - ``None`` or ``"default"``: ``theta_i = base^(-2i/d)``, the same tensor as ``frequencies``.
    - ``"linear"`` (position interpolation, Chen et al. 2023, arXiv:2306.15595; kaiokendev's
      SuperHOT): positions m -> m / s, i.e. every ``theta_i / s``. transformers' ``"linear"``.
    - ``"ntk"`` (NTK-aware, bloc97 2023): a larger base ``base * s^(d/(d-2))``, i.e.
      ``theta_i * s^(-2i/(d-2))``: pair 0 is kept, the slowest pair divided by exactly s, the
      ones between by a geometric blend. No transformers type: it is what ``"dynamic"`` computes once
      its bracket below equals s.
    - ``"dynamic"`` (dynamic NTK, emozilla 2023): ``"ntk"`` with ``s * n / L - (s - 1)`` in place of
      s, for the length n = ``seq_len`` read so far (taken as L when shorter or None): plain RoPE up
      to L, more scaling the longer the text. transformers' ``"dynamic"``; L is
      ``original_max_position_embeddings``. With a KV cache the cached keys keep the rotation of the
      step that cached them (as in transformers), so cached decoding differs from one full pass.
    - ``"llama3"`` (Llama 3.1, Meta 2024, the released ``apply_scaling``): wavelengths shorter than
      ``L / high_freq_factor`` kept, longer than ``L / low_freq_factor`` divided by s, and between,
      ``(1 - g) theta / s + g theta`` with ``g = (L / lambda - low_freq_factor) / (high_freq_factor -
      low_freq_factor)``. Llama 3.1: s = 8, factors 1 and 4, L = 8192. transformers' ``"llama3"``.
    - ``"yarn"`` (Peng et al. 2023, arXiv:2309.00071): the same blend with ``g = 1 - yarn_ramp(...)``
      (kept above beta_fast = 32 turns in L, interpolated below beta_slow = 1), and an attention
      temperature: cos and sin (so q and k) times ``mscale = 0.1 ln(s) + 1`` (sec. 3.4; or
      ``attention_factor`` when given; DeepSeek's ``mscale / mscale_all_dim`` ratio when both are
      given). transformers' ``"yarn"``.

    The attention scale is 1.0 except for YaRN. ``seq_len`` is read by ``"dynamic"`` only. Computed in
    float64 (transformers: float32, equal within 1e-6 relative; tests/test_rope_scaling.py).

    >>> rope_frequencies(4, 10000.0)
    (tensor([1.0000, 0.0100], dtype=torch.float64), 1.0)
    >>> rope_frequencies(4, 10000.0, {"rope_type": "linear", "factor": 2.0})
    (tensor([0.5000, 0.0050], dtype=torch.float64), 1.0)
    >>> inv_freq, scale = rope_frequencies(16, 10000.0, {"rope_type": "yarn", "factor": 4.0,
    ...                                                  "original_max_position_embeddings": 64})
    >>> round(scale, 4)  # 0.1 ln 4 + 1
    1.1386
    """
    _expect_even("d_head", d_head)
    _expect_base(base)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)):
        raise ValueError(f"seq_len must be an int (the length read so far) or None, got {seq_len!r}")
    if scaling is None:
        return frequencies(d_head, base, device=device), 1.0
    validate_rope_scaling(scaling, base=base)
    if scaling["rope_type"] == "default":
        return frequencies(d_head, base, device=device), 1.0
    rope_type, factor = scaling["rope_type"], float(scaling["factor"])
    theta = frequencies(d_head, base, device=device)  # (d_head / 2,)
    if rope_type == "linear":
        return theta / factor, 1.0
    if rope_type in ("ntk", "dynamic"):
        if d_head < 4:
            raise ValueError(f"{rope_type} scaling raises the base to the power d/(d-2): it needs d_head >= 4, "
                             f"got {d_head}")
        if rope_type == "dynamic":
            trained = scaling["original_max_position_embeddings"]
            n = trained if seq_len is None else max(seq_len, trained)
            factor = factor * n / trained - (factor - 1)  # 1 up to the trained length (emozilla 2023)
        return frequencies(d_head, base * factor ** (d_head / (d_head - 2)), device=device), 1.0
    trained = scaling["original_max_position_embeddings"]
    if rope_type == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelength = 2 * math.pi / theta  # (d_head / 2,)
        kept = (trained / wavelength - low) / (high - low)  # g: 1 keeps theta, 0 divides it by factor
        kept = torch.where(wavelength < trained / high, 1.0, torch.where(wavelength > trained / low, 0.0, kept))
        return (1 - kept) * theta / factor + kept * theta, 1.0
    interpolated = yarn_ramp(d_head, base, trained, beta_fast=scaling.get("beta_fast") or 32,
                             beta_slow=scaling.get("beta_slow") or 1, truncate=scaling.get("truncate", True),
                             device=device)  # (d_head / 2,): 1 - g
    inv_freq = theta / factor * interpolated + theta * (1 - interpolated)
    attention_scale = scaling.get("attention_factor")
    if attention_scale is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_scale = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                           if mscale and mscale_all_dim else _yarn_mscale(factor))
    return inv_freq, float(attention_scale)
