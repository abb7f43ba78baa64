"""Pre-norm or post-norm? Gradients at initialisation, and training without warm-up, in a deep narrow GPT.

The lecture decks say "Pre-Norm is easier and more stable to train; Post-Norm tends to present
better performance if properly trained". Xiong et al. (2020, "On Layer Normalization in the
Transformer Architecture", arXiv:2002.04745, sec. 3.3-3.4 and fig. 3) explain the first half: at
initialisation the gradient of the last layer's parameters of a post-norm Transformer does not
shrink with depth, while a pre-norm Transformer's shrinks like 1/sqrt(n_layers) (their theorem 1);
so post-norm needs a learning-rate warm-up and pre-norm trains without one. Liu et al. (2020,
"Understanding the Difficulty of Training Transformers", arXiv:2004.08249) add that post-norm leans
on its residual branches so much that a parameter update is amplified in the output. This module
runs the comparison at toy scale, in seconds on one CPU thread, with ``tfedu.model.GPT``
(``norm_position="pre"`` or ``"post"``, nothing else different):

- ``grad_norms_at_init``: one backward pass on one batch at initialisation; the norm of each
  block's parameter gradient, for pre and post.
- ``grad_norms_vs_depth``: the last block's gradient norm at initialisation for several depths
  (Xiong et al.'s theorem 1, measured).
- ``run_depth``: train both variants from the same initial weights on the same batches with Adam
  at a fixed learning rate and **no warm-up** (``warmup_steps=0``); loss per step, gradient norms
  at initialisation, whether the loss diverged, final loss, CPU seconds.
- ``plot_depth`` (gradients per block and loss curves) and ``plot_grad_norms_vs_depth``.

Both variants start from the initialisation the papers analyse (``init="xavier"``): every weight
matrix Xavier-uniform and the embeddings multiplied by sqrt(d_model), as in the 2017 Transformer
(Vaswani et al. sec. 3.4) and the Annotated Transformer. The GPT class's own GPT-2 initialisation
(``init="gpt2"``: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layers)) changes the
picture; see below.

Tokens are the UTF-8 bytes of ``tfedu.data.load_corpus()`` (256 symbols). The "unigram loss" is
the entropy of the corpus's byte frequencies, 3.261 nats: the loss of the best model that ignores
the context. A model whose loss stays there has learnt how common each byte is and nothing else.
The final loss is the mean training loss of the last 20 steps (every batch is fresh text: 120
steps read 61k of the corpus's 466k bytes).

What it shows with the default ``CPU`` config (8 blocks, d_model 32, 2 heads, 32-byte windows,
batch 16, Adam at lr 3e-3 from the first step, 120 steps; one CPU thread, 3.5-3.8 CPU s per
variant). Seeds 0, 1, 2, then 3, 4, 5 in brackets:

- Final loss, pre-norm 2.753, 2.638, 2.726 (2.748, 2.706, 2.729): 0.51-0.62 nats below the
  unigram loss. Post-norm 3.224, 3.319, 3.170 (3.306, 3.346, 3.291): within 0.09 of the unigram
  loss, stalled there. Gap 0.47, 0.68, 0.44 (0.56, 0.64, 0.56). Neither diverges (no inf/NaN, no
  loss above the first step's). At 300 steps post-norm is still at 3.27-3.30 (seeds 0-2) and
  pre-norm at 2.41-2.48.
- Depth makes the difference: with 2 blocks the gap is -0.02 to 0.00 (post-norm as good), with 4
  blocks 0.03-0.06, with 8 blocks 0.44-0.68 (seeds 0-2).
- The learning rate: at lr 1e-2 the gap is 0.41-0.66 (post-norm again at the unigram loss); at lr
  1e-3 both learn slowly in 120 steps (pre-norm 0.16-0.27 below the unigram loss, post-norm
  0.01-0.09 below, gap 0.15-0.19).
- Gradients at initialisation (one batch, 8 blocks): post-norm's last block gets 2.13, 2.54, 2.35
  (2.30, 2.73, 2.36) times pre-norm's, its first block 1.43, 0.94, 1.22 (0.90, 0.90, 0.52) times:
  compared with pre-norm, post-norm's gradient is tilted towards the output. Pre-norm's shrinks
  from the first block to the last (last/first 0.27, 0.42, 0.58 (0.43, 0.39, 0.16)); post-norm's
  shrinks less or grows (0.40, 1.12, 1.11 (1.09, 1.18, 0.72)). It does **not** grow steadily
  towards the output on its own: one batch's per-block norms are noisy, and 0.40 < 1.
- Against depth (``grad_norms_vs_depth``, 2 to 32 blocks, seeds 0-2; 2.3 CPU s): pre-norm's last
  block gradient falls from 0.64 to 0.13 (x0.20 for 16 times the depth; 1/sqrt(16) = 0.25), post-
  norm's rises from 0.57 to 0.81 (x1.42). At 32 blocks post-norm's is 5.9-7.2 times pre-norm's
  (seeds 0-5: 5.2-7.2); at 2 blocks 0.84-0.98 times.

What did **not** hold, so is not claimed:

- Warm-up rescuing post-norm: a 200-step linear warm-up (300 steps in all) brought post-norm to
  2.72 and 2.63 for seeds 0 and 1, still 0.2 behind pre-norm without warm-up, and left seed 2 at
  the unigram loss (3.27). With 12 blocks, 100 warm-up steps did not help within 400 steps (seeds 0, 1).
- "Post-norm performs better if properly trained": nowhere at this scale. The best post-norm run
  is level with pre-norm only where depth does not matter (2 blocks: -0.02 to 0.00).
- With the GPT-2 initialisation (``init="gpt2"``) nothing is consistent: the gap is 0.12, -0.12,
  0.35 (seeds 0-2; post-norm better for seed 1), and post-norm's last-block gradient is 0.04 times
  pre-norm's, the opposite of Xavier's. Its small weights keep pre-norm's residual stream tiny
  (standard deviation 0.03 going into the final norm at initialisation, seed 0; 2.6 with Xavier),
  so the final norm divides by a small number and magnifies pre-norm's gradients, while post-norm
  renormalises to 1 after every sub-layer.
- Divergence: no run here produced inf or NaN; post-norm stalls rather than blows up.

Built for notebooks/07_transformer_block.ipynb.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from jaxtyping import Float
from torch import Tensor, nn

from tfedu.config import ModelConfig
from tfedu.data import encode_bytes, load_corpus, sample_windows
from tfedu.model import GPT

NORM_POSITIONS = ("pre", "post")
INITS = ("xavier", "gpt2")
D_VOCAB = 256  # one token per byte value


# ----------------------------------------------------------------------------- configuration


def _positive_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class DepthConfig:
    """A deep, narrow byte-level GPT and how to train it; the defaults take about 4 CPU seconds per variant."""

    n_layers: int = 8  # blocks: deep for a residual stream this narrow
    d_model: int = 32  # width of the residual stream
    n_heads: int = 2  # attention heads per block (d_head = 16)
    n_ctx: int = 32  # tokens per training window
    steps: int = 120  # Adam steps per variant (about 33 ms each on one CPU thread)
    batch: int = 16  # windows per step
    lr: float = 3e-3  # Adam's learning rate, fixed from the first step unless warmup_steps > 0
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps to lr over this many steps; 0: none
    init: str = "xavier"  # xavier (the 2017 Transformer, the papers' setting) | gpt2 (GPT's own)
    final_window: int = 20  # the final loss is the mean training loss of the last this many steps
    seed: int = 0  # initial weights and batch order; both variants get the same
    threads: int | None = 1  # torch CPU threads while running (None: leave torch's setting alone)
    device: str = "cpu"  # where to train

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "n_ctx", "steps", "batch", "final_window"):
            _positive_int(name, getattr(self, name))
        _positive_int("warmup_steps", self.warmup_steps, minimum=0)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.final_window > self.steps:
            raise ValueError(f"final_window={self.final_window} must be at most steps={self.steps}")
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not 0 < self.lr < 1:
            raise ValueError(f"lr must be a number in (0, 1), got {self.lr!r}")
        if self.init not in INITS:
            raise ValueError(f"init={self.init!r} is not one of {INITS}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be None or an int >= 1, got {self.threads!r}")

    def replace(self, **changes: object) -> DepthConfig:
        """A copy with ``changes`` (``dataclasses.replace``), checked again.

        >>> DepthConfig().replace(n_layers=2).n_layers
        2
        """
        return dataclasses.replace(self, **changes)

    def model_config(self, norm_position: str) -> ModelConfig:
        """The ``ModelConfig`` of one variant: everything but ``norm_position`` is the same.

        >>> DepthConfig().model_config("post").norm_position, DepthConfig().model_config("post").d_mlp
        ('post', 128)
        """
        _expect_norm_position(norm_position)
        # sdpa: the same numbers as the by-hand attention (tested in test_layers), a third faster here.
        return ModelConfig(
            d_vocab=D_VOCAB, n_ctx=self.n_ctx, d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
            norm_position=norm_position, attention="sdpa",
        )


# The notebook's default: both variants over 3 seeds in about 24 CPU seconds on one thread.
CPU = DepthConfig()


def _expect_norm_position(norm_position: object) -> None:
    if norm_position not in NORM_POSITIONS:
        raise ValueError(f"unknown norm position {norm_position!r}; expected one of {NORM_POSITIONS}")


# ----------------------------------------------------------------------------- the model


def init_like_2017(model: GPT) -> GPT:
    """Re-initialise ``model`` as the 2017 Transformer: Xavier-uniform matrices, embeddings times sqrt(d_model).

    Xavier/Glorot (2010) keeps a linear layer's output variance equal to its input's, so every
    sub-layer writes about as much into the residual stream as the stream already holds; this is
    the initialisation of Xiong et al.'s analysis. The Annotated Transformer does the same
    (``xavier_uniform_`` on every parameter with more than one axis), and Vaswani et al. (sec. 3.4)
    multiply the embeddings by sqrt(d_model). Norm gains stay 1, biases 0.

    >>> from tfedu.config import ModelConfig
    >>> model = init_like_2017(GPT(ModelConfig(d_vocab=256, n_ctx=8, d_model=16, n_layers=1, n_heads=2)))
    >>> model.embed_scale
    4.0
    """
    for param in model.parameters():
        if param.dim() > 1:
            nn.init.xavier_uniform_(param)
    model.embed_scale = math.sqrt(model.cfg.d_model)
    return model


def build_model(cfg: DepthConfig, norm_position: str, seed: int | None = None) -> GPT:
    """The GPT of one variant, initialised from ``seed`` (default ``cfg.seed``) without touching the caller's RNG.

    Pre and post draw the same random numbers in the same order (post-norm's missing final norm
    holds no random weights), so with one seed they start from the same weights.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed if seed is None else seed)
        model = GPT(cfg.model_config(norm_position))
        if cfg.init == "xavier":
            init_like_2017(model)
    return model.to(cfg.device)


def block_grad_norms(model: GPT) -> Float[Tensor, " n_layers"]:
    """The norm of each block's gradient, all its parameters (attention, MLP, norms) taken together.

    >>> from tfedu.config import ModelConfig
    >>> model = GPT(ModelConfig(d_vocab=256, n_ctx=8, d_model=16, n_layers=3, n_heads=2))
    >>> ids = torch.zeros(2, 8, dtype=torch.long)
    >>> model(ids, targets=ids)[1].backward()
    >>> block_grad_norms(model).shape
    torch.Size([3])
    """
    norms = []
    for block in model.blocks:
        squares = [p.grad.detach().float().pow(2).sum() for p in block.parameters() if p.grad is not None]
        norms.append(torch.stack(squares).sum().sqrt() if squares else torch.tensor(0.0))
    return torch.stack(norms).cpu()


# ----------------------------------------------------------------------------- the data


def unigram_loss(tokens: Tensor) -> float:
    """The entropy (nats) of the token frequencies: the loss of the best model that ignores the context.

    >>> round(unigram_loss(torch.tensor([0, 1, 0, 1])), 4) == round(math.log(2), 4)
    True
    """
    counts = torch.bincount(tokens.flatten(), minlength=D_VOCAB).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def _tokens(text: str | None, cfg: DepthConfig) -> Tensor:
    tokens = encode_bytes(load_corpus() if text is None else text)
    if len(tokens) < 2 * (cfg.n_ctx + 1):
        raise ValueError(f"the text has {len(tokens)} bytes; give at least {2 * (cfg.n_ctx + 1)} (a few windows of n_ctx + 1)")
    return tokens


class _Threads:
    """Run with ``n`` torch threads (None: leave them), then put the old setting back."""

    def __init__(self, n: int | None) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        if self.n is not None:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)


# ----------------------------------------------------------------------------- gradients at initialisation


def grad_norms_at_init(
    cfg: DepthConfig = CPU, seed: int | None = None, *, text: str | None = None
) -> dict[str, Float[Tensor, " n_layers"]]:
    """Each block's gradient norm after one backward pass at initialisation, for ``"pre"`` and ``"post"``.

    Both variants start from the same weights (``seed``, default ``cfg.seed``) and see the same
    batch: the first batch ``run_depth`` trains on.

    >>> tiny = DepthConfig(n_layers=3, d_model=16, n_ctx=8, batch=2, steps=1, final_window=1)
    >>> norms = grad_norms_at_init(tiny, text="hello, world. " * 20)
    >>> sorted(norms), norms["post"].shape
    (['post', 'pre'], torch.Size([3]))
    """
    seed = cfg.seed if seed is None else seed
    tokens = _tokens(text, cfg)
    with _Threads(cfg.threads):
        return {name: _grad_norms(cfg, name, seed, tokens) for name in NORM_POSITIONS}


def _grad_norms(cfg: DepthConfig, norm_position: str, seed: int, tokens: Tensor) -> Tensor:
    model = build_model(cfg, norm_position, seed)
    inputs, targets = sample_windows(tokens, cfg.batch, cfg.n_ctx, torch.Generator().manual_seed(seed))
    _, loss = model(inputs.to(cfg.device), targets.to(cfg.device))
    loss.backward()
    return block_grad_norms(model)


@dataclass(frozen=True)
class DepthSweep:
    """The last block's gradient norm at initialisation, per depth and seed: ``last_block[p][i, j]`` for
    ``depths[i]``, ``seeds[j]``."""

    config: DepthConfig
    depths: tuple[int, ...]
    seeds: tuple[int, ...]
    last_block: dict[str, Float[Tensor, "depth seed"]]

    def mean(self, norm_position: str) -> Float[Tensor, " depth"]:
        """The mean over seeds, per depth."""
        return self.last_block[norm_position].mean(dim=1)


def grad_norms_vs_depth(
    cfg: DepthConfig = CPU,
    depths: Sequence[int] = (2, 4, 8, 16, 32),
    seeds: Sequence[int] = (0, 1, 2),
    *,
    text: str | None = None,
) -> DepthSweep:
    """The last block's gradient norm at initialisation for every depth and seed, pre and post.

    Xiong et al.'s theorem 1: post-norm's does not shrink as blocks are added, pre-norm's shrinks
    like 1/sqrt(n_layers). One backward pass per depth, seed and variant (about 3 CPU seconds for
    the defaults).

    >>> tiny = DepthConfig(d_model=16, n_ctx=8, batch=2, steps=1, final_window=1)
    >>> sweep = grad_norms_vs_depth(tiny, depths=(1, 2), seeds=(0,), text="hello, world. " * 20)
    >>> sweep.last_block["pre"].shape
    torch.Size([2, 1])
    """
    depths, seeds = tuple(depths), tuple(seeds)
    if not depths or not seeds:
        raise ValueError("give at least one depth and one seed")
    for n in depths:
        _positive_int("every depth", n)
    tokens = _tokens(text, cfg)
    last = {name: torch.zeros(len(depths), len(seeds)) for name in NORM_POSITIONS}
    with _Threads(cfg.threads):
        for i, n_layers in enumerate(depths):
            deeper = cfg.replace(n_layers=n_layers)
            for j, seed in enumerate(seeds):
                for name in NORM_POSITIONS:
                    last[name][i, j] = _grad_norms(deeper, name, seed, tokens)[-1]
    return DepthSweep(cfg, depths, seeds, last)


# ----------------------------------------------------------------------------- training


@dataclass(frozen=True)
class RunResult:
    """One variant's training run. ``losses`` stops early at the first non-finite loss (``diverged``)."""

    norm_position: str
    losses: list[float]  # training loss (nats per byte) at every step taken
    grad_norms: list[float]  # each block's gradient norm at initialisation (the first batch)
    diverged: bool  # the loss became inf or NaN, and training stopped there
    cpu_seconds: float  # CPU time of the training loop (time.process_time)
    final_window: int = 20

    @property
    def final_loss(self) -> float:
        """Mean training loss over the last ``final_window`` steps; NaN if the run diverged."""
        if self.diverged:
            return math.nan
        return sum(self.losses[-self.final_window :]) / self.final_window


@dataclass(frozen=True)
class DepthResult:
    """Both variants of one run, plus the unigram loss of the text they trained on."""

    config: DepthConfig
    runs: dict[str, RunResult]
    unigram_loss: float
    seconds: float = field(default=0.0)

    def final_loss(self, norm_position: str) -> float:
        return self.runs[norm_position].final_loss

    def grad_ratio(self, norm_position: str) -> float:
        """Last block's gradient norm at initialisation over the first block's."""
        norms = self.runs[norm_position].grad_norms
        return norms[-1] / norms[0]

    def table(self) -> str:
        """A plain-text summary, one row per variant (for printing, never for comparing)."""
        rows = [f"{'variant':<8}{'final loss':>11}{'diverged':>10}{'grad last/first':>17}{'last grad':>11}{'cpu s':>7}"]
        for name, run in self.runs.items():
            rows.append(
                f"{name:<8}{run.final_loss:>11.3f}{str(run.diverged):>10}{self.grad_ratio(name):>17.2f}"
                f"{run.grad_norms[-1]:>11.3f}{run.cpu_seconds:>7.1f}"
            )
        rows.append(f"unigram loss (byte frequencies only): {self.unigram_loss:.3f}")
        return "\n".join(rows)


def learning_rate(cfg: DepthConfig, step: int) -> float:
    """The learning rate at ``step`` (0-based): ``cfg.lr``, ramped up linearly over ``cfg.warmup_steps``.

    >>> [learning_rate(DepthConfig(lr=1e-3, warmup_steps=4), s) for s in range(5)]
    [0.00025, 0.0005, 0.00075, 0.001, 0.001]
    """
    if cfg.warmup_steps == 0:
        return cfg.lr
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)


def train_variant(cfg: DepthConfig, norm_position: str, tokens: Tensor) -> RunResult:
    """Train one variant with Adam and no gradient clipping (clipping would be a fix of its own)."""
    model = build_model(cfg, norm_position)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate(cfg, 0))
    generator = torch.Generator().manual_seed(cfg.seed)
    losses, grad_norms, diverged = [], [], False
    start = time.process_time()
    model.train()
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        inputs, targets = sample_windows(tokens, cfg.batch, cfg.n_ctx, generator)  # (batch, pos) each
        _, loss = model(inputs.to(cfg.device), targets.to(cfg.device))
        value = loss.item()
        if not math.isfinite(value):
            losses.append(value)
            diverged = True
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            grad_norms = block_grad_norms(model).tolist()
        optimizer.step()
        losses.append(value)
    return RunResult(norm_position, losses, grad_norms, diverged, time.process_time() - start, cfg.final_window)


def run_depth(
    cfg: DepthConfig = CPU, *, norm_positions: Sequence[str] = NORM_POSITIONS, text: str | None = None
) -> DepthResult:
    """Train each variant in ``norm_positions`` from the same initial weights on the same batches.

    ``text`` defaults to ``tfedu.data.load_corpus()``. Deterministic for a given config on one
    machine. The gradient norms recorded are those of the first step, so they equal
    ``grad_norms_at_init(cfg)``.

    >>> tiny = DepthConfig(n_layers=2, d_model=16, n_ctx=8, batch=2, steps=3, final_window=2)
    >>> result = run_depth(tiny, text="hello, world. " * 20)
    >>> sorted(result.runs), len(result.runs["post"].losses), result.runs["pre"].diverged
    (['post', 'pre'], 3, False)
    """
    if isinstance(norm_positions, str) or not norm_positions:
        raise ValueError(f"norm_positions must be a non-empty sequence from {NORM_POSITIONS}, got {norm_positions!r}")
    for name in norm_positions:
        _expect_norm_position(name)
    if len(set(norm_positions)) != len(norm_positions):
        raise ValueError(f"norm_positions has repeats: {norm_positions!r}")
    tokens = _tokens(text, cfg)
    start = time.process_time()
    with _Threads(cfg.threads):
        runs = {name: train_variant(cfg, name, tokens) for name in norm_positions}
    return DepthResult(cfg, runs, unigram_loss(tokens), time.process_time() - start)


# ----------------------------------------------------------------------------- the figures


COLOURS = {"pre": "tab:blue", "post": "tab:red"}


def plot_depth(result: DepthResult, axes=None):
    """(a) each block's gradient norm at initialisation (log scale), (b) the training loss; returns the two axes.

    The loss panel has a dashed line at the unigram loss: a curve lying on it has learnt only
    the byte frequencies. A diverged run ends in a cross.
    """
    import matplotlib.pyplot as plt

    if not isinstance(result, DepthResult):
        raise TypeError(f"result must be a DepthResult (from run_depth), got {type(result).__name__}")
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax_grad, ax_loss = axes
    cfg = result.config
    for name, run in result.runs.items():
        layers = range(1, len(run.grad_norms) + 1)
        ax_grad.plot(layers, run.grad_norms, marker="o", color=COLOURS[name], label=f"{name}-norm")
        ax_loss.plot(range(1, len(run.losses) + 1), run.losses, color=COLOURS[name], label=f"{name}-norm", linewidth=1)
        if run.diverged:
            finite = [v for v in run.losses if math.isfinite(v)]
            ax_loss.plot([len(run.losses)], [finite[-1] if finite else result.unigram_loss], "x", color=COLOURS[name],
                         markersize=10, label=f"{name}-norm diverged at step {len(run.losses)}")
    ax_grad.set_yscale("log")
    ax_grad.set_xlabel("block (1 = next to the embeddings)")
    ax_grad.set_ylabel("gradient norm at initialisation")
    ax_grad.set_title(f"(a) gradients per block, {cfg.n_layers} blocks, one batch")
    ax_grad.set_xticks(list(range(1, cfg.n_layers + 1, max(1, cfg.n_layers // 8))))
    ax_grad.legend(fontsize=8)
    ax_loss.axhline(result.unigram_loss, color="gray", linestyle="--", linewidth=1,
                    label=f"unigram loss {result.unigram_loss:.2f}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (nats per byte)")
    warm = f"{cfg.warmup_steps}-step warm-up" if cfg.warmup_steps else "no warm-up"
    ax_loss.set_title(f"(b) Adam, lr {cfg.lr:g}, {warm}")
    ax_loss.legend(fontsize=8)
    return axes


def plot_grad_norms_vs_depth(sweep: DepthSweep, ax=None):
    """The last block's gradient norm at initialisation against depth (log-log), every seed a dot, the mean a line.

    A dotted line of slope -1/2 through pre-norm's first mean shows Xiong et al.'s 1/sqrt(n_layers).
    """
    import matplotlib.pyplot as plt

    if not isinstance(sweep, DepthSweep):
        raise TypeError(f"sweep must be a DepthSweep (from grad_norms_vs_depth), got {type(sweep).__name__}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    depths = list(sweep.depths)
    for name in NORM_POSITIONS:
        for j in range(len(sweep.seeds)):
            ax.plot(depths, sweep.last_block[name][:, j].tolist(), ".", color=COLOURS[name], alpha=0.4)
        ax.plot(depths, sweep.mean(name).tolist(), marker="o", color=COLOURS[name], label=f"{name}-norm (mean)")
    first = float(sweep.mean("pre")[0])
    ax.plot(depths, [first * math.sqrt(depths[0] / n) for n in depths], ":", color="black", label="1/sqrt(n_layers)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(depths, [str(n) for n in depths])
    ax.set_xlabel("n_layers")
    ax.set_ylabel("last block's gradient norm at initialisation")
    ax.set_title(f"Last block's gradient vs depth ({len(sweep.seeds)} seeds)")
    ax.legend(fontsize=8)
    return ax


__all__ = [
    "NORM_POSITIONS", "INITS", "CPU", "DepthConfig", "DepthResult", "RunResult", "DepthSweep", "init_like_2017",
    "build_model", "block_grad_norms", "unigram_loss", "grad_norms_at_init", "grad_norms_vs_depth", "learning_rate",
    "train_variant", "run_depth", "plot_depth", "plot_grad_norms_vs_depth",
]
