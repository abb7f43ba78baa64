"""tfedu.parallel: real gloo processes on the CPU; data parallelism by hand equals training on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tfedu.parallel import BucketedAllReduce, allreduce_gradients, spawn

STEPS, BATCH = 3, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _train(rank: int, world_size: int, how: str) -> list[torch.Tensor]:
    """Train on this rank's rows of every batch (all rows when world_size is 1); the parameters at the end."""
    model = _model()
    if how == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    sync = BucketedAllReduce(model, bucket_bytes=512) if how == "buckets" else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    rows = BATCH // world_size
    for x, y in _batches():
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if how == "by hand":
            allreduce_gradients(model.parameters())
        elif how == "buckets":
            sync.wait()
        optimizer.step()
    extra = [torch.tensor(float(sync.n_buckets))] if sync is not None else []
    return [p.detach().clone() for p in model.parameters()] + extra


def _rank_and_sum(rank: int, world_size: int) -> tuple[int, float]:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, t.item()


def _fails(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 gives up")


def test_spawn_runs_a_group_and_returns_each_ranks_result():
    assert spawn(_rank_and_sum, 2) == [(0, 3.0), (1, 3.0)]


def test_spawn_reports_a_failing_process():
    with pytest.raises(Exception, match="rank 1 gives up"):
        spawn(_fails, 2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        spawn(_rank_and_sum, 0)


@pytest.fixture(scope="module")
def whole_batch() -> list[torch.Tensor]:
    return spawn(_train, 1, "by hand")[0]


@pytest.mark.parametrize("how, world_size", [("by hand", 2), ("buckets", 2), ("ddp", 2), ("by hand", 4)])
def test_several_processes_train_like_one_on_the_whole_batch(how, world_size, whole_batch):
    ranks = spawn(_train, world_size, how)
    for params in ranks:
        for got, want in zip(params, whole_batch):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    if how == "buckets":  # 467 float64 numbers = 3,736 bytes in buckets of 512: several all-reduces per backward
        assert ranks[0][-1].item() >= 2 * STEPS
