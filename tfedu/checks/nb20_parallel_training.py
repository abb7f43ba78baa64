"""Checkers for notebooks/20_parallel_training.ipynb: the ring all-reduce, a sharded optimizer (ZeRO stage 1), the
column- then row-parallel MLP and the loss scaler's update.

Every check runs the learner's SPMD code as several ranks **in threads of one process**, each with a small comm of
its own (``COMM_RUN``: ``rank``, ``world_size``, ``send``/``recv``/``wait`` and the collectives ``all_reduce``,
``all_gather``, ``reduce_scatter``, ``broadcast``, in ``tfedu.parallel.Comm``'s names and argument order), which
records every message and collective; no process is started (the grader's tripwire forbids that during a hidden
test). A rank that waits too long for a message stops with a named deadlock.

Exercise 20.1, ``ring_all_reduce(x, comm) -> Tensor``: the sum over the ranks of x (1-D, the same size on every rank)
found around a ring, as :func:`tfedu.parallel.ring_all_reduce`: x cut into world_size chunks (``tensor_split``), N - 1
steps of reduce-scatter, N - 1 of all-gather; a new tensor, x unchanged. The comm here has only rank, world_size, send,
recv and wait (a collective is refused by name). Cases: N from 1 to 5, sizes that divide and do not, sizes below N
(empty chunks), float32 and float64, magnitudes of 1e4. Invariants checked and named: the sum on every rank; x not
changed; sends only to the next rank and receives only from the one before; 2 (N - 1) n numbers sent in all (n the size
of x); nothing sent when N = 1. Named: only the reduce-scatter (right in one chunk only, or only that chunk returned),
the all-gather's chunk index off by one, N steps where the ring needs N - 1 (with the usual indices the sum stays right:
named by its traffic, and by the message to itself with one rank), the mean for the sum, whole tensors sent (round the
ring or to every rank: the cost and the formula), receiving before sending on every rank (a deadlock), sends and
receives that do not pair up (a deadlock on some ranks), pieces that disagree between ranks (a chunk layout that depends
on the rank), a collective called, x changed in place, x itself returned, something other than a tensor, another dtype.
See :func:`check_ring_all_reduce`.

Exercise 20.2, ``class ShardedAdamW(params, comm, **options)`` with ``step()`` and ``optimizer`` (a
``torch.optim.AdamW`` over this rank's shard only), as :class:`tfedu.parallel.ShardedAdamW`: the parameters flattened in
order, padded with zeros to world_size * ceil(numel / world_size), rank r owning the r-th equal piece; a step
reduce-scatters the flat gradient, divides by world_size, steps AdamW on the shard and all-gathers the shards into every
parameter. Run for three training steps of a small model (three parameters, counts that N does not divide, float64,
weight decay on, an eps of 0.2 to 0.5 so that a sum for the mean shows) on each rank's own rows, against
``torch.optim.AdamW`` on all the rows at once, for N = 1 to 4. Invariants: the same parameters on every rank, equal to
AdamW's; optimizer state of two numbers per owned parameter; one reduce-scatter and one all-gather of the padded vector
per step and nothing more. Named: the sum of the gradients for their mean, no all-gather or only the own slice written
back (ranks disagree), shards that ignore the padding, AdamW over every parameter (state), the optimizer rebuilt every
step (Adam's moments lost), an extra all-reduce or an all-reduce for the reduce-scatter (traffic). See
:func:`check_sharded_adamw`.

Exercise 20.3, ``parallel_mlp(x, W_in, b_in, W_out, b_out, comm) -> Tensor``: a GELU MLP split over the ranks, as
:func:`tfedu.parallel.parallel_mlp`: weights whole in nn.Linear's layout, rank r using rows r d_mlp / N to (r + 1)
d_mlp / N of W_in and b_in and the same columns of W_out, one all-reduce of the partial outputs, b_out added after
it. d_model differs from d_mlp / N; x has one or two leading dimensions; a case where every rank's copy of the
weights holds NaN outside its own slice shows whether a rank reads more than its slice; d_mlp not divisible by N must
raise (or give the exact output). Named: b_out added before the all-reduce (N times), the activation applied to a
partial sum (after the all-reduce, or W_in split by its input features), W_out split by rows (the product's shapes),
b_in not sliced with W_in (the whole, or the first slice on every rank), the tanh GELU, no all-reduce, the whole MLP on
every rank with no communication (no collective, or NaN from another rank's slice), weights read outside the rank's
slice, more traffic than one all-reduce of the output (the hidden features gathered, a second collective), a wrong
output where N does not divide d_mlp. See :func:`check_parallel_mlp`.

Exercise 20.4, ``scaler_update(grads, scale, good_steps, growth_interval, *, growth=2.0, backoff=0.5) -> (step_ok,
new_scale, new_good_steps)``: one update of the dynamic loss scale, as :func:`tfedu.parallel.scaler_update` and
torch's ``GradScaler``: every gradient divided by scale in place; inf or NaN anywhere skips the step, multiplies the
scale by backoff and resets the count; otherwise the count grows and at growth_interval the scale is multiplied by
growth and the count reset. Judged step by step over streams with +inf, -inf and NaN in different tensors, float16
and float32 gradients, and an overflow on the step that would have grown the scale. Named: NaN missed (only inf
tested), only the first tensor tested, the count not reset on an overflow, growth one step late or early, the count
not reset after growth, the gradients multiplied or not divided in place, the step taken on an overflow, growth on an
overflow step. See :func:`check_scaler_update`.

``tfedu.parallel`` (the references), torch.distributed's collectives and torch's ``GradScaler`` are refused.

Each check runs one source (the ``*_RUN`` constants) that the hidden test also runs in the learner's kernel on fresh
inputs, and judges the results with the same function, so the check and the hidden test name the same slips.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import numpy as np
import torch

from tfedu.checks.building_blocks import ACTIVATIONS, ELEMENTARY, MODULES
from tfedu.checks.core import (NOT_DONE_MESSAGE, CheckFailure, ExerciseNotDone, Hints, Probe, checker,
                               globals_from_modules)
from tfedu.parallel import ShardedAdamW, parallel_mlp, ring_all_reduce, scaler_update

# What the answers may not use: the references, torch.distributed's collectives (by name: the module itself is
# torch's), torch's loss scaler and its fused ops.
DIST_COLLECTIVES = tuple(f"torch.distributed.{name}" for name in (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "send", "recv", "isend", "irecv", "all_to_all",
    "all_reduce_coalesced"))
FORBIDDEN = ("tfedu.parallel", *DIST_COLLECTIVES, "torch.amp.grad_scaler", "torch.amp.GradScaler",
             "torch.cuda.amp.GradScaler", "torch._amp_update_scale_", "torch._amp_foreach_non_finite_check_and_unscale_")
# The check's own scan of the answer's globals, by the module an object comes from.
REFUSED_MODULES = ("tfedu.parallel", "torch.distributed", "torch.distributed.distributed_c10d", "torch.amp.grad_scaler")
TIMEOUT = 1.5  # seconds a simulated rank waits for a message before it is a deadlock

HINT_SHORTCUT = ("your {function} uses {names} from tfedu.parallel, torch.distributed or torch.amp: {what} is the "
                 "exercise, so build it from the comm's messages and tensor operations")
HINT_NOT_CALLABLE = "expected {kind} for {function}, got {got}"
HINT_NOT_RUN = "{function}'s hidden test did not run every case"


def _functions_of(fn: Any) -> list[Any]:
    """A function, or a class's functions (its methods, static and class methods, properties' getters)."""
    if not inspect.isclass(fn):
        return [fn]
    found = []
    for klass in fn.__mro__:
        if klass is object or klass.__module__ == "builtins":
            continue
        for value in vars(klass).values():
            value = getattr(value, "__func__", value)
            value = getattr(value, "fget", value)
            if inspect.isfunction(value):
                found.append(value)
    return found


def _refuse(fn: Any, function: str, what: str, kind: str = "a function") -> None:
    if not callable(fn):
        raise CheckFailure(HINT_NOT_CALLABLE.format(kind=kind, function=function, got=type(fn).__name__))
    if inspect.isclass(fn):
        bases = [k.__name__ for k in fn.__mro__ if k.__module__ in REFUSED_MODULES]
        if bases:
            raise CheckFailure(HINT_SHORTCUT.format(function=function, names=bases[0], what=what))
    names = sorted({n for f in _functions_of(fn) for n in globals_from_modules(f, REFUSED_MODULES)})
    if names:
        raise CheckFailure(HINT_SHORTCUT.format(function=function, names=", ".join(names), what=what))


def _run(source: str, name: str, fn: Any, inputs: dict) -> dict:
    """The check's run of ``source`` with ``fn`` bound to ``name``, as the probe runs it in the kernel."""
    scope = {name: fn, "inputs": inputs, "np": np, "torch": torch}
    exec(compile(source, f"<{name}'s run>", "exec"), scope)
    return scope["outputs"]


def _hidden(i: int, what: str) -> str:
    return f"hidden test {i + 1} ({what})"


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Equal shapes and values (NaN where NaN), the absolute tolerance times the larger of 1 and want's largest."""
    if got.shape != want.shape:
        return False
    got, want = got.double(), want.double()
    finite = want[torch.isfinite(want)]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    return bool(torch.allclose(got, want, rtol=rtol, atol=atol * scale, equal_nan=True))


def _all_close(got: list | None, want: list | None, **tol: float) -> bool:
    return got is not None and want is not None and len(got) == len(want) and all(
        g is not None and w is not None and _close(g, w, **tol) for g, w in zip(got, want))


def _as_tensors(arrays: list | None) -> list | None:
    if arrays is None:
        return None
    return [None if isinstance(a, str) or a is None else torch.from_numpy(np.array(a, dtype=np.float64)) for a in arrays]


# ----------------------------------------------------------------------------- the ranks, as threads

# Run in the learner's kernel by the probes, and here by the checks, before each exercise's own run: a comm per rank
# over queues and a barrier, recording every message (sender, receiver, numbers) and every collective (name,
# numbers), and ``_nb20_spmd``, which runs ``build(rank, comm)`` for every rank in a thread and joins them.
COMM_RUN = """\
import queue as _nb20_queue
import threading as _nb20_threading
import time as _nb20_time


class _Nb20Stop(Exception):
    def __init__(self, kind, text):
        super().__init__(text)
        self.kind = kind


class _Nb20Group:
    def __init__(self, n, timeout):
        self.n, self.timeout = n, timeout
        self.queues = {(s, d): _nb20_queue.Queue() for s in range(n) for d in range(n) if s != d}
        self.barrier = _nb20_threading.Barrier(n, timeout=4 * timeout)  # ranks compute between collectives
        self.slots = [None] * n
        self.sends = []
        self.calls = [[] for _ in range(n)]
        self.lock = _nb20_threading.Lock()
        self.failed = _nb20_threading.Event()


class _Nb20Comm:
    def __init__(self, rank, group, collectives):
        self.rank, self.world_size = rank, group.n
        self._group, self._collectives = group, collectives

    def _peer(self, peer, role):
        if peer is self.rank or (type(peer) is int and peer == self.rank):
            raise _Nb20Stop('self', 'rank %d: %s is the rank itself' % (self.rank, role))
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size or peer == self.rank:
            raise _Nb20Stop('peer', 'rank %d: %s must be another rank, an int from 0 to %d other than %d; got %r'
                            % (self.rank, role, self.world_size - 1, self.rank, peer))

    def send(self, tensor, dst):
        self._peer(dst, 'dst')
        if not isinstance(tensor, torch.Tensor):
            raise _Nb20Stop('send', 'rank %d: send takes a tensor, got %s' % (self.rank, type(tensor).__name__))
        copy = tensor.detach().clone()
        with self._group.lock:
            self._group.sends.append([self.rank, dst, int(copy.numel())])
        self._group.queues[(self.rank, dst)].put(copy)

    def recv(self, tensor, src):
        self._peer(src, 'src')
        if not isinstance(tensor, torch.Tensor):
            raise _Nb20Stop('send', 'rank %d: recv fills a tensor, got %s' % (self.rank, type(tensor).__name__))
        deadline = _nb20_time.monotonic() + self._group.timeout
        while True:
            try:
                got = self._group.queues[(src, self.rank)].get(timeout=0.02)
                break
            except _nb20_queue.Empty:
                if self._group.failed.is_set():
                    raise _Nb20Stop('aborted', 'another rank stopped') from None
                if _nb20_time.monotonic() > deadline:
                    raise _Nb20Stop('deadlock', 'rank %d waited %g s for a message from rank %d that never came'
                                    % (self.rank, self._group.timeout, src)) from None
        if tuple(got.shape) != tuple(tensor.shape):
            raise _Nb20Stop('mismatch', 'rank %d received %d numbers from rank %d into a piece of %d'
                            % (self.rank, got.numel(), src, tensor.numel()))
        tensor.copy_(got)
        return tensor

    def wait(self):
        return None

    def _collective(self, name, tensor):
        if name not in self._collectives:
            raise _Nb20Stop('refused', name)
        if not isinstance(tensor, torch.Tensor):
            raise _Nb20Stop('send', 'rank %d: %s takes tensors, got %s' % (self.rank, name, type(tensor).__name__))
        self._group.calls[self.rank].append([name, int(tensor.numel())])

    def _exchange(self, value):
        group = self._group
        try:
            group.barrier.wait()
            group.slots[self.rank] = value
            group.barrier.wait()
            values = list(group.slots)
            group.barrier.wait()
        except _nb20_threading.BrokenBarrierError:
            if group.failed.is_set():
                raise _Nb20Stop('aborted', 'another rank stopped') from None
            raise _Nb20Stop('deadlock', 'rank %d waited %g s in a collective that another rank never joined'
                            % (self.rank, 4 * group.timeout)) from None
        return values

    def _parts(self, name, whole, part):
        self._collective(name, whole)
        if not isinstance(part, torch.Tensor):
            raise _Nb20Stop('send', 'rank %d: %s takes tensors, got %s' % (self.rank, name, type(part).__name__))
        if whole.numel() != part.numel() * self.world_size:
            raise _Nb20Stop('sizes', '%s on rank %d: the whole tensor holds %d numbers and the piece %d, where the '
                            'whole must hold world_size (%d) pieces' % (name, self.rank, whole.numel(), part.numel(),
                                                                        self.world_size))

    def all_reduce(self, tensor):
        self._collective('all_reduce', tensor)
        values = self._exchange(tensor.detach().clone())
        if any(v.shape != tensor.shape for v in values):
            raise _Nb20Stop('sizes', 'all_reduce on rank %d: the ranks passed tensors of different shapes' % self.rank)
        tensor.copy_(torch.stack(values).sum(0))
        return tensor

    def all_gather(self, output, input):
        self._parts('all_gather', output, input)
        values = self._exchange(input.detach().clone())
        output.copy_(torch.cat([v.reshape(-1) for v in values]).view_as(output))
        return output

    def reduce_scatter(self, output, input):
        self._parts('reduce_scatter', input, output)
        values = self._exchange(input.detach().clone())
        whole = torch.stack([v.reshape(-1) for v in values]).sum(0)
        output.copy_(whole.chunk(self.world_size)[self.rank].view_as(output))
        return output

    def broadcast(self, tensor, src):
        self._collective('broadcast', tensor)
        tensor.copy_(self._exchange(tensor.detach().clone())[src])
        return tensor


def _nb20_spmd(build, n, timeout, collectives):
    group = _Nb20Group(n, timeout)
    results, errors = [None] * n, [None] * n

    def run(rank):
        try:
            results[rank] = build(rank, _Nb20Comm(rank, group, collectives))
        except _Nb20Stop as err:
            errors[rank] = [err.kind, str(err)[:300]]
        except NotImplementedError:
            errors[rank] = ['not done', '']
        except Exception as err:
            errors[rank] = ['raised', (type(err).__name__ + ': ' + str(err))[:300]]
        if errors[rank] is not None and errors[rank][0] != 'deadlock':
            group.failed.set()
            group.barrier.abort()

    threads = [_nb20_threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(8 * timeout + 10)
    for rank, thread in enumerate(threads):
        if thread.is_alive():
            errors[rank] = ['hung', 'rank %d had not finished after %g s' % (rank, 8 * timeout + 10)]
    return results, errors, group


def _nb20_describe(value):
    if isinstance(value, torch.Tensor):
        return 'a tensor of shape ' + str(tuple(value.shape)) + ' and dtype ' + str(value.dtype).replace('torch.', '')
    if isinstance(value, (tuple, list)):
        return 'a ' + type(value).__name__ + ' of ' + str(len(value)) + ' items'
    return 'a ' + type(value).__name__


def _nb20_array(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().cpu().double().numpy(), str(value.dtype).replace('torch.', '')
    return _nb20_describe(value), ''
"""


def _error_of(errors: list) -> tuple[str, str] | None:
    """The error that explains a case: a rank's own, before another rank's stop that it caused."""
    order = ("not done", "refused", "self", "peer", "send", "mismatch", "sizes", "raised", "hung", "deadlock", "aborted")
    found = [tuple(e) for e in errors if e is not None]
    return min(found, key=lambda e: order.index(e[0]) if e[0] in order else len(order)) if found else None


# ----------------------------------------------------------------------------- 20.1 the ring all-reduce

HINT_RING_CALL = ("ring_all_reduce(x, comm): x a 1-D float tensor of the same size on every rank, comm with rank, "
                  "world_size, send, recv and wait; return a new tensor of x's shape and dtype, the sum over the ranks")
HINT_RING_COLLECTIVE = ("your ring_all_reduce called the comm's {name}: the exercise is the all-reduce itself, so build "
                        "it from sends and receives between neighbours (this comm has no collectives)")
HINT_RING_MUTATED = ("ring_all_reduce changed its input x in place on rank {rank} (on {what}): the caller keeps x (a "
                     "gradient, a bucket it will write back), so work on copies of the chunks and return a new tensor")
HINT_RING_ALIAS = ("ring_all_reduce returned x itself on {what}: return a new tensor (with one rank the sum is a copy "
                   "of x), so that the caller's x and the result are not the same storage")
HINT_RING_RECV_FIRST = (
    "every rank waited to receive first and none ever sent (a deadlock, on {what}): send does not wait for the "
    "receiver, so at each step every rank sends its chunk to the next rank first, then receives from the one before"
)
HINT_RING_DEADLOCK = ("on {what}, {error}: the sends and receives must pair up one to one, the same number of steps "
                      "on every rank, each rank receiving from the rank before it what that rank sent")
HINT_RING_LAYOUT = (
    "on {what}, {error}: the ranks cut x into different pieces. Every rank must cut x the same way, into world_size "
    "chunks whose sizes depend only on the size of x and N (never on the rank), and at each step send and receive "
    "chunks of the same index on both ends"
)
HINT_RING_RAISED = "ring_all_reduce raised on {what}: {error} ({call})"
HINT_RING_HUNG = "ring_all_reduce did not finish on {what}: {error} (a loop that never ends, or a wait in a loop)"
HINT_RING_NOT_NEXT = (
    "on {what} rank {src} sent to rank {dst}: in a ring each rank sends only to the next one, rank + 1 (the last "
    "sends to rank 0), and receives only from the one before. Sending to every rank costs each rank N - 1 whole "
    "copies of x, (N - 1) n numbers, where the ring sends 2 (N - 1) n / N"
)
HINT_RING_SOLO = ("with one rank (N = 1) your ranks sent {got} numbers: the sum over one rank is x itself, so nothing "
                  "is sent")
HINT_RING_TRAFFIC = (
    "the sum is right on {what}, but your ranks sent {got} numbers in all where the ring sends 2 (N - 1) n = {want} "
    "(n = {n} numbers in x, N = {world} ranks): each rank sends one chunk of about n / N numbers at each of its "
    "2 (N - 1) steps, about 2 (N - 1) / N of x whatever N is.{whole}"
)
HINT_RING_WHOLE = (" Your messages held the whole of x: passing whole tensors round costs each rank (N - 1) n, N / 2 "
                   "times the ring's cost. Send one chunk a step")
HINT_RING_RS_ONLY = (
    "your result holds the full sum in one chunk only (on {what}): that is where the reduce-scatter leaves each rank. "
    "After its N - 1 steps rank r holds the finished chunk r + 1 (mod N); N - 1 more steps of all-gather pass the "
    "finished chunks round the ring so that every rank ends with all of them"
)
HINT_RING_CHUNK_ONLY = (
    "you returned one chunk (of {got} numbers on {what}, where x has {n}): after the reduce-scatter each rank holds "
    "one finished chunk; the all-gather passes them round so every rank returns the whole sum, x's size"
)
HINT_RING_AG_OFF = (
    "your all-gather passes the wrong chunk on (on {what}): after the reduce-scatter rank r holds the finished chunk "
    "r + 1 (mod N). At each all-gather step a rank passes on a finished chunk (first the one it finished, then the "
    "one it received at the step before) and stores the incoming one in that chunk's own place"
)
HINT_RING_N_STEPS = (
    "your ring runs N steps where it needs N - 1 (on {what}): after N - 1 steps of reduce-scatter each chunk has "
    "visited every rank once, and N - 1 steps of all-gather bring every finished chunk to every rank, so a further "
    "step only sends a chunk that is already done (with one rank there is no step at all: a rank would send to itself)"
)
HINT_RING_SELF = ("on {what} a rank sent a message to itself: in a ring each rank sends only to the next rank, rank + "
                  "1 (the last sends to rank 0), and receives from the one before")
HINT_RING_AVERAGE = ("you returned the mean over the ranks: ring_all_reduce returns the sum (a caller that wants the "
                     "mean, such as the gradient all-reduce, divides afterwards)")
HINT_RING_ROTATED = ("on {what} your chunks are numbered differently on each rank: every rank must cut x the same way "
                     "and number the chunks the same way, so that chunk k means the same numbers on every rank")
HINT_RING_RETURN = "ring_all_reduce returned {got} on rank {rank} (on {what}): return a floating-point tensor, the sum"
HINT_RING_SHAPE = "ring_all_reduce returned shape {got} on rank {rank} (on {what}); expected {want}, x's shape"
HINT_RING_DTYPE = ("ring_all_reduce returned {got} on {what}, where x is {want}: keep x's dtype (new tensors made from "
                   "numbers default to float32; make them like x)")
HINT_RING_DIFFERS = ("ring_all_reduce's result differs from the sum on rank {rank} (on {what}): largest error {err:.3g} "
                     "at index {index} (got {got:.6g}, expected {want:.6g})")


def reference_ring_all_reduce(x: torch.Tensor, comm: Any) -> torch.Tensor:
    return ring_all_reduce(x, comm)


def ring_variant(xs: list[torch.Tensor], mistake: str = "") -> list[torch.Tensor] | None:
    """Every rank's result of a ring done right (``mistake=""``) or with one slip, run step by step in lock-step
    (each rank sends, then receives); None where the slip's pieces would disagree (an error)."""
    n = len(xs)
    chunks = [[c.clone() for c in x.tensor_split(n)] for x in xs]
    if mistake == "rotated":
        chunks = [c[r:] + c[:r] for r, c in enumerate(chunks)]
    rs_steps = n if mistake in ("n steps", "n steps both") else n - 1
    for s in range(rs_steps):
        out = [chunks[r][(r - s) % n].clone() for r in range(n)]
        for r in range(n):
            k = (r - s - 1) % n
            if out[(r - 1) % n].shape != chunks[r][k].shape:
                return None
            chunks[r][k] = chunks[r][k] + out[(r - 1) % n]
    if mistake == "rs only":
        return [torch.cat(c) for c in chunks]
    offset = 0 if mistake == "ag off" else 1
    for s in range(n if mistake == "n steps both" else n - 1):
        out = [chunks[r][(r + offset - s) % n].clone() for r in range(n)]
        for r in range(n):
            k = (r + offset - 1 - s) % n
            if out[(r - 1) % n].shape != chunks[r][k].shape:
                return None
            chunks[r][k] = out[(r - 1) % n]
    result = [torch.cat(c) for c in chunks]
    return [t / n for t in result] if mistake == "average" else result


# (N steps in a phase where it needs N - 1 gives the right sum with these indices: the extra step's chunk is
# overwritten; its traffic names it.)
RING_MISTAKES = (("rs only", HINT_RING_RS_ONLY), ("ag off", HINT_RING_AG_OFF), ("average", HINT_RING_AVERAGE),
                 ("rotated", HINT_RING_ROTATED))

RING_RUN = COMM_RUN + """

def _nb20_ring_case(case):
    xs = [torch.from_numpy(np.array(a)) for a in case['xs']]
    kept = [x.clone() for x in xs]
    returned = [None] * len(xs)

    def build(rank, comm):
        got = ring_all_reduce(xs[rank], comm)
        returned[rank] = got is xs[rank]
        return got

    results, errors, group = _nb20_spmd(build, len(xs), inputs['timeout'], ())
    arrays = [_nb20_array(r) for r in results]
    return {'results': [a[0] if e is None else None for a, e in zip(arrays, errors)],
            'dtypes': [a[1] for a in arrays], 'errors': errors, 'sends': list(group.sends),
            'mutated': [r for r in range(len(xs)) if not (xs[r].shape == kept[r].shape and torch.equal(xs[r], kept[r]))],
            'aliased': [r for r in range(len(xs)) if returned[r]]}


def _nb20_ring_all(cases):
    done = []
    for case in cases:
        done.append(_nb20_ring_case(case))
        if any(e is not None and e[0] in ('deadlock', 'hung') for e in done[-1]['errors']):
            break  # every later case would wait as long
    return done


outputs = {'results': _nb20_ring_all(inputs['cases'])}
"""


def ring_cases(rng: np.random.Generator, label: Callable[[int, str], str] = lambda i, w: w) -> dict:
    """N from 1 to 5; sizes that N divides, that it does not, below N (empty chunks); float32 and float64; a case of
    magnitude 1e4."""
    cases = []
    for i, (n, size, dtype, scale) in enumerate([
            (1, 5, np.float64, 1.0), (2, 6, np.float64, 1.0), (3, 9, np.float64, 1.0), (4, 13, np.float32, 1.0),
            (3, 2, np.float64, 1.0), (5, 3, np.float32, 1.0), (5, 17, np.float64, 1.0), (4, 22, np.float32, 1e4),
            (2, 7, np.float32, 1.0)]):
        if size >= n and size % n == 0:
            size += n * int(rng.integers(0, 2))  # still divisible
        elif size > n:
            size += n * int(rng.integers(0, 2))  # still not divisible
        xs = [np.asarray(scale * rng.standard_normal(size), dtype=dtype) for _ in range(n)]
        what = (f"{n} rank{'s' if n > 1 else ''}, x of {size} numbers, {np.dtype(dtype).name}"
                + (", fewer numbers than ranks" if size < n else "") + (", magnitude 1e4" if scale > 1 else ""))
        cases.append({"what": label(i, what), "xs": xs})
    return {"cases": cases, "timeout": TIMEOUT}


def _ring_well_formed(result: Any) -> bool:
    return isinstance(result, dict) and all(isinstance(result.get(k), list) for k in (
        "results", "dtypes", "errors", "sends", "mutated", "aliased"))


def judge_ring(results: list, cases: list) -> None:
    """Raise a CheckFailure naming the slip unless every rank of every case returned the sum, with the ring's
    messages only."""
    if not results or len(results) > len(cases) or not all(_ring_well_formed(r) for r in results):
        raise CheckFailure(HINT_NOT_RUN.format(function="ring_all_reduce"))
    for result, case in zip(results, cases):
        error = _error_of(result["errors"])
        if error is not None and error[0] == "not done":
            raise ExerciseNotDone(NOT_DONE_MESSAGE)
        if error is not None and error[0] == "refused":
            raise CheckFailure(HINT_RING_COLLECTIVE.format(name=error[1]))
        if result["mutated"]:
            raise CheckFailure(HINT_RING_MUTATED.format(rank=result["mutated"][0], what=case["what"]))
    for result, case in zip(results, cases):
        error, what = _error_of(result["errors"]), case["what"]
        if error is None:
            continue
        if error[0] == "deadlock" and not result["sends"] and all(
                e is not None and e[0] == "deadlock" for e in result["errors"]):
            raise CheckFailure(HINT_RING_RECV_FIRST.format(what=what))
    if len(results) < len(cases) and all(_error_of(r["errors"]) is None for r in results):
        raise CheckFailure(HINT_NOT_RUN.format(function="ring_all_reduce"))

    xs = [[torch.from_numpy(np.array(a)) for a in c["xs"]] for c in cases[:len(results)]]
    wants = [[sum(x.double() for x in case_xs)] * len(case_xs) for case_xs in xs]
    gots = [None if _error_of(r["errors"]) is not None else _as_tensors(r["results"]) for r in results]
    bad = [i for i, (g, w) in enumerate(zip(gots, wants)) if g is not None and not _all_close(g, w)]
    if bad:
        variants = {m: [ring_variant([x.double() for x in case_xs], m) for case_xs in xs] for m, _ in RING_MISTAKES}
        for mistake, hint in RING_MISTAKES:
            defined = [i for i in range(len(gots)) if variants[mistake][i] is not None and gots[i] is not None]
            differing = [i for i in defined if not _all_close(variants[mistake][i], wants[i])]
            if differing and all(_all_close(gots[i], variants[mistake][i]) for i in defined):
                raise CheckFailure(hint.format(what=cases[differing[0]]["what"]))
    for i in bad:
        case, got, want = cases[i], gots[i], wants[i]
        for rank, (g, w) in enumerate(zip(got, want)):
            if g is None:
                raise CheckFailure(HINT_RING_RETURN.format(got=results[i]["results"][rank], rank=rank,
                                                           what=case["what"]))
            if g.shape != w.shape:
                finished = w.tensor_split(len(want))[(rank + 1) % len(want)]
                if g.dim() == 1 and g.shape == finished.shape and _close(g, finished):
                    raise CheckFailure(HINT_RING_CHUNK_ONLY.format(got=g.numel(), what=case["what"], n=w.numel()))
                raise CheckFailure(HINT_RING_SHAPE.format(got=tuple(g.shape), rank=rank, what=case["what"],
                                                          want=tuple(w.shape)))
    for result, case in zip(results, cases):
        error, what = _error_of(result["errors"]), case["what"]
        if error is None:
            continue
        if error[0] == "mismatch":
            raise CheckFailure(HINT_RING_LAYOUT.format(what=what, error=error[1]))
        if error[0] == "self":
            raise CheckFailure((HINT_RING_N_STEPS if len(case["xs"]) == 1 else HINT_RING_SELF).format(what=what))
        if error[0] == "deadlock":
            raise CheckFailure(HINT_RING_DEADLOCK.format(what=what, error=error[1]))
        if error[0] == "hung":
            raise CheckFailure(HINT_RING_HUNG.format(what=what, error=error[1]))
        raise CheckFailure(HINT_RING_RAISED.format(what=what, error=error[1], call=HINT_RING_CALL))
    for i in bad:
        case, got, want = cases[i], gots[i], wants[i]
        for rank, (g, w) in enumerate(zip(got, want)):
            if not _close(g, w):
                diff = (g - w).abs().nan_to_num(float("inf"))
                worst = int(diff.argmax())
                raise CheckFailure(HINT_RING_DIFFERS.format(rank=rank, what=case["what"], err=float(diff.max()),
                                                            index=worst, got=float(g[worst]), want=float(w[worst])))
    for result, case in zip(results, cases):
        dtype = str(np.array(case["xs"][0]).dtype)
        for got_dtype in result["dtypes"]:
            if got_dtype != dtype:
                raise CheckFailure(HINT_RING_DTYPE.format(got=got_dtype, what=case["what"], want=dtype))
        if result["aliased"]:
            raise CheckFailure(HINT_RING_ALIAS.format(what=case["what"]))
    for result, case in zip(results, cases):  # the messages: to the next rank only, 2 (N - 1) n numbers in all
        n_ranks, numel = len(case["xs"]), int(np.array(case["xs"][0]).size)
        sent = sum(k for _, _, k in result["sends"])
        if n_ranks == 1 and result["sends"]:
            raise CheckFailure(HINT_RING_SOLO.format(got=sent))
        for src, dst, _ in result["sends"]:
            if dst != (src + 1) % n_ranks:
                raise CheckFailure(HINT_RING_NOT_NEXT.format(what=case["what"], src=src, dst=dst))
        want = 2 * (n_ranks - 1) * numel
        if numel and sent in ((2 * n_ranks - 1) * numel, 2 * n_ranks * numel) and all(
                k <= -(-numel // n_ranks) for _, _, k in result["sends"]):
            raise CheckFailure(HINT_RING_N_STEPS.format(what=case["what"]))
        if sent != want:
            whole = numel > 1 and any(k == numel for _, _, k in result["sends"])
            raise CheckFailure(HINT_RING_TRAFFIC.format(what=case["what"], got=sent, want=want, n=numel,
                                                        world=n_ranks, whole=HINT_RING_WHOLE if whole else ""))


@checker("the ring all-reduce")
def check_ring_all_reduce(ring_all_reduce) -> None:
    """Check ``ring_all_reduce(x, comm)`` on 1 to 5 ranks in threads against the sum, and its messages against the
    ring's (only to the next rank, 2 (N - 1) n numbers in all)."""
    _refuse(ring_all_reduce, "ring_all_reduce", "the ring all-reduce")
    inputs = ring_cases(np.random.default_rng(2001))
    judge_ring(_run(RING_RUN, "ring_all_reduce", ring_all_reduce, inputs)["results"], inputs["cases"])


# ----------------------------------------------------------------------------- 20.2 ZeRO stage 1

HINT_ZERO_CALL = ("ShardedAdamW(params, comm, **options): params the model's parameters, options for torch's AdamW; "
                  "step(); its optimizer attribute an AdamW over this rank's shard only")
HINT_ZERO_RAISED = "ShardedAdamW raised on {what}: {error} ({call})"
HINT_ZERO_SIZES = (
    "on {what}, {error}: a reduce-scatter and an all-gather exchange world_size equal pieces, so the flat vector is "
    "padded with zeros to world_size times ceil(numel / world_size) numbers (here {padded}) before it is cut"
)
HINT_ZERO_DEADLOCK = ("on {what}, {error}: every rank must call the same collectives in the same order, once per step "
                      "(a reduce-scatter, then an all-gather)")
HINT_ZERO_COLLECTIVE = ("your ShardedAdamW sends point-to-point messages: use the comm's collectives (reduce-scatter "
                        "the gradient, all-gather the shards)")
HINT_ZERO_NO_OPTIMIZER = ("ShardedAdamW's optimizer attribute is {got} on {what}: keep the AdamW that steps this rank's "
                          "shard there (a torch.optim.AdamW)")
HINT_ZERO_STATE_ALL = (
    "your AdamW keeps state for every parameter ({got} numbers on rank {rank}, {what}): ZeRO-1's point is that each "
    "rank keeps the two moments only for the shard it owns, 2 numbers per owned parameter ({want} here), so the "
    "optimizer's memory per rank falls as 1 / N"
)
HINT_ZERO_STATE = ("rank {rank}'s optimizer holds {got} numbers of state on {what}; its shard of {shard} numbers needs "
                   "{want}: two moments per owned parameter")
HINT_ZERO_SUM = (
    "your step uses the sum of the ranks' gradients: each rank's loss is a mean over its own rows, so the whole "
    "batch's gradient is the mean of the ranks' gradients. Divide the reduce-scattered shard by world_size (Adam's "
    "step hardly depends on the gradient's scale, but its eps does, and this check's eps is large)"
)
HINT_ZERO_NO_GATHER = (
    "after a step your ranks' parameters differ (on {what}): each rank updated only the shard it owns. All-gather "
    "the updated shards and write the whole vector back into every parameter, so every rank holds the same model"
)
HINT_ZERO_PADDING = (
    "the last numbers of the flat vector were never updated (on {what}): the shards must cover every parameter. Pad "
    "the flat vector to world_size times ceil(numel / world_size) and give rank r the r-th equal piece"
)
HINT_ZERO_REBUILT = (
    "your parameters move as if Adam started afresh every step: its moments (exp_avg, exp_avg_sq) and step count "
    "live in the optimizer's state, so build the AdamW over the shard once, in the constructor, and keep it"
)
HINT_ZERO_DIFFERS = ("after {steps} steps on {what}, rank {rank}'s parameter {param} differs from AdamW's on all the "
                     "rows: largest error {err:.3g}")
HINT_ZERO_TRAFFIC = (
    "the parameters are right on {what}, but rank {rank} ran {got} over {steps} steps, where ZeRO-1 runs one "
    "reduce-scatter and one all-gather of the padded vector ({padded} numbers) per step: {want}. {why}"
)
WHY_ZERO_ALL_REDUCE = ("An all-reduce moves as much as a reduce-scatter and an all-gather together, so an extra one "
                       "doubles the traffic, and one in place of the reduce-scatter sends every rank the whole "
                       "gradient where it needs only its shard")
WHY_ZERO_OTHER = "Anything more is traffic data parallelism does not pay"
HINT_ZERO_FROZEN = (
    "your ShardedAdamW changed a parameter that does not require grad (a frozen one, on {what}): the optimizer "
    "steps only the parameters with requires_grad, so leave the others out of the flat vector"
)
HINT_ZERO_GENERATOR = (
    "ShardedAdamW raised on {what} ({error}): params may be any iterable of parameters, such as model.parameters(), "
    "a generator that can be read only once and not indexed, so make a list of it first"
)
HINT_ZERO_NONE_GRAD = (
    "ShardedAdamW raised on {what} ({error}): a parameter's .grad may be None (one the loss did not reach, or a "
    "frozen one): count a missing gradient as zeros, and keep only the parameters that require grad"
)
HINT_ZERO_FLOAT32 = (
    "your parameters drift from AdamW's by float32's rounding (on {what}, float64 parameters): keep the shard in the "
    "parameters' dtype, so the optimizer steps the numbers the model holds"
)
HINT_ZERO_UNCHANGED = (
    "your parameters did not move (on {what}): step() must write the gathered, updated values back into every "
    "parameter, in place (the model holds the parameters, not your flat copy)"
)
HINT_ZERO_EMPTY = (
    "ShardedAdamW raised on {what} ({error}), as if it found no parameters: params may be a generator, such as "
    "model.parameters(), which is empty the second time it is read, so make a list of it once, first"
)
HINT_ZERO_RETURN = "ShardedAdamW left rank {rank}'s parameters as {got} on {what}: write floating-point numbers back"


def reference_sharded_adamw(params: Any, comm: Any, **options: Any) -> ShardedAdamW:
    return ShardedAdamW(params, comm, **options)


def _zero_model(case: dict) -> list[torch.Tensor]:
    return [torch.from_numpy(np.array(a)) for a in case["init"]]


def _zero_loss(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The small model every rank trains: (x W) * v + b against y, the squared error summed over the outputs and
    averaged over the rows."""
    W, v, b = params
    return (((x @ W) * v + b - y) ** 2).sum(-1).mean()


def _grads(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    return list(torch.autograd.grad(_zero_loss(leaves, x, y), leaves))


def zero_expected(case: dict) -> list[torch.Tensor]:
    """AdamW, unsharded, on every rank's rows at once: the parameters after the case's steps."""
    params = [torch.nn.Parameter(p.clone()) for p in _zero_model(case)]
    optimizer = torch.optim.AdamW(params, **case["options"])
    x = torch.cat([torch.from_numpy(np.array(a)) for a in case["x"]])
    y = torch.cat([torch.from_numpy(np.array(a)) for a in case["y"]])
    for _ in range(case["steps"]):
        optimizer.zero_grad()
        _zero_loss(params, x, y).backward()
        optimizer.step()
    return [p.detach() for p in params]


def zero_variant(case: dict, mistake: str = "") -> list[list[torch.Tensor]] | None:
    """Every rank's parameters after the case's steps of ZeRO-1 done right (``mistake=""``) or with one slip,
    simulated rank by rank in this process."""
    n = len(case["x"])
    init = _zero_model(case)
    if mistake == "unchanged":
        return [[p.clone() for p in init] for _ in range(n)]
    sizes = [p.numel() for p in init]
    numel = sum(sizes)
    shard = numel // n if mistake == "floor" else math.ceil(numel / n)
    padded = n * shard
    if shard == 0:
        return None
    flat0 = torch.cat([p.reshape(-1) for p in init])
    flat0 = torch.cat([flat0, flat0.new_zeros(max(padded - numel, 0))])
    flats = [flat0.clone() for _ in range(n)]  # each rank's copy of the whole vector (padding kept)
    shards = [torch.nn.Parameter(flat0[r * shard:(r + 1) * shard].clone()) for r in range(n)]
    optimizers = [torch.optim.AdamW([s], **case["options"]) for s in shards]
    for _ in range(case["steps"]):
        grads = []
        for r in range(n):
            params = [t.view_as(p) for t, p in zip(flats[r][:numel].split(sizes), init)]
            g = torch.cat([t.reshape(-1) for t in _grads(params, torch.from_numpy(np.array(case["x"][r])),
                                                         torch.from_numpy(np.array(case["y"][r])))])
            grads.append(torch.cat([g, g.new_zeros(max(padded - numel, 0))])[:padded])
        total = torch.stack(grads).sum(0)
        if mistake != "sum":
            total = total / n
        for r in range(n):
            if mistake == "rebuilt":
                optimizers[r] = torch.optim.AdamW([shards[r]], **case["options"])
            shards[r].grad = total[r * shard:(r + 1) * shard].clone()
            optimizers[r].step()
        for r in range(n):
            if mistake == "no gather":
                flats[r][r * shard:(r + 1) * shard] = shards[r].detach()
            else:
                flats[r][:padded] = torch.cat([s.detach() for s in shards])
    return [[t.view_as(p).clone() for t, p in zip(flats[r][:numel].split(sizes), init)] for r in range(n)]


ZERO_MISTAKES = (("sum", HINT_ZERO_SUM), ("no gather", HINT_ZERO_NO_GATHER), ("floor", HINT_ZERO_PADDING),
                 ("rebuilt", HINT_ZERO_REBUILT), ("unchanged", HINT_ZERO_UNCHANGED))

ZERO_RUN = COMM_RUN + """

def _nb20_zero_case(case):
    n = len(case['x'])
    states = [None] * n
    frozen_kept = [True] * n

    def build(rank, comm):
        params = [torch.nn.Parameter(torch.from_numpy(np.array(a))) for a in case['init']]
        frozen = torch.nn.Parameter(torch.ones(3, dtype=params[0].dtype), requires_grad=False)
        x, y = torch.from_numpy(np.array(case['x'][rank])), torch.from_numpy(np.array(case['y'][rank]))
        # a generator, as model.parameters() is, holding a frozen parameter the optimizer must leave alone
        opt = ShardedAdamW((p for p in params[:1] + [frozen] + params[1:]), comm, **case['options'])
        for _ in range(case['steps']):
            W, v, b = params
            (((x @ W) * v + b - y) ** 2).sum(-1).mean().backward()
            opt.step()
            for p in params:
                p.grad = None
        inner = getattr(opt, 'optimizer', None)
        if isinstance(inner, torch.optim.AdamW):
            states[rank] = int(sum(t.numel() for s in inner.state.values() for t in s.values()
                                   if isinstance(t, torch.Tensor) and t.dim() > 0))
        else:
            states[rank] = _nb20_describe(inner) if inner is not None else 'missing'
        frozen_kept[rank] = bool(torch.equal(frozen.detach(), torch.ones_like(frozen)))
        return [_nb20_array(p)[0] for p in params]

    results, errors, group = _nb20_spmd(build, n, inputs['timeout'], ('all_reduce', 'all_gather', 'reduce_scatter',
                                                                     'broadcast'))
    return {'params': [r if e is None else None for r, e in zip(results, errors)], 'errors': errors,
            'states': states, 'calls': group.calls, 'sends': len(group.sends), 'frozen': frozen_kept}


def _nb20_zero_all(cases):
    done = []
    for case in cases:
        done.append(_nb20_zero_case(case))
        if any(e is not None and e[0] in ('deadlock', 'hung') for e in done[-1]['errors']):
            break
    return done


outputs = {'results': _nb20_zero_all(inputs['cases'])}
"""


def zero_cases(rng: np.random.Generator, label: Callable[[int, str], str] = lambda i, w: w) -> dict:
    """N from 1 to 4; three parameters, W (a, b), v (b,) and b (b,), whose count N does not divide (for N = 4 the
    last rank may own padding only); three steps of AdamW in float64 with weight decay."""
    cases = []
    for i, (n, rows) in enumerate([(1, 4), (2, 3), (3, 2), (4, 2)]):
        while True:
            a, b = int(rng.integers(2, 5)), int(rng.integers(2, 4))
            numel = a * b + 2 * b
            if n == 1 or numel % n:
                break
        init = [rng.standard_normal((a, b)), rng.uniform(0.5, 1.5, b), 0.1 * rng.standard_normal(b)]
        x = [rng.standard_normal((rows, a)) for _ in range(n)]
        y = [rng.standard_normal((rows, b)) for _ in range(n)]
        # a large eps: Adam's step hardly depends on the gradient's scale otherwise, and a sum for the mean would pass
        options = {"lr": float(rng.uniform(0.02, 0.08)), "weight_decay": float(rng.uniform(0.05, 0.2)),
                   "betas": [0.9, 0.99], "eps": float(rng.uniform(0.2, 0.5))}
        what = (f"{n} rank{'s' if n > 1 else ''}, {rows} rows each, parameters of {a * b}, {b} and {b} numbers "
                f"({numel} in all, padded to {n * math.ceil(numel / n)}), float64")
        cases.append({"what": label(i, what), "init": init, "x": x, "y": y, "options": options, "steps": 3})
    return {"cases": cases, "timeout": TIMEOUT}


def _zero_well_formed(result: Any) -> bool:
    return isinstance(result, dict) and all(isinstance(result.get(k), list) for k in (
        "params", "errors", "states", "calls", "frozen")) and isinstance(result.get("sends"), int)


def _zero_options(case: dict) -> dict:
    options = dict(case["options"])
    options["betas"] = tuple(options["betas"])
    return options


def judge_zero(results: list, cases: list) -> None:
    """Raise a CheckFailure naming the slip unless every rank ends with unsharded AdamW's parameters, keeps the state
    of its shard only, and runs one reduce-scatter and one all-gather of the padded vector a step."""
    if not results or len(results) > len(cases) or not all(_zero_well_formed(r) for r in results):
        raise CheckFailure(HINT_NOT_RUN.format(function="ShardedAdamW"))
    cases = [dict(c, options=_zero_options(c)) for c in cases[:len(results)]]
    for result in results:
        error = _error_of(result["errors"])
        if error is not None and error[0] == "not done":
            raise ExerciseNotDone(NOT_DONE_MESSAGE)
    for result, case in zip(results, cases):
        if result["sends"]:
            raise CheckFailure(HINT_ZERO_COLLECTIVE)
        error, what = _error_of(result["errors"]), case["what"]
        numel = sum(np.array(a).size for a in case["init"])
        padded = len(case["x"]) * math.ceil(numel / len(case["x"]))
        if error is not None and error[0] == "sizes":
            raise CheckFailure(HINT_ZERO_SIZES.format(what=what, error=error[1], padded=padded))
    if len(results) < len(cases) and all(_error_of(r["errors"]) is None for r in results):
        raise CheckFailure(HINT_NOT_RUN.format(function="ShardedAdamW"))
    for result, case in zip(results, cases):
        if _error_of(result["errors"]) is None and not all(result["frozen"]):
            raise CheckFailure(HINT_ZERO_FROZEN.format(what=case["what"]))
    wants = [[zero_expected(c)] * len(c["x"]) for c in cases]
    gots = [None if _error_of(r["errors"]) is not None or not all(isinstance(p, list) for p in r["params"])
            else [[torch.from_numpy(np.array(t, dtype=np.float64)) if not isinstance(t, str) else None for t in p]
                  for p in r["params"]] for r in results]

    def same(got: list | None, want: list | None) -> bool:
        return got is not None and want is not None and len(got) == len(want) and all(
            _all_close(g, w, rtol=1e-9, atol=1e-11) for g, w in zip(got, want))

    bad = [i for i, (g, w) in enumerate(zip(gots, wants)) if g is not None and not same(g, w)]
    if bad:
        variants = {m: [zero_variant(c, m) for c in cases] for m, _ in ZERO_MISTAKES}
        for mistake, hint in ZERO_MISTAKES:
            defined = [i for i in range(len(gots)) if variants[mistake][i] is not None and gots[i] is not None]
            differing = [i for i in defined if not same(variants[mistake][i], wants[i])]
            if differing and all(same(gots[i], variants[mistake][i]) for i in defined):
                raise CheckFailure(hint.format(what=cases[differing[0]]["what"]))
        for i in bad:  # ranks that disagree: a shard not shared
            got = gots[i]
            if len(got) > 1 and any(not _all_close(g, got[0], rtol=1e-9, atol=1e-12) for g in got[1:]):
                raise CheckFailure(HINT_ZERO_NO_GATHER.format(what=cases[i]["what"]))
    for result, case in zip(results, cases):
        error, what = _error_of(result["errors"]), case["what"]
        if error is None:
            continue
        if error[0] in ("deadlock", "hung"):
            raise CheckFailure(HINT_ZERO_DEADLOCK.format(what=what, error=error[1]))
        if "generator" in error[1]:
            raise CheckFailure(HINT_ZERO_GENERATOR.format(what=what, error=error[1]))
        if any(words in error[1] for words in ("out of range", "non-empty", "empty list", "zero-size")):
            raise CheckFailure(HINT_ZERO_EMPTY.format(what=what, error=error[1]))
        if "NoneType" in error[1]:
            raise CheckFailure(HINT_ZERO_NONE_GRAD.format(what=what, error=error[1]))
        raise CheckFailure(HINT_ZERO_RAISED.format(what=what, error=error[1], call=HINT_ZERO_CALL))
    for i in bad:
        for rank, (got, want) in enumerate(zip(gots[i], wants[i])):
            for k, (g, w) in enumerate(zip(got, want)):
                if g is None:
                    raise CheckFailure(HINT_ZERO_RETURN.format(rank=rank, got="something other than a tensor",
                                                               what=cases[i]["what"]))
                if not _close(g, w, rtol=1e-9, atol=1e-11):
                    if _close(g, w, rtol=1e-5, atol=1e-6):  # off by float32's rounding, not by a slip of the method
                        raise CheckFailure(HINT_ZERO_FLOAT32.format(what=cases[i]["what"]))
                    err = float((g - w).abs().max()) if g.shape == w.shape else float("inf")
                    raise CheckFailure(HINT_ZERO_DIFFERS.format(steps=cases[i]["steps"], what=cases[i]["what"],
                                                                rank=rank, param=("W", "v", "b")[k], err=err))
    for result, case in zip(results, cases):  # the optimizer's state: its shard only
        n = len(case["x"])
        numel = sum(np.array(a).size for a in case["init"])
        shard = math.ceil(numel / n)
        for rank, state in enumerate(result["states"]):
            if isinstance(state, str):
                raise CheckFailure(HINT_ZERO_NO_OPTIMIZER.format(got=state, what=case["what"]))
            owned = max(0, min((rank + 1) * shard, numel) - min(rank * shard, numel))
            if n > 1 and state >= 2 * numel and numel > shard:
                raise CheckFailure(HINT_ZERO_STATE_ALL.format(got=state, rank=rank, what=case["what"], want=2 * shard))
            if not 2 * owned <= state <= 2 * shard:
                raise CheckFailure(HINT_ZERO_STATE.format(rank=rank, got=state, what=case["what"], shard=shard,
                                                          want=2 * shard))
    for result, case in zip(results, cases):  # the traffic: a reduce-scatter and an all-gather of the padded vector
        n = len(case["x"])
        numel = sum(np.array(a).size for a in case["init"])
        padded = n * math.ceil(numel / n)
        want = [["reduce_scatter", padded], ["all_gather", padded]] * case["steps"]
        for rank, calls in enumerate(result["calls"]):
            if n > 1 and sorted(map(tuple, calls)) != sorted(map(tuple, want)):
                names = sorted({c[0] for c in calls})
                got = ", ".join(f"{sum(1 for c in calls if c[0] == name)} {name.replace('_', '-')} of "
                                f"{sum(c[1] for c in calls if c[0] == name)} numbers in all" for name in names)
                raise CheckFailure(HINT_ZERO_TRAFFIC.format(
                    what=case["what"], rank=rank, got=got or "no collective", steps=case["steps"], padded=padded,
                    want=f"{case['steps']} of each",
                    why=WHY_ZERO_ALL_REDUCE if "all_reduce" in names else WHY_ZERO_OTHER))


@checker("the sharded optimizer (ZeRO-1)")
def check_sharded_adamw(ShardedAdamW) -> None:
    """Check ``ShardedAdamW(params, comm, **options)`` on 1 to 4 ranks in threads against ``torch.optim.AdamW`` on
    every rank's rows at once, its state per rank and its collectives."""
    _refuse(ShardedAdamW, "ShardedAdamW", "the sharded optimizer", kind="a class")
    inputs = zero_cases(np.random.default_rng(2002))
    judge_zero(_run(ZERO_RUN, "ShardedAdamW", ShardedAdamW, inputs)["results"], inputs["cases"])


# ----------------------------------------------------------------------------- 20.3 the tensor-parallel MLP

HINT_MLP_CALL = ("parallel_mlp(x, W_in, b_in, W_out, b_out, comm): x (..., d_model), W_in (d_mlp, d_model), b_in "
                 "(d_mlp,), W_out (d_model, d_mlp), b_out (d_model,), whole on every rank; return (..., d_model)")
HINT_MLP_RAISED = "parallel_mlp raised on {what}: {error} ({call}).{why}"
WHY_MLP_LAYOUT = (" In nn.Linear's layout W_in is (d_mlp, d_model) and W_out (d_model, d_mlp): a rank's hidden "
                  "features are rows of W_in and b_in and the same columns of W_out (its rows are the output's "
                  "features)")
HINT_MLP_DEADLOCK = "on {what}, {error}: every rank must call the one all-reduce, with a tensor of the same shape"
HINT_MLP_P2P = ("your parallel_mlp sends point-to-point messages: one all-reduce of the partial outputs is all it "
                "needs")
HINT_MLP_B_OUT = (
    "b_out is counted N times (on {what}): you added it to every rank's partial output before the all-reduce, which "
    "sums the ranks' copies too. Add it once, after the sum"
)
HINT_MLP_GELU_AFTER = (
    "your GELU acts on the wrong thing (on {what}): it belongs on each hidden feature, before W_out, and GELU is not "
    "linear, so it cannot come after a sum of partial results. Split W_in by its rows (each rank computes its own "
    "hidden features from the whole input and applies GELU to them) and sum only after W_out"
)
HINT_MLP_W_OUT_ROWS = (
    "your output has d_mlp features where it should have d_model (on {what}): a rank's slice of W_out is its "
    "columns, the inputs that the rank's hidden features feed (in nn.Linear's layout W_out is (d_model, d_mlp))"
)
HINT_MLP_TANH = ("your GELU is the tanh approximation (on {what}): the MLP here uses the exact GELU, x times the normal "
                 "distribution's cumulative probability of x (through erf), torch's default")
HINT_MLP_B_IN = ("on {what} every rank added the same slice of b_in: b_in belongs to the hidden features, so a rank "
                 "adds the slice of b_in that matches its rows of W_in")
HINT_MLP_NO_REDUCE = (
    "your ranks returned different outputs (on {what}): each rank's product with its columns of W_out is only a "
    "partial output, from its own hidden features. One all-reduce sums them, so every rank returns the whole"
)
HINT_MLP_WHOLE = (
    "your ranks each computed the whole MLP ({how}): the exercise is to split the work, each rank computing only its "
    "d_mlp / N hidden features from its slices of the weights, and one all-reduce summing the partial outputs"
)
HOW_MLP_NO_COMM = "no collective ran, and the output is right"
HOW_MLP_NAN = "in a case where each rank's copy of the weights holds NaN outside its own slice, the output was NaN"
HINT_MLP_READS_OTHERS = (
    "a rank read weights outside its own slice (on {what}, where each rank's copy holds NaN outside its slice, the "
    "output was NaN): a rank needs only its rows of W_in and b_in and the same columns of W_out"
)
HINT_MLP_TRAFFIC = (
    "the output is right on {what}, but rank {rank} ran {got}, where tensor parallelism needs one all-reduce of the "
    "output ({want} numbers). Gathering the hidden features, or a second collective, moves more: the hidden "
    "features are d_mlp / d_model times the output's size"
)
HINT_MLP_NOT_DIVISIBLE = (
    "on {what} your ranks returned a wrong output: when N does not divide d_mlp the ranks cannot split the hidden "
    "features evenly, so raise an error that says so rather than drop features"
)
HINT_MLP_NOT_DIVISIBLE_KIND = (
    "on {what} your parallel_mlp raised {got}: when N does not divide d_mlp, raise a ValueError that says so (the "
    "error a caller expects for an argument it can fix)"
)
HINT_MLP_ALL_FEATURES = (
    "your output is right, but on {what} a rank computed all d_mlp hidden features (activations as wide as the whole "
    "hidden layer) and kept its share afterwards: tensor parallelism's saving is that each rank computes only its "
    "d_mlp / N features, so take its rows of W_in before the product"
)
HINT_MLP_NO_GELU = ("your MLP has no activation (on {what}): the hidden features go through the exact GELU before "
                    "W_out")
HINT_MLP_RETURN = "parallel_mlp returned {got} on rank {rank} (on {what}): return a floating-point tensor, the output"
HINT_MLP_SHAPE = "parallel_mlp returned shape {got} on {what}; expected {want}: x's leading dimensions, then d_model"
HINT_MLP_DTYPE = "parallel_mlp returned {got} on {what}, whose inputs are {want}: keep the inputs' dtype"
HINT_MLP_DIFFERS = ("parallel_mlp's output differs from the unsplit MLP's on rank {rank} (on {what}): largest error "
                    "{err:.3g}. Does each rank use the same hidden features throughout: its rows of W_in and b_in, "
                    "and the columns of W_out with the same indices?")


def reference_parallel_mlp(x, W_in, b_in, W_out, b_out, comm):
    return parallel_mlp(x, W_in, b_in, W_out, b_out, comm)


def mlp_variant(x: torch.Tensor, W_in: torch.Tensor, b_in: torch.Tensor, W_out: torch.Tensor, b_out: torch.Tensor,
                n: int, mistake: str = "") -> list[torch.Tensor] | None:
    """Every rank's output of the split MLP done right (``mistake=""``) or with one slip; None where the slip would
    raise."""
    d_mlp, d_model = W_in.shape
    if d_mlp % n:
        return None
    w = d_mlp // n
    gelu = torch.nn.functional.gelu
    partials = []
    for r in range(n):
        mine = slice(r * w, (r + 1) * w)
        if mistake == "input split":
            partials.append(gelu(x.tensor_split(n, -1)[r] @ W_in.tensor_split(n, 1)[r].T + b_in) @ W_out.T)
            continue
        pre = x @ W_in[mine].T + (b_in[:w] if mistake == "b_in first" else b_in[mine])
        if mistake in ("gelu after", "gelu after bias", "no gelu"):
            partials.append(pre @ W_out[:, mine].T)
        elif mistake == "tanh":
            partials.append(gelu(pre, approximate="tanh") @ W_out[:, mine].T)
        else:
            partials.append(gelu(pre) @ W_out[:, mine].T)
    if mistake == "no reduce":
        return [p + b_out for p in partials]
    total = sum(partials)
    if mistake == "b_out before":
        return [total + n * b_out] * n
    if mistake == "gelu after":
        return [gelu(total) + b_out] * n
    if mistake == "gelu after bias":
        return [gelu(total + b_out)] * n
    return [total + b_out] * n


MLP_MISTAKES = (("b_out before", HINT_MLP_B_OUT), ("gelu after", HINT_MLP_GELU_AFTER),
                ("input split", HINT_MLP_GELU_AFTER), ("tanh", HINT_MLP_TANH),
                ("b_in first", HINT_MLP_B_IN), ("no reduce", HINT_MLP_NO_REDUCE), ("no gelu", HINT_MLP_NO_GELU),
                ("gelu after bias", HINT_MLP_GELU_AFTER))

MLP_RUN = COMM_RUN + """

class _Nb20Wide(torch.overrides.TorchFunctionMode):
    # Notes whether a torch call returns activations as wide as the whole hidden layer (..., d_mlp): a rank that
    # computes every hidden feature (this thread's calls only: a mode is per thread).

    def __init__(self, shape):
        super().__init__()
        self.shape, self.seen = tuple(shape), False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            self.seen = True
        return out


def _nb20_mlp_case(case):
    n = case['world_size']
    args = [[torch.from_numpy(np.array(a)) for a in rank_args] for rank_args in case['args']]
    wide = [False] * n

    def build(rank, comm):
        x, W_in = args[rank][0], args[rank][1]
        mode = _Nb20Wide(tuple(x.shape[:-1]) + (W_in.shape[0],))
        with mode:
            out = parallel_mlp(*args[rank], comm)
        wide[rank] = mode.seen and n > 1 and W_in.shape[0] != W_in.shape[1]  # (square: the output looks the same)
        return out

    results, errors, group = _nb20_spmd(build, n, inputs['timeout'], ('all_reduce', 'all_gather', 'reduce_scatter',
                                                                     'broadcast'))
    arrays = [_nb20_array(r) for r in results]
    return {'results': [a[0] if e is None else None for a, e in zip(arrays, errors)],
            'dtypes': [a[1] for a in arrays], 'errors': errors, 'calls': group.calls, 'sends': len(group.sends),
            'wide': wide}


def _nb20_mlp_all(cases):
    done = []
    for case in cases:
        done.append(_nb20_mlp_case(case))
        if any(e is not None and e[0] in ('deadlock', 'hung') for e in done[-1]['errors']):
            break
    return done


outputs = {'results': _nb20_mlp_all(inputs['cases'])}
"""


def _with_nan_outside(args: list[np.ndarray], rank: int, n: int) -> list[np.ndarray]:
    """Rank ``rank``'s copy of (x, W_in, b_in, W_out, b_out) with NaN in the other ranks' slices."""
    x, W_in, b_in, W_out, b_out = (np.array(a, copy=True) for a in args)
    w = W_in.shape[0] // n
    others = np.ones(W_in.shape[0], dtype=bool)
    others[rank * w:(rank + 1) * w] = False
    W_in[others], b_in[others], W_out[:, others] = np.nan, np.nan, np.nan
    return [x, W_in, b_in, W_out, b_out]


def mlp_cases(rng: np.random.Generator, label: Callable[[int, str], str] = lambda i, w: w) -> dict:
    """N from 1 to 4, d_model unlike d_mlp / N, x with one or two leading dimensions, float64 and float32; a case with
    NaN outside each rank's slice of its weights; d_mlp that N does not divide."""
    cases = []
    for i, (n, lead, d_model, d_mlp, dtype, nan_outside) in enumerate([
            (1, (3,), 4, 6, np.float64, False), (2, (2, 3), 5, 12, np.float64, False), (3, (4,), 4, 6, np.float32, False),
            (4, (2, 2), 6, 8, np.float64, False), (2, (3,), 4, 4, np.float64, False), (3, (2, 3), 5, 9, np.float64, True),
            (2, (3,), 4, 9, np.float64, False)]):
        d_model += int(rng.integers(0, 2)) if d_model != d_mlp else 0
        arrays = [rng.standard_normal((*lead, d_model)), rng.standard_normal((d_mlp, d_model)),
                  rng.standard_normal(d_mlp), rng.standard_normal((d_model, d_mlp)), rng.standard_normal(d_model)]
        arrays = [np.asarray(a, dtype=dtype) for a in arrays]
        per_rank = [_with_nan_outside(arrays, r, n) if nan_outside else arrays for r in range(n)]
        what = (f"{n} rank{'s' if n > 1 else ''}, x {lead + (d_model,)}, d_mlp {d_mlp}, {np.dtype(dtype).name}"
                + (", NaN in each rank's copy outside its slice" if nan_outside else "")
                + (", d_mlp not divisible by N" if d_mlp % n else ""))
        cases.append({"what": label(i, what), "world_size": n, "args": per_rank, "clean": arrays,
                      "nan_outside": nan_outside})
    return {"cases": cases, "timeout": TIMEOUT}


def _mlp_well_formed(result: Any) -> bool:
    return isinstance(result, dict) and all(isinstance(result.get(k), list) for k in (
        "results", "dtypes", "errors", "calls", "wide")) and isinstance(result.get("sends"), int)


def judge_mlp(results: list, cases: list) -> None:
    """Raise a CheckFailure naming the slip unless every rank returns the unsplit MLP's output after one all-reduce
    of it, reading only its slice of the weights."""
    if not results or len(results) > len(cases) or not all(_mlp_well_formed(r) for r in results):
        raise CheckFailure(HINT_NOT_RUN.format(function="parallel_mlp"))
    for result in results:
        error = _error_of(result["errors"])
        if error is not None and error[0] == "not done":
            raise ExerciseNotDone(NOT_DONE_MESSAGE)
        if result["sends"]:
            raise CheckFailure(HINT_MLP_P2P)
    if len(results) < len(cases) and all(_error_of(r["errors"]) is None for r in results):
        raise CheckFailure(HINT_NOT_RUN.format(function="parallel_mlp"))
    cases = cases[:len(results)]
    clean = [[torch.from_numpy(np.array(a)).double() for a in c["clean"]] for c in cases]
    wants = [[mlp_variant(*args, n=1)[0]] * c["world_size"] for args, c in zip(clean, cases)]
    divides = [np.array(c["clean"][1]).shape[0] % c["world_size"] == 0 for c in cases]
    gots = [None if _error_of(r["errors"]) is not None else _as_tensors(r["results"]) for r in results]
    bad = [i for i, (g, w) in enumerate(zip(gots, wants)) if g is not None and divides[i] and not _all_close(g, w)]
    if bad:
        for mistake, hint in MLP_MISTAKES:
            variants = [mlp_variant(*args, n=c["world_size"], mistake=mistake) if divides[i] else None
                        for i, (args, c) in enumerate(zip(clean, cases))]
            defined = [i for i in range(len(gots)) if variants[i] is not None and gots[i] is not None
                       and not cases[i]["nan_outside"]]
            differing = [i for i in defined if not _all_close(variants[i], wants[i])]
            if differing and all(_all_close(gots[i], variants[i]) for i in defined):
                raise CheckFailure(hint.format(what=cases[differing[0]]["what"]))
    for i in bad:
        case, got, want = cases[i], gots[i], wants[i]
        for rank, g in enumerate(got):
            if g is None:
                raise CheckFailure(HINT_MLP_RETURN.format(got="something other than a tensor", rank=rank,
                                                          what=case["what"]))
            if g.shape != want[rank].shape:
                if g.shape[-1] == np.array(case["clean"][1]).shape[0] and g.shape[:-1] == want[rank].shape[:-1]:
                    raise CheckFailure(HINT_MLP_W_OUT_ROWS.format(what=case["what"]))
                raise CheckFailure(HINT_MLP_SHAPE.format(got=tuple(g.shape), what=case["what"],
                                                         want=tuple(want[rank].shape)))
    for i, (result, case) in enumerate(zip(results, cases)):
        error, what = _error_of(result["errors"]), case["what"]
        if error is None or not divides[i]:
            continue
        if error[0] in ("deadlock", "hung"):
            raise CheckFailure(HINT_MLP_DEADLOCK.format(what=what, error=error[1]))
        layout = any(word in error[1] for word in ("shapes cannot be multiplied", "must match the size", "size mismatch"))
        raise CheckFailure(HINT_MLP_RAISED.format(what=what, error=error[1], call=HINT_MLP_CALL,
                                                  why=WHY_MLP_LAYOUT if layout else ""))
    if bad and all(cases[i]["nan_outside"] for i in bad):  # right but where a rank's copy holds NaN elsewhere
        i = bad[0]
        if all(calls == [] for calls in results[i]["calls"]):
            raise CheckFailure(HINT_MLP_WHOLE.format(how=HOW_MLP_NAN))
        _mlp_traffic(results[i], cases[i], wants[i])
        raise CheckFailure(HINT_MLP_READS_OTHERS.format(what=cases[i]["what"]))
    for i in bad:
        case, got, want = cases[i], gots[i], wants[i]
        for rank, (g, w) in enumerate(zip(got, want)):
            if not _close(g, w):
                raise CheckFailure(HINT_MLP_DIFFERS.format(rank=rank, what=case["what"],
                                                           err=float((g - w).abs().nan_to_num(float("inf")).max())))
    for i, (result, case) in enumerate(zip(results, cases)):  # d_mlp that N does not divide: a ValueError, or exact
        error = _error_of(result["errors"])
        if not divides[i] and error is None and not _all_close(gots[i], wants[i]):
            raise CheckFailure(HINT_MLP_NOT_DIVISIBLE.format(what=case["what"]))
        if not divides[i] and error is not None and error[0] == "raised" and not error[1].startswith("ValueError"):
            raise CheckFailure(HINT_MLP_NOT_DIVISIBLE_KIND.format(what=case["what"], got=error[1].split(":")[0]))
    for result, case in zip(results, cases):  # every hidden feature computed on every rank
        if any(result["wide"]) and _error_of(result["errors"]) is None:
            raise CheckFailure(HINT_MLP_ALL_FEATURES.format(what=case["what"]))
    for result, case in zip(results, cases):
        dtype = str(np.array(case["clean"][0]).dtype)
        for got_dtype in result["dtypes"]:
            if got_dtype and got_dtype != dtype:
                raise CheckFailure(HINT_MLP_DTYPE.format(got=got_dtype, what=case["what"], want=dtype))
    for i, (result, case) in enumerate(zip(results, cases)):  # the traffic: one all-reduce of the output
        n = case["world_size"]
        if n == 1 or not divides[i] or _error_of(result["errors"]) is not None:
            continue
        _mlp_traffic(result, case, wants[i])


def _mlp_traffic(result: dict, case: dict, want: list) -> None:
    """Raise unless every rank ran one all-reduce of the output and nothing else."""
    out = int(np.prod(want[0].shape))
    for rank, calls in enumerate(result["calls"]):
        if not calls:
            raise CheckFailure(HINT_MLP_WHOLE.format(how=HOW_MLP_NO_COMM))
        if [list(c) for c in calls] != [["all_reduce", out]]:
            got = ", ".join(f"{c[0].replace('_', '-')} of {c[1]} numbers" for c in calls)
            raise CheckFailure(HINT_MLP_TRAFFIC.format(what=case["what"], rank=rank, got=got, want=out))


@checker("the tensor-parallel MLP")
def check_parallel_mlp(parallel_mlp) -> None:
    """Check ``parallel_mlp(x, W_in, b_in, W_out, b_out, comm)`` on 1 to 4 ranks in threads against the unsplit MLP,
    and its collectives against one all-reduce of the output."""
    _refuse(parallel_mlp, "parallel_mlp", "the split MLP")
    inputs = mlp_cases(np.random.default_rng(2003))
    judge_mlp(_run(MLP_RUN, "parallel_mlp", parallel_mlp, inputs)["results"], inputs["cases"])


# ----------------------------------------------------------------------------- 20.4 the loss scaler's update

HINT_SCALER_CALL = ("scaler_update(grads, scale, good_steps, growth_interval, growth=..., backoff=...): grads a list "
                    "of tensors; return (step_ok, new_scale, new_good_steps)")
HINT_SCALER_RAISED = "scaler_update raised on {what}: {error} ({call})"
HINT_SCALER_RETURN = ("scaler_update returned {got} on {what}: return a triple, step_ok (a bool), new_scale (a number) "
                      "and new_good_steps (an int)")
HINT_SCALER_ISINF = (
    "a NaN gradient went unnoticed ({what}): NaN is not infinite, so a test for inf alone misses it. Any gradient "
    "holding inf or NaN, that is anything not finite, means the step must be skipped"
)
HINT_SCALER_FIRST = ("an overflow in a later tensor went unnoticed ({what}): every tensor in grads must be tested, not "
                     "only the first")
HINT_SCALER_NO_RESET = ("after an overflow your count of clean steps went on ({what}): an overflow starts the count "
                        "again from 0, since growth needs growth_interval clean steps in a row")
HINT_SCALER_LATE = (
    "the scale grew one step off ({what}): count this step first, then grow when the count of clean steps in a row "
    "reaches growth_interval (equal to it), as torch's GradScaler does"
)
HINT_SCALER_KEEP_COUNT = ("after growing the scale your count was not reset ({what}): the count starts again at 0, "
                          "otherwise the scale grows again on every following step")
HINT_SCALER_MULTIPLIED = ("your gradients were multiplied by the scale ({what}): they were computed from the loss times "
                          "the scale, so unscaling divides them by it")
HINT_SCALER_NOT_IN_PLACE = (
    "the gradients passed in were not unscaled ({what}): divide each tensor of grads in place, so the optimizer that "
    "holds them steps with the true gradients (a new list of divided tensors is lost to it)"
)
HINT_SCALER_OK_OVERFLOW = ("you returned step_ok True on an overflow ({what}): a step with inf or NaN gradients must be "
                           "skipped, or it writes inf or NaN into the weights")
HINT_SCALER_GROW_OVERFLOW = ("the scale grew on an overflow step ({what}): an overflow only backs off (and resets the "
                             "count); growth comes only after growth_interval clean steps")
HINT_SCALER_DIFFERS = ("scaler_update's {name} is {got} on {what}; expected {want}")
HINT_SCALER_GRADS = ("scaler_update left gradient {index} wrong on {what}: largest error {err:.3g}. Every tensor of "
                     "grads is divided by the scale, in place, the ones after an overflow too")


def reference_scaler_update(grads, scale, good_steps, growth_interval, *, growth=2.0, backoff=0.5):
    return scaler_update(grads, scale, good_steps, growth_interval, growth=growth, backoff=backoff)


def scaler_variant(grads: list[torch.Tensor], scale: float, good: int, interval: int, growth: float, backoff: float,
                   mistake: str = "") -> tuple[tuple, list[torch.Tensor]]:
    """((step_ok, new_scale, new_good_steps), the gradients after) of the update done right or with one slip."""
    after = [g * scale if mistake == "multiply" else g.clone() if mistake == "not in place" else g / scale
             for g in grads]
    tested = after[:1] if mistake == "first only" else after
    if mistake == "isinf only":
        overflow = any(bool(torch.isinf(g).any()) for g in tested)
    elif mistake == "sum":
        overflow = not all(bool(torch.isfinite(g.sum())) for g in tested)
    else:
        overflow = not all(bool(torch.isfinite(g).all()) for g in tested)
    if mistake == "grow on overflow":
        count = good + 1
        new_scale = scale * growth if count == interval else scale
        count = 0 if count == interval else count
        if overflow:
            return (False, new_scale * backoff, 0), after
        return (True, new_scale, count), after
    if overflow:
        return (mistake == "ok on overflow", scale * backoff, good if mistake == "no reset" else 0), after
    count = good + 1
    at = {"late": count > interval, "early": count == interval - 1}.get(mistake, count == interval)
    if at:
        return (True, scale * growth, count if mistake == "keep count" else 0), after
    return (True, scale, count), after


HINT_SCALER_SUM = (
    "your update skipped a step whose gradients were all finite (on {what}): a tensor's sum can overflow where none "
    "of its numbers does (two float16 numbers near 60,000 sum past float16's largest, 65,504), so test every "
    "number for being finite, not a sum of them"
)

SCALER_MISTAKES = (("isinf only", HINT_SCALER_ISINF), ("first only", HINT_SCALER_FIRST),
                   ("no reset", HINT_SCALER_NO_RESET), ("late", HINT_SCALER_LATE), ("early", HINT_SCALER_LATE),
                   ("keep count", HINT_SCALER_KEEP_COUNT), ("multiply", HINT_SCALER_MULTIPLIED),
                   ("not in place", HINT_SCALER_NOT_IN_PLACE), ("ok on overflow", HINT_SCALER_OK_OVERFLOW),
                   ("grow on overflow", HINT_SCALER_GROW_OVERFLOW), ("sum", HINT_SCALER_SUM))

SCALER_RUN = """\
def _nb20_scaler_step(step):
    grads = [torch.from_numpy(np.array(a)).to(getattr(torch, d)) for a, d in zip(step['grads'], step['dtypes'])]
    try:
        got = scaler_update(grads, step['scale'], step['good'], step['interval'], growth=step['growth'],
                            backoff=step['backoff'])
    except NotImplementedError:
        return 'not done'
    except Exception as err:
        return 'raised ' + (type(err).__name__ + ': ' + str(err))[:300]
    after = [g.detach().double().numpy() for g in grads]
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        size = ' of ' + str(len(got)) + ' items' if isinstance(got, (tuple, list)) else ''
        return {'returned': 'a ' + type(got).__name__ + size, 'after': after}
    values = []
    for item, kind in zip(got, (bool, float, int)):
        if isinstance(item, torch.Tensor) and item.numel() == 1:
            item = item.item()
        if isinstance(item, np.generic):
            item = item.item()
        if not isinstance(item, (bool, int, float)):
            return {'returned': 'a triple holding a ' + type(item).__name__, 'after': after}
        values.append(kind(item))
    return {'ok': values[0], 'scale': values[1], 'good': values[2], 'after': after}


outputs = {'results': [[_nb20_scaler_step(s) for s in stream['steps']] for stream in inputs['streams']]}
"""


def _scaler_stream(rng: np.random.Generator, what: str, plan: str, interval: int, dtypes: list[str],
                   scale: float, growth: float = 2.0, backoff: float = 0.5) -> dict:
    """One stream of steps; ``plan`` a letter a step: ``.`` clean, ``+``/``-`` +inf/-inf, ``n`` NaN, each overflow
    in a tensor drawn at random (the first tensor for a capital letter), ``b`` a tensor of finite numbers near
    float16's largest (with a scale of 1: their sum overflows, they do not). Each step's incoming scale and count are
    the reference's."""
    steps, good = [], 0
    for letter in plan:
        grads = [np.asarray(scale * rng.standard_normal(int(rng.integers(2, 6))) * 1e-3, dtype=d) for d in dtypes]
        if letter.lower() == "b":
            which = 0 if letter.isupper() else int(rng.integers(1, len(grads)))
            grads[which][:] = float(rng.uniform(3.5e4, 6e4)) * (1 if rng.random() < 0.5 else -1)
        elif letter != ".":
            which = 0 if letter.isupper() else int(rng.integers(1, len(grads)))
            where = int(rng.integers(0, grads[which].size))
            grads[which][where] = {"+": np.inf, "-": -np.inf, "n": np.nan}[letter.lower()]
        steps.append({"grads": grads, "dtypes": list(dtypes), "scale": scale, "good": good, "interval": interval,
                      "growth": growth, "backoff": backoff, "letter": letter})
        (ok, scale, good), _ = scaler_variant([torch.from_numpy(g.astype(np.float64)) for g in grads], scale, good,
                                              interval, growth, backoff)
    return {"what": what, "steps": steps}


def scaler_cases(rng: np.random.Generator, label: Callable[[int, str], str] = lambda i, w: w) -> dict:
    """Streams with +inf, -inf and NaN in later tensors and in the first, float16 and float32 gradients, growth
    intervals of 1 to 4, an overflow on the step that would have grown the scale."""
    specs = [
        ("growth interval 3, float32 and float16 gradients", "...+..n...", 3, ["float32", "float16", "float32"],
         2.0 ** 10, 2.0, 0.5),
        ("growth interval 2, float16 gradients, overflows in the first tensor", ".N.-..+.", 2,
         ["float16", "float16"], 2.0 ** 12, 2.0, 0.5),
        ("growth interval 4, float32 gradients, growth 3 and backoff 0.25", "....n..-.....", 4,
         ["float32", "float32", "float32"], 2.0 ** 8, 3.0, 0.25),
        ("growth interval 1, float32 and float16 gradients", "..n.+.", 1, ["float32", "float16"], 2.0 ** 6, 2.0, 0.5),
        ("growth interval 3, float16 gradients near float16's largest number, scale 1", ".B.b", 3,
         ["float16", "float16"], 1.0, 2.0, 0.5),
    ]
    streams = []
    for i, (what, plan, interval, dtypes, scale, growth, backoff) in enumerate(specs):
        if scale != 1.0:  # (a scale of 1 keeps the large float16 numbers finite once divided)
            scale *= 2.0 ** int(rng.integers(-2, 3))
        streams.append(_scaler_stream(rng, label(i, what), plan, interval, dtypes, scale, growth, backoff))
    return {"streams": streams}


def _step_what(stream: dict, k: int) -> str:
    step = stream["steps"][k]
    kind = {".": "clean gradients", "+": "+inf", "-": "-inf", "n": "NaN",
            "b": "large but finite numbers"}[step["letter"].lower()]
    where = "" if step["letter"] == "." else (" in the first tensor" if step["letter"].isupper() else
                                              " in a later tensor")
    return (f"{stream['what']}, step {k + 1}: {kind}{where}, scale {step['scale']:g}, {step['good']} clean steps "
            f"before it")


def judge_scaler(results: list, streams: list) -> None:
    """Raise a CheckFailure naming the slip unless every step returns the reference's triple and leaves the gradients
    divided by the scale."""
    if len(results) != len(streams) or not all(isinstance(r, list) and len(r) == len(s["steps"])
                                               for r, s in zip(results, streams)):
        raise CheckFailure(HINT_NOT_RUN.format(function="scaler_update"))
    flat = [(s, k, r) for s, rs in zip(streams, results) for k, r in enumerate(rs)]
    for stream, k, result in flat:
        if result == "not done":
            raise ExerciseNotDone(NOT_DONE_MESSAGE)
        if not (isinstance(result, str) or isinstance(result, dict) and isinstance(result.get("after"), list)):
            raise CheckFailure(HINT_NOT_RUN.format(function="scaler_update"))

    def args(stream: dict, k: int) -> tuple:
        step = stream["steps"][k]
        grads = [torch.from_numpy(np.array(g)).to(getattr(torch, d)) for g, d in zip(step["grads"], step["dtypes"])]
        return grads, step["scale"], step["good"], step["interval"], step["growth"], step["backoff"]

    def same(got: dict, want: tuple) -> bool:
        (ok, scale, good), after = want
        return ("returned" not in got and got["ok"] == ok and math.isclose(got["scale"], scale, rel_tol=1e-9)
                and got["good"] == good and _grads_same(got["after"], after))

    def _grads_same(got: list, want: list) -> bool:
        return len(got) == len(want) and all(
            _close(torch.from_numpy(np.array(g, dtype=np.float64)), w.double(), rtol=2e-3, atol=1e-6)
            for g, w in zip(got, want))

    wants = [scaler_variant(*args(s, k)) for s, k, _ in flat]
    answered = [i for i, (_, _, r) in enumerate(flat) if isinstance(r, dict)]
    bad = [i for i in answered if not same(flat[i][2], wants[i])]
    if bad:
        for mistake, hint in SCALER_MISTAKES:
            variants = [scaler_variant(*args(s, k), mistake=mistake) for s, k, _ in flat]
            differing = [i for i in answered if not same({"ok": variants[i][0][0], "scale": variants[i][0][1],
                                                          "good": variants[i][0][2],
                                                          "after": [a.double().numpy() for a in variants[i][1]]},
                                                         wants[i])]
            if differing and all(same(flat[i][2], variants[i]) for i in answered):
                raise CheckFailure(hint.format(what=_step_what(flat[differing[0]][0], flat[differing[0]][1])))
    for i in bad:
        got = flat[i][2]
        if "returned" in got:
            raise CheckFailure(HINT_SCALER_RETURN.format(got=got["returned"], what=_step_what(flat[i][0], flat[i][1])))
    for stream, k, result in flat:
        if isinstance(result, str):
            raise CheckFailure(HINT_SCALER_RAISED.format(what=_step_what(stream, k),
                                                         error=result.removeprefix("raised "), call=HINT_SCALER_CALL))
    for i in bad:
        got, ((ok, scale, good), after) = flat[i][2], wants[i]
        what = _step_what(flat[i][0], flat[i][1])
        for index, (g, w) in enumerate(zip(got["after"], after)):
            g = torch.from_numpy(np.array(g, dtype=np.float64))
            if not _close(g, w.double(), rtol=2e-3, atol=1e-6):
                err = float((g - w.double()).abs().nan_to_num(float("inf")).max()) if g.shape == w.shape else math.inf
                raise CheckFailure(HINT_SCALER_GRADS.format(index=index, what=what, err=err))
        for name, g, w in (("step_ok", got["ok"], ok), ("new_scale", got["scale"], scale),
                           ("new_good_steps", got["good"], good)):
            if g != w and not (isinstance(w, float) and math.isclose(g, w, rel_tol=1e-9)):
                raise CheckFailure(HINT_SCALER_DIFFERS.format(name=name, got=g, what=what, want=w))


@checker("the loss scaler's update")
def check_scaler_update(scaler_update) -> None:
    """Check ``scaler_update(grads, scale, good_steps, growth_interval, growth=, backoff=)`` step by step over
    streams of gradients with overflows against :func:`tfedu.parallel.scaler_update` (torch's GradScaler's rule)."""
    _refuse(scaler_update, "scaler_update", "the loss scaler's update")
    inputs = scaler_cases(np.random.default_rng(2004))
    judge_scaler(_run(SCALER_RUN, "scaler_update", scaler_update, inputs)["results"], inputs["streams"])


# ----------------------------------------------------------------------------- the hidden tests and the hints


def _probe_inputs(cases: Callable) -> Callable[[np.random.Generator], dict]:
    return lambda rng: cases(rng, _hidden)


def _compare(judge: Callable[[list, list], None], key: str, function: str) -> Callable[[Any, dict], str | None]:
    def compare(outputs: Any, expected: dict) -> str | None:
        if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list):
            return HINT_NOT_RUN.format(function=function)
        try:
            judge(outputs["results"], expected[key])
        except ExerciseNotDone:
            return f"{function} is not done yet"
        except CheckFailure as failure:
            return f"hidden test: {failure}"
        return None

    return compare


PROBES = {
    "check_ring_all_reduce": Probe(
        exercise="ex_ring_all_reduce",
        make_inputs=_probe_inputs(ring_cases),
        run=RING_RUN,
        reference=lambda inputs: dict(inputs),
        compare=_compare(judge_ring, "cases", "ring_all_reduce"),
        forbidden=FORBIDDEN,
        builds=ELEMENTARY | {"torch.tensor_split"}),
    "check_sharded_adamw": Probe(
        exercise="ex_sharded_adamw",
        make_inputs=_probe_inputs(zero_cases),
        run=ZERO_RUN,
        reference=lambda inputs: dict(inputs),
        compare=_compare(judge_zero, "cases", "ShardedAdamW"),
        forbidden=FORBIDDEN,
        builds=ELEMENTARY | MODULES | {"torch.optim.AdamW", "torch.tensor_split"}),
    "check_parallel_mlp": Probe(
        exercise="ex_parallel_mlp",
        make_inputs=_probe_inputs(mlp_cases),
        run=MLP_RUN,
        reference=lambda inputs: dict(inputs),
        compare=_compare(judge_mlp, "cases", "parallel_mlp"),
        forbidden=FORBIDDEN,
        builds=ELEMENTARY | ACTIVATIONS | {"torch.nn.functional.linear", "torch.tensor_split"}),
    "check_scaler_update": Probe(
        exercise="ex_scaler_update",
        make_inputs=_probe_inputs(scaler_cases),
        run=SCALER_RUN,
        reference=lambda inputs: dict(inputs),
        compare=_compare(judge_scaler, "streams", "scaler_update"),
        forbidden=FORBIDDEN,
        builds=ELEMENTARY),
}


HINTS = {
    "ex_ring_all_reduce": Hints(
        number="20.1",
        check="check_ring_all_reduce",
        idea=(
            "Cut x into N chunks, the same way on every rank. In the first phase (reduce-scatter) the chunks travel "
            "round the ring, each rank adding its own numbers to the chunk passing through: after N - 1 steps every "
            "chunk has collected all N contributions, each finished on a different rank. In the second phase "
            "(all-gather) the finished chunks travel round once more, copied rather than added, until every rank "
            "has all of them. Each step a rank sends one chunk to the next rank and receives one from the rank before."
        ),
        approach=(
            "Let r be the rank and N the world size; the next rank is r + 1 and the previous r - 1, both modulo N. "
            "Make a list of copies of x's N chunks (tensor_split, so the sizes may differ by one). Reduce-scatter: "
            "for s from 0 to N - 2, send chunk (r - s) mod N to the next rank, receive into a fresh tensor shaped "
            "like chunk (r - s - 1) mod N from the previous one, and add it to that chunk. All-gather: for s from 0 "
            "to N - 2, send chunk (r + 1 - s) mod N and receive straight into chunk (r - s) mod N. Send first, then "
            "receive (send does not wait). Finish with wait, and join the chunks."
        ),
        skeleton=(
            "def ring_all_reduce(x, comm):\n"
            "    n, r = ____\n"
            "    chunks = ____  # copies of x's n chunks\n"
            "    nxt, prev = ____\n"
            "    for s in ____:  # reduce-scatter: N - 1 steps\n"
            "        ____  # send one chunk to the next rank\n"
            "        incoming = ____\n"
            "        ____  # add what arrived from the previous rank to its chunk\n"
            "    for s in ____:  # all-gather: N - 1 steps\n"
            "        ____\n"
            "        ____\n"
            "    comm.wait()\n"
            "    return ____\n"
        ),
    ),
    "ex_sharded_adamw": Hints(
        number="20.2",
        check="check_sharded_adamw",
        idea=(
            "Every rank keeps the whole model but the optimizer's state for 1/N of it. View the parameters as one "
            "flat vector, padded with zeros so that it cuts into N equal shards; rank r owns shard r. A step sums "
            "the ranks' flat gradients and hands each rank only the sum over its own shard (reduce-scatter), turns "
            "the sum into the mean, lets an ordinary AdamW update that shard, then hands every rank every updated "
            "shard (all-gather), which it copies back into its parameters."
        ),
        approach=(
            "In the constructor: keep the parameters' list and sizes, the total numel, the shard size ceil(numel / "
            "N) and the padded length N times it. Flatten the parameters (cat of their reshaped copies), pad with "
            "zeros, take this rank's piece as a new leaf tensor, and build torch.optim.AdamW over it alone with the "
            "options; keep it as self.optimizer. In step (under no_grad): flatten and pad the gradients the same "
            "way, reduce-scatter them into a shard-sized tensor, divide by N and set it as the shard's grad; step "
            "the optimizer; all-gather the shard into a padded-length tensor; split its first numel numbers by the "
            "parameters' sizes and copy each into its parameter."
        ),
        skeleton=(
            "class ShardedAdamW:\n"
            "    def __init__(self, params, comm, **options):\n"
            "        self.params, self.comm = ____\n"
            "        self.numel = ____\n"
            "        self.shard_size = ____\n"
            "        flat = ____  # the parameters flattened and padded with zeros\n"
            "        self.shard = ____  # this rank's piece, a leaf tensor of its own\n"
            "        self.optimizer = ____\n"
            "\n"
            "    @torch.no_grad()\n"
            "    def step(self):\n"
            "        flat_grad = ____\n"
            "        mine = ____  # reduce-scattered, then the mean\n"
            "        self.shard.grad = mine\n"
            "        self.optimizer.step()\n"
            "        whole = ____  # every rank's updated shard\n"
            "        ____  # copied back into each parameter\n"
        ),
    ),
    "ex_parallel_mlp": Hints(
        number="20.3",
        check="check_parallel_mlp",
        idea=(
            "The MLP's hidden features are independent of each other until W_out mixes them. So give each rank d_mlp / "
            "N of them: it computes its features from the whole input (its rows of W_in and b_in: column-parallel), "
            "applies GELU to them, which needs no other rank, and turns them into a partial output with the "
            "matching columns of W_out (row-parallel). The output is the sum of the ranks' partial outputs: one "
            "all-reduce. b_out belongs to the whole output, so it is added once, after the sum."
        ),
        approach=(
            "Find the width d_mlp / N (raise an error if it does not divide) and this rank's slice of hidden "
            "features, from rank times width to the next multiple. Multiply x by the transpose of W_in's rows in "
            "that slice and add b_in's slice; apply the exact GELU; multiply by the transpose of W_out's columns in "
            "that slice, which gives (..., d_model). All-reduce that partial output (it sums in place and returns it), "
            "then add b_out."
        ),
        skeleton=(
            "def parallel_mlp(x, W_in, b_in, W_out, b_out, comm):\n"
            "    width = ____  # hidden features per rank (check that it divides)\n"
            "    mine = ____  # this rank's hidden features\n"
            "    hidden = ____  # (..., width)\n"
            "    partial = ____  # (..., d_model)\n"
            "    return ____\n"
        ),
    ),
    "ex_scaler_update": Hints(
        number="20.4",
        check="check_scaler_update",
        idea=(
            "The gradients were computed from the loss times the scale, so first divide every one of them by the "
            "scale, in place. If any number in any of them is inf or NaN, the scale was too large: skip the step, "
            "shrink the scale by backoff and start counting clean steps from zero. Otherwise the step is taken and "
            "the count grows by one; when it reaches growth_interval, grow the scale by growth and start the count "
            "again, so the scale keeps probing upwards."
        ),
        approach=(
            "Loop over grads dividing each in place. Then test every tensor with isfinite and all (NaN counts as "
            "not finite, as inf does). On an overflow return False, the scale times backoff and 0. Otherwise add one "
            "to good_steps; if it equals growth_interval return True, the scale times growth and 0; else return "
            "True, the same scale and the new count."
        ),
        skeleton=(
            "def scaler_update(grads, scale, good_steps, growth_interval, *, growth=2.0, backoff=0.5):\n"
            "    for g in grads:\n"
            "        ____  # unscale in place\n"
            "    overflow = ____  # any inf or NaN in any tensor\n"
            "    if overflow:\n"
            "        return ____\n"
            "    good_steps = ____\n"
            "    if ____:\n"
            "        return ____\n"
            "    return ____\n"
        ),
    ),
}
