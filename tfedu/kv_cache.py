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
- ``KVCache``: one ``LayerKVCache`` per block (``KVCache.for_model``); ``model(ids, kv_cache=cache)``
  appends the new tokens to every layer. ``reorder`` picks rows (beam search), ``reset`` empties it.
- ``kv_cache_bytes``: the formula above, to set against ``KVCache.nbytes``.

A cache cannot slide its window past ``n_ctx``: every position's vector (learned, sinusoidal) or
rotation (RoPE) would change, so the keys held would all be wrong. Overflowing it is an error;
``tfedu.generate.generate`` starts again from the last n_ctx tokens instead.

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

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float, Int
from torch import Tensor

if TYPE_CHECKING:
    from torch import nn

    from tfedu.config import ModelConfig


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
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.d_head * bytes_per_number * n_tokens * batch


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
                "A cache cannot slide its window (every cached key would need new positions): start a fresh one "
                "from the last tokens instead"
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
        if not layers or not all(isinstance(layer, LayerKVCache) for layer in layers):
            raise TypeError("a KVCache is made of LayerKVCache objects, one per block: use KVCache.for_model(model, batch)")
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
        """Bytes held by every layer's keys and values (preallocated: the whole capacity)."""
        return sum(layer.nbytes for layer in self.layers)

    def check_room(self, n_new: int, n_ctx: int) -> int:
        """``length`` when ``n_new`` more positions fit, else a clear error; called before a forward pass."""
        start = self.length
        if start + n_new > self.capacity:
            limit = f"n_ctx={n_ctx}" if self.capacity == n_ctx else f"its capacity={self.capacity} (n_ctx={n_ctx})"
            raise ValueError(
                f"KV cache overflow: {n_new} new token(s) after the {start} already cached make {start + n_new} "
                f"positions, more than {limit}. A cache cannot slide its window (every position's vector or "
                f"rotation would change): start again with the last tokens, e.g. cache.reset(); "
                f"model(ids[:, -{n_ctx}:], kv_cache=cache)"
            )
        return start

    def reorder(self, rows: Int[Tensor, "batch"]) -> None:
        """Row i of every layer takes what row ``rows[i]`` held (beam search: each beam's parent)."""
        for layer in self.layers:
            layer.reorder(rows)

    def reset(self) -> None:
        """Empty every layer (the memory stays allocated)."""
        for layer in self.layers:
            layer.reset()

    def __repr__(self) -> str:
        return (f"KVCache(layers={len(self.layers)}, batch={self.batch}, length={self.length}, "
                f"capacity={self.capacity}, nbytes={self.nbytes})")
