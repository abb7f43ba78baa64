"""What notebooks/01_tokenization.ipynb shows about tokenizers: merge traces, token costs, plots.

The functions here sit behind the notebook's widget and figures, so they are tested
(widgets never fire in a headless run). The tokenizer itself is ``tfedu.tokenizer``.
Used in notebooks/01_tokenization.ipynb.

>>> trace = merge_steps("aaabdaaabac", 3, names="letters")
>>> [step.label for step in trace.steps]
['ZabdZabac', 'ZYdZYac', 'XdXac']
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tfedu.tokenizer import Tokenizer, get_pair_counts, merge_pair, pretokenize

HIGHLIGHT = "#ffd54f"  # background of the pair merged at this step
FIRST_NEW_NAME = "Z"  # the deck names its merged tokens Z, Y, X, ...


@dataclass(frozen=True)
class MergeStep:
    """One BPE merge applied to a text: which pair, how often, and the ids before and after."""

    number: int  # 1 for the first merge
    pair: tuple[int, int]  # the pair of ids merged
    new_id: int  # the id the pair becomes
    count: int  # how often the pair occurred (overlapping count) before the merge
    before: list[int]  # the ids before this merge
    after: list[int]  # the ids after this merge
    starts: list[int]  # positions in `before` where a merged pair starts
    label: str  # the text after the merge, one name per token, concatenated


@dataclass(frozen=True)
class MergeTrace:
    """All merges of ``merge_steps`` plus the names of every id they use."""

    ids: list[int]  # the ids before any merge (the text's UTF-8 bytes)
    steps: list[MergeStep]
    names: dict[int, str]  # id -> printable name

    def name(self, ids: Sequence[int]) -> str:
        return "".join(self.names[i] for i in ids)


def byte_name(token: bytes) -> str:
    """A printable name for a token's bytes: the text with spaces as '·' and newlines as '⏎'.

    >>> byte_name(b" the\\n")
    '·the⏎'
    """
    return token.decode("utf-8", errors="replace").replace(" ", "·").replace("\n", "⏎")


def merge_steps(text: str, max_merges: int, *, min_count: int = 2, names: str = "text") -> MergeTrace:
    """Run byte-level BPE on ``text`` alone, one merge at a time, and record every step.

    Each step merges the most frequent adjacent pair; ties go to the pair with the smaller
    ids, as in ``tfedu.tokenizer.train_bpe``. It stops after ``max_merges`` merges or when no
    pair occurs ``min_count`` times. ``names="text"`` names a token by its text;
    ``names="letters"`` names merged tokens Z, Y, X, ... as the lecture slides do.

    >>> trace = merge_steps("aaabdaaabac", 5)
    >>> [(s.pair, s.new_id, s.count) for s in trace.steps]
    [((97, 97), 256, 4), ((97, 98), 257, 2), ((256, 257), 258, 2)]

    Built by hand in notebooks/01_tokenization.ipynb.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if names not in ("text", "letters"):
        raise ValueError(f"names must be 'text' or 'letters', got {names!r}")
    if max_merges < 0 or min_count < 1:
        raise ValueError(f"need max_merges >= 0 and min_count >= 1, got {max_merges} and {min_count}")
    ids = list(text.encode("utf-8"))
    vocab = {i: bytes([i]) for i in range(256)}
    labels = {i: byte_name(vocab[i]) for i in set(ids)}
    steps: list[MergeStep] = []
    current = ids
    for number in range(1, max_merges + 1):
        counts = get_pair_counts(current)
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))  # most frequent; ties to the smaller ids
        if counts[pair] < min_count:
            break
        new_id = 255 + number
        vocab[new_id] = vocab[pair[0]] + vocab[pair[1]]
        if names == "letters":
            labels[new_id] = chr(ord(FIRST_NEW_NAME) - (number - 1)) if number <= 26 else f"<{new_id}>"
        else:
            labels[new_id] = byte_name(vocab[new_id])
        after = merge_pair(current, pair, new_id)
        steps.append(
            MergeStep(number, pair, new_id, counts[pair], current, after, pair_starts(current, pair),
                      "".join(labels[i] for i in after))
        )
        current = after
    return MergeTrace(ids, steps, labels)


def pair_starts(ids: Sequence[int], pair: tuple[int, int]) -> list[int]:
    """Where a left-to-right, non-overlapping merge of ``pair`` starts in ``ids``.

    >>> pair_starts([97, 97, 97], (97, 97))
    [0]
    """
    starts, i = [], 0
    while i < len(ids) - 1:
        if (ids[i], ids[i + 1]) == pair:
            starts.append(i)
            i += 2
        else:
            i += 1
    return starts


def render_step_html(trace: MergeTrace, number: int) -> str:
    """HTML for step ``number`` of a trace: the ids before the merge, the merged pairs highlighted.

    Step 0 shows the raw bytes. Each token is a box; the boxes that merge at this step sit on a
    yellow background, and a line below says which pair became which id.

    >>> html_text = render_step_html(merge_steps("aaab", 2), 1)
    >>> html_text.count("background:#ffd54f")
    1
    """
    if not 0 <= number <= len(trace.steps):
        raise ValueError(f"step must be between 0 and {len(trace.steps)}, got {number}")
    if number == 0:
        ids, starts, caption = trace.ids, [], f"{len(trace.ids)} bytes, before any merge"
    else:
        step = trace.steps[number - 1]
        ids, starts = step.before, step.starts
        a, b = step.pair
        caption = (
            f"merge {number}: ({a}, {b}) = {html.escape(trace.names[a])} + {html.escape(trace.names[b])}"
            f" occurs {step.count}x, becomes id {step.new_id} '{html.escape(trace.names[step.new_id])}':"
            f" {len(step.before)} -> {len(step.after)} tokens"
        )
    box = "display:inline-block;border:1px solid #999;margin:1px;padding:1px 3px;font-family:monospace"
    parts, i = [], 0
    start_set = set(starts)
    while i < len(ids):
        if i in start_set:
            inner = "".join(f'<span style="{box}">{html.escape(trace.names[t])}</span>' for t in ids[i : i + 2])
            parts.append(f'<span style="background:{HIGHLIGHT};padding:2px">{inner}</span>')
            i += 2
        else:
            parts.append(f'<span style="{box}">{html.escape(trace.names[ids[i]])}</span>')
            i += 1
    return f"<div>{''.join(parts)}</div><div><small>{caption}</small></div>"


def stepper_view(text: str, number: int, *, max_merges: int = 20, names: str = "text") -> str:
    """What the merge-stepper widget shows for ``text`` at slider position ``number``.

    Slider positions past the last possible merge show the last one.

    >>> "merge 1" in stepper_view("hello hello", 1)
    True
    """
    trace = merge_steps(text, max_merges, names=names)
    return render_step_html(trace, min(number, len(trace.steps)))


def merge_stepper(text: str = "aaabdaaabac", *, max_merges: int = 20):
    """An ipywidgets box: type a text, move the slider, watch BPE merge the most frequent pair.

    The function behind it is ``stepper_view`` (tested; widget callbacks never fire headless).
    """
    import ipywidgets as widgets

    box = widgets.Text(value=text, description="text")
    slider = widgets.IntSlider(value=1, min=0, max=max_merges, description="merge")
    names = widgets.ToggleButtons(options=["text", "letters"], value="text", description="names")
    view = widgets.HTML(stepper_view(text, 1, max_merges=max_merges))

    def update(_change=None) -> None:
        view.value = stepper_view(box.value, slider.value, max_merges=max_merges, names=names.value)

    for w in (box, slider, names):
        w.observe(update, names="value")
    return widgets.VBox([box, names, slider, view])


def tokens_per_char(tokenizer: Tokenizer, text: str) -> float:
    """Tokens per character of ``text`` under a tokenizer (special tokens not recognised).

    Lower is cheaper: a model's context window and price are counted in tokens.

    >>> from tfedu.tokenizer import train_bpe
    >>> tokens_per_char(train_bpe("abab", 256, pattern=None), "ab")
    1.0
    """
    if not isinstance(text, str) or not text:
        raise ValueError("tokens_per_char needs a non-empty str")
    return len(tokenizer.encode_ordinary(text)) / len(text)


def cross_boundary_tokens(tokenizer: Tokenizer, pattern: str | None = "gpt4") -> list[bytes]:
    """The merged tokens whose text ``pattern`` would cut into several pre-tokens.

    A tokenizer trained with that pattern can never produce them: they are the junk that
    merging across word boundaries (like ``b"o w"`` from "hello world") adds to a vocabulary.

    >>> from tfedu.tokenizer import train_bpe
    >>> cross_boundary_tokens(train_bpe("ab. ab. ab.", 258, pattern=None))
    [b'ab.']
    """
    specials = set(tokenizer.special_tokens.values())
    junk = []
    for token_id in sorted(tokenizer.vocab):
        if token_id < 256 or token_id in specials:
            continue
        token = tokenizer.vocab[token_id]
        if len(pretokenize(token.decode("utf-8", errors="replace"), pattern)) > 1:
            junk.append(token)
    return junk


def plot_tokens_per_char(costs: Mapping[str, Mapping[str, float]], *, title: str = "tokens per character"):
    """Grouped bars: one group per text kind, one bar per tokenizer; returns the Figure.

    ``costs[tokenizer][kind]`` is tokens per character (from ``tokens_per_char``).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    if not costs:
        raise ValueError("costs is empty: expected {tokenizer: {text kind: tokens per char}}")
    tokenizers = list(costs)
    kinds = list(next(iter(costs.values())))
    for name in tokenizers:
        if list(costs[name]) != kinds:
            raise ValueError(f"tokenizer {name!r} has kinds {list(costs[name])}, expected {kinds}")
    width = 0.8 / len(tokenizers)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = np.arange(len(kinds))
    for k, name in enumerate(tokenizers):
        values = [costs[name][kind] for kind in kinds]
        bars = ax.bar(x + (k - (len(tokenizers) - 1) / 2) * width, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(x, kinds)
    ax.set_ylabel("tokens per character")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig
