"""Checker and probe of notebook 11: each passes the reference and right alternatives, and names realistic mistakes."""

import einops
import numpy as np
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


# ----------------------------------------------------------------------------- 11.2 the ViT from your parts

from torch import nn  # noqa: E402

from tfedu import attention as tfa  # noqa: E402
from tfedu.checks import nb07_transformer_block as nb07  # noqa: E402
from tfedu.checks.core import standin_objects  # noqa: E402

VIT_PROBE = nb11.PROBES["check_vit_forward"]


def make_vit_forward(mistake=""):
    """A learner's vit_forward from the reference parts (05, 07, 11.1), right or with one ``mistake``."""
    cut = rearranged("b (w h) (c p1 p2)") if mistake == "columns" else patchify

    def vit_forward(images, weights, patch_size, n_heads, n_layers, eps):
        W = weights
        d = W["cls_token"].shape[-1]
        conv = W["patch_embed.proj.weight"]
        flat = {"weight reshaped": lambda: conv.reshape(-1, d),
                "weight (p1 p2 c)": lambda: conv.permute(0, 2, 3, 1).reshape(d, -1).T}.get(mistake, lambda: conv.reshape(d, -1).T)()
        tokens = cut(images, patch_size) @ flat + W["patch_embed.proj.bias"]
        cls, pos = W["cls_token"].expand(len(images), -1, -1), W["pos_embed"]
        resid = {"no cls": lambda: tokens + pos[:, 1:], "cls last": lambda: torch.cat([tokens, cls], 1) + pos,
                 "no pos": lambda: torch.cat([cls, tokens], 1),
                 "pos before cls": lambda: torch.cat([cls, tokens + pos[:, 1:]], 1)}.get(
            mistake, lambda: torch.cat([cls, tokens], 1) + pos)()
        used_eps = 1e-5 if mistake == "eps default" else eps

        def norm(name):
            return lambda x: nb07.reference_layer_norm(x, W[name + ".weight"], W[name + ".bias"], used_eps)

        def loaded(module, prefix):
            module.load_state_dict({k[len(prefix):]: v for k, v in W.items() if k.startswith(prefix)})
            return module

        for i in range(n_layers):
            mha = loaded(tfa.MultiHeadAttention(d, n_heads), f"blocks.{i}.attn.")
            mlp = loaded(nb07.reference_ffn(d, "gelu_tanh" if mistake == "tanh" else "gelu"), f"blocks.{i}.mlp.")
            if mistake == "relu":
                mlp = lambda x, m=mlp: m.W_out(torch.relu(m.W_in(x)))  # noqa: E731
            n = resid.shape[1]
            attn = (lambda x, m=mha: m(x, mask=tfa.causal_mask(n, n))) if mistake == "causal" else mha
            ln1, ln2 = norm(f"blocks.{i}.ln1"), norm(f"blocks.{i}.ln2")
            if mistake == "post-norm":
                resid = ln1(resid + attn(resid))
                resid = ln2(resid + mlp(resid))
            else:
                resid = nb07.reference_pre_norm_block(resid, ln1, attn, ln2, mlp)
        final = (lambda x: x) if mistake == "no final norm" else norm("ln_final")
        state = {"mean of patches": lambda: final(resid[:, 1:].mean(1)), "cls last": lambda: final(resid[:, -1]),
                 "every token": lambda: final(resid)}.get(mistake, lambda: final(resid[:, 0]))()
        return state @ W["head.weight"].T + W["head.bias"]

    return vit_forward


def vit_by_hand(images, weights, patch_size, n_heads, n_layers, eps):
    """Another right answer: no parts, everything in functional torch, attention by scaled_dot_product_attention."""
    W = weights
    patches = einops.rearrange(images, "b c (h p1) (w p2) -> b (h w) (c p1 p2)", p1=patch_size, p2=patch_size)
    tokens = F.linear(patches, W["patch_embed.proj.weight"].flatten(1), W["patch_embed.proj.bias"])
    x = torch.cat([W["cls_token"].repeat(len(images), 1, 1), tokens], 1) + W["pos_embed"]
    for i in range(n_layers):
        w = {k.removeprefix(f"blocks.{i}."): v for k, v in W.items() if k.startswith(f"blocks.{i}.")}
        h = F.layer_norm(x, x.shape[-1:], w["ln1.weight"], w["ln1.bias"], eps)
        q, k, v = (einops.rearrange(F.linear(h, w[f"attn.{m}.weight"], w[f"attn.{m}.bias"]), "b n (h d) -> b h n d", h=n_heads)
                   for m in ("W_Q", "W_K", "W_V"))
        z = einops.rearrange(F.scaled_dot_product_attention(q, k, v), "b h n d -> b n (h d)")
        x = x + F.linear(z, w["attn.W_O.weight"], w["attn.W_O.bias"])
        h = F.layer_norm(x, x.shape[-1:], w["ln2.weight"], w["ln2.bias"], eps)
        x = x + F.linear(F.gelu(F.linear(h, w["mlp.W_in.weight"], w["mlp.W_in.bias"])), w["mlp.W_out.weight"], w["mlp.W_out.bias"])
    cls = F.layer_norm(x[:, 0], x.shape[-1:], W["ln_final.weight"], W["ln_final.bias"], eps)
    return F.linear(cls, W["head.weight"], W["head.bias"])


VIT_MISTAKES = {  # name: a phrase of its hint
    "no cls": "has no class token", "cls last": "comes after the patches", "no pos": "no position embeddings",
    "pos before cls": "before putting the class token in front", "mean of patches": "mean over the tokens",
    "no final norm": "without the final LayerNorm", "causal": "causal mask", "tanh": "tanh approximation",
    "relu": "use ReLU", "eps default": "do not use the eps", "columns": "down the columns of the patch grid",
    "post-norm": "post-norm", "weight reshaped": "not the weight's transpose", "weight (p1 p2 c)": "with the channel last",
    "every token": "logits for every token",
}


@pytest.mark.parametrize("answer", [make_vit_forward(), vit_by_hand], ids=["from the parts", "by hand"])
def test_vit_forward_passes_right_answers(answer, capsys):
    nb11.check_vit_forward(answer)
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", VIT_MISTAKES)
def test_vit_forward_names_each_mistake(name):
    assert VIT_MISTAKES[name] in failure_of(nb11.check_vit_forward, make_vit_forward(name))


def test_the_eps_mistake_shows_at_the_checks_tolerance_only_with_a_small_stream():
    """eps 1e-5 for 1e-12 moves the logits by less than the tolerance on ordinary weights (so on those cases it is not
    named), and by far more where the embeddings are 1e-3 small: that case names it."""
    for seed, small, config in nb11.VIT_CASES:
        hf, case = nb11.hf_vit_case(seed, small, config)
        args = [case[k] for k in ("images", "weights", "patch_size", "n_heads", "n_layers", "eps")]
        want = nb11.vit_variant(*args)
        gap = float((nb11.vit_variant(*args, mistake="eps 1e-5") - want).abs().max()) / max(1.0, float(want.abs().max()))
        assert (gap > 100 * nb11.VIT_RTOL) if small else (gap < 30 * nb11.VIT_RTOL), (seed, gap)


def test_vit_reference_equals_transformers_in_float64_and_the_notebooks_vit():
    from tfedu.vision import ViT, ViTConfig, vit_from_hf

    for seed, small, config in nb11.VIT_CASES:
        hf, case = nb11.hf_vit_case(seed, small, config)
        args = [case[k] for k in ("images", "weights", "patch_size", "n_heads", "n_layers", "eps")]
        with torch.no_grad():
            want = hf.double()(pixel_values=case["images"].double()).logits
        torch.testing.assert_close(nb11.vit_variant(*args), want, rtol=1e-10, atol=1e-10)
        assert vit_from_hf(hf).cfg.norm_eps == 1e-12
    torch.manual_seed(0)
    vit = ViT(ViTConfig(d_model=32, n_layers=2, n_heads=2)).eval()
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(nb11.reference_vit_forward(x, nb11.vit_weights(vit), 2, 2, 2, 1e-5), vit(x))


def test_vit_forward_refuses_the_models_it_rebuilds():
    import tfedu.vision

    namespace = {"vision": tfedu.vision, "torch": torch}
    exec("def vit_forward(images, weights, patch_size, n_heads, n_layers, eps):\n"
         "    return None\n", namespace)
    exec("def whole(images, weights, patch_size, n_heads, n_layers, eps):\n"
         "    cfg = vision.ViTConfig(image_size=images.shape[-2:], patch_size=patch_size)\n"
         "    return vision.ViT(cfg)(images)\n", namespace)
    assert "tfedu.vision" in failure_of(nb11.check_vit_forward, namespace["whole"])
    hidden = {"make": lambda cfg: __import__("tfedu.vision", fromlist=["ViT"]).ViT(cfg)}
    exec("def vit_forward(images, weights, patch_size, n_heads, n_layers, eps):\n"
         "    from tfedu.vision import ViTConfig\n"
         "    d = weights['cls_token'].shape[-1]\n"
         "    cfg = ViTConfig(image_size=tuple(images.shape[-2:]), patch_size=patch_size, in_channels=images.shape[1],\n"
         "                    n_classes=weights['head.bias'].shape[0], d_model=d, n_layers=n_layers, n_heads=n_heads,\n"
         "                    norm_eps=eps)\n"
         "    model = make(cfg)\n"
         "    model.load_state_dict(weights)\n"
         "    return model(images)\n", hidden)
    assert "ViT.forward" in failure_of(nb11.check_vit_forward, hidden["vit_forward"])
    with pytest.raises(ExerciseNotDone):
        nb11.check_vit_forward(not_done)


def vit_namespace(answer):
    """The notebook's names as the hidden test sees them: the answer and the parts it calls (the references here)."""
    return {"vit_forward": answer, "patchify": patchify, **nb11.reference_parts()}


@pytest.mark.parametrize("seed", range(4))
def test_vit_probe_passes_right_answers(seed):
    for answer in (make_vit_forward(), vit_by_hand):
        assert verdict(VIT_PROBE, vit_namespace(answer), seed) is None
    namespace = vit_namespace(None) | {"torch": torch}
    exec("def vit_forward(images, weights, patch_size, n_heads, n_layers, eps):\n"
         "    W = weights\n"
         "    d = W['cls_token'].shape[-1]\n"
         "    tokens = patchify(images, patch_size) @ W['patch_embed.proj.weight'].flatten(1).T + W['patch_embed.proj.bias']\n"
         "    resid = torch.cat([W['cls_token'].expand(len(images), -1, -1), tokens], 1) + W['pos_embed']\n"
         "    norm = lambda name: (lambda x: layer_norm(x, W[name + '.weight'], W[name + '.bias'], eps))\n"
         "    def loaded(module, prefix):\n"
         "        module.load_state_dict({k[len(prefix):]: v for k, v in W.items() if k.startswith(prefix)})\n"
         "        return module\n"
         "    for i in range(n_layers):\n"
         "        attn = loaded(MultiHeadAttention(d, n_heads), f'blocks.{i}.attn.')\n"
         "        mlp = loaded(FFN(d, 'gelu'), f'blocks.{i}.mlp.')\n"
         "        resid = pre_norm_block(resid, norm(f'blocks.{i}.ln1'), attn, norm(f'blocks.{i}.ln2'), mlp)\n"
         "    return norm('ln_final')(resid[:, 0]) @ W['head.weight'].T + W['head.bias']\n", namespace)
    assert verdict(VIT_PROBE, namespace, seed) is None
    assert verdict(VIT_PROBE, namespace, seed, standins=True) is None  # the parts replaced by the stand-ins


def test_vit_probe_names_each_mistake():
    for name, phrase in VIT_MISTAKES.items():
        for seed in range(2):
            if name == "weight (p1 p2 c)":  # the probe draws 1 to 3 channels: pick seeds with several
                seed += 10
            feedback = verdict(VIT_PROBE, vit_namespace(make_vit_forward(name)), seed)
            assert feedback is not None and phrase in feedback, (name, seed, feedback)


def test_vit_stand_ins_pass_their_own_exercises_checks():
    from tfedu.checks import nb05_masks_and_heads as nb05

    parts = standin_objects(VIT_PROBE)
    assert sorted(parts) == ["FFN", "MultiHeadAttention", "layer_norm", "patchify", "pre_norm_block"]
    nb05.check_multi_head_attention(parts["MultiHeadAttention"])
    nb07.check_ffn(parts["FFN"])
    nb07.check_layer_norm(parts["layer_norm"])
    nb07.check_pre_norm_block(parts["pre_norm_block"])
    nb11.check_patchify(parts["patchify"])


def test_vit_probe_scan_refuses_the_models_and_allows_the_parts():
    context = ["import torch\nimport torch.nn.functional as F\nfrom torch import nn\nimport math, einops"]
    head = "def vit_forward(images, weights, patch_size, n_heads, n_layers, eps):\n    return "
    for body in ("transformers.ViTForImageClassification(config)(images).logits",
                 "nn.TransformerEncoderLayer(32, 4)(images)"):
        assert scan_answer("import transformers\n" + head + body, context=context, forbidden=VIT_PROBE.forbidden,
                           allowed=VIT_PROBE.builds), body
    assert scan_answer("from tfedu.vision import ViT\n", context=context, forbidden=VIT_PROBE.forbidden)
    assert scan_answer(head + "F.layer_norm(F.gelu(images), (4,))", context=context, forbidden=VIT_PROBE.forbidden,
                       allowed=VIT_PROBE.builds) == []


# ----------------------------------------------------------------------------- 11.4 the Conformer's convolution module

CONV_PROBE = nb11.PROBES["check_conv_module"]


def make_conv_module(mistake=""):
    """A learner's ConvModule, right or with one ``mistake``."""

    class ConvModule(nn.Module):
        def __init__(self, d_model, kernel_size):
            super().__init__()
            self.k = kernel_size
            self.norm = nn.LayerNorm(d_model)
            self.pointwise_in = nn.Conv1d(d_model, d_model if mistake == "no glu" else 2 * d_model, 1)
            padding = {"causal": kernel_size - 1, "no padding": 0}.get(mistake, kernel_size // 2)
            self.depthwise = nn.Conv1d(d_model, d_model, kernel_size, padding=padding,
                                       groups=1 if mistake == "dense" else d_model)
            self.batch_norm = nn.LayerNorm(d_model) if mistake == "layer norm for batch norm" else nn.BatchNorm1d(d_model)
            self.pointwise_out = nn.Conv1d(d_model, d_model, 1)

        def forward(self, x):
            if mistake == "not done":
                raise NotImplementedError
            batch, T, d = x.shape
            h = self.norm(x)
            h = h if mistake == "no transpose" else h.reshape(batch, d, T) if mistake == "reshape" else h.transpose(1, 2)
            h = self.pointwise_in(h)
            h = {"no glu": lambda: h, "glu over time": lambda: F.glu(h, dim=2),
                 "glu swapped": lambda: h[:, d:] * torch.sigmoid(h[:, :d])}.get(mistake, lambda: F.glu(h, dim=1))()
            h = self.depthwise(h)
            if mistake == "causal":
                h = h[..., :T]
            if mistake == "off centre":
                h = F.conv1d(F.pad(self.norm(x).transpose(1, 2), (0, 0)), self.pointwise_in.weight,
                             self.pointwise_in.bias)
                h = F.glu(h, dim=1)
                h = F.conv1d(F.pad(h, (self.k // 2 - 1, self.k // 2 + 1)), self.depthwise.weight, self.depthwise.bias,
                             groups=d)
            if mistake == "batch norm over time":
                h = self.batch_norm(h.transpose(1, 2)).transpose(1, 2)
            else:
                h = self.batch_norm(h)
            h = {"relu": torch.relu, "sigmoid": torch.sigmoid}.get(mistake, F.silu)(h)
            out = self.pointwise_out(h).transpose(1, 2)
            return {"no residual": out, "residual normed": self.norm(x) + out}.get(mistake, x + out)

    return ConvModule


class ConvByHand(nn.Module):
    """Another right answer: pointwise layers as nn.Linear on (batch, time, channels), the GLU by hand, F.conv1d."""

    def __init__(self, d_model, kernel_size):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.pointwise_in = nn.Linear(d_model, 2 * d_model)
        self.depthwise = nn.Conv1d(d_model, d_model, kernel_size, groups=d_model)
        self.batch_norm = nn.BatchNorm1d(d_model)
        self.pointwise_out = nn.Linear(d_model, d_model)

    def forward(self, x):
        value, gate = self.pointwise_in(self.norm(x)).chunk(2, dim=-1)
        h = (value * torch.sigmoid(gate)).transpose(1, 2)
        k = self.depthwise.kernel_size[0]
        h = self.depthwise(F.pad(h, (k // 2, k // 2)))
        h = self.batch_norm(h)
        return x + self.pointwise_out((h * torch.sigmoid(h)).transpose(1, 2))


CONV_MISTAKES = {  # name: a phrase of its hint
    "no residual": "only the convolution path", "residual normed": "adds the LayerNorm's output",
    "no glu": "keeps d_model channels", "glu over time": "halves the time axis", "glu swapped": "other way round",
    "dense": "a full convolution", "causal": "shifted by", "off centre": "shifted by 1 frame",
    "no padding": "frames for", "layer norm for batch norm": "no running statistics",
    "batch norm over time": "your BatchNorm received", "relu": "ReLU", "sigmoid": "the sigmoid alone",
    "no transpose": "Conv1d wants channels first", "reshape": "with a reshape",
}


@pytest.mark.parametrize("answer", [make_conv_module(), ConvByHand], ids=["conv layers", "linear and by hand"])
def test_conv_module_passes_right_answers(answer, capsys):
    nb11.check_conv_module(answer)
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", CONV_MISTAKES)
def test_conv_module_names_each_mistake(name):
    assert CONV_MISTAKES[name] in failure_of(nb11.check_conv_module, make_conv_module(name))


def test_conv_module_causal_padding_names_the_shift_and_refuses_tfedu_audio():
    feedback = failure_of(nb11.check_conv_module, make_conv_module("causal"))
    assert "shifted by 1 frame (causal padding" in feedback  # the first case's kernel is 3: a shift of 3 // 2 frames
    import tfedu.audio

    namespace = {"audio": tfedu.audio, "nn": nn}
    exec("class ConvModule(nn.Module):\n"
         "    def __init__(self, d_model, kernel_size):\n"
         "        super().__init__()\n"
         "        self.inner = audio.ConformerConvModule(d_model, kernel_size=kernel_size)\n"
         "    def forward(self, x):\n"
         "        return x + self.inner(x)\n", namespace)
    assert "tfedu.audio" in failure_of(nb11.check_conv_module, namespace["ConvModule"])
    assert "ConformerConvModule" in failure_of(nb11.check_conv_module, nb11.ReferenceConvModule)
    with pytest.raises(ExerciseNotDone):
        nb11.check_conv_module(make_conv_module("not done"))


def test_conv_reference_is_tfedu_audios_module_with_its_residual():
    rng = __import__("numpy").random.default_rng(0)
    case = nb11.make_conv_case(rng, 8, 5, 12, 3)
    module = tfedu_audio_module(case)
    x = torch.from_numpy(case["x"])
    for training in (False, True):
        with torch.no_grad():
            want = x.double() + module.train(training)(x).double()
        torch.testing.assert_close(nb11.conv_variant(case["x"], case["weights"], 5, training=training), want,
                                   rtol=1e-5, atol=1e-5)


def tfedu_audio_module(case):
    from tfedu.audio import ConformerConvModule

    module = ConformerConvModule(case["d_model"], kernel_size=case["kernel_size"])
    module.load_state_dict({n: torch.as_tensor(v) for n, v in case["weights"].items()})
    return module


def test_conv_reference_equals_torchaudios_conformer_convolution_module():
    # An oracle for machines that have it: torchaudio has no release for the pinned torch 2.13 (its last is 2.11),
    # so CI skips this; tests/test_audio.py checks the reference's structure and its shift equivariance.
    torchaudio = pytest.importorskip("torchaudio", reason="torchaudio has no release for torch 2.13")
    from torchaudio.models.conformer import _ConvolutionModule

    rng = np.random.default_rng(1)
    case = nb11.make_conv_case(rng, 8, 5, 12, 3)
    theirs = _ConvolutionModule(8, 8, 5).eval()
    ours = tfedu_audio_module(case).eval()
    with torch.no_grad():  # their sequential: LayerNorm, then pointwise, GLU, depthwise, BatchNorm, SiLU, pointwise
        theirs.layer_norm.load_state_dict(ours.norm.state_dict())
        seq = theirs.sequential
        seq[0].load_state_dict(ours.pointwise_in.state_dict())
        seq[2].load_state_dict(ours.depthwise.state_dict())
        seq[3].load_state_dict(ours.batch_norm.state_dict())
        seq[5].load_state_dict(ours.pointwise_out.state_dict())
        x = torch.from_numpy(case["x"])
        torch.testing.assert_close(x + theirs(x), nb11.conv_variant(case["x"], case["weights"], 5, training=False).float(),
                                   rtol=1e-5, atol=1e-5)
    assert torchaudio is not None


@pytest.mark.parametrize("seed", range(4))
def test_conv_probe_passes_right_answers(seed):
    for answer in (make_conv_module(), ConvByHand):
        assert verdict(CONV_PROBE, {"ConvModule": answer}, seed) is None


def test_conv_probe_names_each_mistake():
    for name, phrase in CONV_MISTAKES.items():
        if name in ("causal", "off centre"):
            phrase = "shifted by"  # the probe draws the kernel size
        for seed in range(2):
            feedback = verdict(CONV_PROBE, {"ConvModule": make_conv_module(name)}, seed)
            assert feedback is not None and phrase in feedback, (name, seed, feedback)
