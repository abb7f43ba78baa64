"""tfedu.experiments.nopos: causal attention without positional encodings learns position; unmasked attention cannot.

Also the notebook's switch: the experiment in notebooks/05_masks_and_heads.ipynb runs with the
learner's MultiHeadAttention when USE_MY_ATTENTION is True, so it is run here with the notebook's
own solution of exercise 5.3.
"""

import doctest
import math
from pathlib import Path

import einops
import pytest
import torch
from torch import nn

from tfedu.course import nbtools
from tfedu.experiments import nopos
from tfedu.attention import MultiHeadAttention

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "05_masks_and_heads.ipynb"


def notebook_solution_class():
    """The MultiHeadAttention class exactly as exercise 5.3's solution cell defines it."""
    cells = [c for c in nbtools.read(NOTEBOOK).cells if (nbtools.nbgrader_meta(c) or {}).get("grade_id") == "ex_multi_head_attention"]
    assert len(cells) == 1
    namespace = {"torch": torch, "nn": nn, "einops": einops, "math": math}
    exec(compile(cells[0].source, "ex_multi_head_attention", "exec"), namespace)
    return namespace["MultiHeadAttention"]


def test_docstring_examples():
    failures, tried = doctest.testmod(nopos, raise_on_error=False)
    assert tried >= 4 and failures == 0


def test_batches_start_with_bos_and_nowhere_else():
    tokens = nopos.make_position_batch(64, 9, 5, torch.Generator().manual_seed(1))
    assert tokens.shape == (64, 9)
    assert (tokens[:, 0] == nopos.BOS).all() and (tokens[:, 1:] != nopos.BOS).all() and (tokens < 5).all()


def test_the_causal_model_learns_position_and_the_unmasked_one_cannot():
    causal = nopos.train_position_reader(causal=True)
    open_ = nopos.train_position_reader(causal=False)
    assert causal.accuracy > 0.97 and (causal.accuracy_by_pos > 0.9).all()
    bound = nopos.best_accuracy_without_mask(8)
    assert open_.accuracy < bound + 0.03
    assert open_.accuracy_by_pos[0] == 1.0  # BOS gives position 0 away
    # The unmasked model reaches the best loss any order-blind model can: (n-1)/n * ln(n-1) nats.
    assert abs(sum(open_.losses[-20:]) / 20 - 7 / 8 * math.log(7)) < 0.02


def test_the_notebook_switch_trains_with_the_learners_layer():
    """USE_MY_ATTENTION = True with a correct exercise 5.3: the experiment still works, and matches the reference."""
    learner_cls = notebook_solution_class()
    mine = nopos.train_position_reader(learner_cls, causal=True)
    reference = nopos.train_position_reader(MultiHeadAttention, causal=True)
    assert isinstance(mine.model.attention, learner_cls)
    assert mine.accuracy > 0.97
    # Same parameter shapes created in the same order, so the same seeded start and the same training.
    assert mine.losses[0] == pytest.approx(reference.losses[0], abs=1e-5)
    assert mine.accuracy == pytest.approx(reference.accuracy, abs=0.02)


def test_a_broken_learner_layer_does_not_pass_for_a_working_one():
    class NoMask(notebook_solution_class()):  # a learner who forgot to apply the mask
        def forward(self, x, context=None, mask=None):
            return super().forward(x, context)

    assert nopos.train_position_reader(NoMask, causal=True, steps=100).accuracy < 0.3


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: nopos.make_position_batch(0, 4, 5, torch.Generator()), "batch must be an int >= 1"),
        (lambda: nopos.make_position_batch(2, 4, 1, torch.Generator()), "d_vocab must be an int >= 2"),
        (lambda: nopos.make_position_batch(2, 4, 5, 0), "generator must be a torch.Generator"),
        (lambda: nopos.best_accuracy_without_mask(1), "n_pos must be an int >= 2"),
        (lambda: nopos.train_position_reader(steps=0), "steps must be a positive int"),
    ],
)
def test_bad_input_says_what_was_expected(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
