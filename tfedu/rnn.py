"""Recurrent networks, the seq2seq bottleneck, and Bahdanau's additive attention.

- ``rnn_cell`` / ``run_rnn``: the Elman recurrence h_t = tanh(W_xh x_t + b_xh + W_hh h_{t-1} + b_hh),
  with weights laid out like ``torch.nn.RNN`` (``weight_ih_l0`` is W_xh, shape (d_hidden, d_in)),
  so weights copy across unchanged.
- ``gru_cell``: the GRU update written out, in ``torch.nn.GRU``'s layout (gates stacked r, z, n).
- ``lstm_cell``: the LSTM update, in ``torch.nn.LSTM``'s layout (gates stacked i, f, g, o).
- ``additive_attention`` / ``AdditiveAttention``: score = v^T tanh(W_q s + W_k h) (Bahdanau et al.
  2015, sec. 3.1 and appendix A.1.2), softmax over source positions, context = sum of weighted h.
- ``Seq2Seq``: a GRU encoder-decoder, with the decoder fed either one fixed summary of the source
  (no attention) or a fresh attention context at every step; teacher forcing and greedy decoding.
- ``jacobian_norms_through_time`` (with ``scaled_orthogonal``, ``non_normal_matrix``,
  ``initial_recurrent_matrix``) and ``longest_backward_path``: the measurements behind the
  vanishing/exploding-gradient and sequential-dependency arguments.

Built by hand in notebooks/03_rnns_to_attention.ipynb.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from tfedu.toy_tasks import BOS, D_VOCAB, PAD, teacher_forcing_inputs

NONLINEARITIES = ("tanh", "relu", "linear")  # relu: the IRNN of Le et al. 2015


def _shape_error(name: str, expected: str, value: object) -> ValueError:
    got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    return ValueError(f"{name} should have shape {expected}, got {got}")


def _expect_tensor(name: str, value: object, dims: int, expected: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} should be a torch.Tensor of shape {expected}, got {type(value).__name__}")
    if value.dim() != dims:
        raise _shape_error(name, expected, value)
    if not value.is_floating_point():
        raise TypeError(f"{name} should be a floating-point tensor, got dtype {value.dtype}")


def _check_rnn_weights(W_xh, b_xh, W_hh, b_hh, d_in: int, gates: int = 1) -> int:
    """Validate torch-layout recurrent weights; return d_hidden."""
    _expect_tensor("W_hh", W_hh, 2, "(gates * d_hidden, d_hidden)")
    d_hidden = W_hh.shape[1]
    rows = gates * d_hidden
    if W_hh.shape[0] != rows:
        raise _shape_error("W_hh", f"({rows}, {d_hidden})", W_hh)
    _expect_tensor("W_xh", W_xh, 2, f"({rows}, d_in)")
    if W_xh.shape != (rows, d_in):
        raise _shape_error("W_xh", f"({rows}, {d_in}) (torch layout: rows are hidden units, columns inputs)", W_xh)
    for name, b in (("b_xh", b_xh), ("b_hh", b_hh)):
        _expect_tensor(name, b, 1, f"({rows},)")
        if b.shape != (rows,):
            raise _shape_error(name, f"({rows},)", b)
    return d_hidden


def rnn_cell(
    x: Float[Tensor, "batch d_in"],
    h_prev: Float[Tensor, "batch d_hidden"],
    W_xh: Float[Tensor, "d_hidden d_in"],
    b_xh: Float[Tensor, " d_hidden"],
    W_hh: Float[Tensor, "d_hidden d_hidden"],
    b_hh: Float[Tensor, " d_hidden"],
    nonlinearity: str = "tanh",
) -> Float[Tensor, "batch d_hidden"]:
    """One Elman step: h_t = tanh(W_xh x_t + b_xh + W_hh h_{t-1} + b_hh).

    Vectors are rows here (a batch of them), so W x becomes ``x @ W.T``: the torch layout stores
    W_xh as (d_hidden, d_in). ``nonlinearity="linear"`` drops the tanh (for the gradient experiment);
    ``"relu"`` is ``nn.RNN(nonlinearity="relu")``, the IRNN of Le et al. (2015) with W_hh = I.

    >>> W = torch.eye(2); b = torch.zeros(2)
    >>> rnn_cell(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), W, b, W, b)
    tensor([[0.7616, 0.7616]])
    """
    _expect_tensor("x", x, 2, "(batch, d_in)")
    _expect_tensor("h_prev", h_prev, 2, "(batch, d_hidden)")
    d_hidden = _check_rnn_weights(W_xh, b_xh, W_hh, b_hh, x.shape[1])
    if h_prev.shape != (x.shape[0], d_hidden):
        raise _shape_error("h_prev", f"({x.shape[0]}, {d_hidden})", h_prev)
    if nonlinearity not in NONLINEARITIES:
        raise ValueError(f"nonlinearity must be one of {NONLINEARITIES}, got {nonlinearity!r}")
    pre = x @ W_xh.T + b_xh + h_prev @ W_hh.T + b_hh  # batch d_hidden
    if nonlinearity == "tanh":
        return torch.tanh(pre)
    return torch.relu(pre) if nonlinearity == "relu" else pre


def run_rnn(
    x: Float[Tensor, "batch pos d_in"],
    h0: Float[Tensor, "batch d_hidden"] | None,
    W_xh: Float[Tensor, "d_hidden d_in"],
    b_xh: Float[Tensor, " d_hidden"],
    W_hh: Float[Tensor, "d_hidden d_hidden"],
    b_hh: Float[Tensor, " d_hidden"],
    nonlinearity: str = "tanh",
) -> Float[Tensor, "batch pos d_hidden"]:
    """Run the Elman recurrence over a sequence; return every hidden state h_1 .. h_T.

    Slot t of the output holds h_{t+1}, the state *after* reading x_t (as ``torch.nn.RNN``'s
    output does); the last slot is the final state. ``h0=None`` starts from zeros.

    >>> W = torch.full((1, 1), 0.5); b = torch.zeros(1)
    >>> run_rnn(torch.ones(1, 3, 1), None, W, b, W, b, nonlinearity="linear").flatten()
    tensor([0.5000, 0.7500, 0.8750])
    """
    _expect_tensor("x", x, 3, "(batch, pos, d_in)")
    batch, n_pos, d_in = x.shape
    d_hidden = _check_rnn_weights(W_xh, b_xh, W_hh, b_hh, d_in)
    h = x.new_zeros(batch, d_hidden) if h0 is None else h0
    _expect_tensor("h0", h, 2, f"({batch}, {d_hidden})")
    if h.shape != (batch, d_hidden):
        raise _shape_error("h0", f"({batch}, {d_hidden})", h)
    states = []
    for t in range(n_pos):  # strictly sequential: h_t needs h_{t-1}
        h = rnn_cell(x[:, t], h, W_xh, b_xh, W_hh, b_hh, nonlinearity)
        states.append(h)
    return torch.stack(states, dim=1)


def gru_cell(
    x: Float[Tensor, "batch d_in"],
    h_prev: Float[Tensor, "batch d_hidden"],
    W_ih: Float[Tensor, "3*d_hidden d_in"],
    b_ih: Float[Tensor, " 3*d_hidden"],
    W_hh: Float[Tensor, "3*d_hidden d_hidden"],
    b_hh: Float[Tensor, " 3*d_hidden"],
) -> Float[Tensor, "batch d_hidden"]:
    """One GRU step (Cho et al. 2014) in ``torch.nn.GRU``'s layout, gates stacked (r, z, n).

    r = sigmoid(W_ir x + b_ir + W_hr h + b_hr)      reset gate
    z = sigmoid(W_iz x + b_iz + W_hz h + b_hz)      update gate
    n = tanh(W_in x + b_in + r * (W_hn h + b_hn))   candidate state
    h' = (1 - z) * n + z * h

    The update gate lets h' copy h almost unchanged (z near 1), which is why gradients survive
    longer through a GRU than through the plain tanh recurrence.

    >>> d = 2; W_ih = torch.zeros(3 * d, d); W_hh = torch.zeros(3 * d, d); b = torch.zeros(3 * d)
    >>> gru_cell(torch.ones(1, d), torch.ones(1, d), W_ih, b, W_hh, b)  # z = 0.5, n = 0
    tensor([[0.5000, 0.5000]])
    """
    _expect_tensor("x", x, 2, "(batch, d_in)")
    _expect_tensor("h_prev", h_prev, 2, "(batch, d_hidden)")
    d_hidden = _check_rnn_weights(W_ih, b_ih, W_hh, b_hh, x.shape[1], gates=3)
    if h_prev.shape != (x.shape[0], d_hidden):
        raise _shape_error("h_prev", f"({x.shape[0]}, {d_hidden})", h_prev)
    from_x = x @ W_ih.T + b_ih  # batch 3*d_hidden
    from_h = h_prev @ W_hh.T + b_hh  # batch 3*d_hidden
    x_r, x_z, x_n = from_x.chunk(3, dim=-1)
    h_r, h_z, h_n = from_h.chunk(3, dim=-1)
    r = torch.sigmoid(x_r + h_r)
    z = torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    return (1 - z) * n + z * h_prev


def lstm_cell(
    x: Float[Tensor, "batch d_in"],
    h_prev: Float[Tensor, "batch d_hidden"],
    c_prev: Float[Tensor, "batch d_hidden"],
    W_ih: Float[Tensor, "4*d_hidden d_in"],
    b_ih: Float[Tensor, " 4*d_hidden"],
    W_hh: Float[Tensor, "4*d_hidden d_hidden"],
    b_hh: Float[Tensor, " 4*d_hidden"],
) -> tuple[Float[Tensor, "batch d_hidden"], Float[Tensor, "batch d_hidden"]]:
    """One LSTM step (Hochreiter & Schmidhuber 1997, with the forget gate of Gers et al. 2000) in
    ``torch.nn.LSTM``'s layout, gates stacked (i, f, g, o). Returns ``(h, c)``.

    i = sigmoid(W_ii x + b_ii + W_hi h + b_hi)     input gate: how much of the candidate to write
    f = sigmoid(W_if x + b_if + W_hf h + b_hf)     forget gate: how much of the old cell to keep
    g = tanh(W_ig x + b_ig + W_hg h + b_hg)        candidate values
    o = sigmoid(W_io x + b_io + W_ho h + b_ho)     output gate: how much of the cell to show
    c' = f * c + i * g,    h' = o * tanh(c')

    Along the cell state dc'/dc = diag(f): no weight matrix and no squashing, so with f near 1 the
    gradient passes many steps almost unchanged.

    >>> d = 1; W_ih = torch.zeros(4 * d, d); W_hh = torch.zeros(4 * d, d); b = torch.zeros(4 * d)
    >>> lstm_cell(torch.ones(1, d), torch.zeros(1, d), torch.ones(1, d), W_ih, b, W_hh, b)  # f = 0.5, g = 0
    (tensor([[0.2311]]), tensor([[0.5000]]))
    """
    _expect_tensor("x", x, 2, "(batch, d_in)")
    _expect_tensor("h_prev", h_prev, 2, "(batch, d_hidden)")
    _expect_tensor("c_prev", c_prev, 2, "(batch, d_hidden)")
    d_hidden = _check_rnn_weights(W_ih, b_ih, W_hh, b_hh, x.shape[1], gates=4)
    for name, state in (("h_prev", h_prev), ("c_prev", c_prev)):
        if state.shape != (x.shape[0], d_hidden):
            raise _shape_error(name, f"({x.shape[0]}, {d_hidden})", state)
    gates = x @ W_ih.T + b_ih + h_prev @ W_hh.T + b_hh  # batch 4*d_hidden
    i, f, g, o = gates.chunk(4, dim=-1)  # torch's order: input, forget, cell candidate, output
    c = torch.sigmoid(f) * c_prev + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


def additive_attention(
    query: Float[Tensor, "batch d_query"],
    keys: Float[Tensor, "batch key_pos d_key"],
    W_q: Float[Tensor, "d_attn d_query"],
    W_k: Float[Tensor, "d_attn d_key"],
    v: Float[Tensor, " d_attn"],
    mask: Bool[Tensor, "batch key_pos"] | None = None,
) -> tuple[Float[Tensor, "batch d_key"], Float[Tensor, "batch key_pos"]]:
    """Bahdanau attention: score_j = v^T tanh(W_q s + W_k h_j), weights = softmax_j(score), context = sum_j weights_j h_j.

    ``query`` is the decoder state s, ``keys`` the encoder states h_j (they are also the values).
    ``mask`` is True at real source positions; padded positions get weight exactly zero.
    Weights use torch's Linear layout (d_attn, d_in). Returns ``(context, weights)``.

    >>> keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    >>> context, weights = additive_attention(torch.zeros(1, 2), keys, torch.eye(2), torch.eye(2), torch.tensor([5.0, 0.0]))
    >>> weights.round(decimals=3), context.round(decimals=3)
    (tensor([[0.9780, 0.0220]]), tensor([[0.9780, 0.0220]]))
    """
    _expect_tensor("query", query, 2, "(batch, d_query)")
    _expect_tensor("keys", keys, 3, "(batch, key_pos, d_key)")
    batch, _, d_key = keys.shape
    if query.shape[0] != batch:
        raise ValueError(f"query has batch {query.shape[0]} but keys have batch {batch}")
    _expect_tensor("W_q", W_q, 2, "(d_attn, d_query)")
    if W_q.shape[1] != query.shape[1]:
        raise _shape_error("W_q", f"(d_attn, {query.shape[1]})", W_q)
    d_attn = W_q.shape[0]
    _expect_tensor("W_k", W_k, 2, f"({d_attn}, {d_key})")
    if W_k.shape != (d_attn, d_key):
        raise _shape_error("W_k", f"({d_attn}, {d_key})", W_k)
    _expect_tensor("v", v, 1, f"({d_attn},)")
    if v.shape != (d_attn,):
        raise _shape_error("v", f"({d_attn},)", v)
    return _attend(query @ W_q.T, keys @ W_k.T, keys, v, mask)


def _attend(
    projected_query: Tensor, projected_keys: Tensor, keys: Tensor, v: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    # broadcast the one query against every source position: batch 1 d_attn + batch key_pos d_attn
    scores = torch.tanh(projected_query[:, None, :] + projected_keys) @ v  # batch key_pos
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != scores.shape:
            raise ValueError(f"mask should be a bool tensor of shape {tuple(scores.shape)} (True = real position), got {_describe(mask)}")
        if not mask.any(dim=-1).all():
            raise ValueError("mask hides every source position of some row: nothing to attend to")
        scores = scores.masked_fill(~mask, float("-inf"))  # exp(-inf) = 0: padding gets no weight
    weights = torch.softmax(scores, dim=-1)  # batch key_pos, normalised over source positions
    context = (weights[:, :, None] * keys).sum(dim=1)  # batch d_key
    return context, weights


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    return type(value).__name__


AttentionFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


class AdditiveAttention(nn.Module):
    """Bahdanau attention with learned W_q, W_k (no bias, as in the paper) and v.

    ``project_keys`` can be called once per source sequence and reused at every decoder step
    (Bahdanau et al. note this saves computation: W_k h_j does not depend on the decoder).
    ``attend``, if given, replaces :func:`additive_attention`: any function with its signature
    ``(query, keys, W_q, W_k, v) -> (context, weights)``, such as a learner's own (no mask then).

    >>> attn = AdditiveAttention(d_query=4, d_key=3, d_attn=5)
    >>> context, weights = attn(torch.randn(2, 4), torch.randn(2, 6, 3))
    >>> context.shape, weights.shape
    (torch.Size([2, 3]), torch.Size([2, 6]))
    """

    def __init__(self, d_query: int, d_key: int, d_attn: int, attend: AttentionFn | None = None) -> None:
        super().__init__()
        if attend is not None and not callable(attend):
            raise TypeError(f"attend must be a function (query, keys, W_q, W_k, v) -> (context, weights), got {type(attend).__name__}")
        self.W_q = nn.Linear(d_query, d_attn, bias=False)
        self.W_k = nn.Linear(d_key, d_attn, bias=False)
        self.v = nn.Parameter(torch.randn(d_attn) / math.sqrt(d_attn))
        self.attend = attend

    def project_keys(self, keys: Float[Tensor, "batch key_pos d_key"]) -> Float[Tensor, "batch key_pos d_attn"]:
        return self.W_k(keys)

    def forward(
        self,
        query: Float[Tensor, "batch d_query"],
        keys: Float[Tensor, "batch key_pos d_key"],
        mask: Bool[Tensor, "batch key_pos"] | None = None,
        projected_keys: Float[Tensor, "batch key_pos d_attn"] | None = None,
    ) -> tuple[Float[Tensor, "batch d_key"], Float[Tensor, "batch key_pos"]]:
        if self.attend is not None:
            if mask is not None:
                raise ValueError("a custom attend function takes no mask: use it on unpadded batches")
            result = self.attend(query, keys, self.W_q.weight, self.W_k.weight, self.v)
            if not (isinstance(result, (tuple, list)) and len(result) == 2):
                raise TypeError(f"attend must return (context, weights), got {type(result).__name__}")
            return result[0], result[1]
        if projected_keys is None:
            return additive_attention(query, keys, self.W_q.weight, self.W_k.weight, self.v, mask)
        return _attend(self.W_q(query), projected_keys, keys, self.v, mask)


ATTENTION_KINDS = ("none", "bahdanau", "luong")


@dataclass(frozen=True)
class Seq2SeqConfig:
    d_vocab: int = D_VOCAB  # source and target share the digit vocabulary (+ BOS, PAD)
    d_embed: int = 32  # token embedding width, encoder and decoder
    d_hidden: int = 64  # GRU state width
    d_attn: int = 64  # width of the additive-attention scoring layer
    # "bahdanau": c_t is scored against s_{t-1} and read by the GRU (Bahdanau et al. 2015, eq. 4, A.2.2);
    # "luong": c_t is scored against s_t, after the recurrence, and read by the output layer only
    # (Luong et al. 2015, sec. 3); "none": c_t is the fixed source summary at every step.
    attention: str = "bahdanau"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")


class Seq2Seq(nn.Module):
    """GRU encoder-decoder (Sutskever et al. 2014; Cho et al. 2014), optionally with additive attention.

    The encoder is a bidirectional GRU, as in Bahdanau et al. (2015, sec. 3.2): the annotation h_j
    of source position j concatenates a forward state (which has read x_1..x_j) and a backward state
    (x_j..x_T), so it is centred on x_j. The summary (both final states) starts the decoder through
    s_0 = tanh(W_s summary). Each decoder step reads the previous token y_{t-1} and a context c_t;
    the output layer reads [s_t; c_t]. Where c_t comes from is ``cfg.attention``:

    - ``"bahdanau"``: c_t = attend(s_{t-1}, h) and s_t = GRU([y_{t-1}; c_t], s_{t-1}), so the context
      enters the recurrence: s_t = g(y_{t-1}, s_{t-1}, c_t) (Bahdanau et al. 2015, eq. 4, appendix A.2.2).
    - ``"luong"``: s_t = GRU([y_{t-1}; summary], s_{t-1}) first, then c_t = attend(s_t, h), read only
      by the output layer (the order of Luong et al. 2015, sec. 3, with their "concat" score).
    - ``"none"``: c_t is the fixed summary at every step, in the GRU and the output: the bottleneck.

    We leave out the paper's deep-output layer (maxout, and y_{t-1} in the output).

    >>> model = Seq2Seq(Seq2SeqConfig(attention="bahdanau"))
    >>> src = torch.randint(0, 10, (2, 5))
    >>> logits, alignments = model(src, torch.full((2, 5), BOS))
    >>> logits.shape, alignments.shape
    (torch.Size([2, 5, 12]), torch.Size([2, 5, 5]))
    """

    def __init__(self, cfg: Seq2SeqConfig = Seq2SeqConfig(), attend: AttentionFn | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.src_embed = nn.Embedding(cfg.d_vocab, cfg.d_embed)
        self.tgt_embed = nn.Embedding(cfg.d_vocab, cfg.d_embed)
        d_annotation = 2 * cfg.d_hidden  # forward and backward encoder states side by side
        self.encoder = nn.GRU(cfg.d_embed, cfg.d_hidden, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(d_annotation, cfg.d_hidden)  # W_s: source summary -> first decoder state
        self.decoder = nn.GRUCell(cfg.d_embed + d_annotation, cfg.d_hidden)  # reads [token; context or summary]
        if cfg.attention == "none":
            if attend is not None:
                raise ValueError("attend was given but cfg.attention is 'none'")
            self.attention = None
        else:
            self.attention = AdditiveAttention(cfg.d_hidden, d_annotation, cfg.d_attn, attend)
        self.unembed = nn.Linear(cfg.d_hidden + d_annotation, cfg.d_vocab)  # reads [decoder state; context]

    def encode(
        self, src: Int[Tensor, "batch src_pos"], src_mask: Bool[Tensor, "batch src_pos"] | None = None
    ) -> tuple[Float[Tensor, "batch src_pos d_annotation"], Float[Tensor, "batch d_annotation"]]:
        """Annotations at every source position, and the summary: both directions' final states.

        With ``src_mask`` (right padding), the forward GRU stops at each row's last real token and
        the backward GRU starts there, so padding never enters a state; padded annotations are zero.
        """
        if not isinstance(src, torch.Tensor) or src.dim() != 2 or src.dtype != torch.long:
            raise ValueError(f"src should be a (batch, src_pos) tensor of token ids (torch.long), got {_describe(src)}")
        embedded = self.src_embed(src)  # batch src_pos d_embed
        if src_mask is None:
            states, final = self.encoder(embedded)  # final: 2 batch d_hidden (forward, backward)
            return states, torch.cat([final[0], final[1]], dim=-1)
        if src_mask.dtype != torch.bool or src_mask.shape != src.shape:
            raise ValueError(f"src_mask should be a bool tensor of shape {tuple(src.shape)}, got {_describe(src_mask)}")
        lengths = src_mask.sum(dim=1)
        if (lengths == 0).any() or not torch.equal(src_mask, torch.arange(src.shape[1]) < lengths[:, None]):
            raise ValueError("src_mask must mark a non-empty prefix of each row (right padding)")
        packed = nn.utils.rnn.pack_padded_sequence(embedded, lengths.cpu(), batch_first=True, enforce_sorted=False)
        packed_states, final = self.encoder(packed)
        states, _ = nn.utils.rnn.pad_packed_sequence(packed_states, batch_first=True, total_length=src.shape[1])
        return states, torch.cat([final[0], final[1]], dim=-1)

    def _decode_step(self, token, state, enc_states, enc_summary, projected_keys, src_mask):
        embedded = self.tgt_embed(token)  # batch d_embed
        kind = self.cfg.attention
        weights = None
        if kind == "bahdanau":
            # c_t is chosen by s_{t-1}, before the step, and read by the recurrence: s_t = g(y_{t-1}, s_{t-1}, c_t)
            context, weights = self.attention(state, enc_states, src_mask, projected_keys)
            state = self.decoder(torch.cat([embedded, context], dim=-1), state)
        else:
            # Cho et al. (2014) feed the fixed summary at every step; Luong's recurrence reads no context
            state = self.decoder(torch.cat([embedded, enc_summary], dim=-1), state)
            if kind == "luong":  # c_t is chosen by the new state s_t, after the recurrence
                context, weights = self.attention(state, enc_states, src_mask, projected_keys)
            else:
                context = enc_summary  # the same fixed vector at every step: the bottleneck
        logits = self.unembed(torch.cat([state, context], dim=-1))  # batch d_vocab
        return logits, state, weights

    def _run_decoder(self, src, src_mask, n_steps: int, next_token: Callable[[int, Tensor], Tensor]):
        enc_states, enc_final = self.encode(src, src_mask)
        use_cache = self.attention is not None and self.attention.attend is None
        projected_keys = self.attention.project_keys(enc_states) if use_cache else None
        token = torch.full((src.shape[0],), BOS, dtype=torch.long, device=src.device)
        state = torch.tanh(self.bridge(enc_final))  # s_0
        all_logits, all_weights = [], []
        for t in range(n_steps):
            logits, state, weights = self._decode_step(token, state, enc_states, enc_final, projected_keys, src_mask)
            all_logits.append(logits)
            all_weights.append(weights)
            token = next_token(t, logits)
        logits = torch.stack(all_logits, dim=1)  # batch tgt_pos d_vocab
        alignments = None if self.attention is None else torch.stack(all_weights, dim=1)  # batch tgt_pos src_pos
        return logits, alignments

    def forward(
        self,
        src: Int[Tensor, "batch src_pos"],
        tgt_in: Int[Tensor, "batch tgt_pos"],
        src_mask: Bool[Tensor, "batch src_pos"] | None = None,
    ) -> tuple[Float[Tensor, "batch tgt_pos d_vocab"], Float[Tensor, "batch tgt_pos src_pos"] | None]:
        """Teacher forcing: the decoder reads the true previous target token ``tgt_in`` (BOS first)."""
        if not isinstance(tgt_in, torch.Tensor) or tgt_in.dim() != 2 or tgt_in.shape[0] != src.shape[0]:
            raise ValueError(f"tgt_in should be a (batch, tgt_pos) tensor with batch {src.shape[0]}, got {_describe(tgt_in)}")
        if not torch.all(tgt_in[:, 0] == BOS):
            raise ValueError("tgt_in should start with BOS: build it with toy_tasks.teacher_forcing_inputs(tgt)")
        # next_token ignores the prediction and feeds the true token
        return self._run_decoder(src, src_mask, tgt_in.shape[1], lambda t, _logits: tgt_in[:, min(t + 1, tgt_in.shape[1] - 1)])

    @torch.no_grad()
    def greedy_decode(
        self, src: Int[Tensor, "batch src_pos"], n_steps: int, src_mask: Bool[Tensor, "batch src_pos"] | None = None
    ) -> tuple[Int[Tensor, "batch tgt_pos"], Float[Tensor, "batch tgt_pos src_pos"] | None]:
        """Generate ``n_steps`` tokens, each time feeding back the most likely one; return tokens and alignments."""
        if not isinstance(n_steps, int) or n_steps < 1:
            raise ValueError(f"n_steps must be a positive int, got {n_steps!r}")
        logits, alignments = self._run_decoder(src, src_mask, n_steps, lambda t, step_logits: step_logits.argmax(dim=-1))
        return logits.argmax(dim=-1), alignments


def train_seq2seq(
    model: Seq2Seq,
    make_batch: Callable[[int], tuple[Tensor, Tensor]],
    steps: int,
    lr: float = 3e-3,
    progress: bool = False,
) -> list[float]:
    """Train with teacher forcing and Adam; ``make_batch(step)`` returns ``(src, tgt)``. Returns the losses.

    Batches are one length each (no padding), so every target position counts in the loss.
    """
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    steps_iter = range(steps)
    if progress:
        from tqdm.auto import tqdm

        steps_iter = tqdm(steps_iter, desc=f"attention: {model.cfg.attention}")
    losses = []
    model.train()
    for step in steps_iter:
        src, tgt = make_batch(step)
        logits, _ = model(src, teacher_forcing_inputs(tgt))
        loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=PAD)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the exploding-gradient guard the notebook motivates
        optimiser.step()
        losses.append(loss.item())
    model.eval()
    return losses


def accuracy_by_length(
    model: Seq2Seq, lengths: list[int], make_batch: Callable[[int], tuple[Tensor, Tensor]]
) -> list[float]:
    """Greedy-decoding token accuracy for each source length; ``make_batch(length)`` returns ``(src, tgt)``."""
    accuracies = []
    for length in lengths:
        src, tgt = make_batch(length)
        predicted, _ = model.greedy_decode(src, tgt.shape[1])
        accuracies.append((predicted == tgt).float().mean().item())
    return accuracies


def jacobian_norms_through_time(
    W_hh: Float[Tensor, "d_hidden d_hidden"],
    n_steps: int,
    nonlinearity: str = "tanh",
    input_scale: float = 0.5,
    seed: int = 0,
) -> Float[Tensor, " n_steps"]:
    """Measure ||dh_t/dh_0||_2, the largest singular value of the Jacobian, for t = 1..n_steps.

    The RNN h_t = f(x_t + W_hh h_{t-1}) (W_xh = I, no bias) runs from a small random h_0 over random
    inputs of scale ``input_scale``. Automatic differentiation through ``run_rnn`` (forward mode, one
    tangent per unit of h_0) measures the whole matrix dh_t/dh_0 for every t. By the chain rule it is
    the product of the per-step Jacobians diag(f'(pre_s)) W_hh, so its norm is at most
    prod_s max|f'| * sigma_max(W_hh) <= sigma_max(W_hh)^t for tanh (Pascanu et al. 2013, sec. 3).
    Computed in float64.

    >>> jacobian_norms_through_time(0.5 * torch.eye(3), 3, nonlinearity="linear")
    tensor([0.5000, 0.2500, 0.1250], dtype=torch.float64)
    """
    if nonlinearity not in NONLINEARITIES:
        raise ValueError(f"nonlinearity must be one of {NONLINEARITIES}, got {nonlinearity!r}")
    if not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"n_steps must be a positive int, got {n_steps!r}")
    _expect_tensor("W_hh", W_hh, 2, "(d_hidden, d_hidden)")
    d_hidden = W_hh.shape[0]
    if W_hh.shape != (d_hidden, d_hidden):
        raise _shape_error("W_hh", f"({d_hidden}, {d_hidden})", W_hh)
    dtype = torch.float64  # growth to 1e17 and decay to 1e-18 both stay representable
    gen = torch.Generator().manual_seed(seed)
    W = W_hh.detach().to(dtype)
    zeros = torch.zeros(d_hidden, dtype=dtype)
    x = input_scale * torch.randn(1, n_steps, d_hidden, generator=gen, dtype=dtype)
    start = 0.1 * torch.randn(1, d_hidden, generator=gen, dtype=dtype)
    # Forward-mode autodiff: d_hidden identical copies of the sequence, copy i carrying the tangent e_i
    # on h_0, so the tangent of h_t in copy i is column i of dh_t/dh_0. One pass gives every t.
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        h0 = fwAD.make_dual(start.expand(d_hidden, d_hidden).clone(), torch.eye(d_hidden, dtype=dtype))
        states = run_rnn(x.expand(d_hidden, -1, -1), h0, torch.eye(d_hidden, dtype=dtype), zeros, W, zeros, nonlinearity)
        tangents = fwAD.unpack_dual(states).tangent  # copy pos d_hidden: tangents[i, t] = dh_t/dh_0 @ e_i
    jacobians = tangents.permute(1, 2, 0)  # pos d_hidden d_hidden: jacobians[t] = dh_{t+1}/dh_0
    norms = torch.linalg.matrix_norm(jacobians, ord=2)
    return norms


def scaled_orthogonal(radius: float, d_hidden: int = 32, seed: int = 0) -> Float[Tensor, "d_hidden d_hidden"]:
    """radius * Q with Q a random orthogonal matrix: every eigenvalue has modulus ``radius`` and every
    singular value equals ``radius``, so its powers have norm exactly radius^t (float64).

    >>> W = scaled_orthogonal(0.9, 4)
    >>> torch.linalg.svdvals(W).round(decimals=6)
    tensor([0.9000, 0.9000, 0.9000, 0.9000], dtype=torch.float64)
    """
    if not radius > 0 or not isinstance(d_hidden, int) or d_hidden < 1:
        raise ValueError(f"need radius > 0 and a positive int d_hidden, got radius={radius!r}, d_hidden={d_hidden!r}")
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d_hidden, d_hidden, generator=gen, dtype=torch.float64))
    return radius * Q


def non_normal_matrix(radius: float, coupling: float, d_hidden: int = 32, seed: int = 0) -> Float[Tensor, "d_hidden d_hidden"]:
    """A matrix whose eigenvalues all equal ``radius`` but whose largest singular value is bigger.

    Built from 2x2 blocks [[radius, coupling], [0, radius]] on the diagonal (d_hidden even), turned by
    a random orthogonal Q (Q^T B Q keeps eigenvalues and singular values). The powers of one block are
    [[r^t, t c r^(t-1)], [0, r^t]]: with r < 1 they still grow like t c r^(t-1) for a while, a
    transient that the spectral radius alone does not see (Pascanu et al. 2013, sec. 3.1).

    >>> W = non_normal_matrix(0.9, 1.0, 4)
    >>> torch.linalg.eigvals(W).abs().round(decimals=4).tolist(), round(torch.linalg.matrix_norm(W, ord=2).item(), 3)
    ([0.9, 0.9, 0.9, 0.9], 1.53)
    """
    if not isinstance(d_hidden, int) or d_hidden < 2 or d_hidden % 2:
        raise ValueError(f"d_hidden must be a positive even int, got {d_hidden!r}")
    block = torch.tensor([[radius, coupling], [0.0, radius]], dtype=torch.float64)
    B = torch.block_diag(*[block] * (d_hidden // 2))
    Q = scaled_orthogonal(1.0, d_hidden, seed)
    return Q.T @ B @ Q


INITS = ("default", "orthogonal", "identity")


def initial_recurrent_matrix(init: str, d_hidden: int = 32, seed: int = 0) -> Float[Tensor, "d_hidden d_hidden"]:
    """W_hh as an RNN starts training (float64).

    - ``"default"``: torch.nn.RNN's own, uniform in (-1/sqrt(d), 1/sqrt(d)): spectral radius about 1/sqrt(3);
    - ``"orthogonal"``: a random orthogonal matrix (Saxe et al. 2014): every singular value is 1;
    - ``"identity"``: the IRNN's W_hh = I, used with relu (Le et al. 2015).

    >>> initial_recurrent_matrix("identity", 2)
    tensor([[1., 0.],
            [0., 1.]], dtype=torch.float64)
    """
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if init == "identity":
        return torch.eye(d_hidden, dtype=torch.float64)
    if init == "orthogonal":
        return scaled_orthogonal(1.0, d_hidden, seed)
    gen = torch.Generator().manual_seed(seed)
    bound = 1 / math.sqrt(d_hidden)
    return (torch.rand(d_hidden, d_hidden, generator=gen, dtype=torch.float64) * 2 - 1) * bound


def gradient_norms_through_time(
    radius: float, n_steps: int, d_hidden: int = 32, nonlinearity: str = "linear", seed: int = 0
) -> Float[Tensor, " n_steps"]:
    """||dh_t/dh_0||_2 for t = 1..n_steps with W_hh = radius * Q (see :func:`scaled_orthogonal`).

    Every singular value of W_hh equals its spectral radius here, so for the linear recurrence the
    Jacobian W_hh^t has norm exactly radius^t: geometric shrinkage below one, growth above. tanh
    multiplies each step by diag(1 - h^2) <= 1, so its norms are at most radius^t.

    >>> norms = gradient_norms_through_time(0.5, 3)
    >>> norms.round(decimals=4)
    tensor([0.5000, 0.2500, 0.1250], dtype=torch.float64)
    """
    if not isinstance(n_steps, int) or n_steps < 1 or not radius > 0:
        raise ValueError(f"need n_steps >= 1 and radius > 0, got n_steps={n_steps!r}, radius={radius!r}")
    return jacobian_norms_through_time(scaled_orthogonal(radius, d_hidden, seed), n_steps, nonlinearity, seed=seed)


def longest_backward_path(output: Tensor) -> int:
    """The number of autograd operations on the longest path from ``output`` back to a leaf.

    Backpropagation must visit these one after another, so it counts the strictly sequential
    steps between an input and this output. A recurrence over T steps makes it grow like T.

    >>> x = torch.ones(2, requires_grad=True)
    >>> longest_backward_path(x.exp().sin().sum())
    3
    """
    if not isinstance(output, torch.Tensor) or output.grad_fn is None:
        raise ValueError("output must be a tensor produced by operations on tensors that require grad")
    depth: dict = {}
    stack = [(output.grad_fn, False)]
    while stack:  # iterative post-order walk: recursion would overflow on long recurrences
        node, children_done = stack.pop()
        if node in depth:
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if children_done:
            ops = [depth[c] for c in children]
            is_leaf = type(node).__name__ == "AccumulateGrad"
            depth[node] = (0 if is_leaf else 1) + max(ops, default=0)
            continue
        stack.append((node, True))
        stack.extend((child, False) for child in children if child not in depth)
    return depth[output.grad_fn]
