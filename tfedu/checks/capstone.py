"""Notebook 08's capstone: a GPT built from the learner's own parts, trained by the learner's own loop.

Every part a notebook from 05 to 08 had the learner write goes in: multi-head attention (05), the sinusoidal
positions (06), the FFN, LayerNorm, the pre-norm block and the forward pass (07), the batches, the loss, the AdamW
step, the schedule, clipping and the training loop (08), and the sampler that writes its text (08). The same run
with tfedu's reference parts, from the same initial weights, the same batches and the same seed, is the yardstick:
a right set of parts reaches the same held-out loss, up to the rounding that training amplifies (:data:`TOLERANCE`).

:func:`gather` collects the parts: the learner's functions in the notebook's namespace for notebook 08's
exercises, kept parts from ``my_tfedu/`` for the earlier notebooks (``tfedu.use_mine``); any part that is missing
or fails its check is replaced by the reference, and the table it returns says which and why. :func:`train_run`
trains one set; :func:`sample` writes text with one.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tfedu import attention as tfa
from tfedu.checks import carry
from tfedu.checks import nb05_masks_and_heads as nb05
from tfedu.checks import nb06_positional as nb06
from tfedu.checks import nb07_transformer_block as nb07
from tfedu.checks import nb08_training_decoding as nb08
from tfedu.data import CheckpointFile
from tfedu.positional import sinusoidal
from tfedu.train import param_groups

# The parts, in the order the course builds them: exercise number -> (the name the learner gave it, what it is).
PARTS: dict[str, tuple[str, str]] = {
    "5.3": ("MultiHeadAttention", "multi-head attention"),
    "6.1": ("sinusoidal", "the positions (a fixed sinusoidal table)"),
    "7.1": ("FFN", "the feed-forward network"),
    "7.2": ("layer_norm", "LayerNorm"),
    "7.4": ("pre_norm_block", "the pre-norm block"),
    "7.5": ("gpt_forward", "the forward pass"),
    "8.1": ("get_batch", "the batches"),
    "8.2": ("cross_entropy", "the loss"),
    "8.3": ("adamw_step", "the AdamW step"),
    "8.4": ("lr_schedule", "the learning-rate schedule"),
    "8.5": ("clip_grad_norm", "clipping"),
    "8.6": ("train_loop", "the training loop"),
    "8.8": ("sample_next", "the sampler"),
}
CHECKS: dict[str, Callable[[Any], None]] = {
    "5.3": nb05.check_multi_head_attention, "6.1": nb06.check_sinusoidal, "7.1": nb07.check_ffn,
    "7.2": nb07.check_layer_norm, "7.4": nb07.check_pre_norm_block, "7.5": nb07.check_gpt_forward,
    "8.1": nb08.check_get_batch, "8.2": nb08.check_cross_entropy, "8.3": nb08.check_adamw_step,
    "8.4": nb08.check_lr_schedule, "8.5": nb08.check_clip_grad_norm, "8.6": nb08.check_train_loop,
    "8.8": nb08.check_sample_next,
}
REFERENCES: dict[str, Any] = {
    "5.3": tfa.MultiHeadAttention, "6.1": sinusoidal, "7.1": nb07.reference_ffn, "7.2": nb07.reference_layer_norm,
    "7.4": nb07.reference_pre_norm_block, "7.5": nb07.reference_gpt_forward, "8.1": nb08.reference_get_batch,
    "8.2": nb08.reference_cross_entropy, "8.3": nb08.reference_adamw_step, "8.4": nb08.reference_lr_schedule,
    "8.5": nb08.reference_clip_grad_norm, "8.6": nb08.reference_train_loop, "8.8": nb08.reference_sample_next,
}
# What a part the learner wrote must hold for the whole run to count as theirs: the held-out loss within 2%
# of the reference parts' run (notebook 08 measures the spread across seeds beside it).
TOLERANCE = 0.02


@dataclass(frozen=True)
class Recipe:
    """The course GPT's recipe (tfedu.experiments.course_gpt), scaled down to train in about a minute on one core.

    Kept from the course GPT: AdamW with betas (0.9, 0.95) and weight decay 0.1 on matrices only, a peak learning
    rate of 3e-3 after a linear warm-up over the first tenth of the run, cosine decay to a tenth of it, clipping
    to a global norm of 1, 16 windows per step. Changed: half the width and depth, a context of 64, 400 steps,
    no dropout (notebook 05's attention has none), fixed sinusoidal positions (notebook 06's, scaled to the
    embeddings' size: see :class:`GPTOfParts`) for learned ones.
    """

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_ctx: int = 64
    activation: str = "gelu_tanh"
    steps: int = 400
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 40
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eval_every: int = 50
    eval_windows: int = 64  # held-out windows of n_ctx tokens, the same ones for every evaluation


# ----------------------------------------------------------------------------- the parts collected


@dataclass
class Parts:
    """One set of parts (exercise number -> object) and, for each, whose it is."""

    objects: dict[str, Any]
    whose: dict[str, str] = field(default_factory=dict)  # number -> "yours" or "the reference (why)"

    @property
    def all_yours(self) -> bool:
        return all(self.whose.get(number) == "yours" for number in PARTS)

    def table(self) -> str:
        """One line per part, exercise and name, then whose it is; headed by how many are the learner's."""
        width = max(len(f"{number} {name}") for number, (name, _) in PARTS.items())
        yours = sum(self.whose.get(number) == "yours" for number in PARTS)
        lines = [f"{yours} of {len(PARTS)} parts are yours:", f"  {'exercise part':<{width}}  whose"]
        return "\n".join(lines + [f"  {number + ' ' + name:<{width}}  {self.whose.get(number, 'the reference')}"
                                   for number, (name, _) in PARTS.items()])


def reference_parts() -> Parts:
    return Parts(dict(REFERENCES), {number: "the reference" for number in PARTS})


def _passes(number: str, part: Any) -> str | None:
    """None when ``part`` passes its exercise's check, else the first line of the check's feedback."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            CHECKS[number](part)
    except AssertionError as failure:  # CheckFailure and ExerciseNotDone are AssertionErrors
        return (str(failure).splitlines() or [type(failure).__name__])[0]
    return None


def gather(namespace: Mapping[str, Any], earlier: Mapping[str, Any] | None = None, *, here: str = "08") -> Parts:
    """The learner's parts where they pass their checks, the reference elsewhere, and why.

    The parts of notebook ``here`` are looked up by name in ``namespace`` (the notebook's globals); the other
    notebooks' come from ``earlier`` (number -> object) when given, else from the learner's kept files
    (``tfedu.use_mine``). Notebook 09 gathers with ``here="09"``: every part then comes from the kept files.
    Every part the learner has is checked again here, so a part edited since its check passed is not trusted.
    """
    objects, whose = {}, {}
    for number, (name, _) in PARTS.items():
        if number.split(".")[0] == here.lstrip("0"):
            part = namespace.get(name)
            missing = f"no {name} in this notebook"
        elif earlier is not None:
            part = earlier.get(number)
            missing = f"none given for exercise {number}"
        else:
            said = io.StringIO()
            with contextlib.redirect_stdout(said):
                part = carry.use_mine(number, None, name=name)
            missing = said.getvalue().strip().split(": the reference ", 1)[-1].strip("() ") or "not kept"
        problem = missing if part is None else _passes(number, part)
        objects[number] = REFERENCES[number] if problem else part
        whose[number] = f"the reference ({problem})" if problem else "yours"
    return Parts(objects, whose)


# ----------------------------------------------------------------------------- the GPT of the parts


class NormOfParts(nn.Module):
    """LayerNorm's parameters (``weight``, ``bias``) computed with a ``layer_norm(x, weight, bias, eps)`` function."""

    def __init__(self, d_model: int, layer_norm: Callable, eps: float = 1e-5) -> None:
        super().__init__()
        self.layer_norm, self.eps = layer_norm, eps
        self.weight, self.bias = nn.Parameter(torch.ones(d_model)), nn.Parameter(torch.zeros(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(x, self.weight, self.bias, self.eps)


def attention_through(mha: nn.Module, x: torch.Tensor, n_heads: int, flash_fn: Callable) -> torch.Tensor:
    """Causal self-attention with ``mha``'s projections (``W_Q``, ``W_K``, ``W_V``, ``W_O``) around ``flash_fn``.

    ``flash_fn(q, k, v, causal=True)`` takes and returns ``(batch, n_heads, pos, d_head)``: notebook 09's
    FlashAttention (``tfedu.flash.attention_from(forward, backward)``) in place of the softmax the module computes.
    """
    batch, n, d_model = x.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, n, n_heads, -1).transpose(1, 2)  # batch n_heads pos d_head

    z = flash_fn(split(mha.W_Q(x)), split(mha.W_K(x)), split(mha.W_V(x)), causal=True)
    return mha.W_O(z.transpose(1, 2).reshape(batch, n, -1))


class BlockOfParts(nn.Module):
    """A pre-norm decoder block of the parts, with tfedu's parameter names (``ln1``, ``attn.W_Q``, ``mlp.W_in``, ...).

    With ``flash_fn`` the attention keeps the parts' projections and runs ``flash_fn`` between them
    (:func:`attention_through`) instead of the module's own softmax.
    """

    def __init__(self, d_model: int, n_heads: int, activation: str, parts: Mapping[str, Any],
                 flash_fn: Callable | None = None) -> None:
        super().__init__()
        self.block_fn, self.n_heads, self.flash_fn = parts["7.4"], n_heads, flash_fn
        self.ln1, self.ln2 = NormOfParts(d_model, parts["7.2"]), NormOfParts(d_model, parts["7.2"])
        self.attn = parts["5.3"](d_model, n_heads)
        self.mlp = parts["7.1"](d_model, activation)

    def forward(self, resid: torch.Tensor) -> torch.Tensor:
        n = resid.shape[-2]
        if self.flash_fn is not None:
            def attn(x: torch.Tensor) -> torch.Tensor:
                return attention_through(self.attn, x, self.n_heads, self.flash_fn)
        else:
            mask = tfa.causal_mask(n, n, device=resid.device)

            def attn(x: torch.Tensor) -> torch.Tensor:
                return self.attn(x, mask=mask)

        return self.block_fn(resid, self.ln1, attn, self.ln2, self.mlp)


class GPTOfParts(nn.Module):
    """Token embedding (tied to the unembedding), positions, blocks of the parts and a final norm; the forward pass
    is the parts' ``gpt_forward(ids, W_E, W_pos, blocks, ln_final)``.

    ``learned_positions=True`` makes ``W_pos`` a trained parameter (GPT-2's, which notebook 07 loads); otherwise it
    is the parts' sinusoidal table times ``position_scale``, fixed (a buffer). The table's entries are of size 1,
    the token embeddings' 0.02 (GPT-2's initialisation): unscaled, the positions drown the tokens, and the run of
    :class:`Recipe` stays at the unigram loss (6.0 nats after 400 steps, seed 0), while scaled to the embeddings'
    size it reaches 4.47 (learned positions: 4.62). The original Transformer scales the embeddings up instead.

    ``flash_fn`` (notebook 09): every block's attention runs it between the parts' projections.
    """

    def __init__(self, d_vocab: int, n_ctx: int, d_model: int, n_layers: int, n_heads: int, activation: str,
                 parts: Mapping[str, Any], *, learned_positions: bool = False, position_scale: float = 0.02,
                 flash_fn: Callable | None = None) -> None:
        super().__init__()
        self.n_ctx, self.forward_fn = n_ctx, parts["7.5"]
        self.embed = nn.Embedding(d_vocab, d_model)
        if learned_positions:
            self.W_pos = nn.Parameter(torch.zeros(n_ctx, d_model))
        else:
            self.register_buffer("W_pos", position_scale * parts["6.1"](n_ctx, d_model).float(), persistent=False)
        self.blocks = nn.ModuleList(BlockOfParts(d_model, n_heads, activation, parts, flash_fn) for _ in range(n_layers))
        self.ln_final = NormOfParts(d_model, parts["7.2"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.forward_fn(ids, self.embed.weight, self.W_pos, list(self.blocks), self.ln_final)


def initial_weights(d_vocab: int, recipe: Recipe, seed: int) -> dict[str, torch.Tensor]:
    """The run's first weights, drawn once with the reference parts: both runs start from these."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _gpt(d_vocab, recipe, REFERENCES)
        for name, p in model.named_parameters():  # GPT-2's scheme: N(0, 0.02), gains 1, biases 0
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * recipe.n_layers) if name.endswith(("W_O.weight", "W_out.weight")) else 1))
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _gpt(d_vocab: int, recipe: Recipe, parts: Mapping[str, Any], flash_fn: Callable | None = None) -> GPTOfParts:
    return GPTOfParts(d_vocab, recipe.n_ctx, recipe.d_model, recipe.n_layers, recipe.n_heads, recipe.activation, parts,
                      flash_fn=flash_fn)


# ----------------------------------------------------------------------------- training


class AdamWOfSteps(torch.optim.Optimizer):
    """AdamW whose every update is ``step_fn(param, grad, m, v, t, lr, betas, eps, weight_decay) -> (param, m, v)``
    (exercise 8.3), per parameter; param groups, ``lr`` and the state dict as ``torch.optim.AdamW``'s."""

    def __init__(self, params: Any, step_fn: Callable, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.step_fn = step_fn

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["t"] += 1
                new, state["m"], state["v"] = self.step_fn(p, p.grad, state["m"], state["v"], state["t"], group["lr"],
                                                           group["betas"], group["eps"], group["weight_decay"])
                p.copy_(new)


@dataclass
class Run:
    """One training run: the model, each step's training loss, and (step, held-out loss) after each evaluation."""

    model: GPTOfParts
    losses: list[float]
    evals: list[tuple[int, float]]
    seconds: float

    @property
    def final(self) -> float:
        return self.evals[-1][1]


def held_out_windows(val_ids: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """The first ``eval_windows`` non-overlapping windows of n_ctx + 1 held-out tokens (inputs and targets)."""
    n = recipe.n_ctx + 1
    if len(val_ids) < recipe.eval_windows * n:
        raise ValueError(f"the held-out tokens ({len(val_ids)}) are fewer than {recipe.eval_windows} windows of {n}")
    return val_ids[: recipe.eval_windows * n].view(recipe.eval_windows, n)


def train_run(parts: Parts | Mapping[str, Any], train_ids: torch.Tensor, val_ids: torch.Tensor, d_vocab: int,
              recipe: Recipe = Recipe(), seed: int = 0, flash_fn: Callable | None = None) -> Run:
    """Train a GPT of ``parts`` with its own loop, optimizer step, schedule, clipping, batches and loss.

    The first weights (:func:`initial_weights`) and the batch generator's seed are the same whatever the parts, and
    the held-out loss is always measured with PyTorch's cross-entropy, so two runs differ only by their parts
    (and ``flash_fn``, notebook 09's FlashAttention in every block: :class:`GPTOfParts`).
    """
    objects = parts.objects if isinstance(parts, Parts) else parts
    model = _gpt(d_vocab, recipe, objects, flash_fn)
    model.load_state_dict(initial_weights(d_vocab, recipe, seed))  # strict: the parts' names are tfedu's
    windows = held_out_windows(val_ids, recipe)

    def evaluate(m: nn.Module) -> float:
        with torch.no_grad():
            logits = m(windows[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()

    optimizer = AdamWOfSteps(param_groups(model, recipe.weight_decay), objects["8.3"], lr=recipe.lr, betas=recipe.betas,
                             weight_decay=recipe.weight_decay)
    loop = objects["8.6"]
    loop_parts = {"get_batch": objects["8.1"], "cross_entropy": objects["8.2"], "lr_schedule": objects["8.4"],
                  "clip_grad_norm": objects["8.5"]}
    options = dict(steps=recipe.steps, batch_size=recipe.batch_size, seq_len=recipe.n_ctx, max_lr=recipe.lr,
                   warmup_steps=recipe.warmup_steps, evaluate=evaluate, eval_every=recipe.eval_every)
    generator = torch.Generator().manual_seed(seed)
    tic = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        checkpoints = CheckpointFile(os.path.join(folder, "capstone.pt"))
        if loop is nb08.reference_train_loop:
            losses, evals = loop(model, optimizer, train_ids, generator, checkpoints=checkpoints, parts=loop_parts, **options)
        else:
            with nb08.parts_in(loop, loop_parts):  # the learner's loop calls the parts by name
                losses, evals = loop(model, optimizer, train_ids, generator, checkpoints=checkpoints, **options)
    return Run(model.eval(), [float(v) for v in losses], [(int(s), float(v)) for s, v in evals], time.perf_counter() - tic)


def relative_gap(yours: Run, reference: Run) -> float:
    """How far the held-out loss of ``yours`` lies from the reference run's, as a fraction of the reference's."""
    return abs(yours.final - reference.final) / reference.final


@torch.no_grad()
def sample(model: GPTOfParts, prompt_ids: Sequence[int], sample_next: Callable, *, new_tokens: int, temperature: float,
           seed: int) -> list[int]:
    """``prompt_ids`` followed by ``new_tokens`` tokens, each drawn by ``sample_next(logits, temperature, generator)``
    from the model's last-position logits, given at most its last n_ctx tokens."""
    ids = torch.tensor([list(prompt_ids)])
    generator = torch.Generator().manual_seed(seed)
    for _ in range(new_tokens):
        logits = model(ids[:, -model.n_ctx:])[:, -1]
        ids = torch.cat([ids, sample_next(logits, temperature, generator).reshape(1, 1).to(ids.dtype)], dim=1)
    return ids[0].tolist()


# ----------------------------------------------------------------------------- the spread across seeds

SEEDS_FILE = "seeds.json"  # in data/capstone: the reference run's held-out loss for seeds 0-4, with where it was measured


def course_data() -> tuple[torch.Tensor, torch.Tensor, int]:
    """The course corpus as the capstone trains on it: training ids, held-out ids, vocabulary size."""
    import numpy as np

    from tfedu.experiments import course_gpt

    tok = course_gpt.tokenizer()
    train_data, val_data = course_gpt.datasets(tok)
    as_ids = lambda data: torch.from_numpy(data.ids.astype(np.int64))  # noqa: E731
    return as_ids(train_data), as_ids(val_data), tok.vocab_size


def measure_seeds(seeds: Sequence[int] = range(5), recipe: Recipe = Recipe()) -> dict:
    """The reference parts' held-out loss after the run of ``recipe``, for each seed (first weights and batches)."""
    import platform

    train_ids, val_ids, d_vocab = course_data()
    finals = {str(seed): train_run(reference_parts(), train_ids, val_ids, d_vocab, recipe, seed).final for seed in seeds}
    return {"final_val_loss": finals, "recipe": {k: getattr(recipe, k) for k in recipe.__dataclass_fields__},
            "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "command": "python -m tfedu.checks.capstone"}


def stored_seeds() -> dict:
    """What :func:`measure_seeds` wrote to data/capstone/seeds.json."""
    import json

    from tfedu.data import shipped_folder

    return json.loads((shipped_folder("capstone") / SEEDS_FILE).read_text())


if __name__ == "__main__":  # python -m tfedu.checks.capstone: measure the spread again and store it
    import json

    from tfedu.data import shipped_folder

    torch.set_num_threads(1)
    measured = measure_seeds()
    path = shipped_folder("capstone") / SEEDS_FILE  # data/capstone in a checkout, which holds the file
    path.write_text(json.dumps(measured, indent=1) + "\n")
    print(f"wrote {path}: {measured['final_val_loss']}")
