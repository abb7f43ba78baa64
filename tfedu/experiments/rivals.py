"""Notebook 19's measurements: what attention's rivals remember, what a generated token costs, and how well they model text.

Three experiments, each for attention, linear attention, gated linear attention (GLA), Mamba, Gated DeltaNet
and a hybrid (a Gated DeltaNet layer, then attention: Qwen3-Next's pattern cut to two layers):

- **Associative recall** (``train_recall``, ``build_recall``; shipped in ``data/rivals/recall.json``). Multi-query
  associative recall (MQAR: Arora et al. 2023, "Zoology", sec. 3) asks for the value stored under each of many keys
  seen earlier in the context. Zoology writes each pair as two tokens, ``k v``, so a model must first move the key
  onto the value's position (a previous-token head, notebook 15's induction circuit) before it can look anything
  up; on a CPU that circuit alone takes thousands of steps to form (measured: attention stayed near chance for
  1,500 steps of 32 rows at length 64). Here each pair sits at *one* position, its input the sum of the key's and
  the value's embeddings; then every key comes back once, in a random order, marked as a query, and the model must
  name its value. What is left is the lookup itself: can one layer's state hold ``n_pairs`` associations? Attention
  keeps them all in its KV cache; a recurrence must squeeze them into a state of fixed size.
- **The cost of one generated token** (``decode_cost``): time and state bytes of one decoding step of one layer at
  growing context lengths: attention reads a KV cache that grows with the context, the recurrences a state that does
  not.
- **Language-model loss** (``train_lm``, ``build_lm``; shipped in ``data/rivals/lm.json``): two-layer models of
  each kind on the course corpus, at about equal parameter counts (the MLP's width absorbs the mixers' different
  sizes) and the same steps, held-out loss over seeds.

Measured in notebooks/19_beyond_attention.ipynb.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor

from tfedu.config import ModelConfig
from tfedu.data import shipped_folder, write_atomically
from tfedu.delta_rule import GatedDeltaNet
from tfedu.model import GPT, IGNORE_INDEX
from tfedu.recurrences import GatedLinearAttentionLayer, MambaLayer, gated_linear_attention_step
from tfedu.experiments import course_gpt
from tfedu.train import TrainConfig, evaluate, learning_rate, param_groups, train

MIXERS = ("full_attention", "linear", "gla", "mamba", "gated_deltanet", "hybrid")
HYBRID = ("gated_deltanet", "full_attention")  # what "hybrid" means here
LABELS = {"full_attention": "attention", "linear": "linear attention", "gla": "gated linear attention",
          "mamba": "Mamba", "gated_deltanet": "Gated DeltaNet", "hybrid": "hybrid (Gated DeltaNet + attention)"}
FOLDER = shipped_folder("rivals")

# ----------------------------------------------------------------------------- associative recall

N_KEYS = 128  # keys 0..127 and values 128..255 (values repeat within a row; keys do not)
QUERY = 2 * N_KEYS  # the token added to a repeated key: "what was stored under this?"
RECALL_VOCAB = 2 * N_KEYS + 1
N_HEADS = 2
PAIRS = (8, 32, 64)  # pairs per row: sequence lengths 16, 64 and 128
D_MODELS = (32, 64)  # the state-size axis, at 32 pairs; the length axis runs at d_model 64
SEEDS = (0, 1, 2)
N_TEST = 256  # held-out rows per run
TEST_SEED = 10_000  # the held-out rows' generator, apart from every training seed
RECALL_RECIPE = TrainConfig(steps=1200, batch_size=32, lr=3e-3,  # lr: see RECALL_LR
                            warmup_steps=60, min_lr_ratio=0.1,
                            weight_decay=0.0, seed=0)
# The learning rate per mixer: the better of 1e-3 and 3e-3 on a pilot seed (99, outside SEEDS) at 64 pairs, width 64
# (held-out accuracy, 1e-3 / 3e-3): linear attention 0.31 / 0.62, GLA 0.78 / 0.02, Gated DeltaNet 0.06 / 0.01, the
# hybrid 1.00 / 0.01; attention reached 1.00 at 3e-3 on every seed. (At 32 pairs the pilot gave 3e-3 the edge for
# Gated DeltaNet, 0.89, and GLA, 0.91; at 1e-2 and 3e-2 everything but Mamba did worse.) Mamba learns nothing at 32 or
# 64 pairs with any rate tried (32 pairs: 0.03 / 0.01 / 0.01 at 3e-3 / 1e-2 / 3e-2), so its rate comes from 8 pairs
# (seed 99): 0.14 at 3e-3 (it learns only which values occur, 1 / 8) against 0.67 at 3e-2.
RECALL_LR = {"full_attention": 3e-3, "linear": 3e-3, "gla": 1e-3, "gated_deltanet": 1e-3, "hybrid": 1e-3, "mamba": 3e-2}
RECALL_FORMAT = "tfedu-rivals-recall 1"


def _check_int(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return value


def recall_batch(
    n: int, n_pairs: int, generator: torch.Generator, n_keys: int = N_KEYS,
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """``n`` rows of one-position associative recall: (first, second, targets), each (n, 2 n_pairs).

    Position t's input is the sum of two embeddings, ``first[:, t]`` and ``second[:, t]``. The first ``n_pairs``
    positions store the pairs: first is a key (distinct within a row, from 0..n_keys-1), second its value (from
    n_keys..2 n_keys-1, repeats allowed). The last ``n_pairs`` positions ask: first is each key again in a random
    order, second is ``QUERY``, and the target is the key's value; every other target is ``IGNORE_INDEX``.
    Targets sit at the position of their input (the model answers at the query itself).

    >>> first, second, targets = recall_batch(1, 2, torch.Generator().manual_seed(2), n_keys=4)
    >>> first.tolist(), second.tolist(), targets.tolist()  # keys 1 and 3 hold 6 and 7; 3 is asked first
    ([[1, 3, 3, 1]], [[6, 7, 8, 8]], [[-100, -100, 7, 6]])
    """
    _check_int("n", n, 1)
    _check_int("n_pairs", n_pairs, 1)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a seeded torch.Generator, got {type(generator).__name__}")
    if n_pairs > n_keys:
        raise ValueError(f"n_pairs={n_pairs} distinct keys need n_keys >= {n_pairs}, got n_keys={n_keys}")
    keys = torch.rand(n, n_keys, generator=generator).argsort(dim=1)[:, :n_pairs]  # (n, n_pairs), distinct
    values = torch.randint(n_keys, 2 * n_keys, (n, n_pairs), generator=generator)
    order = torch.rand(n, n_pairs, generator=generator).argsort(dim=1)  # the queries' order
    first = torch.cat([keys, keys.gather(1, order)], dim=1)
    second = torch.cat([values, torch.full((n, n_pairs), 2 * n_keys)], dim=1)
    targets = torch.cat([torch.full((n, n_pairs), IGNORE_INDEX), values.gather(1, order)], dim=1)
    return first, second, targets


def _layer_types(mixer: str, n_layers: int) -> tuple[str, ...]:
    if mixer not in MIXERS:
        raise ValueError(f"mixer must be one of {MIXERS}, got {mixer!r}")
    if mixer == "hybrid":
        return HYBRID * (n_layers // 2) if n_layers % 2 == 0 else (*HYBRID * (n_layers // 2), HYBRID[0])
    return (mixer,) * n_layers


def recall_config(mixer: str, d_model: int, n_pairs: int) -> ModelConfig:
    """One layer of ``mixer`` and an MLP (the hybrid: two layers, Gated DeltaNet then attention), 2 heads, RoPE.

    >>> recall_config("hybrid", 32, 8).layer_types
    ('gated_deltanet', 'full_attention')
    """
    n_layers = 2 if mixer == "hybrid" else 1
    return ModelConfig(d_vocab=RECALL_VOCAB, n_ctx=2 * n_pairs, d_model=d_model, n_layers=n_layers, n_heads=N_HEADS,
                       positional="rope", layer_types=_layer_types(mixer, n_layers))


def state_numbers(cfg: ModelConfig, context: int) -> int:
    """Numbers the model carries from one position to the next after ``context`` tokens, all layers together.

    Attention: its KV cache, 2 d_model numbers per position and layer (grows with the context). Linear attention,
    GLA and Gated DeltaNet: a d_head x d_head matrix per head (Gated DeltaNet adds its convolution's last 3 inputs
    of q, k and v). Mamba: d_inner x d_state plus the convolution's last 3 inputs per channel.

    >>> state_numbers(recall_config("linear", 64, 8), 16), state_numbers(recall_config("full_attention", 64, 8), 16)
    (2048, 2048)
    """
    total = 0
    for kind in cfg.layer_types:
        if kind == "full_attention":
            total += 2 * cfg.d_model * context
        elif kind == "mamba":
            d_inner = 2 * cfg.d_model
            total += d_inner * (cfg.d_state + 3)
        elif kind == "gated_deltanet":
            total += cfg.n_heads * cfg.d_head * cfg.d_head + 3 * 3 * cfg.n_heads * cfg.d_head
        else:
            total += cfg.n_heads * cfg.d_head * cfg.d_head
    return total


def _sequential_scans(model: GPT) -> GPT:
    # On one CPU thread Mamba's sequential scan is 3-5x faster than the Hillis-Steele parallel scan, which keeps every
    # h_t (d_model 64, 256 positions, batch 16: 0.37 s against 1.97 s a step); the two are equal (tests/test_recurrences).
    for block in model.blocks:
        if isinstance(block.attn, MambaLayer):
            block.attn.scan = "sequential"
    return model


def recall_logits(model: GPT, first: Tensor, second: Tensor) -> Tensor:
    """The model's logits (batch, pos, d_vocab) when position t's input is embed(first[t]) + embed(second[t])."""
    resid = model.embed(first) + model.embed(second)
    resid = model.run_blocks(model.blocks, resid, causal=True, padding_mask=None, kv_cache=None, positions=None)
    return model.unembed(model.ln_final(resid))


@torch.no_grad()
def recall_accuracy(model: GPT, first: Tensor, second: Tensor, targets: Tensor) -> float:
    """The fraction of queries whose value the model's argmax names."""
    was_training = model.training
    model.eval()
    predicted = recall_logits(model, first, second).argmax(dim=-1)
    model.train(was_training)
    asked = targets != IGNORE_INDEX
    return (predicted[asked] == targets[asked]).float().mean().item()


def _train(model: GPT, recipe: TrainConfig, batch: Callable[[torch.Generator], tuple], loss_of: Callable,
           seed: int) -> list[float]:
    optimizer = torch.optim.AdamW(param_groups(model, recipe.weight_decay), lr=recipe.lr, betas=recipe.betas)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, recipe)
        loss = loss_of(model, batch(generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        losses.append(loss.item())
    return losses


def _recall_loss(model: GPT, rows: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    first, second, targets = rows
    return F.cross_entropy(recall_logits(model, first, second).flatten(0, 1), targets.flatten(),
                           ignore_index=IGNORE_INDEX)


def curriculum(n_pairs: int) -> list[int]:
    """The pair counts the training batches cycle through for a run tested at ``n_pairs``: halvings down to 4.

    Zoology trains on a mixture of sizes too. Only long rows, and attention spreads its first guesses over so many
    positions that the gradient toward the right one is faint: attention at 64 pairs learned the task on one seed of
    three in 1,200 steps of long rows alone, and on every seed with the mixture (same steps, same rate).

    >>> curriculum(64), curriculum(8), curriculum(3)
    ([8, 16, 32, 64], [4, 8], [3])
    """
    sizes = [n_pairs]
    while sizes[0] // 2 >= 4 and len(sizes) < 4:
        sizes.insert(0, sizes[0] // 2)
    return sizes


def recall_recipe(mixer: str) -> TrainConfig:
    """``RECALL_RECIPE`` with ``mixer``'s learning rate (``RECALL_LR``).

    >>> recall_recipe("mamba").lr, recall_recipe("gla").lr
    (0.03, 0.001)
    """
    if mixer not in RECALL_LR:
        raise ValueError(f"mixer must be one of {MIXERS}, got {mixer!r}")
    return dataclasses.replace(RECALL_RECIPE, lr=RECALL_LR[mixer])


def train_recall(mixer: str, d_model: int, n_pairs: int, seed: int, *, recipe: TrainConfig | None = None,
                 n_test: int = N_TEST) -> dict:
    """Train one model on fresh recall rows (``seed`` sets the weights and the rows); its held-out accuracy.

    ``recipe`` defaults to ``recall_recipe(mixer)``.

    Returns the run's record: mixer, d_model, n_pairs, seq_len, seed, steps, final_loss (mean of the last 20
    steps), accuracy (on ``n_test`` rows from ``TEST_SEED``), n_params, state (numbers carried, ``state_numbers``)
    and seconds. The same arguments give the same record on a CPU (bar the seconds).
    """
    recipe = recall_recipe(mixer) if recipe is None else recipe
    cfg = recall_config(mixer, d_model, n_pairs)
    tic = time.perf_counter()
    torch.manual_seed(seed)
    model = _sequential_scans(GPT(cfg).train())
    sizes = curriculum(n_pairs)
    step = iter(range(recipe.steps))

    def batch(generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        return recall_batch(recipe.batch_size, sizes[next(step) % len(sizes)], generator)

    losses = _train(model, recipe, batch, _recall_loss, seed)
    test = recall_batch(n_test, n_pairs, torch.Generator().manual_seed(TEST_SEED))
    tail = losses[-20:]
    return {"mixer": mixer, "d_model": d_model, "n_pairs": n_pairs, "seq_len": 2 * n_pairs, "seed": seed,
            "steps": recipe.steps, "lr": recipe.lr, "final_loss": round(statistics.fmean(tail), 4),
            "accuracy": round(recall_accuracy(model, *test), 4), "n_params": sum(p.numel() for p in model.parameters()),
            "state": state_numbers(cfg, 2 * n_pairs), "seconds": round(time.perf_counter() - tic, 2)}


def recall_grid() -> list[tuple[str, int, int]]:
    """(mixer, d_model, n_pairs) of the sweep: every mixer at d_model 64 and each of ``PAIRS``, and at 32 pairs
    with each of ``D_MODELS``."""
    cells = [(m, 64, p) for m in MIXERS for p in PAIRS]
    return cells + [(m, d, 32) for m in MIXERS for d in D_MODELS if (m, d, 32) not in cells]


def _machine(tic: float) -> dict:
    return {"seconds": round(time.perf_counter() - tic, 1), "device": "cpu", "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine()}


def _recipe_dict(recipe: TrainConfig) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(recipe).items()}


def build_recall(out_dir: str | os.PathLike = FOLDER, *, mixers: Sequence[str] = MIXERS, progress: bool = True,
                 file: str = "recall.json") -> dict:
    """Run the recall sweep (``recall_grid`` x ``SEEDS``) and write ``out_dir/recall.json``.

    ``mixers`` runs part of the grid (``file`` names its log; ``merge_logs`` joins the parts), so that two
    processes can share the work.
    """
    tic = time.perf_counter()
    runs = []
    for mixer, d_model, n_pairs in recall_grid():
        if mixer not in mixers:
            continue
        for seed in SEEDS:
            runs.append(train_recall(mixer, d_model, n_pairs, seed))
            if progress:
                r = runs[-1]
                print(f"{mixer:>15} d_model {d_model:>2} pairs {n_pairs:>2} seed {seed}: accuracy {r['accuracy']:.3f} "
                      f"({r['seconds']:.0f} s)", flush=True)
    log = {"format": RECALL_FORMAT, "runs": runs, "recipe": _recipe_dict(RECALL_RECIPE), "lr": RECALL_LR, "n_keys": N_KEYS,
           "n_heads": N_HEADS, "hybrid": list(HYBRID), "n_test": N_TEST, "test_seed": TEST_SEED, **_machine(tic)}
    _write(Path(out_dir) / file, log)
    return log


def merge_logs(parts: Sequence[str | os.PathLike], out: str | os.PathLike) -> dict:
    """One log from logs of parts of a sweep (same format and recipe): their runs together, the longest time."""
    logs = [json.loads(Path(p).read_text()) for p in parts]
    first = logs[0]
    for log in logs[1:]:
        if log["format"] != first["format"] or log["recipe"] != first["recipe"]:
            raise ValueError("the parts come from different sweeps (format or recipe differ)")
    merged = {**first, "runs": [run for log in logs for run in log["runs"]],
              "seconds": max(log["seconds"] for log in logs), "processes": len(logs)}
    _write(Path(out), merged)
    return merged


def _write(file: Path, log: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(file, lambda p: p.write_text(json.dumps(log, indent=1) + "\n"))


def _load(file: Path, fmt: str, preset: str) -> dict:
    if not file.is_file():
        raise FileNotFoundError(f"no log at {file}: `tfedu train --preset {preset}` writes it")
    log = json.loads(file.read_text())
    if log.get("format") != fmt:
        raise ValueError(f"{file} is not a log of format {fmt!r} (found {log.get('format')!r})")
    return log


def load_recall(path: str | os.PathLike = FOLDER) -> dict:
    """The shipped recall sweep: every run's record, the recipe, the time it took and the machine."""
    return _load(Path(path) / "recall.json", RECALL_FORMAT, "rivals-recall")


def summarise(runs: Sequence[dict], keys: Sequence[str], value: str) -> dict[tuple, tuple[float, float, int]]:
    """``key tuple -> (mean, standard deviation, number of runs)`` of ``value`` over the runs sharing those keys.

    >>> runs = [{"mixer": "gla", "n_pairs": 8, "accuracy": a} for a in (0.5, 0.7)]
    >>> summarise(runs, ("mixer", "n_pairs"), "accuracy")
    {('gla', 8): (0.6, 0.1414, 2)}
    """
    groups: dict[tuple, list[float]] = {}
    for run in runs:
        groups.setdefault(tuple(run[k] for k in keys), []).append(run[value])
    return {key: (round(statistics.fmean(v), 4), round(statistics.stdev(v), 4) if len(v) > 1 else 0.0, len(v))
            for key, v in groups.items()}


# ----------------------------------------------------------------------------- the cost of one generated token


def best_seconds(fn: Callable[[], object], repeats: int, inner: int = 10) -> float:
    """Seconds per call of ``fn``: the fastest of ``repeats`` timings of ``inner`` calls each, divided by ``inner``.

    The fastest, not the median: on a busy machine the scheduler takes the CPU away in slices of a few
    milliseconds, which inflates some timings by whole slices and never deflates one.
    """
    fn()  # warm-up: first-call allocations
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - tic) / inner)
    return best


def decode_cost(contexts: Sequence[int], *, d_model: int = 256, n_heads: int = 4, repeats: int = 5,
                seed: int = 0) -> list[dict]:
    """Time and state of one decoding step of one layer, after each of ``contexts`` tokens, for each kind of layer.

    Attention's step: project the new token, write its key and value into a cache of ``context`` positions, attend
    over all of them, project out. The recurrences' steps (``GatedLinearAttentionLayer``'s projections and
    ``gated_linear_attention_step``, ``MambaLayer.step``, ``GatedDeltaNet.step``) read and write a state whose size
    does not depend on the context, and their work does not depend on what the state holds, so it is not filled by
    a prefill first; attention's cache is filled with random keys and values (its work does not depend on them
    either). Returns rows {kind, context, seconds (``best_seconds`` of ``repeats`` x 10 steps), state_bytes} in float32,
    batch 1.
    """
    torch.manual_seed(seed)
    d_head = d_model // n_heads
    rows = []
    with torch.inference_mode():
        x = torch.randn(1, d_model)
        qkv, out = torch.nn.Linear(d_model, 3 * d_model), torch.nn.Linear(d_model, d_model)
        gla = GatedLinearAttentionLayer(d_model, n_heads)
        mamba = MambaLayer(d_model, 2 * d_model)
        gdn = GatedDeltaNet(d_model, n_heads, d_head, d_head)
        for context in contexts:
            _check_int("context", context, 1)
            cache = torch.randn(2, 1, n_heads, context + 1, d_head)

            def attention_step() -> Tensor:
                q, k, v = qkv(x).view(1, 3, n_heads, 1, d_head).unbind(1)
                cache[0, :, :, context:] = k  # the new position's key and value join the cache
                cache[1, :, :, context:] = v
                o = F.scaled_dot_product_attention(q, cache[0], cache[1])  # (1, n_heads, 1, d_head)
                return out(o.flatten(1))

            S = torch.zeros(1, n_heads, d_head, d_head)

            def gla_step() -> Tensor:
                q, k, v = (t.view(1, n_heads, d_head) for t in gla._qkv(x[:, None]))
                g = gla.gates(x[:, None])[..., 0]
                o, _ = gated_linear_attention_step(S, q, k, v, g)
                return gla.W_O(gla.norm(o, gla.W_G(x).view(1, n_heads, d_head)).flatten(1))

            mamba_state, gdn_cache = mamba.empty_state(1), gdn.empty_cache(1)
            steps = {"full_attention": (attention_step, cache[:, :, :, :context].numel() * 4),
                     "gla": (gla_step, S.numel() * 4),
                     "mamba": (lambda: mamba.step(x, mamba_state),
                               (mamba_state.conv_state.numel() + mamba_state.ssm_state.numel()) * 4),
                     "gated_deltanet": (lambda: gdn.step(x, gdn_cache),
                                        (gdn_cache.conv_state.numel() + gdn_cache.state.numel()) * 4)}
            for kind, (step, state_bytes) in steps.items():
                rows.append({"kind": kind, "context": context, "seconds": best_seconds(step, repeats),
                             "state_bytes": state_bytes})
    return rows


# ----------------------------------------------------------------------------- language-model loss at equal size

LM_D_MODEL, LM_LAYERS, LM_HEADS, LM_CTX = 64, 2, 2, 128
LM_RECIPE = TrainConfig(steps=600, batch_size=16, lr=3e-3, warmup_steps=60, min_lr_ratio=0.1, weight_decay=0.1,
                        eval_every=10_000, seed=0)  # no evaluation during the run: once at the end
LM_FORMAT = "tfedu-rivals-lm 1"


def _lm_config(mixer: str, d_mlp: int | None) -> ModelConfig:
    return ModelConfig(d_vocab=course_gpt.VOCAB_SIZE, n_ctx=LM_CTX, d_model=LM_D_MODEL, n_layers=LM_LAYERS,
                       n_heads=LM_HEADS, positional="rope", d_mlp=d_mlp, layer_types=_layer_types(mixer, LM_LAYERS))


def _n_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):  # counts without allocating or initialising
        return sum(p.numel() for p in GPT(cfg).parameters())


@functools.cache
def lm_config(mixer: str) -> ModelConfig:
    """The LM sweep's model for ``mixer``: ``LM_LAYERS`` layers of width ``LM_D_MODEL`` with the course GPT's
    tokenizer and context, and the MLP width that brings its parameter count closest to the attention model's
    (whose MLP is 4 d_model wide): the mixers differ in size, the total does not (within a few hundred).

    >>> abs(_n_params(lm_config("mamba")) - _n_params(lm_config("full_attention"))) < 300
    True
    """
    target = _n_params(_lm_config("full_attention", 4 * LM_D_MODEL))
    per_unit = _n_params(_lm_config(mixer, 2)) - _n_params(_lm_config(mixer, 1))  # parameters per unit of d_mlp
    base = _n_params(_lm_config(mixer, 1)) - per_unit
    d_mlp = max(1, round((target - base) / per_unit))
    return _lm_config(mixer, d_mlp)


@functools.cache
def _course_data() -> tuple:
    return course_gpt.datasets(course_gpt.tokenizer())


def train_lm(mixer: str, seed: int, *, recipe: TrainConfig = LM_RECIPE) -> dict:
    """Train ``lm_config(mixer)`` on the course corpus (``seed``: weights and batches) and measure held-out loss.

    Returns {mixer, seed, steps, d_mlp, n_params, train_loss (mean of the last 20 steps), val_loss (the whole
    held-out split), seconds}.
    """
    cfg = lm_config(mixer)
    train_data, val_data = _course_data()
    tic = time.perf_counter()
    torch.manual_seed(seed)
    model = _sequential_scans(GPT(cfg))
    result = train(model, train_data, dataclasses.replace(recipe, seed=seed), progress=False)
    tail = [record["loss"] for record in result.history[-20:]]
    return {"mixer": mixer, "seed": seed, "steps": recipe.steps, "d_mlp": cfg.d_mlp,
            "n_params": sum(p.numel() for p in model.parameters()), "train_loss": round(statistics.fmean(tail), 4),
            "val_loss": round(evaluate(model, val_data, cfg.n_ctx), 4), "seconds": round(time.perf_counter() - tic, 1)}


def build_lm(out_dir: str | os.PathLike = FOLDER, *, mixers: Sequence[str] = MIXERS, progress: bool = True,
             file: str = "lm.json") -> dict:
    """Train every mixer of ``mixers`` for each of ``SEEDS`` and write ``out_dir/lm.json``."""
    tic = time.perf_counter()
    runs = []
    for mixer in mixers:
        for seed in SEEDS:
            runs.append(train_lm(mixer, seed))
            if progress:
                r = runs[-1]
                print(f"{mixer:>15} seed {seed}: held-out loss {r['val_loss']:.3f} ({r['seconds']:.0f} s)", flush=True)
    log = {"format": LM_FORMAT, "runs": runs, "recipe": _recipe_dict(LM_RECIPE), "d_model": LM_D_MODEL,
           "n_layers": LM_LAYERS, "n_heads": LM_HEADS, "n_ctx": LM_CTX, "hybrid": list(HYBRID), **_machine(tic)}
    _write(Path(out_dir) / file, log)
    return log


def load_lm(path: str | os.PathLike = FOLDER) -> dict:
    """The shipped LM sweep: every run's record, the recipe, the time it took and the machine."""
    return _load(Path(path) / "lm.json", LM_FORMAT, "rivals-lm")
