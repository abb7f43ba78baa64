"""Checkers and probes of notebook 06: each passes the reference and names realistic mistakes."""

import math
import time

import numpy as np
import pytest
import torch

from tfedu import attention as tfa
from tfedu import positional
from tfedu.checks import nb06_positional as nb06
from tfedu.checks.core import CheckFailure, ExerciseNotDone, is_plain_data, run_probe, standin_objects
from tfedu.checks.scan import scan_answer

# ----------------------------------------------------------------------------- sinusoids


def make_sinusoidal(bug=None):
    """A learner's sinusoidal, written the way the notebook asks, with one switch per mistake."""

    def sinusoidal(n_positions, d_model, base=10000.0):
        b = {"base-1e5": 100000.0, "base-ignored": 10000.0}.get(bug, base)
        i = torch.arange(d_model // 2)
        exponent = {"exponent-i": i / d_model, "k-from-one": 2 * (i + 1) / d_model}.get(bug, 2 * i / d_model)
        omega = b ** (exponent if bug == "positive" else -exponent)
        if bug == "increasing":
            omega = omega.flip(0)
        t = torch.arange(n_positions)[:, None] + (1 if bug == "from-one" else 0)  # (pos, 1)
        angles = t * omega  # (pos, d_model / 2)
        if bug == "concat":
            return torch.cat([angles.sin(), angles.cos()], dim=-1)
        table = torch.zeros(n_positions, d_model)
        table[:, 0::2] = angles.cos() if bug == "swapped" else angles.sin()
        if bug == "exponent-j":  # the cos dimension 2i + 1 with its own index in the exponent
            table[:, 1::2] = (t * b ** (-(2 * i + 1) / d_model)).cos()
        else:
            table[:, 1::2] = angles.sin() if bug == "swapped" else angles.cos()
        if bug == "float64":
            return table.double()
        if bug == "transposed":
            return table.T
        if bug == "numpy":
            return table.numpy()
        return table

    return sinusoidal


def annotated_transformer_sinusoidal(n_positions, d_model, base=10000.0):
    """The Annotated Transformer's PositionalEncoding table: exp of a log, all in float32."""
    pe = torch.zeros(n_positions, d_model)
    position = torch.arange(0, n_positions).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2) * -(math.log(base) / d_model))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe


def loop_sinusoidal(n_positions, d_model, base=10000.0):
    """The formula of the paper, one entry at a time with math.sin and math.cos."""
    rows = [[math.sin(t / base ** (j / d_model)) if j % 2 == 0 else math.cos(t / base ** ((j - 1) / d_model))
             for j in range(d_model)] for t in range(n_positions)]
    return torch.tensor(rows)


def test_sinusoidal_reference_and_learner_solutions_pass(capsys, typechecked):
    nb06.check_sinusoidal(typechecked(positional.sinusoidal))
    for solution in (make_sinusoidal(), annotated_transformer_sinusoidal, loop_sinusoidal):
        nb06.check_sinusoidal(solution)
    assert "\N{CHECK MARK} sinusoidal positions" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bug, match",
    [
        ("swapped", "sin and cos are swapped"),
        ("increasing", "your frequencies increase along the vector"),
        ("positive", "the exponent's sign is wrong"),
        ("base-1e5", "you used base = 100000; the paper uses 10000"),
        ("base-ignored", r"base=100\.0\) gave the table of base 10000: use the `base` argument instead of a hard-coded"),
        ("from-one", "positions start at 0, not 1"),
        ("concat", "all the sines in the first half"),
        ("exponent-i", "the exponent is 2i / d_model, not i / d_model"),
        ("exponent-j", "not the dimension's own index"),
        ("k-from-one", "the frequency index starts at 0"),
        ("float64", "return float32"),
        ("transposed", r"your table is \(d_model, pos\)"),
        ("numpy", "returned a NumPy array: build it with torch operations"),
    ],
)
def test_sinusoidal_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb06.check_sinusoidal(make_sinusoidal(bug))


def test_sinusoidal_other_bases_are_read_off_the_table():
    with pytest.raises(CheckFailure, match="you used base = 500"):
        nb06.check_sinusoidal(lambda n, d, base=10000.0: positional.sinusoidal(n, d, 500.0))


def test_sinusoidal_without_a_base_argument_says_keep_the_signature():
    with pytest.raises(CheckFailure, match=r"raised TypeError.*keep the signature sinusoidal\(n_positions, d_model, base=10000.0\)"):
        nb06.check_sinusoidal(lambda n_positions, d_model: positional.sinusoidal(n_positions, d_model))


def test_sinusoidal_not_done():
    def sinusoidal(n_positions, d_model, base=10000.0):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb06.check_sinusoidal(sinusoidal)


# ----------------------------------------------------------------------------- ALiBi


def make_alibi_bias(bug=None):
    """A learner's alibi_bias with its own slopes (the paper's recipe), with one switch per mistake."""

    def geometric(n):
        start = 2 ** (-8 / n)
        return [start ** (h + 1) for h in range(n)]

    def slopes_for(n):
        if bug == "plain-geometric":
            return geometric(n)
        if bug == "from-zero":
            return [2 ** (-8 * h / n) for h in range(n)]
        if bug == "halves-from-zero":
            return [1 / 2**h for h in range(n)]
        if bug == "fixed-8":
            return [1 / 2 ** (h + 1) for h in range(n)]
        if bug == "next-power-prefix":  # right for powers of two; otherwise the first n slopes of the next power
            return geometric(2 ** math.ceil(math.log2(n)))[:n]
        if bug == "no-slope":
            return [1.0] * n
        below = 2 ** math.floor(math.log2(n))
        slopes = geometric(below) + geometric(2 * below)[0::2][: n - below]
        return slopes[::-1] if bug == "reversed" else slopes

    def alibi_bias(n_heads, n_query, n_key):
        m = torch.tensor(slopes_for(n_heads))[:, None, None]  # (n_heads, 1, 1)
        i = torch.arange(n_query)[:, None] + (0 if bug == "not-aligned" else n_key - n_query)  # query positions
        j = torch.arange(n_key)[None, :]
        if bug == "bool":
            return (j <= i).expand(n_heads, n_query, n_key)
        if bug == "bloom":
            return (m * j).expand(n_heads, n_query, n_key)
        distance = i - j  # negative above the diagonal, where the causal mask hides the keys anyway
        bias = m * distance if bug == "sign" else -m * distance
        if bug == "masked":  # the causal mask baked in: also a right answer
            bias = bias.masked_fill(j > i, float("-inf"))
        return {"no-heads": lambda: bias[0], "heads-last": lambda: bias.permute(1, 2, 0),
                "float64": lambda: bias.double()}.get(bug, lambda: bias)()

    return alibi_bias


def test_alibi_reference_and_learner_solutions_pass(capsys, typechecked):
    checked = typechecked(positional.alibi_bias)
    nb06.check_alibi_bias(lambda h, q, k: checked(h, q, k))
    nb06.check_alibi_bias(make_alibi_bias())
    nb06.check_alibi_bias(make_alibi_bias("masked"))
    assert "\N{CHECK MARK} ALiBi bias" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bug, match",
    [
        ("reversed", "your slopes are reversed"),
        ("sign", "the sign is flipped"),
        ("not-aligned", r"query i sits at position i \+ n_key - n_query"),
        ("plain-geometric", r"for 6 heads \(not a power of two\).*power of two below \(4 heads\)"),
        ("from-zero", "head 0 has slope 1"),
        ("halves-from-zero", "head 0 has slope 1"),
        ("fixed-8", "you used the 8-head slopes 1/2, 1/4, ... for 4 heads"),
        ("next-power-prefix", r"the first 6 of the 8-head slopes.*6 is not a power of two.*4-head slopes"),
        ("no-slope", "every head has the same bias, -distance"),
        ("bloom", "BLOOM's shortcut"),
        ("bool", "you returned a boolean mask"),
        ("no-heads", r"shape \(5, 5\): one bias per head"),
        ("heads-last", "put the heads first"),
        ("float64", "return float32"),
    ],
)
def test_alibi_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb06.check_alibi_bias(make_alibi_bias(bug))


def test_alibi_not_done():
    def alibi_bias(n_heads, n_query, n_key):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb06.check_alibi_bias(alibi_bias)


# ----------------------------------------------------------------------------- RoPE


def make_apply_rope(bug=None):
    """A learner's apply_rope (float32 angles, as most code writes it), with one switch per mistake."""

    def apply_rope(x, positions):
        d = x.shape[-1]
        exponent = torch.arange(d // 2) / d if bug == "exponent-i" else torch.arange(0, d, 2) / d
        theta = (100000.0 if bug == "base-100k" else 10000.0) ** (exponent if bug == "positive" else -exponent)
        if bug == "increasing":
            theta = theta.flip(0)
        p = {"from-one": lambda: positions + 1, "ignore-positions": lambda: torch.arange(x.shape[-2])}.get(bug, lambda: positions)()
        p = {"float16": p.half, "bfloat16": p.bfloat16}.get(bug, p.float)()
        angles = theta.expand(len(p), -1) if bug == "not-scaled" else p[:, None] * theta  # (pos, d / 2)
        angles = angles if bug == "bfloat16" else angles.float()
        if bug == "backwards":
            angles = -angles
        if bug == "first-pair":
            angles = torch.cat([angles[:, :1], torch.zeros_like(angles[:, 1:])], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        a, b = (x[..., : d // 2], x[..., d // 2:]) if bug == "half" else (x[..., 0::2], x[..., 1::2])
        ra, rb = a * cos - b * sin, a * sin + b * cos
        if bug in ("half", "written-as-halves"):
            return torch.cat([ra, rb], dim=-1)
        if bug == "in-place":
            x[..., 0::2], x[..., 1::2] = ra, rb
            return x
        out = torch.stack([ra, rb], dim=-1).flatten(-2)
        return {"float64": lambda: out.double(), "no-grad": lambda: out.detach(),
                "numpy": lambda: out.detach().numpy()}.get(bug, lambda: out)()

    return apply_rope


def llama_style_apply_rope(x, positions, *, real=True):
    """Meta's Llama code, interleaved pairs as complex numbers; ``real=False`` forgets view_as_real."""
    d = x.shape[-1]
    freqs = 1.0 / (10000.0 ** (torch.arange(0, d, 2)[: d // 2].float() / d))
    freqs_cis = torch.polar(torch.ones(len(positions), d // 2), torch.outer(positions.float(), freqs))
    x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = x_complex * freqs_cis
    return torch.view_as_real(rotated).flatten(-2).type_as(x) if real else rotated


def gpt_j_style_apply_rope(x, positions):
    """GPT-J's rotate_every_two: interleaved pairs, cos and sin repeated to full width."""
    d = x.shape[-1]
    angles = positions.float()[:, None] * 10000.0 ** (-torch.arange(0, d, 2).float() / d)  # (pos, d / 2)
    cos, sin = angles.cos().repeat_interleave(2, dim=-1), angles.sin().repeat_interleave(2, dim=-1)
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def test_apply_rope_reference_and_learner_solutions_pass(capsys, typechecked):
    checked = typechecked(positional.apply_rope)
    nb06.check_apply_rope(lambda x, positions: checked(x, positions))
    nb06.check_apply_rope(make_apply_rope())
    nb06.check_apply_rope(llama_style_apply_rope)
    nb06.check_apply_rope(gpt_j_style_apply_rope)
    assert "\N{CHECK MARK} rotary position embedding (RoPE)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bug, match",
    [
        ("half", "rotate_half, the layout of GPT-NeoX and Hugging Face Llama.*the paper's interleaved pairs"),
        ("written-as-halves", "wrote them back as two halves"),
        ("backwards", "the wrong direction"),
        ("not-scaled", "every position is turned by theta_i alone"),
        ("from-one", r"you used m \+ 1"),
        ("ignore-positions", "you ignored `positions`"),
        ("increasing", "your frequencies increase along the vector"),
        ("positive", "the exponent's sign is wrong"),
        ("exponent-i", "the exponent is 2i / d_head, not i / d_head"),
        ("base-100k", "your angles use base 100000"),
        ("first-pair", "only the first pair"),
        ("float64", r"return x's dtype \(torch.float32\), got torch.float64"),
        ("in-place", "changed the caller's `x` in place"),
        ("no-grad", "no gradient flows back to x"),
        ("numpy", "returned a NumPy array"),
        ("float16", "wrong for positions past 2048: float16 and bfloat16 cannot hold every integer"),
        ("bfloat16", r"differs from the reference.*right for positions 0 \.\. 4 but not for these"),
    ],
)
def test_apply_rope_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb06.check_apply_rope(make_apply_rope(bug))


def test_apply_rope_complex_result_is_told_to_turn_back_real():
    with pytest.raises(CheckFailure, match=r"complex tensor: .*torch\.view_as_real"):
        nb06.check_apply_rope(lambda x, positions: llama_style_apply_rope(x, positions, real=False))


def test_apply_rope_for_2d_inputs_only_is_pointed_to_the_leading_dims():
    def two_d_only(x, positions):
        (pos, d) = x.shape  # unpacking fails on (batch, n_heads, pos, d_head)
        return make_apply_rope()(x, positions)

    with pytest.raises(CheckFailure, match=r"raised ValueError.*leading batch and head dims"):
        nb06.check_apply_rope(two_d_only)


def test_apply_rope_not_done():
    def apply_rope(x, positions):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb06.check_apply_rope(apply_rope)


# ----------------------------------------------------------------------------- attention with RoPE


def make_rope_attention(bug=None, rope=positional.apply_rope):
    """A learner's rope_attention built on tfedu.attention, with one switch per mistake."""

    def rope_attention(q, k, v, positions):
        n = q.shape[-2]
        rotated_q = q if bug in ("only-k", "no-rope") else rope(q, positions)
        rotated_k = k if bug in ("only-q", "no-rope") else rope(k, positions)
        if bug == "rotate-v":
            v = rope(v, positions)
        mask = None if bug == "no-mask" else tfa.causal_mask(n, n)
        if bug == "no-scale":
            scores = (rotated_q @ rotated_k.transpose(-2, -1)).masked_fill(~mask, float("-inf"))
            return torch.softmax(scores, dim=-1) @ v
        output, weights = tfa.scaled_dot_product_attention(rotated_q, rotated_k, v, mask)
        if bug == "no-grad":
            return output.detach()
        return (output, weights) if bug == "pair" else output

    return rope_attention


def mask_from_positions_rope_attention(q, k, v, positions):
    """Llama-style rotation, and the causal mask built from the positions themselves (key at or before the query)."""
    rotated_q, rotated_k = llama_style_apply_rope(q, positions), llama_style_apply_rope(k, positions)
    return tfa.scaled_dot_product_attention(rotated_q, rotated_k, v, positions[:, None] >= positions[None, :])[0]


ROPE_ATTENTION_CELL = """\
def rope_attention(q, k, v, positions):
    n = q.shape[-2]
    q, k = apply_rope(q, positions), apply_rope(k, positions)
    return tfa.scaled_dot_product_attention(q, k, {values}, tfa.causal_mask(n, n))[0]
"""


def notebook_rope_attention(apply_rope, values="v"):
    """rope_attention as the notebook defines it: it finds `apply_rope` among the notebook's globals."""
    namespace = {"torch": torch, "tfa": tfa, "apply_rope": apply_rope}
    exec(ROPE_ATTENTION_CELL.format(values=values), namespace)
    return namespace["rope_attention"]


def test_rope_attention_reference_and_learner_solutions_pass(capsys, typechecked):
    checked_rope = typechecked(positional.apply_rope)
    checked_attention = typechecked(tfa.scaled_dot_product_attention)

    def typechecked_reference(q, k, v, positions):
        n = q.shape[-2]
        return checked_attention(checked_rope(q, positions), checked_rope(k, positions), v, tfa.causal_mask(n, n))[0]

    nb06.check_rope_attention(typechecked_reference)
    nb06.check_rope_attention(nb06.reference_rope_attention)
    nb06.check_rope_attention(make_rope_attention(rope=make_apply_rope()))
    nb06.check_rope_attention(notebook_rope_attention(llama_style_apply_rope))
    nb06.check_rope_attention(mask_from_positions_rope_attention)
    assert "\N{CHECK MARK} attention with RoPE" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bug, match",
    [
        ("rotate-v", "you rotated the values too"),
        ("only-k", "you rotated k but not q"),
        ("only-q", "you rotated q but not k"),
        ("no-rope", "neither q nor k was rotated"),
        ("no-mask", "no causal mask"),
        ("pair", r"return only the output tensor \(\.\.\., pos, d_head\)"),
        ("no-scale", r"missing 1/sqrt\(d_head\) scale"),
        ("no-grad", "no gradient flows back through rope_attention"),
    ],
)
def test_rope_attention_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb06.check_rope_attention(make_rope_attention(bug))


def test_rope_attention_with_half_pairs_is_named():
    rope_half = lambda x, positions: positional.apply_rope(x, positions, layout="half")  # noqa: E731
    with pytest.raises(CheckFailure, match="half-split pairs"):
        nb06.check_rope_attention(make_rope_attention(rope=rope_half))


def test_rope_attention_that_rotates_q_in_place_is_told_so():
    with pytest.raises(CheckFailure, match="changed the caller's `q` in place"):
        nb06.check_rope_attention(make_rope_attention(rope=make_apply_rope("in-place")))


def test_rope_attention_blames_a_wrong_apply_rope_it_calls():
    learner = notebook_rope_attention(make_apply_rope("half"))
    with pytest.raises(CheckFailure, match=r"calls your apply_rope, which is wrong: fix apply_rope first.*rotate_half") as info:
        nb06.check_rope_attention(learner)
    assert "Also" not in str(info.value)  # its own part is right
    assert learner.__globals__["apply_rope"].__name__ == "apply_rope"  # the learner's binding is back
    assert learner.__globals__["apply_rope"] is not positional.apply_rope


def test_rope_attention_names_its_own_mistake_and_the_wrong_apply_rope():
    learner = notebook_rope_attention(make_apply_rope("backwards"), values="apply_rope(v, positions)")
    with pytest.raises(CheckFailure, match=r"you rotated the values too.*Also, your rope_attention calls your apply_rope"):
        nb06.check_rope_attention(learner)


def test_rope_attention_says_when_apply_rope_is_not_done():
    def apply_rope(x, positions):
        raise NotImplementedError

    with pytest.raises(CheckFailure, match="calls your apply_rope, which is not done yet") as info:
        nb06.check_rope_attention(notebook_rope_attention(apply_rope))
    assert not isinstance(info.value, ExerciseNotDone)  # rope_attention itself is done


def test_rope_attention_not_done():
    def apply_rope(x, positions):
        raise NotImplementedError

    def rope_attention(q, k, v, positions):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb06.check_rope_attention(rope_attention)
    namespace = {"apply_rope": apply_rope}
    exec("def rope_attention(q, k, v, positions):\n    raise NotImplementedError\n", namespace)
    with pytest.raises(ExerciseNotDone, match="not done yet"):  # both stubs, as in the released notebook
        nb06.check_rope_attention(namespace["rope_attention"])


# ----------------------------------------------------------------------------- probes


def verdict(probe, namespace, seed, *, standins=False):
    """The grader's verdict on one hidden test: None (pass) or the feedback (an exception counts as a failure)."""
    try:
        outputs, expected = run_probe(probe, namespace, seed, standins=standins)
    except Exception as err:
        return f"raised {type(err).__name__}: {err}"
    return probe.compare(outputs, expected)


def naive_softmax_rope_attention(q, k, v, positions):
    q, k = positional.apply_rope(q, positions), positional.apply_rope(k, positions)
    n = q.shape[-2]
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~tfa.causal_mask(n, n), float("-inf"))
    exps = scores.exp()  # no max shift: exp(1000) = inf
    return exps / exps.sum(dim=-1, keepdim=True) @ v


GOOD = {
    "check_sinusoidal": [{"sinusoidal": positional.sinusoidal}, {"sinusoidal": make_sinusoidal()},
                         {"sinusoidal": annotated_transformer_sinusoidal}],
    "check_alibi_bias": [{"alibi_bias": lambda h, q, k: positional.alibi_bias(h, q, k)}, {"alibi_bias": make_alibi_bias()},
                         {"alibi_bias": make_alibi_bias("masked")}],
    "check_apply_rope": [{"apply_rope": lambda x, p: positional.apply_rope(x, p)}, {"apply_rope": make_apply_rope()},
                         {"apply_rope": llama_style_apply_rope}, {"apply_rope": gpt_j_style_apply_rope}],
    "check_rope_attention": [{"rope_attention": nb06.reference_rope_attention},
                             {"rope_attention": make_rope_attention(rope=make_apply_rope())},
                             {"rope_attention": mask_from_positions_rope_attention}],
}
BAD = {
    "check_sinusoidal": [{"sinusoidal": make_sinusoidal(bug)} for bug in ("swapped", "base-ignored", "from-one", "concat", "k-from-one")],
    "check_alibi_bias": [{"alibi_bias": make_alibi_bias(bug)} for bug in ("reversed", "sign", "not-aligned", "plain-geometric", "no-slope")],
    "check_apply_rope": [{"apply_rope": make_apply_rope(bug)} for bug in ("half", "backwards", "not-scaled", "from-one", "float16")],
    "check_rope_attention": [{"rope_attention": make_rope_attention(bug)} for bug in ("rotate-v", "only-k", "only-q", "no-mask")],
}


def test_every_check_cell_has_a_probe():
    assert set(nb06.PROBES) == set(GOOD) == set(BAD)
    for grade_id, probe in nb06.PROBES.items():
        assert probe.exercise == grade_id.replace("check_", "ex_")
        assert probe.forbidden == ("tfedu.positional",)
        assert probe.compare is not None


@pytest.mark.parametrize("grade_id", sorted(GOOD))
@pytest.mark.parametrize("seed", range(6))
def test_probe_passes_the_reference_and_learner_solutions(grade_id, seed):
    probe = nb06.PROBES[grade_id]
    for namespace in GOOD[grade_id]:
        assert verdict(probe, namespace, seed) is None, (grade_id, seed, namespace)


@pytest.mark.parametrize("grade_id", sorted(BAD))
def test_probe_catches_buggy_versions(grade_id):
    probe = nb06.PROBES[grade_id]
    for namespace in BAD[grade_id]:
        caught = sum(verdict(probe, namespace, seed) is not None for seed in range(6))
        assert caught >= 5, (grade_id, namespace, caught)


@pytest.mark.parametrize(
    "grade_id, namespace, fragment",
    [
        ("check_sinusoidal", {"sinusoidal": make_sinusoidal("float64")}, "returned dtype torch.float64, expected torch.float32"),
        ("check_sinusoidal", {"sinusoidal": make_sinusoidal("numpy")}, "should return tensor, it returned ndarray"),
        ("check_alibi_bias", {"alibi_bias": make_alibi_bias("bool")}, "you returned a boolean mask"),
        ("check_alibi_bias", {"alibi_bias": make_alibi_bias("heads-last")}, "expected (n_heads, query_pos, key_pos)"),
        ("check_apply_rope", {"apply_rope": lambda x, p: llama_style_apply_rope(x, p, real=False)}, "torch.view_as_real"),
        ("check_apply_rope", {"apply_rope": make_apply_rope("in-place")}, "changed its input in place (argument 1"),
        ("check_apply_rope", {"apply_rope": make_apply_rope("no-grad")}, "no gradient flows back through apply_rope"),
        ("check_apply_rope", {"apply_rope": make_apply_rope("float64")}, "returned dtype torch.float64"),
        ("check_rope_attention", {"rope_attention": make_rope_attention("pair")}, "return only the output tensor"),
        ("check_rope_attention", {"rope_attention": naive_softmax_rope_attention}, "scores around 1e3 overflow exp"),
    ],
)
def test_probe_feedback_names_the_mistake(grade_id, namespace, fragment):
    probe = nb06.PROBES[grade_id]
    for seed in range(3):
        feedback = verdict(probe, namespace, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


def test_alibi_probe_compares_only_what_the_causal_mask_shows():
    probe = nb06.PROBES["check_alibi_bias"]
    inputs = probe.make_inputs(np.random.default_rng(0))
    assert any(q < k for _, q, k in inputs["calls"]) and any(k >= 1000 for _, _, k in inputs["calls"])
    assert any(h & (h - 1) for h, _, _ in inputs["calls"])  # a head count that is not a power of two


@pytest.mark.parametrize("grade_id", sorted(GOOD))
def test_probe_inputs_are_plain_data_and_the_run_is_quick(grade_id):
    probe = nb06.PROBES[grade_id]
    namespace = GOOD[grade_id][1]  # a learner-style solution
    run_probe(probe, namespace, 0)  # warm-up
    for seed in range(3):
        assert is_plain_data(probe.make_inputs(np.random.default_rng(seed)))
        start = time.process_time()
        outputs, expected = run_probe(probe, namespace, seed)
        assert time.process_time() - start < 1.0, grade_id
        assert is_plain_data(outputs) and is_plain_data(expected)


def test_probe_code_leaves_no_helper_names_behind():
    for grade_id, probe in nb06.PROBES.items():
        scope = {**GOOD[grade_id][0], "inputs": probe.make_inputs(np.random.default_rng(0)), "np": np, "torch": torch}
        exec(probe.run, scope)
        assert not [name for name in scope if name.startswith("_") and name != "__builtins__"], grade_id


# ----------------------------------------------------------------------------- the stand-in and the scan


def test_the_apply_rope_stand_in_agrees_with_the_reference_and_passes_its_check(capsys):
    standin = standin_objects(nb06.PROBES["check_rope_attention"])["apply_rope"]
    assert sorted(standin_objects(nb06.PROBES["check_rope_attention"])) == ["apply_rope"]
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(2, 3, 9, 2 * (seed + 1), generator=gen)
        positions = torch.randint(0, 5000, (9,), generator=gen)
        torch.testing.assert_close(standin(x, positions), positional.apply_rope(x, positions))
    nb06.check_apply_rope(standin)
    assert "\N{CHECK MARK}" in capsys.readouterr().out


def test_the_stand_in_does_not_rescue_a_rope_attention_that_is_wrong_itself():
    learner = notebook_rope_attention(make_apply_rope(), values="apply_rope(v, positions)")
    assert verdict(nb06.PROBES["check_rope_attention"], learner.__globals__, 0, standins=True) is not None


def test_the_scan_refuses_the_reference_but_lets_rope_attention_use_tfedu_attention():
    context = ["import torch, math\nfrom tfedu import attention as tfa\nfrom tfedu import positional as tfp"]
    for grade_id, probe in nb06.PROBES.items():
        assert scan_answer("def f(x, positions):\n    return tfp.apply_rope(x, positions)\n", context=context,
                           forbidden=probe.forbidden), grade_id
    probe = nb06.PROBES["check_rope_attention"]
    assert scan_answer(ROPE_ATTENTION_CELL.format(values="v"), context=context, forbidden=probe.forbidden) == []
    assert scan_answer(probe.standins, context=["import torch, math\nimport numpy as np\nimport torch.nn.functional as F"],
                       forbidden=probe.forbidden) == []
    assert "tfedu" not in probe.standins
