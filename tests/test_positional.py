"""tfedu.positional against independent oracles (the formulas in float64, the RoFormer complex form,
Hugging Face's Llama rotary layer and attention, Bloom's ALiBi slopes, torch SDPA) and the
invariants each encoding promises (M(k) moves positions, RoPE scores depend on m - n only, ALiBi
is end-aligned and shift-invariant under the softmax)."""

import math

import einops
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tfedu.attention import attention_weights, causal_mask, scaled_dot_product_attention
from tfedu.positional import (
    LearnedPositions,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    binary_positions,
    frequencies,
    half_layout_permutation,
    rope_angles,
    rotation_matrix,
    sinusoidal,
)

DEVICES = ["cpu", "meta"] + (["cuda"] if torch.cuda.is_available() else [])
# Fixed example lists: the property tests are seeded and repeatable, like the rest of the suite.
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True)


def randn(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def sinusoid_oracle(positions, d_model, base=10000.0):
    """Vaswani et al. sec. 3.5 written out in numpy float64, for any integer positions (negative too)."""
    t = np.asarray(positions, dtype=np.float64)[:, None]  # (pos, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)  # (d_model / 2,): 0, 2, 4, ...
    angles = t / np.power(float(base), two_i / d_model)  # (pos, d_model / 2)
    table = np.empty((len(t), d_model))
    table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    return torch.from_numpy(table)


def theta_oracle(d_head, base=10000.0):
    """RoFormer eq. 15, theta_i = base^(-2(i-1)/d) for i = 1 .. d/2, in python floats."""
    return torch.tensor([base ** (-2 * i / d_head) for i in range(d_head // 2)], dtype=torch.float64)


def dot(a, b):
    return (a * b).sum(-1)


# ----------------------------------------------------------------------------- sinusoids


@pytest.mark.parametrize(
    ("n_positions", "d_model", "base"),
    [(1, 2, 10000.0), (16, 4, 10000.0), (50, 64, 10000.0), (200, 128, 10000.0), (33, 10, 100.0), (7, 6, 1.5),
     (20, 8, 10000)],
)
def test_sinusoidal_matches_the_formula(n_positions, d_model, base, typechecked):
    expected = sinusoid_oracle(range(n_positions), d_model, base)
    make = typechecked(sinusoidal) if isinstance(base, float) else sinusoidal  # (beartype reads `float` strictly)
    table64 = make(n_positions, d_model, base, dtype=torch.float64)
    assert table64.dtype == torch.float64 and table64.shape == (n_positions, d_model)
    torch.testing.assert_close(table64, expected, rtol=0, atol=1e-12)
    table32 = make(n_positions, d_model, base)  # float32 by default
    assert table32.dtype == torch.float32
    torch.testing.assert_close(table32, expected.float(), rtol=0, atol=1e-7)
    # "a float32 table is the float64 table rounded once"
    assert torch.equal(table32, table64.float())


def test_sinusoidal_row_zero_and_frequency_ends():
    assert sinusoidal(1, 8)[0].tolist() == [0.0, 1.0] * 4
    omega = frequencies(8, 10000.0)
    assert omega[0] == 1.0 and 1 / 10000.0 < omega[-1] < omega[0]
    assert (omega[1:] < omega[:-1]).all()  # falling along the vector
    torch.testing.assert_close(omega, theta_oracle(8), rtol=1e-15, atol=0)


def test_sinusoidal_of_no_positions():
    assert sinusoidal(0, 4).shape == (0, 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_tables_respect_device_and_dtype(device, dtype):
    made = [
        sinusoidal(5, 8, dtype=dtype, device=device),
        rotation_matrix(3, 8, dtype=dtype, device=device),
        binary_positions(5, 4, dtype=dtype, device=device),
        alibi_slopes(6, dtype=dtype, device=device),
        alibi_bias(6, 3, 5, dtype=dtype, device=device),
        frequencies(8, dtype=dtype, device=device),
    ]
    for table in made:
        assert table.device.type == torch.device(device).type and table.dtype == dtype


def test_rope_follows_its_input_device():
    x = torch.empty(2, 3, 8, device="meta")
    out = apply_rope(x, torch.arange(3, device="meta"))
    assert out.device.type == "meta" and out.shape == x.shape


# ----------------------------------------------------------------------------- M(k)

T_K = [(t, k) for t in (0, 1, 5, 37, 99) for k in (-120, -37, -5, -1, 0, 1, 3, 64, 250)]


@pytest.mark.parametrize(("d_model", "base"), [(4, 10000.0), (16, 10000.0), (64, 10000.0), (10, 50.0)])
def test_rotation_matrix_moves_positions_by_k(d_model, base, typechecked):
    # The table only goes to position 99; t + k reaches -120 .. 349, so the targets come from the formula.
    table = sinusoidal(100, d_model, base, dtype=torch.float64)
    for t, k in T_K:
        M = typechecked(rotation_matrix)(k, d_model, base, dtype=torch.float64)
        target = sinusoid_oracle([t + k], d_model, base)[0]
        torch.testing.assert_close(M @ table[t], target, rtol=0, atol=1e-12, msg=f"t={t}, k={k}")
    # and within a longer table computed separately
    longer = sinusoidal(400, d_model, base, dtype=torch.float64)
    for t, k in T_K:
        if t + k >= 0:
            torch.testing.assert_close(rotation_matrix(k, d_model, base, dtype=torch.float64) @ table[t], longer[t + k])


def test_rotation_matrix_float32_moves_the_float32_table():
    P = sinusoidal(64, 32)
    M = rotation_matrix(7, 32)
    assert M.dtype == torch.float32
    torch.testing.assert_close(P[:50] @ M.T, P[7:57], rtol=0, atol=1e-5)


@pytest.mark.parametrize("d_model", [2, 8, 64])
def test_rotation_matrix_is_an_orthogonal_group(d_model):
    eye = torch.eye(d_model, dtype=torch.float64)
    M = lambda k: rotation_matrix(k, d_model, dtype=torch.float64)  # noqa: E731
    torch.testing.assert_close(M(0), eye, rtol=0, atol=0)
    for a, b in [(1, 2), (-3, 3), (17, -40), (100, 250), (0.5, 0.5), (-2.25, 7)]:
        torch.testing.assert_close(M(a) @ M(a).T, eye, rtol=0, atol=1e-12)
        torch.testing.assert_close(M(a) @ M(b), M(a + b), rtol=0, atol=1e-12)
        torch.testing.assert_close(M(-a), M(a).T, rtol=0, atol=1e-12)
    # block diagonal: nothing mixes two different frequencies
    in_a_block = torch.block_diag(*[torch.ones(2, 2)] * (d_model // 2)).bool()
    assert (M(5)[~in_a_block] == 0).all()


@pytest.mark.parametrize("d_model", [4, 16, 64])
def test_sinusoid_dot_products_depend_only_on_the_offset(d_model):
    P = sinusoidal(300, d_model, dtype=torch.float64)
    omega = theta_oracle(d_model)
    for k in (0, 1, 2, 5, 17, 100, 199):
        dots = dot(P[: 300 - k], P[k:])  # P_t . P_{t+k} for every t
        expected = torch.cos(k * omega).sum()  # sum_i sin(a)sin(b) + cos(a)cos(b) = sum_i cos(k w_i)
        torch.testing.assert_close(dots, expected.expand_as(dots), rtol=0, atol=1e-12, msg=f"k={k}")


# ----------------------------------------------------------------------------- binary codes


def test_binary_positions_match_the_lecture_table(typechecked):
    # The JHU slide: 16 positions in 4 bits, most significant bit first.
    slide = """0000 0001 0010 0011 0100 0101 0110 0111
               1000 1001 1010 1011 1100 1101 1110 1111""".split()
    expected = torch.tensor([[int(bit) for bit in row] for row in slide], dtype=torch.float32)
    table = typechecked(binary_positions)(16, 4)
    assert table.dtype == torch.float32
    assert torch.equal(table, expected)


@pytest.mark.parametrize("n_bits", [1, 7, 62, 63, 64, 65, 128])
def test_binary_positions_for_wide_codes(n_bits):
    # Regression: for n_bits >= 64 the int64 place value 2^63 wrapped negative (wrong first bit)
    # and 2^64 wrapped to 0 (ZeroDivisionError).
    n = min(2**n_bits, 300)
    table = binary_positions(n, n_bits, dtype=torch.int64)
    assert table.shape == (n, n_bits)
    expected = [[int(b) for b in format(t, f"0{n_bits}b")] for t in range(n)]
    assert table.tolist() == expected


def test_binary_positions_need_enough_bits():
    assert binary_positions(16, 4).shape == (16, 4)  # exactly enough
    with pytest.raises(ValueError, match=r"4 bits give only 2\*\*4 = 16 distinct codes, fewer than n_positions=17"):
        binary_positions(17, 4)
    with pytest.raises(ValueError, match="n_bits must be an int >= 1"):
        binary_positions(1, 0)


# ----------------------------------------------------------------------------- RoPE: invariants


@PROPERTY
@given(
    seed=st.integers(0, 2**16),
    d_head=st.sampled_from([2, 4, 8, 32, 64]),
    m=st.integers(-2000, 2000),
    n=st.integers(-2000, 2000),
    shift=st.integers(-5000, 5000),
    layout=st.sampled_from(["interleaved", "half"]),
)
def test_rope_scores_depend_only_on_the_offset(seed, d_head, m, n, shift, layout):
    q, k = randn(seed, 1, d_head), randn(seed + 1, 1, d_head)
    q, k = q / q.norm(), k / k.norm()  # unit vectors: scores in [-1, 1], so 1e-5 is an absolute claim
    rope = lambda x, p: apply_rope(x, torch.tensor([p]), layout=layout)  # noqa: E731
    score = dot(rope(q, m), rope(k, n))
    # the same offset elsewhere, and the whole offset put on one side: <R(m) q, R(n) k> = <R(m - n) q, k>
    for other in (dot(rope(q, m + shift), rope(k, n + shift)), dot(rope(q, m - n), k), dot(q, rope(k, n - m))):
        torch.testing.assert_close(other, score, rtol=0, atol=1e-5)
    # and in float64 to the float64 oracle
    q64, k64 = q.double(), k.double()
    score64 = dot(apply_rope(q64, torch.tensor([m]), layout=layout), apply_rope(k64, torch.tensor([n]), layout=layout))
    offset64 = dot(apply_rope(q64, torch.tensor([m - n]), layout=layout), k64)
    torch.testing.assert_close(score64, offset64, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_score_matrix_is_a_function_of_the_offset(layout):
    # The whole query-by-key score matrix of one q and one k placed at every position: constant on diagonals.
    n_ctx, d_head = 48, 16
    q = randn(0, 1, d_head).expand(n_ctx, d_head)
    k = randn(1, 1, d_head).expand(n_ctx, d_head)
    positions = torch.arange(n_ctx)
    scores = apply_rope(q, positions, layout=layout) @ apply_rope(k, positions, layout=layout).T  # (query_pos, key_pos)
    for offset in range(-n_ctx + 1, n_ctx):
        diagonal = scores.diagonal(offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rope_preserves_norms(layout, dtype):
    x = randn(2, 3, 4, 50, 32, dtype=dtype)
    positions = torch.randint(-10_000, 10_000, (50,), generator=torch.Generator().manual_seed(0))
    out = apply_rope(x, positions, layout=layout)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=tol, atol=tol)


@pytest.mark.parametrize("d_head", [2, 4, 6, 64])
def test_the_two_layouts_agree_after_the_permutation(d_head, typechecked):
    perm = typechecked(half_layout_permutation)(d_head)
    assert sorted(perm.tolist()) == list(range(d_head))
    x = randn(3, 2, 7, d_head)
    positions = torch.arange(100, 107)
    interleaved = typechecked(apply_rope)(x, positions, layout="interleaved")
    half = typechecked(apply_rope)(x[..., perm], positions, layout="half")
    torch.testing.assert_close(half, interleaved[..., perm])
    # ...and the layouts really differ without it (with one pair, d_head = 2, they are the same)
    assert d_head == 2 or not torch.allclose(apply_rope(x, positions, layout="half"), interleaved)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_positions_broadcast(layout, typechecked):
    batch, n_heads, pos, d_head = 3, 4, 5, 8
    x = randn(4, batch, n_heads, pos, d_head)
    offsets = torch.tensor([0, 7, 1000])
    per_sequence = offsets[:, None, None] + torch.arange(pos)  # (batch, 1, pos)
    out = typechecked(apply_rope)(x, per_sequence, layout=layout)
    for b in range(batch):
        expected = apply_rope(x[b], per_sequence[b, 0], layout=layout)  # (pos,) against (n_heads, pos, d_head)
        torch.testing.assert_close(out[b], expected, rtol=0, atol=0)
    # (pos,) is the same as spelling the positions out for every batch and head
    full = torch.arange(pos).expand(batch, n_heads, pos)
    torch.testing.assert_close(
        apply_rope(x, torch.arange(pos), layout=layout), apply_rope(x, full, layout=layout), rtol=0, atol=0
    )
    # without heads: (batch, pos, d_head) with (batch, pos)
    x3 = x[:, 0]
    torch.testing.assert_close(apply_rope(x3, per_sequence[:, 0], layout=layout), out[:, 0], rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_rope_keeps_the_input_dtype(layout, dtype):
    x = randn(5, 2, 9, 16, dtype=dtype)
    positions = torch.arange(9) * 50
    out = apply_rope(x, positions, layout=layout)
    assert out.dtype == dtype and out.shape == x.shape
    exact = apply_rope(x.double(), positions, layout=layout)
    # one rounding of the float32 (float64) result to the input's precision
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), exact, rtol=tol, atol=tol)
    if dtype in (torch.bfloat16, torch.float16):
        # computed in float32 and rounded once at the end, not rotated in 8 (or 11) bits of mantissa
        assert torch.equal(out, apply_rope(x.float(), positions, layout=layout).to(dtype))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_at_position_zero_is_the_identity(layout):
    x = randn(6, 2, 4, 10, 32)
    assert torch.equal(apply_rope(x, torch.zeros(10, dtype=torch.long), layout=layout), x)
    assert torch.equal(rope_angles(torch.zeros(3, dtype=torch.long), 8), torch.zeros(3, 4, dtype=torch.float64))


@pytest.mark.parametrize("d_head", [2, 8, 64])
@pytest.mark.parametrize("base", [10000.0, 500000.0, 2.0])
def test_interleaved_rope_is_the_roformer_complex_product(d_head, base, typechecked):
    # RoFormer sec. 3.4.1 / eq. 34: view (x_{2i}, x_{2i+1}) as x_{2i} + i x_{2i+1} and multiply by e^{i m theta_i}.
    x = randn(7, 3, 20, d_head, dtype=torch.float64)
    positions = torch.tensor([0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584, 4181, -6765])
    angles = positions.double()[:, None] * theta_oracle(d_head, base)  # (pos, d_head / 2)
    rotor = torch.polar(torch.ones_like(angles), angles)  # e^{i m theta}
    as_complex = torch.view_as_complex(x.reshape(3, 20, d_head // 2, 2).contiguous())
    expected = torch.view_as_real(as_complex * rotor).reshape(3, 20, d_head)
    # angles of thousands of radians carry float64 rounding of about 1e-16 * angle
    torch.testing.assert_close(typechecked(apply_rope)(x, positions, base=base), expected, rtol=0, atol=1e-11)
    torch.testing.assert_close(typechecked(rope_angles)(positions, d_head, base), angles, rtol=1e-15, atol=0)
    # float32: same up to one rounding
    torch.testing.assert_close(apply_rope(x.float(), positions, base=base), expected.float(), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- RoPE: Hugging Face Llama

def llama_config(**overrides):
    transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
    settings_ = dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16, intermediate_size=128,
        num_hidden_layers=1, vocab_size=32, max_position_embeddings=512, rope_theta=10000.0,
        attention_bias=False, attn_implementation="eager",
    )
    return transformers.LlamaConfig(**{**settings_, **overrides})


@pytest.mark.parametrize(("head_dim", "rope_theta"), [(16, 10000.0), (64, 10000.0), (8, 500000.0), (32, 100.0)])
def test_half_layout_matches_hugging_face_llama_rotary(head_dim, rope_theta):
    config = llama_config(head_dim=head_dim, rope_theta=rope_theta)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    batch, n_heads, pos = 2, config.num_attention_heads, 12
    q, k = randn(8, batch, n_heads, pos, head_dim), randn(9, batch, n_heads, pos, head_dim)
    position_ids = torch.stack([torch.arange(pos), torch.arange(pos) + 40])  # (batch, pos): the second starts at 40
    cos, sin = LlamaRotaryEmbedding(config)(q, position_ids)  # (batch, pos, head_dim)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    positions = position_ids[:, None, :]  # (batch, 1, pos)
    # HF keeps its frequencies and angles in float32 (angle error ~ position * 6e-8); ours are float64.
    torch.testing.assert_close(apply_rope(q, positions, base=rope_theta, layout="half"), q_hf, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(apply_rope(k, positions, base=rope_theta, layout="half"), k_hf, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("n_kv_heads", [4, 2])  # 2: grouped-query attention, each key/value head serves two query heads
def test_tfedu_pieces_reproduce_a_hugging_face_llama_attention_layer(n_kv_heads):
    config = llama_config(num_key_value_heads=n_kv_heads)
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = LlamaAttention(config, layer_idx=0).eval()  # random weights, from the config alone
        for linear in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
            torch.nn.init.normal_(linear.weight, std=0.3)  # big enough that positions change the weights visibly
    batch, pos, n_heads = 2, 10, config.num_attention_heads
    x = randn(10, batch, pos, config.hidden_size)
    position_ids = torch.stack([torch.arange(pos), torch.arange(pos) + 100])  # (batch, pos)
    hide = ~causal_mask(pos, pos)
    hf_mask = torch.zeros(pos, pos).masked_fill(hide, float("-inf"))[None, None].expand(batch, 1, pos, pos)
    with torch.no_grad():
        cos_sin = LlamaRotaryEmbedding(config)(x, position_ids)
        expected, _ = layer(x, position_embeddings=cos_sin, attention_mask=hf_mask)

        # the same layer from tfedu pieces: W_Q, W_K, W_V, W_O copied, RoPE (half layout), tfedu attention
        W_Q, W_K, W_V, W_O = (p.weight for p in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj))

        def heads(y, h):  # (batch, pos, h * d_head) -> (batch, n_heads, pos, d_head), key/value heads repeated
            y = einops.rearrange(y, "batch pos (h d_head) -> batch h pos d_head", h=h)
            return y.repeat_interleave(n_heads // h, dim=1)  # HF's repeat_kv: kv head j serves query heads j*g ...

        def attend(q, k, v):
            z, weights = scaled_dot_product_attention(q, k, v, causal_mask(pos, pos))  # (batch, n_heads, pos, d_head)
            return einops.rearrange(z, "batch n_heads pos d_head -> batch pos (n_heads d_head)") @ W_O.T, weights

        q, k, v = heads(x @ W_Q.T, n_heads), heads(x @ W_K.T, n_kv_heads), heads(x @ W_V.T, n_kv_heads)
        positions = position_ids[:, None, :]  # (batch, 1, pos)
        theta = config.rope_parameters["rope_theta"]
        out, weights = attend(apply_rope(q, positions, base=theta, layout="half"),
                              apply_rope(k, positions, base=theta, layout="half"), v)
        no_rope, _ = attend(q, k, v)
    assert out.shape == expected.shape == (batch, pos, config.hidden_size)
    # HF's rotary angles are float32 (an error of about position * 6e-8 radians at positions up to 109)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=5e-5)
    # the test has teeth: the last query (10 keys to choose from) is far from uniform, and dropping RoPE
    # changes the output
    assert weights[..., -1, :].max() > 0.5
    assert not torch.allclose(no_rope, expected, rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------- ALiBi


def test_alibi_slopes_for_powers_of_two(typechecked):
    assert typechecked(alibi_slopes)(8, dtype=torch.float64).tolist() == [2.0**-h for h in range(1, 9)]
    torch.testing.assert_close(
        alibi_slopes(16, dtype=torch.float64), torch.tensor([2 ** (-h / 2) for h in range(1, 17)], dtype=torch.float64),
        rtol=1e-14, atol=0,
    )
    assert alibi_slopes(16, dtype=torch.float64)[[0, -1]].tolist() == pytest.approx([2**-0.5, 2**-8], rel=1e-14)
    assert alibi_slopes(1, dtype=torch.float64).tolist() == [2.0**-8]
    assert alibi_slopes(2, dtype=torch.float64).tolist() == [2.0**-4, 2.0**-8]


@pytest.mark.parametrize(
    ("n_heads", "exponents"),
    [
        # the 4 slopes of 4 heads (2^-2 .. 2^-8), then every other slope of 8 heads (2^-1, 2^-3, ...), 2 of them
        (6, [-2, -4, -6, -8, -1, -3]),
        # the 8 slopes of 8 heads (2^-1 .. 2^-8), then every other slope of 16 heads (2^-0.5, 2^-1.5, ...), 4 of them
        (12, [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5]),
        (3, [-4, -8, -2]),
        (5, [-2, -4, -6, -8, -1]),
    ],
)
def test_alibi_slopes_for_other_head_counts(n_heads, exponents):
    torch.testing.assert_close(
        alibi_slopes(n_heads, dtype=torch.float64), torch.tensor([2.0**e for e in exponents], dtype=torch.float64),
        rtol=1e-15, atol=0,
    )


@pytest.mark.parametrize("n_heads", [1, 2, 3, 5, 6, 7, 8, 12, 16, 20, 24, 32, 40, 64, 96])
def test_alibi_slopes_match_bloom(n_heads):
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom", reason="transformers is not installed")
    torch.testing.assert_close(alibi_slopes(n_heads), bloom._get_alibi_slopes(n_heads, "cpu"), rtol=1e-6, atol=0)


def test_alibi_bias_is_minus_slope_times_distance(typechecked):
    n_heads, n_query, n_key = 6, 4, 9
    bias = typechecked(alibi_bias)(n_heads, n_query, n_key, dtype=torch.float64)
    slopes = alibi_slopes(n_heads, dtype=torch.float64)
    for h in range(n_heads):
        for i in range(n_query):
            for j in range(n_key):
                assert bias[h, i, j] == -slopes[h] * abs(i + n_key - n_query - j)


@pytest.mark.parametrize(("n_query", "n_key"), [(1, 1), (1, 7), (3, 7), (7, 7), (5, 12)])
def test_alibi_bias_is_end_aligned(n_query, n_key):
    full = alibi_bias(8, n_key, n_key)
    bias = alibi_bias(8, n_query, n_key)
    torch.testing.assert_close(bias[:, -1], full[:, -1], rtol=0, atol=0)  # the newest query is the same query
    torch.testing.assert_close(bias, full[:, -n_query:], rtol=0, atol=0)
    # 0 on the end-aligned diagonal (where causal_mask's last True sits), negative everywhere else
    on_diagonal = torch.arange(n_key)[None, :] == torch.arange(n_query)[:, None] + (n_key - n_query)
    assert (bias[:, on_diagonal] == 0).all() and not torch.signbit(bias[:, on_diagonal]).any()
    assert (bias[:, ~on_diagonal] < 0).all()
    # that diagonal is where each row of causal_mask has its last True
    last_visible = causal_mask(n_query, n_key).int().cumsum(-1).argmax(-1)
    assert torch.equal(on_diagonal.int().argmax(-1), last_visible)


@pytest.mark.parametrize(("n_query", "n_key"), [(6, 6), (2, 6)])
def test_alibi_softmax_only_sees_relative_positions(n_query, n_key):
    # softmax is shift-invariant along a row: -m (i - j) and m j differ by -m i, the same for every key
    # of query i, so ALiBi's weights equal those of Bloom's bias m * j (and of any per-row shift of it).
    n_heads, d_head = 4, 8
    q, k = randn(11, 2, n_heads, n_query, d_head), randn(12, 2, n_heads, n_key, d_head)
    mask = causal_mask(n_query, n_key)
    slopes = alibi_slopes(n_heads)[:, None, None]  # (n_heads, 1, 1)
    weights = attention_weights(q, k, mask, bias=alibi_bias(n_heads, n_query, n_key))
    key_ramp = slopes * torch.arange(n_key)  # (n_heads, 1, key_pos)
    torch.testing.assert_close(attention_weights(q, k, mask, bias=key_ramp), weights)
    row_shift = randn(13, n_heads, n_query, 1) * 5  # a different constant for each (head, query) row
    torch.testing.assert_close(attention_weights(q, k, mask, bias=key_ramp + row_shift), weights)
    # moving every position along by the same amount (a longer cache in front) leaves the bias unchanged
    longer = alibi_bias(n_heads, n_query + 30, n_key + 30)
    torch.testing.assert_close(alibi_bias(n_heads, n_query, n_key), longer[:, 30:, 30:])
    # and the bias is not a no-op: the weights differ from plain causal attention
    assert not torch.allclose(attention_weights(q, k, mask), weights)


@pytest.mark.parametrize(("n_query", "n_key"), [(7, 7), (3, 7)])
def test_attention_with_alibi_matches_torch_sdpa_with_a_float_mask(n_query, n_key, typechecked):
    n_heads, d_head = 8, 16
    q = randn(14, 2, n_heads, n_query, d_head)
    k, v = randn(15, 2, n_heads, n_key, d_head), randn(16, 2, n_heads, n_key, d_head)
    mask, bias = causal_mask(n_query, n_key), alibi_bias(n_heads, n_query, n_key)
    out, weights = typechecked(scaled_dot_product_attention)(q, k, v, mask, bias=bias)
    float_mask = bias.masked_fill(~mask, float("-inf"))  # (n_heads, query_pos, key_pos)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, n_heads, n_query))


# ----------------------------------------------------------------------------- learned table


def test_learned_positions_shape_and_lookup():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        table = LearnedPositions(n_ctx=8, d_model=6)
    assert table.W_pos.shape == (8, 6) and table.W_pos.requires_grad
    assert 0.005 < table.W_pos.std().item() < 0.05  # GPT-2's init, std 0.02
    positions = torch.tensor([[0, 1, 2, 7], [3, 3, 5, 0]])  # (batch, pos)
    out = table(positions)
    assert out.shape == (2, 4, 6)
    torch.testing.assert_close(out[1, 2], table.W_pos[5], rtol=0, atol=0)
    assert table(torch.arange(8)).shape == (8, 6)
    assert table(torch.zeros(0, dtype=torch.long)).shape == (0, 6)


@pytest.mark.parametrize("bad", [torch.tensor([0, 8]), torch.arange(20), torch.tensor([-1, 0])])
def test_learned_positions_have_nothing_past_n_ctx(bad):
    table = LearnedPositions(n_ctx=8, d_model=4)
    with pytest.raises(IndexError, match=r"n_ctx=8 rows \(positions 0..7\)"):
        table(bad)


def test_learned_positions_need_integer_positions():
    table = LearnedPositions(n_ctx=8, d_model=4)
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        table(torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        table([0, 1])


def test_learned_positions_gradients_reach_only_the_rows_used():
    table = LearnedPositions(n_ctx=10, d_model=3)
    positions = torch.tensor([[1, 4, 4], [4, 9, 1]])
    table(positions).sum().backward()
    counts = torch.bincount(positions.flatten(), minlength=10).float()  # row 4 is used 3 times, rows 1 and 9 ...
    torch.testing.assert_close(table.W_pos.grad, counts[:, None].expand(10, 3))
    assert (table.W_pos.grad[[0, 2, 3, 5, 6, 7, 8]] == 0).all()


# ----------------------------------------------------------------------------- clear errors


@pytest.mark.parametrize(
    "call",
    [
        lambda: sinusoidal(4, 5),
        lambda: rotation_matrix(1, 7),
        lambda: frequencies(3),
        lambda: half_layout_permutation(5),
        lambda: rope_angles(torch.arange(3), 9),
    ],
)
def test_odd_widths_are_refused(call):
    with pytest.raises(ValueError, match=r"must be even: dimensions come in \(sin, cos\) or rotation pairs"):
        call()


def test_odd_d_head_in_apply_rope_is_refused():
    with pytest.raises(ValueError, match="d_head=7 must be even: RoPE rotates dimensions in pairs"):
        apply_rope(torch.zeros(3, 7), torch.arange(3))


@pytest.mark.parametrize("base", [0.5, 1, 1.0, 0, -10.0, float("nan"), float("inf"), True, "10000"])
@pytest.mark.parametrize(
    "call",
    [
        lambda base: sinusoidal(4, 8, base),
        lambda base: frequencies(8, base),
        lambda base: rotation_matrix(1, 8, base),
        lambda base: apply_rope(torch.zeros(3, 8), torch.arange(3), base=base),
    ],
    ids=["sinusoidal", "frequencies", "rotation_matrix", "apply_rope"],
)
def test_bad_bases_are_refused(base, call):
    with pytest.raises(ValueError, match="base must be a finite number > 1"):
        call(base)


@pytest.mark.parametrize(
    "positions",
    [torch.arange(4), torch.arange(6).view(2, 3)[:, None, None, :], torch.arange(3).view(3, 1), torch.tensor(0),
     torch.arange(6).view(3, 2)],
    ids=["too-long", "too-many-dims", "transposed", "scalar", "wrong-batch"],
)
def test_positions_of_the_wrong_shape_are_refused(positions):
    with pytest.raises(ValueError, match=r"do not match x of shape \(\.\.\., pos, d_head\) = \(2, 3, 8\)"):
        apply_rope(torch.zeros(2, 3, 8), positions)


@pytest.mark.parametrize("positions", [torch.arange(3.0), torch.ones(3, dtype=torch.bool), [0, 1, 2]])
def test_rope_needs_integer_positions(positions):
    with pytest.raises(TypeError, match="positions must be an integer tensor of shape \\(pos,\\)"):
        apply_rope(torch.zeros(3, 8), positions)


@pytest.mark.parametrize("x", [torch.zeros(3, 8, dtype=torch.long), torch.zeros(8), [[0.0] * 8]])
def test_rope_needs_a_float_x_with_a_pos_axis(x):
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor of shape \(\.\.\., pos, d_head\)"):
        apply_rope(x, torch.arange(1))


@pytest.mark.parametrize("layout", ["neox", "Half", "", None])
def test_unknown_layouts_are_refused(layout):
    with pytest.raises(ValueError, match=r"layout must be one of \('interleaved', 'half'\)"):
        apply_rope(torch.zeros(3, 8), torch.arange(3), layout=layout)


@pytest.mark.parametrize("n_heads", [0, -1, 2.0, True])
def test_alibi_needs_at_least_one_head(n_heads):
    with pytest.raises(ValueError, match="n_heads must be an int >= 1"):
        alibi_slopes(n_heads)
    with pytest.raises(ValueError, match="n_heads must be an int >= 1"):
        alibi_bias(n_heads, 3, 3)


def test_other_sizes_are_checked():
    with pytest.raises(ValueError, match="n_positions must be an int >= 0"):
        sinusoidal(-1, 4)
    with pytest.raises(ValueError, match="n_query must be an int >= 0"):
        alibi_bias(2, -1, 3)
    with pytest.raises(ValueError, match="n_ctx must be an int >= 1"):
        LearnedPositions(n_ctx=0, d_model=4)
    with pytest.raises(TypeError, match="positions must be a real tensor"):
        rope_angles([0, 1], 4)


def test_positions_on_another_device_are_refused():
    with pytest.raises(ValueError, match="positions are on meta but x is on cpu"):
        apply_rope(torch.zeros(3, 8), torch.arange(3, device="meta"))


def test_doctests_of_this_module_are_run():
    from tests.test_doctests import MODULES

    assert "tfedu.positional" in MODULES
