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

from tfedu.tokenizer import Tokenizer, get_pair_counts, letter_ids, merge_pair, pretokenize

HIGHLIGHT = "#ffd54f"  # background of the pair merged at this step, and of the token it became
FIRST_NEW_NAME = "Z"  # the deck names its merged tokens Z, Y, X, ...
LETTERS = "abcdefghijklmnopqrstuvwxyz"
VIEWS = ("bytes", "letters")  # real UTF-8 byte ids (new ids from 256), or the slides' a..z = 1..26 (new from 27)


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

    ids: list[int]  # the ids before any merge (UTF-8 bytes, or letters a..z = 1..26)
    steps: list[MergeStep]
    names: dict[int, str]  # id -> printable name
    view: str = "bytes"  # "bytes" or "letters"
    exhausted: bool = True  # True when merging stopped because no pair occurs min_count times

    def name(self, ids: Sequence[int]) -> str:
        return "".join(self.names[i] for i in ids)


def byte_name(token: bytes) -> str:
    r"""A readable name for a token's bytes: its text, spaces as '·', newlines as '⏎', tabs as '→'.

    A byte that is only part of a character (UTF-8 writes 'ü' as two bytes) is shown by its
    value in hex, ``⟨c3⟩``, rather than as a replacement box.

    >>> byte_name(b" the\n"), byte_name("ü".encode()[:1]), byte_name("aü".encode())
    ('·the⏎', '⟨c3⟩', 'aü')
    """
    out, rest = [], token
    while rest:
        try:
            out.append(rest.decode("utf-8"))
            break
        except UnicodeDecodeError as err:
            out.append(rest[: err.start].decode("utf-8"))
            out.append(f"⟨{rest[err.start]:02x}⟩")
            rest = rest[err.start + 1 :]
    return "".join(out).replace(" ", "·").replace("\n", "⏎").replace("\t", "→")


def merge_steps(text: str, max_merges: int, *, min_count: int = 2, names: str = "bytes") -> MergeTrace:
    """Run BPE on ``text`` alone, one merge at a time, and record every step.

    Each step merges the most frequent adjacent pair; ties go to the pair with the smaller
    ids, as in ``tfedu.tokenizer.train_bpe``. It stops after ``max_merges`` merges or when no
    pair occurs ``min_count`` times. ``names="bytes"`` starts from the UTF-8 bytes (new ids
    256, 257, ...) and names a token by its text; ``names="letters"`` takes lowercase a-z text
    with the slides' ids a..z = 1..26 and names the new tokens 27, 28, ... Z, Y, X.

    >>> trace = merge_steps("aaabdaaabac", 5)
    >>> [(s.pair, s.new_id, s.count) for s in trace.steps]
    [((97, 97), 256, 4), ((97, 98), 257, 2), ((256, 257), 258, 2)]
    >>> [(s.pair, s.new_id, s.label) for s in merge_steps("aaabdaaabac", 5, names="letters").steps]
    [((1, 1), 27, 'ZabdZabac'), ((1, 2), 28, 'ZYdZYac'), ((27, 28), 29, 'XdXac')]

    Built by hand in notebooks/01_tokenization.ipynb.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if names not in VIEWS:
        raise ValueError(f"names must be one of {VIEWS}, got {names!r}")
    if max_merges < 0 or min_count < 1:
        raise ValueError(f"need max_merges >= 0 and min_count >= 1, got {max_merges} and {min_count}")
    if names == "letters":
        ids = letter_ids(text) if text else []
        first_new = 27
        labels = {i: LETTERS[i - 1] for i in range(1, 27)}
    else:
        ids = list(text.encode("utf-8"))
        first_new = 256
        vocab = {i: bytes([i]) for i in range(256)}
        labels = {i: byte_name(vocab[i]) for i in set(ids)}
    steps: list[MergeStep] = []
    current = ids
    exhausted = True
    for number in range(1, max_merges + 2):
        counts = get_pair_counts(current)
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))  # most frequent; ties to the smaller ids
        if counts[pair] < min_count:
            break
        if number > max_merges:
            exhausted = False  # a pair still repeats: max_merges, not the text, stopped us
            break
        new_id = first_new + number - 1
        if names == "letters":
            labels[new_id] = chr(ord(FIRST_NEW_NAME) - (number - 1)) if number <= 26 else f"<{new_id}>"
        else:
            vocab[new_id] = vocab[pair[0]] + vocab[pair[1]]
            labels[new_id] = byte_name(vocab[new_id])
        after = merge_pair(current, pair, new_id)
        steps.append(
            MergeStep(number, pair, new_id, counts[pair], current, after, pair_starts(current, pair),
                      "".join(labels[i] for i in after))
        )
        current = after
    return MergeTrace(ids, steps, labels, names, exhausted)


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


_BOX = "display:inline-block;border:1px solid #999;margin:1px;padding:1px 3px;font-family:monospace"


def _token_row(trace: MergeTrace, ids: Sequence[int], marked: set[int], width: int) -> str:
    """One row of token boxes; positions in ``marked`` start a highlighted group of ``width`` boxes."""
    parts, i = [], 0
    while i < len(ids):
        if i in marked:
            inner = "".join(
                f'<span style="{_BOX}" title="id {t}">{html.escape(trace.names[t])}</span>' for t in ids[i : i + width])
            parts.append(f'<span style="background:{HIGHLIGHT};padding:2px">{inner}</span>')
            i += width
        else:
            parts.append(f'<span style="{_BOX}" title="id {ids[i]}">{html.escape(trace.names[ids[i]])}</span>')
            i += 1
    return "".join(parts)


def _legend(trace: MergeTrace) -> str:
    if trace.view == "letters":
        return "ids as in section 2: a..z = 1..26; merge k makes id 26 + k, named Z, Y, X, ..."
    return ("ids are the text's UTF-8 bytes (a = 97, space = 32, shown as ·; section 3 explains bytes); "
            "merge k makes id 255 + k; ⟨c3⟩ is one byte of a character that takes several")


def render_step_html(trace: MergeTrace, number: int) -> str:
    """HTML for step ``number`` of a trace: the tokens before the merge and after it.

    Step 0 shows the text before any merge. Step k shows the tokens before merge k with the
    merged pairs on a yellow background, then the tokens after it with the new token on yellow,
    and a caption saying which pair became which id and whether this was the last merge.

    >>> html_text = render_step_html(merge_steps("aaab", 2), 1)
    >>> html_text.count("background:#ffd54f")
    2
    """
    total = len(trace.steps)
    if not 0 <= number <= total:
        raise ValueError(f"step must be between 0 and {total}, got {number}")
    rows = []
    if number == 0:
        rows.append(f"<div>{_token_row(trace, trace.ids, set(), 1)}</div>")
        caption = f"{len(trace.ids)} tokens before any merge; {total} merge{'s' if total != 1 else ''} to come"
    else:
        step = trace.steps[number - 1]
        a, b = step.pair
        new_positions = {j for j, t in enumerate(step.after) if t == step.new_id}
        rows.append(f"<div><small>before</small> {_token_row(trace, step.before, set(step.starts), 2)}</div>")
        rows.append(f"<div><small>after&nbsp;&nbsp;</small> {_token_row(trace, step.after, new_positions, 1)}</div>")
        caption = (
            f"merge {number} of {total}: ({a}, {b}) = {html.escape(trace.names[a])} + {html.escape(trace.names[b])}"
            f" occurs {step.count}x, becomes id {step.new_id} '{html.escape(trace.names[step.new_id])}':"
            f" {len(step.before)} -> {len(step.after)} tokens"
        )
    if number == total:
        caption += (". This is the last merge: no pair occurs twice any more" if trace.exhausted
                    else ". This is the last merge shown (max_merges reached)")
    return f"{''.join(rows)}<div><small>{caption}</small></div><div><small>{_legend(trace)}</small></div>"


def stepper_view(text: str, number: int, *, max_merges: int = 20, names: str = "bytes") -> str:
    """What the merge-stepper widget shows for ``text`` at slider position ``number``.

    A position past the last merge shows the last one and says so; the letters view of a text
    that is not lowercase a-z says what it needs instead of failing.

    >>> "merge 1 of 3" in stepper_view("aaabdaaabac", 1)
    True
    """
    try:
        trace = merge_steps(text, max_merges, names=names)
    except ValueError as err:
        return f"<div><small>{html.escape(str(err))}: the letters view is the slides' toy alphabet; choose bytes</small></div>"
    shown = render_step_html(trace, min(number, len(trace.steps)))
    if number > len(trace.steps):
        shown += f"<div><small>(position {number} is past the last merge, {len(trace.steps)}: shown instead)</small></div>"
    return shown


def count_merges(text: str, *, max_merges: int = 20, names: str = "bytes") -> int:
    """How many merges the stepper can show for ``text``: the slider's maximum (0 if the view does not apply).

    >>> count_merges("aaabdaaabac"), count_merges("Hello", names="letters")
    (3, 0)
    """
    try:
        return len(merge_steps(text, max_merges, names=names).steps)
    except ValueError:
        return 0


def merge_stepper(text: str = "aaabdaaabac", *, start: int = 1, max_merges: int = 20):
    """Type a text, pick a view, move the slider: BPE merges the most frequent pair, one step at a time.

    Returns a ``tfedu.course.widgets.InteractiveFigure`` (display it): the live widget where a kernel
    runs, the HTML of the starting step elsewhere. The slider ends at the last possible merge and
    its end moves when the text or the view changes. The function behind it is ``stepper_view``.
    """
    import ipywidgets as widgets

    from tfedu.course.widgets import interactive_figure

    n = count_merges(text, max_merges=max_merges)
    # wide enough for the default sentence and the deck's example; it shrinks with a narrow notebook
    box = widgets.Text(value=text, description="text", continuous_update=False,
                       layout=widgets.Layout(width="95%", max_width="60em"))
    view = widgets.ToggleButtons(options=list(VIEWS), value="bytes", description="ids")
    slider = widgets.IntSlider(value=min(start, n), min=0, max=n, description="merge")

    def fit_slider(_change=None) -> None:
        slider.max = count_merges(box.value, max_merges=max_merges, names=view.value)

    box.observe(fit_slider, names="value")  # registered first, so the slider fits before the redraw
    view.observe(fit_slider, names="value")

    def draw(text: str, names: str, merge: int) -> str:
        return stepper_view(text, merge, max_merges=max_merges, names=names)

    return interactive_figure(draw, text=box, names=view, merge=slider)


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
