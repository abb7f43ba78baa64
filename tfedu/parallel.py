"""Training across processes, by hand: start a group of processes, and data parallelism's gradient all-reduce.

When a model outgrows one device, or one device is too slow, training runs as several processes that talk through
``torch.distributed``: collectives such as all-reduce (every process ends with the sum of everyone's tensor). This
module starts real processes on one machine with the gloo backend, so every learner can run them on a laptop CPU;
the same code runs unchanged with NCCL on GPUs.

- ``spawn(fn, world_size, *args)``: run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in
  one process group, and return each rank's result.
- ``allreduce_gradients(params)``: data parallelism after ``backward``: every process trained on its own slice of the
  batch; averaging the gradients makes every process take the step that the whole batch would have given.
- ``BucketedAllReduce``: the same average, started during ``backward``: each parameter's gradient joins a bucket as
  soon as it is final (a hook), and a full bucket's all-reduce runs while autograd computes the rest, as PyTorch's
  DistributedDataParallel does (Li et al. 2020, "PyTorch Distributed", sec. 3.2).

Issue 47 (notebook 20, parallel training) builds on these; the notebook is not written yet.
"""

from __future__ import annotations

import io
import os
import socket
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn


def free_port() -> int:
    """A TCP port that was free a moment ago on this machine (for the group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, backend: str, results: Any, args: tuple) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)  # world_size processes share the machine's cores
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)  # bytes, not shared-memory tensors: they outlive this process
        results.put((rank, buffer.getvalue()))
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes of one group; their results, by rank.

    ``fn`` must be importable by name (defined at a module's top level, not in a notebook cell or a lambda): the
    processes are started fresh ("spawn"), as on every platform and in Jupyter. Each process uses one thread.
    A failure in any process raises here, with that process's traceback.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (the number of processes), got {world_size!r}")
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_entry, args=(fn, world_size, free_port(), backend, results, args), nprocs=world_size,
                       join=True, start_method="spawn")
    by_rank = dict(results.get() for _ in range(world_size))
    return [torch.load(io.BytesIO(by_rank[rank]), weights_only=False) for rank in range(world_size)]


def allreduce_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Replace every gradient by its mean over the group's processes (one all-reduce per parameter).

    Call it between ``loss.backward()`` and ``optimizer.step()``. With the batch split evenly and the loss a mean
    over each process's rows, the mean of the gradients is the whole batch's gradient, so every process takes the
    same step and the copies of the model stay equal.
    """
    world_size = dist.get_world_size(group)
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            p.grad.div_(world_size)


class BucketedAllReduce:
    """Average gradients over the group during ``backward``, in buckets of about ``bucket_bytes``.

    Autograd finishes the gradients of the last layers first. A hook on each parameter
    (``register_post_accumulate_grad_hook``) adds its gradient to the open bucket when it is final; a full bucket
    is flattened into one tensor and its all-reduce started at once (``async_op=True``), so communication overlaps
    the backward pass of the earlier layers. ``wait()`` (before ``optimizer.step()``) finishes the last bucket,
    waits for every all-reduce and writes the averaged gradients back. Buckets follow the order the gradients
    arrive in, the same on every process, so the processes' collectives match one to one.

    >>> # in each process, after dist.init_process_group:  sync = BucketedAllReduce(model)
    >>> # loss.backward(); sync.wait(); optimizer.step()
    """

    def __init__(self, model: nn.Module, bucket_bytes: int = 1 << 20, group: dist.ProcessGroup | None = None) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self.bucket_bytes, self.group = bucket_bytes, group
        self.world_size = dist.get_world_size(group)
        self._open: list[nn.Parameter] = []
        self._pending: list[tuple[list[nn.Parameter], Tensor, Any]] = []
        self.n_buckets = 0  # all-reduces started in the last backward pass
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in model.parameters()
                         if p.requires_grad]

    def _ready(self, p: nn.Parameter) -> None:
        self._open.append(p)
        if sum(q.grad.numel() * q.grad.element_size() for q in self._open) >= self.bucket_bytes:
            self._launch()

    def _launch(self) -> None:
        if not self._open:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in self._open])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._pending.append((self._open, flat, work))
        self._open = []
        self.n_buckets += 1

    def wait(self) -> None:
        """Finish the open bucket, wait for every all-reduce and put the averaged gradients back in place."""
        self._launch()
        for params, flat, work in self._pending:
            work.wait()
            flat.div_(self.world_size)
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        self._pending = []

    def reset_count(self) -> None:
        self.n_buckets = 0

    def remove(self) -> None:
        """Take the hooks off the model's parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
