"""Checker and probe of notebook 11: each passes the reference and right alternatives, and names realistic mistakes."""

import einops
import pytest
import torch
import torch.nn.functional as F
from torch.nn.functional import unfold as imported_unfold

from tfedu.checks import nb11_beyond_text as nb11
from checker_helpers import failure_of, not_done, verdict
from tfedu.checks.core import CheckFailure, ExerciseNotDone, run_probe
from tfedu.checks.scan import scan_answer
from tfedu.vision import patchify

pytestmark = pytest.mark.usefixtures("one_torch_thread")




def rearranged(pattern):
    """A patchify written with einops, cutting to ``pattern`` (right or wrong)."""
    return lambda images, P: einops.rearrange(images, f"b c (h p1) (w p2) -> {pattern}", p1=P, p2=P)


def by_reshape(images, P):
    b, c, H, W = images.shape
    return images.reshape(b, c, H // P, P, W // P, P).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * P * P)


def by_tensor_unfold(images, P, stride=None):
    windows = images.unfold(2, P, stride or P).unfold(3, P, stride or P)  # b c rows cols P P
    return windows.permute(0, 2, 3, 1, 4, 5).flatten(1, 2).flatten(2)


def in_place(images, P):
    images -= images.mean()  # "normalise" the caller's images
    return by_reshape(images + images.mean(), P)


RIGHT = {"reshape": by_reshape, "einops": rearranged("b (h w) (c p1 p2)"),
         "tensor unfold": by_tensor_unfold}

MISTAKES = {  # name: (wrong patchify, a phrase its hint must contain)
    "channel last in patch": (rearranged("b (h w) (p1 p2 c)"), "flattened with the channel last ((p1 p2 c)"),
    "patch rows and columns swapped": (rearranged("b (h w) (c p2 p1)"), "columns before the rows ((c p2 p1)"),
    "channel in the middle": (rearranged("b (h w) (p1 c p2)"), "channel is not the first axis"),
    "grid column by column": (rearranged("b (w h) (c p1 p2)"), "down the columns of the patch grid first ((w h))"),
    "three at once": (rearranged("b (w h) (p2 p1 c)"), "in the wrong order in 3 ways"),
    "channels-last input": (lambda x, P: einops.rearrange(x, "b (h p1) (w p2) c -> b (h w) (c p1 p2)", p1=P, p2=P),
                            "treats images as (batch, height, width, channels)"),
    "channels-last input, (p1 p2 c)": (
        lambda x, P: einops.rearrange(x, "b (h p1) (w p2) c -> b (h w) (p1 p2 c)", p1=P, p2=P),
        "channels last: it cuts correctly when given the images with their channel axis moved last"),
    "overlapping strides": (lambda x, P: by_tensor_unfold(x, P, stride=1), "your patches overlap"),
    "stride 2 of 4": (lambda x, P: by_tensor_unfold(x, P, stride=max(1, P // 2)), "a stride of"),
    "naive reshape": (lambda x, P: x.reshape(x.shape[0], -1, x.shape[1] * P * P), "not a P x P square"),
    "split as (P, H/P)": (lambda x, P: einops.rearrange(x, "b c (p1 h) (p2 w) -> b (h w) (c p1 p2)", p1=P, p2=P),
                          "strided samples"),
    "channel not moved": (lambda x, P: rearranged("b (c h w p1 p2)")(x, P).reshape(x.shape[0], -1, x.shape[1] * P * P),
                          "channel axis stayed in front of the grid"),
    "transposed output": (lambda x, P: by_reshape(x, P).transpose(1, 2), "(batch, patch_dim, n_patches), transposed"),
    "channels dropped": (lambda x, P: by_reshape(x[:, :1], P), "every channel, channels * P * P"),
    "square grid assumed": (lambda x, P: by_reshape(x, P)[:, :(x.shape[2] // P) ** 2], "(H/P) * (W/P)"),
    "float64": (lambda x, P: by_reshape(x.double(), P), "keep their dtype"),
    "changed in place": (in_place, "changed the caller's `images` in place"),
    "view after permute": (lambda x, P: x.reshape(x.shape[0], x.shape[1], x.shape[2] // P, P, x.shape[3] // P, P)
                           .permute(0, 2, 4, 1, 3, 5).view(x.shape[0], -1, x.shape[1] * P * P), "use .reshape"),
    "not a tensor": (lambda x, P: by_reshape(x, P).tolist(), "should return a torch.Tensor"),
    "one patch wrong": (lambda x, P: torch.cat([by_reshape(x, P)[:, :-1], by_reshape(x, P)[:, -1:] + 1], 1),
                        "not the reference's"),
}


@pytest.mark.parametrize("name", RIGHT)
def test_patchify_passes_right_answers(name, capsys):
    nb11.check_patchify(RIGHT[name])
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", MISTAKES)
def test_patchify_names_each_mistake(name):
    wrong, fragment = MISTAKES[name]
    message = failure_of(nb11.check_patchify, wrong)
    assert fragment in message, message


def test_the_feedback_shows_the_learners_patches_of_a_small_image():
    message = failure_of(nb11.check_patchify, rearranged("b (w h) (c p1 p2)"))
    assert "one (1, 2, 4, 6) image whose pixels hold their own positions, 0 to 47" in message
    assert "your first two patches are [[0, 1, 6, 7, 24, 25, 30, 31], [12, 13, 18, 19, 36, 37, 42, 43]]" in message
    assert "expected [[0, 1, 6, 7, 24, 25, 30, 31], [2, 3, 8, 9, 26, 27, 32, 33]]" in message
    assert "AST, the Audio Spectrogram Transformer" in failure_of(nb11.check_patchify, MISTAKES["overlapping strides"][0])


def test_patchify_refuses_the_shortcuts_and_says_when_not_done():
    def with_unfold(images, P):
        return F.unfold(images, P, stride=P).transpose(1, 2)

    def with_imported_unfold(images, P):
        return imported_unfold(images, P, stride=P).transpose(1, 2)

    def with_conv(images, P):
        kernel = torch.eye(images.shape[1] * P * P).reshape(-1, images.shape[1], P, P)
        return F.conv2d(images, kernel, stride=P).flatten(2).transpose(1, 2)

    assert "calls torch.nn.functional.unfold: the exercise is the cut itself" in failure_of(nb11.check_patchify, with_unfold)
    assert "calls F.unfold" in failure_of(nb11.check_patchify, with_imported_unfold)
    assert "calls conv2d" in failure_of(nb11.check_patchify, with_conv)
    assert "calls tfedu.vision.patchify" in failure_of(nb11.check_patchify, lambda x, P: patchify(x, P).clone())
    assert "calls torch.nn.functional.unfold" in failure_of(nb11.check_patchify, patchify)  # the reference cuts with it
    assert "einops.rearrange" in failure_of(nb11.check_patchify, with_unfold)  # says what to use instead
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb11.check_patchify(not_done)


def test_every_layout_mistake_differs_from_the_reference_on_the_first_case():
    seed, batch, channels, height, width, P = nb11.PATCHIFY_CASES[0]
    images = torch.randn(batch, channels, height, width, generator=torch.Generator().manual_seed(seed))
    want = patchify(images, P)
    wrongs = [wrong for _, wrong in nb11.layout_mistakes(images, P)]
    assert all(not torch.equal(wrong, want) for wrong in wrongs)
    assert all(not torch.equal(a, b) for i, a in enumerate(wrongs) for b in wrongs[:i])  # each told apart


# ----------------------------------------------------------------------------- probe

PROBE = nb11.PROBES["check_patchify"]
# Left out: those that raise on the probe's images (the grader scores an exception zero), and float64, which the probe
# lets pass: it exports every float answer as float32, and a float64 copy of the pixels holds the same values.
PROBE_MISTAKES = [name for name in MISTAKES if not name.startswith(("channels-last input", "float64", "view"))]


@pytest.mark.parametrize("name", [*RIGHT, "reference"])
def test_probe_passes_right_answers(name):  # the probe judges outputs only: the grader's scan refuses F.unfold
    for seed in range(4):
        assert verdict(PROBE, {"patchify": RIGHT.get(name, patchify)}, seed) is None, seed


def test_probe_names_mistakes():
    hints = {"changed in place": "changed its input in place", "not a tensor": "should return tensor",
             "one patch wrong": "not the reference's", "stride 2 of 4": "overlap"}
    for name in PROBE_MISTAKES:
        wrong, fragment = MISTAKES[name]
        for seed in range(2):
            feedback = verdict(PROBE, {"patchify": wrong}, seed)
            assert feedback is not None and hints.get(name, fragment) in feedback, (name, seed, feedback)


def test_probe_errors_fail_and_channels_last_is_named_when_it_runs():
    with pytest.raises(Exception):  # in the grader, an exception in the kernel scores zero
        run_probe(PROBE, {"patchify": MISTAKES["channels-last input"][0]}, 0)
    assert "treats images as (batch, height, width, channels)" in PROBE.compare(
        {"returned": ["tensor"], "mutated": [], "patches": [torch.zeros(1, 2, 12).numpy()],
         "channels_last": [patchify(torch.arange(24.).reshape(1, 3, 2, 4), 2).numpy()], "demo": None},
        {"returned": ["tensor"], "inputs": {"images": [torch.arange(24.).reshape(1, 3, 2, 4).numpy()], "patch_sizes": [2]}})


def test_probe_forbids_the_shortcuts_but_not_einops_or_tensor_unfold():
    assert PROBE.exercise == "ex_patchify"
    context = ["import torch\nimport torch.nn.functional as F\nfrom torch import nn\nimport math, einops"]
    head = "def patchify(images, P):\n    return "
    for body in ("F.unfold(images, P, stride=P).mT", "nn.Unfold(P, stride=P)(images).mT", "torch.conv2d(images, w, stride=P)",
                 "nn.Conv2d(3, 12, P, stride=P)(images)"):
        assert scan_answer(head + body, context=context, forbidden=PROBE.forbidden), body
    assert scan_answer("from tfedu.vision import patchify as cut\n", context=context, forbidden=PROBE.forbidden)
    for body in ("images.unfold(2, P, P).unfold(3, P, P).permute(0, 2, 3, 1, 4, 5).flatten(1, 2).flatten(2)",
                 "einops.rearrange(images, 'b c (h p1) (w p2) -> b (h w) (c p1 p2)', p1=P, p2=P)"):
        assert scan_answer(head + body, context=context, forbidden=PROBE.forbidden) == [], body


# ----------------------------------------------------------------------------- 11.2 mel_filterbank

def mel_by_hand(n_freqs, n_mels, sample_rate):
    """A learner's answer, written as the exercise asks (not through tfedu)."""
    def hz_to_mel(f):
        return 2595 * torch.log10(1 + f / 700)

    def mel_to_hz(m):
        return 700 * (10 ** (m / 2595) - 1)

    bins = torch.linspace(0, sample_rate / 2, n_freqs, dtype=torch.float64)
    top = hz_to_mel(torch.tensor(sample_rate / 2, dtype=torch.float64))
    edges = mel_to_hz(torch.linspace(0, top, n_mels + 2, dtype=torch.float64))
    low, centre, high = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    return torch.minimum((bins - low) / (centre - low), (high - bins) / (high - centre)).clamp(min=0)


def mel_float32_loop(n_freqs, n_mels, sample_rate):
    """Another right answer: a loop over filters, in float32, with math instead of torch for the scale."""
    import math
    top = 2595 * math.log10(1 + sample_rate / 2 / 700)
    edges = [700 * (10 ** (top * i / (n_mels + 1) / 2595) - 1) for i in range(n_mels + 2)]
    bins = torch.linspace(0, sample_rate / 2, n_freqs)
    rows = []
    for m in range(n_mels):
        up = (bins - edges[m]) / (edges[m + 1] - edges[m])
        down = (edges[m + 2] - bins) / (edges[m + 2] - edges[m + 1])
        rows.append(torch.clamp(torch.minimum(up, down), min=0))
    return torch.stack(rows)


MEL_MISTAKES = {
    "linear in Hz": (lambda n, m, sr: nb11.mel_variant(n, m, sr, scale="linear"), "evenly spaced in Hz"),
    "Slaney scale": (lambda n, m, sr: nb11.mel_variant(n, m, sr, scale="slaney"), "Slaney's mel scale"),
    "ln with 2595": (lambda n, m, sr: nb11.mel_variant(n, m, sr, scale="mixed"), "do not undo each other"),
    "bins to sample_rate": (lambda n, m, sr: nb11.mel_variant(n, m, sr, bins_to_sr=True), "0 to sample_rate /"),
    "triangles in mel": (lambda n, m, sr: nb11.mel_variant(n, m, sr, in_mel=True), "straight lines in mel"),
    "no clamp": (lambda n, m, sr: nb11.mel_variant(n, m, sr, clamp=False), "go negative"),
    "area normalised": (lambda n, m, sr: nb11.mel_variant(n, m, sr, area=True), "area 1"),
    "rows rescaled": (lambda n, m, sr: nb11.mel_variant(n, m, sr, max_peak=True), "peaks at exactly 1"),
    "transposed": (lambda n, m, sr: mel_by_hand(n, m, sr).T, "transposed"),
    "n_mels edges": (lambda n, m, sr: mel_by_hand(n, m - 2, sr), "n_mels \\+ 2 edges"),
    "numpy": (lambda n, m, sr: mel_by_hand(n, m, sr).numpy(), "should return a torch.Tensor"),
}


@pytest.mark.parametrize("answer", [mel_by_hand, mel_float32_loop], ids=["vectorised", "loop float32"])
def test_mel_filterbank_passes_right_answers(answer, capsys):
    nb11.check_mel_filterbank(answer)
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", MEL_MISTAKES)
def test_mel_filterbank_names_each_mistake(name):
    answer, phrase = MEL_MISTAKES[name]
    with pytest.raises(CheckFailure, match=phrase):
        nb11.check_mel_filterbank(answer)


def test_mel_filterbank_refuses_librosa_and_says_when_not_done():
    import types
    fake = types.SimpleNamespace(filters=types.SimpleNamespace(mel=lambda **kw: None))
    namespace = {"librosa": fake}
    exec("def mel_filterbank(n_freqs, n_mels, sample_rate):\n"
         "    return librosa.filters.mel(sr=sample_rate, n_fft=2 * (n_freqs - 1), n_mels=n_mels)\n", namespace)
    assert "librosa" in failure_of(nb11.check_mel_filterbank, namespace["mel_filterbank"])
    with pytest.raises(ExerciseNotDone):
        nb11.check_mel_filterbank(not_done)


MEL_PROBE = nb11.PROBES["check_mel_filterbank"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mel_probe_passes_right_answers_and_names_mistakes(seed):
    assert verdict(MEL_PROBE, {"mel_filterbank": mel_by_hand}, seed) is None
    assert verdict(MEL_PROBE, {"mel_filterbank": mel_float32_loop}, seed) is None
    for name in ("linear in Hz", "area normalised", "transposed"):
        answer, phrase = MEL_MISTAKES[name]
        problem = verdict(MEL_PROBE, {"mel_filterbank": answer}, seed)
        assert problem is not None and __import__("re").search(phrase, problem), (name, problem)


def test_mel_filterbank_passes_float32_work_and_refuses_tfedu_audio():
    import functools
    import tfedu.audio

    def float32_then_cast(n_freqs, n_mels, sample_rate):
        top = 2595 * torch.log10(torch.tensor(1 + sample_rate / 2 / 700))  # float32 throughout
        edges = 700 * (10 ** (torch.linspace(0, float(top), n_mels + 2) / 2595) - 1)
        bins = torch.linspace(0, sample_rate / 2, n_freqs)
        low, centre, high = edges[:-2, None], edges[1:-1, None], edges[2:, None]
        return torch.minimum((bins - low) / (centre - low), (high - bins) / (high - centre)).clamp(min=0).double()

    nb11.check_mel_filterbank(float32_then_cast)
    namespace = {"mel_fn": functools.partial(tfedu.audio.mel_filterbank, htk=True, norm=None), "audio": tfedu.audio}
    exec("def wrapped(n_freqs, n_mels, sample_rate):\n    return mel_fn(n_freqs, n_mels, sample_rate)\n"
         "def direct(n_freqs, n_mels, sample_rate):\n"
         "    return audio.mel_filterbank(n_freqs, n_mels, sample_rate, htk=True, norm=None)\n", namespace)
    for name in ("wrapped", "direct"):
        assert "tfedu.audio" in failure_of(nb11.check_mel_filterbank, namespace[name]), name


def test_patchify_through_tfedu_vision_is_named_as_such():
    import tfedu.vision

    namespace = {"vision": tfedu.vision}
    exec("def patchify(images, patch_size):\n    return vision.patchify(images, patch_size)\n", namespace)
    assert "tfedu.vision (as vision)" in failure_of(nb11.check_patchify, namespace["patchify"])
    hidden = {"fn": getattr(tfedu.vision, "patchify")}  # reached through another name: caught while it runs
    exec("def patchify(images, patch_size):\n    return fn(images, patch_size)\n", hidden)
    assert "patchify calls" in failure_of(nb11.check_patchify, hidden["patchify"])
