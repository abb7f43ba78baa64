"""Looking inside a trained GPT: cached activations, attention patterns, the logit lens, head scores, attributions.

Everything here reads a ``tfedu.model.GPT`` through its hook points (TransformerLens's names:
``hook_embed``, ``blocks.0.hook_resid_pre``, ``blocks.0.attn.hook_pattern``, ``blocks.0.attn.hook_z``,
``blocks.0.hook_attn_out``, ..., ``blocks.3.hook_resid_post``) and never changes a weight.

- ``run_with_cache``: one forward pass, the named activations kept. ``attention_patterns`` switches the
  fused ("sdpa") attention to the by-hand softmax for a while, so that the pattern exists to be read.
- ``plot_attention_heads`` / ``plot_attention_mean``: the patterns as heat maps over the tokens.
- ``logit_lens`` (nostalgebraist 2020): the final norm and the unembedding applied to the residual
  stream after every block: what the model would predict if it stopped there.
- ``repeated_random_tokens``, ``previous_token_score``, ``induction_score``, ``chance_scores``,
  ``score_heads``, ``repeated_sequence_losses``: the test of Olsson et al. 2022 (sec. 2) for induction
  heads, a random sequence shown twice.
- ``direct_logit_attribution`` (Elhage et al. 2021, "A Mathematical Framework"): with the final
  norm's scale frozen the logit is linear in the residual stream, and the stream is a sum of what
  the embeddings, each head and each MLP wrote to it; so the logit splits into their contributions.

Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from tfedu.attention import MultiHeadAttention, causal_mask
from tfedu.layers import Attention, LayerNorm, RMSNorm
from tfedu.model import LanguageModel

# ----------------------------------------------------------------------------- checks


def _check_model(model: object) -> None:
    if not isinstance(model, LanguageModel):
        raise TypeError(f"model must be a tfedu GPT (or Encoder), a tfedu.model.LanguageModel; got {type(model).__name__}")


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_pattern(pattern: object, need: str) -> None:
    expected = f"a float tensor of shape {need}"
    if not isinstance(pattern, Tensor) or not pattern.is_floating_point():
        got = pattern.dtype if isinstance(pattern, Tensor) else type(pattern).__name__
        raise TypeError(f"pattern must be {expected}, got {got}")


# ----------------------------------------------------------------------------- caching activations


@contextmanager
def attention_patterns(model: nn.Module) -> Iterator[nn.Module]:
    """Run every ``Attention`` in ``model`` by hand (``impl="manual"``) inside the block, so ``hook_pattern`` fires.

    The fused kernel (``impl="sdpa"``) never builds the pattern; the by-hand softmax does, with the
    same numbers up to float rounding. Each layer's own ``impl`` comes back on exit, exception or not.

    >>> from tfedu.config import preset; from tfedu.model import GPT
    >>> model = GPT(preset("tiny").replace(attention="sdpa"))
    >>> with attention_patterns(model):
    ...     model.blocks[0].attn.impl
    'manual'
    >>> model.blocks[0].attn.impl
    'sdpa'

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    saved = [(module, module.impl) for module in model.modules() if isinstance(module, Attention)]
    try:
        for module, _ in saved:
            module.impl = "manual"
        yield model
    finally:
        for module, impl in saved:
            module.impl = impl


def _select_names(model: LanguageModel, names: object) -> list[str]:
    points = list(model.hook_points())
    if names is None:
        return points
    if callable(names):
        return [name for name in points if names(name)]
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"names must be None (all), a list of hook-point names or a predicate str -> bool, got {names!r}")
    unknown = [name for name in names if name not in points]
    if unknown:
        raise KeyError(f"no hook point {', '.join(map(repr, unknown))}; this model has: {', '.join(points)}")
    return list(names)


def run_with_cache(
    model: LanguageModel,
    ids: Int[Tensor, "batch pos"],
    names: Sequence[str] | Callable[[str], bool] | None = None,
) -> tuple[Float[Tensor, "batch pos d_vocab"], dict[str, Tensor]]:
    """One forward pass in eval mode without gradients: ``(logits, cache)``, cache = hook name -> detached tensor.

    ``names``: None keeps every hook point, a list keeps those (an unknown name raises a ``KeyError``
    listing the real ones), a predicate ``str -> bool`` keeps the names it accepts. When a pattern
    (``...attn.hook_pattern``) is asked for, the pass runs under ``attention_patterns``: a model with
    fused attention then gives logits equal to its own up to float rounding (~1e-6), not bit for bit.
    ``hook_z`` (batch pos n_heads d_head) fires with either attention. The model's train/eval mode is
    restored afterwards.

    >>> from tfedu.config import preset; from tfedu.model import GPT
    >>> model = GPT(preset("tiny").replace(attention="sdpa"))
    >>> logits, cache = run_with_cache(model, torch.zeros(1, 5, dtype=torch.long), lambda name: "blocks.1" in name)
    >>> cache["blocks.1.attn.hook_pattern"].shape, cache["blocks.1.attn.hook_z"].shape
    (torch.Size([1, 4, 5, 5]), torch.Size([1, 5, 4, 16]))

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    _check_model(model)
    selected = _select_names(model, names)
    needs_pattern = any(name.endswith("hook_pattern") for name in selected)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), attention_patterns(model) if needs_pattern else nullcontext():
            # Transformer.run_with_cache records every hook point; keeping a few is a dict comprehension.
            logits, cache = model.run_with_cache(ids)
    finally:
        model.train(was_training)
    return logits, {name: cache[name] for name in selected if name in cache}


def per_head_W_O(attn: MultiHeadAttention) -> Float[Tensor, "n_heads d_head d_model"]:
    """``W_O`` cut into the heads' slices: head h writes ``z[..., h, :] @ per_head_W_O(attn)[h]`` to the stream.

    ``W_O`` is an ``nn.Linear`` whose weight is ``(d_model, n_heads * d_head)``, the heads' columns side
    by side in the order ``merge_heads`` concatenates them. A view: no copy.

    >>> attn = Attention(d_model=8, n_heads=2)
    >>> per_head_W_O(attn).shape
    torch.Size([2, 4, 8])

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"expected a tfedu attention layer (model.blocks[i].attn), got {type(attn).__name__}")
    return attn.W_O.weight.T.unflatten(0, (attn.n_heads, attn.d_head))  # n_heads d_head d_model


# ----------------------------------------------------------------------------- pictures of attention


def token_labels(tokenizer: object, ids: Sequence[int] | Int[Tensor, "pos"]) -> list[str]:
    """Each token's text, readable on an axis: a space shows as ``·``, a newline as ``\\n``, a tab as ``\\t``.

    A token that is not whole UTF-8 (part of a character) shows its bytes as ``\\xNN``.

    >>> from tfedu.tokenizer import Tokenizer
    >>> token_labels(Tokenizer([]), [104, 32, 10, 195])
    ['h', '·', '\\\\n', '\\\\xc3']
    """
    if isinstance(ids, Tensor):
        if ids.dim() != 1:
            raise ValueError(f"ids must be one sequence (pos,), got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    labels = []
    for i in ids:
        text = tokenizer.decode_bytes([int(i)]).decode("utf-8", errors="backslashreplace")
        labels.append(text.replace(" ", "·").replace("\n", "\\n").replace("\t", "\\t"))
    return labels


def _tick_fontsize(n: int) -> float:
    return max(4.0, min(9.0, 360.0 / max(n, 1)))


def _heat_map(ax, values: Tensor, x_labels: Sequence[str], y_labels: Sequence[str], *, vmax: float = 1.0):
    image = ax.imshow(values.detach().float().cpu().numpy(), cmap="Blues", vmin=0.0, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(x_labels)), x_labels, rotation=90, fontsize=_tick_fontsize(len(x_labels)))
    ax.set_yticks(range(len(y_labels)), y_labels, fontsize=_tick_fontsize(len(y_labels)))
    return image


def _check_one_sequence_pattern(pattern: object, tokens: Sequence[str]) -> None:
    _check_pattern(pattern, "(n_heads, query_pos, key_pos) for one sequence")
    if pattern.dim() != 3:
        hint = " (a cached pattern is batch n_heads query_pos key_pos: take pattern[0])" if pattern.dim() == 4 else ""
        raise ValueError(f"pattern must have shape (n_heads, query_pos, key_pos), got {tuple(pattern.shape)}{hint}")
    if len(tokens) != pattern.shape[-1] or pattern.shape[-2] > pattern.shape[-1]:
        raise ValueError(f"tokens must label the {pattern.shape[-1]} keys (the last query_pos of them label the "
                         f"queries), got {len(tokens)} tokens for a pattern of shape {tuple(pattern.shape)}")


def plot_attention_heads(
    pattern: Float[Tensor, "n_heads query_pos key_pos"], tokens: Sequence[str], *, title: str | None = None
):
    """One heat map per head, side by side: row = query (the token attending), column = key; returns the Figure.

    ``tokens`` label the keys; the queries are the last ``query_pos`` of them. Colours run from 0 to 1
    (a row of a pattern sums to one), with a colour bar.

    >>> import matplotlib; matplotlib.use("Agg")
    >>> fig = plot_attention_heads(torch.eye(3).expand(2, 3, 3), ["a", "b", "c"])
    >>> [ax.get_title() for ax in fig.axes[:2]]
    ['head 0', 'head 1']

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    import matplotlib.pyplot as plt

    _check_one_sequence_pattern(pattern, tokens)
    n_heads, n_query, n_key = pattern.shape
    size = min(4.0, 1.5 + 0.08 * n_key)
    fig, axes = plt.subplots(1, n_heads, figsize=(size * n_heads + 1.0, size), squeeze=False, layout="constrained")
    query_labels = list(tokens)[n_key - n_query:]
    for head, ax in enumerate(axes[0]):
        image = _heat_map(ax, pattern[head], tokens, query_labels)
        ax.set_title(f"head {head}")
        ax.set_xlabel("key (attended to)")
        if head == 0:
            ax.set_ylabel("query (attending)")
    fig.colorbar(image, ax=axes[0].tolist(), label="attention weight", shrink=0.8)
    if title is not None:
        fig.suptitle(title)
    return fig


def plot_attention_mean(
    pattern: Float[Tensor, "n_heads query_pos key_pos"], tokens: Sequence[str], *, title: str | None = None
):
    """The pattern averaged over the heads, one heat map (query rows, key columns) with a colour bar; returns the Figure.

    >>> import matplotlib; matplotlib.use("Agg")
    >>> fig = plot_attention_mean(torch.eye(3).expand(2, 3, 3), ["a", "b", "c"], title="mean")
    >>> fig.axes[0].get_title(), [t.get_text() for t in fig.axes[0].get_xticklabels()]
    ('mean', ['a', 'b', 'c'])

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    import matplotlib.pyplot as plt

    _check_one_sequence_pattern(pattern, tokens)
    n_heads, n_query, n_key = pattern.shape
    size = min(7.0, 2.5 + 0.1 * n_key)
    fig, ax = plt.subplots(figsize=(size + 1.0, size), layout="constrained")
    image = _heat_map(ax, pattern.mean(0), tokens, list(tokens)[n_key - n_query:])
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.set_title(title if title is not None else f"attention averaged over {n_heads} heads")
    fig.colorbar(image, ax=ax, label="mean attention weight", shrink=0.8)
    return fig


# ----------------------------------------------------------------------------- the logit lens


def residual_names(model: LanguageModel) -> list[str]:
    """The residual stream's hook points in order: after the embeddings, then after each block (n_layers + 1).

    >>> from tfedu.config import preset; from tfedu.model import GPT
    >>> residual_names(GPT(preset("tiny")))
    ['blocks.0.hook_resid_pre', 'blocks.0.hook_resid_post', 'blocks.1.hook_resid_post']
    """
    _check_model(model)
    return ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(len(model.blocks))]


def logit_lens(model: LanguageModel, ids: Int[Tensor, "batch pos"]) -> Float[Tensor, "layer batch pos d_vocab"]:
    """``unembed(ln_final(resid))`` for the stream after the embeddings and after each block: n_layers + 1 rows.

    Row 0 reads the embeddings alone (a bigram guess), row ``i + 1`` the stream after block i; the last
    row is the model's own logits, bit for bit: the same tensor through the same two layers
    (nostalgebraist 2020, "interpreting GPT: the logit lens").

    >>> from tfedu.config import preset; from tfedu.model import GPT
    >>> model = GPT(preset("tiny")).eval(); ids = torch.zeros(1, 4, dtype=torch.long)
    >>> lens = logit_lens(model, ids)
    >>> lens.shape, torch.equal(lens[-1], model(ids))
    (torch.Size([3, 1, 4, 256]), True)

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    names = residual_names(model)
    _, cache = run_with_cache(model, ids, names)
    with torch.no_grad():
        # One layer at a time, each call shaped like the forward pass's own, so the last row is exact.
        return torch.stack([model.unembed(model.ln_final(cache[name])) for name in names])


def logit_lens_probs(
    lens: Float[Tensor, "layer batch pos d_vocab"], targets: Int[Tensor, "batch pos"] | None = None
) -> Float[Tensor, "layer batch pos"]:
    """The probability each layer's lens gives ``targets`` (default: the model's final top prediction).

    >>> lens = torch.tensor([[[[0.0, 0.0]]], [[[0.0, 2.0]]]])  # 2 layers, 1 sequence, 1 position, 2 tokens
    >>> logit_lens_probs(lens).flatten()  # the final guess is token 1: 0.5 at first, then 0.88
    tensor([0.5000, 0.8808])
    """
    if not isinstance(lens, Tensor) or lens.dim() != 4 or not lens.is_floating_point():
        raise ValueError(f"lens must be a float tensor (layer, batch, pos, d_vocab) from logit_lens, got "
                         f"{tuple(lens.shape) if isinstance(lens, Tensor) else type(lens).__name__}")
    if targets is None:
        targets = lens[-1].argmax(-1)
    if not isinstance(targets, Tensor) or targets.shape != lens.shape[1:3] or targets.is_floating_point():
        got = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
        raise ValueError(f"targets must be integer ids of shape (batch, pos) = {tuple(lens.shape[1:3])}, got {got}")
    probs = lens.float().softmax(-1)  # layer batch pos d_vocab
    index = targets.long().expand(lens.shape[0], -1, -1)[..., None]  # layer batch pos 1
    return probs.gather(-1, index)[..., 0]


def top_tokens_table(
    lens: Float[Tensor, "layer batch pos d_vocab"], tokenizer: object, *, k: int = 1, batch_index: int = 0
) -> list[list[str]]:
    """Each layer's top-``k`` tokens at each position of sequence ``batch_index``: rows = layers, columns = positions.

    A cell is the tokens' ``token_labels`` joined by ``" / "``, best first.

    >>> from tfedu.tokenizer import Tokenizer
    >>> lens = torch.zeros(2, 1, 1, 256); lens[0, 0, 0, 104] = 1.0; lens[1, 0, 0, 105] = 1.0
    >>> top_tokens_table(lens, Tokenizer([]))
    [['h'], ['i']]

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    if not isinstance(lens, Tensor) or lens.dim() != 4:
        raise ValueError(f"lens must be a tensor (layer, batch, pos, d_vocab) from logit_lens, got "
                         f"{tuple(lens.shape) if isinstance(lens, Tensor) else type(lens).__name__}")
    _check_int("k", k, 1)
    if not -lens.shape[1] <= batch_index < lens.shape[1]:
        raise IndexError(f"batch_index {batch_index} is out of range for a batch of {lens.shape[1]}")
    top = lens[:, batch_index].topk(k, dim=-1).indices  # layer pos k
    return [[" / ".join(token_labels(tokenizer, cell)) for cell in row] for row in top]


def plot_logit_lens(
    probs: Float[Tensor, "layer pos"],
    tokens: Sequence[str],
    *,
    cell_labels: Sequence[Sequence[str]] | None = None,
    layer_labels: Sequence[str] | None = None,
    title: str | None = None,
):
    """Heat map of a probability per layer (rows, the embeddings at the bottom) and input position (columns).

    ``probs`` is one sequence's ``logit_lens_probs`` (e.g. ``[:, 0]``). ``tokens`` label the positions
    (the input token there), ``cell_labels`` (e.g. ``top_tokens_table``) are written in the cells,
    ``layer_labels`` default to ``embed, block 0, block 1, ...``. Returns the Figure.

    >>> import matplotlib; matplotlib.use("Agg")
    >>> fig = plot_logit_lens(torch.rand(3, 4), list("abcd"), cell_labels=[list("wxyz")] * 3)
    >>> [t.get_text() for t in fig.axes[0].get_yticklabels()]
    ['embed', 'block 0', 'block 1']

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    import matplotlib.pyplot as plt

    if not isinstance(probs, Tensor) or probs.dim() != 2 or not probs.is_floating_point():
        got = tuple(probs.shape) if isinstance(probs, Tensor) else type(probs).__name__
        raise ValueError(f"probs must be a float tensor (layer, pos) for one sequence (logit_lens_probs(...)[:, 0]), got {got}")
    n_layer, n_pos = probs.shape
    layer_labels = ["embed"] + [f"block {i}" for i in range(n_layer - 1)] if layer_labels is None else list(layer_labels)
    if len(tokens) != n_pos or len(layer_labels) != n_layer:
        raise ValueError(f"probs has {n_layer} layers and {n_pos} positions, but {len(layer_labels)} layer labels "
                         f"and {len(tokens)} tokens were given")
    if cell_labels is not None and (len(cell_labels) != n_layer or any(len(row) != n_pos for row in cell_labels)):
        raise ValueError(f"cell_labels must be {n_layer} rows of {n_pos} strings (top_tokens_table's shape)")
    fig, ax = plt.subplots(figsize=(max(5.0, 0.7 * n_pos + 2.0), 0.5 * n_layer + 2.0), layout="constrained")
    image = ax.imshow(probs.detach().float().cpu().numpy(), cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto",
                      origin="lower")
    ax.set_xticks(range(n_pos), list(tokens), rotation=90, fontsize=_tick_fontsize(n_pos))
    ax.set_yticks(range(n_layer), layer_labels)
    ax.set_xlabel("input token (position)")
    ax.set_ylabel("residual stream after")
    if cell_labels is not None:
        for layer, row in enumerate(cell_labels):
            for pos, text in enumerate(row):
                dark = float(probs[layer, pos]) > 0.5  # white text on the dark cells
                ax.text(pos, layer, text, ha="center", va="center", fontsize=_tick_fontsize(n_pos) * 0.9,
                        color="white" if dark else "black")
    ax.set_title(title if title is not None else "logit lens")
    fig.colorbar(image, ax=ax, label="probability", shrink=0.8)
    return fig


# ----------------------------------------------------------------------------- induction heads


def repeated_random_tokens(
    batch: int, seq_len: int, d_vocab: int, *, generator: torch.Generator, bos: int | None = None
) -> Int[Tensor, "batch pos"]:
    """``batch`` random sequences of ``seq_len`` tokens, each shown twice: shape (batch, [1 +] 2 * seq_len).

    With ``bos`` that id comes first (and is never drawn among the random tokens). The first copy
    cannot be predicted (loss about ln d_vocab); in the second, a model that has induction heads
    looks back at the earlier occurrence and copies what came next (Olsson et al. 2022, sec. 2).

    >>> ids = repeated_random_tokens(2, 3, 10, generator=torch.Generator().manual_seed(0), bos=9)
    >>> ids.shape, bool((ids[:, 1:4] == ids[:, 4:]).all()), bool((ids[:, 1:] != 9).all())
    (torch.Size([2, 7]), True, True)

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    _check_int("batch", batch, 1)
    _check_int("seq_len", seq_len, 1)
    _check_int("d_vocab", d_vocab, 2 if bos is not None else 1)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (seeded, for a repeatable draw), got {type(generator).__name__}")
    if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int) or not 0 <= bos < d_vocab):
        raise ValueError(f"bos must be a token id in 0..{d_vocab - 1}, or None, got {bos!r}")
    n_choices = d_vocab - (bos is not None)
    half = torch.randint(0, n_choices, (batch, seq_len), generator=generator, device=generator.device)
    if bos is not None:
        half = half + (half >= bos).long()  # skip the BOS id
    ids = torch.cat([half, half], dim=1)  # batch 2*seq_len
    if bos is not None:
        ids = torch.cat([torch.full((batch, 1), bos, dtype=ids.dtype, device=ids.device), ids], dim=1)
    return ids


def previous_token_score(pattern: Float[Tensor, "*head query_pos key_pos"]) -> Float[Tensor, "*head"]:
    """Mean attention from each position to the one just before it (queries 1 .. pos - 1); leading axes kept.

    1 for a perfect previous-token head; a head spreading its attention evenly over the visible keys
    scores ``chance_scores(...)["previous_token"]``. Average over ``batch`` yourself.

    >>> previous_token_score(torch.diag(torch.ones(3), -1))  # every query (but the first) on the key before it
    tensor(1.)

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    _check_pattern(pattern, "(..., query_pos, key_pos)")
    if pattern.dim() < 2 or pattern.shape[-1] != pattern.shape[-2] or pattern.shape[-1] < 2:
        raise ValueError(f"pattern must be square, (..., pos, pos) with pos >= 2 (self-attention, no KV cache), "
                         f"got shape {tuple(pattern.shape)}")
    return pattern.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)  # [..., i + 1, i] averaged over i


def _induction_positions(seq_len: int, offset: int) -> tuple[Tensor, Tensor]:
    """Queries in the second copy and, for each, the key just after the same token's first occurrence."""
    query = torch.arange(offset + seq_len, offset + 2 * seq_len)
    return query, query - seq_len + 1


def induction_score(
    pattern: Float[Tensor, "*head query_pos key_pos"], seq_len: int, offset: int = 0
) -> Float[Tensor, "*head"]:
    """Mean attention from each token of the second copy to the token after its first occurrence; leading axes kept.

    The sequence is ``offset`` tokens (1 for a BOS) then a random ``seq_len`` tokens twice, so
    ``pos = offset + 2 * seq_len``. A query at ``q`` in the second copy repeats the token at
    ``q - seq_len``; an induction head attends to the key after it, ``q - seq_len + 1``, whose token
    comes next (Olsson et al. 2022). A perfect induction head scores 1.

    >>> seq_len = 3; pattern = torch.zeros(6, 6)
    >>> pattern[torch.arange(6), (torch.arange(6) - seq_len + 1).clamp(min=0)] = 1.0
    >>> induction_score(pattern, seq_len)
    tensor(1.)

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    _check_pattern(pattern, "(..., query_pos, key_pos)")
    _check_int("seq_len", seq_len, 2)
    _check_int("offset", offset, 0)
    n_pos = offset + 2 * seq_len
    if pattern.dim() < 2 or tuple(pattern.shape[-2:]) != (n_pos, n_pos):
        raise ValueError(f"pattern must be (..., pos, pos) with pos = offset + 2 * seq_len = {n_pos}, "
                         f"got shape {tuple(pattern.shape)}")
    query, key = _induction_positions(seq_len, offset)
    return pattern[..., query, key].mean(-1)


def chance_scores(seq_len: int, *, offset: int = 0) -> dict[str, float]:
    """What uniform causal attention (each query spreads 1 / (query_pos + 1) over its keys) scores.

    The same positions as ``previous_token_score`` and ``induction_score`` on a sequence of
    ``offset + 2 * seq_len`` tokens: the mean of ``1 / (q + 1)`` over the scored queries ``q``.
    A head scoring well above this is doing something; one at it might as well not look.

    >>> {name: round(score, 4) for name, score in chance_scores(2).items()}  # (1/2 + 1/3 + 1/4) / 3, (1/3 + 1/4) / 2
    {'previous_token': 0.3611, 'induction': 0.2917}

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    _check_int("seq_len", seq_len, 2)
    _check_int("offset", offset, 0)
    n_pos = offset + 2 * seq_len
    visible = causal_mask(n_pos, n_pos).double()
    uniform = visible / visible.sum(-1, keepdim=True)  # query_pos key_pos
    return {"previous_token": float(previous_token_score(uniform)),
            "induction": float(induction_score(uniform, seq_len, offset))}


def _repeat_offset(ids: object, seq_len: int) -> int:
    """The number of tokens before the repeated part of ``ids``, after checking that it does repeat."""
    _check_int("seq_len", seq_len, 2)
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        got = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"ids must be (batch, pos) token ids from repeated_random_tokens, got {got}")
    offset = ids.shape[1] - 2 * seq_len
    if offset < 0:
        raise ValueError(f"ids have {ids.shape[1]} positions, fewer than 2 * seq_len = {2 * seq_len}")
    if not torch.equal(ids[:, offset:offset + seq_len], ids[:, offset + seq_len:]):
        raise ValueError(f"ids do not end in a sequence of seq_len={seq_len} tokens repeated twice "
                         "(make them with repeated_random_tokens)")
    return offset


def score_heads(model: LanguageModel, ids: Int[Tensor, "batch pos"], seq_len: int) -> dict[str, Float[Tensor, "n_layers n_heads"]]:
    """Every head's ``previous_token_score`` and ``induction_score`` on repeated tokens, averaged over the batch.

    ``ids`` come from ``repeated_random_tokens`` (with or without a BOS in front).

    >>> from tfedu.config import preset; from tfedu.model import GPT
    >>> model = GPT(preset("tiny")); g = torch.Generator().manual_seed(0)
    >>> scores = score_heads(model, repeated_random_tokens(2, 5, 256, generator=g), 5)
    >>> scores["previous_token"].shape, scores["induction"].shape
    (torch.Size([2, 4]), torch.Size([2, 4]))

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    _check_model(model)
    offset = _repeat_offset(ids, seq_len)
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(len(model.blocks))]
    _, cache = run_with_cache(model, ids, names)
    patterns = torch.stack([cache[name] for name in names])  # n_layers batch n_heads pos pos
    return {"previous_token": previous_token_score(patterns).mean(1),
            "induction": induction_score(patterns, seq_len, offset).mean(1)}


def repeated_sequence_losses(model: LanguageModel, ids: Int[Tensor, "batch pos"], seq_len: int) -> dict[str, object]:
    """Next-token loss on repeated tokens: per position, and averaged over each copy.

    Returns ``{"per_position": (pos - 1,) losses averaged over the batch, entry t for predicting the
    token at t + 1; "first": mean loss on the first copy; "second": on the second}``. Each copy counts
    its ``seq_len - 1`` tokens whose previous token belongs to the same copy: those the second copy
    can predict by induction. Random tokens cost about ln(d_vocab) in the first copy; a model with
    induction heads pays far less in the second.

    >>> from tfedu.config import preset; from tfedu.model import GPT
    >>> model = GPT(preset("tiny")); g = torch.Generator().manual_seed(0)
    >>> losses = repeated_sequence_losses(model, repeated_random_tokens(2, 5, 256, generator=g), 5)
    >>> losses["per_position"].shape, round(losses["first"])  # untrained: ln 256 = 5.5
    (torch.Size([9]), 6)

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    _check_model(model)
    offset = _repeat_offset(ids, seq_len)
    logits, _ = run_with_cache(model, ids, [])
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten().long(), reduction="none")
    per_position = losses.view(ids.shape[0], -1).mean(0)  # pos - 1; entry t predicts token t + 1
    # Targets at offset+1 .. offset+seq_len-1 (first copy) and offset+seq_len+1 .. offset+2*seq_len-1 (second).
    first = per_position[offset:offset + seq_len - 1]
    second = per_position[offset + seq_len:offset + 2 * seq_len - 1]
    return {"per_position": per_position, "first": float(first.mean()), "second": float(second.mean())}


# ----------------------------------------------------------------------------- direct logit attribution


def _frozen_readout(model: LanguageModel, resid: Float[Tensor, "d_model"], token: int) -> tuple[Tensor, Tensor]:
    """``(direction, constant)`` with ``logit(x) = x @ direction + constant`` for the final norm's scale frozen at ``resid``.

    LayerNorm: ``((x - mean x) / s * w + b) @ u`` with ``u = W_U[:, token]`` and ``s`` the std of
    ``resid``; the mean subtraction moves onto the direction, ``(w*u - mean(w*u)) / s``. RMSNorm has no
    mean and no bias.
    """
    norm, u = model.ln_final, model.unembed.weight[token]  # u: d_model, the token's column of W_U
    wu = norm.weight * u
    if isinstance(norm, LayerNorm):
        # LayerNorm's scale, the same biased variance and eps as layer_norm_by_hand.
        scale = torch.sqrt((resid - resid.mean()).pow(2).mean() + norm.eps)
        constant = norm.bias @ u if norm.bias is not None else resid.new_zeros(())
        return (wu - wu.mean()) / scale, constant
    scale = torch.sqrt(resid.pow(2).mean() + norm.eps)  # RMSNorm
    return wu / scale, resid.new_zeros(())


def direct_logit_attribution(
    model: LanguageModel, ids: Int[Tensor, "batch pos"], pos: int, token: int, *, batch_index: int = 0
) -> dict[str, float]:
    """The logit of ``token`` at position ``pos`` split into what each part of the model wrote to the stream.

    A pre-norm model's final stream is a sum: token embedding (``"embed"``) + position (``"pos_embed"``,
    when the model adds one) + for each layer l every head's ``z_h @ W_O[h]`` (``"L{l}H{h}"``), the output
    bias of ``W_O`` (``"L{l} attn bias"``) and the MLP's output (``"L{l} MLP"``). With the final norm's
    scale frozen at its value on this stream, the logit is linear in the stream, so it is the sum of
    the parts' logits plus the norm's bias read out (``"ln_final bias"``; LayerNorm with a bias only).
    The values sum to the model's logit up to float rounding. This is the *direct* effect: a head's
    effect through later layers is counted in those layers (Elhage et al. 2021).

    >>> from tfedu.config import preset; from tfedu.model import GPT
    >>> model = GPT(preset("tiny")).eval(); ids = torch.tensor([[1, 2, 3]])
    >>> parts = direct_logit_attribution(model, ids, pos=2, token=7)
    >>> list(parts)[:4], abs(sum(parts.values()) - model(ids)[0, 2, 7].item()) < 1e-4
    (['embed', 'pos_embed', 'L0H0', 'L0H1'], True)

    Built by hand in notebooks/15_interpretability_and_decoding.ipynb.
    """
    _check_model(model)
    if model.cfg.norm_position != "pre" or not isinstance(model.ln_final, (LayerNorm, RMSNorm)):
        raise ValueError("direct logit attribution needs a pre-norm model (the stream a plain sum, one final norm); "
                         f"this one has norm_position={model.cfg.norm_position!r}")
    if any(block.has_cross_attention for block in model.blocks):
        raise ValueError("blocks with cross-attention are not supported")
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        raise ValueError(f"ids must be (batch, pos) token ids, got {tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__}")
    batch, n_pos = ids.shape
    for name, value, size in (("pos", pos, n_pos), ("batch_index", batch_index, batch)):
        if isinstance(value, bool) or not isinstance(value, int) or not -size <= value < size:
            raise IndexError(f"{name} must be an int in -{size}..{size - 1}, got {value!r}")
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < model.cfg.d_vocab:
        raise ValueError(f"token must be an id in 0..{model.cfg.d_vocab - 1}, got {token!r}")
    n_layers = len(model.blocks)
    names = ["hook_embed", f"blocks.{n_layers - 1}.hook_resid_post"]
    points = ("attn.hook_z", "hook_mlp_out") if model.cfg.has_mlp else ("attn.hook_z",)  # d_mlp=0: attention-only
    names += [f"blocks.{i}.{point}" for i in range(n_layers) for point in points]
    if model.pos_embed is not None:
        names.append("hook_pos_embed")
    _, cache = run_with_cache(model, ids, names)
    at = (batch_index, pos)
    with torch.no_grad():
        direction, constant = _frozen_readout(model, cache[names[1]][at], token)
        parts = {"embed": cache["hook_embed"][at] @ direction}
        if model.pos_embed is not None:
            parts["pos_embed"] = cache["hook_pos_embed"][pos] @ direction
        for i, block in enumerate(model.blocks):
            z = cache[f"blocks.{i}.attn.hook_z"][at]  # n_heads d_head
            heads = torch.einsum("hd,hdm->hm", z, per_head_W_O(block.attn)) @ direction  # n_heads
            parts |= {f"L{i}H{h}": value for h, value in enumerate(heads)}
            if block.attn.W_O.bias is not None:
                parts[f"L{i} attn bias"] = block.attn.W_O.bias @ direction
            if model.cfg.has_mlp:
                parts[f"L{i} MLP"] = cache[f"blocks.{i}.hook_mlp_out"][at] @ direction
        if isinstance(model.ln_final, LayerNorm) and model.ln_final.bias is not None:
            parts["ln_final bias"] = constant
    return {label: float(value) for label, value in parts.items()}
