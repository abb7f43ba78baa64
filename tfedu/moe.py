"""A mixture-of-experts feed-forward layer: router, top-k gating, capacity, balance losses, two dispatches.

A mixture of experts (MoE) keeps E copies of the MLP in a block, the *experts*, and a small linear
*router* that picks, for every token on its own, which k of them run on it (Shazeer et al. 2017;
Fedus, Zoph & Shazeer 2022, "Switch Transformers", k = 1). The MLP's parameters grow E times; the
FLOPs per token grow only k times, plus the router's ``2 d_model E``:

- ``top_k_gating(router_logits, k)``: softmax over the *experts* axis, keep the k largest, and
  weight each chosen expert's output by its gate. With k = 1 the gate is the probability itself
  (Switch's 0.65 in the deck): the router is trained through it, so it must not be renormalised to
  1. With k > 1 the k gates are divided by their sum (GShard's top-2, Mixtral), so they add to 1.
- ``expert_capacity``: an expert takes at most ``ceil(capacity_factor * k * tokens / E)`` tokens
  (Switch, eq. 3, times k for top-k); the ones past that, in position order, are *dropped*: the
  expert does not run on them and they pass on through the residual connection alone.
- ``balance_loss``: Switch's ``E * sum_i f_i * P_i`` (eq. 4), with f_i the fraction of the token
  assignments that went to expert i and P_i the mean router probability of expert i. It is 1 when
  the router spreads tokens evenly, and up to E when it sends every token to one expert.
- ``router_z_loss``: ST-MoE's ``mean over tokens of logsumexp(router_logits)^2`` (Zoph et al.
  2022, eq. 5), which keeps the router's logits small.
- ``MoE``: the layer. It stores its expert weights stacked, ``W_in`` (E, d_model, d_mlp) and
  ``W_out`` (E, d_mlp, d_model), and runs them one of two ways that give the same outputs and
  gradients: ``dispatch="loop"``, a readable loop over the experts that picks each one's tokens
  with a mask, and ``dispatch="sorted"`` (the default), which sorts the assignments by expert,
  gathers them into an (E, capacity, d_model) buffer and runs every expert in one batched matmul.

``ModelConfig(n_experts=E, top_k=k, capacity_factor=c)`` puts an ``MoE`` in place of every
block's MLP (``tfedu.layers.make_mlp``). After each forward pass every MoE layer holds its
``aux_loss`` (``balance_loss_coef * balance + z_loss_coef * z``) and its ``stats``;
``router_losses(model)`` adds the layers' aux losses up, and ``tfedu.train.train`` adds that to
the next-token loss it minimises.

Built by hand in notebooks/12_moe_and_scaling.ipynb.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

DISPATCHES = ("sorted", "loop")


def _check_logits(router_logits: object) -> None:
    if not isinstance(router_logits, Tensor) or not router_logits.is_floating_point() or router_logits.dim() != 2:
        got = (f"{router_logits.dtype} {tuple(router_logits.shape)}" if isinstance(router_logits, Tensor)
               else type(router_logits).__name__)
        raise ValueError(f"router_logits must be a float tensor of shape (tokens, n_experts), got {got}")


def _check_k(k: object, n_experts: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_experts:
        raise ValueError(f"k must be an int from 1 to n_experts={n_experts}, got {k!r}")


def top_k_gating(
    router_logits: Float[Tensor, "tokens n_experts"], k: int = 1
) -> tuple[Float[Tensor, "tokens k"], Int[Tensor, "tokens k"]]:
    """Each token's k experts and their gates: ``(gates, experts)``, both (tokens, k), largest gate first.

    The router's probabilities are a softmax over the experts (the last axis: each token's row adds
    to 1). The k largest are kept. With k = 1 the gate is that probability, unchanged (Switch); with
    k > 1 the k gates are divided by their sum so that they add to 1 (Mixtral; equal to a softmax
    over the k chosen logits).

    >>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    >>> gates, experts = top_k_gating(logits, k=1)
    >>> experts.tolist(), round(gates.item(), 4)  # softmax([2, 1, 0, -1])[0]
    ([[0]], 0.6439)
    >>> gates, experts = top_k_gating(logits, k=2)
    >>> experts.tolist(), [round(g, 4) for g in gates[0].tolist()]  # softmax([2, 1])
    ([[0, 1]], [0.7311, 0.2689])
    """
    _check_logits(router_logits)
    _check_k(k, router_logits.shape[-1])
    probs = router_logits.float().softmax(dim=-1)
    gates, experts = probs.topk(k, dim=-1)
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates.to(router_logits.dtype), experts


def _check_assignments(router_probs: object, experts: object) -> None:
    if not isinstance(router_probs, Tensor) or not router_probs.is_floating_point() or router_probs.dim() != 2:
        got = (f"{router_probs.dtype} {tuple(router_probs.shape)}" if isinstance(router_probs, Tensor)
               else type(router_probs).__name__)
        raise ValueError(f"router_probs must be a float tensor of shape (tokens, n_experts), got {got}")
    if (not isinstance(experts, Tensor) or experts.is_floating_point() or experts.dtype == torch.bool
            or experts.dim() != 2 or experts.shape[0] != router_probs.shape[0]):
        got = f"{experts.dtype} {tuple(experts.shape)}" if isinstance(experts, Tensor) else type(experts).__name__
        raise ValueError(f"experts must be an integer tensor of shape (tokens, k) with tokens = "
                         f"{router_probs.shape[0]}, got {got}")


def expert_fractions(experts: Int[Tensor, "tokens k"], n_experts: int) -> Float[Tensor, "n_experts"]:
    """f_i: the fraction of the tokens x k assignments that went to expert i (adds to 1; no gradient).

    >>> expert_fractions(torch.tensor([[0], [0], [1], [3]]), 4).tolist()
    [0.5, 0.25, 0.0, 0.25]
    """
    counts = torch.bincount(experts.flatten(), minlength=n_experts)
    return counts.float() / experts.numel()


def balance_loss(router_probs: Float[Tensor, "tokens n_experts"], experts: Int[Tensor, "tokens k"]) -> Tensor:
    """Switch's load-balancing loss ``E * sum_i f_i * P_i`` (Fedus et al. 2022, eqs. 4-6).

    f_i is the fraction of assignments routed to expert i (``expert_fractions``: counts, so no
    gradient flows through it) and P_i the mean probability the router gives expert i over the
    tokens (differentiable: the loss trains the router through it). Both are uniform, 1/E, when
    the load is balanced, and then the loss is E * E * (1/E)^2 = 1; sending every token to one
    expert with probability 1 gives E. f here adds to 1 for any k (this course's convention); Hugging
    Face's Mixtral counts each token's k picks, so its f adds to k and its balanced loss is k.

    >>> probs = torch.full((8, 4), 0.25)
    >>> balance_loss(probs, torch.arange(8)[:, None] % 4).item()  # perfectly balanced
    1.0
    >>> balance_loss(F.one_hot(torch.zeros(8, dtype=torch.long), 4).float(), torch.zeros(8, 1, dtype=torch.long)).item()
    4.0
    """
    _check_assignments(router_probs, experts)
    n_experts = router_probs.shape[-1]
    f = expert_fractions(experts, n_experts).to(router_probs.dtype)
    P = router_probs.mean(dim=0)
    return n_experts * (f * P).sum()


def router_z_loss(router_logits: Float[Tensor, "tokens n_experts"]) -> Tensor:
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits)^2`` (Zoph et al. 2022, eq. 5).

    It pushes the router's logits towards 0, where the softmax (and its exp) stays well inside
    floating-point range; adding the same constant to a row changes it although it leaves the
    softmax unchanged.

    >>> abs(router_z_loss(torch.zeros(3, 4)).item() - math.log(4) ** 2) < 1e-6  # logsumexp of 4 zeros is ln 4
    True
    """
    _check_logits(router_logits)
    return torch.logsumexp(router_logits.float(), dim=-1).pow(2).mean()
