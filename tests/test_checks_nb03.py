import pytest
import torch

from tfedu import rnn, toy_tasks
from tfedu.checks import nb03_rnns_to_attention as nb03
from tfedu.checks.core import CheckFailure, ExerciseNotDone, run_probe

# ---- run_rnn: the reference passes, each realistic mistake is named ----


def loop_rnn(x, h0, W_xh, b_xh, W_hh, b_hh):
    """A plain learner solution, written the way the notebook asks."""
    h, states = h0, []
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] @ W_xh.T + b_xh + h @ W_hh.T + b_hh)
        states.append(h)
    return torch.stack(states, dim=1)


def test_reference_and_plain_loop_pass(capsys):
    nb03.check_run_rnn(rnn.run_rnn)
    nb03.check_run_rnn(loop_rnn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} Elman RNN recurrence") == 2


def no_tanh(x, h0, W_xh, b_xh, W_hh, b_hh):
    h, states = h0, []
    for t in range(x.shape[1]):
        h = x[:, t] @ W_xh.T + b_xh + h @ W_hh.T + b_hh
        states.append(h)
    return torch.stack(states, dim=1)


def h0_every_step(x, h0, W_xh, b_xh, W_hh, b_hh):
    states = []
    for t in range(x.shape[1]):
        states.append(torch.tanh(x[:, t] @ W_xh.T + b_xh + h0 @ W_hh.T + b_hh))
    return torch.stack(states, dim=1)


def appends_old_state(x, h0, W_xh, b_xh, W_hh, b_hh):
    h, states = h0, []
    for t in range(x.shape[1]):
        states.append(h)
        h = torch.tanh(x[:, t] @ W_xh.T + b_xh + h @ W_hh.T + b_hh)
    return torch.stack(states, dim=1)


def transposed_W_xh(x, h0, W_xh, b_xh, W_hh, b_hh):
    h, states = h0, []
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] @ W_xh + b_xh + h @ W_hh.T + b_hh)
        states.append(h)
    return torch.stack(states, dim=1)


def transposed_W_hh(x, h0, W_xh, b_xh, W_hh, b_hh):
    h, states = h0, []
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] @ W_xh.T + b_xh + h @ W_hh + b_hh)
        states.append(h)
    return torch.stack(states, dim=1)


def column_vectors(x, h0, W_xh, b_xh, W_hh, b_hh):
    # W @ x with x as a column: the maths as written, but both matrices end up transposed in row form
    h, states = h0, []
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] @ W_xh + b_xh + h @ W_hh + b_hh)
        states.append(h)
    return torch.stack(states, dim=1)


def missing_bias(x, h0, W_xh, b_xh, W_hh, b_hh):
    h, states = h0, []
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] @ W_xh.T + b_xh + h @ W_hh.T)
        states.append(h)
    return torch.stack(states, dim=1)


def final_only(x, h0, *weights):
    return loop_rnn(x, h0, *weights)[:, -1]


def stacked_dim0(x, h0, *weights):
    return loop_rnn(x, h0, *weights).transpose(0, 1)


def cell_rnn(step):
    """A learner loop around the cell ``step(x_t, h, W_xh, b_xh, W_hh, b_hh) -> h_t``."""

    def run(x, h0, W_xh, b_xh, W_hh, b_hh):
        h, states = h0, []
        for t in range(x.shape[1]):
            h = step(x[:, t], h, W_xh, b_xh, W_hh, b_hh)
            states.append(h)
        return torch.stack(states, dim=1)

    return run


missing_input_bias = cell_rnn(lambda x_t, h, W_xh, b_xh, W_hh, b_hh: torch.tanh(x_t @ W_xh.T + h @ W_hh.T + b_hh))
sigmoid_cell = cell_rnn(lambda x_t, h, W_xh, b_xh, W_hh, b_hh: torch.sigmoid(x_t @ W_xh.T + b_xh + h @ W_hh.T + b_hh))
tanh_on_input_only = cell_rnn(lambda x_t, h, W_xh, b_xh, W_hh, b_hh: torch.tanh(x_t @ W_xh.T + b_xh) + h @ W_hh.T + b_hh)


def one_step_short(x, h0, *weights):  # range(x.shape[1] - 1)
    return loop_rnn(x[:, :-1], h0, *weights)


def includes_h0(x, h0, *weights):
    return torch.cat([h0[:, None, :], loop_rnn(x, h0, *weights)], dim=1)


def cat_not_stack(x, h0, W_xh, b_xh, W_hh, b_hh):
    h, states = h0, []
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] @ W_xh.T + b_xh + h @ W_hh.T + b_hh)
        states.append(h)
    return torch.cat(states, dim=1)


def indexes_batch_not_time(x, h0, W_xh, b_xh, W_hh, b_hh):
    h, states = h0, []
    for t in range(x.shape[1]):
        h = torch.tanh(x[t] @ W_xh.T + b_xh + h @ W_hh.T + b_hh)
        states.append(h)
    return torch.stack(states, dim=1)


@pytest.mark.parametrize(
    "buggy, hint",
    [
        (no_tanh, "tanh is missing"),
        (h0_every_step, "every step used h_0 instead of h_{t-1}"),
        (appends_old_state, "shifted by one step"),
        (transposed_W_xh, "wrong orientation of W_xh"),
        (transposed_W_hh, "wrong orientation of W_hh"),
        (column_vectors, "both weight matrices are transposed"),
        (missing_bias, "a bias is missing"),
        (final_only, "returned only the final state"),
        (stacked_dim0, "stack along dim=1"),
        (missing_input_bias, "b_xh is the one left out"),
        (sigmoid_cell, "tanh, not sigmoid"),
        (tanh_on_input_only, "tanh must wrap the whole sum"),
        (one_step_short, "one state is missing"),
        (includes_h0, "you included h_0"),
        (cat_not_stack, "torch.cat joined the states"),
        (indexes_batch_not_time, "the input at step t is position t of the second axis (pos)"),
    ],
)
def test_rnn_mistakes_are_named(buggy, hint):
    with pytest.raises(CheckFailure) as info:
        nb03.check_run_rnn(buggy)
    assert hint in str(info.value)


def test_rnn_unfinished_exercise():
    def stub(x, h0, W_xh, b_xh, W_hh, b_hh):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb03.check_run_rnn(stub)


def test_rnn_crash_is_reported_as_a_hint():
    with pytest.raises(CheckFailure, match=r"run_rnn\(tensor\(2, 5, 4\)"):
        nb03.check_run_rnn(lambda x, h0, *w: x @ torch.ones(7, 7))


# ---- additive attention ----


def plain_attention(query, keys, W_q, W_k, v):
    scores = torch.tanh((query @ W_q.T)[:, None, :] + keys @ W_k.T) @ v
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bk,bkd->bd", weights, keys), weights


def test_attention_reference_and_plain_version_pass(capsys):
    nb03.check_additive_attention(rnn.additive_attention)
    nb03.check_additive_attention(plain_attention)
    assert capsys.readouterr().out.count("\N{CHECK MARK} Bahdanau additive attention") == 2


def attention_no_tanh(query, keys, W_q, W_k, v):
    weights = torch.softmax(((query @ W_q.T)[:, None, :] + keys @ W_k.T) @ v, dim=-1)
    return (weights[..., None] * keys).sum(1), weights


def attention_softmax_dim0(query, keys, W_q, W_k, v):
    weights = torch.softmax(torch.tanh((query @ W_q.T)[:, None, :] + keys @ W_k.T) @ v, dim=0)
    return (weights[..., None] * keys).sum(1), weights


def attention_no_softmax(query, keys, W_q, W_k, v):
    scores = torch.tanh((query @ W_q.T)[:, None, :] + keys @ W_k.T) @ v
    return (scores[..., None] * keys).sum(1), scores


def attention_projected_values(query, keys, W_q, W_k, v):
    projected = keys @ W_k.T
    weights = torch.softmax(torch.tanh((query @ W_q.T)[:, None, :] + projected) @ v, dim=-1)
    return (weights[..., None] * projected).sum(1), weights


def attention_transposed_W_q(query, keys, W_q, W_k, v):
    weights = torch.softmax(torch.tanh((query @ W_q)[:, None, :] + keys @ W_k.T) @ v, dim=-1)
    return (weights[..., None] * keys).sum(1), weights


def attention_dot_product(query, keys, W_q, W_k, v):
    weights = torch.softmax(torch.einsum("bd,bkd->bk", query, keys), dim=-1)
    return (weights[..., None] * keys).sum(1), weights


def attention_swapped_outputs(query, keys, W_q, W_k, v):
    context, weights = plain_attention(query, keys, W_q, W_k, v)
    return weights, context


def attention_weights_only(query, keys, W_q, W_k, v):
    return plain_attention(query, keys, W_q, W_k, v)[1]


def attention_from(score, normalise=lambda s: torch.softmax(s, dim=-1), pool=lambda wk: wk.sum(1)):
    """A learner attention built from its score, normalisation and pooling steps."""

    def attend(query, keys, W_q, W_k, v):
        weights = normalise(score(query, keys, W_q, W_k, v))
        return pool(weights[..., None] * keys), weights

    return attend


def additive_score(query, keys, W_q, W_k, v):
    return torch.tanh((query @ W_q.T)[:, None, :] + keys @ W_k.T) @ v


def attention_weights_matmul_keys(query, keys, W_q, W_k, v):
    """The natural slip: (batch, key_pos) @ (batch, key_pos, d_key) broadcasts to (batch, batch, d_key)."""
    weights = torch.softmax(additive_score(query, keys, W_q, W_k, v), dim=-1)
    return weights @ keys, weights


attention_mean_context = attention_from(additive_score, pool=lambda wk: wk.mean(1))
attention_keepdim_context = attention_from(additive_score, pool=lambda wk: wk.sum(1, keepdim=True))
attention_sigmoid_weights = attention_from(additive_score, normalise=torch.sigmoid)
attention_divide_by_sum = attention_from(additive_score, normalise=lambda s: s / s.sum(-1, keepdim=True))
attention_tanh_after_v = attention_from(lambda q, k, W_q, W_k, v: torch.tanh(((q @ W_q.T)[:, None, :] + k @ W_k.T) @ v))
attention_tanh_per_term = attention_from(
    lambda q, k, W_q, W_k, v: (torch.tanh(q @ W_q.T)[:, None, :] + torch.tanh(k @ W_k.T)) @ v
)
attention_no_key_axis = attention_from(lambda q, k, W_q, W_k, v: torch.tanh(q @ W_q.T + k @ W_k.T) @ v)


@pytest.mark.parametrize(
    "buggy, hint",
    [
        (attention_no_tanh, "tanh is missing"),
        (attention_softmax_dim0, "softmax runs over the batch"),
        (attention_no_softmax, "there is no softmax"),
        (attention_projected_values, "not of W_k h_j"),
        (attention_transposed_W_q, "wrong orientation of W_q"),
        (attention_dot_product, "dot-product attention"),
        (attention_swapped_outputs, "order (context, weights)"),
        (attention_weights_only, "should return a pair"),
        (attention_mean_context, "not the mean"),
        (attention_keepdim_context, "no keepdim=True"),
        (attention_sigmoid_weights, "not a sigmoid per position"),
        (attention_divide_by_sum, "exponentiate first"),
        (attention_tanh_after_v, "the tanh goes before v"),
        (attention_tanh_per_term, "one tanh over the sum"),
        (attention_no_key_axis, "give the query a key axis of size one in the middle"),
        (attention_weights_matmul_keys, "(batch, 1, key_pos) with (batch, key_pos, d_key)"),
    ],
)
def test_attention_mistakes_are_named(buggy, hint):
    with pytest.raises(CheckFailure) as info:
        nb03.check_additive_attention(buggy)
    assert hint in str(info.value)


def test_attention_unfinished_exercise():
    def stub(query, keys, W_q, W_k, v):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb03.check_additive_attention(stub)


# ---- probes: the reference under the learner's name reproduces the expected outputs ----



def assert_outputs_close(outputs, expected, probe):
    """The grader's verdict: the probe's own comparison (return type, values, gradients)."""
    assert probe.compare(outputs, expected) is None


def test_every_check_cell_has_a_probe():
    assert set(nb03.PROBES) == {"check_run_rnn", "check_lstm_cell", "check_additive_attention"}
    assert nb03.PROBES["check_lstm_cell"].exercise == "ex_lstm_cell"
    assert nb03.PROBES["check_run_rnn"].exercise == "ex_run_rnn"
    assert nb03.PROBES["check_additive_attention"].exercise == "ex_additive_attention"
    assert all("tfedu.rnn" in probe.forbidden for probe in nb03.PROBES.values())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("implementation", [rnn.run_rnn, loop_rnn])
def test_rnn_probe_agrees_with_reference(seed, implementation):
    probe = nb03.PROBES["check_run_rnn"]
    outputs, expected = run_probe(probe, {"run_rnn": implementation}, seed)
    assert_outputs_close(outputs, expected, probe)


@pytest.mark.parametrize("buggy", [no_tanh, appends_old_state, transposed_W_hh, missing_bias])
def test_rnn_probe_catches_mistakes(buggy):
    probe = nb03.PROBES["check_run_rnn"]
    outputs, expected = run_probe(probe, {"run_rnn": buggy}, 0)
    assert probe.compare(outputs, expected) is not None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("implementation", [rnn.additive_attention, plain_attention])
def test_attention_probe_agrees_with_reference(seed, implementation):
    probe = nb03.PROBES["check_additive_attention"]
    outputs, expected = run_probe(probe, {"additive_attention": implementation}, seed)
    assert_outputs_close(outputs, expected, probe)


@pytest.mark.parametrize("buggy", [attention_no_tanh, attention_softmax_dim0, attention_projected_values])
def test_attention_probe_catches_mistakes(buggy):
    probe = nb03.PROBES["check_additive_attention"]
    caught = False
    for seed in range(3):  # a draw with batch 1 cannot tell dim 0 from dim -1; over a few draws it must
        outputs, expected = run_probe(probe, {"additive_attention": buggy}, seed)
        caught |= probe.compare(outputs, expected) is not None
    assert caught


# ---- LSTM cell ----


def plain_lstm(x, h_prev, c_prev, W_ih, b_ih, W_hh, b_hh):
    """A learner solution written gate by gate."""
    i, f, g, o = (x @ W_ih.T + b_ih + h_prev @ W_hh.T + b_hh).chunk(4, dim=-1)
    c = torch.sigmoid(f) * c_prev + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def lstm_with(order="ifgo", acts="sstS", cell="f*c+i*g", out="o*tanh(c)", biases=("ih", "hh"), swap=False):
    """Build a buggy learner LSTM: gate order letters, activations (s sigmoid, t tanh) and update rules."""

    def step(x, h_prev, c_prev, W_ih, b_ih, W_hh, b_hh):
        pre = x @ W_ih.T + h_prev @ W_hh.T + (b_ih if "ih" in biases else 0) + (b_hh if "hh" in biases else 0)
        chunks = dict(zip(order, pre.chunk(4, dim=-1)))
        fn = {"s": torch.sigmoid, "t": torch.tanh}
        i, f, g, o = (fn[a.lower()](chunks[k]) for a, k in zip(acts, "ifgo"))
        c = eval(cell, {"f": f, "i": i, "g": g, "c": c_prev, "h": h_prev})
        h = eval(out, {"o": o, "c": c, "c_prev": c_prev, "torch": torch, "tanh": torch.tanh})
        return (c, h) if swap else (h, c)

    return step


def test_lstm_reference_and_plain_version_pass(capsys):
    nb03.check_lstm_cell(rnn.lstm_cell)
    nb03.check_lstm_cell(plain_lstm)
    assert capsys.readouterr().out.count("\N{CHECK MARK} LSTM cell") == 2


@pytest.mark.parametrize(
    "buggy, hint",
    [
        (lstm_with(cell="f*h+i*g"), "forget gate multiplies the old *cell* state"),
        (lstm_with(acts="ttst"), "sigmoid and tanh are swapped"),
        (lstm_with(acts="ssss"), "the candidate g is a tanh"),
        (lstm_with(order="ifog"), "you read them as i, f, o, g"),
        (lstm_with(order="igfo"), "TensorFlow's order"),
        (lstm_with(order="figo"), "you read them as f, i, g, o"),
        (lstm_with(out="tanh(c)"), "the output gate is missing"),
        (lstm_with(out="o*c"), "goes through a tanh before the output gate"),
        (lstm_with(out="o*tanh(c_prev)"), "uses the old cell state"),
        (lstm_with(cell="f*c+g"), "the input gate is missing"),
        (lstm_with(cell="c+i*g"), "the forget gate is missing"),
        (lstm_with(cell="f*c+(1-f)*g"), "that coupling is the GRU's"),
        (lstm_with(biases=("ih",)), "a bias is missing"),
        (lstm_with(biases=("hh",)), "b_ih is the one left out"),
        (lstm_with(swap=True), "order (h, c)"),
        (lambda *args: plain_lstm(*args)[0], "should return a pair"),
        (lambda x, h, c, W_ih, b_ih, W_hh, b_hh: x @ W_ih, "four gates along the last axis"),  # forgot the .T: a crash
    ],
)
def test_lstm_mistakes_are_named(buggy, hint):
    with pytest.raises(CheckFailure) as info:
        nb03.check_lstm_cell(buggy)
    assert hint in str(info.value)


def test_lstm_unfinished_exercise():
    def stub(x, h_prev, c_prev, W_ih, b_ih, W_hh, b_hh):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb03.check_lstm_cell(stub)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("implementation", [rnn.lstm_cell, plain_lstm])
def test_lstm_probe_agrees_with_reference(seed, implementation):
    probe = nb03.PROBES["check_lstm_cell"]
    outputs, expected = run_probe(probe, {"lstm_cell": implementation}, seed)
    assert_outputs_close(outputs, expected, probe)


@pytest.mark.parametrize("buggy", [lstm_with(cell="f*h+i*g"), lstm_with(order="ifog"), lstm_with(out="tanh(c)")])
def test_lstm_probe_catches_mistakes(buggy):
    probe = nb03.PROBES["check_lstm_cell"]
    outputs, expected = run_probe(probe, {"lstm_cell": buggy}, 0)
    assert probe.compare(outputs, expected) is not None


# ---- the USE_MY_ATTENTION switch really routes the experiment through the learner's function ----


def uniform_attention(query, keys, W_q, W_k, v):
    """A deliberately broken attention: every source position gets the same weight."""
    weights = torch.full(keys.shape[:2], 1 / keys.shape[1])
    return (weights[..., None] * keys).sum(1), weights


def notebook_train_model(use_my_attention: bool, additive_attention, steps: int):
    """The notebook's own train_model, defined from its cell with the switch set as given."""
    import time
    from pathlib import Path

    from tfedu.course import nbtools

    cell = next(c.source for c in nbtools.read(Path(__file__).parents[1] / "notebooks/03_rnns_to_attention.ipynb").cells
                if c.cell_type == "code" and "def train_model" in c.source)
    definitions = cell.split("\nmodels, losses = {}, {}")[0]  # everything above the training loop
    namespace = {"torch": torch, "tfr": rnn, "toy_tasks": toy_tasks, "time": time,
                 "USE_MY_ATTENTION": use_my_attention, "additive_attention": additive_attention}
    exec(definitions, namespace)
    namespace["TRAIN_STEPS"], namespace["BATCH"] = steps, 32  # a short run is enough to tell them apart
    return namespace["train_model"]


def test_use_my_attention_switch_runs_a_passing_function_and_falls_back_from_a_wrong_one(capsys):
    reference_model, reference_losses = notebook_train_model(False, uniform_attention, steps=5)("luong")
    calls = []

    def counted_attention(*args):
        calls.append(args[1].shape)
        return plain_attention(*args)

    _, right_model_losses = notebook_train_model(True, counted_attention, steps=5)("luong")
    assert any(shape[0] == 32 for shape in calls)  # the training batches went through the learner's function
    assert right_model_losses == pytest.approx(reference_losses, rel=1e-5)  # a correct function: same training
    assert "running your additive_attention" in capsys.readouterr().out

    wrong_model, wrong_losses = notebook_train_model(True, uniform_attention, steps=5)("luong")
    out = capsys.readouterr().out
    assert "does not pass exercise 3.3's check" in out and "USE_MY_ATTENTION = False" in out
    assert wrong_losses == pytest.approx(reference_losses, rel=1e-5)  # the wrong one is replaced by the reference
    src, _ = toy_tasks.make_digit_batch(2, 6, torch.Generator().manual_seed(0))
    _, align = wrong_model.greedy_decode(src, 6)
    assert not torch.allclose(align, torch.full_like(align, 1 / 6))  # so its alignments are not the uniform ones
