"""Checkers for notebooks/18_serving.ipynb: speculative sampling's acceptance step, the paged cache's gather and the
continuous-batching scheduler's admission.

Exercise 18.1, ``accept_reject(p, q, draft_tokens, generator) -> (n_accepted, next_token)``: one round of speculative
sampling for one sequence (Leviathan et al. 2023; Chen et al. 2023), as :func:`tfedu.speculative.accept_reject`:
draft token i is accepted when a uniform draw is below ``p_i(x_i) / q_i(x_i)``; at the first rejection the next
token is drawn from ``max(0, p_i - q_i)`` normalised; after k acceptances from ``p_k``. An answer may draw its random
numbers in any order, so no single draw is compared: the check calls the answer thousands of times and compares
the *distribution* of ``(n_accepted, next_token)`` with the exact one, computed by enumerating the accept/reject
patterns (:func:`outcome_law`). Outcomes the rule never gives fail at once (p equal to q, one-hot targets, a draft
token of target probability 0, k = 0, a vocabulary of 50,000); on the statistical cases the total variation distance
must stay within a bound that a right answer exceeds with probability below one in a million (:func:`tv_tolerance`).
Named, each when its own exact law explains every case: the ratio inverted (q/p), p(x) alone (q ignored), a
comparison of p and q with no draw, one random number for every draft token, the replacement drawn from p, the
residual's sign swapped (max(0, q - p)), an argmax where a draw belongs, going on after the first rejection, the
bonus token from the wrong row (p[k - 1], q, a draft token), the rows of p off by one, n_accepted counting the
replacement, and random numbers not drawn from the generator passed in. See :func:`check_accept_reject`.

Exercise 18.2, ``gather_blocks(pool, block_table, length) -> keys``: one sequence's ``(n_kv_heads, length, d_head)``
keys read from a pool ``(n_blocks, n_kv_heads, block_size, d_head)`` through its block table (a list of ints), as
:func:`tfedu.paged.gather_blocks`. Every pool entry is distinct, so a wrong answer is told where each position's
key came from. Named: not cut to ``length``, block and offset swapped, the pool's axes not moved, the table read
reversed or sorted, the table ignored (contiguous blocks), the last partial block dropped; length 0 must give an
empty result. See :func:`check_gather_blocks`.

Exercise 18.3, ``admit(waiting, n_running, n_free_blocks, *, max_batch, block_size) -> int``: how many requests from
the head of the FIFO queue to admit, as :func:`tfedu.batching.admit`: while the batch has a free row and the
request's blocks, ``ceil((len(prompt) + max_new_tokens - 1) / block_size)``, fit in what is left of
``n_free_blocks``; the first that does not fit stops the admission. Named: overtaking, the batch limit ignored (or
the running requests left out of it, or one row too many), the blocks ignored, the prompt's blocks only, floor
division, one position too many, the blocks of the requests admitted before not subtracted, an exact fit refused,
a list returned. See :func:`check_admit`.

``tfedu.speculative``, ``tfedu.paged`` and ``tfedu.batching``'s ``admit`` and ``blocks_needed`` (the references) are
refused.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import torch

from tfedu.batching import Request, admit, blocks_needed
from tfedu.checks.building_blocks import EINOPS, ELEMENTARY
from tfedu.checks.core import (NOT_DONE_MESSAGE, CheckFailure, ExerciseNotDone, Hints, Probe, call_learner, checker,
                               describe, global_names, globals_from_modules)
from tfedu.paged import gather_blocks
from tfedu.speculative import accept_reject

HINT_SHORTCUT = "your {function} uses {names} from tfedu: {what} is the exercise, so build it from tensor operations"


def _refuse(fn: Any, modules: tuple[str, ...], function: str, what: str) -> None:
    names = globals_from_modules(fn, modules)
    if names:
        raise CheckFailure(HINT_SHORTCUT.format(function=function, names=", ".join(names), what=what))


# ----------------------------------------------------------------------------- 18.1 the acceptance step

AR_FORBIDDEN = ("tfedu.speculative",)
HINT_AR_CALL = ("accept_reject(p, q, draft_tokens, generator): p (k + 1, d_vocab) and q (k, d_vocab) float tensors "
                "of probabilities, draft_tokens (k,) int64, generator a torch.Generator; return (n_accepted, "
                "next_token), two ints")
HINT_AR_TYPE = ("accept_reject returned {got} on {what}: return a pair of ints (n_accepted, next_token). Every call "
                "gives a next token, also when every draft token is accepted (then it is drawn from the last row "
                "of p)")
HINT_AR_RANGE = ("accept_reject returned (n_accepted, next_token) = ({n}, {y}) on {what}: with k = {k} draft tokens "
                 "and a vocabulary of {d_vocab}, n_accepted lies in 0..{k} and next_token in 0..{last}")
HINT_AR_MUTATED = ("accept_reject changed one of its input tensors in place (on {what}): the caller keeps using p, "
                   "q and the draft tokens, so build new tensors instead")
HINT_AR_RAISED = "accept_reject {error} on {what} ({call})"
HINT_AR_NEVER = ("on {what}: (n_accepted, next_token) = ({n}, {y}) came out in {count} of {calls} calls, which the "
                 "rule never gives: {why}")
HINT_AR_DIFFERS = (
    "on {what}, over {calls} calls, your distribution of (n_accepted, next_token) is {tv:.3f} from the rule's in "
    "total variation, where a right answer stays within {tol:.3f} (a bound a correct sampler exceeds with "
    "probability below one in a million). Most off: ({n}, {y}) came out {got:.1%} of the time; the rule gives it "
    "{want:.1%}"
)
HINT_AR_INVERTED = (
    "you accept a draft token with probability q(x) / p(x), the ratio upside down: the draft token x is kept with "
    "probability min(1, p(x) / q(x)), target over draft, so a token the target likes less than the draft did is "
    "kept less often, and one the target gives probability 0 is never kept"
)
HINT_AR_P_ONLY = (
    "you accept a draft token with probability p(x), the target's probability alone: the rule divides it by the "
    "draft's, min(1, p(x) / q(x)), so a token the target likes at least as much as the draft is always kept. (With "
    "a one-hot q, prompt lookup, the two agree; with a sampled draft they do not)"
)
HINT_AR_COMPARE = (
    "you accept or reject each draft token by comparing p(x) with q(x), with no random draw: a token the target "
    "likes less than the draft is still kept, with probability p(x) / q(x). Draw a uniform number in [0, 1) for each "
    "draft token examined and keep the token when it falls below the ratio"
)
HINT_AR_SHARED_R = (
    "you drew one random number and compared it with every draft token's ratio: each draft token examined gets a "
    "fresh draw of its own, so that its acceptance is independent of the ones before"
)
HINT_AR_REPLACE_P = (
    "at a rejection you drew the replacement from p, the target's distribution itself: that over-weights the tokens "
    "the draft proposes often (they already come out as accepted drafts). The replacement is drawn from the "
    "residual, max(0, p - q) normalised, which puts back exactly the probability the acceptance step lost"
)
HINT_AR_RES_SWAPPED = (
    "at a rejection you drew the replacement from max(0, q - p): the sign is swapped. The replacement comes from "
    "where the target has *more* probability than the draft, max(0, p - q) normalised (the rejected draft token has "
    "p < q, so it is never drawn again)"
)
HINT_AR_GREEDY = (
    "you took the most probable token (an argmax) where a token must be drawn at random: the replacement after a "
    "rejection is sampled from the residual max(0, p - q) normalised, and the bonus token after k acceptances from "
    "the last row of p. An argmax breaks the guarantee that the output is distributed as the target's"
)
HINT_AR_NO_STOP = (
    "you go on examining draft tokens after the first rejection: once draft token i is rejected, the tokens after "
    "it were drafted from a context the target has not accepted, so they are discarded. Stop at the first "
    "rejection: n_accepted is i, and next_token is drawn from the residual at position i"
)
HINT_AR_BONUS = (
    "when every draft token is accepted, the extra (bonus) token must be drawn from p[k], the target's distribution "
    "after all k draft tokens (the last row of p, the one no draft token is judged by): you took it from elsewhere "
    "(an earlier row of p, the draft's q, or a draft token)"
)
HINT_AR_SHIFT = ("you are off by one row of p: draft token i is judged by p[i], the target's distribution after the "
                 "context and the draft tokens before i (the row the draft's q[i] matches), not by p[i + 1]")
HINT_AR_COUNT = (
    "n_accepted counts the draft tokens accepted, not the tokens emitted: at a rejection of draft token i it is i "
    "(the replacement is next_token, not an accepted draft), and k when every draft token is accepted"
)
HINT_AR_GENERATOR = (
    "two calls with generators seeded alike gave different results: draw every random number from the generator "
    "passed in (the generator= argument of torch.rand and torch.multinomial), so that a seeded run repeats itself"
)

AR_CALLS = 4000  # calls per statistical case, in the check and the probe
AR_DELTA = 1e-6  # the chance that a right answer fails one case's distribution test


def _ar_reference_knobs() -> dict[str, Any]:
    return dict(how="ratio", shift=0, res="residual", bonus="p_k", stop="first", count="accepted", shared=False)


# (hint, variants): each variant changes the rule in one place (see outcome_law); the first whose law explains every
# case is named.
AR_MISTAKES: list[tuple[str, list[dict[str, Any]]]] = [
    (HINT_AR_INVERTED, [dict(how="inverted")]),
    (HINT_AR_P_ONLY, [dict(how="p")]),
    (HINT_AR_COMPARE, [dict(how="ge"), dict(how="gt")]),
    (HINT_AR_SHIFT, [dict(shift=1)]),
    (HINT_AR_COUNT, [dict(count="emitted"), dict(count="plus")]),
    (HINT_AR_RES_SWAPPED, [dict(res="swapped")]),
    (HINT_AR_REPLACE_P, [dict(res="p")]),
    (HINT_AR_GREEDY, [dict(res="argmax"), dict(res="argmax", bonus="argmax"), dict(bonus="argmax")]),
    (HINT_AR_NO_STOP, [dict(stop="last"), dict(stop="no stop, first")]),
    (HINT_AR_BONUS, [dict(bonus="p[k-1]"), dict(bonus="q[k-1]"), dict(bonus="draft")]),
    (HINT_AR_SHARED_R, [dict(shared=True)]),
]


def _normalised(weights: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    total = weights.sum()
    return weights / total if total > 0 else fallback


def _one_hot(index: int, d_vocab: int) -> np.ndarray:
    out = np.zeros(d_vocab)
    out[index] = 1.0
    return out


def outcome_law(p: Any, q: Any, draft_tokens: Any, **knobs: Any) -> np.ndarray | None:
    """The exact law of ``(n_accepted, next_token)``: an array ``(k + 2, d_vocab)`` whose entry ``[n, y]`` is the
    probability of that outcome (row k + 1 is for answers that count k + 1), or None where a variant is undefined.

    Enumerates the 2^k accept/reject patterns of the draft tokens, each with its probability (independent draws, or
    one shared draw), and adds the next token's distribution for each. ``knobs`` change the rule in one place each
    (the named mistakes): ``how`` the acceptance probability ("ratio" min(1, p/q), "inverted" min(1, q/p), "p",
    "ge"/"gt" a comparison with no draw), ``shift`` the row of p, ``res`` the replacement ("residual", "p",
    "swapped", "argmax"), ``bonus`` the token after k acceptances ("p_k", "argmax", "p[k-1]", "q[k-1]", "draft"),
    ``stop`` ("first"; "last" and "no stop, first" go on past a rejection, keeping the last or first replacement),
    ``count`` ("accepted", "emitted", "plus": the replacement counted), ``shared`` (one draw for all).

    >>> p, q = [[0.5, 0.5], [1.0, 0.0]], [[0.25, 0.75]]  # token 1: accepted with probability 2/3, else 0 drawn
    >>> outcome_law(p, q, [1]).round(3).tolist()  # rows: n_accepted = 0, 1, 2; columns: the next token
    [[0.333, 0.0], [0.667, 0.0], [0.0, 0.0]]
    """
    v = {**_ar_reference_knobs(), **knobs}
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    tokens = [int(t) for t in np.asarray(draft_tokens).reshape(-1)]
    k, d_vocab = len(tokens), p.shape[1]
    accept = []
    for i, x in enumerate(tokens):
        pi, qi = p[i + v["shift"], x], q[i, x]
        accept.append({"ratio": min(1.0, pi / qi), "inverted": 1.0 if pi == 0 else min(1.0, qi / pi), "p": pi,
                       "ge": float(pi >= qi), "gt": float(pi > qi)}[v["how"]])

    def replacement(i: int) -> np.ndarray:
        pi, qi = p[i + v["shift"]], q[i]
        if v["res"] == "p":
            return pi
        if v["res"] == "swapped":
            return _normalised(np.maximum(0.0, qi - pi), pi)
        if v["res"] == "argmax":
            return _one_hot(int(np.argmax(np.maximum(0.0, pi - qi))), d_vocab)
        return _normalised(np.maximum(0.0, pi - qi), pi)

    def bonus() -> np.ndarray | None:
        if v["bonus"] == "p_k":
            return p[k]
        if v["bonus"] == "argmax":
            return _one_hot(int(np.argmax(p[k])), d_vocab)
        if k == 0:
            return None  # an answer with this slip indexes an empty tensor
        return {"p[k-1]": p[k - 1], "q[k-1]": q[k - 1], "draft": _one_hot(tokens[-1], d_vocab)}[v["bonus"]]

    law = np.zeros((k + 2, d_vocab))
    for pattern in itertools.product((True, False), repeat=k):
        if v["shared"]:
            below = min([accept[i] for i in range(k) if pattern[i]], default=1.0)
            above = max([accept[i] for i in range(k) if not pattern[i]], default=0.0)
            chance = max(0.0, below - above)
        else:
            chance = math.prod(accept[i] if pattern[i] else 1.0 - accept[i] for i in range(k))
        if chance == 0:
            continue
        rejected = [i for i in range(k) if not pattern[i]]
        if not rejected:
            dist = bonus()
            if dist is None:
                return None
            n = k + (v["count"] == "emitted")
        elif v["stop"] == "first":
            dist, n = replacement(rejected[0]), rejected[0] + (v["count"] in ("emitted", "plus"))
        else:
            dist, n = replacement(rejected[-1] if v["stop"] == "last" else rejected[0]), sum(pattern)
        law[n] += chance * dist
    return law


def reference_accept_reject(p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor,
                            generator: torch.Generator | None = None) -> tuple[int, int]:
    return accept_reject(p, q, draft_tokens, generator)


def tv_tolerance(law: np.ndarray, calls: int, delta: float = AR_DELTA) -> float:
    """How far (total variation) ``calls`` draws from ``law`` may fall from it, but with probability ``delta``.

    The expected L1 distance is at most sum_j sqrt(p_j (1 - p_j) / calls) (Jensen, per outcome), and one draw moves
    the L1 distance by at most 2 / calls, so by McDiarmid's inequality it exceeds its mean by t with probability at
    most exp(-calls t^2 / 2). Total variation is half the L1 distance.
    """
    mean = float(np.sqrt(law * (1 - law) / calls).sum())
    return 0.5 * (mean + math.sqrt(2 * math.log(1 / delta) / calls))


def _ar_distribution(rows: Any, k: int, d_vocab: int) -> np.ndarray:
    counts = np.zeros((k + 2, d_vocab))
    for n, y, c in rows:
        counts[n, y] += c
    return counts


def _ar_consistent(counts: np.ndarray, law: np.ndarray, calls: int, statistical: bool) -> bool:
    """Whether the observed ``counts`` could come from ``law``: no outcome of probability 0, and, on a statistical
    case, a total variation within :func:`tv_tolerance`."""
    if (counts[law <= 0] > 0).any():
        return False
    return not statistical or 0.5 * float(np.abs(counts / calls - law).sum()) <= tv_tolerance(law, calls)


def _never_why(case: dict, n: int, y: int) -> str:
    """Why the rule never gives ``(n, y)`` on ``case``, in words."""
    p, q = np.asarray(case["p"], dtype=np.float64), np.asarray(case["q"], dtype=np.float64)
    tokens = [int(t) for t in case["draft"]]
    k = len(tokens)
    zero = next((i for i, x in enumerate(tokens[:n]) if p[i, x] == 0), None)
    if zero is not None:
        return (f"draft token {zero} ({tokens[zero]}) has target probability p = 0, so it is always rejected and "
                f"nothing after it is accepted")
    if n < k and p[n, tokens[n]] >= q[n, tokens[n]]:
        return (f"draft token {n} ({tokens[n]}) has p = {p[n, tokens[n]]:.3g} >= q = {q[n, tokens[n]]:.3g}, so it is "
                "always accepted")
    if n < k:
        return (f"after a rejection at position {n} the replacement is drawn from max(0, p - q) normalised, where "
                f"token {y} has weight 0 (p = {p[n, y]:.3g}, q = {q[n, y]:.3g})")
    if n == k:
        return f"after all {k} draft tokens are accepted the next token is drawn from p[{k}], where token {y} has p = 0"
    return f"n_accepted is at most k = {k}"


def judge_ar(results: list[Any], cases: list[dict]) -> None:
    """Raise a CheckFailure naming the mistake unless the outcomes tallied in ``results`` (one per case: a dict with
    ``counts`` rows (n, y, count) and ``problem``, or a string) follow the rule's exact law on every case."""
    problems: list[CheckFailure] = []
    ran: list[tuple[dict, np.ndarray]] = []  # (case, counts) of the cases the answer ran through
    for result, case in zip(results, cases):
        k, d_vocab, what = len(case["draft"]), np.asarray(case["p"]).shape[1], case["what"]
        problem = result.get("problem") if isinstance(result, dict) else f"no result on {what}"
        if not problem:
            ran.append((case, _ar_distribution(result["counts"], k, d_vocab)))
        elif problem.startswith("raised NotImplementedError"):
            raise ExerciseNotDone(NOT_DONE_MESSAGE)
        elif problem == "mutated":
            problems.append(CheckFailure(HINT_AR_MUTATED.format(what=what)))
        elif problem.startswith("raised "):
            problems.append(CheckFailure(HINT_AR_RAISED.format(error=problem, what=what, call=HINT_AR_CALL)))
        elif problem.startswith("range "):
            n, y = (int(s) for s in problem.split()[1:3])
            problems.append(CheckFailure(HINT_AR_RANGE.format(n=n, y=y, what=what, k=k, d_vocab=d_vocab,
                                                              last=d_vocab - 1)))
        else:
            problems.append(CheckFailure(HINT_AR_TYPE.format(got=problem, what=what)))

    def consistent(**knobs: Any) -> bool:
        for case, counts in ran:
            law = outcome_law(case["p"], case["q"], case["draft"], **knobs)
            if law is not None and not _ar_consistent(counts, law, case["calls"], case["calls"] >= 500):
                return False
        return True

    if consistent():
        if problems:
            raise problems[0]
        for result in results:
            if result.get("repeats") is False:
                raise CheckFailure(HINT_AR_GENERATOR)
        return
    if sum(case["calls"] >= 500 for case, _ in ran) >= 2:  # enough evidence to name a slip
        for hint, variants in AR_MISTAKES:
            if any(consistent(**knobs) for knobs in variants):
                raise CheckFailure(hint)
    if problems:
        raise problems[0]
    distributions = [counts for _, counts in ran]
    cases = [case for case, _ in ran]
    reference_laws = [outcome_law(case["p"], case["q"], case["draft"]) for case in cases]
    statistical = [case["calls"] >= 500 for case in cases]
    for counts, law, case, stat in zip(distributions, reference_laws, cases, statistical):
        calls, what = case["calls"], case["what"]
        impossible = np.argwhere((counts > 0) & (law <= 0))
        if len(impossible):
            n, y = (int(i) for i in impossible[0])
            raise CheckFailure(HINT_AR_NEVER.format(what=what, n=n, y=y, count=int(counts[n, y]), calls=calls,
                                                    why=_never_why(case, n, y)))
        tv = 0.5 * float(np.abs(counts / calls - law).sum())
        if stat and tv > (tol := tv_tolerance(law, calls)):
            n, y = (int(i) for i in np.unravel_index(np.argmax(np.abs(counts / calls - law)), law.shape))
            raise CheckFailure(HINT_AR_DIFFERS.format(what=what, calls=calls, tv=tv, tol=tol, n=n, y=y,
                                                      got=counts[n, y] / calls, want=law[n, y]))
    raise CheckFailure("accept_reject's outcomes do not follow the rule")  # not reached: some case is inconsistent


# Run in the learner's kernel by the probe, and here by the check: one source. For each case, `calls` calls with one
# generator (the global generator seeded too, inside fork_rng, so that an answer that ignores the generator is
# repeatable and the learner's own random state is left alone); then, on the cases marked `repeat`, pairs of calls
# with generators seeded alike, the global one seeded differently.
AR_RUN = """\
def _ar_outcome(value, k, d_vocab):
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return None, (type(value).__name__ + ' of ' + str(len(value)) if isinstance(value, (tuple, list))
                      else 'a ' + type(value).__name__)
    pair = []
    for item in value:
        if isinstance(item, torch.Tensor) and item.numel() == 1 and not item.is_floating_point() \\
                and item.dtype != torch.bool:
            item = int(item.reshape(()).item())
        elif isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
            item = int(item)
        else:
            return None, 'a pair holding ' + (('a tensor of shape ' + str(tuple(item.shape)) + ' ' + str(item.dtype))
                                              if isinstance(item, torch.Tensor) else repr(item)[:40])
        pair.append(item)
    if not (0 <= pair[0] <= k + 1 and 0 <= pair[1] < d_vocab):
        return None, 'range ' + str(pair[0]) + ' ' + str(pair[1])
    return tuple(pair), None


def _ar_case(case):
    p, q = torch.from_numpy(np.array(case['p'])), torch.from_numpy(np.array(case['q']))
    draft = torch.from_numpy(np.array(case['draft'], dtype=np.int64))
    kept = (p.clone(), q.clone(), draft.clone())
    k, d_vocab = draft.shape[0], p.shape[1]
    counts, problem, repeats = {}, None, None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case['seed'] + 1)
        generator = torch.Generator().manual_seed(case['seed'])
        for _ in range(case['calls']):
            try:
                got = accept_reject(p, q, draft, generator)
            except Exception as err:
                problem = 'raised ' + type(err).__name__ + ': ' + str(err)[:200]
                break
            outcome, problem = _ar_outcome(got, k, d_vocab)
            if problem:
                break
            counts[outcome] = counts.get(outcome, 0) + 1
        if problem is None and not all(torch.equal(a, b) for a, b in zip((p, q, draft), kept)):
            problem = 'mutated'
        if problem is None and case['repeat']:
            repeats = True
            for s in range(16):
                once = []
                for again in range(2):
                    torch.manual_seed(1000 * again + s)
                    once.append(_ar_outcome(accept_reject(p, q, draft, torch.Generator().manual_seed(s)), k,
                                            d_vocab)[0])
                repeats = repeats and once[0] == once[1]
    return {'counts': [[n, y, c] for (n, y), c in sorted(counts.items())], 'problem': problem, 'repeats': repeats}


outputs = {'results': [_ar_case(_c) for _c in inputs['cases']]}
del _ar_outcome, _ar_case
"""


def _ar_tally(fn: Any, cases: list[dict]) -> list[dict]:
    """The check's run of :data:`AR_RUN` with ``fn`` as accept_reject."""
    scope = {"accept_reject": fn, "inputs": {"cases": cases}, "np": np, "torch": torch}
    exec(compile(AR_RUN, "<accept_reject's tally>", "exec"), scope)
    return scope["outputs"]["results"]


def _ar_row(probs: list[float]) -> np.ndarray:
    return np.asarray(probs, dtype=np.float32)


def _statistical_cases() -> list[tuple[str, np.ndarray, np.ndarray, list[int]]]:
    """(what, p, q, draft tokens) of the cases judged by their distribution: k = 1, k = 2 with a target probability
    of exactly 0 and one of 1e-9, and k = 2 with a one-hot q (a prompt-lookup draft)."""
    p1 = np.stack([_ar_row([0.05, 0.45, 0.2, 0.3]), _ar_row([0.6, 0.1, 0.1, 0.2])])
    q1 = np.stack([_ar_row([0.1, 0.6, 0.1, 0.2])])
    p2 = np.stack([_ar_row([0.45, 0.3, 0.25 - 1e-9, 1e-9]), _ar_row([0.1, 0.0, 0.3, 0.6]),
                   _ar_row([0.15, 0.55, 0.05, 0.25])])
    q2 = np.stack([_ar_row([0.3, 0.5, 0.1, 0.1]), _ar_row([0.2, 0.3, 0.4, 0.1])])
    p3 = np.stack([_ar_row([0.1, 0.5, 0.15, 0.1, 0.15]), _ar_row([0.2, 0.05, 0.05, 0.5, 0.2]),
                   _ar_row([0.0, 0.2, 0.1, 0.3, 0.4])])
    q3 = np.zeros((2, 5), dtype=np.float32)
    q3[0, 1] = q3[1, 3] = 1.0
    return [("one draft token in a vocabulary of 4", p1, q1, [1]),
            ("two draft tokens, target probabilities of exactly 0 and of 1e-9", p2, q2, [1, 2]),
            ("two draft tokens from a one-hot q (a prompt-lookup draft)", p3, q3, [1, 3])]


def _corner_cases(rng: np.random.Generator, big: int = 50_000) -> list[tuple[str, np.ndarray, np.ndarray, list[int]]]:
    """Cases whose every outcome is certain (or certain to avoid a token), whatever the random draws; ``rng`` picks
    the tokens (the check's is fixed, the probe's fresh)."""
    d = int(rng.integers(6, 10))

    def dist(size: int, zero: tuple[int, ...] = ()) -> np.ndarray:
        w = rng.uniform(0.2, 1.0, size)
        w[list(zero)] = 0.0
        return (w / w.sum()).astype(np.float32)

    def one_hot(i: int, size: int = d) -> np.ndarray:
        out = np.zeros(size, dtype=np.float32)
        out[i] = 1.0
        return out

    cases = []
    tokens = [int(t) for t in rng.integers(0, d, 3)]
    q = np.stack([dist(d) for _ in tokens])
    last = int(rng.integers(d))
    cases.append(("p equal to q at every draft position (k = 3), p[3] one-hot",
                  np.concatenate([q, one_hot(last)[None]]), q, tokens))
    tokens = [int(t) for t in rng.integers(0, d, 2)]
    cases.append(("p one-hot on each draft token (k = 2), p[2] one-hot",
                  np.stack([one_hot(tokens[0]), one_hot(tokens[1]), one_hot(last)]), np.stack([dist(d), dist(d)]),
                  tokens))
    x, other = (int(t) for t in rng.choice(d, 2, replace=False))
    cases.append(("p[0] one-hot on another token than the draft token (k = 1)",
                  np.stack([one_hot(other), dist(d)]), dist(d)[None], [x]))
    cases.append(("no draft tokens at all, the first row of p one-hot", one_hot(last)[None], np.zeros((0, d), dtype=np.float32),
                  []))
    x, y = (int(t) for t in rng.choice(d, 2, replace=False))
    cases.append(("a draft token whose target probability is 0 (k = 2)", np.stack([dist(d, (x,)), dist(d), dist(d)]),
                  np.stack([dist(d), dist(d)]), [x, y]))
    x, far = int(rng.integers(big)), int(rng.integers(big))
    uniform = np.full(big, 1.0 / big, dtype=np.float32)
    cases.append((f"a vocabulary of {big:,}, p[0] one-hot, q uniform (k = 1)",
                  np.stack([one_hot(far, big), uniform]), uniform[None], [x if x != far else (far + 1) % big]))
    cases.append((f"a vocabulary of {big:,}, p equal to q (k = 1), p[1] one-hot",
                  np.stack([uniform, one_hot(far, big)]), uniform[None], [x]))
    return cases


def _ar_inputs(stat: list, corners: list, calls: int, seeds: list[int]) -> list[dict]:
    out = []
    for i, (what, p, q, tokens) in enumerate(stat + corners):
        out.append({"what": what, "p": np.asarray(p, dtype=np.float32), "q": np.asarray(q, dtype=np.float32),
                    "draft": [int(t) for t in tokens], "calls": calls if i < len(stat) else 12,
                    "seed": int(seeds[i]), "repeat": i == 1})
    return out


def ar_cases() -> list[dict]:
    """The check's cases: the statistical ones (4000 calls each), then the corners (12 calls each)."""
    return _ar_inputs(_statistical_cases(), _corner_cases(np.random.default_rng(18)), AR_CALLS,
                      list(range(100, 200, 10)))


@checker("the acceptance-rejection step")
def check_accept_reject(accept_reject) -> None:
    """Check ``accept_reject(p, q, draft_tokens, generator)``: the distribution of its outcomes over thousands of
    calls against :func:`outcome_law`, the outcomes that are certain, and the use of the generator."""
    _refuse(accept_reject, AR_FORBIDDEN, "accept_reject", "the acceptance step")
    cases = ar_cases()
    p, q = torch.from_numpy(cases[0]["p"]), torch.from_numpy(cases[0]["q"])
    call_learner(accept_reject, p, q, torch.tensor(cases[0]["draft"]), torch.Generator().manual_seed(0),
                 name="accept_reject", error_hint=HINT_AR_CALL)
    judge_ar(_ar_tally(accept_reject, cases), cases)


def _perturbed(rng: np.random.Generator, what: str, p: np.ndarray, q: np.ndarray, tokens: list[int]) -> tuple:
    """A statistical case moved to fresh inputs that keep its structure: the vocabulary permuted and padded with tokens
    of probability 0, every probability above 1e-6 scaled by a factor in [0.9, 1.1] and the rows renormalised (exact
    zeros, one-hot rows and the 1e-9 stay)."""
    d = p.shape[1]
    d_new = d + int(rng.integers(0, 4))
    perm = rng.permutation(d_new)[:d]

    def move(rows: np.ndarray) -> np.ndarray:
        rows = rows.astype(np.float64) * np.where(rows > 1e-6, rng.uniform(0.9, 1.1, rows.shape), 1.0)
        rows = rows / rows.sum(1, keepdims=True) if len(rows) else rows
        out = np.zeros((len(rows), d_new))
        out[:, perm] = rows
        return out.astype(np.float32)

    return what, move(p), move(q), [int(perm[t]) for t in tokens]


def _ar_probe_inputs(rng: np.random.Generator) -> dict:
    stat = [_perturbed(rng, *case) for case in _statistical_cases()]
    corners = _corner_cases(rng, big=int(rng.integers(16_000, 33_000)))
    return {"cases": _ar_inputs(stat, corners, AR_CALLS, [int(s) for s in rng.integers(0, 2**31, len(stat + corners))])}


def _compare_ar(outputs: Any, expected: dict) -> str | None:
    cases = expected["cases"]
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list) \
            or len(outputs["results"]) != len(cases):
        return "accept_reject's hidden test did not run every case"
    try:
        judge_ar(outputs["results"], [{**c, "what": f"hidden test {i + 1} ({c['what']})"} for i, c in enumerate(cases)])
    except ExerciseNotDone:
        return "accept_reject is not done yet"
    except CheckFailure as failure:
        return f"hidden test: {failure}"
    return None


# ----------------------------------------------------------------------------- 18.2 the block-table gather

GB_FORBIDDEN = ("tfedu.paged",)
HINT_GB_CALL = ("gather_blocks(pool, block_table, length): pool (n_blocks, n_kv_heads, block_size, d_head), "
                "block_table a list of block indices (ints), length an int; return (n_kv_heads, length, d_head)")
HINT_GB_TYPE = "gather_blocks should return a tensor (n_kv_heads, length, d_head) = {want}, got {got} on {what}"
HINT_GB_EMPTY = ("gather_blocks {error} on {what}: a sequence of length 0 holds no positions, and its keys are an "
                 "empty tensor (n_kv_heads, 0, d_head) = {want}. (Joining an empty list of blocks fails: build the "
                 "result so that no positions means an empty one)")
HINT_GB_NOT_CUT = (
    "you returned every position of the blocks you read, {got} positions, not the first {length}: the last block of "
    "a sequence is usually only partly written, and the block table may hold more blocks than needed. Keep the first "
    "length positions"
)
HINT_GB_DROPPED = (
    "you returned {got} positions, not {length}: the last, partly filled block is missing. A sequence of length "
    "positions needs ceil(length / block_size) blocks, the last one read only up to its offset"
)
HINT_GB_SWAPPED = ("block and offset are swapped: position t lives in the block the table gives at index t // "
                   "block_size, at offset t % block_size inside it (t // block_size counts whole blocks)")
HINT_GB_AXES = (
    "your result has the positions before the heads, {got}: the pool keeps each block as (n_kv_heads, block_size, "
    "d_head), and a contiguous cache holds one sequence as (n_kv_heads, length, d_head), heads first. Move the "
    "positions' axis after the heads'"
)
HINT_GB_RESHAPED = (
    "heads and positions are mixed up: you reshaped the blocks you picked, (blocks, n_kv_heads, block_size, d_head), "
    "straight to (n_kv_heads, positions, d_head), so the numbers of one head's block land under another head. A "
    "reshape only regroups numbers in memory order: bring the heads' axis to the front first, then join the blocks "
    "and their offsets into one axis of positions"
)
HINT_GB_ORDER = (
    "you read the block table in another order ({order}): the table's order is the sequence's order, not the "
    "pool's. The table's first entry holds positions 0 .. block_size - 1, the second the next ones, wherever those "
    "blocks lie in the pool"
)
HINT_GB_CONTIGUOUS = (
    "you read block t // block_size of the pool directly, as if the sequence's blocks were the pool's first blocks "
    "in order: the blocks lie anywhere in the pool, and the block table says which. Look the block up in the table"
)
HINT_GB_DIFFERS = ("on {what}: position {t} (head {h}) holds {got}; it should hold block {block}'s offset {offset} "
                   "(block_table[{index}] = {block})")
HINT_GB_INDEX = ("gather_blocks {error} on {what}: an index ran past the block table or past a block. Position t is "
                 "in the block the table gives at index t // block_size, at offset t % block_size (below block_size), "
                 "and only the first ceil(length / block_size) entries of the table are needed")
HINT_GB_MUTATED = "gather_blocks changed {name} in place (on {what}): the cache keeps using it, so read it only"


def reference_gather_blocks(pool: torch.Tensor, block_table: Any, length: int) -> torch.Tensor:
    return gather_blocks(pool, block_table, length)


def gb_pool(rng: np.random.Generator | None, n_blocks: int, n_kv_heads: int, block_size: int,
            d_head: int) -> np.ndarray:
    """A pool whose every entry is distinct (0, 1, 2, ...; shuffled by ``rng`` when one is given), so that a wrong
    answer's values say where they were read from."""
    values = np.arange(n_blocks * n_kv_heads * block_size * d_head, dtype=np.float32)
    if rng is not None:
        values = rng.permutation(values)
    return values.reshape(n_blocks, n_kv_heads, block_size, d_head)


def gb_cases() -> list[dict]:
    """Block tables out of order and not contiguous; lengths that end mid-block, on a block's end, at 0, in a single
    block, with blocks of 1; a table longer than the length needs."""
    return [
        {"what": "a table [5, 2, 7, 0] out of order, length 10 (the third block half full)",
         "pool": gb_pool(None, 8, 2, 4, 3), "table": [5, 2, 7, 0], "length": 10},
        {"what": "a table [6, 1, 3], length 12 (exactly three full blocks)",
         "pool": gb_pool(None, 8, 2, 4, 3), "table": [6, 1, 3], "length": 12},
        {"what": "a single block [3], length 5 of 8", "pool": gb_pool(None, 5, 1, 8, 2), "table": [3], "length": 5},
        {"what": "blocks of 1 position, table [4, 0, 5, 2, 1]", "pool": gb_pool(None, 6, 3, 1, 2),
         "table": [4, 0, 5, 2, 1], "length": 5},
        {"what": "a table [2, 7, 4, 1, 6] of blocks of 3, length 14", "pool": gb_pool(None, 9, 2, 3, 2),
         "table": [2, 7, 4, 1, 6], "length": 14},
        {"what": "length 0 (an empty table)", "pool": gb_pool(None, 4, 2, 4, 3), "table": [], "length": 0},
    ]


def _gb_read(pool: torch.Tensor, blocks: list[int], offsets: list[int]) -> torch.Tensor | None:
    """pool[blocks[t], :, offsets[t]] stacked along the positions, (n_kv_heads, len, d_head); None when an index falls
    outside the pool."""
    n_blocks, heads, block_size, d_head = pool.shape
    if any(not 0 <= b < n_blocks for b in blocks) or any(not 0 <= o < block_size for o in offsets):
        return None
    if not blocks:
        return pool.new_zeros(heads, 0, d_head)
    return torch.stack([pool[b, :, o] for b, o in zip(blocks, offsets)], dim=1)


def gb_mistakes(pool: torch.Tensor, table: list[int], length: int) -> list[tuple[str, torch.Tensor | None]]:
    """(hint, the slip's result or None where it is undefined), in one order for every case."""
    block_size = pool.shape[2]
    needed = -(-length // block_size)

    def through(order: list[int], n: int) -> torch.Tensor | None:
        if len(order) < -(-n // block_size):
            return None
        return _gb_read(pool, [order[t // block_size] for t in range(n)], [t % block_size for t in range(n)])

    swapped = None
    if length and block_size <= len(table) and (length - 1) // block_size < block_size:
        swapped = _gb_read(pool, [table[t % block_size] for t in range(length)],
                           [t // block_size for t in range(length)])
    right = through(table, length)
    return [
        (HINT_GB_NOT_CUT.format(got=needed * block_size, length=length), through(table, needed * block_size)),
        (HINT_GB_NOT_CUT.format(got=len(table) * block_size, length=length), through(table, len(table) * block_size)),
        (HINT_GB_DROPPED.format(got=length // block_size * block_size, length=length),
         through(table, length // block_size * block_size)),
        (HINT_GB_SWAPPED, swapped),
        (HINT_GB_AXES.format(got=f"({length}, {pool.shape[1]}, {pool.shape[3]})"),
         None if right is None else right.transpose(0, 1)),
        (HINT_GB_RESHAPED, None if not needed or len(table) < needed
         else pool[torch.tensor(table[:needed])].reshape(pool.shape[1], -1, pool.shape[3])[:, :length]),
        (HINT_GB_ORDER.format(order="reversed"), through(table[::-1], length)),
        (HINT_GB_ORDER.format(order="reversed"), through(table[:needed][::-1], length)),
        (HINT_GB_ORDER.format(order="sorted"), through(sorted(table), length)),
        (HINT_GB_ORDER.format(order="sorted"), through(sorted(table[:needed]), length)),
        (HINT_GB_CONTIGUOUS, through(list(range(pool.shape[0])), length)),
    ]


def _gb_equal(got: Any, want: torch.Tensor | None) -> bool:
    return want is not None and isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want.shape) \
        and bool(torch.equal(got.detach().cpu().to(want.dtype), want))


def _gb_where(pool: torch.Tensor, value: float) -> str:
    """Where in the pool ``value`` lies, in words (every entry is distinct)."""
    found = (pool == value).nonzero()
    if len(found) != 1:
        return f"{value:g}, which is no single entry of the pool"
    b, h, o, _ = (int(i) for i in found[0])
    return f"block {b}'s offset {o} (head {h})"


def judge_gb(results: list[Any], cases: list[dict]) -> None:
    """Raise a CheckFailure naming the mistake unless each result is :func:`tfedu.paged.gather_blocks` of its case.

    ``results[i]`` is a tensor, or a string (what the answer raised or returned instead). A mistake is named when
    it explains every case where it is defined and differs from the answer somewhere."""
    pools = [torch.from_numpy(np.array(c["pool"])) for c in cases]
    wants = [reference_gather_blocks(pool, c["table"], c["length"]) for pool, c in zip(pools, cases)]
    mistakes = [gb_mistakes(pool, list(c["table"]), c["length"]) for pool, c in zip(pools, cases)]
    bad = [i for i, (got, want) in enumerate(zip(results, wants)) if not _gb_equal(got, want)]
    if not bad:
        return
    for j in range(len(mistakes[0])):
        defined = [i for i in range(len(cases)) if mistakes[i][j][1] is not None and not isinstance(results[i], str)]
        differing = [i for i in defined if not _gb_equal(mistakes[i][j][1], wants[i])]
        if differing and all(_gb_equal(results[i], mistakes[i][j][1]) for i in defined):
            raise CheckFailure(mistakes[differing[0]][j][0])
    i = bad[0]
    got, want, case, pool = results[i], wants[i], cases[i], pools[i]
    if isinstance(got, str):
        if got.startswith("raised ") and case["length"] == 0:
            raise CheckFailure(HINT_GB_EMPTY.format(error=got, what=case["what"], want=tuple(want.shape)))
        if got.startswith("raised IndexError"):
            raise CheckFailure(HINT_GB_INDEX.format(error=got, what=case["what"]))
        if got.startswith("raised "):
            raise CheckFailure(f"gather_blocks {got} on {case['what']} ({HINT_GB_CALL})")
        if got.startswith("mutated "):
            raise CheckFailure(HINT_GB_MUTATED.format(name=got.split(" ", 1)[1], what=case["what"]))
        raise CheckFailure(HINT_GB_TYPE.format(want=tuple(want.shape), got=got, what=case["what"]))
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        raise CheckFailure(HINT_GB_TYPE.format(want=tuple(want.shape), got=describe(got), what=case["what"]))
    wrong = (got.detach().cpu().to(want.dtype) != want).nonzero()
    h, t, _ = (int(x) for x in wrong[0])
    block_size = pool.shape[2]
    raise CheckFailure(HINT_GB_DIFFERS.format(what=case["what"], t=t, h=h, got=_gb_where(pool, float(got[h, t, 0])),
                                              block=case["table"][t // block_size], offset=t % block_size,
                                              index=t // block_size))


# Run in the learner's kernel by the probe, and here by the check: one source.
GB_RUN = """\
def _gb_case(case):
    pool = torch.from_numpy(np.array(case['pool']))
    kept, table = pool.clone(), [int(b) for b in case['table']]
    try:
        got = gather_blocks(pool, list(table), int(case['length']))
    except Exception as err:
        return 'raised ' + type(err).__name__ + ': ' + str(err)[:200]
    if not torch.equal(pool, kept):
        return 'mutated the pool'
    if isinstance(got, torch.Tensor):
        return got.detach().cpu().float().numpy() if got.is_floating_point() else 'a tensor of dtype ' + str(got.dtype)
    return 'a ' + type(got).__name__


outputs = {'results': [_gb_case(_c) for _c in inputs['cases']]}
del _gb_case
"""


def _gb_tally(fn: Any, cases: list[dict]) -> list[Any]:
    scope = {"gather_blocks": fn, "inputs": {"cases": cases}, "np": np, "torch": torch}
    exec(compile(GB_RUN, "<gather_blocks' run>", "exec"), scope)
    return [torch.from_numpy(np.array(r)) if isinstance(r, np.ndarray) else r for r in scope["outputs"]["results"]]


@checker("the block-table gather")
def check_gather_blocks(gather_blocks) -> None:
    """Check ``gather_blocks(pool, block_table, length)`` against :func:`tfedu.paged.gather_blocks`, exactly."""
    _refuse(gather_blocks, GB_FORBIDDEN, "gather_blocks", "reading through the block table")
    cases = gb_cases()
    call_learner(gather_blocks, torch.from_numpy(cases[0]["pool"]), list(cases[0]["table"]), cases[0]["length"],
                 name="gather_blocks", error_hint=HINT_GB_CALL)
    judge_gb(_gb_tally(gather_blocks, cases), cases)


def _gb_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    for kind in ("mid-block", "boundary", "single", "size 1", "long table", "empty"):
        block_size = 1 if kind == "size 1" else int(rng.integers(2, 6))
        n_blocks = int(rng.integers(6, 12))
        heads, d_head = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        used = {"single": 1, "empty": 0}.get(kind, int(rng.integers(3, 6)))
        extra = int(rng.integers(1, n_blocks - used + 1)) if kind == "long table" else 0
        table = [int(b) for b in rng.permutation(n_blocks)[:used + extra]]
        if used > 1 and table[:used] == sorted(table[:used]):
            table[0], table[1] = table[1], table[0]
        if kind in ("boundary", "size 1", "empty"):
            length = used * block_size
        else:
            length = (used - 1) * block_size + int(rng.integers(1, block_size))
        cases.append({"what": f"hidden test {len(cases) + 1} (blocks of {block_size}, table {table}, length {length})",
                      "pool": gb_pool(rng, n_blocks, heads, block_size, d_head), "table": table, "length": length})
    block_size = int(rng.integers(2, 4))  # a table at least block_size long, length at most block_size ** 2
    n_blocks = int(rng.integers(6, 10))
    table = [int(b) for b in rng.permutation(n_blocks)[:block_size + 1]]
    length = int(rng.integers(block_size + 1, block_size * block_size + 1))
    cases.append({"what": f"hidden test {len(cases) + 1} (blocks of {block_size}, table {table}, length {length})",
                  "pool": gb_pool(rng, n_blocks, 2, block_size, 2), "table": table, "length": length})
    return {"cases": cases}


def _compare_gb(outputs: Any, expected: dict) -> str | None:
    cases = expected["cases"]
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list) \
            or len(outputs["results"]) != len(cases):
        return "gather_blocks' hidden test did not run every case"
    results = [torch.from_numpy(np.array(r)) if isinstance(r, np.ndarray) else r for r in outputs["results"]]
    try:
        judge_gb(results, cases)
    except CheckFailure as failure:
        return f"hidden test: {failure}"
    return None


# ----------------------------------------------------------------------------- 18.3 the scheduler's admission

ADMIT_FORBIDDEN = ("tfedu.batching.admit", "tfedu.batching.blocks_needed", "tfedu.batching.ContinuousBatcher")
HINT_ADMIT_SHORTCUT = ("your admit uses {names} from tfedu.batching: the admission and the blocks a request needs are "
                       "the exercise, so work them out from the requests' prompts and max_new_tokens")
HINT_ADMIT_CALL = ("admit(waiting, n_running, n_free_blocks, *, max_batch, block_size): waiting a list of Requests "
                   "(each with .prompt, a 1-D tensor of token ids, and .max_new_tokens), the rest ints; return how "
                   "many requests from the head of waiting to admit, an int")
HINT_ADMIT_LIST = ("admit returned {got} on {what}: return how many requests to admit from the head of the queue, an "
                   "int (the batcher then takes that many from the front)")
HINT_ADMIT_TYPE = "admit should return an int (how many requests to admit), got {got} on {what}"
HINT_ADMIT_OVERTAKE = (
    "you skipped a request whose blocks did not fit and went on admitting the ones behind it: the queue is served in "
    "order, and the first request that does not fit stops the admission. Letting smaller requests overtake a long "
    "one would starve it for as long as small ones keep arriving"
)
HINT_ADMIT_NO_BATCH_LIMIT = ("you admitted past the batch limit: a request needs a free row of the batch, so at most "
                             "max_batch requests run at once, the ones already running included")
HINT_ADMIT_RUNNING_IGNORED = ("you filled the batch as if it were empty: the n_running requests already running take "
                              "rows too, so at most max_batch - n_running can join")
HINT_ADMIT_ONE_ROW_TOO_MANY = ("you admitted one request too many when the batch fills up: with n_running already "
                               "running, a request joins only while the running and admitted ones are fewer than "
                               "max_batch")
HINT_ADMIT_NO_BLOCKS = ("you did not check the blocks: a request is admitted only if the KV cache blocks it will ever "
                        "hold fit in the free blocks not yet promised to the requests admitted before it")
HINT_ADMIT_PROMPT_ONLY = (
    "you counted the blocks of the prompt alone: a request goes on to write its new tokens into the cache too, all "
    "but the last (which is emitted and never fed back), so it needs blocks for len(prompt) + max_new_tokens - 1 "
    "positions, reserved at admission so it can never run out"
)
HINT_ADMIT_FLOOR = ("you rounded the blocks a request needs down: a partly filled last block is a whole block "
                    "taken, so round up (ceil((len(prompt) + max_new_tokens - 1) / block_size))")
HINT_ADMIT_ONE_TOO_MANY = (
    "you counted len(prompt) + max_new_tokens positions, one too many: the last new token is emitted and never fed "
    "back, so it is never written to the cache. At a block's end that reserves a block the request never uses, and "
    "here it refuses a request that fits"
)
HINT_ADMIT_NOT_SUBTRACTED = ("you compared each request's blocks with all of n_free_blocks: the requests admitted "
                             "before it in the same call have been promised their blocks, so only what is left after "
                             "them is free for the next one")
HINT_ADMIT_STRICT = ("you refused a request whose blocks fit exactly: a request needing as many blocks as are left "
                     "fits (needed <= left)")
HINT_ADMIT_DIFFERS = ("on {what}: admit returned {got}; admitting in order while a row and the blocks are free admits "
                      "{want} ({needs})")


def reference_admit(waiting: list[Request], n_running: int, n_free_blocks: int, *, max_batch: int,
                    block_size: int) -> int:
    return admit(waiting, n_running, n_free_blocks, max_batch=max_batch, block_size=block_size)


def _admitted(sizes: list[tuple[int, int]], n_running: int, n_free_blocks: int, max_batch: int, block_size: int, *,
              blocks: Any = None, rows: Any = None, overtake: bool = False, subtract: bool = True,
              strict: bool = False) -> int:
    """How many requests of ``sizes`` ((prompt length, max_new_tokens) each) the rule admits, or a slip of it:
    ``blocks(length, new, block_size)`` the blocks one needs, ``rows(admitted)`` whether a row is free, ``overtake``
    go on past a request that does not fit, ``subtract`` take admitted requests' blocks off, ``strict`` < for <=."""
    blocks = blocks or (lambda n, m, b: -(-(n + m - 1) // b))
    rows = rows or (lambda admitted: n_running + admitted < max_batch)
    admitted, left = 0, n_free_blocks
    for length, new in sizes:
        if not rows(admitted):
            break
        need = blocks(length, new, block_size)
        if need > left or (strict and need == left):
            if overtake:
                continue
            break
        admitted += 1
        left -= need if subtract else 0
    return admitted


def admit_mistakes(sizes: list[tuple[int, int]], n_running: int, n_free_blocks: int, max_batch: int,
                   block_size: int) -> list[tuple[str, int]]:
    args = (sizes, n_running, n_free_blocks, max_batch, block_size)
    return [
        (HINT_ADMIT_OVERTAKE, _admitted(*args, overtake=True)),
        (HINT_ADMIT_NO_BLOCKS, _admitted(*args, blocks=lambda n, m, b: 0)),
        (HINT_ADMIT_NO_BATCH_LIMIT, _admitted(*args, rows=lambda a: True)),
        (HINT_ADMIT_RUNNING_IGNORED, _admitted(*args, rows=lambda a: a < max_batch)),
        (HINT_ADMIT_ONE_ROW_TOO_MANY, _admitted(*args, rows=lambda a: n_running + a <= max_batch)),
        (HINT_ADMIT_PROMPT_ONLY, _admitted(*args, blocks=lambda n, m, b: -(-n // b))),
        (HINT_ADMIT_FLOOR, _admitted(*args, blocks=lambda n, m, b: (n + m - 1) // b)),
        (HINT_ADMIT_ONE_TOO_MANY, _admitted(*args, blocks=lambda n, m, b: -(-(n + m) // b))),
        (HINT_ADMIT_NOT_SUBTRACTED, _admitted(*args, subtract=False)),
        (HINT_ADMIT_STRICT, _admitted(*args, strict=True)),
    ]


def admit_cases() -> list[dict]:
    """Mixed queues (a request that does not fit with smaller ones behind it), a full batch, an empty queue, a pool
    that fits exactly, blocks of 1 position; requests as (prompt length, max_new_tokens)."""
    return [
        {"what": "5 requests, 1 running, 6 free blocks of 4, max_batch 8",
         "sizes": [[5, 4], [3, 3], [10, 7], [2, 1], [4, 4]], "n_running": 1, "n_free_blocks": 6, "max_batch": 8,
         "block_size": 4},
        {"what": "8 small requests, 3 running, 40 free blocks of 4, max_batch 6",
         "sizes": [[4, 2], [6, 3], [2, 2], [3, 1], [5, 5], [1, 1], [2, 3], [4, 1]], "n_running": 3, "n_free_blocks": 40,
         "max_batch": 6, "block_size": 4},
        {"what": "a full batch (4 of 4 running)", "sizes": [[3, 2], [1, 1]], "n_running": 4, "n_free_blocks": 50,
         "max_batch": 4, "block_size": 8},
        {"what": "an empty queue", "sizes": [], "n_running": 0, "n_free_blocks": 10, "max_batch": 4, "block_size": 4},
        {"what": "3 requests that fill the 7 free blocks of 4 exactly",
         "sizes": [[8, 1], [6, 3], [9, 4], [1, 1]], "n_running": 0, "n_free_blocks": 7, "max_batch": 8,
         "block_size": 4},
        {"what": "blocks of 1 position, 12 free", "sizes": [[3, 2], [4, 5], [2, 3], [1, 1]], "n_running": 2,
         "n_free_blocks": 12, "max_batch": 16, "block_size": 1},
        {"what": "a first request too large for the free blocks", "sizes": [[30, 20], [2, 2], [3, 1]],
         "n_running": 5, "n_free_blocks": 3, "max_batch": 8, "block_size": 16},
        {"what": "requests that end on a block's end, 5 free blocks of 8", "sizes": [[5, 4], [12, 5], [3, 6], [7, 2]],
         "n_running": 0, "n_free_blocks": 5, "max_batch": 8, "block_size": 8},
        {"what": "3 free rows, every request fits, blocks of 2", "sizes": [[3, 3], [4, 1], [2, 4], [1, 3], [2, 2]],
         "n_running": 5, "n_free_blocks": 30, "max_batch": 8, "block_size": 2},
    ]


def _requests(sizes: list[list[int]], offset: int = 0) -> list[Request]:
    return [Request(f"r{i}", torch.arange(n, dtype=torch.long) % 97 + 1, max_new_tokens=m)
            for i, (n, m) in enumerate(sizes, start=offset)]


def _needs(case: dict) -> str:
    return ", ".join(f"{-(-(n + m - 1) // case['block_size'])}" for n, m in case["sizes"])


def judge_admit(results: list[Any], cases: list[dict]) -> None:
    """Raise a CheckFailure naming the mistake unless each result is the right count. ``results[i]`` is an int, or
    a string (what the answer raised or returned instead)."""
    args = [(c["sizes"], c["n_running"], c["n_free_blocks"], c["max_batch"], c["block_size"]) for c in cases]
    wants = [_admitted(*a) for a in args]
    for got, case in zip(results, cases):
        if isinstance(got, str) and got.startswith("a list") or isinstance(got, str) and got.startswith("a tuple"):
            raise CheckFailure(HINT_ADMIT_LIST.format(got=got, what=case["what"]))
    bad = [i for i, (g, w) in enumerate(zip(results, wants)) if g != w]
    if not bad:
        return
    mistakes = [admit_mistakes(*a) for a in args]
    ran = [i for i, g in enumerate(results) if isinstance(g, int)]
    for j in range(len(mistakes[0])):
        differing = [i for i in ran if mistakes[i][j][1] != wants[i]]
        if differing and all(results[i] == mistakes[i][j][1] for i in ran):
            raise CheckFailure(mistakes[differing[0]][j][0])
    i = bad[0]
    got, case = results[i], cases[i]
    if isinstance(got, str) and got.startswith("raised "):
        raise CheckFailure(f"admit {got} on {case['what']} ({HINT_ADMIT_CALL})")
    if isinstance(got, str):
        raise CheckFailure(HINT_ADMIT_TYPE.format(got=got, what=case["what"]))
    raise CheckFailure(HINT_ADMIT_DIFFERS.format(what=case["what"], got=got, want=wants[i],
                                                 needs=f"the requests need {_needs(case)} blocks"
                                                 if case["sizes"] else "nothing waits"))


# Run in the learner's kernel by the probe, and here by the check: one source (the requests are tfedu.batching's).
ADMIT_RUN = """\
def _admit_case(case):
    from tfedu.batching import Request
    waiting = [Request('r' + str(i), torch.arange(n, dtype=torch.long) % 97 + 1, max_new_tokens=m)
               for i, (n, m) in enumerate(case['sizes'])]
    try:
        got = admit(list(waiting), case['n_running'], case['n_free_blocks'], max_batch=case['max_batch'],
                    block_size=case['block_size'])
    except Exception as err:
        return 'raised ' + type(err).__name__ + ': ' + str(err)[:200]
    if isinstance(got, torch.Tensor) and got.numel() == 1 and not got.is_floating_point() and got.dtype != torch.bool:
        return int(got.reshape(()).item())
    if isinstance(got, (int, np.integer)) and not isinstance(got, (bool, np.bool_)):
        return int(got)
    if isinstance(got, (list, tuple)):
        return 'a ' + type(got).__name__ + ' of ' + str(len(got)) + ' items'
    return 'a ' + type(got).__name__ + (' (' + repr(got)[:20] + ')' if isinstance(got, (float, bool)) else '')


outputs = {'results': [_admit_case(_c) for _c in inputs['cases']]}
del _admit_case
"""


def _admit_tally(fn: Any, cases: list[dict]) -> list[Any]:
    scope = {"admit": fn, "inputs": {"cases": cases}, "np": np, "torch": torch}
    exec(compile(ADMIT_RUN, "<admit's run>", "exec"), scope)
    return scope["outputs"]["results"]


@checker("the scheduler's admission")
def check_admit(admit) -> None:
    """Check ``admit(waiting, n_running, n_free_blocks, *, max_batch, block_size)`` against
    :func:`tfedu.batching.admit` on queues of mixed requests and the edge cases."""
    scope, refused = getattr(admit, "__globals__", {}), reference_admit_objects()
    names = sorted(n for n in global_names(admit) if n in scope and any(scope[n] is obj for obj in refused))
    if names:
        raise CheckFailure(HINT_ADMIT_SHORTCUT.format(names=", ".join(names)))
    cases = admit_cases()
    call_learner(admit, _requests(cases[0]["sizes"]), 1, 6, max_batch=8, block_size=4, name="admit",
                 error_hint=HINT_ADMIT_CALL)
    judge_admit(_admit_tally(admit, cases), cases)


def reference_admit_objects() -> tuple[Any, ...]:
    """The library's objects an answer to 18.3 may not use (the check refuses them by object, whatever the name): the
    reference, its blocks_needed, the batcher, and the module itself."""
    import tfedu.batching

    return admit, blocks_needed, tfedu.batching.ContinuousBatcher, tfedu.batching


def _admit_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []

    def add(what: str, sizes: list, n_running: int, n_free_blocks: int, max_batch: int, block_size: int) -> None:
        cases.append({"what": f"hidden test {len(cases) + 1} ({what})", "sizes": [[int(n), int(m)] for n, m in sizes],
                      "n_running": int(n_running), "n_free_blocks": int(n_free_blocks), "max_batch": int(max_batch),
                      "block_size": int(block_size)})

    def sizes(count: int, longest: int = 12) -> list:
        return [[int(rng.integers(1, longest)), int(rng.integers(1, longest))] for _ in range(count)]

    def need(s: list, b: int) -> list[int]:
        return [-(-(n + m - 1) // b) for n, m in s]

    b = int(rng.integers(2, 6))
    s = sizes(6)
    s[2] = [int(rng.integers(20, 30)), int(rng.integers(8, 16))]  # a long one with smaller ones behind it
    s[3] = [1, 1]
    add("a long request in a mixed queue", s, int(rng.integers(0, 3)), sum(need(s[:2], b)) + int(rng.integers(1, 3)),
        16, b)
    s = sizes(10, 6)
    add("many small requests, few free rows", s, int(rng.integers(2, 6)), 200, int(rng.integers(6, 9)), b)
    m = int(rng.integers(2, 9))
    add("a full batch", sizes(3), m, 100, m, b)
    add("an empty queue", [], int(rng.integers(0, 4)), int(rng.integers(1, 20)), 8, b)
    s = sizes(4)
    b = int(rng.integers(2, 6))
    add("a pool that fits the first three exactly", s, 0, sum(need(s[:3], b)), 8, b)
    s = sizes(5, 8)
    add("blocks of 1 position", s, int(rng.integers(0, 3)), sum(need(s[:3], 1)) + int(rng.integers(0, 2)), 16, 1)
    b = int(rng.integers(3, 9))
    s = [[int(b * j - m + 1), int(m)] for j, m in zip(rng.integers(1, 4, 4), rng.integers(1, 4, 4))]  # ends on a block
    s = [[max(1, n), m] for n, m in s]
    add("requests that end on a block's end", s, 0, sum(need(s[:2], b)) + 1, 8, b)
    b = int(rng.integers(3, 9))
    s = [[int(b * j - m + 2), int(m)] for j, m in zip(rng.integers(1, 4, 4), rng.integers(1, 3, 4))]  # just past one
    s[0] = [s[0][0] + s[0][1] - 1, 1]
    add("requests just past a block's end", s, 0, sum(n + m - 1 for n, m in s[:3]) // b, 8, b)
    b = int(rng.integers(2, 5))
    s = [[int(rng.integers(12, 20)), int(rng.integers(4, 9))]] + sizes(3, 4)
    add("a head request larger than the free blocks", s, int(rng.integers(0, 4)), need(s, b)[0] - 1, 8, b)
    s = sizes(5)
    b = int(rng.integers(2, 5))
    add("every request fits, some free rows", s, int(rng.integers(3, 6)), 200, 8, b)
    return {"cases": cases}


def _compare_admit(outputs: Any, expected: dict) -> str | None:
    cases = expected["cases"]
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list) \
            or len(outputs["results"]) != len(cases):
        return "admit's hidden test did not run every case"
    try:
        judge_admit(outputs["results"], cases)
    except CheckFailure as failure:
        return f"hidden test: {failure}"
    return None


# ----------------------------------------------------------------------------- the hidden tests and the hints

PROBES = {
    "check_accept_reject": Probe(
        exercise="ex_accept_reject",
        make_inputs=_ar_probe_inputs,
        run=AR_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_ar,
        forbidden=AR_FORBIDDEN),
    "check_gather_blocks": Probe(
        exercise="ex_gather_blocks",
        make_inputs=_gb_probe_inputs,
        run=GB_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_gb,
        forbidden=GB_FORBIDDEN,
        builds=ELEMENTARY | EINOPS),
    "check_admit": Probe(
        exercise="ex_admit",
        make_inputs=_admit_probe_inputs,
        run=ADMIT_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_admit,
        forbidden=ADMIT_FORBIDDEN),
}


HINTS = {
    "ex_accept_reject": Hints(
        number="18.1",
        check="check_accept_reject",
        idea=(
            "Walk along the draft tokens in order. Draft token i was drawn from q[i]; the target would have drawn it "
            "with probability p[i] of that token. Keep it with probability min(1, p / q): a token the target likes "
            "at least as much as the draft is always kept, one it likes less only sometimes. At the first token not "
            "kept, stop: the next token is drawn from where the target has more probability than the draft, max(0, "
            "p[i] - q[i]) normalised, which gives back exactly the probability the rejections took away. If every "
            "draft token is kept, the target's last row, p[k], gives one more token for free."
        ),
        approach=(
            "Loop i over 0 .. k - 1 with x the i-th draft token. Draw one uniform number in [0, 1) from the "
            "generator (torch.rand with generator=generator) and compare it with the ratio of p[i] and q[i] at x; "
            "below it, go on to the next token. Otherwise build the residual (the difference of the two rows, "
            "negative entries clamped to 0), draw one token from it with torch.multinomial (it normalises the "
            "weights itself; pass the generator) and return i and that token as ints. After the loop, draw from "
            "p[k] the same way and return k with it."
        ),
        skeleton=(
            "def accept_reject(p, q, draft_tokens, generator):\n"
            "    k = ____\n"
            "    for i in range(k):\n"
            "        x = ____\n"
            "        r = ____  # one uniform draw from the generator\n"
            "        if ____:  # accepted\n"
            "            continue\n"
            "        residual = ____\n"
            "        return ____  # (i, a token drawn from the residual)\n"
            "    return ____  # (k, a token drawn from the last row of p)\n"
        ),
    ),
    "ex_gather_blocks": Hints(
        number="18.2",
        check="check_gather_blocks",
        idea=(
            "A sequence's keys are scattered over the pool in fixed-size blocks; its block table lists them in the "
            "sequence's order. Position t is in the table's entry t // block_size, at offset t % block_size inside "
            "that block. Read the first length positions that way, and lay them out heads first, as a contiguous "
            "cache holds one sequence."
        ),
        approach=(
            "Make the positions 0 .. length - 1 as a tensor t. The table (as a tensor of longs) indexed by t // "
            "block_size gives each position's block, t % block_size its offset; index the pool with the blocks in "
            "the first axis and the offsets in the third, keeping the heads' axis whole: that gives (length, "
            "n_kv_heads, d_head). Swap the first two axes. Length 0 then gives an empty result by itself. (A loop "
            "over the positions that stacks each position's key works too.)"
        ),
        skeleton=(
            "def gather_blocks(pool, block_table, length):\n"
            "    block_size = ____\n"
            "    t = ____  # the positions\n"
            "    blocks = ____  # each position's block in the pool, through the table\n"
            "    offsets = ____\n"
            "    picked = ____  # (length, n_kv_heads, d_head)\n"
            "    return ____\n"
        ),
    ),
    "ex_admit": Hints(
        number="18.3",
        check="check_admit",
        idea=(
            "Serve the queue in order. A request can join when the batch has a free row (the running ones count) "
            "and the cache blocks it will ever need are still unpromised: its prompt and every new token but the "
            "last, rounded up to whole blocks. Each request admitted takes its blocks off what is left for the next. "
            "The first request that does not fit stops the admission: no overtaking."
        ),
        approach=(
            "Keep a count of admitted requests and the blocks left (starting at n_free_blocks). For each request in "
            "order: stop when n_running plus the count reaches max_batch; work out its blocks with a ceiling "
            "division of (prompt length + max_new_tokens - 1) by block_size; stop if that is more than the blocks "
            "left; otherwise count it and take its blocks off. Return the count."
        ),
        skeleton=(
            "def admit(waiting, n_running, n_free_blocks, *, max_batch, block_size):\n"
            "    admitted, left = ____\n"
            "    for request in waiting:\n"
            "        if ____:  # no free row\n"
            "            break\n"
            "        needed = ____\n"
            "        if ____:  # its blocks do not fit\n"
            "            break\n"
            "        ____\n"
            "    return admitted\n"
        ),
    ),
}
