"""The course chat model: the course GPT instruction-tuned on verifiable tasks, shipped in ``data/course-chat/``.

Notebook 17 starts its preference tuning and RL from it, and reads the measurements this recipe makes
(SFT against the number of examples, GRPO on several seeds) from its log, because they take longer than
a notebook may. Everything is fixed here (tasks, split, schedule, seeds), so ``tfedu train --preset
course-chat`` makes the same model and the same numbers again on a CPU (one thread; about 14 minutes: 817 s on the course machine).

The folder holds ``model.safetensors``, ``config.json`` (the ``ModelConfig`` and this recipe's settings),
``tokenizer.txt`` (the course tokenizer with the chat tokens) and ``train_log.json``: the SFT losses,
held-out accuracy before and after, the sweep over the number of examples and the GRPO runs.
"""

from __future__ import annotations

import copy
import os
import platform
import time
from pathlib import Path

import torch

from tfedu.experiments import course_gpt
from tfedu.model import GPT
from tfedu.post_training import Example, add_chat_tokens, make_tasks, split_tasks
from tfedu.shipped_models import SHIPPED, load_shipped_log, load_shipped_with_tokenizer, save_shipped, shipped_folder
from tfedu.tokenizer import Tokenizer
from tfedu.tuning import (Pair, dpo_loss, dpo_train, group_advantages, grow_vocab, grpo_loss, grpo_train,
                          kl_to_reference, preference_pairs, sample_counts, sft_loss, sft_train, task_accuracy)

NAME = "course-chat"
FORMAT = SHIPPED[NAME].format
FOLDER = shipped_folder(NAME)

TASK_SEED = 1234  # make_tasks(N_TASKS, TASK_SEED), split by hash: about 80% train, 20% held out
N_TASKS = 6000
N_HELD_OUT = 600  # the held-out prompts every measurement uses (the first 600 of the held-out side)
SFT = {"steps": 300, "batch_size": 32, "lr": 1e-3, "min_lr_ratio": 0.1, "seed": 0}
SWEEP = {"n_examples": [30, 100, 300, 1000, 4000], "seeds": [0, 1, 2]}  # each run: SFT's schedule
DPO = {"n_prompts": 320, "samples": 8, "pair_seed": 0, "steps": 40, "batch_size": 16, "lr": 1e-4,
       "betas": [0.03, 0.1, 0.3, 1.0], "seeds": [0, 1, 2], "kl_prompts": 200, "kl_samples": 2}
# GRPO trains on one family, reading the answer from a sentence: after SFT the model gets it right often
# enough that most groups hold both right and wrong answers (the other families are right too rarely at
# this size for a group of 8 to contain a right answer, and then every advantage is 0).
GRPO = {"family": "read", "steps": 60, "prompts_per_step": 16, "group": 8, "lr": 1e-4, "beta": 0.04,
        "clip_eps": 0.2, "temperature": 1.0, "updates_per_batch": 2, "seeds": [0, 1, 2]}
PASS = {"n": 16, "seed": 99}  # answers sampled per held-out prompt of GRPO's family, for pass@k


def tasks() -> tuple[list[Example], list[Example]]:
    """The training tasks and the held-out tasks every measurement uses."""
    train, held_out = split_tasks(make_tasks(N_TASKS, seed=TASK_SEED))
    return train, held_out[:N_HELD_OUT]


def chat_tokenizer() -> Tokenizer:
    """The course tokenizer with ``<|system|> <|user|> <|assistant|> <|end|>`` at ids 1024..1027."""
    return add_chat_tokens(course_gpt.load()[1])


def base_model() -> GPT:
    """The course GPT with four new embedding rows for the chat tokens (their mean start), dropout off."""
    return grow_vocab(course_gpt.load()[0], 4)


def sft(examples: list[Example], tok: Tokenizer, seed: int = SFT["seed"], loss_fn=sft_loss,
        stop_after: int | None = None) -> tuple[GPT, list[float]]:
    """The base model instruction-tuned on ``examples`` with the recipe's schedule; (model, losses)."""
    model = base_model()
    settings = {k: v for k, v in SFT.items() if k != "seed"}
    losses = sft_train(model, tok, examples, seed=seed, loss_fn=loss_fn, stop_after=stop_after, **settings)
    return model, losses


def sweep_subset(train: list[Example], n: int, seed: int) -> list[Example]:
    """The ``n`` training examples the sweep's run with ``seed`` uses (the seed also draws its batches)."""
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    return [train[i] for i in order[:n].tolist()]


def pairs(model: GPT, tok: Tokenizer, train: list[Example]) -> list[Pair]:
    """DPO's preference pairs: sampled answers to the first prompts of the training side, judged by the verifier."""
    return preference_pairs(model, tok, train[:DPO["n_prompts"]], n=DPO["samples"], seed=DPO["pair_seed"])


def dpo_run(sft_model: GPT, tok: Tokenizer, pair_list: list[Pair], beta: float, seed: int, loss_fn=dpo_loss
            ) -> tuple[GPT, dict]:
    """DPO from a copy of ``sft_model`` (the frozen reference is another copy); (policy, history)."""
    policy, ref = copy.deepcopy(sft_model), copy.deepcopy(sft_model)
    history = dpo_train(policy, ref, tok, pair_list, beta=beta, seed=seed, loss_fn=loss_fn,
                        **{k: DPO[k] for k in ("steps", "batch_size", "lr")})
    return policy, history


def grpo_examples(train: list[Example]) -> list[Example]:
    return [ex for ex in train if ex.family == GRPO["family"]]


def grpo_run(sft_model: GPT, tok: Tokenizer, train: list[Example], seed: int, steps: int = GRPO["steps"],
             advantages_fn=group_advantages, loss_fn=grpo_loss) -> tuple[GPT, dict]:
    """GRPO from a copy of ``sft_model`` on the training prompts of GRPO's family; (policy, history)."""
    policy, ref = copy.deepcopy(sft_model), copy.deepcopy(sft_model)
    settings = {k: v for k, v in GRPO.items() if k not in ("family", "seeds", "steps")}
    history = grpo_train(policy, ref, tok, grpo_examples(train), steps=steps, seed=seed,
                         advantages_fn=advantages_fn, loss_fn=loss_fn, **settings)
    return policy, history


def correct_counts(model: GPT, tok: Tokenizer, held_out: list[Example]) -> list[int]:
    """For each held-out prompt of GRPO's family, how many of ``PASS["n"]`` sampled answers are right."""
    return sample_counts(model, tok, grpo_examples(held_out), n=PASS["n"], seed=PASS["seed"])


def build(out_dir: str | os.PathLike = FOLDER, *, progress: bool = True) -> dict:
    """Instruction-tune the course GPT, measure every stage, and write the folder; returns the log."""
    torch.set_num_threads(1)  # one thread: the run repeats exactly on a CPU
    say = print if progress else (lambda *a, **k: None)
    tok = chat_tokenizer()
    train, held_out = tasks()
    tic = time.perf_counter()
    log: dict = {"before": task_accuracy(base_model(), tok, held_out)}
    model, losses = sft(train, tok)
    log.update(losses=losses, after=task_accuracy(model, tok, held_out))
    say(f"SFT: held-out accuracy {log['before']['all']:.3f} -> {log['after']['all']:.3f}", flush=True)
    log["sweep"] = []
    for n in SWEEP["n_examples"]:
        for seed in SWEEP["seeds"]:
            small, _ = sft(sweep_subset(train, n, seed), tok, seed=seed)
            log["sweep"].append({"n_examples": n, "seed": seed, "accuracy": task_accuracy(small, tok, held_out)})
            say(f"SFT sweep: {n} examples, seed {seed}: {log['sweep'][-1]['accuracy']['all']:.3f}", flush=True)
    pair_list = pairs(model, tok, train)
    log["dpo"] = {"pairs": len(pair_list), "runs": []}
    kl_prompts = [ex.prompt for ex in held_out[:DPO["kl_prompts"]]]
    for beta in DPO["betas"]:
        for seed in DPO["seeds"]:
            policy, history = dpo_run(model, tok, pair_list, beta, seed)
            log["dpo"]["runs"].append({
                "beta": beta, "seed": seed, "loss": history["loss"], "reward_accuracy": history["reward_accuracy"],
                "accuracy": task_accuracy(policy, tok, held_out),
                "kl": kl_to_reference(policy, model, tok, kl_prompts, n=DPO["kl_samples"], seed=seed)})
            say(f"DPO beta {beta} seed {seed}: accuracy {log['dpo']['runs'][-1]['accuracy']['all']:.3f}, "
                f"KL {log['dpo']['runs'][-1]['kl']:.3f}", flush=True)
    log["grpo"] = {"counts_before": correct_counts(model, tok, held_out), "runs": []}
    for seed in GRPO["seeds"]:
        policy, history = grpo_run(model, tok, train, seed)
        log["grpo"]["runs"].append({"seed": seed, "reward": history["reward"], "loss": history["loss"],
                                    "counts": correct_counts(policy, tok, held_out),
                                    "accuracy": task_accuracy(policy, tok, held_out)})
        say(f"GRPO seed {seed}: reward {history['reward'][0]:.3f} -> {history['reward'][-1]:.3f}", flush=True)
    log.update(seconds=round(time.perf_counter() - tic, 1), torch=torch.__version__, threads=torch.get_num_threads(),
               machine=platform.machine())
    save(model, tok, out_dir, log)
    return log


def save(model: GPT, tok: Tokenizer, out_dir: str | os.PathLike, log: dict) -> Path:
    config = {"format": FORMAT, "model": model.cfg.as_dict(), "tasks": {"seed": TASK_SEED, "n": N_TASKS,
              "held_out": N_HELD_OUT}, "sft": SFT, "sweep": SWEEP, "dpo": DPO, "grpo": GRPO, "pass": PASS}
    return save_shipped(model, out_dir, config, log=log, tokenizer=tok)


def load(path: str | os.PathLike = FOLDER) -> tuple[GPT, Tokenizer]:
    """The shipped chat model (eval mode) and its tokenizer, from ``path``."""
    return load_shipped_with_tokenizer(NAME, path)


def load_log(path: str | os.PathLike = FOLDER) -> dict:
    """The shipped log: SFT's losses and accuracies, the sweep over examples, the DPO and GRPO runs."""
    return load_shipped_log(NAME, path)
