"""The course's own models, shipped as folders in data/: which there are, where they live, how they are read.

``course-gpt`` (notebooks 10-15 start from it) and ``induction-gpt`` (notebook 15's attention-only model)
are trained by recipes in ``tfedu.experiments`` (``course_gpt``, ``induction``), which write their folders
with ``save_shipped``. Reading one needs only this module, so ``tfedu.checkpoints.pretrained("course-gpt")``
works without the recipes. A folder holds ``model.safetensors``, ``config.json`` (its format and
``ModelConfig``) and the files a model lists here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tfedu.config import ModelConfig
from tfedu.data import shipped_folder, write_atomically
from tfedu.model import GPT
from tfedu.tokenizer import Tokenizer


@dataclass(frozen=True)
class Shipped:
    format: str  # what its config.json says under "format"
    extra_files: tuple[str, ...] = ()  # besides model.safetensors and config.json
    rebuild: str = ""  # how long `tfedu train --preset NAME` takes, for the error that suggests it


SHIPPED = {
    "course-gpt": Shipped("tfedu-course-gpt 1", extra_files=("tokenizer.txt",)),
    "induction-gpt": Shipped("tfedu-induction-gpt 1", rebuild=" (about two and a half minutes on one CPU thread)"),
    "course-chat": Shipped("tfedu-course-chat 1", extra_files=("tokenizer.txt",), rebuild=" (about 14 minutes on one CPU thread)"),
    "course-draft": Shipped("tfedu-course-draft 1", rebuild=" (about 40 seconds on one CPU thread)"),
}


def save_shipped(model: GPT, out_dir: str | os.PathLike, config: dict, files: Mapping[str, object] = {}, *,
                 log: dict | None = None, tokenizer: Tokenizer | None = None) -> Path:
    """Write a shipped model's folder: ``model.safetensors``, ``config.json`` (``config``) and ``files``.

    ``files`` maps a file name to a function that writes it at a given path; ``log`` is written as
    ``train_log.json`` and ``tokenizer`` as ``tokenizer.txt``. Every file goes through a temporary name
    and a rename (``tfedu.data.write_atomically``).
    """
    from safetensors.torch import save_file

    files = dict(files)
    if log is not None:
        files["train_log.json"] = lambda p: p.write_text(json.dumps(log) + "\n")
    if tokenizer is not None:
        files["tokenizer.txt"] = tokenizer.save

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # safetensors refuses two names for one tensor: a tied W_U is stored once, as the embedding.
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (model.cfg.tied_embeddings and k == "unembed.weight")}
    write_atomically(out / "model.safetensors", lambda p: save_file(state, str(p)))
    write_atomically(out / "config.json", lambda p: p.write_text(json.dumps(config, indent=1) + "\n"))
    for file_name, write in files.items():
        write_atomically(out / file_name, write)
    return out


def load_shipped(name: str, path: str | os.PathLike | None = None) -> tuple[GPT, dict]:
    """The shipped model ``name`` (eval mode) and its ``config.json``, from ``path`` (default: its folder).

    ``config.json`` must say ``"format": SHIPPED[name].format`` and hold the ``ModelConfig`` under
    ``"model"``; a missing file or a foreign folder gets a clear error saying how to rebuild it.
    """
    from safetensors.torch import load_file

    if name not in SHIPPED:
        raise ValueError(f"no shipped model {name!r}; the course ships {', '.join(map(repr, SHIPPED))}")
    shipped = SHIPPED[name]
    folder = Path(path) if path is not None else shipped_folder(name)
    files = [folder / f for f in ("model.safetensors", "config.json", *shipped.extra_files)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"the shipped {name} model is incomplete; missing {missing}. Rebuild it with "
                                f"`tfedu train --preset {name}`{shipped.rebuild}")
    config = json.loads(files[1].read_text())
    if config.get("format") != shipped.format:
        article = "an" if name[0] in "aeiou" else "a"
        raise ValueError(f"{files[1]} is not {article} {name} config (format {config.get('format')!r}, "
                         f"expected {shipped.format!r})")
    model = GPT(ModelConfig(**config["model"]))
    state = load_file(str(files[0]))
    if model.cfg.tied_embeddings:
        state["unembed.weight"] = state["embed.weight"]
    model.load_state_dict(state)
    return model.eval(), config


def load_shipped_with_tokenizer(name: str, path: str | os.PathLike | None = None) -> tuple[GPT, Tokenizer]:
    """The shipped model ``name`` (eval mode) and the tokenizer saved beside it."""
    model, _ = load_shipped(name, path)
    return model, Tokenizer.load(Path(path if path is not None else shipped_folder(name)) / "tokenizer.txt")


def load_shipped_log(name: str, path: str | os.PathLike | None = None) -> dict:
    """The ``train_log.json`` of the shipped model ``name``."""
    return json.loads((Path(path if path is not None else shipped_folder(name)) / "train_log.json").read_text())
