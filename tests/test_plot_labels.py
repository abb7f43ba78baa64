import doctest

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import tfedu.experiments.plot_labels as P  # noqa: E402


def test_doctests():
    failures, tried = doctest.testmod(P, raise_on_error=False)
    assert tried > 0 and failures == 0


def test_crowded_points_get_labels_that_never_overlap():
    points = torch.randn(40, 2, generator=torch.Generator().manual_seed(0)) * 0.3
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.scatter(points[:, 0], points[:, 1])
    placed, skipped = P.place_labels(ax, points.tolist(), [f"word{i}" for i in range(40)])
    assert len(placed) + len(skipped) == 40 and len(placed) >= 20
    assert P.overlapping_labels(placed) == []
    # The oracle the assertion relies on: labels drawn at the same spot do overlap.
    clash = [ax.annotate("x", (0, 0)), ax.annotate("y", (0, 0))]
    assert P.overlapping_labels(clash) == [("x", "y")]
    plt.close(fig)


def test_bad_input():
    fig, ax = plt.subplots()
    with pytest.raises(ValueError, match="2 points but 1 labels"):
        P.place_labels(ax, [(0, 0), (1, 1)], ["a"])
    assert P.overlapping_labels([]) == []
    plt.close(fig)
