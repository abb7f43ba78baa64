"""The shipped course chat model (data/course-chat): it loads, its log is what its recipe makes again, and the
claims notebook 17 reads from the log are there. Rebuilding it all takes about 14 minutes on one thread, so the
tests replay the first steps of each stage and compare them with the log."""

import json

import pytest
import torch

from tfedu.experiments import course_chat
from tfedu.post_training import CHAT_SPECIAL_TOKENS
from tfedu.tuning import task_accuracy


@pytest.fixture(scope="module")
def shipped():
    torch.set_num_threads(1)  # the recipe ran on one thread; the replay must too to repeat it bit for bit
    model, tok = course_chat.load()
    train, held_out = course_chat.tasks()
    return model, tok, train, held_out, course_chat.load_log()


def test_the_shipped_model_has_the_chat_tokens(shipped):
    model, tok, *_ = shipped
    assert model.cfg.d_vocab == 1028 and not model.training
    assert [tok.special_tokens[t] for t in CHAT_SPECIAL_TOKENS] == [1024, 1025, 1026, 1027]
    config = json.loads((course_chat.FOLDER / "config.json").read_text())
    assert config["sft"] == course_chat.SFT and config["grpo"] == course_chat.GRPO and config["dpo"] == course_chat.DPO


def test_sft_replays_the_logged_first_steps_and_accuracy(shipped):
    model, tok, train, held_out, log = shipped
    _, losses = course_chat.sft(train, tok, stop_after=3)
    assert losses == pytest.approx(log["losses"][:3], abs=1e-4)
    assert len(log["losses"]) == course_chat.SFT["steps"]
    assert task_accuracy(model, tok, held_out) == log["after"]
    assert log["before"]["all"] == 0.0 and log["after"]["all"] > 0.1


def test_dpo_and_grpo_replay_their_first_steps(shipped):
    model, tok, train, held_out, log = shipped
    pairs = course_chat.pairs(model, tok, train)
    assert len(pairs) == log["dpo"]["pairs"]
    run = next(r for r in log["dpo"]["runs"] if r["beta"] == 0.1 and r["seed"] == 0)
    _, history = course_chat.dpo_run(model, tok, pairs[:], 0.1, 0)
    assert history["loss"] == pytest.approx(run["loss"], abs=1e-4)
    _, history = course_chat.grpo_run(model, tok, train, seed=0, steps=2)
    assert history["reward"] == log["grpo"]["runs"][0]["reward"][:2]


def test_the_log_holds_every_run_notebook_17_reads(shipped):
    *_, log = shipped
    assert {(r["n_examples"], r["seed"]) for r in log["sweep"]} == {
        (n, s) for n in course_chat.SWEEP["n_examples"] for s in course_chat.SWEEP["seeds"]}
    assert {(r["beta"], r["seed"]) for r in log["dpo"]["runs"]} == {
        (b, s) for b in course_chat.DPO["betas"] for s in course_chat.DPO["seeds"]}
    assert [r["seed"] for r in log["grpo"]["runs"]] == course_chat.GRPO["seeds"]
    for r in log["grpo"]["runs"]:
        assert len(r["reward"]) == course_chat.GRPO["steps"] and len(r["counts"]) == len(log["grpo"]["counts_before"])
        assert all(0 <= c <= course_chat.PASS["n"] for c in r["counts"])


def test_bad_input_gets_clear_errors(tmp_path, capsys):
    from tfedu.course import cli

    with pytest.raises(FileNotFoundError, match="tfedu train --preset course-chat"):
        course_chat.load(tmp_path)
    (tmp_path / "model.safetensors").write_text("x")
    (tmp_path / "config.json").write_text('{"format": "tfedu-course-gpt 1"}')
    (tmp_path / "tokenizer.txt").write_text("x")
    with pytest.raises(ValueError, match="course-chat"):
        course_chat.load(tmp_path)
    assert cli.main(["train", "--preset", "course-chat", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert cli.main(["train", "--preset", "course-chat", "--steps", "3", "--out", str(tmp_path)]) == 2
    assert "course-chat" in capsys.readouterr().out
