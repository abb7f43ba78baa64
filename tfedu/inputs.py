"""Input checks shared by the model's modules: a clear error for token ids or features of the wrong kind.

``tfedu.model``, ``tfedu.kv_cache``, ``tfedu.peft`` check token ids with ``check_ids``; the norms, the MLP
and the mixture of experts check the features they are given with ``check_features``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tfedu.config import ModelConfig


def check_d_model(d_model: object) -> None:
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model <= 0:
        raise ValueError(f"d_model must be a positive int, got {d_model!r}")


def check_features(layer: str, x: object, d_model: int) -> None:
    expected = f"(..., d_model) with d_model = {d_model}"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{layer} expects a torch.Tensor of shape {expected}, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{layer} expects a floating-point tensor, got dtype {x.dtype}; "
            "token ids must go through the embedding first (or call .float())"
        )
    if x.dim() == 0 or x.shape[-1] != d_model:
        raise ValueError(f"{layer} expects shape {expected}, got shape {tuple(x.shape)} (last dim must be d_model)")


def check_ids(ids: object, cfg: ModelConfig, name: str = "ids", *, cached: int = 0) -> None:
    """A clear error unless ``ids`` is an integer (batch, pos) tensor of in-range ids, ``cached + pos <= n_ctx``.

    ``cached`` counts the positions a KV cache already holds before these ids.
    """
    expected = f"an integer tensor of shape (batch, pos) with 1 <= pos <= n_ctx={cfg.n_ctx}"
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be {expected}, got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be {expected}, got dtype {ids.dtype} (token ids are whole numbers: use .long())")
    if ids.dim() != 2:
        hint = " (one sequence? use ids[None])" if ids.dim() == 1 else ""
        raise ValueError(f"{name} must be {expected}, got shape {tuple(ids.shape)}{hint}")
    if ids.shape[1] == 0:
        raise ValueError(f"{name} has no positions: give at least one token, shape (batch, pos) with pos >= 1")
    if cached and cached + ids.shape[1] > cfg.n_ctx:
        raise ValueError(f"{name} has {ids.shape[1]} position(s) after the {cached} cached: "
                         f"{cached + ids.shape[1]} in all, more than n_ctx={cfg.n_ctx}")
    if ids.shape[1] > cfg.n_ctx:
        raise ValueError(
            f"{name} has {ids.shape[1]} positions but this model's context is n_ctx={cfg.n_ctx}: "
            f"give at most {cfg.n_ctx} tokens (crop with {name}[:, -{cfg.n_ctx}:])"
        )
    if not ids.numel():
        return
    low, high = (int(value) for value in torch.aminmax(ids))  # one reduction, one wait for the device
    if low < 0 or high >= cfg.d_vocab:
        raise IndexError(f"{name} must lie in 0..{cfg.d_vocab - 1} (d_vocab={cfg.d_vocab}), got values from {low} to {high}")
