"""The function behind notebook 08's decoding widget (widget callbacks never fire headless)."""

import matplotlib

matplotlib.use("Agg")
import pytest
import torch

from tfedu.config import ModelConfig
from tfedu.data import END_OF_TEXT
from tfedu.course.generate_widgets import draw_next_token, next_token_view
from tfedu.model import GPT
from tfedu.tokenizer import train_bpe

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tok = train_bpe("the cat sat on the mat. " * 20, 270, special_tokens=[END_OF_TEXT])
    torch.manual_seed(0)
    model = GPT(ModelConfig(d_vocab=tok.vocab_size, n_ctx=16, d_model=32, n_layers=1, n_heads=2))
    with torch.no_grad():
        model.unembed.weight.mul_(50)  # sharpen the random model so that filters bite
    return model, tok


def test_the_view_keeps_k_tokens_and_renormalises(model_and_tokenizer):
    model, tok = model_and_tokenizer
    view = next_token_view(model, tok, "the cat", top_k=5, shown=10)
    assert view.kept == 5
    assert sum(p > 0 for p in view.after) == 5 and abs(sum(view.after) - 1) < 1e-5  # the 5 kept are the 5 most probable
    assert view.before == sorted(view.before, reverse=True)


def test_top_p_keeps_the_smallest_set_reaching_p_and_off_switches_keep_everything(model_and_tokenizer):
    model, tok = model_and_tokenizer
    everything = next_token_view(model, tok, "the cat", top_k=0, top_p=1.0)
    assert everything.kept == tok.vocab_size
    probs = torch.tensor(next_token_view(model, tok, "the cat", shown=tok.vocab_size).before)
    view = next_token_view(model, tok, "the cat", top_p=0.5)
    assert view.kept == int((probs.cumsum(0) - probs < 0.5).sum())


def test_temperature_raises_entropy_and_the_sample_is_seeded(model_and_tokenizer):
    model, tok = model_and_tokenizer
    cold, hot = (next_token_view(model, tok, "the", temperature=t) for t in (0.5, 2.0))
    assert cold.entropy < hot.entropy
    assert next_token_view(model, tok, "the", seed=3).sample == next_token_view(model, tok, "the", seed=3).sample


def test_the_learners_filters_are_used(model_and_tokenizer):
    model, tok = model_and_tokenizer
    calls = []

    def my_top_k(logits, k):
        calls.append(k)
        return logits

    next_token_view(model, tok, "the", top_k=3, top_k_filter=my_top_k)
    assert calls and set(calls) == {3}


def test_draw_returns_a_figure_titled_with_the_settings(model_and_tokenizer):
    model, tok = model_and_tokenizer
    fig = draw_next_token(model, tok, "the cat", temperature=0.7, top_k=4)
    assert "T=0.7" in fig.axes[0].get_title() and "4 tokens kept" in fig.axes[0].get_title()
