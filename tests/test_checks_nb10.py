"""Checkers and probes of notebook 10: each passes the reference and names realistic mistakes."""

import math

import pytest
import torch
import torch.nn.functional as F

from tfedu.checks import nb10_inference as nb10
from checker_helpers import failure_of, not_done, verdict
from tfedu.checks.core import ExerciseNotDone, run_probe
from tfedu.kv_cache import decode_step, kv_cache_bytes, pool_kv_weight

pytestmark = pytest.mark.usefixtures("one_torch_thread")




# ----------------------------------------------------------------------------- 10.1 decode_step


def attend(q, K, V, *, scale=True, dim=-1, mask=None):
    scores = q @ K.transpose(-2, -1)
    if scale:
        scores = scores / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=dim) @ V


def grow(k, v, k_cache, v_cache):
    return torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)


def decode_variant(q, k, v, k_cache, v_cache, mistake=""):
    K, V = grow(k, v, k_cache, v_cache)
    P = K.shape[2]
    if mistake == "overwritten":
        return attend(q, k, v), k, v
    if mistake == "overwrote last":
        K, V = torch.cat([k_cache[:, :, :-1], k], dim=2), torch.cat([v_cache[:, :, :-1], v], dim=2)
        return attend(q, K, V), K, V
    if mistake == "only new":
        return attend(q, k, v), K, V
    if mistake == "self twice":
        return attend(q, torch.cat([K, k], dim=2), torch.cat([V, v], dim=2)), K, V
    if mistake == "appended twice":
        K, V = torch.cat([K, k], dim=2), torch.cat([V, v], dim=2)
        return attend(q, K, V), K, V
    if mistake == "cat dim 1":
        K, V = torch.cat([k_cache, k], dim=1), torch.cat([v_cache, v], dim=1)
        return attend(q, K, V), K, V
    if mistake == "transposed layout":
        return attend(q, K, V), K.transpose(1, 2), V.transpose(1, 2)
    if mistake == "front":
        K, V = torch.cat([k, k_cache], dim=2), torch.cat([v, v_cache], dim=2)
        return attend(q, K, V), K, V
    if mistake == "no scale":
        return attend(q, K, V, scale=False), K, V
    if mistake == "softmax heads":
        return attend(q, K, V, dim=1), K, V
    if mistake == "softmax query":
        return attend(q, K, V, dim=-2), K, V
    if mistake == "tril mask":
        return attend(q, K, V, mask=~torch.tril(torch.ones(1, P)).bool()), K, V
    if mistake == "square mask":
        return attend(q, K, V, mask=torch.triu(torch.ones(P, P), diagonal=1).bool()), K, V
    if mistake == "diagonal masked":
        hide = torch.zeros(1, P, dtype=torch.bool)
        hide[:, -1] = True
        return attend(q, K, V, mask=hide), K, V
    if mistake == "before append":
        return attend(q, k_cache, v_cache), K, V
    if mistake == "order":
        return K, V, attend(q, K, V)
    if mistake == "v from keys":
        return attend(q, K, K), K, K
    if mistake == "z from keys":
        return attend(q, K, K), K, V
    if mistake == "squeezed":
        return attend(q, K, V).squeeze(2), K, V
    if mistake == "exp sum":  # the red team's softmax (issue 37): exp over the sum, no max subtracted
        e = (q @ K.transpose(-2, -1) / math.sqrt(q.shape[-1])).exp()
        return (e / e.sum(dim=-1, keepdim=True)) @ V, K, V
    if mistake == "in place":
        q /= math.sqrt(q.shape[-1])
        return attend(q, K, V, scale=False), K, V
    return attend(q, K, V), K, V


def decode_with_sdpa(q, k, v, k_cache, v_cache):
    K, V = grow(k, v, k_cache, v_cache)
    return F.scaled_dot_product_attention(q, K, V), K, V


DECODE_MISTAKES = [
    ("overwritten", "overwritten instead of appended"), ("overwrote last", "overwritten instead of appended"),
    ("only new", "attended to its own key alone"), ("self twice", "attends to itself twice"),
    ("appended twice", "appended twice"), ("cat dim 1", "Append along dim 2"),
    ("transposed layout", "laid out (batch, pos, n_heads, d_head)"), ("front", "at the front of the cache"),
    ("no scale", "sqrt(d_head)"), ("softmax heads", "over the heads axis"), ("softmax query", "over the query axis"),
    ("tril mask", "first key alone"), ("square mask", "pos + 1 rows"), ("diagonal masked", "z holds NaN"),
    ("before append", "leaves out the new token's own key"), ("order", "you returned (k_cache, v_cache, z)"),
    ("v from keys", "value cache holds keys"), ("z from keys", "weighted sum of keys"),
    ("squeezed", "lost its query axis"), ("in place", "changed the caller's `q` in place"),
    ("exp sum", "e^x overflows once x passes about 88"),
]


def test_decode_step_passes_the_reference_and_a_variant():
    nb10.check_decode_step(decode_step)
    nb10.check_decode_step(decode_variant)


@pytest.mark.parametrize("mistake, fragment", DECODE_MISTAKES, ids=[m for m, _ in DECODE_MISTAKES])
def test_decode_step_names_each_mistake(mistake, fragment):
    message = failure_of(nb10.check_decode_step, lambda *a: decode_variant(*a, mistake=mistake))
    assert fragment in message, message


def test_decode_step_refuses_sdpa_and_says_when_not_done():
    assert "calls scaled_dot_product_attention" in failure_of(nb10.check_decode_step, decode_with_sdpa)
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb10.check_decode_step(not_done)


def test_the_front_mistake_gives_the_right_z():
    # why the front append is told from the returned cache: one step's z does not depend on the cache's order
    tokens, (k_cache, v_cache) = nb10.decode_inputs(0, 2, 3, 5, start=4, steps=1)
    z, *_ = decode_variant(*tokens[0], k_cache, v_cache, mistake="front")
    torch.testing.assert_close(z, decode_step(*tokens[0], k_cache, v_cache)[0])


# ----------------------------------------------------------------------------- 10.3 cache_bytes


def bytes_variant(cfg, n_tokens, batch, dtype, mistakes=()):
    per_number = 4 if "four bytes" in mistakes else torch.empty((), dtype=dtype).element_size()
    per_number = 1 if "numbers" in mistakes else per_number
    heads = cfg.n_heads if "n_heads" in mistakes else cfg.n_kv_heads
    d_head = cfg.d_model // cfg.n_heads if "derived d_head" in mistakes else cfg.d_head
    width = cfg.d_model if "d_model" in mistakes else heads * d_head
    count = (1 if "keys only" in mistakes else 2) * (1 if "no layers" in mistakes else cfg.n_layers) * width * per_number
    count *= (cfg.n_ctx if "n_ctx" in mistakes else n_tokens) * (1 if "no batch" in mistakes else batch)
    if "bits" in mistakes:
        count *= 8
    return float(count) if "float" in mistakes else count


BYTES_MISTAKES = [
    (("keys only",), "the 2 is missing"), (("n_heads",), "n_heads heads where the cache holds n_kv_heads"),
    (("d_model",), "you used d_model"), (("derived d_head",), "d_head as d_model // n_heads"),
    (("n_heads", "derived d_head"), "you used d_model"), (("no batch",), "batch is missing"), (("no layers",), "n_layers is missing"),
    (("four bytes",), "assumed 4 bytes"), (("bits",), "bits, not bytes"), (("n_ctx",), "cfg.n_ctx"),
    (("numbers",), "you counted numbers, not bytes"),
    (("float",), "a float with the right value"), (("float", "bits"), "bits, not bytes"),
    (("keys only", "four bytes"), "the 2 is missing: the cache holds a key AND a value vector per layer, key/value "
                                  "head and token; and you assumed 4 bytes"),
    (("n_heads", "no batch", "bits"), "batch is missing"),
]


def test_cache_bytes_passes_the_reference_and_a_variant():
    nb10.check_cache_bytes(kv_cache_bytes)
    nb10.check_cache_bytes(lambda cfg, n, b, dtype: 2 * cfg.n_layers * cfg.n_kv_heads * cfg.d_head * dtype.itemsize * n * b)


@pytest.mark.parametrize("mistakes, fragment", BYTES_MISTAKES, ids=["+".join(m) for m, _ in BYTES_MISTAKES])
def test_cache_bytes_names_each_mistake(mistakes, fragment):
    message = failure_of(nb10.check_cache_bytes, lambda *a: bytes_variant(*a, mistakes=mistakes))
    assert fragment in message, message


def test_cache_bytes_refuses_tensors_and_says_when_not_done():
    message = failure_of(nb10.check_cache_bytes, lambda *a: torch.tensor(bytes_variant(*a)))
    assert "not tensors" in message, message
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb10.check_cache_bytes(not_done)
    # a dict of sizes without float64 raises, and the hint says where the size comes from
    sizes = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
    message = failure_of(nb10.check_cache_bytes, lambda cfg, n, b, dtype: 2 * cfg.n_layers * cfg.n_kv_heads * cfg.d_head
                         * sizes[dtype] * n * b)
    assert "element_size()" in message, message


def test_the_check_cases_tell_every_set_of_mistakes_apart():
    assert nb10.separates_mistakes(nb10.BYTES_CASES)
    # each case stays a real ModelConfig: grouped heads and a d_head of its own are there
    assert any(cfg.n_kv_heads < cfg.n_heads for cfg, *_ in nb10.BYTES_CASES)
    assert any(cfg.d_head * cfg.n_heads != cfg.d_model for cfg, *_ in nb10.BYTES_CASES)


# ----------------------------------------------------------------------------- 10.5 pool_kv_weight


def pool_variant(weight, n_heads, n_kv_heads, mistake=""):
    g, d_head = n_heads // n_kv_heads, weight.shape[0] // n_heads
    if mistake == "strided":
        return weight.reshape(g, n_kv_heads, d_head, *weight.shape[1:]).mean(0).reshape(-1, *weight.shape[1:])
    if mistake == "2-D only":
        return weight.reshape(n_kv_heads, g, d_head, weight.shape[1]).mean(1).reshape(-1, weight.shape[1])
    if mistake == "flattened rest":
        return weight.reshape(n_kv_heads, g, d_head, -1).mean(1).reshape(n_kv_heads * d_head, -1)
    if mistake == "transposed rows":
        return weight.reshape(d_head, n_kv_heads, g, *weight.shape[1:]).mean(2).flatten(0, 1)
    if mistake == "input axis" and weight.dim() == 2:
        return weight.reshape(weight.shape[0], n_kv_heads, g, -1).mean(2).flatten(1)
    heads = weight.unflatten(0, (n_kv_heads, g, d_head))
    if mistake == "in place":  # a view of the caller's weight, divided in place
        heads /= g
        return heads.sum(1).flatten(0, 1)
    if mistake == "sum":
        return heads.sum(1).flatten(0, 1)
    if mistake == "first":
        return heads[:, 0].flatten(0, 1)
    return heads.mean(1).flatten(0, 1)


POOL_MISTAKES = [("strided", "strided heads"), ("sum", "summed"), ("first", "first head of each group"),
                 ("transposed rows", "(d_head, n_heads)"), ("2-D only", "keep the trailing axes"),
                 ("flattened rest", "keep the trailing axes"), ("input axis", "pooled the input axis"),
                 ("in place", "in place")]


def test_pool_passes_the_reference_and_a_variant():
    nb10.check_pool_kv_weight(pool_kv_weight)
    nb10.check_pool_kv_weight(pool_variant)


@pytest.mark.parametrize("mistake, fragment", POOL_MISTAKES, ids=[m for m, _ in POOL_MISTAKES])
def test_pool_names_each_mistake(mistake, fragment):
    message = failure_of(nb10.check_pool_kv_weight, lambda *a: pool_variant(*a, mistake=mistake))
    assert fragment in message, message


def test_pool_says_when_not_done():
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb10.check_pool_kv_weight(not_done)


# ----------------------------------------------------------------------------- probes

PROBE_CASES = [
    ("check_decode_step", "decode_step", decode_variant,
     [(lambda *a, k=k: decode_variant(*a, mistake=k), f) for k, f in DECODE_MISTAKES
      if k not in ("cat dim 1", "in place", "diagonal masked")]  # these raise or go through the grader's own checks
     + [(lambda *a: decode_variant(*a, mistake="in place"), "changed its input in place")]),
    ("check_cache_bytes", "cache_bytes", kv_cache_bytes,
     [(lambda *a, m=m: bytes_variant(*a, mistakes=m), f) for m, f in BYTES_MISTAKES]),
    ("check_pool_kv_weight", "pool_kv_weight", pool_variant,
     [(lambda *a, k=k: pool_variant(*a, mistake=k), f) for k, f in POOL_MISTAKES
      if k not in ("2-D only", "in place")] + [(lambda *a: pool_variant(*a, mistake="in place"), "in place")]),
]


@pytest.mark.parametrize("grade_id, name, right, wrongs", PROBE_CASES, ids=[c[0] for c in PROBE_CASES])
def test_probes_pass_right_answers_and_name_mistakes(grade_id, name, right, wrongs):
    probe = nb10.PROBES[grade_id]
    for seed in range(4):
        assert verdict(probe, {name: right}, seed) is None
    for wrong, fragment in wrongs:
        for seed in range(2):
            feedback = verdict(probe, {name: wrong}, seed)
            assert feedback is not None and fragment in feedback, (fragment, seed, feedback)


def test_probe_errors_and_nan_fail():
    probe = nb10.PROBES["check_decode_step"]
    with pytest.raises(RuntimeError):  # in the grader, an exception in the kernel scores zero
        run_probe(probe, {"decode_step": lambda *a: decode_variant(*a, mistake="cat dim 1")}, 0)
    assert "z holds NaN" in verdict(probe, {"decode_step": lambda *a: decode_variant(*a, mistake="diagonal masked")}, 0)
    with pytest.raises(IndexError):
        run_probe(nb10.PROBES["check_pool_kv_weight"], {"pool_kv_weight": lambda *a: pool_variant(*a, mistake="2-D only")}, 0)


def test_probe_names_the_grader_can_check():
    assert nb10.PROBES["check_decode_step"].exercise == "ex_decode_step"
    assert "torch.nn.functional.scaled_dot_product_attention" in nb10.PROBES["check_decode_step"].forbidden
    assert {"tfedu.kv_cache", "tfedu.mla"} <= set(nb10.PROBES["check_cache_bytes"].forbidden)
    assert "tfedu.kv_cache" in nb10.PROBES["check_pool_kv_weight"].forbidden


# ----------------------------------------------------------------------------- 10.2

from tfedu.checks.core import CheckFailure  # noqa: E402
from tfedu.kv_cache import KVCache  # noqa: E402


def cg_learner(bug=None):
    """A learner's cached_generate, one switch per mistake."""

    def cached_generate(model, ids, max_new_tokens):
        if bug != "no-eval":
            model.eval()
        with torch.no_grad():
            cache = None if bug == "no-cache" else KVCache.for_model(model, batch=ids.shape[0])
            if bug == "token-by-token":
                for t in range(ids.shape[1]):
                    logits = model(ids[:, t:t + 1], kv_cache=cache)
            else:
                logits = model(ids, kv_cache=cache) if cache is not None else model(ids)
            out = ids
            for step in range(max_new_tokens):
                position = 0 if bug == "first" and step == 0 else -1
                if bug == "flat-argmax":  # no dim: the index into the whole flattened logits, one per batch
                    chosen = torch.stack([logits[b, position].flatten().argmax() + logits.shape[-1] for b in range(len(out))])
                    out = torch.cat([out, chosen[:, None]], dim=1)
                    break
                out = torch.cat([out, logits[:, position].argmax(dim=-1, keepdim=True)], dim=1)
                if step == max_new_tokens - 1 and bug != "extra-call":
                    break
                if bug == "no-cache":
                    logits = model(out)
                elif bug == "whole":
                    logits = model(out, kv_cache=cache)
                elif bug == "fresh":
                    logits = model(out[:, -1:], kv_cache=KVCache.for_model(model, batch=ids.shape[0]))
                else:
                    logits = model(out[:, -1:], kv_cache=cache)
        return out

    return cached_generate


CG_MISTAKES = [("no-cache", "without the cache"), ("token-by-token", "one token at a time"),
               ("whole", "a decoding step fed"), ("fresh", "found the cache empty"),
               ("first", "logits of the first position"), ("extra-call", "needs no forward pass"),
               ("flat-argmax", "outside the vocabulary"),
               ("no-eval", "model.eval() first")]


def test_cached_generate_passes_the_reference_and_a_learners_loop(capsys):
    for fn in (nb10.reference_cached_generate, cg_learner()):
        nb10.check_cached_generate(fn)
    assert capsys.readouterr().out.count("all checks passed") == 2


@pytest.mark.parametrize("bug, fragment", CG_MISTAKES)
def test_cached_generate_names_each_mistake(bug, fragment):
    with pytest.raises(CheckFailure) as failure:
        nb10.check_cached_generate(cg_learner(bug))
    assert fragment in str(failure.value), str(failure.value)


def test_cached_generate_not_done():
    with pytest.raises(ExerciseNotDone):
        nb10.check_cached_generate(not_done)


@pytest.mark.parametrize("bug, fragment", [m for m in CG_MISTAKES if m[0] != "no-eval"])
def test_the_cached_generate_probe_names_each_mistake(bug, fragment):
    probe = nb10.PROBES["check_cached_generate"]
    for seed in range(2):
        feedback = verdict(probe, {"cached_generate": cg_learner(bug)}, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


def test_the_cached_generate_probe_passes_right_answers():
    probe = nb10.PROBES["check_cached_generate"]
    for seed in range(4):
        assert verdict(probe, {"cached_generate": cg_learner()}, seed) is None


# ----------------------------------------------------------------------------- 10.4


def gqa_learner(x, W_Q, W_K, W_V, W_O, n_heads, n_kv_heads):
    """A learner's grouped-query attention written with einsum and an explicit mask, another way than the notebook's."""
    b, n, _ = x.shape
    dh = W_Q.shape[0] // n_heads
    q = (x @ W_Q.T).reshape(b, n, n_kv_heads, n_heads // n_kv_heads, dh)  # query heads grouped by their kv head
    k, v = (x @ W_K.T).reshape(b, n, n_kv_heads, dh), (x @ W_V.T).reshape(b, n, n_kv_heads, dh)
    scores = torch.einsum("bqkgd,bskd->bkgqs", q, k) / math.sqrt(dh)
    scores = torch.where(torch.ones(n, n, dtype=torch.bool).tril(), scores, float("-inf"))
    z = torch.einsum("bkgqs,bskd->bqkgd", scores.softmax(-1), v).reshape(b, n, n_heads * dh)
    return z @ W_O.T


def test_gqa_passes_the_reference_and_a_learners_einsum_version(capsys):
    for fn in (nb10.reference_gqa_attention, gqa_learner):
        nb10.check_gqa_attention(fn)
    assert capsys.readouterr().out.count("all checks passed") == 2


@pytest.mark.parametrize("variant, fragment", [("tiled", "wrong order"), ("no-mask", "every query saw every key"),
                                               ("no-scale", "sqrt(d_head)"), ("axis", "over the queries"),
                                               ("split-no-transpose", "mixes positions into heads"),
                                               ("merge-no-transpose", "swap the heads and pos axes back")])
def test_gqa_names_each_mistake_in_the_check_and_the_probe(variant, fragment):
    wrong = lambda *args: nb10._gqa_variant(*args, variant)  # noqa: E731
    with pytest.raises(CheckFailure) as failure:
        nb10.check_gqa_attention(wrong)
    assert fragment in str(failure.value)
    for seed in range(2):
        feedback = verdict(nb10.PROBES["check_gqa_attention"], {"gqa_attention": wrong}, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


def test_the_gqa_probe_passes_right_answers_and_the_oracle_is_transformers_llama():
    for seed in range(4):
        assert verdict(nb10.PROBES["check_gqa_attention"], {"gqa_attention": gqa_learner}, seed) is None
    layer = nb10.llama_attention(7, 32, 8, 2, 4)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    weights = [p.detach() for p in (layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, layer.o_proj.weight)]
    assert torch.allclose(nb10.reference_gqa_attention(x, *weights, 8, 2), nb10.llama_output(layer, x), atol=1e-5)


def test_gqa_names_heads_taken_from_d_model_a_d_model_scale_and_a_hidden_diagonal():
    def from_d_model(x, W_Q, W_K, W_V, W_O, n_heads, n_kv_heads):
        d_head = x.shape[-1] // n_heads  # wrong once the heads are wider than d_model / n_heads
        b, n, _ = x.shape
        q = (x @ W_Q.T).view(b, n, n_heads, d_head)
        return nb10._gqa_variant(x, W_Q, W_K, W_V, W_O, n_heads, n_kv_heads) + 0 * q.sum()

    def hidden_diagonal(x, W_Q, W_K, W_V, W_O, n_heads, n_kv_heads):
        return gqa_learner(x, W_Q, W_K, W_V, W_O, n_heads, n_kv_heads) * float("nan")

    for fn, fragment in ((from_d_model, "the head width came from d_model"),
                         (lambda *a: nb10._gqa_variant(*a, "scale-d-model"), "divided by sqrt(d_model)"),
                         (hidden_diagonal, "hid the diagonal")):
        with pytest.raises(CheckFailure) as failure:
            nb10.check_gqa_attention(fn)
        assert fragment in str(failure.value), str(failure.value)
