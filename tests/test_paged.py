"""tfedu.paged: the paged KV cache gives the contiguous cache's logits and ``generate``'s tokens, in less memory.

Oracles: ``tfedu.kv_cache.KVCache`` (one sequence at a time, contiguous) for the logits, to 1e-5;
``tfedu.generate.generate`` (greedy, each prompt alone) for the tokens, identical; for the gather, the
blocks of the table concatenated in order (an independent formula). Models: tiny configs with learned
positions (multi-head), RoPE with grouped key/value heads, ALiBi, and SDPA attention. Plus allocation
(reuse of freed blocks, bytes held, running out), memory against a contiguous cache preallocated to
n_ctx, and the errors. Shared blocks (fork, copy-on-write, reorder): each sequence's logits are those
of its own tokens run alone through a contiguous cache (reorder: a contiguous cache reordered the same
way), ``paged_sample``'s tokens those of ``generate`` with the same generator, and the blocks held are
counted against the formula.
"""

import pytest
import torch

from tfedu.config import preset
from tfedu.generate import generate
from tfedu.kv_cache import KVCache, kv_cache_bytes
from tfedu.model import GPT, Encoder
from tfedu.paged import BlockAllocator, PagedKVCache, gather_blocks, paged_greedy, paged_sample

# Weights of a trained model's size (peaked next-token distributions, far from ties); pytest puts tests/ on sys.path.
from test_checkpoints import randomise  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

CONFIGS = {
    "learned_mha": preset("tiny"),
    "rope_gqa": preset("tiny").replace(positional="rope", n_kv_heads=2),
    "alibi_mqa": preset("tiny").replace(positional="alibi", n_kv_heads=1),
    "rope_sdpa": preset("tiny").replace(positional="rope", n_kv_heads=2, attention="sdpa"),
}


def tiny_model(name: str = "rope_gqa") -> GPT:
    torch.manual_seed(0)
    return randomise(GPT(CONFIGS[name]))


def random_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the gather


@pytest.mark.parametrize("length", [1, 7, 8, 13, 24])
def test_gather_blocks_equals_the_blocks_in_table_order(length):
    gen = torch.Generator().manual_seed(length)
    pool = torch.randn(10, 3, 4, 5, generator=gen)  # n_blocks n_kv_heads block_size d_head
    table = torch.randperm(10, generator=gen)[:6].tolist()  # shuffled, non-contiguous blocks
    # The oracle: the table's blocks one after another along the positions, cut to length.
    contiguous = pool[table].transpose(0, 1).flatten(1, 2)[:, :length]  # n_kv_heads 24 d_head -> length
    torch.testing.assert_close(gather_blocks(pool, table, length), contiguous, rtol=0, atol=0)


def test_gather_blocks_reads_what_was_written_position_by_position():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 11, 3, generator=gen)  # n_kv_heads pos d_head, a contiguous cache's
    pool, table = torch.zeros(8, 2, 4, 3), [5, 2, 7]
    for t in range(11):
        pool[table[t // 4], :, t % 4] = keys[:, t]
    torch.testing.assert_close(gather_blocks(pool, table, 11), keys, rtol=0, atol=0)
    torch.testing.assert_close(gather_blocks(pool, torch.tensor(table), 5), keys[:, :5], rtol=0, atol=0)


def test_gather_blocks_errors():
    pool = torch.zeros(4, 1, 2, 3)
    with pytest.raises(ValueError, match="block table of at least 3"):
        gather_blocks(pool, [0, 1], 5)
    with pytest.raises(IndexError, match="outside the pool's 4 blocks"):
        gather_blocks(pool, [0, 4], 3)
    with pytest.raises(ValueError, match="n_blocks, n_kv_heads, block_size, d_head"):
        gather_blocks(torch.zeros(4, 2, 3), [0], 1)
    with pytest.raises(ValueError, match="length must be an int >= 0"):
        gather_blocks(pool, [0], -1)


# ----------------------------------------------------------------------------- the model through the cache


@pytest.mark.parametrize("name", ["learned_mha", "rope_gqa"])
def test_one_sequence_logits_equal_the_contiguous_cache(name):
    model = tiny_model(name)
    ids = random_ids(20, seed=2)
    chunks = [ids[:6], ids[6:7], ids[7:12], ids[12:13], ids[13:20]]  # prefill, decode steps, chunks across blocks
    paged = PagedKVCache.for_model(model, n_blocks=8, block_size=4)
    paged.add_sequence("s")
    contiguous = KVCache.for_model(model, batch=1)
    with torch.no_grad():
        for chunk in chunks:
            expected = model(chunk[None], kv_cache=contiguous)
            torch.testing.assert_close(paged.run(model, ["s"], [chunk]), expected, rtol=0, atol=1e-5)
    assert paged.length("s") == 20 and paged.block_table("s") == [0, 1, 2, 3, 4]
    for layer, contiguous_layer in enumerate(contiguous.layers):  # what the pools hold is what the contiguous cache holds
        keys, values = paged.layer_keys("s", layer)
        torch.testing.assert_close(keys, contiguous_layer.keys[0, :, :20], rtol=0, atol=1e-6)
        torch.testing.assert_close(values, contiguous_layer.values[0, :, :20], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["learned_mha", "rope_gqa", "alibi_mqa"])
def test_a_batch_of_different_lengths_gives_each_row_its_contiguous_logits(name):
    model = tiny_model(name)
    histories = [random_ids(n, seed=10 + n) for n in (9, 2, 5)]
    news = [random_ids(n, seed=20 + n) for n in (1, 4, 3)]  # new tokens of different lengths in one pass
    paged = PagedKVCache.for_model(model, n_blocks=12, block_size=3)
    with torch.no_grad():
        for seq_id, history in enumerate(histories):  # one by one, so that the sequences' blocks interleave below
            paged.add_sequence(seq_id)
            paged.run(model, [seq_id], [history[:1]])
        paged.run(model, [0, 1, 2], [h[1:] for h in histories])  # mixed-length prefill, row 1 brings one token
        logits = paged.run(model, [0, 1, 2], news)
        for row, (history, new) in enumerate(zip(histories, news, strict=True)):
            alone = KVCache.for_model(model, batch=1)
            model(history[None], kv_cache=alone)
            expected = model(new[None], kv_cache=alone)[0]  # n_new d_vocab
            torch.testing.assert_close(logits[row, -len(new):], expected, rtol=0, atol=1e-5)
    assert [paged.length(i) for i in range(3)] == [10, 6, 8]
    assert paged.block_table(0)[:3] == [0, 3, 4]  # seq 0's blocks are not contiguous in the pool


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_greedy_gives_generates_tokens_for_each_prompt(name):
    model = tiny_model(name)
    prompts = [random_ids(n, seed=30 + n) for n in (3, 11, 1, 17, 6)]
    out = paged_greedy(model, prompts, 12, block_size=4)
    for prompt, got in zip(prompts, out, strict=True):
        assert torch.equal(got, generate(model, prompt[None], 12)[0])


def test_paged_greedy_edge_cases():
    model = tiny_model()
    prompt = random_ids(5, seed=3)
    assert torch.equal(paged_greedy(model, [prompt], 0)[0], prompt)
    full = paged_greedy(model, [random_ids(60, seed=4)], 5, block_size=64)[0]  # 60 + 5 - 1 = n_ctx, one block
    assert torch.equal(full, generate(model, random_ids(60, seed=4)[None], 5)[0])
    assert model.training is False


# ----------------------------------------------------------------------------- allocation and memory


def test_allocator_reuses_freed_blocks_and_says_when_it_runs_out():
    allocator = BlockAllocator(3)
    assert [allocator.allocate() for _ in range(3)] == [0, 1, 2] and allocator.n_free == 0
    with pytest.raises(RuntimeError, match="1 block asked for, 0 of 3 free"):
        allocator.allocate()
    allocator.free([2, 0])
    assert allocator.n_free == 2 and allocator.allocate() == 2 and allocator.allocate() == 0
    with pytest.raises(ValueError, match="appears twice"):
        allocator.free([0, 0])
    with pytest.raises(ValueError, match="not in use"):
        BlockAllocator(2).free([1])


def test_finished_sequences_give_their_blocks_to_new_ones_and_bytes_held_counts_blocks():
    model = tiny_model()  # 2 layers, 2 key/value heads, d_head 16, float32
    paged = PagedKVCache.for_model(model, n_blocks=6, block_size=4)
    assert paged.bytes_per_block == 2 * 2 * 2 * 4 * 16 * 4
    assert paged.nbytes == 6 * paged.bytes_per_block and paged.bytes_held == 0
    with torch.no_grad():
        paged.add_sequence("a"); paged.add_sequence("b")
        paged.run(model, ["a", "b"], [random_ids(9, seed=5), random_ids(4, seed=6)])  # 3 blocks + 1 block
        assert paged.bytes_held == 4 * paged.bytes_per_block and paged.allocator.n_free == 2
        a_blocks = paged.block_table("a")
        paged.free_sequence("a")
        assert paged.bytes_held == 1 * paged.bytes_per_block
        paged.add_sequence("c")
        paged.run(model, ["c"], [random_ids(12, seed=7)])
        assert set(paged.block_table("c")) == set(a_blocks)  # a's blocks, reused
        paged.add_sequence("d")
        with pytest.raises(RuntimeError, match=r"3 more block\(s\) of 4 positions asked for, 2 of 6 free"):
            paged.view(["d"], 9)
        assert paged.allocator.n_free == 2 and paged.length("d") == 0  # all or nothing: nothing was taken


def test_paged_memory_tracks_the_tokens_held_not_the_longest_request():
    model = GPT(preset("tiny"))  # 2 layers, 4 key/value heads, d_head 16, float32: 1024 bytes a token
    lengths = [5, 12, 40, 64, 9, 20, 33, 7]  # a mix of short and long requests; 190 tokens in all
    contiguous = KVCache.for_model(model, batch=len(lengths))  # preallocated to n_ctx = 64 for every request
    paged = PagedKVCache.for_model(model, n_blocks=64, block_size=8)
    with torch.no_grad():
        for seq_id in range(len(lengths)):
            paged.add_sequence(seq_id)
        paged.run(model, list(range(len(lengths))), [random_ids(n, seed=n) for n in lengths])
    # contiguous: 8 rows * 64 positions * 1024 B = 524,288 B. paged: ceil(n / 8) blocks per request =
    # 1 + 2 + 5 + 8 + 2 + 3 + 5 + 1 = 27 blocks * 8 positions * 1024 B = 221,184 B (42%), against the
    # 190 * 1024 = 194,560 B the tokens themselves take: at most block_size - 1 positions wasted per request.
    assert contiguous.nbytes == len(lengths) * kv_cache_bytes(model.cfg, 64) == 524_288
    assert paged.bytes_held == 27 * paged.bytes_per_block == 221_184
    assert sum(lengths) * kv_cache_bytes(model.cfg, 1) == 194_560 <= paged.bytes_held < contiguous.nbytes


def test_crop_gives_back_the_blocks_past_the_kept_positions_and_decoding_goes_on_as_if_never_written():
    model = tiny_model()
    ids = random_ids(14, seed=9)
    paged = PagedKVCache.for_model(model, n_blocks=6, block_size=4)
    paged.add_sequence("s")
    with torch.no_grad():
        paged.run(model, ["s"], [ids[:6]])
        paged.run(model, ["s"], [random_ids(5, seed=10)])  # 11 positions: 3 blocks; then rolled back to 6: 2
        paged.crop("s", 6)
        assert paged.length("s") == 6 and paged.block_table("s") == [0, 1] and paged.allocator.n_free == 4
        logits = paged.run(model, ["s"], [ids[6:]])
        torch.testing.assert_close(logits[0], model(ids[None])[0, 6:], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"length must be an int in 0..14"):
        paged.crop("s", 15)
    paged.crop("s", 0)
    assert paged.block_table("s") == [] and paged.bytes_held == 0


# ----------------------------------------------------------------------------- shared blocks


def test_the_allocator_counts_holders_and_frees_a_block_with_its_last_one():
    allocator = BlockAllocator(3)
    a, b = allocator.allocate(), allocator.allocate()
    allocator.share(a)
    allocator.share(a)
    assert (allocator.ref_count(a), allocator.ref_count(b), allocator.ref_count(2)) == (3, 1, 0)
    allocator.free([a, b])
    assert allocator.n_used == 1 and allocator.n_free == 2 and allocator.allocate() == b  # b went back, a did not
    allocator.free([a])
    allocator.free([a])
    assert allocator.ref_count(a) == 0 and allocator.allocate() == a
    with pytest.raises(ValueError, match="block 2 is not in use: only a block some sequence holds can be shared"):
        allocator.share(2)


def contiguous_logits(model, ids):
    """Logits of ``ids`` (1-D) run alone, from scratch: the oracle for a forked sequence's every token."""
    return model(ids[None])[0]


@pytest.mark.parametrize("name", ["learned_mha", "rope_gqa"])
def test_forked_sequences_share_their_blocks_and_copy_only_the_one_they_write_into(name):
    model = tiny_model(name)
    prompt, tails = random_ids(10, seed=3), [random_ids(7, seed=40 + i) for i in range(3)]
    paged = PagedKVCache.for_model(model, n_blocks=12, block_size=4)
    paged.add_sequence(0)
    with torch.no_grad():
        paged.run(model, [0], [prompt])  # 10 positions: blocks [0, 1, 2], the last one half full
        held = paged.bytes_held
        for child in (1, 2):
            paged.fork(0, child)
        assert paged.bytes_held == held and all(paged.block_table(i) == [0, 1, 2] for i in range(3))
        assert [paged.allocator.ref_count(b) for b in (0, 1, 2)] == [3, 3, 3]
        logits = paged.run(model, [0, 1, 2], tails)  # each writes positions 10..16: into block 2, then two new ones
        for row, tail in enumerate(tails):
            whole = torch.cat([prompt, tail])
            torch.testing.assert_close(logits[row], contiguous_logits(model, whole)[10:], rtol=0, atol=1e-5)
            for layer in range(model.cfg.n_layers):  # no sequence's write reached another's keys
                alone = KVCache.for_model(model, batch=1)
                model(whole[None], kv_cache=alone)
                keys, values = paged.layer_keys(row, layer)
                torch.testing.assert_close(keys, alone.layers[layer].keys[0, :, :17], rtol=0, atol=1e-5)
                torch.testing.assert_close(values, alone.layers[layer].values[0, :, :17], rtol=0, atol=1e-5)
    tables = [paged.block_table(i) for i in range(3)]
    assert all(t[:2] == [0, 1] for t in tables)  # the full prompt blocks stay shared
    assert len({t[2] for t in tables}) == 3 and 2 in {t[2] for t in tables}  # two copies; the last holder kept block 2
    assert paged.allocator.n_used == 2 + 3 + 3 * 2  # 2 shared, 3 half-prompt blocks, two new blocks each
    for seq_id in (1, 2, 0):
        paged.free_sequence(seq_id)
    assert paged.allocator.n_used == 0 and paged.allocator.n_free == 12


def test_a_fork_at_a_block_boundary_copies_nothing_and_crop_keeps_the_others_blocks():
    model = tiny_model()
    prompt, token_a, token_b = random_ids(8, seed=5), random_ids(1, seed=6), random_ids(1, seed=7)
    paged = PagedKVCache.for_model(model, n_blocks=6, block_size=4)
    paged.add_sequence("a")
    with torch.no_grad():
        paged.run(model, ["a"], [prompt])  # two full blocks
        paged.fork("a", "b")
        paged.run(model, ["a", "b"], [token_a, token_b])  # each starts a block of its own: nothing copied
        assert paged.allocator.n_used == 4 and paged.block_table("a")[:2] == paged.block_table("b")[:2]
        paged.crop("b", 3)  # b lets go of its own block and of its hold on block 1
        assert paged.block_table("b") == [0] and paged.allocator.ref_count(1) == 1
        logits = paged.run(model, ["b"], [prompt[3:]])  # b writes into shared block 0: it gets a copy
        torch.testing.assert_close(logits[0], contiguous_logits(model, prompt)[3:], rtol=0, atol=1e-5)
        logits = paged.run(model, ["a"], [prompt[:2]])  # a's keys are untouched by b's writes
        torch.testing.assert_close(logits[0], contiguous_logits(model, torch.cat([prompt, token_a, prompt[:2]]))[9:],
                                   rtol=0, atol=1e-5)


def test_reorder_moves_each_beam_onto_its_parents_blocks_like_a_contiguous_cache():
    model = tiny_model()
    n, g = 4, torch.Generator().manual_seed(8)
    prompt = random_ids(6, seed=8)
    paged = PagedKVCache.for_model(model, n_blocks=n * 6, block_size=4)
    contiguous = KVCache.for_model(model, batch=n)
    with torch.no_grad():
        paged.add_sequence(0)
        paged.run(model, [0], [prompt])
        for i in range(1, n):
            paged.fork(0, i)
        model(prompt[None].expand(n, -1), kv_cache=contiguous)
        for step in range(9):
            rows = torch.randint(0, n, (n,), generator=g)
            paged.reorder(list(range(n)), rows)
            contiguous.reorder(rows)
            tokens = torch.randint(0, 256, (n, 1), generator=g)
            torch.testing.assert_close(paged.run(model, list(range(n)), list(tokens)), model(tokens, kv_cache=contiguous),
                                       rtol=0, atol=1e-5)
        # the same through a view, as beam search calls it after a forward pass
        view = paged.view(list(range(n)), 1)
        model(tokens, kv_cache=view, padding_mask=view.padding_mask, positions=view.positions)
        view.reorder(torch.tensor([1, 1, 1, 1]))
    assert len({tuple(paged.block_table(i)) for i in range(n)}) == 1  # every beam now holds beam 1's blocks
    assert paged.allocator.n_used == len(paged.block_table(0))  # the others' blocks went back
    with pytest.raises(ValueError, match=r"rows must hold 4 ints in 0..3"):
        paged.reorder(list(range(n)), [0, 1, 2])
    with pytest.raises(ValueError, match=r"rows must hold 4 ints in 0..3"):
        paged.reorder(list(range(n)), [0, 1, 2, 4])


@pytest.mark.parametrize("share", [True, False])
def test_paged_sample_gives_each_sample_generates_tokens(share):
    model = tiny_model()
    prompt = random_ids(13, seed=11)
    generators = lambda: [torch.Generator().manual_seed(50 + i) for i in range(4)]  # noqa: E731
    options = dict(temperature=1.5, top_k=40)
    outs, peak = paged_sample(model, prompt, 4, 9, generator=generators(), share=share, block_size=4, **options)
    alone = [generate(model, prompt[None], 9, do_sample=True, generator=g, **options)[0] for g in generators()]
    assert all(torch.equal(a, b) for a, b in zip(outs, alone, strict=True))
    assert len({tuple(o.tolist()) for o in outs}) == 4  # four different answers
    per_block = PagedKVCache.for_model(model, n_blocks=1, block_size=4).bytes_per_block
    # 13 + 8 = 21 positions per sample: 6 blocks each unshared; shared, the 3 full prompt blocks once and
    # 3 of each sample's own (the half-full prompt block, copied, and two more)
    assert peak == (3 + 4 * 3 if share else 4 * 6) * per_block


def test_paged_sample_errors():
    model = tiny_model()
    prompt = random_ids(5, seed=1)
    with pytest.raises(ValueError, match="n must be a positive int"):
        paged_sample(model, prompt, 0, 3)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        paged_sample(model, prompt, 2, 0)
    with pytest.raises(ValueError, match="prompt must be a 1-D integer tensor"):
        paged_sample(model, prompt[None], 2, 3)
    with pytest.raises(ValueError, match="list of 2 torch.Generators"):
        paged_sample(model, prompt, 2, 3, generator=[torch.Generator()])
    with pytest.raises(ValueError, match="more than n_ctx=64"):
        paged_sample(model, random_ids(60, seed=0), 2, 6)


def test_copies_count_against_the_free_blocks():
    model = tiny_model()
    paged = PagedKVCache.for_model(model, n_blocks=2, block_size=4)
    paged.add_sequence("a")
    with torch.no_grad():
        paged.run(model, ["a"], [random_ids(5, seed=2)])  # both blocks in use
    paged.fork("a", "b")
    with pytest.raises(RuntimeError, match=r"1 of them copies of shared blocks about to be written\), 0 of 2 free"):
        paged.view(["b"], 1)
    with pytest.raises(ValueError, match="already held"):
        paged.fork("a", "b")
    with pytest.raises(KeyError, match="no sequence 'c' is held"):
        paged.fork("c", "d")


# ----------------------------------------------------------------------------- errors


def test_clear_errors_on_bad_input():
    model = tiny_model()
    with pytest.raises(ValueError, match="n_blocks must be a positive int"):
        PagedKVCache.for_model(model, n_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        PagedKVCache.for_model(model, n_blocks=4, block_size=0)
    with pytest.raises(TypeError, match="only a causal decoder"):
        PagedKVCache.for_model(Encoder(preset("tiny")), n_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="sliding-window"):
        PagedKVCache.for_model(GPT(preset("tiny").replace(sliding_window=4)), n_blocks=4, block_size=4)
    paged = PagedKVCache.for_model(model, n_blocks=20, block_size=4)
    paged.add_sequence("a")
    with pytest.raises(ValueError, match="already held"):
        paged.add_sequence("a")
    with pytest.raises(KeyError, match="no sequence 'b' is held"):
        paged.free_sequence("b")
    with pytest.raises(KeyError, match="no sequence 'b' is held"):
        paged.view(["a", "b"])
    with pytest.raises(ValueError, match="names a sequence twice"):
        paged.view(["a", "a"])
    with pytest.raises(ValueError, match="n_new must be an int >= 1"):
        paged.view(["a"], 0)
    with pytest.raises(ValueError, match="more than n_ctx=64"):
        paged.view(["a"], 65)
    with pytest.raises(ValueError, match="1-D integer tensors of token ids"):
        paged.run(model, ["a"], [torch.tensor([[1, 2]])])
    with pytest.raises(ValueError, match="1-D integer tensors of token ids"):
        paged.run(model, ["a"], [torch.tensor([1.0, 2.0])])
    view = paged.view(["a"], 2)
    with pytest.raises(ValueError, match="left-padded to max"):  # 3 ids where the view was made for 2
        model(torch.tensor([[1, 2, 3]]), kv_cache=view, positions=torch.tensor([[0, 1, 2]]))
    view = paged.view(["a"], 2)
    with torch.no_grad():
        model(torch.tensor([[1, 2]]), kv_cache=view, padding_mask=view.padding_mask, positions=view.positions)
        with pytest.raises(RuntimeError, match="served its forward pass"):
            model(torch.tensor([[1, 2]]), kv_cache=view, padding_mask=view.padding_mask, positions=view.positions)
    stale = paged.view(["a"], 1)
    paged.view(["a"], 1)  # a second view of the same sequence: the first one's layout is out of date
    with pytest.raises(RuntimeError, match="changed since this view was made"):
        model(torch.tensor([[1]]), kv_cache=stale, padding_mask=stale.padding_mask, positions=stale.positions)
    with pytest.raises(ValueError, match="more than n_ctx=64: the paged cache never crops"):
        paged_greedy(model, [random_ids(60, seed=0)], 6)
    with pytest.raises(ValueError, match="1-D integer tensors"):
        paged_greedy(model, [torch.tensor([1.0, 2.0])], 3)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        paged_greedy(model, [torch.tensor([1, 2])], -1)
