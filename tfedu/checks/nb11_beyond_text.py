"""Checkers for notebooks/11_beyond_text.ipynb: cutting images into patches, and the mel filterbank.

Two exercises, each checked against tfedu's reference after first trying the known mistakes:

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
- 11.2 ``mel_filterbank(n_freqs, n_mels, sample_rate) -> (n_mels, n_freqs)``, HTK mel scale, no
  normalisation: edges evenly spaced in Hz instead of mel, Slaney's mel scale, a natural log with
  HTK's 2595 (the conversions do not undo each other), FFT bins spread to sample_rate instead of
  sample_rate / 2, triangles linear in mel instead of Hz, no clamp at 0, Slaney's area
  normalisation, each row rescaled to peak at 1, the output transposed, the wrong number of filters
  (n_mels + 2 edges). Compared with ``tfedu.audio.mel_filterbank(..., htk=True, norm=None)``, then
  used for a log-mel spectrogram of a chirp. librosa and torchaudio are refused.

The feedback after a wrong layout shows the learner's first patches of a small image whose values
are their own positions, ``torch.arange(48.).reshape(1, 2, 4, 6)`` with P = 2 (:data:`DEMO_SHAPE`).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tfedu.checks.core import (
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


# ----------------------------------------------------------------------------- 11.2 mel_filterbank

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

PROBES = {
    "check_patchify": Probe(
        exercise="ex_patchify", make_inputs=_patchify_probe_inputs, run=PATCHIFY_PROBE_RUN,
        reference=_patchify_probe_reference, compare=_compare_patchify, forbidden=PATCHIFY_FORBIDDEN),
    "check_mel_filterbank": Probe(
        exercise="ex_mel_filterbank", make_inputs=_mel_probe_inputs, run=MEL_PROBE_RUN,
        reference=_mel_probe_reference, compare=_compare_mel, forbidden=MEL_FORBIDDEN),
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
    "ex_mel_filterbank": Hints(
        number="11.2",
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
}
