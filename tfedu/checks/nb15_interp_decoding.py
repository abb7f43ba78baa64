"""Checkers for notebooks/15_interpretability_and_decoding.ipynb: the induction score, an ablation hook, activation
patching, the logit lens, direct logit attribution and constrained decoding.

Exercise 15.1, ``induction_score(pattern, seq_len) -> scores``: one layer's attention pattern ``(batch, n_heads, pos,
pos)`` on ``lead`` tokens (a BOS or none) then ``seq_len`` random tokens shown twice; each head's mean attention from
the second copy's queries to the key ``seq_len - 1`` back (the token after the earlier copy), averaged over the batch:
``(n_heads,)``. Named: the copy itself (``seq_len`` back), the key one further back (``seq_len + 1``), the first copy's
queries averaged in, one extra query (the first copy's last token), the BOS not accounted for, the axes swapped (key as
query: 0 on a causal pattern), the heads averaged, the batch not averaged. ``tfedu.interp`` is refused. See
:func:`check_induction_score`.

Exercise 15.2, ``ablate_heads(model, ids, layer, heads, how) -> logits``: the model run with the heads ``heads`` of
block ``layer`` ablated at ``attn.hook_z``, set to 0 (``how="zero"``) or to their mean over the batch and the positions
(``how="mean"``). Named: a hook returning None after changing a copy (nothing ablated), every head ablated, the whole
attention output zeroed (``hook_attn_out``), positions taken for heads, the mean over the heads, over the batch,
positions and every head of the block together, over every axis (one number), over d_head, over the batch only or the
positions only, the attention pattern mean-ablated instead of the output, zero for mean and mean for zero, a hook
left on the model. See :func:`check_ablate_heads`.

Exercise 15.3, ``patch_head(model, clean_ids, corrupted_ids, layer, head) -> logits``: the corrupted run with one head's
output (block ``layer``'s ``attn.hook_z``, head ``head``, every position) taken from the clean run. Named: every head
patched, the patch run the wrong way, no patch at all (no hook attached, or a hook that returned None after changing a
copy: the two give the same logits, so the message names both), the clean run returned (or everything the later blocks
read patched), the position axis indexed for the head, the last position alone, a hook left on the model. See
:func:`check_patch_head`.

Exercise 15.4, ``logit_lens(model, ids) -> lens``: ``unembed(ln_final(resid))`` for the residual stream after the
embeddings (``blocks.0.hook_resid_pre``) and after each block (``blocks.<i>.hook_resid_post``), stacked on a first
axis, ``(n_layers + 1, batch, pos, d_vocab)``; the last row is the model's logits bit for bit. Checked on small
pre-norm GPTs with random norm scales (LayerNorm and RMSNorm). Named: no final norm, the embedding row missing, each
block's input read instead of its output, the last row normed twice, the model's logits appended as an extra row, the
layers stacked on the batch axis, probabilities instead of logits, a last row close to the logits but not bit for bit,
a hook left on the model. ``tfedu.interp`` is refused. See :func:`check_logit_lens`.

Exercise 15.5, ``logit_attribution(model, ids, pos, token) -> parts``: the logit of ``token`` at ``pos`` split into what
each part wrote to the final stream (``embed``, ``pos_embed``, ``L<l>H<h>``, ``L<l> attn bias``, ``L<l> MLP``,
``ln_final bias``), the final norm's scale frozen at its value on the final stream; the parts add up to the logit.
Named: each part run through the final norm on its own, each part divided by its own scale, the scale frozen at torch's
std of the final stream (centred, Bessel's d_model - 1, no eps: wrong for LayerNorm and RMSNorm alike), LayerNorm's
centring left out, no scale, no norm weight, the norm's bias added to every part, W_O's per-head slices cut from its
rows or interleaved, the MLP parts read from hook_resid_post. ``tfedu.interp`` is refused. See
:func:`check_logit_attribution`.

Exercise 15.6, ``constrained_probs(logits, allowed) -> probs``: the next-token distribution restricted to the
allowed tokens. ``logits`` is a float tensor ``(..., d_vocab)``, ``allowed`` a bool tensor of the same shape with at
least one True per row; the answer sets every forbidden logit to -inf and then takes the softmax over the last
dimension, so a forbidden token gets probability exactly 0 and each row sums to 1.

Named mistakes, each built from the same inputs and compared with the learner's output:

- masking *after* the softmax without renormalising (``softmax(logits) * allowed``): rows sum to the allowed
  mass, less than 1 (the "forgot to renormalise" of sampling);
- masking after the softmax and renormalising: equal in exact arithmetic, but a row whose allowed tokens are all
  far less likely than a forbidden one (logits 120 below it, as when the model wants to write something the
  grammar forbids) underflows to 0 / 0 in float32;
- exponentiating without subtracting the row's largest logit: right for small logits, NaN once a logit passes
  about 88 in float32 (a confident model's logits near 100, or logits divided by a temperature of 0.1);
- masking with 0 instead of -inf (``masked_fill(~allowed, 0)``, or ``logits * allowed``): a logit of 0 still has
  probability e^0 / Z;
- the mask inverted (the forbidden tokens kept), no mask at all, the softmax over the wrong dimension, returning
  the masked logits without the softmax, and changing ``logits`` in place (``masked_fill_``);
- a result not typed like the logits: half precision, or a conversion before the softmax (float32 back for float64
  logits, or float64 for float32); the probe records the dtype the learner returned.

A large negative finite fill (-1e9, ``torch.finfo(dtype).min``) gives the same probabilities on these inputs
and passes. ``tfedu.constrained`` and ``tfedu.generate`` are refused: the masking is the exercise.

Exercise 15.7, ``utf8_prefix_ok(data) -> bool``: whether bytes can still become valid UTF-8 (valid UTF-8, then at most
the beginning of one more character that the table of RFC 3629 / the Unicode Standard's table 3-7 allows), the
automaton behind notebook 01's promise of a UTF-8 constraint. Checked on fixed boundary inputs and random byte strings
weighted toward the table's edges, with all their prefixes; the shortest input where the answer is wrong names the
mistake, with the input in hex: an overlong form accepted (E0 80..9F, F0 80..8F), a surrogate (ED A0..BF), a code
point above U+10FFFF (F4 90..BF), C0/C1 or F5..FF accepted, a stray continuation byte accepted, an unfinished
character followed by ASCII or by a lead byte (a continuation test on the top bit only), an unfinished last
character rejected, a lead byte counted with the wrong length. Python's decoder (``.decode``, ``codecs``,
``str(data, encoding)``) and ``tfedu.constrained`` are refused. See :func:`check_utf8_prefix_ok`.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

import numpy as np
import torch

from tfedu.checks.core import (CheckFailure, Hints, Probe, call_learner, checker, describe, expect, from_modules,
                               global_names, globals_from_modules)
from tfedu.config import ModelConfig
from tfedu.model import GPT
from tfedu.checks.probes import CLEANUP, GPT_CLEANUP, GPT_FROM_INPUTS, HELPERS, gpt_from_inputs
from tfedu.checks.scan import scan_answer

FORBIDDEN = ("tfedu.constrained", "tfedu.generate")
NAME = "constrained_probs"

HINT_CALL = ("constrained_probs(logits, allowed): logits a float tensor (..., d_vocab), allowed a bool tensor of the "
             "same shape; to negate a bool mask use ~allowed (1 - allowed fails on bool tensors)")
HINT_SHORTCUT = "your constrained_probs uses {name}: the masking is the exercise, so build it from torch operations"
HINT_NONE = "your constrained_probs returned None: this exercise is not done yet, or the function has no `return`"
HINT_TYPE = ("constrained_probs should return a float torch tensor of probabilities shaped like logits (the sampling "
             "loop hands it to torch.multinomial), got {got}")
HINT_TIMES_INF = ("you added (~allowed) * -inf: at the allowed tokens that is 0 * -inf, which is NaN, not 0, so every row "
                  "becomes NaN. Set the forbidden entries instead (masked_fill or torch.where)")
HINT_HALF = ("your probabilities are {dtype}, the logits {want}: keep the logits' dtype (a half-precision softmax is "
             "off by about 1e-4)")
HINT_DTYPE = (
    "your probabilities are {dtype}, the logits {want}: the result is typed like the logits, so keep their dtype and "
    "do not convert before (or after) the softmax{why}"
)
DTYPE_WHY = {True: (": a float64 caller asked for float64's precision, which a float32 softmax throws away (float32 "
                    "keeps about 7 significant digits, float64 about 16)"),
             False: ": the softmax runs in the logits' own dtype"}
HINT_SHAPE = "your probabilities have shape {got}, expected the shape of logits, {want}"
HINT_AFTER_NO_RENORM = (
    "you masked after the softmax and did not renormalise: each row now sums to the probability the model gave "
    "the allowed tokens ({mass}), not 1, so sampling and log-probabilities are off. Set the forbidden logits to "
    "-inf *before* the softmax: the softmax then renormalises over the allowed tokens for you"
)
HINT_AFTER_RENORM = (
    "you masked after the softmax (or after exponentiating) and renormalised: right in exact arithmetic, but in "
    "{what}, every allowed token is 120 logits below the forbidden favourite, so in float32 "
    "their probabilities underflow to 0 (or the forbidden exponential overflows to inf) and the renormalisation "
    "gives NaN. Mask the logits to -inf before the softmax: it then subtracts the largest *allowed* logit and "
    "nothing underflows"
)
HINT_ZERO_FILL = (
    "you masked with 0 instead of -inf (a fill with 0, or the logits multiplied by the mask): a forbidden token's "
    "logit becomes 0, and e^0 = 1 is not 0, so forbidden tokens keep probability. Fill with minus infinity, whose "
    "exponential is exactly 0"
)
HINT_INVERTED = ("the mask is inverted: the forbidden tokens got the probability and the allowed ones got 0. "
                 "allowed is True where a token may come next, so the entries to hide are those where it is False")
HINT_NO_MASK = ("the mask was not applied: forbidden tokens still have probability; the entries where allowed is False "
                "must be at -inf when the softmax runs")
HINT_WRONG_DIM = ("the softmax ran over the wrong dimension: each row of logits (the last dim, d_vocab) is one "
                  "next-token distribution, so take the softmax over the last dimension")
HINT_LOGITS = ("you returned the masked logits (or log-probabilities), not probabilities: apply the softmax (over "
               "the last dimension) after setting the forbidden logits to -inf")
HINT_FORBIDDEN_MASS = ("forbidden tokens get probability (largest {mass:.3g} in {what}): every token with allowed=False "
                       "must get exactly 0. A finite fill such as -100 leaves e^-100 > 0; fill with minus infinity")
HINT_IN_PLACE = ("constrained_probs changed the caller's logits in place (masked_fill_, an index assignment into "
                 "logits, or another in-place op): the model's logits must stay as they were. Use masked_fill (no "
                 "underscore), or clone first")
HINT_NOT_NORMALISED = "the rows of your probabilities sum to {total:.6g} in {what}, not 1"
HINT_DIFFERS = "your probabilities differ from softmax over the allowed tokens in {what}: largest error {err:.3g}"
HINT_OVERFLOW = (
    "your probabilities contain NaN in {what}, where the allowed logits are near {top:.0f}: e^x overflows float32 "
    "once x passes about 88 (e^100 is inf), and inf / inf is NaN. The softmax of a row does not change when the "
    "same number is subtracted from every logit in it; subtract the row's largest allowed logit before "
    "exponentiating, so the largest term is e^0 = 1 (torch's softmax does this for you)"
)
HINT_NAN = ("your probabilities contain NaN in {what}: a row's softmax divided 0 by 0 or subtracted -inf from -inf. "
            "Mask to -inf, then softmax (it subtracts the largest finite logit for you)")


# ----------------------------------------------------------------------------- the reference and the mistakes


def expected_probs(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The reference, in float64: softmax over the allowed tokens of each row (forbidden tokens exactly 0)."""
    return logits.double().masked_fill(~allowed, float("-inf")).softmax(dim=-1)


def mistakes(logits: torch.Tensor, allowed: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """What each named mistake returns on these inputs, with its hint (computed in float32, as a learner's would)."""
    x = logits.float()
    plain = x.softmax(dim=-1)
    kept = plain * allowed
    mass = kept.sum(dim=-1)
    out = [
        (HINT_TIMES_INF, (x + (~allowed) * float("-inf")).softmax(dim=-1)),
        (HINT_AFTER_NO_RENORM.format(mass=f"{float(mass.min()):.3g} in one row"), kept),
        (HINT_ZERO_FILL, x.masked_fill(~allowed, 0.0).softmax(dim=-1)),
        (HINT_INVERTED, x.masked_fill(allowed, float("-inf")).softmax(dim=-1)),
        (HINT_NO_MASK, plain),
    ]
    for dim in range(x.dim() - 1):  # every dimension but the last
        out.append((HINT_WRONG_DIM, x.masked_fill(~allowed, float("-inf")).softmax(dim=dim)))
    return out


# ----------------------------------------------------------------------------- inputs


def underflow_case(seed: int, rows: int = 3, d_vocab: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows where a forbidden token's logit is 120 above every allowed one: softmax-then-mask underflows to 0 / 0."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, d_vocab, generator=g) * 2
    allowed = torch.rand(rows, d_vocab, generator=g) < 0.4
    allowed[:, 0] = False
    allowed[:, 1] = True
    logits[:, 0] = logits.max() + 120.0  # the model's favourite, forbidden
    return logits, allowed


def confident_case(seed: int, rows: int = 3, d_vocab: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits near 100 (a confident model, or logits divided by a temperature of 0.1): e^x overflows float32."""
    logits, allowed = random_case(seed, (rows, d_vocab))
    return logits + 100.0, allowed


def random_case(seed: int, shape: tuple[int, ...], *, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits (spread 3) and a random mask with at least one allowed token per row."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=g) * 3).to(dtype)
    allowed = torch.rand(shape, generator=g) < 0.5
    first = torch.randint(0, shape[-1], shape[:-1], generator=g)
    allowed.scatter_(-1, first[..., None], True)
    return logits, allowed


def cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what, logits, allowed): small and batched random cases, one row, float64, and the underflow rows."""
    return [
        ("a (3, 10) batch", *random_case(0, (3, 10))),
        ("a (2, 4, 33) batch", *random_case(1, (2, 4, 33))),
        ("a single row of 17 logits (shape (17,))", *random_case(2, (17,))),
        ("a (4, 9) float64 batch", *random_case(3, (4, 9), dtype=torch.float64)),
        ("rows where the model's favourite token is forbidden", *underflow_case(4)),
        ("rows of logits near 100 (a confident model, or a temperature of 0.1)", *confident_case(5)),
    ]


# ----------------------------------------------------------------------------- diagnosis


def diagnose(got: Any, logits: torch.Tensor, allowed: torch.Tensor, *, what: str,
             dtype: torch.dtype | None = None) -> None:
    """Raise a ``CheckFailure`` naming the mistake when ``got`` is not softmax over the allowed tokens. ``dtype``: the
    dtype the learner returned, when ``got`` is a converted copy (the probe's), else ``got.dtype``."""
    if got is None:
        raise CheckFailure(HINT_NONE)
    if not isinstance(got, torch.Tensor) or not got.is_floating_point():  # a NumPy array too: torch.multinomial needs a tensor
        raise CheckFailure(HINT_TYPE.format(got=describe(got)))
    expect(tuple(got.shape) == tuple(logits.shape), HINT_SHAPE.format(got=tuple(got.shape), want=tuple(logits.shape)))
    dtype = got.dtype if dtype is None else dtype
    if dtype in (torch.float16, torch.bfloat16) and logits.dtype not in (torch.float16, torch.bfloat16):
        raise CheckFailure(HINT_HALF.format(dtype=dtype, want=logits.dtype))
    if dtype != logits.dtype:
        lost = logits.dtype == torch.float64
        raise CheckFailure(HINT_DTYPE.format(dtype=dtype, want=logits.dtype, why=DTYPE_WHY[lost]))
    got = got.detach().double()
    want = expected_probs(logits, allowed)
    if got.isneginf().any() or (got.isfinite().all() and (got < 0).any() and got.isneginf().sum() == 0
                                 and bool((got.masked_select(allowed) < 0).any())):
        raise CheckFailure(HINT_LOGITS)
    if torch.isnan(got).any():
        after = (logits.float().softmax(-1) * allowed)
        if bool((after.sum(-1) == 0).any()):
            raise CheckFailure(HINT_AFTER_RENORM.format(what=what))
        for hint, wrong in mistakes(logits, allowed):
            if torch.allclose(got, wrong.double(), rtol=1e-4, atol=1e-6, equal_nan=True):
                raise CheckFailure(hint)
        top = float(logits.masked_fill(~allowed, float("-inf")).max())
        if top > 80:
            raise CheckFailure(HINT_OVERFLOW.format(what=what, top=top))
        raise CheckFailure(HINT_NAN.format(what=what))
    if torch.allclose(got, want, rtol=1e-4, atol=1e-6):
        return
    for hint, wrong in mistakes(logits, allowed):
        if torch.allclose(got, wrong.double(), rtol=1e-4, atol=1e-6):
            raise CheckFailure(hint)
    forbidden = got.masked_fill(allowed, 0).abs().max()
    if forbidden > 0:
        raise CheckFailure(HINT_FORBIDDEN_MASS.format(mass=float(forbidden), what=what))
    total = got.sum(dim=-1)
    worst = int((total - 1).abs().flatten().argmax())
    if abs(float(total.flatten()[worst]) - 1) > 1e-4:
        raise CheckFailure(HINT_NOT_NORMALISED.format(total=float(total.flatten()[worst]), what=what))
    raise CheckFailure(HINT_DIFFERS.format(what=what, err=float((got - want).abs().max())))


# ----------------------------------------------------------------------------- the check


def _refuse_shortcuts(fn: Any, forbidden: tuple[str, ...] = FORBIDDEN, hint: str = HINT_SHORTCUT) -> None:
    if from_modules(fn, forbidden):
        raise CheckFailure(hint.format(name=f"{getattr(fn, '__module__', 'tfedu')}'s "
                                       f"{getattr(fn, '__name__', 'object')}"))
    used = globals_from_modules(fn, forbidden)
    expect(not used, hint.format(name=", ".join(used)))
    try:  # the grader's static scan, on the same source: what it would refuse is refused here too
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return
    scope = getattr(fn, "__globals__", {})
    modules = [f"import {scope[n].__name__} as {n}" for n in sorted(global_names(fn))
               if inspect.ismodule(scope.get(n))]  # so the scan knows what `tfedu.` or `tc.` stands for
    problems = scan_answer(source, context=modules, forbidden=forbidden)
    expect(not problems, problems[0] if problems else "")


@checker("constrained next-token probabilities")
def check_constrained_probs(constrained_probs) -> None:
    """Check ``constrained_probs(logits, allowed)`` on :func:`cases`: values to 1e-4, forbidden tokens exactly 0."""
    _refuse_shortcuts(constrained_probs)
    for what, logits, allowed in cases():
        given = logits.clone()
        got = call_learner(constrained_probs, given, allowed.clone(), name=NAME, error_hint=HINT_CALL)
        if not torch.equal(given, logits):
            raise CheckFailure(HINT_IN_PLACE)
        diagnose(got, logits, allowed, what=what)
        if isinstance(got, torch.Tensor):
            expect(bool((got.detach().masked_select(~allowed) == 0).all()),
                   HINT_FORBIDDEN_MASS.format(mass=float(got.detach().masked_fill(allowed, 0).abs().max()), what=what))


# ----------------------------------------------------------------------------- 15.1 induction_score

IS_FORBIDDEN = ("tfedu.interp",)
HINT_IS_SHORTCUT = ("your induction_score uses {name}: reading the score off the pattern is the exercise, so index "
                    "the pattern yourself")
HINT_IS_CALL = (
    "induction_score(pattern, seq_len): one layer's attention pattern, a float tensor (batch, n_heads, query_pos, "
    "key_pos), for sequences of pos = lead + 2 * seq_len tokens (lead: the tokens before the first copy, 1 for a "
    "BOS, else 0); return one score per head, a float tensor (n_heads,)"
)
HINT_IS_SHAPE = "induction_score should return one score per head, a float tensor of shape {want}, got {got}"
HINT_IS_HEADS_MEAN = ("you averaged over the heads too ({got}): the score is one number per head, (n_heads,), "
                      "averaged over the batch and the queries of the second copy only")
HINT_IS_NO_BATCH_MEAN = ("you returned a score per sequence and head, {got}: average over the batch as well, so that "
                         "there is one number per head, (n_heads,)")
HINT_IS_COPY = (
    "you scored the attention to the earlier copy of the current token itself, seq_len positions back: an induction "
    "head attends to the token just *after* that earlier copy, seq_len - 1 positions back, the token it then predicts"
)
HINT_IS_ALL_QUERIES = (
    "you averaged over every query that has a key seq_len - 1 positions back, queries of the first copy included: "
    "only a query in the second copy has an earlier occurrence of its token to look up, so the score averages over "
    "those seq_len queries alone"
)
HINT_IS_KEY_FURTHER = (
    "you scored the key seq_len + 1 positions back, one before the earlier copy of the current token: an induction "
    "head attends to the token just *after* that earlier copy, seq_len - 1 positions back (the copy itself is seq_len "
    "back, so the key is one position later than the copy, not one earlier)"
)
HINT_IS_EXTRA_QUERY = (
    "you averaged over seq_len + 1 queries: your first query is the last token of the first copy, one position before "
    "the second copy starts. That token has not occurred before, so it has nothing to look up; the second copy's "
    "queries are the seq_len positions from lead + seq_len to the end"
)
HINT_IS_NO_LEAD = (
    "your query and key positions ignore the tokens before the first copy: with a BOS at position 0 the first copy "
    "starts at position 1 and the second at 1 + seq_len, so every position moves by lead = pos - 2 * seq_len"
)
HINT_IS_TRANSPOSED = (
    "your scores are 0 on a causal pattern: you read the entry with the key as the query (the axes swapped). The "
    "pattern is (batch, n_heads, query_pos, key_pos), and a query never attends to a later key, so that entry is 0"
)
HINT_IS_DIFFERS = "your scores differ from the reference in {what}: largest difference {err:.3g}"

IS_MISTAKES = {"copy": HINT_IS_COPY, "key-further": HINT_IS_KEY_FURTHER, "all-queries": HINT_IS_ALL_QUERIES,
               "extra-query": HINT_IS_EXTRA_QUERY, "no-lead": HINT_IS_NO_LEAD, "transposed": HINT_IS_TRANSPOSED}


def _induction_variant(pattern: torch.Tensor, seq_len: int, mistake: str | None = None) -> torch.Tensor:
    """Each head's induction score on ``pattern`` (batch, n_heads, pos, pos), right or with one known mistake."""
    n_pos = pattern.shape[-1]
    lead = 0 if mistake == "no-lead" else n_pos - 2 * seq_len
    query = torch.arange(lead + seq_len, lead + 2 * seq_len)  # the second copy
    if mistake == "all-queries":
        query = torch.arange(seq_len - 1, n_pos)  # every query with a key seq_len - 1 back
    if mistake == "extra-query":
        query = torch.arange(lead + seq_len - 1, lead + 2 * seq_len)  # the first copy's last query too
    back = {"copy": seq_len, "key-further": seq_len + 1}.get(mistake, seq_len - 1)
    key = query - back  # with no lead, seq_len + 1 back wraps to the last key at the first query, as a learner's does
    read = pattern.transpose(-1, -2) if mistake == "transposed" else pattern
    return read[..., query, key].double().mean(-1).mean(0)  # n_heads


def reference_induction_score(pattern: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The exercise's answer: (n_heads,), float32."""
    return _induction_variant(pattern, seq_len).float()


def score_pattern(seed: int, batch: int, n_heads: int, seq_len: int, lead: int) -> torch.Tensor:
    """A random causal pattern (batch, n_heads, pos, pos), each head leaning a random amount towards the induction
    key, so that every named mistake gives other numbers."""
    g = torch.Generator().manual_seed(seed)
    n_pos = lead + 2 * seq_len
    scores = torch.randn(batch, n_heads, n_pos, n_pos, generator=g)
    query = torch.arange(lead + seq_len, n_pos)
    scores[:, :, query, query - seq_len + 1] += 3 * torch.rand(n_heads, 1, generator=g)
    visible = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    return scores.masked_fill(~visible, float("-inf")).softmax(-1)


def _induction_problem(got: Any, pattern: torch.Tensor, seq_len: int, what: str) -> str | None:
    want = _induction_variant(pattern, seq_len)
    if not (isinstance(got, torch.Tensor) and got.is_floating_point()):
        return HINT_IS_SHAPE.format(want=tuple(want.shape), got=describe(got))
    got = got.detach().double()
    close = lambda a, b: a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    if got.shape != want.shape:
        if got.numel() == 1 or tuple(got.shape) == tuple(pattern.shape[:1]):  # one number, or one per sequence
            return HINT_IS_HEADS_MEAN.format(got=f"shape {tuple(got.shape)}")
        if tuple(got.shape) == tuple(pattern.shape[:2]):
            return HINT_IS_NO_BATCH_MEAN.format(got=f"shape {tuple(got.shape)}")
        return HINT_IS_SHAPE.format(want=tuple(want.shape), got=describe(got))
    if close(got, want):
        return None
    for mistake, hint in IS_MISTAKES.items():
        wrong = _induction_variant(pattern, seq_len, mistake)
        if close(got, wrong) and not close(wrong, want):
            return hint
    return HINT_IS_DIFFERS.format(what=what, err=float((got - want).abs().max()))


IS_CASES = ((0, 3, 4, 6, 1), (1, 2, 2, 9, 0), (2, 4, 3, 5, 1))  # (seed, batch, n_heads, seq_len, lead)


@checker("the induction score: attention to the token after the earlier copy")
def check_induction_score(induction_score) -> None:
    """Check ``induction_score(pattern, seq_len)`` on random causal patterns with and without a BOS in front: one
    score per head, the mean over the batch and the second copy's queries of the attention on the key seq_len - 1
    back. Named: see the module docstring."""
    _refuse_shortcuts(induction_score, IS_FORBIDDEN, HINT_IS_SHORTCUT)
    for seed, batch, n_heads, seq_len, lead in IS_CASES:
        pattern = score_pattern(seed, batch, n_heads, seq_len, lead)
        what = (f"induction_score(pattern, seq_len={seq_len}) with pattern {tuple(pattern.shape)} "
                f"({'a BOS, then ' if lead else ''}{seq_len} random tokens shown twice)")
        given = pattern.clone()
        got = call_learner(induction_score, given, seq_len, name="induction_score", error_hint=HINT_IS_CALL)
        expect(torch.equal(given, pattern), "induction_score changed the pattern in place: read it, do not write it")
        problem = _induction_problem(got, pattern, seq_len, what)
        if problem:
            raise CheckFailure(problem)


IS_PROBE_RUN = HELPERS + """\
_fn = globals().get('induction_score')
_results = []
for _c in inputs['cases']:
    if _fn is None:
        _results.append({'returned': 'undefined', 'scores': None, 'error': None})
        continue
    try:
        _r = _call(_fn, torch.from_numpy(_c['pattern']), _c['seq_len'])
        _results.append({'returned': _kind(_r), 'scores': _array(_r), 'error': None})
    except Exception as _e:
        _results.append({'returned': None, 'scores': None, 'error': type(_e).__name__ + ': ' + str(_e)[:200]})
outputs = {'results': _results, 'mutated': _MUTATED}
del _fn, _results, _c
""" + CLEANUP


def _is_probe_inputs(rng: np.random.Generator) -> dict:
    cases_ = []
    for lead in (1, 0, int(rng.integers(0, 3))):
        pattern = score_pattern(int(rng.integers(0, 2**31)), int(rng.integers(1, 5)), int(rng.integers(2, 6)),
                                int(rng.integers(4, 12)), lead)
        cases_.append({"pattern": pattern.numpy(), "seq_len": (pattern.shape[-1] - lead) // 2})
    return {"cases": cases_}


def _compare_is(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list):
        return "the hidden test's outputs should be a dict with the results"
    if outputs.get("mutated"):
        return "induction_score changed the pattern in place: read it, do not write it"
    for i, (got, case) in enumerate(zip(outputs["results"], expected["inputs"]["cases"])):
        if got.get("returned") == "undefined":
            return "induction_score is not defined: run the exercise's cell"
        if got.get("error"):
            return f"induction_score raised {got['error']} ({HINT_IS_CALL})"
        scores = got.get("scores")
        if isinstance(scores, np.ndarray) and scores.dtype.kind == "f":
            scores = torch.from_numpy(scores)
        else:
            scores = got.get("returned")
        problem = _induction_problem(scores, torch.from_numpy(case["pattern"]), case["seq_len"], f"hidden test {i + 1}")
        if problem:
            return problem
    return None


# ----------------------------------------------------------------------------- 15.2 ablate_heads

HINT_AB_CALL = (
    "ablate_heads(model, ids, layer, heads, how): a tfedu GPT, (batch, pos) token ids, a block index, a list of head "
    "indices and how = 'zero' or 'mean'; the heads' outputs sit at blocks.<layer>.attn.hook_z, (batch, pos, n_heads, "
    "d_head) (in model.hooks, write the dots as __)"
)
HINT_AB_SHAPE = "ablate_heads should return the ablated run's logits, a float tensor {want}, got {got}"
HINT_AB_NONE_BACK = (
    "your logits are the model's own, nothing ablated: either no hook was attached while the model ran, or the hook "
    "changed a copy and returned None (a hook that returns None leaves the activation as it was; return the new tensor)"
)
HINT_AB_ALL_HEADS = (
    "every head of block {layer} was ablated: the hook's tensor holds all of the block's heads side by side, (batch, "
    "pos, n_heads, d_head); change only the heads asked for, {heads}, and leave the others as they are"
)
HINT_AB_ATTN_OUT = (
    "you zeroed the block's whole attention output (hook_attn_out, after W_O has mixed the heads and added its bias): "
    "that removes every head of the block and the bias. One head's own output is at attn.hook_z, before W_O"
)
HINT_AB_POSITION = (
    "you ablated positions {heads} rather than heads {heads}: the hook's tensor is (batch, pos, n_heads, d_head), so "
    "a head is picked on the third axis, at every position"
)
HINT_AB_MEAN_HEADS = (
    "your mean ablation averaged over the heads axis, mixing the heads' outputs: each ablated head gets its *own* "
    "mean output, averaged over the batch and the positions (axes 0 and 1), one d_head vector per head"
)
HINT_AB_MEAN_ALL_HEADS = (
    "your mean ablation averaged over the batch, the positions and the heads together, every head of block {layer} "
    "pooled into one d_head vector: each ablated head gets its *own* mean output, averaged over the batch and the "
    "positions only (axes 0 and 1), taken from that head's slice alone"
)
HINT_AB_MEAN_ALL = (
    "your mean ablation replaced the heads' outputs by one number, the mean over every axis (batch, positions, "
    "heads and d_head): each ablated head gets its own mean output *vector*, averaged over the batch and the "
    "positions only (axes 0 and 1), keeping d_head"
)
HINT_AB_MEAN_D_HEAD = (
    "your mean ablation averaged over d_head, the last axis: that gives one number per position instead of the "
    "head's mean output vector. Average over the batch and the positions (axes 0 and 1), keeping d_head"
)
HINT_AB_MEAN_BATCH = (
    "your mean ablation averaged over the batch only, so each position keeps its own mean: average over the batch "
    "and the positions (axes 0 and 1), one d_head vector per head for the whole run"
)
HINT_AB_MEAN_POS = (
    "your mean ablation averaged over the positions only, so each sequence keeps its own mean: average over the "
    "batch and the positions (axes 0 and 1), one d_head vector per head for the whole run"
)
HINT_AB_PATTERN = (
    "you mean-ablated the heads' attention pattern (hook_pattern), not their output: the head then still reads the "
    "current tokens' values through the averaged weights. Mean ablation replaces the head's output, at attn.hook_z, "
    "by its mean over the batch and the positions"
)
HINT_AB_ZERO_FOR_MEAN = ("with how='mean' you zeroed the heads: mean ablation replaces each head's output by its mean "
                         "over the batch and the positions, not by 0")
HINT_AB_MEAN_FOR_ZERO = ("with how='zero' you replaced the heads' outputs by their mean: zero ablation sets them to 0")
HINT_AB_LEAK = (
    "a hook was still attached to the model after ablate_heads returned, so every later run of the model stays "
    "ablated: attach it for one run only (model.hooks is a context manager) or remove its handle before returning"
)
HINT_AB_DIFFERS = "your ablated logits differ from the reference in {what}: largest difference {err:.3g}"

AB_MISTAKES = {"none-back": HINT_AB_NONE_BACK, "all-heads": HINT_AB_ALL_HEADS, "attn-out": HINT_AB_ATTN_OUT,
               "position-axis": HINT_AB_POSITION, "mean-heads": HINT_AB_MEAN_HEADS,
               "mean-all-heads": HINT_AB_MEAN_ALL_HEADS, "mean-all": HINT_AB_MEAN_ALL,
               "mean-d-head": HINT_AB_MEAN_D_HEAD, "mean-batch": HINT_AB_MEAN_BATCH, "mean-pos": HINT_AB_MEAN_POS,
               "pattern": HINT_AB_PATTERN, "zero-for-mean": HINT_AB_ZERO_FOR_MEAN,
               "mean-for-zero": HINT_AB_MEAN_FOR_ZERO}
_MEAN_AXES = {"mean-heads": (0, 1, 2), "mean-all-heads": (0, 1, 2), "mean-all": (0, 1, 2, 3),
              "mean-d-head": (0, 1, 3), "mean-batch": (0,), "mean-pos": (1,)}


def _ablate_variant(model: GPT, ids: torch.Tensor, layer: int, heads: Any, how: str = "zero",
                    mistake: str | None = None) -> torch.Tensor | None:
    """The logits with heads ``heads`` of block ``layer`` ablated (``how``: zero or mean), right or with one known
    mistake; None when the mistake does not apply to ``how``."""
    heads = list(heads)
    if mistake in (*_MEAN_AXES, "pattern") and how != "mean" or mistake == "position-axis" and how != "zero":
        return None
    if mistake == "zero-for-mean" and how != "mean" or mistake == "mean-for-zero" and how != "zero":
        return None
    with torch.no_grad():
        if mistake == "none-back":
            return model(ids)
        if mistake == "attn-out":
            with model.hooks(**{f"blocks__{layer}__hook_attn_out": torch.zeros_like}):
                return model(ids)
        if mistake == "pattern":  # the weights averaged over the batch and the queries, the values left alone
            if model.cfg.attention != "manual":
                return None

            def average(pattern: torch.Tensor) -> torch.Tensor:  # batch n_heads query_pos key_pos
                pattern = pattern.clone()
                picked = pattern[:, heads]
                pattern[:, heads] = picked.mean((0, 2), keepdim=True).expand_as(picked)
                return pattern

            with model.hooks(**{f"blocks__{layer}__attn__hook_pattern": average}):
                return model(ids)
        use_mean = (how == "mean") != (mistake in ("zero-for-mean", "mean-for-zero"))

        def ablate(z: torch.Tensor) -> torch.Tensor:  # batch pos n_heads d_head
            z = z.clone()
            if mistake == "position-axis":
                z[:, heads] = 0.0
                return z
            which = slice(None) if mistake == "all-heads" else heads
            if use_mean:
                picked = z[:, :, which]
                pooled = z if mistake == "mean-all-heads" else picked  # every head of the block, not only `heads`
                z[:, :, which] = pooled.mean(_MEAN_AXES.get(mistake, (0, 1)), keepdim=True).expand_as(picked)
            else:
                z[:, :, which] = 0.0
            return z

        with model.hooks(**{f"blocks__{layer}__attn__hook_z": ablate}):
            return model(ids)


def reference_ablate_heads(model: GPT, ids: torch.Tensor, layer: int, heads: Any, how: str = "zero") -> torch.Tensor:
    """The exercise's answer: the logits (batch, pos, d_vocab) with the heads' hook_z outputs zeroed or mean-ablated."""
    return _ablate_variant(model, ids, layer, heads, how)


def _ablate_problem(got: Any, model: GPT, ids: torch.Tensor, layer: int, heads: Any, how: str,
                    what: str) -> str | None:
    want = reference_ablate_heads(model, ids, layer, heads, how)
    if not (isinstance(got, torch.Tensor) and got.is_floating_point() and got.shape == want.shape):
        return HINT_AB_SHAPE.format(want=tuple(want.shape), got=describe(got))
    got = got.detach().float()
    close = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    if close(got, want):
        return None
    for mistake, hint in AB_MISTAKES.items():
        wrong = _ablate_variant(model, ids, layer, heads, how, mistake)
        if wrong is not None and close(got, wrong) and not close(wrong, want):
            return hint.format(layer=layer, heads=list(heads))
    return HINT_AB_DIFFERS.format(what=what, err=float((got - want).abs().max()))


def ablation_model(seed: int, *, d_vocab: int = 40, positional: str = "rope") -> GPT:
    """``patch_model`` with random biases (a GPT starts with them at 0, and then zeroing the whole attention output
    would be zeroing every head)."""
    model = patch_model(seed, d_vocab=d_vocab, positional=positional)
    _random_biases(model, torch.Generator().manual_seed(seed))
    return model


def _random_biases(model: GPT, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)


AB_CASES = ((0, 1, [2], "zero", "rope"), (1, 0, [0, 3], "mean", "learned"), (2, 2, [1], "mean", "rope"),
            (3, 0, [1, 2], "zero", "learned"))  # (seed, layer, heads, how, positional)


@checker("an ablation hook: zero or mean ablation of chosen heads")
def check_ablate_heads(ablate_heads) -> None:
    """Check ``ablate_heads(model, ids, layer, heads, how)`` on small random GPTs: the logits with the heads' hook_z
    outputs set to 0 (how='zero') or to their mean over the batch and the positions (how='mean'), and no hook left on
    the model afterwards. Named: see the module docstring."""
    for seed, layer, heads, how, positional in AB_CASES:
        model = ablation_model(seed, positional=positional)
        ids = torch.randint(0, model.cfg.d_vocab, (3, 10), generator=torch.Generator().manual_seed(seed))
        what = (f"ablate_heads(model, ids, layer={layer}, heads={heads}, how={how!r}) on a 3-block GPT of 4 heads "
                f"with ids of shape {tuple(ids.shape)}")
        got = call_learner(ablate_heads, model, ids.clone(), layer, list(heads), how, name="ablate_heads",
                           error_hint=HINT_AB_CALL)
        if _hooks_left(model):
            raise CheckFailure(HINT_AB_LEAK)
        problem = _ablate_problem(got, model, ids, layer, heads, how, what)
        if problem:
            raise CheckFailure(problem)


AB_PROBE_RUN = HELPERS + GPT_FROM_INPUTS + """\
_results = []
for _c in inputs['cases']:
    try:
        _r = _call(ablate_heads, _model, torch.from_numpy(inputs['ids']), _c['layer'], list(_c['heads']), _c['how'])
        _error = None
    except Exception as _e:
        _r, _error = None, type(_e).__name__ + ': ' + str(_e)[:200]
    _left = any(_m._forward_hooks or _m._forward_pre_hooks for _m in _model.modules())
    _results.append({'returned': _kind(_r), 'logits': _array(_r), 'error': _error, 'left': _left})
    if _left:
        break
outputs = {'results': _results, 'mutated': _MUTATED}
del _results, _c, _r, _error, _left
""" + GPT_CLEANUP + CLEANUP


def _ab_probe_inputs(rng: np.random.Generator) -> dict:
    """A fresh small GPT, ids, and a zero and a mean ablation whose named mistakes all differ from the answer."""
    for _ in range(100):
        config = {"d_vocab": int(rng.integers(30, 70)), "n_ctx": 32, "d_model": 32, "n_layers": 3, "n_heads": 4,
                  "init_std": 0.5, "tied_embeddings": False, "positional": str(rng.choice(["rope", "learned"]))}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(rng.integers(0, 2**31)))
            model = GPT(ModelConfig(**config))
        _random_biases(model, torch.Generator().manual_seed(int(rng.integers(0, 2**31))))
        weights = {name: value.numpy() for name, value in model.state_dict().items()}
        ids = rng.integers(0, config["d_vocab"], (int(rng.integers(2, 4)), int(rng.integers(8, 15)))).astype(np.int64)
        cases_ = []
        for how in ("zero", "mean"):
            n = int(rng.integers(1, 3)) if how == "zero" else int(rng.integers(2, 4))  # the heads' mean: two or more
            cases_.append({"layer": int(rng.integers(0, 3)), "how": how,
                           "heads": sorted(int(h) for h in rng.choice(4, n, replace=False))})
        inputs = {"config": config, "weights": weights, "ids": ids, "cases": cases_}
        model = gpt_from_inputs(inputs)
        ok = True
        for case in cases_:
            args = (model, torch.from_numpy(ids), case["layer"], case["heads"], case["how"])
            outs = [reference_ablate_heads(*args)]
            outs += [v for m in AB_MISTAKES if (v := _ablate_variant(*args, m)) is not None]
            ok &= all(not torch.allclose(a, b, rtol=1e-4, atol=1e-4) for i, a in enumerate(outs) for b in outs[i + 1:])
        if ok:
            return inputs
    raise RuntimeError("no ablation case whose named mistakes all differ from the answer")


def _compare_ab(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list):
        return "the hidden test's outputs should be a dict with the results"
    inputs = expected["inputs"]
    model, ids = gpt_from_inputs(inputs), torch.from_numpy(inputs["ids"])
    for i, (got, case) in enumerate(zip(outputs["results"], inputs["cases"])):
        if got.get("error"):
            return f"ablate_heads raised {got['error']} ({HINT_AB_CALL})"
        if got.get("left"):
            return HINT_AB_LEAK
        logits = got.get("logits")
        if isinstance(logits, np.ndarray) and logits.dtype.kind == "f":
            logits = torch.from_numpy(logits)
        else:
            logits = got.get("returned")
        problem = _ablate_problem(logits, model, ids, case["layer"], case["heads"], case["how"], f"hidden test {i + 1}")
        if problem:
            return problem
    if len(outputs["results"]) != len(inputs["cases"]):
        return "ablate_heads's hidden test did not run every case"
    return None


# ----------------------------------------------------------------------------- 15.5 logit_attribution

LA_FORBIDDEN = ("tfedu.interp",)
HINT_LA_SHORTCUT = ("your logit_attribution uses {name}: splitting the logit is the exercise, so build it from the "
                    "model's cache, its W_O, ln_final and unembedding")
HINT_LA_CALL = (
    "logit_attribution(model, ids, pos, token): a pre-norm tfedu GPT, token ids of shape (1, n_pos), a position and a "
    "token id; return a dict from each part's label ('embed', 'pos_embed', 'L0H0', ..., 'L0 attn bias', 'L0 MLP', "
    "'ln_final bias') to a float. A head's z is d_head numbers, not d_model: it reaches the stream through its own "
    "d_head columns of W_O.weight"
)
HINT_LA_TYPE = "logit_attribution should return a dict from label to float, got {got}"
HINT_LA_KEYS = ("your labels are not the parts of this model ({model}): {detail}. The parts are 'embed', 'pos_embed' "
                "(learned positions only), 'L<l>H<h>' for every head, 'L<l> attn bias' (when W_O has a bias), "
                "'L<l> MLP' (when the blocks have MLPs) and 'ln_final bias' (a LayerNorm with a bias)")
HINT_LA_VALUE = "the value of {key!r} should be a float (or a 0-d tensor), got {got}"
HINT_LA_OWN_NORM = (
    "you ran each part through the final norm on its own: the norm's scale (and, for LayerNorm, its mean and bias) "
    "belongs to the whole residual stream, so a part normed alone gets another scale and the parts no longer add up "
    "to the logit. Compute the scale once, on the final stream at this position, and divide every part by it"
)
HINT_LA_OWN_SCALE = (
    "you divided each part by its own scale (its own standard deviation or RMS): the scale is the final stream's, "
    "computed once at this position, and the same divisor for every part; otherwise the parts do not add up"
)
HINT_LA_NO_CENTRE = (
    "you left out LayerNorm's centring: LayerNorm subtracts the stream's mean before scaling, and since the mean is "
    "linear, each part's share of it comes off that part. Subtract each part's mean over d_model (or, the same, use "
    "the read-out direction minus its own mean)"
)
HINT_LA_STD = (
    "you froze the scale at the final stream's standard deviation as torch's std computes it: {detail}. The scale "
    "is the square root of ({what}) plus ln_final.eps"
)
LA_STD_LAYER = ("it divides the sum of squares by d_model - 1 (Bessel's correction, for estimating a population from "
                "a sample), while LayerNorm divides by d_model, and it leaves out eps")
LA_STD_RMS = ("it subtracts the stream's mean, which RMSNorm never does, divides by d_model - 1 (Bessel's "
              "correction) where RMSNorm divides by d_model, and leaves out eps")
LA_STD_WHAT = {True: "the mean square of the stream after subtracting its mean, over d_model",
               False: "the mean square of the stream itself, uncentred, over d_model"}
HINT_LA_NO_SCALE = ("you did not divide by the final norm's scale: with the scale frozen at its value on the final "
                    "stream, every part is divided by it (the read-out is then linear)")
HINT_LA_NO_WEIGHT = ("you left out the final norm's weight: after centring and scaling, LayerNorm (and RMSNorm) "
                     "multiply by ln_final.weight, elementwise, before the unembedding")
HINT_LA_BIAS_EVERYWHERE = (
    "you added the final norm's bias read-out to every part: it is one constant of the read-out, added once, as its "
    "own part 'ln_final bias', not once per part"
)
HINT_LA_WO_ROWS = (
    "your heads' slices of W_O are cut along the wrong axis: W_O.weight is (d_model, n_heads * d_head), the heads' "
    "columns side by side, so head h's slice is the columns h * d_head to (h + 1) * d_head (transpose it to map "
    "d_head to d_model)"
)
HINT_LA_WO_ORDER = (
    "your heads' slices of W_O are interleaved: the n_heads * d_head columns hold head 0's d_head columns first, then "
    "head 1's, and so on, so split them as (n_heads, d_head), not (d_head, n_heads)"
)
HINT_LA_RESID = (
    "your MLP parts read the stream after each block (hook_resid_post), which holds everything written so far, not "
    "what the MLP alone wrote: read each MLP's own output (hook_mlp_out)"
)
HINT_LA_NOT_SUM = ("your parts sum to {total:.5g} but the model's logit is {logit:.5g} in {what}: the parts of the "
                   "frozen read-out add up to the logit exactly (to float rounding)")
HINT_LA_DIFFERS = "your part {key!r} is {got:.5g}, the reference's {want:.5g}, in {what}"

LA_MISTAKES = {"own-norm": HINT_LA_OWN_NORM, "own-scale": HINT_LA_OWN_SCALE, "no-centre": HINT_LA_NO_CENTRE,
               "std": HINT_LA_STD, "std-eps": HINT_LA_STD, "no-scale": HINT_LA_NO_SCALE, "no-weight": HINT_LA_NO_WEIGHT,
               "bias-everywhere": HINT_LA_BIAS_EVERYWHERE,
               "wo-rows": HINT_LA_WO_ROWS, "wo-order": HINT_LA_WO_ORDER, "resid-post": HINT_LA_RESID}


def _attribution_variant(model: GPT, ids: torch.Tensor, pos: int, token: int,
                         mistake: str | None = None) -> dict[str, float] | None:
    """The logit of ``token`` at ``pos`` (row 0 of ``ids``) split into its parts, right or with one known mistake;
    None when the mistake does not apply to this model."""
    from tfedu.layers import LayerNorm

    norm, n_layers = model.ln_final, len(model.blocks)
    is_layer_norm = isinstance(norm, LayerNorm)
    if (mistake == "no-centre" and not is_layer_norm or mistake == "resid-post" and not model.cfg.has_mlp
            or mistake == "bias-everywhere" and getattr(norm, "bias", None) is None):
        return None
    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
        at = (0, pos)
        u = model.unembed.weight[token]  # d_model: the token's column of W_U
        centre = is_layer_norm and mistake != "no-centre"

        def scale_of(x: torch.Tensor) -> torch.Tensor:
            x = x - x.mean() if is_layer_norm else x
            return torch.sqrt(x.pow(2).mean() + norm.eps)

        final = cache[f"blocks.{n_layers - 1}.hook_resid_post"][at]
        final_scale = scale_of(final)
        if mistake == "std":  # torch's std: centred, Bessel's correction (d_model - 1), no eps
            final_scale = final.std()
        elif mistake == "std-eps":
            final_scale = torch.sqrt(final.var() + norm.eps)
        bias = norm.bias @ u if getattr(norm, "bias", None) is not None else None

        def read(x: torch.Tensor) -> torch.Tensor:
            if mistake == "own-norm":
                return norm(x) @ u
            x = x - x.mean() if centre else x
            scale = scale_of(x) if mistake == "own-scale" else 1.0 if mistake == "no-scale" else final_scale
            weight = 1.0 if mistake == "no-weight" else norm.weight
            value = (x / scale * weight) @ u
            return value + bias if mistake == "bias-everywhere" else value

        parts = {"embed": read(cache["hook_embed"][at])}
        if model.pos_embed is not None:
            parts["pos_embed"] = read(cache["hook_pos_embed"][pos])
        for i, block in enumerate(model.blocks):
            attn = block.attn
            z = cache[f"blocks.{i}.attn.hook_z"][at]  # n_heads d_head
            w_o = attn.W_O.weight  # d_model, n_heads * d_head
            if mistake == "wo-rows":
                per_head = w_o.unflatten(0, (attn.n_heads, attn.d_head))  # rows, not columns
            elif mistake == "wo-order":
                per_head = w_o.T.unflatten(0, (attn.d_head, attn.n_heads)).transpose(0, 1)
            else:
                per_head = w_o.T.unflatten(0, (attn.n_heads, attn.d_head))  # n_heads d_head d_model
            for h in range(attn.n_heads):
                parts[f"L{i}H{h}"] = read(z[h] @ per_head[h])
            if attn.W_O.bias is not None:
                parts[f"L{i} attn bias"] = read(attn.W_O.bias)
            if model.cfg.has_mlp:
                name = "hook_resid_post" if mistake == "resid-post" else "hook_mlp_out"
                parts[f"L{i} MLP"] = read(cache[f"blocks.{i}.{name}"][at])
        if bias is not None:
            parts["ln_final bias"] = bias
    return {label: float(value) for label, value in parts.items()}


def reference_logit_attribution(model: GPT, ids: torch.Tensor, pos: int, token: int) -> dict[str, float]:
    """The exercise's answer: label -> float, summing to ``model(ids)[0, pos, token]`` to float rounding."""
    return _attribution_variant(model, ids, pos, token)


def attribution_model(seed: int, *, norm: str = "layer", positional: str = "learned", d_mlp: int | None = None,
                      bias: bool = True) -> GPT:
    """A small pre-norm GPT with random norm scales and biases (see ``lens_model``), MLPs or not."""
    cfg = ModelConfig(d_vocab=45, n_ctx=32, d_model=32, n_layers=2, n_heads=4, init_std=0.5, tied_embeddings=False,
                      positional=positional, norm=norm, bias=bias, **({} if d_mlp is None else {"d_mlp": d_mlp}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg).eval()
        _scramble_norms(model, torch.Generator().manual_seed(seed))
    return model


def _attribution_problem(got: Any, model: GPT, ids: torch.Tensor, pos: int, token: int, what: str) -> str | None:
    want = reference_logit_attribution(model, ids, pos, token)
    if not isinstance(got, dict):
        return HINT_LA_TYPE.format(got=describe(got))
    parts = {}
    for key, value in got.items():
        try:
            parts[str(key)] = float(value)
        except (TypeError, ValueError, RuntimeError):
            return HINT_LA_VALUE.format(key=key, got=describe(value))
    if set(parts) != set(want):
        missing, extra = sorted(set(want) - set(parts)), sorted(set(parts) - set(want))
        detail = "; ".join([f"missing {missing}"] * bool(missing) + [f"not parts {extra}"] * bool(extra))
        return HINT_LA_KEYS.format(model=what, detail=detail)
    close = lambda a, b: all(abs(a[k] - b[k]) <= 1e-4 + 1e-4 * abs(b[k]) for k in b)
    if close(parts, want):
        return None
    for mistake, hint in LA_MISTAKES.items():
        wrong = _attribution_variant(model, ids, pos, token, mistake)
        if wrong is not None and set(wrong) == set(want) and close(parts, wrong) and not close(wrong, want):
            if hint is HINT_LA_STD:
                from tfedu.layers import LayerNorm

                layer_norm = isinstance(model.ln_final, LayerNorm)
                return hint.format(detail=LA_STD_LAYER if layer_norm else LA_STD_RMS, what=LA_STD_WHAT[layer_norm])
            return hint
    with torch.no_grad():
        logit = float(model(ids)[0, pos, token])
    total = sum(parts.values())
    if abs(total - logit) > 1e-3 * max(1.0, abs(logit)):
        return HINT_LA_NOT_SUM.format(total=total, logit=logit, what=what)
    key = max(want, key=lambda k: abs(parts[k] - want[k]))
    return HINT_LA_DIFFERS.format(key=key, got=parts[key], want=want[key], what=what)


LA_CASES = (  # (seed, norm, positional, d_mlp, bias, n_pos, pos)
    (0, "layer", "learned", None, True, 9, 6),
    (1, "rms", "rope", None, False, 7, 3),
    (2, "layer", "rope", 0, True, 8, 7),  # attention only, like the induction GPT
)


@checker("direct logit attribution: one logit split into what each part wrote")
def check_logit_attribution(logit_attribution) -> None:
    """Check ``logit_attribution(model, ids, pos, token)`` on small random pre-norm GPTs (LayerNorm with biases and
    learned positions, RMSNorm with RoPE and no biases, attention only): every part to 1e-4, the parts adding up to
    the logit. Named: see the module docstring."""
    _refuse_shortcuts(logit_attribution, LA_FORBIDDEN, HINT_LA_SHORTCUT)
    for seed, norm, positional, d_mlp, bias, n_pos, pos in LA_CASES:
        model = attribution_model(seed, norm=norm, positional=positional, d_mlp=d_mlp, bias=bias)
        ids = torch.randint(0, model.cfg.d_vocab, (1, n_pos), generator=torch.Generator().manual_seed(seed))
        token = int(torch.randint(0, model.cfg.d_vocab, (), generator=torch.Generator().manual_seed(seed + 10)))
        what = (f"logit_attribution(model, ids, pos={pos}, token={token}) on a 2-block GPT "
                f"({'LayerNorm' if norm == 'layer' else 'RMSNorm'}, {positional} positions, "
                f"{'attention only' if d_mlp == 0 else 'with MLPs'}, {'with' if bias else 'no'} biases)")
        got = call_learner(logit_attribution, model, ids.clone(), pos, token, name="logit_attribution",
                           error_hint=HINT_LA_CALL)
        if _hooks_left(model):
            raise CheckFailure("a hook was still attached to the model after logit_attribution returned: remove it")
        problem = _attribution_problem(got, model, ids, pos, token, what)
        if problem:
            raise CheckFailure(problem)


LA_PROBE_RUN = HELPERS + GPT_FROM_INPUTS + """\
try:
    _r = _call(logit_attribution, _model, torch.from_numpy(inputs['ids']), inputs['pos'], inputs['token'])
    _error = None
except Exception as _e:
    _r, _error = None, type(_e).__name__ + ': ' + str(_e)[:200]
_parts = None
if isinstance(_r, dict):
    _parts = {}
    for _k, _v in _r.items():
        try:
            _parts[str(_k)] = float(_v)
        except Exception:
            _parts[str(_k)] = 'not a number: ' + type(_v).__name__
outputs = {'returned': _kind(_r), 'parts': _parts, 'error': _error,
           'left': any(_m._forward_hooks or _m._forward_pre_hooks for _m in _model.modules()), 'mutated': _MUTATED}
del _r, _error, _parts
""" + GPT_CLEANUP + CLEANUP


def _la_probe_inputs(rng: np.random.Generator) -> dict:
    """A fresh small pre-norm GPT (random norm, positions, biases, MLPs or not, norm scales), one sequence, a
    position and a token."""
    config = {"d_vocab": int(rng.integers(30, 70)), "n_ctx": 32, "d_model": 32, "n_layers": int(rng.integers(1, 4)),
              "n_heads": 4, "init_std": 0.5, "tied_embeddings": bool(rng.integers(0, 2)),
              "positional": str(rng.choice(["rope", "learned"])), "norm": str(rng.choice(["layer", "rms"])),
              "bias": bool(rng.integers(0, 2))}
    if rng.integers(0, 3) == 0:
        config["d_mlp"] = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(rng.integers(0, 2**31)))
        model = GPT(ModelConfig(**config))
    _scramble_norms(model, torch.Generator().manual_seed(int(rng.integers(0, 2**31))))
    n_pos = int(rng.integers(4, 16))
    return {"config": config, "weights": {name: value.numpy() for name, value in model.state_dict().items()},
            "ids": rng.integers(0, config["d_vocab"], (1, n_pos)).astype(np.int64),
            "pos": int(rng.integers(0, n_pos)), "token": int(rng.integers(0, config["d_vocab"]))}


def _compare_la(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict):
        return "the hidden test's outputs should be a dict"
    if outputs.get("error"):
        return f"logit_attribution raised {outputs['error']} ({HINT_LA_CALL})"
    if outputs.get("left"):
        return "a hook was still attached to the model after logit_attribution returned: remove it"
    inputs = expected["inputs"]
    got = outputs.get("parts")
    if got is None:
        return HINT_LA_TYPE.format(got=outputs.get("returned"))
    for key, value in got.items():
        if isinstance(value, str):
            return HINT_LA_VALUE.format(key=key, got=value.removeprefix("not a number: "))
    return _attribution_problem(got, gpt_from_inputs(inputs), torch.from_numpy(inputs["ids"]), inputs["pos"],
                                inputs["token"], "the hidden test")


# ----------------------------------------------------------------------------- 15.3 patch_head

HINT_PT_ALL_HEADS = (
    "every head of block {layer} was patched: the hook's tensor holds all of the block's heads side by side, (batch, "
    "pos, n_heads, d_head); give only head {head} its clean values and keep the corrupted run's for the others"
)
HINT_PT_REVERSED = (
    "the patch went the wrong way: you ran the clean input and gave head {head} its output from the corrupted run. "
    "Activation patching runs the corrupted input and gives one head its clean output, to measure how much of the "
    "clean behaviour that head alone brings back"
)
HINT_PT_NO_PATCH = (
    "your logits are the corrupted run's, unpatched: either no hook was attached while the corrupted input ran "
    "(attach it, then run the model on the corrupted input while it is attached), or the hook changed a copy and "
    "returned None (a hook that returns None leaves the activation as it was; return the patched tensor)"
)
HINT_PT_CLEAN = (
    "your logits are the clean run's: either the corrupted input never ran with the patch, or the patch replaced "
    "everything the later blocks read (the whole residual stream at every position), not one head's output"
)
HINT_PT_POSITION = (
    "you replaced position {head} rather than head {head}: the hook's tensor is (batch, pos, n_heads, d_head), so a "
    "head is picked on the third axis, at every position"
)
HINT_PT_LAST = (
    "only the last position was patched: replace the head's output at every position, since each later position "
    "reads the earlier ones"
)
HINT_PT_LEAK = (
    "a hook was still attached to the model after patch_head returned, so every later run of the model stays "
    "patched: attach it for one run only (model.hooks is a context manager) or remove its handle before returning"
)
HINT_PT_SHAPE = "patch_head should return the corrupted run's logits, a float tensor {want}, got {got}"
HINT_PT_CALL = (
    "patch_head(model, clean_ids, corrupted_ids, layer, head): two (batch, pos) tensors of token ids of the same "
    "shape, a block index and a head index; the hook point is named blocks.<layer>.attn.hook_z (in model.hooks, "
    "write the dots as __)"
)
HINT_PT_DIFFERS = "your patched logits differ from the reference in {what}: largest difference {err:.3g}"

PT_MISTAKES = {"all-heads": HINT_PT_ALL_HEADS, "reversed": HINT_PT_REVERSED, "no-patch": HINT_PT_NO_PATCH,
               "clean": HINT_PT_CLEAN, "position-axis": HINT_PT_POSITION, "last-position": HINT_PT_LAST}


def _patch_variant(model: GPT, clean_ids: torch.Tensor, corrupted_ids: torch.Tensor, layer: int, head: int,
                   mistake: str | None = None) -> torch.Tensor:
    """The corrupted run with head ``head`` of block ``layer`` given its clean output, right or with one known mistake."""
    source, target = (corrupted_ids, clean_ids) if mistake == "reversed" else (clean_ids, corrupted_ids)
    name = f"blocks.{layer}.attn.hook_z"
    with torch.no_grad():
        if mistake in ("no-patch", "clean"):
            return model(clean_ids if mistake == "clean" else corrupted_ids)
        _, cache = model.run_with_cache(source)
        saved = cache[name]

        def patch(z: torch.Tensor) -> torch.Tensor:
            if mistake == "all-heads":
                return saved
            z = z.clone()
            if mistake == "position-axis":
                z[:, head] = saved[:, head]
            elif mistake == "last-position":
                z[:, -1, head] = saved[:, -1, head]
            else:
                z[:, :, head] = saved[:, :, head]
            return z

        with model.hooks(**{name.replace(".", "__"): patch}):
            return model(target)


def reference_patch_head(model: GPT, clean_ids: torch.Tensor, corrupted_ids: torch.Tensor, layer: int,
                         head: int) -> torch.Tensor:
    """The exercise's answer."""
    return _patch_variant(model, clean_ids, corrupted_ids, layer, head)


def patch_model(seed: int, *, d_vocab: int = 40, positional: str = "rope") -> GPT:
    """A small GPT (3 blocks of 4 heads) with large random weights, so that every head matters to the logits."""
    cfg = ModelConfig(d_vocab=d_vocab, n_ctx=32, d_model=32, n_layers=3, n_heads=4, init_std=0.5,
                      tied_embeddings=False, positional=positional)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg).eval()


def patch_inputs(seed: int, batch: int, pos: int, d_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean ids, and corrupted ids that differ from them in their first half only."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, d_vocab, (batch, pos), generator=g)
    corrupted = clean.clone()
    corrupted[:, : pos // 2] = torch.randint(0, d_vocab, (batch, pos // 2), generator=g)
    return clean, corrupted


def _hooks_left(model: torch.nn.Module) -> bool:
    return any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


def _patch_problem(got: Any, model: GPT, clean: torch.Tensor, corrupted: torch.Tensor, layer: int, head: int,
                   what: str) -> str | None:
    """What is wrong with ``got`` as the patched logits, or None."""
    want = reference_patch_head(model, clean, corrupted, layer, head)
    if not (isinstance(got, torch.Tensor) and got.is_floating_point() and got.shape == want.shape):
        return HINT_PT_SHAPE.format(want=tuple(want.shape), got=describe(got))
    got = got.detach().float()
    if torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        return None
    for mistake, hint in PT_MISTAKES.items():
        wrong = _patch_variant(model, clean, corrupted, layer, head, mistake)
        if torch.allclose(got, wrong, rtol=1e-4, atol=1e-4) and not torch.allclose(wrong, want, rtol=1e-4, atol=1e-4):
            return hint.format(layer=layer, head=head)
    return HINT_PT_DIFFERS.format(what=what, err=float((got - want).abs().max()))


@checker("activation patching: one head's clean output in the corrupted run")
def check_patch_head(patch_head) -> None:
    """Check ``patch_head(model, clean_ids, corrupted_ids, layer, head)`` on a small random GPT: the logits of the
    corrupted run with one head's hook_z output from the clean run, for two (layer, head) pairs and two position
    encodings, and no hook left on the model afterwards. Named: see the module docstring."""
    for seed, (layer, head), positional in ((0, (1, 2), "rope"), (1, (0, 3), "learned")):
        model = patch_model(seed, positional=positional)
        clean, corrupted = patch_inputs(seed, batch=2, pos=12, d_vocab=model.cfg.d_vocab)
        what = (f"patch_head(model, clean_ids, corrupted_ids, layer={layer}, head={head}) on a 3-block GPT of 4 "
                f"heads with ids of shape {tuple(clean.shape)}")
        got = call_learner(patch_head, model, clean.clone(), corrupted.clone(), layer, head, name="patch_head",
                           error_hint=HINT_PT_CALL)
        if _hooks_left(model):
            raise CheckFailure(HINT_PT_LEAK)
        problem = _patch_problem(got, model, clean, corrupted, layer, head, what)
        if problem:
            raise CheckFailure(problem)


PT_PROBE_RUN = HELPERS + GPT_FROM_INPUTS + """\
try:
    _r = _call(patch_head, _model, torch.from_numpy(inputs['clean']), torch.from_numpy(inputs['corrupted']),
               inputs['layer'], inputs['head'])
    _error = None
except Exception as _e:
    _r, _error = None, type(_e).__name__ + ': ' + str(_e)[:200]
_left = any(_m._forward_hooks or _m._forward_pre_hooks for _m in _model.modules())
outputs = {'returned': [_kind(_r)], 'logits': _array(_r), 'error': _error, 'left': _left, 'mutated': _MUTATED}
del _r, _error, _left
""" + GPT_CLEANUP + CLEANUP


def _pt_probe_inputs(rng: np.random.Generator) -> dict:
    """A fresh small GPT, clean and corrupted ids, and a (layer, head) whose mistakes all differ from the answer."""
    while True:
        config = {"d_vocab": int(rng.integers(30, 70)), "n_ctx": 32, "d_model": 32, "n_layers": 3, "n_heads": 4,
                  "init_std": 0.5, "tied_embeddings": False, "positional": str(rng.choice(["rope", "learned"]))}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(rng.integers(0, 2**31)))
            weights = {name: value.numpy() for name, value in GPT(ModelConfig(**config)).state_dict().items()}
        clean, corrupted = patch_inputs(int(rng.integers(0, 2**31)), int(rng.integers(1, 4)), int(rng.integers(8, 17)),
                                        config["d_vocab"])
        inputs = {"config": config, "weights": weights, "clean": clean.numpy(), "corrupted": corrupted.numpy(),
                  "layer": int(rng.integers(0, 2)), "head": int(rng.integers(0, 4))}  # not the last block
        model = gpt_from_inputs(inputs)
        want = reference_patch_head(model, clean, corrupted, inputs["layer"], inputs["head"])
        variants = [_patch_variant(model, clean, corrupted, inputs["layer"], inputs["head"], m) for m in PT_MISTAKES]
        if all(not torch.allclose(a, b, rtol=1e-4, atol=1e-4) for i, a in enumerate([want, *variants])
               for b in variants[i:]):  # every mistake apart from the answer and from each other
            return inputs


def _pt_probe_reference(inputs: dict) -> dict:
    return {"returned": ["tensor"], "inputs": inputs}


def _compare_pt(outputs: dict, expected: dict) -> str | None:
    if not isinstance(outputs, dict):
        return "the hidden test's outputs should be a dict"
    if outputs.get("error"):
        return f"patch_head raised {outputs['error']} ({HINT_PT_CALL})"
    if outputs.get("left"):
        return HINT_PT_LEAK
    inputs = expected["inputs"]
    model = gpt_from_inputs(inputs)
    got = outputs.get("logits")
    got = torch.from_numpy(got) if isinstance(got, np.ndarray) and got.dtype.kind == "f" else got
    clean, corrupted = torch.from_numpy(inputs["clean"]), torch.from_numpy(inputs["corrupted"])
    return _patch_problem(got, model, clean, corrupted, inputs["layer"], inputs["head"], "the hidden test")


# ----------------------------------------------------------------------------- 15.4 logit_lens

LL_FORBIDDEN = ("tfedu.interp",)
HINT_LL_SHORTCUT = ("your logit_lens uses {name}: reading the stream after every block is the exercise, so build it "
                    "from the model's hook points, its ln_final and its unembed")
HINT_LL_CALL = (
    "logit_lens(model, ids): a pre-norm GPT and a (batch, pos) tensor of token ids; the residual stream sits at the "
    "hook points blocks.0.hook_resid_pre (after the embeddings) and blocks.<i>.hook_resid_post (after block i)"
)
HINT_LL_SHAPE = ("logit_lens should return a float tensor (n_layers + 1, batch, pos, d_vocab) = {want}: one row of "
                 "logits for the embeddings and one after each block, got {got}")
HINT_LL_NO_NORM = (
    "your rows skip the final norm: the model reads its last residual stream through ln_final and then the "
    "unembedding, so the lens applies the same two, in that order, to every row (without the norm the last row is "
    "not even the model's own logits)"
)
HINT_LL_NO_EMBED = (
    "you returned n_layers rows, the stream after each block only: the first row reads the stream after the "
    "embeddings (blocks.0.hook_resid_pre), before any block has written to it"
)
HINT_LL_RESID_PRE = (
    "you read each block's input (hook_resid_pre) where the lens reads its output: the row after block i is "
    "blocks.<i>.hook_resid_post. With the inputs the embeddings come twice (block 0's input is the embeddings) and "
    "the last block's output, the one the model itself reads, is missing"
)
HINT_LL_TWICE = (
    "your last row went through the final norm twice (read after ln_final, then normed again): read the last block's "
    "output at its hook_resid_post, before ln_final, like every other row"
)
HINT_LL_EXTRA_ROW = (
    "you returned n_layers + 2 rows, the model's own logits added after the n_layers + 1 read-outs: the read-out of "
    "the last block's output already is the model's output, so it is the last row, once"
)
HINT_LL_BATCH_FIRST = (
    "the layers are stacked on the wrong axis: you returned (batch, layer, pos, d_vocab); the layer axis comes "
    "first, (n_layers + 1, batch, pos, d_vocab), so that lens[-1] is the model's output"
)
HINT_LL_SOFTMAX = ("you returned probabilities (a softmax over d_vocab), not logits: the lens's rows are logits, "
                   "like the model's output, and its last row equals the model's logits")
HINT_LL_LEAK = (
    "a hook was still attached to the model after logit_lens returned, so every later run of the model calls it: "
    "remove each handle before returning (in a finally block), or use a context manager that does"
)
HINT_LL_NOT_EXACT = (
    "your last row is within {err:.3g} of the model's logits but not equal to them bit for bit: run the last block's "
    "output through the model's own ln_final and unembed modules, as the forward pass does, and not a matrix "
    "product of your own"
)
HINT_LL_DIFFERS = "your lens differs from the reference in {what}, row {row} ({row_name}): largest difference {err:.3g}"

LL_MISTAKES = {"no-norm": HINT_LL_NO_NORM, "no-embed": HINT_LL_NO_EMBED, "resid-pre": HINT_LL_RESID_PRE,
               "twice": HINT_LL_TWICE, "extra-row": HINT_LL_EXTRA_ROW, "batch-first": HINT_LL_BATCH_FIRST,
               "softmax": HINT_LL_SOFTMAX}


def _lens_variant(model: GPT, ids: torch.Tensor, mistake: str | None = None) -> torch.Tensor:
    """The logit lens of ``model`` on ``ids``, right or with one known mistake (``LL_MISTAKES``)."""
    n_layers = len(model.blocks)
    with torch.no_grad():
        logits, cache = model.run_with_cache(ids)
        after = [f"blocks.{i}.hook_resid_post" for i in range(n_layers)]
        if mistake == "resid-pre":
            after = [f"blocks.{i}.hook_resid_pre" for i in range(n_layers)]
        names = after if mistake == "no-embed" else ["blocks.0.hook_resid_pre", *after]
        rows = []
        for i, name in enumerate(names):
            resid = cache[name]  # batch pos d_model
            normed = resid if mistake == "no-norm" else model.ln_final(resid)
            if mistake == "twice" and i == len(names) - 1:
                normed = model.ln_final(normed)
            rows.append(model.unembed(normed))  # batch pos d_vocab
        if mistake == "extra-row":
            rows.append(logits)
        lens = torch.stack(rows, dim=1 if mistake == "batch-first" else 0)
        return lens.softmax(dim=-1) if mistake == "softmax" else lens


def reference_logit_lens(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """The exercise's answer: ``(n_layers + 1, batch, pos, d_vocab)``, its last row the model's logits bit for bit."""
    return _lens_variant(model, ids)


def lens_model(seed: int, *, n_layers: int = 3, norm: str = "layer", positional: str = "rope", tied: bool = False,
               d_vocab: int = 45) -> GPT:
    """A small pre-norm GPT with large random weights and random norm scales (and biases), so that reading the stream
    without the final norm, or through it twice, gives other logits."""
    cfg = ModelConfig(d_vocab=d_vocab, n_ctx=32, d_model=32, n_layers=n_layers, n_heads=4, init_std=0.5,
                      tied_embeddings=tied, positional=positional, norm=norm)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg).eval()
        _scramble_norms(model, torch.Generator().manual_seed(seed))
    return model


def _scramble_norms(model: GPT, g: torch.Generator) -> None:
    """Random norm weights around 1 and biases around 0 (at initialisation they are exactly 1 and 0, and a norm
    applied twice would then be almost the norm applied once)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 2)[-2].startswith("ln"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.5 + (1.5 if name.endswith("weight") else 0.0))


def _lens_problem(got: Any, model: GPT, ids: torch.Tensor, what: str, *, exact: bool | None = None) -> str | None:
    """What is wrong with ``got`` as the logit lens of ``model`` on ``ids``, or None. ``exact``: whether the learner's
    last row equals the model's logits bit for bit, when known (computed here when None)."""
    want = reference_logit_lens(model, ids)
    n_layers = want.shape[0] - 1
    if not (isinstance(got, torch.Tensor) and got.is_floating_point()):
        return HINT_LL_SHAPE.format(want=tuple(want.shape), got=describe(got))
    got = got.detach()
    close = lambda a, b: a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-4)
    if close(got, want):
        if exact is None:
            with torch.no_grad():
                exact = torch.equal(got[-1], model(ids))
        if not exact:
            return HINT_LL_NOT_EXACT.format(err=float((got[-1].float() - want[-1]).abs().max()))
        return None
    if got.dim() == 4 and close(got.transpose(0, 1), want):
        return HINT_LL_BATCH_FIRST
    if close(got, want[1:]):
        return HINT_LL_NO_EMBED
    if close(got, want[:-1]):
        return HINT_LL_RESID_PRE  # n_layers rows of block inputs: the same mistake, without the first row
    for mistake, hint in LL_MISTAKES.items():
        wrong = _lens_variant(model, ids, mistake)
        if close(got, wrong) and not close(wrong, want):
            return hint
    if got.shape != want.shape:
        return HINT_LL_SHAPE.format(want=tuple(want.shape), got=describe(got))
    err = (got.float() - want).abs().flatten(1).max(dim=1).values  # per row
    row = int(err.argmax())
    row_name = "the embeddings" if row == 0 else f"after block {row - 1}"
    return HINT_LL_DIFFERS.format(what=what, row=row, row_name=row_name, err=float(err[row]))


LENS_CASES = (  # (seed, n_layers, norm, positional, tied, batch, pos)
    (0, 3, "layer", "rope", False, 2, 9),
    (1, 2, "rms", "learned", True, 3, 7),  # batch = n_layers + 1: the batch-first mistake keeps the shape
)


@checker("the logit lens: the final read-out after every block")
def check_logit_lens(logit_lens) -> None:
    """Check ``logit_lens(model, ids)`` on small random pre-norm GPTs (LayerNorm and RMSNorm, RoPE and learned
    positions, tied and untied unembedding): ``(n_layers + 1, batch, pos, d_vocab)`` to 1e-4, its last row the
    model's logits bit for bit, and no hook left on the model. Named: see the module docstring."""
    _refuse_shortcuts(logit_lens, LL_FORBIDDEN, HINT_LL_SHORTCUT)
    for seed, n_layers, norm, positional, tied, batch, pos in LENS_CASES:
        model = lens_model(seed, n_layers=n_layers, norm=norm, positional=positional, tied=tied)
        ids = torch.randint(0, model.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))
        what = (f"logit_lens(model, ids) on a {n_layers}-block GPT ({'RMSNorm' if norm == 'rms' else 'LayerNorm'}) "
                f"with ids of shape {tuple(ids.shape)}")
        got = call_learner(logit_lens, model, ids.clone(), name="logit_lens", error_hint=HINT_LL_CALL)
        if _hooks_left(model):
            raise CheckFailure(HINT_LL_LEAK)
        problem = _lens_problem(got, model, ids, what)
        if problem:
            raise CheckFailure(problem)


LL_PROBE_RUN = HELPERS + GPT_FROM_INPUTS + """\
_ids = torch.from_numpy(inputs['ids'])
try:
    _r = _call(logit_lens, _model, _ids.clone())
    _error = None
except Exception as _e:
    _r, _error = None, type(_e).__name__ + ': ' + str(_e)[:200]
_left = any(_m._forward_hooks or _m._forward_pre_hooks for _m in _model.modules())
with torch.no_grad():
    _exact = (isinstance(_r, torch.Tensor) and _r.dim() == 4 and _r.shape[1:] == (_ids.shape[0], _ids.shape[1], _model.cfg.d_vocab)
              and bool(torch.equal(_r[-1].detach(), _model(_ids))))
outputs = {'returned': [_kind(_r)], 'lens': _array(_r), 'error': _error, 'left': _left, 'exact': _exact,
           'mutated': _MUTATED}
del _ids, _r, _error, _left, _exact
""" + GPT_CLEANUP + CLEANUP


def _ll_probe_inputs(rng: np.random.Generator) -> dict:
    """A fresh small pre-norm GPT (random norm, positions, tying and norm scales) and ids."""
    config = {"d_vocab": int(rng.integers(30, 70)), "n_ctx": 32, "d_model": 32, "n_layers": int(rng.integers(2, 5)),
              "n_heads": 4, "init_std": 0.5, "tied_embeddings": bool(rng.integers(0, 2)),
              "positional": str(rng.choice(["rope", "learned"])), "norm": str(rng.choice(["layer", "rms"]))}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(rng.integers(0, 2**31)))
        model = GPT(ModelConfig(**config))
    _scramble_norms(model, torch.Generator().manual_seed(int(rng.integers(0, 2**31))))
    ids = rng.integers(0, config["d_vocab"], (int(rng.integers(1, 5)), int(rng.integers(5, 17))))
    return {"config": config, "weights": {name: value.numpy() for name, value in model.state_dict().items()},
            "ids": ids.astype(np.int64)}


def _compare_ll(outputs: dict, expected: dict) -> str | None:
    if not isinstance(outputs, dict):
        return "the hidden test's outputs should be a dict"
    if outputs.get("error"):
        return f"logit_lens raised {outputs['error']} ({HINT_LL_CALL})"
    if outputs.get("left"):
        return HINT_LL_LEAK
    inputs = expected["inputs"]
    got = outputs.get("lens")
    got = torch.from_numpy(got) if isinstance(got, np.ndarray) and got.dtype.kind == "f" else got
    if not isinstance(got, torch.Tensor):
        n_layers, (batch, pos) = inputs["config"]["n_layers"], inputs["ids"].shape
        return HINT_LL_SHAPE.format(want=(n_layers + 1, batch, pos, inputs["config"]["d_vocab"]),
                                    got=(outputs.get("returned") or ["nothing"])[0])
    return _lens_problem(got, gpt_from_inputs(inputs), torch.from_numpy(inputs["ids"]), "the hidden test",
                         exact=bool(outputs.get("exact")))


# ----------------------------------------------------------------------------- probe (hidden test)

PROBE_RUN = HELPERS + """\
_fn = globals().get('constrained_probs')
_results, _dtypes = [], []
for _c in inputs['cases']:
    if _fn is None:
        _results.append('undefined')
        _dtypes.append(None)
        continue
    _r = _call(_fn, torch.from_numpy(_c['logits']), torch.from_numpy(_c['allowed']))
    _results.append(_r.detach().cpu().double().numpy() if isinstance(_r, torch.Tensor) and _r.is_floating_point()
                    else _kind(_r) if _r is not None else 'NoneType')
    _dtypes.append(str(_r.dtype).removeprefix('torch.') if isinstance(_r, torch.Tensor) else None)
outputs = {'results': _results, 'dtypes': _dtypes, 'mutated': _MUTATED}
del _fn, _results, _dtypes, _c
""" + CLEANUP


def _probe_inputs(rng: np.random.Generator) -> dict:
    out = []
    for i in range(4):
        shape = (int(rng.integers(1, 5)), int(rng.integers(5, 40))) if i < 3 else (int(rng.integers(3, 30)),)
        logits, allowed = random_case(int(rng.integers(0, 2**31)), shape,
                                      dtype=torch.float64 if i == 2 else torch.float32)
        out.append({"logits": logits.numpy(), "allowed": allowed.numpy()})
    logits, allowed = underflow_case(int(rng.integers(0, 2**31)), rows=int(rng.integers(2, 5)),
                                     d_vocab=int(rng.integers(6, 30)))
    out.insert(int(rng.integers(0, 4)), {"logits": logits.numpy(), "allowed": allowed.numpy()})
    logits, allowed = confident_case(int(rng.integers(0, 2**31)), rows=int(rng.integers(2, 5)),
                                     d_vocab=int(rng.integers(6, 30)))
    logits = logits + float(rng.uniform(0.0, 200.0))  # up to 300: overflow whatever the exact offset
    out.insert(int(rng.integers(0, 5)), {"logits": logits.numpy(), "allowed": allowed.numpy()})
    return {"cases": out}


def _compare(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list):
        return "the hidden test's outputs should be a dict with the results"
    if outputs.get("mutated"):
        return HINT_IN_PLACE
    cases_ = expected["cases"]
    if len(outputs["results"]) != len(cases_):
        return "constrained_probs's hidden test did not run every case"
    for i, (got, case) in enumerate(zip(outputs["results"], cases_)):
        if isinstance(got, str) and got == "undefined":
            return "constrained_probs is not defined: run the exercise's cell"
        logits, allowed = torch.from_numpy(np.array(case["logits"])), torch.from_numpy(np.array(case["allowed"]))
        what = f"hidden test {i + 1} (logits of shape {tuple(logits.shape)})"
        if isinstance(got, str):
            return HINT_NONE if got == "NoneType" else HINT_TYPE.format(got=got)
        try:
            dtypes = outputs.get("dtypes")
            dtype = dtypes[i] if isinstance(dtypes, list) and i < len(dtypes) else None
            dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
            dtype = dtype if isinstance(dtype, torch.dtype) else logits.dtype  # unknown: the values decide
            diagnose(torch.from_numpy(np.array(got)), logits, allowed, what=what, dtype=dtype)
            if not bool((torch.from_numpy(np.array(got)).masked_select(~allowed) == 0).all()):
                return HINT_FORBIDDEN_MASS.format(mass=float(np.abs(np.where(case["allowed"], 0, got)).max()), what=what)
        except CheckFailure as failure:
            return str(failure)
    return None


# ----------------------------------------------------------------------------- 15.7 utf8_prefix_ok

U8_NAME = "utf8_prefix_ok"
U8_FORBIDDEN = ("tfedu.constrained", "codecs", "encodings")
HINT_U8_CALL = "utf8_prefix_ok(data): data is a bytes object (each item an int 0..255); return True or False"
HINT_U8_SHORTCUT = ("your utf8_prefix_ok uses {name}: reading UTF-8 byte by byte is the exercise, so build it from the "
                    "table, without tfedu.constrained or Python's codecs")
HINT_U8_DECODER = (
    "your utf8_prefix_ok uses {what}, Python's own UTF-8 decoder: deciding which bytes are UTF-8 is what this "
    "exercise builds (the check compares with the table, and the decoder even lags there: it accepts ED A0, the "
    "first two bytes of a surrogate, until a third byte comes). Walk the bytes yourself"
)
HINT_U8_NONE = "your utf8_prefix_ok returned None on the bytes {data}: this exercise is not done yet, or the function has no `return`"
HINT_U8_KIND = "utf8_prefix_ok should return True or False, got {got} on the bytes {data}"
HINT_U8_OVERLONG = (
    "utf8_prefix_ok({literal}) returned True, but {lead} followed by {byte} can only become an overlong form: {why}, "
    "and a code point has exactly one encoding, the shortest. After E0 the second byte must be A0..BF; after F0, 90..BF"
)
OVERLONG_WHY = {0xE0: "E0 80..9F xx would spell U+0000..U+07FF in three bytes, which one or two bytes already spell",
                0xF0: "F0 80..8F xx xx would spell U+0000..U+FFFF in four bytes, which three or fewer already spell"}
HINT_U8_SURROGATE = (
    "utf8_prefix_ok({literal}) returned True, but ED followed by {byte} (A0..BF) can only become U+D800..U+DFFF, the "
    "surrogates: they are not characters (UTF-16 uses them in pairs) and UTF-8 has no form for them. After ED the "
    "second byte must be 80..9F"
)
HINT_U8_ABOVE = (
    "utf8_prefix_ok({literal}) returned True, but F4 followed by {byte} (90..BF) can only become a code point above "
    "U+10FFFF, the last one Unicode has. After F4 the second byte must be 80..8F"
)
HINT_U8_C0C1 = (
    "utf8_prefix_ok({literal}) returned True, but {byte} never occurs in UTF-8: C0 and C1 could only start overlong "
    "two-byte forms of U+0000..U+007F, which one byte spells. Two-byte sequences start with C2..DF"
)
HINT_U8_F5FF = (
    "utf8_prefix_ok({literal}) returned True, but {byte} never occurs in UTF-8: F5..F7 would start code points above "
    "U+10FFFF, and F8..FF start nothing at all (the five- and six-byte forms were dropped in 2003). Four-byte "
    "sequences start with F0..F4"
)
HINT_U8_STRAY = (
    "utf8_prefix_ok({literal}) returned True, but byte {pos} ({byte}) is a continuation byte (80..BF, 10xxxxxx) "
    "with no character to continue: {where}. A continuation byte is valid only where its lead byte still needs one"
)
HINT_U8_LENGTH = (
    "utf8_prefix_ok({literal}) returned {got}: the lead byte {lead} starts a character of {n} bytes ({k} continuation "
    "byte{s}), and yours counted {counted}. The lead byte's high bits give the length: 0xxxxxxx one byte, 110xxxxx "
    "two, 1110xxxx three, 11110xxx four"
)
HINT_U8_RESTART = (
    "utf8_prefix_ok({literal}) returned True, but the character that {lead} starts is unfinished when {byte} comes: "
    "it still needed {missing} continuation byte{s}, and no later byte can finish it. Only the last character may "
    "be unfinished"
)
HINT_U8_LOOSE = (
    "utf8_prefix_ok({literal}) returned True, but byte {pos} ({byte}) is not a continuation byte, which the "
    "character that {lead} starts needed there: continuation bytes are 10xxxxxx (80..BF), and {byte} is 11xxxxxx, "
    "{what}. Testing only the top bit lets it through; the top two bits (or the range) tell them apart"
)
HINT_U8_INCOMPLETE = (
    "utf8_prefix_ok({literal}) returned False, but these bytes can still become valid UTF-8: they end inside a "
    "character ({lead} needs {missing} more continuation byte{s}), and {completion} would finish it as {char}. The "
    "question is whether more bytes could make the data valid, so an unfinished last character is fine as long as "
    "its bytes so far fit the table"
)
HINT_U8_REJECTS = (
    "utf8_prefix_ok({literal}) returned False, but {what}. Compare each of its bytes with the table's row for its "
    "character"
)

# The table, as the reference reads it: lead byte ranges -> (continuation bytes, the second byte's range).
U8_TABLE = ((0x00, 0x7F, 0, None), (0xC2, 0xDF, 1, (0x80, 0xBF)), (0xE0, 0xE0, 2, (0xA0, 0xBF)),
            (0xE1, 0xEC, 2, (0x80, 0xBF)), (0xED, 0xED, 2, (0x80, 0x9F)), (0xEE, 0xEF, 2, (0x80, 0xBF)),
            (0xF0, 0xF0, 3, (0x90, 0xBF)), (0xF1, 0xF3, 3, (0x80, 0xBF)), (0xF4, 0xF4, 3, (0x80, 0x8F)))


def _u8_lead(byte: int) -> tuple[int, tuple[int, int]] | None:
    for first, last, missing, second in U8_TABLE:
        if first <= byte <= last:
            return missing, second or (0x80, 0xBF)
    return None


def u8_walk(data: bytes) -> tuple[int | None, int, int, int]:
    """Read ``data`` with the table: (where it fails or None, continuation bytes still missing there or at the end,
    where the last character starts, the lead byte of the last (or failing) character; -1 when none)."""
    missing, lo, hi, start = 0, 0x80, 0xBF, -1
    for i, byte in enumerate(data):
        if missing:
            if not lo <= byte <= hi:
                return i, missing, start, data[start]
            missing, lo, hi = missing - 1, 0x80, 0xBF
            continue
        lead = _u8_lead(byte)
        if lead is None:
            return i, 0, start, data[start] if start >= 0 else -1
        start, (missing, (lo, hi)) = i, lead
    return None, missing, start, data[start] if start >= 0 else -1


def reference_utf8_prefix_ok(data: bytes) -> bool:
    """The exercise's answer: valid UTF-8, then at most the beginning of one more character that the table allows."""
    return u8_walk(bytes(data))[0] is None


def _hex(data: bytes) -> str:
    return data.hex(" ").upper() if data else "(no bytes)"


def _completion(data: bytes) -> bytes:
    """``data`` (a valid prefix) finished with the smallest continuation bytes the table allows."""
    failure, missing, start, lead = u8_walk(data)
    assert failure is None
    out = bytearray(data)
    for _ in range(missing):
        position = len(out) - start
        lo = _u8_lead(lead)[1][0] if position == 1 else 0x80
        out.append(lo)
    return bytes(out)


U8_TABLE_BYTES = (0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xEC,
                  0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xF7, 0xF8, 0xFE, 0xFF)
U8_CODE_POINTS = (0x41, 0x7F, 0x80, 0xE9, 0x7FF, 0x800, 0xFFF, 0x1000, 0x20AC, 0xCFFF, 0xD000, 0xD7FF, 0xE000,
                  0xFFFF, 0x10000, 0x1F600, 0x3FFFF, 0x40000, 0xFFFFF, 0x100000, 0x10FFFF)


def u8_cases() -> list[bytes]:
    """Fixed inputs, one or more per row of the table and per mistake (the closure adds their prefixes)."""
    text = [chr(c).encode() for c in U8_CODE_POINTS] + ["Grüße, 世界 😀".encode(), "é".encode() + b"a", b""]
    wrong = ["e0 80 80", "e0 9f bf", "f0 80 80 80", "f0 8f bf bf", "ed a0 80", "ed bf bf", "f4 90 80 80",
             "f4 bf bf bf", "c0 80", "c1 bf", "f5 80 80 80", "f7 bf", "f8 88", "fe", "ff", "80", "bf", "41 80",
             "c3 a9 80", "e2 82 ac bf", "f0 9f 98 80 80", "c3 41", "e2 82 41", "f0 9f 98 41", "e2 41", "c3 c3",
             "e2 82 e2 82 ac", "f0 9f f0", "c3 ff", "61 e0 a0"]
    return text + [bytes.fromhex(h) for h in wrong]


def u8_random_cases(rng: np.random.Generator, n: int) -> list[bytes]:
    """Random byte strings of 1 to 9 bytes, weighted toward the table's boundaries: whole characters at the ends of
    the ranges, bytes at the ends of the ranges, unfinished characters."""
    out = []
    for _ in range(n):
        data = bytearray()
        for _ in range(int(rng.integers(1, 5))):
            kind = rng.random()
            if kind < 0.2:  # a lead whose second byte the table narrows, then any continuation byte
                data += bytes([int(rng.choice([0xE0, 0xED, 0xF0, 0xF4])), int(rng.integers(0x80, 0xC0))])
            elif kind < 0.45:
                code = int(rng.choice(U8_CODE_POINTS)) if rng.random() < 0.5 else int(rng.integers(0, 0x110000))
                if 0xD800 <= code <= 0xDFFF:
                    code -= 0x800
                piece = chr(code).encode()
                data += piece if rng.random() < 0.6 else piece[:int(rng.integers(1, len(piece) + 1))]
            elif kind < 0.85:
                data.append(int(rng.choice(U8_TABLE_BYTES)))
            else:
                data.append(int(rng.integers(0, 256)))
        out.append(bytes(data[:9]))
    return out


def u8_closure(cases: list[bytes]) -> list[bytes]:
    """The cases, every prefix of each, and each valid unfinished prefix finished: shortest first, so the first
    disagreement is where a mistake shows first."""
    found = set()
    for data in cases:
        for k in range(len(data) + 1):
            found.add(data[:k])
            if reference_utf8_prefix_ok(data[:k]):
                found.add(_completion(data[:k]))
    return sorted(found, key=lambda d: (len(d), d))


def _decoder_used(source: str) -> str | None:
    """Where ``source`` reaches Python's decoder: ``.decode``, codecs or encodings, ``str(data, encoding)``."""
    import ast

    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("decode", "getincrementaldecoder", "getdecoder", "utf_8_decode"):
            return f"`.{node.attr}`"
        if isinstance(node, ast.Name) and node.id in ("codecs", "encodings"):
            return f"`{node.id}`"
        if isinstance(node, ast.Constant) and node.value in ("decode", "codecs", "encodings"):
            return f"the name {node.value!r}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" \
                and (len(node.args) >= 2 or any(k.arg in ("encoding", "errors") for k in node.keywords)):
            return "`str` with an encoding"
    return None


def _u8_lead_length(lead: int) -> int:
    return 1 + _u8_lead(lead)[0]


def u8_problem(answers: dict[bytes, bool]) -> str | None:
    """What is wrong with a learner's answers (bytes -> bool, the closure of some cases), or None when all are right.

    The shortest input where the answer differs from the reference is named, with the row of the table it breaks.
    A lead byte accepted where a continuation byte was needed is named as a new character started too early rather
    than as a top-bit test when the answers also accept an ASCII byte there (a top-bit test never does)."""
    wrong = [data for data in sorted(answers, key=lambda d: (len(d), d))
             if answers[data] != reference_utf8_prefix_ok(data)]
    if not wrong:
        return None
    kind, message = _u8_diagnose(wrong[0], answers)
    if kind == "loose":
        restarts = [found for found in (_u8_diagnose(data, answers) for data in wrong) if found[0] == "restart"]
        if restarts:
            return restarts[0][1]
    return message


def _u8_diagnose(data: bytes, answers: dict[bytes, bool]) -> tuple[str, str]:
    """(the named mistake, its message) behind the learner's wrong answer on ``data``."""
    literal = repr(data)
    if answers[data]:  # an input that can never become UTF-8 was accepted
        at, missing, start, lead = u8_walk(data)
        byte = data[at]
        fields = dict(literal=literal, byte=f"{byte:02X}", pos=at, lead=f"{lead:02X}" if lead >= 0 else "",
                      missing=missing, s="" if missing == 1 else "s")
        if missing == 0:  # between characters
            if 0x80 <= byte <= 0xBF:
                if start >= 0 and lead >= 0xC2:  # right after a complete multi-byte character
                    return "length", _u8_length(literal, True, lead, f"a longer one, taking byte {at} ({byte:02X}) "
                                                "as part of it")
                where = "it starts the data" if at == 0 else "the character before it is complete"
                return "stray", HINT_U8_STRAY.format(**fields, where=where)
            return "bad lead", (HINT_U8_C0C1 if byte in (0xC0, 0xC1) else HINT_U8_F5FF).format(**fields)
        if 0x80 <= byte <= 0xBF:  # a continuation byte outside the narrow second-byte range
            if lead in (0xE0, 0xF0):
                return "overlong", HINT_U8_OVERLONG.format(**fields, why=OVERLONG_WHY[lead])
            return "narrow", (HINT_U8_SURROGATE if lead == 0xED else HINT_U8_ABOVE).format(**fields)
        if byte < 0x80:
            return "restart", HINT_U8_RESTART.format(**fields)
        what = "a lead byte" if _u8_lead(byte) else "a byte that never occurs in UTF-8"
        return "loose", HINT_U8_LOOSE.format(**fields, what=what)
    # a valid beginning was rejected
    _, missing, start, lead = u8_walk(data)
    before = data[:-1]
    prev_lead = u8_walk(before)[3]
    if start == len(data) - 1 and prev_lead >= 0xC2 and answers.get(before):  # still waiting after a finished character
        return "length", _u8_length(literal, False, prev_lead, f"a longer one, still waiting for continuation bytes "
                                    f"when {data[-1]:02X} came")
    if missing:
        finished = _completion(data)
        char = f"U+{ord(finished[start:].decode('utf-8')):04X}"
        if answers.get(finished):
            return "incomplete", HINT_U8_INCOMPLETE.format(literal=literal, lead=f"{lead:02X}", missing=missing,
                                                           s="" if missing == 1 else "s", completion=_hex(finished),
                                                           char=char)
        return "rejects", HINT_U8_REJECTS.format(literal=literal, what=f"they begin {_hex(finished)}, the UTF-8 of {char}")
    if lead >= 0xC2 and answers.get(before):  # the character's last continuation byte looked stray
        return "length", _u8_length(literal, False, lead, f"a shorter one, so its last byte ({data[-1]:02X}) looked stray")
    text = data.decode("utf-8")
    return "rejects", HINT_U8_REJECTS.format(literal=literal, what=f"these bytes are valid UTF-8, the text {text!r}")


def _u8_length(literal: str, got: bool, lead: int, counted: str) -> str:
    n = _u8_lead_length(lead)
    return HINT_U8_LENGTH.format(literal=literal, got=got, lead=f"{lead:02X}", n=n, k=n - 1, s="" if n == 2 else "s",
                                 counted=counted)


def _u8_answer(result: Any, data: bytes) -> bool:
    from tfedu.checks.core import ExerciseNotDone

    if result is None:
        raise ExerciseNotDone(HINT_U8_NONE.format(data=_hex(data)))
    if not isinstance(result, (bool, np.bool_)):
        raise CheckFailure(HINT_U8_KIND.format(got=describe(result), data=_hex(data)))
    return bool(result)


@checker("UTF-8 prefixes: bytes that can still become valid UTF-8")
def check_utf8_prefix_ok(utf8_prefix_ok) -> None:
    """Check ``utf8_prefix_ok(data) -> bool`` on :func:`u8_cases` and 300 random byte strings (fixed seed), with all
    their prefixes: the shortest input where it differs from the table names the mistake. Python's decoder
    (``.decode``, ``codecs``, ``str(data, encoding)``) and ``tfedu.constrained`` are refused."""
    _refuse_shortcuts(utf8_prefix_ok, U8_FORBIDDEN, HINT_U8_SHORTCUT)
    try:
        source = inspect.getsource(utf8_prefix_ok)
    except (OSError, TypeError):
        source = ""
    used = _decoder_used(source)
    expect(used is None, HINT_U8_DECODER.format(what=used))
    answers = {}
    for data in u8_closure(u8_cases() + u8_random_cases(np.random.default_rng(15_7), 300)):
        result = call_learner(utf8_prefix_ok, data, name=U8_NAME, error_hint=HINT_U8_CALL)
        answers[data] = _u8_answer(result, data)
    problem = u8_problem(answers)
    expect(problem is None, problem or "")


U8_PROBE_RUN = HELPERS + """\
import inspect as _inspect
_fn = globals().get('utf8_prefix_ok')
_results = []
for _h in inputs['cases'] if _fn is not None else []:
    try:
        _r = _fn(bytes.fromhex(_h))
        _r = bool(_r) if isinstance(_r, bool) or type(_r).__name__ == 'bool_' else 'NoneType' if _r is None else _kind(_r)
    except Exception as _e:
        _r = 'raised ' + type(_e).__name__ + ': ' + str(_e)[:200]
    _results.append(_r)
try:
    _source = _inspect.getsource(_fn)[:20000] if _fn is not None else ''
except (OSError, TypeError):
    _source = ''
outputs = {'defined': _fn is not None, 'results': _results, 'source': _source}
del _inspect, _fn, _results, _source
""" + CLEANUP


def _u8_probe_inputs(rng: np.random.Generator) -> dict:
    """Fresh random byte strings weighted toward the table's boundaries, with their prefixes and completions."""
    return {"cases": [data.hex() for data in u8_closure(u8_cases() + u8_random_cases(rng, 150))]}


def _compare_u8(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list):
        return "the hidden test's outputs should be a dict with the results"
    if not outputs.get("defined"):
        return "utf8_prefix_ok is not defined: run the exercise's cell"
    used = _decoder_used(outputs.get("source") or "")
    if used:
        return HINT_U8_DECODER.format(what=used)
    cases = expected["cases"]
    if len(outputs["results"]) != len(cases):
        return "utf8_prefix_ok's hidden test did not run every case"
    answers = {}
    for h, got in zip(cases, outputs["results"]):
        data = bytes.fromhex(h)
        if isinstance(got, str):
            if got.startswith("raised "):
                return f"hidden test: utf8_prefix_ok({data!r}) {got} ({HINT_U8_CALL})"
            return HINT_U8_NONE.format(data=_hex(data)) if got == "NoneType" else \
                HINT_U8_KIND.format(got=got, data=_hex(data))
        answers[data] = bool(got)
    problem = u8_problem(answers)
    return f"hidden test: {problem}" if problem else None


PROBES = {
    "check_induction_score": Probe(
        exercise="ex_induction_score", make_inputs=_is_probe_inputs, run=IS_PROBE_RUN,
        reference=lambda inputs: {"inputs": inputs}, compare=_compare_is, forbidden=IS_FORBIDDEN, builds=None),
    "check_ablate_heads": Probe(
        exercise="ex_ablate_heads", make_inputs=_ab_probe_inputs, run=AB_PROBE_RUN,
        reference=lambda inputs: {"inputs": inputs}, compare=_compare_ab,
        builds=None),  # the model's own hooks: an exercise in their API
    "check_patch_head": Probe(
        exercise="ex_patch_head", make_inputs=_pt_probe_inputs, run=PT_PROBE_RUN, reference=_pt_probe_reference,
        compare=_compare_pt, builds=None),  # the model's own hooks and cache: an exercise in their API
    "check_logit_lens": Probe(
        exercise="ex_logit_lens", make_inputs=_ll_probe_inputs, run=LL_PROBE_RUN,
        reference=lambda inputs: {"returned": ["tensor"], "inputs": inputs}, compare=_compare_ll,
        forbidden=LL_FORBIDDEN, builds=None),  # the model's hook points and modules: an exercise in their API
    "check_logit_attribution": Probe(
        exercise="ex_logit_attribution", make_inputs=_la_probe_inputs, run=LA_PROBE_RUN,
        reference=lambda inputs: {"inputs": inputs}, compare=_compare_la, forbidden=LA_FORBIDDEN,
        builds=None),  # the model's cache, W_O, norm and unembedding: an exercise in their API
    "check_constrained_probs": Probe(
        exercise="ex_constrained_probs",
        make_inputs=_probe_inputs,
        run=PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare,
        forbidden=FORBIDDEN),
    "check_utf8_prefix_ok": Probe(
        exercise="ex_utf8_prefix_ok", make_inputs=_u8_probe_inputs, run=U8_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]}, compare=_compare_u8, forbidden=U8_FORBIDDEN),
}


HINTS = {
    "ex_induction_score": Hints(
        number="15.1",
        check="check_induction_score",
        idea=(
            "On a random sequence shown twice, a query in the second copy holds a token seen once before. An induction "
            "head looks up that earlier occurrence and attends to the token that came *after* it, the one it then "
            "predicts. In the pattern that key sits seq_len - 1 positions before the query, on one diagonal below the "
            "main one. The score is the attention on that key, averaged over the queries of the second copy (only "
            "they have an earlier occurrence) and over the batch: one number per head."
        ),
        approach=(
            "The pattern is (batch, n_heads, query_pos, key_pos). Work out lead, the tokens before the first copy, "
            "from pos = lead + 2 * seq_len. The second copy's queries are the positions lead + seq_len up to pos - 1; "
            "for each, the key is seq_len - 1 positions earlier. Pick those (query, key) entries for every batch row "
            "and head, with two index tensors on the last two axes, or with the diagonal at offset -(seq_len - 1) "
            "and a slice of it. Average over the queries, then over the batch: (n_heads,)."
        ),
        skeleton=(
            "def induction_score(pattern, seq_len):\n"
            "    lead = ____  # the tokens before the first copy\n"
            "    query = torch.arange(____, ____)  # the second copy's positions\n"
            "    key = ____  # for each query: the position after the earlier copy of its token\n"
            "    return pattern[..., ____, ____].mean(____).mean(____)  # (n_heads,)\n"
        ),
    ),
    "ex_ablate_heads": Hints(
        number="15.2",
        check="check_ablate_heads",
        idea=(
            "To see what some heads do, run the model without them. Each head's output passes through the "
            "attention's hook_z, (batch, pos, n_heads, d_head), before W_O mixes the heads, so a hook there can "
            "replace the chosen heads' slices and leave the others alone. Zero ablation puts 0 there; mean ablation "
            "puts each chosen head's average output on this input, one d_head vector per head averaged over the "
            "batch and the positions, so the head still writes its typical vector but nothing that depends on the "
            "tokens. The hook is attached for this one run and removed afterwards."
        ),
        approach=(
            "Name the hook point: blocks, the layer, attn, hook_z (dots written as __ for model.hooks). Write a "
            "function of the hook's tensor that copies it, then sets the slice of the chosen heads on the third "
            "axis (all batches, all positions): to 0, or, with how='mean', to that slice's mean over axes 0 and 1 "
            "(keepdim, so it broadcasts back). It must return the new tensor: a hook that returns None leaves the "
            "activation as it was. Under torch.no_grad, inside model.hooks with that function, run the model on the "
            "ids and return its logits."
        ),
        skeleton=(
            "def ablate_heads(model, ids, layer, heads, how=\"zero\"):\n"
            "    def ablate(z):  # (batch, pos, n_heads, d_head)\n"
            "        z = ____  # a copy\n"
            "        picked = z[____]  # the chosen heads, every batch row and position\n"
            "        z[____] = 0.0 if how == \"zero\" else ____  # the mean over the batch and the positions\n"
            "        return ____\n"
            "\n"
            "    with torch.no_grad(), model.hooks(____):\n"
            "        return ____\n"
        ),
    ),
    "ex_patch_head": Hints(
        number="15.3",
        check="check_patch_head",
        idea=(
            "Two runs of the same model. The clean run, on the input where the behaviour works, is only there to "
            "record what one head wrote: its output at the attention's hook_z, before W_O mixes the heads. The "
            "corrupted run, on the input where the behaviour breaks, is the one whose logits you return, with one "
            "change: while it runs, that head's output is replaced by the recorded clean one, at every position, and "
            "every other head keeps what the corrupted input gives it. A hook does the replacing; it must come off "
            "again when the run ends."
        ),
        approach=(
            "Name the hook point: blocks, the layer, attn, hook_z, joined by dots (by double underscores as a keyword "
            "of model.hooks). Under torch.no_grad, run the model on the clean ids with run_with_cache and keep that "
            "hook point's tensor, (batch, pos, n_heads, d_head). Write a function of the corrupted run's tensor that "
            "returns a copy with the head's slice on the third axis (all batches, all positions) taken from the clean "
            "tensor. Inside model.hooks with that function, run the model on the corrupted ids and return its logits."
        ),
        skeleton=(
            "def patch_head(model, clean_ids, corrupted_ids, layer, head):\n"
            "    name = ____  # the hook point of block `layer`'s per-head outputs\n"
            "    with torch.no_grad():\n"
            "        _, cache = ____\n"
            "        clean_z = ____  # (batch, pos, n_heads, d_head)\n"
            "\n"
            "        def patch(z):\n"
            "            z = ____  # a copy: leave the tensor the model hands you as it is\n"
            "            ____ = ____  # one head, every position\n"
            "            return z\n"
            "\n"
            "        with model.hooks(____):\n"
            "            return ____\n"
        ),
    ),
    "ex_logit_lens": Hints(
        number="15.4",
        check="check_logit_lens",
        idea=(
            "The model reads its residual stream once, at the end: the final norm, then the unembedding, gives the "
            "logits. The residual stream is a running sum, so the same read-out can be applied to it at any earlier "
            "point, asking what the model would predict if it stopped there. There are n_layers + 1 such points: "
            "after the embeddings, before any block, and after each block. Applied to the last one, the read-out is "
            "exactly what the forward pass did, so that row equals the model's logits bit for bit."
        ),
        approach=(
            "Under torch.no_grad, run the model once with run_with_cache on the ids. The stream after the embeddings "
            "is block 0's input, at blocks.0.hook_resid_pre; the stream after block i is at blocks.<i>.hook_resid_post "
            "(the number of blocks is the length of model.blocks). For each of these n_layers + 1 tensors, (batch, pos, "
            "d_model), apply model.ln_final and then model.unembed, giving (batch, pos, d_vocab). Stack the rows on a "
            "new first axis: (n_layers + 1, batch, pos, d_vocab). No softmax: the rows are logits."
        ),
        skeleton=(
            "def logit_lens(model, ids):\n"
            "    with torch.no_grad():\n"
            "        _, cache = ____\n"
            "        names = ____  # n_layers + 1 hook points: after the embeddings, then after each block\n"
            "        rows = [____ for name in names]  # each (batch, pos, d_vocab): the final read-out\n"
            "        return ____  # (n_layers + 1, batch, pos, d_vocab)\n"
        ),
    ),
    "ex_logit_attribution": Hints(
        number="15.5",
        check="check_logit_attribution",
        idea=(
            "The final stream at a position is a sum of what each part wrote: the token embedding, the position "
            "embedding, every head's output through its own slice of W_O, each W_O bias and each MLP's output. The "
            "final norm is not linear, but its scale is one number for the whole stream: frozen at its value on the "
            "final stream, the norm (centre, divide by that scale, multiply by the weight, add the bias) followed by "
            "the token's column of W_U is linear plus a constant. So each part's logit is that read-out without the "
            "bias, and the bias read-out is one more part, counted once; the parts add up to the logit."
        ),
        approach=(
            "Under torch.no_grad, run_with_cache on the ids, and take everything at row 0, position pos. The scale: "
            "from the last block's hook_resid_post, the square root of (its mean square after subtracting its mean, "
            "for LayerNorm; its mean square, for RMSNorm) plus ln_final.eps. A part x (d_model) reads out as x, "
            "minus its own mean for LayerNorm, divided by that scale, times ln_final.weight, dotted with "
            "model.unembed.weight[token]. The parts: hook_embed, hook_pos_embed (learned positions; indexed by "
            "position alone), for each block each head's z (hook_z, (n_heads, d_head)) times its columns of "
            "W_O.weight, transposed, the W_O bias, hook_mlp_out; and ln_final.bias dotted with the token's column."
        ),
        skeleton=(
            "def logit_attribution(model, ids, pos, token):\n"
            "    with torch.no_grad():\n"
            "        _, cache = ____\n"
            "        u, norm = ____, model.ln_final  # the token's column of W_U (d_model,)\n"
            "        final = cache[____][0, pos]  # the stream the model reads\n"
            "        scale = ____  # once, on `final`: LayerNorm centres first, RMSNorm does not\n"
            "\n"
            "        def read(x):  # one part's logit, with the scale frozen\n"
            "            return float(____)\n"
            "\n"
            "        parts = {\"embed\": read(____)}\n"
            "        ...  # 'pos_embed', then per block 'L<l>H<h>', 'L<l> attn bias', 'L<l> MLP'\n"
            "        ...  # and 'ln_final bias', once\n"
            "        return parts\n"
        ),
    ),
    "ex_constrained_probs": Hints(
        number="15.6",
        check="check_constrained_probs",
        idea=(
            "The answer is the model's next-token distribution restricted to the allowed tokens: a forbidden token "
            "gets probability exactly 0, and the allowed ones share all of it in the proportions the model gave "
            "them. The softmax does both at once if the forbidden tokens are already gone when it runs, because "
            "exp(-inf) is exactly 0 and the denominator then adds up the allowed tokens only. Removing them after "
            "the softmax leaves rows that sum to less than 1 (or 0 / 0 when the model's favourite is forbidden), "
            "and a fill of 0 hides nothing, since exp(0) is 1."
        ),
        approach=(
            "Two steps on logits (..., d_vocab) and allowed, a bool tensor of the same shape. First, a new tensor "
            "of logits in which every entry where allowed is False becomes minus infinity: an out-of-place fill or "
            "torch.where, with the bool mask negated by ~ (1 minus a bool tensor fails), so the caller's logits stay "
            "as they were. Then a softmax over the last dimension, d_vocab; torch's softmax subtracts each row's "
            "largest finite logit itself, so logits near 100 do not overflow. The result keeps the logits' shape "
            "and dtype."
        ),
        skeleton=(
            "def constrained_probs(logits, allowed):\n"
            "    masked = logits.masked_fill(____, ____)  # a new tensor: which entries, and what makes exp give 0?\n"
            "    return ____  # (..., d_vocab): each row a distribution over its allowed tokens\n"
        ),
    ),
    "ex_utf8_prefix_ok": Hints(
        number="15.7",
        check="check_utf8_prefix_ok",
        idea=(
            "Read the bytes from left to right and carry one small piece of state from byte to byte: how many "
            "continuation bytes the current character still needs, and the range the next byte must lie in. Between "
            "characters a byte is a lead: the table's first column says whether it stands alone (ASCII), announces "
            "one, two or three continuation bytes, or can never start a character at all. Inside a character the "
            "next byte must fall in the range, or no later byte can repair it. Four leads (E0, ED, F0, F4) narrow "
            "the range of the byte right after them; every other continuation byte may be 80..BF. When the bytes "
            "run out, an unfinished character is fine: more bytes could still finish it."
        ),
        approach=(
            "Start with nothing missing. For each byte: if a continuation byte is missing, answer False when the "
            "byte lies outside the current range, otherwise count one fewer missing and widen the range back to "
            "80..BF. If nothing is missing, look the byte up among the leads: 00..7F needs nothing more; C2..DF "
            "needs one; E0..EF two, with the next range A0..BF after E0 and 80..9F after ED; F0..F4 three, with "
            "90..BF after F0 and 80..8F after F4; any other byte answers False. If the loop ends, answer True."
        ),
        skeleton=(
            "def utf8_prefix_ok(data):\n"
            "    need, low, high = ____  # nothing missing yet; the range of the next continuation byte\n"
            "    for b in data:\n"
            "        if need > 0:\n"
            "            if ____:  # outside the range: no later byte can repair it\n"
            "                return False\n"
            "            need, low, high = ____\n"
            "        elif ____:  # ASCII: a whole character\n"
            "            pass\n"
            "        elif ____:  # a two-byte lead\n"
            "            need = ____\n"
            "        elif ____:  # a three-byte lead (E0 and ED narrow the next byte's range)\n"
            "            need, low, high = ____\n"
            "        elif ____:  # a four-byte lead (F0 and F4 narrow it)\n"
            "            need, low, high = ____\n"
            "        else:\n"
            "            return ____\n"
            "    return ____  # an unfinished last character can still be finished\n"
        ),
    ),
}
