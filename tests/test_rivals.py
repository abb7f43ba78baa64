"""tfedu.experiments.rivals: notebook 19's recall task, decoding cost, equal-size LM configs and the shipped sweeps."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from tfedu.experiments import rivals
from tfedu.model import IGNORE_INDEX

TINY = dataclasses.replace(rivals.RECALL_RECIPE, steps=6, batch_size=4, warmup_steps=2)


@pytest.mark.parametrize("seed", [0, 1])
def test_recall_batch_asks_for_the_value_stored_under_each_key(seed):
    first, second, targets = rivals.recall_batch(16, 8, torch.Generator().manual_seed(seed))
    assert first.shape == second.shape == targets.shape == (16, 16)
    for row in range(16):
        keys, values = first[row, :8], second[row, :8]
        assert len(set(keys.tolist())) == 8  # distinct keys: each query has one answer
        assert ((keys >= 0) & (keys < rivals.N_KEYS)).all()
        assert ((values >= rivals.N_KEYS) & (values < 2 * rivals.N_KEYS)).all()
        stored = dict(zip(keys.tolist(), values.tolist()))
        assert sorted(first[row, 8:].tolist()) == sorted(keys.tolist())  # every key asked once
        assert (second[row, 8:] == rivals.QUERY).all()
        assert (targets[row, :8] == IGNORE_INDEX).all()
        assert [stored[k] for k in first[row, 8:].tolist()] == targets[row, 8:].tolist()


def test_recall_batch_is_seeded_and_refuses_bad_arguments():
    a = rivals.recall_batch(4, 8, torch.Generator().manual_seed(3))
    b = rivals.recall_batch(4, 8, torch.Generator().manual_seed(3))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="n_pairs=9 distinct keys need n_keys >= 9"):
        rivals.recall_batch(1, 9, torch.Generator(), n_keys=8)
    with pytest.raises(TypeError, match="seeded torch.Generator"):
        rivals.recall_batch(1, 2, 0)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        rivals.recall_batch(0, 2, torch.Generator())


@pytest.mark.parametrize("mixer", ["full_attention", "mamba", "hybrid"])
def test_a_recall_run_repeats_exactly(mixer):
    one = rivals.train_recall(mixer, 16, 4, 0, recipe=TINY, n_test=8)
    two = rivals.train_recall(mixer, 16, 4, 0, recipe=TINY, n_test=8)
    one.pop("seconds"), two.pop("seconds")
    assert one == two
    assert one["seq_len"] == 8 and one["steps"] == 6 and 0 <= one["accuracy"] <= 1


def test_every_mixer_has_a_learning_rate_and_nothing_else_does():
    assert set(rivals.RECALL_LR) == set(rivals.MIXERS)
    assert rivals.recall_recipe("mamba").lr == 3e-2
    assert rivals.recall_recipe("linear").steps == rivals.RECALL_RECIPE.steps
    with pytest.raises(ValueError, match="mixer must be one of"):
        rivals.recall_recipe("rnn")


def test_state_numbers_grow_with_the_context_for_attention_only():
    for mixer in rivals.MIXERS:
        cfg = rivals.recall_config(mixer, 64, 8)
        grows = rivals.state_numbers(cfg, 200) - rivals.state_numbers(cfg, 100)
        attention_layers = cfg.layer_types.count("full_attention")
        assert grows == attention_layers * 2 * 64 * 100, mixer


def test_lm_configs_have_equal_parameter_counts():
    counts = {m: rivals._n_params(rivals.lm_config(m)) for m in rivals.MIXERS}
    target = counts["full_attention"]
    assert rivals.lm_config("full_attention").d_mlp == 4 * rivals.LM_D_MODEL
    for mixer, count in counts.items():
        assert abs(count - target) < 300, (mixer, count, target)
    assert rivals.lm_config("hybrid").layer_types == rivals.HYBRID


def test_decode_cost_counts_the_bytes_each_layer_carries():
    rows = rivals.decode_cost([8, 32], d_model=32, n_heads=2, repeats=1)
    by = {(r["kind"], r["context"]): r for r in rows}
    assert by["full_attention", 8]["state_bytes"] == 2 * 32 * 8 * 4
    assert by["full_attention", 32]["state_bytes"] == 2 * 32 * 32 * 4
    assert by["gla", 8]["state_bytes"] == by["gla", 32]["state_bytes"] == 2 * 16 * 16 * 4
    assert by["mamba", 8]["state_bytes"] == 64 * (16 + 3) * 4
    assert all(r["seconds"] > 0 for r in rows)


def test_summarise_gives_mean_std_and_count():
    runs = [{"m": "a", "x": 1.0}, {"m": "a", "x": 3.0}, {"m": "b", "x": 2.0}]
    assert rivals.summarise(runs, ("m",), "x") == {("a",): (2.0, 1.4142, 2), ("b",): (2.0, 0.0, 1)}


def test_merge_logs_joins_parts_of_one_sweep(tmp_path):
    part = {"format": rivals.RECALL_FORMAT, "recipe": {"lr": 1}, "seconds": 5.0}
    (tmp_path / "a.json").write_text(json.dumps({**part, "runs": [{"mixer": "a"}]}))
    (tmp_path / "b.json").write_text(json.dumps({**part, "runs": [{"mixer": "b"}], "seconds": 7.0}))
    merged = rivals.merge_logs([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "out" / "recall.json")
    assert [r["mixer"] for r in merged["runs"]] == ["a", "b"] and merged["seconds"] == 7.0
    assert rivals.load_recall(tmp_path / "out")["processes"] == 2
    (tmp_path / "c.json").write_text(json.dumps({**part, "recipe": {"lr": 2}, "runs": []}))
    with pytest.raises(ValueError, match="different sweeps"):
        rivals.merge_logs([tmp_path / "a.json", tmp_path / "c.json"], tmp_path / "x.json")


def test_loading_a_missing_or_foreign_log_says_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="tfedu train --preset rivals-recall"):
        rivals.load_recall(tmp_path)
    (tmp_path / "lm.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a log of format"):
        rivals.load_lm(tmp_path)


def test_the_shipped_recall_sweep_has_every_run():
    log = rivals.load_recall()
    cells = {(r["mixer"], r["d_model"], r["n_pairs"], r["seed"]) for r in log["runs"]}
    assert cells == {(m, d, p, s) for m, d, p in rivals.recall_grid() for s in rivals.SEEDS}
    assert len(log["runs"]) == len(cells)
    assert log["recipe"] == rivals._recipe_dict(rivals.RECALL_RECIPE)
    assert all(r["steps"] == rivals.RECALL_RECIPE.steps for r in log["runs"])
    assert all(r["lr"] == rivals.recall_recipe(r["mixer"]).lr for r in log["runs"])


def test_the_shipped_lm_sweep_has_every_run():
    log = rivals.load_lm()
    assert {(r["mixer"], r["seed"]) for r in log["runs"]} == {(m, s) for m in rivals.MIXERS for s in rivals.SEEDS}
    assert log["recipe"] == rivals._recipe_dict(rivals.LM_RECIPE)
    params = {r["n_params"] for r in log["runs"]}
    assert max(params) - min(params) < 300


@pytest.mark.parametrize("extra, message", [(["--steps", "5"], "has no --steps"),
                                            (["--device", "cuda"], "runs on the CPU")])
def test_the_presets_refuse_what_they_cannot_do(extra, message, tmp_path):
    result = subprocess.run([sys.executable, "-m", "tfedu.course.cli", "train", "--preset", "rivals-lm",
                             "--out", str(tmp_path), *extra], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stdout
