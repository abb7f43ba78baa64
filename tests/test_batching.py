"""tfedu.batching: continuous batching gives every request the tokens it gets alone, and gives its memory back.

Oracles: ``tfedu.generate.generate`` on each prompt alone (greedy, with and without eos; sampled with the
request's own seeded generator) for the tokens, identical; the paged cache's block tables for the memory held (bytes held = blocks in the tables, each
table the fewest blocks its length needs); hand-worked traces on a ``StepClock`` (one unit per forward
pass) for the admission order and the times. ``admit`` and ``is_finished`` against hand-worked cases.
Models: tiny configs with learned positions (multi-head) and RoPE with grouped key/value heads.
"""

import pytest
import torch

from tfedu.batching import (Completion, ContinuousBatcher, Request, StepClock, admit, blocks_needed, is_finished,
                            random_trace, serve, serve_static, tfedu_static_batch)
from tfedu.config import preset
from tfedu.generate import generate
from tfedu.model import GPT, Encoder

# Weights of a trained model's size (peaked next-token distributions, far from ties); pytest puts tests/ on sys.path.
from test_checkpoints import randomise  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

CONFIGS = {
    "learned_mha": preset("tiny"),
    "rope_gqa": preset("tiny").replace(positional="rope", n_kv_heads=2),
}


def tiny_model(name: str = "rope_gqa") -> GPT:
    torch.manual_seed(0)
    return randomise(GPT(CONFIGS[name]))


def random_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def alone(model: GPT, prompt: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None) -> torch.Tensor:
    """The oracle: generate's new tokens for the prompt alone, up to and including the first eos."""
    new = generate(model, prompt[None], max_new_tokens, eos_token_id=eos_token_id)[0, prompt.numel():]
    if eos_token_id is not None and bool((new == eos_token_id).any()):
        new = new[:int((new == eos_token_id).nonzero()[0, 0]) + 1]
    return new


def trace(n: int = 9, seed: int = 0) -> list[Request]:
    """Prompts of 1..20 tokens, 1..12 new tokens, arrivals staggered over the first passes (some together)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 20] + torch.randint(1, 21, (n - 2,), generator=gen).tolist()
    news = [12, 1] + torch.randint(1, 13, (n - 2,), generator=gen).tolist()
    arrivals = [0, 0] + sorted(torch.randint(0, 15, (n - 2,), generator=gen).tolist())
    return [Request(f"r{i}", random_ids(length, seed=100 * seed + i), new, arrival=float(t))
            for i, (length, new, t) in enumerate(zip(lengths, news, arrivals, strict=True))]


# ----------------------------------------------------------------------------- the tokens


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_request_gets_its_tokens_alone(name, block_size):
    model = tiny_model(name)
    requests = trace()
    largest = max(blocks_needed(r, block_size) for r in requests)
    clock = StepClock()
    with clock.count_passes(model):  # a small pool (two of the largest) and 3 rows: requests wait for both
        done = serve(model, requests, n_blocks=2 * largest, block_size=block_size, max_batch=3, clock=clock,
                     sleep=clock.sleep)
    assert [c.id for c in done] == [r.id for r in requests]
    for request, completion in zip(requests, done, strict=True):
        assert torch.equal(completion.tokens, alone(model, request.prompt, request.max_new_tokens)), request.id
        assert completion.arrival < completion.first_token <= completion.finish
        assert completion.prompt is request.prompt
    assert model.training is False


def test_sampling_requests_draw_with_their_own_generators_whatever_shares_their_batch():
    model = tiny_model()
    settings = [dict(), dict(temperature=0.7), dict(top_k=20), dict(temperature=1.3, top_p=0.9), dict()]
    seed = lambda i: torch.Generator().manual_seed(70 + i)  # noqa: E731

    def requests(sampling: bool) -> list[Request]:
        return [Request(i, random_ids(3 + 4 * i, seed=i), 6 + i, arrival=float(i % 3),
                        do_sample=sampling and i != 4, generator=seed(i), **options)
                for i, options in enumerate(settings)]

    for max_batch in (1, 2, 5):  # alone in the batch, in pairs, all at once: the same tokens
        clock = StepClock()
        with clock.count_passes(model):
            done = serve(model, requests(True), block_size=4, max_batch=max_batch, clock=clock, sleep=clock.sleep)
        for request, completion in zip(requests(True), done, strict=True):
            expected = generate(model, request.prompt[None], request.max_new_tokens, do_sample=request.do_sample,
                                generator=seed(request.id), **settings[request.id])[0, request.prompt.numel():]
            assert torch.equal(completion.tokens, expected), (max_batch, request.id)
    clock = StepClock()
    greedy = serve(model, requests(False), block_size=4, clock=clock, sleep=clock.sleep)
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(done, greedy, strict=True))  # it did sample
    with pytest.raises(ValueError, match="serve_static decodes greedily .* request 0 samples"):
        serve_static(tfedu_static_batch(model), requests(True), batch_size=2)


def test_requests_wait_for_rows_and_for_blocks_and_still_get_their_tokens():
    model = tiny_model()
    requests, block_size = trace(12, seed=1), 4
    largest = max(blocks_needed(r, block_size) for r in requests)
    batcher = ContinuousBatcher(model, n_blocks=largest + 2, block_size=block_size, max_batch=4)
    for request in requests:  # all at once: the queue is long
        batcher.submit(request)
    done = []
    while not batcher.idle:
        done += batcher.step()
    by_id = {c.id: c for c in done}
    for request in requests:
        assert torch.equal(by_id[request.id].tokens, alone(model, request.prompt, request.max_new_tokens))
    steps = batcher.steps
    assert max(s.n_prefill + s.n_decode for s in steps) <= 4
    assert any(s.n_waiting and s.n_prefill + s.n_decode - s.n_finished < 4 for s in steps)  # blocks, not rows, held back
    assert len(done) == len(requests) == sum(s.n_finished for s in steps)


def test_eos_ends_a_request_and_its_blocks_come_back():
    model = tiny_model("learned_mha")
    requests = trace(8, seed=2)
    requests = [Request(r.id, r.prompt, 12, r.arrival) for r in requests]  # room for eos to come
    eos = int(alone(model, requests[3].prompt, 12)[4])  # a token the model does emit
    expected = {r.id: alone(model, r.prompt, 12, eos_token_id=eos) for r in requests}
    assert any(len(t) < 12 for t in expected.values())
    batcher = ContinuousBatcher(model, n_blocks=40, block_size=4, max_batch=3, eos_token_id=eos)
    for request in requests:
        batcher.submit(request)
    stopped_early = 0
    while not batcher.idle:
        for completion in batcher.step():
            assert torch.equal(completion.tokens, expected[completion.id]), completion.id
            assert completion.id not in batcher.cache.seq_ids  # its sequence, and so its blocks, are gone
            stopped_early += len(completion.tokens) < 12
        cache = batcher.cache
        assert cache.allocator.n_used == sum(len(cache.block_table(s)) for s in cache.seq_ids)
    assert stopped_early >= 1
    assert batcher.cache.allocator.n_free == 40


def test_a_request_stopping_at_eos_returns_its_promised_blocks():
    model = tiny_model("learned_mha")
    prompt = random_ids(4, seed=5)
    new = alone(model, prompt, 13).tolist()
    stop = next(j for j in range(1, 13) if new[j] not in new[:j])  # the first token not emitted before
    eos = new[stop]
    # Each request is promised the whole pool: the second can only start when the first is gone.
    first, second = Request("a", prompt, 13), Request("b", random_ids(3, seed=6), 2)
    batcher = ContinuousBatcher(model, n_blocks=4, block_size=4, max_batch=4, eos_token_id=eos)
    batcher.submit(first)
    batcher.submit(second)
    assert [c.id for c in batcher.step()] == [] and batcher.n_waiting == 1
    done = batcher.step()
    while not done:
        assert batcher.n_waiting == 1
        done = batcher.step()
    assert [c.id for c in done] == ["a"] and len(done[0].tokens) == stop + 1 and done[0].tokens[-1] == eos
    assert batcher.cache.allocator.n_free == 4
    assert batcher.n_waiting == 1  # admitted at the next step
    batcher.step()
    assert batcher.steps[-1].n_prefill == 1


# ----------------------------------------------------------------------------- memory


def test_memory_held_is_the_blocks_the_sequences_hold_and_all_comes_back():
    model = tiny_model()
    requests, block_size, n_blocks = trace(10, seed=3), 4, 24
    batcher = ContinuousBatcher(model, n_blocks=n_blocks, block_size=block_size, max_batch=5)
    cache = batcher.cache
    for request in requests:
        batcher.submit(request)
    promised = {r.id: blocks_needed(r, block_size) for r in requests}
    while not batcher.idle:
        batcher.step()
        tables = {s: cache.block_table(s) for s in cache.seq_ids}
        assert cache.bytes_held == sum(len(t) for t in tables.values()) * cache.bytes_per_block
        for seq_id, table in tables.items():
            assert len(table) == -(-cache.length(seq_id) // block_size)  # the fewest blocks its tokens need
            assert len(table) <= promised[seq_id]  # never more than promised at admission
        used = [b for t in tables.values() for b in t]
        assert len(used) == len(set(used))  # no block in two tables
        record = batcher.steps[-1]
        assert record.bytes_held <= cache.nbytes
        assert record.bytes_held >= cache.bytes_held  # recorded before the retired requests' blocks went back
    assert cache.allocator.n_free == n_blocks and cache.bytes_held == 0 and cache.seq_ids == []
    assert max(s.bytes_held for s in batcher.steps) <= cache.nbytes
    assert all(s.tokens_held <= s.bytes_held // cache.bytes_per_block * block_size for s in batcher.steps)


def test_promised_blocks_hold_back_a_request_that_would_fit_now():
    model = tiny_model()
    batcher = ContinuousBatcher(model, n_blocks=4, block_size=4, max_batch=8)
    long_request = Request("long", random_ids(4, seed=7), 13)  # 16 positions: the whole pool, 1 block taken at first
    batcher.submit(long_request)
    batcher.submit(Request("short", random_ids(1, seed=8), 1))  # 1 block
    batcher.step()
    assert batcher.cache.allocator.n_free == 3 and batcher.n_waiting == 1  # 3 free, all promised to "long"
    steps = 1
    while batcher.n_waiting:
        batcher.step()
        steps += 1
    assert steps == 14  # "short" joins at the step after "long" retired (its prefill, then 12 decode steps)
    assert batcher.steps[-1].n_prefill == 1


# ----------------------------------------------------------------------------- admit and is_finished


def reqs(*block_counts: int, block_size: int = 4) -> list[Request]:
    """Requests needing the given numbers of blocks (prompt of that many blocks, one new token)."""
    return [Request(i, torch.zeros(n * block_size, dtype=torch.long), 1) for i, n in enumerate(block_counts)]


def test_admit_takes_the_head_of_the_queue_in_order():
    waiting = reqs(1, 1, 1)
    assert admit(waiting, 0, 10, max_batch=8, block_size=4) == 3
    assert admit([], 0, 10, max_batch=8, block_size=4) == 0
    assert admit(reqs(3, 1), 0, 4, max_batch=8, block_size=4) == 2  # exactly fits


def test_admit_never_lets_a_small_request_overtake():
    assert admit(reqs(1, 5, 1, 1), 0, 4, max_batch=8, block_size=4) == 1  # the 5 does not fit: nothing behind it goes
    assert admit(reqs(5, 1), 0, 4, max_batch=8, block_size=4) == 0


def test_admit_respects_the_batch_limit():
    assert admit(reqs(1, 1, 1), 6, 10, max_batch=8, block_size=4) == 2
    assert admit(reqs(1, 1, 1), 8, 10, max_batch=8, block_size=4) == 0
    assert admit(reqs(1, 1, 1), 0, 10, max_batch=1, block_size=4) == 1


def test_admit_counts_blocks_with_the_last_token_never_written():
    waiting = [Request(0, torch.zeros(3, dtype=torch.long), 2), Request(1, torch.zeros(4, dtype=torch.long), 2)]
    assert [blocks_needed(r, 4) for r in waiting] == [1, 2]  # 3 + 2 - 1 = 4 positions; 4 + 2 - 1 = 5
    assert admit(waiting, 0, 2, max_batch=8, block_size=4) == 1
    assert admit(waiting, 0, 3, max_batch=8, block_size=4) == 2
    assert admit(waiting, 0, 0, max_batch=8, block_size=4) == 0


def test_admit_errors():
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        admit(reqs(1), 0, 1, max_batch=0, block_size=4)
    with pytest.raises(ValueError, match="n_free_blocks must be an int >= 0"):
        admit(reqs(1), 0, -1, max_batch=2, block_size=4)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        blocks_needed(reqs(1)[0], 0)


def test_is_finished():
    assert not is_finished([], 1, None)
    assert is_finished([3], 1, None)
    assert not is_finished([3, 4], 3, None)
    assert is_finished([3, 0], 3, 0) and not is_finished([0, 3], 3, 0)
    assert is_finished(torch.tensor([5, 7]), 4, eos_token_id=7)
    assert is_finished(torch.tensor([5, 7, 8, 9]), 4, eos_token_id=1)


def test_shapes_match_the_annotations(typechecked):
    request = Request(0, torch.tensor([1, 2, 3]), 2)
    assert typechecked(blocks_needed)(request, 2) == 2
    assert typechecked(is_finished)(torch.tensor([1, 2]), 2, None)
    assert typechecked(admit)([request], 0, 2, max_batch=2, block_size=2) == 1


# ----------------------------------------------------------------------------- serving traces


def test_serve_on_a_step_clock_is_deterministic_and_worked_by_hand():
    model = tiny_model()
    requests = [Request("a", random_ids(3, 1), 3), Request("b", random_ids(2, 2), 2, arrival=1.0),
                Request("c", random_ids(5, 3), 1, arrival=10.0)]
    runs = []
    for _ in range(2):
        clock = StepClock()
        with clock.count_passes(model):
            runs.append([(c.id, c.first_token, c.finish, c.latency) for c in
                         serve(model, requests, block_size=4, clock=clock, sleep=clock.sleep)])
    assert runs[0] == runs[1]
    # a: prefill (t=1), then decodes at t=3 (after b's prefill at 2) and t=4. b: prefill at 2, decode at 4.
    # c arrives at 10 into an idle server: the server sleeps until then, prefills (t=11) and is done.
    assert runs[0] == [("a", 1.0, 4.0, 4.0), ("b", 2.0, 4.0, 3.0), ("c", 11.0, 11.0, 1.0)]


def test_serve_admits_in_arrival_order():
    model = tiny_model()
    requests = [Request(i, random_ids(2, i), 2, arrival=float(t)) for i, t in enumerate([3, 0, 0, 1])]
    clock = StepClock()
    with clock.count_passes(model):
        done = serve(model, requests, max_batch=1, clock=clock, sleep=clock.sleep)
    order = sorted(done, key=lambda c: c.first_token)
    assert [c.id for c in order] == [1, 2, 3, 0]  # by arrival; equal arrivals in the list's order
    assert all(isinstance(c, Completion) for c in done)


def test_serve_static_gives_the_tokens_alone_and_whole_batch_times():
    model = tiny_model()
    requests = trace(7, seed=4)
    clock = StepClock()
    with clock.count_passes(model):
        done = serve_static(tfedu_static_batch(model), requests, batch_size=3, clock=clock, sleep=clock.sleep)
    for request, completion in zip(requests, done, strict=True):
        assert torch.equal(completion.tokens, alone(model, request.prompt, request.max_new_tokens)), request.id
        assert completion.first_token == completion.finish > completion.arrival
    # The first batch: the two requests of time 0 (the others have not arrived), one pass per token of the longer.
    assert [c.finish for c in done[:2]] == [12.0, 12.0]


def test_serve_static_with_eos_cuts_at_eos():
    model = tiny_model("learned_mha")
    requests = trace(5, seed=5)
    eos = int(alone(model, requests[0].prompt, 12)[3])
    clock = StepClock()  # arrivals in passes, and no real waiting
    with clock.count_passes(model):
        done = serve_static(tfedu_static_batch(model, eos_token_id=eos), requests, batch_size=5, clock=clock,
                            sleep=clock.sleep)
    assert any(len(c.tokens) < r.max_new_tokens for r, c in zip(requests, done, strict=True))
    for request, completion in zip(requests, done, strict=True):
        assert torch.equal(completion.tokens, alone(model, request.prompt, request.max_new_tokens, eos))


def test_serve_waits_on_the_real_clock_with_sleep():
    model = tiny_model()
    slept = []
    clock = StepClock()
    serve(model, [Request("late", random_ids(2, 1), 1, arrival=5.0)], clock=clock,
          sleep=lambda s: (slept.append(s), clock.sleep(s)))
    assert slept == [5.0]


# ----------------------------------------------------------------------------- bad input


def test_request_errors():
    with pytest.raises(ValueError, match="1-D integer tensor of token ids"):
        Request("a", torch.tensor([1.0, 2.0]), 2)
    with pytest.raises(ValueError, match="at least one"):
        Request("a", torch.tensor([], dtype=torch.long), 2)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        Request("a", [1, 2], 2)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        Request("a", torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="arrival must be a finite number"):
        Request("a", torch.tensor([1]), 1, arrival=-1.0)
    with pytest.raises(TypeError, match="hashable"):
        Request(["a"], torch.tensor([1]), 1)
    with pytest.raises(ValueError, match="temperature"):
        Request("a", torch.tensor([1]), 1, do_sample=True, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        Request("a", torch.tensor([1]), 1, do_sample=True, top_k=0)
    with pytest.raises(TypeError, match="do_sample must be True or False"):
        Request("a", torch.tensor([1]), 1, do_sample="yes")
    with pytest.raises(TypeError, match="generator must be None or a torch.Generator"):
        Request("a", torch.tensor([1]), 1, do_sample=True, generator=0)


def test_submit_errors():
    model = tiny_model()
    batcher = ContinuousBatcher(model, n_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="need 65 positions, more than n_ctx=64"):
        batcher.submit(Request("long", torch.zeros(60, dtype=torch.long), 6))
    with pytest.raises(ValueError, match="needs 5 blocks .* more than the whole pool \\(4\\)"):
        batcher.submit(Request("big", torch.zeros(17, dtype=torch.long), 4))
    batcher.submit(Request("a", torch.tensor([1]), 1))
    with pytest.raises(ValueError, match="'a' is already queued or running"):
        batcher.submit(Request("a", torch.tensor([2]), 1))
    batcher.step()
    batcher.submit(Request("a", torch.tensor([2]), 1))  # retired: its id is free again
    with pytest.raises(ValueError, match="token ids must be in 0..255"):
        batcher.submit(Request("b", torch.tensor([256]), 1))
    with pytest.raises(TypeError, match="takes a tfedu.batching.Request"):
        batcher.submit(("c", torch.tensor([1]), 1))


def test_batcher_and_serve_errors():
    model = tiny_model()
    with pytest.raises(TypeError, match="cannot keep a KV cache"):
        ContinuousBatcher(Encoder(preset("tiny")), n_blocks=4)
    with pytest.raises(ValueError, match="eos_token_id must be None or a token id in 0..255"):
        ContinuousBatcher(model, n_blocks=4, eos_token_id=256)
    with pytest.raises(ValueError, match="n_blocks must be an int >= 1"):
        ContinuousBatcher(model, n_blocks=0)
    twice = [Request("a", torch.tensor([1]), 1), Request("a", torch.tensor([2]), 1)]
    with pytest.raises(ValueError, match="'a' appears twice"):
        serve(model, twice)
    with pytest.raises(ValueError, match="'a' appears twice"):
        serve_static(tfedu_static_batch(model), twice, batch_size=2)
    with pytest.raises(ValueError, match="non-empty list"):
        serve(model, [])
    with pytest.raises(ValueError, match="generate_batch must return a list of 1 1-D tensors"):
        serve_static(lambda prompts, n: None, [twice[0]], batch_size=1)


def test_batcher_properties():
    model = tiny_model()
    batcher = ContinuousBatcher(model, n_blocks=4, block_size=4, max_batch=1)
    assert batcher.idle and batcher.step() == [] and batcher.steps == []
    batcher.submit(Request(0, torch.tensor([1, 2]), 2))
    batcher.submit(Request(1, torch.tensor([3]), 1))
    assert (batcher.n_waiting, batcher.n_running, batcher.idle) == (2, 0, False)
    batcher.step()
    assert (batcher.n_waiting, batcher.n_running) == (1, 1)
    assert batcher.cache.length(0) == 2
    while not batcher.idle:
        batcher.step()
    assert [(s.n_prefill, s.n_decode, s.n_finished) for s in batcher.steps] == [(1, 0, 0), (0, 1, 1), (1, 0, 1)]
    assert "ContinuousBatcher(" in repr(batcher)


def test_a_given_admission_rule_replaces_admit_and_record_receives_the_steps():
    """``admit=``: notebook 18 runs the learner's rule in the server; ``record=`` gets the step records."""
    model = tiny_model()
    requests = trace()
    calls, records = [], []

    def mine(waiting, n_running, n_free_blocks, *, max_batch, block_size):
        calls.append(len(waiting))
        return admit(waiting, n_running, n_free_blocks, max_batch=max_batch, block_size=block_size)

    clock = StepClock()
    with clock.count_passes(model):
        ours = serve(model, requests, block_size=4, max_batch=3, clock=clock, sleep=clock.sleep, admit=mine,
                     record=records)
    clock = StepClock()
    with clock.count_passes(model):
        reference = serve(model, requests, block_size=4, max_batch=3, clock=clock, sleep=clock.sleep)
    assert calls and records and sum(r.n_finished for r in records) == len(requests)
    assert [(c.id, c.finish) for c in ours] == [(c.id, c.finish) for c in reference]
    for bad in (lambda *a, **k: -1, lambda *a, **k: len(a[0]) + 1, lambda *a, **k: 1.0, lambda *a, **k: True):
        with pytest.raises(ValueError, match="admission rule must return how many requests to admit"):
            serve(model, requests, block_size=4, max_batch=3, admit=bad)
    with pytest.raises(TypeError, match="admit must be a function"):
        ContinuousBatcher(model, n_blocks=4, admit="fifo")


def test_random_trace_is_seeded_in_range_and_cut_from_texts():
    kwargs = dict(prompt_lengths=(3, 6), new_tokens=(2, 50), rate=4.0, seed=3)
    a, b = random_trace(200, d_vocab=30, **kwargs), random_trace(200, d_vocab=30, **kwargs)
    assert [(r.id, r.prompt.tolist(), r.max_new_tokens, r.arrival) for r in a] == \
        [(r.id, r.prompt.tolist(), r.max_new_tokens, r.arrival) for r in b]
    assert [r.id for r in a] == list(range(200)) and a[0].arrival == 0.0
    assert all(x.arrival <= y.arrival for x, y in zip(a, a[1:]))
    assert all(3 <= len(r.prompt) <= 6 and 2 <= r.max_new_tokens <= 50 and int(r.prompt.max()) < 30 for r in a)
    assert 2.5 < 199 / a[-1].arrival < 6  # about 4 a unit of time
    # Log-uniform: about as many answers below sqrt(2 * 50) = 10 as above.
    assert 70 < sum(r.max_new_tokens < 10 for r in a) < 130
    texts = [torch.arange(100, 120), torch.arange(500, 506)]
    cut = random_trace(50, texts=texts, **kwargs)
    for r in cut:
        ids = r.prompt.tolist()
        assert ids == list(range(ids[0], ids[0] + len(ids))) and (100 <= ids[0] < 120 or 500 <= ids[0] < 506)
    with pytest.raises(ValueError, match="either texts .* or d_vocab"):
        random_trace(3, **kwargs)
    with pytest.raises(ValueError, match="at least 6 tokens"):
        random_trace(3, texts=[torch.arange(4)], **kwargs)
    with pytest.raises(ValueError, match="rate must be a positive number"):
        random_trace(3, prompt_lengths=(3, 6), new_tokens=(2, 50), rate=0, d_vocab=30)
    with pytest.raises(ValueError, match="1 <= low <= high"):
        random_trace(3, prompt_lengths=(6, 3), new_tokens=(2, 50), rate=1, d_vocab=30)
