"""Speculative decoding: a cheap guesser proposes k tokens, the large model checks all of them in one pass.

Decoding one token at a time is bound by memory traffic: each step reads every weight of the model
to produce one token. Scoring k + 1 positions in one forward pass costs about the same as scoring
one, so if something cheap can guess the next k tokens, the large *target* model can check them all
at once and keep the ones it agrees with (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling"). One round:

1. The *draft* proposes ``x_1 .. x_k``, each drawn from its own next-token distribution ``q_i``
   (a small model with its own KV cache, or prompt lookup: ``prompt_lookup_draft``).
2. The target runs the last token and ``x_1 .. x_k`` in one pass: its distributions ``p_1 .. p_{k+1}``.
3. ``accept_reject`` keeps ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
   rejection it draws a token from the normalised residual ``max(0, p_i - q_i)`` and drops the
   rest; if all k are kept it draws one more from ``p_{k+1}``. 1 to k + 1 tokens per target pass,
   and the tokens follow the target's distribution *exactly* (Leviathan et al. 2023, Theorem 1).
4. Both KV caches roll back over the dropped tokens (``KVCache.crop``).

Greedy (``do_sample=False``): keep ``x_i`` while it is the target's argmax, then emit the target's
argmax: the same tokens as ``tfedu.generate.generate`` on the target alone.

- ``accept_reject``: the acceptance-rejection step for one sequence (exercise 18.1);
  ``residual_distribution``: what it draws from after a rejection.
- ``prompt_lookup_draft``: draft tokens copied from the context after an earlier occurrence of its last
  n-gram (Saxena 2023, "Prompt Lookup Decoding"): no draft model at all.
- ``speculative_generate``: the whole decoder, with ``SpeculativeStats`` (target passes, drafted and
  accepted tokens, acceptance rate, tokens per pass).

>>> from tfedu.config import preset
>>> from tfedu.generate import generate
>>> from tfedu.model import GPT
>>> _ = torch.manual_seed(0); target = GPT(preset("tiny")); draft = GPT(preset("tiny").replace(n_layers=1))
>>> ids = torch.tensor([[72, 105]])
>>> tokens, stats = speculative_generate(target, draft, ids, 8, k=3)
>>> torch.equal(tokens, generate(target, ids, 8)), stats.emitted, stats.target_passes <= 8
(True, 8, True)

Built by hand in notebooks/18_serving.ipynb.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from tfedu.generate import next_token_distribution
from tfedu.inputs import check_ids
from tfedu.kv_cache import KVCache

Drafter = Callable[[Tensor, int], Tensor]


# ----------------------------------------------------------------------------- the acceptance rule


def residual_distribution(p: Float[Tensor, "d_vocab"], q: Float[Tensor, "d_vocab"]) -> Float[Tensor, "d_vocab"]:
    """``max(0, p - q)`` normalised: what a rejected draft token is replaced with (Leviathan et al. 2023, eq. 1).

    Why it is right: a token y comes out of one step either as an accepted draft,
    ``q(y) * min(1, p(y)/q(y)) = min(p(y), q(y))``, or after a rejection. A rejection happens with
    probability ``1 - sum_x min(p(x), q(x)) = sum_x max(0, p(x) - q(x))``, the residual's total mass,
    so ``P(y) = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y)``.

    The residual is all zeros exactly when ``p == q``; then every draft token is accepted
    (``p(x)/q(x) = 1``), so it is never drawn from. If rounding leaves it empty while ``p`` and ``q``
    differ by a few ulps, ``p`` itself is returned: the exact answer in the limit ``q -> p``.

    >>> residual_distribution(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.25, 0.25, 0.5]))
    tensor([0.5000, 0.5000, 0.0000])
    """
    residual = (p - q).clamp(min=0)  # d_vocab
    total = residual.sum()
    return residual / total if total > 0 else p


def accept_reject(
    p: Float[Tensor, "k_plus_1 d_vocab"],
    q: Float[Tensor, "k d_vocab"],
    draft_tokens: Int[Tensor, "k"],
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """One round of speculative sampling for one sequence: ``(n_accepted, next_token)``.

    ``p[i]`` is the target's next-token distribution after the context and ``draft_tokens[:i]``
    (k + 1 rows: one per draft position and one after all of them), ``q[i]`` the draft's
    distribution that ``draft_tokens[i]`` was drawn from. For i = 0, 1, ...: draw ``r ~ U[0, 1)`` and
    accept ``x_i`` when ``r < p_i(x_i) / q_i(x_i)``, i.e. with probability ``min(1, p_i(x_i)/q_i(x_i))``.
    At the first rejection the next token is drawn from ``residual_distribution(p_i, q_i)`` and the
    later draft tokens are discarded; if all k are accepted it is drawn from ``p_k``. The caller emits
    ``draft_tokens[:n_accepted]`` then ``next_token``: 1 to k + 1 tokens, distributed exactly as if
    drawn one by one from the target (Leviathan et al. 2023, Theorem 1; Chen et al. 2023, Theorem 1).

    ``q_i(x_i) = 0`` is impossible when ``x_i ~ q_i`` and is refused. A deterministic drafter (prompt
    lookup) is the one-hot ``q``: accepted with probability ``p_i(x_i)``, replaced by ``p_i`` without
    ``x_i``, renormalised. Computed in float64; ``k = 0`` (no draft) draws from ``p[0]``.

    >>> p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    >>> accept_reject(p, torch.tensor([[0.5, 0.5]]), torch.tensor([0]))  # p(0) = 0: always rejected, 1 drawn
    (0, 1)
    """
    k = _check_round(p, q, draft_tokens)
    device = p.device if generator is None else generator.device
    p = p.detach().to(device, torch.float64)
    q = q.detach().to(device, torch.float64)
    tokens = draft_tokens.tolist()
    for i, x in enumerate(tokens):
        r = torch.rand((), generator=generator, device=device, dtype=torch.float64)
        # r < 1, so a ratio >= 1 always accepts; p == q gives exactly 1.0 (IEEE division of equal numbers).
        if r < p[i, x] / q[i, x]:
            continue
        return i, _draw(residual_distribution(p[i], q[i]), generator)
    return k, _draw(p[k], generator)


def _draw(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _check_round(p: object, q: object, draft_tokens: object) -> int:
    """k, after a clear error unless p (k+1, d_vocab), q (k, d_vocab) and draft_tokens (k,) fit together."""
    for name, value in (("p", p), ("q", q), ("draft_tokens", draft_tokens)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if draft_tokens.dim() != 1 or draft_tokens.is_floating_point() or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must be a 1-D integer tensor (k,), got {draft_tokens.dtype} "
                         f"{tuple(draft_tokens.shape)}")
    k = draft_tokens.shape[0]
    if p.dim() != 2 or q.dim() != 2 or p.shape[0] != k + 1 or q.shape[0] != k or (k and q.shape[1] != p.shape[1]):
        raise ValueError(f"for k={k} draft tokens, p must be (k+1, d_vocab) (the target's distributions at the k draft "
                         f"positions and the one after) and q (k, d_vocab) (the draft's); got p {tuple(p.shape)}, "
                         f"q {tuple(q.shape)}")
    d_vocab = p.shape[1]
    for name, probs in (("p", p), ("q", q)):
        if probs.numel() and (not probs.is_floating_point() or float(probs.min()) < 0
                              or float((probs.double().sum(dim=-1) - 1).abs().max()) > 1e-5):
            raise ValueError(f"every row of {name} must be a probability distribution (>= 0, summing to 1): pass "
                             "softmax(logits), not logits")
    if k:
        low, high = (int(value) for value in torch.aminmax(draft_tokens))
        if low < 0 or high >= d_vocab:
            raise IndexError(f"draft_tokens must lie in 0..{d_vocab - 1} (d_vocab={d_vocab}), got {draft_tokens.tolist()}")
        drawn = q.gather(1, draft_tokens[:, None].to(q.device).long())[:, 0]  # k
        if bool((drawn <= 0).any()):
            i = int((drawn <= 0).nonzero()[0, 0])
            raise ValueError(f"draft token {i} ({int(draft_tokens[i])}) has probability 0 under q[{i}], so it cannot "
                             "have been drawn from q: pass the distribution each draft token was sampled from")
    return k


# ----------------------------------------------------------------------------- drafters


def prompt_lookup_draft(ids: Int[Tensor, "pos"], k: int, ngram: int = 3) -> Int[Tensor, "n_draft"]:
    """Up to ``k`` draft tokens copied from the context: what followed the latest earlier copy of its last n-gram.

    Prompt lookup (Saxena 2023, "Prompt Lookup Decoding"): in summarising, editing or answering
    about a document, the output often repeats the input, so the tokens that followed the last
    ``ngram`` tokens the previous time they occurred are a free guess. Tries the ``ngram``-token
    suffix first, then shorter ones down to 1; the most recent earlier occurrence wins (Saxena's code
    and transformers' ``PromptLookupCandidateGenerator`` take the first). Returns 0 to ``k`` tokens: none
    when no suffix occurred before. As a drafter it is deterministic, i.e. a one-hot ``q``.

    >>> prompt_lookup_draft(torch.tensor([5, 6, 7, 8, 9, 1, 6, 7]), k=2)  # "6 7" came before, then "8 9"
    tensor([8, 9])
    """
    if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"ids must be a 1-D integer tensor (pos,), one sequence, got {got}")
    for name, value in (("k", k), ("ngram", ngram)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "k" else 1):
            raise ValueError(f"{name} must be an int >= {0 if name == 'k' else 1}, got {value!r}")
    pos = ids.shape[0]
    for n in range(min(ngram, pos - 1), 0, -1):
        windows = ids[:pos - 1].unfold(0, n, 1)  # starts 0 .. pos-1-n: every n-gram that ends before the last token
        hits = (windows == ids[pos - n:]).all(dim=1).nonzero()[:, 0]
        if hits.numel():
            start = int(hits[-1]) + n
            return ids[start:start + k].clone()
    return ids[:0].clone()


# ----------------------------------------------------------------------------- the decoder


@dataclass
class SpeculativeStats:
    """What one ``speculative_generate`` call did: the counts that decide its speed-up."""

    target_passes: int = 0  # forward passes of the target (the expensive part)
    draft_passes: int = 0  # forward passes of the draft model (0 with a drafter function)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target kept
    emitted: int = 0  # tokens added to the sequence

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens emitted per target pass: 1 for plain decoding, up to k + 1 here."""
        return self.emitted / self.target_passes if self.target_passes else 0.0


def speculative_generate(
    target: nn.Module,
    draft: nn.Module | None,
    ids: Int[Tensor, "1 pos"],
    max_new_tokens: int,
    *,
    k: int = 4,
    do_sample: bool = False,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    drafter: Drafter | None = None,
    rule: Callable[..., tuple[int, int]] | None = None,
) -> tuple[Int[Tensor, "1 pos_out"], SpeculativeStats]:
    """The prompt ``ids`` and up to ``max_new_tokens`` tokens of ``target``, drafted ``k`` at a time: ``(tokens, stats)``.

    The draft is either a small model ``draft`` with the target's vocabulary (each of its tokens drawn,
    or argmax'ed, from its own next-token distribution, through its own KV cache) or, with
    ``draft=None``, a ``drafter(ids, k) -> up to k token ids`` such as ``prompt_lookup_draft``
    (deterministic: a one-hot ``q``). Each round the target scores the draft in one cached pass, and
    ``accept_reject`` (sampling) or agreement with the target's argmax (greedy) decides; both caches
    are then cropped back to the tokens kept (``KVCache.crop``).

    Greedy: the tokens of ``tfedu.generate.generate(target, ids, max_new_tokens)``. Sampling
    (``do_sample=True``): target and draft distributions are ``softmax(logits / temperature)``, and
    the tokens follow the target's distribution exactly, whatever the draft (only the speed
    depends on it). The random draws come from ``generator``. ``rule`` replaces ``accept_reject`` (same
    arguments and result; notebook 18 runs the learner's).

    One sequence (batch 1): sequences accept different numbers of tokens, so a batch would need
    ragged caches. The whole output must fit the context: ``pos + max_new_tokens - 1 <= n_ctx`` of
    both models (no cropping and recomputing here, unlike ``generate``). Near the end a round
    drafts fewer tokens, so exactly ``max_new_tokens`` come out (fewer if ``eos_token_id`` comes first:
    the sequence ends with it). A model with sliding-window layers cannot roll its ring cache back past
    the window (``RingKVCache.crop``): the first rejection there is a clear error.

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> _ = torch.manual_seed(0); target = GPT(preset("tiny"))
    >>> ids = torch.tensor([[1, 2, 3, 1, 2]])  # "1 2" came before: prompt lookup proposes "3 1 2"
    >>> tokens, stats = speculative_generate(target, None, ids, 6, k=3, drafter=prompt_lookup_draft, do_sample=True,
    ...                                      generator=torch.Generator().manual_seed(0))
    >>> tokens.shape, stats.emitted, stats.drafted >= 3
    (torch.Size([1, 11]), 6, True)
    """
    if draft is None and drafter is None:
        raise ValueError("give a draft model (draft=small_gpt) or a drafter function (drafter=prompt_lookup_draft)")
    if draft is not None and drafter is not None:
        raise ValueError("give either a draft model or a drafter function, not both")
    if drafter is not None and not callable(drafter):
        raise TypeError(f"drafter must be a function (ids, k) -> draft token ids, got {type(drafter).__name__}")
    models = {"target": target} if draft is None else {"target": target, "draft": draft}
    for name, model in models.items():
        if not getattr(model, "supports_kv_cache", False):
            raise TypeError(f"the {name} must be a causal tfedu model that keeps a KV cache (tfedu.model.GPT), "
                            f"got {type(model).__name__}")
    if draft is not None and draft.cfg.d_vocab != target.cfg.d_vocab:
        raise ValueError(f"draft and target must share a vocabulary: draft d_vocab={draft.cfg.d_vocab}, target "
                         f"d_vocab={target.cfg.d_vocab} (p and q must be over the same tokens)")
    check_ids(ids, target.cfg)
    if ids.shape[0] != 1:
        raise ValueError(f"speculative_generate decodes one sequence (batch 1), got batch {ids.shape[0]}: rows accept "
                         "different numbers of tokens; call it once per row")
    for name, value, least in (("max_new_tokens", max_new_tokens, 0), ("k", k, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a positive number, got {temperature!r} (greedy: do_sample=False)")
    if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)
                                     or not 0 <= eos_token_id < target.cfg.d_vocab):
        raise ValueError(f"eos_token_id must be None or a token id in 0..{target.cfg.d_vocab - 1}, got {eos_token_id!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be None or a torch.Generator, got {type(generator).__name__}")
    if rule is not None and not callable(rule):
        raise TypeError(f"rule must be a function like accept_reject(p, q, draft_tokens, generator), got {type(rule).__name__}")
    positions = ids.shape[1] + max_new_tokens - 1  # the last token is emitted, never fed back
    for name, model in models.items():
        if max_new_tokens and positions > model.cfg.n_ctx:
            raise ValueError(f"{ids.shape[1]} prompt tokens + {max_new_tokens} new ones need {positions} positions, "
                             f"more than the {name}'s n_ctx={model.cfg.n_ctx}: speculative decoding keeps one cache and "
                             "never crops the context (ask for fewer tokens, or use tfedu.generate.generate)")
    stats = SpeculativeStats()
    if max_new_tokens == 0:
        return ids.clone(), stats
    caches = {name: KVCache.for_model(model, 1, capacity=positions) for name, model in models.items()}
    training = [model for model in models.values() if model.training]  # eval() walks every module: only if needed
    for model in training:
        model.eval()
    try:
        with torch.inference_mode():
            ids = _decode(target, draft, drafter, ids, max_new_tokens, k, do_sample, float(temperature),
                          generator, eos_token_id, caches, stats, rule or accept_reject)
    finally:
        for model in training:
            model.train()
    # Made under inference_mode: its clone is an ordinary tensor that autograd can use later.
    return ids.clone(), stats


def _decode(target: nn.Module, draft: nn.Module | None, drafter: Drafter | None, ids: Tensor, max_new_tokens: int,
            k: int, do_sample: bool, temperature: float, generator: torch.Generator | None, eos_token_id: int | None,
            caches: dict[str, KVCache], stats: SpeculativeStats, rule: Callable[..., tuple[int, int]]) -> Tensor:
    d_vocab = target.cfg.d_vocab
    emitted = 0
    while emitted < max_new_tokens:
        # Each round emits at most budget + 1 tokens: never more than asked for.
        budget = min(k, max_new_tokens - emitted - 1)
        if draft is not None:
            drafts, q = _draft_with_model(draft, caches["draft"], ids, budget, do_sample, temperature, generator, stats)
        else:
            drafts = _draft_with_function(drafter, ids, budget, d_vocab)
            q = F.one_hot(drafts.long(), d_vocab).to(torch.float64)  # n_draft d_vocab: a deterministic guess
        n_draft = drafts.shape[0]

        # One target pass over every token it has not seen: the last emitted one and the drafts.
        cache = caches["target"]
        seen = torch.cat([ids[0], drafts])  # pos+n_draft
        logits = target(seen[None, cache.length:], kv_cache=cache)[0, -(n_draft + 1):]  # n_draft+1 d_vocab
        stats.target_passes += 1
        if do_sample:
            p = next_token_distribution(logits.double(), temperature=temperature)  # n_draft+1 d_vocab
            result = rule(p, q, drafts, generator)
            n_accepted, next_token = _round_result(result)
            if n_accepted is None or not (0 <= n_accepted <= n_draft and 0 <= next_token < d_vocab):
                raise ValueError(f"the acceptance rule must return (n_accepted, next_token): two ints, n_accepted in "
                                 f"0..{n_draft} and a token id in 0..{d_vocab - 1}; got {result!r}")
        else:
            best = logits.argmax(dim=-1)  # n_draft+1
            agree = (best[:n_draft] == drafts).long()  # n_draft
            n_accepted = int(agree.cumprod(dim=0).sum())  # the leading run of agreements
            next_token = int(best[n_accepted])

        new = drafts[:n_accepted].tolist() + [next_token]
        if eos_token_id is not None and eos_token_id in new:
            new = new[:new.index(eos_token_id) + 1]
        stats.drafted += n_draft
        stats.accepted += n_accepted
        stats.emitted += len(new)
        emitted += len(new)
        ids = torch.cat([ids, torch.tensor([new], dtype=ids.dtype, device=ids.device)], dim=1)
        if eos_token_id is not None and new[-1] == eos_token_id:
            break
        # Roll back over the rejected drafts: each cache holds every token but the newest.
        for cache in caches.values():
            cache.crop(min(cache.length, ids.shape[1] - 1))
    return ids


def _round_result(result: object) -> tuple[int, int] | tuple[None, None]:
    """An acceptance rule's ``(n_accepted, next_token)`` as two ints (plain, numpy or 0-d tensor), else ``(None, None)``."""
    try:
        n_accepted, next_token = result
        if isinstance(n_accepted, bool) or isinstance(next_token, bool):
            return None, None
        return operator.index(n_accepted), operator.index(next_token)
    except (TypeError, ValueError):
        return None, None


def _draft_with_model(draft: nn.Module, cache: KVCache, ids: Tensor, budget: int, do_sample: bool, temperature: float,
                      generator: torch.Generator | None, stats: SpeculativeStats) -> tuple[Tensor, Tensor]:
    """``budget`` tokens from the draft model, and the distributions they were drawn from (n_draft, d_vocab)."""
    seen = ids[0]
    drafts, q = [], []
    for _ in range(budget):
        logits = draft(seen[None, cache.length:], kv_cache=cache)[0, -1]  # d_vocab
        stats.draft_passes += 1
        if do_sample:
            probs = next_token_distribution(logits[None].double(), temperature=temperature)[0]  # d_vocab
            token = torch.multinomial(probs.to(generator.device if generator is not None else probs.device), 1,
                                      generator=generator).to(seen.device)
            q.append(probs)
        else:
            token = logits.argmax()[None]
        drafts.append(token)
        seen = torch.cat([seen, token.to(seen.dtype)])
    d_vocab = draft.cfg.d_vocab
    q_rows = torch.stack(q) if q else torch.zeros(0, d_vocab, dtype=torch.float64, device=ids.device)
    return (torch.cat(drafts) if drafts else ids[0, :0]), q_rows


def _draft_with_function(drafter: Drafter, ids: Tensor, budget: int, d_vocab: int) -> Tensor:
    if budget == 0:
        return ids[0, :0]
    drafts = drafter(ids[0], budget)
    if not isinstance(drafts, Tensor) or drafts.dim() != 1 or drafts.is_floating_point() or drafts.shape[0] > budget:
        got = f"{drafts.dtype} {tuple(drafts.shape)}" if isinstance(drafts, Tensor) else type(drafts).__name__
        raise ValueError(f"drafter(ids, k) must return a 1-D integer tensor of at most k={budget} token ids, got {got}")
    if drafts.numel() and (int(drafts.min()) < 0 or int(drafts.max()) >= d_vocab):
        raise IndexError(f"drafter returned token ids outside 0..{d_vocab - 1}: {drafts.tolist()}")
    return drafts.to(ids.device, ids.dtype)
