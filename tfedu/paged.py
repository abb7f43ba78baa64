"""A paged KV cache: keys and values in fixed-size blocks, each sequence reading its own through a block table.

A contiguous cache (``tfedu.kv_cache.KVCache``) reserves ``n_ctx`` positions per sequence up front,
because it cannot know how long a request will run; a server holding many requests of mixed lengths
then reserves mostly empty memory. PagedAttention (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention", the vLLM paper, sec. 4) borrows the operating
system's answer, virtual memory: the keys and values live in a *pool* of fixed-size blocks of
``block_size`` positions, each sequence owns a *block table* (the indices of its blocks, in order),
a block is taken from a free list only when the sequence's last one is full, and a finished sequence
gives its blocks back. Memory held then tracks the tokens actually held (at most ``block_size - 1``
wasted per sequence) instead of the longest request allowed.

Position t of a sequence lives in block ``block_table[t // block_size]`` at offset ``t % block_size``.
Every layer has its own pool, ``(n_blocks, n_kv_heads, block_size, d_head)`` for the keys and the
same for the values, and one allocator serves all layers: a block index names the same slot in every
layer's pool, so one block table per sequence is enough.

- ``BlockAllocator``: the free list.
- ``gather_blocks``: one sequence's keys (or values) read back through its block table (exercise 18.2).
- ``PagedKVCache``: the pools, the allocator and the sequences (``crop`` rolls one back and frees the blocks
  past it, for speculative decoding; ``fork`` starts a sequence that shares another's blocks, copied on
  write, and ``reorder`` moves beams onto their parents' blocks); ``view(seq_ids, n_new)`` makes what
  ``model(ids, kv_cache=...)`` accepts for a batch of sequences of different lengths, and ``run`` does
  the whole forward pass (padding, mask, positions) for a list of new tokens per sequence.
- ``paged_greedy``: greedy decoding of prompts of different lengths, batched, through the paged cache:
  the tokens of ``tfedu.generate.generate`` on each prompt alone (tests/test_paged.py).
- ``paged_sample``: several sampled answers to one prompt, its blocks shared (parallel sampling): the
  tokens each sample gets alone, the prompt's keys held once.

Attention here gathers each row's keys into a left-padded tensor and runs the model's own attention
on it (the layout ``tfedu.generate`` uses for prompts of different lengths), so the numbers are the
contiguous cache's. vLLM's kernel reads the blocks in place instead of copying them out at every
step: the memory held is the same, the copy is what this version pays in time.

>>> from tfedu.config import preset
>>> from tfedu.model import GPT
>>> _ = torch.manual_seed(0); model = GPT(preset("tiny")).eval()
>>> cache = PagedKVCache.for_model(model, n_blocks=8, block_size=4)
>>> cache.add_sequence("a"); cache.add_sequence("b")
>>> logits = cache.run(model, ["a", "b"], [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7])])
>>> logits.shape, cache.length("a"), cache.block_table("a"), cache.block_table("b")  # 5 tokens: 2 blocks
(torch.Size([2, 5, 256]), 5, [0, 1], [2])
>>> cache.free_sequence("a"); cache.allocator.n_free
7

Built by hand in notebooks/18_serving.ipynb.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from tfedu.generate import _check_generator, _check_sampling, _sample, next_token_distribution
from tfedu.kv_cache import KVCache, LayerKVCache
from tfedu.layers import Attention


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class BlockAllocator:
    """A free list of ``n_blocks`` block indices, ``0 .. n_blocks - 1``: ``allocate`` takes one, ``free`` gives back.

    Blocks come out lowest index first and a freed block is the next one handed out again (a stack,
    as vLLM's free list), so a finished request's memory serves the next request at once. A block can
    have several holders (``share``: sequences forked from one prompt, Kwon et al. 2023 sec. 4.4); it
    counts them, and ``free`` returns it to the free list when its last holder lets go.

    >>> allocator = BlockAllocator(3)
    >>> [allocator.allocate() for _ in range(2)], allocator.n_free
    ([0, 1], 1)
    >>> allocator.free([0]); allocator.allocate()
    0
    >>> allocator.share(1); allocator.free([1]); allocator.ref_count(1), allocator.n_free  # one holder left
    (1, 1)
    """

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = _positive_int("n_blocks", n_blocks)
        self._free = list(range(n_blocks - 1, -1, -1))  # a stack: pop() gives the lowest index first
        self._refs: dict[int, int] = {}  # block in use -> how many holders it has

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        """Blocks in use, each counted once however many sequences hold it."""
        return len(self._refs)

    def ref_count(self, block: int) -> int:
        """How many holders ``block`` has (0: free)."""
        return self._refs.get(block, 0)

    def share(self, block: int) -> None:
        """One more holder for ``block``, which must be in use: its keys are read by another sequence too."""
        if block not in self._refs:
            raise ValueError(f"block {block!r} is not in use: only a block some sequence holds can be shared")
        self._refs[block] += 1

    def allocate(self) -> int:
        """One free block's index; a clear error when none is left."""
        if not self._free:
            raise RuntimeError(f"out of KV cache blocks: 1 block asked for, 0 of {self.n_blocks} free (every block "
                               "is held by a running sequence): free a finished sequence or make a larger pool")
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def free(self, blocks: Sequence[int]) -> None:
        """One holder lets go of each of ``blocks`` (each must be in use, named once).

        A block whose last holder let go goes back to the free list: of those, ``blocks[0]`` is the next one
        allocated, then ``blocks[1]``, ...
        """
        blocks = list(blocks)
        for block in blocks:
            if block not in self._refs:
                raise ValueError(f"block {block!r} is not in use (free blocks cannot be freed again; indices are "
                                 f"0..{self.n_blocks - 1})")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"a block appears twice in {blocks}: each block is freed once")
        released = []
        for block in blocks:
            self._refs[block] -= 1
            if not self._refs[block]:
                del self._refs[block]
                released.append(block)
        self._free.extend(reversed(released))

    def __repr__(self) -> str:
        return f"BlockAllocator(n_blocks={self.n_blocks}, n_free={self.n_free})"


def gather_blocks(
    pool: Float[Tensor, "n_blocks n_kv_heads block_size d_head"], block_table: Sequence[int] | Int[Tensor, "n_table"],
    length: int,
) -> Float[Tensor, "n_kv_heads length d_head"]:
    """One sequence's first ``length`` keys (or values), read from ``pool`` through its ``block_table``.

    Position t lives in block ``block_table[t // block_size]`` at offset ``t % block_size``
    (Kwon et al. 2023, sec. 4.2): the blocks need not be contiguous nor in order in the pool. The
    result is laid out as a contiguous cache holds one sequence (heads before positions).

    >>> pool = torch.arange(4.0).reshape(4, 1, 1, 1).repeat(1, 1, 2, 1)  # block b holds the value b twice
    >>> gather_blocks(pool, [3, 0], 3).flatten().tolist()  # positions 0, 1 in block 3, position 2 in block 0
    [3.0, 3.0, 0.0]
    """
    if not isinstance(pool, Tensor) or pool.dim() != 4:
        got = tuple(pool.shape) if isinstance(pool, Tensor) else type(pool).__name__
        raise ValueError(f"pool must be a tensor (n_blocks, n_kv_heads, block_size, d_head), got {got}")
    n_blocks, _, block_size, _ = pool.shape
    table = torch.as_tensor(block_table, dtype=torch.long, device=pool.device)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be an int >= 0 (positions to read), got {length!r}")
    needed = -(-length // block_size)
    if table.dim() != 1 or table.numel() < needed:
        raise ValueError(f"{length} positions in blocks of {block_size} need a block table of at least {needed} "
                         f"indices, got {table.tolist()}")
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= n_blocks):
        raise IndexError(f"block table {table.tolist()} points outside the pool's {n_blocks} blocks")
    t = torch.arange(length, device=pool.device)
    return pool[table[t // block_size], :, t % block_size].transpose(0, 1)  # n_kv_heads length d_head


class PagedKVCache:
    """Every layer's pools of key and value blocks, one shared ``BlockAllocator``, and the sequences held.

    ``keys[i]``, ``values[i]``: layer i's pools ``(n_blocks, n_kv_heads, block_size, d_head)``. A sequence
    is added by id (any hashable), grows by whole blocks as tokens are written, and gives its blocks back
    when freed. ``nbytes`` is the pools' memory, ``bytes_held`` the part in use by sequences
    (``blocks in use * bytes_per_block``).

    To run the model on several sequences of different lengths at once, ``view(seq_ids, n_new)`` gives a
    ``PagedView`` (a ``KVCache`` to the model) and ``run`` does the whole forward pass.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, d_head: int, *, n_blocks: int, block_size: int, n_ctx: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("d_head", d_head),
                            ("block_size", block_size), ("n_ctx", n_ctx)):
            _positive_int(name, value)
        self.allocator = BlockAllocator(n_blocks)
        self.block_size, self.n_ctx = block_size, n_ctx
        shape = (n_blocks, n_kv_heads, block_size, d_head)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        self._version = 0  # bumped by every change to the sequences: a view made before one is stale

    @classmethod
    def for_model(cls, model: nn.Module, n_blocks: int, block_size: int) -> PagedKVCache:
        """Empty pools for every block of ``model`` (a causal tfedu ``GPT``), in its dtype and on its device."""
        if not getattr(model, "supports_kv_cache", False):
            raise TypeError(f"{type(model).__name__} cannot keep a KV cache: only a causal decoder (tfedu.model.GPT) can")
        attns = [block.attn for block in model.blocks]
        for attn in attns:
            if type(attn) is not Attention:
                raise ValueError(f"the paged cache holds tfedu.layers.Attention's keys and values; this model's blocks "
                                 f"use {type(attn).__name__}, whose cache has another layout")
            if attn.sliding_window is not None:
                raise ValueError("sliding-window layers keep a ring of recent keys (tfedu.kv_cache.RingKVCache); the "
                                 "paged cache does not support them")
        weight = model.embed.weight
        return cls(len(attns), attns[0].n_kv_heads, attns[0].d_head, n_blocks=n_blocks, block_size=block_size,
                   n_ctx=model.cfg.n_ctx, dtype=weight.dtype, device=weight.device)

    # ------------------------------------------------------------------ sequences and memory

    def add_sequence(self, seq_id: Hashable) -> None:
        """Start holding a sequence, empty: it takes no block until a token is written."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} is already held (free it first, or pick another id)")
        self._tables[seq_id], self._lengths[seq_id] = [], 0
        self._version += 1

    def free_sequence(self, seq_id: Hashable) -> None:
        """Forget a sequence and give its blocks back to the allocator."""
        self._check_held(seq_id)
        self.allocator.free(self._tables.pop(seq_id))
        del self._lengths[seq_id]
        self._version += 1

    def _check_held(self, seq_id: Hashable) -> None:
        if seq_id not in self._tables:
            raise KeyError(f"no sequence {seq_id!r} is held; held: {list(self._tables)} (add_sequence first)")

    def fork(self, seq_id: Hashable, new_id: Hashable) -> None:
        """Start ``new_id`` as a copy of ``seq_id`` that shares its blocks: no key or value is copied.

        Parallel sampling (several answers to one prompt) and beam search (beams with a common past) hold the
        same keys many times over; forked sequences hold them once (Kwon et al. 2023, sec. 4.4). Blocks are
        only ever appended to, so a full shared block stays shared; the partly filled last block is copied
        when a sequence first writes into it while another still holds it (copy-on-write, in ``view``).
        """
        self._check_held(seq_id)
        if new_id in self._tables:
            raise ValueError(f"sequence {new_id!r} is already held (free it first, or pick another id)")
        table = list(self._tables[seq_id])
        for block in table:
            self.allocator.share(block)
        self._tables[new_id], self._lengths[new_id] = table, self._lengths[seq_id]
        self._version += 1

    def reorder(self, seq_ids: Sequence[Hashable], rows: Sequence[int] | Int[Tensor, "batch"]) -> None:
        """Sequence ``seq_ids[i]`` continues as ``seq_ids[rows[i]]`` did (beam search: each beam takes its parent's past).

        Each takes its parent's block table and length, sharing the blocks (as ``fork``); blocks no sequence
        holds any more go back to the allocator.
        """
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self._check_held(seq_id)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids {seq_ids} names a sequence twice: each row is a different sequence")
        rows = rows.tolist() if isinstance(rows, Tensor) else list(rows)
        if len(rows) != len(seq_ids) or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < len(seq_ids)
                                            for r in rows):
            raise ValueError(f"rows must hold {len(seq_ids)} ints in 0..{len(seq_ids) - 1} (the row each sequence "
                             f"continues), got {rows}")
        tables = [list(self._tables[seq_ids[r]]) for r in rows]
        lengths = [self._lengths[seq_ids[r]] for r in rows]
        for table in tables:  # take the new holds before letting go of the old, so no shared block is freed
            for block in table:
                self.allocator.share(block)
        for seq_id, table, length in zip(seq_ids, tables, lengths, strict=True):
            self.allocator.free(self._tables[seq_id])
            self._tables[seq_id], self._lengths[seq_id] = table, length
        self._version += 1

    def crop(self, seq_id: Hashable, length: int) -> None:
        """Keep ``seq_id``'s first ``length`` positions and give back the blocks past them (rejected draft tokens)."""
        self._check_held(seq_id)
        held = self._lengths[seq_id]
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= held:
            raise ValueError(f"crop keeps the first length positions: length must be an int in 0..{held} (the "
                             f"positions {seq_id!r} holds), got {length!r}")
        keep = -(-length // self.block_size)
        self.allocator.free(self._tables[seq_id][keep:])
        del self._tables[seq_id][keep:]
        self._lengths[seq_id] = length
        self._version += 1

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._tables)

    def length(self, seq_id: Hashable) -> int:
        """Positions held for ``seq_id``."""
        self._check_held(seq_id)
        return self._lengths[seq_id]

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The indices of ``seq_id``'s blocks, in the order of its positions (a copy)."""
        self._check_held(seq_id)
        return list(self._tables[seq_id])

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block index holds over every layer: 2 (keys, values) * n_layers * n_kv_heads * block_size * d_head."""
        return 2 * sum(pool[0].nbytes for pool in self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's pools, used or not."""
        return sum(pool.nbytes for pool in self.keys) + sum(pool.nbytes for pool in self.values)

    @property
    def bytes_held(self) -> int:
        """Bytes of the blocks the sequences hold: what the pool could shrink to."""
        return self.allocator.n_used * self.bytes_per_block

    def layer_keys(self, seq_id: Hashable, layer: int) -> tuple[Float[Tensor, "n_kv_heads pos d_head"],
                                                                  Float[Tensor, "n_kv_heads pos d_head"]]:
        """``seq_id``'s keys and values in ``layer``, gathered: what a contiguous cache holds for it."""
        self._check_held(seq_id)
        table, length = self._tables[seq_id], self._lengths[seq_id]
        return gather_blocks(self.keys[layer], table, length), gather_blocks(self.values[layer], table, length)

    # ------------------------------------------------------------------ running the model

    def view(self, seq_ids: Sequence[Hashable], n_new: int | Sequence[int] = 1) -> PagedView:
        """What ``model(ids, kv_cache=...)`` accepts for the sequences ``seq_ids`` (one row each), adding ``n_new`` tokens.

        ``n_new``: how many real new tokens each row brings (an int for all, or one per row, each >= 1).
        The ids go in left-padded to ``N = max(n_new)`` columns; pass ``padding_mask=view.padding_mask``
        and ``positions=view.positions`` with them. The blocks the new tokens need are allocated here,
        all or none. Make the view right before its forward pass: any change to the sequences in between
        (another view included) makes it stale, a clear error when the model runs it.
        """
        seq_ids = list(seq_ids)
        if not seq_ids:
            raise ValueError("seq_ids is empty: a view needs at least one sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids {seq_ids} names a sequence twice: each row is a different sequence")
        for seq_id in seq_ids:
            self._check_held(seq_id)
        n_new = [n_new] * len(seq_ids) if isinstance(n_new, int) and not isinstance(n_new, bool) else list(n_new)
        if len(n_new) != len(seq_ids) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in n_new):
            raise ValueError(f"n_new must be an int >= 1 or one such int per sequence ({len(seq_ids)}), got {n_new}")
        lengths = [self._lengths[seq_id] + n for seq_id, n in zip(seq_ids, n_new, strict=True)]
        too_long = [(seq_id, n) for seq_id, n in zip(seq_ids, lengths, strict=True) if n > self.n_ctx]
        if too_long:
            raise ValueError(f"sequence {too_long[0][0]!r} would hold {too_long[0][1]} positions, more than "
                             f"n_ctx={self.n_ctx}")
        # (max: a forward pass that failed may have left a sequence more blocks than its length needs)
        wanted = sum(max(0, -(-n // self.block_size) - len(self._tables[seq_id]))
                     for seq_id, n in zip(seq_ids, lengths, strict=True))
        shared = self._shared_to_write(seq_ids, lengths)
        if wanted + len(shared) > self.allocator.n_free:
            copies = f" ({len(shared)} of them copies of shared blocks about to be written)" if shared else ""
            raise RuntimeError(f"out of KV cache blocks: {wanted + len(shared)} more block(s) of {self.block_size} "
                               f"positions asked for{copies}, {self.allocator.n_free} of {self.allocator.n_blocks} "
                               "free: free finished sequences, run fewer at once, or make a larger pool")
        for seq_id, index in shared:  # copy-on-write: this sequence gets a block of its own to write into
            old, new = self._tables[seq_id][index], self.allocator.allocate()
            for pool in (*self.keys, *self.values):
                pool[new] = pool[old]
            self.allocator.free([old])
            self._tables[seq_id][index] = new
        for seq_id, n in zip(seq_ids, lengths, strict=True):
            while len(self._tables[seq_id]) * self.block_size < n:
                self._tables[seq_id].append(self.allocator.allocate())
        self._version += 1
        return PagedView(self, seq_ids, n_new)

    def _shared_to_write(self, seq_ids: list[Hashable], lengths: list[int]) -> list[tuple[Hashable, int]]:
        """(sequence, table index) of each block a sequence is about to write into while another still holds it.

        A sequence writes positions ``held .. length - 1``; of the blocks it already has, those covering them
        need a copy of their own if shared. Sequences copy in order, so the last holder of a block (once the
        others have copied it away) writes in place.
        """
        copies, taken = [], {}  # taken: block -> holders that already copied it away in this view
        for seq_id, length in zip(seq_ids, lengths, strict=True):
            table = self._tables[seq_id]
            first, end = self._lengths[seq_id] // self.block_size, min(len(table), -(-length // self.block_size))
            for index in range(first, end):
                block = table[index]
                if self.allocator.ref_count(block) - taken.get(block, 0) > 1:
                    copies.append((seq_id, index))
                    taken[block] = taken.get(block, 0) + 1
        return copies

    def run(self, model: nn.Module, seq_ids: Sequence[Hashable], new_ids: Sequence[Int[Tensor, "n_new"]]
            ) -> Float[Tensor, "batch n_new_max d_vocab"]:
        """One forward pass of ``model`` over each sequence's new tokens ``new_ids[i]`` (1-D, lengths may differ).

        Returns the logits left-padded like the ids: row i's last ``len(new_ids[i])`` positions are its
        tokens', equal to what ``model`` gives the sequence alone with a contiguous cache.
        """
        if not isinstance(new_ids, (list, tuple)) or len(new_ids) != len(seq_ids) or not all(
                isinstance(ids, Tensor) and ids.dim() == 1 and ids.numel() >= 1 and not ids.is_floating_point()
                for ids in new_ids):
            raise ValueError(f"new_ids must be a list of {len(seq_ids)} 1-D integer tensors of token ids (one per "
                             "sequence, at least one token each)")
        view = self.view(seq_ids, [ids.numel() for ids in new_ids])
        width = max(ids.numel() for ids in new_ids)
        device = self.keys[0].device
        ids = torch.zeros(len(new_ids), width, dtype=torch.long, device=device)  # left-padded with token 0
        for row, tokens in enumerate(new_ids):
            ids[row, width - tokens.numel():] = tokens.to(device)
        return model(ids, kv_cache=view, padding_mask=view.padding_mask, positions=view.positions)

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={len(self.keys)}, n_blocks={self.allocator.n_blocks}, "
                f"block_size={self.block_size}, sequences={len(self._tables)}, n_free={self.allocator.n_free})")


class PagedView(KVCache):
    """A batch of a ``PagedKVCache``'s sequences as one ``KVCache`` for one forward pass (``PagedKVCache.view``).

    Row i holds ``h_i`` positions and brings ``n_i`` new tokens. The model sees each row left-padded to
    ``T = max(h_i + n_i)`` key columns, its real keys in the last ``h_i + n_i``, and the ids left-padded
    to ``N = max(n_i)`` columns: ``length = T - N`` columns come before the new ones, so the causal
    mask (aligned to the end) lets new token r of row i, at key column ``T - n_i + r``, see exactly its
    own sequence's earlier keys. ``padding_mask`` ``(batch, T)`` hides the padding and ``positions``
    ``(batch, N)`` puts row i's new tokens at ``h_i, h_i + 1, ...``: the layout ``tfedu.generate`` uses
    for prompts of different lengths, so each row gets what a contiguous cache gives it alone.

    Each layer's ``append`` writes its real new keys and values into the row's blocks and returns the
    row's keys and values gathered through its block table; after the last layer the sequences'
    lengths grow by ``n_i``. A view serves one forward pass.
    """

    def __init__(self, cache: PagedKVCache, seq_ids: list[Hashable], n_new: list[int]) -> None:
        # Not KVCache.__init__: there is no preallocated tensor per row; the model only needs ``layers``,
        # ``length``, ``batch``, ``capacity`` and ``check_room`` (and the first layer's ``keys`` dtype).
        self.cache, self.seq_ids, self.n_new = cache, seq_ids, n_new
        device = cache.keys[0].device
        held = [cache._lengths[seq_id] for seq_id in seq_ids]
        totals = torch.tensor([h + n for h, n in zip(held, n_new, strict=True)], device=device)  # batch
        width, n_cols = max(n_new), int(totals.max())
        self._length = n_cols - width
        cols = torch.arange(n_cols, device=device)
        self.padding_mask: Bool[Tensor, "batch key_pos"] = cols >= n_cols - totals[:, None]
        # Row i's real column c holds its position c - (n_cols - total_i); the table maps that to a pool slot.
        position = (cols - (n_cols - totals[:, None])).clamp(min=0)  # batch key_pos
        tables = [torch.tensor(cache._tables[seq_id], dtype=torch.long, device=device) for seq_id in seq_ids]
        self._blocks = torch.stack([table[position[row] // cache.block_size] for row, table in enumerate(tables)])
        self._offsets = position % cache.block_size  # batch key_pos
        self.positions: Int[Tensor, "batch n_new_max"] = position[:, self._length:]  # padded slots sit at 0
        # The new keys to write: row i's last n_i of the N new columns (a padded new column is written nowhere; the
        # padding mask will not do, since a short row's cached keys reach into those columns too).
        n_new_t = torch.tensor(n_new, device=device)
        self._new_real = torch.arange(width, device=device) >= width - n_new_t[:, None]  # batch n_new_max
        # Where each real new token goes, the same in every layer: worked out once per view, not per layer.
        self._rows, self._cols = self._new_real.nonzero(as_tuple=True)  # n_real
        write_blocks = self._blocks[:, self._length:][self._rows, self._cols]  # n_real
        write_offsets = self._offsets[:, self._length:][self._rows, self._cols]  # n_real
        # Pools are contiguous (n_blocks, n_kv_heads, block_size, d): slot (block, head, offset) is row
        # (block * n_kv_heads + head) * block_size + offset of the pool viewed as (-1, d). One index_select
        # then reads every row's keys in the layout attention wants, and one index_copy_ writes the new ones.
        n_kv_heads, heads = cache.keys[0].shape[1], torch.arange(cache.keys[0].shape[1], device=device)
        self._read_rows = ((self._blocks[:, None, :] * n_kv_heads + heads[:, None]) * cache.block_size
                           + self._offsets[:, None, :]).flatten()  # batch*n_kv_heads*key_pos
        self._write_rows = ((write_blocks[:, None] * n_kv_heads + heads) * cache.block_size
                            + write_offsets[:, None]).flatten()  # n_real*n_kv_heads
        self.layers = [PagedLayerView(self, layer) for layer in range(len(cache.keys))]
        self._appended, self._version = 0, cache._version

    @property
    def length(self) -> int:
        """Key columns before the new tokens' (``T - N``): the model's ``padding_mask`` covers these and the new ones."""
        return self._length

    @property
    def capacity(self) -> int:
        return self.cache.n_ctx

    @property
    def batch(self) -> int:
        return len(self.seq_ids)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def _write_and_gather(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self._appended >= len(self.layers):
            raise RuntimeError("this view has served its forward pass: make a new one with cache.view(...) per step")
        if self._version != self.cache._version:
            raise RuntimeError("the cache's sequences changed since this view was made (another view, a sequence added, "
                               "freed or cropped): make the view right before the forward pass that uses it")
        expected = (self.batch, self.cache.keys[layer].shape[1], self._new_real.shape[1], self.cache.keys[layer].shape[3])
        if k.dim() != 4 or tuple(k.shape) != expected or v.shape != k.shape:
            raise ValueError(f"this view expects new keys and values (batch, n_kv_heads, n_new_max, d_head) = {expected} "
                             f"(ids left-padded to max(n_new) columns), got k {tuple(k.shape)} and v {tuple(v.shape)}")
        gathered = []
        for pool, new in ((self.cache.keys[layer], k), (self.cache.values[layer], v)):
            flat = pool.view(-1, pool.shape[3])  # the pool's rows of d numbers, in place
            flat.index_copy_(0, self._write_rows, new[self._rows, :, self._cols].reshape(-1, pool.shape[3]).to(pool))
            # A padded column reads some real slot of its own row (position 0's): finite, and hidden by the padding
            # mask, so its attention weight is exactly 0. The pools hold only zeros and keys the model wrote.
            gathered.append(flat.index_select(0, self._read_rows).view(self.batch, pool.shape[1], -1, pool.shape[3]))
        gathered_k, gathered_v = gathered
        self._appended += 1
        if self._appended == len(self.layers):  # every layer written: the sequences now hold the new tokens
            for seq_id, n in zip(self.seq_ids, self.n_new, strict=True):
                self.cache._lengths[seq_id] += n
            self.cache._version += 1
        return gathered_k, gathered_v  # batch n_kv_heads key_pos d_head

    def reorder(self, rows: Int[Tensor, "batch"]) -> None:
        """After the forward pass, row i's sequence continues as row ``rows[i]``'s did, sharing its blocks
        (``PagedKVCache.reorder``; beam search). Make the next step's view after it."""
        if self._appended != len(self.layers):
            raise RuntimeError("reorder the rows after this view's forward pass, not during it")
        self.cache.reorder(self.seq_ids, rows)

    def crop(self, length: int) -> None:
        raise NotImplementedError("crop the sequences in the PagedKVCache instead (cache.crop(seq_id, length))")

    def reset(self) -> None:
        raise NotImplementedError("free the sequences in the PagedKVCache instead (cache.free_sequence(seq_id))")

    def __repr__(self) -> str:
        return f"PagedView(seq_ids={self.seq_ids}, n_new={self.n_new}, length={self.length})"


class PagedLayerView(LayerKVCache):
    """One layer of a ``PagedView``: what ``tfedu.layers.Attention`` calls ``append(k, v)`` on.

    ``keys`` and ``values`` are the layer's pools (so the model can check their dtype and device).
    """

    def __init__(self, view: PagedView, layer: int) -> None:
        # Not LayerKVCache.__init__: the memory is the cache's pools, not a tensor per row.
        self.view, self.layer = view, layer
        self.keys, self.values = view.cache.keys[layer], view.cache.values[layer]

    @property
    def length(self) -> int:
        return self.view.length

    @property
    def capacity(self) -> int:
        return self.view.capacity

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def append(
        self, k: Float[Tensor, "batch n_kv_heads n_new_max d_head"], v: Float[Tensor, "batch n_kv_heads n_new_max d_head"]
    ) -> tuple[Float[Tensor, "batch n_kv_heads key_pos d_head"], Float[Tensor, "batch n_kv_heads key_pos d_head"]]:
        """Write the real new keys and values into their blocks; return each row's, gathered and left-padded."""
        return self.view._write_and_gather(self.layer, k, v)

    def reorder(self, rows: Int[Tensor, "batch"]) -> None:
        self.view.reorder(rows)

    def crop(self, length: int) -> None:
        self.view.crop(length)

    def reset(self) -> None:
        self.view.reset()


def paged_greedy(
    model: nn.Module, prompts: Sequence[Int[Tensor, "pos"]], max_new_tokens: int, *, block_size: int = 16,
    n_blocks: int | None = None,
) -> list[Int[Tensor, "pos_out"]]:
    """Greedy decoding of ``prompts`` (1-D tensors, lengths may differ) together, through a ``PagedKVCache``.

    The prompts run in one forward pass (left-padded, ``PagedKVCache.run``), then one token per row per
    step. Returns each prompt followed by its ``max_new_tokens`` tokens: those
    ``tfedu.generate.generate(model, prompt[None], max_new_tokens)`` gives it alone (tested).
    ``n_blocks`` defaults to what every sequence needs at its longest; each sequence's blocks are
    freed when it is done. The context must fit: ``len(prompt) + max_new_tokens - 1 <= n_ctx``.

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> _ = torch.manual_seed(0); model = GPT(preset("tiny"))
    >>> out = paged_greedy(model, [torch.tensor([72, 105]), torch.tensor([1, 2, 3, 4, 5])], 3, block_size=4)
    >>> [len(o) for o in out]
    [5, 8]
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(
            isinstance(p, Tensor) and p.dim() == 1 and p.numel() >= 1 and not p.is_floating_point() for p in prompts):
        raise ValueError("prompts must be a non-empty list of 1-D integer tensors of token ids, one per prompt, "
                         "at least one token each")
    n_ctx = model.cfg.n_ctx
    longest = max(p.numel() for p in prompts) + max_new_tokens - 1
    if longest > n_ctx:
        raise ValueError(f"a prompt plus {max_new_tokens} new tokens needs {longest} positions, more than "
                         f"n_ctx={n_ctx}: the paged cache never crops")
    _positive_int("block_size", block_size)
    if n_blocks is None:
        n_blocks = sum(-(-(p.numel() + max(max_new_tokens - 1, 0)) // block_size) for p in prompts)
    out = [p.clone() for p in prompts]
    if max_new_tokens == 0:
        return out
    cache = PagedKVCache.for_model(model, n_blocks=n_blocks, block_size=block_size)
    seq_ids = list(range(len(prompts)))
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for seq_id in seq_ids:
                cache.add_sequence(seq_id)
            new = [p.to(cache.keys[0].device) for p in prompts]
            for _ in range(max_new_tokens):
                next_ids = cache.run(model, seq_ids, new)[:, -1].argmax(dim=-1)  # batch
                out = [torch.cat([o, t[None].to(o)]) for o, t in zip(out, next_ids, strict=True)]
                new = [t[None] for t in next_ids]
    finally:
        model.train(was_training)
        for seq_id in cache.seq_ids:
            cache.free_sequence(seq_id)
    return [o.clone() for o in out]


def paged_sample(
    model: nn.Module, prompt: Int[Tensor, "pos"], n: int, max_new_tokens: int, *,
    generator: torch.Generator | list | tuple | None = None, share: bool = True, block_size: int = 16,
    temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
) -> tuple[list[Int[Tensor, "pos_out"]], int]:
    """``n`` sampled continuations of one ``prompt`` (1-D), decoded together through a ``PagedKVCache``.

    With ``share`` (parallel sampling, Kwon et al. 2023 sec. 4.4) the prompt runs once, in sequence 0, and
    the other samples ``fork`` it: its full blocks are held once for all of them, and its partly filled last
    block is copied for each sample that writes into it while another still holds it. Without, every sample runs the prompt in blocks of
    its own, as a server that does not share holds it. ``generator``: as ``tfedu.generate.generate``'s, a
    list of ``n`` generators draws sample i with ``generator[i]``, so each gets the tokens
    ``generate(model, prompt[None], max_new_tokens, do_sample=True, generator=generator[i], ...)`` gives
    it alone (tested), shared or not. ``temperature``, ``top_k``, ``top_p`` shape every draw.

    Returns the ``n`` outputs (the prompt, then ``max_new_tokens`` tokens) and the most bytes of blocks
    the cache held at once (``bytes_held``, after each forward pass).
    """
    _positive_int("n", n)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(prompt, Tensor) or prompt.dim() != 1 or prompt.numel() < 1 or prompt.is_floating_point():
        raise ValueError("prompt must be a 1-D integer tensor of token ids, at least one token")
    _check_sampling(temperature, top_k, top_p)
    _check_generator(generator, n)
    _positive_int("block_size", block_size)
    longest = prompt.numel() + max_new_tokens - 1
    if longest > model.cfg.n_ctx:
        raise ValueError(f"the prompt plus {max_new_tokens} new tokens needs {longest} positions, more than "
                         f"n_ctx={model.cfg.n_ctx}: the paged cache never crops")
    per_sample = -(-longest // block_size)
    cache = PagedKVCache.for_model(model, n_blocks=n * per_sample, block_size=block_size)
    seq_ids = list(range(n))
    prompt = prompt.to(cache.keys[0].device)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            first = seq_ids[:1] if share else seq_ids
            for seq_id in first:
                cache.add_sequence(seq_id)
            last = cache.run(model, first, [prompt] * len(first))[:, -1].float()  # 1 or n, d_vocab
            peak = cache.bytes_held
            for seq_id in seq_ids[len(first):]:
                cache.fork(0, seq_id)
            logits = last.expand(n, -1)  # the prompt's last logits, the same for every sample
            new_tokens = []
            for step in range(max_new_tokens):
                probs = next_token_distribution(logits, temperature=temperature, top_k=top_k, top_p=top_p)
                next_ids = _sample(probs, generator)  # n
                new_tokens.append(next_ids)
                if step + 1 < max_new_tokens:
                    logits = cache.run(model, seq_ids, [t[None] for t in next_ids])[:, -1].float()
                    peak = max(peak, cache.bytes_held)
    finally:
        model.train(was_training)
        for seq_id in cache.seq_ids:
            cache.free_sequence(seq_id)
    new = torch.stack(new_tokens, dim=1).to(prompt)  # n max_new_tokens
    return [torch.cat([prompt, row]).clone() for row in new], peak
