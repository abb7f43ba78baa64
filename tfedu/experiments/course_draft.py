"""The course draft model, and what speculative decoding with it measures: notebook 18's numbers.

Speculative decoding (``tfedu.speculative``) needs a *draft*: a model much cheaper than the target that
still often predicts the target's next token. This one is the course GPT's recipe made small: the same
tokenizer, data, split and training schedule (``course_gpt.tokenizer``, ``datasets``, ``TRAIN_CONFIG``),
one layer of width 64 instead of four of width 128. It ships in ``data/course-draft/``
(``model.safetensors``, ``config.json``, ``train_log.json``; the tokenizer is the course GPT's), and
``tfedu train --preset course-draft`` makes it again, step for step (tests/test_course_draft.py).

The measurements, for ``target = course_gpt.load()[0]`` and ``draft = load()[0]`` on held-out course text
(``held_out_prompts``):

- ``acceptance_vs_k``: acceptance rate and tokens per target pass against the draft length k, greedy or
  sampled, with their spread over prompts and seeds; with ``drafter=prompt_lookup_draft`` for prompt lookup.
- ``speedup_vs_k``: wall-clock time per token against ``tfedu.generate.generate`` on the target alone
  (identical tokens checked first), the measured cost ratio c of a draft pass to a target pass, the cost of
  the target's (k+1)-token verifying pass against a 1-token one, and the speed-up Leviathan et al. (2023)
  predict from them (``predicted_speedup``).

>>> draft, tokenizer = load()  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
from jaxtyping import Int
from torch import Tensor, nn

from tfedu.experiments import course_gpt
from tfedu.experiments.course_gpt import TRAIN_CONFIG, datasets, tokenizer
from tfedu.generate import generate
from tfedu.kv_cache import KVCache
from tfedu.model import GPT
from tfedu.shipped_models import SHIPPED, load_shipped, load_shipped_log, save_shipped, shipped_folder
from tfedu.speculative import Drafter, speculative_generate
from tfedu.tokenizer import Tokenizer

NAME = "course-draft"
FORMAT = SHIPPED[NAME].format
FOLDER = shipped_folder(NAME)
MODEL_SEED = 0

# One layer of width 64 (d_head 32, as the target's), chosen by measuring (one CPU thread, 8 held-out prompts):
# its 1-token pass costs c = 0.31 of the target's and it agrees with the target's greedy token 47% of the time
# (k = 1); two layers agree 57% of the time but cost c = 0.50, which predicts less speed-up at every k.
MODEL_CONFIG = course_gpt.MODEL_CONFIG.replace(n_layers=1, d_model=64, n_heads=2)


def fresh_model() -> GPT:
    torch.manual_seed(MODEL_SEED)
    return GPT(MODEL_CONFIG)


def build(out_dir: str | os.PathLike = FOLDER, *, steps: int | None = None, progress: bool = True) -> dict:
    """Train the draft model from scratch on the CPU and write its folder; returns the training log.

    The course GPT's data and schedule (``course_gpt.TRAIN_CONFIG``); ``steps`` cuts the run short
    (the schedule stays the full one, so the first steps equal the shipped run's).
    """
    model = fresh_model()
    log = course_gpt.train_on_corpus(model, tokenizer(), steps=steps, device="cpu", progress=progress)
    save(model, out_dir, log)
    return log


def save(model: GPT, out_dir: str | os.PathLike, log: dict) -> Path:
    """Write ``model.safetensors``, ``config.json`` and ``train_log.json``, each through a temporary name."""
    config = {"format": FORMAT, "model": model.cfg.as_dict(), "train": asdict(TRAIN_CONFIG),
              "tokenizer": "the course GPT's (data/course-gpt/tokenizer.txt)"}
    return save_shipped(model, out_dir, config, log=log)


def load(path: str | os.PathLike = FOLDER) -> tuple[GPT, Tokenizer]:
    """The shipped draft model (in eval mode) from ``path``, and its tokenizer: the shipped course GPT's."""
    model, _ = load_shipped(NAME, path)
    return model, Tokenizer.load(course_gpt.FOLDER / "tokenizer.txt")


def load_log(path: str | os.PathLike = FOLDER) -> dict:
    """The shipped training log: every step's loss and learning rate, every evaluation, time and machine."""
    return load_shipped_log(NAME, path)


# ----------------------------------------------------------------------------- the model of the speed-up


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """``1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)``: tokens per target pass.

    Leviathan et al. (2023), section 3.3, eq. 1: each of the k draft tokens is accepted with probability
    ``alpha``, independently, until the first rejection, and the pass adds one token of its own.

    >>> expected_tokens_per_pass(0.5, 2), expected_tokens_per_pass(1.0, 4)
    (1.75, 5.0)
    """
    _check_alpha_k(alpha, k)
    return sum(alpha**i for i in range(k + 1))  # no division: exact at alpha = 1


def predicted_speedup(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """The expected wall-clock speed-up of speculative decoding over the target alone.

    Leviathan et al. (2023), section 3.4, Theorem 3.8: ``(1 - alpha^(k+1)) / ((1 - alpha) (k c + 1))``,
    with ``alpha`` the probability that a draft token is accepted and ``c`` the cost coefficient (their
    Definition 3.7): the time of one draft pass over the time of one target pass. A round costs k draft
    passes and one target pass and yields ``expected_tokens_per_pass(alpha, k)`` tokens. The theorem
    assumes that the target scores k + 1 tokens in the time it scores one (spare parallel compute);
    ``verify_cost`` is that pass's time over a 1-token pass where it is not (measured: ``speedup_vs_k``),
    and replaces the 1 in the denominator.

    >>> predicted_speedup(0.5, 1, 0.0), predicted_speedup(1.0, 3, 0.0), round(predicted_speedup(0.8, 4, 0.1), 3)
    (1.5, 4.0, 2.401)
    """
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < math.inf:
        raise ValueError(f"c (draft pass time / target pass time) must be a number >= 0, got {c!r}")
    if isinstance(verify_cost, bool) or not isinstance(verify_cost, (int, float)) or not 0 < verify_cost < math.inf:
        raise ValueError(f"verify_cost (a (k+1)-token target pass over a 1-token one) must be > 0, got {verify_cost!r}")
    return expected_tokens_per_pass(alpha, k) / (k * c + verify_cost)


def alpha_from_tokens_per_pass(tokens_per_pass: float, k: int) -> float:
    """The acceptance probability ``alpha`` for which ``expected_tokens_per_pass(alpha, k)`` is the given value.

    The counted acceptance rate (accepted / drafted) is *not* alpha for k > 1: the draft tokens after a
    rejection are drafted but never tested, so it comes out lower. Inverting eq. 1 of Leviathan et al.
    (2023) gives the per-token probability that their model assumes (bisection; it rises with alpha).

    >>> alpha_from_tokens_per_pass(1.75, 2)
    0.5
    """
    if not 1 <= tokens_per_pass <= k + 1:
        raise ValueError(f"tokens per pass must lie in 1..k+1 = 1..{k + 1}, got {tokens_per_pass!r}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens_per_pass(mid, k) < tokens_per_pass else (low, mid)
    return round((low + high) / 2, 12)


def _check_alpha_k(alpha: float, k: int) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha (the acceptance probability) must lie in [0, 1], got {alpha!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (draft tokens per round) must be an int >= 1, got {k!r}")


# ----------------------------------------------------------------------------- measurements


def held_out_prompts(tok: Tokenizer | None = None, n: int = 8, length: int = 32) -> Int[Tensor, "n length"]:
    """``n`` prompts of ``length`` tokens, evenly spaced through the held-out course text (never trained on)."""
    _, val_data = datasets(tok if tok is not None else Tokenizer.load(course_gpt.FOLDER / "tokenizer.txt"))
    if n < 1 or length < 1 or length > len(val_data):
        raise ValueError(f"need n >= 1 prompts of 1..{len(val_data)} tokens, got n={n}, length={length}")
    starts = torch.linspace(0, len(val_data) - length, n).long().tolist()
    ids = torch.from_numpy(val_data.ids.astype("int64"))
    return torch.stack([ids[s:s + length] for s in starts])


def acceptance_vs_k(
    target: nn.Module,
    draft: nn.Module | None,
    prompts: Int[Tensor, "n_prompts pos"],
    ks,
    *,
    new_tokens: int,
    do_sample: bool,
    seeds=(0,),
    temperature: float = 1.0,
    drafter: Drafter | None = None,
) -> list[dict]:
    """For each k in ``ks``: acceptance rate and tokens per target pass of ``speculative_generate``, and their spread.

    Each prompt (a row of ``prompts``) is decoded for ``new_tokens`` tokens, once per seed when
    sampling (``torch.Generator().manual_seed(seed)``) and once when greedy (seeds change nothing
    there). One dict per k: ``acceptance_rate`` and ``tokens_per_pass`` pooled over all runs (accepted /
    drafted, emitted / target passes), ``alpha`` (the per-token acceptance probability that gives those
    tokens per pass, ``alpha_from_tokens_per_pass``), and per-run ``*_mean``, ``*_sem`` (standard error
    of the mean), ``*_min``, ``*_max`` over the ``runs`` runs. ``draft=None, drafter=prompt_lookup_draft``
    measures prompt lookup.
    """
    prompts = _check_prompts(prompts)
    runs = list(seeds) if do_sample else [None]
    results = []
    for k in ks:
        stats = []
        for prompt in prompts:
            for seed in runs:
                generator = torch.Generator().manual_seed(seed) if seed is not None else None
                _, s = speculative_generate(target, draft, prompt[None], new_tokens, k=k, do_sample=do_sample,
                                            temperature=temperature, generator=generator, drafter=drafter)
                stats.append(s)
        accepted, drafted = sum(s.accepted for s in stats), sum(s.drafted for s in stats)
        emitted, passes = sum(s.emitted for s in stats), sum(s.target_passes for s in stats)
        row = {"k": k, "runs": len(stats), "acceptance_rate": accepted / drafted if drafted else 0.0,
               "tokens_per_pass": emitted / passes, "alpha": alpha_from_tokens_per_pass(emitted / passes, k)}
        row.update(_spread("acceptance_rate", [s.acceptance_rate for s in stats]))
        row.update(_spread("tokens_per_pass", [s.tokens_per_pass for s in stats]))
        results.append(row)
    return results


def _spread(name: str, values: list[float]) -> dict:
    mean = statistics.fmean(values)
    sem = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return {f"{name}_mean": mean, f"{name}_sem": sem, f"{name}_min": min(values), f"{name}_max": max(values)}


def _check_prompts(prompts: object) -> Tensor:
    if not isinstance(prompts, Tensor) or prompts.dim() != 2 or prompts.is_floating_point() or not prompts.numel():
        got = f"{prompts.dtype} {tuple(prompts.shape)}" if isinstance(prompts, Tensor) else type(prompts).__name__
        raise ValueError(f"prompts must be a 2-D integer tensor (n_prompts, pos), one prompt per row, got {got}")
    return prompts


def pass_seconds(model: nn.Module, prompt: Int[Tensor, "pos"], n_tokens: int, *, calls: int = 10) -> float:
    """Median seconds of one cached forward pass of ``model`` over ``n_tokens`` new tokens after ``prompt``.

    What a decoding step costs: the cache holds the prompt, the pass adds ``n_tokens`` positions (1: a
    plain decoding step or a draft step; k + 1: the target verifying k draft tokens), then the cache is
    cropped back. Median of ``calls`` calls, after one to warm up.
    """
    cache = KVCache.for_model(model, 1, capacity=prompt.shape[0] + n_tokens)
    new = prompt[-n_tokens:].flip(0)[None].clone()  # any tokens will do: the cost does not depend on them
    times = []
    with torch.inference_mode():
        model(prompt[None], kv_cache=cache)
        for _ in range(calls + 1):
            tic = time.perf_counter()
            model(new, kv_cache=cache)
            times.append(time.perf_counter() - tic)
            cache.crop(prompt.shape[0])
    return statistics.median(times[1:])


def speedup_vs_k(
    target: nn.Module,
    draft: nn.Module | None,
    prompts: Int[Tensor, "n_prompts pos"],
    ks,
    *,
    new_tokens: int,
    repeats: int = 3,
    drafter: Drafter | None = None,
    pass_calls: int = 10,
) -> dict:
    """Greedy speculative decoding against ``generate(target, ...)`` alone: time per token, measured and predicted.

    First every prompt is decoded both ways and the tokens are asserted identical; those runs also give
    each k's tokens per pass and ``alpha`` (``alpha_from_tokens_per_pass``). Then ``repeats`` rounds, each
    timing every method over all prompts in turn (the order rotates each round, so the machine's
    load falls on all alike); the median per method is kept. Pass costs (``pass_seconds``, at the end
    of the prompts, interleaved the same way): ``c`` = draft 1-token pass / target 1-token pass, and
    ``verify_cost[k]`` = target (k+1)-token pass / target 1-token pass, which Leviathan et al. (2023)
    take to be 1. With a drafter function there is no draft pass: ``c`` is 0 and the drafter's time shows
    only in the measured ``speedup``. Returns ``{"baseline_seconds_per_token", "c", "target_pass_seconds",
    "draft_pass_seconds", "threads", "rows": [one dict per k]}``, each row holding ``seconds_per_token``,
    ``speedup`` (measured), ``predicted_speedup`` (the paper's formula with this ``alpha`` and ``c``) and
    ``predicted_speedup_with_verify_cost`` (the same with the measured ``verify_cost``).
    """
    prompts = _check_prompts(prompts)
    ks = list(ks)
    baselines = [generate(target, prompt[None], new_tokens) for prompt in prompts]
    tokens_per_pass = {}
    for k in ks:
        emitted = passes = 0
        for prompt, expected in zip(prompts, baselines):
            tokens, stats = speculative_generate(target, draft, prompt[None], new_tokens, k=k, drafter=drafter)
            if not torch.equal(tokens, expected):
                raise AssertionError(f"greedy speculative decoding with k={k} gave other tokens than the target alone "
                                     f"for prompt {prompt.tolist()[:8]}...")
            emitted, passes = emitted + stats.emitted, passes + stats.target_passes
        tokens_per_pass[k] = emitted / passes

    methods = {"baseline": lambda prompt: generate(target, prompt[None], new_tokens)}
    for k in ks:
        methods[k] = lambda prompt, k=k: speculative_generate(target, draft, prompt[None], new_tokens, k=k,
                                                              drafter=drafter)
    last = prompts[0]
    passes = {("target", 1): lambda: pass_seconds(target, last, 1, calls=pass_calls)}
    if draft is not None:
        passes["draft", 1] = lambda: pass_seconds(draft, last, 1, calls=pass_calls)
    for k in ks:
        passes["target", k + 1] = lambda k=k: pass_seconds(target, last, k + 1, calls=pass_calls)
    times = {name: [] for name in methods}
    pass_times = {name: [] for name in passes}
    for r in range(repeats):
        for name in _rotated(list(methods), r):
            tic = time.perf_counter()
            for prompt in prompts:
                methods[name](prompt)
            times[name].append((time.perf_counter() - tic) / (len(prompts) * new_tokens))
        for name in _rotated(list(passes), r):
            pass_times[name].append(passes[name]())
    per_token = {name: statistics.median(t) for name, t in times.items()}
    per_pass = {name: statistics.median(t) for name, t in pass_times.items()}
    one = per_pass["target", 1]
    c = per_pass["draft", 1] / one if draft is not None else 0.0
    rows = []
    for k in ks:
        alpha = alpha_from_tokens_per_pass(tokens_per_pass[k], k)
        verify_cost = per_pass["target", k + 1] / one
        rows.append({"k": k, "seconds_per_token": per_token[k], "speedup": per_token["baseline"] / per_token[k],
                     "tokens_per_pass": tokens_per_pass[k], "alpha": alpha, "verify_cost": verify_cost,
                     "predicted_speedup": predicted_speedup(alpha, k, c),
                     "predicted_speedup_with_verify_cost": predicted_speedup(alpha, k, c, verify_cost)})
    return {"baseline_seconds_per_token": per_token["baseline"], "c": c, "target_pass_seconds": one,
            "draft_pass_seconds": per_pass.get(("draft", 1)), "threads": torch.get_num_threads(), "rows": rows}


def _rotated(items: list, r: int) -> list:
    r %= len(items)
    return items[r:] + items[:r]
