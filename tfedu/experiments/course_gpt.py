"""The course GPT: a small model trained on the course corpus, shipped in ``data/course-gpt/``.

Notebooks 10-15 start from it instead of training their own. Everything about it is fixed here
(tokenizer, data, split, model shape, training schedule, seeds), so ``tfedu train --preset course-gpt``
makes the same model again: on CPU the same losses, step by step (tests/test_course_gpt.py checks the
first steps against the shipped log).

The folder holds ``model.safetensors`` (float32 weights), ``config.json`` (the ``ModelConfig`` and the
``TrainConfig``), ``tokenizer.txt`` (``Tokenizer.save``'s format) and ``train_log.json`` (every step's
loss and learning rate, every evaluation, how long it took and on what).

>>> model, tokenizer = load()  # doctest: +SKIP
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from tfedu.shipped_models import SHIPPED, load_shipped_log, load_shipped_with_tokenizer, save_shipped, shipped_folder
from tfedu.config import ModelConfig
from tfedu.data import END_OF_TEXT, TokenDataset, load_pydoc_text, pydoc_documents
from tfedu.model import GPT
from tfedu.tokenizer import Tokenizer, train_bpe
from tfedu.train import TrainConfig, evaluate, train

NAME = "course-gpt"
FORMAT = SHIPPED[NAME].format


FOLDER = shipped_folder(NAME)
VOCAB_SIZE = 1024  # 767 merges + 256 bytes + <|endoftext|>
VAL_FRACTION = 0.1  # the last 10% of the token stream (the topics last in sorted order) is held out
MODEL_SEED = 0

MODEL_CONFIG = ModelConfig(
    d_vocab=VOCAB_SIZE, n_ctx=128, d_model=128, n_layers=4, n_heads=4, dropout=0.1, attention="sdpa",
)
TRAIN_CONFIG = TrainConfig(
    steps=1000, batch_size=16, lr=3e-3, warmup_steps=100, min_lr_ratio=0.1, weight_decay=0.1,
    eval_every=100, eval_batches=None, seed=0,
)


def tokenizer() -> Tokenizer:
    """Byte-level BPE with the GPT-4 split pattern, trained on the course corpus (about 0.2 s)."""
    return train_bpe(load_pydoc_text(), VOCAB_SIZE, special_tokens=[END_OF_TEXT])


def datasets(tok: Tokenizer) -> tuple[TokenDataset, TokenDataset]:
    """The corpus, each topic followed by <|endoftext|>, split into training and held-out ids."""
    return TokenDataset.from_texts(pydoc_documents(), tok).split(VAL_FRACTION)


def fresh_model() -> GPT:
    torch.manual_seed(MODEL_SEED)
    return GPT(MODEL_CONFIG)


def build(out_dir: str | os.PathLike = FOLDER, *, steps: int | None = None, device: str | None = None,
          progress: bool = True) -> dict | None:
    """Train the course GPT from scratch and write its folder; returns the training log.

    ``steps`` cuts the run short (the schedule stays the full one, so the first steps equal the
    shipped run's); the folder is then written too, for inspection.
    """
    tok = tokenizer()
    model = fresh_model()
    log = train_on_corpus(model, tok, steps=steps, device=device, progress=progress)
    if log is not None:
        save(model, tok, out_dir, log)
    return log


def train_on_corpus(model: GPT, tok: Tokenizer, *, steps: int | None = None, device: str | None = None,
                    progress: bool = True) -> dict | None:
    """Train ``model`` on the course corpus with ``TRAIN_CONFIG`` and return its training log (the model ends on the CPU).

    The log: every step's loss and learning rate, every evaluation, the held-out loss at the end, and
    how long it took on what. Under torchrun only the first process gets it (the others: None). The
    course draft model (``course_draft``) trains this way too.
    """
    train_data, val_data = datasets(tok)
    tic = time.perf_counter()
    result = train(model, train_data, TRAIN_CONFIG, val_data=val_data, device=device, progress=progress,
                   on_step=_stop_after(steps))
    seconds = time.perf_counter() - tic
    model.to("cpu")
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None  # under torchrun only the first process writes the folder
    return {
        "history": result.history,
        "evals": result.evals,
        "val_loss": evaluate(model, val_data, model.cfg.n_ctx),
        "train_tokens": len(train_data),
        "val_tokens": len(val_data),
        "seconds": round(seconds, 1),
        "device": str(device or "cpu"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def _stop_after(steps: int | None):
    def on_step(record: dict) -> bool:
        return steps is not None and record["step"] >= steps  # True stops train(); the schedule stays the full run's

    return on_step


def save(model: GPT, tok: Tokenizer, out_dir: str | os.PathLike, log: dict) -> Path:
    """Write the four files, each through a temporary name and a rename."""
    config = {"format": FORMAT, "model": model.cfg.as_dict(), "train": asdict(TRAIN_CONFIG),
              "vocab_size": VOCAB_SIZE, "val_fraction": VAL_FRACTION}
    return save_shipped(model, out_dir, config, log=log, tokenizer=tok)


def load(path: str | os.PathLike = FOLDER) -> tuple[GPT, Tokenizer]:
    """The shipped course GPT (in eval mode) and its tokenizer, from ``path``."""
    return load_shipped_with_tokenizer(NAME, path)


def load_log(path: str | os.PathLike = FOLDER) -> dict:
    """The shipped training log: every step's loss and learning rate, every evaluation, time and machine."""
    return load_shipped_log(NAME, path)
