"""Checkers and probes of notebook 08: each passes the reference and names realistic mistakes."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tfedu.checks import nb08_training_decoding as nb08
from tfedu.checks.core import CheckFailure, ExerciseNotDone, run_probe
from tfedu.generate import filter_top_k, filter_top_p, generate
from tfedu.checks.scan import scan_answer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: see tests/conftest.py

NEG_INF = float("-inf")

# The solution cells as the notebook will hold them (between ### BEGIN SOLUTION / ### END SOLUTION).
SOLUTIONS = {
    "ex_greedy": '''\
def greedy_generate(model, ids, max_new_tokens):
    model.eval()                                           # no dropout while generating
    with torch.no_grad():
        for _ in range(max_new_tokens):
            context = ids[:, -model.cfg.n_ctx:]            # the model sees at most n_ctx tokens
            logits = model(context)                        # batch pos d_vocab
            next_id = logits[:, -1, :].argmax(dim=-1)      # batch: the last position predicts what comes next
            ids = torch.cat([ids, next_id[:, None]], dim=1)
    return ids
''',
    "ex_top_k": '''\
def top_k_filter(logits, k):
    if k >= logits.shape[-1]:
        return logits.clone()
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # ... 1: the k-th largest of each row
    return logits.masked_fill(logits < kth, float("-inf"))  # ties with the k-th largest stay
''',
    "ex_top_p": '''\
def top_p_filter(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs             # what the more likely tokens already hold
    remove_sorted = mass_before >= p                       # the nucleus reached p without this token
    remove = remove_sorted.scatter(-1, order, remove_sorted)  # back to the vocabulary's order
    return logits.masked_fill(remove, float("-inf"))
''',
}
NOTEBOOK_CONTEXT = "import torch\nimport torch.nn.functional as F\nfrom torch import nn\nimport math, einops, regex"


def solution(grade_id):
    namespace = {"torch": torch, "F": F, "nn": nn, "math": math}
    exec(SOLUTIONS[grade_id], namespace)
    return namespace


# ----------------------------------------------------------------------------- 8.1 greedy_generate


def make_greedy(bug=None):
    """A learner's greedy_generate, written the way the notebook asks, with one switch per mistake."""

    def greedy_generate(model, ids, max_new_tokens):
        if bug != "no-eval":
            model.eval()
        n_ctx = model.cfg.n_ctx
        out = ids
        for _ in range(max_new_tokens):
            source = ids if bug == "not-fed-back" else out
            context = {"no-crop": source, "crop-start": source[:, :n_ctx]}.get(bug, source[:, -n_ctx:])
            with torch.no_grad():
                logits = model(context)
            if bug == "first":
                next_id = logits[:, 0, :].argmax(dim=-1)
            elif bug == "axis":
                next_id = logits.argmax(dim=1)[:, -1]
            elif bug == "axis-batch":
                next_id = logits[:, -1, :].argmax(dim=0)
            elif bug == "sample":
                next_id = torch.multinomial(logits[:, -1, :].softmax(dim=-1), 1)[:, 0]
            else:
                next_id = logits[:, -1, :].argmax(dim=-1)
            if bug == "only-prompt":
                torch.cat([out, next_id[:, None]], dim=1)  # the result is dropped
            else:
                out = torch.cat([out, next_id[:, None]], dim=1)
        if bug == "only-new":
            return out[:, ids.shape[1]:]
        if bug == "float":
            return out.float()
        return out

    return greedy_generate


def rolling_window_greedy(model, ids, max_new_tokens):
    """A fixed-size context window updated in place: a view of the caller's prompt."""
    model.eval()
    window = ids[:, -model.cfg.n_ctx:]
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = model(window)[:, -1].argmax(dim=-1)
            window[:, :-1] = window[:, 1:].clone()  # slide left...
            window[:, -1] = next_id  # ... and write the new token into the prompt's memory
            new.append(next_id)
    return torch.cat([ids, torch.stack(new, dim=1)], dim=1)


def greedy_cropping_when_needed(model, ids, max_new_tokens):
    model.eval()
    for _ in range(max_new_tokens):
        context = ids if ids.shape[1] <= model.cfg.n_ctx else ids[:, ids.shape[1] - model.cfg.n_ctx:]
        with torch.no_grad():
            next_id = model(context)[:, -1:, :].argmax(dim=-1)  # batch 1
        ids = torch.cat((ids, next_id), dim=-1)
    return ids


def test_greedy_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_greedy")["greedy_generate"], make_greedy(), greedy_cropping_when_needed,
               lambda model, ids, n: generate(model, ids, n)):
        nb08.check_greedy_generate(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} greedy decoding: all checks passed") == 4


@pytest.mark.parametrize("bug, match", [
    ("first", "logits of the first position"),
    ("axis", "argmax over the positions"),
    ("axis-batch", "argmax over the last dim"),
    ("only-new", "only the new tokens"),
    ("only-prompt", "returned the prompt unchanged"),
    ("not-fed-back", "predicted from the prompt alone"),
    ("no-crop", "keep only its last model.cfg.n_ctx"),
    ("crop-start", "kept the first n_ctx tokens"),
    ("sample", "do not sample"),
    ("no-eval", "call model.eval\\(\\) first"),
    ("float", "do not convert to float"),
])
def test_greedy_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_greedy_generate(make_greedy(bug))


def test_greedy_that_writes_into_the_prompt_is_told():
    with pytest.raises(CheckFailure, match="changed the caller's `ids` in place"):
        nb08.check_greedy_generate(rolling_window_greedy)


def test_greedy_not_done():
    def greedy_generate(model, ids, max_new_tokens):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb08.check_greedy_generate(greedy_generate)


def test_the_greedy_checks_model_leaves_the_global_random_state_alone():
    before = torch.random.get_rng_state()
    nb08.make_greedy_model(0, dropout=0.5)
    assert torch.equal(torch.random.get_rng_state(), before)


# ----------------------------------------------------------------------------- 8.2 top_k_filter


def make_top_k(bug=None):
    def top_k_filter(logits, k):
        if bug == "plus-one":
            kth = torch.topk(logits, k + 1).values[..., -1:]
        elif bug == "smallest":
            kth = torch.topk(logits, k, largest=False).values[..., -1:]
            return logits.masked_fill(logits > kth, NEG_INF)
        elif bug == "one-row":
            kth = torch.topk(logits, k).values[-1]  # the k-th largest of a 1-D row; a batch's last row otherwise
        else:
            kth = torch.topk(logits, k).values[..., -1:]
        remove = logits <= kth if bug == "minus-one" else logits < kth
        if bug == "zero":
            return logits.masked_fill(remove, 0.0)
        if bug == "big-negative":
            return logits.masked_fill(remove, -1e9)
        if bug == "in-place":
            logits[remove] = NEG_INF
            return logits
        if bug == "probs-first":
            return logits.softmax(dim=-1).masked_fill(remove, 0.0)
        out = logits.masked_fill(remove, NEG_INF)
        return out.softmax(dim=-1) if bug == "softmax" else out

    return top_k_filter


def top_k_by_scatter(logits, k):
    """Exactly k tokens: ties at the k-th value are broken by torch.topk's order."""
    values, indices = torch.topk(logits, min(k, logits.shape[-1]))
    return torch.full_like(logits, NEG_INF).scatter(-1, indices, values)


def top_k_by_sort(logits, k):
    kth = logits.sort(dim=-1, descending=True).values[..., min(k, logits.shape[-1]) - 1, None]
    return torch.where(logits < kth, torch.tensor(NEG_INF), logits)


def test_top_k_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_top_k")["top_k_filter"], make_top_k(), top_k_by_sort, filter_top_k):
        nb08.check_top_k_filter(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} top-k filter: all checks passed") == 4


@pytest.mark.parametrize("fn, match", [
    (make_top_k("plus-one"), "kept k \\+ 1 tokens"),
    (make_top_k("minus-one"), "kept k - 1 tokens"),
    (make_top_k("smallest"), "kept the k smallest"),
    (make_top_k("softmax"), "returned probabilities \\(a softmax"),
    (make_top_k("probs-first"), "probabilities with the removed tokens set to 0"),
    (make_top_k("zero"), "set the removed logits to 0"),
    (make_top_k("big-negative"), "large negative number"),
    (make_top_k("in-place"), "changed the caller's `logits` in place"),
    (make_top_k("one-row"), "right on one row"),
    (top_k_by_scatter, "ties at the k-th largest"),
    (lambda logits, k: torch.topk(logits, k), "not torch.topk's \\(values, indices\\)"),
], ids=["plus-one", "minus-one", "smallest", "softmax", "probs-first", "zero", "big-negative", "in-place", "one-row",
        "ties", "tuple"])
def test_top_k_mistakes_are_named(fn, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_top_k_filter(fn)


def test_top_k_not_done():
    def top_k_filter(logits, k):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone):
        nb08.check_top_k_filter(top_k_filter)


# ----------------------------------------------------------------------------- 8.3 top_p_filter


def make_top_p(bug=None):
    def top_p_filter(logits, p):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=bug != "ascending")
        if bug == "exp-sum":  # the red team's softmax (issue 37): no max subtracted, NaN once a logit passes 88
            probs = sorted_logits.exp() / sorted_logits.exp().sum(dim=-1, keepdim=True)
        else:
            probs = sorted_logits.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        if bug == "crossing":
            remove = cumulative > p
        elif bug == "no-keep-first":
            remove = cumulative > p
            remove[..., 1:] = remove[..., :-1].clone()  # shift right, but index 0 is never set back to False
        else:
            remove = cumulative - probs >= p
        if bug == "sorted-order":
            return sorted_logits.masked_fill(remove, NEG_INF)
        if bug == "unsorted-mask":
            return logits.masked_fill(remove, NEG_INF)
        if bug == "gather":
            back = remove.gather(-1, order)
        elif bug == "one-row":
            back = remove.scatter(0, order, remove)
        else:
            back = remove.scatter(-1, order, remove)
        if bug == "probs-no-renorm":
            return logits.softmax(dim=-1).masked_fill(back, 0.0)
        if bug == "in-place":
            return logits.masked_fill_(back, NEG_INF)
        if bug == "zero":
            return logits.masked_fill(back, 0.0)
        out = logits.masked_fill(back, NEG_INF)
        return out.softmax(dim=-1) if bug == "softmax" else out

    return top_p_filter


def top_p_transformers_style(logits, p):
    """transformers' TopPLogitsWarper: ascending sort, remove what the least likely tokens hold up to 1 - p."""
    sorted_logits, order = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= 1 - p
    remove[..., -1:] = False
    return logits.masked_fill(remove.scatter(-1, order, remove), NEG_INF)


def top_p_old_transformers_style(logits, p):
    """transformers 4's descending version: remove past p, shifted right by one, the first always kept."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative > p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    return logits.masked_fill(remove.scatter(-1, order, remove), NEG_INF)


def test_top_p_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_top_p")["top_p_filter"], make_top_p(), top_p_transformers_style,
               top_p_old_transformers_style, filter_top_p):
        nb08.check_top_p_filter(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} top-p (nucleus) filter: all checks passed") == 5


@pytest.mark.parametrize("bug, match", [
    ("crossing", "leaves out the token that carries the mass across p"),
    ("ascending", "sorted the tokens least likely first"),
    ("probs-no-renorm", "no longer sum to 1"),
    ("softmax", "returned probabilities \\(renormalised"),
    ("no-keep-first", "removed every token"),
    ("sorted-order", "in sorted order"),
    ("unsorted-mask", "applied the mask, which is in sorted order"),
    ("gather", "moved the mask back with gather"),
    ("zero", "set the removed logits to 0"),
    ("in-place", "changed the caller's `logits` in place"),
    ("one-row", "right on one row"),
    ("exp-sum", "overflows once x passes about 88"),
])
def test_top_p_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_top_p_filter(make_top_p(bug))


def test_top_p_not_done():
    def top_p_filter(logits, p):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone):
        nb08.check_top_p_filter(top_p_filter)


def test_the_checkers_p_values_lie_clear_of_every_cumulative_sum():
    for seed, shape, p in nb08.TOP_P_CALLS:
        assert nb08.top_p_margin(nb08.top_p_logits(seed, *shape), p) > 5e-4, (seed, p)
    seed, shape, p = nb08.TOP_P_CONFIDENT
    logits = nb08.top_p_logits(seed, *shape) + nb08.CONFIDENT_OFFSET
    assert nb08.top_p_margin(logits, p) > 5e-4 and (nb08.filter_top_p(logits, p).isinf().sum(-1) > 0).all()
    assert (nb08.filter_top_p(logits, p).isfinite().sum(-1) > 1).any()  # a nucleus of several tokens, not only the top one


# ----------------------------------------------------------------------------- probes

GOOD = {
    "check_greedy": [solution("ex_greedy"), {"greedy_generate": greedy_cropping_when_needed}],
    "check_top_k": [solution("ex_top_k"), {"top_k_filter": top_k_by_sort}],
    "check_top_p": [solution("ex_top_p"), {"top_p_filter": top_p_transformers_style},
                    {"top_p_filter": top_p_old_transformers_style}],
}
BAD = [  # (probe, namespace, a fragment of the feedback)
    ("check_greedy", {"greedy_generate": make_greedy("first")}, "first position"),
    ("check_greedy", {"greedy_generate": make_greedy("no-crop")}, "raised"),
    ("check_greedy", {"greedy_generate": make_greedy("crop-start")}, "kept the first n_ctx"),
    ("check_greedy", {"greedy_generate": make_greedy("only-new")}, "only the new tokens"),
    ("check_greedy", {"greedy_generate": make_greedy("not-fed-back")}, "prompt alone"),
    ("check_greedy", {"greedy_generate": make_greedy("sample")}, "do not sample"),
    ("check_greedy", {"greedy_generate": make_greedy("no-eval")}, "model.eval()"),
    ("check_greedy", {"greedy_generate": rolling_window_greedy}, "changed its input in place"),
    # k + 1 tokens: torch.topk(logits, k + 1) fails outright at k = d_vocab, one of the hidden test's calls
    ("check_top_k", {"top_k_filter": make_top_k("plus-one")}, "out of range"),
    ("check_top_k", {"top_k_filter": make_top_k("minus-one")}, "k - 1"),
    ("check_top_k", {"top_k_filter": make_top_k("smallest")}, "k smallest"),
    ("check_top_k", {"top_k_filter": make_top_k("zero")}, "to 0"),
    ("check_top_k", {"top_k_filter": make_top_k("in-place")}, "changed its input in place"),
    ("check_top_k", {"top_k_filter": top_k_by_scatter}, "ties"),
    ("check_top_p", {"top_p_filter": make_top_p("crossing")}, "across p"),
    ("check_top_p", {"top_p_filter": make_top_p("exp-sum")}, "overflows once x passes about 88"),
    ("check_top_p", {"top_p_filter": make_top_p("ascending")}, "least likely first"),
    ("check_top_p", {"top_p_filter": make_top_p("no-keep-first")}, "removed every token"),
    ("check_top_p", {"top_p_filter": make_top_p("gather")}, "gather"),
    ("check_top_p", {"top_p_filter": make_top_p("softmax")}, "probabilities"),
]


def verdict(probe, namespace, seed):
    try:
        outputs, expected = run_probe(probe, namespace, seed)
    except Exception as err:  # in the grader, an exception in the kernel scores zero too
        return f"raised {type(err).__name__}: {err}"
    return probe.compare(outputs, expected)


def test_every_check_cell_has_a_probe():
    assert set(nb08.PROBES) == set(GOOD) == {"check_greedy", "check_top_k", "check_top_p"}
    for grade_id, probe in nb08.PROBES.items():
        assert probe.exercise == grade_id.replace("check_", "ex_")
        assert probe.compare is not None and "tfedu.generate" in probe.forbidden


@pytest.mark.parametrize("grade_id", sorted(GOOD))
def test_probe_passes_the_reference_and_learner_solutions(grade_id):
    probe = nb08.PROBES[grade_id]
    for namespace in GOOD[grade_id]:
        for seed in range(4):
            assert verdict(probe, namespace, seed) is None, (grade_id, seed, namespace)


@pytest.mark.parametrize("grade_id, namespace, fragment", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_probe_feedback_names_the_mistake(grade_id, namespace, fragment):
    probe = nb08.PROBES[grade_id]
    for seed in range(3):
        feedback = verdict(probe, namespace, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


def test_probe_code_leaves_no_helper_names_behind():
    for grade_id, probe in nb08.PROBES.items():
        namespace = GOOD[grade_id][0]
        scope = {**namespace, "inputs": probe.make_inputs(np.random.default_rng(0)), "np": np, "torch": torch}
        exec(probe.run, scope)
        assert {name for name in scope if name.startswith("_") and name != "__builtins__"} == set(), grade_id


def test_nothing_the_solutions_use_is_forbidden():
    for probe in nb08.PROBES.values():
        assert scan_answer(SOLUTIONS[probe.exercise], context=[NOTEBOOK_CONTEXT], forbidden=probe.forbidden) == []
