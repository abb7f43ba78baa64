"""Interactive figures that show once: the live widget where a kernel draws it, a still elsewhere.

A notebook that draws a figure and then a widget showing the same figure shows it twice in
JupyterLab. One that shows only the widget shows nothing on GitHub, nbviewer or in a PDF export,
where no kernel runs. :func:`interactive_figure` sends one output with two forms of the same
picture, and the frontend picks the richest form it can draw:

- ``application/vnd.jupyter.widget-view+json``: the sliders and the live figure. JupyterLab, Jupyter
  Notebook 7 and Colab prefer it whenever their widget manager is loaded and the kernel is running.
- ``image/png`` (or ``text/html``): the figure at the starting values, drawn once here. Static
  renderers, which cannot draw widgets, show this instead.

``draw(**values)`` returns what to show for one setting of the controls: a matplotlib ``Figure``
(build it with ``plt.subplots``; do not call ``plt.show``) or an HTML string. Widget callbacks never
fire headless, so test ``draw`` itself; the notebooks assert what the starting figure shows.
"""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Callable
from typing import Any

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _still_bundle(shown: Any) -> dict[str, str]:
    """The static form of one drawing: PNG for a Figure, HTML for a string.

    >>> _still_bundle("<b>hi</b>")
    {'text/html': '<b>hi</b>'}
    """
    from matplotlib.figure import Figure

    if isinstance(shown, Figure):
        buffer = io.BytesIO()
        shown.savefig(buffer, format="png", bbox_inches="tight", dpi=80)
        return {"image/png": base64.b64encode(buffer.getvalue()).decode("ascii")}
    if isinstance(shown, str):
        return {"text/html": shown}
    raise TypeError(f"draw(**values) must return a matplotlib Figure or an HTML string, got {type(shown).__name__}")


def _show(shown: Any) -> None:
    """Display one drawing inside the widget's output area, then free the figure."""
    import matplotlib.pyplot as plt
    from IPython.display import HTML, display
    from matplotlib.figure import Figure

    if isinstance(shown, Figure):
        display(shown)
        plt.close(shown)  # otherwise the inline backend shows it a second time below the cell
    else:
        display(HTML(shown) if isinstance(shown, str) else shown)


class InteractiveFigure:
    """A widget and a still picture of its starting state, displayed as one output.

    ``widget`` is the live ``ipywidgets.interactive`` box; ``values`` the starting values of its
    controls; ``still`` the static MIME bundle drawn from them.
    """

    def __init__(self, widget: Any, values: dict[str, Any], still: dict[str, str]):
        self.widget = widget
        self.values = values
        self.still = still

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        bundle: dict[str, Any] = dict(self.still)
        bundle[WIDGET_VIEW] = self.widget._repr_mimebundle_()[WIDGET_VIEW]
        settings = ", ".join(f"{name}={value!r}" for name, value in self.values.items())
        bundle["text/plain"] = f"interactive figure ({settings}); move the controls in a running notebook"
        return bundle


def interactive_figure(draw: Callable[..., Any], **controls: Any) -> InteractiveFigure:
    """Controls for ``draw``'s arguments (ipywidgets ``interact`` abbreviations or widgets).

    Display the result (last line of a cell). Returns an :class:`InteractiveFigure` whose ``values``
    are the starting values, so a notebook can assert what its still picture shows.

    In a notebook cell::

        def draw(slope=1.0):
            fig, ax = plt.subplots()
            ax.plot([0, 1], [0, slope])
            return fig

        interactive_figure(draw, slope=(0.0, 2.0, 0.5))  # starts at slope=1.0, draw's default
    """
    import ipywidgets as widgets

    @functools.wraps(draw)  # keeps draw's signature, so its defaults are the starting values
    def show(**values: Any) -> None:
        _show(draw(**values))

    box = widgets.interactive(show, **controls)
    values = {w._kwarg: w.get_interact_value() for w in box.kwargs_widgets}
    return InteractiveFigure(box, values, _still_bundle_and_close(draw(**values)))


def _still_bundle_and_close(shown: Any) -> dict[str, str]:
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    try:
        return _still_bundle(shown)
    finally:
        if isinstance(shown, Figure):
            plt.close(shown)
