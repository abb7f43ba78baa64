"""The course's Transformers, built from ``tfedu.layers.Block``: ``GPT``, ``Encoder`` and ``EncoderDecoder``.

One ``ModelConfig`` (``tfedu.config``) describes them all; they differ only in their masks and
their heads (Vaswani et al. 2017, fig. 1; Radford et al. 2019; Devlin et al. 2019):

- ``GPT``: decoder-only. Every position attends to itself and earlier positions (the causal
  mask) and predicts the next token: ``forward(ids, targets)`` returns the logits and, with
  targets, the mean cross-entropy.
- ``Encoder``: the same stack without the causal mask, every position sees the whole sequence;
  its head predicts the tokens hidden by ``mask_tokens`` (BERT's masked-language-model task).
- ``EncoderDecoder``: an encoder over the source and a decoder over the target whose blocks add
  cross-attention to the encoder's output (the original Transformer).

Every model has the same parts, named as in TransformerLens: ``embed`` (an ``nn.Embedding``,
the matrix ``W_E``), ``pos_embed`` (learned or sinusoidal positions; RoPE and ALiBi act inside
attention instead), ``blocks``, ``ln_final`` (pre-norm models only), ``unembed`` (an
``nn.Linear`` whose weight is ``W_E`` itself when ``cfg.tied_embeddings``), and hook points
``hook_embed``, ``hook_pos_embed`` plus those of every block. ``run_with_cache`` records them all.

Later notebooks extend these classes rather than write new ones: a KV cache (``forward(ids,
kv_cache=...)``, ``tfedu.kv_cache``, notebooks/10), grouped key/value heads (``cfg.n_kv_heads``),
a mixture of experts in place of ``Block.mlp``, LoRA adapters on the ``nn.Linear`` layers, the
logit lens on the hook points.

>>> from tfedu.config import preset
>>> model = GPT(preset("tiny"))  # 2 blocks, d_model 64, a byte vocabulary of 256
>>> ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
>>> logits, loss = model(ids[:, :-1], targets=ids[:, 1:])  # predict each next token
>>> logits.shape, abs(loss.item() - math.log(256)) < 0.2  # at initialisation: about ln(d_vocab)
(torch.Size([2, 10, 256]), True)

Built by hand in notebooks/07_transformer_block.ipynb.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from tfedu.config import ModelConfig
from tfedu.inputs import check_ids
from tfedu.kv_cache import KVCache
from tfedu.layers import Block, dropout, make_norm
from tfedu.moe import MoE
from tfedu.positional import LearnedPositions, alibi_bias, sinusoidal
from tfedu.recurrences import MambaLayer

IGNORE_INDEX = -100  # target value that the loss skips (padding, unmasked MLM positions), as in F.cross_entropy


# ----------------------------------------------------------------------------- input checks


def _check_targets(targets: object, ids: Tensor, cfg: ModelConfig) -> None:
    if (not isinstance(targets, Tensor) or targets.shape != ids.shape or targets.is_floating_point()
            or targets.is_complex() or targets.dtype == torch.bool):
        got = f"{targets.dtype} {tuple(targets.shape)}" if isinstance(targets, Tensor) else type(targets).__name__
        raise ValueError(
            f"targets must be an integer tensor shaped like the ids {tuple(ids.shape)} "
            f"(the next token at each position, or {IGNORE_INDEX} to skip one), got {got}"
        )
    valid = (targets == IGNORE_INDEX) | ((targets >= 0) & (targets < cfg.d_vocab))
    if not bool(valid.all()):
        raise IndexError(f"targets must lie in 0..{cfg.d_vocab - 1} or be {IGNORE_INDEX} (skipped)")


def _check_padding(padding_mask: object, ids: Tensor, name: str, *, cached: int = 0) -> None:
    """``padding_mask`` must be None or bool of shape (batch, cached + pos): the cached positions' and the ids'."""
    if padding_mask is None:
        return
    shape = (ids.shape[0], cached + ids.shape[1])
    if not isinstance(padding_mask, Tensor) or padding_mask.dtype != torch.bool or tuple(padding_mask.shape) != shape:
        got = f"{padding_mask.dtype} {tuple(padding_mask.shape)}" if isinstance(padding_mask, Tensor) else type(padding_mask).__name__
        like = (f"(batch, cached + pos) = {shape}: the {cached} positions the KV cache holds, then the ids'" if cached
                else f"shaped like the ids {tuple(ids.shape)}")
        raise ValueError(f"{name} must be a bool tensor {like}, True = real token; got {got}")


def _check_positions(positions: object, ids: Tensor, cfg: ModelConfig) -> None:
    if positions is None:
        return
    if (not isinstance(positions, Tensor) or positions.shape != ids.shape or positions.is_floating_point()
            or positions.is_complex() or positions.dtype == torch.bool):
        got = f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, Tensor) else type(positions).__name__
        raise ValueError(f"positions must be an integer tensor shaped like the ids {tuple(ids.shape)}, each token's "
                         f"position (for left padding: (padding_mask.cumsum(1) - 1).clamp(min=0)); got {got}")
    if positions.numel():
        low, high = (int(value) for value in torch.aminmax(positions))
        if low < 0 or high >= cfg.n_ctx:
            raise ValueError(f"positions must lie in 0..{cfg.n_ctx - 1} (n_ctx={cfg.n_ctx}), got values from {low} to {high}")


def soft_cap(x: Tensor, cap: float | None) -> Tensor:
    """``cap * tanh(x / cap)``: x squashed smoothly into (-cap, cap), nearly unchanged where ``|x| << cap``; ``x`` if None.

    Gemma 2 caps the final logits at 30 and the attention scores at 50 (Team Gemma 2024, sec. 2; the idea is
    Bello et al. 2017's), so that no logit can run away during training.

    >>> soft_cap(torch.tensor([0.1, 100.0]), 30.0)
    tensor([ 0.1000, 29.9237])
    """
    if cap is None:
        return x
    return cap * torch.tanh(x / cap)


def next_token_loss(logits: Float[Tensor, "batch pos d_vocab"], targets: Int[Tensor, "batch pos"]) -> Tensor:
    """Mean cross-entropy over the positions whose target is not ``IGNORE_INDEX`` (in float32)."""
    # .long(): cross_entropy takes only int64 class indices, but int32 ids are fine everywhere else.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten().long(), ignore_index=IGNORE_INDEX)


# ----------------------------------------------------------------------------- shared parts


class SinusoidalPositions(nn.Module):
    """The fixed sin/cos table of Vaswani et al. (2017, sec. 3.5), a buffer (no parameters)."""

    def __init__(self, n_ctx: int, d_model: int) -> None:
        super().__init__()
        self.register_buffer("table", sinusoidal(n_ctx, d_model), persistent=False)

    def forward(self, positions: Int[Tensor, "pos"]) -> Float[Tensor, "pos d_model"]:
        return self.table[positions]


class Transformer(nn.Module):
    """What every tfedu model has: token embedding, positions, dropout, unembedding and initialisation.

    Subclasses add the blocks and ``forward``. Not used on its own.
    """

    embed_scale = 1.0  # the 2017 paper multiplies the embeddings by sqrt(d_model); GPT-2 does not

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"expected a tfedu.config.ModelConfig, got {type(cfg).__name__}")
        if cfg.has_recurrent_layers and getattr(self, "causal", None) is not True:
            raise ValueError(f"layer_types {cfg.layer_types} has recurrent layers, which run forward only: they make "
                             f"a causal decoder (GPT), not a {type(self).__name__}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        if cfg.positional == "learned":
            self.pos_embed = LearnedPositions(cfg.n_ctx, cfg.d_model)
        elif cfg.positional == "sinusoidal":
            self.pos_embed = SinusoidalPositions(cfg.n_ctx, cfg.d_model)
        else:
            self.pos_embed = None  # rope / alibi act inside attention; none is the causal mask alone
        self.hook_embed = nn.Identity()
        self.hook_pos_embed = nn.Identity()
        self.drop = nn.Dropout(cfg.dropout)
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab, bias=False)

    def default_init_std(self) -> float:
        """The weights' initial std when ``cfg.init_std`` is None: GPT-2's 0.02 (BERT uses the same)."""
        return 0.02

    def _finish_init(self) -> None:
        """GPT-2's initialisation (Radford et al. 2019, sec. 2.3), then tie W_U to W_E if asked."""
        std = self.default_init_std() if self.cfg.init_std is None else self.cfg.init_std
        n_residual_layers = sum(2 + hasattr(block, "cross_attn") for block in self.modules() if isinstance(block, Block))
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, MoE):  # stacked expert weights: each expert as GPT-2 initialises an MLP
                module.reset_parameters(std, out_std=std / math.sqrt(n_residual_layers))
        for name, param in self.named_parameters():
            # Each sub-layer adds to the residual stream; scaling the layers that write to it by
            # 1/sqrt(number of writes) keeps the stream's variance from growing with depth.
            # (attn.out_proj: the output of a Mamba or Gated DeltaNet layer in attention's place, cfg.layer_types)
            if name.endswith(("attn.W_O.weight", "mlp.W_out.weight", "attn.out_proj.weight")):
                nn.init.normal_(param, mean=0.0, std=std / math.sqrt(n_residual_layers))
        for module in self.modules():
            if isinstance(module, MambaLayer):  # the loop above zeroed dt_proj's bias: Mamba's initial steps again
                module.reset_dt_bias()
        if self.cfg.tied_embeddings:
            self.unembed.weight = self.embed.weight  # one Parameter: W_U = W_E^T

    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        """The token embedding matrix."""
        return self.embed.weight

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        """The unembedding matrix (``W_E.T`` when tied): logits = resid @ W_U."""
        return self.unembed.weight.T

    @property
    def supports_kv_cache(self) -> bool:
        """Whether ``forward`` takes ``kv_cache=``: only a causal decoder (``GPT``) can keep one."""
        return False

    def embed_tokens(
        self, ids: Int[Tensor, "batch pos"], name: str = "ids", *, embed: nn.Embedding | None = None,
        hook: nn.Module | None = None, start: int = 0, positions: Int[Tensor, "batch pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """Token embeddings (times ``embed_scale``) plus the position vectors: the residual stream's start.

        ``embed`` and ``hook`` default to ``self.embed`` and ``self.hook_embed`` (the encoder-decoder
        passes its target table and ``hook_tgt_embed``). The tokens sit at positions ``start,
        start + 1, ...`` (``start`` > 0 after the positions a KV cache holds), or at ``positions``,
        one per token (left-padded rows start later: ``tfedu.generate``).
        """
        check_ids(ids, self.cfg, name, cached=start)
        _check_positions(positions, ids, self.cfg)
        embed, hook = embed or self.embed, hook or self.hook_embed
        scale = self.embed_scale
        if self.cfg.scale_embeddings:
            # Gemma: sqrt(d_model) rounded to the weights' dtype first, as HF's Gemma3TextScaledWordEmbedding does
            # (in bfloat16, sqrt(640) = 25.298 becomes 25.25).
            scale = torch.tensor(math.sqrt(self.cfg.d_model), dtype=embed.weight.dtype, device=embed.weight.device)
        resid = hook(embed(ids) * scale)  # batch pos d_model
        if self.pos_embed is not None:
            if positions is None:
                positions = torch.arange(start, start + ids.shape[1], device=ids.device)
            resid = resid + self.hook_pos_embed(self.pos_embed(positions))  # (batch) pos d_model
        return dropout(self.drop, resid)

    def attention_bias(self, n_query: int, n_key: int, like: Tensor) -> Tensor | None:
        """ALiBi's bias for ``cfg.positional == "alibi"``, else None.

        The queries are the last ``n_query`` of the ``n_key`` positions (the newest tokens after a KV cache).
        """
        if self.cfg.positional != "alibi":
            return None
        return alibi_bias(self.cfg.n_heads, n_query, n_key, dtype=like.dtype, device=like.device)

    def run_blocks(
        self,
        blocks: nn.ModuleList,
        resid: Float[Tensor, "batch pos d_model"],
        *,
        causal: bool,
        padding_mask: Bool[Tensor, "batch pos"] | None = None,
        context: Tensor | None = None,
        context_padding_mask: Bool[Tensor, "batch key_pos"] | None = None,
        kv_cache: KVCache | None = None,
        positions: Int[Tensor, "batch pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """Run ``blocks`` over the stream; padded keys are hidden from every real query.

        With ``kv_cache`` the stream holds the new positions only: they sit after the ``kv_cache.length``
        positions cached, and block i appends their keys and values to ``kv_cache.layers[i]``; a
        ``padding_mask`` then covers the cached positions and the new ones. ``positions`` (one per
        token) reach RoPE; by default the tokens sit at ``start, start + 1, ...``. ALiBi measures the
        distance between columns, which is the distance between positions for left-padded rows.
        """
        n = resid.shape[1]
        start = 0 if kv_cache is None else kv_cache.length
        if padding_mask is None:
            mask = None
        elif causal:
            # A padded query sees the padded keys too, so that no softmax row is empty (left padding puts the
            # padded queries before every real key); what it computes is never read. Real queries see real keys.
            query_real = padding_mask[:, -n:]  # batch query_pos
            mask = padding_mask[:, None, None, :] | ~query_real[:, None, :, None]  # batch 1 query_pos key_pos
        else:
            mask = padding_mask[:, None, None, :]  # batch 1 1 key_pos
        context_mask = None if context_padding_mask is None else context_padding_mask[:, None, None, :]
        if positions is None:
            positions = torch.arange(start, start + n, device=resid.device)
        else:
            positions = positions[:, None, :]  # batch 1 pos: one row of positions per sequence, for every head
        bias = self.attention_bias(n, start + n, resid)
        layer_caches = [None] * len(blocks) if kv_cache is None else kv_cache.layers
        for block, layer_cache in zip(blocks, layer_caches, strict=True):
            # kv_cache only when there is one: a block written before notebook 10 (a learner's, in
            # notebook 07's switch) need not know the argument.
            cached = {} if layer_cache is None else {"kv_cache": layer_cache}
            resid = block(resid, mask, causal=causal, positions=positions, attn_bias=bias,
                          context=context, context_mask=context_mask, **cached)
        return resid

    def hook_points(self) -> dict[str, nn.Module]:
        """Every hook point by its dotted name, e.g. ``"blocks.0.hook_resid_post"``, ``"blocks.0.attn.hook_pattern"``."""
        return {name: module for name, module in self.named_modules() if name.rsplit(".", 1)[-1].startswith("hook_")}

    @contextmanager
    def hooks(self, **fns: object) -> Iterator[None]:
        """Temporarily attach forward hooks by hook-point name (dots written as ``__``), removed on exit.

        ``fn(tensor) -> tensor | None``; returning a tensor replaces the activation.

        >>> from tfedu.config import preset
        >>> model = GPT(preset("tiny")); ids = torch.zeros(1, 3, dtype=torch.long)
        >>> with model.hooks(blocks__0__hook_attn_out=lambda t: torch.zeros_like(t)):
        ...     ablated = model(ids)
        """
        points = self.hook_points()
        handles = []
        try:
            for key, fn in fns.items():
                name = key.replace("__", ".")
                if name not in points:
                    raise KeyError(f"no hook point {name!r}; see model.hook_points() for the names")
                handles.append(points[name].register_forward_hook(lambda module, inputs, output, fn=fn: fn(output)))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def run_with_cache(self, *args: object, **kwargs: object) -> tuple[object, dict[str, Tensor]]:
        """Run ``forward`` and return ``(output, cache)``, cache mapping every hook point's name to its tensor.

        The attention pattern is only materialised by ``cfg.attention == "manual"``.
        """
        cache: dict[str, Tensor] = {}
        handles = [
            module.register_forward_hook(lambda module, inputs, output, name=name: cache.__setitem__(name, output.detach()))
            for name, module in self.hook_points().items()
        ]
        try:
            output = self(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        return output, cache


# ----------------------------------------------------------------------------- decoder-only and encoder-only


class LanguageModel(Transformer):
    """Embeddings, one stack of blocks, a final norm (pre-norm only) and the unembedding: ``GPT`` and ``Encoder``.

    ``forward(ids)`` returns logits ``(batch, pos, d_vocab)``; ``forward(ids, targets)`` returns
    ``(logits, loss)``, the mean cross-entropy over positions whose target is not -100.
    ``padding_mask`` (True = real token) hides padded keys. ``positions`` (an integer tensor shaped
    like ``ids``) places each token; by default row after row at 0, 1, ... Subclasses set ``causal``.

    A causal model (``GPT``) also takes ``kv_cache=`` (``tfedu.kv_cache.KVCache.for_model(model,
    batch)``): ``ids`` are then the *new* tokens, placed after the positions the cache holds; their
    keys and values are appended to it and the logits cover the new positions only. A
    ``padding_mask`` then covers every position, cached and new, ``(batch, kv_cache.length + pos)``:
    how ``tfedu.generate`` decodes left-padded prompts of different lengths.
    """

    causal: bool  # set by GPT (True) and Encoder (False)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if not isinstance(getattr(self, "causal", None), bool):
            raise TypeError("use GPT or Encoder (LanguageModel leaves the mask, causal or not, to its subclasses)")
        self.blocks = nn.ModuleList(Block(cfg, layer=i) for i in range(cfg.n_layers))
        # Pre-norm leaves the stream un-normalised after the last block, so one more norm goes
        # before the unembedding; post-norm blocks already end in a norm.
        self.ln_final = make_norm(cfg) if cfg.norm_position == "pre" else nn.Identity()
        self._finish_init()

    def forward(
        self,
        ids: Int[Tensor, "batch pos"],
        targets: Int[Tensor, "batch pos"] | None = None,
        *,
        padding_mask: Bool[Tensor, "batch pos"] | None = None,
        kv_cache: KVCache | None = None,
        positions: Int[Tensor, "batch pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_vocab"] | tuple[Float[Tensor, "batch pos d_vocab"], Tensor]:
        start = 0 if kv_cache is None else self._check_kv_cache(kv_cache, ids)
        resid = self.embed_tokens(ids, start=start, positions=positions)
        _check_padding(padding_mask, ids, "padding_mask", cached=start)
        resid = self.run_blocks(self.blocks, resid, causal=self.causal, padding_mask=padding_mask, kv_cache=kv_cache,
                                positions=positions)
        logits = soft_cap(self.unembed(self.ln_final(resid)), self.cfg.final_logit_softcap)  # batch pos d_vocab
        if targets is None:
            return logits
        _check_targets(targets, ids, self.cfg)
        return logits, next_token_loss(logits, targets)

    @property
    def supports_kv_cache(self) -> bool:
        # Recurrent layers (cfg.layer_types) carry a state, not keys and values: such a model decodes without a cache.
        return self.causal and not self.cfg.has_recurrent_layers

    def _check_kv_cache(self, kv_cache: object, ids: object) -> int:
        """The positions ``kv_cache`` holds, after clear errors for a cache this forward pass cannot use."""
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"kv_cache must be a tfedu.kv_cache.KVCache (KVCache.for_model(model, batch)), "
                            f"got {type(kv_cache).__name__}")
        if not self.causal:
            raise ValueError(f"{type(self).__name__} attends both ways: a new token changes every earlier position, "
                             "so there is nothing to cache (a KV cache serves causal decoding, GPT)")
        if self.cfg.has_recurrent_layers:
            raise ValueError(f"layer_types {self.cfg.layer_types} has recurrent layers: they keep a state, not keys and "
                             "values, so this model takes no KV cache (tfedu.generate decodes it without one)")
        if len(kv_cache.layers) != len(self.blocks):
            raise ValueError(f"this kv_cache has {len(kv_cache.layers)} layers but the model {len(self.blocks)} blocks: "
                             "make it with KVCache.for_model(model, batch)")
        keys, weight = kv_cache.layers[0].keys, self.embed.weight
        if keys.dtype != weight.dtype or keys.device != weight.device:
            raise ValueError(f"the KV cache holds {keys.dtype} on {keys.device} but the model computes in {weight.dtype} "
                             f"on {weight.device}: make the cache after moving the model (KVCache.for_model)")
        if isinstance(ids, Tensor) and ids.dim() == 2 and ids.shape[0] != kv_cache.batch:
            raise ValueError(f"ids has batch {ids.shape[0]} but the KV cache holds {kv_cache.batch} sequences")
        if isinstance(ids, Tensor) and ids.dim() == 2:
            kv_cache.check_room(ids.shape[1], self.cfg.n_ctx)
        return kv_cache.length


class GPT(LanguageModel):
    """A decoder-only language model (Radford et al. 2018, 2019): embeddings, causal blocks, final norm, unembedding.

    ``forward(ids, targets)``: targets are usually the ids shifted by one (the next token).
    ``tfedu.checkpoints.gpt_from_hf`` loads GPT-2 and Llama weights from ``transformers`` into one.
    """

    causal = True


class Encoder(LanguageModel):
    """An encoder-only model with a masked-language-model head (Devlin et al. 2019, BERT).

    The same blocks as ``GPT`` without the causal mask: every position sees every (non-padded)
    position. Train it with ``mask_tokens``: the loss is taken only where a token was hidden.
    (BERT's head has one more dense layer and norm before the unembedding; here the head is the
    tied unembedding alone, like ``GPT``.)
    """

    causal = False


def mask_tokens(
    ids: Int[Tensor, "batch pos"],
    *,
    mask_id: int,
    d_vocab: int,
    p: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """BERT's masking (Devlin et al. 2019, sec. 3.1): ``(inputs, targets)``.

    Each position is chosen with probability p; a chosen token becomes ``mask_id`` 80% of the
    time, a random token 10% and stays itself 10%. ``targets`` holds the original token at chosen
    positions and -100 (skipped by the loss) everywhere else.

    >>> g = torch.Generator().manual_seed(0)
    >>> inputs, targets = mask_tokens(torch.arange(10)[None], mask_id=99, d_vocab=100, p=0.5, generator=g)
    >>> bool(((targets == -100) | (targets == torch.arange(10))).all())
    True
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"p must be a probability in (0, 1], got {p!r}")
    if not 0 <= mask_id < d_vocab:
        raise ValueError(f"mask_id={mask_id} is not a token id (0..{d_vocab - 1}): reserve one id for [MASK]")
    # Draw on the generator's device (a CPU generator for GPU ids is the usual seeded set-up), then move.
    device = ids.device if generator is None else generator.device
    chosen = (torch.rand(ids.shape, generator=generator, device=device) < p).to(ids.device)
    action = torch.rand(ids.shape, generator=generator, device=device).to(ids.device)
    random_ids = torch.randint(0, d_vocab, ids.shape, generator=generator, device=device).to(ids)
    inputs = torch.where(chosen & (action < 0.8), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, inputs)
    targets = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    return inputs, targets


# ----------------------------------------------------------------------------- encoder-decoder


class EncoderDecoder(Transformer):
    """The original Transformer (Vaswani et al. 2017, fig. 1): an encoder and a cross-attending decoder.

    The source goes through ``encoder_blocks`` (no causal mask); the target through
    ``decoder_blocks``, each of which attends causally to the target so far and then, through
    cross-attention, to the whole encoded source. One embedding matrix serves source, target and
    the unembedding when ``cfg.tied_embeddings`` (sec. 3.4, a shared source/target vocabulary),
    and the embeddings are multiplied by sqrt(d_model).

    ``forward(src, tgt, targets=None, *, src_padding_mask=None, tgt_padding_mask=None)``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.embed_scale = math.sqrt(cfg.d_model)
        if not cfg.tied_embeddings:
            self.tgt_embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.hook_tgt_embed = nn.Identity()  # the target's token embeddings (hook_embed sees the source's)
        self.encoder_blocks = nn.ModuleList(Block(cfg, layer=i) for i in range(cfg.n_layers))
        self.decoder_blocks = nn.ModuleList(Block(cfg, cross_attention=True, layer=i) for i in range(cfg.n_layers))
        pre = cfg.norm_position == "pre"
        self.encoder_ln_final = make_norm(cfg) if pre else nn.Identity()
        self.decoder_ln_final = make_norm(cfg) if pre else nn.Identity()
        self._finish_init()
        # sqrt(d_model) times N(0, 1/d_model) entries: embeddings of about unit size, like the sinusoids.
        for embedding in (self.embed, getattr(self, "tgt_embed", None)):
            if embedding is not None:
                nn.init.normal_(embedding.weight, mean=0.0, std=cfg.d_model**-0.5)
        if isinstance(self.pos_embed, LearnedPositions):
            # Learned positions at the scale of the scaled embeddings (entries of about 1, like the
            # sinusoids); GPT-2's std 0.02 here would leave the position 2% of each input vector.
            nn.init.normal_(self.pos_embed.W_pos, mean=0.0, std=1.0)

    def default_init_std(self) -> float:
        """d_model ** -0.5: weights and sqrt(d_model)-scaled embeddings on one scale.

        The embeddings enter at entries of about 1; with GPT-2's 0.02 every block's first writes
        are ~1% of that, and in tests a 2-block model then sat at the unigram loss for hundreds of
        steps on digit reversal. Variance 1 / d_model (LeCun / Xavier scale, like the 2017 code's
        Xavier initialisation) learns it in about a hundred.
        """
        return self.cfg.d_model**-0.5

    def encode(
        self, src: Int[Tensor, "batch src_pos"], src_padding_mask: Bool[Tensor, "batch src_pos"] | None = None
    ) -> Float[Tensor, "batch src_pos d_model"]:
        """The encoder's output, which every decoder block reads through cross-attention."""
        resid = self.embed_tokens(src, "src")
        _check_padding(src_padding_mask, src, "src_padding_mask")
        resid = self.run_blocks(self.encoder_blocks, resid, causal=False, padding_mask=src_padding_mask)
        return self.encoder_ln_final(resid)

    def decode(
        self,
        tgt: Int[Tensor, "batch tgt_pos"],
        memory: Float[Tensor, "batch src_pos d_model"],
        *,
        src_padding_mask: Bool[Tensor, "batch src_pos"] | None = None,
        tgt_padding_mask: Bool[Tensor, "batch tgt_pos"] | None = None,
    ) -> Float[Tensor, "batch tgt_pos d_vocab"]:
        """Next-token logits for the target, given the encoded source ``memory``."""
        resid = self.embed_tokens(tgt, "tgt", embed=getattr(self, "tgt_embed", self.embed), hook=self.hook_tgt_embed)
        _check_padding(tgt_padding_mask, tgt, "tgt_padding_mask")
        resid = self.run_blocks(self.decoder_blocks, resid, causal=True, padding_mask=tgt_padding_mask,
                                context=memory, context_padding_mask=src_padding_mask)
        return self.unembed(self.decoder_ln_final(resid))

    def forward(
        self,
        src: Int[Tensor, "batch src_pos"],
        tgt: Int[Tensor, "batch tgt_pos"],
        targets: Int[Tensor, "batch tgt_pos"] | None = None,
        *,
        src_padding_mask: Bool[Tensor, "batch src_pos"] | None = None,
        tgt_padding_mask: Bool[Tensor, "batch tgt_pos"] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        memory = self.encode(src, src_padding_mask)
        logits = self.decode(tgt, memory, src_padding_mask=src_padding_mask, tgt_padding_mask=tgt_padding_mask)
        if targets is None:
            return logits
        _check_targets(targets, tgt, self.cfg)
        return logits, next_token_loss(logits, targets)
