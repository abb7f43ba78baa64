"""The shipped course GPT (data/course-gpt): it loads, its held-out loss is the README's, and a fresh
run of `tfedu train --preset course-gpt` starts exactly as the shipped training log says."""

import re
from pathlib import Path

import pytest
import torch

import tfedu
from tfedu.experiments import course_gpt
from tfedu.train import evaluate, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def shipped():
    return course_gpt.load()


@pytest.fixture(scope="module")
def tokenizer():
    return course_gpt.tokenizer()


def readme_val_loss() -> float:
    match = re.search(r"held-out loss of ([0-9.]+)", README.read_text())
    assert match, "README.md must state the course GPT's 'held-out loss of X'"
    return float(match.group(1))


def test_the_folder_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in course_gpt.FOLDER.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.txt", "train_log.json"} <= set(files)
    assert sum(files.values()) < 10 * 2**20


def test_it_loads_in_eval_mode_with_tied_embeddings_and_through_tfedu_pretrained(shipped):
    model, tok = shipped
    assert not model.training and model.unembed.weight is model.embed.weight
    assert model.cfg == course_gpt.MODEL_CONFIG
    again = tfedu.pretrained("course-gpt")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_the_shipped_tokenizer_is_the_one_the_corpus_trains(shipped, tokenizer):
    assert shipped[1].merges == tokenizer.merges and shipped[1].special_tokens == tokenizer.special_tokens


def test_held_out_loss_matches_the_readme_and_the_log(shipped, tokenizer):
    model, _ = shipped
    _, val_data = course_gpt.datasets(tokenizer)
    loss = evaluate(model, val_data, model.cfg.n_ctx)
    assert abs(loss - readme_val_loss()) < 0.02
    assert abs(loss - course_gpt.load_log()["val_loss"]) < 1e-4


def test_a_fresh_run_of_the_preset_reproduces_the_first_logged_steps(tokenizer):
    train_data, _ = course_gpt.datasets(tokenizer)
    model = course_gpt.fresh_model()
    first = 5
    result = train(model, train_data, course_gpt.TRAIN_CONFIG, progress=False,
                   on_step=course_gpt._stop_after(first))
    logged = course_gpt.load_log()["history"][:first]
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor([r["loss"] for r in logged]), rtol=1e-4, atol=1e-5)
    assert [r["lr"] for r in result.history] == pytest.approx([r["lr"] for r in logged])


def test_a_missing_or_foreign_folder_gets_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tfedu train --preset course-gpt"):
        course_gpt.load(tmp_path)
    for name in ("model.safetensors", "tokenizer.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "config.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a course-gpt config"):
        course_gpt.load(tmp_path)
