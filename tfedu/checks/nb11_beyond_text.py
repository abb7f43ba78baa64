"""Checkers for notebooks/11_beyond_text.ipynb: patches, the ViT from the learner's parts, the mel filterbank and the
Conformer's convolution module.

Four exercises, each checked against tfedu's reference after first trying the known mistakes:

- 11.1 ``patchify(images, patch_size) -> (batch, n_patches, channels * P * P)``: each patch
  flattened in the wrong order (the channel last, ``(p1 p2 c)``, or the patch's rows and columns
  swapped, ``(c p2 p1)``), the patch grid read column by column (``(w h)`` for ``(h w)``), images
  taken as channels last (batch, height, width, channels), overlapping patches (a stride smaller
  than P: too many patches), the naive ``images.reshape(batch, -1, C*P*P)`` that cuts runs of
  pixels along an image row instead of squares, height split as (P, H/P) (strided samples, not
  squares), the channel axis left in front of the grid, the channels dropped from each patch,
  the output transposed (batch, patch_dim, n_patches), any other wrong shape, ``.view`` after a
  permute (use reshape), the input changed in place, a result that is no tensor. Compared exactly (a cut is a copy: no rounding) with
  ``tfedu.vision.patchify`` on images with 1 and 3 channels, non-square (8x12), P = 2 and 4; then a
  ``Linear`` on the learner's patches must equal the convolution patch embedding
  (``LinearPatchEmbedding.from_conv``). ``F.unfold``, ``nn.Unfold``, a convolution and
  ``tfedu.vision``'s patchify are refused: the cut is the exercise (``einops.rearrange`` and the
  method ``Tensor.unfold`` are allowed).
- 11.2 ``vit_forward(images, weights, patch_size, n_heads, n_layers, eps) -> (batch, n_classes)``, the ViT
  assembled from the learner's parts (11.1's patchify, 05's MultiHeadAttention, 07's FFN, layer_norm and
  pre_norm_block, brought in by ``tfedu.use_mine``; stand-ins in plain torch while it is graded), the weights a
  tfedu ViT's state dict (``vit_weights``). Compared with transformers' ViTForImageClassification with the same
  weights (four small configs: patch sizes 2 to 4, 1 to 3 channels, a non-square image, 1 to 3 layers, one with a
  residual stream of size 1e-3, where eps = 1e-5 for 1e-12 shows). Named: no class token, the class token
  appended at the end, no positions, positions added before the class token is prepended, the head on the mean
  of the tokens, no final norm, a causal mask, tanh-approximated GELU or ReLU, eps not passed, the grid read
  column by column, post-norm blocks, the convolution weight flattened channel last or reshaped instead of
  transposed, logits for every token. tfedu's ViT and Block and transformers' ViT are refused.
- 11.3 ``mel_filterbank(n_freqs, n_mels, sample_rate) -> (n_mels, n_freqs)``, HTK mel scale, no
  normalisation: edges evenly spaced in Hz instead of mel, Slaney's mel scale, a natural log with
  HTK's 2595 (the conversions do not undo each other), FFT bins spread to sample_rate instead of
  sample_rate / 2, triangles linear in mel instead of Hz, no clamp at 0, Slaney's area
  normalisation, each row rescaled to peak at 1, the output transposed, the wrong number of filters
  (n_mels + 2 edges). Compared with ``tfedu.audio.mel_filterbank(..., htk=True, norm=None)``, then
  used for a log-mel spectrogram of a chirp. librosa and torchaudio are refused.
- 11.4 ``ConvModule(d_model, kernel_size)``, the Conformer's convolution module with its residual, sub-modules
  named as ``tfedu.audio.ConformerConvModule``'s (norm, pointwise_in, depthwise, batch_norm, pointwise_out) so
  its weights load: ``x + ConformerConvModule(x)`` in eval and training mode. Named: no residual or a residual
  from the normed input, no GLU (first convolution not doubled, or its channels passed on), the GLU over time,
  its halves swapped or ungated, a dense convolution, causal or off-centre padding (the shift in frames), no
  padding, LayerNorm in BatchNorm's place or BatchNorm over time, ReLU, GELU or the sigmoid for Swish, no
  Swish, no BatchNorm, Swish before it, a transpose missed (the shape each sub-module received, recorded by
  forward pre-hooks) or done with a reshape, batch statistics in eval mode or running ones in training.
  tfedu.audio and torchaudio are refused.

The feedback after a wrong layout shows the learner's first patches of a small image whose values
are their own positions, ``torch.arange(48.).reshape(1, 2, 4, 6)`` with P = 2 (:data:`DEMO_SHAPE`).
"""

from __future__ import annotations

import itertools
import math
import types
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tfedu.checks.building_blocks import ACTIVATIONS, EINOPS, ELEMENTARY, MODULES, SOFTMAX
from tfedu.checks.core import (
    NOT_DONE_MESSAGE,
    CheckFailure,
    ExerciseNotDone,
    Hints,
    Probe,
    call_learner,
    call_on_copies,
    checker,
    describe,
    expect,
    global_names,
    globals_from_modules,
    seeded_randn,
    watch_calls,
)
from tfedu.checks.probes import CLEANUP, HELPERS, as_array, compare_outputs
import tfedu.audio as _audio
import tfedu.vision as _vision
from tfedu.vision import LinearPatchEmbedding, PatchEmbedding
from tfedu.vision import patchify as reference_patchify

# ----------------------------------------------------------------------------- 11.1 patchify

LAYOUT = (
    "patches row by row over the grid (left to right, then top to bottom), each flattened channel first, then "
    "its rows, then its columns: (batch, n_patches, channels * P * P)"
)
HOW_TO_CUT = (
    "split the height into (H/P, P) and the width into (W/P, P), the grid index outside and the position inside "
    "the patch inside; move the axes so that the two grid axes come first and each patch's channel, rows and columns "
    "last, (batch, H/P, W/P, channels, P, P); then merge the grid axes into one and the patch's three axes into "
    "one. reshape and permute do it, or a single einops.rearrange pattern that names those axes"
)
HINT_GRID_COLUMNS = (
    "your patches go down the columns of the patch grid first ((w h)): read the grid row by row, like text, "
    "left to right then top to bottom, so patch k sits at grid row k // (W/P), column k % (W/P). Put the grid's "
    "row axis before its column axis when you flatten them ((h w))"
)
HINT_PATCH_SWAPPED = (
    "inside each patch you flattened the columns before the rows ((c p2 p1): the patch transposed). Flatten "
    "the channel, then the patch's rows, then its columns ((c p1 p2)), the layout of a Conv2d weight "
    "(d_model, channels, P, P)"
)
HINT_CHANNEL_LAST_IN_PATCH = (
    "each patch is flattened with the channel last ((p1 p2 c): each pixel's channels side by side). Flatten the "
    "channel first, then the patch's rows, then its columns ((c p1 p2)), the layout of PyTorch's Conv2d weight "
    "(d_model, channels, P, P), so a Linear on your patches computes the convolution patch embedding "
    "((p1 p2 c) is the order of channels-last code, such as the original JAX ViT)"
)
HINT_CHANNEL_MIDDLE = (
    "the channel is not the first axis of your flattened patch ({order}): flatten channel first, then the "
    "patch's rows, then its columns ((c p1 p2)), the layout of a Conv2d weight (d_model, channels, P, P)"
)
HINT_NAIVE_RESHAPE = (
    "you reshaped the image straight into rows of channels * P * P numbers: reshape reads memory in order, so "
    "each of your 'patches' is a run of consecutive pixels along an image row, not a P x P square. First "
    + HOW_TO_CUT
)
HINT_SPLIT_OUTER = (
    "your patches are strided samples of the image (every (H/P)-th pixel), not P x P squares: you split a side "
    "as (P, H/P). Split it as (H/P, P): the grid index is the outer (slower) axis of the split and the position "
    "inside the patch the inner (faster) one, so that P neighbouring pixels stay together"
)
HINT_CHANNEL_NOT_MOVED = (
    "your patches mix pixels of neighbouring patches of one channel: the channel axis stayed in front of the grid "
    "axes when you flattened. Move it behind them, (batch, H/P, W/P, channels, P, P), so that each row holds one "
    "patch's P x P pixels of every channel"
)
HINT_OVERLAP = (
    "your patches overlap: {got} patches where a {H}x{W} image cut into {P}x{P} patches gives (H/P)(W/P) = {want}; "
    "a stride of {stride}, smaller than the patch size P = {P}, slides the window by {stride} pixel{s}. ViT's "
    "patches do not overlap: step the window by the patch size P (Tensor.unfold's step), or cut with reshape. "
    "(AST, the Audio Spectrogram Transformer of Gong et al. 2021, overlaps its 16x16 spectrogram "
    "patches with stride 10 on purpose, but that is a different, deliberate choice.)"
)
HINT_TRANSPOSED = (
    "your output is (batch, patch_dim, n_patches), transposed: each patch is one token, one row, so return "
    "(batch, n_patches, channels * P * P); swap the last two axes"
)
HINT_CHANNELS_LAST_INPUT = (
    "your patchify treats images as (batch, height, width, channels), channels last: it cuts correctly when given "
    "the images with their channel axis moved last. PyTorch images are channels first, (batch, channels, height, "
    "width), the "
    "layout Conv2d takes: read the channels from dim 1 and height and width from dims 2 and 3"
)
HINT_NO_CHANNELS = (
    "your patches hold {got} numbers, P * P = {pp}: each patch holds its P x P pixels of every channel, "
    "channels * P * P = {want} numbers (flatten channel, rows, columns)"
)
HINT_SHAPE = (
    "patchify(images of shape {shape}, {P}) has shape {got}, expected {want}: batch, then (H/P) * (W/P) = "
    "{h} * {w} patches ({h} rows of {w}), then channels * P * P = {dim} numbers each"
)
HINT_NOT_TENSOR = "patchify should return a torch.Tensor (batch, n_patches, channels * P * P), got {got}"
HINT_DTYPE = "patchify returned {got}, the images are {want}: a cut copies the pixels, keep their dtype"
HINT_VALUES = (
    "patchify({what}) has the right shape but patch {k} of image {b} is not the reference's: the layout is "
    + LAYOUT
)
HINT_MUTATED = "your patchify changed the caller's `{name}` in place: build the patches without writing into the images"
HINT_CALL = (
    "patchify(images, patch_size): images is a float tensor (batch, channels, height, width), channels first, "
    "with height and width multiples of patch_size, an int P; return (batch, (H/P) * (W/P), channels * P * P)"
)
HINT_VIEW = (
    "After a permute the tensor's memory is no longer in the new axis order, so .view cannot merge those axes: "
    "use .reshape (it copies when it must), or make the tensor contiguous before the .view"
)
HINT_SHORTCUT = (
    "your patchify calls {name}: the exercise is the cut itself. To write it, " + HOW_TO_CUT
    + "; Tensor.unfold on the height and width axes, with a window and a step of P, works too"
)
HINT_LINEAR = (
    "your patches are right on their own, but a Linear on them does not reproduce the convolution patch "
    "embedding (a PatchEmbedding with 3 channels, d_model 16 and P = 4, its weight reshaped into a Linear that reads "
    "your patches): largest difference "
    "{diff:.3g}"
)

SHORTCUT_NAMES = ("Unfold", "im2col", "conv2d", "Conv2d", "PatchEmbedding", "LinearPatchEmbedding", "patch_linear")
# Objects refused whatever the learner calls them (``from torch.nn.functional import unfold``): looked up in its globals.
SHORTCUT_OBJECTS = {id(F.unfold): "F.unfold", id(nn.Unfold): "nn.Unfold", id(F.conv2d): "F.conv2d",
                    id(torch.conv2d): "torch.conv2d", id(nn.Conv2d): "nn.Conv2d", id(reference_patchify): "tfedu.vision.patchify",
                    id(PatchEmbedding): "tfedu.vision.PatchEmbedding", id(LinearPatchEmbedding): "tfedu.vision.LinearPatchEmbedding"}
WATCHED = ((F, "unfold"), (F, "conv2d"), (torch, "conv2d"), (_vision, "patchify"))  # caught at run time, however reached

# The small image the feedback shows: its values are their own flat positions (channel, row, column).
DEMO_SHAPE, DEMO_P = (1, 2, 4, 6), 2
DEMO_TEXT = "one (1, 2, 4, 6) image whose pixels hold their own positions, 0 to 47 in memory order, with patch size 2"


def demo_images() -> torch.Tensor:
    return torch.arange(float(np.prod(DEMO_SHAPE))).reshape(DEMO_SHAPE)


def _grid_cut(images: torch.Tensor, P: int, grid: tuple[str, str], patch: tuple[str, ...]) -> torch.Tensor:
    """The cut with the grid flattened in ``grid`` order and each patch in ``patch`` order (names h w, c p1 p2)."""
    b, c, H, W = images.shape
    axes = {"c": 1, "h": 2, "p1": 3, "w": 4, "p2": 5}
    split = images.reshape(b, c, H // P, P, W // P, P)
    return split.permute(0, *(axes[a] for a in grid), *(axes[a] for a in patch)).reshape(b, -1, c * P * P)


SHORT_CHANNEL_LAST = "each patch flattened with the channel last ((p1 p2 c))"
SHORT_CHANNEL_MIDDLE = "the channel not the first axis of each flattened patch ({order})"
SHORT_PATCH_SWAPPED = "each patch's columns flattened before its rows ((c p2 p1): the patch transposed)"
SHORT_GRID_COLUMNS = "the patch grid read column by column ((w h)) instead of row by row ((h w))"
HINT_SEVERAL = "your patches are in the wrong order in {n} ways: {what}. The layout is " + LAYOUT


def _layout_hint(grid: tuple[str, str], patch: tuple[str, ...]) -> str:
    hints = []  # (the hint alone, a short phrase for several at once)
    order = f"({' '.join(patch)})"
    if patch[0] != "c":
        hints.append((HINT_CHANNEL_LAST_IN_PATCH, SHORT_CHANNEL_LAST) if patch[-1] == "c"
                     else (HINT_CHANNEL_MIDDLE.format(order=order), SHORT_CHANNEL_MIDDLE.format(order=order)))
    if [a for a in patch if a != "c"] == ["p2", "p1"]:
        hints.append((HINT_PATCH_SWAPPED, SHORT_PATCH_SWAPPED))
    if grid == ("w", "h"):
        hints.append((HINT_GRID_COLUMNS, SHORT_GRID_COLUMNS))
    if len(hints) == 1:
        return hints[0][0]
    return HINT_SEVERAL.format(n=len(hints), what="; ".join(short for _, short in hints))


def layout_mistakes(images: torch.Tensor, P: int) -> list[tuple[str, torch.Tensor]]:
    """(hint, wrong patches) for every wrong order of the grid and of a patch, fewest mistakes first, then the rest."""
    variants = []
    for grid in (("h", "w"), ("w", "h")):
        for patch in itertools.permutations(("c", "p1", "p2")):
            if (grid, patch) != (("h", "w"), ("c", "p1", "p2")):
                hint = _layout_hint(grid, patch)
                variants.append((hint.startswith("your patches are in the wrong order in"), hint,
                                 _grid_cut(images, P, grid, patch)))
    variants.sort(key=lambda v: v[0])
    b, c, H, W = images.shape
    interleaved = images.reshape(b, c, P, H // P, P, W // P).permute(0, 3, 5, 1, 2, 4).reshape(b, -1, c * P * P)
    unmoved = images.reshape(b, c, H // P, P, W // P, P).permute(0, 1, 2, 4, 3, 5).reshape(b, -1, c * P * P)
    return [(hint, wrong) for _, hint, wrong in variants] + [
        (HINT_NAIVE_RESHAPE, images.reshape(b, -1, c * P * P)),
        (HINT_SPLIT_OUTER, interleaved),
        (HINT_CHANNEL_NOT_MOVED, unmoved),
    ]


def overlapping_cut(images: torch.Tensor, P: int, stride: int) -> torch.Tensor:
    """Patches P x P taken every ``stride`` pixels (overlapping when stride < P), row by row, (c p1 p2)."""
    windows = images.unfold(2, P, stride).unfold(3, P, stride)  # b c rows cols P P
    return windows.permute(0, 2, 3, 1, 4, 5).flatten(1, 2).flatten(2)


def _same(a: Any, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a.detach().cpu().to(b.dtype), b))


def _rows(t: torch.Tensor, n: int = 2) -> str:
    return str([[int(v) if float(v).is_integer() else float(v) for v in row] for row in t[0, :n].tolist()])


def demo_text(demo: Any) -> str:
    """The learner's first patches of the demo image against the reference's, or "" when they cannot be shown."""
    want = reference_patchify(demo_images(), DEMO_P)
    if not isinstance(demo, torch.Tensor) or demo.shape != want.shape or _same(demo, want):
        return ""
    return f". Try it on {DEMO_TEXT}: your first two patches are {_rows(demo)}, expected {_rows(want)}"


def channels_last_hint(channels_last: Any, images: torch.Tensor, P: int) -> str | None:
    """The hint when ``channels_last``, the learner's answer for ``images.permute(0, 2, 3, 1)``, cuts ``images`` right."""
    if _same(channels_last, reference_patchify(images, P)):
        return HINT_CHANNELS_LAST_INPUT
    if any(_same(channels_last, wrong) for _, wrong in layout_mistakes(images, P)):
        return HINT_CHANNELS_LAST_INPUT + "; and flatten each patch channel first, then its rows, then its columns ((c p1 p2))"
    return None


def diagnose_patchify(got: Any, images: torch.Tensor, P: int, *, channels_last: Any = None, demo: Any = None) -> None:
    """Raise CheckFailure naming what is wrong with ``got`` = patchify(images, P); shared with the hidden test.

    ``channels_last`` is the learner's answer for ``images.permute(0, 2, 3, 1)`` (None if it raised),
    ``demo`` its answer for :func:`demo_images` (None if it raised): both only sharpen the feedback.
    """
    want = reference_patchify(images, P)
    b, c, H, W = images.shape
    if isinstance(got, np.ndarray):
        got = torch.from_numpy(got)
    if not isinstance(got, torch.Tensor):
        raise CheckFailure(HINT_NOT_TENSOR.format(got=describe(got)))
    if type(got) is not torch.Tensor:
        got = got.as_subclass(torch.Tensor)  # never trust a subclass's overridden comparisons
    if _same(got, want):
        if got.dtype != want.dtype:
            raise CheckFailure(HINT_DTYPE.format(got=got.dtype, want=want.dtype))
        return
    for hint, wrong in layout_mistakes(images, P):
        if _same(got, wrong) and not _same(wrong, want):
            raise CheckFailure(hint + demo_text(demo))
    if _same(got, want.transpose(1, 2)):
        raise CheckFailure(HINT_TRANSPOSED)
    for stride in range(1, P):
        overlap = overlapping_cut(images, P, stride)
        if got.dim() == 3 and got.shape[1] == overlap.shape[1] and got.shape[1] > want.shape[1]:
            raise CheckFailure(HINT_OVERLAP.format(got=got.shape[1], H=H, W=W, P=P, want=want.shape[1], stride=stride,
                                                   s="s" if stride > 1 else ""))
    hint = channels_last_hint(channels_last, images, P)
    if hint:
        raise CheckFailure(hint)
    if got.shape != want.shape:
        if got.dim() == 3 and got.shape[:2] == want.shape[:2] and got.shape[2] == P * P and c > 1:
            raise CheckFailure(HINT_NO_CHANNELS.format(got=got.shape[2], pp=P * P, want=want.shape[2]))
        raise CheckFailure(HINT_SHAPE.format(shape=tuple(images.shape), P=P, got=tuple(got.shape), want=tuple(want.shape),
                                             h=H // P, w=W // P, dim=c * P * P))
    if got.dtype != want.dtype:
        raise CheckFailure(HINT_DTYPE.format(got=got.dtype, want=want.dtype))
    wrong_rows = (got.detach().cpu() != want).flatten(2).any(-1).nonzero()  # (image, patch) pairs that differ
    image, patch = (int(i) for i in wrong_rows[0])
    raise CheckFailure(HINT_VALUES.format(what=f"images of shape {tuple(images.shape)}, {P}", k=patch, b=image)
                       + demo_text(demo))


def _quiet_call(fn: Any, images: torch.Tensor, P: int) -> Any:
    """fn(images, P), or None when it raises: an extra call that only sharpens feedback."""
    try:
        return fn(images.clone(), P)
    except Exception:
        return None


def _refuse_shortcuts(fn: Any) -> None:
    names = global_names(fn)
    used = sorted(names & set(SHORTCUT_NAMES))
    scope = getattr(fn, "__globals__", {})
    used += sorted(SHORTCUT_OBJECTS[id(scope[n])] for n in names if n in scope and id(scope[n]) in SHORTCUT_OBJECTS
                   and n not in used)
    used += [f"tfedu.vision (as {n})" for n in sorted(names) if n in scope and scope[n] is _vision]
    expect(not used, HINT_SHORTCUT.format(name=", ".join(used)))


def _check_patchify_call(fn: Any, images: torch.Tensor, P: int) -> None:
    try:
        with watch_calls(*WATCHED) as called:
            got = call_on_copies(fn, {"images": images, "patch_size": P}, name="patchify",
                                 mutated_hint=HINT_MUTATED, error_hint=HINT_CALL)
    except ExerciseNotDone:
        raise
    except CheckFailure as failure:
        hint = channels_last_hint(_quiet_call(fn, images.permute(0, 2, 3, 1), P), images, P)
        if hint:
            raise CheckFailure(hint) from None
        if "view size is not compatible" in str(failure):
            raise CheckFailure(f"{failure}. {HINT_VIEW}") from None
        raise
    expect(not called, HINT_SHORTCUT.format(name=", ".join(sorted(set(called)))))
    if _same(got, reference_patchify(images, P)) and got.dtype == images.dtype:
        return
    diagnose_patchify(got, images, P, channels_last=_quiet_call(fn, images.permute(0, 2, 3, 1), P),
                      demo=_quiet_call(fn, demo_images(), DEMO_P))


# (seed, batch, channels, height, width, P): RGB first (every wrong flattening order shows), non-square grids
# (a column-by-column grid shows), then grey, a 1 x 1 grid, and square images.
PATCHIFY_CASES = ((0, 2, 3, 8, 12, 4), (1, 2, 3, 8, 12, 2), (2, 3, 1, 12, 8, 4), (3, 1, 1, 8, 8, 2),
                  (4, 2, 3, 4, 4, 4), (5, 1, 3, 6, 10, 2))


@checker("cutting images into patches")
def check_patchify(patchify) -> None:
    """Check a learner's ``patchify(images, patch_size) -> (batch, n_patches, channels * P * P)``.

    Exactly against ``tfedu.vision.patchify`` on :data:`PATCHIFY_CASES` (a cut copies, so no
    tolerance), then a ``Linear`` on the learner's patches against the convolution patch embedding
    with the same weights. F.unfold, nn.Unfold, convolutions and tfedu.vision's patchify are refused.
    """
    _refuse_shortcuts(patchify)
    for seed, batch, channels, height, width, P in PATCHIFY_CASES:
        _check_patchify_call(patchify, seeded_randn(seed, batch, channels, height, width), P)
    with torch.random.fork_rng():  # the learner's random state stays as it was
        torch.manual_seed(0)
        conv = PatchEmbedding(in_channels=3, d_model=16, patch_size=4)
    linear = LinearPatchEmbedding.from_conv(conv, patchify=patchify)  # square patches: called with an int P
    images = seeded_randn(10, 2, 3, 8, 12)
    with torch.no_grad():
        want = conv(images)
        got = call_learner(linear, images, name="the Linear patch embedding on your patchify",
                           error_hint=HINT_CALL)
    diff = (got - want).abs().max().item()
    expect(diff <= 1e-5, HINT_LINEAR.format(diff=diff))


# ----------------------------------------------------------------------------- probes

# patchify: fresh sizes (1-3 channels, P from 2 to 4, grids of 1-4 patches a side, rarely square), float32 images;
# the run also tries each image channels last and the demo image, for sharper feedback (None where it raises).
PATCHIFY_PROBE_RUN = HELPERS + """\
def _quiet(_images, _p):
    try:
        return _array(patchify(_images, _p))
    except Exception:
        return None
_results = [_call(patchify, torch.from_numpy(_img), _p) for _img, _p in zip(inputs['images'], inputs['patch_sizes'])]
outputs = {'returned': [_kind(_r) for _r in _results], 'mutated': _MUTATED, 'patches': [_array(_r) for _r in _results],
           'channels_last': [_quiet(torch.from_numpy(np.ascontiguousarray(np.moveaxis(_img, 1, -1))), _p)
                             for _img, _p in zip(inputs['images'], inputs['patch_sizes'])],
           'demo': _quiet(torch.arange(48.).reshape(1, 2, 4, 6), 2)}
del _quiet, _results
""" + CLEANUP


def _patchify_probe_inputs(rng: np.random.Generator) -> dict:
    images, sizes = [], []
    for channels in (3, 1, int(rng.integers(2, 4))):
        P = int(rng.integers(2, 5))
        rows, cols = int(rng.integers(1, 5)), int(rng.integers(2, 5))
        if rows == cols:  # a non-square grid, so a column-by-column read shows
            rows = cols - 1
        images.append(rng.standard_normal((int(rng.integers(1, 4)), channels, rows * P, cols * P)).astype(np.float32))
        sizes.append(P)
    return {"images": images, "patch_sizes": sizes}


def _patchify_probe_reference(inputs: dict) -> dict:
    patches = [as_array(reference_patchify(torch.from_numpy(img), P)) for img, P in zip(inputs["images"], inputs["patch_sizes"])]
    return {"returned": ["tensor"] * len(patches), "patches": patches, "inputs": inputs}


def _tensor(value: Any) -> Any:
    return torch.from_numpy(np.array(value)) if isinstance(value, (np.ndarray, list)) else value


def _compare_patchify(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="patchify")
    if problem:
        return problem
    patches, inputs = outputs.get("patches"), expected["inputs"]
    channels_last = outputs.get("channels_last")
    if not isinstance(patches, list) or len(patches) != len(inputs["images"]):
        return "patchify's hidden test did not run every case"
    if not isinstance(channels_last, list) or len(channels_last) != len(patches):
        channels_last = [None] * len(patches)
    for got, cl, image, P in zip(patches, channels_last, inputs["images"], inputs["patch_sizes"]):
        try:
            diagnose_patchify(_tensor(got), torch.from_numpy(image), P, channels_last=_tensor(cl),
                              demo=_tensor(outputs.get("demo")))
        except CheckFailure as failure:
            return str(failure)
    return None


PATCHIFY_FORBIDDEN = ("tfedu.vision", "torch.nn.functional.unfold", "torch.nn.Unfold", "torch.nn.modules.fold",
                      "torch.nn.functional.conv2d", "torch.conv2d", "torch.nn.Conv2d", "torch.nn.modules.conv")


# ----------------------------------------------------------------------------- 11.2 the ViT from your parts

# The names of a ViT's weights as exercise 11.2 takes them: tfedu's ViT's state dict (tfedu.vision.vit_from_hf maps
# Hugging Face's names onto them), the patch embedding's weight in a convolution's shape (d_model, channels, P, P).
VIT_BLOCK_NAMES = ("ln1.weight", "ln1.bias", "attn.W_Q.weight", "attn.W_Q.bias", "attn.W_K.weight", "attn.W_K.bias",
                   "attn.W_V.weight", "attn.W_V.bias", "attn.W_O.weight", "attn.W_O.bias", "ln2.weight", "ln2.bias",
                   "mlp.W_in.weight", "mlp.W_in.bias", "mlp.W_out.weight", "mlp.W_out.bias")
# The parts of earlier notebooks the notebook brings in (tfedu.use_mine) for 11.2, and their references.
EARLIER_PARTS = {"5.3": "MultiHeadAttention", "7.1": "FFN", "7.2": "layer_norm", "7.4": "pre_norm_block"}


def reference_parts() -> dict[str, Any]:
    """The references of :data:`EARLIER_PARTS`, under the names the notebook gives them."""
    from tfedu import attention as tfa
    from tfedu.checks import nb07_transformer_block as nb07

    return {"MultiHeadAttention": tfa.MultiHeadAttention, "FFN": nb07.reference_ffn,
            "layer_norm": nb07.reference_layer_norm, "pre_norm_block": nb07.reference_pre_norm_block}


def vit_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A tfedu ``ViT``'s weights as exercise 11.2 takes them: its state dict, detached, with the patch embedding's
    weight in a convolution's shape (d_model, channels, P, P) whether the model embeds by convolution or by a
    linear map of its patches (``LinearPatchEmbedding``)."""
    weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
    conv = weights["patch_embed.proj.weight"]
    if conv.dim() == 2:
        weights["patch_embed.proj.weight"] = conv.reshape(conv.shape[0], model.cfg.in_channels, *model.cfg.patch_size)
    return weights


def _ln(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def vit_variant(images: torch.Tensor, weights: dict, patch_size: int, n_heads: int, n_layers: int, eps: float,
                mistake: str | None = None) -> torch.Tensor:
    """The ViT's logits (float64) with these weights, or with one of the known mistakes (:data:`VIT_MISTAKES`)."""
    W = {name: torch.as_tensor(value).detach().double() for name, value in weights.items()}
    images = torch.as_tensor(images).detach().double()
    P, d = int(patch_size), W["cls_token"].shape[-1]
    patches = _grid_cut(images, P, ("w", "h") if mistake == "columns" else ("h", "w"), ("c", "p1", "p2"))
    conv = W["patch_embed.proj.weight"]  # d_model channels P P
    flat = {"weight (p1 p2 c)": lambda: conv.permute(0, 2, 3, 1).reshape(d, -1).T,
            "weight reshaped": lambda: conv.reshape(-1, d)}.get(mistake, lambda: conv.reshape(d, -1).T)()
    tokens = patches @ flat + W["patch_embed.proj.bias"]  # batch n_patches d_model
    batch, n = tokens.shape[:2]
    cls, pos = W["cls_token"].expand(batch, 1, d), W["pos_embed"]
    resid = {
        "no pos": lambda: torch.cat([cls, tokens], 1),
        "pos before cls": lambda: torch.cat([cls, tokens + pos[:, 1:]], 1),
        "pos before cls, first rows": lambda: torch.cat([cls, tokens + pos[:, :n]], 1),
        "cls last": lambda: torch.cat([tokens, cls], 1) + pos, "cls last, read last": lambda: torch.cat([tokens, cls], 1) + pos,
        "no cls": lambda: tokens + pos[:, 1:], "no cls, first rows": lambda: tokens + pos[:, :n],
        "no cls, mean": lambda: tokens + pos[:, 1:],
    }.get(mistake, lambda: torch.cat([cls, tokens], 1) + pos)()
    used_eps = {"eps 1e-5": 1e-5, "eps 1e-12": 1e-12}.get(mistake, eps)
    T = resid.shape[1]
    for i in range(n_layers):
        w = {name: W[f"blocks.{i}.{name}"] for name in VIT_BLOCK_NAMES}

        def attn(x: torch.Tensor) -> torch.Tensor:
            q, k, v = ((x @ w[f"attn.{m}.weight"].T + w[f"attn.{m}.bias"]).unflatten(-1, (n_heads, -1)).transpose(1, 2)
                       for m in ("W_Q", "W_K", "W_V"))
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            if mistake == "causal":
                scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            z = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
            return z @ w["attn.W_O.weight"].T + w["attn.W_O.bias"]

        def mlp(x: torch.Tensor) -> torch.Tensor:
            h = x @ w["mlp.W_in.weight"].T + w["mlp.W_in.bias"]
            h = {"tanh": lambda: F.gelu(h, approximate="tanh"), "relu": lambda: torch.relu(h)}.get(mistake, lambda: F.gelu(h))()
            return h @ w["mlp.W_out.weight"].T + w["mlp.W_out.bias"]

        def ln1(x: torch.Tensor) -> torch.Tensor:
            return _ln(x, w["ln1.weight"], w["ln1.bias"], used_eps)

        def ln2(x: torch.Tensor) -> torch.Tensor:
            return _ln(x, w["ln2.weight"], w["ln2.bias"], used_eps)

        if mistake == "post-norm":
            resid = ln1(resid + attn(resid))
            resid = ln2(resid + mlp(resid))
        else:
            resid = resid + attn(ln1(resid))
            resid = resid + mlp(ln2(resid))

    def final(x: torch.Tensor) -> torch.Tensor:
        return x if mistake == "no final norm" else _ln(x, W["ln_final.weight"], W["ln_final.bias"], used_eps)

    state = {"mean of patches": lambda: final(resid[:, 1:].mean(1)),
             "mean of patches, normed first": lambda: final(resid[:, 1:]).mean(1),
             "mean of all": lambda: final(resid).mean(1), "no cls, mean": lambda: final(resid).mean(1),
             "cls last, read last": lambda: final(resid[:, -1])}.get(mistake, lambda: final(resid[:, 0]))()
    return state @ W["head.weight"].T + W["head.bias"]


def reference_vit_forward(images: torch.Tensor, weights: dict, patch_size: int, n_heads: int, n_layers: int,
                          eps: float) -> torch.Tensor:
    """Exercise 11.2's answer: the logits (batch, n_classes) of the ViT with these weights (tfedu's names), in the
    images' dtype; equal to transformers' ViTForImageClassification with the same weights (checked)."""
    return vit_variant(images, weights, patch_size, n_heads, n_layers, eps).to(images.dtype)


HINT_VIT_CALL = (
    "vit_forward(images, weights, patch_size, n_heads, n_layers, eps): images (batch, channels, height, width), "
    "weights a dict of tensors under a tfedu ViT's names (its state dict), patch_size an int P, n_heads, n_layers "
    "and eps numbers; return the logits (batch, n_classes)"
)
HINT_VIT_NOT_TENSOR = "vit_forward should return the logits as a torch.Tensor (batch, n_classes), got {got}"
HINT_VIT_EVERY_TOKEN = (
    "your vit_forward returns {got}: logits for every token. The ViT classifies the image from one vector, the class "
    "token's final state (row 0 of the sequence, after the final LayerNorm): return (batch, n_classes) = {want}"
)
HINT_VIT_SHAPE = "vit_forward on {what} returned shape {got}, expected (batch, n_classes) = {want}"
HINT_VIT_NAN = "your logits on {what} hold NaN or inf"
HINT_VIT_COLUMNS = (
    "your patch tokens go down the columns of the patch grid first: the ViT reads the grid row by row, like text "
    "(exercise 11.1's order), and its position embeddings were learned for that order. Cut the patches with your "
    "patchify as it is"
)
HINT_VIT_WEIGHT_ORDER = (
    "your patch embedding flattens the convolution's weight (d_model, channels, P, P) with the channel last, while "
    "your patches are flattened channel first: each weight then meets the wrong pixel. Flatten the weight in its "
    "own order, channel, then rows, then columns, the order of exercise 11.1's patches"
)
HINT_VIT_WEIGHT_RESHAPED = (
    "you reshaped the convolution's weight (d_model, channels, P, P) straight to (channels * P * P, d_model): a "
    "reshape keeps the memory order, so that is not the weight's transpose, and every output feature mixes pieces "
    "of several filters. Flatten each filter to a row, (d_model, channels * P * P), then transpose that matrix"
)
HINT_VIT_NO_CLS = (
    "your sequence has no class token: put the learned vector cls_token (1, 1, d_model) in front of the patch "
    "tokens, one copy per image, so the sequence holds 1 + n_patches tokens; then add pos_embed, whose "
    "1 + n_patches rows cover it, and read the head from that token's final state (Dosovitskiy et al.'s eq. 1 and 4)"
)
HINT_VIT_CLS_LAST = (
    "your class token comes after the patches: it goes in front, at position 0 (BERT's [CLS]), so that row 0 of "
    "pos_embed is added to it and the head reads row 0. Put it first, then the patches in grid order"
)
HINT_VIT_POS_BEFORE_CLS = (
    "you added the positions to the patch tokens before putting the class token in front: the class token then gets "
    "no position (or the patches get the wrong rows). pos_embed (1, 1 + n_patches, d_model) has one row per token of "
    "the whole sequence, row 0 for the class token: concatenate first, then add it"
)
HINT_VIT_NO_POS = (
    "your tokens get no position embeddings: add pos_embed to the sequence (class token and patches) before the "
    "first block. Without them the blocks see a bag of patches: attention without positions cannot tell where a "
    "patch came from (notebook 06)"
)
HINT_VIT_CAUSAL = (
    "your blocks attend with a causal mask: the ViT is an encoder, every token attends to every token, before and "
    "after it (the class token, at position 0, would otherwise see only itself). Call the attention without a mask"
)
HINT_VIT_TANH = (
    "your feed-forward layers use the tanh approximation of GELU (GPT-2's): the ViT (and Hugging Face's, "
    "hidden_act 'gelu') uses the exact GELU, with the error function. Build your FFN with the activation 'gelu'"
)
HINT_VIT_RELU = (
    "your feed-forward layers use ReLU: the ViT's MLP uses the exact GELU (Dosovitskiy et al., section 3.1). Build "
    "your FFN with the activation 'gelu'"
)
HINT_VIT_EPS = (
    "your LayerNorms do not use the eps you are given ({eps:g}): they add {used:g} to the variance (a layer_norm's "
    "default, 1e-5?). Hugging Face's ViT uses 1e-12; where the residual stream's variance is small (about 1e-6 in "
    "one of these cases) the two normalise very differently. Pass eps to every LayerNorm, the final one too"
)
HINT_VIT_POST_NORM = (
    "your blocks normalise after each residual addition (post-norm, the 2017 paper's Add & Norm): the ViT's blocks "
    "are pre-norm, each sub-layer reads a LayerNorm of the stream and adds its output to the stream unnormalised "
    "(exercise 7.4's block)"
)
HINT_VIT_NO_FINAL = (
    "your head reads the class token's state without the final LayerNorm: the ViT normalises the last block's "
    "output (ln_final's weight and bias, with eps) before the classification head (eq. 4)"
)
HINT_VIT_MEAN = (
    "your head reads the mean over the tokens: the ViT classifies from the class token alone, the final state of "
    "row 0 after the final LayerNorm (eq. 4). Averaging the patch tokens is another design (global average pooling, "
    "used by some later ViTs), not this model's"
)
HINT_VIT_VALUES = (
    "vit_forward on {what} differs from transformers' ViTForImageClassification with the same weights (largest "
    "difference {diff:.3g} in logits up to {scale:.3g}). The model: patch tokens (your patches times the flattened "
    "convolution weight, plus its bias), the class token in front, the positions added, the pre-norm blocks without "
    "a mask, then the final LayerNorm on the class token's state and the head"
)
HINT_VIT_SHORTCUT = (
    "your vit_forward uses {name}: the exercise is to assemble the model yourself from your parts (your patchify, "
    "attention, FFN, layer_norm and pre_norm_block), reading the weights from the dict"
)
HINT_VIT_MUTATED = "your vit_forward changed the caller's images in place: compute the tokens without writing into them"

VIT_MISTAKES = (  # (mistake, hint): the names of vit_variant
    ("columns", HINT_VIT_COLUMNS), ("weight (p1 p2 c)", HINT_VIT_WEIGHT_ORDER), ("weight reshaped", HINT_VIT_WEIGHT_RESHAPED),
    ("no cls", HINT_VIT_NO_CLS), ("no cls, first rows", HINT_VIT_NO_CLS), ("no cls, mean", HINT_VIT_NO_CLS),
    ("cls last", HINT_VIT_CLS_LAST), ("cls last, read last", HINT_VIT_CLS_LAST),
    ("pos before cls", HINT_VIT_POS_BEFORE_CLS), ("pos before cls, first rows", HINT_VIT_POS_BEFORE_CLS),
    ("no pos", HINT_VIT_NO_POS), ("causal", HINT_VIT_CAUSAL), ("tanh", HINT_VIT_TANH), ("relu", HINT_VIT_RELU),
    ("eps 1e-5", HINT_VIT_EPS), ("eps 1e-12", HINT_VIT_EPS), ("post-norm", HINT_VIT_POST_NORM),
    ("no final norm", HINT_VIT_NO_FINAL), ("mean of patches", HINT_VIT_MEAN),
    ("mean of patches, normed first", HINT_VIT_MEAN), ("mean of all", HINT_VIT_MEAN),
)
# Logits match within this fraction of their largest size: a float32 forward differs from float64 by about 4e-7 of
# it, the nearest named mistake (tanh for the exact GELU) by 8e-5 or more on every case below (measured).
VIT_RTOL = 2e-5


def _vit_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    tol = VIT_RTOL * max(1.0, float(want.abs().max()))
    return got.shape == want.shape and bool(((got.double() - want.double()).abs() <= tol).all())


def describe_vit_case(case: dict) -> str:
    images = case["images"]
    shape = tuple(images.shape)
    small = ", a small residual stream" if case.get("small") else ""
    return (f"images {shape}, patch_size {case['patch_size']}, {case['n_heads']} heads, {case['n_layers']} "
            f"layer{'s' if case['n_layers'] > 1 else ''}, eps {case['eps']:g}{small}")


def diagnose_vit(got: Any, case: dict, want: torch.Tensor | None = None) -> None:
    """Raise CheckFailure naming what is wrong with ``got``, the learner's logits on ``case``; shared with the probe.

    ``case``: images, weights (tfedu's names), patch_size, n_heads, n_layers, eps; ``want``: the logits to match
    (transformers' in the checker), by default :func:`vit_variant`'s."""
    args = (case["images"], case["weights"], case["patch_size"], case["n_heads"], case["n_layers"], case["eps"])
    reference = vit_variant(*args)
    want = reference if want is None else want
    what = describe_vit_case(case)
    if isinstance(got, np.ndarray):
        got = torch.from_numpy(got)
    expect(isinstance(got, torch.Tensor), HINT_VIT_NOT_TENSOR.format(got=describe(got)))
    got = got.detach().cpu()
    if got.shape != want.shape:
        batch, n_classes = want.shape
        if got.dim() == 3 and got.shape[0] == batch and got.shape[2] == n_classes:
            raise CheckFailure(HINT_VIT_EVERY_TOKEN.format(got=tuple(got.shape), want=tuple(want.shape)))
        raise CheckFailure(HINT_VIT_SHAPE.format(what=what, got=tuple(got.shape), want=tuple(want.shape)))
    expect(bool(torch.isfinite(got).all()), HINT_VIT_NAN.format(what=what))
    if _vit_close(got, want):
        return
    for mistake, hint in VIT_MISTAKES:
        if mistake == "eps 1e-12" and case["eps"] == 1e-12:
            continue
        wrong = vit_variant(*args, mistake=mistake)
        if _vit_close(got, wrong) and not _vit_close(wrong, reference):
            raise CheckFailure(hint.format(eps=case["eps"], used=1e-12 if mistake == "eps 1e-12" else 1e-5))
    diff = float((got.double() - want.double()).abs().max())
    raise CheckFailure(HINT_VIT_VALUES.format(what=what, diff=diff, scale=float(want.abs().max())))


# The checker's models: transformers' ViTForImageClassification built from these configs (no download), every weight
# moved off its initialisation; (seed, small, config). small: the embeddings and images scaled by 1e-3, so the first
# LayerNorm sees a variance near 1e-6, where eps = 1e-5 instead of 1e-12 shows.
VIT_CASES = (
    (0, False, dict(image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_labels=10)),
    (1, False, dict(image_size=12, patch_size=4, num_channels=3, hidden_size=24, num_hidden_layers=3,
                    num_attention_heads=2, num_labels=5)),
    (2, False, dict(image_size=(8, 12), patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                    num_attention_heads=2, num_labels=3)),
    (3, True, dict(image_size=6, patch_size=3, num_channels=2, hidden_size=16, num_hidden_layers=2,
                   num_attention_heads=4, num_labels=4)),
)


def hf_vit_case(seed: int, small: bool, config: dict) -> tuple[nn.Module, dict]:
    """A transformers ViTForImageClassification (float32, random weights, eval mode) and exercise 11.2's inputs for it."""
    import transformers

    from tfedu.vision import vit_from_hf

    config = {**config, "intermediate_size": 4 * config["hidden_size"]}  # exercise 7.1's FFN is 4 d_model wide
    with torch.random.fork_rng(devices=[]):  # the learner's random state stays as it was
        torch.manual_seed(seed)
        hf = transformers.ViTForImageClassification(transformers.ViTConfig(**config)).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.add_(0.3 * torch.randn_like(p))
                if small and "embeddings" in name:
                    p.mul_(1e-3)
        size = config["image_size"]
        height, width = (size, size) if isinstance(size, int) else size
        images = torch.randn(3, config["num_channels"], height, width) * (1e-3 if small else 1.0)
    weights = vit_weights(vit_from_hf(hf))
    return hf, {"images": images, "weights": weights, "patch_size": config["patch_size"],
                "n_heads": config["num_attention_heads"], "n_layers": config["num_hidden_layers"],
                "eps": hf.config.layer_norm_eps, "small": small}


# The answer assembles the model from the parts: tfedu's ViT, its blocks and layers, and transformers' ViT are what
# it rebuilds (the parts of 5.3, 7.1, 7.2, 7.4 and 11.1 are stand-ins in plain torch while it is graded).
VIT_FORBIDDEN = ("tfedu.vision", "tfedu.layers", "tfedu.model", "transformers.models.vit.modeling_vit")
VIT_BUILDS = frozenset({"torch.nn.functional.layer_norm", "torch.nn.LayerNorm", "torch.nn.GELU",
                        "torch.nn.functional.scaled_dot_product_attention"})
VIT_SHORTCUT_NAMES = ("ViT", "vit_from_hf", "ViTForImageClassification", "ViTModel", "Block", "PatchEmbedding",
                      "LinearPatchEmbedding")


def _refuse_vit_shortcuts(fn: Any) -> None:
    names = global_names(fn)
    scope = getattr(fn, "__globals__", {})
    used = sorted(names & set(VIT_SHORTCUT_NAMES))
    used += sorted(f"{n} (tfedu.vision)" for n in names if n in scope and n not in used and scope[n] is _vision)
    used += sorted(f"{n} (transformers)" for n in names if n in scope and n not in used
                   and getattr(scope[n], "__name__", "").split(".")[0] == "transformers")
    expect(not used, HINT_VIT_SHORTCUT.format(name=", ".join(used)))


@checker("the ViT from your parts")
def check_vit_forward(vit_forward) -> None:
    """Check a learner's ``vit_forward(images, weights, patch_size, n_heads, n_layers, eps) -> (batch, n_classes)``.

    On the models of :data:`VIT_CASES`, against transformers' ViTForImageClassification with the same weights
    (float32 logits, within :data:`VIT_RTOL` of their size), after trying the known mistakes (:data:`VIT_MISTAKES`).
    tfedu's ViT and Block and transformers' ViT are refused, by name and at run time.
    """
    import transformers

    from tfedu import layers

    _refuse_vit_shortcuts(vit_forward)
    watched = ((_vision.ViT, "forward"), (_vision.ViT, "features"), (_vision.ViT, "embed"), (layers.Block, "forward"),
               (transformers.ViTForImageClassification, "forward"), (transformers.ViTModel, "forward"))
    for seed, small, config in VIT_CASES:
        hf, case = hf_vit_case(seed, small, config)
        with torch.no_grad():
            want = hf(pixel_values=case["images"]).logits
        torch.testing.assert_close(vit_variant(**{k: case[k] for k in ("images", "weights", "patch_size", "n_heads",
                                                                          "n_layers", "eps")}).float(),
                                   want, rtol=0, atol=VIT_RTOL * max(1.0, float(want.abs().max())))  # our own guard
        images = case["images"].clone()
        with watch_calls(*watched) as called:
            got = call_learner(vit_forward, images, {k: v.clone() for k, v in case["weights"].items()},
                               case["patch_size"], case["n_heads"], case["n_layers"], case["eps"], name="vit_forward",
                               error_hint=HINT_VIT_CALL)
        expect(not called, HINT_VIT_SHORTCUT.format(name=", ".join(sorted(set(called)))))
        expect(torch.equal(images, case["images"]), HINT_VIT_MUTATED)
        diagnose_vit(got, case, want)


# The probe: fresh models drawn as plain data (tfedu's names, every weight N(0, 0.3), the norms' gains 1 + N(0, 0.3)),
# patch sizes 2-4, 1-3 channels, grids of 2-3 patches a side, 1-2 layers; the last case with a small residual stream.
VIT_PROBE_RUN = HELPERS + """\
_results = []
for _case in inputs['cases']:
    _weights = {_name: torch.from_numpy(_value) for _name, _value in _case['weights'].items()}
    _results.append(_call(vit_forward, torch.from_numpy(_case['images']), _weights, _case['patch_size'],
                          _case['n_heads'], _case['n_layers'], _case['eps']))
outputs = {'returned': [_kind(_r) for _r in _results], 'mutated': _MUTATED, 'logits': [_array(_r) for _r in _results]}
del _results, _case, _weights
""" + CLEANUP


def make_vit_case(rng: np.random.Generator, small: bool = False) -> dict:
    """One ViT as plain data: weights under tfedu's names (float32 arrays), images, the config numbers."""
    P, channels = int(rng.integers(2, 5)), int(rng.choice([1, 3, 2]))
    rows, cols = int(rng.integers(2, 4)), int(rng.integers(2, 4))
    n_heads = int(rng.choice([2, 4]))
    d, n_layers, n_classes = n_heads * int(rng.choice([4, 6])), int(rng.integers(1, 3)), int(rng.integers(3, 8))
    n = rows * cols
    shapes = {"cls_token": (1, 1, d), "pos_embed": (1, n + 1, d), "patch_embed.proj.weight": (d, channels, P, P),
              "patch_embed.proj.bias": (d,)}
    for i in range(n_layers):
        for name in VIT_BLOCK_NAMES:
            kind = name.split(".")[-1]
            if name.startswith("mlp.W_in"):
                shape = (4 * d, d) if kind == "weight" else (4 * d,)
            elif name.startswith("mlp.W_out"):
                shape = (d, 4 * d) if kind == "weight" else (d,)
            else:
                shape = (d, d) if kind == "weight" and name.startswith("attn") else (d,)
            shapes[f"blocks.{i}.{name}"] = shape
    shapes.update({"ln_final.weight": (d,), "ln_final.bias": (d,), "head.weight": (n_classes, d), "head.bias": (n_classes,)})
    weights = {}
    for name, shape in shapes.items():
        value = 0.3 * rng.standard_normal(shape)
        if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
            value = value + 1.0  # a LayerNorm's gain starts at 1
        if small and name.startswith(("cls_token", "pos_embed", "patch_embed")):
            value = value * 1e-3
        weights[name] = value.astype(np.float32)
    images = rng.standard_normal((int(rng.integers(2, 4)), channels, rows * P, cols * P)) * (1e-3 if small else 1.0)
    return {"images": images.astype(np.float32), "weights": weights, "patch_size": P, "n_heads": n_heads,
            "n_layers": n_layers, "eps": float(rng.choice([1e-12, 1e-6])) if not small else 1e-12, "small": small}


def _vit_probe_inputs(rng: np.random.Generator) -> dict:
    return {"cases": [make_vit_case(rng), make_vit_case(rng), make_vit_case(rng, small=True)]}


def _vit_probe_reference(inputs: dict) -> dict:
    return {"returned": ["tensor"] * len(inputs["cases"]), "cases": inputs["cases"]}


def _compare_vit(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="vit_forward")
    if problem:
        return problem
    logits = outputs.get("logits")
    if not isinstance(logits, list) or len(logits) != len(expected["cases"]):
        return "vit_forward's hidden test did not run every case"
    for got, case in zip(logits, expected["cases"]):
        try:
            diagnose_vit(_tensor(got) if got is not None else None,
                         {**case, "images": torch.from_numpy(np.asarray(case["images"]))})
        except CheckFailure as failure:
            return str(failure)
    return None


# Exercises 5.3, 7.1, 7.2, 7.4 and 11.1 in plain torch, bound in place of the learner's while 11.2 is graded.
VIT_STANDINS = '''\
def patchify(images, patch_size):
    """Stand-in for exercise 11.1: non-overlapping P x P patches, row by row, each flattened (c p1 p2)."""
    batch, channels, height, width = images.shape
    P = patch_size
    grid = images.reshape(batch, channels, height // P, P, width // P, P).permute(0, 2, 4, 1, 3, 5)
    return grid.reshape(batch, (height // P) * (width // P), channels * P * P)


class MultiHeadAttention(torch.nn.Module):
    """Stand-in for exercise 5.3: W_Q, W_K, W_V, W_O with biases; forward(x, context=None, mask=None)."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.W_Q = torch.nn.Linear(d_model, d_model)
        self.W_K = torch.nn.Linear(d_model, d_model)
        self.W_V = torch.nn.Linear(d_model, d_model)
        self.W_O = torch.nn.Linear(d_model, d_model)

    def forward(self, x, context=None, mask=None):
        context = x if context is None else context
        split = lambda t: t.unflatten(-1, (self.n_heads, self.d_head)).transpose(1, 2)
        q, k, v = split(self.W_Q(x)), split(self.W_K(context)), split(self.W_V(context))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        z = torch.softmax(scores, dim=-1) @ v
        return self.W_O(z.transpose(1, 2).flatten(2))


class FFN(torch.nn.Module):
    """Stand-in for exercise 7.1: W_out(act(W_in x)), 4 d_model wide with biases, or SwiGLU without."""

    def __init__(self, d_model, activation="gelu", multiple_of=1):
        super().__init__()
        self.activation = activation
        if activation == "swiglu":
            self.d_mlp = -(-(8 * d_model // 3) // multiple_of) * multiple_of
            self.W_gate = torch.nn.Linear(d_model, self.d_mlp, bias=False)
            self.W_in = torch.nn.Linear(d_model, self.d_mlp, bias=False)
            self.W_out = torch.nn.Linear(self.d_mlp, d_model, bias=False)
        else:
            self.d_mlp = 4 * d_model
            self.W_in = torch.nn.Linear(d_model, self.d_mlp)
            self.W_out = torch.nn.Linear(self.d_mlp, d_model)

    def forward(self, x):
        if self.activation == "swiglu":
            return self.W_out(F.silu(self.W_gate(x)) * self.W_in(x))
        return self.W_out(F.gelu(self.W_in(x), approximate="tanh" if self.activation == "gelu_tanh" else "none"))


def layer_norm(x, weight, bias, eps=1e-5):
    """Stand-in for exercise 7.2: (x - mean) / sqrt(var + eps) * weight + bias over the last dim."""
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def pre_norm_block(resid, ln1, attn, ln2, mlp):
    """Stand-in for exercise 7.4: the two pre-norm residual updates."""
    resid = resid + attn(ln1(resid))
    return resid + mlp(ln2(resid))
'''


# ----------------------------------------------------------------------------- 11.3 mel_filterbank

HINT_MEL_CALL = (
    "mel_filterbank(n_freqs, n_mels, sample_rate): return a float tensor (n_mels, n_freqs), row m filter m's "
    "weight on each FFT bin, the bins evenly spaced from 0 to sample_rate / 2 Hz"
)
HINT_MEL_NOT_TENSOR = "mel_filterbank should return a torch.Tensor (n_mels, n_freqs), got {got}"
HINT_MEL_TRANSPOSED = (
    "your filterbank is (n_freqs, n_mels), transposed: one row per filter, (n_mels, n_freqs), so that "
    "filterbank @ power_spectrum turns (n_freqs, frames) into (n_mels, frames)"
)
HINT_MEL_ROWS = (
    "your filterbank has {got} rows for n_mels = {want}: n_mels triangles need n_mels + 2 edges (each filter "
    "uses three consecutive edges: where it starts, peaks and ends), evenly spaced in mel from mel(0) to "
    "mel(sample_rate / 2)"
)
HINT_MEL_SHAPE = "mel_filterbank({args}) has shape {got}, expected (n_mels, n_freqs) = {want}"
HINT_MEL_LINEAR_HZ = (
    "your edges are evenly spaced in Hz: space them evenly in mel, mel(f) = 2595 log10(1 + f / 700), then convert "
    "each back to Hz, f = 700 (10^(mel / 2595) - 1). On the mel scale the low filters are narrow and the high ones "
    "wide, as pitch is heard"
)
HINT_MEL_SLANEY = (
    "your edges follow Slaney's mel scale (librosa's default: linear below 1 kHz, logarithmic above); this "
    "exercise uses the HTK formula, mel(f) = 2595 log10(1 + f / 700)"
)
HINT_MEL_MIXED_LOG = (
    "your mel conversions do not undo each other: 2595 goes with log10 (mel = 2595 log10(1 + f / 700), "
    "f = 700 (10^(mel / 2595) - 1)); with the natural log the constant is 1127. Check that mel_to_hz(hz_to_mel(f)) "
    "gives f back"
)
HINT_MEL_BINS_TO_SR = (
    "your FFT bins run from 0 to sample_rate: the n_freqs = n_fft / 2 + 1 bins of a real signal's FFT go from "
    "0 to sample_rate / 2 (the Nyquist frequency): n_freqs evenly spaced frequencies, both ends included"
)
HINT_MEL_IN_MEL = (
    "your triangles are straight lines in mel: the exercise's (and HTK's and librosa's) triangles rise and fall "
    "linearly in Hz between the edges. Compute the slopes from the bins' frequencies and the edges in Hz"
)
HINT_MEL_NO_CLAMP = (
    "your filters go negative away from their triangle: each is 0 outside [edge m, edge m + 2]; clamp the "
    "minimum of the rising and falling slopes at 0"
)
HINT_MEL_AREA = (
    "your filters are normalised to area 1 (Slaney's 2 / (f_m+2 - f_m)): this exercise leaves that out, so each "
    "triangle peaks at 1 (or just under, when no bin falls on its peak)"
)
HINT_MEL_MAX_PEAK = (
    "every one of your filters peaks at exactly 1: the triangles are defined by the edges, and a filter only "
    "reaches 1 where a bin falls exactly on its centre; do not rescale each row by its maximum"
)
HINT_MEL_VALUES = (
    "mel_filterbank({args}) has the right shape but filter {m} differs from the reference (largest difference "
    "{diff:.2g} at bin {k}): n_mels + 2 edges evenly spaced in HTK mel from 0 to sample_rate / 2, converted to Hz; "
    "filter m rises from edge m to edge m + 1 and falls to edge m + 2, linearly in Hz"
)
HINT_MEL_NAN = "your filterbank holds NaN or inf: a division by zero? Two edges coincide only if n_mels + 2 points are not distinct"
HINT_MEL_SHORTCUT = (
    "your mel_filterbank calls {name}: the exercise is to build the triangles yourself, from the HTK mel formula "
    "and torch.linspace"
)
MEL_SHORTCUT_NAMES = ("librosa", "torchaudio", "melscale_fbanks")
MEL_ATOL = 1e-4  # see diagnose_mel
HINT_MEL_TFEDU = (
    "your mel_filterbank uses tfedu.audio's ({name}): the exercise is to build the triangles yourself, from the "
    "HTK mel formula and torch.linspace"
)


def _htk(f: torch.Tensor) -> torch.Tensor:
    return 2595 * torch.log10(1 + f / 700)


def _htk_inverse(m: torch.Tensor) -> torch.Tensor:
    return 700 * (10 ** (m / 2595) - 1)


def mel_variant(n_freqs: int, n_mels: int, sample_rate: float, *, scale: str = "htk", bins_to_sr: bool = False,
                in_mel: bool = False, clamp: bool = True, area: bool = False, max_peak: bool = False) -> torch.Tensor:
    """The exercise's filterbank (float64), or one of the known mistakes when a keyword is set."""
    from tfedu.audio import hz_to_mel, mel_to_hz

    to_mel, to_hz = {
        "htk": (_htk, _htk_inverse),
        "slaney": (lambda f: hz_to_mel(f), lambda m: mel_to_hz(m)),
        "linear": (lambda f: f, lambda m: m),
        "mixed": (lambda f: 2595 * torch.log(1 + f / 700), _htk_inverse),
    }[scale]
    top = torch.tensor(sample_rate / 2, dtype=torch.float64)
    bins = torch.linspace(0, sample_rate if bins_to_sr else sample_rate / 2, n_freqs, dtype=torch.float64)
    edges = to_hz(torch.linspace(float(to_mel(torch.zeros((), dtype=torch.float64))), float(to_mel(top)),
                                 n_mels + 2, dtype=torch.float64))
    if in_mel:
        bins, edges = _htk(bins), _htk(edges)
    low, centre, high = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    weights = torch.minimum((bins - low) / (centre - low), (high - bins) / (high - centre))
    if clamp:
        weights = weights.clamp(min=0)
    if area:
        weights = weights * (2 / (edges[2:] - edges[:-2]))[:, None]
    if max_peak:
        weights = weights / weights.amax(dim=1, keepdim=True)
    return weights


MEL_MISTAKES = ((HINT_MEL_LINEAR_HZ, dict(scale="linear")), (HINT_MEL_SLANEY, dict(scale="slaney")),
                (HINT_MEL_MIXED_LOG, dict(scale="mixed")), (HINT_MEL_BINS_TO_SR, dict(bins_to_sr=True)),
                (HINT_MEL_IN_MEL, dict(in_mel=True)), (HINT_MEL_NO_CLAMP, dict(clamp=False)),
                (HINT_MEL_AREA, dict(area=True)), (HINT_MEL_MAX_PEAK, dict(max_peak=True)))


def diagnose_mel(got: Any, n_freqs: int, n_mels: int, sample_rate: float) -> None:
    """Raise CheckFailure naming what is wrong with ``got``, a learner's filterbank for these arguments."""
    args = f"{n_freqs}, {n_mels}, {sample_rate}"
    expect(isinstance(got, torch.Tensor), HINT_MEL_NOT_TENSOR.format(got=describe(got)))
    expect(got.is_floating_point(), HINT_MEL_NOT_TENSOR.format(got=describe(got)) + " of floats")
    want = mel_variant(n_freqs, n_mels, sample_rate)
    got = got.detach().to("cpu", torch.float64)
    if tuple(got.shape) != tuple(want.shape):
        expect(tuple(got.shape) != (n_freqs, n_mels), HINT_MEL_TRANSPOSED)
        expect(got.dim() != 2 or got.shape[1] != n_freqs, HINT_MEL_ROWS.format(got=got.shape[0], want=n_mels))
        raise CheckFailure(HINT_MEL_SHAPE.format(args=args, got=tuple(got.shape), want=tuple(want.shape)))
    expect(bool(torch.isfinite(got).all()), HINT_MEL_NAN)
    # Weights lie in [0, 1]; float32 arithmetic anywhere on the way (linspace, the top mel) moves them by a few
    # 1e-6, while every named mistake moves some weight by more than 1e-2. So 1e-4 passes float32 work.
    if torch.allclose(got, want, rtol=0, atol=MEL_ATOL):
        return
    for hint, mistake in MEL_MISTAKES:
        wrong = mel_variant(n_freqs, n_mels, sample_rate, **mistake)
        if torch.isfinite(wrong).all() and torch.allclose(got, wrong, rtol=0, atol=MEL_ATOL):
            raise CheckFailure(hint)
    diff = (got - want).abs()
    m, k = divmod(int(diff.argmax()), n_freqs)
    raise CheckFailure(HINT_MEL_VALUES.format(args=args, m=m, k=k, diff=float(diff.max())))


# (n_freqs, n_mels, sample_rate): the notebook's (n_fft 512 at 8 kHz), a speech front end's, a small one, CD audio.
MEL_CASES = ((257, 32, 8000), (201, 40, 16000), (33, 6, 8000), (513, 64, 44100))


@checker("the mel filterbank")
def check_mel_filterbank(mel_filterbank) -> None:
    """Check a learner's ``mel_filterbank(n_freqs, n_mels, sample_rate) -> (n_mels, n_freqs)``.

    Against ``tfedu.audio.mel_filterbank(..., htk=True, norm=None)`` on :data:`MEL_CASES`, after trying
    the known mistakes (:data:`MEL_MISTAKES`), then used for a log-mel spectrogram of a chirp, which must
    equal the reference's. librosa and torchaudio are refused.
    """
    from tfedu.audio import log_mel_spectrogram
    from tfedu.audio import mel_filterbank as reference

    used = sorted(global_names(mel_filterbank) & set(MEL_SHORTCUT_NAMES))
    expect(not used, HINT_MEL_SHORTCUT.format(name=", ".join(used)))
    borrowed = globals_from_modules(mel_filterbank, ["tfedu.audio"])
    expect(not borrowed, HINT_MEL_TFEDU.format(name=", ".join(borrowed)))
    import tfedu.audio

    for n_freqs, n_mels, sample_rate in MEL_CASES:
        with watch_calls((tfedu.audio, "mel_filterbank"), (tfedu.audio, "_filterbank")) as called:
            got = call_learner(mel_filterbank, n_freqs, n_mels, sample_rate, name="mel_filterbank",
                               error_hint=HINT_MEL_CALL)
        expect(not called, HINT_MEL_TFEDU.format(name=", ".join(sorted(set(called)))))
        diagnose_mel(got, n_freqs, n_mels, sample_rate)
        torch.testing.assert_close(mel_variant(n_freqs, n_mels, sample_rate),
                                   reference(n_freqs, n_mels, sample_rate, htk=True, norm=None))  # our own guard
    t = torch.arange(4000, dtype=torch.float64) / 8000
    chirp = torch.sin(2 * torch.pi * 300 * 0.5 * (8 ** (t / 0.5) - 1) / torch.log(torch.tensor(8.0)))
    mine = log_mel_spectrogram(chirp, 8000, n_fft=512, hop_length=128,
                               filterbank=call_learner(mel_filterbank, 257, 32, 8000, name="mel_filterbank"))
    theirs = log_mel_spectrogram(chirp, 8000, n_fft=512, hop_length=128, n_mels=32, htk=True, norm=None)
    expect(torch.allclose(mine, theirs, atol=1e-2), "a log-mel spectrogram made with your filterbank differs from "
                                                   "the reference's, although the filterbank matched: tell the course staff")


# The probe: fresh (n_freqs, n_mels, sample_rate), few enough bands that no filter falls between two bins.
MEL_PROBE_RUN = HELPERS + """\
_results = [_call(mel_filterbank, _n_freqs, _n_mels, _sr) for _n_freqs, _n_mels, _sr in inputs['cases']]
outputs = {'returned': [_kind(_r) for _r in _results], 'mutated': _MUTATED,
           'filterbanks': [None if _r is None or not isinstance(_r, torch.Tensor) else
                           _r.detach().to('cpu', torch.float64).numpy() for _r in _results]}
del _results
""" + CLEANUP


def _mel_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    for n_fft, sample_rate in ((512, 8000), (int(rng.choice([256, 400, 512])), int(rng.choice([16000, 22050]))),
                               (int(rng.choice([128, 256])), int(rng.choice([8000, 11025])))):
        n_freqs = n_fft // 2 + 1
        cases.append([n_freqs, int(rng.integers(4, max(5, n_freqs // 8))), sample_rate])
    return {"cases": cases}


def _mel_probe_reference(inputs: dict) -> dict:
    return {"returned": ["tensor"] * len(inputs["cases"]), "cases": inputs["cases"]}


def _compare_mel(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="mel_filterbank")
    if problem:
        return problem
    banks = outputs.get("filterbanks")
    if not isinstance(banks, list) or len(banks) != len(expected["cases"]):
        return "mel_filterbank's hidden test did not run every case"
    for bank, (n_freqs, n_mels, sample_rate) in zip(banks, expected["cases"]):
        try:
            diagnose_mel(_tensor(bank) if bank is not None else None, n_freqs, n_mels, sample_rate)
        except CheckFailure as failure:
            return str(failure)
    return None


MEL_FORBIDDEN = ("tfedu.audio", "librosa", "torchaudio")


# ----------------------------------------------------------------------------- 11.4 the Conformer's convolution module

# The reference's parameters and buffers, by name, for d_model d and kernel k (tfedu.audio.ConformerConvModule's).
def conv_shapes(d: int, k: int) -> dict[str, tuple[int, ...]]:
    return {"norm.weight": (d,), "norm.bias": (d,), "pointwise_in.weight": (2 * d, d, 1), "pointwise_in.bias": (2 * d,),
            "depthwise.weight": (d, 1, k), "depthwise.bias": (d,), "batch_norm.weight": (d,), "batch_norm.bias": (d,),
            "batch_norm.running_mean": (d,), "batch_norm.running_var": (d,), "batch_norm.num_batches_tracked": (),
            "pointwise_out.weight": (d, d, 1), "pointwise_out.bias": (d,)}


class ReferenceConvModule(_audio.ConformerConvModule):
    """Exercise 11.4's answer: ``tfedu.audio.ConformerConvModule`` with its residual, ``x + module(x)``
    (the Conformer block adds the residual itself; the exercise's module includes it)."""

    def __init__(self, d_model: int, kernel_size: int = 15) -> None:
        super().__init__(d_model, kernel_size=kernel_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return x + super().forward(x, mask)


def load_conv_weights(module: nn.Module, weights: dict) -> nn.Module:
    """Load a ``ConformerConvModule``'s weights (its state dict) into ``module``, exercise 11.4's, each reshaped to
    the module's tensor of that name (a pointwise layer kept as an ``nn.Linear`` takes the kernel-1 convolution's
    weight without its last axis, as the check does); returns ``module``."""
    state = module.state_dict()
    module.load_state_dict({name: torch.as_tensor(weights[name]).reshape(state[name].shape).to(state[name].dtype)
                            for name in state})
    return module


def conv_variant(x: Any, weights: dict, kernel_size: int, *, training: bool, mistake: str | None = None) -> torch.Tensor:
    """The convolution module with its residual (float64), or with one of the known mistakes (:data:`CONV_MISTAKES`)."""
    W = {name: torch.as_tensor(np.asarray(value)).double() for name, value in weights.items()}
    x = torch.as_tensor(np.asarray(x)).double()
    batch, T, d = x.shape
    k = int(kernel_size)
    h = x if mistake == "no layer norm" else _ln(x, W["norm.weight"], W["norm.bias"], 1e-5)
    normed = h
    h = h.reshape(batch, d, T) if mistake in ("reshaped in", "reshaped both") else h.transpose(1, 2)  # batch d T
    h = F.conv1d(h, W["pointwise_in.weight"], W["pointwise_in.bias"])  # batch 2d T
    value, gate = h[:, :d], h[:, d:]
    h = {"no gate": lambda: value, "gate swapped": lambda: gate * torch.sigmoid(value),
         "gate not squashed": lambda: value * gate}.get(mistake, lambda: value * torch.sigmoid(gate))()
    left = {"causal": k - 1, "anti-causal": 0}.get(mistake, k // 2)
    if isinstance(mistake, str) and mistake.startswith("shift "):
        left = k // 2 + int(mistake.split()[1])
    h = F.conv1d(F.pad(h, (left, k - 1 - left)), W["depthwise.weight"], W["depthwise.bias"], groups=d)

    def batch_norm(t: torch.Tensor) -> torch.Tensor:
        batch_stats = training != (mistake == "running statistics in training") or mistake == "batch statistics in eval"
        return F.batch_norm(t, W["batch_norm.running_mean"].clone(), W["batch_norm.running_var"].clone(),
                            W["batch_norm.weight"], W["batch_norm.bias"], training=batch_stats, eps=1e-5)

    act = {"relu": torch.relu, "sigmoid": torch.sigmoid, "gelu": F.gelu, "no swish": lambda t: t}.get(mistake, F.silu)
    if mistake == "no batch norm":
        h = act(h)
    elif mistake == "swish before batch norm":
        h = batch_norm(act(h))
    else:
        h = act(batch_norm(h))
    h = F.conv1d(h, W["pointwise_out.weight"], W["pointwise_out.bias"])  # batch d T
    out = h.reshape(batch, T, d) if mistake in ("reshaped out", "reshaped both") else h.transpose(1, 2)
    return {"no residual": lambda: out, "residual from the norm": lambda: normed + out}.get(mistake, lambda: x + out)()


# Run in the student's kernel (in the probe's run code) and, for the checker, here: one source.
CONV_HELPERS = '''\
def _conv_record(ConvModule, case):
    """What a learner's ConvModule does on one case, as plain data: its tensors' shapes, the input shape each of its
    sub-modules received, and its outputs in eval and in training mode with the case's weights loaded."""
    d, k = int(case["d_model"]), int(case["kernel_size"])
    try:
        module = ConvModule(d, k)
    except NotImplementedError:
        return {"status": "not done"}
    except Exception as err:
        return {"status": "error", "error": type(err).__name__ + ": " + str(err)[:300], "where": "built"}
    if not isinstance(module, torch.nn.Module):
        return {"status": "not a module", "got": type(module).__name__}
    state = module.state_dict()
    record = {"status": "ok", "shapes": {name: list(value.shape) for name, value in state.items()}}
    weights = case["weights"]
    if set(state) != set(weights) or any(state[name].numel() != np.asarray(weights[name]).size for name in state):
        record["status"] = "shapes"
        return record
    module.load_state_dict({name: torch.as_tensor(np.asarray(weights[name])).reshape(state[name].shape).to(state[name].dtype)
                            for name in state})
    seen = {}

    def _saw(name):
        def hook(_module, args):
            if args and isinstance(args[0], torch.Tensor) and name not in seen:
                seen[name] = list(args[0].shape)
        return hook

    hooks = [sub.register_forward_pre_hook(_saw(name)) for name, sub in module.named_children()]
    try:
        for mode in ("eval", "train"):
            module.train(mode == "train")
            seen.clear()
            try:
                out = module(torch.as_tensor(np.asarray(case["x"])).float())
            except NotImplementedError:
                return {"status": "not done"}
            except Exception as err:
                record.update(status="error", error=type(err).__name__ + ": " + str(err)[:300], where=mode,
                              seen=dict(seen))
                return record
            if out is None:
                return {"status": "not done"}
            record[mode] = (out.detach().double().numpy() if isinstance(out, torch.Tensor)
                            else "a " + type(out).__name__)
            record["seen_" + mode] = dict(seen)
    finally:
        for hook in hooks:
            hook.remove()
    return record


'''
CONV_CLEANUP = "del _conv_record\n"
_conv_helpers: dict[str, Any] = {"torch": torch, "np": np}
exec(compile(CONV_HELPERS, "<conv module probe helpers>", "exec"), _conv_helpers)
conv_record = _conv_helpers["_conv_record"]

HINT_CONV_NOT_A_MODULE = "ConvModule(d_model, kernel_size) should build an nn.Module, got {got}"
HINT_CONV_BUILD = "ConvModule({d}, {k}) raised {error}"
HINT_CONV_NAMES = (
    "ConvModule({d}, {k})'s parameters and buffers should be those of five sub-modules named norm (LayerNorm over "
    "d_model), pointwise_in (a kernel-1 Conv1d from d_model to 2 d_model channels), depthwise (a Conv1d with "
    "kernel_size taps and one filter per channel), batch_norm (BatchNorm1d over d_model) and pointwise_out (a "
    "kernel-1 Conv1d back to d_model): {expected}; yours are {got}"
)
HINT_CONV_DENSE = (
    "your depthwise convolution's weight is {got}, a full convolution: every output channel reads every input "
    "channel, d_model times the weights and the compute. The Conformer's is depthwise, one kernel per channel "
    "(groups = d_model), weight (d_model, 1, kernel_size)"
)
HINT_CONV_NO_GLU_WIDTH = (
    "your first pointwise convolution keeps d_model channels ({got}): it doubles them, to 2 d_model, because the "
    "GLU after it splits the channels into two halves and gates one with the sigmoid of the other, leaving d_model"
)
HINT_CONV_LN_FOR_BN = (
    "your batch_norm has no running statistics (running_mean, running_var): a LayerNorm in BatchNorm's place? The "
    "Conformer normalises the depthwise convolution's output with BatchNorm1d over the d_model channels, each "
    "channel by its mean and variance over the batch and the frames (running averages of them in eval mode)"
)
HINT_CONV_KERNEL = (
    "your depthwise convolution's weight is {got}: it should have kernel_size = {k} taps, (d_model, 1, {k})"
)
HINT_CONV_NO_TRANSPOSE = (
    "your {part} received {got}, (batch, time, channels): Conv1d wants channels first, (batch, channels, time). "
    "Swap the time and channel axes after the LayerNorm (which works on the last axis) and swap them back at the end"
)
HINT_CONV_LN_AXIS = (
    "your LayerNorm received {got}, (batch, channels, time): it normalises the last axis, which must be the "
    "d_model channels. Normalise first, on (batch, time, d_model), then move the channels in front for the convolutions"
)
HINT_CONV_BN_AXIS = (
    "your BatchNorm received {got}, (batch, time, channels): BatchNorm1d takes (batch, channels, time) and "
    "normalises each channel over the batch and the frames. Apply it before moving the channels back last"
)
HINT_CONV_GLU_TIME = (
    "your GLU halves the time axis instead of the channels: after the first pointwise convolution the 2 d_model "
    "channels are on axis 1, so split and gate over that axis (one half times the sigmoid of the other), leaving "
    "(batch, d_model, time)"
)
HINT_CONV_NO_GLU = (
    "your depthwise convolution received {got}, all 2 d_model channels of the first pointwise convolution: the GLU "
    "in between is missing. It splits the channels into two halves and multiplies the first by the sigmoid of the "
    "second, leaving d_model channels"
)
HINT_CONV_LENGTH = (
    "your depthwise convolution's output has {got} frames for {T} in: with kernel_size = {k} it needs (k - 1) / 2 "
    "zeros of padding on each side ('same' padding), so every frame keeps its place and the length stays {T}"
)
HINT_CONV_ERROR = "ConvModule's forward (in {where} mode, on x of shape {shape}) raised {error}"
HINT_CONV_NOT_TENSOR = "ConvModule's forward should return a tensor (batch, time, d_model), got {got}"
HINT_CONV_TRANSPOSED_OUT = (
    "your module returns {got}, (batch, channels, time): move the channels back last, (batch, time, d_model), "
    "the layout the block's residual stream has"
)
HINT_CONV_SHAPE = "ConvModule's forward on x of shape {shape} returned shape {got}, expected {want}"
HINT_CONV_NO_RESIDUAL = (
    "your module returns only the convolution path: the Conformer adds it to the module's input (x + Conv(x), "
    "Gulati et al.'s eq. 1), and this exercise's module includes that residual"
)
HINT_CONV_RESIDUAL_NORMED = (
    "your residual adds the LayerNorm's output, not the module's input: the skip connection carries x itself, "
    "unnormalised, around the whole module (pre-norm, as in the Transformer blocks)"
)
HINT_CONV_NO_LN = "your module skips the LayerNorm at its start: it normalises x over d_model before the first convolution"
HINT_CONV_NO_GATE = (
    "your GLU keeps the first half of the channels without gating it: GLU multiplies that half by the sigmoid of the "
    "other half (Dauphin et al. 2017)"
)
HINT_CONV_GATE_SWAPPED = (
    "your GLU gates the second half with the sigmoid of the first: it is the other way round, the first half times "
    "the sigmoid of the second (PyTorch's GLU, and the reference)"
)
HINT_CONV_GATE_NOT_SQUASHED = (
    "your GLU multiplies the two halves directly: the gate is the sigmoid of the second half, a number between 0 "
    "and 1 for each channel and frame"
)
HINT_CONV_SHIFT = (
    "your depthwise convolution's output is shifted by {s} frame{plural} ({which}): with kernel_size = {k} the "
    "padding must be (k - 1) / 2 = {half} zeros on each side, so that output frame t is centred on input frame t"
)
HINT_CONV_RELU = "your module uses ReLU after the BatchNorm: the Conformer uses Swish, x times sigmoid(x) (SiLU)"
HINT_CONV_SIGMOID = "your Swish is the sigmoid alone: Swish (SiLU) is x times sigmoid(x)"
HINT_CONV_GELU = "your module uses GELU after the BatchNorm: the Conformer uses Swish, x times sigmoid(x) (SiLU)"
HINT_CONV_NO_SWISH = "your module has no activation after the BatchNorm: the Conformer applies Swish, x times sigmoid(x)"
HINT_CONV_NO_BN = "your module skips the BatchNorm between the depthwise convolution and the Swish"
HINT_CONV_ORDER = "your module applies Swish before the BatchNorm: the order is depthwise convolution, BatchNorm, then Swish"
HINT_CONV_RESHAPED = (
    "you changed between (batch, time, channels) and (batch, channels, time) with a reshape (or view): that keeps "
    "the memory order and scrambles frames with channels. Swap the two axes with a transpose"
)
HINT_CONV_BATCH_STATS_EVAL = (
    "in eval mode your BatchNorm normalises with the batch's own statistics: at inference it uses the running mean "
    "and variance it kept during training (nn.BatchNorm1d switches with the module's train and eval modes)"
)
HINT_CONV_RUNNING_IN_TRAINING = (
    "in training mode your BatchNorm normalises with the running statistics: while training it uses the batch's "
    "mean and variance over the batch and the frames, per channel"
)
HINT_CONV_VALUES = (
    "ConvModule in {mode} mode on x of shape {shape} (kernel_size {k}) differs from the reference (largest "
    "difference {diff:.3g}): x plus pointwise_out(Swish(BatchNorm(depthwise(GLU(pointwise_in(LayerNorm(x)))))), "
    "the convolutions on (batch, channels, time)"
)
HINT_CONV_SHORTCUT = "your ConvModule uses {name}: build the module from torch's layers yourself"

CONV_MISTAKES = (
    ("no residual", HINT_CONV_NO_RESIDUAL), ("residual from the norm", HINT_CONV_RESIDUAL_NORMED),
    ("no layer norm", HINT_CONV_NO_LN), ("no gate", HINT_CONV_NO_GATE), ("gate swapped", HINT_CONV_GATE_SWAPPED),
    ("gate not squashed", HINT_CONV_GATE_NOT_SQUASHED), ("relu", HINT_CONV_RELU), ("sigmoid", HINT_CONV_SIGMOID),
    ("gelu", HINT_CONV_GELU), ("no swish", HINT_CONV_NO_SWISH), ("no batch norm", HINT_CONV_NO_BN),
    ("swish before batch norm", HINT_CONV_ORDER), ("reshaped in", HINT_CONV_RESHAPED),
    ("reshaped out", HINT_CONV_RESHAPED), ("reshaped both", HINT_CONV_RESHAPED),
    ("batch statistics in eval", HINT_CONV_BATCH_STATS_EVAL),
    ("running statistics in training", HINT_CONV_RUNNING_IN_TRAINING),
)
CONV_RTOL = 1e-4  # of the output's largest size: a float32 module differs from float64 by about 1e-6 of it


def _conv_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(((got - want).abs() <= CONV_RTOL * max(1.0, float(want.abs().max()))).all())


def _shape_problem(record: dict, case: dict) -> str | None:
    d, k = int(case["d_model"]), int(case["kernel_size"])
    expected = {name: list(shape) for name, shape in conv_shapes(d, k).items()}
    shapes = record["shapes"]
    if "batch_norm.weight" in shapes and "batch_norm.running_mean" not in shapes:
        return HINT_CONV_LN_FOR_BN
    depthwise = shapes.get("depthwise.weight")
    if depthwise is not None and len(depthwise) == 3 and depthwise[1] == d and depthwise[1] != 1:
        return HINT_CONV_DENSE.format(got=tuple(depthwise))
    if depthwise is not None and len(depthwise) == 3 and depthwise[:2] == [d, 1] and depthwise[2] != k:
        return HINT_CONV_KERNEL.format(got=tuple(depthwise), k=k)
    pointwise = shapes.get("pointwise_in.weight")
    if pointwise is not None and pointwise and pointwise[0] == d:
        return HINT_CONV_NO_GLU_WIDTH.format(got=tuple(pointwise))
    if set(shapes) != set(expected) or any(math.prod(shapes[n]) != math.prod(expected[n]) for n in expected):
        text = lambda table: ", ".join(f"{n} {tuple(s)}" for n, s in table.items()) or "none"  # noqa: E731
        return HINT_CONV_NAMES.format(d=d, k=k, expected=text(expected), got=text(shapes))
    return None


def _seen_problem(seen: dict, case: dict, shapes: dict) -> str | None:
    """The hint when a sub-module received its input in the wrong layout, from the shapes the pre-hooks saw
    (a pointwise layer kept as a linear map, weight (out, in), takes channels last: that is right for it)."""
    batch, T, d = np.asarray(case["x"]).shape
    across, along = [batch, d, T], [batch, T, d]
    conv_in, conv_out = (len(shapes.get(f"{n}.weight", [])) == 3 for n in ("pointwise_in", "pointwise_out"))
    if seen.get("norm") == across:
        return HINT_CONV_LN_AXIS.format(got=tuple(across))
    if conv_in and seen.get("pointwise_in") == along:
        return HINT_CONV_NO_TRANSPOSE.format(part="first pointwise convolution", got=tuple(along))
    depthwise = seen.get("depthwise")
    if depthwise is not None and len(depthwise) == 3:
        if depthwise[1] == 2 * d and depthwise[2] == T:
            return HINT_CONV_NO_GLU.format(got=tuple(depthwise))
        if depthwise[1] == 2 * d and depthwise[2] == T // 2:
            return HINT_CONV_GLU_TIME
        if depthwise == along:
            return HINT_CONV_NO_TRANSPOSE.format(part="depthwise convolution", got=tuple(along))
    if seen.get("batch_norm") == along:
        return HINT_CONV_BN_AXIS.format(got=tuple(along))
    for name in ("batch_norm", "pointwise_out"):
        got = seen.get(name)
        if got is not None and len(got) == 3 and got[:2] == [batch, d] and got[2] != T:
            return HINT_CONV_LENGTH.format(got=got[2], T=T, k=int(case["kernel_size"]))
    if conv_out and seen.get("pointwise_out") == along:
        return HINT_CONV_NO_TRANSPOSE.format(part="last pointwise convolution", got=tuple(along))
    return None


def diagnose_conv(record: dict, case: dict) -> None:
    """Raise CheckFailure naming what is wrong with one record of ``_conv_record``; return when it is right."""
    d, k = int(case["d_model"]), int(case["kernel_size"])
    if record["status"] == "not done":
        raise ExerciseNotDone(NOT_DONE_MESSAGE)
    if record["status"] == "not a module":
        raise CheckFailure(HINT_CONV_NOT_A_MODULE.format(got=record["got"]))
    if record["status"] == "error" and record.get("where") == "built":
        raise CheckFailure(HINT_CONV_BUILD.format(d=d, k=k, error=record["error"]))
    problem = _shape_problem(record, case)
    if problem:
        raise CheckFailure(problem)
    shape = tuple(np.asarray(case["x"]).shape)
    if record["status"] == "error":
        problem = _seen_problem(record.get("seen") or {}, case, record["shapes"])
        if problem is None and "Halving dimension" in record["error"]:
            problem = HINT_CONV_GLU_TIME
        raise CheckFailure(problem or HINT_CONV_ERROR.format(where=record["where"], shape=shape, error=record["error"]))
    for mode in ("eval", "train"):
        got = record[mode]
        problem = _seen_problem(record.get("seen_" + mode) or {}, case, record["shapes"])
        if not isinstance(got, np.ndarray):
            expect(problem is None, problem or "")
            raise CheckFailure(HINT_CONV_NOT_TENSOR.format(got=got))
        got = torch.from_numpy(np.asarray(got, dtype=np.float64))
        want = conv_variant(case["x"], case["weights"], k, training=mode == "train")
        if tuple(got.shape) != tuple(want.shape):
            expect(problem is None, problem or "")
            expect(tuple(got.shape) != (shape[0], d, shape[1]), HINT_CONV_TRANSPOSED_OUT.format(got=tuple(got.shape)))
            raise CheckFailure(HINT_CONV_SHAPE.format(shape=shape, got=tuple(got.shape), want=tuple(want.shape)))
        if _conv_close(got, want):
            continue
        expect(problem is None, problem or "")
        for mistake, hint in CONV_MISTAKES:
            wrong = conv_variant(case["x"], case["weights"], k, training=mode == "train", mistake=mistake)
            if _conv_close(got, wrong) and not _conv_close(wrong, want):
                raise CheckFailure(hint)
        for s in [s for s in range(-(k // 2), k // 2 + 1) if s]:
            wrong = conv_variant(case["x"], case["weights"], k, training=mode == "train", mistake=f"shift {s}")
            if _conv_close(got, wrong):
                which = ("causal padding: all k - 1 zeros on the left, each frame sees only the past" if s == k // 2
                         else "all k - 1 zeros on the right" if s == -(k // 2) else "the padding off centre")
                raise CheckFailure(HINT_CONV_SHIFT.format(s=abs(s), plural="s" if abs(s) > 1 else "", which=which, k=k,
                                                          half=k // 2))
        diff = float((got - want).abs().max())
        raise CheckFailure(HINT_CONV_VALUES.format(mode=mode, shape=shape, k=k, diff=diff))


def make_conv_case(rng: np.random.Generator, d: int, k: int, T: int, batch: int) -> dict:
    """One case as plain data: the module's weights (float32, the norms' gains near 1, running statistics off their
    start), and x (batch, T, d)."""
    weights = {}
    for name, shape in conv_shapes(d, k).items():
        if name.endswith("num_batches_tracked"):
            weights[name] = np.array(10, dtype=np.int64)
            continue
        value = 0.5 * rng.standard_normal(shape)
        if name.endswith(("norm.weight", "running_var")):
            value = np.exp(0.3 * value) if name.endswith("running_var") else 1.0 + 0.6 * value
        weights[name] = value.astype(np.float32)
    x = (1.5 * rng.standard_normal((batch, T, d)) + rng.standard_normal(d)).astype(np.float32)
    return {"d_model": d, "kernel_size": k, "weights": weights, "x": x}


# (d_model, kernel_size, frames, batch): frames differ from d_model and 2 d_model and are even, so a layout slip shows
# in the shapes a sub-module receives, and a GLU over time halves them.
CONV_CASES = ((8, 3, 10, 3), (12, 7, 20, 2), (6, 5, 16, 4))


def _refuse_conv_shortcuts(cls: Any) -> None:
    if isinstance(cls, type) and issubclass(cls, _audio.ConformerConvModule):
        raise CheckFailure(HINT_CONV_SHORTCUT.format(name="tfedu.audio's ConformerConvModule"))
    for fn in [getattr(cls, name) for name in ("__init__", "forward") if hasattr(cls, name)]:
        scope = getattr(fn, "__globals__", {})
        used = [f"{n} ({getattr(scope[n], '__name__', '') if isinstance(scope[n], types.ModuleType) else scope[n].__module__})"
                for n in globals_from_modules(fn, ["tfedu.audio", "torchaudio", "torchaudio.models"])]
        names = global_names(fn) - {u.split()[0] for u in used}
        used += sorted(names & {"ConformerConvModule", "ConformerBlock", "torchaudio"} - set(used))
        expect(not used, HINT_CONV_SHORTCUT.format(name=", ".join(used)))


@checker("the Conformer's convolution module")
def check_conv_module(ConvModule) -> None:
    """Check a learner's ``ConvModule(d_model, kernel_size)``, forward (batch, time, d_model) -> the same, residual included.

    Its sub-modules carry tfedu.audio.ConformerConvModule's names, so the reference's weights load into it; then in
    eval mode (BatchNorm's running statistics) and training mode (the batch's) on :data:`CONV_CASES`, against
    ``x + ConformerConvModule(x)``, after trying the known mistakes (:data:`CONV_MISTAKES`, shifts, layouts).
    """
    if ConvModule is None:
        raise ExerciseNotDone(NOT_DONE_MESSAGE)
    _refuse_conv_shortcuts(ConvModule)
    rng = np.random.default_rng(1104)
    for d, k, T, batch in CONV_CASES:
        case = make_conv_case(rng, d, k, T, batch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            reference = ReferenceConvModule(d, k)
        reference.load_state_dict({n: torch.from_numpy(np.asarray(v)) for n, v in case["weights"].items()})
        x = torch.from_numpy(case["x"])
        with torch.no_grad():  # our own guard: the functional reference is tfedu's module with its residual
            for training in (False, True):
                want = reference.train(training)(x).double()
                torch.testing.assert_close(conv_variant(case["x"], case["weights"], k, training=training), want,
                                           rtol=0, atol=1e-5 * max(1.0, float(want.abs().max())))
        with watch_calls((_audio.ConformerConvModule, "forward")) as called:
            record = conv_record(ConvModule, case)
        expect(not called, HINT_CONV_SHORTCUT.format(name="tfedu.audio's ConformerConvModule"))
        diagnose_conv(record, case)


CONV_PROBE_RUN = HELPERS + CONV_HELPERS + """\
outputs = {'records': [_conv_record(ConvModule, _c) for _c in inputs['cases']]}
""" + CONV_CLEANUP + CLEANUP


def _conv_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    for _ in range(2):
        d, k = int(rng.integers(4, 11)), int(rng.choice([3, 5, 7]))
        T = 2 * int(rng.integers(4, 10))
        while T in (d, 2 * d):
            T += 2
        cases.append(make_conv_case(rng, d, k, T, int(rng.integers(2, 5))))
    return {"cases": cases}


def _compare_conv(outputs: dict, expected: dict) -> str | None:
    records = outputs.get("records") if isinstance(outputs, dict) else None
    if not isinstance(records, list) or len(records) != len(expected["cases"]):
        return "ConvModule's hidden test did not run every case"
    for i, (record, case) in enumerate(zip(records, expected["cases"])):
        try:
            diagnose_conv(record, case)
        except CheckFailure as failure:
            return f"hidden test {i + 1} (d_model={case['d_model']}, kernel_size={case['kernel_size']}): {failure}"
    return None


CONV_FORBIDDEN = ("tfedu.audio", "torchaudio")
CONV_BUILDS = frozenset({"torch.nn.Conv1d", "torch.nn.BatchNorm1d", "torch.nn.LayerNorm", "torch.nn.GLU", "torch.nn.SiLU",
                         "torch.nn.functional.glu", "torch.nn.functional.conv1d", "torch.nn.functional.batch_norm",
                         "torch.nn.functional.layer_norm"})

PROBES = {
    "check_patchify": Probe(
        exercise="ex_patchify", make_inputs=_patchify_probe_inputs, run=PATCHIFY_PROBE_RUN,
        reference=_patchify_probe_reference, compare=_compare_patchify, forbidden=PATCHIFY_FORBIDDEN),
    "check_vit_forward": Probe(
        exercise="ex_vit_forward", make_inputs=_vit_probe_inputs, run=VIT_PROBE_RUN,
        reference=_vit_probe_reference, compare=_compare_vit, forbidden=VIT_FORBIDDEN,
        builds=ELEMENTARY | SOFTMAX | ACTIVATIONS | MODULES | EINOPS | VIT_BUILDS, standins=VIT_STANDINS),
    "check_mel_filterbank": Probe(
        exercise="ex_mel_filterbank", make_inputs=_mel_probe_inputs, run=MEL_PROBE_RUN,
        reference=_mel_probe_reference, compare=_compare_mel, forbidden=MEL_FORBIDDEN),
    "check_conv_module": Probe(
        exercise="ex_conv_module", make_inputs=_conv_probe_inputs, run=CONV_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]}, compare=_compare_conv, forbidden=CONV_FORBIDDEN,
        builds=ELEMENTARY | ACTIVATIONS | MODULES | EINOPS | CONV_BUILDS),
}


HINTS = {
    "ex_patchify": Hints(
        number="11.1",
        check="check_patchify",
        idea=(
            "A patch is a P x P square of the image with all its channels; an H x W image holds (H/P) x (W/P) of "
            "them, side by side, and they become a sequence read like text, left to right, then top to bottom. "
            "Cutting computes nothing: it only moves numbers, and every pixel lands in exactly one patch. The trap "
            "is the order: reshape reads memory in order, so reshaping the image straight into rows of "
            "channels * P * P numbers gives runs of pixels along an image row, not squares. The axes have to be "
            "split and reordered first."
        ),
        approach=(
            "Three steps. Split: the height into (H/P, P) and the width into (W/P, P), the grid index outside and "
            "the position inside the patch inside, giving (batch, channels, H/P, P, W/P, P). Reorder with permute: "
            "the grid's row axis, the grid's column axis, then the channel, the patch's rows and the patch's "
            "columns, (batch, H/P, W/P, channels, P, P). Merge with reshape (a .view fails after a permute): the "
            "two grid axes into n_patches = (H/P)(W/P), the last three into channels * P * P. One einops.rearrange "
            "pattern that names those six axes does all three at once."
        ),
        skeleton=(
            "def patchify(images, patch_size):\n"
            "    batch, channels, height, width = ____  # (batch, channels, H, W), channels first\n"
            "    P = patch_size\n"
            "    grid = images.reshape(batch, channels, ____, P, ____, P)  # (batch, channels, H/P, P, W/P, P)\n"
            "    grid = grid.permute(0, ____)  # (batch, H/P, W/P, channels, P, P)\n"
            "    return grid.reshape(batch, ____, ____)  # (batch, n_patches, channels * P * P)\n"
        ),
    ),
    "ex_vit_forward": Hints(
        number="11.2",
        check="check_vit_forward",
        idea=(
            "A ViT is notebook 07's encoder with another tokenizer. The tokens: each image's patches (exercise 11.1), "
            "each times the patch embedding, one linear map shared by every patch, whose weight comes in a "
            "convolution's shape (d_model, channels, P, P). In front of them one learned class token; added to the "
            "whole sequence, one learned position vector per token. Then the pre-norm blocks with attention that "
            "has no mask, so every token sees every token. At the end the final LayerNorm of the class token's state "
            "alone, and a linear head. The weights are in the dict under a tfedu ViT's names; your parts from "
            "notebooks 05 and 07 and exercise 11.1 do the computing."
        ),
        approach=(
            "Patch tokens: flatten each filter of the convolution weight to one row, (d_model, channels * P * P), in "
            "its own order, which is your patches' order; multiply patchify's output by its transpose and add the "
            "bias. Copy cls_token once per image (expand), put it in front along the sequence axis, then add "
            "pos_embed. Block i's weights are the names that start with 'blocks.i.': build a MultiHeadAttention and "
            "an FFN with the activation 'gelu' and load their weights into them (load_state_dict takes a dict "
            "of the names that follow the prefix); make ln1 and ln2 small functions that call your layer_norm with their weight, bias "
            "and the eps you are given; hand the four to your pre_norm_block. Last, your layer_norm with ln_final's "
            "weights on row 0 of the sequence, then the head's weight and bias."
        ),
        skeleton=(
            "def vit_forward(images, weights, patch_size, n_heads, n_layers, eps):\n"
            "    W = weights\n"
            "    d_model = ____  # the class token's width\n"
            "    tokens = ____  # (batch, n_patches, d_model): your patches, the flattened convolution weight, its bias\n"
            "    cls = ____  # (batch, 1, d_model): the class token, once per image\n"
            "    resid = ____  # (batch, 1 + n_patches, d_model): the class token first, then the positions added\n"
            "\n"
            "    def norm(name):  # LayerNorm with the weights stored under name, as a function of x\n"
            "        return lambda x: ____\n"
            "\n"
            "    def under(prefix):  # the weights whose names start with prefix, named by the rest of their names\n"
            "        return {____: value for name, value in W.items() if ____}\n"
            "\n"
            "    for i in range(n_layers):\n"
            "        attn, mlp = ____  # your attention and your FFN, for block i\n"
            "        ____  # load block i's weights into both\n"
            "        resid = pre_norm_block(resid, ____, attn, ____, mlp)\n"
            "    return ____  # (batch, n_classes): the head on the normed class token\n"
        ),
    ),
    "ex_mel_filterbank": Hints(
        number="11.3",
        check="check_mel_filterbank",
        idea=(
            "The filterbank is a matrix: row m says how much of each FFT bin's power goes into mel band m. Each "
            "row is a triangle, 0 up to its left edge, rising linearly in Hz to 1 at its centre, falling back to 0 "
            "at its right edge, and 0 beyond; neighbouring triangles overlap by half. The n_mels + 2 edges are "
            "evenly spaced in mel, not in Hz, so the low filters are narrow and the high ones wide. The usual "
            "slips: edges spaced in Hz, triangles drawn in mel units, bins that run past the Nyquist frequency "
            "(sample_rate / 2), and slopes left negative outside the triangle."
        ),
        approach=(
            "Work in float64. The bins: n_freqs frequencies evenly spaced from 0 to sample_rate / 2, both ends "
            "included (torch.linspace), shape (n_freqs,). The edges: convert 0 and sample_rate / 2 to mel with the "
            "HTK formula, space n_mels + 2 points evenly between them, and convert each back to Hz with the inverse "
            "formula. Filter m uses edges m, m + 1 and m + 2 (low, centre, high): take them as three (n_mels, 1) "
            "columns of the edges, which broadcast against the bins. The rising slope is (bin - low) / (centre - low), "
            "the falling one (high - bin) / (high - centre), both (n_mels, n_freqs); the filter is the smaller of "
            "the two (torch.minimum), floored at 0."
        ),
        skeleton=(
            "def mel_filterbank(n_freqs, n_mels, sample_rate):\n"
            "    def hz_to_mel(f):\n"
            "        return ____  # HTK: 2595 log10(1 + f / 700)\n"
            "\n"
            "    def mel_to_hz(m):\n"
            "        return ____  # its inverse\n"
            "\n"
            "    bins = torch.linspace(____, ____, n_freqs, dtype=torch.float64)  # (n_freqs,): each bin's frequency\n"
            "    top = hz_to_mel(torch.tensor(____, dtype=torch.float64))\n"
            "    edges = mel_to_hz(torch.linspace(____, ____, ____, dtype=torch.float64))  # (n_mels + 2,), in Hz\n"
            "    low, centre, high = edges[____, None], edges[____, None], edges[____, None]  # (n_mels, 1) each\n"
            "    rising = ____  # (n_mels, n_freqs): 0 at low, 1 at the centre\n"
            "    falling = ____  # 1 at the centre, 0 at high\n"
            "    return ____  # the smaller slope, never below 0\n"
        ),
    ),
    "ex_conv_module": Hints(
        number="11.4",
        check="check_conv_module",
        idea=(
            "The convolution module mixes each channel over a few neighbouring frames. It takes and returns "
            "(batch, time, d_model), like the block around it, but PyTorch's Conv1d wants (batch, channels, time): "
            "normalise first (a LayerNorm works on the last axis), swap the two axes, convolve, swap them back. The "
            "two pointwise convolutions (kernel 1) are per-frame linear maps; between the first and the depthwise "
            "one, a GLU turns 2 d_model channels into d_model by gating one half with the sigmoid of the other. The "
            "depthwise convolution has one kernel per channel and (k - 1) / 2 zeros of padding on each side, so "
            "frame t stays centred; then BatchNorm and Swish. The module's input is added back at the end."
        ),
        approach=(
            "In __init__, five sub-modules under the reference's names: norm, a LayerNorm over d_model; "
            "pointwise_in, a Conv1d from d_model to 2 d_model channels with kernel 1; depthwise, a Conv1d from "
            "d_model to d_model channels with kernel_size taps, padding kernel_size // 2 and groups d_model; "
            "batch_norm, a BatchNorm1d over d_model; pointwise_out, a Conv1d back to d_model channels with kernel 1. "
            "In forward: normalise x, transpose time and channels, the first pointwise convolution, the GLU over "
            "axis 1 (F.glu takes the axis), the depthwise convolution, the BatchNorm, SiLU, the last pointwise "
            "convolution, transpose back, and add x."
        ),
        skeleton=(
            "class ConvModule(nn.Module):\n"
            "    def __init__(self, d_model, kernel_size):\n"
            "        super().__init__()\n"
            "        self.norm = ____  # over d_model\n"
            "        self.pointwise_in = ____  # d_model -> 2 d_model channels, kernel 1\n"
            "        self.depthwise = ____  # kernel_size taps, one kernel per channel, centred zero padding\n"
            "        self.batch_norm = ____\n"
            "        self.pointwise_out = ____  # back to d_model channels, kernel 1\n"
            "\n"
            "    def forward(self, x):  # (batch, time, d_model)\n"
            "        h = ____  # normalised, then (batch, d_model, time)\n"
            "        h = ____  # the first pointwise convolution, then the GLU over the channels\n"
            "        h = ____  # depthwise, BatchNorm, Swish\n"
            "        return ____  # the last pointwise convolution, channels last again, plus the residual\n"
        ),
    ),
}
