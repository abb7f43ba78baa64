"""Checkers and probes of notebook 20: each passes right answers and names realistic mistakes.

The learner's SPMD code runs as ranks in threads of this process (no process is started); a deadlock waits
nb20.TIMEOUT seconds, so the deadlock tests are the slow ones."""

import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import checker_helpers as helpers
from checker_helpers import failure_of, not_done, verdict
from torch.amp import GradScaler

from tfedu import parallel
from tfedu.checks import nb20_parallel_training as nb20
from tfedu.checks.core import ExerciseNotDone

pytestmark = pytest.mark.usefixtures("one_torch_thread")

names_everywhere = functools.partial(helpers.names_everywhere, nb20.PROBES)
passes_everywhere = functools.partial(helpers.passes_everywhere, nb20.PROBES)
check_time = helpers.check_time


# ----------------------------------------------------------------------------- 20.1 the ring all-reduce


def ring_all_reduce(x, comm, mistake=""):
    """A learner's answer, right or with one ``mistake``."""
    n, r = comm.world_size, comm.rank
    nxt, prev = (r + 1) % n, (r - 1) % n
    if mistake == "collective":
        return comm.all_reduce(x.clone())
    if mistake == "whole ring":  # the whole tensor passed round, added up on the way
        total, piece = x.clone(), x.clone()
        for _ in range(n - 1):
            comm.send(piece, nxt)
            piece = comm.recv(torch.empty_like(x), prev)
            total += piece
        return total
    if mistake == "every rank":
        for d in range(n):
            if d != r:
                comm.send(x, d)
        total = x.clone()
        for s in range(n):
            if s != r:
                total += comm.recv(torch.empty_like(x), s)
        return total
    if mistake == "other rank":  # a ring the other way round: right sum, sends to the previous rank
        nxt, prev = prev, nxt
        chunks = [c.clone() for c in x.tensor_split(n)]
        for s in range(n - 1):
            comm.send(chunks[(r + s) % n], nxt)
            chunks[(r + s + 1) % n] += comm.recv(torch.empty_like(chunks[(r + s + 1) % n]), prev)
        for s in range(n - 1):
            comm.send(chunks[(r - 1 + s) % n], nxt)
            comm.recv(chunks[(r + s) % n], prev)
        return torch.cat(chunks)
    chunks = list(x.tensor_split(n)) if mistake == "in place" else [c.clone() for c in x.tensor_split(n)]
    if mistake == "by rank":
        chunks = chunks[r:] + chunks[:r]
    for s in range(n if mistake == "n steps" else n - 1):
        send, recv = (r - s) % n, (r - s - 1) % n
        if mistake == "recv first":
            incoming = comm.recv(torch.empty_like(chunks[recv]), prev)
            comm.send(chunks[send], nxt)
        else:
            comm.send(chunks[send], nxt)
            incoming = comm.recv(torch.empty_like(chunks[recv]), prev)
        chunks[recv] += incoming
    if mistake == "rs only":
        return torch.cat(chunks)
    if mistake == "list":
        return chunks
    if mistake == "chunk only":
        return chunks[(r + 1) % n]
    offset = 0 if mistake == "ag off" else 1
    for s in range(n - 2 if mistake == "uneven" and r == 0 else n - 1):
        comm.send(chunks[(r + offset - s) % n], nxt)
        comm.recv(chunks[(r + offset - 1 - s) % n], prev)
    comm.wait()
    out = torch.cat(chunks)
    if mistake == "average":
        return out / n
    if mistake == "float32":
        return out.float()
    if mistake == "alias" and n == 1:
        return x
    return out


def ring_all_reduce_lists(x, comm):
    """Another right way: chunk boundaries computed by hand, pieces received into fresh tensors and copied."""
    n, r = comm.world_size, comm.rank
    base, extra = divmod(x.numel(), n)
    bounds = [0]
    for k in range(n):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    parts = [x[bounds[k]:bounds[k + 1]].clone() for k in range(n)]
    for step in range(2 * (n - 1)):
        out_k = (r - step) % n if step < n - 1 else (r + 1 - (step - n + 1)) % n
        in_k = (out_k - 1) % n
        comm.send(parts[out_k], (r + 1) % n)
        got = comm.recv(torch.zeros(bounds[in_k + 1] - bounds[in_k], dtype=x.dtype), (r - 1) % n)
        parts[in_k] = parts[in_k] + got if step < n - 1 else got
    return torch.cat(parts)


RING_MISTAKES = {
    "collective": "build it from sends and receives",
    "whole ring": "2 (N - 1) n",
    "every rank": "sends only to the next one",
    "other rank": "sends only to the next one",
    "in place": "changed its input x in place",
    "by rank": "the same way",
    "n steps": "N steps where it needs N - 1",
    "recv first": "every rank waited to receive first",
    "rs only": "full sum in one chunk only",
    "chunk only": "returned one chunk",
    "ag off": "all-gather passes the wrong chunk",
    "average": "returned the mean",
    "float32": "keep x's dtype",
    "alias": "returned x itself",
    "list": "return a floating-point tensor",
    "uneven": "pair up one to one",
}


def test_ring_all_reduce_passes_right_answers():
    for fn in (ring_all_reduce, ring_all_reduce_lists):
        passes_everywhere(nb20.check_ring_all_reduce, "check_ring_all_reduce", "ring_all_reduce", fn)


@pytest.mark.parametrize("mistake", RING_MISTAKES)
def test_ring_all_reduce_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb20.check_ring_all_reduce, "check_ring_all_reduce", "ring_all_reduce",
                     lambda x, comm, m=mistake: ring_all_reduce(x, comm, mistake=m), RING_MISTAKES[mistake])


def test_ring_whole_tensors_are_priced_and_every_rank_ends_with_the_sum():
    message = failure_of(nb20.check_ring_all_reduce, lambda x, c: ring_all_reduce(x, c, mistake="whole ring"))
    assert "the whole of x" in message and "N / 2" in message, message


def test_ring_all_reduce_refuses_the_library_waits_and_is_quick():
    assert "tfedu" in failure_of(nb20.check_ring_all_reduce, lambda x, comm: parallel.ring_all_reduce(x, comm))
    with pytest.raises(ExerciseNotDone):
        nb20.check_ring_all_reduce(not_done)
    assert check_time(nb20.check_ring_all_reduce, ring_all_reduce) < 1.0


# ----------------------------------------------------------------------------- 20.2 ZeRO stage 1


def make_sharded(mistake=""):
    """A learner's ShardedAdamW, right or with one ``mistake``."""

    class Sharded:
        def __init__(self, params, comm, **options):
            if mistake == "generator":
                params[0]  # a learner who takes params for a list
            if mistake == "read twice":
                params = [p for p in params if p.requires_grad] and [p for p in params if p.requires_grad]
            keep = mistake in ("no filter", "none grad")  # frozen parameters kept in the flat vector
            self.params, self.comm = [p for p in params if keep or p.requires_grad], comm
            n, r = comm.world_size, comm.rank
            self.numel = sum(p.numel() for p in self.params)
            self.shard_size = self.numel // n if mistake == "floor" else math.ceil(self.numel / n)
            self.padded = n * self.shard_size
            self.options = options
            flat = self.flat([p.detach() for p in self.params])
            if mistake == "all params":
                self.optimizer = torch.optim.AdamW(self.params, **options)
            else:
                self.shard = torch.nn.Parameter(flat[r * self.shard_size:(r + 1) * self.shard_size].clone())
                if mistake == "float32":
                    self.shard = torch.nn.Parameter(self.shard.detach().float())
                self.optimizer = torch.optim.AdamW([self.shard], **options)

        def flat(self, tensors):
            flat = torch.cat([t.reshape(-1) for t in tensors])
            if mistake == "no pad":
                return flat
            if mistake == "floor":
                return flat[:self.padded]
            return torch.cat([flat, flat.new_zeros(self.padded - self.numel)])

        def zero_grad(self):
            for p in self.params:
                p.grad = None

        @torch.no_grad()
        def step(self):
            n, r = self.comm.world_size, self.comm.rank
            grad = self.flat([p.grad if p.grad is not None or mistake == "none grad" else torch.zeros_like(p)
                              for p in self.params])
            if mistake == "float32":
                grad = grad.float()
            if mistake == "all params":
                self.comm.all_reduce(grad)
                for p, g in zip(self.params, grad[:self.numel].split([p.numel() for p in self.params])):
                    p.grad.copy_(g.view_as(p) / n)
                self.optimizer.step()
                return
            mine = grad.new_empty(self.shard_size)
            if mistake == "all-reduce":
                mine.copy_(self.comm.all_reduce(grad.clone())[r * self.shard_size:(r + 1) * self.shard_size])
            else:
                self.comm.reduce_scatter(mine, grad)
            if mistake == "extra all-reduce":
                self.comm.all_reduce(grad.clone())
            self.shard.grad = mine if mistake == "sum" else mine / n
            if mistake == "rebuilt":
                self.optimizer = torch.optim.AdamW([self.shard], **self.options)
            self.optimizer.step()
            if mistake == "no gather":
                whole = self.flat([p.detach() for p in self.params])
                whole[r * self.shard_size:(r + 1) * self.shard_size] = self.shard.detach()
            else:
                whole = grad.new_empty(self.padded)
                self.comm.all_gather(whole, self.shard.detach())
            if mistake == "floor":  # the numbers past the last shard keep their old values
                whole = torch.cat([whole, torch.cat([p.detach().reshape(-1) for p in self.params])[self.padded:]])
            offset = 0
            for p in self.params:
                if mistake != "unchanged":
                    p.copy_(whole[offset:offset + p.numel()].view_as(p).to(p.dtype))
                offset += p.numel()

    return Sharded


class ShardedByRanges:
    """Another right way: owned ranges, the shard kept as a float tensor and the moments in AdamW, parameters written
    back one by one from the gathered vector."""

    def __init__(self, params, comm, **options):
        self.params, self.comm = [p for p in params if p.requires_grad], comm
        total = sum(p.numel() for p in self.params)
        self.per = -(-total // comm.world_size)
        self.total = total
        with torch.no_grad():
            whole = torch.zeros(self.per * comm.world_size, dtype=self.params[0].dtype)
            whole[:total] = torch.cat([p.flatten() for p in self.params])
        self.piece = whole[comm.rank * self.per:(comm.rank + 1) * self.per].clone().requires_grad_(True)
        self.optimizer = torch.optim.AdamW([self.piece], **options)

    def zero_grad(self):
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    def step(self):
        with torch.no_grad():
            whole = torch.zeros(self.per * self.comm.world_size, dtype=self.piece.dtype)
            whole[:self.total] = torch.cat([p.grad.flatten() for p in self.params])
            mine = torch.zeros(self.per, dtype=whole.dtype)
            self.comm.reduce_scatter(mine, whole)
            self.piece.grad = mine / self.comm.world_size
        self.optimizer.step()
        with torch.no_grad():
            gathered = torch.zeros_like(whole)
            self.comm.all_gather(gathered, self.piece.detach())
            start = 0
            for p in self.params:
                p.copy_(gathered[start:start + p.numel()].reshape(p.shape))
                start += p.numel()


ZERO_MISTAKES = {
    "sum": "mean of the ranks' gradients",
    "no gather": "ranks' parameters differ",
    "floor": "never updated",
    "no pad": "padded with zeros",
    "all params": "keeps state for every parameter",
    "rebuilt": "Adam started afresh",
    "extra all-reduce": "doubles the traffic",
    "all-reduce": "whole gradient",
    "float32": "keep the shard in the parameters' dtype",
    "no filter": "does not require grad",
    "none grad": "may be None",
    "generator": "make a list of it first",
    "read twice": "empty the second time it is read",
    "unchanged": "did not move",
}


def test_sharded_adamw_passes_right_answers():
    for fn in (make_sharded(), ShardedByRanges):
        passes_everywhere(nb20.check_sharded_adamw, "check_sharded_adamw", "ShardedAdamW", fn)


@pytest.mark.parametrize("mistake", ZERO_MISTAKES)
def test_sharded_adamw_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb20.check_sharded_adamw, "check_sharded_adamw", "ShardedAdamW", make_sharded(mistake),
                     ZERO_MISTAKES[mistake])


def test_sharded_adamw_refuses_the_library_waits_and_is_quick():
    assert "tfedu" in failure_of(nb20.check_sharded_adamw, parallel.ShardedAdamW)

    class Subclass(parallel.ShardedAdamW):
        pass

    assert "tfedu" in failure_of(nb20.check_sharded_adamw, Subclass)

    class NotDone:
        def __init__(self, params, comm, **options):
            raise NotImplementedError

    with pytest.raises(ExerciseNotDone):
        nb20.check_sharded_adamw(NotDone)
    assert check_time(nb20.check_sharded_adamw, make_sharded()) < 2.0


# ----------------------------------------------------------------------------- 20.3 the tensor-parallel MLP


def parallel_mlp(x, W_in, b_in, W_out, b_out, comm, mistake=""):
    """A learner's answer, right or with one ``mistake``."""
    n, r = comm.world_size, comm.rank
    d_mlp = W_in.shape[0]
    if d_mlp % n:
        if mistake == "floor":
            pass
        elif mistake == "runtime error":
            raise RuntimeError("oops")
        else:
            raise ValueError(f"d_mlp {d_mlp} does not split over {n} ranks")
    w = d_mlp // n
    mine = slice(r * w, (r + 1) * w)
    if mistake == "whole":
        return F.gelu(x @ W_in.T + b_in) @ W_out.T + b_out
    if mistake == "input split":
        pre = x.tensor_split(n, -1)[r] @ W_in.tensor_split(n, 1)[r].T + b_in
        return comm.all_reduce(F.gelu(pre) @ W_out.T) + b_out
    if mistake == "x synced":
        x = comm.all_reduce(x.clone()) / n
    bias = {"b_in whole": b_in, "b_in first": b_in[:w]}.get(mistake, b_in[mine])
    pre = x @ W_in[mine].T + bias
    if mistake == "gelu after":
        return F.gelu(comm.all_reduce(pre @ W_out[:, mine].T)) + b_out
    if mistake == "gelu after bias":
        return F.gelu(comm.all_reduce(pre @ W_out[:, mine].T) + b_out)
    if mistake == "no gelu":
        return comm.all_reduce(pre @ W_out[:, mine].T) + b_out
    if mistake == "all features":
        return comm.all_reduce(F.gelu(x @ W_in.T + b_in)[..., mine] @ W_out[:, mine].T) + b_out
    hidden = F.gelu(pre, approximate="tanh" if mistake == "tanh" else "none")
    if mistake == "gather hidden":
        pieces = hidden.new_empty(n, *hidden.shape)
        comm.all_gather(pieces, hidden.contiguous())
        return torch.cat(pieces.unbind(0), dim=-1) @ W_out.T + b_out
    partial = hidden @ (W_out[mine].T if mistake == "w_out rows" else W_out[:, mine].T)
    if mistake == "b_out before":
        return comm.all_reduce(partial + b_out)
    if mistake == "no reduce":
        return partial + b_out
    out = comm.all_reduce(partial) + b_out
    return out.float() if mistake == "float32" else out


def parallel_mlp_linear(x, W_in, b_in, W_out, b_out, comm):
    """Another right way: F.linear on chunks, the bias added to a copy after the sum."""
    if W_in.shape[0] % comm.world_size:
        raise ValueError("d_mlp must divide by world_size")
    W_in_part = W_in.chunk(comm.world_size, dim=0)[comm.rank]
    b_in_part = b_in.chunk(comm.world_size)[comm.rank]
    W_out_part = W_out.chunk(comm.world_size, dim=1)[comm.rank]
    partial = F.linear(F.gelu(F.linear(x, W_in_part, b_in_part)), W_out_part)
    total = comm.all_reduce(partial)
    return total + b_out


MLP_MISTAKES = {
    "whole": "split the work",
    "input split": "cannot come after a sum of partial results",
    "gelu after": "cannot come after a sum of partial results",
    "b_in whole": "b_in",
    "b_in first": "same slice of b_in",
    "w_out rows": "columns of W_out",
    "b_out before": "counted N times",
    "no reduce": "partial output",
    "gather hidden": "hidden features",
    "x synced": "one all-reduce of the",
    "floor": "cannot split the hidden features evenly",
    "float32": "keep the inputs' dtype",
    "tanh": "tanh approximation",
    "gelu after bias": "cannot come after a sum of partial results",
    "no gelu": "has no activation",
    "all features": "computed all d_mlp hidden features",
    "runtime error": "raise a ValueError",
}


def test_parallel_mlp_passes_right_answers():
    for fn in (parallel_mlp, parallel_mlp_linear):
        passes_everywhere(nb20.check_parallel_mlp, "check_parallel_mlp", "parallel_mlp", fn)


@pytest.mark.parametrize("mistake", MLP_MISTAKES)
def test_parallel_mlp_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb20.check_parallel_mlp, "check_parallel_mlp", "parallel_mlp",
                     lambda *a, m=mistake: parallel_mlp(*a, mistake=m), MLP_MISTAKES[mistake])


def test_parallel_mlp_refuses_the_library_waits_and_is_quick():
    assert "tfedu" in failure_of(nb20.check_parallel_mlp, lambda *a: parallel.parallel_mlp(*a))
    with pytest.raises(ExerciseNotDone):
        nb20.check_parallel_mlp(not_done)
    assert check_time(nb20.check_parallel_mlp, parallel_mlp) < 1.0


# ----------------------------------------------------------------------------- 20.4 the loss scaler's update


def scaler_update(grads, scale, good_steps, growth_interval, *, growth=2.0, backoff=0.5, mistake=""):
    """A learner's answer, right or with one ``mistake``."""
    if mistake == "multiply":
        for g in grads:
            g.mul_(scale)
    elif mistake == "not in place":
        grads = [g / scale for g in grads]
    else:
        for g in grads:
            g.div_(scale)
    tested = grads[:1] if mistake == "first only" else grads
    test = torch.isinf if mistake == "isinf only" else (lambda g: ~torch.isfinite(g.sum())) if mistake == "sum" \
        else (lambda g: ~torch.isfinite(g))
    overflow = any(bool(test(g).any()) for g in tested)
    if mistake == "grow on overflow":
        good_steps += 1
        if good_steps == growth_interval:
            scale, good_steps = scale * growth, 0
        if overflow:
            return False, scale * backoff, 0
        return True, scale, good_steps
    if overflow:
        return mistake == "ok on overflow", scale * backoff, good_steps if mistake == "no reset" else 0
    good_steps += 1
    if (good_steps > growth_interval if mistake == "late" else good_steps == growth_interval - 1 if mistake == "early"
            else good_steps == growth_interval):
        return True, scale * growth, good_steps if mistake == "keep count" else 0
    if mistake == "pair":
        return True, scale
    if mistake == "tensor scale":
        return torch.tensor(True), torch.tensor(scale), good_steps
    return True, scale, good_steps


def scaler_update_flags(grads, scale, good_steps, growth_interval, *, growth=2.0, backoff=0.5):
    """Another right way: one stacked finiteness test, the scale's update written out, tensors returned."""
    inv = 1.0 / scale
    finite = True
    for g in grads:
        g.mul_(inv)
        finite = finite and bool(torch.isfinite(g).all())
    if not finite:
        return False, backoff * scale, 0
    good_steps = (good_steps + 1) % growth_interval
    return True, scale * (growth if good_steps == 0 else 1.0), good_steps


SCALER_MISTAKES = {
    "sum": "a tensor's sum can overflow",
    "isinf only": "NaN gradient went unnoticed",
    "first only": "later tensor went unnoticed",
    "no reset": "count of clean steps went on",
    "late": "grew one step off",
    "early": "grew one step off",
    "keep count": "count was not reset",
    "multiply": "multiplied by the scale",
    "not in place": "were not unscaled",
    "ok on overflow": "step_ok True on an overflow",
    "grow on overflow": "grew on an overflow step",
    "pair": "return a triple",
}


def test_scaler_update_passes_right_answers():
    for fn in (scaler_update, scaler_update_flags, lambda *a, **k: scaler_update(*a, **k, mistake="tensor scale")):
        passes_everywhere(nb20.check_scaler_update, "check_scaler_update", "scaler_update", fn)


@pytest.mark.parametrize("mistake", SCALER_MISTAKES)
def test_scaler_update_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb20.check_scaler_update, "check_scaler_update", "scaler_update",
                     lambda *a, m=mistake, **k: scaler_update(*a, **k, mistake=m), SCALER_MISTAKES[mistake])


def test_scaler_update_refuses_the_library_and_torch_and_waits():
    assert "tfedu" in failure_of(nb20.check_scaler_update, lambda *a, **k: parallel.scaler_update(*a, **k))
    def with_torch(grads, scale, good_steps, growth_interval, *, growth=2.0, backoff=0.5):
        GradScaler("cpu")
        return scaler_update(grads, scale, good_steps, growth_interval, growth=growth, backoff=backoff)

    assert "torch.amp" in failure_of(nb20.check_scaler_update, with_torch)
    with pytest.raises(ExerciseNotDone):
        nb20.check_scaler_update(lambda *a, **k: not_done())
    assert check_time(nb20.check_scaler_update, scaler_update) < 0.5


def test_the_scaler_reference_follows_torchs_grad_scaler():
    """The reference's scale and count equal torch's own update (GradScaler's _amp_update_scale_) on every stream."""
    for seed in range(3):
        for stream in nb20.scaler_cases(np.random.default_rng(seed))["streams"]:
            first = stream["steps"][0]
            scale = torch.tensor([first["scale"]], dtype=torch.float32)
            tracker = torch.zeros(1, dtype=torch.int32)
            for step in stream["steps"]:
                grads = [torch.from_numpy(np.array(g)).to(getattr(torch, d)) for g, d in zip(step["grads"], step["dtypes"])]
                assert float(scale) == step["scale"] and int(tracker) == step["good"]
                found = torch.tensor([0.0 if all(bool(torch.isfinite(g).all()) for g in grads) else 1.0])
                torch._amp_update_scale_(scale, tracker, found, step["growth"], step["backoff"], step["interval"])
                ok, new_scale, good = nb20.reference_scaler_update(
                    grads, step["scale"], step["good"], step["interval"], growth=step["growth"],
                    backoff=step["backoff"])
                assert (new_scale, good) == (float(scale), int(tracker)) and ok == (float(found) == 0.0)


# ----------------------------------------------------------------------------- all four


def test_the_variants_done_right_are_the_references():
    rng = np.random.default_rng(0)
    for case in nb20.ring_cases(rng)["cases"]:
        xs = [torch.from_numpy(np.array(a)).double() for a in case["xs"]]
        for got in nb20.ring_variant(xs):
            torch.testing.assert_close(got, sum(xs))
    for case in nb20.zero_cases(rng)["cases"]:
        case = dict(case, options=dict(case["options"], betas=tuple(case["options"]["betas"])))
        want = nb20.zero_expected(case)
        for rank_params in nb20.zero_variant(case):
            for g, w in zip(rank_params, want):
                torch.testing.assert_close(g, w)
    for case in nb20.mlp_cases(rng)["cases"]:
        args = [torch.from_numpy(np.array(a)).double() for a in case["clean"]]
        if args[1].shape[0] % case["world_size"]:
            continue
        x, W_in, b_in, W_out, b_out = args
        want = F.gelu(x @ W_in.T + b_in) @ W_out.T + b_out
        for got in nb20.mlp_variant(*args, n=case["world_size"]):
            torch.testing.assert_close(got, want)


def test_every_exercise_has_hints_and_a_probe():
    assert {p.exercise for p in nb20.PROBES.values()} == set(nb20.HINTS)
    assert {h.check for h in nb20.HINTS.values()} == set(nb20.PROBES)
    assert [h.number for h in nb20.HINTS.values()] == ["20.1", "20.2", "20.3", "20.4"]
    for probe in nb20.PROBES.values():
        assert "tfedu.parallel" in probe.forbidden and "torch.distributed.all_reduce" in probe.forbidden
        assert "tfedu" not in probe.run  # the probe's ranks run on its own comm, not the library's


def test_the_probes_start_no_process_and_leave_no_thread():
    import threading

    before = set(threading.enumerate())
    for name, fn in (("ring_all_reduce", ring_all_reduce), ("parallel_mlp", parallel_mlp)):
        probe = nb20.PROBES[f"check_{name}"]
        assert verdict(probe, {name: fn}, 0) is None
    assert set(threading.enumerate()) <= before


# ----------------------------------------------------------------------------- under the grader's harness


def run_under_the_harness(grade_id, answer):
    """One hidden test as the grader runs it in the kernel (tests/checker_helpers.py): its tripwire watches the ranks'
    threads too."""
    return helpers.run_under_the_harness(
        nb20.PROBES[grade_id], "import torch\nimport torch.nn.functional as F\nimport math\nimport tfedu.parallel", answer)


RIGHT_ANSWERS = {
    "check_ring_all_reduce": (
        "def ring_all_reduce(x, comm):\n"
        "    n, r = comm.world_size, comm.rank\n"
        "    chunks = [c.clone() for c in x.tensor_split(n)]\n"
        "    for s in range(n - 1):\n"
        "        comm.send(chunks[(r - s) % n], (r + 1) % n)\n"
        "        chunks[(r - s - 1) % n] += comm.recv(torch.empty_like(chunks[(r - s - 1) % n]), (r - 1) % n)\n"
        "    for s in range(n - 1):\n"
        "        comm.send(chunks[(r + 1 - s) % n], (r + 1) % n)\n"
        "        comm.recv(chunks[(r - s) % n], (r - 1) % n)\n"
        "    return torch.cat(chunks)\n"),
    "check_parallel_mlp": (
        "def parallel_mlp(x, W_in, b_in, W_out, b_out, comm):\n"
        "    w = W_in.shape[0] // comm.world_size\n"
        "    if w * comm.world_size != W_in.shape[0]:\n"
        "        raise ValueError('d_mlp must divide')\n"
        "    lo, hi = comm.rank * w, (comm.rank + 1) * w\n"
        "    return comm.all_reduce(F.gelu(x @ W_in[lo:hi].T + b_in[lo:hi]) @ W_out[:, lo:hi].T) + b_out\n"),
    "check_scaler_update": (
        "def scaler_update(grads, scale, good_steps, growth_interval, *, growth=2.0, backoff=0.5):\n"
        "    for g in grads:\n"
        "        g.div_(scale)\n"
        "    if not all(bool(torch.isfinite(g).all()) for g in grads):\n"
        "        return False, scale * backoff, 0\n"
        "    good_steps += 1\n"
        "    if good_steps == growth_interval:\n"
        "        return True, scale * growth, 0\n"
        "    return True, scale, good_steps\n"),
}


@pytest.mark.parametrize("grade_id", sorted(RIGHT_ANSWERS))
def test_right_answers_pass_under_the_grader_harness(grade_id):
    assert run_under_the_harness(grade_id, RIGHT_ANSWERS[grade_id]) == ([], None)


def test_sharded_adamw_passes_under_the_grader_harness():
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(ShardedByRanges))
    assert run_under_the_harness("check_sharded_adamw", source.replace("class ShardedByRanges", "class ShardedAdamW")) \
        == ([], None)


@pytest.mark.parametrize("grade_id, answer, hit", [
    ("check_ring_all_reduce", "def ring_all_reduce(x, comm):\n    return tfedu.parallel.ring_all_reduce(x, comm)\n",
     "ring_all_reduce from parallel.py"),
    ("check_parallel_mlp", "def parallel_mlp(*args):\n    return tfedu.parallel.parallel_mlp(*args)\n",
     "parallel_mlp from parallel.py"),
    ("check_scaler_update", "def scaler_update(grads, scale, good, interval, *, growth=2.0, backoff=0.5):\n"
     "    s = torch.amp.GradScaler('cpu', init_scale=scale, growth_interval=interval)\n"
     "    return tfedu.parallel.scaler_update(grads, scale, good, interval, growth=growth, backoff=backoff)\n",
     "from grad_scaler.py"),
])
def test_the_harness_tripwire_catches_the_references(grade_id, answer, hit):
    hits, _ = run_under_the_harness(grade_id, answer)
    assert any(hit in h for h in hits), hits


def test_collectives_that_do_not_pair_up_are_named():
    """A rank that skips a collective leaves the others waiting 4 * TIMEOUT s: judged here on the run's record."""
    zero = nb20.zero_cases(np.random.default_rng(0))["cases"]
    stuck = {"params": [None, None], "errors": [None, ["deadlock", "rank 1 waited 6 s in a collective"]],
             "states": [None, None], "calls": [[], []], "sends": 0, "frozen": [True, True]}
    with pytest.raises(nb20.CheckFailure, match="same collectives in the same order"):
        nb20.judge_zero([{"params": [None], "errors": [None], "states": [0], "calls": [[]], "sends": 0,
                          "frozen": [True]}, stuck], zero)
    mlp = nb20.mlp_cases(np.random.default_rng(0))["cases"]
    stuck = {"results": [None, None], "dtypes": ["", ""], "errors": [None, ["deadlock", "rank 1 waited"]],
             "calls": [[], []], "sends": 0, "wide": [False, False]}
    right = nb20.mlp_variant(*[torch.from_numpy(np.array(a)) for a in mlp[0]["clean"]], n=1)[0].numpy()
    first = {"results": [right], "dtypes": ["float64"], "errors": [None], "calls": [[["all_reduce", right.size]]],
             "sends": 0, "wide": [False]}
    with pytest.raises(nb20.CheckFailure, match="every rank must call the one all-reduce"):
        nb20.judge_mlp([first, stuck], mlp)
