"""One training loop for every model in the course, short enough to read in one screen.

``train(model, train_data, cfg, val_data=...)`` does what nanoGPT's ``train.py`` does, as a function:

- **AdamW** (Loshchilov & Hutter 2019) with two parameter groups: weight decay on the matrices
  (every parameter with two or more dimensions, embeddings included, as nanoGPT does) and none on
  biases and norm gains, which set scales and offsets rather than store features.
- **Warm-up then cosine**: the learning rate rises linearly for ``warmup_steps`` (Adam's second-moment
  estimates are noise for the first steps), then follows half a cosine down to ``min_lr_ratio * lr``.
- **Gradient clipping** to a global norm of ``grad_clip``: one bad batch cannot throw the weights far.
- A tqdm bar with the loss and tokens/s; held-out loss every ``eval_every`` steps.
- **Checkpoints written atomically** (to a temporary file, then renamed over the old one: a crash mid-write
  leaves the previous checkpoint whole). A checkpoint holds the model, AdamW's moments, the step, the
  history and both random states (the batch sampler's and torch's, which drives dropout), so
  ``resume=`` continues a run exactly where it stopped: on CPU the loss curve is bit-for-bit the
  uninterrupted one (tests/test_train.py).
- **bf16 autocast on CUDA GPUs that have bfloat16 in hardware** (compute capability 8.0 on, ``runtime.bfloat16_native``):
  matrix products in bfloat16, weights and optimizer in float32. Older GPUs (Colab's T4) emulate bfloat16 slowly,
  so they train in float32.
- **Several processes**: under ``torchrun --nproc_per_node=N`` the same call wraps the model in
  DistributedDataParallel (gloo on CPU, NCCL on GPU). Every process draws the same global batch and
  trains on its own ``batch_size / N`` rows; DDP averages the gradients, which equals the gradient of the
  whole batch's mean loss, so the loss curve matches one process with the same global batch.

``tfedu train --preset course-gpt`` trains the course's shipped checkpoint with this loop.
Built up in notebooks/08_training_and_decoding.ipynb.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tfedu.data import CheckpointFile, TokenDataset
from tfedu.moe import router_losses
from tfedu.runtime import bfloat16_native


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000  # optimizer steps in the whole run
    batch_size: int = 32  # sequences per step, over all processes together
    seq_len: int | None = None  # tokens per sequence; None: the model's n_ctx
    lr: float = 1e-3  # peak learning rate, reached at the end of warm-up
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 100  # linear warm-up from lr / warmup_steps
    weight_decay: float = 0.1  # on matrices only (see param_groups)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's; GPT-3 and nanoGPT use beta2 = 0.95
    grad_clip: float | None = 1.0  # clip the global gradient norm to this; None: no clipping
    eval_every: int = 100  # held-out loss every so many steps (and at the end)
    eval_batches: int | None = 20  # how many held-out windows of batch_size; None: all of them
    checkpoint_every: int | None = None  # with out_dir; None: at every evaluation
    seed: int = 0  # the batch sampler's seed (the model's init is the caller's)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "warmup_steps", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "warmup_steps" else 1):
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0 and 0 <= min_lr_ratio <= 1, got lr={self.lr}, min_lr_ratio={self.min_lr_ratio}")


@dataclass
class TrainResult:
    history: list[dict] = field(default_factory=list)  # one record per step: step, loss, lr, grad_norm, tokens_per_s
    evals: list[dict] = field(default_factory=list)  # step, val_loss
    stopped_early: bool = False  # stopped before cfg.steps (Ctrl-C, or on_step returned True)

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.history]


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """The learning rate for optimizer step ``step`` (0-based): linear warm-up, then cosine decay.

    >>> cfg = TrainConfig(steps=101, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    >>> [round(learning_rate(s, cfg), 3) for s in (0, 9, 10, 55, 100)]  # 55: halfway down, (1 + 0.1) / 2
    [0.1, 1.0, 1.0, 0.55, 0.1]
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    low = cfg.lr * cfg.min_lr_ratio
    return low + (cfg.lr - low) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decay for parameters with 2+ dims, none for biases and norm gains.

    A tied embedding (W_U is W_E) appears once: ``named_parameters`` skips repeats.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ----------------------------------------------------------------------------- several processes


@dataclass(frozen=True)
class Processes:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def start_processes(device: torch.device) -> Processes:
    """Join the process group that ``torchrun`` set up through its environment, if there is one."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Processes()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Processes(dist.get_rank(), dist.get_world_size())


def mean_over_processes(value: float, procs: Processes) -> float:
    if procs.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / procs.world_size


# ----------------------------------------------------------------------------- the loop


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast the loop runs under: bfloat16 on a CUDA GPU that has it in hardware, none elsewhere."""
    if bfloat16_native(device):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train(
    model: nn.Module,
    train_data: TokenDataset,
    cfg: TrainConfig = TrainConfig(),
    *,
    val_data: TokenDataset | None = None,
    out_dir: str | os.PathLike | None = None,
    resume: bool = False,
    device: str | torch.device | None = None,
    progress: bool = True,
    on_step: Callable[[dict], bool | None] | None = None,
    optimizer_class: Callable[..., torch.optim.Optimizer] | None = None,
) -> TrainResult:
    """Train ``model`` (called as ``model(x, y) -> (logits, loss)``) on random windows of ``train_data``.

    ``optimizer_class`` replaces ``torch.optim.AdamW``: called with the parameter groups and
    ``lr=`` and ``betas=``, like it.
    ``out_dir`` receives ``checkpoint.pt``; ``resume=True`` continues from it. ``on_step(record)`` is
    called after every step (a notebook plots from it); if it returns True the run stops there. Ctrl-C (KeyboardInterrupt) stops the run after
    the current step and returns what was trained so far; the model keeps its weights.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    procs = start_processes(device)
    seq_len = cfg.seq_len or model.cfg.n_ctx
    if cfg.batch_size % procs.world_size:
        raise ValueError(f"batch_size {cfg.batch_size} must divide evenly over {procs.world_size} processes")
    rows = slice(procs.rank * cfg.batch_size // procs.world_size, (procs.rank + 1) * cfg.batch_size // procs.world_size)
    model.to(device)
    if optimizer_class is None:
        optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                                      fused=device.type == "cuda")
    else:  # another AdamW, called like torch's (notebook 08 trains with the learner's own step)
        optimizer = optimizer_class(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas)
    sampler = torch.Generator().manual_seed(cfg.seed)
    result, start = TrainResult(), 0
    path = Path(out_dir) / "checkpoint.pt" if out_dir is not None else None
    if resume:
        if path is None or not path.is_file():
            raise FileNotFoundError(f"resume=True needs a checkpoint at out_dir/checkpoint.pt; found none at {path}")
        start = load_checkpoint(path, model, optimizer, sampler, result)
    net = nn.parallel.DistributedDataParallel(model) if procs.world_size > 1 else model
    autocast = autocast_for(device)
    bar = _progress_bar(start, cfg.steps, enabled=progress and procs.is_main)
    checkpoint_every = cfg.checkpoint_every or cfg.eval_every
    model.train()
    try:
        for step in range(start, cfg.steps):
            tic = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, cfg)
            x, y = train_data.batch(cfg.batch_size, seq_len, sampler)  # the same global batch in every process
            x, y = x[rows].to(device), y[rows].to(device)
            with autocast:
                _, loss = net(x, y)
            optimizer.zero_grad(set_to_none=True)
            (loss + router_losses(model)).backward()  # + a mixture of experts' balance and z-losses (else 0)
            norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip else math.inf)
            optimizer.step()
            record = {"step": step + 1, "loss": mean_over_processes(loss.item(), procs), "lr": optimizer.param_groups[0]["lr"],
                      "grad_norm": norm.item(), "tokens_per_s": cfg.batch_size * seq_len / (time.perf_counter() - tic)}
            result.history.append(record)
            if val_data is not None and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                val = evaluate(model, val_data, seq_len, cfg.batch_size, cfg.eval_batches, procs, autocast)
                result.evals.append({"step": step + 1, "val_loss": val})
            if path is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == cfg.steps) and procs.is_main:
                save_checkpoint(path, model, optimizer, sampler, result, cfg)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                            **({"val": f"{result.evals[-1]['val_loss']:.3f}"} if result.evals else {}), refresh=False)
            if on_step is not None and on_step(record):
                result.stopped_early = True  # the caller asked to stop here
                break
    except KeyboardInterrupt:
        result.stopped_early = True
        if procs.is_main:
            where = f"; last checkpoint in {path}" if path is not None and path.is_file() else ""
            print(f"stopped by the user after step {len(result.history)}: the model keeps what it learned{where}")
    finally:
        bar.close()
        model.eval()
    return result


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: TokenDataset,
    seq_len: int,
    batch_size: int = 32,
    max_batches: int | None = None,
    procs: Processes = Processes(),
    autocast=None,
) -> float:
    """Mean next-token loss over non-overlapping windows of ``data`` (the same windows every time).

    ``max_batches`` evenly spaced batches of ``batch_size`` windows, or all windows when None.
    Under several processes each evaluates its share of the rows and the means are averaged.
    """
    was_training = model.training
    model.eval()
    starts = data.eval_starts(seq_len)
    if not starts:
        raise ValueError(f"held-out data of {len(data)} tokens is shorter than one window of {seq_len + 1}")
    if max_batches is not None and len(starts) > max_batches * batch_size:
        stride = len(starts) / (max_batches * batch_size)
        starts = [starts[int(i * stride)] for i in range(max_batches * batch_size)]
    mine = starts[procs.rank :: procs.world_size]
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(mine), batch_size):
        x, y = data.windows(mine[i : i + batch_size], seq_len)
        with autocast or contextlib.nullcontext():
            _, loss = model(x.to(device), y.to(device))
        total += loss.item() * len(x)
        count += len(x)
    model.train(was_training)
    if procs.world_size > 1:
        t = torch.tensor([total, count], dtype=torch.float64)
        dist.all_reduce(t)
        total, count = t.tolist()
    return total / count


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(path: Path, model: nn.Module, optimizer, sampler: torch.Generator, result: TrainResult,
                    cfg: TrainConfig) -> None:
    """Write everything ``resume`` needs, atomically: a temporary file, then a rename over the old one."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": sampler.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "history": result.history,
        "evals": result.evals,
        "train_config": asdict(cfg),
    }
    CheckpointFile(path).store(state)


def load_checkpoint(path: Path, model: nn.Module, optimizer, sampler: torch.Generator, result: TrainResult) -> int:
    """Restore a checkpoint written by ``save_checkpoint``; returns the number of steps already done."""
    try:
        state = CheckpointFile(path).restore()
        model.load_state_dict(state["model"])
    except Exception as error:
        raise ValueError(f"{path} is not a checkpoint of this model: {error}") from None
    optimizer.load_state_dict(state["optimizer"])
    sampler.set_state(state["sampler"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    result.history[:] = state["history"]
    result.evals[:] = state["evals"]
    return len(result.history)


def _progress_bar(start: int, total: int, enabled: bool):
    from tqdm.auto import tqdm

    # Redrawn at most once a second: in a notebook every redraw is a message to the front end, and a
    # kernel that sends more than ZeroMQ's 1000-message buffer while nothing reads it loses messages.
    return tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True, mininterval=1.0)

