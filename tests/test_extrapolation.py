"""tfedu.experiments.extrapolation: a tiny causal LM per positional encoding, trained short and tested long.

The headline test runs the notebook's experiment (the default config) for seeds 0, 1 and 2 and
checks the claim notebooks/06_positional_encoding.ipynb asserts: past the training length ALiBi
degrades least. Everything else runs on a config small enough to train in a fraction of a second.
"""

import dataclasses
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tfedu import positional
from tfedu.data import load_corpus
from tfedu.experiments.extrapolation import (
    CPU,
    GPU,
    POSITIONALS,
    ExtrapolationConfig,
    ExtrapolationLM,
    ExtrapolationResult,
    encode_bytes,
    held_out_loss,
    plot_extrapolation,
    run_extrapolation,
    split_corpus,
)
from tfedu.experiments.plot_labels import overlapping_labels

TINY = ExtrapolationConfig(
    train_len=8, eval_lengths=(8, 16, 32), d_model=16, n_heads=2, n_layers=2, d_mlp=16, steps=6, batch=4, eval_tokens=256
)
TEXT = load_corpus()[:20_000]  # enough for TINY's held-out 10% (2,000 bytes >= 257)


def tiny_model(name: str, **fns) -> ExtrapolationLM:
    torch.manual_seed(0)
    return ExtrapolationLM(name, d_model=16, n_heads=2, n_layers=2, d_mlp=16, n_ctx=8, **fns).eval()


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("name", POSITIONALS)
def test_logits_have_shape_batch_pos_d_vocab(name, typechecked):
    model = tiny_model(name)
    tokens = torch.randint(0, 256, (3, 8))
    logits = typechecked(model.forward)(tokens)
    assert logits.shape == (3, 8, 256) and logits.dtype == torch.float32


@pytest.mark.parametrize("name", POSITIONALS)
def test_future_tokens_never_change_earlier_logits(name):
    model = tiny_model(name)
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
        prefix = model(tokens[:, :5])
    torch.testing.assert_close(after[:, :5], before[:, :5])
    assert not torch.allclose(after[:, 5:], before[:, 5:])  # the changed tokens do matter
    # And a prefix alone gives the same logits: positions count from the start, not from the end.
    torch.testing.assert_close(prefix, before[:, :5], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["none", "sinusoidal", "alibi", "rope"])
def test_every_variant_but_learned_runs_past_its_training_length(name):
    with torch.no_grad():
        assert torch.isfinite(tiny_model(name)(torch.zeros(1, 40, dtype=torch.long))).all()


def test_learned_positions_raise_past_their_table():
    model = tiny_model("learned")
    model(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(IndexError, match="n_ctx=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_position_schemes_act_where_they_should():
    """Sinusoid and learned tables touch the embeddings; ALiBi only the scores; RoPE only q and k."""
    seen = {}
    model = tiny_model("rope", apply_rope=lambda x, p: seen.setdefault("shapes", []).append(tuple(x.shape)) or x)
    model(torch.zeros(3, 8, dtype=torch.long))
    assert seen["shapes"] == [(3, 2, 8, 8)] * 4  # q and k of 2 layers, each (batch, n_heads, pos, d_head)
    names = lambda m: {n for n, _ in m.named_parameters()}  # noqa: E731
    assert names(tiny_model("learned")) - names(tiny_model("none")) == {"W_pos.W_pos"}
    for name in ("sinusoidal", "alibi", "rope"):
        assert names(tiny_model(name)) == names(tiny_model("none")), f"{name} must add no parameters"


# ----------------------------------------------------------------------------- injection


def test_injected_functions_are_called_with_the_exercise_signatures():
    calls = {"sinusoidal": [], "alibi_bias": [], "apply_rope": []}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            assert not kwargs, f"{name} must be called with positional arguments only, got {kwargs}"
            calls[name].append(tuple(a if isinstance(a, int) else tuple(a.shape) for a in args))
            return fn(*args)

        return wrapped

    result = run_extrapolation(
        TINY,
        positionals=("sinusoidal", "alibi", "rope"),
        text=TEXT,
        sinusoidal=spy("sinusoidal", positional.sinusoidal),
        alibi_bias=spy("alibi_bias", positional.alibi_bias),
        apply_rope=spy("apply_rope", positional.apply_rope),
    )
    assert {args for args in calls["sinusoidal"]} == {(n, 16) for n in TINY.eval_lengths}
    assert {args for args in calls["alibi_bias"]} == {(2, n, n) for n in TINY.eval_lengths}
    for x_shape, positions_shape in calls["apply_rope"]:
        assert len(x_shape) == 4 and x_shape[1:] == (2, positions_shape[0], 8)  # (batch, n_heads, pos, d_head)
    assert {positions_shape for _, positions_shape in calls["apply_rope"]} == {(n,) for n in TINY.eval_lengths}
    assert all(math.isfinite(v) for r in result.variants.values() for v in r.losses.values())


@pytest.mark.parametrize(
    "name, neutral",
    [
        ("sinusoidal", {"sinusoidal": lambda n, d: torch.zeros(n, d)}),
        ("alibi", {"alibi_bias": lambda h, q, k: torch.zeros(h, q, k)}),
        ("rope", {"apply_rope": lambda x, p: x}),
    ],
)
def test_a_neutral_injected_function_turns_the_variant_into_no_positions(name, neutral):
    """Zero table, zero bias, no rotation: the same seed must then give exactly the 'none' model's losses."""
    ours = run_extrapolation(TINY, positionals=(name,), text=TEXT, **neutral).variants[name]
    none = run_extrapolation(TINY, positionals=("none",), text=TEXT).variants["none"]
    assert ours.losses == none.losses and ours.train_losses == none.train_losses
    reference = run_extrapolation(TINY, positionals=(name,), text=TEXT).variants[name]
    assert reference.losses != none.losses  # and the real function does change the model


def test_an_injected_function_with_the_wrong_shape_is_named():
    with pytest.raises(ValueError, match=r"alibi_bias must return a tensor of shape \(2, 8, 8\)"):
        run_extrapolation(TINY, positionals=("alibi",), text=TEXT, alibi_bias=lambda h, q, k: torch.zeros(q, k))


# ----------------------------------------------------------------------------- the experiment


def test_learned_is_recorded_as_missing_past_its_table_never_as_a_number():
    result = run_extrapolation(TINY, positionals=("learned", "alibi"), text=TEXT)
    learned = result.variants["learned"]
    assert math.isfinite(learned.losses[8]) and learned.can_run(8) and 8 not in learned.reasons
    for n in (16, 32):
        assert math.isnan(learned.losses[n]) and not learned.can_run(n)
        assert "n_ctx=8" in learned.reasons[n] and "cannot read sequences longer than 8" in learned.reasons[n]
    assert math.isnan(result.degradation("learned"))
    assert result.variants["alibi"].reasons == {}


def test_runs_are_deterministic():
    a = run_extrapolation(TINY, text=TEXT)
    b = run_extrapolation(TINY, text=TEXT)
    for name in POSITIONALS:
        assert a.variants[name].train_losses == b.variants[name].train_losses
        assert str(a.variants[name].losses) == str(b.variants[name].losses)  # str: NaN != NaN
    c = run_extrapolation(dataclasses.replace(TINY, seed=1), positionals=("none",), text=TEXT)
    assert c.variants["none"].train_losses != a.variants["none"].train_losses


def test_threads_are_restored():
    before = torch.get_num_threads()
    run_extrapolation(dataclasses.replace(TINY, threads=1), positionals=("none",), text=TEXT)
    assert torch.get_num_threads() == before


def test_held_out_text_is_the_end_of_the_corpus_and_every_length_scores_the_same_tokens():
    tokens = encode_bytes(TEXT)
    train, held_out = split_corpus(tokens, TINY)
    assert len(train) == len(tokens) - int(len(tokens) * 0.1)
    assert held_out.data_ptr() >= train.data_ptr() + len(train) * train.element_size()  # no overlap
    scored = []
    spy = lambda inputs: scored.append(inputs.numel()) or torch.zeros(*inputs.shape, 256)  # noqa: E731
    for n in TINY.eval_lengths:
        assert held_out_loss(spy, held_out, n) == pytest.approx(math.log(256))
    assert scored == [256] * 3  # 256 eval tokens at every length


def test_encode_bytes_is_lossless():
    text = "naïve → ok"
    assert bytes(encode_bytes(text).tolist()).decode("utf-8") == text


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"eval_lengths": (8, 12, 32)}, "multiple of train_len=8"),
        ({"eval_lengths": (16, 32)}, "start at the training length 8"),
        ({"eval_lengths": (8, 32, 16)}, "increase"),
        ({"eval_lengths": [8, 16]}, "tuple"),
        ({"d_model": 18, "n_heads": 2}, "even"),
        ({"d_model": 16, "n_heads": 3}, "divisible"),
        ({"steps": 0}, "steps must be an int >= 1"),
        ({"lr": 2.0}, "lr"),
        ({"eval_tokens": 16}, "at least one window of 32"),
        ({"held_out_fraction": 1.5}, "held_out_fraction"),
    ],
)
def test_bad_config_says_what_was_expected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **kwargs)


def test_unknown_positional_is_named():
    with pytest.raises(ValueError, match=r"unknown positional encoding 'xpos'; expected one of \('none'"):
        run_extrapolation(TINY, positionals=("alibi", "xpos"), text=TEXT)
    with pytest.raises(ValueError, match="unknown positional encoding 'ALiBi'"):
        ExtrapolationLM("ALiBi", d_model=16, n_heads=2, n_layers=1, d_mlp=0, n_ctx=8)
    with pytest.raises(ValueError, match="non-empty sequence"):
        run_extrapolation(TINY, positionals="alibi", text=TEXT)


def test_too_small_corpus_is_named():
    with pytest.raises(ValueError, match="give a longer text or a smaller eval_tokens"):
        run_extrapolation(TINY, text="too short" * 100)


def test_non_function_is_named():
    with pytest.raises(TypeError, match="alibi_bias must be a function"):
        run_extrapolation(TINY, text=TEXT, alibi_bias=positional.alibi_bias(2, 8, 8))


def test_presets_are_valid():
    assert CPU == ExtrapolationConfig() and CPU.threads == 1 and CPU.device == "cpu"
    assert GPU.device == "cuda" and GPU.eval_lengths == (GPU.train_len, 2 * GPU.train_len, 4 * GPU.train_len)


# ----------------------------------------------------------------------------- the figure


def test_plot_draws_learned_only_where_it_ran():
    result = run_extrapolation(TINY, text=TEXT)
    fig, ax = plt.subplots()
    assert plot_extrapolation(result, ax=ax) is ax
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(POSITIONALS) <= set(lines)
    assert list(lines["learned"].get_xdata()) == [8]
    assert list(lines["alibi"].get_xdata()) == [8, 16, 32]
    assert ax.get_xscale() == "log"
    assert any(list(line.get_xdata()) == [8, 8] for line in ax.get_lines())  # the training-length line
    assert any("learned" in t.get_text() for t in ax.texts)
    assert overlapping_labels(ax.texts) == []
    plt.close(fig)
    with pytest.raises(TypeError, match="ExtrapolationResult"):
        plot_extrapolation({"alibi": 1.0})


# ----------------------------------------------------------------------------- the headline


@pytest.mark.parametrize("seed", [1, 2])
def test_alibi_degrades_least_past_the_training_length(seed):
    """The notebook's claim, on its own config: loss(4L) - loss(L) is smallest for ALiBi.

    Learned positions cannot run at 4L and are left out (the notebook shows why). Seed 0 is the notebook's
    own run: its guard cell asserts the same, and tests/test_notebooks.py and tests/test_release.py run it.
    """
    cfg = dataclasses.replace(CPU, seed=seed)
    result = run_extrapolation(cfg)  # all five; learned is compared at L only
    assert isinstance(result, ExtrapolationResult)
    runnable = ("none", "sinusoidal", "alibi", "rope")
    degradation = {name: result.degradation(name) for name in runnable}
    others = min(v for name, v in degradation.items() if name != "alibi")
    # Measured on the reference machine: ALiBi's own change is at most 0.006 nats, the next best
    # (no positions) loses 0.045-0.051, so the margin is 0.040-0.054; 0.02 leaves room for other CPUs.
    assert degradation["alibi"] < others - 0.02, result.table()
    assert abs(degradation["alibi"]) < 0.01, result.table()  # ALiBi is flat, not merely less bad
    assert degradation["sinusoidal"] > 1.5 * degradation["none"], result.table()  # "about twice as much"
    at_L = {name: v.losses[cfg.train_len] for name, v in result.variants.items()}
    assert sorted(at_L, key=at_L.get)[:2] == ["rope", "alibi"] and at_L["learned"] < at_L["none"], result.table()  # at L
    assert at_L["rope"] < min(loss for name, loss in at_L.items() if name != "rope") - 0.1, result.table()
    # The notebook also states the whole order at 2L and 4L (measured margins of 0.02 nats or more between neighbours).
    for length in result.lengths[1:]:
        at = {name: result.degradation(name, length) for name in runnable}
        assert at["alibi"] < at["none"] < at["sinusoidal"] < at["rope"], (length, result.table())


def test_the_callers_random_state_is_left_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    run_extrapolation(TINY, positionals=("none",), text=TEXT)
    torch.testing.assert_close(torch.rand(3), expected)


def test_every_variant_starts_from_the_same_weights_but_its_position_table():
    """The notebook says the five models differ only in their positional encoding: same initial weights."""
    models = {}
    for name in POSITIONALS:
        torch.manual_seed(7)
        models[name] = ExtrapolationLM(name, d_model=16, n_heads=2, n_layers=2, d_mlp=32, n_ctx=8)
    shared = {k: v for k, v in models["none"].state_dict().items()}
    for name, model in models.items():
        state = {k: v for k, v in model.state_dict().items() if not k.startswith("W_pos")}
        assert state.keys() == shared.keys(), name
        for key, value in state.items():
            assert torch.equal(value, shared[key]), (name, key)
