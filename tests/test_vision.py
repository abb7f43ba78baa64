"""tfedu.vision: patches, the ViT against transformers' ViTForImageClassification, the digits experiments."""

import math

import einops
import pytest
import torch

from tfedu.vision import (
    SmallCNN,
    LinearPatchEmbedding,
    PatchEmbedding,
    ViT,
    ViTConfig,
    accuracy,
    attention_distance,
    data_efficiency,
    fit_classifier,
    load_digits,
    patch_linear,
    patchify,
    stratified_subset,
)


@pytest.fixture(scope="module")
def digits():
    return load_digits()


@pytest.mark.parametrize("shape, patch", [((2, 1, 8, 8), 2), ((3, 3, 12, 8), 4), ((1, 2, 6, 10), (3, 5))])
def test_patchify_equals_an_einops_rearrange_exactly(shape, patch, typechecked):
    x = torch.randn(shape)
    ph, pw = (patch, patch) if isinstance(patch, int) else patch
    expected = einops.rearrange(x, "b c (h p1) (w p2) -> b (h w) (c p1 p2)", p1=ph, p2=pw)
    assert torch.equal(typechecked(patchify)(x, patch), expected)


def test_patches_come_row_by_row_and_flatten_channel_first():
    x = torch.arange(2 * 4 * 4.).reshape(1, 2, 4, 4)  # channel 1 = channel 0 + 16
    patches = patchify(x, 2)[0]
    assert patches[1].tolist() == [2, 3, 6, 7, 18, 19, 22, 23]  # top-right patch, channel 0 then 1
    assert patches[2].tolist()[:4] == [8, 9, 12, 13]  # bottom-left


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conv_patch_embedding_equals_unfold_plus_linear(dtype):
    torch.manual_seed(0)
    embed = PatchEmbedding(3, 16, 4).to(dtype)
    # Exactly, bit for bit, on small integers: every product and partial sum is exact in floating
    # point, so the order of summation (conv's kernel vs matmul's) cannot change the result.
    with torch.no_grad():
        embed.proj.weight.copy_(torch.randint(-3, 4, embed.proj.weight.shape))
        embed.proj.bias.copy_(torch.randint(-3, 4, embed.proj.bias.shape))
    x = torch.randint(0, 17, (5, 3, 8, 12)).to(dtype)
    linear = patch_linear(embed)
    assert torch.equal(linear(patchify(x, 4)), embed(x))
    assert torch.equal(LinearPatchEmbedding.from_conv(embed)(x), embed(x))
    # On random values the two sum in different orders: equal to rounding only.
    nn_init = torch.nn.init
    nn_init.normal_(embed.proj.weight)
    x = torch.randn(5, 3, 8, 12, dtype=dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(patch_linear(embed)(patchify(x, 4)), embed(x), rtol=tol, atol=tol)


def test_patch_embedding_is_equivariant_to_shifts_by_whole_patches():
    """What the deck's "ViT: no inductive bias" leaves out: the patch embedding is one shared map."""
    embed = PatchEmbedding(1, 8, 2)
    x = torch.randn(1, 1, 8, 8)
    shifted = torch.roll(x, shifts=2, dims=-1)  # one patch to the right (wrapping around)
    grid, grid_shifted = embed(x).reshape(4, 4, 8), embed(shifted).reshape(4, 4, 8)
    torch.testing.assert_close(torch.roll(grid, shifts=1, dims=1), grid_shifted)


@pytest.mark.parametrize("bad, message", [
    (torch.randn(8, 8), "batch, channels, height, width"),
    (torch.randint(0, 5, (1, 1, 8, 8)), "float tensor"),
    (torch.randn(1, 1, 7, 8), "multiple"),
    (torch.randn(1, 8, 8, 1), "channels first|multiple"),
])
def test_bad_images_get_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        patchify(bad, 2)
    with pytest.raises(ValueError, match=message):
        PatchEmbedding(1, 4, 2)(bad)


def test_channels_last_images_are_refused_by_name():
    with pytest.raises(ValueError, match="channels-last"):
        PatchEmbedding(3, 4, 2)(torch.randn(1, 8, 8, 3))


def test_a_linear_patch_embedding_refuses_a_patchify_of_the_wrong_shape():
    embed = LinearPatchEmbedding(1, 4, 2, patchify=lambda x, p: x.flatten(1))
    with pytest.raises(ValueError, match="expected .batch, n_patches, patch_dim."):
        embed(torch.randn(2, 1, 4, 4))


def test_vit_config_validates_and_derives_the_grid():
    cfg = ViTConfig(image_size=(8, 12), patch_size=(2, 4))
    assert cfg.grid == (4, 3) and cfg.n_patches == 12 and cfg.block.n_ctx == 13
    with pytest.raises(ValueError, match="must divide"):
        ViTConfig(image_size=8, patch_size=3)
    with pytest.raises(ValueError, match="patch_size"):
        ViTConfig(patch_size=0)


@pytest.mark.parametrize("kw", [
    dict(image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
         intermediate_size=64, num_labels=10),
    dict(image_size=12, patch_size=4, num_channels=3, hidden_size=24, num_hidden_layers=3, num_attention_heads=2,
         intermediate_size=40, num_labels=5),
])
def test_vit_logits_equal_transformers_vit_for_image_classification(kw, typechecked):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.ViTForImageClassification(transformers.ViTConfig(**kw)).eval()
    with torch.no_grad():  # move every weight off its init, so LayerNorm and bias mistakes would show
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ours = typechecked(ViT.forward)
    model = __import__("tfedu.vision", fromlist=["vit_from_hf"]).vit_from_hf(hf).eval()
    x = torch.randn(3, kw["num_channels"], kw["image_size"], kw["image_size"])
    with torch.no_grad():
        expected = hf(pixel_values=x).logits
        torch.testing.assert_close(ours(model, x), expected, rtol=1e-5, atol=1e-5)
        model_manual = __import__("tfedu.vision", fromlist=["vit_from_hf"]).vit_from_hf(hf).eval()
        for block in model_manual.blocks:
            block.attn.impl = "manual"
        torch.testing.assert_close(model_manual(x), expected, rtol=1e-5, atol=1e-5)


def test_attention_distance_of_uniform_attention_is_the_mean_patch_distance():
    model = ViT(ViTConfig(d_model=16, n_layers=2, n_heads=2)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.W_Q.weight.zero_()
            block.attn.W_Q.bias.zero_()  # every score 0: each query spreads evenly over the keys
    dist = attention_distance(model, torch.randn(4, 1, 8, 8))
    r, c = torch.meshgrid(torch.arange(4) * 2.0, torch.arange(4) * 2.0, indexing="ij")
    centres = torch.stack([r.flatten(), c.flatten()], -1)
    expected = torch.cdist(centres, centres).mean()
    torch.testing.assert_close(dist, torch.full((2, 2), expected.item()))
    assert all(block.attn.impl == "sdpa" for block in model.blocks), "the kernel choice was not restored"


def test_stratified_subset_keeps_the_class_proportions(digits):
    chosen = stratified_subset(digits.train_labels, 30, seed=1)
    assert len(set(chosen.tolist())) == 30
    assert torch.bincount(digits.train_labels[chosen], minlength=10).tolist() == [3] * 10
    with pytest.raises(ValueError, match="between the number of classes"):
        stratified_subset(digits.train_labels, 5)


def test_digits_load_offline_scaled_and_split(digits):
    assert digits.train_images.shape == (1300, 1, 8, 8) and digits.test_images.shape == (497, 1, 8, 8)
    assert 0.0 <= digits.train_images.min() and digits.train_images.max() == 1.0
    assert torch.bincount(digits.test_labels).min() >= 48  # stratified: about 497 / 10 per class


def test_fit_classifier_is_seeded_and_leaves_eval_mode(one_torch_thread):
    x, y = torch.randn(40, 3), torch.randint(0, 2, (40,))
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 2))
        runs.append(fit_classifier(model, x, y, steps=12, batch_size=16, lr=1e-2, seed=5))
        assert not model.training
    assert runs[0] == runs[1] and len(runs[0]) == 12
    model.train()
    accuracy(model, x, y)
    assert model.training  # accuracy puts the mode back
    with pytest.raises(ValueError, match="integer class indices"):
        fit_classifier(model, x, y.float(), steps=1, batch_size=4, lr=1e-2, seed=0)
    with pytest.raises(ValueError, match="same first axis"):
        accuracy(model, x, y[:5])


# The notebook's claims, over three seeds (notebook settings: ViT d_model=32, 2 layers, 2 heads, patches 2x2).
NOTEBOOK_VIT = ViTConfig(d_model=32, n_layers=2, n_heads=2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_cnn_beats_the_vit_on_the_smallest_training_set(digits, seed, one_torch_thread):
    # Measured (seeds 0, 1, 2; 30 images, 300 steps): CNN 0.813, 0.863, 0.807; ViT 0.455, 0.423, 0.457.
    acc = data_efficiency(digits, [30], {"cnn": SmallCNN, "vit": lambda: ViT(NOTEBOOK_VIT)}, steps=300, seed=seed)
    assert acc["cnn"][0] > acc["vit"][0] + 0.15, acc


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_notebook_vit_learns_the_digits(digits, seed, one_torch_thread):
    torch.manual_seed(seed)
    model = ViT(NOTEBOOK_VIT)
    # 500 steps, not the notebook's 300: at 300 the float rounding of the CPU decides the outcome of some seeds (on an
    # AMD EPYC seed 2 reached 0.702 at 300 steps, where an earlier machine measured 0.807), so the claim "this shape
    # learns the digits" is tested where it no longer depends on the CPU. The notebook asserts its own run (seed 0).
    fit_classifier(model, digits.train_images, digits.train_labels, steps=500, batch_size=64, lr=3e-3, seed=seed)
    acc = accuracy(model, digits.test_images, digits.test_labels)
    assert acc > 0.75, acc  # measured 0.940, 0.920, 0.881 on seeds 0-2 at 500 steps (AMD EPYC; chance: 0.10)
    assert not math.isnan(acc)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_on_a_gpu_with_the_data_on_the_cpu_matches_the_cpu(digits):
    losses = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = ViT(NOTEBOOK_VIT).to(device)
        losses[device] = fit_classifier(model, digits.train_images, digits.train_labels, steps=20, batch_size=64,
                                        lr=3e-3, seed=0)
        assert 0 <= accuracy(model, digits.test_images, digits.test_labels) <= 1
    torch.testing.assert_close(losses["cuda"], losses["cpu"], rtol=1e-2, atol=1e-2)  # TF32 and kernel order differ
