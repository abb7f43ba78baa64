"""Counting floating-point operations (FLOPs) of the matrix multiplies in a Transformer.

One multiply-add is two FLOPs, so a matrix product (m, k) @ (k, n) costs 2 * m * k * n and a
linear layer applied to n vectors costs 2 * n * d_in * d_out (the bias adds are n * d_out,
a lower-order term we leave out, as torch's ``FlopCounterMode`` does). Matrix multiplies are
where almost all of a Transformer's arithmetic goes; the softmax is counted separately.

For a whole model, ``param_count`` and ``flops_per_token`` read the counts off a ``ModelConfig``
without building anything; ``training_compute`` is the C = 6ND rule of Kaplan et al. (2020).

Built by hand in notebooks/05_masks_and_heads.ipynb (multi-head attention costs about the
same as one full-width head); notebooks/07_transformer_block.ipynb adds the MLP and the
whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

from tfedu.activations import GATED
from tfedu.config import ModelConfig

SOFTMAX_OPS_PER_SCORE = 5  # max, subtract, exp, add to the sum, divide: one of each per score


def _count(name: str, value: object, *, allow_zero: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
        least = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {least} int, got {value!r}")
    return value


def matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs of (m, k) @ (k, n): m * n dot products of length k, each k multiplies and k adds.

    >>> matmul_flops(2, 3, 4)
    48
    """
    return 2 * _count("m", m, allow_zero=True) * _count("k", k, allow_zero=True) * _count("n", n, allow_zero=True)


def linear_flops(n: int, d_in: int, d_out: int) -> int:
    """FLOPs of a linear layer ``nn.Linear(d_in, d_out)`` applied to n vectors: 2 * n * d_in * d_out.

    >>> linear_flops(n=10, d_in=768, d_out=768)
    11796480
    """
    return 2 * _count("n", n, allow_zero=True) * _count("d_in", d_in) * _count("d_out", d_out)


@dataclass(frozen=True)
class AttentionFlops:
    """The FLOPs of one multi-head attention layer, term by term.

    Every field but ``softmax`` is a matrix multiply counted as 2 * m * k * n; ``softmax`` is
    ``SOFTMAX_OPS_PER_SCORE`` operations per attention score (an estimate, not a matmul).
    """

    q_proj: int  # x @ W_Q: batch * query_pos rows, d_model -> n_heads * d_head
    k_proj: int  # context @ W_K: batch * key_pos rows, kv_d_model -> n_heads * d_head
    v_proj: int  # context @ W_V, the same shape as k_proj
    scores: int  # q @ k^T per head: (query_pos, d_head) @ (d_head, key_pos)
    mix: int  # pattern @ v per head: (query_pos, key_pos) @ (key_pos, d_head)
    out_proj: int  # concat(heads) @ W_O: n_heads * d_head -> d_model
    softmax: int  # about SOFTMAX_OPS_PER_SCORE per score, batch * n_heads * query_pos * key_pos scores

    @property
    def matmul(self) -> int:
        """All matrix-multiply FLOPs (what torch's FlopCounterMode reports)."""
        return self.q_proj + self.k_proj + self.v_proj + self.scores + self.mix + self.out_proj

    @property
    def total(self) -> int:
        """Matrix multiplies plus the softmax estimate."""
        return self.matmul + self.softmax


def attention_flops(
    batch: int,
    query_pos: int,
    key_pos: int,
    d_model: int,
    n_heads: int,
    *,
    d_head: int | None = None,
    kv_d_model: int | None = None,
) -> AttentionFlops:
    """FLOPs of ``MultiHeadAttention(d_model, n_heads, d_head=..., kv_d_model=...)`` on one batch.

    Self-attention has key_pos == query_pos; cross-attention reads key_pos context vectors of
    width kv_d_model (default d_model). With d_head = d_model / n_heads (the default) the
    matmul count is

        8 * batch * pos * d_model**2  +  4 * batch * pos**2 * d_model

    for self-attention, whatever n_heads is: splitting into heads only cuts the width each
    head works in. Only the softmax term, batch * n_heads * pos**2 scores, grows with n_heads.

    >>> f = attention_flops(batch=1, query_pos=4, key_pos=4, d_model=8, n_heads=2)
    >>> f.matmul == 8 * 4 * 8**2 + 4 * 4**2 * 8
    True
    >>> f.matmul == attention_flops(1, 4, 4, 8, n_heads=1).matmul
    True
    """
    for name, value in (("batch", batch), ("query_pos", query_pos), ("key_pos", key_pos)):
        _count(name, value, allow_zero=True)
    _count("d_model", d_model)
    _count("n_heads", n_heads)
    if d_head is None:
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pass d_head explicitly")
        d_head = d_model // n_heads
    _count("d_head", d_head)
    kv_d_model = d_model if kv_d_model is None else _count("kv_d_model", kv_d_model)
    width = n_heads * d_head
    per_head_scores = matmul_flops(query_pos, d_head, key_pos)
    per_head_mix = matmul_flops(query_pos, key_pos, d_head)
    return AttentionFlops(
        q_proj=linear_flops(batch * query_pos, d_model, width),
        k_proj=linear_flops(batch * key_pos, kv_d_model, width),
        v_proj=linear_flops(batch * key_pos, kv_d_model, width),
        scores=batch * n_heads * per_head_scores,
        mix=batch * n_heads * per_head_mix,
        out_proj=linear_flops(batch * query_pos, width, d_model),
        softmax=SOFTMAX_OPS_PER_SCORE * batch * n_heads * query_pos * key_pos,
    )


def multi_head_overhead(batch: int, pos: int, d_model: int, n_heads: int) -> float:
    """Total FLOPs of n_heads heads of width d_model / n_heads over one head of width d_model.

    The matmuls cancel exactly; what is left is the extra softmax work, so the ratio is
    1 + a little (the FLOP widget in notebooks/05_masks_and_heads.ipynb plots it).

    >>> round(multi_head_overhead(batch=1, pos=1024, d_model=768, n_heads=12), 4)
    1.0072
    """
    _count("batch", batch)  # an empty batch or sequence costs nothing: no ratio to speak of
    _count("pos", pos)
    many = attention_flops(batch, pos, pos, d_model, n_heads)
    one = attention_flops(batch, pos, pos, d_model, 1)
    return many.total / one.total


@dataclass(frozen=True)
class LayerCost:
    """One row of Vaswani et al. (2017), Table 1, evaluated for given sizes (constants dropped, as there)."""

    per_layer: int  # complexity per layer: the arithmetic, up to a constant
    sequential: int  # operations that must run one after another
    max_path: int  # longest path a signal travels between any two positions


def layer_costs(n: int, d: int, k: int, r: int) -> dict[str, LayerCost]:
    """Vaswani et al. 2017, Table 1, for sequence length n, width d, kernel size k, neighbourhood r.

    =============================  ==========  ==========  =============
    layer type                     per layer   sequential  maximum path
    =============================  ==========  ==========  =============
    self-attention                 n^2 d       1           1
    recurrent                      n d^2       n           n
    convolutional                  k n d^2     1           log_k(n)
    self-attention (restricted)    r n d       1           n / r
    =============================  ==========  ==========  =============

    The convolutional path is for dilated convolutions (Kalchbrenner et al. 2016); a stack of plain
    (contiguous) kernels needs n / k layers instead. Paths are rounded up to whole layers.

    >>> costs = layer_costs(n=512, d=512, k=3, r=64)
    >>> costs["self-attention"].per_layer == costs["recurrent"].per_layer  # equal when n == d
    True
    >>> costs["convolutional"].max_path, costs["self-attention (restricted)"].max_path
    (6, 8)
    """
    for name, value in (("n", n), ("d", d), ("r", r)):
        _count(name, value)
    if _count("k", k) < 2:
        raise ValueError(f"k must be at least 2 for log_k(n), got {k}")
    log_k_n = 0
    while k**log_k_n < n:  # ceil(log_k n) in integers, free of float rounding
        log_k_n += 1
    return {
        "self-attention": LayerCost(per_layer=n * n * d, sequential=1, max_path=1),
        "recurrent": LayerCost(per_layer=n * d * d, sequential=n, max_path=n),
        "convolutional": LayerCost(per_layer=k * n * d * d, sequential=1, max_path=max(1, log_k_n)),
        "self-attention (restricted)": LayerCost(per_layer=r * n * d, sequential=1, max_path=-(-n // r)),
    }


# ----------------------------------------------------------------------------- whole models

MODEL_KINDS = ("gpt", "encoder", "encoder-decoder")


def _config(cfg: object) -> ModelConfig:
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"expected a tfedu.config.ModelConfig (e.g. preset('gpt2')), got {type(cfg).__name__}")
    return cfg


def _linear_params(cfg: ModelConfig, d_in: int, d_out: int) -> int:
    return d_in * d_out + (d_out if cfg.bias else 0)


def _attention_params(cfg: ModelConfig) -> int:
    """W_Q, W_K, W_V, W_O of one attention layer; K and V are n_kv_heads wide (grouped-query)."""
    d_q, d_kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    return (
        _linear_params(cfg, cfg.d_model, d_q)
        + 2 * _linear_params(cfg, cfg.d_model, d_kv)
        + _linear_params(cfg, d_q, cfg.d_model)
    )


def _mlp_params(cfg: ModelConfig) -> int:
    """W_in and W_out, plus W_gate for SwiGLU (Shazeer 2020, sec. 2: three matrices)."""
    if not cfg.has_mlp:
        return 0  # attention-only blocks
    n_in = 2 if cfg.activation in GATED else 1
    return n_in * _linear_params(cfg, cfg.d_model, cfg.d_mlp) + _linear_params(cfg, cfg.d_mlp, cfg.d_model)


def _norm_params(cfg: ModelConfig) -> int:
    """LayerNorm: a gain and (with bias) a shift per feature; RMSNorm only rescales, so never a bias."""
    return 2 * cfg.d_model if cfg.norm == "layer" and cfg.bias else cfg.d_model


@dataclass(frozen=True)
class ParamCount:
    """The parameters of a model, part by part (``param_count`` fills it in).

    ``total`` adds them all, each shared matrix once. ``non_embedding`` leaves out the token
    embedding(s), the unembedding and the position tables: the N of Kaplan et al. (2020), whose
    loss and compute laws are cleanest in it.
    """

    embedding: int  # token embedding W_E (d_vocab x d_model); encoder-decoder, untied: source + target
    positions: int  # learned position tables (n_ctx x d_model each); 0 for sinusoidal, rope, alibi, none
    attention: int  # self-attention W_Q, W_K, W_V, W_O (+ biases) of every block
    cross_attention: int  # decoder blocks' attention to the encoder output; 0 unless encoder-decoder
    mlp: int  # W_in, W_out (and W_gate for SwiGLU) (+ biases) of every block
    norms: int  # the norms inside every block, plus the final norm of each pre-norm stack
    unembedding: int  # W_U (d_model x d_vocab, no bias); 0 when tied to W_E
    router: int = 0  # a mixture of experts' routers, d_model x n_experts per block (tfedu.moe)
    mlp_inactive: int = 0  # the experts' parameters one token does not run through: (E - k) / E of mlp

    @property
    def total(self) -> int:
        """Every parameter, a shared one counted once."""
        return (self.embedding + self.positions + self.attention + self.cross_attention + self.mlp + self.norms
                + self.unembedding + self.router)

    @property
    def active(self) -> int:
        """The parameters one token uses: ``total`` less the experts it is not routed to (= total for a dense model)."""
        return self.total - self.mlp_inactive

    @property
    def non_embedding(self) -> int:
        """``total`` without the embedding, unembedding and position tables (Kaplan et al. 2020, sec. 2.1)."""
        return self.total - self.embedding - self.unembedding - self.positions


def param_count(cfg: ModelConfig, kind: str = "gpt") -> ParamCount:
    """The parameters of the ``kind`` of model that ``cfg`` describes, counted without building it.

    ``kind`` is ``"gpt"`` (decoder-only), ``"encoder"`` (BERT-style: the same parameters; its
    masked-language-model head is the unembedding, nothing more) or ``"encoder-decoder"`` (the
    2017 Transformer: n_layers encoder blocks and n_layers decoder blocks, each decoder block with
    a cross-attention and a third norm). Tied embeddings mean one matrix for everything that
    maps tokens to vectors and back: in the encoder-decoder, source, target and W_U (Vaswani et
    al. 2017, sec. 3.4). Learned positions there are one table shared by both stacks, as in
    ``tfedu.model.EncoderDecoder``.

    >>> from tfedu.config import preset
    >>> p = param_count(preset("gpt2"))
    >>> p.total, p.embedding, p.positions, p.unembedding  # GPT-2 small: 124M, W_U tied to W_E
    (124439808, 38597376, 786432, 0)
    >>> p.non_embedding  # Kaplan's N: 85M, blocks and final norm only
    85056000
    >>> param_count(preset("transformer-base"), kind="encoder-decoder").total  # the paper says 65M
    63082496

    Built up in notebooks/07_transformer_block.ipynb.
    """
    cfg = _config(cfg)
    if kind not in MODEL_KINDS:
        raise ValueError(f"kind={kind!r} is not one of {', '.join(map(repr, MODEL_KINDS))}")
    if getattr(cfg, "has_recurrent_layers", False):
        raise ValueError(f"param_count counts attention blocks; layer_types {cfg.layer_types} has recurrent layers, "
                         "whose parameters it does not model: count the built model's, sum(p.numel() for p in "
                         "model.parameters())")
    stacks = 2 if kind == "encoder-decoder" else 1
    table = cfg.d_vocab * cfg.d_model
    n_embeddings = 1 if cfg.tied_embeddings else stacks  # untied encoder-decoder: source and target tables
    decoder_blocks = cfg.n_layers if kind == "encoder-decoder" else 0
    # Post-norm blocks end in a norm already (norm(x + F(x))); pre-norm leaves the residual stream
    # unnormalised, so each pre-norm stack ends in one more (Radford et al. 2019, sec. 2.3).
    final_norms = stacks if cfg.norm_position == "pre" else 0
    n_experts = cfg.n_experts or 1
    mlp = stacks * cfg.n_layers * n_experts * _mlp_params(cfg)
    return ParamCount(
        embedding=n_embeddings * table,
        positions=cfg.n_ctx * cfg.d_model if cfg.positional == "learned" else 0,
        attention=stacks * cfg.n_layers * _attention_params(cfg),
        cross_attention=decoder_blocks * _attention_params(cfg),
        mlp=mlp,
        norms=(stacks * cfg.n_layers * (1 + cfg.has_mlp) * (1 + cfg.sandwich_norm) + decoder_blocks + final_norms)
        * _norm_params(cfg) + (stacks * cfg.n_layers + decoder_blocks) * 2 * cfg.d_head * cfg.qk_norm,  # (QK-norm: d_head each)
        unembedding=0 if cfg.tied_embeddings else table,
        router=stacks * cfg.n_layers * cfg.d_model * cfg.n_experts if cfg.n_experts else 0,
        mlp_inactive=mlp * (n_experts - cfg.top_k) // n_experts,
    )


def deck_param_count(cfg: ModelConfig) -> int:
    """Weights as the lecture deck counts them: the block matrices plus embedding and unembedding.

    The deck's table lists, per layer, the four attention matrices (Q, K, V, O: d_model x
    n_heads * d_head each; K and V are n_kv_heads wide here, for grouped-query models) and the
    MLP's up- and down-projection (d_model x d_mlp each; SwiGLU's gate is a third), and then
    the embedding and the unembedding, d_vocab x d_model each, counted *twice* even when they
    are one tied matrix. Left out: every bias, every norm, the learned position table.

    For GPT-3 (d_model 12288 = 96 heads x 128, d_mlp 4 x 12288, 96 layers, d_vocab 50257):

        Q, K, V, O    4 * 12288 * 12288 * 96  =  57,982,058,496
        up, down      2 * 12288 * 49152 * 96  = 115,964,116,992
        W_E, W_U      2 * 50257 * 12288       =   1,235,116,032
        total         12 d_model^2 n_layers + 2 d_vocab d_model = 175,181,291,520

    The exact count of ``preset("gpt3")`` (tied, like GPT-2) is 174,604,259,328, the 174,600M of
    Brown et al. (2020), table D.1. The deck's number differs in both directions: it counts W_U
    as a second d_vocab x d_model matrix (+617,558,016) and leaves out the biases (96 layers x 9
    x 12288 = 10,616,832: Q, K, V, O, W_out one d_model each, W_in four), the LayerNorms (96 x 2
    x 2 x 12288 + the final 2 x 12288 = 4,743,168) and the learned positions (2048 x 12288 =
    25,165,824). Untied, the exact count would be 175,221,817,344.

    >>> from tfedu.config import preset
    >>> deck_param_count(preset("gpt3"))
    175181291520
    >>> param_count(preset("gpt3")).total
    174604259328
    """
    cfg = _config(cfg)
    d_q, d_kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    n_mlp = 3 if cfg.activation in GATED else 2
    per_layer = cfg.d_model * (2 * d_q + 2 * d_kv) + n_mlp * cfg.d_model * cfg.d_mlp
    return cfg.n_layers * per_layer + 2 * cfg.d_vocab * cfg.d_model


@dataclass(frozen=True)
class FlopsPerToken:
    """Forward-pass FLOPs per token of a decoder-only model, term by term (``flops_per_token``).

    Matrix multiplies only, 2 FLOPs per multiply-add, as Kaplan et al. (2020), table 1, and
    torch's ``FlopCounterMode`` count: no bias adds, norms, softmax or activations.
    """

    embedding: int  # a table lookup: 0 (Kaplan's 4 d_model for adding positions is not a matmul)
    attention_proj: int  # x @ W_Q, W_K, W_V and heads @ W_O in every layer
    attention_scores: int  # q @ k^T against all n_ctx keys: 2 n_layers n_ctx n_heads d_head
    attention_mix: int  # pattern @ v over all n_ctx keys: as many again
    mlp: int  # W_in, W_out (and W_gate for SwiGLU) in every layer; top_k experts' worth in a mixture of experts
    unembedding: int  # the logits, x @ W_U: 2 d_model d_vocab
    router: int = 0  # a mixture of experts' router logits, x @ W_router: 2 d_model n_experts per layer

    @property
    def forward(self) -> int:
        """All forward FLOPs of one token."""
        return (self.embedding + self.attention_proj + self.attention_scores + self.attention_mix + self.mlp
                + self.unembedding + self.router)

    @property
    def training(self) -> int:
        """Forward plus backward: 3 x forward. The backward pass runs every matmul twice, once for the
        gradient with respect to its input (to pass back) and once for its weight (to update)."""
        return 3 * self.forward

    @property
    def training_with_recompute(self) -> int:
        """4 x forward: activation checkpointing throws activations away and reruns the forward in
        the backward pass, buying memory with one more forward (Chen et al. 2016)."""
        return 4 * self.forward


def flops_per_token(cfg: ModelConfig, n_ctx_used: int) -> FlopsPerToken:
    """Forward FLOPs per token of ``cfg``'s GPT (or encoder) when each token sees ``n_ctx_used`` positions.

    The weight matmuls cost 2 FLOPs per weight (one multiply-add per weight per token). The two
    n_ctx products are counted over the *full* n_ctx x n_ctx score matrix, masked half included,
    as a plain implementation (and ``FlopCounterMode``) computes it; a causal kernel that skips
    the masked half does about half. Kaplan et al. (2020), table 1, list one term for them,
    2 n_layers n_ctx d_attn (d_attn = n_heads d_head): that is ``attention_scores`` alone, or
    scores and mix over the causal half, so their C_forward = 2N + 2 n_layers n_ctx d_attn is
    this ``forward`` minus ``attention_mix`` and ``unembedding``. Positions cost no matmul
    (RoPE and ALiBi are elementwise), nor do norms, activations and the softmax.

    >>> from tfedu.config import preset
    >>> f = flops_per_token(preset("gpt2"), 1024)
    >>> f.attention_proj + f.mlp == 2 * 12 * 12 * 768**2  # 2 FLOPs per block weight
    True
    >>> f.attention_scores == f.attention_mix == 2 * 12 * 1024 * 768
    True
    >>> f.unembedding == 2 * 768 * 50257  # a quarter of GPT-2 small's forward pass
    True
    >>> f.forward, f.training == 3 * f.forward
    (284812800, True)

    Built up in notebooks/07_transformer_block.ipynb.
    """
    cfg = _config(cfg)
    _count("n_ctx_used", n_ctx_used)
    if cfg.positional == "learned" and n_ctx_used > cfg.n_ctx:
        raise ValueError(f"n_ctx_used={n_ctx_used} is longer than the learned position table (n_ctx={cfg.n_ctx})")
    d_q, d_kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    # One token is one row: its query meets n_ctx_used keys in every head (Kaplan et al. 2020, table 1).
    q_and_o = linear_flops(1, cfg.d_model, d_q) + linear_flops(1, d_q, cfg.d_model)
    k_and_v = 2 * linear_flops(1, cfg.d_model, d_kv)  # n_kv_heads wide: grouped-query attention saves here
    n_mlp_in = 2 if cfg.activation in GATED else 1  # SwiGLU's W_gate reads the input beside W_in
    mlp = n_mlp_in * linear_flops(1, cfg.d_model, cfg.d_mlp) + linear_flops(1, cfg.d_mlp, cfg.d_model) if cfg.has_mlp else 0
    return FlopsPerToken(
        embedding=0,
        attention_proj=cfg.n_layers * (q_and_o + k_and_v),
        attention_scores=cfg.n_layers * cfg.n_heads * matmul_flops(1, cfg.d_head, n_ctx_used),
        attention_mix=cfg.n_layers * cfg.n_heads * matmul_flops(1, n_ctx_used, cfg.d_head),
        mlp=cfg.n_layers * cfg.top_k * mlp,  # each token runs through top_k experts (1 = the dense MLP)
        unembedding=linear_flops(1, cfg.d_model, cfg.d_vocab),
        router=cfg.n_layers * linear_flops(1, cfg.d_model, cfg.n_experts) if cfg.n_experts else 0,
    )


def training_compute(n_params: float, n_tokens: float) -> float:
    """Training FLOPs C = 6 N D: 2 per parameter per token forward, 4 backward (Kaplan et al. 2020, sec. 2.1).

    Attention's n_ctx terms are left out, as the rule does; ``flops_per_token(...).training`` has them.

    >>> training_compute(175e9, 300e9)  # GPT-3, 300B tokens
    3.15e+23
    >>> f"{training_compute(174.6e9, 300e9):.2e}"  # Brown et al. 2020, table D.1: 3.14E+23 with N = 174,600M
    '3.14e+23'
    """
    for name, value in (("n_params", n_params), ("n_tokens", n_tokens)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    return 6 * n_params * n_tokens
