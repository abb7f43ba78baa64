"""tfedu.experiments.depth: pre-norm vs post-norm in a deep narrow GPT, gradients at initialisation and training without warm-up.

The headline claims (post-norm stalls at the unigram loss where pre-norm learns; the last block's
gradient at initialisation shrinks with depth in pre-norm only) are asserted once, by the guard cells
of notebooks/07_transformer_block.ipynb, which runs the default config for seeds 0, 1 and 2 (in
tests/test_release.py's run of the notebook): running the same three training runs here as well
cost the suite their time twice. Here: the control (two blocks, the same seeds), and everything
else on a config small enough to train in a fraction of a second.
"""

import dataclasses
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tfedu.experiments import depth  # noqa: E402
from tfedu.data import encode_bytes, load_corpus  # noqa: E402
from tfedu.experiments.depth import (  # noqa: E402
    CPU,
    NORM_POSITIONS,
    DepthConfig,
    DepthResult,
    DepthSweep,
    block_grad_norms,
    build_model,
    grad_norms_at_init,
    grad_norms_vs_depth,
    learning_rate,
    plot_depth,
    plot_grad_norms_vs_depth,
    run_depth,
    unigram_loss,
)
from tfedu.experiments.plot_labels import overlapping_labels  # noqa: E402

TINY = DepthConfig(n_layers=3, d_model=16, n_heads=2, n_ctx=8, steps=6, batch=4, final_window=3)
TEXT = load_corpus()[:20_000]


# ----------------------------------------------------------------------------- shapes and fields


def test_run_records_every_field_for_both_variants():
    result = run_depth(TINY, text=TEXT)
    assert isinstance(result, DepthResult) and set(result.runs) == set(NORM_POSITIONS)
    for name, run in result.runs.items():
        assert run.norm_position == name
        assert len(run.losses) == TINY.steps and all(math.isfinite(v) for v in run.losses)
        assert len(run.grad_norms) == TINY.n_layers and all(v > 0 for v in run.grad_norms)
        assert run.diverged is False and run.cpu_seconds > 0
        assert run.final_loss == pytest.approx(sum(run.losses[-3:]) / 3)
        # The first loss is about ln(256): neither variant knows anything yet.
        assert abs(run.losses[0] - math.log(256)) < 1.0
    assert result.unigram_loss == pytest.approx(unigram_loss(encode_bytes(TEXT)))
    assert "unigram loss" in result.table()


def test_recorded_grad_norms_are_those_of_grad_norms_at_init():
    result = run_depth(TINY, text=TEXT)
    at_init = grad_norms_at_init(TINY, text=TEXT)
    for name in NORM_POSITIONS:
        assert at_init[name].shape == (TINY.n_layers,)
        torch.testing.assert_close(torch.tensor(result.runs[name].grad_norms), at_init[name])


def test_pre_and_post_start_from_the_same_weights():
    pre, post = build_model(TINY, "pre"), build_model(TINY, "post")
    pre_state, post_state = pre.state_dict(), post.state_dict()
    assert set(pre_state) - set(post_state) == {"ln_final.weight", "ln_final.bias"}  # post-norm has no final norm
    for key, value in post_state.items():
        assert torch.equal(value, pre_state[key]), key
    assert pre.cfg.norm_position == "pre" and post.cfg.norm_position == "post"
    assert pre.cfg.replace(norm_position="post") == post.cfg  # nothing else differs


def test_xavier_init_is_the_2017_recipe_and_gpt2_is_the_models_own():
    model = build_model(TINY, "post")
    assert model.embed_scale == pytest.approx(math.sqrt(16))
    bound = math.sqrt(6 / (16 + 64))  # Xavier-uniform bound of the 16 -> 64 MLP input matrix
    w_in = model.blocks[0].mlp.W_in.weight
    assert w_in.abs().max() <= bound and w_in.abs().max() > 0.8 * bound
    own = build_model(TINY.replace(init="gpt2"), "post")
    assert own.embed_scale == 1.0 and own.blocks[0].mlp.W_in.weight.std() < 0.03


def test_block_grad_norms_take_every_parameter_of_a_block():
    model = build_model(TINY, "pre")
    ids = torch.zeros(2, 8, dtype=torch.long)
    model(ids, targets=ids)[1].backward()
    expected = torch.cat([p.grad.flatten() for p in model.blocks[1].parameters()]).norm()
    torch.testing.assert_close(block_grad_norms(model)[1], expected)


def test_warm_up_ramps_linearly_then_holds():
    cfg = TINY.replace(lr=1e-2, warmup_steps=10)
    assert [learning_rate(cfg, s) for s in (0, 4, 9, 50)] == pytest.approx([1e-3, 5e-3, 1e-2, 1e-2])
    assert learning_rate(TINY, 0) == TINY.lr  # no warm-up: the full rate from the first step


def test_a_diverging_run_stops_and_says_so(monkeypatch):
    """Adam at this size never produced inf/NaN (even at lr 0.9), so the divergence is injected: NaN logits from step 4."""
    real_build = depth.build_model

    def poisoned(cfg, norm_position, seed=None):
        model = real_build(cfg, norm_position, seed)
        calls = []

        def to_nan(module, inputs, output):
            calls.append(1)
            return output * float("nan") if len(calls) >= 4 else None

        model.unembed.register_forward_hook(to_nan)
        return model

    monkeypatch.setattr(depth, "build_model", poisoned)
    result = run_depth(TINY, norm_positions=("post",), text=TEXT)
    run = result.runs["post"]
    assert run.diverged and len(run.losses) == 4 and math.isnan(run.losses[-1]) and math.isnan(run.final_loss)
    assert all(math.isfinite(v) for v in run.losses[:3]) and len(run.grad_norms) == TINY.n_layers
    fig, axes = plt.subplots(1, 2)
    plot_depth(result, axes=axes)
    assert any("diverged at step 4" in line.get_label() for line in axes[1].get_lines())
    plt.close(fig)


def test_depth_sweep_has_one_number_per_depth_and_seed():
    sweep = grad_norms_vs_depth(TINY, depths=(1, 2, 4), seeds=(0, 1), text=TEXT)
    assert isinstance(sweep, DepthSweep)
    for name in NORM_POSITIONS:
        assert sweep.last_block[name].shape == (3, 2) and bool((sweep.last_block[name] > 0).all())
        assert sweep.mean(name).shape == (3,)
    # Depth 2 of the sweep is grad_norms_at_init's last block at depth 2.
    at_init = grad_norms_at_init(TINY.replace(n_layers=2), seed=1, text=TEXT)
    assert float(sweep.last_block["post"][1, 1]) == pytest.approx(float(at_init["post"][-1]))


# ----------------------------------------------------------------------------- determinism and state


def test_runs_are_deterministic():
    a, b = run_depth(TINY, text=TEXT), run_depth(TINY, text=TEXT)
    for name in NORM_POSITIONS:
        assert a.runs[name].losses == b.runs[name].losses and a.runs[name].grad_norms == b.runs[name].grad_norms
    c = run_depth(TINY.replace(seed=1), norm_positions=("pre",), text=TEXT)
    assert c.runs["pre"].losses != a.runs["pre"].losses


def test_the_callers_random_state_and_threads_are_left_alone():
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    run_depth(TINY.replace(threads=1), norm_positions=("pre",), text=TEXT)
    grad_norms_at_init(TINY, text=TEXT)
    torch.testing.assert_close(torch.rand(3), expected)
    assert torch.get_num_threads() == threads


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_layers": 0}, "n_layers must be an int >= 1"),
        ({"d_model": 15}, "divisible"),
        ({"warmup_steps": -1}, "warmup_steps must be an int >= 0"),
        ({"lr": 2.0}, "lr must be a number in"),
        ({"init": "kaiming"}, "init='kaiming' is not one of"),
        ({"final_window": 7}, "final_window=7 must be at most steps=6"),
        ({"threads": 0}, "threads"),
    ],
)
def test_bad_config_says_what_was_expected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **kwargs)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown norm position 'sandwich'"):
        run_depth(TINY, norm_positions=("pre", "sandwich"), text=TEXT)
    with pytest.raises(ValueError, match="non-empty sequence"):
        run_depth(TINY, norm_positions="pre", text=TEXT)
    with pytest.raises(ValueError, match="give at least"):
        run_depth(TINY, text="short")
    with pytest.raises(TypeError, match="DepthResult"):
        plot_depth({"pre": 1.0})
    with pytest.raises(TypeError, match="DepthSweep"):
        plot_grad_norms_vs_depth({"pre": 1.0})


def test_preset_is_the_default():
    assert CPU == DepthConfig() and CPU.warmup_steps == 0 and CPU.threads == 1 and CPU.init == "xavier"


# ----------------------------------------------------------------------------- the figures


def test_plots_draw_both_variants():
    result = run_depth(TINY, text=TEXT)
    fig, axes = plt.subplots(1, 2)
    assert list(plot_depth(result, axes=axes)) == list(axes)
    ax_grad, ax_loss = axes
    assert ax_grad.get_yscale() == "log"
    for ax in axes:
        labels = {line.get_label() for line in ax.get_lines()}
        assert {"pre-norm", "post-norm"} <= labels
        assert overlapping_labels(ax.texts) == []
    assert any(line.get_label().startswith("unigram loss") for line in ax_loss.get_lines())
    plt.close(fig)
    sweep = grad_norms_vs_depth(TINY, depths=(1, 2), seeds=(0,), text=TEXT)
    fig, ax = plt.subplots()
    assert plot_grad_norms_vs_depth(sweep, ax=ax) is ax and ax.get_xscale() == "log"
    plt.close(fig)


# ----------------------------------------------------------------------------- the control (the headline: notebook 07)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_two_blocks_post_norm_trains_as_well_as_pre_norm(seed):
    """The control: the same run with 2 blocks (measured gap, post minus pre: -0.023 to -0.002)."""
    result = run_depth(CPU.replace(seed=seed, n_layers=2))
    assert abs(result.final_loss("post") - result.final_loss("pre")) < 0.08, result.table()
    assert result.final_loss("post") < result.unigram_loss - 0.35, result.table()


def test_signatures_are_shape_checked(typechecked):
    norms = typechecked(grad_norms_at_init)(TINY, text=TEXT)
    assert norms["pre"].shape == (TINY.n_layers,)
    model = build_model(TINY, "post")
    ids = torch.zeros(2, 8, dtype=torch.long)
    model(ids, targets=ids)[1].backward()
    assert typechecked(block_grad_norms)(model).shape == (TINY.n_layers,)
