"""The functions behind notebook 01's widget and plots (widgets never fire headless)."""

import matplotlib
import pytest

from tfedu.course import tokenizer_widgets as tw
from tfedu.tokenizer import train_bpe, train_bpe_naive

matplotlib.use("Agg")


def test_merge_steps_reproduce_the_deck():
    trace = tw.merge_steps("aaabdaaabac", 10, names="letters")
    assert [step.label for step in trace.steps] == ["ZabdZabac", "ZYdZYac", "XdXac"]
    # the slides' ids, as in section 2 of the notebook: a..z = 1..26, new tokens 27, 28, 29
    assert [step.pair for step in trace.steps] == [(1, 1), (1, 2), (27, 28)]
    assert [step.new_id for step in trace.steps] == [27, 28, 29]
    assert [step.count for step in trace.steps] == [4, 2, 2]
    assert trace.steps[-1].after == [29, 4, 29, 1, 3]
    assert trace.name(trace.steps[0].before) == "aaabdaaabac" and trace.exhausted
    in_bytes = tw.merge_steps("aaabdaaabac", 10)
    assert [step.pair for step in in_bytes.steps] == [(97, 97), (97, 98), (256, 257)]
    assert in_bytes.steps[-1].after == [258, 100, 258, 97, 99]
    assert [s.label for s in in_bytes.steps] == ["aaabdaaabac"] * 3  # bytes view names tokens by their text


def test_letters_view_takes_only_lowercase_letters():
    with pytest.raises(ValueError, match="lowercase"):
        tw.merge_steps("Hello", 3, names="letters")
    assert "choose bytes" in tw.stepper_view("Hello", 1, names="letters")
    assert tw.count_merges("Hello", names="letters") == 0


@pytest.mark.parametrize("text", ["hello hello world", "abababab", "🙂🙂🙂 ok ok", "mississippi river"])
def test_merge_steps_agree_with_the_reference_trainer(text):
    # Oracle: with min_count=1 the trace makes exactly train_bpe_naive's merges on the same text.
    trace = tw.merge_steps(text, 6, min_count=1)
    assert [step.pair for step in trace.steps] == train_bpe_naive(text, 256 + len(trace.steps), pattern=None)
    for step in trace.steps:
        assert len(step.after) == len(step.before) - len(step.starts)
        assert all(step.before[i : i + 2] == list(step.pair) for i in step.starts)
    final = trace.steps[-1].after
    assert final == train_bpe(text, 256 + len(trace.steps), pattern=None).encode(text)


def test_merge_steps_stop_when_nothing_repeats():
    trace = tw.merge_steps("abcdef", 5)
    assert trace.steps == []
    aaaa = tw.merge_steps("aaaa", 5)  # aaaa -> ZZ; the pair (Z, Z) occurs once, so it stops
    assert len(aaaa.steps) == 1 and aaaa.steps[0].after == [256, 256]
    assert len(tw.merge_steps("aaaa", 5, min_count=1).steps) == 2
    assert len(tw.merge_steps("", 5).steps) == 0


def test_merge_steps_reject_bad_input():
    with pytest.raises(TypeError, match="str"):
        tw.merge_steps(b"abc", 2)
    with pytest.raises(ValueError, match="names"):
        tw.merge_steps("abc", 2, names="greek")
    with pytest.raises(ValueError, match="max_merges"):
        tw.merge_steps("abc", -1)


def test_pair_starts_are_left_to_right_and_non_overlapping():
    assert tw.pair_starts([97, 97, 97], (97, 97)) == [0]
    assert tw.pair_starts([1, 1, 1, 1], (1, 1)) == [0, 2]
    assert tw.pair_starts([1, 2, 3], (2, 3)) == [1]
    assert tw.pair_starts([], (1, 1)) == []


def test_render_highlights_each_merged_pair_and_draws_the_result():
    trace = tw.merge_steps("aaabdaaabac", 3, names="letters")
    first = tw.render_step_html(trace, 1)
    # two 'aa' pairs merge (before row) into two Z tokens (after row)
    assert first.count(f"background:{tw.HIGHLIGHT}") == 4
    assert "occurs 4x" in first and "becomes id 27 'Z'" in first and "merge 1 of 3" in first
    assert "last merge" not in first
    assert tw.render_step_html(trace, 0).count(f"background:{tw.HIGHLIGHT}") == 0
    third = tw.render_step_html(trace, 3)
    assert third.count(f"background:{tw.HIGHLIGHT}") == 4 and "'X'" in third
    assert "last merge: no pair occurs twice" in third
    after_row = third.split("after")[1]
    assert all(f">{c}</span>" in after_row for c in "XdXac")  # the last result is drawn
    with pytest.raises(ValueError, match="between 0 and 3"):
        tw.render_step_html(trace, 4)


def test_bytes_view_explains_byte_ids_and_shows_no_boxes():
    trace = tw.merge_steps("üü üü", 3)
    shown = tw.render_step_html(trace, 0)
    assert "UTF-8" in shown and "\ufffd" not in shown and "⟨c3⟩" in shown
    assert "\ufffd" not in "".join(tw.render_step_html(trace, k) for k in range(len(trace.steps) + 1))
    assert trace.names[trace.steps[0].new_id] == "ü"  # the two bytes of ü, merged


def test_render_escapes_html():
    html_text = tw.render_step_html(tw.merge_steps("<b><b>", 2), 1)
    assert "<b>" not in html_text and "&lt;b" in html_text


def test_stepper_view_says_when_the_slider_is_past_the_last_merge():
    past = tw.stepper_view("aaabdaaabac", 99)
    assert past.startswith(tw.stepper_view("aaabdaaabac", 3)) and "past the last merge" in past
    assert "merge 2 of 3" in tw.stepper_view("aaabdaaabac", 2, names="letters")
    capped = tw.stepper_view("aaabdaaabac", 2, max_merges=2)
    assert "max_merges reached" in capped and "no pair occurs twice" not in capped


def test_merge_stepper_slider_ends_at_the_last_merge():
    shown = tw.merge_stepper("hello hello", max_merges=5)
    text, names, slider, _out = shown.widget.children
    assert shown.values == {"text": "hello hello", "names": "bytes", "merge": 1}
    assert shown.still == {"text/html": tw.stepper_view("hello hello", 1, max_merges=5)}
    assert slider.max == tw.count_merges("hello hello", max_merges=5) == 4  # he, hel, hell, hello; then nothing repeats
    text.value = "abab abab"  # observers run synchronously when a value is set in Python
    assert slider.max == tw.count_merges("abab abab", max_merges=5)
    text.value = "aaabdaaabac"
    names.value = "letters"
    assert slider.max == 3
    text.value = "Hello"
    assert slider.max == 0 and slider.value == 0


def test_byte_name():
    assert tw.byte_name(b" the\n\t") == "·the⏎→"
    assert tw.byte_name(b"\xe4") == "⟨e4⟩"
    assert tw.byte_name("日".encode()[:2] + b"x") == "⟨e6⟩⟨97⟩x"


def test_tokens_per_char():
    tok = train_bpe("abab abab", 260, pattern="gpt4")
    assert tw.tokens_per_char(tok, "abab") == len(tok.encode_ordinary("abab")) / 4
    assert tw.tokens_per_char(train_bpe("x", 256, pattern=None), "日本") == 3.0  # 3 bytes per character
    with pytest.raises(ValueError, match="non-empty"):
        tw.tokens_per_char(tok, "")


def test_cross_boundary_tokens():
    text = "the cat. the hat. the bat. " * 5
    loose = train_bpe(text, 290, pattern=None)
    strict = train_bpe(text, 290, pattern="gpt4")
    junk = tw.cross_boundary_tokens(loose, "gpt4")
    assert junk and all(len(tw.pretokenize(t.decode(), "gpt4")) > 1 for t in junk)
    assert tw.cross_boundary_tokens(strict, "gpt4") == []
    special = train_bpe(text, 291, pattern="gpt4", special_tokens=["<|endoftext|>"])
    assert tw.cross_boundary_tokens(special, "gpt4") == []  # specials are not merges


def test_plot_tokens_per_char():
    fig = tw.plot_tokens_per_char({"A": {"prose": 0.3, "code": 0.5}, "B": {"prose": 0.4, "code": 0.7}}, title="t")
    ax = fig.axes[0]
    assert len(ax.patches) == 4
    assert [t.get_text() for t in ax.get_xticklabels()] == ["prose", "code"]
    assert ax.get_title() == "t"
    with pytest.raises(ValueError, match="kinds"):
        tw.plot_tokens_per_char({"A": {"prose": 1.0}, "B": {"code": 1.0}})
    with pytest.raises(ValueError, match="empty"):
        tw.plot_tokens_per_char({})
    matplotlib.pyplot.close("all")


def test_annotations_are_accurate(typechecked):
    # beartype enforces the declared argument and return types of the public helpers.
    tok = train_bpe("the cat. the hat. " * 4, 270, pattern=None)
    trace = typechecked(tw.merge_steps)("aaabdaaabac", 3)
    assert isinstance(typechecked(tw.render_step_html)(trace, 2), str)
    assert typechecked(tw.count_merges)("abab") == 1
    assert isinstance(typechecked(tw.stepper_view)("abab", 1), str)
    assert typechecked(tw.pair_starts)([1, 1, 1], (1, 1)) == [0]
    assert typechecked(tw.byte_name)(b"a b") == "a·b"
    assert isinstance(typechecked(tw.tokens_per_char)(tok, "the cat"), float)
    assert all(isinstance(t, bytes) for t in typechecked(tw.cross_boundary_tokens)(tok, "gpt4"))


def test_merge_stepper_text_box_is_wide_enough_for_its_sentence():
    shown = tw.merge_stepper()
    text = shown.widget.children[0]
    assert text.layout.width == "95%" and text.layout.max_width == "60em"
    assert len(text.value) <= 60  # an em holds at least one character of the box's font
