"""tfedu.course.widgets: one output, two forms (live widget, still picture); figures never shown twice."""

import base64

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from tfedu.course.widgets import WIDGET_VIEW, InteractiveFigure, interactive_figure  # noqa: E402


def draw_line(slope=1.0, label="a"):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, slope], label=label)
    return fig


def test_bundle_holds_the_widget_view_and_a_png_of_the_starting_values():
    calls = []

    def draw(slope=1.0):
        calls.append(slope)
        return draw_line(slope)

    shown = interactive_figure(draw, slope=(0.0, 2.0, 0.25))
    bundle = shown._repr_mimebundle_()
    assert shown.values == {"slope": 1.0}
    assert set(calls) == {1.0}  # the widget's first drawing and the still both use the start
    assert bundle[WIDGET_VIEW]["model_id"] == shown.widget.model_id
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    assert "slope=1.0" in bundle["text/plain"]


def test_no_figure_is_left_open_for_the_inline_backend_to_show_again():
    before = plt.get_fignums()
    interactive_figure(draw_line, slope=(0.0, 2.0), label=["a", "b"])
    assert plt.get_fignums() == before


def test_an_html_drawing_becomes_the_html_still():
    shown = interactive_figure(lambda n=2: "<b>" + "x" * n + "</b>", n=(1, 5))
    assert shown._repr_mimebundle_()["text/html"] == "<b>xx</b>"


def test_a_draw_returning_anything_else_is_named():
    with pytest.raises(TypeError, match="matplotlib Figure or an HTML string, got NoneType"):
        interactive_figure(lambda n=2: None, n=(1, 5))


def test_an_existing_widget_can_carry_its_own_still():
    import ipywidgets

    slider = ipywidgets.IntSlider(3)
    shown = InteractiveFigure(slider, {"n": 3}, {"text/html": "<i>3</i>"})
    assert shown._repr_mimebundle_()["text/html"] == "<i>3</i>"
