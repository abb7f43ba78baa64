"""Checkers and probes of notebook 09: each passes the reference and names realistic mistakes."""

import pytest
import torch

from tfedu.checks import nb09_efficient_attention as nb09
from checker_helpers import verdict
from tfedu.checks.core import CheckFailure
from tfedu.flash import tile_update
from tfedu.softmax import online_softmax_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- 9.1


def step_variant(m, l, x, mistake=""):
    m_new = torch.maximum(m, x.amax(-1))
    exps = (x - m_new[..., None]).exp().sum(-1)
    if mistake == "not rescaled":
        return m_new, l + exps
    if mistake == "exp before max":
        return m_new, l * (m - m_new).exp() + (x - m[..., None]).exp().sum(-1)
    if mistake == "inverted":
        return m_new, l * (m_new - m).exp() + exps
    if mistake == "block max":
        b = x.amax(-1)
        return b, l * (m - b).exp() + (x - b[..., None]).exp().sum(-1)
    if mistake == "raw exp":
        return m_new, l * (m - m_new).exp() + x.exp().sum(-1) * (-m_new).exp()
    if mistake == "swapped":
        return l * (m - m_new).exp() + exps, m_new
    if mistake == "in place":
        l.mul_((m - m_new).exp()).add_(exps)
        return m_new, l
    if mistake == "global max":
        g = torch.maximum(m, x.max().expand_as(m))
        return g, l * (m - g).exp() + (x - g[..., None]).exp().sum(-1)
    if mistake == "block not added":
        return m_new, l * (m - m_new).exp()
    if mistake == "block's own max":
        return m_new, l * (m - m_new).exp() + (x - x.amax(-1, keepdim=True)).exp().sum(-1)
    if mistake == "no max":
        return m_new, l + x.exp().sum(-1)
    return m_new, l * (m - m_new).exp() + exps


def step_with_logsumexp(m, l, x):
    m_new = torch.maximum(m, x.amax(-1))
    lse = torch.logaddexp(m + l.log(), torch.logsumexp(x, dim=-1))
    return m_new, (lse - m_new).exp()


STEP_MISTAKES = [("not rescaled", "not rescaled when the max grows"), ("exp before max", "exponent before updating"),
                 ("inverted", "upside down"), ("block max", "block's max alone"), ("raw exp", "raw scores"),
                 ("swapped", "(l_new, m_new)"), ("in place", "in place"), ("global max", "whole block tensor"),
                 ("block not added", "leaves out the block"), ("block's own max", "block's own max"),
                 ("no max", "no max subtracted")]


def test_online_step_refuses_logsumexp():
    with pytest.raises(CheckFailure, match="calls logsumexp"):
        nb09.check_online_softmax_step(step_with_logsumexp)


def test_online_step_passes_the_reference_and_a_variant():
    nb09.check_online_softmax_step(online_softmax_step)
    nb09.check_online_softmax_step(step_variant)


@pytest.mark.parametrize("mistake, fragment", STEP_MISTAKES)
def test_online_step_names_each_mistake(mistake, fragment):
    with pytest.raises(CheckFailure, match=None) as failure:
        nb09.check_online_softmax_step(lambda m, l, x: step_variant(m, l, x, mistake))
    assert fragment in str(failure.value), str(failure.value)


# ----------------------------------------------------------------------------- 9.2


def tiled(A, B, tile, *, accumulate=True, edges=True):
    return nb09._tiled_reference(A, B, tile, accumulate=accumulate, edges=edges)


def test_tiled_matmul_passes_the_reference():
    nb09.check_tiled_matmul(nb09.tiled_matmul_reference)


def tiled_elementwise(A, B, tile):
    C = torch.zeros(A.shape[0], B.shape[1])
    for i in range(0, A.shape[0], tile):
        for j in range(0, B.shape[1], tile):
            for k in range(0, A.shape[1], tile):
                a, b = A[i:i + tile, k:k + tile], B[k:k + tile, j:j + tile]
                C[i:i + tile, j:j + tile] += (a[:, :, None] * b[None]).sum(1)
    return C


@pytest.mark.parametrize("wrong, fragment", [
    (tiled_elementwise, "no torch matrix multiply"),
    (lambda A, B, t: A @ B, "wider than tile"),
    (lambda A, B, t: torch.einsum("ij,jk->ik", A, B), "wider than tile"),
    (lambda A, B, t: tiled(A, B, t, accumulate=False), "last partial product"),
    (lambda A, B, t: tiled(A, B, t, edges=False), "not a multiple of tile"),
])
def test_tiled_matmul_names_each_mistake(wrong, fragment):
    with pytest.raises(CheckFailure) as failure:
        nb09.check_tiled_matmul(wrong)
    assert fragment in str(failure.value), str(failure.value)


# ----------------------------------------------------------------------------- 9.3


def tile_variant(m, l, o, s, v, mistake=""):
    m_new = torch.maximum(m, s.amax(-1))
    p = (s - m_new[..., None]).exp()
    a = (m - m_new).exp()
    l_new = a * l + p.sum(-1)
    if mistake == "o not rescaled":
        return m_new, l_new, o + p @ v
    if mistake == "divided early":
        return m_new, l_new, (a[..., None] * o + p @ v) / l_new[..., None]
    if mistake == "divided new part":
        return m_new, l_new, a[..., None] * o + (p @ v) / l_new[..., None]
    if mistake == "local softmax":
        w = s.softmax(-1)
        return m_new, l + w.sum(-1), o + w @ v
    if mistake == "old max":
        p = (s - m[..., None]).exp()
        return m_new, a * l + p.sum(-1), a[..., None] * o + p @ v
    if mistake == "l not rescaled":
        return m_new, l + p.sum(-1), a[..., None] * o + p @ v
    if mistake == "pair":
        return m_new, a[..., None] * o + p @ v
    return m_new, l_new, a[..., None] * o + p @ v


TILE_MISTAKES = [("o not rescaled", "o is not rescaled"), ("divided early", "too early"), ("divided new part", "too early"),
                 ("local softmax", "softmax of each tile"), ("old max", "old max"), ("l not rescaled", "l is not rescaled"),
                 ("pair", "triple")]


def test_tile_update_passes_the_reference_and_a_variant():
    nb09.check_flash_tile_update(tile_update)
    nb09.check_flash_tile_update(tile_variant)


@pytest.mark.parametrize("mistake, fragment", TILE_MISTAKES)
def test_tile_update_names_each_mistake(mistake, fragment):
    with pytest.raises(CheckFailure) as failure:
        nb09.check_flash_tile_update(lambda *a: tile_variant(*a, mistake=mistake))
    assert fragment in str(failure.value), str(failure.value)


# ----------------------------------------------------------------------------- probes

PROBE_CASES = [
    ("check_online_softmax_step", "online_softmax_step", step_variant, [(lambda m, l, x, k=k: step_variant(m, l, x, k), f)
                                                                        for k, f in STEP_MISTAKES if k != "raw exp"]),
    ("check_tiled_matmul", "tiled_matmul", nb09.tiled_matmul_reference,
     [(lambda A, B, t: A @ B, "wider than tile"), (lambda A, B, t: tiled(A, B, t, accumulate=False), "last partial product"),
      (tiled_elementwise, "no torch matrix multiply")]),
    ("check_flash_tile_update", "flash_tile_update", tile_variant, [(lambda *a, k=k: tile_variant(*a, mistake=k), f)
                                                                    for k, f in TILE_MISTAKES if k != "pair"]),
]




@pytest.mark.parametrize("grade_id, name, right, wrongs", PROBE_CASES, ids=[c[0] for c in PROBE_CASES])
def test_probes_pass_right_answers_and_name_mistakes(grade_id, name, right, wrongs):
    probe = nb09.PROBES[grade_id]
    for seed in range(4):
        assert verdict(probe, {name: right}, seed) is None
    for wrong, fragment in wrongs:
        for seed in range(3):
            feedback = verdict(probe, {name: wrong}, seed)
            assert feedback is not None and fragment.split()[0] in feedback, (fragment, seed, feedback)


def test_the_raw_exp_mistake_fails_the_probe():
    feedback = verdict(nb09.PROBES["check_online_softmax_step"],
                       {"online_softmax_step": lambda m, l, x: step_variant(m, l, x, "raw exp")}, 0)
    assert feedback is not None


# ----------------------------------------------------------------------------- 9.4

FF_SOLUTION = '''
def flash_attention_forward(q, k, v, causal=False, block_q=64, block_k=64):
    *batch, n_q, d = q.shape
    n_k = k.shape[-2]
    outs, lses = [], []
    for i0 in range(0, n_q, block_q):
        qi = q[..., i0:i0 + block_q, :]
        bq = qi.shape[-2]
        m = torch.full((*batch, bq), float("-inf"))
        l = torch.zeros(*batch, bq)
        acc = torch.zeros(*batch, bq, v.shape[-1])
        for j0 in range(0, n_k, block_k):
            if causal and j0 > i0 + bq - 1:
                break
            kj, vj = k[..., j0:j0 + block_k, :], v[..., j0:j0 + block_k, :]
            s = torch.matmul(qi, kj.transpose(-1, -2)) / math.sqrt(d)
            if causal:
                qpos = torch.arange(i0, i0 + bq).unsqueeze(1)
                kpos = torch.arange(j0, j0 + kj.shape[-2]).unsqueeze(0)
                s = torch.where(kpos <= qpos, s, torch.tensor(float("-inf")))
            m, l, acc = flash_tile_update(m, l, acc, s, vj)
        outs.append(acc / l.unsqueeze(-1))
        lses.append(m + l.log())
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
'''


def ff_learner(**names):
    """A learner's forward pass, written another way than the notebook's, calling flash_tile_update by name."""
    import math

    namespace = {"torch": torch, "math": math, "flash_tile_update": tile_update, **names}
    exec(FF_SOLUTION, namespace)
    return namespace["flash_attention_forward"]


def ff_mistake(mistake):
    def flash_attention_forward(q, k, v, causal=False, block_q=64, block_k=64):
        if mistake == "pair":
            return nb09._ff_variant(q, k, v, causal, block_q, block_k)[0]
        if mistake == "whole":
            scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
            if causal:
                scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
            return scores.softmax(-1) @ v, torch.logsumexp(scores, -1)
        if mistake == "no-skip":  # every tile computed, the future ones masked whole
            with_skip = nb09._ff_variant(q, k, v, causal, block_q, block_k)
            for i0 in range(0, q.shape[-2], block_q) if causal else ():
                for j0 in range(i0 + block_q, k.shape[-2], block_k):
                    if j0 >= min(i0 + block_q, q.shape[-2]):  # a future tile: its two products, then masked whole
                        _ = q[..., i0:i0 + block_q, :] @ k[..., j0:j0 + block_k, :].transpose(-2, -1)
                        _ = q[..., i0:i0 + block_q, :] @ k[..., j0:j0 + block_k, :].transpose(-2, -1)
            return with_skip
        if mistake == "skip-too-little":  # right, and one future key block per query block computed before the stop
            for i0 in range(0, q.shape[-2], block_q) if causal else ():
                j0 = -(-min(i0 + block_q, q.shape[-2]) // block_k) * block_k  # the first key block wholly in the future
                if j0 < k.shape[-2]:
                    _ = q[..., i0:i0 + block_q, :] @ k[..., j0:j0 + block_k, :].transpose(-2, -1)
                    _ = q[..., i0:i0 + block_q, :] @ k[..., j0:j0 + block_k, :].transpose(-2, -1)
            return nb09._ff_variant(q, k, v, causal, block_q, block_k)
        return nb09._ff_variant(q, k, v, causal, block_q, block_k, mistake)
    return flash_attention_forward


FF_MISTAKES = [("not-normalised", "unnormalised sum"), ("no-scale", "not scaled"), ("lse-no-max", "leaves out the running max"),
               ("lse-max-only", "the row's max alone"), ("state-kept", "carried from one block"),
               ("diagonal", "hides the diagonal"), ("peek", "one key too many"), ("local-mask", "within the tile"),
               ("local-mask-crossing", "within the tile"), ("diagonal-tile-only", "only the tile that starts on the"),
               ("skip-too-much", "the diagonal crosses"), ("skip-at-diagonal", "the diagonal crosses"),
               ("skip-past-end", "the diagonal crosses"), ("skip-too-little", "tiles of scores where"),
               ("skip-last-query", "the diagonal crosses"), ("edges", "shorter block was dropped"),
               ("edges-q", "shorter block was dropped"), ("edges-k", "shorter block was dropped"),
               ("whole", "wider than the blocks"), ("pair", "should return (o, lse)")]


def test_flash_forward_passes_the_reference_the_notebooks_kind_and_another_way(capsys):
    nb09.check_flash_attention_forward(nb09.reference_flash_attention_forward)
    nb09.check_flash_attention_forward(nb09._ff_variant)
    nb09.check_flash_attention_forward(ff_learner())
    assert capsys.readouterr().out.count("all checks passed") == 3


@pytest.mark.parametrize("mistake, fragment", FF_MISTAKES)
def test_flash_forward_names_each_mistake(mistake, fragment):
    with pytest.raises(CheckFailure) as failure:
        nb09.check_flash_attention_forward(ff_mistake(mistake))
    assert fragment in str(failure.value), str(failure.value)


def test_flash_forward_that_skips_nothing_is_told():
    with pytest.raises(CheckFailure, match="as many score tiles as the full one"):
        nb09.check_flash_attention_forward(ff_mistake("no-skip"))


def test_a_wrong_tile_update_is_not_counted_twice():
    """9.4 runs with the reference update in place of the learner's (exercise 9.3's slip costs only 9.3)."""
    def broken_update(m, l, o, s, v):
        return tile_update(m, l, o, s, v)[0], l, o  # nothing accumulated

    learner = ff_learner(flash_tile_update=broken_update)
    nb09.check_flash_attention_forward(learner)
    assert learner.__globals__["flash_tile_update"] is broken_update  # the learner's own binding put back


@pytest.mark.parametrize("mistake, fragment", [m for m in FF_MISTAKES if m[0] not in ("pair",)] +
                         [("no-skip", "as many score tiles")])
def test_the_flash_forward_probe_names_each_mistake(mistake, fragment):
    probe = nb09.PROBES["check_flash_attention_forward"]
    for seed in range(2):
        feedback = verdict(probe, {"flash_attention_forward": ff_mistake(mistake)}, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


def test_the_flash_forward_probe_passes_right_answers():
    probe = nb09.PROBES["check_flash_attention_forward"]
    for seed in range(4):
        assert verdict(probe, {"flash_attention_forward": ff_learner()}, seed) is None
        assert verdict(probe, {"flash_attention_forward": nb09.reference_flash_attention_forward}, seed) is None


# ----------------------------------------------------------------------------- 9.5

FB_QUERIES_OUTSIDE = '''
def flash_attention_backward(q, k, v, o, lse, do, causal=False, block_q=64, block_k=64):
    d = q.shape[-1]
    delta = torch.einsum("...id,...id->...i", do, o)
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    for i0 in range(0, q.shape[-2], block_q):
        qi, doi = q[..., i0:i0 + block_q, :], do[..., i0:i0 + block_q, :]
        rows = torch.arange(i0, i0 + qi.shape[-2])
        for j0 in range(0, k.shape[-2], block_k):
            if causal and j0 > rows[-1]:
                break
            kj, vj = k[..., j0:j0 + block_k, :], v[..., j0:j0 + block_k, :]
            s = torch.matmul(qi, kj.transpose(-1, -2)) / math.sqrt(d)
            if causal:
                s = torch.where(torch.arange(j0, j0 + kj.shape[-2])[None, :] <= rows[:, None], s, float("-inf"))
            p = (s - lse[..., i0:i0 + block_q].unsqueeze(-1)).exp()
            ds = p * (torch.matmul(doi, vj.transpose(-1, -2)) - delta[..., i0:i0 + block_q].unsqueeze(-1))
            dq[..., i0:i0 + block_q, :] += torch.matmul(ds, kj) / math.sqrt(d)
            dk[..., j0:j0 + block_k, :] += torch.matmul(ds.transpose(-1, -2), qi) / math.sqrt(d)
            dv[..., j0:j0 + block_k, :] += torch.matmul(p.transpose(-1, -2), doi)
    return dq, dk, dv
'''


def fb_learner():
    import math

    namespace = {"torch": torch, "math": math}
    exec(FB_QUERIES_OUTSIDE, namespace)
    return namespace["flash_attention_backward"]


def fb_mistake(mistake):
    def flash_attention_backward(q, k, v, o, lse, do, causal=False, block_q=64, block_k=64):
        if mistake == "pair":
            return nb09._fb_variant(q, k, v, o, lse, do, causal, block_q, block_k)[:2]
        if mistake == "no-skip":  # the right gradients, and the products of the tiles it should have skipped
            for j0 in range(0, k.shape[-2], block_k):
                for i0 in range(0, q.shape[-2], block_q):
                    if causal and min(i0 + block_q, q.shape[-2]) <= j0:
                        for _ in range(5):
                            _ = q[..., i0:i0 + block_q, :] @ k[..., j0:j0 + block_k, :].transpose(-2, -1)
            return nb09._fb_variant(q, k, v, o, lse, do, causal, block_q, block_k)
        if mistake == "skip-too-little":  # right, and the tiles of the first future query block computed too
            for j0 in range(0, k.shape[-2], block_k) if causal else ():
                for i0 in range(0, q.shape[-2], block_q):
                    if min(i0 + block_q, q.shape[-2]) <= j0 < min(i0 + 2 * block_q, q.shape[-2] + block_q):
                        for _ in range(5):
                            _ = q[..., i0:i0 + block_q, :] @ k[..., j0:j0 + block_k, :].transpose(-2, -1)
            return nb09._fb_variant(q, k, v, o, lse, do, causal, block_q, block_k)
        return nb09._fb_variant(q, k, v, o, lse, do, causal, block_q, block_k, mistake)
    return flash_attention_backward


FB_MISTAKES = [("no-D", "leaves out D"), ("D-whole", "one number for the whole input"), ("P-raw", "raw scores"),
               ("no-scale", "missing the scale"), ("unmasked", "was not masked"), ("dq-overwrite", "dq was written over"),
               ("dkv-overwrite", "kept only the last block"), ("skip-too-much", "the diagonal crosses"),
               ("D-per-tile", "summed within each tile"), ("P-tile-softmax", "softmax over the tile alone"),
               ("skip-too-little", "tiles where"), ("local-mask", "within the tile"),
               ("no-scale-dq", "missing the scale"), ("no-scale-dk", "missing the scale"),
               ("dk-overwrite", "kept only the last block"), ("dv-overwrite", "kept only the last block"),
               ("skip-last-query", "the diagonal crosses"),
               ("no-skip", "as many tile products"), ("pair", "should return (dq, dk, dv)")]


def test_flash_backward_passes_the_reference_and_learners_written_either_way(capsys):
    for fn in (nb09.reference_flash_attention_backward, nb09._fb_variant, fb_learner()):
        nb09.check_flash_attention_backward(fn)
    assert capsys.readouterr().out.count("all checks passed") == 3


@pytest.mark.parametrize("mistake, fragment", FB_MISTAKES)
def test_flash_backward_names_each_mistake(mistake, fragment):
    with pytest.raises(CheckFailure) as failure:
        nb09.check_flash_attention_backward(fb_mistake(mistake))
    assert fragment in str(failure.value), str(failure.value)


@pytest.mark.parametrize("mistake, fragment", [m for m in FB_MISTAKES if m[0] != "pair"])
def test_the_flash_backward_probe_names_each_mistake(mistake, fragment):
    probe = nb09.PROBES["check_flash_attention_backward"]
    for seed in range(2):
        feedback = verdict(probe, {"flash_attention_backward": fb_mistake(mistake)}, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


def test_the_flash_backward_probe_passes_right_answers():
    probe = nb09.PROBES["check_flash_attention_backward"]
    for seed in range(4):
        assert verdict(probe, {"flash_attention_backward": fb_learner()}, seed) is None
        assert verdict(probe, {"flash_attention_backward": nb09.reference_flash_attention_backward}, seed) is None


def test_the_backward_oracle_is_autograd_and_agrees_with_tfedus_flash_backward():
    q, k, v = nb09._ff_inputs(9, (2,), 9, 9, 4, 3)
    do = torch.randn(2, 9, 3, generator=torch.Generator().manual_seed(1))
    for causal in (False, True):
        o, lse = nb09.flash_forward(q, k, v, causal=causal, block_q=4, block_k=2)
        ours = nb09.reference_flash_attention_backward(q, k, v, o, lse, do, causal, 4, 2)
        assert nb09._fb_close(ours, nb09.autograd_gradients(q, k, v, do, causal))


# ----------------------------------------------------------------------------- 9.6

LA_OTHER_WAY = '''
def linear_attention_recurrent(q, k, v, eps=1e-6):
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    state = torch.zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    norm = torch.zeros(*q.shape[:-2], q.shape[-1])
    out = torch.empty(*q.shape[:-1], v.shape[-1])
    for t in range(q.shape[-2]):
        state = state + torch.einsum("...d,...e->...de", fk[..., t, :], v[..., t, :])
        norm = norm + fk[..., t, :]
        out[..., t, :] = torch.einsum("...d,...de->...e", fq[..., t, :], state) / (
            torch.einsum("...d,...d->...", fq[..., t, :], norm)[..., None] + eps)
    return out


def linear_attention_cumsum(q, k, v, eps=1e-6):
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    kv = torch.cumsum(torch.einsum("...td,...te->...tde", fk, v), dim=-3)
    num = torch.einsum("...td,...tde->...te", fq, kv)
    den = torch.einsum("...td,...td->...t", fq, torch.cumsum(fk, dim=-2))
    return num / (den[..., None] + eps)
'''


def la_other_way():
    namespace = {"torch": torch}
    exec(LA_OTHER_WAY, namespace)
    return namespace["linear_attention_recurrent"], namespace["linear_attention_cumsum"]


def la_mistake(mistake):
    return lambda q, k, v, eps=1e-6: nb09._la_variant(q, k, v, eps, mistake).float()


LA_MISTAKES = [("state-late", "left out its own key"), ("no-phi", "feature map is missing"),
               ("no-normaliser", "not normalised"), ("not-causal", "every query saw every key"),
               ("wrong-axis", "along the wrong axis"), ("S-axis", "outer products phi(k_j) v_j^T ran along"),
               ("z-axis", "normaliser's running sum of phi(k_j) ran along"),
               ("S-axis-head", "outer products phi(k_j) v_j^T ran along"), ("wrong-axis-head", "along the wrong axis")]


def test_linear_attention_passes_the_reference_and_another_way(capsys):
    nb09.check_linear_attention_two_ways(*la_other_way())
    nb09.check_linear_attention_two_ways(la_mistake(None), nb09.reference_causal_linear_attention)
    assert capsys.readouterr().out.count("all checks passed") == 2


@pytest.mark.parametrize("mistake, fragment", LA_MISTAKES)
def test_linear_attention_names_each_mistake_in_either_function(mistake, fragment):
    right_recurrent, right_cumsum = la_other_way()
    for pair, name in (((la_mistake(mistake), right_cumsum), "linear_attention_recurrent"),
                       ((right_recurrent, la_mistake(mistake)), "linear_attention_cumsum")):
        with pytest.raises(CheckFailure) as failure:
            nb09.check_linear_attention_two_ways(*pair)
        assert fragment in str(failure.value) and name in str(failure.value), str(failure.value)


@pytest.mark.parametrize("mistake, fragment", LA_MISTAKES)
def test_the_linear_attention_probe_names_each_mistake(mistake, fragment):
    right_recurrent, _ = la_other_way()
    probe = nb09.PROBES["check_linear_attention_two_ways"]
    for seed in range(2):
        feedback = verdict(probe, {"linear_attention_recurrent": right_recurrent,
                                   "linear_attention_cumsum": la_mistake(mistake)}, seed)
        assert feedback is not None and fragment in feedback and "linear_attention_cumsum" in feedback, (seed, feedback)


def test_the_linear_attention_probe_passes_right_answers():
    recurrent, cumulative = la_other_way()
    probe = nb09.PROBES["check_linear_attention_two_ways"]
    for seed in range(4):
        assert verdict(probe, {"linear_attention_recurrent": recurrent, "linear_attention_cumsum": cumulative}, seed) is None


# ----------------------------------------------------------------------------- 9.7

def kernels_or_skip():
    kernels = pytest.importorskip("tfedu.kernels")
    usable, why = kernels.available()
    if not usable:
        pytest.skip(why)
    return kernels


def variant_as_kernel(mistake_number):
    """The variant kernel with one mistake, launched as a learner's kernel would be (kernel[grid](...))."""
    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: nb09._variant_kernel()[grid](*args, **kwargs, MISTAKE=mistake_number)
    return Kernel()


LEARNER_KERNEL = '''
@jit
def flash_kernel(Q, K, V, O, N, scale, D_HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64) * N * D_HEAD
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_HEAD)
    q = tl.load(Q + head + offs_m[:, None] * D_HEAD + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_HEAD], 0.0, tl.float32)
    for start_n in range(0, N, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        valid = cols < N
        k = tl.load(K + head + cols[:, None] * D_HEAD + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + head + cols[:, None] * D_HEAD + offs_d[None, :], mask=valid[:, None], other=0.0)
        scores = tl.where(valid[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        new_max = tl.maximum(m_i, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_max[:, None])
        shrink = tl.exp(m_i - new_max)
        acc = acc * shrink[:, None] + tl.dot(weights, v)
        l_i = l_i * shrink + tl.sum(weights, axis=1)
        m_i = new_max
    tl.store(O + head + offs_m[:, None] * D_HEAD + offs_d[None, :], acc / l_i[:, None], mask=offs_m[:, None] < N)
'''


def learner_kernel(source=LEARNER_KERNEL):
    kernels = kernels_or_skip()
    import linecache
    import tempfile

    # Triton reads a kernel's source from its file: write it to one, as a notebook cell's is kept by IPython.
    path = tempfile.NamedTemporaryFile("w", suffix="_kernel.py", delete=False)
    path.write("from tfedu.kernels import jit, tl\n" + source)
    path.close()
    namespace = {"__name__": "learner_kernel"}
    exec(compile(open(path.name).read(), path.name, "exec"), namespace)
    linecache.checkcache(path.name)
    return kernels, namespace["flash_kernel"]


def test_the_kernel_check_passes_a_learners_kernel_and_the_variant_without_mistake(capsys):
    _, kernel = learner_kernel()
    nb09.check_flash_kernel(kernel)
    nb09.check_flash_kernel(variant_as_kernel(0))
    assert capsys.readouterr().out.count("all checks passed") == 2


@pytest.mark.parametrize("hint", list(nb09.TK_MISTAKES), ids=[str(n) for n in nb09.TK_MISTAKES.values()])
def test_the_kernel_check_names_each_mistake(hint):
    kernels_or_skip()
    with pytest.raises(CheckFailure) as failure:
        nb09.check_flash_kernel(variant_as_kernel(nb09.TK_MISTAKES[hint]))
    assert hint in str(failure.value)


def test_an_unfinished_kernel_is_not_done_and_a_broken_one_says_what_it_raised():
    from tfedu.checks.core import ExerciseNotDone

    stub = LEARNER_KERNEL.split("    for start_n")[0] + (
        "    for start_n in range(0, N, BLOCK_N):\n        raise NotImplementedError('replace this line with your code')\n")
    _, kernel = learner_kernel(stub)
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb09.check_flash_kernel(kernel)
    broken = LEARNER_KERNEL.replace("tl.sum(weights, axis=1)", "tl.sum(weights, axis=1) + row_sums_so_far")  # undefined
    _, kernel = learner_kernel(broken)
    with pytest.raises(CheckFailure, match="your kernel raised .*row_sums_so_far"):
        nb09.check_flash_kernel(kernel)
    with pytest.raises(CheckFailure, match="keep the kernel's signature"):
        nb09.check_flash_kernel(lambda *args: None)  # a plain function, not a @triton.jit kernel


def test_the_kernel_probe_passes_right_kernels_and_names_mistakes():
    _, kernel = learner_kernel()
    probe = nb09.PROBES["check_flash_kernel"]
    for seed in range(2):
        assert verdict(probe, {"flash_kernel": kernel}, seed) is None
    for hint, number in nb09.TK_MISTAKES.items():
        assert verdict(probe, {"flash_kernel": variant_as_kernel(number)}, 0) == hint
