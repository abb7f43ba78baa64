"""tfedu.parallel and notebook 20's runs: real gloo processes on the CPU (and threads for the simulated group). Every
scheme trains like one process on the whole batch; the collectives' traffic matches the formulas; tensor-parallel
layers equal the unsplit ones; the loss scaler follows torch's GradScaler."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tfedu import parallel as P
from tfedu.experiments import scale_out as S
from tfedu.layers import MLP, Attention


def _rank_and_sum(rank: int, world_size: int, offset: float = 0.0) -> tuple[int, float]:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, t.item() + offset


def _fails(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    dist.barrier()  # left waiting for rank 1: the process that failed first is the one reported


def test_spawn_runs_a_group_and_returns_each_ranks_result():
    assert P.spawn(_rank_and_sum, 2, offset=0.5) == [(0, 3.5), (1, 3.5)]


def test_spawn_reports_the_process_that_failed():
    with pytest.raises(RuntimeError, match="process 1 of 2 raised:(.|\n)*rank 1 gives up"):
        P.spawn(_fails, 2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        P.spawn(_rank_and_sum, 0)


# ----------------------------------------------------------------------------- the ring and the simulated group


@pytest.mark.parametrize("world_size, numel", [(2, 10), (3, 10), (4, 7), (5, 3)])
def test_ring_all_reduce_sums_and_sends_2_n_minus_1_over_n(world_size, numel):
    xs = [torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
          for r in range(world_size)]
    results, comms = P.simulate(P.ring_all_reduce, world_size, P.per_rank(xs))
    for got in results:
        torch.testing.assert_close(got, sum(xs))
    total = sum(c.sent for c in comms)  # every chunk crosses 2 (N - 1) links: 2 (N - 1) x the tensor, all ranks
    assert total == 2 * (world_size - 1) * numel * 8
    assert all(dst == (src + 1) % world_size for src, dst, _ in comms[0].log.sends)
    if numel % world_size == 0:
        assert all(c.sent == P.ring_traffic("all_reduce", numel * 8, world_size) for c in comms)


def test_simulated_collectives_match_their_definitions_and_name_a_deadlock():
    def collectives(comm):
        x = torch.arange(4.0) + 10 * comm.rank
        summed = comm.all_reduce(x.clone())
        gathered = comm.all_gather(torch.empty(8), x[:4])
        mine = comm.reduce_scatter(torch.empty(2), x)
        return summed, gathered, mine, comm.broadcast(x.clone(), 1)

    (s0, g0, m0, b0), (s1, g1, m1, b1) = P.simulate(collectives, 2)[0]
    torch.testing.assert_close(s0, torch.tensor([10.0, 12, 14, 16]))
    torch.testing.assert_close(g1, torch.tensor([0.0, 1, 2, 3, 10, 11, 12, 13]))
    torch.testing.assert_close((m0, m1), (torch.tensor([10.0, 12]), torch.tensor([14.0, 16])))
    torch.testing.assert_close(b0, torch.tensor([10.0, 11, 12, 13]))

    def both_receive_first(comm):
        return comm.recv(torch.empty(3), 1 - comm.rank)

    with pytest.raises(P.Deadlock, match="waited 0.2 s for a message from rank"):
        P.simulate(both_receive_first, 2, timeout=0.2)

    def wrong_size(comm):
        if comm.rank == 0:
            comm.send(torch.ones(3), 1)
        else:
            comm.recv(torch.empty(4), 0)

    with pytest.raises(ValueError, match="received \\(3,\\) numbers from rank 0 into a tensor of shape \\(4,\\)"):
        P.simulate(wrong_size, 2)


def _ring_in_processes(rank: int, world_size: int) -> tuple[torch.Tensor, int]:
    comm = P.ProcessComm()
    return P.ring_all_reduce(torch.arange(9.0) * (rank + 1), comm), comm.sent


def test_ring_all_reduce_in_real_processes():
    for got, sent in P.spawn(_ring_in_processes, 3):
        torch.testing.assert_close(got, torch.arange(9.0) * 6)
        assert sent == 2 * 2 * 3 * 4  # 2 (N - 1) chunks of 3 float32 numbers


# ----------------------------------------------------------------------------- data parallelism, ZeRO-1, FSDP


@pytest.fixture(scope="module")
def whole_batch() -> dict:
    return P.spawn(S.train_scheme, 1, "by hand")[0]


@pytest.mark.parametrize("scheme, world_size", [("by hand", 2), ("ring", 2), ("buckets", 2), ("ddp", 2),
                                                ("zero1", 2), ("by hand", 4), ("zero1", 4)])
def test_every_scheme_trains_like_one_process_on_the_whole_batch(scheme, world_size, whole_batch):
    ranks = P.spawn(S.train_scheme, world_size, scheme)
    n_bytes = sum(p.numel() * p.element_size() for p in whole_batch["params"].values())
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], whole_batch["losses"], atol=1e-12, rtol=1e-12)
        for name, want in whole_batch["params"].items():
            torch.testing.assert_close(rank["params"][name], want, atol=1e-12, rtol=1e-10)
        # traffic per step, counted, against the formulas (N parameters' bytes per all-reduce; ZeRO-1 the same
        # bytes in a reduce-scatter and an all-gather of the padded vector)
        if scheme in ("by hand", "buckets", "ddp"):
            assert rank["payload"] == {"all_reduce": S.STEPS * n_bytes}
        if scheme == "buckets":  # 4 KiB buckets: many all-reduces per backward, started while it runs
            assert rank["calls"]["all_reduce"] > 5 * S.STEPS
        if scheme == "ring":
            assert rank["sent"] == S.STEPS * P.ring_traffic("all_reduce", n_bytes, world_size)
        if scheme == "zero1":
            padded = world_size * math.ceil(n_bytes / 8 / world_size) * 8
            assert rank["payload"] == {"reduce_scatter": S.STEPS * padded, "all_gather": S.STEPS * padded}
            assert rank["state_bytes"] == 2 * padded // world_size  # the two moments of its shard only
        else:
            assert rank["state_bytes"] == 2 * n_bytes


def test_fsdp_trains_the_course_gpt_like_one_process_and_moves_three_times_the_parameters():
    single = P.spawn(S.train_scheme, 1, "by hand", dtype=torch.float32)[0]
    ranks = P.spawn(S.train_scheme, 2, "fsdp", dtype=torch.float32)
    n_bytes = sum(p.numel() * p.element_size() for p in single["params"].values())
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], single["losses"], atol=1e-5, rtol=1e-5)
        for name, want in single["params"].items():
            torch.testing.assert_close(rank["params"][name], want, atol=1e-5, rtol=1e-4)
        assert rank["param_bytes"] <= n_bytes / 2 + 64 and rank["state_bytes"] <= n_bytes + 128
        # per step: all-gather before forward and again before backward, reduce-scatter after it (padding aside)
        assert rank["payload"]["all_gather"] == pytest.approx(2 * S.STEPS * n_bytes, rel=1e-3)
        assert rank["payload"]["reduce_scatter"] == pytest.approx(S.STEPS * n_bytes, rel=1e-3)


def test_owned_ranges_cover_the_vector_once():
    for numel in (1, 7, 12, 13):
        for world_size in (1, 2, 3, 4, 5):
            ranges = [P.owned_range(numel, r, world_size) for r in range(world_size)]
            assert [i for a, b in ranges for i in range(a, b)] == list(range(numel))


# ----------------------------------------------------------------------------- tensor parallelism


def _mlp_and_attention(mlp, attn, x, comm):
    x = x.clone().requires_grad_()
    out = P.ParallelMLP(mlp, comm)(x) + P.ParallelAttention(attn, comm)(x, causal=True)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, comm.calls["all_reduce"]


@pytest.mark.parametrize("activation, world_size", [("gelu", 2), ("swiglu", 4)])
def test_tensor_parallel_layers_equal_the_unsplit_ones(activation, world_size):
    torch.manual_seed(0)
    mlp = MLP(16, 32, activation=activation).double()
    attn = Attention(16, 4, n_kv_heads=4 if world_size == 4 else 2, rope_base=10_000.0).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    want = mlp(x) + attn(x, causal=True)
    want.pow(2).sum().backward()
    for out, grad, all_reduces in P.simulate(_mlp_and_attention, world_size, mlp, attn, x.detach())[0]:
        torch.testing.assert_close(out, want.detach())
        torch.testing.assert_close(grad, x.grad)
        assert all_reduces == 4  # one per sub-layer forward, one per sub-layer backward
    with pytest.raises(ValueError, match="splits the MLP's hidden width \\(32\\) evenly over 3 ranks"):
        P.simulate(lambda comm: P.ParallelMLP(mlp, comm), 3)


def _tp_in_processes(rank: int, world_size: int) -> torch.Tensor:
    torch.manual_seed(0)
    mlp = MLP(8, 16).double()
    return P.ParallelMLP(mlp, P.ProcessComm())(torch.ones(1, 2, 8, dtype=torch.float64)).detach()


def test_tensor_parallel_mlp_in_real_processes():
    torch.manual_seed(0)
    want = MLP(8, 16).double()(torch.ones(1, 2, 8, dtype=torch.float64)).detach()
    for got in P.spawn(_tp_in_processes, 2):
        torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------- mixed precision


def test_loss_scaler_follows_torchs_grad_scaler():
    """The same scales and skipped steps as torch.amp.GradScaler on a stream with overflows and NaN."""
    stream = [1.0, 1.0, math.inf, 1.0, 1.0, 1.0, math.nan, 1.0, 1.0, 1.0, 1.0, 1.0, -math.inf, 1.0]
    ours = P.LossScaler(scale=1024.0, growth_interval=3)
    param = nn.Parameter(torch.zeros(3))
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    optimizer = torch.optim.SGD([param], lr=0.1)
    for value in stream:
        grad = torch.tensor([1.0, value, 2.0]) * ours.scale
        theirs.scale(torch.ones(()))  # (GradScaler makes its scale on first use)
        scale_before = theirs.get_scale()
        assert ours.scale == scale_before
        took = ours.unscale_and_update([grad.clone()])
        param.grad = torch.tensor([1.0, value, 2.0]) * scale_before
        before = param.detach().clone()
        theirs.step(optimizer)
        theirs.update()
        assert took == (not torch.equal(param.detach(), before))
    assert ours.scale == theirs.get_scale()


def test_float16_training_with_a_scaler_finds_its_scale_and_low_precision_tracks_float32():
    f32, bf16 = S.train_precision("float32", steps=30), S.train_precision("bfloat16", steps=30)
    assert max(abs(a - b) for a, b in zip(f32["losses"], bf16["losses"])) < 0.02
    fp16 = S.train_precision("float16", steps=30, scaler=P.LossScaler(scale=2.0 ** 30, growth_interval=50))
    assert fp16["skipped"] >= 5 and fp16["scales"][-1] < 2.0 ** 25  # overflowed, halved, then trained
    assert fp16["losses"][-1] < fp16["losses"][0] - 0.3


def test_comm_counter_counts_what_torch_distributed_moves():
    def run(rank, world_size):
        with P.CommCounter() as c:
            dist.all_reduce(torch.ones(5))
            P._ALL_GATHER(torch.empty(10), torch.ones(5))
            P._REDUCE_SCATTER(torch.empty(5), torch.ones(10))
        return dict(c.calls), dict(c.payload)

    assert P.ring_traffic("all_gather", 100, 4) == 75
    with pytest.raises(ValueError, match="kind must be one of"):
        P.ring_traffic("gossip", 1, 2)
    calls, payload = P.spawn(run, 2)[0]
    assert calls == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1}
    assert payload == {"all_reduce": 20, "all_gather": 40, "reduce_scatter": 40}
