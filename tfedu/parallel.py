"""Training across processes, by hand: a group of real processes, the collectives they talk with, and the four ways
of splitting training over them that notebooks/20_parallel_training.ipynb builds.

When a model outgrows one device, or one device is too slow, training runs as several processes that talk through
``torch.distributed``: collectives such as all-reduce (every process ends with the sum of everyone's tensor). This
module starts real processes on one machine with the gloo backend, so every learner can run them on a laptop CPU;
the same code runs unchanged with NCCL on GPUs (``backend="nccl"``, one process per GPU).

- ``spawn(fn, world_size, *args)``: run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined in one
  group; each rank's result comes back.
- ``Comm`` (over ``torch.distributed``) and ``simulate`` (threads in this process, for checks and small
  demonstrations): one interface for point-to-point messages and collectives, each counting the bytes it sends.
- **Data parallelism**: ``ring_all_reduce`` (reduce-scatter then all-gather around a ring, each rank sending
  2 (N - 1) / N of its tensor), ``allreduce_gradients`` after ``backward``, and ``BucketedAllReduce`` started during
  it, as DistributedDataParallel does (Li et al. 2020, "PyTorch Distributed", sec. 3.2).
- **ZeRO stage 1** (Rajbhandari et al. 2020): ``owned_range`` and ``ShardedAdamW``, each rank keeping the AdamW
  state of its slice of the parameters only.
- **FSDP** (ZeRO stage 3): ``shard_model`` applies torch's own ``fully_shard`` to the course GPT's blocks.
- **Tensor parallelism** (Shoeybi et al. 2019, Megatron-LM): ``parallel_mlp`` (the forward alone), ``ParallelMLP``
  and ``ParallelAttention``, column- then row-parallel, one all-reduce per sub-layer forward.
- **Mixed precision**: ``scaler_update`` and ``LossScaler``, the dynamic loss scale of float16 training (Micikevicius et al. 2018).
- ``CommCounter``: counts the collectives a block of code runs and the bytes handed to them.
"""

from __future__ import annotations

import abc
import datetime
import math
import os
import queue
import shutil
import tempfile
import threading
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from tfedu.layers import MLP, Attention, activate

# ----------------------------------------------------------------------------- a group of processes


def _check_world_size(world_size: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (the number of processes), got {world_size!r}")


def _entry(rank: int, fn: Callable, world_size: int, folder: str, backend: str, args: tuple, kwargs: dict) -> None:
    torch.set_num_threads(1)  # world_size processes share the machine's cores
    # A file in a fresh folder is the rendezvous: no port to find, no network needed (a sandbox may have none).
    dist.init_process_group(backend, init_method=f"file://{os.path.join(folder, 'rendezvous')}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    failed = False
    try:
        result = fn(rank, world_size, *args, **kwargs)
        torch.save(result, os.path.join(folder, f"rank{rank}.pt"))  # a file: any size, read after every rank ends
    except Exception:
        failed = True
        with open(os.path.join(folder, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
    if not failed:
        # A rank can see its last collective complete while a peer still receives its final piece; leaving the group
        # then closes the connection under the peer. So the ranks leave together (a failed rank does not wait: its
        # peers may be blocked in a collective it never joined, and its exit ends them).
        dist.barrier()
    dist.destroy_process_group()
    if failed:
        os._exit(1)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          start_method: str | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` new processes of one group; their results,
    by rank.

    Each process calls ``torch.distributed.init_process_group`` first (so ``fn`` can use the collectives) and uses
    one thread. The processes are forked where the platform can (Linux, Colab): then ``fn`` may be defined in a
    notebook cell. Elsewhere (``start_method="spawn"``, macOS and Windows) they start fresh and ``fn`` must be
    importable by name. If ``fn`` raises in a process, ``spawn`` raises a RuntimeError holding its traceback.

    >>> import torch.distributed as dist
    >>> def rank_plus_one(rank, world_size):
    ...     t = torch.tensor([rank + 1.0]); dist.all_reduce(t); return t.item()
    >>> spawn(rank_plus_one, 2)  # doctest: +SKIP
    [3.0, 3.0]
    """
    _check_world_size(world_size)
    if not callable(fn):
        raise TypeError(f"spawn runs a function fn(rank, world_size, *args); got {type(fn).__name__}")
    if start_method is None:
        start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    folder = tempfile.mkdtemp(prefix="tfedu-spawn-")
    try:
        try:
            with warnings.catch_warnings():
                # Python 3.12+ warns when a process with threads forks (a Jupyter kernel always has some); the child
                # runs only fn, which takes no lock those threads could hold
                warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks.*")
                mp.start_processes(_entry, args=(fn, world_size, folder, backend, args, kwargs), nprocs=world_size,
                                   join=True, start_method=start_method)
        except mp.ProcessExitedException as exited:
            # The first error written is the cause; a peer left waiting for the failed rank errs after it.
            errors = sorted((os.stat(os.path.join(folder, name)).st_mtime_ns, name) for name in os.listdir(folder)
                            if name.endswith(".error"))
            if not errors:
                raise RuntimeError(f"a process of {world_size} died without a Python error: {exited}") from None
            with open(os.path.join(folder, errors[0][1])) as f:
                raise RuntimeError(f"process {errors[0][1].removesuffix('.error').removeprefix('rank')} of "
                                   f"{world_size} raised:\n{f.read()}") from None
        return [torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=False) for rank in range(world_size)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ----------------------------------------------------------------------------- one interface, two transports


class Comm(abc.ABC):
    """This process's rank in its group, and the messages and collectives it takes part in, counted.

    The methods follow ``torch.distributed``'s names and argument order (``send(tensor, dst)``, ``recv(tensor,
    src)`` filling ``tensor``, ``all_reduce(tensor)`` summing in place, ``all_gather(output, input)`` and
    ``reduce_scatter(output, input)`` on whole tensors, ``broadcast(tensor, src)``). ``sent`` counts the bytes this
    rank handed to point-to-point sends; ``payload`` the bytes handed to each collective (the input of a
    reduce-scatter, the output of an all-gather, the tensor of an all-reduce), by its name; ``calls`` how many
    of each ran.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.sent = 0
        self.payload: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def _count(self, name: str, tensor: Tensor) -> None:
        self.calls[name] += 1
        self.payload[name] += tensor.numel() * tensor.element_size()

    def _check_peer(self, peer: Any, role: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"rank {self.rank}: {role} must be another rank, an int from 0 to {self.world_size - 1} "
                             f"other than {self.rank}; got {peer!r}")

    def _check_gather(self, name: str, whole: Tensor, part: Tensor) -> None:
        if whole.numel() != part.numel() * self.world_size:
            raise ValueError(f"{name}: the whole tensor holds {whole.numel()} numbers, the part {part.numel()}; the "
                             f"whole must hold world_size ({self.world_size}) parts")

    @abc.abstractmethod
    def send(self, tensor: Tensor, dst: int) -> None:
        """Hand a copy of ``tensor`` to rank ``dst``, without waiting for it to be received."""

    @abc.abstractmethod
    def recv(self, tensor: Tensor, src: int) -> Tensor:
        """Wait for the next message from rank ``src``, copy it into ``tensor`` and return it."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Wait until this rank's sends were delivered."""

    @abc.abstractmethod
    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over the ranks, in place; return it."""

    @abc.abstractmethod
    def all_gather(self, output: Tensor, input: Tensor) -> Tensor:
        """Fill ``output`` with every rank's ``input``, in rank order; return it."""

    @abc.abstractmethod
    def reduce_scatter(self, output: Tensor, input: Tensor) -> Tensor:
        """Fill ``output`` with this rank's piece of the sum over the ranks of ``input``; return it."""

    @abc.abstractmethod
    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        """Overwrite ``tensor`` with rank ``src``'s, in place; return it."""


# torch 2.13 renamed the whole-tensor gathers and scatters (the old names warn); older releases have the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ProcessComm(Comm):
    """``Comm`` over ``torch.distributed`` (inside :func:`spawn`, or any initialised group).

    ``send`` does not wait for the receiver (``isend``: in a ring every rank sends before it receives); its
    tensor is copied first, so the caller may change it at once. ``wait()`` waits for every send to be delivered.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        self._sends: list[tuple[Any, Tensor]] = []

    def send(self, tensor: Tensor, dst: int) -> None:
        self._check_peer(dst, "dst")
        copy = tensor.detach().contiguous().clone()
        self.sent += copy.numel() * copy.element_size()
        self._sends.append((dist.isend(copy, dst, group=self.group), copy))

    def recv(self, tensor: Tensor, src: int) -> Tensor:
        self._check_peer(src, "src")
        dist.recv(tensor, src, group=self.group)
        return tensor

    def wait(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    def all_reduce(self, tensor: Tensor) -> Tensor:
        self._count("all_reduce", tensor)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, output: Tensor, input: Tensor) -> Tensor:
        self._check_gather("all_gather", output, input)
        self._count("all_gather", output)
        _ALL_GATHER(output, input.contiguous(), group=self.group)
        return output

    def reduce_scatter(self, output: Tensor, input: Tensor) -> Tensor:
        self._check_gather("reduce_scatter", input, output)
        self._count("reduce_scatter", input)
        _REDUCE_SCATTER(output, input.contiguous(), group=self.group)
        return output

    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        self._count("broadcast", tensor)
        dist.broadcast(tensor, src, group=self.group)
        return tensor


class Deadlock(RuntimeError):
    """A simulated rank waited for a message that never came."""


class _Mailboxes:
    """What the threads of one :func:`simulate` share: a queue per (sender, receiver) and the collectives' meeting
    point."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size, self.timeout = world_size, timeout
        self.queues = {(s, d): queue.Queue() for s in range(world_size) for d in range(world_size) if s != d}
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list[Any] = [None] * world_size
        self.sends: list[tuple[int, int, int]] = []  # (sender, receiver, numbers) in the order sent
        self.lock = threading.Lock()


class ThreadComm(Comm):
    """``Comm`` between threads of one process (see :func:`simulate`): the same answers as :class:`ProcessComm`,
    deterministic, and every message recorded (``log.sends``)."""

    def __init__(self, rank: int, log: _Mailboxes) -> None:
        super().__init__(rank, log.world_size)
        self.log = log

    def send(self, tensor: Tensor, dst: int) -> None:
        self._check_peer(dst, "dst")
        if not isinstance(tensor, Tensor):
            raise TypeError(f"rank {self.rank}: send takes a tensor, got {type(tensor).__name__}")
        copy = tensor.detach().clone()
        self.sent += copy.numel() * copy.element_size()
        with self.log.lock:
            self.log.sends.append((self.rank, dst, copy.numel()))
        self.log.queues[(self.rank, dst)].put(copy)

    def recv(self, tensor: Tensor, src: int) -> Tensor:
        self._check_peer(src, "src")
        try:
            got = self.log.queues[(src, self.rank)].get(timeout=self.log.timeout)
        except queue.Empty:
            raise Deadlock(f"rank {self.rank} waited {self.log.timeout:g} s for a message from rank {src} that never "
                           "came") from None
        if got.shape != tensor.shape:
            raise ValueError(f"rank {self.rank} received {tuple(got.shape)} numbers from rank {src} into a tensor of "
                             f"shape {tuple(tensor.shape)}: sender and receiver must agree on the piece's size")
        tensor.copy_(got)
        return tensor

    def wait(self) -> None:
        pass

    def _exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank (all ranks must call it)."""
        try:
            self.log.barrier.wait()
            self.log.slots[self.rank] = value
            self.log.barrier.wait()
            values = list(self.log.slots)
            self.log.barrier.wait()
        except threading.BrokenBarrierError:
            raise Deadlock(f"rank {self.rank} waited {self.log.timeout:g} s in a collective that another rank never "
                           "joined") from None
        return values

    def all_reduce(self, tensor: Tensor) -> Tensor:
        self._count("all_reduce", tensor)
        values = self._exchange(tensor.detach().clone())
        tensor.copy_(torch.stack(values).sum(0))
        return tensor

    def all_gather(self, output: Tensor, input: Tensor) -> Tensor:
        self._check_gather("all_gather", output, input)
        self._count("all_gather", output)
        output.copy_(torch.cat([v.reshape(-1) for v in self._exchange(input.detach().clone())]).view_as(output))
        return output

    def reduce_scatter(self, output: Tensor, input: Tensor) -> Tensor:
        self._check_gather("reduce_scatter", input, output)
        self._count("reduce_scatter", input)
        whole = torch.stack([v.reshape(-1) for v in self._exchange(input.detach().clone())]).sum(0)
        output.copy_(whole.chunk(self.world_size)[self.rank].view_as(output))
        return output

    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        self._count("broadcast", tensor)
        tensor.copy_(self._exchange(tensor.detach().clone())[src])
        return tensor


def simulate(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 10.0) -> tuple[list[Any], list[ThreadComm]]:
    """Run ``fn(*args, comm)`` as ``world_size`` ranks in threads of this process, each with its ``ThreadComm``
    (last, as torch's collectives take their group last).

    Returns the ranks' results and their comms (bytes sent, collectives called; ``comms[0].log.sends`` lists every
    message). An argument that is a list of ``world_size`` items marked with :func:`per_rank` gives each rank its
    own item. A rank that raises makes ``simulate`` raise the same error, with its rank in front; a rank that
    waits ``timeout`` seconds for a message raises :class:`Deadlock`. For checks and small demonstrations: no
    processes, nothing to launch, the same answers as :func:`spawn` with :class:`ProcessComm`.
    """
    _check_world_size(world_size)
    log = _Mailboxes(world_size, timeout)
    comms = [ThreadComm(rank, log) for rank in range(world_size)]
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run(rank: int) -> None:
        try:
            mine = [a.items[rank] if isinstance(a, PerRank) else a for a in args]
            results[rank] = fn(*mine, comms[rank])
        except BaseException as err:  # reported below, with the rank
            errors[rank] = err
            log.barrier.abort()  # ranks waiting in a collective for this one stop at once

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, Deadlock)), None) \
        or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results, comms


class PerRank:
    """Arguments of :func:`simulate` that differ by rank (see :func:`per_rank`)."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)


def per_rank(items: Sequence[Any]) -> PerRank:
    """Mark a list for :func:`simulate`: rank r gets ``items[r]``."""
    return PerRank(items)


# ----------------------------------------------------------------------------- data parallelism


def ring_all_reduce(x: Tensor, comm: Comm) -> Tensor:
    """The sum over the ranks of ``x`` (a 1-D tensor of the same size on every rank), found around a ring.

    ``x`` is cut into ``world_size`` chunks (the last ones a number shorter when the size does not divide).
    Reduce-scatter: for N - 1 steps, rank r sends chunk (r - s) mod N to rank r + 1 and adds the chunk arriving
    from rank r - 1 to its own copy; after them rank r holds the full sum of chunk (r + 1) mod N. All-gather: for
    N - 1 more steps each rank passes the finished chunk it last received on, around the same ring. Every rank
    sends 2 (N - 1) chunks, 2 (N - 1) / N of the tensor, whatever N is: the ring's cost per rank hardly grows with
    the number of ranks (Patarasuk & Yuan 2009). Returns a new tensor; ``x`` is left as it was.
    """
    n, r = comm.world_size, comm.rank
    chunks = [c.clone() for c in x.tensor_split(n)]
    nxt, prev = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):  # reduce-scatter
        send, recv = (r - s) % n, (r - s - 1) % n
        comm.send(chunks[send], nxt)
        incoming = torch.empty_like(chunks[recv])
        chunks[recv] += comm.recv(incoming, prev)
    for s in range(n - 1):  # all-gather
        send, recv = (r + 1 - s) % n, (r - s) % n
        comm.send(chunks[send], nxt)
        comm.recv(chunks[recv], prev)
    comm.wait()
    return torch.cat(chunks)


def allreduce_gradients(params: Iterable[nn.Parameter], all_reduce: Callable[[Tensor], Any] | None = None,
                        world_size: int | None = None) -> None:
    """Replace every gradient by its mean over the group's processes (one all-reduce of all of them, flattened).

    Call it between ``loss.backward()`` and ``optimizer.step()``. With the batch split evenly and the loss a mean
    over each process's rows, the mean of the gradients is the whole batch's gradient, so every process takes the
    same step and the copies of the model stay equal. ``all_reduce`` (a function summing a flat tensor over the
    group in place, or returning the sum) defaults to ``torch.distributed.all_reduce``; pass another one, such as
    a ring, with the ``world_size`` it runs over.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    if all_reduce is None:
        all_reduce, world_size = dist.all_reduce, dist.get_world_size()
    elif world_size is None:
        raise ValueError("allreduce_gradients: pass world_size with your own all_reduce")
    flat = torch.cat([g.reshape(-1) for g in grads])
    summed = all_reduce(flat)
    summed = flat if summed is None else summed
    torch._foreach_copy_(grads, [s.view_as(g) for s, g in zip(summed.div(world_size).split([g.numel() for g in grads]),
                                                               grads)])


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
        self.n_buckets = 0  # all-reduces started since this object was made
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

    def remove(self) -> None:
        """Take the hooks off the model's parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


# ----------------------------------------------------------------------------- ZeRO stage 1


def owned_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The slice ``[start, stop)`` of a flat tensor of ``numel`` numbers that ``rank`` owns.

    The tensor is padded to ``world_size * ceil(numel / world_size)`` numbers and cut into equal shards (equal
    pieces are what reduce-scatter and all-gather exchange); ``stop`` is clipped to ``numel``, so the last ranks
    may own fewer real numbers, or none.
    """
    shard = math.ceil(numel / world_size)
    return min(rank * shard, numel), min((rank + 1) * shard, numel)


class ShardedAdamW:
    """AdamW whose state is split over the ranks (ZeRO stage 1): the same steps as AdamW on every rank, 1/N of
    its memory.

    The parameters are viewed as one flat vector, padded to a multiple of ``world_size``. A step reduce-scatters
    the flat gradient (rank r receives the sum of its shard only), divides by ``world_size``, runs AdamW on its
    shard (a copy in the parameters' dtype with its own ``exp_avg`` and ``exp_avg_sq``: 2 numbers per owned parameter instead of 2
    per parameter), and all-gathers the updated shards into every rank's parameters. Together reduce-scatter and
    all-gather move what one all-reduce moves: ZeRO-1 costs no more communication than data parallelism.
    ``comm`` is a :class:`Comm`; ``options`` go to ``torch.optim.AdamW``.
    """

    def __init__(self, params: Iterable[nn.Parameter], comm: Comm, **options: Any) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ShardedAdamW got no parameters that require grad")
        self.comm = comm
        self.numel = sum(p.numel() for p in self.params)
        self.padded = comm.world_size * math.ceil(self.numel / comm.world_size)
        start, stop = owned_range(self.numel, comm.rank, comm.world_size)
        self.start, self.stop = start, stop
        flat = self._flat([p.detach() for p in self.params])
        self.shard = nn.Parameter(flat[comm.rank * self.shard_size:(comm.rank + 1) * self.shard_size].clone())
        self.optimizer = torch.optim.AdamW([self.shard], **options)

    @property
    def shard_size(self) -> int:
        return self.padded // self.comm.world_size

    def _flat(self, tensors: Sequence[Tensor]) -> Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.cat([flat, flat.new_zeros(self.padded - self.numel)])

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        mine = self.shard.new_empty(self.shard_size)
        self.comm.reduce_scatter(mine, self._flat(grads))
        self.shard.grad = mine.div_(self.comm.world_size)
        self.optimizer.step()
        whole = self.shard.new_empty(self.padded)
        self.comm.all_gather(whole, self.shard.detach())
        torch._foreach_copy_(self.params, [w.view_as(p) for w, p in zip(whole[:self.numel].split(
            [p.numel() for p in self.params]), self.params)])


# ----------------------------------------------------------------------------- FSDP (ZeRO stage 3), torch's own


def shard_model(model: nn.Module, mesh: Any = None) -> nn.Module:
    """Shard ``model`` with torch's ``fully_shard`` (FSDP2): each of its blocks, then the whole.

    Every rank keeps 1/N of each parameter. Before a block's forward (and again before its backward) its
    parameters are all-gathered, used and freed; after its backward the gradients are reduce-scattered, so each
    rank keeps the gradient of its shard, and the optimizer (any torch optimizer, built after this call) steps
    the shards. Per step: two all-gathers and one reduce-scatter of the parameters, 1.5 times data parallelism's
    traffic, for memory that falls as 1/N (Zhao et al. 2023, "PyTorch FSDP"). Blocks are the modules in
    ``model.blocks`` when it has them, else its direct children with parameters.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = init_device_mesh("cuda" if dist.get_backend() == "nccl" else "cpu", (dist.get_world_size(),))
    blocks = list(model.blocks) if hasattr(model, "blocks") else [m for m in model.children()
                                                                   if any(True for _ in m.parameters())]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    # torch keeps the root's parameters (embeddings, the last norm, the unembedding) gathered from forward to
    # backward unless told; resharding them too makes every parameter follow the pattern above
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


# ----------------------------------------------------------------------------- tensor parallelism


class _CopyToRanks(torch.autograd.Function):
    """Megatron's f: the identity forward; backward sums the gradient over the ranks (each rank's piece of the
    layer used the same input)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.comm.all_reduce(grad.contiguous().clone()), None


class _SumOverRanks(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over the ranks; backward passes the gradient on unchanged
    (every rank's partial output entered the sum once)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        return comm.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _split(n: int, world_size: int, what: str) -> int:
    if n % world_size:
        raise ValueError(f"tensor parallelism splits the {what} ({n}) evenly over {world_size} ranks: it must divide")
    return n // world_size


def _linear_piece(full: nn.Linear, rows: slice | None = None, cols: slice | None = None, bias: bool = True) -> nn.Linear:
    weight = full.weight.detach()[rows or slice(None), cols or slice(None)]
    piece = nn.Linear(weight.shape[1], weight.shape[0], bias=bias and full.bias is not None,
                      device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        piece.weight.copy_(weight)
        if piece.bias is not None:
            piece.bias.copy_(full.bias.detach()[rows or slice(None)])
    return piece


def parallel_mlp(x: Tensor, W_in: Tensor, b_in: Tensor, W_out: Tensor, b_out: Tensor, comm: Comm) -> Tensor:
    """This rank's share of a GELU MLP, ``W_out gelu(W_in x + b_in) + b_out``, summed over the ranks: the output.

    The weights are whole (nn.Linear's layout: ``W_in`` (d_mlp, d_model), ``W_out`` (d_model, d_mlp)); rank r
    uses rows r d_mlp/N .. (r+1) d_mlp/N of ``W_in`` and ``b_in`` (column-parallel: its hidden features, each
    computed from the whole input) and the same columns of ``W_out`` (row-parallel: a partial output from its
    features only). One all-reduce sums the partial outputs; ``b_out`` is added once, after it. The forward of
    :class:`ParallelMLP` without autograd's part, for notebook 20's exercise.
    """
    width = _split(W_in.shape[0], comm.world_size, "MLP's hidden width")
    mine = slice(comm.rank * width, (comm.rank + 1) * width)
    hidden = torch.nn.functional.gelu(x @ W_in[mine].T + b_in[mine])
    return comm.all_reduce(hidden @ W_out[:, mine].T) + b_out


class ParallelMLP(nn.Module):
    """This rank's piece of an :class:`tfedu.layers.MLP`: ``W_in`` (and ``W_gate``) split by output features
    (column-parallel), ``W_out`` by input features (row-parallel).

    Each rank computes its d_mlp / N hidden features from the whole input, which the activation needs no other
    rank for; ``W_out``'s slice turns them into a partial output, and one all-reduce sums the partial outputs.
    ``W_out``'s bias is added once, after the sum. Backward: one all-reduce of the input's gradient.
    """

    def __init__(self, mlp: MLP, comm: Comm) -> None:
        super().__init__()
        width = _split(mlp.d_mlp, comm.world_size, "MLP's hidden width")
        mine = slice(comm.rank * width, (comm.rank + 1) * width)
        self.comm, self.activation = comm, mlp.activation
        self.W_in = _linear_piece(mlp.W_in, rows=mine)
        if "W_gate" in mlp._modules:
            self.W_gate = _linear_piece(mlp.W_gate, rows=mine)
        self.W_out = _linear_piece(mlp.W_out, cols=mine, bias=False)
        self.out_bias = None if mlp.W_out.bias is None else nn.Parameter(mlp.W_out.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        x = _CopyToRanks.apply(x, self.comm)
        gate = self.W_gate(x) if "W_gate" in self._modules else None
        out = _SumOverRanks.apply(self.W_out(activate(self.W_in(x), self.activation, gate)), self.comm)
        return out if self.out_bias is None else out + self.out_bias


class ParallelAttention(nn.Module):
    """This rank's heads of an :class:`tfedu.layers.Attention`: ``W_Q``, ``W_K``, ``W_V`` split by heads
    (column-parallel), ``W_O`` by the heads' input columns (row-parallel), one all-reduce of the partial outputs.

    The heads never look at each other before ``W_O``, so each rank runs ordinary attention on n_heads / N heads.
    ``W_O``'s bias is added once, after the sum. (Grouped heads: the key-value heads are split too, so N must
    divide ``n_kv_heads``.)
    """

    def __init__(self, attn: Attention, comm: Comm) -> None:
        super().__init__()
        heads = _split(attn.n_heads, comm.world_size, "number of heads")
        kv_heads = _split(attn.n_kv_heads, comm.world_size, "number of key-value heads")
        d = attn.d_head
        q, kv = slice(comm.rank * heads * d, (comm.rank + 1) * heads * d), \
            slice(comm.rank * kv_heads * d, (comm.rank + 1) * kv_heads * d)
        self.comm = comm
        self.local = Attention(attn.d_model, heads, n_kv_heads=kv_heads, d_head=d, bias=attn.W_Q.bias is not None,
                               rope_base=attn.rope_base, rope_layout=attn.rope_layout, impl=attn.impl,
                               scale=attn.scale if attn.scale is not None else d ** -0.5)
        self.local.to(attn.W_Q.weight.dtype)
        self.local.W_Q = _linear_piece(attn.W_Q, rows=q)
        self.local.W_K = _linear_piece(attn.W_K, rows=kv)
        self.local.W_V = _linear_piece(attn.W_V, rows=kv)
        self.local.W_O = _linear_piece(attn.W_O, cols=q, bias=False)
        self.out_bias = None if attn.W_O.bias is None else nn.Parameter(attn.W_O.bias.detach().clone())

    def forward(self, x: Tensor, **kwargs: Any) -> Tensor:
        out = _SumOverRanks.apply(self.local(_CopyToRanks.apply(x, self.comm), **kwargs), self.comm)
        return out if self.out_bias is None else out + self.out_bias


# ----------------------------------------------------------------------------- mixed precision


def scaler_update(grads: Sequence[Tensor], scale: float, good_steps: int, growth_interval: int, *,
                  growth: float = 2.0, backoff: float = 0.5) -> tuple[bool, float, int]:
    """One update of a dynamic loss scale: ``(step_ok, new_scale, new_good_steps)``.

    Divides every gradient in ``grads`` by ``scale`` in place (they were computed from the loss times ``scale``).
    If any holds inf or NaN the scale was too large: the step is not taken, the scale is multiplied by
    ``backoff`` and the count of clean steps starts again. Otherwise the step is taken and the count grows; when
    it reaches ``growth_interval`` the scale is multiplied by ``growth`` and the count starts again (torch's
    ``GradScaler``: its ``unscale_``, ``step`` and ``update`` together).
    """
    for g in grads:
        g.div_(scale)
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        return False, scale * backoff, 0
    good_steps += 1
    if good_steps == growth_interval:
        return True, scale * growth, 0
    return True, scale, good_steps


class LossScaler:
    """The dynamic loss scale of float16 training (Micikevicius et al. 2018; torch's ``GradScaler``).

    float16's smallest normal number is 6e-5, and small gradients vanish below it. Multiplying the loss by
    ``scale`` before backward multiplies every gradient by it too; ``unscale_and_update`` divides them back (in
    float32 master weights) and says whether the step may be taken. A gradient that overflowed (inf or NaN)
    means the scale is too large: the step is skipped and the scale multiplied by ``backoff``. After
    ``growth_interval`` clean steps in a row the scale is multiplied by ``growth``, probing upwards again.
    ``rule`` replaces :func:`scaler_update` (notebook 20 plugs in the learner's).
    """

    def __init__(self, scale: float = 2.0 ** 16, growth: float = 2.0, backoff: float = 0.5,
                 growth_interval: int = 2000, rule: Callable[..., tuple[bool, float, int]] | None = None) -> None:
        if not scale > 0 or not growth > 1 or not 0 < backoff < 1:
            raise ValueError(f"need scale > 0, growth > 1 and 0 < backoff < 1; got {scale}, {growth}, {backoff}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.scale, self.growth, self.backoff, self.growth_interval = float(scale), growth, backoff, growth_interval
        self.good_steps = 0
        self.rule = scaler_update if rule is None else rule

    def unscale_and_update(self, grads: Iterable[Tensor | None]) -> bool:
        """Divide ``grads`` by the scale in place; update the scale; True when the step may be taken."""
        ok, self.scale, self.good_steps = self.rule([g for g in grads if g is not None], self.scale,
                                                    self.good_steps, self.growth_interval, growth=self.growth,
                                                    backoff=self.backoff)
        return bool(ok)


# ----------------------------------------------------------------------------- counting communication

_COLLECTIVES = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather", "allgather_": "all_gather",
                "allgather_into_tensor_coalesced_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
                "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
                "broadcast_": "broadcast", "send": "send", "recv_": "recv", "allreduce_coalesced_": "all_reduce"}


def _tensors_in(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


class CommCounter(TorchDispatchMode):
    """Count the collectives that code inside ``with CommCounter() as c:`` runs through ``torch.distributed``, and
    the bytes handed to each: ``c.calls["all_gather"]``, ``c.payload["reduce_scatter"]``.

    The payload of an all-reduce is its tensor, of an all-gather its output (the whole), of a reduce-scatter its
    input (the whole): the sizes the formulas use. It sees what goes through torch's dispatcher (the ``c10d``
    ops: ``torch.distributed``'s functions, FSDP's collectives); DistributedDataParallel's own all-reduces start in
    C++ and are counted with a communication hook instead (see notebooks/20).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.payload: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        namespace, _, op = func._schema.name.partition("::")
        name = _COLLECTIVES.get(op) if namespace == "c10d" else None
        if name is not None:  # (outputs, inputs, ...) for the gathers and scatters; (tensors, ...) for the rest
            tensors = _tensors_in(args[1] if name == "reduce_scatter" else args[0])
            self.calls[name] += 1
            self.payload[name] += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **kwargs)


def ring_traffic(kind: str, payload_bytes: float, world_size: int) -> float:
    """Bytes each rank sends when a ring runs the collective ``kind`` on ``payload_bytes`` (the whole tensor):
    all-reduce 2 (N - 1) / N of it, reduce-scatter and all-gather (N - 1) / N, broadcast (pipelined) about 1."""
    factor = {"all_reduce": 2 * (world_size - 1) / world_size, "all_gather": (world_size - 1) / world_size,
              "reduce_scatter": (world_size - 1) / world_size, "broadcast": 1.0 if world_size > 1 else 0.0}
    if kind not in factor:
        raise ValueError(f"kind must be one of {', '.join(map(repr, factor))}, got {kind!r}")
    return factor[kind] * payload_bytes
