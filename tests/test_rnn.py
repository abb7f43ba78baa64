import math

import numpy as np
import pytest
import torch
from torch import nn

from tfedu import rnn
from tfedu.toy_tasks import BOS, make_digit_batch, pad_sequences, teacher_forcing_inputs


def torch_rnn_weights(module: nn.RNN | nn.GRU):
    return module.weight_ih_l0, module.bias_ih_l0, module.weight_hh_l0, module.bias_hh_l0


@pytest.mark.parametrize("seed", range(3))
def test_run_rnn_matches_torch_rnn_with_copied_weights(seed, typechecked):
    torch.manual_seed(seed)
    oracle = nn.RNN(input_size=5, hidden_size=7, batch_first=True, nonlinearity="tanh")
    x = torch.randn(3, 6, 5)
    h0 = torch.randn(3, 7)
    expected, h_last = oracle(x, h0[None])
    got = typechecked(rnn.run_rnn)(x, h0, *torch_rnn_weights(oracle))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, -1], h_last[0], rtol=1e-5, atol=1e-6)


def test_linear_run_rnn_matches_matrix_powers():
    # linear recurrence with zero input: h_t = W^t h_0, computed independently by matrix powers
    torch.manual_seed(0)
    W = torch.randn(4, 4, dtype=torch.float64) * 0.5
    h0 = torch.randn(2, 4, dtype=torch.float64)
    zeros = torch.zeros(4, dtype=torch.float64)
    x = torch.zeros(2, 5, 3, dtype=torch.float64)
    got = rnn.run_rnn(x, h0, torch.zeros(4, 3, dtype=torch.float64), zeros, W, zeros, nonlinearity="linear")
    for t in range(5):
        torch.testing.assert_close(got[:, t], h0 @ torch.linalg.matrix_power(W, t + 1).T)


def test_run_rnn_starts_from_zeros_by_default():
    torch.manual_seed(1)
    oracle = nn.RNN(3, 4, batch_first=True)
    x = torch.randn(2, 5, 3)
    torch.testing.assert_close(rnn.run_rnn(x, None, *torch_rnn_weights(oracle)), oracle(x)[0])


def test_rnn_cell_is_one_step_of_run_rnn(typechecked):
    torch.manual_seed(2)
    oracle = nn.RNNCell(3, 4)
    x, h = torch.randn(2, 3), torch.randn(2, 4)
    got = typechecked(rnn.rnn_cell)(x, h, oracle.weight_ih, oracle.bias_ih, oracle.weight_hh, oracle.bias_hh)
    torch.testing.assert_close(got, oracle(x, h))


def test_rnn_gradients_match_torch():
    torch.manual_seed(3)
    oracle = nn.RNN(3, 4, batch_first=True)
    x = torch.randn(2, 6, 3, requires_grad=True)
    rnn.run_rnn(x, None, *torch_rnn_weights(oracle)).pow(2).sum().backward()
    ours = x.grad.clone()
    x.grad = None
    oracle(x)[0].pow(2).sum().backward()
    torch.testing.assert_close(ours, x.grad)


@pytest.mark.parametrize("seed", range(3))
def test_gru_cell_matches_torch_gru_cell(seed, typechecked):
    torch.manual_seed(seed)
    oracle = nn.GRUCell(5, 6)
    x, h = torch.randn(4, 5), torch.randn(4, 6)
    got = typechecked(rnn.gru_cell)(x, h, oracle.weight_ih, oracle.bias_ih, oracle.weight_hh, oracle.bias_hh)
    torch.testing.assert_close(got, oracle(x, h), rtol=1e-5, atol=1e-6)


def test_gru_cell_annotations_reject_weights_of_the_wrong_height(typechecked):
    from jaxtyping import TypeCheckError

    W_ih, W_hh, b = torch.randn(8, 5), torch.randn(8, 4), torch.randn(8)  # 2*d_hidden rows, not 3*d_hidden
    with pytest.raises((TypeCheckError, ValueError)):
        typechecked(rnn.gru_cell)(torch.randn(2, 5), torch.randn(2, 4), W_ih, b, W_hh, b)


def test_gru_cell_over_a_sequence_matches_torch_gru():
    torch.manual_seed(4)
    oracle = nn.GRU(3, 5, batch_first=True)
    x = torch.randn(2, 7, 3)
    expected, _ = oracle(x)
    h = torch.zeros(2, 5)
    for t in range(7):
        h = rnn.gru_cell(x[:, t], h, *torch_rnn_weights(oracle))
        torch.testing.assert_close(h, expected[:, t], rtol=1e-5, atol=1e-6)


def test_seq2seq_encoder_equals_hand_gru_in_both_directions():
    torch.manual_seed(5)
    model = rnn.Seq2Seq(rnn.Seq2SeqConfig(d_embed=8, d_hidden=6, d_attn=5))
    src = torch.randint(0, 10, (3, 5))
    states, summary = model.encode(src)
    x = model.src_embed(src)
    enc = model.encoder
    forward = (enc.weight_ih_l0, enc.bias_ih_l0, enc.weight_hh_l0, enc.bias_hh_l0)
    backward = (enc.weight_ih_l0_reverse, enc.bias_ih_l0_reverse, enc.weight_hh_l0_reverse, enc.bias_hh_l0_reverse)
    h_f, h_b = torch.zeros(3, 6), torch.zeros(3, 6)
    for t in range(5):
        h_f = rnn.gru_cell(x[:, t], h_f, *forward)
        torch.testing.assert_close(states[:, t, :6], h_f, rtol=1e-5, atol=1e-6)
    for t in reversed(range(5)):
        h_b = rnn.gru_cell(x[:, t], h_b, *backward)
        torch.testing.assert_close(states[:, t, 6:], h_b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(summary, torch.cat([h_f, h_b], dim=-1), rtol=1e-5, atol=1e-6)


def numpy_additive_attention(query, keys, W_q, W_k, v, mask=None):
    """Independent oracle: loops in float64 NumPy, one score at a time."""
    query, keys, W_q, W_k, v = (np.asarray(a, dtype=np.float64) for a in (query, keys, W_q, W_k, v))
    batch, n_keys, _ = keys.shape
    weights = np.zeros((batch, n_keys))
    contexts = np.zeros((batch, keys.shape[2]))
    for b in range(batch):
        scores = np.array([v @ np.tanh(W_q @ query[b] + W_k @ keys[b, j]) for j in range(n_keys)])
        if mask is not None:
            scores = np.where(np.asarray(mask[b]), scores, -np.inf)
        e = np.exp(scores - scores.max())
        weights[b] = e / e.sum()
        contexts[b] = weights[b] @ keys[b]
    return contexts, weights


@pytest.mark.parametrize("seed", range(3))
def test_additive_attention_matches_a_loop_oracle(seed, typechecked):
    g = torch.Generator().manual_seed(seed)
    query, keys = torch.randn(3, 4, generator=g), torch.randn(3, 6, 5, generator=g)
    W_q, W_k, v = torch.randn(7, 4, generator=g), torch.randn(7, 5, generator=g), torch.randn(7, generator=g)
    context, weights = typechecked(rnn.additive_attention)(query, keys, W_q, W_k, v)
    want_context, want_weights = numpy_additive_attention(query, keys, W_q, W_k, v)
    np.testing.assert_allclose(weights.numpy(), want_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(context.numpy(), want_context, rtol=1e-5, atol=1e-6)
    assert (weights >= 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(3))


def test_additive_attention_masks_padded_positions():
    g = torch.Generator().manual_seed(7)
    query, keys = torch.randn(2, 4, generator=g), torch.randn(2, 5, 4, generator=g)
    W_q, W_k, v = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    mask = torch.tensor([[True, True, True, False, False], [True, True, True, True, True]])
    context, weights = rnn.additive_attention(query, keys, W_q, W_k, v, mask)
    assert (weights[0, 3:] == 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    want_context, want_weights = numpy_additive_attention(query, keys, W_q, W_k, v, mask)
    np.testing.assert_allclose(weights.numpy(), want_weights, rtol=1e-5, atol=1e-6)
    # the padded keys cannot influence the result: change them and nothing moves
    keys2 = keys.clone()
    keys2[0, 3:] = 100.0
    context2, _ = rnn.additive_attention(query, keys2, W_q, W_k, v, mask)
    torch.testing.assert_close(context2[0], context[0])


def test_attention_module_equals_functional_with_and_without_projected_keys():
    torch.manual_seed(8)
    attn = rnn.AdditiveAttention(d_query=4, d_key=6, d_attn=5)
    query, keys = torch.randn(2, 4), torch.randn(2, 3, 6)
    want = rnn.additive_attention(query, keys, attn.W_q.weight, attn.W_k.weight, attn.v)
    for got in (attn(query, keys), attn(query, keys, projected_keys=attn.project_keys(keys))):
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: rnn.run_rnn(torch.randn(2, 3), None, torch.randn(4, 3), torch.randn(4), torch.randn(4, 4), torch.randn(4)), r"x should have shape \(batch, pos, d_in\)"),
        (lambda: rnn.run_rnn(torch.randn(2, 5, 3), None, torch.randn(3, 4), torch.randn(4), torch.randn(4, 4), torch.randn(4)), r"W_xh should have shape \(4, 3\)"),
        (lambda: rnn.run_rnn(torch.randn(2, 5, 3), torch.randn(3, 4), torch.randn(4, 3), torch.randn(4), torch.randn(4, 4), torch.randn(4)), r"h0 should have shape \(2, 4\)"),
        (lambda: rnn.run_rnn(torch.randn(2, 5, 3), None, torch.randn(4, 3), torch.randn(5), torch.randn(4, 4), torch.randn(4)), r"b_xh should have shape \(4,\)"),
        (lambda: rnn.run_rnn(torch.ones(2, 5, 3, dtype=torch.long), None, torch.randn(4, 3), torch.randn(4), torch.randn(4, 4), torch.randn(4)), "floating-point"),
        (lambda: rnn.rnn_cell(torch.randn(2, 3), torch.randn(2, 4), torch.randn(4, 3), torch.randn(4), torch.randn(4, 4), torch.randn(4), nonlinearity="sigmoid"), "nonlinearity must be one of"),
        (lambda: rnn.gru_cell(torch.randn(2, 3), torch.randn(2, 4), torch.randn(4, 3), torch.randn(4), torch.randn(4, 4), torch.randn(4)), r"W_hh should have shape \(12, 4\)"),
        (lambda: rnn.additive_attention(torch.randn(2, 4), torch.randn(2, 6), torch.randn(3, 4), torch.randn(3, 6), torch.randn(3)), r"keys should have shape \(batch, key_pos, d_key\)"),
        (lambda: rnn.additive_attention(torch.randn(3, 4), torch.randn(2, 5, 6), torch.randn(3, 4), torch.randn(3, 6), torch.randn(3)), "query has batch 3 but keys have batch 2"),
        (lambda: rnn.additive_attention(torch.randn(2, 4), torch.randn(2, 5, 6), torch.randn(3, 4), torch.randn(3, 5), torch.randn(3)), r"W_k should have shape \(3, 6\)"),
        (lambda: rnn.additive_attention(torch.randn(2, 4), torch.randn(2, 5, 6), torch.randn(3, 4), torch.randn(3, 6), torch.randn(3), torch.ones(2, 5)), "mask should be a bool tensor"),
        (lambda: rnn.additive_attention(torch.randn(2, 4), torch.randn(2, 5, 6), torch.randn(3, 4), torch.randn(3, 6), torch.randn(3), torch.zeros(2, 5, dtype=torch.bool)), "hides every source position"),
    ],
)
def test_bad_inputs_get_clear_errors(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_rnn_rejects_non_tensors():
    with pytest.raises(TypeError, match="x should be a torch.Tensor"):
        rnn.run_rnn([[1.0]], None, torch.randn(1, 1), torch.randn(1), torch.randn(1, 1), torch.randn(1))


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(9)
    return rnn.Seq2Seq(rnn.Seq2SeqConfig(d_embed=8, d_hidden=12, d_attn=10)).eval()


@pytest.mark.parametrize("attention", ["bahdanau", "luong", "none"])
def test_seq2seq_shapes(attention, typechecked):
    torch.manual_seed(10)
    model = rnn.Seq2Seq(rnn.Seq2SeqConfig(d_embed=8, d_hidden=12, d_attn=10, attention=attention))
    src, tgt = make_digit_batch(3, 5, torch.Generator().manual_seed(0))
    logits, alignments = typechecked(model.forward)(src, teacher_forcing_inputs(tgt))
    assert logits.shape == (3, 5, 12)
    if attention != "none":
        assert alignments.shape == (3, 5, 5)
        torch.testing.assert_close(alignments.sum(-1), torch.ones(3, 5))
    else:
        assert alignments is None
    tokens, _ = model.greedy_decode(src, 7)
    assert tokens.shape == (3, 7) and tokens.dtype == torch.long


def test_greedy_decode_equals_teacher_forcing_on_its_own_output(small_model):
    src = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(1))
    tokens, alignments = small_model.greedy_decode(src, 6)
    with torch.no_grad():
        logits, forced_alignments = small_model(src, teacher_forcing_inputs(tokens))
    assert torch.equal(logits.argmax(-1), tokens)
    torch.testing.assert_close(forced_alignments, alignments)


def test_padded_batch_equals_each_sequence_alone(small_model):
    seqs = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3]]
    src, mask = pad_sequences(seqs)
    tgt_in = torch.full((3, 4), BOS)
    with torch.no_grad():
        logits, alignments = small_model(src, tgt_in, src_mask=mask)
        for row, seq in enumerate(seqs):
            alone, alone_alignments = small_model(torch.tensor([seq]), tgt_in[:1])
            torch.testing.assert_close(logits[row], alone[0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(alignments[row, :, : len(seq)], alone_alignments[0], rtol=1e-5, atol=1e-6)
            assert (alignments[row, :, len(seq):] == 0).all()


def test_seq2seq_rejects_bad_inputs(small_model):
    src = torch.randint(0, 10, (2, 4))
    with pytest.raises(ValueError, match="start with BOS"):
        small_model(src, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids"):
        small_model(src.float(), torch.full((2, 4), BOS))
    with pytest.raises(ValueError, match="right padding"):
        small_model(src, torch.full((2, 4), BOS), src_mask=torch.tensor([[False, True, True, True]] * 2))
    with pytest.raises(ValueError, match="n_steps"):
        small_model.greedy_decode(src, 0)


@pytest.fixture
def one_thread():
    """Tiny models train faster on one thread than on several contending for a busy CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def plain_additive_attention(query, keys, W_q, W_k, v):
    """The notebook's exercise solution, written independently of tfedu.rnn."""
    weights = torch.softmax(torch.tanh((query @ W_q.T)[:, None, :] + keys @ W_k.T) @ v, dim=-1)
    return (weights[:, :, None] * keys).sum(dim=1), weights


@pytest.mark.parametrize("attend", [None, plain_additive_attention], ids=["reference", "learner"])
def test_attention_model_learns_short_reversal_with_a_mirrored_alignment(one_thread, attend):
    # attend=plain_additive_attention is the notebook's USE_MY_ATTENTION = True path
    torch.manual_seed(0)
    model = rnn.Seq2Seq(rnn.Seq2SeqConfig(d_embed=16, d_hidden=32, d_attn=32, attention="luong"), attend=attend)
    g = torch.Generator().manual_seed(0)
    losses = rnn.train_seq2seq(model, lambda step: make_digit_batch(32, 4, g), steps=300, lr=1e-2)
    assert losses[-1] < 0.2 * losses[0]
    eval_g = torch.Generator().manual_seed(1)
    accuracy = rnn.accuracy_by_length(model, [4], lambda n: make_digit_batch(128, n, eval_g))[0]
    assert accuracy > 0.95
    src, _ = make_digit_batch(64, 4, eval_g)
    _, alignments = model.greedy_decode(src, 4)
    mirrored = torch.arange(3, -1, -1)
    assert (alignments.argmax(-1) == mirrored).float().mean() > 0.8


@pytest.mark.parametrize("radius", [0.5, 0.9, 1.2])
def test_linear_gradient_norms_are_exactly_geometric(radius, typechecked):
    norms = typechecked(rnn.gradient_norms_through_time)(radius, 20, d_hidden=8)
    expected = torch.tensor([radius ** t for t in range(1, 21)], dtype=torch.float64)
    torch.testing.assert_close(norms, expected, rtol=1e-9, atol=0)


@pytest.mark.parametrize("radius", [0.8, 1.0, 1.5])
def test_tanh_gradient_norms_never_exceed_the_linear_bound(radius):
    norms = rnn.gradient_norms_through_time(radius, 30, nonlinearity="tanh")
    bound = torch.tensor([radius ** t for t in range(1, 31)], dtype=torch.float64)
    assert (norms <= bound * (1 + 1e-9)).all()
    assert norms[-1] < bound[-1]  # saturation makes tanh strictly smaller


def test_gradient_norms_reject_bad_arguments():
    with pytest.raises(ValueError, match="nonlinearity"):
        rnn.gradient_norms_through_time(0.5, 3, nonlinearity="sigmoid")
    with pytest.raises(ValueError, match="radius > 0"):
        rnn.gradient_norms_through_time(-1.0, 3)


def test_longest_backward_path_counts_sequential_operations():
    x = torch.ones(3, requires_grad=True)
    assert rnn.longest_backward_path(x.exp().sin().sum()) == 3
    # parallel branches do not add up: the longest one counts
    assert rnn.longest_backward_path((x.exp() + x.sin().cos()).sum()) == 4
    with pytest.raises(ValueError, match="require grad"):
        rnn.longest_backward_path(torch.ones(2))


def test_longest_backward_path_grows_linearly_through_a_recurrence():
    W = torch.randn(4, 4, requires_grad=True)
    b = torch.zeros(4)
    depths = []
    for n in (5, 10, 20):
        states = rnn.run_rnn(torch.randn(1, n, 4), None, torch.eye(4), b, W, b)
        depths.append(rnn.longest_backward_path(states[:, -1].sum()))
    per_step = (depths[1] - depths[0]) / 5
    assert per_step > 0 and math.isclose(depths[2] - depths[1], 10 * per_step)


def test_learner_attend_function_gives_the_same_model_as_the_reference():
    torch.manual_seed(11)
    for kind in ("bahdanau", "luong"):
        cfg = rnn.Seq2SeqConfig(d_embed=8, d_hidden=12, d_attn=10, attention=kind)
        torch.manual_seed(12)
        ours = rnn.Seq2Seq(cfg)
        torch.manual_seed(12)
        learner = rnn.Seq2Seq(cfg, attend=plain_additive_attention)
        src, tgt = make_digit_batch(3, 5, torch.Generator().manual_seed(0))
        a, b = ours(src, teacher_forcing_inputs(tgt)), learner(src, teacher_forcing_inputs(tgt))
        torch.testing.assert_close(a[0], b[0])
        torch.testing.assert_close(a[1], b[1])
    with pytest.raises(ValueError, match="takes no mask"):
        learner.attention(torch.randn(1, 12), torch.randn(1, 2, 24), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention must be one of"):
        rnn.Seq2SeqConfig(attention="dot")


def test_bahdanau_scores_the_previous_state_and_luong_the_new_one():
    """Step 0: Bahdanau's weights come from s_0 (before the GRU step), Luong's from s_1 (after it)."""
    torch.manual_seed(13)
    src = torch.randint(0, 10, (2, 4))
    for kind in ("bahdanau", "luong"):
        model = rnn.Seq2Seq(rnn.Seq2SeqConfig(d_embed=8, d_hidden=12, d_attn=10, attention=kind))
        with torch.no_grad():
            _, alignments = model(src, torch.full((2, 1), BOS))
            states, summary = model.encode(src)
            s0 = torch.tanh(model.bridge(summary))
            token = model.tgt_embed(torch.full((2,), BOS))
            if kind == "bahdanau":
                query = s0
                context, _ = model.attention(s0, states)
                s1 = model.decoder(torch.cat([token, context], -1), s0)  # the context enters the GRU
            else:
                s1 = model.decoder(torch.cat([token, summary], -1), s0)
                query = s1
            _, want = rnn.additive_attention(query, states, model.attention.W_q.weight, model.attention.W_k.weight, model.attention.v)
            torch.testing.assert_close(alignments[:, 0], want)
            logits, _ = model(src, torch.full((2, 1), BOS))
            context, _ = model.attention(query, states)
            torch.testing.assert_close(logits[:, 0], model.unembed(torch.cat([s1, context], -1)))


@pytest.mark.parametrize("seed", range(3))
def test_lstm_cell_matches_torch_lstm_cell(seed, typechecked):
    torch.manual_seed(seed)
    oracle = nn.LSTMCell(5, 6)
    x, h, c = torch.randn(4, 5), torch.randn(4, 6), torch.randn(4, 6)
    got_h, got_c = typechecked(rnn.lstm_cell)(x, h, c, oracle.weight_ih, oracle.bias_ih, oracle.weight_hh, oracle.bias_hh)
    want_h, want_c = oracle(x, (h, c))
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_c, want_c, rtol=1e-5, atol=1e-6)


def test_lstm_cell_over_a_sequence_matches_torch_lstm():
    torch.manual_seed(14)
    oracle = nn.LSTM(3, 5, batch_first=True)
    x = torch.randn(2, 7, 3)
    expected, (h_n, c_n) = oracle(x)
    h, c = torch.zeros(2, 5), torch.zeros(2, 5)
    for t in range(7):
        h, c = rnn.lstm_cell(x[:, t], h, c, *torch_rnn_weights(oracle))
        torch.testing.assert_close(h, expected[:, t], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c, c_n[0], rtol=1e-5, atol=1e-6)


def test_lstm_cell_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"W_hh should have shape \(16, 4\)"):
        rnn.lstm_cell(torch.randn(2, 3), torch.randn(2, 4), torch.randn(2, 4), torch.randn(12, 3), torch.randn(12), torch.randn(12, 4), torch.randn(12))
    with pytest.raises(ValueError, match="c_prev should have shape"):
        rnn.lstm_cell(torch.randn(2, 3), torch.randn(2, 4), torch.randn(2, 5), torch.randn(16, 3), torch.randn(16), torch.randn(16, 4), torch.randn(16))


def test_relu_run_rnn_matches_torch_relu_rnn():
    torch.manual_seed(15)
    oracle = nn.RNN(3, 4, batch_first=True, nonlinearity="relu")
    x = torch.randn(2, 6, 3)
    torch.testing.assert_close(rnn.run_rnn(x, None, *torch_rnn_weights(oracle), nonlinearity="relu"), oracle(x)[0])


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu", "linear"])
def test_jacobian_norms_match_reverse_mode_jacobians(nonlinearity):
    W = rnn.initial_recurrent_matrix("default", 6, seed=1) * 2
    norms = rnn.jacobian_norms_through_time(W, 5, nonlinearity, seed=3)
    g = torch.Generator().manual_seed(3)  # the same draws as inside the function
    x = 0.5 * torch.randn(1, 5, 6, generator=g, dtype=torch.float64)
    h0 = 0.1 * torch.randn(1, 6, generator=g, dtype=torch.float64)
    zeros, eye = torch.zeros(6, dtype=torch.float64), torch.eye(6, dtype=torch.float64)
    J = torch.autograd.functional.jacobian(lambda h: rnn.run_rnn(x, h, eye, zeros, W, zeros, nonlinearity)[0], h0)
    torch.testing.assert_close(norms, torch.linalg.matrix_norm(J[:, :, 0, :], ord=2))


def test_linear_jacobian_norms_are_the_norms_of_matrix_powers():
    W = rnn.non_normal_matrix(0.9, 1.0, 8)
    norms = rnn.jacobian_norms_through_time(W, 30, "linear")
    want = torch.stack([torch.linalg.matrix_norm(torch.linalg.matrix_power(W, t), ord=2) for t in range(1, 31)])
    torch.testing.assert_close(norms, want)
    assert norms.max() > 3 and norms[-1] < norms.max() / 2  # transient growth, then decay at rate 0.9


def test_non_normal_matrix_spectrum():
    W = rnn.non_normal_matrix(0.8, 0.5, 6, seed=2)
    torch.testing.assert_close(torch.linalg.eigvals(W).abs(), torch.full((6,), 0.8, dtype=torch.float64), rtol=1e-4, atol=1e-4)
    assert torch.linalg.matrix_norm(W, ord=2) > 1 > 0.8
    with pytest.raises(ValueError, match="even"):
        rnn.non_normal_matrix(0.8, 0.5, 5)


def test_initial_recurrent_matrices():
    d = 64
    default = rnn.initial_recurrent_matrix("default", d)
    torch.manual_seed(0)
    assert default.abs().max() <= 1 / math.sqrt(d)  # nn.RNN's uniform(-1/sqrt(d), 1/sqrt(d))
    radius = torch.linalg.eigvals(default).abs().max().item()
    assert 0.4 < radius < 0.75  # about 1/sqrt(3) by the circular law
    Q = rnn.initial_recurrent_matrix("orthogonal", d)
    torch.testing.assert_close(Q @ Q.T, torch.eye(d, dtype=torch.float64))
    with pytest.raises(ValueError, match="init must be one of"):
        rnn.initial_recurrent_matrix("xavier")
