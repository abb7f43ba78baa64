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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from tfedu.activations import ACTIVATIONS, activate
from tfedu.config import ModelConfig
from tfedu.inputs import check_features

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


# ----------------------------------------------------------------------------- capacity and dispatch


def expert_capacity(n_tokens: int, n_experts: int, k: int = 1, capacity_factor: float = 1.0) -> int:
    """The most token assignments one expert takes: ``ceil(capacity_factor * k * n_tokens / n_experts)``.

    Switch's expert capacity (Fedus et al. 2022, eq. 3: tokens per batch / experts x capacity
    factor), times k when each token makes k assignments. A factor of 1 leaves no slack: any
    imbalance drops tokens; Switch trained with 1.0 to 1.25.

    >>> expert_capacity(n_tokens=512, n_experts=8, k=1, capacity_factor=1.25)  # 64 per expert, plus 25%
    80
    """
    for name, value in (("n_tokens", n_tokens), ("n_experts", n_experts), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be a positive number, got {capacity_factor!r}")
    return max(1, math.ceil(capacity_factor * k * n_tokens / n_experts))


@dataclass(frozen=True)
class Assignments:
    """Every (token, choice) assignment sorted by expert, and each one's place in its expert's queue.

    The queue order is every token's first choice in position order, then every second choice, and
    so on: when an expert is full, second choices are dropped before first ones (GShard's top-2
    gating also serves first choices first; Lepikhin et al. 2021).
    """

    expert: Tensor  # (tokens * k,) the expert of each assignment, sorted
    rank: Tensor  # (tokens * k,) its place in that expert's queue: 0, 1, 2, ...
    token: Tensor  # (tokens * k,) which token it carries
    choice: Tensor  # (tokens * k,) which of the token's k choices it is
    counts: Tensor  # (n_experts,) assignments per expert before any is dropped


def sort_assignments(experts: Int[Tensor, "tokens k"], n_experts: int) -> Assignments:
    """Sort the assignments by expert (stably, so each expert's queue keeps the priority order).

    >>> a = sort_assignments(torch.tensor([[1], [0], [1], [1]]), 2)
    >>> a.expert.tolist(), a.rank.tolist(), a.token.tolist(), a.counts.tolist()
    ([0, 1, 1, 1], [0, 0, 1, 2], [1, 0, 2, 3], [1, 3])
    """
    n_tokens = experts.shape[0]
    flat = experts.T.reshape(-1)  # choice-major: all first choices, then all second choices ...
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    counts = torch.bincount(flat, minlength=n_experts)
    starts = counts.cumsum(0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - starts[expert]
    return Assignments(expert=expert, rank=rank, token=order % n_tokens, choice=order // n_tokens, counts=counts)


@dataclass(frozen=True)
class RouterStats:
    """What the router did in one forward pass (detached, for plots and asserts)."""

    counts: Tensor  # (n_experts,) assignments each expert was sent
    kept: Tensor  # (n_experts,) assignments it ran (at most the capacity)
    capacity: int | None  # None: no limit (eval mode, or capacity_factor None)
    dropped: int  # assignments over capacity, not run
    dropped_tokens: int  # tokens all of whose k assignments were dropped: the residual alone carries them
    n_tokens: int
    balance: float  # balance_loss of this pass, 1.0 when perfectly even
    z: float  # router_z_loss of this pass

    @property
    def utilisation(self) -> Tensor:
        """Each expert's share of the assignments, ``counts / counts.sum()``: 1/E each when balanced."""
        return self.counts.float() / self.counts.sum()


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer: a router and E MLPs, each token run through k of them.

    ``out[t] = sum over t's kept choices j of gate[t, j] * expert_{e(t, j)}(x[t])``. Tokens dropped
    for capacity get 0 here; in a block, ``x + moe(norm(x))`` then passes them on unchanged.

    The experts' weights are stacked: ``W_in`` (E, d_model, d_mlp), ``W_out`` (E, d_mlp, d_model)
    (SwiGLU adds ``W_gate``), biases ``b_in``/``b_out`` with ``bias=True``; the router is
    ``router``, an ``nn.Linear(d_model, E, bias=False)`` run in float32 (Switch's "selective
    precision", sec. 2.4). ``gating`` is the function that turns router logits into (gates,
    experts): ``top_k_gating`` unless you pass your own; ``balance`` computes the load-balancing loss
    from (router probabilities, experts): ``balance_loss`` unless you pass your own.

    Capacity applies in training mode only: in eval mode every assignment runs (as Mixtral runs
    without dropping), so a KV-cached decode step, which routes one token at a time, gives the same
    output as the full forward pass.

    >>> moe = MoE(d_model=8, d_mlp=16, n_experts=4, top_k=2)
    >>> moe(torch.randn(2, 5, 8)).shape, moe.stats.counts.sum().item()  # 10 tokens x 2 choices
    (torch.Size([2, 5, 8]), 20)
    """

    def __init__(self, d_model: int, d_mlp: int, n_experts: int, *, top_k: int = 1,
                 capacity_factor: float | None = None, activation: str = "gelu", bias: bool = True,
                 balance_loss_coef: float = 0.01, z_loss_coef: float = 0.001, dispatch: str = "sorted",
                 gating: Callable[[Tensor, int], tuple[Tensor, Tensor]] = top_k_gating,
                 balance: Callable[[Tensor, Tensor], Tensor] = balance_loss) -> None:
        super().__init__()
        cfg = ModelConfig(d_vocab=1, n_ctx=1, d_model=d_model, n_layers=1, n_heads=1, d_mlp=d_mlp,
                          activation=activation, n_experts=n_experts, top_k=top_k, capacity_factor=capacity_factor,
                          balance_loss_coef=balance_loss_coef, z_loss_coef=z_loss_coef)
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; valid ones are {', '.join(map(repr, ACTIVATIONS))}")
        self.d_model, self.d_mlp, self.n_experts, self.top_k = d_model, d_mlp, n_experts, top_k
        self.capacity_factor = cfg.capacity_factor
        self.activation = activation
        self.balance_loss_coef, self.z_loss_coef = balance_loss_coef, z_loss_coef
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch={dispatch!r} is not one of {', '.join(map(repr, DISPATCHES))}")
        self.dispatch = dispatch
        self.gating = gating
        self.balance = balance
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.W_in = nn.Parameter(torch.empty(n_experts, d_model, d_mlp))
        if activation == "swiglu":
            self.W_gate = nn.Parameter(torch.empty(n_experts, d_model, d_mlp))
        self.W_out = nn.Parameter(torch.empty(n_experts, d_mlp, d_model))
        self.b_in = nn.Parameter(torch.zeros(n_experts, d_mlp)) if bias else None
        self.b_gate = nn.Parameter(torch.zeros(n_experts, d_mlp)) if bias and activation == "swiglu" else None
        self.b_out = nn.Parameter(torch.zeros(n_experts, d_model)) if bias else None
        self.reset_parameters()
        self.aux_loss: Tensor | None = None  # balance_loss_coef * balance + z_loss_coef * z, of the last forward
        self.stats: RouterStats | None = None

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> MoE:
        """The MoE that replaces a block's MLP for ``cfg`` (``n_experts``, ``top_k``, ``capacity_factor``...)."""
        return cls(cfg.d_model, cfg.d_mlp, cfg.n_experts, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                   activation=cfg.activation, bias=cfg.bias, balance_loss_coef=cfg.balance_loss_coef,
                   z_loss_coef=cfg.z_loss_coef)

    def reset_parameters(self, std: float | None = None, out_std: float | None = None) -> None:
        """Each expert initialised as an ``nn.Linear`` would be (uniform, +-1/sqrt(fan_in)), or normal(0, std).

        ``tfedu.model`` passes its std (GPT-2's 0.02) and the smaller ``out_std`` for ``W_out``.
        """
        for name in ("W_in", "W_gate", "W_out"):
            weight = getattr(self, name, None)
            if weight is None:
                continue
            if std is None:
                bound = 1 / math.sqrt(weight.shape[1])
                nn.init.uniform_(weight, -bound, bound)
            else:
                nn.init.normal_(weight, 0.0, out_std if name == "W_out" and out_std is not None else std)
        for bias in (self.b_in, self.b_gate, self.b_out):
            if bias is not None:
                nn.init.zeros_(bias)

    # -- the experts

    def expert(self, e: int, x: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_model"]:
        """Expert ``e``'s MLP on the rows of ``x``: ``act(x W_in[e] + b_in[e]) W_out[e] + b_out[e]``."""
        pre = x @ self.W_in[e] + (self.b_in[e] if self.b_in is not None else 0)
        gate = None
        if self.activation == "swiglu":
            gate = x @ self.W_gate[e] + (self.b_gate[e] if self.b_gate is not None else 0)
        return activate(pre, self.activation, gate) @ self.W_out[e] + (self.b_out[e] if self.b_out is not None else 0)

    def experts_batched(self, buffer: Float[Tensor, "n_experts capacity d_model"]) -> Tensor:
        """Every expert on its own slice of ``buffer`` at once: two batched matmuls (three for SwiGLU)."""
        pre = torch.bmm(buffer, self.W_in)
        if self.b_in is not None:
            pre = pre + self.b_in[:, None]
        gate = None
        if self.activation == "swiglu":
            gate = torch.bmm(buffer, self.W_gate)
            if self.b_gate is not None:
                gate = gate + self.b_gate[:, None]
        out = torch.bmm(activate(pre, self.activation, gate), self.W_out)
        return out + self.b_out[:, None] if self.b_out is not None else out

    # -- forward

    def capacity(self, n_tokens: int) -> int | None:
        """This pass's expert capacity: None (no limit) in eval mode or without a capacity factor."""
        if self.capacity_factor is None or not self.training:
            return None
        return expert_capacity(n_tokens, self.n_experts, self.top_k, self.capacity_factor)

    def route(self, x: Float[Tensor, "tokens d_model"]) -> tuple[Tensor, Tensor, Tensor]:
        """``(router_logits, gates, experts)`` for the rows of ``x``; logits in float32."""
        logits = F.linear(x.float(), self.router.weight.float())
        gates, experts = self.gating(logits, self.top_k)
        if (not isinstance(gates, Tensor) or not isinstance(experts, Tensor)
                or gates.shape != (x.shape[0], self.top_k) or experts.shape != gates.shape):
            raise ValueError(f"gating must return (gates, experts), both of shape (tokens, k) = "
                             f"({x.shape[0]}, {self.top_k}); got {describe_pair(gates, experts)}")
        return logits, gates, experts.long()

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        check_features("MoE", x, self.d_model)
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"dispatch={self.dispatch!r} is not one of {', '.join(map(repr, DISPATCHES))}")
        flat = x.reshape(-1, self.d_model)
        logits, gates, experts = self.route(flat)
        a = sort_assignments(experts, self.n_experts)
        capacity = self.capacity(flat.shape[0])
        limit = int(a.counts.max()) if capacity is None else capacity
        keep = a.rank < limit
        if self.dispatch == "loop":
            out = self._loop(flat, gates.to(flat.dtype), experts, a, keep)
        else:
            out = self._sorted(flat, gates.to(flat.dtype), a, keep, limit)
        probs = logits.softmax(dim=-1)
        balance, z = self.balance(probs, experts), router_z_loss(logits)
        self.aux_loss = self.balance_loss_coef * balance + self.z_loss_coef * z
        self._record(a, keep, capacity, flat.shape[0], balance, z)
        return out.reshape(x.shape)

    def _loop(self, x: Tensor, gates: Tensor, experts: Tensor, a: Assignments, keep: Tensor) -> Tensor:
        """The readable dispatch: for each expert, pick its kept tokens with a mask, run it, add back."""
        kept = torch.zeros(experts.numel(), dtype=torch.bool, device=x.device)
        kept[a.choice[keep] * x.shape[0] + a.token[keep]] = True
        kept = kept.view(self.top_k, -1).T  # (tokens, k), True where that assignment runs
        out = torch.zeros_like(x)
        for e in range(self.n_experts):
            token, choice = torch.where((experts == e) & kept)
            if token.numel():
                out = out.index_add(0, token, gates[token, choice, None] * self.expert(e, x[token]))
        return out

    def _sorted(self, x: Tensor, gates: Tensor, a: Assignments, keep: Tensor, capacity: int) -> Tensor:
        """Sort-and-gather: copy the kept assignments into an (E, capacity, d_model) buffer, run all experts
        in batched matmuls, scale by the gates and add each row back to its token."""
        token, choice = a.token[keep], a.choice[keep]
        slot = a.expert[keep] * capacity + a.rank[keep]  # row of the flattened buffer
        buffer = x.new_zeros(self.n_experts * capacity, self.d_model).index_copy(0, slot, x[token])
        y = self.experts_batched(buffer.view(self.n_experts, capacity, self.d_model))
        y = y.reshape(-1, self.d_model)[slot] * gates[token, choice, None]
        return torch.zeros_like(x).index_add(0, token, y)

    def _record(self, a: Assignments, keep: Tensor, capacity: int | None, n_tokens: int, balance: Tensor,
                z: Tensor) -> None:
        kept = torch.bincount(a.expert[keep], minlength=self.n_experts)
        tokens_kept = torch.zeros(n_tokens, dtype=torch.bool, device=keep.device)
        tokens_kept[a.token[keep]] = True
        self.stats = RouterStats(counts=a.counts.detach().cpu(), kept=kept.cpu(), capacity=capacity,
                                 dropped=int((~keep).sum()), dropped_tokens=int((~tokens_kept).sum()),
                                 n_tokens=n_tokens, balance=float(balance.detach()), z=float(z.detach()))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_mlp={self.d_mlp}, n_experts={self.n_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, activation={self.activation!r}, dispatch={self.dispatch!r}")


def describe_pair(gates: object, experts: object) -> str:
    def one(t: object) -> str:
        return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__

    return f"{one(gates)} and {one(experts)}"


# ----------------------------------------------------------------------------- in a model


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every ``MoE`` inside ``model``, in order."""
    return [module for module in model.modules() if isinstance(module, MoE)]


def router_losses(model: nn.Module) -> Tensor | float:
    """The sum of the MoE layers' ``aux_loss`` from the last forward pass; 0.0 when the model has none.

    ``tfedu.train.train`` adds it to the next-token loss before the backward pass.
    """
    losses = [layer.aux_loss for layer in moe_layers(model) if layer.aux_loss is not None]
    return sum(losses) if losses else 0.0


def use_router(model: nn.Module, *, gating: Callable[[Tensor, int], tuple[Tensor, Tensor]] | None = None,
               balance: Callable[[Tensor, Tensor], Tensor] | None = None) -> int:
    """Make every MoE layer of ``model`` route with ``gating`` and/or score balance with ``balance``.

    Returns how many layers changed (0 for a model without a mixture of experts).
    """
    layers = moe_layers(model)
    for layer in layers:
        if gating is not None:
            layer.gating = gating
        if balance is not None:
            layer.balance = balance
    return len(layers)
