"""Checkers for notebooks/15_interpretability_and_decoding.ipynb: activation patching, the logit lens and constrained
decoding.

Exercise 15.1, ``patch_head(model, clean_ids, corrupted_ids, layer, head) -> logits``: the corrupted run with one
head's output (block ``layer``'s ``attn.hook_z``, head ``head``, every position) taken from the clean run. Named: every
head patched, the patch run the wrong way, no patch at all, the clean run returned (or everything the later blocks read
patched), the position axis indexed for the head, the last position alone, a hook left on the model. See
:func:`check_patch_head`.

Exercise 15.2, ``logit_lens(model, ids) -> lens``: ``unembed(ln_final(resid))`` for the residual stream after the
embeddings (``blocks.0.hook_resid_pre``) and after each block (``blocks.<i>.hook_resid_post``), stacked on a first
axis, ``(n_layers + 1, batch, pos, d_vocab)``; the last row is the model's logits bit for bit. Checked on small
pre-norm GPTs with random norm scales (LayerNorm and RMSNorm). Named: no final norm, the embedding row missing, each
block's input read instead of its output, the last row normed twice, the model's logits appended as an extra row, the
layers stacked on the batch axis, probabilities instead of logits, a last row close to the logits but not bit for bit,
a hook left on the model. ``tfedu.interp`` is refused. See :func:`check_logit_lens`.

Exercise 15.3, ``constrained_probs(logits, allowed) -> probs``: the next-token distribution restricted to the
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
  the masked logits without the softmax, and changing ``logits`` in place (``masked_fill_``).

A large negative finite fill (-1e9, ``torch.finfo(dtype).min``) gives the same probabilities on these inputs
and passes. ``tfedu.constrained`` and ``tfedu.generate`` are refused: the masking is the exercise.
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


def diagnose(got: Any, logits: torch.Tensor, allowed: torch.Tensor, *, what: str) -> None:
    """Raise a ``CheckFailure`` naming the mistake when ``got`` is not softmax over the allowed tokens."""
    if got is None:
        raise CheckFailure(HINT_NONE)
    if not isinstance(got, torch.Tensor) or not got.is_floating_point():  # a NumPy array too: torch.multinomial needs a tensor
        raise CheckFailure(HINT_TYPE.format(got=describe(got)))
    expect(tuple(got.shape) == tuple(logits.shape), HINT_SHAPE.format(got=tuple(got.shape), want=tuple(logits.shape)))
    if got.dtype in (torch.float16, torch.bfloat16) and logits.dtype not in (torch.float16, torch.bfloat16):
        raise CheckFailure(HINT_HALF.format(dtype=got.dtype, want=logits.dtype))
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


# ----------------------------------------------------------------------------- 15.1 patch_head

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
    "your logits are the corrupted run's, unpatched: no hook was attached while the corrupted input ran (attach it, "
    "then run the model on the corrupted input while it is attached)"
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


# ----------------------------------------------------------------------------- 15.2 logit_lens

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
_results = []
for _c in inputs['cases']:
    if _fn is None:
        _results.append('undefined')
        continue
    _r = _call(_fn, torch.from_numpy(_c['logits']), torch.from_numpy(_c['allowed']))
    _results.append(_r.detach().cpu().double().numpy() if isinstance(_r, torch.Tensor) and _r.is_floating_point()
                    else _kind(_r) if _r is not None else 'NoneType')
outputs = {'results': _results, 'mutated': _MUTATED}
del _fn, _results, _c
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
            diagnose(torch.from_numpy(np.array(got)), logits, allowed, what=what)
            if not bool((torch.from_numpy(np.array(got)).masked_select(~allowed) == 0).all()):
                return HINT_FORBIDDEN_MASS.format(mass=float(np.abs(np.where(case["allowed"], 0, got)).max()), what=what)
        except CheckFailure as failure:
            return str(failure)
    return None


PROBES = {
    "check_patch_head": Probe(
        exercise="ex_patch_head", make_inputs=_pt_probe_inputs, run=PT_PROBE_RUN, reference=_pt_probe_reference,
        compare=_compare_pt, builds=None),  # the model's own hooks and cache: an exercise in their API
    "check_logit_lens": Probe(
        exercise="ex_logit_lens", make_inputs=_ll_probe_inputs, run=LL_PROBE_RUN,
        reference=lambda inputs: {"returned": ["tensor"], "inputs": inputs}, compare=_compare_ll,
        forbidden=LL_FORBIDDEN, builds=None),  # the model's hook points and modules: an exercise in their API
    "check_constrained_probs": Probe(
        exercise="ex_constrained_probs",
        make_inputs=_probe_inputs,
        run=PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare,
        forbidden=FORBIDDEN),
}


HINTS = {
    "ex_patch_head": Hints(
        number="15.1",
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
        number="15.2",
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
    "ex_constrained_probs": Hints(
        number="15.3",
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
}
