"""Checkers and probes of notebook 19: each passes right answers and names realistic mistakes."""

import functools

import numpy as np
import pytest
import torch

import checker_helpers as helpers
from checker_helpers import failure_of, not_done, verdict
from tfedu import delta_rule, recurrences
from tfedu.checks import nb19_beyond_attention as nb19
from tfedu.checks.core import ExerciseNotDone

pytestmark = pytest.mark.usefixtures("one_torch_thread")

names_everywhere = functools.partial(helpers.names_everywhere, nb19.PROBES)
passes_everywhere = functools.partial(helpers.passes_everywhere, nb19.PROBES)
check_time = helpers.check_time


# ----------------------------------------------------------------------------- 19.1 gated linear attention's step


def gla_step(state, q_t, k_t, v_t, g_t, mistake=""):
    """A learner's answer, right or with one ``mistake``: broadcasting and a matrix product."""
    gate = g_t[..., None, None]
    outer = v_t.unsqueeze(-1) * k_t.unsqueeze(-2) if mistake == "transposed" else k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
    if mistake == "gate new":
        new = gate * (state + outer)
    elif mistake == "no gate":
        new = state + outer
    elif mistake == "one minus":
        new = (1 - gate) * state + outer
    elif mistake == "in place":
        state.mul_(gate).add_(outer)
        new = state
    else:
        new = gate * state + outer
    read = {"read before": state, "read gated": gate * state}.get(mistake, new)
    o = ((k_t if mistake == "key reads" else q_t).unsqueeze(-2) @ read).squeeze(-2)
    if mistake == "old state":
        return o, state
    if mistake == "no state":
        return o
    if mistake == "float32":
        return o.float(), new.float()
    return o, new


def gla_step_einsum(state, q_t, k_t, v_t, g_t):
    """Another right way: einsum for the outer product and the read."""
    new = torch.einsum("bh,bhde->bhde", g_t, state) + torch.einsum("bhd,bhe->bhde", k_t, v_t)
    return torch.einsum("bhd,bhde->bhe", q_t, new), new


GLA_STEP_MISTAKES = {
    "read before": "before step t's write",
    "read gated": "before step t's write",
    "gate new": "gated the new term too",
    "no gate": "ignores the gate",
    "one minus": "1 - g_t",
    "transposed": "the wrong way round",
    "key reads": "read the state with the key",
    "old state": "returned the old state",
    "in place": "the caller keeps the old state",
    "no state": "return a pair (o_t, new_state)",
    "float32": "keep the inputs' dtype",
}


def test_gla_step_passes_right_answers():
    for fn in (gla_step, gla_step_einsum):
        passes_everywhere(nb19.check_gla_step, "check_gla_step", "gla_step", fn)


@pytest.mark.parametrize("mistake", GLA_STEP_MISTAKES)
def test_gla_step_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb19.check_gla_step, "check_gla_step", "gla_step",
                     lambda *args, m=mistake: gla_step(*args, mistake=m), GLA_STEP_MISTAKES[mistake])


def test_gla_step_refuses_the_library_waits_for_an_answer_and_is_quick():
    assert "tfedu" in failure_of(nb19.check_gla_step, lambda *a: recurrences.gated_linear_attention_step(*a))
    with pytest.raises(ExerciseNotDone):
        nb19.check_gla_step(not_done)
    assert check_time(nb19.check_gla_step, gla_step) < 0.5


# ----------------------------------------------------------------------------- 19.2 the chunked form


def gla_chunked(q, k, v, g, chunk, mistake=""):
    """A learner's answer, right or with one ``mistake``: einsum, a chunk's length from what is left."""
    batch, heads, pos, d_head = q.shape
    state = q.new_zeros(batch, heads, d_head, v.shape[-1])
    log_g, outs = g.log(), []
    starts = range(0, pos // chunk * chunk, chunk) if mistake == "dropped" else range(0, pos, chunk)
    for start in starts:
        end = min(start + chunk, pos)
        q_c, k_c, v_c, lg, g_c = (x[:, :, start:end] for x in (q, k, v, log_g, g))
        b = torch.cumsum(lg, dim=-1)
        if mistake == "exclusive":
            b = b - lg
        if mistake == "global b":
            b = torch.cumsum(log_g, dim=-1)[:, :, start:end]
        c = end - start
        below = torch.tril(torch.ones(c, c, dtype=torch.bool))
        if mistake in ("products", "products mask"):
            p = torch.cumprod(g_c, dim=-1)
            ratio = p[..., :, None] / p[..., None, :]
            decay = ratio * below if mistake == "products mask" else torch.where(below, ratio, torch.zeros(()))
            entering, to_end, through = p, p[..., -1:] / p, p[..., -1]
        else:
            diff = b[..., :, None] - b[..., None, :]
            if mistake == "not causal":
                decay = diff.exp()
            elif mistake == "no mask":
                decay = torch.ones_like(diff)
            elif mistake == "no decay":
                decay = below.to(q.dtype)
            elif mistake == "exp then mask":
                decay = diff.exp() * below
            elif mistake == "tril after exp":  # right values (only a backward pass would meet inf times 0)
                decay = diff.exp().tril()
            elif mistake == "triu":
                decay = torch.where(below.T, diff, torch.tensor(-torch.inf, dtype=q.dtype)).exp()
            elif mistake == "zero fill":
                decay = diff.masked_fill(~below, 0.0).exp()
            else:
                decay = torch.where(below, diff, torch.tensor(-torch.inf, dtype=q.dtype)).exp()
            entering, to_end, through = b.exp(), (b[..., -1:] - b).exp(), b[..., -1].exp()
        if mistake == "state not decayed":
            entering = torch.ones_like(entering)
        if mistake == "to end":
            to_end = b.exp()
        if mistake == "to end none":
            to_end = torch.ones_like(b)
        if mistake == "to end own gate":
            to_end = (b[..., -1:] - b + lg).exp()
        if mistake == "carry not decayed":
            through = torch.ones_like(through)
        if mistake == "no carry":
            state = torch.zeros_like(state)
        scores = torch.einsum("bhtd,bhsd->bhts", q_c, k_c) * decay
        outs.append(torch.einsum("bhts,bhse->bhte", scores, v_c)
                    + entering[..., None] * torch.einsum("bhtd,bhde->bhte", q_c, state))
        state = through[..., None, None] * state + torch.einsum("bhs,bhsd,bhse->bhde", to_end, k_c, v_c)
    return torch.cat(outs, dim=2), state


def gla_chunked_padded(q, k, v, g, chunk):
    """Another right way: padded to whole chunks (gates of 1, zero keys), every chunk's inside at once with matrix
    products, then a loop over chunks for the state only."""
    batch, heads, pos, d_head = q.shape
    d_v, pad = v.shape[-1], -pos % chunk
    qp, kp, vp = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    lg = torch.nn.functional.pad(g.log(), (0, pad))
    n = (pos + pad) // chunk
    qp, kp, vp = (x.reshape(batch, heads, n, chunk, -1) for x in (qp, kp, vp))
    b = lg.reshape(batch, heads, n, chunk).cumsum(-1)
    mask = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    decay = (b[..., :, None] - b[..., None, :]).masked_fill(~mask, float("-inf")).exp()
    inside = ((qp @ kp.transpose(-1, -2)) * decay) @ vp  # (batch, heads, n, chunk, d_v)
    states, S = [], q.new_zeros(batch, heads, d_head, d_v)
    for i in range(n):
        states.append(S)
        w = (b[:, :, i, -1:] - b[:, :, i]).exp()
        S = b[:, :, i, -1, None, None].exp() * S + (kp[:, :, i] * w[..., None]).transpose(-1, -2) @ vp[:, :, i]
    entering = torch.stack(states, dim=2)  # (batch, heads, n, d_head, d_v)
    out = inside + b.exp()[..., None] * (qp @ entering)
    return out.reshape(batch, heads, n * chunk, d_v)[:, :, :pos], S


def gla_chunked_positions(q, k, v, g, chunk):
    """Right values, position by position (the recurrent form with the learner's own step)."""
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[2]):
        o, S = gla_step(S, q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t])
        outs.append(o)
    return torch.stack(outs, dim=2), S


def gla_chunked_reshaped(q, k, v, g, chunk):
    """Right on whole chunks; a reshape into chunks that fails when the last one is shorter."""
    batch, heads, pos, _ = q.shape
    q.reshape(batch, heads, pos // chunk, chunk, -1)
    return gla_chunked(q, k, v, g, chunk)


def gla_chunked_zero_padded_gates(q, k, v, g, chunk):
    """Padded to whole chunks with gates of 0: log 0 = -inf, and the final state turns NaN."""
    pad = -q.shape[2] % chunk
    qp, kp, vp = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    out, S = gla_chunked(qp, kp, vp, torch.nn.functional.pad(g, (0, pad)), chunk)
    return out[:, :, :q.shape[2]], S


GLA_CHUNKED_MISTAKES = {
    "no carry": "starts from a zero state",
    "state not decayed": "without its decay",
    "not causal": "depends on later positions",
    "no mask": "depends on later positions",
    "triu": "depends on later positions",
    "zero fill": "depends on later positions",
    "exp then mask": "exp overflows float32 to infinity",
    "products mask": "overflow to infinity (the mask's 0 times infinity is NaN), and products of gates underflow",
    "to end none": "final_state is wrong even on one chunk",
    "to end own gate": "your out is right but your final_state differs",
    "global b": "runs from the sequence's start",
    "no decay": "causal but has no decay",
    "exclusive": "off by one step",
    "to end": "the decay from s to the chunk's end",
    "carry not decayed": "passed on without its decay",
    "dropped": "the last, shorter chunk is missing",
    "products": "products of gates underflow (64 gates of 0.05 multiply to about 1e-83, below anything float32 can hold",
}


def test_gla_chunked_passes_right_answers():
    for fn in (gla_chunked, gla_chunked_padded, lambda *args: gla_chunked(*args, mistake="tril after exp")):
        passes_everywhere(nb19.check_gla_chunked, "check_gla_chunked", "gla_chunked", fn)


@pytest.mark.parametrize("mistake", GLA_CHUNKED_MISTAKES)
def test_gla_chunked_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb19.check_gla_chunked, "check_gla_chunked", "gla_chunked",
                     lambda *args, m=mistake: gla_chunked(*args, mistake=m), GLA_CHUNKED_MISTAKES[mistake])


@pytest.mark.parametrize("fn, words", [
    (gla_chunked_positions, "does work for every position"),
    (gla_chunked_reshaped, "fails only when pos is not a multiple of chunk"),
    (gla_chunked_zero_padded_gates, "final_state holds NaN"),
])
def test_gla_chunked_names_per_position_work_and_partial_chunks(fn, words):
    names_everywhere(nb19.check_gla_chunked, "check_gla_chunked", "gla_chunked", fn, words)


def test_the_strong_decay_case_is_where_products_of_gates_fail():
    """float32 gates near 0.05 over a chunk of 64: cumulative products reach 0 (so their ratios are 0 / 0), the
    reference (sums of logs) stays finite, and every other case keeps the products finite."""
    for rng in (np.random.default_rng(1902), np.random.default_rng(0), np.random.default_rng(5)):
        for case in nb19.gla_chunked_cases(rng)["cases"]:
            g = torch.from_numpy(case["args"][3])
            chunk = case["more"][0]
            zero = any(bool((g[..., s:s + chunk].cumprod(-1) == 0).any()) for s in range(0, g.shape[-1], chunk))
            assert zero == bool(case.get("strong")), case["what"]
            out, S = nb19.reference_gla_chunked(*(torch.from_numpy(a) for a in case["args"]), chunk)
            assert torch.isfinite(out).all() and torch.isfinite(S).all()


def test_gla_chunked_refuses_the_library_waits_and_is_quick():
    for fn in (lambda *a: recurrences.gated_linear_attention_chunked(*a),
               lambda q, k, v, g, chunk: recurrences.gated_linear_attention_recurrent(q, k, v, g)):
        assert "tfedu" in failure_of(nb19.check_gla_chunked, fn)
    with pytest.raises(ExerciseNotDone):
        nb19.check_gla_chunked(not_done)
    assert check_time(nb19.check_gla_chunked, gla_chunked) < 2.0


# ----------------------------------------------------------------------------- 19.3 the selective scan's step


def scan_step(h, x_t, delta_t, A, B_t, C_t, D, mistake=""):
    """A learner's answer, right or with one ``mistake``: broadcasting and sums."""
    dA = delta_t[..., None] * A
    if mistake == "exp A":
        A_bar = torch.exp(A)
    elif mistake == "euler":
        A_bar = 1 + dA
    elif mistake == "sign":
        A_bar = torch.exp(-dA)
    else:
        A_bar = torch.exp(dA)
    write_with, read_with = (C_t, B_t) if mistake == "swapped" else (B_t, C_t)
    step = 1.0 if mistake == "no delta B" else delta_t[..., None]
    if mistake == "zoh":
        step = (torch.exp(dA) - 1) / A
    if mistake == "in place":
        h.mul_(A_bar).add_(step * write_with[:, None, :] * x_t[..., None])
        new = h
    else:
        new = A_bar * h + step * write_with[:, None, :] * x_t[..., None]
    state = h if mistake == "read before" else new
    if mistake == "C axis":
        read = (read_with[:, None, :] @ state).squeeze(1)
    else:
        read = (state * read_with[:, None, :]).sum(-1)
    if mistake == "no D":
        y = read
    elif mistake == "D y":
        y = read + D * read
    elif mistake == "D only y":
        y = D * read
    else:
        y = read + D * x_t
    if mistake == "float32":
        return y.float(), new.float()
    return y, (h if mistake == "old state" else new)


def scan_step_einsum(h, x_t, delta_t, A, B_t, C_t, D):
    """Another right way: einsum, the decay through exp of a product."""
    new = torch.exp(torch.einsum("bd,dn->bdn", delta_t, A)) * h + torch.einsum("bd,bn,bd->bdn", delta_t, B_t, x_t)
    return torch.einsum("bn,bdn->bd", C_t, new) + D * x_t, new


SCAN_MISTAKES = {
    "exp A": "exp(A), without the step",
    "euler": "Euler's step for A too",
    "no delta B": "input term has no step",
    "zoh": "the exact zero-order hold",
    "no D": "leaves out the skip",
    "D y": "scales the state's read by D",
    "D only y": "scales the state's read by D",
    "float32": "keep the inputs' dtype",
    "read before": "before step t's update",
    "swapped": "B_t and C_t are swapped",
    "sign": "exp(-delta_t A)",
    "C axis": "over d_inner, the channels",
    "old state": "returned the old state",
    "in place": "changed its input h in place",
}


def test_scan_step_passes_right_answers():
    for fn in (scan_step, scan_step_einsum):
        passes_everywhere(nb19.check_scan_step, "check_scan_step", "scan_step", fn)


@pytest.mark.parametrize("mistake", SCAN_MISTAKES)
def test_scan_step_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb19.check_scan_step, "check_scan_step", "scan_step",
                     lambda *args, m=mistake: scan_step(*args, mistake=m), SCAN_MISTAKES[mistake])


def test_scan_step_refuses_the_library_waits_and_is_quick():
    assert "tfedu" in failure_of(nb19.check_scan_step, lambda *a: recurrences.selective_scan_step(*a))
    with pytest.raises(ExerciseNotDone):
        nb19.check_scan_step(not_done)
    assert check_time(nb19.check_scan_step, scan_step) < 0.5


# ----------------------------------------------------------------------------- 19.4 the gated delta rule's step


def delta_step(state, q_t, k_t, v_t, beta_t, g_t, mistake=""):
    """A learner's answer, right or with one ``mistake``: matrix products of one-row matrices."""
    gate, beta = g_t[..., None, None], beta_t[..., None]
    if mistake == "exp gate":
        gate = torch.exp(gate)
    faded = state if mistake == "no gate" else gate * state
    source = state if mistake in ("old before gate", "gate after") else faded
    old = ((q_t if mistake == "query old" else k_t).unsqueeze(-2) @ source).squeeze(-2)
    if mistake == "plain":
        change = beta * v_t
    elif mistake == "plain no beta":
        change = v_t
    elif mistake == "sign plus":
        change = beta * (v_t + old)
    elif mistake == "beta v":
        change = beta * v_t - old
    elif mistake == "no beta":
        change = v_t - old
    elif mistake == "sign":
        change = beta * (old - v_t)
    else:
        change = beta * (v_t - old)
    if mistake == "transposed":
        write = change.unsqueeze(-1) @ k_t.unsqueeze(-2)
    else:
        write = k_t.unsqueeze(-1) @ change.unsqueeze(-2)
    new = gate * (state + write) if mistake == "gate after" else faded + write
    read = {"read before": state, "read gated": faded}.get(mistake, new)
    return (q_t.unsqueeze(-2) @ read).squeeze(-2), (state if mistake == "old state" else new)


def delta_step_householder(state, q_t, k_t, v_t, beta_t, g_t):
    """Another right way: S_t = g (I - beta k^T k) S + beta k^T v, with einsum."""
    eye = torch.eye(k_t.shape[-1], dtype=k_t.dtype)
    project = eye - beta_t[..., None, None] * torch.einsum("bhd,bhe->bhde", k_t, k_t)
    new = g_t[..., None, None] * (project @ state) + torch.einsum("bh,bhd,bhe->bhde", beta_t, k_t, v_t)
    return torch.einsum("bhd,bhde->bhe", q_t, new), new


DELTA_MISTAKES = {
    "plain": "plain linear-attention term",
    "plain no beta": "plain linear-attention term",
    "old before gate": "old value from the state before the gate",
    "gate after": "applied the gate after the write",
    "no gate": "ignores the gate",
    "exp gate": "as if g_t were a log-gate",
    "beta v": "scaled the new value by beta_t but not the old one",
    "no beta": "write has no beta_t",
    "query old": "read the old value with the query",
    "read before": "before step t's write",
    "read gated": "before step t's write",
    "sign": "sign is flipped",
    "sign plus": "sign is flipped",
    "transposed": "the wrong way round",
    "old state": "returned the old state",
}


def test_delta_step_passes_right_answers():
    for fn in (delta_step, delta_step_householder):
        passes_everywhere(nb19.check_delta_step, "check_delta_step", "delta_step", fn)


@pytest.mark.parametrize("mistake", DELTA_MISTAKES)
def test_delta_step_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb19.check_delta_step, "check_delta_step", "delta_step",
                     lambda *args, m=mistake: delta_step(*args, mistake=m), DELTA_MISTAKES[mistake])


def test_delta_step_refuses_the_library_waits_and_is_quick():
    assert "tfedu" in failure_of(nb19.check_delta_step, lambda s, q, k, v, b, g: delta_rule.delta_rule_step(
        s, q, k, v, b, g.log()))
    with pytest.raises(ExerciseNotDone):
        nb19.check_delta_step(not_done)
    assert check_time(nb19.check_delta_step, delta_step) < 0.5


def test_the_references_agree_with_the_variants_on_every_case():
    """The module's slip-free variants are the library's references (what the named slips are built on)."""
    rng = np.random.default_rng(7)
    for cases, reference, variant in (
            (nb19.gla_step_cases(rng), nb19.reference_gla_step, nb19.gla_step_variant),
            (nb19.gla_chunked_cases(rng)["cases"], nb19.reference_gla_chunked, nb19.gla_chunked_variant),
            (nb19.scan_step_cases(rng), nb19.reference_scan_step, nb19.scan_step_variant),
            (nb19.delta_step_cases(rng), nb19.reference_delta_step, nb19.delta_step_variant)):
        for case in cases:
            args = [torch.from_numpy(a) for a in case["args"]] + case.get("more", [])
            for want, got in zip(reference(*args), variant(*args)):
                assert want.dtype == got.dtype and torch.allclose(want, got, rtol=1e-5, atol=1e-5), case["what"]


@pytest.mark.parametrize("name, cases, run, spec", [
    ("gla_step", lambda: {"cases": nb19.gla_step_cases(np.random.default_rng(1901))}, nb19.GLA_STEP_RUN, nb19.GLA_STEP),
    ("gla_chunked", lambda: nb19.gla_chunked_cases(np.random.default_rng(1902)), nb19.GLA_CHUNKED_RUN,
     nb19.GLA_CHUNKED),
    ("scan_step", lambda: {"cases": nb19.scan_step_cases(np.random.default_rng(1903))}, nb19.SCAN_STEP_RUN,
     nb19.SCAN_STEP),
    ("delta_step", lambda: {"cases": nb19.delta_step_cases(np.random.default_rng(1904))}, nb19.DELTA_STEP_RUN,
     nb19.DELTA_STEP),
])
def test_the_references_pass_the_checks_judgement_and_the_probes(name, cases, run, spec):
    """The check refuses the library by name; its judgement and the hidden test pass the reference itself."""
    reference = getattr(nb19, f"reference_{name}")
    inputs = cases()
    outputs = nb19._run(run, name, reference, inputs)
    nb19.judge(spec, outputs["results"], inputs["cases"])
    if name == "gla_chunked":
        nb19.judge_calls(outputs["calls"], inputs)
    for seed in range(4):
        assert verdict(nb19.PROBES[f"check_{name}"], {name: reference}, seed) is None, seed


def test_every_exercise_has_hints_and_a_probe():
    assert sorted(nb19.HINTS) == sorted(p.exercise for p in nb19.PROBES.values())
    assert set(nb19.HINTS) == {"ex_gla_step", "ex_gla_chunked", "ex_scan_step", "ex_delta_step"}
    assert [h.number for h in nb19.HINTS.values()] == ["19.1", "19.2", "19.3", "19.4"]
    for hints in nb19.HINTS.values():
        assert "____" in hints.skeleton and hints.check in nb19.PROBES
