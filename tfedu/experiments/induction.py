"""The induction GPT: a two-layer attention-only model trained until it has induction heads.

The course GPT (``tfedu.experiments.course_gpt``) has none: 1000 steps on 466 KB of text is far short of the
billions of tokens after which Olsson et al. (2022) see them form, and notebook 15 measures that.
This model is the smallest setting in which they do form on a laptop: Elhage et al.'s (2021)
two-layer attention-only Transformer (``ModelConfig(d_mlp=0)``), trained on sequences that repeat.

Each training row is ``BOS``, a random prefix (0-12 tokens), then a random pattern of ``L`` distinct
tokens repeated to the end, with ``L`` drawn per row from 3..24. Only a lookup by *content* predicts
every row: the token after the last occurrence of the current token. A fixed offset cannot, since
the period changes from row to row. We measured which positions make that work (2 layers, d_model 64,
3000 steps, seeded, one CPU thread): with RoPE a layer-0 head attends to the previous token and both
layer-1 heads become induction heads; with learned absolute positions (``train(cfg=MODEL_CONFIG.replace(
positional="learned"))``) no head does. The numbers are in ``train_log.json`` and notebook 15.

Everything is fixed here (data, model shape, schedule, seeds), so ``tfedu train --preset induction-gpt``
makes the same model again; ``tests/test_induction.py`` checks the first steps against the shipped
log, and the heads of the shipped weights.

>>> model = load()  # doctest: +SKIP
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from jaxtyping import Int
from torch import Tensor

from tfedu.shipped_models import SHIPPED, load_shipped, load_shipped_log, save_shipped, shipped_folder
from tfedu.config import ModelConfig
from tfedu.model import GPT, next_token_loss
from tfedu.train import TrainConfig, learning_rate, param_groups

NAME = "induction-gpt"
FORMAT = SHIPPED[NAME].format
BOS = 0  # never drawn inside a row
PERIODS = (3, 24)  # the pattern length L of a row, inclusive
MAX_PREFIX = 12  # random tokens before the first copy of the pattern
MODEL_SEED = 0


FOLDER = shipped_folder(NAME)

MODEL_CONFIG = ModelConfig(
    d_vocab=128, n_ctx=64, d_model=64, n_layers=2, n_heads=2, d_mlp=0, positional="rope", attention="manual",
)
TRAIN_CONFIG = TrainConfig(
    steps=3000, batch_size=64, lr=1e-3, warmup_steps=100, min_lr_ratio=0.1, weight_decay=0.01, seed=1,
)


def periodic_batch(
    batch: int, *, generator: torch.Generator, n_ctx: int = MODEL_CONFIG.n_ctx, d_vocab: int = MODEL_CONFIG.d_vocab,
) -> Int[Tensor, "batch n_ctx"]:
    """``batch`` training rows: ``BOS``, a random prefix, then a random pattern repeated to ``n_ctx`` tokens.

    The pattern's ``L`` tokens are distinct (so each token of it has one successor), ``L`` is drawn
    per row from ``PERIODS`` and the prefix length from 0..``MAX_PREFIX``; every row holds at least two
    copies of its pattern.

    >>> ids = periodic_batch(2, generator=torch.Generator().manual_seed(0))
    >>> ids.shape, bool((ids[:, 0] == BOS).all()), bool((ids[:, 1:] != BOS).all())
    (torch.Size([2, 64]), True, True)
    """
    low, high = PERIODS
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a seeded torch.Generator, got {type(generator).__name__}")
    if d_vocab - 1 < high or n_ctx < 1 + MAX_PREFIX + 2 * high:
        raise ValueError(f"need d_vocab > {high} (distinct pattern tokens besides BOS) and n_ctx >= "
                         f"{1 + MAX_PREFIX + 2 * high} (two copies of the longest pattern), got d_vocab={d_vocab}, "
                         f"n_ctx={n_ctx}")
    rows = []
    for _ in range(batch):
        period = int(torch.randint(low, high + 1, (), generator=generator))
        prefix = int(torch.randint(0, MAX_PREFIX + 1, (), generator=generator))
        pattern = torch.randperm(d_vocab - 1, generator=generator)[:period] + 1  # distinct, never BOS
        filler = torch.randint(1, d_vocab, (prefix,), generator=generator)
        repeated = pattern.repeat(n_ctx // period + 1)
        rows.append(torch.cat([torch.tensor([BOS]), filler, repeated])[:n_ctx])
    return torch.stack(rows)


def fresh_model(cfg: ModelConfig = MODEL_CONFIG) -> GPT:
    torch.manual_seed(MODEL_SEED)
    return GPT(cfg)


def train(steps: int | None = None, *, cfg: ModelConfig = MODEL_CONFIG,
          on_step: Callable[[dict], object] | None = None) -> tuple[GPT, list[dict]]:
    """Train the induction GPT from its seeded initialisation; returns the model (eval mode) and each step's record.

    ``steps`` stops early; the learning-rate schedule stays the full run's, so the first steps equal the
    shipped run's. ``cfg`` swaps the model for an experiment (e.g. learned positions); the data and
    schedule stay. ``on_step(record)`` sees ``{"step", "loss", "lr"}`` after every step.
    """
    model = fresh_model(cfg).train()  # GPT checks cfg; periodic_batch checks d_vocab and n_ctx
    cfg = TRAIN_CONFIG
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas)
    generator = torch.Generator().manual_seed(cfg.seed)
    history = []
    for step in range(cfg.steps if steps is None else min(steps, cfg.steps)):
        lr = learning_rate(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = periodic_batch(cfg.batch_size, generator=generator, n_ctx=model.cfg.n_ctx, d_vocab=model.cfg.d_vocab)
        loss = next_token_loss(model(ids[:, :-1]), ids[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        record = {"step": step + 1, "loss": round(loss.item(), 6), "lr": lr}
        history.append(record)
        if on_step is not None:
            on_step(record)
    return model.eval(), history


def build(out_dir: str | os.PathLike = FOLDER, *, steps: int | None = None, progress: bool = True) -> dict:
    """Train the induction GPT and write its folder (``model.safetensors``, ``config.json``, ``train_log.json``)."""

    def report(record: dict) -> None:
        if progress and record["step"] % 250 == 0:
            print(f"step {record['step']}: loss {record['loss']:.3f}", flush=True)

    tic = time.perf_counter()
    model, history = train(steps, on_step=report)
    log = {"history": history, "seconds": round(time.perf_counter() - tic, 1), "device": "cpu",
           "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    save(model, out_dir, log)
    return log


def save(model: GPT, out_dir: str | os.PathLike, log: dict) -> Path:
    """Write the three files, each through a temporary name and a rename."""
    config = {"format": FORMAT, "model": model.cfg.as_dict(), "train": asdict(TRAIN_CONFIG), "bos": BOS,
              "periods": list(PERIODS), "max_prefix": MAX_PREFIX}
    return save_shipped(model, out_dir, config, log=log)


def load(path: str | os.PathLike = FOLDER) -> GPT:
    """The shipped induction GPT, in eval mode. Its tokens are plain ids 0..127; 0 is BOS."""
    return load_shipped(NAME, path)[0]


def load_log(path: str | os.PathLike = FOLDER) -> dict:
    """The shipped training log: every step's loss and learning rate, time and machine."""
    return load_shipped_log(NAME, path)
