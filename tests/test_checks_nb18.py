"""Checkers and probes of notebook 18: each passes right answers and names realistic mistakes."""

import functools
import math

import numpy as np
import pytest
import torch

from tfedu import batching, paged, speculative
import checker_helpers as helpers
from checker_helpers import failure_of, not_done
from tfedu.checks import nb18_serving as nb18
from tfedu.checks.core import ExerciseNotDone

pytestmark = pytest.mark.usefixtures("one_torch_thread")

names_everywhere = functools.partial(helpers.names_everywhere, nb18.PROBES)
passes_everywhere = functools.partial(helpers.passes_everywhere, nb18.PROBES)
check_time = helpers.check_time


# ----------------------------------------------------------------------------- 18.1 the acceptance step


def accept_reject(p, q, draft_tokens, generator, mistake=""):
    """A learner's answer, right or with one ``mistake``."""
    k = draft_tokens.shape[0]
    shared = torch.rand((), generator=generator) if mistake == "shared" else None
    n_accepted, next_token = 0, None
    for i in range(k):
        x = int(draft_tokens[i])
        row = p[i + 1] if mistake == "shift" else p[i]
        r = shared if shared is not None else torch.rand((), generator=generator)
        if mistake == "inverted":
            accepted = r < q[i, x] / row[x]
        elif mistake == "p only":
            accepted = r < row[x]
        elif mistake == "compare":
            accepted = row[x] >= q[i, x]
        else:
            accepted = r < row[x] / q[i, x]
        if accepted:
            n_accepted += 1
            continue
        if mistake == "replace p":
            weights = row
        elif mistake == "swapped":
            weights = (q[i] - row).clamp(min=0)
        else:
            weights = (row - q[i]).clamp(min=0)
        if mistake in ("greedy", "greedy both"):
            token = int(torch.argmax(weights))
        else:
            token = int(torch.multinomial(weights, 1, generator=generator))
        if mistake == "no stop":
            next_token = token
            continue
        return (i + 1 if mistake in ("count", "count plus") else i), token
    if next_token is not None:
        return n_accepted, next_token
    if mistake == "bonus p":
        return k, int(torch.multinomial(p[k - 1], 1, generator=generator))
    if mistake == "bonus q":
        return k, int(torch.multinomial(q[k - 1], 1, generator=generator))
    if mistake == "bonus draft":
        return k, int(draft_tokens[-1])
    if mistake in ("greedy both", "greedy bonus"):
        return k, int(torch.argmax(p[k]))
    if mistake == "global":
        return k, int(torch.multinomial(p[k], 1))
    if mistake == "count":
        return k + 1, int(torch.multinomial(p[k], 1, generator=generator))
    if mistake == "none":
        return k, None
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def accept_reject_up_front(p, q, draft_tokens, generator):
    """Another right way: every uniform number drawn up front, in float64, the token by an inverse CDF; returns
    tensors."""
    p, q = p.double(), q.double()
    k = draft_tokens.shape[0]
    r = torch.rand(k + 1, generator=generator, dtype=torch.float64)
    ratio = p[torch.arange(k), draft_tokens] / q[torch.arange(k), draft_tokens]
    rejected = (r[:k] >= ratio).nonzero()
    if len(rejected):
        i = int(rejected[0])
        weights = (p[i] - q[i]).clamp(min=0)
    else:
        i, weights = k, p[k]
    cdf = torch.cumsum(weights / weights.sum(), 0)
    token = int(torch.searchsorted(cdf, r[k:] * cdf[-1], right=True).clamp(max=len(cdf) - 1))
    while weights[token] == 0:  # past the end by rounding: back to the last token with weight
        token -= 1
    return torch.tensor(i), torch.tensor(token)


def accept_reject_bernoulli(p, q, draft_tokens, generator):
    """Another right way: torch.bernoulli of the clamped ratio, one draw per token examined."""
    for i, x in enumerate(draft_tokens.tolist()):
        if torch.bernoulli((p[i, x] / q[i, x]).clamp(max=1.0), generator=generator):
            continue
        residual = torch.relu(p[i] - q[i])
        return i, torch.multinomial(residual / residual.sum(), 1, generator=generator).item()
    k = len(draft_tokens)
    return k, torch.multinomial(p[k], 1, generator=generator).item()


AR_MISTAKES = {
    "inverted": "ratio upside down",
    "p only": "the target's probability alone",
    "compare": "with no random draw",
    "shared": "one random number",
    "replace p": "drew the replacement from p",
    "swapped": "the sign is swapped",
    "greedy": "an argmax",
    "greedy both": "an argmax",
    "greedy bonus": "an argmax",
    "no stop": "after the first rejection",
    "bonus p": "the extra (bonus) token",
    "bonus q": "the extra (bonus) token",
    "bonus draft": "the extra (bonus) token",
    "shift": "off by one row",
    "count": "not the tokens emitted",
    "count plus": "not the tokens emitted",
    "global": "generators seeded alike",
    "none": "return a pair of ints",
}


def test_accept_reject_passes_right_answers():
    for fn in (accept_reject, accept_reject_up_front, accept_reject_bernoulli):
        passes_everywhere(nb18.check_accept_reject, "check_accept_reject", "accept_reject", fn)


@pytest.mark.parametrize("mistake", AR_MISTAKES)
def test_accept_reject_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb18.check_accept_reject, "check_accept_reject", "accept_reject",
                     lambda *args, m=mistake: accept_reject(*args, mistake=m), AR_MISTAKES[mistake])


def test_accept_reject_refuses_the_library_and_waits_for_an_answer():
    assert "tfedu" in failure_of(nb18.check_accept_reject, lambda *a: speculative.accept_reject(*a))
    with pytest.raises(ExerciseNotDone):
        nb18.check_accept_reject(not_done)


def test_the_exact_law_is_the_library_samplers():
    """outcome_law against tfedu.speculative.accept_reject itself, 20,000 draws, and its total mass."""
    case = nb18.ar_cases()[1]
    p, q, draft = torch.from_numpy(case["p"]), torch.from_numpy(case["q"]), torch.tensor(case["draft"])
    generator = torch.Generator().manual_seed(0)
    counts = np.zeros((4, 4))
    for _ in range(20_000):
        n, y = speculative.accept_reject(p, q, draft, generator)
        counts[n, y] += 1
    law = nb18.outcome_law(case["p"], case["q"], case["draft"])
    assert 0.5 * np.abs(counts / 20_000 - law).sum() < nb18.tv_tolerance(law, 20_000)
    assert law.sum() == pytest.approx(1.0, abs=1e-6)
    # averaged over draft tokens drawn from q[0], the first token emitted is distributed as p[0]: the replacement
    # when n = 0, the draft token otherwise (Leviathan et al. 2023, Theorem 1)
    for case in nb18.ar_cases()[:2]:
        p, q = case["p"].astype(np.float64), case["q"].astype(np.float64)
        first = sum(q[0, x] * (nb18.outcome_law(p, q, [x] + case["draft"][1:])[0] + np.eye(p.shape[1])[x]
                               * nb18.outcome_law(p, q, [x] + case["draft"][1:])[1:].sum())
                    for x in range(p.shape[1]) if q[0, x] > 0)
        assert np.allclose(first, p[0] / p[0].sum(), atol=1e-6)


def test_the_cases_separate_every_named_mistake():
    """On the check's cases and the probe's (six seeds), every mistake's law is at least 0.2 from the rule's (total
    variation) in some statistical case, about three times the tolerance, and two different hints' laws are
    further apart than two tolerances."""
    for cases in [nb18.ar_cases()] + [nb18._ar_probe_inputs(np.random.default_rng(s))["cases"] for s in range(6)]:
        stat = [c for c in cases if c["calls"] >= 500]
        tol = max(nb18.tv_tolerance(nb18.outcome_law(c["p"], c["q"], c["draft"]), c["calls"]) for c in stat)
        assert tol < 0.07
        laws = {(hint, str(knobs)): [nb18.outcome_law(c["p"], c["q"], c["draft"], **knobs) for c in stat]
                for hint, variants in nb18.AR_MISTAKES for knobs in variants}
        right = [nb18.outcome_law(c["p"], c["q"], c["draft"]) for c in stat]
        for key, mine in laws.items():
            assert max(0.5 * np.abs(a - b).sum() for a, b in zip(mine, right) if a is not None) > 0.2, key
        for (a, la), (b, lb) in [(x, y) for x in laws.items() for y in laws.items() if x[0][0] < y[0][0]]:
            assert max(0.5 * np.abs(x - y).sum() for x, y in zip(la, lb)
                       if x is not None and y is not None) > 2 * tol, (a, b)


def test_accept_reject_check_is_quick():
    assert check_time(nb18.check_accept_reject, accept_reject) < 2.0


# ----------------------------------------------------------------------------- 18.2 the block-table gather


def gather_blocks(pool, block_table, length, mistake=""):
    n_blocks, heads, block_size, d_head = pool.shape
    table = list(block_table)
    if mistake == "reversed":
        table = table[::-1]
    elif mistake == "sorted":
        table = sorted(table)
    elif mistake == "sorted in place":
        block_table.sort()
        table = block_table
    needed = -(-length // block_size)
    if mistake == "not cut":
        return torch.cat([pool[b] for b in table[:needed]], dim=1)
    if mistake == "cat":
        return torch.cat([pool[b] for b in table[:needed]], dim=1)[:, :length]
    if mistake == "dropped":
        return torch.cat([pool[b] for b in table[:length // block_size]] + [pool.new_zeros(heads, 0, d_head)], dim=1)
    t = torch.arange(length)
    if mistake == "swapped":
        return pool[torch.tensor(table)[t % block_size], :, t // block_size].transpose(0, 1)
    if mistake == "contiguous":
        return pool[t // block_size, :, t % block_size].transpose(0, 1)
    if mistake == "reshaped":  # the picked blocks regrouped without moving the heads' axis first
        return pool[torch.tensor(table[:needed], dtype=torch.long)].reshape(heads, -1, d_head)[:, :length]
    if mistake == "axes":
        return pool[torch.tensor(table, dtype=torch.long)[t // block_size], :, t % block_size]
    if mistake == "in place":
        pool[0, 0, 0, 0] += 1
    return pool[torch.tensor(table, dtype=torch.long)[t // block_size], :, t % block_size].transpose(0, 1)


def gather_blocks_loop(pool, block_table, length):
    """Another right way: a loop over the positions."""
    block_size = pool.shape[2]
    columns = [pool[block_table[t // block_size], :, t % block_size] for t in range(length)]
    if not columns:
        return pool.new_zeros(pool.shape[1], 0, pool.shape[3])
    return torch.stack(columns, dim=1)


def gather_blocks_cat(pool, block_table, length):
    """Another right way: whole blocks joined along the positions, then cut."""
    block_size = pool.shape[2]
    needed = -(-length // block_size)
    blocks = [pool[b] for b in block_table[:needed]]
    return torch.cat(blocks + [pool.new_zeros(pool.shape[1], 0, pool.shape[3])], dim=1)[:, :length]


GB_MISTAKES = {
    "reversed": "(reversed)",
    "sorted": "(sorted)",
    "sorted in place": "(sorted)",
    "not cut": "every position of the blocks you read",
    "cat": "length 0",
    "dropped": "partly filled block is missing",
    "swapped": "block and offset are swapped",
    "contiguous": "as if the sequence's blocks were the pool's first blocks",
    "axes": "positions before the heads",
    "reshaped": "heads and positions are mixed up",
    "in place": "in place",
}


def test_gather_blocks_passes_right_answers():
    for fn in (gather_blocks, gather_blocks_loop, gather_blocks_cat):
        passes_everywhere(nb18.check_gather_blocks, "check_gather_blocks", "gather_blocks", fn)


@pytest.mark.parametrize("mistake", GB_MISTAKES)
def test_gather_blocks_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb18.check_gather_blocks, "check_gather_blocks", "gather_blocks",
                     lambda *args, m=mistake: gather_blocks(*args, mistake=m), GB_MISTAKES[mistake])


def test_gather_blocks_says_where_a_wrong_key_came_from():
    def off_by_one_offset(pool, block_table, length):
        t = torch.arange(length)
        return pool[torch.tensor(block_table)[t // pool.shape[2]], :, (t + 1) % pool.shape[2]].transpose(0, 1)

    message = failure_of(nb18.check_gather_blocks, off_by_one_offset)
    assert "position 0 (head 0) holds block 5's offset 1" in message and "block 5's offset 0" in message, message


def test_gather_blocks_refuses_the_library_and_times():
    assert "tfedu" in failure_of(nb18.check_gather_blocks, lambda *a: paged.gather_blocks(*a))
    with pytest.raises(ExerciseNotDone):
        nb18.check_gather_blocks(not_done)
    assert check_time(nb18.check_gather_blocks, gather_blocks) < 1.0


# ----------------------------------------------------------------------------- 18.3 the scheduler's admission


def admit(waiting, n_running, n_free_blocks, *, max_batch, block_size, mistake=""):
    admitted, left, chosen = 0, n_free_blocks, []
    for request in waiting:
        row_free = n_running + admitted < max_batch
        if mistake == "no batch limit":
            row_free = True
        elif mistake == "running ignored":
            row_free = admitted < max_batch
        elif mistake == "<=":
            row_free = n_running + admitted <= max_batch
        if not row_free:
            break
        n, m = len(request.prompt), request.max_new_tokens
        needed = math.ceil((n + m - 1) / block_size)
        if mistake == "prompt only":
            needed = math.ceil(n / block_size)
        elif mistake == "floor":
            needed = (n + m - 1) // block_size
        elif mistake == "plus one":
            needed = math.ceil((n + m) / block_size)
        elif mistake == "no blocks":
            needed = 0
        fits = needed < left if mistake == "strict" else needed <= left
        if mistake == "not subtracted":
            fits = needed <= n_free_blocks
        if not fits:
            if mistake == "overtake":
                continue
            break
        admitted += 1
        chosen.append(request)
        left -= needed
    return chosen if mistake == "list" else admitted


def admit_while(waiting, n_running, n_free_blocks, *, max_batch, block_size):
    """Another right way: a while loop, the blocks by a negated floor division."""
    i, left = 0, n_free_blocks
    while i < len(waiting) and n_running + i < max_batch:
        needed = -(-(waiting[i].prompt.numel() + waiting[i].max_new_tokens - 1) // block_size)
        if needed > left:
            break
        left -= needed
        i += 1
    return i


ADMIT_MISTAKES = {
    "overtake": "went on admitting the ones behind it",
    "no batch limit": "past the batch limit",
    "running ignored": "as if it were empty",
    "<=": "one request too many",
    "prompt only": "the prompt alone",
    "floor": "rounded the blocks a request needs down",
    "plus one": "one too many: the last new token",
    "no blocks": "did not check the blocks",
    "strict": "fit exactly",
    "not subtracted": "all of n_free_blocks",
    "list": "returned a list",
}


def test_admit_passes_right_answers():
    for fn in (admit, admit_while):
        passes_everywhere(nb18.check_admit, "check_admit", "admit", fn)


@pytest.mark.parametrize("mistake", ADMIT_MISTAKES)
def test_admit_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb18.check_admit, "check_admit", "admit",
                     lambda *args, m=mistake, **kw: admit(*args, mistake=m, **kw), ADMIT_MISTAKES[mistake])


def test_admit_agrees_with_the_library_and_refuses_it():
    for case in nb18.admit_cases() + nb18._admit_probe_inputs(np.random.default_rng(0))["cases"]:
        args = (nb18._requests(case["sizes"]), case["n_running"], case["n_free_blocks"])
        kw = {"max_batch": case["max_batch"], "block_size": case["block_size"]}
        assert batching.admit(*args, **kw) == nb18._admitted(case["sizes"], *args[1:], *kw.values()), case["what"]
    assert "tfedu.batching" in failure_of(nb18.check_admit, lambda *a, **k: batching.admit(*a, **k))
    with pytest.raises(ExerciseNotDone):
        nb18.check_admit(lambda *args, **kwargs: not_done())
    assert check_time(nb18.check_admit, admit) < 1.0


def test_every_exercise_has_hints_and_a_probe():
    assert sorted(nb18.HINTS) == sorted(p.exercise for p in nb18.PROBES.values())
    assert set(nb18.HINTS) == {"ex_accept_reject", "ex_gather_blocks", "ex_admit"}
    for hints in nb18.HINTS.values():
        assert "____" in hints.skeleton and hints.check in nb18.PROBES
