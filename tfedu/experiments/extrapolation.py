"""Train short, test long: which positional encoding survives sequences longer than it was trained on?

Press et al. (2022, "Train Short, Test Long", arXiv:2108.12409, fig. 1) trained language models on
short inputs and measured their perplexity on longer ones: sinusoidal positions blow up soon after
the training length, rotary positions a little later, and ALiBi's linear distance penalty stays
flat. This module runs the same experiment at toy scale, in seconds on a laptop CPU:

- ``ExtrapolationLM``: a tiny causal language model (token embedding, ``n_layers`` pre-norm blocks
  of ``tfedu.attention`` multi-head attention and an MLP, unembedding) with one of five position
  schemes: ``"none"`` (only the causal mask), ``"sinusoidal"`` and ``"learned"`` (added to the token
  embeddings), ``"alibi"`` (a bias on the attention scores) and ``"rope"`` (queries and keys rotated
  in every head; values never).
- ``run_extrapolation``: train every variant on windows of ``train_len`` tokens with the same seed
  and the same batches, then measure mean next-token cross-entropy on held-out text at longer
  lengths. A learned table has no rows past ``train_len``: its longer lengths are recorded as NaN
  with the reason ``LearnedPositions`` gives, never as a number.
- ``plot_extrapolation``: loss against evaluation length.

What it shows with the default ``CPU`` config (seeds 0, 1, 2; nats per byte, loss at 4L minus loss
at L): ALiBi -0.003 to +0.006, no positions +0.045 to +0.051, sinusoidal +0.10 to +0.12, RoPE
+0.28 to +0.39, though RoPE is the best of all at L. Learned positions cannot run past L at all.

Tokens are the UTF-8 **bytes** of the corpus: a fixed vocabulary of 256 that needs no training and
has no unknown symbols, so held-out text can never contain a token the model has not got a row for
(a character vocabulary built from the training slice could). The held-out text is the end of the
corpus, which the training windows never touch.

The functions that build the sinusoid table, the ALiBi bias and the RoPE rotation are arguments
(defaulting to ``tfedu.positional``'s), so the notebook can run the experiment on the learner's
own versions, called exactly as ``sinusoidal(n_positions, d_model)``,
``alibi_bias(n_heads, n_query, n_key)`` and ``apply_rope(x, positions)``.

Built by hand in notebooks/06_positional_encoding.ipynb.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from tfedu import positional as _positional
from tfedu.attention import MultiHeadAttention, attention_weights, causal_mask
from tfedu.data import encode_bytes, load_corpus, sample_windows  # re-exported: notebook 06 imported them from here

POSITIONALS = ("none", "sinusoidal", "learned", "alibi", "rope")
D_VOCAB = 256  # one token per byte value

SinusoidalFn = Callable[[int, int], Tensor]  # (n_positions, d_model) -> (pos, d_model)
AlibiBiasFn = Callable[[int, int, int], Tensor]  # (n_heads, n_query, n_key) -> (n_heads, query_pos, key_pos)
ApplyRopeFn = Callable[[Tensor, Tensor], Tensor]  # (x (..., pos, d_head), positions (pos,)) -> like x


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ExtrapolationConfig:
    """Sizes and training settings of the experiment; the defaults run on 2 CPU cores in well under 40 s."""

    train_len: int = 32  # L: every training window has this many input tokens
    eval_lengths: tuple[int, ...] = (32, 64, 128)  # evaluation lengths: multiples of train_len, the first == L
    d_model: int = 64  # width of the residual stream
    n_heads: int = 4  # attention heads per layer (d_head = d_model / n_heads)
    n_layers: int = 2  # attention + MLP blocks
    d_mlp: int = 128  # hidden width of each MLP (0: attention-only blocks)
    steps: int = 200  # optimiser steps per variant (20-25 ms each on one CPU thread)
    batch: int = 32  # training windows per step
    lr: float = 3e-3  # AdamW learning rate (linear warm-up, then cosine decay to 10%)
    eval_tokens: int = 16384  # held-out tokens scored at every length (rounded down to a multiple of each)
    held_out_fraction: float = 0.1  # the end of the corpus kept for evaluation only
    seed: int = 0  # initialisation and batch order; every variant sees the same batches
    threads: int | None = 1  # torch CPU threads while running (None: leave torch's setting alone)
    device: str = "cpu"  # where to train; "cuda" with the GPU preset

    def __post_init__(self) -> None:
        for name in ("train_len", "d_model", "n_heads", "n_layers", "steps", "batch", "eval_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.d_mlp, int) or isinstance(self.d_mlp, bool) or self.d_mlp < 0:
            raise ValueError(f"d_mlp must be an int >= 0 (0: no MLP), got {self.d_mlp!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2 or self.d_model % 2:
            raise ValueError(
                f"d_head = d_model / n_heads = {self.d_model // self.n_heads} and d_model must be even: "
                f"RoPE rotates dimension pairs and sinusoids come in (sin, cos) pairs"
            )
        lengths = self.eval_lengths
        if (
            not isinstance(lengths, tuple)
            or not lengths
            or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lengths)
        ):
            raise ValueError(f"eval_lengths must be a non-empty tuple of positive ints, got {lengths!r}")
        if lengths[0] != self.train_len or list(lengths) != sorted(set(lengths)):
            raise ValueError(
                f"eval_lengths must start at the training length {self.train_len} and increase, "
                f"e.g. {(self.train_len, 2 * self.train_len, 4 * self.train_len)}; got {lengths!r}"
            )
        if any(n % self.train_len for n in lengths):
            raise ValueError(
                f"every evaluation length must be a multiple of train_len={self.train_len} "
                f"(1x, 2x, 4x, ...); got {lengths!r}"
            )
        if max(lengths) > self.eval_tokens:
            raise ValueError(f"eval_tokens={self.eval_tokens} must hold at least one window of {max(lengths)} tokens")
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not 0 < self.lr < 1:
            raise ValueError(f"lr must be a number in (0, 1), got {self.lr!r}")
        if not isinstance(self.held_out_fraction, float) or not 0 < self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be a float in (0, 1), got {self.held_out_fraction!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be None or an int >= 1, got {self.threads!r}")


# The notebook's default: 25-30 s for all five variants on one thread of a 2-core machine. Short
# training is the conservative regime: the gaps only widen with more steps (at 1000 steps, sinusoidal
# and RoPE lose over 1 nat at 4L while ALiBi improves slightly).
CPU = ExtrapolationConfig()
# Bigger model, longer windows, more steps, for a GPU: several hundred times CPU's compute. Not
# validated on a GPU yet; the claims of the notebook are asserted on CPU.
GPU = ExtrapolationConfig(
    train_len=128, eval_lengths=(128, 256, 512), d_model=128, n_heads=8, n_layers=4, d_mlp=512,
    steps=2000, batch=64, lr=1e-3, eval_tokens=65536, threads=None, device="cuda",
)


# ----------------------------------------------------------------------------- the model


class PositionalSelfAttention(MultiHeadAttention):
    """Causal multi-head self-attention that can rotate its queries and keys (RoPE) and take a score bias (ALiBi).

    The projections, ``split_heads``/``merge_heads`` and the ``hook_pattern`` hook point are
    ``tfedu.attention.MultiHeadAttention``'s; only the forward pass changes. RoPE rotates q and k
    *after* they are split into heads, since each head's dot product must see the rotation of its
    own d_head dimensions (RoFormer eq. 34); v carries content, not position, and is left alone.

    >>> attn = PositionalSelfAttention(d_model=8, n_heads=2)
    >>> attn(torch.randn(3, 5, 8), mask=causal_mask(5, 5)).shape
    torch.Size([3, 5, 8])
    """

    def forward(  # type: ignore[override]
        self,
        x: Float[Tensor, "batch pos d_model"],
        *,
        mask: Bool[Tensor, "query_pos key_pos"],
        bias: Float[Tensor, "n_heads query_pos key_pos"] | None = None,
        rotate: Callable[[Tensor], Tensor] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        q = self.split_heads(self.W_Q(x))  # (batch, n_heads, pos, d_head)
        k = self.split_heads(self.W_K(x))  # (batch, n_heads, pos, d_head)
        v = self.split_heads(self.W_V(x))  # (batch, n_heads, pos, d_head)
        if rotate is not None:
            q, k = rotate(q), rotate(k)
        pattern = self.hook_pattern(attention_weights(q, k, mask, bias=bias))  # (batch, n_heads, query_pos, key_pos)
        return self.W_O(self.merge_heads(pattern @ v))  # (batch, pos, d_model)


class Block(nn.Module):
    """Pre-norm residual block (GPT-2): ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` if ``d_mlp > 0``."""

    def __init__(self, d_model: int, n_heads: int, d_mlp: int) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attention = PositionalSelfAttention(d_model, n_heads)
        self.mlp = (
            nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, d_mlp), nn.GELU(), nn.Linear(d_mlp, d_model))
            if d_mlp
            else None
        )

    def forward(self, x: Float[Tensor, "batch pos d_model"], **attention_kwargs) -> Float[Tensor, "batch pos d_model"]:
        x = x + self.attention(self.ln_attn(x), **attention_kwargs)
        return x if self.mlp is None else x + self.mlp(x)


class ExtrapolationLM(nn.Module):
    """A tiny causal byte-level language model with a chosen positional encoding.

    ``positional`` is one of ``POSITIONALS``. ``"learned"`` holds a ``LearnedPositions`` table of
    ``n_ctx`` rows and raises its ``IndexError`` on anything longer; the others run at any length.
    ``sinusoidal``, ``alibi_bias`` and ``apply_rope`` are the functions the model calls to build
    its positions (see the module docstring for their signatures).

    >>> lm = ExtrapolationLM("alibi", d_model=16, n_heads=2, n_layers=1, d_mlp=0, n_ctx=8)
    >>> lm(torch.zeros(3, 20, dtype=torch.long)).shape  # ALiBi runs past n_ctx
    torch.Size([3, 20, 256])
    """

    def __init__(
        self,
        positional: str,
        *,
        d_model: int,
        n_heads: int,
        n_layers: int,
        d_mlp: int,
        n_ctx: int,
        sinusoidal: SinusoidalFn = _positional.sinusoidal,
        alibi_bias: AlibiBiasFn = _positional.alibi_bias,
        apply_rope: ApplyRopeFn = _positional.apply_rope,
    ) -> None:
        super().__init__()
        _expect_positional(positional)
        self.positional, self.n_heads, self.d_model = positional, n_heads, d_model
        self.sinusoidal, self.alibi_bias, self.apply_rope = sinusoidal, alibi_bias, apply_rope
        # The sinusoid table and the ALiBi bias depend only on the length: build each length once
        # (a learner's loop-by-loop version then costs nothing per step).
        self._tables: dict[tuple, Tensor] = {}
        self.W_E = nn.Embedding(D_VOCAB, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_mlp) for _ in range(n_layers))
        self.ln_final = nn.LayerNorm(d_model)
        self.W_U = nn.Linear(d_model, D_VOCAB, bias=False)
        nn.init.normal_(self.W_E.weight, std=0.02)  # GPT-2's scale, the same as LearnedPositions'
        # Built last, so that every variant draws the same initial weights for everything else.
        self.W_pos = _positional.LearnedPositions(n_ctx, d_model) if positional == "learned" else None

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_vocab"]:
        n, device = tokens.shape[-1], tokens.device
        positions = torch.arange(n, device=device)  # (pos,)
        x = self.W_E(tokens)  # (batch, pos, d_model)
        bias, rotate = None, None
        if self.positional == "sinusoidal":
            # The table's values lie in [-1, 1], 50x the embeddings' std of 0.02: position would
            # drown the tokens. Scaled to the tokens' size, as the learned table starts (GPT-2), it
            # gets the ratio the paper gets by multiplying the embeddings by sqrt(d_model). (The
            # unscaled table, measured: worse at L and three times the degradation at 4L.)
            x = x + 0.02 * self._built("sinusoidal", n, device, x.dtype)
        elif self.positional == "learned":
            x = x + self.W_pos(positions)  # IndexError past n_ctx: there is no row to add
        elif self.positional == "alibi":
            bias = self._built("alibi_bias", n, device, x.dtype)
        elif self.positional == "rope":
            rotate = lambda t: self.apply_rope(t, positions)  # noqa: E731  t: (batch, n_heads, pos, d_head)
        mask = causal_mask(n, n, device=device)  # (query_pos, key_pos): every variant is causal
        for block in self.blocks:
            x = block(x, mask=mask, bias=bias, rotate=rotate)
        return self.W_U(self.ln_final(x))  # (batch, pos, d_vocab)

    def _built(self, name: str, n: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``sinusoidal(n, d_model)`` or ``alibi_bias(n_heads, n, n)``, checked and kept for the next call."""
        key = (name, n, device, dtype)
        if key not in self._tables:
            if name == "sinusoidal":
                built, shape = self.sinusoidal(n, self.d_model), (n, self.d_model)
            else:
                built, shape = self.alibi_bias(self.n_heads, n, n), (self.n_heads, n, n)
            self._tables[key] = _on(built, device, dtype, name, shape).detach()
        return self._tables[key]


def _on(t: object, device: torch.device, dtype: torch.dtype, name: str, shape: tuple[int, ...]) -> Tensor:
    """An injected function's answer, checked for shape and moved to where the model computes."""
    if not isinstance(t, Tensor) or tuple(t.shape) != shape:
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must return a tensor of shape {shape}, got {got}")
    return t.to(device=device, dtype=dtype)


def _expect_positional(positional: object) -> None:
    if positional not in POSITIONALS:
        raise ValueError(f"unknown positional encoding {positional!r}; expected one of {POSITIONALS}")


# ----------------------------------------------------------------------------- data


def split_corpus(
    tokens: Int[Tensor, " n_tokens"], cfg: ExtrapolationConfig
) -> tuple[Int[Tensor, " n_train"], Int[Tensor, " n_eval"]]:
    """The training slice (the start) and the held-out slice (the end, ``eval_tokens + 1`` tokens of it).

    The held-out slice is the last ``held_out_fraction`` of the corpus; only its first
    ``eval_tokens + 1`` tokens are scored (one extra: the last input needs a next token).

    >>> train, held_out = split_corpus(torch.arange(10_000), ExtrapolationConfig(eval_tokens=256))
    >>> len(train), held_out[:2].tolist(), len(held_out)
    (9000, [9000, 9001], 257)
    """
    n_held_out = int(len(tokens) * cfg.held_out_fraction)
    n_train = len(tokens) - n_held_out
    if n_held_out < cfg.eval_tokens + 1 or n_train < 10 * (cfg.train_len + 1):
        raise ValueError(
            f"the corpus has {len(tokens)} tokens: its held-out {cfg.held_out_fraction:.0%} ({n_held_out}) must hold "
            f"eval_tokens + 1 = {cfg.eval_tokens + 1}, and the rest ({n_train}) at least 10 training windows of "
            f"{cfg.train_len + 1}; give a longer text or a smaller eval_tokens"
        )
    return tokens[:n_train], tokens[n_train : n_train + cfg.eval_tokens + 1]


@torch.no_grad()
def held_out_loss(model: nn.Module, held_out: Int[Tensor, " n_eval"], length: int, *, chunk: int = 64) -> float:
    """Mean next-token cross-entropy (nats) over the held-out text, read in windows of ``length`` tokens.

    The text is cut into non-overlapping windows; at every length the *same* tokens are
    predicted (the first ``length * (len(held_out) - 1) // length`` of them), so losses at
    different lengths differ only in how much context, and which positions, the model sees.

    >>> uniform = lambda tokens: torch.zeros(*tokens.shape, D_VOCAB)
    >>> round(held_out_loss(uniform, torch.arange(65), 8), 4) == round(math.log(256), 4)
    True
    """
    n_windows = (len(held_out) - 1) // length
    inputs = held_out[: n_windows * length].view(n_windows, length)  # (n_windows, pos)
    targets = held_out[1 : n_windows * length + 1].view(n_windows, length)  # (n_windows, pos)
    total = 0.0
    for start in range(0, n_windows, chunk):  # chunks keep memory flat at long lengths
        logits = model(inputs[start : start + chunk])  # (chunk, pos, d_vocab)
        total += F.cross_entropy(logits.flatten(0, 1).float(), targets[start : start + chunk].flatten(), reduction="sum").item()
    return total / targets.numel()


# ----------------------------------------------------------------------------- the experiment


@dataclass(frozen=True)
class VariantResult:
    """One positional encoding's run: held-out loss per evaluation length, and how long it took.

    ``losses[n]`` is NaN where the model cannot run at length n; ``reasons[n]`` then says why
    (the error message of ``LearnedPositions``).
    """

    positional: str
    losses: dict[int, float]  # evaluation length -> mean cross-entropy in nats (NaN: could not run)
    reasons: dict[int, str]  # evaluation length -> why there is no loss
    train_losses: list[float]  # training loss at every step
    train_seconds: float
    eval_seconds: float

    def can_run(self, length: int) -> bool:
        return not math.isnan(self.losses[length])


@dataclass(frozen=True)
class ExtrapolationResult:
    """All variants of one run. ``degradation(p)`` is loss(longest) - loss(train_len), NaN if it cannot run."""

    config: ExtrapolationConfig
    variants: dict[str, VariantResult]
    seconds: float = field(default=0.0)

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.config.eval_lengths

    def degradation(self, positional: str, length: int | None = None) -> float:
        """How much worse the loss at ``length`` (default: the longest) is than at the training length."""
        losses = self.variants[positional].losses
        return losses[self.lengths[-1] if length is None else length] - losses[self.config.train_len]

    def table(self) -> str:
        """The losses as a plain-text table, one row per variant (for printing, never for comparing)."""
        head = "positional   " + "".join(f"{n:>9}" for n in self.lengths) + "   train s"
        rows = [head]
        for name, v in self.variants.items():
            cells = "".join(f"{v.losses[n]:>9.3f}" if v.can_run(n) else f"{'-':>9}" for n in self.lengths)
            rows.append(f"{name:<13}{cells}{v.train_seconds:>10.1f}")
        return "\n".join(rows)


def train_variant(
    positional: str,
    train_tokens: Int[Tensor, " n_train"],
    cfg: ExtrapolationConfig,
    **position_fns: Callable,
) -> tuple[ExtrapolationLM, list[float]]:
    """Train one ``ExtrapolationLM`` on random ``train_len`` windows; returns it and its loss per step.

    The seed fixes both the initial weights and the batches, so every variant reads the same text
    in the same order.
    """
    _expect_positional(positional)
    with torch.random.fork_rng(devices=[]):  # seed the initial weights without moving the caller's RNG
        torch.manual_seed(cfg.seed)
        model = ExtrapolationLM(
            positional, d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers, d_mlp=cfg.d_mlp,
            n_ctx=cfg.train_len, **position_fns,
        ).to(cfg.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, foreach=True)
    warmup = max(1, cfg.steps // 20)
    # Linear warm-up then cosine decay to 10%: the small-model recipe of nanoGPT.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(step, cfg.steps) / cfg.steps))),
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    losses = []
    model.train()
    for _ in range(cfg.steps):
        inputs, targets = sample_windows(train_tokens, cfg.batch, cfg.train_len, generator)  # (batch, pos) each
        logits = model(inputs.to(cfg.device))  # (batch, pos, d_vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.to(cfg.device).flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    return model, losses


def run_extrapolation(
    cfg: ExtrapolationConfig = CPU,
    *,
    positionals: Sequence[str] = POSITIONALS,
    text: str | None = None,
    sinusoidal: SinusoidalFn = _positional.sinusoidal,
    alibi_bias: AlibiBiasFn = _positional.alibi_bias,
    apply_rope: ApplyRopeFn = _positional.apply_rope,
) -> ExtrapolationResult:
    """Train each positional variant at ``cfg.train_len`` and score it on held-out text at every ``cfg.eval_lengths``.

    ``text`` defaults to ``tfedu.data.load_corpus()``. ``sinusoidal``, ``alibi_bias`` and
    ``apply_rope`` are called as ``sinusoidal(n_positions, d_model)``,
    ``alibi_bias(n_heads, n_query, n_key)`` and ``apply_rope(x, positions)``; pass your own to
    run the experiment on them. Deterministic for a given config on one machine.

    >>> tiny = ExtrapolationConfig(train_len=8, eval_lengths=(8, 16), d_model=16, n_heads=2, n_layers=1,
    ...                            d_mlp=0, steps=5, batch=4, eval_tokens=64)
    >>> result = run_extrapolation(tiny, positionals=("alibi", "learned"), text="abcdefgh" * 200)
    >>> result.variants["learned"].losses[16], "n_ctx=8" in result.variants["learned"].reasons[16]
    (nan, True)
    """
    if isinstance(positionals, str) or not positionals:
        raise ValueError(f"positionals must be a non-empty sequence of names from {POSITIONALS}, got {positionals!r}")
    for name in positionals:
        _expect_positional(name)
    if len(set(positionals)) != len(positionals):
        raise ValueError(f"positionals has repeats: {positionals!r}")
    fns = {"sinusoidal": sinusoidal, "alibi_bias": alibi_bias, "apply_rope": apply_rope}
    for name, fn in fns.items():
        if not callable(fn):
            raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
    tokens = encode_bytes(load_corpus() if text is None else text)
    train_tokens, held_out = split_corpus(tokens, cfg)
    held_out = held_out.to(cfg.device)

    # One thread: these matrices are small, and when the other core is busy (a second test worker,
    # another kernel) two threads ran 3-8x slower per step than one (measured: 61-211 ms against
    # 21-27 ms); on an idle machine two were only 1.4x faster. A fixed thread count also keeps the
    # numbers identical from run to run (a sum can be split differently with another thread count).
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    start = time.perf_counter()
    try:
        variants = {}
        for name in positionals:
            t0 = time.perf_counter()
            model, train_losses = train_variant(name, train_tokens, cfg, **fns)
            t1 = time.perf_counter()
            losses, reasons = {}, {}
            for n in cfg.eval_lengths:
                try:
                    losses[n] = held_out_loss(model, held_out, n)
                except IndexError as err:  # a learned table has no row for position >= train_len
                    if name != "learned":
                        raise
                    losses[n], reasons[n] = math.nan, str(err)
            variants[name] = VariantResult(name, losses, reasons, train_losses, t1 - t0, time.perf_counter() - t1)
    finally:
        torch.set_num_threads(threads)
    return ExtrapolationResult(cfg, variants, time.perf_counter() - start)


# ----------------------------------------------------------------------------- the figure


COLOURS = {"none": "tab:gray", "sinusoidal": "tab:blue", "learned": "tab:purple", "alibi": "tab:green", "rope": "tab:orange"}


def plot_extrapolation(result: ExtrapolationResult, ax=None):
    """Held-out loss against evaluation length (log2 axis), one line per variant; returns the axes.

    A dashed vertical line marks the training length. A variant that cannot run at some length
    (a learned table) is drawn only where it ran, and annotated with the reason it stops.
    """
    import matplotlib.pyplot as plt

    if not isinstance(result, ExtrapolationResult):
        raise TypeError(f"result must be an ExtrapolationResult (from run_extrapolation), got {type(result).__name__}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    lengths = result.lengths
    for name, variant in result.variants.items():
        ran = [n for n in lengths if variant.can_run(n)]
        style = dict(color=COLOURS[name], marker="o", label=name)
        ax.plot(ran, [variant.losses[n] for n in ran], **style)
        if len(ran) < len(lengths):
            last = ran[-1] if ran else lengths[0]
            ax.annotate(
                f"{name}: no rows past position {result.config.train_len - 1}",
                xy=(last, variant.losses[last] if ran else ax.get_ylim()[0]),
                xytext=(8, -14), textcoords="offset points", color=COLOURS[name], fontsize=8,
            )
    ax.axvline(result.config.train_len, color="black", linestyle="--", linewidth=1)
    ax.text(result.config.train_len, 1.0, " training length", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlim(lengths[0] / 1.2, lengths[-1] * 1.2)  # keep the end points off the frame
    ax.set_xticks(list(lengths), [str(n) for n in lengths])
    ax.set_xlabel("evaluation length (tokens: bytes of UTF-8)")
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_title("Train short, test long")
    ax.legend(fontsize=8)
    return ax


__all__ = [
    "POSITIONALS", "CPU", "GPU", "ExtrapolationConfig", "ExtrapolationLM", "PositionalSelfAttention",
    "ExtrapolationResult", "VariantResult", "encode_bytes", "split_corpus", "sample_windows", "held_out_loss",
    "train_variant", "run_extrapolation", "plot_extrapolation",
]
