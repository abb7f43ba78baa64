"""Checker and probe of notebook 15: each passes right answers and names realistic mistakes."""

import numpy as np
import pytest
import torch

import tfedu.constrained
import tfedu.interp
from checker_helpers import failure_of, not_done, verdict
from tfedu.checks import nb15_interp_decoding as nb15
from tfedu.checks.core import ExerciseNotDone, is_plain_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def constrained_probs(logits, allowed, mistake=""):
    """A learner's answer, right or with one ``mistake``."""
    if mistake == "after, no renorm":
        return logits.softmax(dim=-1) * allowed
    if mistake == "after, renorm":
        p = logits.softmax(dim=-1) * allowed
        return p / p.sum(dim=-1, keepdim=True)
    if mistake == "zero fill":
        return logits.masked_fill(~allowed, 0.0).softmax(dim=-1)
    if mistake == "multiply":
        return (logits * allowed).softmax(dim=-1)
    if mistake == "inverted":
        return logits.masked_fill(allowed, float("-inf")).softmax(dim=-1)
    if mistake == "no mask":
        return logits.softmax(dim=-1)
    if mistake == "dim 0":
        return logits.masked_fill(~allowed, float("-inf")).softmax(dim=0)
    if mistake == "logits":
        return logits.masked_fill(~allowed, float("-inf"))
    if mistake == "in place":
        return logits.masked_fill_(~allowed, float("-inf")).softmax(dim=-1)
    if mistake == "one minus":
        return logits.masked_fill((1 - allowed).bool(), float("-inf")).softmax(dim=-1)
    return logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)


def by_where(logits, allowed):
    """torch.where with a float32 -inf and F.softmax: right."""
    return torch.nn.functional.softmax(torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype)), -1)


def by_large_negative(logits, allowed):
    """A large negative finite fill: the same probabilities here, right."""
    return logits.masked_fill(~allowed, torch.finfo(logits.dtype).min).softmax(dim=-1)


def by_hand_exp(logits, allowed):
    """A softmax by hand over the masked logits: right."""
    masked = logits.masked_fill(~allowed, float("-inf"))
    e = (masked - masked.amax(dim=-1, keepdim=True)).exp()
    return e / e.sum(dim=-1, keepdim=True)


def shift_then_mask(logits, allowed):
    """exp(logits - max over allowed) * allowed: a forbidden logit 120 above overflows exp, and inf * 0 is NaN."""
    shifted = logits - logits.masked_fill(~allowed, float("-inf")).amax(dim=-1, keepdim=True)
    e = shifted.exp() * allowed
    return e / e.sum(dim=-1, keepdim=True)


def no_max_shift(logits, allowed):
    """The red team's softmax: exp over the sum with no max subtracted; NaN once an allowed logit passes about 88."""
    e = logits.masked_fill(~allowed, float("-inf")).exp()
    return e / e.sum(dim=-1, keepdim=True)


RIGHT = {"masked_fill": constrained_probs, "where": by_where, "finfo.min": by_large_negative, "by hand": by_hand_exp}

MISTAKES = {  # name: (answer, a phrase its hint must contain)
    "after, no renorm": ("after, no renorm", "did not renormalise"),
    "after, renorm": ("after, renorm", "underflow"),
    "zero fill": ("zero fill", "with 0 instead of -inf"),
    "multiply": ("multiply", "with 0 instead of -inf"),
    "inverted": ("inverted", "mask is inverted"),
    "no mask": ("no mask", "not applied"),
    "dim 0": ("dim 0", "wrong dimension"),
    "logits": ("logits", "not probabilities"),
    "in place": ("in place", "in place"),
    "one minus": ("one minus", "~allowed"),
}
def index_assign(logits, allowed):
    logits[~allowed] = float("-inf")
    return logits.softmax(dim=-1)


def softmax_dim_1(logits, allowed):
    return logits.masked_fill(~allowed, float("-inf")).softmax(dim=1)


def log_softmax(logits, allowed):
    return logits.masked_fill(~allowed, float("-inf")).log_softmax(dim=-1)


def finite_fill(logits, allowed):
    return logits.masked_fill(~allowed, -100.0).softmax(dim=-1)


def import_inside(logits, allowed):
    from tfedu.constrained import mask_logits
    return mask_logits(logits, allowed).softmax(-1)


def through_the_package(logits, allowed):
    return tfedu.constrained.mask_logits(logits, allowed).softmax(-1)


def numpy_answer(logits, allowed):
    return logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1).numpy()


def times_inf(logits, allowed):
    return (logits + (~allowed) * float("-inf")).softmax(dim=-1)


def half(logits, allowed):
    return logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1).half()


def float_first(logits, allowed):
    """The learner's: float32 before the softmax, so a float64 caller gets float32 back."""
    return logits.float().masked_fill(~allowed, float("-inf")).softmax(dim=-1)


def double_first(logits, allowed):
    return logits.double().masked_fill(~allowed, float("-inf")).softmax(dim=-1)


MISTAKE_FUNCTIONS = {
    "a NumPy array (torch.multinomial would fail)": (numpy_answer, "float torch tensor"),
    "(~allowed) * -inf added": (times_inf, "0 * -inf"),
    "half precision": (half, "keep the logits' dtype"),
    "float32 before the softmax": (float_first, "typed like the logits"),
    "float64 before the softmax": (double_first, "typed like the logits"),
    "shift by the allowed max, mask after exp": (shift_then_mask, "or after exponentiating"),
    "index assignment in place": (index_assign, "in place"),
    "exp over the sum without the max shift": (no_max_shift, "overflows float32"),
    "softmax over dim 1 of a 3-d batch": (softmax_dim_1, "wrong dimension"),
    "log_softmax": (log_softmax, "log-probabilities"),
    "a finite fill of -100": (finite_fill, "finite fill"),
    "the reference imported inside": (import_inside, "tfedu.constrained"),
    "the reference through the package": (through_the_package, "tfedu.constrained"),
}


@pytest.mark.parametrize("name", RIGHT)
def test_passes_right_answers(name, capsys):
    nb15.check_constrained_probs(RIGHT[name])
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", MISTAKES)
def test_names_each_mistake(name):
    mistake, fragment = MISTAKES[name]
    message = failure_of(nb15.check_constrained_probs, lambda x, a: constrained_probs(x, a, mistake))
    assert fragment in message, message


@pytest.mark.parametrize("name", MISTAKE_FUNCTIONS)
def test_names_other_mistakes(name):
    fn, fragment = MISTAKE_FUNCTIONS[name]
    message = failure_of(nb15.check_constrained_probs, fn)
    assert fragment in message, message


def test_refuses_the_reference_and_not_done():
    assert "the masking is the exercise" in failure_of(nb15.check_constrained_probs, tfedu.constrained.mask_logits)
    with pytest.raises(ExerciseNotDone):
        nb15.check_constrained_probs(not_done)
    assert "returned None" in failure_of(nb15.check_constrained_probs, lambda x, a: None)


def test_the_underflow_case_really_underflows():
    logits, allowed = nb15.underflow_case(0)
    after = logits.softmax(-1) * allowed
    assert bool((after.sum(-1) == 0).all())  # 0 / 0 for the renormalise-after answer
    assert torch.allclose(nb15.expected_probs(logits, allowed).sum(-1), torch.ones(3, dtype=torch.float64))


def test_every_mistake_differs_from_the_reference_on_some_case():
    for name, (mistake, _) in MISTAKES.items():
        if name in ("in place", "one minus"):
            continue
        assert any(not torch.allclose(constrained_probs(x.clone(), a, mistake).double().nan_to_num(-7),
                                      nb15.expected_probs(x, a), atol=1e-6)
                   for _, x, a in nb15.cases()), name


def test_probe_passes_the_reference_and_names_mistakes():
    probe = nb15.PROBES["check_constrained_probs"]
    for seed in range(4):
        assert is_plain_data(probe.make_inputs(np.random.default_rng(seed)))
        assert verdict(probe, {"constrained_probs": constrained_probs}, seed) is None, seed
        for mistake, fragment in [("after, no renorm", "did not renormalise"), ("after, renorm", "underflow"),
                                  ("zero fill", "instead of -inf"), ("in place", "in place"), ("logits", "not probabilities")]:
            feedback = verdict(probe, {"constrained_probs": lambda x, a, m=mistake: constrained_probs(x, a, m)}, seed)
            assert feedback is not None and fragment in feedback, (seed, mistake, feedback)
        feedback = verdict(probe, {"constrained_probs": no_max_shift}, seed)  # issue 37: it scored full marks
        assert feedback is not None and "overflows float32" in feedback, (seed, feedback)
        for fn in (float_first, double_first, half):
            feedback = verdict(probe, {"constrained_probs": fn}, seed)
            named = feedback is not None and ("keep their dtype" in feedback or "keep the logits' dtype" in feedback)
            assert named, (seed, fn.__name__, feedback)
        for fn in RIGHT.values():
            assert verdict(probe, {"constrained_probs": fn}, seed) is None, (seed, fn.__name__)
    assert "not defined" in verdict(probe, {}, 0)


# ----------------------------------------------------------------------------- 15.3 patch_head

PATCH_ANOTHER_WAY = '''
def patch_head(model, clean_ids, corrupted_ids, layer, head):
    point = model.hook_points()[f"blocks.{layer}.attn.hook_z"]
    kept = {}
    handle = point.register_forward_hook(lambda module, args, out: kept.__setitem__("z", out.detach().clone()))
    try:
        with torch.inference_mode():
            model(clean_ids)
    finally:
        handle.remove()

    def swap(module, args, out):
        out = out.clone()
        out[..., head, :] = kept["z"][..., head, :]
        return out

    handle = point.register_forward_hook(swap)
    try:
        with torch.inference_mode():
            return model(corrupted_ids).clone()
    finally:
        handle.remove()
'''


def patch_another_way():
    namespace = {"torch": torch}
    exec(PATCH_ANOTHER_WAY, namespace)
    return namespace["patch_head"]


PATCH_NONE_BACK = """
def patch_head(model, clean_ids, corrupted_ids, layer, head):
    name = f"blocks.{layer}.attn.hook_z"
    with torch.no_grad():
        _, cache = model.run_with_cache(clean_ids)
        clean_z = cache[name]

        def patch(z):
            z = z.clone()
            z[:, :, head] = clean_z[:, :, head]
            # no return: the patched copy is thrown away

        with model.hooks(**{name.replace(".", "__"): patch}):
            return model(corrupted_ids)
"""


def patch_mistake(mistake):
    if mistake == "none-back":
        return _exec(PATCH_NONE_BACK, "patch_head")
    if mistake == "leak":
        def leaky(model, clean_ids, corrupted_ids, layer, head):
            right = patch_another_way()(model, clean_ids, corrupted_ids, layer, head)
            model.blocks[layer].attn.hook_z.register_forward_hook(lambda module, args, out: None)  # never removed
            return right
        return leaky
    return lambda *args: nb15._patch_variant(*args, mistake)


PATCH_MISTAKES = [("all-heads", "every head of block"), ("reversed", "the patch went the wrong way"),
                  ("no-patch", "unpatched"), ("clean", "the clean run's"), ("position-axis", "rather than head"),
                  ("last-position", "only the last position"), ("leak", "still attached"),
                  ("none-back", "returned None"), ("none-back", "no hook was attached")]


def test_patch_head_passes_the_reference_and_another_way(capsys):
    for fn in (nb15.reference_patch_head, patch_another_way()):
        nb15.check_patch_head(fn)
    assert capsys.readouterr().out.count("all checks passed") == 2


@pytest.mark.parametrize("mistake, fragment", PATCH_MISTAKES)
def test_patch_head_names_each_mistake_in_the_check_and_the_probe(mistake, fragment):
    assert fragment in failure_of(nb15.check_patch_head, patch_mistake(mistake))
    for seed in range(2):
        feedback = verdict(nb15.PROBES["check_patch_head"], {"patch_head": patch_mistake(mistake)}, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


def test_the_patch_head_probe_passes_right_answers():
    for seed in range(4):
        assert verdict(nb15.PROBES["check_patch_head"], {"patch_head": patch_another_way()}, seed) is None
        assert verdict(nb15.PROBES["check_patch_head"], {"patch_head": nb15.reference_patch_head}, seed) is None


def test_patching_every_position_of_the_residual_stream_is_the_clean_run():
    """Why the checker has no separate 'whole residual stream' mistake: after any block, at every position, it is the
    clean run itself (the later blocks read nothing else)."""
    model = nb15.patch_model(0)
    clean, corrupted = nb15.patch_inputs(0, 2, 12, model.cfg.d_vocab)
    with torch.no_grad():
        _, cache = model.run_with_cache(clean)
        with model.hooks(blocks__0__hook_resid_post=lambda resid: cache["blocks.0.hook_resid_post"]):
            patched = model(corrupted)
        assert torch.allclose(patched, model(clean), atol=1e-5)


# ----------------------------------------------------------------------------- 15.4 logit_lens

LENS_ANOTHER_WAY = '''
def logit_lens(model, ids):
    """With forward hooks of its own on the blocks (no run_with_cache), removed afterwards."""
    kept = []
    handles = [model.blocks[0].register_forward_pre_hook(lambda module, args: kept.append(args[0]))]
    handles += [block.register_forward_hook(lambda module, args, out: kept.append(out)) for block in model.blocks]
    try:
        with torch.inference_mode():
            model(ids)
            return torch.stack([model.unembed(model.ln_final(resid)) for resid in kept]).clone()
    finally:
        for handle in handles:
            handle.remove()
'''


def lens_another_way():
    namespace = {"torch": torch}
    exec(LENS_ANOTHER_WAY, namespace)
    return namespace["logit_lens"]


LENS_VARIANT = '''
def logit_lens(model, ids):
    """A learner's lens with one mistake (MISTAKE), written without tfedu.checks (the check scans the answer)."""
    n_layers = len(model.blocks)
    with torch.no_grad():
        logits, cache = model.run_with_cache(ids)
        after = [f"blocks.{i}.hook_resid_{'pre' if MISTAKE == 'resid-pre' else 'post'}" for i in range(n_layers)]
        names = after if MISTAKE == "no-embed" else ["blocks.0.hook_resid_pre"] + after
        rows = []
        for i, name in enumerate(names):
            normed = cache[name] if MISTAKE == "no-norm" else model.ln_final(cache[name])
            if MISTAKE == "twice" and i == len(names) - 1:
                normed = model.ln_final(normed)
            rows.append(model.unembed(normed))
        if MISTAKE == "extra-row":
            rows.append(logits)
        lens = torch.stack(rows, dim=1 if MISTAKE == "batch-first" else 0)
        if MISTAKE == "not-exact":
            lens = lens + 1e-6 * lens.abs().max()  # within 1e-4 of the logits, not bit for bit
        if MISTAKE == "leak":
            model.ln_final.register_forward_hook(lambda module, args, out: None)  # never removed
        return lens.softmax(dim=-1) if MISTAKE == "softmax" else lens
'''


def lens_mistake(mistake):
    namespace = {"torch": torch, "MISTAKE": mistake}
    exec(LENS_VARIANT, namespace)
    return namespace["logit_lens"]


def test_the_learner_variants_are_the_checkers():
    model = nb15.lens_model(3)
    ids = torch.randint(0, model.cfg.d_vocab, (2, 6), generator=torch.Generator().manual_seed(3))
    for mistake in (None, *nb15.LL_MISTAKES):
        assert torch.equal(lens_mistake(mistake)(model, ids), nb15._lens_variant(model, ids, mistake)), mistake


LENS_MISTAKES = [("no-norm", "skip the final norm"), ("no-embed", "n_layers rows"),
                 ("resid-pre", "each block's input"), ("twice", "through the final norm twice"),
                 ("extra-row", "n_layers + 2 rows"), ("batch-first", "wrong axis"), ("softmax", "probabilities"),
                 ("not-exact", "bit for bit"), ("leak", "still attached")]


def test_logit_lens_passes_the_reference_and_another_way(capsys):
    for fn in (nb15.reference_logit_lens, lens_another_way()):
        nb15.check_logit_lens(fn)
    assert capsys.readouterr().out.count("all checks passed") == 2


def test_the_reference_lens_is_interps_bit_for_bit():
    from tfedu import interp

    for seed, n_layers, norm, positional, tied, batch, pos in nb15.LENS_CASES:
        model = nb15.lens_model(seed, n_layers=n_layers, norm=norm, positional=positional, tied=tied)
        ids = torch.randint(0, model.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(nb15.reference_logit_lens(model, ids), interp.logit_lens(model, ids))


@pytest.mark.parametrize("mistake, fragment", LENS_MISTAKES)
def test_logit_lens_names_each_mistake_in_the_check_and_the_probe(mistake, fragment):
    assert fragment in failure_of(nb15.check_logit_lens, lens_mistake(mistake))
    for seed in range(2):
        feedback = verdict(nb15.PROBES["check_logit_lens"], {"logit_lens": lens_mistake(mistake)}, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


def test_logit_lens_refuses_interp_and_not_done():
    from tfedu import interp

    assert "tfedu.interp" in failure_of(nb15.check_logit_lens, interp.logit_lens)
    with pytest.raises(ExerciseNotDone):
        nb15.check_logit_lens(not_done)


def test_the_logit_lens_probe_passes_right_answers():
    for seed in range(4):
        assert verdict(nb15.PROBES["check_logit_lens"], {"logit_lens": lens_another_way()}, seed) is None
        assert verdict(nb15.PROBES["check_logit_lens"], {"logit_lens": nb15.reference_logit_lens}, seed) is None


# ----------------------------------------------------------------------------- 15.1 induction_score

INDUCTION_BY_DIAGONAL = """
def induction_score(pattern, seq_len):
    lead = pattern.shape[-1] - 2 * seq_len
    stripe = pattern.diagonal(offset=-(seq_len - 1), dim1=-2, dim2=-1)  # batch n_heads (pos - seq_len + 1)
    return stripe[..., lead + 1:].mean(dim=(0, -1))  # its entries from query lead + seq_len on
"""

INDUCTION_VARIANT = """
def induction_score(pattern, seq_len):
    \"\"\"A learner's score with one mistake (MISTAKE).\"\"\"
    n_pos = pattern.shape[-1]
    lead = 0 if MISTAKE == "no-lead" else n_pos - 2 * seq_len
    query = torch.arange(lead + seq_len, n_pos if MISTAKE != "no-lead" else 2 * seq_len)
    if MISTAKE == "all-queries":
        query = torch.arange(seq_len - 1, n_pos)
    if MISTAKE == "extra-query":  # one query too many: the first copy's last token included
        query = torch.arange(lead + seq_len - 1, n_pos)
    key = query - seq_len if MISTAKE == "copy" else query - seq_len + 1
    if MISTAKE == "key-further":  # one further back than the copy
        key = query - (seq_len + 1)
    if MISTAKE == "transposed":
        picked = pattern[..., key, query]
    else:
        picked = pattern[..., query, key]
    scores = picked.mean(-1)  # batch n_heads
    if MISTAKE == "heads-mean":
        return scores.mean()
    if MISTAKE == "no-batch-mean":
        return scores
    return scores.mean(0)
"""


def _exec(source, name, **names):
    namespace = {"torch": torch, **names}
    exec(source, namespace)
    return namespace[name]


INDUCTION_MISTAKES = [("copy", "the earlier copy of the current token itself"), ("all-queries", "first copy included"),
                      ("key-further", "seq_len + 1 positions back"), ("extra-query", "seq_len + 1 queries"),
                      ("no-lead", "ignore the tokens before the first copy"), ("transposed", "axes swapped"),
                      ("heads-mean", "averaged over the heads"), ("no-batch-mean", "average over the batch")]


def test_induction_score_passes_the_reference_and_another_way(capsys):
    for fn in (nb15.reference_induction_score, _exec(INDUCTION_BY_DIAGONAL, "induction_score")):
        nb15.check_induction_score(fn)
    assert capsys.readouterr().out.count("all checks passed") == 2


@pytest.mark.parametrize("mistake, fragment", INDUCTION_MISTAKES)
def test_induction_score_names_each_mistake_in_the_check_and_the_probe(mistake, fragment):
    fn = _exec(INDUCTION_VARIANT, "induction_score", MISTAKE=mistake)
    assert fragment in failure_of(nb15.check_induction_score, fn)
    for seed in range(2):
        feedback = verdict(nb15.PROBES["check_induction_score"], {"induction_score": fn}, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


def test_the_induction_score_probe_passes_right_answers():
    probe = nb15.PROBES["check_induction_score"]
    for seed in range(4):
        assert is_plain_data(probe.make_inputs(np.random.default_rng(seed)))
        for fn in (nb15.reference_induction_score, _exec(INDUCTION_BY_DIAGONAL, "induction_score")):
            assert verdict(probe, {"induction_score": fn}, seed) is None, seed
    assert "not defined" in verdict(probe, {}, 0)


def induction_through_interp(pattern, seq_len):
    """Right numbers, through tfedu.interp (a global, as in the notebook): refused."""
    return tfedu.interp.induction_score(pattern, seq_len, pattern.shape[-1] - 2 * seq_len).mean(0)


def test_induction_score_refuses_interp_and_not_done():
    assert "tfedu.interp" in failure_of(nb15.check_induction_score, induction_through_interp)
    with pytest.raises(ExerciseNotDone):
        nb15.check_induction_score(not_done)


def test_the_reference_induction_score_is_interps_on_the_course_models():
    from tfedu import interp
    from tfedu.experiments import course_gpt, induction

    for model, bos, seq_len in ((course_gpt.load()[0], 0, 10), (induction.load(), induction.BOS, 12)):
        ids = interp.repeated_random_tokens(4, seq_len, model.cfg.d_vocab, generator=torch.Generator().manual_seed(1),
                                            bos=bos)
        names = [f"blocks.{i}.attn.hook_pattern" for i in range(model.cfg.n_layers)]
        _, cache = interp.run_with_cache(model, ids, names)
        mine = torch.stack([nb15.reference_induction_score(cache[name], seq_len) for name in names])
        assert torch.allclose(mine, interp.score_heads(model, ids, seq_len)["induction"], atol=1e-6)


# ----------------------------------------------------------------------------- 15.2 ablate_heads

ABLATE_IN_PLACE = """
def ablate_heads(model, ids, layer, heads, how="zero"):
    \"\"\"A forward hook of its own that changes the tensor in place and returns None: right (None keeps the changed
    tensor), and removed afterwards.\"\"\"
    def ablate(module, args, z):
        for h in heads:
            z[:, :, h] = 0.0 if how == "zero" else z[:, :, h].mean(dim=(0, 1))

    handle = model.blocks[layer].attn.hook_z.register_forward_hook(ablate)
    try:
        with torch.inference_mode():
            return model(ids).clone()
    finally:
        handle.remove()
"""

ABLATE_NONE_BACK = """
def ablate_heads(model, ids, layer, heads, how="zero"):
    def ablate(z):
        z = z.clone()
        z[:, :, heads] = 0.0 if how == "zero" else z[:, :, heads].mean(dim=(0, 1), keepdim=True)
        # no return: the clone is thrown away

    with torch.no_grad(), model.hooks(**{f"blocks__{layer}__attn__hook_z": ablate}):
        return model(ids)
"""


ABLATE_MEAN_POOLED = """
def ablate_heads(model, ids, layer, heads, how="zero"):
    \"\"\"Mean ablation with the mean taken over AXES of the whole hook tensor (every head of the block).\"\"\"
    def ablate(z):
        z = z.clone()
        z[:, :, heads] = 0.0 if how == "zero" else z.mean(dim=AXES)
        return z

    with torch.no_grad(), model.hooks(**{f"blocks__{layer}__attn__hook_z": ablate}):
        return model(ids)
"""

ABLATE_MEAN_SCALAR = """
def ablate_heads(model, ids, layer, heads, how="zero"):
    def ablate(z):
        z = z.clone()
        z[:, :, heads] = 0.0 if how == "zero" else z[:, :, heads].mean()
        return z

    with torch.no_grad(), model.hooks(**{f"blocks__{layer}__attn__hook_z": ablate}):
        return model(ids)
"""


def ablate_mistake(mistake):
    if mistake == "none-back":
        return _exec(ABLATE_NONE_BACK, "ablate_heads")
    if mistake == "learner-mean-all-heads":
        return _exec(ABLATE_MEAN_POOLED, "ablate_heads", AXES=(0, 1, 2))
    if mistake == "learner-mean-all":
        return _exec(ABLATE_MEAN_SCALAR, "ablate_heads")
    if mistake == "leak":
        def leaky(model, ids, layer, heads, how="zero"):
            right = nb15.reference_ablate_heads(model, ids, layer, heads, how)
            model.blocks[layer].attn.hook_z.register_forward_hook(lambda module, args, out: None)  # never removed
            return right
        return leaky

    def wrong(model, ids, layer, heads, how="zero"):  # right where the mistake does not apply (a mean slip, how='zero')
        out = nb15._ablate_variant(model, ids, layer, heads, how, mistake)
        return nb15.reference_ablate_heads(model, ids, layer, heads, how) if out is None else out

    return wrong


ABLATE_MISTAKES = [("none-back", "returned None"), ("all-heads", "every head of block"),
                   ("attn-out", "whole attention output"), ("position-axis", "rather than heads"),
                   ("mean-heads", "over the heads axis"), ("mean-d-head", "averaged over d_head"),
                   ("mean-batch", "over the batch only"), ("mean-pos", "over the positions only"),
                   ("pattern", "attention pattern (hook_pattern)"), ("zero-for-mean", "you zeroed the heads"),
                   ("mean-for-zero", "by their mean"),
                   ("mean-all-heads", "the heads together"), ("learner-mean-all-heads", "the heads together"),
                   ("mean-all", "by one number"), ("learner-mean-all", "by one number"),
                   ("leak", "still attached")]


def test_ablate_heads_passes_the_reference_and_another_way(capsys):
    for fn in (nb15.reference_ablate_heads, _exec(ABLATE_IN_PLACE, "ablate_heads")):
        nb15.check_ablate_heads(fn)
    assert capsys.readouterr().out.count("all checks passed") == 2


@pytest.mark.parametrize("mistake, fragment", ABLATE_MISTAKES)
def test_ablate_heads_names_each_mistake_in_the_check_and_the_probe(mistake, fragment):
    assert fragment in failure_of(nb15.check_ablate_heads, ablate_mistake(mistake))
    for seed in range(2):
        feedback = verdict(nb15.PROBES["check_ablate_heads"], {"ablate_heads": ablate_mistake(mistake)}, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


def test_the_ablate_heads_probe_passes_right_answers():
    probe = nb15.PROBES["check_ablate_heads"]
    for seed in range(4):
        assert is_plain_data(probe.make_inputs(np.random.default_rng(seed)))
        for fn in (nb15.reference_ablate_heads, _exec(ABLATE_IN_PLACE, "ablate_heads")):
            assert verdict(probe, {"ablate_heads": fn}, seed) is None, seed


def test_ablate_heads_refuses_not_done():
    with pytest.raises(ExerciseNotDone):
        nb15.check_ablate_heads(not_done)


# ----------------------------------------------------------------------------- 15.5 logit_attribution

ATTRIBUTION_ANOTHER_WAY = """
def logit_attribution(model, ids, pos, token):
    \"\"\"One read-out direction for the frozen norm (centring moved onto it), each head's W_O columns by slicing.\"\"\"
    with torch.inference_mode():
        _, cache = model.run_with_cache(ids)
        norm = model.ln_final
        final = cache[f"blocks.{len(model.blocks) - 1}.hook_resid_post"][0, pos]
        wu = norm.weight * model.unembed.weight[token]
        if hasattr(norm, "bias"):  # LayerNorm: centre
            direction = (wu - wu.mean()) / ((final - final.mean()).pow(2).mean() + norm.eps).sqrt()
        else:  # RMSNorm
            direction = wu / (final.pow(2).mean() + norm.eps).sqrt()
        parts = {"embed": cache["hook_embed"][0, pos] @ direction}
        if "hook_pos_embed" in cache:
            parts["pos_embed"] = cache["hook_pos_embed"][pos] @ direction
        for i, block in enumerate(model.blocks):
            z, attn = cache[f"blocks.{i}.attn.hook_z"][0, pos], block.attn
            for h in range(attn.n_heads):
                columns = attn.W_O.weight[:, h * attn.d_head:(h + 1) * attn.d_head]  # d_model d_head
                parts[f"L{i}H{h}"] = (columns @ z[h]) @ direction
            if attn.W_O.bias is not None:
                parts[f"L{i} attn bias"] = attn.W_O.bias @ direction
            if f"blocks.{i}.hook_mlp_out" in cache:
                parts[f"L{i} MLP"] = cache[f"blocks.{i}.hook_mlp_out"][0, pos] @ direction
        if getattr(norm, "bias", None) is not None:
            parts["ln_final bias"] = norm.bias @ model.unembed.weight[token]
        return {label: value.item() for label, value in parts.items()}
"""


def attribution_another_way():
    return _exec(ATTRIBUTION_ANOTHER_WAY, "logit_attribution")


ATTRIBUTION_VARIANT = """
def logit_attribution(model, ids, pos, token):
    \"\"\"A learner's split with one mistake (MISTAKE), written without tfedu.checks (the check scans the answer).\"\"\"
    norm = model.ln_final
    is_layer_norm = type(norm).__name__ == "LayerNorm"
    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
        u = model.unembed.weight[token]

        def scale_of(x):
            x = x - x.mean() if is_layer_norm else x
            return (x.pow(2).mean() + norm.eps).sqrt()

        final = cache[f"blocks.{len(model.blocks) - 1}.hook_resid_post"][0, pos]
        final_scale = scale_of(final)
        if MISTAKE == "std":  # the learner's slip: s = x.std()
            final_scale = final.std()
        if MISTAKE == "std-eps":
            final_scale = (final.var() + norm.eps).sqrt()
        bias = norm.bias @ u if getattr(norm, "bias", None) is not None else None

        def read(x):
            if MISTAKE == "own-norm":
                return norm(x) @ u
            x = x - x.mean() if is_layer_norm and MISTAKE != "no-centre" else x
            scale = scale_of(x) if MISTAKE == "own-scale" else 1.0 if MISTAKE == "no-scale" else final_scale
            value = (x / scale * (1.0 if MISTAKE == "no-weight" else norm.weight)) @ u
            return value + bias if MISTAKE == "bias-everywhere" else value

        parts = {"embed": read(cache["hook_embed"][0, pos])}
        if model.pos_embed is not None:
            parts["pos_embed"] = read(cache["hook_pos_embed"][pos])
        for i, block in enumerate(model.blocks):
            attn, z = block.attn, cache[f"blocks.{i}.attn.hook_z"][0, pos]
            w_o = attn.W_O.weight
            if MISTAKE == "wo-rows":
                per_head = w_o.reshape(attn.n_heads, attn.d_head, -1)
            elif MISTAKE == "wo-order":
                per_head = w_o.T.reshape(attn.d_head, attn.n_heads, -1).transpose(0, 1)
            else:
                per_head = w_o.T.reshape(attn.n_heads, attn.d_head, -1)
            for h in range(attn.n_heads):
                parts[f"L{i}H{h}"] = read(z[h] if MISTAKE == "no-wo" else z[h] @ per_head[h])
            if attn.W_O.bias is not None:
                parts[f"L{i} attn bias"] = read(attn.W_O.bias)
            if f"blocks.{i}.hook_mlp_out" in cache:
                point = "hook_resid_post" if MISTAKE == "resid-post" else "hook_mlp_out"
                parts[f"L{i} MLP"] = read(cache[f"blocks.{i}.{point}"][0, pos])
        if bias is not None:
            parts["ln_final bias"] = bias
        if MISTAKE == "no-bias-part":
            parts.pop("ln_final bias", None)
        if MISTAKE == "off":
            parts["embed"] = parts["embed"] + 0.5
    return {label: float(value) for label, value in parts.items()}
"""


def attribution_mistake(mistake):
    return _exec(ATTRIBUTION_VARIANT, "logit_attribution", MISTAKE=mistake)


def test_the_attribution_variants_are_the_checkers():
    model = nb15.attribution_model(4)
    ids = torch.randint(0, 45, (1, 7), generator=torch.Generator().manual_seed(4))
    for mistake in (None, *nb15.LA_MISTAKES):
        assert attribution_mistake(mistake)(model, ids, 5, 3) == pytest.approx(
            nb15._attribution_variant(model, ids, 5, 3, mistake), abs=1e-5), mistake


ATTRIBUTION_MISTAKES = [("own-norm", "through the final norm on its own"), ("own-scale", "by its own scale"),
                        ("no-centre", "centring"), ("no-scale", "did not divide by the final norm's scale"),
                        ("no-weight", "final norm's weight"), ("bias-everywhere", "to every part"),
                        ("wo-rows", "wrong axis"), ("wo-order", "interleaved"), ("resid-post", "hook_resid_post"),
                        ("std", "Bessel's correction"), ("std-eps", "Bessel's correction")]


def test_logit_attribution_passes_the_reference_and_another_way(capsys):
    for fn in (nb15.reference_logit_attribution, attribution_another_way()):
        nb15.check_logit_attribution(fn)
    assert capsys.readouterr().out.count("all checks passed") == 2


@pytest.mark.parametrize("mistake, fragment", ATTRIBUTION_MISTAKES)
def test_logit_attribution_names_each_mistake_in_the_check_and_the_probe(mistake, fragment):
    assert fragment in failure_of(nb15.check_logit_attribution, attribution_mistake(mistake))
    probe, named = nb15.PROBES["check_logit_attribution"], 0
    for seed in range(8):  # a probe's model may lack what the mistake needs (no MLP, RMSNorm, no bias)
        inputs = probe.make_inputs(np.random.default_rng(seed))
        model = nb15.gpt_from_inputs(inputs)
        if nb15._attribution_variant(model, torch.from_numpy(inputs["ids"]), inputs["pos"], inputs["token"],
                                     mistake) is None:
            continue
        feedback = verdict(probe, {"logit_attribution": attribution_mistake(mistake)}, seed)
        assert feedback is not None and (fragment in feedback or "own" in feedback), (seed, feedback)
        named += fragment in feedback
    assert named >= 2, mistake


def test_logit_attribution_names_wrong_labels_and_a_wrong_sum():
    assert "missing ['ln_final bias']" in failure_of(nb15.check_logit_attribution, attribution_mistake("no-bias-part"))
    assert "sum to" in failure_of(nb15.check_logit_attribution, attribution_mistake("off"))
    assert "d_head columns of W_O" in failure_of(nb15.check_logit_attribution, attribution_mistake("no-wo"))


def test_the_logit_attribution_probe_passes_right_answers():
    probe = nb15.PROBES["check_logit_attribution"]
    for seed in range(4):
        assert is_plain_data(probe.make_inputs(np.random.default_rng(seed)))
        for fn in (nb15.reference_logit_attribution, attribution_another_way()):
            assert verdict(probe, {"logit_attribution": fn}, seed) is None, seed


def test_logit_attribution_refuses_interp_and_not_done():
    from tfedu import interp

    assert "tfedu.interp" in failure_of(nb15.check_logit_attribution, interp.direct_logit_attribution)
    with pytest.raises(ExerciseNotDone):
        nb15.check_logit_attribution(not_done)


def test_the_reference_attribution_is_interps_and_adds_up_on_the_course_models():
    from tfedu import interp
    from tfedu.experiments import course_gpt, induction

    course, tok = course_gpt.load()
    ids = torch.tensor([tok.encode("The list is sorted in place. The sorted list is returned.")])
    rep = interp.repeated_random_tokens(1, 12, 128, generator=torch.Generator().manual_seed(12), bos=induction.BOS)
    for model, ids, pos, token in ((course, ids, 8, 17), (induction.load(), rep, 18, int(rep[0, 19]))):
        mine, theirs = nb15.reference_logit_attribution(model, ids, pos, token), interp.direct_logit_attribution(
            model, ids, pos, token)
        assert list(mine) == list(theirs) and all(abs(mine[k] - theirs[k]) < 1e-5 for k in mine)
        with torch.no_grad():
            assert abs(sum(mine.values()) - model(ids)[0, pos, token].item()) < 1e-4
