"""Text labels next to scattered points that never overlap one another.

``place_labels(ax, xy, texts)`` tries a few offsets around each point (right, above, left, below,
and the diagonals) and keeps the first whose box overlaps no label already placed and stays
inside the axes; a label that fits nowhere is left out and returned in ``skipped``. Notebooks
then assert ``overlapping_labels(ax.texts) == []``. Used by notebooks/02_embeddings.ipynb.
"""

from __future__ import annotations

from collections.abc import Sequence

# Offsets in points, tried in this order: right, above, left, below, then the diagonals, then further out.
OFFSETS = [(4, 0), (0, 5), (-4, 0), (0, -5), (4, 4), (-4, 4), (-4, -4), (4, -4),
           (10, 0), (0, 11), (-10, 0), (0, -11), (10, 10), (-10, 10), (-10, -10), (10, -10),
           (0, 18), (0, -18), (18, 14), (-18, 14), (-18, -14), (18, -14)]


def _alignment(dx: float, dy: float) -> tuple[str, str]:
    ha = "left" if dx > 0 else "right" if dx < 0 else "center"
    va = "bottom" if dy > 0 else "top" if dy < 0 else "center"
    return ha, va


def place_labels(
    ax, xy: Sequence[tuple[float, float]], texts: Sequence[str], *, fontsize: float = 9, pad: float = 2.0, marker_radius: float = 4.0
):
    """Annotate point ``xy[i]`` with ``texts[i]`` where the label overlaps no other label and no point; return (placed, skipped).

    Each point is an obstacle of ``marker_radius`` pixels around it; labels keep ``pad`` pixels apart.

    >>> import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots()
    >>> placed, skipped = place_labels(ax, [(0.5, 0.5), (0.5, 0.5), (0.2, 0.8)], ["same", "place", "c"])
    >>> len(placed), skipped, overlapping_labels(placed)
    (3, [], [])
    """
    if len(xy) != len(texts):
        raise ValueError(f"{len(xy)} points but {len(texts)} labels")
    figure = ax.figure
    figure.canvas.draw()  # fixes the axes limits and gives a renderer to measure text with
    renderer = figure.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    from matplotlib.transforms import Bbox

    placed, boxes, skipped = [], [], []
    centres = ax.transData.transform(list(xy)) if len(xy) else []
    points = [Bbox.from_extents(x - marker_radius, y - marker_radius, x + marker_radius, y + marker_radius) for x, y in centres]
    for (x, y), text in zip(xy, texts):
        for dx, dy in OFFSETS:
            ha, va = _alignment(dx, dy)
            label = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va, fontsize=fontsize)
            box = label.get_window_extent(renderer).expanded(1.0, 1.0).padded(pad)
            fits = inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1)
            if fits and not any(box.overlaps(other) for other in boxes + points):
                placed.append(label)
                boxes.append(box)
                break
            label.remove()
        else:
            skipped.append(text)
    return placed, skipped


def overlapping_labels(labels) -> list[tuple[str, str]]:
    """The pairs of text labels whose drawn boxes overlap (empty when none do)."""
    labels = list(labels)
    if not labels:
        return []
    renderer = labels[0].figure.canvas.get_renderer()
    boxes = [label.get_window_extent(renderer) for label in labels]
    return [(labels[i].get_text(), labels[j].get_text())
            for i in range(len(labels)) for j in range(i + 1, len(labels)) if boxes[i].overlaps(boxes[j])]
