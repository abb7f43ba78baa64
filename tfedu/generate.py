"""Decoding: turning a language model's next-token logits into text, one token at a time.

A ``GPT`` gives, for every position, logits over the next token. Generation feeds the prompt,
picks a token from the last position's logits, appends it and repeats (Radford et al. 2019;
Holtzman et al. 2020 for the sampling filters; Graves 2012 and Sutskever et al. 2014 for beam
search). Every function here gives the same tokens as Hugging Face ``transformers`` 5.x on the
same weights (tests/test_generate.py checks it against ``GPT2LMHeadModel.generate``):

- ``generate``: greedy (argmax) or sampling, with ``temperature``, ``top_k`` and ``top_p``
  applied in transformers' order (``next_token_distribution``), stopping each row at an
  end-of-sequence token; prompts of different lengths go in padded on the left (``pad_prompts``)
  with a ``padding_mask``, and each row gets the tokens it would get alone;
- ``filter_top_k`` and ``filter_top_p``: the two filters, as transformers' ``TopKLogitsWarper``
  and ``TopPLogitsWarper``;
- ``beam_search``: keep the ``num_beams`` best partial sequences by total log-probability;
- ``sequence_logprob``: the total log-probability a model gives a continuation.

Both decoders take ``logits_processors``: callables ``(ids, logits) -> logits`` run in order on each
step's last-position logits before anything picks a token (transformers' ``LogitsProcessorList``).
``tfedu.constrained.RegexConstraint`` is one: it keeps the output inside a regular expression.

With ``use_cache=True`` (the default) ``generate`` and ``beam_search`` keep a KV cache
(``tfedu.kv_cache``): the prompt is run once, then each step runs the one new token, whose query
attends over the cached keys. ``use_cache=False`` runs the whole (cropped) context again at every
step, the path notebook 08 builds; both give the same tokens (tests/test_kv_cache.py).

>>> from tfedu.config import preset
>>> from tfedu.model import GPT
>>> _ = torch.manual_seed(0); model = GPT(preset("tiny"))
>>> ids = torch.tensor([[72, 105]])  # "Hi" in bytes
>>> generate(model, ids, max_new_tokens=3).shape  # the prompt and three new tokens
torch.Size([1, 5])

Built by hand in notebooks/08_training_and_decoding.ipynb.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from tfedu.kv_cache import KVCache

# ----------------------------------------------------------------------------- argument checks


def _check_ids(ids: object) -> None:
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex() \
            or ids.dtype == torch.bool:
        got = f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
        hint = " (one prompt? use ids[None])" if isinstance(ids, Tensor) and ids.dim() == 1 else ""
        raise ValueError(f"ids must be a 2-D integer tensor (batch, pos) of token ids, got {got}{hint}")
    if ids.shape[1] == 0:
        raise ValueError("ids has no positions: give at least one prompt token, shape (batch, pos) with pos >= 1")


def _check_count(name: str, value: object, *, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _check_sampling(temperature: object, top_k: object, top_p: object) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
            or not math.isfinite(temperature):
        raise ValueError(
            f"temperature must be a positive number, got {temperature!r}: temperature -> 0 is greedy decoding, "
            "so for greedy use do_sample=False (argmax) rather than temperature=0"
        )
    if top_k is not None:
        _check_count("top_k", top_k, least=1)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be a probability in (0, 1] (the nucleus' mass), got {top_p!r}")


def _check_padding(padding_mask: object, ids: Tensor) -> Tensor | None:
    """The left-padding mask, checked; None when there is none or every token is real (nothing to hide)."""
    if padding_mask is None:
        return None
    if not isinstance(padding_mask, Tensor) or padding_mask.dtype != torch.bool or padding_mask.shape != ids.shape:
        got = f"{padding_mask.dtype} {tuple(padding_mask.shape)}" if isinstance(padding_mask, Tensor) else type(padding_mask).__name__
        raise ValueError(f"padding_mask must be a bool tensor shaped like the ids {tuple(ids.shape)}, True = real token; "
                         f"got {got} (pad_prompts makes both)")
    rows_ok = padding_mask[:, -1] & (padding_mask[:, 1:].int() >= padding_mask[:, :-1].int()).all(dim=1)
    if not bool(rows_ok.all()):
        row = int((~rows_ok).nonzero()[0, 0])
        raise ValueError(f"padding_mask must pad on the left: each row False (padding) and then True (its prompt, at "
                         f"least one token, up to the last column); row {row} is {padding_mask[row].int().tolist()}. "
                         "New tokens go after the last column, so right padding would put padding inside the text "
                         "(pad_prompts pads on the left)")
    return None if bool(padding_mask.all()) else padding_mask


def _check_generator(generator: object, batch: int) -> None:
    if generator is None or isinstance(generator, torch.Generator):
        return
    if not isinstance(generator, (list, tuple)) or len(generator) != batch \
            or not all(isinstance(g, torch.Generator) for g in generator):
        got = f"a {type(generator).__name__} of {len(generator)}" if isinstance(generator, (list, tuple)) \
            else type(generator).__name__
        raise ValueError(f"generator must be None, a torch.Generator, or a list of {batch} torch.Generators "
                         f"(one per row), got {got}")


def pad_prompts(prompts: list | tuple, pad_id: int = 0) -> tuple[Int[Tensor, "batch pos"], Bool[Tensor, "batch pos"]]:
    """Prompts of different lengths as one batch, padded on the left: ``(ids, padding_mask)``, True = real token.

    Left, so that every row's last column is its newest token and the next one goes after it: what
    ``generate`` expects. ``pad_id`` fills the padding; the model never sees it (the mask hides it).

    >>> ids, padding_mask = pad_prompts([[5, 6, 7], [8]])
    >>> ids
    tensor([[5, 6, 7],
            [0, 0, 8]])
    >>> padding_mask
    tensor([[ True,  True,  True],
            [False, False,  True]])
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token-id lists or 1-D tensors, got {type(prompts).__name__}")
    rows = []
    for i, prompt in enumerate(prompts):
        row = torch.as_tensor(prompt) if not isinstance(prompt, Tensor) else prompt
        if row.dim() != 1 or row.numel() == 0 or row.is_floating_point() or row.dtype == torch.bool:
            raise ValueError(f"prompt {i} must be a non-empty 1-D list or tensor of token ids, got "
                             f"{row.dtype} of shape {tuple(row.shape)}")
        rows.append(row.long())
    longest = max(row.numel() for row in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long, device=rows[0].device)
    padding_mask = torch.zeros((len(rows), longest), dtype=torch.bool, device=rows[0].device)
    for i, row in enumerate(rows):
        ids[i, longest - row.numel():] = row.to(ids.device)
        padding_mask[i, longest - row.numel():] = True
    return ids, padding_mask


def _check_processors(logits_processors: object) -> tuple:
    if logits_processors is None:
        return ()
    if not isinstance(logits_processors, (list, tuple)) or not all(callable(p) for p in logits_processors):
        got = type(logits_processors).__name__ if not isinstance(logits_processors, (list, tuple)) else \
            ", ".join(type(p).__name__ for p in logits_processors if not callable(p)) + " (not callable)"
        raise TypeError("logits_processors must be None or a list/tuple of callables (ids, logits) -> logits, "
                        f"got {got}")
    return tuple(logits_processors)


def _check_eos(eos_token_id: object, d_vocab: int) -> None:
    if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)
                                     or not 0 <= eos_token_id < d_vocab):
        raise ValueError(f"eos_token_id must be None or a token id in 0..{d_vocab - 1}, got {eos_token_id!r}")


# ----------------------------------------------------------------------------- the two filters


def filter_top_k(logits: Float[Tensor, "... d_vocab"], k: int) -> Float[Tensor, "... d_vocab"]:
    """Keep the k largest logits of each row, set the rest to -inf (Fan et al. 2018's top-k sampling).

    Every logit equal to the k-th largest is kept, so ties can keep more than k (as transformers'
    ``TopKLogitsWarper``). ``k >= d_vocab`` keeps everything. The input is not changed.

    >>> filter_top_k(torch.tensor([1.0, 3.0, 2.0, 3.0]), 2)  # the two 3s
    tensor([-inf, 3., -inf, 3.])
    >>> filter_top_k(torch.tensor([1.0, 3.0, 2.0, 2.0]), 2)  # a tie at the 2nd largest keeps both 2s
    tensor([-inf, 3., 2., 2.])
    """
    _check_count("top_k", k, least=1)
    if k >= logits.shape[-1]:
        return logits.clone()
    kth_largest = logits.topk(k, dim=-1).values[..., -1:]  # ... 1
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def filter_top_p(logits: Float[Tensor, "... d_vocab"], p: float) -> Float[Tensor, "... d_vocab"]:
    """Nucleus filter (Holtzman et al. 2020): keep the fewest most likely tokens whose mass reaches p.

    Sort the tokens by probability, largest first; a token is kept when the tokens before it hold
    less than p of the mass. So the token whose probability carries the total across p is kept,
    and the most likely token always is (nothing comes before it). The rest become -inf, in the
    tokens' own order. Equal to transformers' ``TopPLogitsWarper`` (``min_tokens_to_keep=1``),
    which computes the same set from the other end; ``p = 1`` keeps everything.

    >>> logits = torch.tensor([0.5, 0.3, 0.2]).log()  # probabilities 0.5, 0.3, 0.2
    >>> filter_top_p(logits, 0.6).isfinite()  # 0.5 < 0.6, 0.5 + 0.3 >= 0.6: two tokens
    tensor([ True,  True, False])
    >>> filter_top_p(logits, 0.01).isfinite()  # a tiny p keeps the most likely token
    tensor([ True, False, False])
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise ValueError(f"top_p must be a probability in (0, 1] (the nucleus' mass), got {p!r}")
    if p >= 1:
        return logits.clone()
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # ... d_vocab, most likely first
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each one
    remove_sorted = mass_before >= p  # the nucleus already holds p without this token
    remove = remove_sorted.scatter(-1, order, remove_sorted)  # back to vocabulary order
    return logits.masked_fill(remove, float("-inf"))


def next_token_distribution(
    logits: Float[Tensor, "batch d_vocab"],
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    top_k_filter: Callable[[Tensor, int], Tensor] = filter_top_k,
    top_p_filter: Callable[[Tensor, float], Tensor] = filter_top_p,
) -> Float[Tensor, "batch d_vocab"]:
    """The distribution sampling draws from: logits / temperature, then top-k, then top-p, then softmax.

    The order is transformers' (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
    ``TopPLogitsWarper``): top-p measures its mass on the already temperature-scaled, top-k-filtered
    distribution. ``top_k_filter`` and ``top_p_filter`` let a notebook put in its own filters.
    Computed in float32 at least (a bfloat16 model's logits are upcast).

    >>> probs = next_token_distribution(torch.tensor([[2.0, 1.0, 0.0]]), temperature=0.5, top_k=2)
    >>> probs.round(decimals=3)  # e^4 : e^2 : 0
    tensor([[0.8810, 0.1190, 0.0000]])
    """
    _check_sampling(temperature, top_k, top_p)
    scores = logits.float() / temperature if logits.dtype != torch.float64 else logits / temperature
    if top_k is not None:
        scores = top_k_filter(scores, top_k)
    if top_p is not None:
        scores = top_p_filter(scores, top_p)
    return scores.softmax(dim=-1)


# ----------------------------------------------------------------------------- logits processors


def apply_logits_processors(
    logits_processors: list | tuple | None,
    ids: Int[Tensor, "batch pos"],
    logits: Float[Tensor, "batch d_vocab"],
) -> Float[Tensor, "batch d_vocab"]:
    """Run each processor ``(ids, logits) -> logits`` in order, as transformers' ``LogitsProcessorList``.

    ``ids`` are the sequences so far (prompt and generated tokens), ``logits`` the next-token logits
    after them. A processor may add to the logits (a repetition penalty) or set some to -inf (a
    constraint: ``tfedu.constrained.mask_logits``); it must give back a float tensor of the same shape.

    >>> ban_first = lambda ids, logits: logits.index_fill(-1, torch.tensor([0]), float("-inf"))
    >>> apply_logits_processors([ban_first], torch.tensor([[5]]), torch.tensor([[2.0, 1.0]]))
    tensor([[-inf, 1.]])
    """
    for processor in _check_processors(logits_processors):
        out = processor(ids, logits)
        if not isinstance(out, Tensor) or out.shape != logits.shape or not out.is_floating_point():
            got = f"{out.dtype} of shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"logits processor {processor!r} must return float logits of shape {tuple(logits.shape)} "
                             f"(batch, d_vocab), got {got}")
        logits = out
    return logits


# ----------------------------------------------------------------------------- greedy and sampling


def _last_logits(
    model: nn.Module, ids: Int[Tensor, "batch pos"], kv_cache: KVCache | None = None,
    padding_mask: Bool[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, "batch d_vocab"]:
    """The next-token logits after ``ids``, the context cropped to the model's last n_ctx tokens.

    With ``kv_cache``, which must hold the keys and values of ``ids[:, :kv_cache.length]``, only the
    tokens after those are run. Past n_ctx a cache cannot slide (its keys saw the tokens a crop drops), so it is
    emptied and filled again from the last n_ctx tokens: the context the uncached path crops to.

    With a (left-)``padding_mask`` the padded keys are hidden and each row's real tokens sit at
    positions 0, 1, ... counted within the window, as if the row were decoded alone.
    """
    n_ctx = model.cfg.n_ctx
    if kv_cache is not None and ids.shape[1] > n_ctx:
        kv_cache.reset()
    first = max(0, ids.shape[1] - n_ctx)  # the window's first column
    cached = 0 if kv_cache is None else kv_cache.length
    new = ids[:, first + cached:]  # the prompt at the first step, then the one newest token
    kwargs: dict = {} if kv_cache is None else {"kv_cache": kv_cache}
    if padding_mask is not None:
        window = padding_mask[:, first:]  # every key the new tokens see: cached and new
        kwargs["padding_mask"] = window
        kwargs["positions"] = (window.cumsum(dim=1) - 1).clamp(min=0)[:, cached:]  # a padded slot sits at 0
    return model(new, **kwargs)[:, -1, :].float()  # only the last position predicts the new token


def _new_cache(model: nn.Module, batch: int, pos: int, max_new_tokens: int, use_cache: bool) -> KVCache | None:
    """A cache for ``max_new_tokens`` after ``batch`` prompts of ``pos`` tokens, if asked for and the model can keep one."""
    if not use_cache or not getattr(model, "supports_kv_cache", False) or max_new_tokens == 0:
        return None
    # The last forward pass reads pos + max_new_tokens - 1 tokens (the final token is never fed back).
    return KVCache.for_model(model, batch, capacity=min(model.cfg.n_ctx, pos + max_new_tokens - 1))


def _sample(probs: Float[Tensor, "batch d_vocab"], generator: torch.Generator | list | tuple | None
            ) -> Int[Tensor, "batch"]:
    if isinstance(generator, (list, tuple)):  # one per row: each row draws as it would alone
        return torch.cat([_sample(probs[row:row + 1], g) for row, g in enumerate(generator)])
    # Draw on the generator's device (a CPU generator with a GPU model is the usual seeded set-up).
    device = probs.device if generator is None else generator.device
    return torch.multinomial(probs.to(device), 1, generator=generator).squeeze(-1).to(probs.device)


def generate(
    model: nn.Module,
    ids: Int[Tensor, "batch pos"],
    max_new_tokens: int,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | list | tuple | None = None,
    padding_mask: Bool[Tensor, "batch pos"] | None = None,
    top_k_filter: Callable[[Tensor, int], Tensor] = filter_top_k,
    top_p_filter: Callable[[Tensor, float], Tensor] = filter_top_p,
    use_cache: bool = True,
    logits_processors: list | tuple | None = None,
) -> Int[Tensor, "batch pos_out"]:
    """The prompts ``ids`` followed by up to ``max_new_tokens`` generated tokens each.

    Greedy (the argmax of each step's logits) unless ``do_sample``, which draws from
    ``next_token_distribution`` with ``torch.multinomial(generator=generator)``: the same generator
    seed gives the same tokens. (``temperature``, ``top_k`` and ``top_p`` only shape sampling; greedy
    ignores them, as transformers does.) ``generator`` may also be a list of one generator per row:
    each row then draws from its own, as it would if decoded alone with it.

    Prompts of different lengths: pad them on the left and pass ``padding_mask`` (True = real token;
    ``pad_prompts`` makes both). The padded keys are hidden from every query, in the prompt's pass
    and in the cache, and each row's tokens take positions 0, 1, ... from its first real token, so
    each row gets the tokens that decoding its prompt alone gives (tests/test_generate.py). The
    output keeps the padding: row b is ``ids[b]`` (padding and prompt) followed by its new tokens.

    With ``eos_token_id``, a row that emits it is done: it gets ``eos_token_id`` again at every later
    step (padding, as transformers with ``pad_token_id = eos_token_id``), and the loop stops early
    once every row is done, so ``pos_out`` can be less than ``pos + max_new_tokens``.

    The context is cropped to the model's last ``cfg.n_ctx`` tokens before each forward pass, so
    generation can run past the context length (each new token then sees only the last n_ctx).
    Runs in eval mode (no dropout) under ``torch.inference_mode()`` (no autograd bookkeeping at all,
    cheaper per op than ``no_grad``) and puts the model's training flag back. The ids returned are an
    ordinary tensor, fine to train on; a tensor a hook keeps from inside the call is an inference
    tensor (``.clone()`` it outside before it meets autograd).

    ``use_cache=True`` (the default) keeps a KV cache (``tfedu.kv_cache.KVCache``) when the model
    can (``model.supports_kv_cache``: a ``GPT``; an ``Encoder`` or a model without it decodes
    uncached): the prompt runs once, then one token per step. The tokens are the uncached path's.
    Past n_ctx a cache cannot slide its window, so each step from there on empties it and runs
    the last n_ctx tokens again (what ``use_cache=False`` does at every step): same tokens, no saving.

    ``logits_processors``: callables ``(ids, logits) -> logits`` applied in order to each step's
    last-position logits (float32, every row, finished ones included) before temperature, top-k,
    top-p and before the greedy argmax, as transformers' ``logits_processor`` argument
    (``apply_logits_processors``). ``ids`` is the whole sequence so far, uncropped.

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> _ = torch.manual_seed(0); model = GPT(preset("tiny"))
    >>> ids = torch.tensor([[72, 105], [72, 111]])
    >>> out = generate(model, ids, 4, do_sample=True, top_k=10, generator=torch.Generator().manual_seed(1))
    >>> out.shape, torch.equal(out[:, :2], ids)
    (torch.Size([2, 6]), True)
    """
    _check_ids(ids)
    _check_count("max_new_tokens", max_new_tokens, least=0)
    _check_sampling(temperature, top_k, top_p)
    _check_eos(eos_token_id, model.cfg.d_vocab)
    _check_generator(generator, ids.shape[0])
    padding_mask = _check_padding(padding_mask, ids)
    logits_processors = _check_processors(logits_processors)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            kv_cache = _new_cache(model, *ids.shape, max_new_tokens, use_cache)
            done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)  # batch
            for _ in range(max_new_tokens):
                logits = _last_logits(model, ids, kv_cache, padding_mask)  # batch d_vocab
                if logits_processors:
                    logits = apply_logits_processors(logits_processors, ids, logits)
                if do_sample:
                    probs = next_token_distribution(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                                    top_k_filter=top_k_filter, top_p_filter=top_p_filter)
                    next_id = _sample(probs, generator)  # batch
                else:
                    next_id = logits.argmax(dim=-1)  # batch
                if eos_token_id is not None:
                    next_id = next_id.masked_fill(done, eos_token_id)  # a finished row only pads
                    done = done | (next_id == eos_token_id)
                ids = torch.cat([ids, next_id[:, None].to(ids.dtype)], dim=1)
                if padding_mask is not None:  # the new token is real in every row
                    padding_mask = F.pad(padding_mask, (0, 1), value=True)
                # Only a row that can end can stop the loop (bool() waits for the device: skip it otherwise).
                if eos_token_id is not None and bool(done.all()):
                    break
    finally:
        model.train(was_training)
    # A tensor made under inference_mode can never enter autograd (an embedding saves its ids for the
    # backward pass); its clone made out here is an ordinary tensor.
    return ids.clone()


# ----------------------------------------------------------------------------- beam search


def beam_search(
    model: nn.Module,
    ids: Int[Tensor, "batch pos"],
    max_new_tokens: int,
    *,
    num_beams: int,
    length_penalty: float = 1.0,
    eos_token_id: int | None = None,
    early_stopping: bool | str = False,
    use_cache: bool = True,
    logits_processors: list | tuple | None = None,
) -> Int[Tensor, "batch pos_out"]:
    """The best continuation of each prompt found by beam search, as transformers' ``num_beams`` search.

    Same tokens as ``GPT2LMHeadModel.generate(num_beams=..., do_sample=False, length_penalty=...,
    early_stopping=..., eos_token_id=...)`` (transformers 5.x, ``_beam_search``). Per prompt:

    1. Keep ``num_beams`` running beams, each scored by the sum of its generated tokens'
       log-probabilities (log_softmax of the cropped context's last logits). At the start there is one
       beam, the prompt, with score 0.
    2. Each step, extend every beam by every token and take the ``2 * num_beams`` best extensions over
       all beams (twice as many so that, even if up to num_beams of them end in eos, num_beams can run on).
    3. An extension ending in ``eos_token_id`` is finished if it is among the ``num_beams`` best
       of the step (those ranked lower are dropped); at the last step (``max_new_tokens``) the
       ``num_beams`` best extensions are all finished. A finished hypothesis is scored
       ``sum of log-probs / L ** length_penalty``, with L the number of generated tokens, its eos
       included; the ``num_beams`` best finished hypotheses are kept. ``length_penalty > 0`` favours
       longer sequences (the sum is negative), ``< 0`` shorter ones, ``0`` none.
    4. The ``num_beams`` best extensions that did not end in eos are the next running beams.
    5. A prompt is done (nothing more is added to its finished set) once it holds ``num_beams``
       finished hypotheses and, by transformers' heuristic, the best running beam's score divided by
       L ** length_penalty cannot beat the worst of them, L being the generated length so far
       (``early_stopping=False``, the default) or, for ``early_stopping="never"`` with
       ``length_penalty > 0``, ``max_new_tokens``. ``early_stopping=True`` stops as soon as the set is
       full. The search ends when every prompt is done or after ``max_new_tokens`` steps.

    Returns each prompt followed by its best finished hypothesis. Hypotheses that ended early are
    padded with ``eos_token_id`` (transformers pads with ``pad_token_id``, which defaults to eos) to the
    longest best one, so ``pos_out <= pos + max_new_tokens``. Scores add in float32, as transformers'.

    ``use_cache`` as in ``generate``: one cache row per beam, and after each step row i takes the
    keys and values of the beam that running beam i grew from (``KVCache.reorder``).

    ``logits_processors`` as in ``generate``, but, as transformers' beam search, applied to each beam's
    log-probabilities (after the log_softmax), with ``ids`` the beam's sequence. They see only the live
    beams (finite score): a beam scored -inf (the prompt's spare copies at the start, or a filler picked
    when a constraint leaves fewer than ``2 * num_beams`` extensions) can never win, and its tokens may
    break the constraint that a processor enforces.

    (A difference only a toy vocabulary can see: with ``d_vocab < 2 * num_beams`` transformers also
    extends copies of the prompt scored -1e9; here those copies score -inf and are never finished.)

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> _ = torch.manual_seed(0); model = GPT(preset("tiny"))
    >>> ids = torch.tensor([[72, 105]])
    >>> beam = beam_search(model, ids, 4, num_beams=3)
    >>> greedy = generate(model, ids, 4)
    >>> bool(sequence_logprob(model, beam, 2) >= sequence_logprob(model, greedy, 2))
    True
    """
    _check_ids(ids)
    _check_count("max_new_tokens", max_new_tokens, least=0)
    _check_count("num_beams", num_beams, least=1)
    _check_eos(eos_token_id, model.cfg.d_vocab)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) or not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number (1.0: average log-prob, 0: none), got {length_penalty!r}")
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise ValueError(f"early_stopping must be False, True or 'never' (transformers' values), got {early_stopping!r}")
    logits_processors = _check_processors(logits_processors)
    if max_new_tokens == 0:
        return ids.clone()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            kv_cache = _new_cache(model, ids.shape[0] * num_beams, ids.shape[1], max_new_tokens, use_cache)
            return _beam_search(model, ids, max_new_tokens, num_beams, float(length_penalty), eos_token_id,
                                early_stopping, kv_cache, logits_processors)
    finally:
        model.train(was_training)


def _beam_search(model: nn.Module, ids: Tensor, max_new_tokens: int, num_beams: int, length_penalty: float,
                 eos_token_id: int | None, early_stopping: bool | str, kv_cache: KVCache | None,
                 logits_processors: tuple = ()) -> Tensor:
    batch, prompt_len = ids.shape
    device, n_candidates = ids.device, 2 * num_beams
    batch_index = torch.arange(batch, device=device)[:, None]  # batch 1, for gathering beams
    # Running beams: the prompt num_beams times; only the first copy counts at the start.
    running = ids[:, None, :].expand(batch, num_beams, prompt_len).clone()  # batch beam pos
    running_scores = torch.full((batch, num_beams), float("-inf"), device=device)
    running_scores[:, 0] = 0.0
    # Finished hypotheses, padded with eos to full length: num_beams slots per prompt, -inf = empty.
    pad = eos_token_id if eos_token_id is not None else 0
    finished = torch.full((batch, num_beams, prompt_len + max_new_tokens), pad, dtype=ids.dtype, device=device)
    finished_scores = torch.full((batch, num_beams), float("-inf"), device=device)
    finished_lengths = torch.zeros((batch, num_beams), dtype=torch.long, device=device)
    open_ = torch.ones(batch, dtype=torch.bool, device=device)  # prompts whose finished set may still change

    for step in range(max_new_tokens):
        length = step + 1  # generated tokens after this step
        logits = _last_logits(model, running.flatten(0, 1), kv_cache)  # batch*beam d_vocab
        log_probs = F.log_softmax(logits, dim=-1)  # batch*beam d_vocab
        if logits_processors:
            live = torch.isfinite(running_scores).flatten()  # batch*beam
            log_probs[live] = apply_logits_processors(logits_processors, running.flatten(0, 1)[live], log_probs[live])
        log_probs = log_probs.view(batch, num_beams, -1)  # batch beam d_vocab
        d_vocab = log_probs.shape[-1]
        totals = (running_scores[:, :, None] + log_probs).flatten(1)  # batch beam*d_vocab
        top_scores, top_index = totals.topk(n_candidates, dim=-1)  # batch 2*beam, best first
        from_beam, token = top_index // d_vocab, top_index % d_vocab
        candidates = torch.cat([running[batch_index, from_beam], token[:, :, None].to(ids.dtype)], dim=-1)
        if step == max_new_tokens - 1:
            ends = torch.ones_like(token, dtype=torch.bool)  # the last step: every candidate stops here
        elif eos_token_id is not None:
            ends = token == eos_token_id
        else:
            ends = torch.zeros_like(token, dtype=torch.bool)

        # Finished: the candidates that end, among the num_beams best, while the prompt is open.
        in_top = torch.arange(n_candidates, device=device) < num_beams  # 2*beam
        enters = ends & in_top & open_[:, None]  # batch 2*beam
        normalised = (top_scores / length**length_penalty).masked_fill(~enters, float("-inf"))
        pool_scores = torch.cat([finished_scores, normalised], dim=1)  # batch 3*beam
        keep_scores, keep = pool_scores.topk(num_beams, dim=-1)
        padded = F.pad(candidates, (0, max_new_tokens - length), value=pad)  # batch 2*beam pos+max_new
        pool = torch.cat([finished, padded], dim=1)
        pool_lengths = torch.cat([finished_lengths, torch.full_like(token, length)], dim=1)
        finished, finished_scores = pool[batch_index, keep], keep_scores
        finished_lengths = pool_lengths[batch_index, keep]

        # Running: the num_beams best candidates that do not end.
        running_scores, keep = top_scores.masked_fill(ends, float("-inf")).topk(num_beams, dim=-1)
        running = candidates[batch_index, keep]
        if kv_cache is not None:  # each running beam takes over its parent's cached keys and values
            kv_cache.reorder((batch_index * num_beams + from_beam[batch_index, keep]).flatten())

        # Done: the finished set is full and (transformers' heuristic) the best running beam cannot beat it.
        full = torch.isfinite(finished_scores).all(dim=-1)  # batch
        if early_stopping is True:
            open_ = open_ & ~full
        hypothetical = max_new_tokens if early_stopping == "never" and length_penalty > 0 else length
        best_possible = running_scores[:, 0] / hypothetical**length_penalty
        open_ = open_ & ~(full & (best_possible <= finished_scores.min(dim=-1).values))
        if not bool(open_.any()):
            break

    best_length = int(finished_lengths[:, 0].max())
    return finished[:, 0, :prompt_len + best_length]


# ----------------------------------------------------------------------------- scoring


def sequence_logprob(model: nn.Module, ids: Int[Tensor, "batch pos"], prompt_len: int) -> Float[Tensor, "batch"]:
    """The total log-probability the model gives ``ids[:, prompt_len:]`` after what precedes each token.

    Each token is scored with the context generation would have seen: the last ``cfg.n_ctx``
    tokens before it. Every token after ``prompt_len`` counts, eos padding included. Used to compare
    decoders: beam search usually finds a likelier continuation than greedy (not always: the greedy
    path can drop out of the beam).

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> _ = torch.manual_seed(0); model = GPT(preset("tiny"))
    >>> ids = torch.tensor([[72, 105, 33]])
    >>> lp = sequence_logprob(model, ids, 1)  # log p(105 | 72) + log p(33 | 72 105)
    >>> bool(lp < 0), lp.shape
    (True, torch.Size([1]))
    """
    _check_ids(ids)
    _check_count("prompt_len", prompt_len, least=1)
    if prompt_len > ids.shape[1]:
        raise ValueError(f"prompt_len={prompt_len} is longer than the sequences ({ids.shape[1]} tokens)")
    n_ctx = model.cfg.n_ctx
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            total = torch.zeros(ids.shape[0], device=ids.device)
            # Targets 1..n_ctx in one pass (a causal model's position t sees tokens 0..t) ...
            first = min(ids.shape[1], n_ctx + 1)
            if first > prompt_len:
                log_probs = F.log_softmax(model(ids[:, :first - 1]).float(), dim=-1)  # batch pos d_vocab
                picked = log_probs.gather(-1, ids[:, 1:first, None].long())[..., 0]  # batch pos
                total = total + picked[:, prompt_len - 1:].sum(dim=-1)
            # ... then each later target with its own window of the last n_ctx tokens.
            for t in range(max(first, prompt_len), ids.shape[1]):
                log_probs = F.log_softmax(_last_logits(model, ids[:, :t]), dim=-1)  # batch d_vocab
                total = total + log_probs.gather(-1, ids[:, t, None].long())[:, 0]
    finally:
        model.train(was_training)
    return total
