"""The key/value cache: decoding one token at a time without computing the past again.

In a causal model the keys and values of positions 0..t-1 never change when token t arrives (no
earlier position can see a later one). So a decoder keeps them: each step computes the query, key
and value of the *new* token only, writes its key and value after the ones already held, and lets
the new query attend over every key held, its own included, exactly once. A step then costs
O(d_model^2) for the projections plus O(pos * d_model) for the attention, instead of a whole forward
pass over the context (Pope et al. 2022, "Efficiently Scaling Transformer Inference", sec. 2).

The price is memory. Per token and per sequence the cache holds one key and one value vector per
layer and key/value head::

    2 * n_layers * n_kv_heads * d_head * bytes_per_number

GPT-2 small in float32: 2 * 12 * 12 * 64 * 4 = 73,728 bytes (72 KiB) a token, 72 MiB for its 1024
positions. Fewer key/value heads (grouped-query attention, Ainslie et al. 2023; multi-query, Shazeer
2019) shrink it by n_heads / n_kv_heads: that is what they are for.

- ``LayerKVCache``: one layer's keys and values, preallocated ``(batch, n_kv_heads, capacity, d_head)``
  in the model's dtype and device, and how many positions are filled; ``append`` writes new ones
  and returns everything held.
- ``RingKVCache``: a local (sliding-window) layer's cache, a ring of ``sliding_window - 1`` slots: the
  newest keys overwrite the oldest, so its memory stays the same however long the sequence grows.
- ``KVCache``: one ``LayerKVCache`` (or ``RingKVCache``) per block (``KVCache.for_model``); ``model(ids, kv_cache=cache)``
  appends the new tokens to every layer. ``reorder`` picks rows (beam search), ``crop`` rolls it back
  (speculative decoding, ``tfedu.speculative``), ``reset`` empties it.
- ``kv_cache_bytes``: the formula above, to set against ``KVCache.nbytes``.
- ``decode_step``: one step of cached attention written out in full (the exercise of notebook 10), and
  ``greedy_by_hand``: a whole model decoded greedily through it, block by block (what the
  notebook's switch runs with the learner's step).
- ``pool_kv_heads``: a model converted to fewer key/value heads by averaging the heads of each group
  (Ainslie et al. 2023, sec. 2.1), the starting point of grouped-query uptraining.

A cache cannot slide its window past ``n_ctx`` and still give what the uncached path gives (it crops
the context to the last n_ctx tokens and computes them again): past the first block, every cached key
and value came from hidden states that attended to the tokens a crop drops, and learned or sinusoidal
position vectors would all have to shift. (RoPE alone would not forbid sliding, since its scores depend
only on offsets; models trained with sliding-window attention keep a rolling cache, e.g. Mistral 7B,
Jiang et al. 2023, sec. 2: that is ``RingKVCache``, for their local layers.) Overflowing it is an error; ``tfedu.generate.generate`` starts again from
the last n_ctx tokens instead.

>>> from tfedu.config import preset
>>> from tfedu.model import GPT
>>> _ = torch.manual_seed(0); model = GPT(preset("tiny")).eval()
>>> ids = torch.randint(0, 256, (1, 8))
>>> cache = KVCache.for_model(model, batch=1)
>>> prompt = model(ids[:, :7], kv_cache=cache)  # the prompt: 7 positions cached
>>> step = model(ids[:, 7:], kv_cache=cache)  # one new token, its query over all 8 keys
>>> step.shape, cache.length, torch.allclose(step[:, -1], model(ids)[:, -1], atol=1e-5)
(torch.Size([1, 1, 256]), 8, True)
>>> cache.nbytes == kv_cache_bytes(model.cfg, model.cfg.n_ctx)  # preallocated for n_ctx = 64 positions
True

Built by hand in notebooks/10_inference_and_kv_cache.ipynb.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from tfedu.config import ModelConfig
from tfedu.inputs import check_ids
from tfedu.positional import apply_rope


def kv_cache_bytes(cfg: ModelConfig, n_tokens: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """Bytes a KV cache needs for ``n_tokens`` positions of ``batch`` sequences: 2·n_layers·n_kv_heads·d_head·bytes each.

    The 2 is one key and one value vector per layer and key/value head.

    >>> from tfedu.config import preset
    >>> kv_cache_bytes(preset("gpt2"), 1)  # GPT-2 small, float32: 72 KiB a token
    73728
    >>> kv_cache_bytes(preset("gpt2"), 1024, dtype=torch.float16) / 2**20  # the whole context, half precision
    36.0
    """
    for name, value in (("n_tokens", n_tokens), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (torch.float32, torch.bfloat16, ...), got {dtype!r}")
    bytes_per_number = torch.empty((), dtype=dtype).element_size()
    # A local layer keeps at most sliding_window - 1 positions (RingKVCache), a global one all of them. (getattr: the
    # checkers pass any object with the shape fields.)
    window = getattr(cfg, "sliding_window", None)
    held = sum(min(n_tokens, window - 1) if window is not None and cfg.is_local(layer) else n_tokens
               for layer in range(cfg.n_layers))
    return 2 * cfg.n_kv_heads * cfg.d_head * bytes_per_number * held * batch


def _check_crop(length: object, held: int) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= held:
        raise ValueError(f"crop keeps the first length positions: length must be an int in 0..{held} (the positions "
                         f"held), got {length!r}")


class LayerKVCache:
    """One attention layer's keys and values, preallocated ``(batch, n_kv_heads, capacity, d_head)``.

    ``length`` positions are filled (0 at first). ``append(k, v)`` writes the new positions' keys and
    values after them, in place, and returns views of everything held: the new query attends to the
    cached keys and to its own key, once. The layout is the one attention computes in (heads before
    positions), so nothing is transposed per step. ``d_value`` lets a variant keep values of another
    width (the same as ``d_head`` for ordinary attention).

    >>> layer = LayerKVCache(batch=1, n_kv_heads=2, capacity=4, d_head=3)
    >>> keys, values = layer.append(torch.ones(1, 2, 3, 3), torch.ones(1, 2, 3, 3))  # 3 positions
    >>> keys, values = layer.append(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))  # one more
    >>> keys.shape, layer.length
    (torch.Size([1, 2, 4, 3]), 4)
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        capacity: int,
        d_head: int,
        *,
        d_value: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (("batch", batch), ("n_kv_heads", n_kv_heads), ("capacity", capacity), ("d_head", d_head)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        d_value = d_head if d_value is None else d_value
        self.keys = torch.zeros(batch, n_kv_heads, capacity, d_head, dtype=dtype, device=device)
        self.values = torch.zeros(batch, n_kv_heads, capacity, d_value, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held: the whole preallocated capacity, filled or not."""
        return self.keys.nbytes + self.values.nbytes

    def append(
        self, k: Float[Tensor, "batch n_kv_heads new_pos d_head"], v: Float[Tensor, "batch n_kv_heads new_pos d_value"]
    ) -> tuple[Float[Tensor, "batch n_kv_heads key_pos d_head"], Float[Tensor, "batch n_kv_heads key_pos d_value"]]:
        """Write ``k``, ``v`` after the ``length`` positions held; return all ``length + new_pos`` of them."""
        start, n_new = self.length, k.shape[-2] if k.dim() == 4 else -1
        batch, n_kv_heads, capacity, d_head = self.keys.shape
        expected = (batch, n_kv_heads, n_new, d_head)
        if k.dim() != 4 or tuple(k.shape) != expected or v.shape[:3] != k.shape[:3] or v.shape[3] != self.values.shape[3]:
            raise ValueError(
                f"the cache holds keys and values as (batch, n_kv_heads, pos, d_head) = ({batch}, {n_kv_heads}, pos, "
                f"{d_head}); got k {tuple(k.shape)} and v {tuple(v.shape)} (split the heads first, heads before positions)"
            )
        if start + n_new > capacity:
            raise ValueError(
                f"KV cache full: it holds {start} of its {capacity} positions and {n_new} more were appended. "
                "A cache cannot slide its window and match the uncached model (past the first block, cached keys saw the "
                "tokens a crop drops): start a fresh one from the last tokens instead"
            )
        self.keys[:, :, start:start + n_new] = k
        self.values[:, :, start:start + n_new] = v
        self.length = start + n_new
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]

    def reorder(self, rows: Int[Tensor, "batch"]) -> None:
        """Keep, in row i, what row ``rows[i]`` held (beam search follows each beam's parent)."""
        held = slice(0, self.length)
        self.keys[:, :, held] = self.keys[rows, :, held]
        self.values[:, :, held] = self.values[rows, :, held]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions, forget the rest (speculative decoding drops rejected draft tokens)."""
        _check_crop(length, self.length)
        self.length = length

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self.length = 0


class RingKVCache:
    """A local layer's keys and values: a ring of ``window - 1`` slots ``(batch, n_kv_heads, window - 1, d_head)``.

    In sliding-window attention a query sees itself and the ``window - 1`` positions before it
    (``tfedu.layers.sliding_window_mask``; Jiang et al. 2023, sec. 2, Mistral's "rolling buffer cache"), so
    a new token never needs anything older than the last ``window - 1`` keys: position p lives in slot
    ``p % (window - 1)`` and overwrites the key that fell out of every future window. ``append(k, v)``
    returns the kept keys oldest first followed by the new ones (at most ``window - 1 + new_pos``), so the
    caller's mask columns line up with them; the attention applies the window mask when more than
    ``window`` keys come back (a prompt of several tokens). ``length`` counts every position seen;
    ``capacity`` is the positions the model may run in all (its ``n_ctx``), not the slots.

    >>> ring = RingKVCache(batch=1, n_kv_heads=1, window=3, d_head=1, capacity=16)
    >>> for p in range(5):
    ...     keys, _ = ring.append(torch.full((1, 1, 1, 1), float(p)), torch.zeros(1, 1, 1, 1))
    >>> keys.flatten().tolist(), ring.length, ring.slots  # position 4 sees 2, 3 and itself
    ([2.0, 3.0, 4.0], 5, 2)
    """

    def __init__(self, batch: int, n_kv_heads: int, window: int, d_head: int, *, capacity: int,
                 d_value: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        for name, value in (("batch", batch), ("n_kv_heads", n_kv_heads), ("window", window), ("d_head", d_head),
                            ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        d_value = d_head if d_value is None else d_value
        self.window = window
        self.keys = torch.zeros(batch, n_kv_heads, window - 1, d_head, dtype=dtype, device=device)
        self.values = torch.zeros(batch, n_kv_heads, window - 1, d_value, dtype=dtype, device=device)
        self._capacity = capacity
        self.length = 0

    @property
    def slots(self) -> int:
        """Positions the ring keeps: ``window - 1`` (a new query adds its own key)."""
        return self.keys.shape[2]

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def nbytes(self) -> int:
        """Bytes held: the ring's slots, whatever ``length`` is."""
        return self.keys.nbytes + self.values.nbytes

    def _held(self) -> Tensor:
        """The slots of the kept positions, oldest first."""
        held = min(self.length, self.slots)
        return torch.arange(self.length - held, self.length, device=self.keys.device) % max(self.slots, 1)

    def append(
        self, k: Float[Tensor, "batch n_kv_heads new_pos d_head"], v: Float[Tensor, "batch n_kv_heads new_pos d_value"]
    ) -> tuple[Float[Tensor, "batch n_kv_heads key_pos d_head"], Float[Tensor, "batch n_kv_heads key_pos d_value"]]:
        """The kept keys and values (oldest first) then ``k``, ``v``; the newest ``window - 1`` go into the ring."""
        batch, n_kv_heads, _, d_head = self.keys.shape
        if k.dim() != 4 or k.shape[:2] != (batch, n_kv_heads) or k.shape[3] != d_head or v.shape[:3] != k.shape[:3] \
                or v.shape[3] != self.values.shape[3]:
            raise ValueError(
                f"the cache holds keys and values as (batch, n_kv_heads, pos, d_head) = ({batch}, {n_kv_heads}, pos, "
                f"{d_head}); got k {tuple(k.shape)} and v {tuple(v.shape)} (split the heads first, heads before positions)"
            )
        held = self._held()
        keys = torch.cat([self.keys[:, :, held], k], dim=2)  # batch n_kv_heads held+new_pos d_head
        values = torch.cat([self.values[:, :, held], v], dim=2)
        n_new, n_write = k.shape[2], min(k.shape[2], self.slots)
        if n_write:
            slots = torch.arange(self.length + n_new - n_write, self.length + n_new, device=k.device) % self.slots
            self.keys[:, :, slots] = k[:, :, n_new - n_write:]
            self.values[:, :, slots] = v[:, :, n_new - n_write:]
        self.length += n_new
        return keys, values

    def reorder(self, rows: Int[Tensor, "batch"]) -> None:
        """Keep, in row i, what row ``rows[i]`` held (beam search follows each beam's parent)."""
        self.keys[:] = self.keys[rows]
        self.values[:] = self.values[rows]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions, while the ring still holds the keys they need, else a clear error.

        Position p overwrote the slot of position p - slots, so once more than ``slots`` positions went
        in, the keys a cropped sequence would need again are gone.
        """
        _check_crop(length, self.length)
        if length < self.length and self.length > self.slots:
            raise ValueError(
                f"a ring cache cannot roll back from {self.length} to {length} positions: it keeps only the last "
                f"{self.slots} (the keys before them were overwritten). Use a model without sliding-window layers, "
                "or run the context again from a fresh cache"
            )
        self.length = length

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self.length = 0


class KVCache:
    """A model's KV cache: one ``LayerKVCache`` per block, all filled to the same ``length``.

    Make one with ``KVCache.for_model(model, batch)`` and pass it to the model:
    ``model(ids, kv_cache=cache)`` reads the new tokens at positions ``cache.length ..``, appends
    their keys and values in every layer and returns logits for the new positions only.
    ``capacity`` (default and at most ``n_ctx``) is how many positions it can hold.

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> model = GPT(preset("tiny").replace(n_kv_heads=1))  # multi-query: one key/value head
    >>> cache = KVCache.for_model(model, batch=2, capacity=16)
    >>> len(cache.layers), tuple(cache.layers[0].keys.shape), cache.nbytes  # 2 layers * (k, v) * 2*1*16*16 numbers * 4 bytes
    (2, (2, 1, 16, 16), 8192)
    """

    def __init__(self, layers: Sequence[LayerKVCache]) -> None:
        layers = list(layers)
        if not layers or not all(isinstance(layer, (LayerKVCache, RingKVCache)) for layer in layers):
            raise TypeError("a KVCache is made of LayerKVCache (or RingKVCache) objects, one per block: "
                            "use KVCache.for_model(model, batch)")
        shapes = {(layer.keys.shape[0], layer.capacity) for layer in layers}
        if len(shapes) != 1:
            raise ValueError(f"every layer's cache needs the same (batch, capacity), got {sorted(shapes)}")
        self.layers = layers

    @classmethod
    def for_model(cls, model: nn.Module, batch: int, *, capacity: int | None = None) -> KVCache:
        """An empty cache for ``model`` (a causal tfedu model, e.g. ``GPT``) in its dtype and on its device.

        Each block's attention makes its own layer (``Attention.new_kv_cache``), so an attention variant
        with another cache layout only has to override that.
        """
        if not getattr(model, "supports_kv_cache", False):
            cfg = getattr(model, "cfg", None)
            if getattr(cfg, "has_recurrent_layers", False):
                raise TypeError(f"this GPT has recurrent layers (layer_types {cfg.layer_types}): they carry a state, not "
                                "keys and values, so it keeps no KV cache (tfedu.generate decodes it without one)")
            raise TypeError(
                f"{type(model).__name__} cannot keep a KV cache: only a causal decoder (tfedu.model.GPT) can, since "
                "there no earlier position changes when a token is added"
            )
        n_ctx = model.cfg.n_ctx
        capacity = n_ctx if capacity is None else capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= n_ctx:
            raise ValueError(f"capacity must be an int in 1..n_ctx={n_ctx} (positions the cache can hold), got {capacity!r}")
        weight = model.embed.weight
        return cls([block.attn.new_kv_cache(batch, capacity, dtype=weight.dtype, device=weight.device)
                    for block in model.blocks])

    @property
    def length(self) -> int:
        """Positions held (the same in every layer after a forward pass)."""
        return self.layers[0].length

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    @property
    def batch(self) -> int:
        return self.layers[0].keys.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's keys and values (preallocated: the whole capacity; a ring: its slots)."""
        return sum(layer.nbytes for layer in self.layers)

    def check_room(self, n_new: int, n_ctx: int) -> int:
        """``length`` when ``n_new`` more positions fit, else a clear error; called before a forward pass."""
        start = self.length
        if start + n_new > self.capacity:
            limit = f"n_ctx={n_ctx}" if self.capacity == n_ctx else f"its capacity={self.capacity} (n_ctx={n_ctx})"
            raise ValueError(
                f"KV cache overflow: {n_new} new token(s) after the {start} already cached make {start + n_new} "
                f"positions, more than {limit}. A cache cannot slide its window and match the uncached model (past "
                f"the first block, cached keys saw the tokens a crop drops): start again with the last tokens, e.g. cache.reset(); "
                f"model(ids[:, -{n_ctx}:], kv_cache=cache)"
            )
        return start

    def reorder(self, rows: Int[Tensor, "batch"]) -> None:
        """Row i of every layer takes what row ``rows[i]`` held (beam search: each beam's parent)."""
        for layer in self.layers:
            layer.reorder(rows)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions in every layer (speculative decoding: drop the rejected draft tokens).

        The keys and values of positions ``0..length-1`` depend on those tokens only (causal), so what
        stays is exactly what a cache filled with them alone would hold.

        >>> from tfedu.config import preset
        >>> from tfedu.model import GPT
        >>> _ = torch.manual_seed(0); model = GPT(preset("tiny")).eval()
        >>> cache = KVCache.for_model(model, batch=1)
        >>> _ = model(torch.tensor([[1, 2, 3, 4]]), kv_cache=cache)
        >>> cache.crop(2); cache.length  # 3 and 4 forgotten: the next token goes at position 2
        2
        """
        for layer in self.layers:
            layer.crop(length)

    def reset(self) -> None:
        """Empty every layer (the memory stays allocated)."""
        for layer in self.layers:
            layer.reset()

    def __repr__(self) -> str:
        return (f"KVCache(layers={len(self.layers)}, batch={self.batch}, length={self.length}, "
                f"capacity={self.capacity}, nbytes={self.nbytes})")


# ----------------------------------------------------------------------------- one step, by hand


def decode_step(
    q: Float[Tensor, "batch n_heads 1 d_head"],
    k_new: Float[Tensor, "batch n_heads 1 d_head"],
    v_new: Float[Tensor, "batch n_heads 1 d_head"],
    k_cache: Float[Tensor, "batch n_heads pos d_head"],
    v_cache: Float[Tensor, "batch n_heads pos d_head"],
) -> tuple[Float[Tensor, "batch n_heads 1 d_head"], Float[Tensor, "batch n_heads pos_1 d_head"],
           Float[Tensor, "batch n_heads pos_1 d_head"]]:
    """One decoding step of attention: append the new key and value, then attend over all of them.

    ``q``, ``k_new``, ``v_new`` belong to the one new token; ``k_cache``, ``v_cache`` hold the ``pos``
    tokens before it (``pos`` may be 0), heads before positions. Returns the new token's attention
    output and the caches grown to ``pos + 1`` positions: new tensors, the inputs are not changed.
    The new query attends to every cached key and to its own key, each once; no mask is needed,
    since nothing in the cache lies in its future. (``LayerKVCache.append`` does the same append in
    place, into preallocated memory.)

    >>> q = k = v = torch.ones(1, 1, 1, 2)
    >>> z, k_cache, v_cache = decode_step(q, k, v, torch.zeros(1, 1, 0, 2), torch.zeros(1, 1, 0, 2))
    >>> z.shape, k_cache.shape  # the first step: the token attends to itself alone
    (torch.Size([1, 1, 1, 2]), torch.Size([1, 1, 1, 2]))
    """
    k_cache = torch.cat([k_cache, k_new], dim=2)  # batch n_heads pos+1 d_head
    v_cache = torch.cat([v_cache, v_new], dim=2)
    scores = q @ k_cache.transpose(-2, -1) / q.shape[-1] ** 0.5  # batch n_heads 1 pos+1
    return scores.softmax(dim=-1) @ v_cache, k_cache, v_cache


DecodeStep = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]


def _by_hand_supported(model: nn.Module) -> None:
    cfg = getattr(model, "cfg", None)
    if not getattr(model, "supports_kv_cache", False) or cfg is None:
        raise TypeError(f"greedy_by_hand decodes a causal tfedu GPT, got {type(model).__name__}")
    unsupported = []
    if cfg.norm_position != "pre":
        unsupported.append(f"norm_position={cfg.norm_position!r}")
    if cfg.positional == "alibi":
        unsupported.append("positional='alibi'")
    if cfg.n_kv_heads != cfg.n_heads:
        unsupported.append(f"n_kv_heads={cfg.n_kv_heads} (grouped heads)")
    for name in ("qk_norm", "sliding_window", "rope_local_base", "attn_logit_softcap", "final_logit_softcap",
                 "scale_embeddings", "sandwich_norm", "query_pre_attn_scalar"):
        if getattr(cfg, name) not in (None, False):
            unsupported.append(f"{name}={getattr(cfg, name)!r}")
    if unsupported:
        raise ValueError("greedy_by_hand writes out a pre-norm GPT-2/Llama-style model with one key/value head per "
                         f"query head and no ALiBi; this one has {', '.join(unsupported)}: use tfedu.generate.generate")


def greedy_by_hand(
    model: nn.Module, ids: Int[Tensor, "batch pos"], max_new_tokens: int, step: DecodeStep = decode_step
) -> Int[Tensor, "batch pos_out"]:
    """Greedy decoding with a KV cache written out block by block, attention done by ``step``.

    The same tokens as ``tfedu.generate.generate(model, ids, max_new_tokens)`` (tested), but every
    part is visible: the prompt goes through ``step`` one token at a time, and then each new
    token. Per block: ``ln1``; the new token's query, key and value (RoPE at its position when the
    model uses it); ``step`` appends to that block's cache and attends; ``W_O``; the residual; the
    MLP. ``step`` defaults to ``decode_step``; notebook 10 passes the learner's. The context must fit
    (``pos + max_new_tokens - 1 <= n_ctx``): this loop does not start again past it.
    """
    _by_hand_supported(model)
    check_ids(ids, model.cfg)
    total = ids.shape[1] + max_new_tokens - 1
    if max_new_tokens > 0 and total > model.cfg.n_ctx:
        raise ValueError(f"{ids.shape[1]} prompt tokens + {max_new_tokens} new ones need {total} positions, more than "
                         f"n_ctx={model.cfg.n_ctx}: greedy_by_hand keeps one cache and never crops")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            caches = [None] * len(model.blocks)
            out, logits = ids, None
            for pos in range(total):
                token = out[:, pos:pos + 1]  # batch 1
                resid = model.embed_tokens(token, start=pos)  # batch 1 d_model
                for i, block in enumerate(model.blocks):
                    attn, x = block.attn, block.ln1(resid)
                    q, k, v = (attn.split_heads(W(x)) for W in (attn.W_Q, attn.W_K, attn.W_V))  # batch n_heads 1 d_head
                    if attn.rope_base is not None:
                        where = torch.tensor([pos], device=ids.device)
                        q = apply_rope(q, where, base=attn.rope_base, layout=attn.rope_layout)
                        k = apply_rope(k, where, base=attn.rope_base, layout=attn.rope_layout)
                    if caches[i] is None:
                        empty = k.new_zeros(*k.shape[:2], 0, k.shape[-1])
                        caches[i] = (empty, empty.clone())
                    z, *caches[i] = step(q, k, v, *caches[i])
                    resid = resid + attn.W_O(attn.merge_heads(z))
                    if block.cfg.has_mlp:  # d_mlp=0: attention-only
                        resid = resid + block.mlp(block.ln2(resid))
                logits = model.unembed(model.ln_final(resid))[:, -1]  # batch d_vocab
                if pos + 1 >= ids.shape[1]:  # past the prompt: the prediction is the next token
                    out = torch.cat([out, logits.argmax(dim=-1, keepdim=True)], dim=1)
            return out
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------- fewer key/value heads


def pool_kv_weight(weight: Float[Tensor, "n_heads_d_head *rest"], n_heads: int, n_kv_heads: int
                   ) -> Float[Tensor, "n_kv_heads_d_head *rest"]:
    """A key or value projection's weight (or bias) with its ``n_heads`` heads averaged in groups down to ``n_kv_heads``.

    The first axis holds the heads one after another, ``n_heads * d_head`` rows (``nn.Linear``'s
    ``(out, in)`` weight, or its bias). Head j of the result is the mean of heads j*g .. j*g + g - 1,
    g = n_heads / n_kv_heads: consecutive heads, the ones ``repeat_interleave`` will give it to serve.

    >>> w = torch.arange(4.0)[:, None].repeat(1, 3)  # 4 heads of width 1, rows 0, 1, 2, 3
    >>> pool_kv_weight(w, 4, 2)[:, 0]  # heads (0, 1) and (2, 3)
    tensor([0.5000, 2.5000])
    """
    if weight.dim() < 1 or n_kv_heads < 1 or n_heads % n_kv_heads or weight.shape[0] % n_heads:
        raise ValueError(f"weight must have a first axis of n_heads * d_head rows and n_kv_heads must divide n_heads; "
                         f"got shape {tuple(weight.shape)}, n_heads={n_heads}, n_kv_heads={n_kv_heads}")
    d_head = weight.shape[0] // n_heads
    heads = weight.unflatten(0, (n_kv_heads, n_heads // n_kv_heads, d_head))  # n_kv_heads group d_head *rest
    return heads.mean(dim=1).flatten(0, 1)


def pool_kv_heads(model: nn.Module, n_kv_heads: int, *, pool: Callable[[Tensor, int, int], Tensor] = pool_kv_weight
                  ) -> nn.Module:
    """A copy of ``model`` with ``n_kv_heads`` key/value heads, each the mean of a group of the old ones.

    Grouped-query attention (Ainslie et al. 2023, sec. 2.1) converts a multi-head checkpoint this
    way: key head j becomes the mean of the key heads j*g .. j*g + g - 1 (g = old n_kv_heads /
    n_kv_heads), which are the query heads it will serve (``Attention``'s ``repeat_interleave``);
    values alike (``pool_kv_weight``; ``pool`` swaps in another). Queries, outputs and everything
    else are copied. The paper then trains the converted model a little ("uptraining", 5% of the
    original steps) to recover. The original is not changed.

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> mqa = pool_kv_heads(GPT(preset("tiny")), 1)  # multi-query: one key/value head
    >>> mqa.cfg.n_kv_heads, tuple(mqa.blocks[0].attn.W_K.weight.shape)
    (1, (16, 64))
    """
    cfg = model.cfg
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads < 1 or cfg.n_kv_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads must be a positive int dividing the model's n_kv_heads={cfg.n_kv_heads}, "
                         f"got {n_kv_heads!r}")
    pooled = type(model)(cfg.replace(n_kv_heads=n_kv_heads)).to(model.embed.weight)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    for name, tensor in state.items():
        if ".attn.W_K." in name or ".attn.W_V." in name:  # weight (heads*d_head, d_model) or bias (heads*d_head,)
            state[name] = pool(tensor, cfg.n_kv_heads, n_kv_heads)
    pooled.load_state_dict(state)
    pooled.train(model.training)
    return pooled
