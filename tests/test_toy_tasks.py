import pytest
import torch

from tfedu import toy_tasks


def test_reverse_and_copy_targets(typechecked):
    src, tgt = typechecked(toy_tasks.make_digit_batch)(4, 6, torch.Generator().manual_seed(0))
    assert src.shape == tgt.shape == (4, 6)
    assert torch.equal(tgt, src.flip(1))
    assert ((src >= 0) & (src < toy_tasks.N_DIGITS)).all()
    src2, tgt2 = toy_tasks.make_digit_batch(4, 6, torch.Generator().manual_seed(0), task="copy")
    assert torch.equal(src2, src) and torch.equal(tgt2, src)


def test_batches_are_seeded():
    a = toy_tasks.make_digit_batch(3, 5, torch.Generator().manual_seed(3))[0]
    b = toy_tasks.make_digit_batch(3, 5, torch.Generator().manual_seed(3))[0]
    assert torch.equal(a, b)


def test_teacher_forcing_inputs_shift_right_behind_bos(typechecked):
    tgt = torch.tensor([[3, 1, 4], [1, 5, 9]])
    got = typechecked(toy_tasks.teacher_forcing_inputs)(tgt)
    assert got.tolist() == [[toy_tasks.BOS, 3, 1], [toy_tasks.BOS, 1, 5]]


def test_pad_sequences(typechecked):
    tokens, mask = typechecked(toy_tasks.pad_sequences)([[1, 2, 3], [4]])
    assert tokens.tolist() == [[1, 2, 3], [4, toy_tasks.PAD, toy_tasks.PAD]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]


def test_bad_arguments():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="task must be one of"):
        toy_tasks.make_digit_batch(2, 3, g, task="sort")
    with pytest.raises(ValueError, match="positive ints"):
        toy_tasks.make_digit_batch(2, 0, g)
    with pytest.raises(TypeError, match="torch.Generator"):
        toy_tasks.make_digit_batch(2, 3, 0)
    with pytest.raises(ValueError, match=r"\(batch, pos\)"):
        toy_tasks.teacher_forcing_inputs(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="non-empty"):
        toy_tasks.pad_sequences([[1], []])
