"""Notebook 20's runs: one small GPT trained on the course corpus by 1, 2 or 4 real processes under each scheme of
:mod:`tfedu.parallel`, against training in one process on the whole batch; what each scheme communicates and keeps
per rank; and float16 / bfloat16 training against float32.

Every run function here takes ``(rank, world_size, ...)`` and is defined at the module's top level, so
:func:`tfedu.parallel.spawn` can start it with any start method.

- :func:`train_scheme`: ``STEPS`` AdamW steps of ``CONFIG`` on fixed batches of ``BATCH`` windows, each rank
  taking its rows; schemes "by hand" (one all-reduce after backward), "ring" (the same through a ring all-reduce,
  the library's or one passed in), "buckets" (all-reduces started during backward), "ddp" (torch's
  DistributedDataParallel), "zero1" (:class:`tfedu.parallel.ShardedAdamW`) and "fsdp" (torch's ``fully_shard``).
- :func:`memory_per_rank`: bytes of weights, gradients and optimizer state each rank holds under each ZeRO stage.
- :func:`train_precision`: float32, bfloat16 autocast and float16 autocast with a loss scaler, one process.
- :func:`underflow`: how many of a trained model's gradients float16 flushes to zero, with and without a scale.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch import Tensor, nn

from tfedu.config import ModelConfig
from tfedu.data import sample_windows
from tfedu.experiments import course_gpt
from tfedu.model import GPT
from tfedu.parallel import (BucketedAllReduce, CommCounter, LossScaler, ProcessComm, ShardedAdamW,
                            allreduce_gradients, ring_all_reduce, shard_model)

CONFIG = ModelConfig(d_vocab=course_gpt.VOCAB_SIZE, n_ctx=32, d_model=32, n_layers=2, n_heads=4)
BATCH, STEPS, LR, SEED = 8, 4, 3e-3, 0
SCHEMES = ("by hand", "ring", "buckets", "ddp", "zero1", "fsdp")


@functools.cache
def _tokens() -> Tensor:
    train_data, _ = course_gpt.datasets(course_gpt.tokenizer())
    return torch.from_numpy(train_data.ids.astype("int64"))


def batches(steps: int = STEPS, batch: int = BATCH, seed: int = SEED, n_ctx: int = CONFIG.n_ctx) -> list[tuple[Tensor, Tensor]]:
    """``steps`` batches of ``batch`` windows of the course corpus (inputs, targets), the same for every rank."""
    g = torch.Generator().manual_seed(seed)
    return [sample_windows(_tokens(), batch, n_ctx, g) for _ in range(steps)]


def _model(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg).to(dtype)


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _full_state(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter whole (an FSDP shard gathered), by name."""
    out = {}
    for name, p in model.named_parameters():
        data = p.detach()
        if hasattr(data, "full_tensor"):
            data = data.full_tensor()
        out[name.removeprefix("module.")] = data.clone()
    return out


def train_scheme(rank: int, world_size: int, scheme: str, *, steps: int = STEPS, batch: int = BATCH,
                 cfg: ModelConfig = CONFIG, seed: int = SEED, dtype: torch.dtype = torch.float64,
                 ring: Callable[[Tensor, Any], Tensor] | None = None, sharded: type | None = None,
                 bucket_bytes: int = 4096) -> dict:
    """Train ``cfg`` for ``steps`` AdamW steps as rank ``rank`` of ``world_size`` under ``scheme``.

    Each rank takes ``batch / world_size`` rows of every batch (with ``world_size`` 1 and any scheme but "fsdp",
    which needs a group, it is training on the whole batch). Returns {losses (the whole batch's mean loss at each
    step), params (every parameter whole, by name), payload and calls (the bytes handed to each kind of collective
    during training, and how many ran), sent (bytes this rank sent by point-to-point messages), state_bytes
    (optimizer state on this rank), param_bytes (parameters on this rank), seconds (per step on this rank: the fastest
    step after the first, as a busy machine only ever slows a step down)}.
    ``ring(x, comm)`` replaces the library's ring all-reduce in the "ring" scheme, ``sharded`` (a class made as
    ``sharded(params, comm, lr=...)``, with ``step`` and its torch optimizer as ``.optimizer``) the
    library's :class:`ShardedAdamW` in the "zero1" scheme.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(map(repr, SCHEMES))}, got {scheme!r}")
    if batch % world_size:
        raise ValueError(f"batch ({batch}) must split evenly over world_size ({world_size}) processes")
    model = _model(cfg, seed, dtype)
    grouped = dist.is_available() and dist.is_initialized()
    comm = ProcessComm() if grouped else None
    counter = CommCounter()
    ddp_payload = [0, 0]  # bytes, all-reduces
    if scheme == "ddp":
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_bytes / 2 ** 20)

        def counted(state, bucket):  # (DDP refuses a hook whose annotations are not its own types: none here)
            ddp_payload[0] += bucket.buffer().numel() * bucket.buffer().element_size()
            ddp_payload[1] += 1
            return default_hooks.allreduce_hook(None, bucket)

        model.register_comm_hook(None, counted)
    elif scheme == "fsdp":
        shard_model(model)
    sync = BucketedAllReduce(model, bucket_bytes=bucket_bytes) if scheme == "buckets" else None
    if scheme == "zero1":
        optimizer: Any = (sharded or ShardedAdamW)(model.parameters(), comm, lr=LR)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rows = batch // world_size
    losses, times = [], []
    for x, y in batches(steps, batch, seed, cfg.n_ctx):
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        tic = time.perf_counter()
        model.zero_grad(set_to_none=True)
        with counter:
            loss = _loss(model, x, y)
            loss.backward()
            if world_size > 1 and scheme == "by hand":
                allreduce_gradients(model.parameters())
            elif world_size > 1 and scheme == "ring":
                allreduce_gradients(model.parameters(), lambda t: (ring or ring_all_reduce)(t, comm), world_size)
            elif sync is not None:
                sync.wait()
            optimizer.step()
        times.append(time.perf_counter() - tic)
        whole = loss.detach().clone()
        if grouped:
            dist.all_reduce(whole)
        losses.append(whole.item() / world_size)
    payload, calls = dict(counter.payload), dict(counter.calls)
    if scheme == "ddp":
        payload, calls = {"all_reduce": ddp_payload[0]}, {"all_reduce": ddp_payload[1]}
    state = _state_bytes(optimizer.optimizer if scheme == "zero1" else optimizer)
    return {"losses": losses, "params": _full_state(model), "payload": payload, "calls": calls,
            "sent": comm.sent if comm is not None else 0, "state_bytes": state,
            "param_bytes": sum(_local(p).numel() * p.element_size() for p in model.parameters()),
            "seconds": min(times[1:] or times)}


def _local(p: Tensor) -> Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(_local(v).numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, Tensor) and v.dim() > 0)


def memory_per_rank(n_params: float, world_size: int, *, weight_bytes: int = 2, grad_bytes: int = 2,
                    optimizer_bytes: int = 12) -> dict[str, float]:
    """Bytes of model state one rank holds, by scheme, in mixed-precision AdamW's accounting (Rajbhandari et al.
    2020, "ZeRO", sec. 3.1): 16-bit weights and gradients (2 bytes each) and K = 12 bytes of optimizer state per
    parameter (the float32 master weight, momentum and variance). Data parallelism keeps all of it on every rank;
    ZeRO-1 shards the optimizer state, ZeRO-2 the gradients too, ZeRO-3 (FSDP) the weights as well (activations and
    the one layer gathered at a time not counted).

    >>> round(memory_per_rank(7.5e9, 64)["ZeRO-1"] / 1e9, 1)  # the paper's figure 1: 7.5B parameters, 64 GPUs
    31.4
    """
    p, n = n_params, world_size
    return {"data parallel": (weight_bytes + grad_bytes + optimizer_bytes) * p,
            "ZeRO-1": (weight_bytes + grad_bytes) * p + optimizer_bytes * p / n,
            "ZeRO-2": weight_bytes * p + (grad_bytes + optimizer_bytes) * p / n,
            "ZeRO-3 / FSDP": (weight_bytes + grad_bytes + optimizer_bytes) * p / n}


# A model large enough that a step's compute, not the processes' start, is what a timing sees.
TIMING_CONFIG = ModelConfig(d_vocab=course_gpt.VOCAB_SIZE, n_ctx=64, d_model=128, n_layers=4, n_heads=4)
TIMING_BATCH = 16


# ----------------------------------------------------------------------------- mixed precision

PRECISIONS = ("float32", "bfloat16", "float16")


def train_precision(precision: str, *, steps: int = 60, batch: int = 8, seed: int = SEED,
                    scaler: LossScaler | None = None, lr: float = LR) -> dict:
    """Train ``CONFIG`` on the corpus in one process with float32 weights (the master copy), the forward and
    backward run in ``precision`` by autocast; float16 with a loss scaler (``scaler``, a fresh
    :class:`tfedu.parallel.LossScaler` by default). Returns {losses, scales (the scale at each step; float16),
    skipped (steps whose gradients overflowed and were not taken)}."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    model = _model(CONFIG, seed, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if precision == "float16" and scaler is None:
        scaler = LossScaler(growth_interval=20)
    losses, scales, skipped = [], [], 0
    for x, y in batches(steps, batch, seed):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=getattr(torch, precision), enabled=precision != "float32"):
            loss = _loss(model, x, y)
        if precision == "float16":
            scales.append(scaler.scale)
            (loss.float() * scaler.scale).backward()
            if not scaler.unscale_and_update([p.grad for p in model.parameters()]):
                skipped += 1
                losses.append(loss.item())
                continue
        else:
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "scales": scales, "skipped": skipped}


def underflow(steps: int = 20, seed: int = SEED) -> dict[str, float]:
    """Train ``CONFIG`` for ``steps`` float32 steps, then cast one batch's gradients to float16: the share of the
    nonzero gradients that become 0, unscaled and scaled by 2**16 first (Micikevicius et al. 2018, fig. 3)."""
    model = _model(CONFIG, seed, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for x, y in batches(steps + 1, BATCH, seed)[:-1]:
        optimizer.zero_grad()
        _loss(model, x, y).backward()
        optimizer.step()
    x, y = batches(steps + 1, BATCH, seed)[-1]
    optimizer.zero_grad()
    _loss(model, x, y).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    grads = grads[grads != 0]
    return {"unscaled": float((grads.half() == 0).double().mean()),
            "scaled 2**16": float(((grads * 2 ** 16).half() == 0).double().mean()),
            "smallest": float(grads.abs().min()), "n": grads.numel()}
