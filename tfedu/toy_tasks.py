"""Tiny seeded sequence tasks for recurrent models: reverse or copy a string of digits.

Reversal is the classic probe of the seq2seq bottleneck: the first output digit is the last
input digit, so a decoder that only sees one fixed summary vector of the source must keep every
digit in that vector, while a decoder with attention can look the digit up.

Used in notebooks/03_rnns_to_attention.ipynb.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Int
from torch import Tensor

N_DIGITS = 10  # tokens 0..9 are the digits themselves
BOS = 10  # beginning of sequence: the decoder's first input
PAD = 11  # fills the tail of shorter sequences in a padded batch
D_VOCAB = 12
TASKS = ("reverse", "copy")


def make_digit_batch(
    batch: int, length: int, generator: torch.Generator, task: str = "reverse"
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """Random digit strings ``src`` and their targets ``tgt`` (reversed or copied), all of one length.

    >>> src, tgt = make_digit_batch(2, 4, torch.Generator().manual_seed(0))
    >>> bool((tgt == src.flip(1)).all()), src.shape
    (True, torch.Size([2, 4]))
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if not isinstance(batch, int) or not isinstance(length, int) or batch < 1 or length < 1:
        raise ValueError(f"batch and length must be positive ints, got batch={batch!r}, length={length!r}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    src = torch.randint(0, N_DIGITS, (batch, length), generator=generator)
    tgt = src.flip(1) if task == "reverse" else src.clone()
    return src, tgt


def teacher_forcing_inputs(tgt: Int[Tensor, "batch pos"]) -> Int[Tensor, "batch pos"]:
    """The decoder's inputs under teacher forcing: BOS, then the target shifted right by one.

    >>> teacher_forcing_inputs(torch.tensor([[3, 1, 4]]))
    tensor([[10,  3,  1]])
    """
    if not isinstance(tgt, torch.Tensor) or tgt.dim() != 2:
        raise ValueError(f"tgt must be a (batch, pos) tensor of token ids, got {_describe(tgt)}")
    bos = torch.full((tgt.shape[0], 1), BOS, dtype=tgt.dtype, device=tgt.device)
    return torch.cat([bos, tgt[:, :-1]], dim=1)


def pad_sequences(seqs: list[list[int]]) -> tuple[Int[Tensor, "batch pos"], Bool[Tensor, "batch pos"]]:
    """Right-pad token lists to one length; the mask is True at real tokens, False at padding.

    >>> tokens, mask = pad_sequences([[1, 2, 3], [4]])
    >>> tokens.tolist(), mask.tolist()
    ([[1, 2, 3], [4, 11, 11]], [[True, True, True], [True, False, False]])
    """
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("pad_sequences needs a non-empty list of non-empty sequences")
    longest = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), longest), PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.bool)
    for row, seq in enumerate(seqs):
        tokens[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = True
    return tokens, mask


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return type(value).__name__
