"""The decoding widget of notebooks/08_training_and_decoding.ipynb: one next-token distribution under
temperature, top-k and top-p, and a sample drawn from it.

``next_token_view`` computes what the widget shows (tested directly, since widget callbacks never fire
headless); ``draw_next_token`` draws it as a matplotlib figure for ``tfedu.course.widgets.interactive_figure``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tfedu.generate import filter_top_k, filter_top_p, generate, next_token_distribution


@dataclass
class NextTokenView:
    tokens: list[str]  # the most probable tokens before any filtering, most probable first
    before: list[float]  # their probabilities at temperature 1, nothing filtered
    after: list[float]  # their probabilities after temperature, top-k, top-p and renormalising
    kept: int  # how many tokens of the whole vocabulary keep a probability above zero
    entropy: float  # of the filtered distribution, in nats
    sample: str  # a continuation sampled with these settings


@torch.no_grad()
def next_token_view(
    model, tokenizer, prompt: str, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
    seed: int = 0, shown: int = 15, sample_tokens: int = 20,
    top_k_filter: Callable = filter_top_k, top_p_filter: Callable = filter_top_p,
) -> NextTokenView:
    """What the decoding widget shows for ``prompt`` with these settings (``top_k=0`` or ``top_p=1`` mean off).

    >>> import tfedu.experiments.course_gpt as cg  # doctest: +SKIP
    >>> model, tok = cg.load()  # doctest: +SKIP
    >>> next_token_view(model, tok, "The ", top_k=5).kept  # doctest: +SKIP
    5
    """
    top_k = top_k or None
    top_p = None if top_p is None or top_p >= 1 else top_p
    ids = torch.tensor([tokenizer.encode(prompt)])
    model.eval()
    logits = model(ids[:, -model.cfg.n_ctx:])[:, -1]  # (1, d_vocab)
    plain = torch.softmax(logits.float(), dim=-1)[0]
    probs = next_token_distribution(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                    top_k_filter=top_k_filter, top_p_filter=top_p_filter)[0]
    order = plain.argsort(descending=True)[:shown]
    nonzero = probs[probs > 0]
    out = generate(model, ids, sample_tokens, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                   generator=torch.Generator().manual_seed(seed), top_k_filter=top_k_filter, top_p_filter=top_p_filter)
    return NextTokenView(
        tokens=[tokenizer.decode([int(i)]) for i in order],
        before=plain[order].tolist(),
        after=probs[order].tolist(),
        kept=int((probs > 0).sum()),
        entropy=float(-(nonzero * nonzero.log()).sum()),
        sample=tokenizer.decode(out[0, ids.shape[1]:].tolist()),
    )


def draw_next_token(model, tokenizer, prompt: str, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    seed: int = 0, **options):
    """A bar chart of the next-token distribution before and after the settings, titled with a sample."""
    import matplotlib.pyplot as plt

    view = next_token_view(model, tokenizer, prompt, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                           **options)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    x = torch.arange(len(view.tokens))
    ax.bar(x - 0.2, view.before, width=0.4, color="0.75", label="temperature 1, nothing filtered")
    ax.bar(x + 0.2, view.after, width=0.4, color="tab:blue", label="with these settings")
    # repr shows a newline as \n; a space, invisible in a tick label, is drawn as ␣.
    ax.set_xticks(x.tolist(), [repr(t)[1:-1].replace(" ", "␣") or "''" for t in view.tokens], rotation=60, fontsize=8)
    ax.set_ylabel("probability")
    ax.legend(fontsize=8)
    ax.set_title(f"T={temperature:g}, top-k={top_k or 'off'}, top-p={top_p if top_p < 1 else 'off'}: "
                 f"{view.kept} tokens kept, entropy {view.entropy:.2f} nats\n"
                 f"{prompt!r} + sample: {view.sample!r}", fontsize=9)
    fig.tight_layout()
    return fig
