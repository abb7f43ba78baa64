"""Checkers for notebooks/19_beyond_attention.ipynb: gated linear attention step by step and chunk by chunk, Mamba's
selective scan step and the gated delta rule's step.

Exercise 19.1, ``gla_step(state, q_t, k_t, v_t, g_t) -> (o_t, new_state)``: one step of gated linear attention, as
:func:`tfedu.recurrences.gated_linear_attention_step`: S_t = g_t S_{t-1} + k_t^T v_t, o_t = q_t S_t (read after the
write); state (batch, n_heads, d_head, d_v), q_t and k_t (batch, n_heads, d_head), v_t (batch, n_heads, d_v), g_t
(batch, n_heads) in (0, 1]. Named: read before the write (from the old state, or the gated old state), the gate on the
new term too, no gate, 1 - g for g, the outer product the wrong way round (v^T k: a square case shows it where it does
not raise), the key in place of the query in the read, the old state returned, the input state changed in place. See
:func:`check_gla_step`.

Exercise 19.2, ``gla_chunked(q, k, v, g, chunk) -> (out, final_state)``: the chunkwise-parallel form from a zero
state, as :func:`tfedu.recurrences.gated_linear_attention_chunked`: q, k (batch, n_heads, pos, d_head), v (batch,
n_heads, pos, d_v), g (batch, n_heads, pos) in (0, 1], chunk a positive int (pos need not be a multiple: the last
chunk is shorter); equal to the recurrent form. It must work chunk by chunk: the number of torch calls it makes
(counted with a ``TorchFunctionMode``) may not grow with pos when pos / chunk is fixed (pos 32 in chunks of 8 against
pos 128 in chunks of 32). A float32 case with strong decay (gates near 0.05 over a chunk of 64) catches ratios of
cumulative products of gates, which underflow to 0 / 0, and the exponential taken before the mask, which overflows above
the diagonal (infinity times the mask's 0): the rows where out is NaN tell the two apart. A case equal to the first up
to a position inside a chunk and redrawn after it tests causality as an invariant. Named: the state not carried between
chunks, the state's contribution inside a chunk not decayed, the output depending on later positions (any mask that
leaks: none, the upper triangle, 0 filled in before the exponential), causal without the decay, an exclusive
cumulative sum, the keys' decay to the chunk's end wrong or missing, b counted from the sequence's start, the old state
not decayed across the chunk, the last partial chunk dropped (or only partial chunks failing), the products of gates
underflowing, the exponential before the mask, out right but the final state wrong on one chunk, per-position work. See
:func:`check_gla_chunked`.

Exercise 19.3, ``scan_step(h, x_t, delta_t, A, B_t, C_t, D) -> (y_t, new_h)``: one step of Mamba's selective scan, as
:func:`tfedu.recurrences.selective_scan_step`: h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t, y_t = C_t h_t + D x_t;
h (batch, d_inner, d_state), x_t and delta_t (batch, d_inner), A (d_inner, d_state) negative, B_t and C_t (batch,
d_state), D (d_inner,). Cases with a large step (delta 50 with A down to -20: exp(delta A) is 0, rightly) and a tiny
one. Named: exp(A) (delta forgotten), 1 + delta A (Euler for A too), delta missing on the B term, the D skip missing,
D times the output in place of the input, the exact zero-order-hold B_bar for the write (the notebook, like Mamba's
code, writes delta B x), read before the write, B and C swapped, exp(-delta A), C contracted over d_inner (a square
case), the old state returned, an input changed in place. See :func:`check_scan_step`.

Exercise 19.4, ``delta_step(state, q_t, k_t, v_t, beta_t, g_t) -> (o_t, new_state)``: one step of the gated delta
rule, as :func:`tfedu.delta_rule.delta_rule_step` **with the gate given as a decay g_t in (0, 1]**, the convention of
19.1 and 19.2 (the library takes the log-gate, so :func:`reference_delta_step` passes it ``g_t.log()``): S' = g_t
S_{t-1}; S_t = S' + beta_t k_t^T (v_t - k_t S'); o_t = q_t S_t; beta_t in [0, 1] (batch, n_heads), keys of unit
length. Named: the plain linear-attention write (no subtraction), the old value read before the gate, the gate after
the write, no gate, exp(g_t) as the decay (g_t taken for a log-gate), beta on v only, beta missing, the query in place of the key for the old value, read before the write, the
subtraction's sign flipped, the outer product transposed (a square case), the old state returned, an input changed in
place. See :func:`check_delta_step`.

``tfedu.recurrences``, ``tfedu.delta_rule`` and ``tfedu.flash`` (the references) are refused.

Each check runs one source (the ``*_RUN`` constants) that the hidden test also runs in the learner's kernel on fresh
inputs, and judges the results with the same function, so the check and the hidden test name the same slips.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from tfedu.checks.building_blocks import EINOPS, ELEMENTARY
from tfedu.checks.core import (NOT_DONE_MESSAGE, CheckFailure, ExerciseNotDone, Hints, Probe, checker,
                               globals_from_modules)
from tfedu.delta_rule import delta_rule_step
from tfedu.recurrences import gated_linear_attention_chunked, gated_linear_attention_step, selective_scan_step

FORBIDDEN = ("tfedu.recurrences", "tfedu.delta_rule", "tfedu.flash")
HINT_SHORTCUT = "your {function} uses {names} from tfedu: {what} is the exercise, so build it from tensor operations"
HINT_NOT_CALLABLE = "expected a function for {function}, got {got}"
HINT_RAISED = "{function} {error} on {what} ({call})"
HINT_RETURN = ("{function} returned {got} on {what}: return a pair ({first}, {second}) of floating-point tensors. "
               "{why}")
HINT_SHAPE = "{function}'s {name} has shape {got} on {what}; expected {want}, {words}"
HINT_DTYPE = ("{function}'s {name} is {got} on {what}, whose inputs are {want}: keep the inputs' dtype (new tensors "
              "made from numbers default to float32; make them with the inputs' dtype)")
HINT_NAN = "{function}'s {name} holds NaN or Inf on {what}, where the rule's is finite"
HINT_DIFFERS = ("{function}'s {name} differs from the rule's on {what}: largest error {err:.3g} at index {index} "
                "(got {got:.6g}, expected {want:.6g})")
HINT_NOT_RUN = "{function}'s hidden test did not run every case"


def _refuse(fn: Any, function: str, what: str) -> None:
    if not callable(fn):
        raise CheckFailure(HINT_NOT_CALLABLE.format(function=function, got=type(fn).__name__))
    names = globals_from_modules(fn, FORBIDDEN)
    if names:
        raise CheckFailure(HINT_SHORTCUT.format(function=function, names=", ".join(names), what=what))


# ----------------------------------------------------------------------------- what the four checks share

# Run in the learner's kernel by the probe, and here by the check: one source per exercise (FUNCTION replaced by its
# name). Each case's inputs are copied into tensors; the result is a dict of its two tensors as float64 arrays with
# their dtypes, or a string saying what the answer raised, changed or returned instead.
STEP_RUN_TEMPLATE = """\
def _nb19_describe(value):
    if isinstance(value, torch.Tensor):
        return 'a tensor of shape ' + str(tuple(value.shape)) + ' and dtype ' + str(value.dtype).replace('torch.', '')
    if isinstance(value, (tuple, list)):
        return 'a ' + type(value).__name__ + ' of ' + str(len(value)) + ' items'
    return 'a ' + type(value).__name__


def _nb19_case(case):
    args = [torch.from_numpy(np.array(a)) for a in case['args']]
    kept = [a.clone() for a in args]
    try:
        got = FUNCTION(*args, *case.get('more', []))
    except Exception as err:
        return 'raised ' + type(err).__name__ + ': ' + str(err)[:300]
    changed = [n for n, a, b in zip(case['names'], args, kept) if not (a.shape == b.shape and torch.equal(a, b))]
    if changed:
        return 'mutated ' + ', '.join(changed)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return 'returned ' + _nb19_describe(got)
    result = {}
    for key, item in zip(('first', 'second'), got):
        if not isinstance(item, torch.Tensor) or not item.is_floating_point():
            return 'returned a pair holding ' + _nb19_describe(item)
        result[key] = item.detach().cpu().double().numpy()
        result[key + ' dtype'] = str(item.dtype).replace('torch.', '')
    return result


outputs = {'results': [_nb19_case(_c) for _c in inputs['cases']]}
del _nb19_describe, _nb19_case
"""


def _run(source: str, name: str, fn: Any, inputs: dict) -> dict:
    """The check's run of ``source`` with ``fn`` bound to ``name``, as the probe runs it in the kernel."""
    scope = {name: fn, "inputs": inputs, "np": np, "torch": torch}
    exec(compile(source, f"<{name}'s run>", "exec"), scope)
    return scope["outputs"]


def _tensors(case: dict) -> list[torch.Tensor]:
    return [torch.from_numpy(np.array(a)) for a in case["args"]]


def _finite_or_none(pair: tuple | None) -> tuple | None:
    if pair is None or not all(bool(torch.isfinite(t).all()) for t in pair):
        return None
    return pair


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Equal shapes and values within tolerance, the absolute one times the larger of 1 and want's largest value."""
    if got.shape != want.shape:
        return False
    got, want = got.double(), want.double()
    scale = max(1.0, float(want.abs().max())) if want.numel() and bool(torch.isfinite(want).all()) else 1.0
    return bool(torch.allclose(got, want, rtol=rtol, atol=atol * scale))


def _pair_close(got: tuple | None, want: tuple | None) -> bool:
    return got is not None and want is not None and all(_close(g, w) for g, w in zip(got, want))


@dataclass(frozen=True)
class Spec:
    """What one exercise's judge needs: its function's name and call, the reference, the slips and the words."""

    function: str  # the learner's function, "gla_step"
    call: str  # the call and its shapes, for an answer that raised
    names: tuple[str, str]  # the two results, ("o_t", "new_state")
    shapes: Callable[[list], tuple[str, str]]  # the two results' shapes in words
    reference: Callable[..., tuple]
    mistakes: Callable[..., list]  # the named slips: [(hint, (first, second) or None)], one order for every case
    mutated: str  # the hint for an input changed in place
    why_pair: str  # why both results go back


def _well_formed(result: Any) -> bool:
    """A result the kernel's run could have made: a string, or the two arrays with their dtypes."""
    if isinstance(result, str):
        return True
    return isinstance(result, dict) and all(isinstance(result.get(k), np.ndarray) and result[k].dtype.kind == "f"
                                            and isinstance(result.get(k + " dtype"), str) for k in ("first", "second"))


def _got(result: Any) -> tuple | None:
    if not isinstance(result, dict):
        return None
    return torch.from_numpy(np.array(result["first"])), torch.from_numpy(np.array(result["second"]))


def name_slip(spec: Spec, results: list, cases: list, wants: list) -> None:
    """Raise the hint of the first slip that explains every case the answer ran (where the slip is defined) and that
    differs from the rule somewhere."""
    got = [_got(r) for r in results]
    mistakes = [spec.mistakes(*_tensors(c), *c.get("more", [])) for c in cases]
    for j in range(len(mistakes[0])):
        defined = [i for i in range(len(cases)) if mistakes[i][j][1] is not None and got[i] is not None]
        differing = [i for i in defined if not _pair_close(mistakes[i][j][1], wants[i])]
        if differing and all(_pair_close(got[i], mistakes[i][j][1]) for i in defined):
            raise CheckFailure(mistakes[differing[0]][j][0])


def judge(spec: Spec, results: list, cases: list, extra: Callable[[list, list, list], None] | None = None) -> None:
    """Raise a CheckFailure that names the mistake unless every result is the reference's pair, of its dtype.

    In order: not done, an input changed in place, the named slips (``extra`` adds slips seen across cases), what was
    returned (kind, shape), an error raised, NaN, the values; then the dtypes."""
    if len(results) != len(cases):
        raise CheckFailure(HINT_NOT_RUN.format(function=spec.function))
    for result, case in zip(results, cases):
        if isinstance(result, str) and result.startswith("raised NotImplementedError"):
            raise ExerciseNotDone(NOT_DONE_MESSAGE)
        if isinstance(result, str) and result.startswith("mutated "):
            raise CheckFailure(spec.mutated.format(names=result.removeprefix("mutated "), what=case["what"]))
    wants = [spec.reference(*_tensors(c), *c.get("more", [])) for c in cases]
    bad = [i for i, (r, w) in enumerate(zip(results, wants)) if not _pair_close(_got(r), w)]
    if bad:
        name_slip(spec, results, cases, wants)
        if extra is not None:
            extra(results, cases, wants)
    for i in bad:
        result, case, want = results[i], cases[i], wants[i]
        what = case["what"]
        if isinstance(result, str) and result.startswith("raised "):
            continue  # a wrong shape or value elsewhere says more than an error; errors last
        if isinstance(result, str):
            raise CheckFailure(HINT_RETURN.format(function=spec.function, got=result.removeprefix("returned "),
                                                  what=what, first=spec.names[0], second=spec.names[1],
                                                  why=spec.why_pair))
        words = spec.shapes(_tensors(case))
        for name, g, w, word in zip(spec.names, _got(result), want, words):
            if g.shape != w.shape:
                raise CheckFailure(HINT_SHAPE.format(function=spec.function, name=name, got=tuple(g.shape),
                                                     what=what, want=tuple(w.shape), words=word))
    for i in bad:
        result, case = results[i], cases[i]
        if isinstance(result, str):
            raise CheckFailure(HINT_RAISED.format(function=spec.function, error=result, what=case["what"],
                                                  call=spec.call))
    for i in bad:
        got, want, what = _got(results[i]), wants[i], cases[i]["what"]
        for name, g, w in zip(spec.names, got, want):
            if not bool(torch.isfinite(g).all()) and bool(torch.isfinite(w).all()):
                raise CheckFailure(HINT_NAN.format(function=spec.function, name=name, what=what))
        for name, g, w in zip(spec.names, got, want):
            if not _close(g, w):
                diff = (g.double() - w.double()).abs()
                worst = int(diff.argmax())
                index = tuple(int(x) for x in np.unravel_index(worst, tuple(diff.shape)))
                raise CheckFailure(HINT_DIFFERS.format(function=spec.function, name=name, what=what,
                                                       err=float(diff.max()), index=index,
                                                       got=float(g.flatten()[worst]), want=float(w.flatten()[worst])))
    for result, case in zip(results, cases):
        dtype = str(np.array(case["args"][0]).dtype)
        for name in ("first", "second"):
            if result[name + " dtype"] != dtype:
                label = spec.names[0 if name == "first" else 1]
                raise CheckFailure(HINT_DTYPE.format(function=spec.function, name=label, got=result[name + " dtype"],
                                                     what=case["what"], want=dtype))


def _compare(spec: Spec, extra: Callable | None = None,
             then: Callable[[Any, dict], None] | None = None) -> Callable[[Any, dict], str | None]:
    """A probe's comparison: :func:`judge` on the kernel's results, then ``then(outputs, expected)``."""

    def compare(outputs: Any, expected: dict) -> str | None:
        cases = expected["cases"]
        if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list) \
                or len(outputs["results"]) != len(cases) or not all(_well_formed(r) for r in outputs["results"]):
            return HINT_NOT_RUN.format(function=spec.function)
        try:
            judge(spec, outputs["results"], cases, extra)
            if then is not None:
                then(outputs, expected)
        except ExerciseNotDone:
            return f"{spec.function} is not done yet"
        except CheckFailure as failure:
            return f"hidden test: {failure}"
        return None

    return compare


def _case(what: str, names: list[str], arrays: list[np.ndarray], dtype: Any, more: list | None = None) -> dict:
    case = {"what": what, "names": list(names), "args": [np.asarray(a, dtype=dtype) for a in arrays]}
    if more is not None:
        case["more"] = list(more)
    return case


def _gates(rng: np.random.Generator, shape: tuple, low: float, high: float = 1.0, ones: bool = True) -> np.ndarray:
    """Gates in [low, high], with some exactly 1 when ``ones`` (a gate of 1 keeps the state whole)."""
    g = rng.uniform(low, high, shape)
    if ones:
        g.reshape(-1)[:: max(2, g.size // 3)] = 1.0
    return g


# ----------------------------------------------------------------------------- 19.1 gated linear attention's step

GLA_STEP_NAMES = ("state", "q_t", "k_t", "v_t", "g_t")
HINT_GLA_STEP_CALL = ("gla_step(state, q_t, k_t, v_t, g_t): state (batch, n_heads, d_head, d_v), q_t and k_t (batch, "
                      "n_heads, d_head), v_t (batch, n_heads, d_v), g_t (batch, n_heads); return (o_t, new_state). "
                      "A size mismatch between d_head and d_v usually means an outer product or a read along the "
                      "wrong axis: the state's rows are indexed by the key, its columns by the value")
HINT_GLA_STEP_MUTATED = ("gla_step changed its input {names} in place (on {what}): the caller keeps the old state (a "
                         "decoder may try two continuations from it, and the chunked form is checked against it), so "
                         "build the new state as a new tensor")
HINT_GLA_READ_BEFORE = (
    "your o_t reads the state before step t's write: the output reads the new state S_t, so the current key and value "
    "count in the current output (as the causal mask of attention includes the diagonal). Write first, then read"
)
HINT_GLA_GATE_NEW = (
    "you gated the new term too, g_t (S_{t-1} + k_t^T v_t): the gate shrinks what was stored before step t; the "
    "current outer product enters whole, so a step's own key and value are never decayed by its own gate"
)
HINT_GLA_NO_GATE = ("your state ignores the gate: adding k_t^T v_t to S_{t-1} as it stands is plain linear attention. "
                    "Each step first scales the old state by g_t (in (0, 1]: old memories fade), then adds the new "
                    "outer product")
HINT_GLA_ONE_MINUS = ("you scaled the old state by 1 - g_t: g_t is the share of the old state kept (g_t = 1 keeps it "
                      "all, as linear attention does), not the share forgotten")
HINT_GLA_TRANSPOSED = (
    "your outer product is the wrong way round, v_t^T k_t: the state is (d_head, d_v), its rows indexed by the key and "
    "its columns by the value, so the new term is k_t^T v_t, a column of the key times a row of the value (with d_head "
    "= d_v the shapes do not tell, so no error was raised)"
)
HINT_GLA_KEY_READS = ("you read the state with the key: the output is the query's read, q_t S_t (the key only says "
                      "where the value is written)")
HINT_GLA_OLD_STATE = ("you returned the old state: the second result is the new state S_t, after the gate and the "
                      "write, which the next step starts from")
WHY_GLA_PAIR = "The new state goes back too: the caller passes it to the next step."


def reference_gla_step(state: torch.Tensor, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor,
                       g_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_linear_attention_step(state, q_t, k_t, v_t, g_t)


def gla_step_variant(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     mistake: str = "") -> tuple[torch.Tensor, torch.Tensor] | None:
    """19.1 done right (``mistake=""``) or with one slip; None where the slip would raise (shapes that disagree)."""
    gate = g[..., None, None]
    if mistake == "transposed":
        if k.shape[-1] != v.shape[-1]:
            return None
        outer = v[..., :, None] * k[..., None, :]
    else:
        outer = k[..., :, None] * v[..., None, :]
    new = {"gate new": lambda: gate * (state + outer), "no gate": lambda: state + outer,
           "one minus": lambda: (1 - gate) * state + outer}.get(mistake, lambda: gate * state + outer)()
    read = {"read before": state, "read gated": gate * state}.get(mistake, new)
    o = torch.einsum("bhd,bhde->bhe", k if mistake == "key reads" else q, read)
    return o, (state if mistake == "old state" else new)


def gla_step_mistakes(*args: torch.Tensor) -> list[tuple[str, tuple | None]]:
    return [(hint, _finite_or_none(gla_step_variant(*args, mistake=m))) for m, hint in (
        ("read before", HINT_GLA_READ_BEFORE), ("read gated", HINT_GLA_READ_BEFORE), ("gate new", HINT_GLA_GATE_NEW),
        ("no gate", HINT_GLA_NO_GATE), ("one minus", HINT_GLA_ONE_MINUS), ("transposed", HINT_GLA_TRANSPOSED),
        ("key reads", HINT_GLA_KEY_READS), ("old state", HINT_GLA_OLD_STATE))]


def _state_step_shapes(t: list[torch.Tensor]) -> tuple[str, str]:
    """What a step of a matrix state returns (19.1 and 19.4): a read and the new state."""
    return "(batch, n_heads, d_v): one value-sized read per head", "(batch, n_heads, d_head, d_v), the state's shape"


GLA_STEP = Spec("gla_step", HINT_GLA_STEP_CALL, ("o_t", "new_state"), _state_step_shapes, reference_gla_step,
                gla_step_mistakes, HINT_GLA_STEP_MUTATED, WHY_GLA_PAIR)
GLA_STEP_RUN = STEP_RUN_TEMPLATE.replace("FUNCTION", "gla_step")


def gla_step_cases(rng: np.random.Generator, label: Callable[[int, str], str] = lambda i, w: w) -> list[dict]:
    """d_v different from d_head, batch and heads above 1 (float64 and float32), a square case (d_head = d_v), gates
    from 0.05 to 1 with some exactly 1, a large state."""
    cases = []
    for i, (batch, heads, d_head, d_v, dtype, scale) in enumerate([
            (2, 3, 4, 5, np.float64, 1.0), (3, 2, 3, 2, np.float32, 1.0), (2, 2, 4, 4, np.float32, 1.0),
            (1, 4, 6, 3, np.float64, 30.0)]):
        d_head, d_v = d_head + int(rng.integers(0, 2)), d_v + int(rng.integers(0, 2))
        if i == 2:
            d_v = d_head
        elif d_v == d_head:
            d_v += 1
        arrays = [scale * rng.standard_normal((batch, heads, d_head, d_v)), rng.standard_normal((batch, heads, d_head)),
                  rng.standard_normal((batch, heads, d_head)), rng.standard_normal((batch, heads, d_v)),
                  _gates(rng, (batch, heads), 0.05)]
        what = (f"batch {batch}, {heads} heads, d_head {d_head}, d_v {d_v}, {np.dtype(dtype).name}"
                + (" (square, d_head equal to d_v)" if d_head == d_v else "") + (", a large state" if scale > 1 else ""))
        cases.append(_case(label(i, what), GLA_STEP_NAMES, arrays, dtype))
    return cases


@checker("gated linear attention's step")
def check_gla_step(gla_step) -> None:
    """Check ``gla_step(state, q_t, k_t, v_t, g_t)`` against :func:`tfedu.recurrences.gated_linear_attention_step`."""
    _refuse(gla_step, "gla_step", "the step")
    cases = gla_step_cases(np.random.default_rng(1901))
    judge(GLA_STEP, _run(GLA_STEP_RUN, "gla_step", gla_step, {"cases": cases})["results"], cases)


def _hidden(i: int, what: str) -> str:
    return f"hidden test {i + 1} ({what})"


# ----------------------------------------------------------------------------- 19.2 the chunked form

GLA_CHUNKED_NAMES = ("q", "k", "v", "g")
HINT_CHUNKED_CALL = ("gla_chunked(q, k, v, g, chunk): q and k (batch, n_heads, pos, d_head), v (batch, n_heads, pos, "
                     "d_v), g (batch, n_heads, pos), chunk a positive int; return (out, final_state), out (batch, "
                     "n_heads, pos, d_v) and the state after the last position (batch, n_heads, d_head, d_v)")
HINT_CHUNKED_MUTATED = ("gla_chunked changed its input {names} in place (on {what}): the caller (a layer, its "
                        "backward pass, the recurrent form it is compared with) keeps using it, so build new tensors")
HINT_CHUNKED_NO_CARRY = (
    "each of your chunks starts from a zero state: the state at the end of a chunk carries everything before it into "
    "the next one (its queries read it, decayed, and its keys are added to it, decayed). Carry the state from chunk "
    "to chunk"
)
HINT_CHUNKED_FROM_STATE = (
    "inside a chunk your queries read the state that entered the chunk without its decay: that state has faded by "
    "every gate from the chunk's start up to t, so its read is scaled by exp(b_t), b_t the sum of log g over the chunk "
    "up to and including t"
)
HINT_CHUNKED_NOT_CAUSAL = (
    "the matrix inside your chunk is not causal: the output at position t depends on later positions (the keys after "
    "it in the same chunk leak in). Only keys s <= t count: fill the entries above the diagonal with minus infinity "
    "before the exponential, so that they become 0 (a 0 filled in before it would become exp(0) = 1)"
)
HINT_CHUNKED_LEAK = (
    "the output at position t depends on later positions: on {what}, your out at positions up to {t0} differs from "
    "your out on {other}, whose inputs are the same up to there (by up to {err:.3g}). Only keys s <= t may reach "
    "query t, so inside a chunk the entries above the diagonal must be 0 after the exponential: fill them with minus "
    "infinity before it (a 0 filled in before it becomes exp(0) = 1), and keep the diagonal"
)
HINT_CHUNKED_NO_DECAY = (
    "the matrix inside your chunk is causal but has no decay: key s reaches query t through the gates g_{s+1} ... "
    "g_t, so each entry (q_t . k_s) is scaled by exp(b_t - b_s), b the cumulative sum of log g over the chunk"
)
HINT_CHUNKED_EXCLUSIVE = (
    "your decays are off by one step, as from an exclusive cumulative sum (each b_t leaving out t's own log gate): the "
    "state at t has already been scaled by g_t before anything is read, so b_t sums the log gates up to and "
    "including t, and the key at s escapes only its own gate (the decay from s to t is g_{s+1} ... g_t)"
)
HINT_CHUNKED_TO_END = (
    "the keys you add to the state are decayed by exp(b_s), the decay from the chunk's start to s: what the state "
    "needs is the decay from s to the chunk's end, g_{s+1} ... g_last = exp(b_last - b_s)"
)
HINT_CHUNKED_TO_END_NONE = (
    "your final_state is wrong even on one chunk, where out is right: you add each key's outer product with its value "
    "to the state as it stands, the plain sum. By the chunk's end the pair written at s has faded by every gate after "
    "it, g_{s+1} ... g_last = exp(b_last - b_s), so each pair is scaled by that before it is added"
)
HINT_CHUNKED_GLOBAL_B = (
    "your b runs from the sequence's start, not the chunk's: the state entering a chunk has already faded by every "
    "gate before the chunk, so reading it with exp(b_t) counted from position 0 (and passing it on with exp(b_last) "
    "counted from position 0) fades it twice. Restart the cumulative sum of log g at each chunk's first position"
)
HINT_CHUNKED_STATE_ONLY = (
    "on {what}, a single chunk (no state comes in), your out is right but your final_state differs: the error is in "
    "the state's update at the chunk's end, where each key's outer product with its value is added, faded from its "
    "step to the chunk's end by exp(b_last - b_s) (and the entering state, faded by the whole chunk, exp(b_last))"
)
HINT_CHUNKED_CARRY_DECAY = (
    "the state that entered a chunk is passed on without its decay: by the chunk's end it has faded by every gate of "
    "the chunk, exp(b_last), before the chunk's keys are added"
)
HINT_CHUNKED_DROPPED = (
    "the last, shorter chunk is missing: when pos is not a multiple of chunk, the last chunk holds the pos % chunk "
    "positions left over; its outputs and its keys (in the final state) count like the others'"
)
HINT_CHUNKED_PARTIAL = (
    "your function fails only when pos is not a multiple of chunk ({error} on {what}), and is right on whole chunks: "
    "the last chunk is shorter then, so take each chunk's length from what is left of the sequence rather than "
    "assuming chunk positions"
)
HINT_CHUNKED_UNDERFLOW = (
    "your output holds NaN on {what}, and is right everywhere else: over a chunk of 64 such gates, products of gates "
    "underflow (64 gates of 0.05 multiply to about 1e-83, below anything float32 can hold, about 1e-45, so a "
    "cumulative product reaches 0 and a ratio of two of them is 0 / 0). Work with sums of log gates: the decay from s "
    "to t is exp(b_t - b_s), b the cumulative sum of log g, and a difference of sums never underflows"
)
HINT_CHUNKED_OVERFLOW = (
    "your output holds NaN on {what}, at the chunk's first positions, and is right everywhere else: you take the "
    "exponential of the differences b_t - b_s before masking. Above the diagonal (s after t) the difference is "
    "positive, the sum of -log g over the gap, and with gates near 0.05 it passes 88, where exp overflows float32 to "
    "infinity; the mask's 0 times infinity is NaN. Fill the entries above the diagonal with minus infinity before "
    "taking the exponential (exp of minus infinity is exactly 0)"
)
HINT_CHUNKED_STRONG_NAN = (
    "your output holds NaN on {what}, and is right everywhere else: with gates near 0.05 over a chunk of 64, "
    "decays above the diagonal overflow to infinity (the mask's 0 times infinity is NaN), and products of gates "
    "underflow (64 gates of 0.05 multiply to about 1e-83, below anything float32 can hold, about 1e-45: a ratio of "
    "two is 0 / 0). Work with sums of log gates, b the cumulative sum of log g, and fill the entries above the "
    "diagonal with minus infinity before taking the exponential of b_t - b_s"
)
HINT_CHUNKED_PER_POSITION = (
    "your function does work for every position: it made {small} torch calls on {pos_small} positions in chunks of "
    "{chunk_small} and {big} on {pos_big} positions in chunks of {chunk_big}, the same {n} chunks, where the chunked "
    "form does the same work per chunk whatever its length (whole-chunk matrix products, one state update). A loop "
    "over positions is the recurrent form; inside a chunk, build the matrix of decays at once"
)
HINT_CHUNKED_CALLS = "gla_chunked's count of torch calls could not be taken ({problem})"
WHY_CHUNKED_PAIR = "The final state goes back too: decoding continues from it."


def reference_gla_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_linear_attention_chunked(q, k, v, g, chunk)


def gla_chunked_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, chunk: int,
                        mistake: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """19.2 done right (``mistake=""``) or with one slip, in the inputs' dtype."""
    batch, heads, pos, d_head = q.shape
    S = q.new_zeros(batch, heads, d_head, v.shape[-1])
    log_g, outs = g.log(), []
    for c0 in range(0, pos, chunk):
        c1 = min(c0 + chunk, pos)
        if mistake in ("dropped", "dropped zeros") and c1 - c0 < chunk:
            if mistake == "dropped zeros":
                outs.append(v.new_zeros(batch, heads, c1 - c0, v.shape[-1]))
            break
        qc, kc, vc, lg = q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1], log_g[:, :, c0:c1]
        b = lg.cumsum(-1) - (lg if mistake == "exclusive" else 0)
        if mistake == "global b":
            b = log_g.cumsum(-1)[:, :, c0:c1]
        diff = b[..., :, None] - b[..., None, :]
        causal = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool).tril()
        decay = {"not causal": lambda: diff.exp(), "no decay": lambda: causal.to(q.dtype).expand(diff.shape),
                 "no mask at all": lambda: torch.ones_like(diff),
                 "exp then mask": lambda: diff.exp() * causal.to(q.dtype)}.get(
            mistake, lambda: diff.masked_fill(~causal, -torch.inf).exp())()
        if mistake == "no carry":
            S = torch.zeros_like(S)
        inside = ((qc @ kc.transpose(-2, -1)) * decay) @ vc
        read = qc @ S
        outs.append(inside + (read if mistake == "state not decayed" else b.exp()[..., None] * read))
        to_end = {"to end": lambda: b.exp(), "to end none": lambda: torch.ones_like(b)}.get(
            mistake, lambda: (b[..., -1:] - b).exp())()
        carried = S if mistake == "carry not decayed" else b[..., -1].exp()[..., None, None] * S
        S = carried + (kc * to_end[..., None]).transpose(-2, -1) @ vc
    out = torch.cat(outs, dim=2) if outs else v.new_zeros(batch, heads, 0, v.shape[-1])
    return out, S


def gla_chunked_mistakes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         chunk: int) -> list[tuple[str, tuple | None]]:
    return [(hint, _finite_or_none(gla_chunked_variant(q, k, v, g, chunk, m))) for m, hint in (
        ("no carry", HINT_CHUNKED_NO_CARRY), ("state not decayed", HINT_CHUNKED_FROM_STATE),
        ("not causal", HINT_CHUNKED_NOT_CAUSAL), ("no mask at all", HINT_CHUNKED_NOT_CAUSAL),
        ("no decay", HINT_CHUNKED_NO_DECAY), ("exclusive", HINT_CHUNKED_EXCLUSIVE), ("to end", HINT_CHUNKED_TO_END),
        ("to end none", HINT_CHUNKED_TO_END_NONE), ("global b", HINT_CHUNKED_GLOBAL_B),
        ("carry not decayed", HINT_CHUNKED_CARRY_DECAY), ("dropped", HINT_CHUNKED_DROPPED),
        ("dropped zeros", HINT_CHUNKED_DROPPED))]


def _chunked_shapes(t: list[torch.Tensor]) -> tuple[str, str]:
    return ("(batch, n_heads, pos, d_v): one output per position, all of them",
            "(batch, n_heads, d_head, d_v), the state after the last position")


# Where float32 overflows (exp of more than about 88.7) and where a product underflows to 0 (below about 1e-45, a log
# below about -103.3), with margins: the rows each explanation of NaN under strong decay predicts.
_EXP_OVERFLOW, _LOG_UNDERFLOW, _MARGIN = 88.7, -103.3, 5.0


def _strong_nan_hint(result: Any, case: dict) -> str:
    """Which explanation reproduces the NaN rows of out: the exponential taken before the mask (NaN at a chunk's
    first positions, whose differences above the diagonal overflow) or products of gates (NaN at its last positions,
    where the cumulative product is 0); both or neither, the hint that names both."""
    log_g = np.log(np.asarray(case["args"][3], dtype=np.float64))
    chunk, pos = case["more"][0], log_g.shape[-1]
    early, late = np.zeros(log_g.shape, dtype=bool), np.zeros(log_g.shape, dtype=bool)
    for c0 in range(0, pos, chunk):
        b = log_g[..., c0:c0 + chunk].cumsum(-1)
        above = b - b[..., -1:]  # the largest difference above the diagonal in each row
        early[..., c0:c0 + chunk] = (above > _EXP_OVERFLOW + _MARGIN) & (b > _LOG_UNDERFLOW + _MARGIN)
        late[..., c0:c0 + chunk] = (b < _LOG_UNDERFLOW - _MARGIN) & (above < _EXP_OVERFLOW - _MARGIN)
    out = _got(result)[0]
    if tuple(out.shape[:3]) != log_g.shape:
        return HINT_CHUNKED_STRONG_NAN.format(what=case["what"])
    rows = torch.isnan(out).any(-1).numpy()
    nan_early, nan_late = bool((rows & early).any()), bool((rows & late).any())
    if nan_early and not nan_late:
        return HINT_CHUNKED_OVERFLOW.format(what=case["what"])
    if nan_late and not nan_early:
        return HINT_CHUNKED_UNDERFLOW.format(what=case["what"])
    return HINT_CHUNKED_STRONG_NAN.format(what=case["what"])


def _chunked_leak(results: list, cases: list) -> None:
    """The causal invariant: on a case equal to another up to position t0, out up to t0 must not change."""
    for i, case in enumerate(cases):
        if "same_as" not in case:
            continue
        j, t0 = case["same_as"], case["until"]
        mine, other = _got(results[i]), _got(results[j])
        if mine is None or other is None or mine[0].dim() != 4 or mine[0].shape != other[0].shape \
                or mine[0].shape[2] <= t0:
            continue
        a, b = mine[0][:, :, :t0 + 1], other[0][:, :, :t0 + 1]
        if bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all()) and not _close(a, b):
            raise CheckFailure(HINT_CHUNKED_LEAK.format(what=case["what"], other=cases[j]["what"], t0=t0,
                                                        err=float((a - b).abs().max())))


def _chunked_extra(results: list, cases: list, wants: list) -> None:
    """Slips seen across cases: the output depending on later positions; errors only where pos is no multiple of
    chunk; NaN only under strong decay (told apart by its rows); out right but the final state wrong on one chunk."""
    _chunked_leak(results, cases)
    partial = [c["args"][0].shape[2] % c["more"][0] != 0 for c in cases]
    right = [_pair_close(_got(r), w) for r, w in zip(results, wants)]
    raised = [isinstance(r, str) and r.startswith("raised ") for r in results]
    if any(raised) and all(p for p, r in zip(partial, raised) if r) and all(ok for ok, p in zip(right, partial) if not p):
        i = raised.index(True)
        raise CheckFailure(HINT_CHUNKED_PARTIAL.format(error=results[i], what=cases[i]["what"]))
    strong = [bool(c.get("strong")) for c in cases]
    nan = [_got(r) is not None and not all(bool(torch.isfinite(t).all()) for t in _got(r)) for r in results]
    if any(n and s for n, s in zip(nan, strong)) and all(ok for ok, s in zip(right, strong) if not s):
        i = next(i for i, (n, s) in enumerate(zip(nan, strong)) if n and s)
        raise CheckFailure(_strong_nan_hint(results[i], cases[i]))
    for result, case, want in zip(results, cases, wants):
        got = _got(result)
        if case["args"][0].shape[2] <= case["more"][0] and got is not None and _close(got[0], want[0]) \
                and got[1].shape == want[1].shape and bool(torch.isfinite(got[1]).all()) and not _close(got[1], want[1]):
            raise CheckFailure(HINT_CHUNKED_STATE_ONLY.format(what=case["what"]))


GLA_CHUNKED = Spec("gla_chunked", HINT_CHUNKED_CALL, ("out", "final_state"), _chunked_shapes, reference_gla_chunked,
                   gla_chunked_mistakes, HINT_CHUNKED_MUTATED, WHY_CHUNKED_PAIR)

# The cases, then the count of torch calls on two sequences of the same number of chunks (a chunked answer makes as
# many calls on both; one that loops over positions, more on the longer).
GLA_CHUNKED_RUN = STEP_RUN_TEMPLATE.replace("FUNCTION", "gla_chunked").replace("del _nb19_describe, _nb19_case\n", "") \
    + """\
from torch.overrides import TorchFunctionMode as _Nb19Mode


class _Nb19Count(_Nb19Mode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _nb19_calls(case):
    args = [torch.from_numpy(np.array(a)) for a in case['args']]
    try:
        with _Nb19Count() as counter:
            gla_chunked(*args, *case['more'])
    except Exception as err:
        return 'raised ' + type(err).__name__ + ': ' + str(err)[:200]
    return counter.calls


outputs['calls'] = [_nb19_calls(_c) for _c in inputs['count']]
del _nb19_describe, _nb19_case, _Nb19Mode, _Nb19Count, _nb19_calls
"""


def judge_calls(calls: Any, expected: dict) -> None:
    """Fail when the answer makes more torch calls on the longer of two sequences of as many chunks."""
    count = expected["count"]
    if not isinstance(calls, list) or len(calls) != 2:
        raise CheckFailure(HINT_CHUNKED_CALLS.format(problem="no count came back"))
    for c in calls:
        if isinstance(c, str):
            raise CheckFailure(HINT_CHUNKED_CALLS.format(problem=c))
        if not isinstance(c, (int, np.integer)) or isinstance(c, bool):
            raise CheckFailure(HINT_CHUNKED_CALLS.format(problem="a count that is no number came back"))
    small, big = calls
    if big > small + max(4, small // 8):
        (pos_small, chunk_small), (pos_big, chunk_big) = ((c["args"][0].shape[2], c["more"][0]) for c in count)
        raise CheckFailure(HINT_CHUNKED_PER_POSITION.format(small=small, big=big, pos_small=pos_small,
                                                            chunk_small=chunk_small, pos_big=pos_big,
                                                            chunk_big=chunk_big, n=pos_small // chunk_small))


def _judge_probe_calls(outputs: dict, expected: dict) -> None:
    judge_calls(outputs.get("calls"), expected)


def gla_chunked_cases(rng: np.random.Generator, label: Callable[[int, str], str] = lambda i, w: w) -> dict:
    """Whole chunks (float64, some gates exactly 1), a last chunk shorter (float64), one chunk longer than the
    sequence, chunks of 1 (float32), strong decay in float32: gates near 0.05 over chunks of 64, where ratios of
    cumulative products of gates are 0 / 0 and exponentials above the diagonal overflow; then the first case with every
    position after one inside its second chunk redrawn (the causal invariant). Then two sequences of the same number of
    chunks, to count calls."""
    cases = []
    n_chunks = int(rng.integers(3, 5))
    plans = [  # (batch, heads, pos, chunk, d_head, d_v, dtype, gate low, gate high, strong)
        (2, 2, 4 * n_chunks, 4, 3, 5, np.float64, 0.5, 1.0, False),
        (1, 3, 5 * n_chunks - int(rng.integers(1, 4)), 5, 4, 2, np.float64, 0.3, 1.0, False),
        (2, 1, int(rng.integers(7, 12)), 16, 4, 3, np.float32, 0.6, 1.0, False),
        (1, 2, int(rng.integers(5, 8)), 1, 3, 4, np.float32, 0.4, 1.0, False),
        (1, 2, 64 + int(rng.integers(24, 64)), 64, 4, 3, np.float32, 0.03, 0.08, True),
    ]
    for i, (batch, heads, pos, chunk, d_head, d_v, dtype, low, high, strong) in enumerate(plans):
        arrays = [rng.standard_normal((batch, heads, pos, d_head)), rng.standard_normal((batch, heads, pos, d_head)),
                  rng.standard_normal((batch, heads, pos, d_v)), _gates(rng, (batch, heads, pos), low, high, not strong)]
        what = (f"batch {batch}, {heads} heads, pos {pos} in chunks of {chunk}, d_head {d_head}, d_v {d_v}, "
                f"{np.dtype(dtype).name}" + (", strong decay: gates near 0.05" if strong else ""))
        case = _case(label(i, what), GLA_CHUNKED_NAMES, arrays, dtype, [chunk])
        if strong:
            case["strong"] = True
        cases.append(case)
    first = cases[0]["args"]  # the first case again, every position after t0 (inside a chunk) redrawn
    pos, chunk = first[0].shape[2], plans[0][3]
    t0 = chunk + int(rng.integers(0, chunk - 1))
    arrays = [a.copy() for a in first]
    for a in arrays[:3]:
        a[:, :, t0 + 1:] = rng.standard_normal(a[:, :, t0 + 1:].shape)
    arrays[3][:, :, t0 + 1:] = rng.uniform(0.5, 1.0, arrays[3][:, :, t0 + 1:].shape)
    what = (f"batch 2, 2 heads, pos {pos} in chunks of {chunk}, d_head 3, d_v 5, float64, the first case's inputs "
            f"with every position after {t0} redrawn")
    case = _case(label(len(cases), what), GLA_CHUNKED_NAMES, arrays, np.float64, [chunk])
    case["same_as"], case["until"] = 0, t0
    cases.append(case)
    count = []
    small = int(rng.integers(4, 9))
    n = int(rng.integers(3, 6))
    for chunk in (small, 4 * small):
        pos = n * chunk
        arrays = [rng.standard_normal((1, 1, pos, 2)), rng.standard_normal((1, 1, pos, 2)),
                  rng.standard_normal((1, 1, pos, 2)), rng.uniform(0.8, 1.0, (1, 1, pos))]
        count.append(_case(f"pos {pos} in chunks of {chunk}", GLA_CHUNKED_NAMES, arrays, np.float32, [chunk]))
    return {"cases": cases, "count": count}


@checker("gated linear attention, chunk by chunk")
def check_gla_chunked(gla_chunked) -> None:
    """Check ``gla_chunked(q, k, v, g, chunk)`` against :func:`tfedu.recurrences.gated_linear_attention_chunked`
    (equal to the recurrent form), and that it works chunk by chunk."""
    _refuse(gla_chunked, "gla_chunked", "the chunked form")
    inputs = gla_chunked_cases(np.random.default_rng(1902))
    outputs = _run(GLA_CHUNKED_RUN, "gla_chunked", gla_chunked, inputs)
    judge(GLA_CHUNKED, outputs["results"], inputs["cases"], _chunked_extra)
    judge_calls(outputs["calls"], inputs)


# ----------------------------------------------------------------------------- 19.3 the selective scan's step

SCAN_STEP_NAMES = ("h", "x_t", "delta_t", "A", "B_t", "C_t", "D")
HINT_SCAN_CALL = ("scan_step(h, x_t, delta_t, A, B_t, C_t, D): h (batch, d_inner, d_state), x_t and delta_t (batch, "
                  "d_inner), A (d_inner, d_state), B_t and C_t (batch, d_state), D (d_inner,); return (y_t, new_h), "
                  "y_t (batch, d_inner). Each channel of d_inner has its own d_state numbers: B_t and C_t are shared "
                  "by the channels, along d_state")
HINT_SCAN_MUTATED = ("scan_step changed its input {names} in place (on {what}): the caller keeps the old state and "
                     "the layer's parameters, so build new tensors")
HINT_SCAN_EXP_A = ("your A_bar is exp(A), without the step: the discretised decay is exp(delta_t A), so a large step "
                   "forgets the past (exp of a very negative number is 0) and a tiny one keeps it")
HINT_SCAN_EULER = (
    "your A_bar is 1 + delta_t A, Euler's step for A too: Mamba discretises A by the exact exponential, exp(delta_t "
    "A) (zero-order hold), which stays in (0, 1]; 1 + delta A goes negative once delta |A| > 1 (here delta 50 with A "
    "down to -20 gives about -999) and the state flips sign and blows up. Only the B term takes the Euler shortcut"
)
HINT_SCAN_NO_DELTA_B = ("your input term has no step: B_bar x_t is delta_t B_t x_t, so a tiny step writes almost "
                        "nothing and a large one writes much (the step selects what enters the state)")
HINT_SCAN_ZOH = (
    "your write is the exact zero-order hold, (exp(delta_t A) - 1) / A times B_t x_t: right for the continuous "
    "system held fixed over the step, but the notebook, like Mamba's code, keeps the exponential for the decay only "
    "and writes with the simpler delta_t B_t x_t (the two agree for small steps and part for large ones); use that, "
    "so your step matches the layer"
)
HINT_SCAN_NO_D = ("your y_t leaves out the skip, D x_t: the input passed straight through, scaled by D per channel, "
                  "and added to the state's read C_t h_t")
HINT_SCAN_D_Y = ("your skip scales the state's read by D: the skip passes the input through, D times x_t per "
                 "channel, added to the read C_t h_t")
HINT_SCAN_READ_BEFORE = ("your y_t reads the state before step t's update: y_t reads the new state h_t, so x_t "
                         "reaches the output at its own step through the state, not only through D")
HINT_SCAN_SWAPPED = ("B_t and C_t are swapped: B_t writes the input into the state (h gets delta B x) and C_t reads "
                     "the state out (y gets C h)")
HINT_SCAN_SIGN = ("your decay is exp(-delta_t A): A is already negative (the state decays), so exp(delta_t A) lies in "
                  "(0, 1]; with the sign flipped it grows without bound")
HINT_SCAN_C_AXIS = (
    "you contracted C_t with the state over d_inner, the channels: the read sums over d_state, each channel reading "
    "its own d_state numbers with C_t (so y_t keeps one number per channel). With d_inner = d_state the shapes do "
    "not tell"
)
HINT_SCAN_OLD_STATE = ("you returned the old state: the second result is the new h_t, which the next step starts "
                       "from")
WHY_SCAN_PAIR = "The new state goes back too: the caller passes it to the next step."


def reference_scan_step(h: torch.Tensor, x_t: torch.Tensor, delta_t: torch.Tensor, A: torch.Tensor, B_t: torch.Tensor,
                        C_t: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return selective_scan_step(h, x_t, delta_t, A, B_t, C_t, D)


def scan_step_variant(h: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      C: torch.Tensor, D: torch.Tensor, mistake: str = "") -> tuple[torch.Tensor, torch.Tensor] | None:
    """19.3 done right (``mistake=""``) or with one slip; None where the slip would raise."""
    dA = delta[..., None] * A  # (batch, d_inner, d_state)
    A_bar = {"exp A": lambda: torch.exp(A).expand_as(dA), "euler": lambda: 1 + dA,
             "sign": lambda: torch.exp(-dA)}.get(mistake, lambda: torch.exp(dA))()
    write, read_with = (C, B) if mistake == "swapped" else (B, C)
    step = torch.ones_like(delta) if mistake == "no delta B" else delta
    if mistake == "zoh":
        new = A_bar * h + (torch.exp(dA) - 1) / A * write[:, None, :] * x[..., None]
    else:
        new = A_bar * h + step[..., None] * write[:, None, :] * x[..., None]
    state = h if mistake == "read before" else new
    if mistake == "C axis":
        if h.shape[1] != h.shape[2]:
            return None
        read = torch.einsum("bi,bij->bj", read_with, state)
    else:
        read = torch.einsum("bn,bdn->bd", read_with, state)
    skip = {"no D": lambda: 0 * x, "D y": lambda: D * read, "D only y": lambda: D * read - read}.get(
        mistake, lambda: D * x)()
    return read + skip, (h if mistake == "old state" else new)


def scan_step_mistakes(*args: torch.Tensor) -> list[tuple[str, tuple | None]]:
    return [(hint, _finite_or_none(scan_step_variant(*args, mistake=m))) for m, hint in (
        ("exp A", HINT_SCAN_EXP_A), ("euler", HINT_SCAN_EULER), ("no delta B", HINT_SCAN_NO_DELTA_B),
        ("zoh", HINT_SCAN_ZOH), ("no D", HINT_SCAN_NO_D), ("D y", HINT_SCAN_D_Y), ("D only y", HINT_SCAN_D_Y),
        ("read before", HINT_SCAN_READ_BEFORE), ("swapped", HINT_SCAN_SWAPPED), ("sign", HINT_SCAN_SIGN),
        ("C axis", HINT_SCAN_C_AXIS), ("old state", HINT_SCAN_OLD_STATE))]


def _scan_shapes(t: list[torch.Tensor]) -> tuple[str, str]:
    return "(batch, d_inner): one output per channel", "(batch, d_inner, d_state), the state's shape"


SCAN_STEP = Spec("scan_step", HINT_SCAN_CALL, ("y_t", "new_h"), _scan_shapes, reference_scan_step, scan_step_mistakes,
                 HINT_SCAN_MUTATED, WHY_SCAN_PAIR)
SCAN_STEP_RUN = STEP_RUN_TEMPLATE.replace("FUNCTION", "scan_step")


def scan_step_cases(rng: np.random.Generator, label: Callable[[int, str], str] = lambda i, w: w) -> list[dict]:
    """Steps of ordinary size (float64), large and tiny steps side by side (float32: delta 50 with A down to -20, where
    exp(delta A) is 0, and delta 1e-4), a square case (d_inner = d_state), one sample."""
    cases = []
    for i, (batch, d_inner, d_state, dtype, kind) in enumerate([
            (2, 5, 3, np.float64, "ordinary"), (3, 4, 6, np.float32, "large and tiny"),
            (2, 4, 4, np.float32, "square"), (1, 6, 2, np.float64, "ordinary")]):
        d_inner += int(rng.integers(0, 2)) if kind != "square" else 0
        if kind == "large and tiny":
            delta = np.where(rng.random((batch, d_inner)) < 0.5, 50.0, 1e-4)
            delta[0, 0], delta[0, 1] = 50.0, 1e-4
            A = -rng.uniform(1.0, 20.0, (d_inner, d_state))
            A[:, 0] = -20.0
        else:
            delta = rng.uniform(0.05, 1.5, (batch, d_inner))
            A = -rng.uniform(0.5, 4.0, (d_inner, d_state))
        arrays = [rng.standard_normal((batch, d_inner, d_state)), rng.standard_normal((batch, d_inner)), delta, A,
                  rng.standard_normal((batch, d_state)), rng.standard_normal((batch, d_state)),
                  rng.uniform(0.5, 2.0, d_inner)]
        what = (f"batch {batch}, d_inner {d_inner}, d_state {d_state}, {np.dtype(dtype).name}"
                + {"large and tiny": ", steps of 50 (A down to -20) and of 1e-4", "square": " (d_inner = d_state)"}.get(
                    kind, ""))
        cases.append(_case(label(i, what), SCAN_STEP_NAMES, arrays, dtype))
    return cases


@checker("the selective scan's step")
def check_scan_step(scan_step) -> None:
    """Check ``scan_step(h, x_t, delta_t, A, B_t, C_t, D)`` against :func:`tfedu.recurrences.selective_scan_step`."""
    _refuse(scan_step, "scan_step", "the step")
    cases = scan_step_cases(np.random.default_rng(1903))
    judge(SCAN_STEP, _run(SCAN_STEP_RUN, "scan_step", scan_step, {"cases": cases})["results"], cases)


# ----------------------------------------------------------------------------- 19.4 the gated delta rule's step

DELTA_STEP_NAMES = ("state", "q_t", "k_t", "v_t", "beta_t", "g_t")
HINT_DELTA_CALL = ("delta_step(state, q_t, k_t, v_t, beta_t, g_t): state (batch, n_heads, d_head, d_v), q_t and k_t "
                   "(batch, n_heads, d_head), v_t (batch, n_heads, d_v), beta_t and g_t (batch, n_heads), g_t a decay "
                   "in (0, 1] as in 19.1; return (o_t, new_state). The state's rows are indexed by the key")
HINT_DELTA_MUTATED = ("delta_step changed its input {names} in place (on {what}): the caller keeps the old state, so "
                      "build the new state as a new tensor")
HINT_DELTA_PLAIN = (
    "you wrote the plain linear-attention term, k_t^T v_t (scaled by beta_t or not), with nothing taken away: the "
    "delta rule first reads what the gated state already holds under k_t, the old value k_t S', and writes only the "
    "difference, beta_t k_t^T (v_t - k_t S'), so a key written twice is replaced rather than piled up"
)
HINT_DELTA_OLD_BEFORE_GATE = (
    "you read the old value from the state before the gate, k_t S_{t-1}: the state fades first (S' = g_t S_{t-1}), "
    "and the correction removes what the faded state holds under k_t, k_t S'"
)
HINT_DELTA_GATE_AFTER = ("you applied the gate after the write, g_t (S + write): the gate fades the old state first; "
                         "the correction and the new value are then written whole")
HINT_DELTA_NO_GATE = ("your state ignores the gate: the delta rule's write on S_{t-1} as it stands is DeltaNet without "
                      "the gate. Gated DeltaNet first scales the old state by g_t (in (0, 1]: old memories fade), as "
                      "in 19.1, then reads the old value from the faded state and writes the correction")
HINT_DELTA_EXP_GATE = ("you decayed the state by exp(g_t), as if g_t were a log-gate: here g_t is the decay itself, in "
                       "(0, 1] as in 19.1 and 19.2, and scales the state as it is (the library's layer takes the "
                       "logarithm of the decay, and exponentiates that; this exercise passes the decay)")
HINT_DELTA_BETA_V = ("you scaled the new value by beta_t but not the old one: beta_t (v_t - k_t S') scales the whole "
                     "difference, so with beta_t = 1 the old value is replaced and with beta_t = 0 nothing changes")
HINT_DELTA_NO_BETA = ("your write has no beta_t: the correction is scaled by the step size beta_t in [0, 1] (a step "
                      "of gradient descent with rate beta_t), and beta_t = 0 leaves the state alone")
HINT_DELTA_QUERY_OLD = ("you read the old value with the query: the value to replace is the one stored under the key "
                        "being written, k_t S' (the query only reads the output)")
HINT_DELTA_READ_BEFORE = ("your o_t reads the state before step t's write: the output reads the new state S_t, after "
                          "the gate and the correction")
HINT_DELTA_SIGN = ("the correction's sign is flipped: the write moves the value stored under k_t toward v_t, adding "
                   "beta_t k_t^T (v_t - k_t S'), the new value minus the old one")
HINT_DELTA_TRANSPOSED = (
    "your outer product is the wrong way round: the state is (d_head, d_v), rows indexed by the key, so the write is "
    "k_t^T times the row of value corrections (with d_head = d_v the shapes do not tell)"
)
HINT_DELTA_OLD_STATE = ("you returned the old state: the second result is the new state S_t, which the next step "
                        "starts from")
WHY_DELTA_PAIR = "The new state goes back too: the caller passes it to the next step."


def reference_delta_step(state: torch.Tensor, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor,
                         beta_t: torch.Tensor, g_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tfedu.delta_rule.delta_rule_step` with the gate given as a decay g_t in (0, 1] (the library takes its
    log, the log-gate of Gated DeltaNet's code)."""
    return delta_rule_step(state, q_t, k_t, v_t, beta_t, g_t.log())


def delta_step_variant(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                       g: torch.Tensor, mistake: str = "") -> tuple[torch.Tensor, torch.Tensor] | None:
    """19.4 done right (``mistake=""``) or with one slip; None where the slip would raise."""
    decay = {"no gate": lambda: torch.ones_like(g), "exp gate": lambda: g.exp()}.get(mistake, lambda: g)()
    gate = decay[..., None, None]
    b = beta[..., None]
    gated = gate * state
    source = state if mistake in ("old before gate", "gate after") else gated
    old = torch.einsum("bhd,bhde->bhe", q if mistake == "query old" else k, source)
    change = {"plain": lambda: b * v, "plain no beta": lambda: v, "beta v": lambda: b * v - old,
              "no beta": lambda: v - old, "sign": lambda: b * (old - v), "sign plus": lambda: b * (v + old)}.get(
        mistake, lambda: b * (v - old))()
    if mistake == "transposed":
        if k.shape[-1] != v.shape[-1]:
            return None
        write = change[..., :, None] * k[..., None, :]
    else:
        write = k[..., :, None] * change[..., None, :]
    new = gate * (state + write) if mistake == "gate after" else gated + write
    read = {"read before": state, "read gated": gated}.get(mistake, new)
    o = torch.einsum("bhd,bhde->bhe", q, read)
    return o, (state if mistake == "old state" else new)


def delta_step_mistakes(*args: torch.Tensor) -> list[tuple[str, tuple | None]]:
    return [(hint, _finite_or_none(delta_step_variant(*args, mistake=m))) for m, hint in (
        ("plain", HINT_DELTA_PLAIN), ("plain no beta", HINT_DELTA_PLAIN), ("old before gate", HINT_DELTA_OLD_BEFORE_GATE),
        ("gate after", HINT_DELTA_GATE_AFTER), ("no gate", HINT_DELTA_NO_GATE), ("exp gate", HINT_DELTA_EXP_GATE),
        ("beta v", HINT_DELTA_BETA_V), ("no beta", HINT_DELTA_NO_BETA),
        ("query old", HINT_DELTA_QUERY_OLD), ("read before", HINT_DELTA_READ_BEFORE),
        ("read gated", HINT_DELTA_READ_BEFORE), ("sign", HINT_DELTA_SIGN), ("sign plus", HINT_DELTA_SIGN),
        ("transposed", HINT_DELTA_TRANSPOSED), ("old state", HINT_DELTA_OLD_STATE))]


DELTA_STEP = Spec("delta_step", HINT_DELTA_CALL, ("o_t", "new_state"), _state_step_shapes, reference_delta_step,
                  delta_step_mistakes, HINT_DELTA_MUTATED, WHY_DELTA_PAIR)
DELTA_STEP_RUN = STEP_RUN_TEMPLATE.replace("FUNCTION", "delta_step")


def delta_step_cases(rng: np.random.Generator, label: Callable[[int, str], str] = lambda i, w: w) -> list[dict]:
    """Unit keys (as the layer makes them), beta in [0.1, 1] with some exactly 1, gates in [0.2, 1] with some exactly
    1; d_v different from d_head in float64 and float32, a square case, a large state."""
    cases = []
    for i, (batch, heads, d_head, d_v, dtype, scale) in enumerate([
            (2, 3, 4, 3, np.float64, 1.0), (3, 2, 5, 2, np.float32, 1.0), (2, 2, 4, 4, np.float32, 1.0),
            (1, 3, 6, 5, np.float64, 20.0)]):
        d_head += int(rng.integers(0, 2)) if d_head != d_v else 0
        k = rng.standard_normal((batch, heads, d_head))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        beta = rng.uniform(0.1, 1.0, (batch, heads))
        beta.reshape(-1)[::3] = 1.0
        arrays = [scale * rng.standard_normal((batch, heads, d_head, d_v)), rng.standard_normal((batch, heads, d_head)),
                  k, rng.standard_normal((batch, heads, d_v)), beta, _gates(rng, (batch, heads), 0.2)]
        what = (f"batch {batch}, {heads} heads, d_head {d_head}, d_v {d_v}, {np.dtype(dtype).name}"
                + (" (square, d_head equal to d_v)" if d_head == d_v else "") + (", a large state" if scale > 1 else ""))
        cases.append(_case(label(i, what), DELTA_STEP_NAMES, arrays, dtype))
    return cases


@checker("the gated delta rule's step")
def check_delta_step(delta_step) -> None:
    """Check ``delta_step(state, q_t, k_t, v_t, beta_t, g_t)`` against :func:`reference_delta_step`
    (:func:`tfedu.delta_rule.delta_rule_step` with the log of the decay)."""
    _refuse(delta_step, "delta_step", "the delta rule's step")
    cases = delta_step_cases(np.random.default_rng(1904))
    judge(DELTA_STEP, _run(DELTA_STEP_RUN, "delta_step", delta_step, {"cases": cases})["results"], cases)


# ----------------------------------------------------------------------------- the hidden tests and the hints


def _probe_inputs(cases: Callable) -> Callable[[np.random.Generator], dict]:
    def make(rng: np.random.Generator) -> dict:
        made = cases(rng, _hidden)
        return made if isinstance(made, dict) else {"cases": made}

    return make


PROBES = {
    "check_gla_step": Probe(
        exercise="ex_gla_step",
        make_inputs=_probe_inputs(gla_step_cases),
        run=GLA_STEP_RUN,
        reference=lambda inputs: dict(inputs),
        compare=_compare(GLA_STEP),
        forbidden=FORBIDDEN,
        builds=ELEMENTARY | EINOPS),
    "check_gla_chunked": Probe(
        exercise="ex_gla_chunked",
        make_inputs=_probe_inputs(gla_chunked_cases),
        run=GLA_CHUNKED_RUN,
        reference=lambda inputs: dict(inputs),
        compare=_compare(GLA_CHUNKED, _chunked_extra, _judge_probe_calls),
        forbidden=FORBIDDEN,
        builds=ELEMENTARY | EINOPS),
    "check_scan_step": Probe(
        exercise="ex_scan_step",
        make_inputs=_probe_inputs(scan_step_cases),
        run=SCAN_STEP_RUN,
        reference=lambda inputs: dict(inputs),
        compare=_compare(SCAN_STEP),
        forbidden=FORBIDDEN,
        builds=ELEMENTARY | EINOPS),
    "check_delta_step": Probe(
        exercise="ex_delta_step",
        make_inputs=_probe_inputs(delta_step_cases),
        run=DELTA_STEP_RUN,
        reference=lambda inputs: dict(inputs),
        compare=_compare(DELTA_STEP),
        forbidden=FORBIDDEN,
        builds=ELEMENTARY | EINOPS),
}


HINTS = {
    "ex_gla_step": Hints(
        number="19.1",
        check="check_gla_step",
        idea=(
            "The state is a small matrix per head, d_head rows by d_v columns: a memory of every key-value pair "
            "written so far, each as the outer product of the key (a column) and the value (a row). One step fades "
            "the whole memory by the gate g_t, adds the new pair's outer product undimmed, and then reads the "
            "updated memory with the query: a row vector of d_v numbers per head."
        ),
        approach=(
            "Give the gate two trailing axes of size 1 so that it scales each head's whole (d_head, d_v) matrix. Form "
            "the outer product of k_t and v_t per batch and head by giving the key a trailing axis of size 1 and the "
            "value a new axis before its last, and multiplying: that is (batch, n_heads, d_head, d_v). The new state "
            "is the gated old state plus that. For the read, contract the query with the new state over d_head (an "
            "einsum, or a matrix product of the query as a one-row matrix). Return both, the new state as a new "
            "tensor (no in-place update of the state passed in)."
        ),
        skeleton=(
            "def gla_step(state, q_t, k_t, v_t, g_t):\n"
            "    outer = ____  # (batch, n_heads, d_head, d_v)\n"
            "    new_state = ____  # the faded old state plus the new pair\n"
            "    o_t = ____  # the query's read of the new state, (batch, n_heads, d_v)\n"
            "    return o_t, new_state\n"
        ),
    ),
    "ex_gla_chunked": Hints(
        number="19.2",
        check="check_gla_chunked",
        idea=(
            "Cut the sequence into chunks and carry only the state from one chunk to the next. Inside a chunk, let b "
            "be the running sum of log g from the chunk's start, up to and including each position. A query at t "
            "gets two things: the state that entered the chunk, faded by exp(b_t), and the chunk's own keys s <= t, "
            "each weighted by (q_t . k_s) exp(b_t - b_s): attention without softmax, with a causal mask of decays. "
            "Then the state moves on: the entering state faded by exp(b_last), plus each key's outer product with its "
            "value faded by exp(b_last - b_s). Sums of logs never underflow where products of gates would."
        ),
        approach=(
            "Start from a zero state (batch, n_heads, d_head, d_v) in the inputs' dtype and take the logs of the "
            "gates once. Loop over chunk starts in steps of chunk; each chunk ends at the smaller of its start plus "
            "chunk and pos, so the last may be shorter. Slice q, k, v and the log gates; take the cumulative sum of "
            "the log gates along the positions; build the (c, c) matrix of differences b_t - b_s, fill the entries "
            "above the diagonal with minus infinity and take the exponential. The chunk's output is the masked, "
            "decayed score matrix times the values, plus exp(b) times the queries' read of the state. Update the "
            "state as above, collect the outputs and join them along the positions at the end."
        ),
        skeleton=(
            "def gla_chunked(q, k, v, g, chunk):\n"
            "    state = ____  # zeros, (batch, n_heads, d_head, d_v), in the inputs' dtype\n"
            "    log_g = ____\n"
            "    outs = []\n"
            "    for start in ____:  # each chunk's first position\n"
            "        end = ____  # the last chunk may be shorter\n"
            "        q_c, k_c, v_c, lg = ____  # this chunk's slices\n"
            "        b = ____  # running sums of the log gates in the chunk\n"
            "        decay = ____  # (c, c): exp(b_t - b_s) on and below the diagonal, 0 above\n"
            "        inside = ____  # the chunk's own keys\n"
            "        from_state = ____  # the state that entered the chunk, read and faded\n"
            "        outs.append(____)\n"
            "        state = ____  # faded by the whole chunk, plus its keys faded to the chunk's end\n"
            "    return ____, state\n"
        ),
    ),
    "ex_scan_step": Hints(
        number="19.3",
        check="check_scan_step",
        idea=(
            "Every channel of d_inner runs its own little linear system with d_state numbers of memory. The step "
            "delta_t turns the continuous decay A into a factor per step, the exponential of delta_t times A (in "
            "(0, 1] since A is negative: a large step forgets, a tiny one keeps), and scales what is written, B_t "
            "times the channel's input x_t. After the update, C_t reads each channel's d_state numbers down to one, "
            "and D passes the input straight through."
        ),
        approach=(
            "Give delta_t a trailing axis so that it multiplies A (d_inner, d_state) per sample: the decay is the "
            "exponential of that product, (batch, d_inner, d_state). The write is delta_t times x_t (both with a "
            "trailing axis) times B_t with a new axis for the channels. The new state is the decay times the old "
            "state plus the write. The output sums the new state times C_t (with a channels axis) over d_state, plus "
            "D times x_t."
        ),
        skeleton=(
            "def scan_step(h, x_t, delta_t, A, B_t, C_t, D):\n"
            "    A_bar = ____  # (batch, d_inner, d_state)\n"
            "    write = ____  # (batch, d_inner, d_state)\n"
            "    new_h = ____\n"
            "    y_t = ____  # (batch, d_inner)\n"
            "    return y_t, new_h\n"
        ),
    ),
    "ex_delta_step": Hints(
        number="19.4",
        check="check_delta_step",
        idea=(
            "Fade the state by the gate first, as in 19.1. Then, before writing, ask the faded state what it already "
            "holds under this key: the key's read of it, a row of d_v numbers. Write only the difference between the "
            "new value and that old one, scaled by beta_t, as the key's outer product with it. With a unit key and "
            "beta_t = 1 the old value is replaced exactly; keys at right angles are untouched. The output reads the "
            "new state with the query."
        ),
        approach=(
            "Scale the state by the gate (with two trailing axes). Contract the key with the faded state over d_head "
            "to get the old value (batch, n_heads, d_v). The correction is beta_t (with a trailing axis) times the "
            "new value minus the old one. Add the outer product of the key and the correction to the faded state. "
            "Contract the query with the result over d_head for the output; return both."
        ),
        skeleton=(
            "def delta_step(state, q_t, k_t, v_t, beta_t, g_t):\n"
            "    faded = ____\n"
            "    old = ____  # what the faded state holds under k_t, (batch, n_heads, d_v)\n"
            "    correction = ____\n"
            "    new_state = ____\n"
            "    o_t = ____\n"
            "    return o_t, new_state\n"
        ),
    ),
}
