"""Checkers for notebooks/03_rnns_to_attention.ipynb: the Elman recurrence, the LSTM cell and Bahdanau attention."""

from __future__ import annotations

import numpy as np
import torch

from tfedu.checks.building_blocks import ACTIVATIONS, ELEMENTARY, SOFTMAX
from tfedu.checks.core import CheckFailure, Hints, Probe, call_learner, checker, compare, expect, is_close, seeded_randn
from tfedu.checks.probes import CLEANUP, HELPERS, as_array, backward, compare_outputs, leaf, upstream_like
from tfedu.rnn import additive_attention as reference_attention
from tfedu.rnn import lstm_cell as reference_lstm_cell
from tfedu.rnn import run_rnn as reference_run_rnn

RNN_ARGS = ("x", "h0", "W_xh", "b_xh", "W_hh", "b_hh")
ATTENTION_ARGS = ("query", "keys", "W_q", "W_k", "v")


RNN_ERROR_HINT = (
    "x has shape (batch, pos, d_in), so the input at step t is position t of the second axis (pos), taken for "
    "every sequence of the batch at once, shape (batch, d_in); indexing the first axis picks the t-th sequence "
    "of the batch instead"
)
ATTENTION_ERROR_HINT = (
    "the projected query has shape (batch, d_attn) and the projected keys (batch, key_pos, d_attn): give the "
    "query a key axis of size one in the middle, (batch, 1, d_attn), so it broadcasts against every key of its "
    "own sequence"
)


def _rnn_inputs(seed: int, batch: int, n_pos: int, d_in: int, d_hidden: int) -> dict[str, torch.Tensor]:
    shapes = {
        "x": (batch, n_pos, d_in),
        "h0": (batch, d_hidden),
        "W_xh": (d_hidden, d_in),
        "b_xh": (d_hidden,),
        "W_hh": (d_hidden, d_hidden),
        "b_hh": (d_hidden,),
    }
    return {name: seeded_randn(seed + i, *shape) * (0.7 if name == "W_hh" else 1.0) for i, (name, shape) in enumerate(shapes.items())}


def _loop(x, h0, step):
    """Run ``step(x_t, h_prev) -> h_t`` over the sequence, stacking the new states."""
    h, states = h0, []
    for t in range(x.shape[1]):
        h = step(x[:, t], h)
        states.append(h)
    return torch.stack(states, dim=1)


def rnn_mistakes(x, h0, W_xh, b_xh, W_hh, b_hh) -> dict[str, torch.Tensor]:
    """What the usual wrong recurrences return on these inputs, keyed by the hint that names them."""
    right = reference_run_rnn(x, h0, W_xh, b_xh, W_hh, b_hh)
    mistakes = {
        "tanh is missing: the new state is the tanh of the whole sum, input term, recurrent term and both biases; "
        "without it the recurrence is linear":
            reference_run_rnn(x, h0, W_xh, b_xh, W_hh, b_hh, nonlinearity="linear"),
        "every step used h_0 instead of h_{t-1}: carry the new state into the next step (update the state "
        "variable inside the loop)":
            torch.tanh(x @ W_xh.T + b_xh + (h0 @ W_hh.T + b_hh)[:, None, :]),
        "your outputs are shifted by one step: slot t must hold h_t, the state after reading x_t, not h_{t-1} "
        "(append the new state, not the old one)":
            torch.cat([h0[:, None, :], right[:, :-1]], dim=1),
        "wrong orientation of W_hh: with torch's layout (rows = hidden units) the recurrent term is h_{t-1} @ W_hh.T":
            _loop(x, h0, lambda x_t, h: torch.tanh(x_t @ W_xh.T + b_xh + h @ W_hh + b_hh)),
        "a bias is missing: the Elman cell adds both b_xh and b_hh":
            _loop(x, h0, lambda x_t, h: torch.tanh(x_t @ W_xh.T + b_xh + h @ W_hh.T)),
        "a bias is missing: the Elman cell adds both b_xh and b_hh (b_xh is the one left out)":
            _loop(x, h0, lambda x_t, h: torch.tanh(x_t @ W_xh.T + h @ W_hh.T + b_hh)),
        "the Elman cell squashes with tanh, not sigmoid: its states lie in (-1, 1)":
            _loop(x, h0, lambda x_t, h: torch.sigmoid(x_t @ W_xh.T + b_xh + h @ W_hh.T + b_hh)),
        "tanh must wrap the whole sum: the recurrent term and its bias go inside the tanh too, not added after it":
            _loop(x, h0, lambda x_t, h: torch.tanh(x_t @ W_xh.T + b_xh) + h @ W_hh.T + b_hh),
        "one state is missing: loop over all T positions (the length of x's pos axis), one new state per input x_t":
            right[:, :-1],
        "you included h_0 in the output: return only the new states h_1..h_T, one per input position":
            torch.cat([h0[:, None, :], right], dim=1),
        "torch.cat joined the states end to end: they need a new pos axis after the batch, (batch, pos, d_hidden)":
            right.reshape(right.shape[0], -1),
        "you returned only the final state; return every state h_1..h_T stacked to (batch, pos, d_hidden)":
            right[:, -1],
        "you stacked the states along dim 0 (pos, batch, d_hidden); stack along dim=1 to get (batch, pos, d_hidden)":
            right.transpose(0, 1),
    }
    if W_xh.shape[0] == W_xh.shape[1]:  # only a square W_xh lets the transposed product run
        mistakes["wrong orientation of W_xh: torch stores it as (d_hidden, d_in), so the input term is x_t @ W_xh.T"] = _loop(
            x, h0, lambda x_t, h: torch.tanh(x_t @ W_xh + b_xh + h @ W_hh.T + b_hh)
        )
        mistakes["both weight matrices are transposed: use x_t @ W_xh.T and h_{t-1} @ W_hh.T (torch layout)"] = _loop(
            x, h0, lambda x_t, h: torch.tanh(x_t @ W_xh + b_xh + h @ W_hh + b_hh)
        )
    return mistakes


@checker("Elman RNN recurrence")
def check_run_rnn(run_rnn) -> None:
    """Check ``run_rnn(x, h0, W_xh, b_xh, W_hh, b_hh) -> (batch, pos, d_hidden)`` against ``tfedu.rnn.run_rnn``."""
    for seed, (batch, n_pos, d_in, d_hidden) in ((0, (2, 5, 4, 4)), (10, (3, 6, 3, 5)), (20, (1, 1, 2, 3))):
        inputs = _rnn_inputs(seed, batch, n_pos, d_in, d_hidden)
        args = [inputs[name] for name in RNN_ARGS]
        compare(
            call_learner(run_rnn, *args, name="run_rnn", error_hint=RNN_ERROR_HINT),
            reference_run_rnn(*args),
            what=f"run_rnn on x of shape {(batch, n_pos, d_in)} with d_hidden={d_hidden}",
            mistakes=rnn_mistakes(*args),
        )
    # Agreement with torch.nn.RNN given the same weights: the layouts match by design.
    torch.manual_seed(0)
    oracle = torch.nn.RNN(3, 4, batch_first=True)
    x, h0 = seeded_randn(30, 2, 4, 3), seeded_randn(31, 2, 4)
    with torch.no_grad():
        expected, _ = oracle(x, h0[None])
        got = call_learner(run_rnn, x, h0, oracle.weight_ih_l0, oracle.bias_ih_l0, oracle.weight_hh_l0, oracle.bias_hh_l0, name="run_rnn")
    compare(got, expected, what="run_rnn with weights copied from torch.nn.RNN", check_dtype=False)


LSTM_ARGS = ("x", "h_prev", "c_prev", "W_ih", "b_ih", "W_hh", "b_hh")
LSTM_ERROR_HINT = (
    "the two projections and their biases, added, have shape (batch, 4 * d_hidden): split that into the "
    "four gates along the last axis"
)


def _lstm_from_gates(x, h_prev, c_prev, W_ih, b_ih, W_hh, b_hh, order=(0, 1, 2, 3), cell=None, out=None, act=None):
    """An LSTM step with a chosen gate order and pluggable cell/output rules, for writing mistakes.

    ``order`` gives the chunk indices read as (i, f, g, o); ``act`` maps (i, f, g, o) pre-activations
    to gate values; ``cell(i, f, g, c_prev, h_prev)`` and ``out(o, c)`` replace the update rules.
    """
    chunks = (x @ W_ih.T + b_ih + h_prev @ W_hh.T + b_hh).chunk(4, dim=-1)
    pre = [chunks[k] for k in order]
    i, f, g, o = act(*pre) if act else (torch.sigmoid(pre[0]), torch.sigmoid(pre[1]), torch.tanh(pre[2]), torch.sigmoid(pre[3]))
    c = cell(i, f, g, c_prev, h_prev) if cell else f * c_prev + i * g
    h = out(o, c) if out else o * torch.tanh(c)
    return h, c


def lstm_mistakes(x, h_prev, c_prev, W_ih, b_ih, W_hh, b_hh) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What the usual wrong LSTM cells return, ``hint -> (h, c)``."""
    args = (x, h_prev, c_prev, W_ih, b_ih, W_hh, b_hh)

    def variant(**kw):
        return _lstm_from_gates(*args, **kw)

    order_hint = ("the gates are in the wrong order: torch.nn.LSTM stacks its weight rows as (input, forget, "
                  "cell candidate, output), so the four chunks are i, f, g, o in that order")
    mistakes = {
        "the forget gate multiplies the old *cell* state c_{t-1}, not the old hidden state h_{t-1}: it decides "
        "how much of the cell to keep":
            variant(cell=lambda i, f, g, c, h: f * h + i * g),
        "sigmoid and tanh are swapped: the gates i, f, o are sigmoids (values in (0, 1)) and the candidate g is a tanh":
            variant(act=lambda i, f, g, o: (torch.tanh(i), torch.tanh(f), torch.sigmoid(g), torch.tanh(o))),
        "the candidate g is a tanh (values in (-1, 1)), not a sigmoid: only i, f and o are gates":
            variant(act=lambda i, f, g, o: (torch.sigmoid(i), torch.sigmoid(f), torch.sigmoid(g), torch.sigmoid(o))),
        "the output gate is missing: the new hidden state is the output gate times the tanh of the new cell; "
        "the gate decides how much of the cell to show":
            variant(out=lambda o, c: torch.tanh(c)),
        "the new cell state goes through a tanh before the output gate scales it: the hidden state is the gate "
        "times the squashed cell, not times the raw cell":
            variant(out=lambda o, c: o * c),
        "the input gate is missing: the candidate g is scaled by the input gate i before it is added to the "
        "kept cell; the gate i scales what is written":
            variant(cell=lambda i, f, g, c, h: f * c + g),
        "the forget gate is missing: the old cell c_{t-1} is scaled by the forget gate f before the new "
        "candidate is added; the gate f scales what is kept":
            variant(cell=lambda i, f, g, c, h: c + i * g),
        "the LSTM has separate input and forget gates: the candidate is scaled by its own input gate i, not by "
        "one minus the forget gate (that coupling is the GRU's)":
            variant(cell=lambda i, f, g, c, h: f * c + (1 - f) * g),
        "the output uses the old cell state: the hidden state comes from the new cell c_t, the one this step "
        "just computed, not from c_{t-1}":
            (_output_from_old_cell(*args), reference_lstm_cell(*args)[1]),
        order_hint + " (you read them as i, f, o, g)": variant(order=(0, 1, 3, 2)),
        order_hint + " (you read them as i, g, f, o, TensorFlow's order)": variant(order=(0, 2, 1, 3)),
        order_hint + " (you read them as f, i, g, o)": variant(order=(1, 0, 2, 3)),
        order_hint + " (you read them as i, f, g, o from the wrong end)": variant(order=(3, 2, 1, 0)),
        "a bias is missing: the gates add both b_ih and b_hh (torch keeps two)":
            _lstm_no_bias(x, h_prev, c_prev, W_ih, b_ih, W_hh, b_hh, drop="b_hh"),
        "a bias is missing: the gates add both b_ih and b_hh (b_ih is the one left out)":
            _lstm_no_bias(x, h_prev, c_prev, W_ih, b_ih, W_hh, b_hh, drop="b_ih"),
    }
    return mistakes


def _output_from_old_cell(x, h_prev, c_prev, W_ih, b_ih, W_hh, b_hh):
    _, _, _, o = (x @ W_ih.T + b_ih + h_prev @ W_hh.T + b_hh).chunk(4, dim=-1)
    return torch.sigmoid(o) * torch.tanh(c_prev)


def _lstm_no_bias(x, h_prev, c_prev, W_ih, b_ih, W_hh, b_hh, drop):
    zero = torch.zeros_like(b_ih)
    return reference_lstm_cell(x, h_prev, c_prev, W_ih, zero if drop == "b_ih" else b_ih, W_hh, zero if drop == "b_hh" else b_hh)


def _lstm_inputs(seed: int, batch: int, d_in: int, d_hidden: int) -> dict[str, torch.Tensor]:
    shapes = {"x": (batch, d_in), "h_prev": (batch, d_hidden), "c_prev": (batch, d_hidden),
              "W_ih": (4 * d_hidden, d_in), "b_ih": (4 * d_hidden,), "W_hh": (4 * d_hidden, d_hidden), "b_hh": (4 * d_hidden,)}
    return {name: seeded_randn(seed + i, *shape) for i, (name, shape) in enumerate(shapes.items())}


@checker("LSTM cell")
def check_lstm_cell(lstm_cell) -> None:
    """Check ``lstm_cell(x, h_prev, c_prev, W_ih, b_ih, W_hh, b_hh) -> (h, c)`` against ``tfedu.rnn.lstm_cell``."""
    for seed, (batch, d_in, d_hidden) in ((0, (3, 4, 5)), (10, (2, 3, 3)), (20, (1, 2, 4))):
        inputs = _lstm_inputs(seed, batch, d_in, d_hidden)
        args = [inputs[name] for name in LSTM_ARGS]
        result = call_learner(lstm_cell, *args, name="lstm_cell", error_hint=LSTM_ERROR_HINT)
        expect(isinstance(result, (tuple, list)) and len(result) == 2,
               f"lstm_cell should return a pair (h, c), got {type(result).__name__}")
        expect(isinstance(result, tuple), "lstm_cell should return a tuple (h, c), got a list: return h, c")
        h, c = result
        want_h, want_c = reference_lstm_cell(*args)
        what = f"lstm_cell on x of shape {(batch, d_in)} with d_hidden={d_hidden}"
        if is_close(h, want_c) and is_close(c, want_h) and not is_close(want_h, want_c):
            raise CheckFailure("you returned (c, h); return them in the order (h, c), as torch.nn.LSTMCell does")
        mistakes = lstm_mistakes(*args)
        compare(c, want_c, what=f"the cell state c of {what}", mistakes={k: v[1] for k, v in mistakes.items()})
        compare(h, want_h, what=f"the hidden state h of {what}", mistakes={k: v[0] for k, v in mistakes.items()})
    # Agreement with torch.nn.LSTMCell given the same weights: the layouts match by design.
    torch.manual_seed(0)
    oracle = torch.nn.LSTMCell(3, 4)
    x, h0, c0 = seeded_randn(30, 2, 3), seeded_randn(31, 2, 4), seeded_randn(32, 2, 4)
    with torch.no_grad():
        want_h, want_c = oracle(x, (h0, c0))
        h, c = call_learner(lstm_cell, x, h0, c0, oracle.weight_ih, oracle.bias_ih, oracle.weight_hh, oracle.bias_hh, name="lstm_cell")
    compare(c, want_c, what="the cell state with weights copied from torch.nn.LSTMCell", check_dtype=False)
    compare(h, want_h, what="the hidden state with weights copied from torch.nn.LSTMCell", check_dtype=False)


def attention_mistakes(query, keys, W_q, W_k, v) -> dict[str, dict[str, torch.Tensor]]:
    """Wrong (weights, context) pairs, keyed by the hint; each value holds the wrong 'weights' and/or 'context'."""
    pre = query[:, None, :] @ W_q.T + keys @ W_k.T  # batch key_pos d_attn
    scores = torch.tanh(pre) @ v  # batch key_pos
    weights = torch.softmax(scores, dim=-1)

    def context_of(w):
        return (w[:, :, None] * keys).sum(dim=1)

    no_tanh = torch.softmax(pre @ v, dim=-1)
    over_batch = torch.softmax(scores, dim=0)
    mistakes = {
        "tanh is missing: the score of key j is v against the tanh of the two projections added together; "
        "without it the score is linear in s and h_j": {
            "weights": no_tanh, "context": context_of(no_tanh)},
        "the softmax runs over the batch (dim 0); normalise over the source positions, dim=-1": {
            "weights": over_batch, "context": context_of(over_batch)},
        "there is no softmax: the weights must be softmax(scores) over source positions, non-negative and summing to one": {
            "weights": scores, "context": context_of(scores)},
        "the context should be the weighted sum of the keys h_j (the encoder states), not of W_k h_j": {
            "context": (weights[:, :, None] * (keys @ W_k.T)).sum(dim=1)},
        "you summed over the wrong axis: the context adds up the weighted keys over the source positions j, "
        "the key_pos axis (dim 1), not over their features": {
            "context": (weights[:, :, None] * keys).sum(dim=-1)},
        "the weights already sum to one: the context is their weighted sum over positions, not the mean": {
            "context": (weights[:, :, None] * keys).mean(dim=1)},
        "weights @ keys multiplies a (batch, key_pos) matrix with every batch's keys, crossing the batches: give "
        "the weights a key axis so each row multiplies its own keys, a batched product of (batch, 1, key_pos) "
        "with (batch, key_pos, d_key), or take the weighted sum of the keys over key_pos": {
            "context": weights @ keys},
        "drop the summed axis: the context has shape (batch, d_key), so no keepdim=True": {
            "context": (weights[:, :, None] * keys).sum(dim=1, keepdim=True)},
        "the tanh goes before v: first the tanh of the summed projections (a d_attn vector for every key), then "
        "the product with v; not the tanh of that product": {
            "weights": (w := torch.softmax(torch.tanh(pre @ v), dim=-1)), "context": context_of(w)},
        "one tanh over the sum: add the projected query and the projected key first, then take one tanh; not "
        "a tanh of each projection added afterwards": {
            "weights": (w := torch.softmax((torch.tanh(query @ W_q.T)[:, None, :] + torch.tanh(keys @ W_k.T)) @ v, dim=-1)),
            "context": context_of(w)},
        "the weights come from a softmax over source positions, not a sigmoid per position: they must sum to one": {
            "weights": (w := torch.sigmoid(scores)), "context": context_of(w)},
        "scores can be negative, so dividing them by their sum is no distribution: exponentiate first (torch.softmax)": {
            "weights": (w := scores / scores.sum(dim=-1, keepdim=True)), "context": context_of(w)},
    }
    if W_q.shape[0] == W_q.shape[1]:
        wrong = torch.softmax(torch.tanh(query[:, None, :] @ W_q + keys @ W_k.T) @ v, dim=-1)
        mistakes["wrong orientation of W_q: torch's layout (d_attn, d_query) means query @ W_q.T"] = {
            "weights": wrong, "context": context_of(wrong)}
    if W_k.shape[0] == W_k.shape[1]:
        wrong = torch.softmax(torch.tanh(query[:, None, :] @ W_q.T + keys @ W_k) @ v, dim=-1)
        mistakes["wrong orientation of W_k: torch's layout (d_attn, d_key) means keys @ W_k.T"] = {
            "weights": wrong, "context": context_of(wrong)}
    if query.shape[-1] == keys.shape[-1]:
        dot = torch.softmax((keys @ query[:, :, None])[..., 0], dim=-1)
        mistakes["that is dot-product attention (s . h_j); Bahdanau's score is additive: v^T tanh(W_q s + W_k h_j)"] = {
            "weights": dot, "context": context_of(dot)}
    return mistakes


def _attention_inputs(seed: int, batch: int, n_keys: int, d_query: int, d_key: int, d_attn: int) -> dict[str, torch.Tensor]:
    shapes = {"query": (batch, d_query), "keys": (batch, n_keys, d_key), "W_q": (d_attn, d_query), "W_k": (d_attn, d_key), "v": (d_attn,)}
    return {name: seeded_randn(seed + i, *shape) for i, (name, shape) in enumerate(shapes.items())}


@checker("Bahdanau additive attention")
def check_additive_attention(additive_attention) -> None:
    """Check ``additive_attention(query, keys, W_q, W_k, v) -> (context, weights)`` against ``tfedu.rnn``."""
    cases = ((0, (2, 5, 4, 4, 4)), (10, (3, 7, 5, 6, 4)), (20, (1, 1, 3, 2, 5)))
    for seed, dims in cases:
        inputs = _attention_inputs(seed, *dims)
        args = [inputs[name] for name in ATTENTION_ARGS]
        result = call_learner(additive_attention, *args, name="additive_attention", error_hint=ATTENTION_ERROR_HINT)
        expect(
            isinstance(result, (tuple, list)) and len(result) == 2,
            f"additive_attention should return a pair (context, weights), got {type(result).__name__}",
        )
        expect(isinstance(result, tuple), "additive_attention should return a tuple (context, weights), got a list: return context, weights")
        context, weights = result
        want_context, want_weights = reference_attention(*args)
        mistakes = attention_mistakes(*args)
        what = "additive_attention(query {}, keys {})".format(tuple(args[0].shape), tuple(args[1].shape))
        if isinstance(weights, torch.Tensor) and weights.shape == want_context.shape != want_weights.shape:
            raise CheckFailure("you returned (weights, context); return them in the order (context, weights)")
        compare(weights, want_weights, what=f"the weights of {what}",
                mistakes={hint: wrong["weights"] for hint, wrong in mistakes.items() if "weights" in wrong})
        compare(context, want_context, what=f"the context of {what}",
                mistakes={hint: wrong["context"] for hint, wrong in mistakes.items() if "context" in wrong})


# ----------------------------------------------------------------------------- probes

# Exercise 3.1 says "do not call nn.RNN". The class is for the grader's scan; at run time the
# tripwire watches the module it lives in (a class call is no function call it could see) and
# the fused kernels nn.RNN runs.
RNN_SHORTCUTS = ("torch.nn.RNN", "torch.nn.RNNCell", "torch.nn.modules.rnn", "torch.rnn_tanh", "torch.rnn_tanh_cell")

HINT_PROBE_OVERFLOW = (
    "scores around 1e3 overflow exp (exp(89) is already inf in float32): use torch's softmax over the source "
    "positions, or subtract each row's max before exp if you wrote the softmax yourself"
)


def _draw(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _probe_rnn_inputs(rng: np.random.Generator) -> dict:
    # Sequences far longer than the check cell's (up to 40 steps), so a loop over a fixed range shows;
    # at least two, so a gradient cut between steps (h.detach()) shows too.
    batch, n_pos, d_in, d_hidden = (int(rng.integers(lo, hi)) for lo, hi in ((1, 4), (2, 41), (2, 6), (2, 7)))
    return {
        "x": _draw(rng, batch, n_pos, d_in),
        "h0": _draw(rng, batch, d_hidden),
        "W_xh": _draw(rng, d_hidden, d_in),
        "b_xh": _draw(rng, d_hidden),
        "W_hh": _draw(rng, d_hidden, d_hidden, scale=0.7),
        "b_hh": _draw(rng, d_hidden),
        "upstream": upstream_like(rng, (batch, n_pos, d_hidden)),
    }


def _probe_lstm_inputs(rng: np.random.Generator) -> dict:
    batch, d_in, d_hidden = (int(rng.integers(lo, hi)) for lo, hi in ((1, 5), (2, 9), (2, 9)))
    return {"x": _draw(rng, batch, d_in), "h_prev": _draw(rng, batch, d_hidden), "c_prev": _draw(rng, batch, d_hidden),
            "W_ih": _draw(rng, 4 * d_hidden, d_in), "b_ih": _draw(rng, 4 * d_hidden),
            "W_hh": _draw(rng, 4 * d_hidden, d_hidden), "b_hh": _draw(rng, 4 * d_hidden),
            "upstream_h": upstream_like(rng, (batch, d_hidden)), "upstream_c": upstream_like(rng, (batch, d_hidden))}


def _probe_attention_inputs(rng: np.random.Generator) -> dict:
    batch, n_keys, d_query, d_key, d_attn = (int(rng.integers(lo, hi)) for lo, hi in ((1, 4), (1, 21), (2, 6), (2, 6), (2, 6)))
    inputs = {"query": _draw(rng, batch, d_query), "keys": _draw(rng, batch, n_keys, d_key), "W_q": _draw(rng, d_attn, d_query),
              "W_k": _draw(rng, d_attn, d_key), "v": _draw(rng, d_attn),
              "upstream_context": upstream_like(rng, (batch, d_key)), "upstream_weights": upstream_like(rng, (batch, n_keys))}
    # Large scores, exact in float32: W_k x 1000 saturates tanh to exactly +-1 and v is integer, so each
    # score is a sum of +-v_i, in the hundreds. Key 0 (a scaled first basis vector, against a first column
    # of W_k of signs sign(v)) scores sum |v_i| >= 400: exp overflows there unless the max is subtracted.
    batch, n_keys, d_query, d_key, d_attn = (int(rng.integers(lo, hi)) for lo, hi in ((2, 5), (2, 21), (2, 6), (2, 6), (2, 6)))
    v = (rng.choice([-1, 1], size=d_attn) * rng.integers(200, 401, size=d_attn)).astype(np.float32)
    W_k = _draw(rng, d_attn, d_key, scale=1000.0)
    W_k[:, 0] = np.sign(v) * 1000.0
    keys = _draw(rng, batch, n_keys, d_key)
    keys[:, 0] = 0.0
    keys[:, 0, 0] = 1.0
    # Row 1's keys all score -sum |v_i| (<= -400), far below row 0's maximum: a softmax shifted by the
    # maximum of the whole tensor instead of each row's underflows to 0 / 0 there.
    keys[1] = 0.0
    keys[1, :, 0] = -1.0
    inputs.update(query_big=_draw(rng, batch, d_query), keys_big=keys, W_q_big=_draw(rng, d_attn, d_query), W_k_big=W_k, v_big=v)
    return inputs


RNN_RUN = HELPERS + """\
_leaves = {_name: torch.tensor(inputs[_name], requires_grad=True) for _name in ('x', 'h0', 'W_xh', 'b_xh', 'W_hh', 'b_hh')}
_result = run_rnn(*(_t.clone() for _t in _leaves.values()))
outputs = {'returned': [_kind(_result)], 'states': _array(_result),
           'grad': _backward([_result], [torch.from_numpy(inputs['upstream'])], _leaves)}
del _leaves, _result
""" + CLEANUP


def _rnn_reference(inputs: dict) -> dict:
    leaves = {name: leaf(inputs[name]) for name in RNN_ARGS}
    states = reference_run_rnn(*leaves.values())
    return {"returned": ["tensor"], "states": as_array(states),
            "grad": backward([states], [torch.from_numpy(inputs["upstream"])], leaves)}


LSTM_RUN = HELPERS + """\
_leaves = {_name: torch.tensor(inputs[_name], requires_grad=True) for _name in ('x', 'h_prev', 'c_prev', 'W_ih', 'b_ih', 'W_hh', 'b_hh')}
_result = lstm_cell(*(_t.clone() for _t in _leaves.values()))
_pair = _result if _kind(_result) == 'a tuple of two tensors' else (None, None)
outputs = {'returned': [_kind(_result)], 'h': _array(_pair[0]), 'c': _array(_pair[1]),
           'grad': _backward(list(_pair), [torch.from_numpy(inputs['upstream_h']), torch.from_numpy(inputs['upstream_c'])], _leaves)}
del _leaves, _result, _pair
""" + CLEANUP


def _lstm_reference(inputs: dict) -> dict:
    leaves = {name: leaf(inputs[name]) for name in LSTM_ARGS}
    h, c = reference_lstm_cell(*leaves.values())
    upstreams = [torch.from_numpy(inputs["upstream_h"]), torch.from_numpy(inputs["upstream_c"])]
    return {"returned": ["a tuple of two tensors"], "h": as_array(h), "c": as_array(c), "grad": backward([h, c], upstreams, leaves)}


ADDITIVE_RUN = HELPERS + """\
_leaves = {_name: torch.tensor(inputs[_name], requires_grad=True) for _name in ('query', 'keys', 'W_q', 'W_k', 'v')}
_result = additive_attention(*(_t.clone() for _t in _leaves.values()))
_big = additive_attention(*(torch.tensor(inputs[_name + '_big']) for _name in ('query', 'keys', 'W_q', 'W_k', 'v')))
_pairs = [_r if _kind(_r) == 'a tuple of two tensors' else (None, None) for _r in (_result, _big)]
outputs = {
    'returned': [_kind(_result), _kind(_big)],
    'context': _array(_pairs[0][0]), 'weights': _array(_pairs[0][1]),
    'context_big': _array(_pairs[1][0]), 'weights_big': _array(_pairs[1][1]),
    'grad': _backward(list(_pairs[0]), [torch.from_numpy(inputs['upstream_context']), torch.from_numpy(inputs['upstream_weights'])],
                      _leaves),
}
del _leaves, _result, _big, _pairs
""" + CLEANUP


def _additive_reference(inputs: dict) -> dict:
    leaves = {name: leaf(inputs[name]) for name in ATTENTION_ARGS}
    context, weights = reference_attention(*leaves.values())
    context_big, weights_big = reference_attention(*(torch.from_numpy(inputs[name + "_big"]) for name in ATTENTION_ARGS))
    upstreams = [torch.from_numpy(inputs["upstream_context"]), torch.from_numpy(inputs["upstream_weights"])]
    return {"returned": ["a tuple of two tensors"] * 2, "context": as_array(context), "weights": as_array(weights),
            "context_big": as_array(context_big), "weights_big": as_array(weights_big),
            "grad": backward([context, weights], upstreams, leaves)}


def _compare_additive(outputs: dict, expected: dict) -> str | None:
    got_context, got_weights = outputs.get("context"), outputs.get("weights")
    if (isinstance(got_context, np.ndarray) and isinstance(got_weights, np.ndarray)
            and got_context.shape == expected["weights"].shape != expected["context"].shape == got_weights.shape):
        return "additive_attention returned (weights, context); return them in the order (context, weights)"
    call = "additive_attention(query, keys, W_q, W_k, v)"
    return compare_outputs(
        outputs, expected, function="additive_attention",
        labels={"context": f"the context of {call}", "weights": f"the weights of {call}",
                "context_big": f"the context of {call} with scores around 1e3",
                "weights_big": f"the weights of {call} with scores around 1e3"},
        nan_hints={"context_big": HINT_PROBE_OVERFLOW, "weights_big": HINT_PROBE_OVERFLOW},
    )


PROBES = {
    "check_run_rnn": Probe(
        builds=ELEMENTARY | ACTIVATIONS,
        exercise="ex_run_rnn",
        make_inputs=_probe_rnn_inputs,
        run=RNN_RUN,
        reference=_rnn_reference,
        compare=lambda outputs, expected: compare_outputs(
            outputs, expected, function="run_rnn", labels={"states": "run_rnn(x, h0, W_xh, b_xh, W_hh, b_hh)"}),
        forbidden=("tfedu.rnn", *RNN_SHORTCUTS),
    ),
    "check_lstm_cell": Probe(
        builds=ELEMENTARY | ACTIVATIONS,
        exercise="ex_lstm_cell",
        make_inputs=_probe_lstm_inputs,
        run=LSTM_RUN,
        reference=_lstm_reference,
        compare=lambda outputs, expected: compare_outputs(
            outputs, expected, function="lstm_cell",
            labels={"h": "the hidden state h of lstm_cell", "c": "the cell state c of lstm_cell"}),
        # The exercise forbids nothing but the reference (its prose does not rule out nn.LSTMCell).
        forbidden=("tfedu.rnn",),
    ),
    "check_additive_attention": Probe(
        builds=ELEMENTARY | ACTIVATIONS | SOFTMAX,
        exercise="ex_additive_attention",
        make_inputs=_probe_attention_inputs,
        run=ADDITIVE_RUN,
        reference=_additive_reference,
        compare=_compare_additive,
        forbidden=("tfedu.rnn",),
    ),
}


# ----------------------------------------------------------------------------- hints

HINTS = {
    "ex_run_rnn": Hints(
        number="3.1",
        check="check_run_rnn",
        idea=(
            "An RNN reads the sequence one position at a time and carries one state. The new state h_t is the tanh "
            "of everything added together: what the input x_t brings (through W_xh, plus b_xh) and what the "
            "previous state h_{t-1} brings (through W_hh, plus b_hh). The same weights serve every step. The "
            "classic traps: feeding h_0 at every step instead of the state just computed, and storing the state "
            "from before the update; slot t of the output holds the state after reading x_t."
        ),
        approach=(
            "Start with the state equal to h0, shape (batch, d_hidden), and an empty list. Loop over the "
            "positions, as many as x's second axis (pos) has. At step t take the input at position t for the "
            "whole batch, shape (batch, d_in). The weights are in torch's layout (one row per hidden unit), so a "
            "batch of row vectors meets each matrix through its transpose: both terms come out (batch, d_hidden). "
            "Add the two biases, take the tanh, make the result the new state and append it to the list. After "
            "the loop, stack the T states along a new axis 1 (torch.stack, which adds an axis; torch.cat would "
            "join them end to end): (batch, pos, d_hidden)."
        ),
        skeleton=(
            "def run_rnn(x, h0, W_xh, b_xh, W_hh, b_hh):\n"
            "    h = h0  # (batch, d_hidden): the state before the first input\n"
            "    states = []\n"
            "    for t in range(____):  # one step per position\n"
            "        x_t = ____  # (batch, d_in): position t of every sequence\n"
            "        h = torch.tanh(____ + b_xh + ____ + b_hh)  # the input term and the recurrent term\n"
            "        states.append(____)  # the state after reading x_t\n"
            "    return torch.stack(states, dim=____)  # (batch, pos, d_hidden)\n"
        ),
    ),
    "ex_lstm_cell": Hints(
        number="3.2",
        check="check_lstm_cell",
        idea=(
            "One LSTM step computes four vectors from the same two inputs, x_t and h_{t-1}: three gates squashed "
            "by a sigmoid into (0, 1), input i, forget f and output o, and one candidate g squashed by a tanh into "
            "(-1, 1). The new cell keeps f of the old cell and adds i of the candidate; the new hidden state shows "
            "o of the tanh of the new cell. The forget gate scales the old cell state, never the hidden state. "
            "Torch stacks the four blocks of weight rows in the order i, f, g, o: read in another order (TensorFlow "
            "uses i, g, f, o) the cell still runs but computes something else."
        ),
        approach=(
            "One product for x (with the transpose of W_ih) and one for h_prev (with the transpose of W_hh), plus "
            "both biases, give all four pre-activations at once, shape (batch, 4 * d_hidden). Cut that last axis "
            "into four equal pieces of d_hidden (tensors have a method that splits into n chunks along an axis), "
            "in the order i, f, g, o. Apply a sigmoid to i, f and o and a tanh to g. The new cell, (batch, "
            "d_hidden), is the forget gate times c_prev plus the input gate times the candidate, elementwise. The "
            "new hidden state is the output gate times the tanh of the new cell (not of c_prev). Return h first, "
            "then c."
        ),
        skeleton=(
            "def lstm_cell(x, h_prev, c_prev, W_ih, b_ih, W_hh, b_hh):\n"
            "    gates = ____ + b_ih + ____ + b_hh  # (batch, 4 * d_hidden): all four pre-activations\n"
            "    i, f, g, o = gates.chunk(____, dim=____)  # torch's order: input, forget, candidate, output\n"
            "    i, f, o = ____, ____, ____  # the three gates, each in (0, 1)\n"
            "    g = ____  # the candidate, in (-1, 1)\n"
            "    c = ____ * c_prev + ____  # keep some of the old cell, write some of the candidate\n"
            "    h = ____  # show some of the new cell\n"
            "    return ____, ____\n"
        ),
    ),
    "ex_additive_attention": Hints(
        number="3.3",
        check="check_additive_attention",
        idea=(
            "Bahdanau's score asks a small one-hidden-layer network how well source position j matches what the "
            "decoder needs now: project the query and the key into the same d_attn space, add them, squash the sum "
            "with one tanh, and read it out with the vector v, one number per key. A softmax over the source "
            "positions (not over the batch) turns each row of scores into weights that are non-negative and sum "
            "to one. The context is the weighted sum of the keys themselves, the annotations h_j, not of their "
            "projections."
        ),
        approach=(
            "Project the query, (batch, d_query), with the transpose of W_q: (batch, d_attn). Project the keys, "
            "(batch, key_pos, d_key), with the transpose of W_k: (batch, key_pos, d_attn). To add the two, give "
            "the projected query a key axis of size one in the middle, (batch, 1, d_attn), so it broadcasts over "
            "the key positions of its own sequence; take the tanh. A product with v contracts d_attn: scores "
            "(batch, key_pos). The softmax over the last axis, key_pos, gives the weights. For the context, give "
            "the weights a trailing axis, (batch, key_pos, 1), multiply with the keys and sum over key_pos: "
            "(batch, d_key). Return the context first, then the weights."
        ),
        skeleton=(
            "def additive_attention(query, keys, W_q, W_k, v):\n"
            "    q_proj = ____  # (batch, 1, d_attn): the projected query, with a key axis to broadcast\n"
            "    k_proj = ____  # (batch, key_pos, d_attn)\n"
            "    scores = torch.tanh(____) @ ____  # (batch, key_pos)\n"
            "    weights = torch.softmax(scores, dim=____)  # over the source positions\n"
            "    context = (____ * keys).sum(dim=____)  # (batch, d_key): the weighted sum of the keys\n"
            "    return context, weights\n"
        ),
    ),
}
