"""The shipped induction GPT (data/induction-gpt): it loads, it has the heads notebook 15 says it has
(a previous-token head in layer 0, induction heads in layer 1, at periods it was and was not trained
on), ablating them undoes the copying, and a fresh run starts exactly as the shipped log says."""

import json

import pytest
import torch

import tfedu
from tfedu.experiments import induction
from tfedu.interp import chance_scores, repeated_random_tokens, repeated_sequence_losses, score_heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")
V = induction.MODEL_CONFIG.d_vocab


@pytest.fixture(scope="module")
def model():
    return induction.load()


def repeated(seq_len: int, seed: int = 0, batch: int = 32) -> torch.Tensor:
    return repeated_random_tokens(batch, seq_len, V, generator=torch.Generator().manual_seed(seed), bos=induction.BOS)


def test_the_folder_is_small_and_loads_through_tfedu_pretrained(model):
    files = {p.name: p.stat().st_size for p in induction.FOLDER.iterdir()}
    assert {"model.safetensors", "config.json", "train_log.json"} <= set(files)
    assert sum(files.values()) < 2**20
    assert model.cfg == induction.MODEL_CONFIG and not model.cfg.has_mlp and not model.training
    again = tfedu.pretrained("induction-gpt")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_periodic_batch_rows_repeat_a_pattern_of_distinct_tokens():
    ids = induction.periodic_batch(200, generator=torch.Generator().manual_seed(3))
    assert ids.shape == (200, induction.MODEL_CONFIG.n_ctx) and (ids[:, 0] == induction.BOS).all()
    assert (ids[:, 1:] != induction.BOS).all() and ids.max() < V
    periods = []
    for row in ids.tolist():
        body = row[1:]
        # the smallest L such that the row's tail repeats with period L over at least two copies
        found = [L for L in range(induction.PERIODS[0], induction.PERIODS[1] + 1)
                 if all(body[i] == body[i - L] for i in range(induction.MAX_PREFIX + L, len(body)))]
        assert found, row
        L = found[0]
        assert len(set(body[-L:])) == L  # the pattern's tokens are distinct
        periods.append(L)
    assert min(periods) == induction.PERIODS[0] and max(periods) == induction.PERIODS[1]


@pytest.mark.parametrize("seq_len", [5, 8, 12, 20])
def test_layer_one_has_induction_heads_at_every_period(model, seq_len):
    """Periods never drawn together in one batch row, one score per period: content matching, not one offset."""
    scores = score_heads(model, repeated(seq_len), seq_len)
    chance = chance_scores(seq_len, offset=1)
    assert (scores["induction"][1] > 0.8).all(), scores["induction"]
    assert (scores["induction"][1] > 5 * chance["induction"]).all()
    assert (scores["induction"][0] < 0.1).all()  # layer 0 cannot: no earlier layer has said which token came before
    assert scores["previous_token"][0].max() > 0.8 and scores["previous_token"][0].max() > 4 * chance["previous_token"]


def test_past_the_trained_distances_the_heads_weaken(model):
    """Period 30: the model never saw a key 30 back from its repeat (periods 3-24). RoPE makes the
    query-key score depend on distance too, and the induction scores fall (0.57 and 0.65 measured)."""
    scores = score_heads(model, repeated(30), 30)["induction"][1]
    assert (scores < 0.75).all() and (scores > 10 * chance_scores(30, offset=1)["induction"]).all()
    assert repeated_sequence_losses(model, repeated(30), 30)["second"] > 2.0


def test_the_second_copy_is_predicted_and_the_first_is_not(model):
    losses = repeated_sequence_losses(model, repeated(12), 12)
    assert losses["first"] > 0.9 * torch.log(torch.tensor(float(V - 1))).item()  # random tokens: about ln 127
    assert losses["second"] < 1.0


def _ablated_second_copy_loss(model, layer: int, heads: list[int], seq_len: int = 12) -> float:
    def ablate(z):
        z = z.clone()
        z[:, :, heads] = 0.0
        return z

    with model.hooks(**{f"blocks__{layer}__attn__hook_z": ablate}):
        return repeated_sequence_losses(model, repeated(seq_len), seq_len)["second"]


def test_ablating_either_half_of_the_circuit_undoes_the_copying(model):
    clean = repeated_sequence_losses(model, repeated(12), 12)["second"]
    prev_head = int(score_heads(model, repeated(12), 12)["previous_token"][0].argmax())
    assert _ablated_second_copy_loss(model, 1, [0, 1]) > clean + 2.5  # the induction heads
    assert _ablated_second_copy_loss(model, 0, [prev_head]) > clean + 2.0  # the previous-token head they read


def test_a_fresh_run_reproduces_the_first_logged_steps():
    first = 5
    _, history = induction.train(first)
    logged = induction.load_log()["history"][:first]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in history]), torch.tensor([r["loss"] for r in logged]),
                               rtol=1e-4, atol=1e-5)
    assert [r["lr"] for r in history] == pytest.approx([r["lr"] for r in logged])


def test_the_shipped_config_records_the_data_recipe():
    config = json.loads((induction.FOLDER / "config.json").read_text())
    assert config["periods"] == list(induction.PERIODS) and config["max_prefix"] == induction.MAX_PREFIX
    assert config["bos"] == induction.BOS and config["train"]["steps"] == len(induction.load_log()["history"])


def test_bad_input_gets_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tfedu train --preset induction-gpt"):
        induction.load(tmp_path)
    (tmp_path / "model.safetensors").write_text("x")
    (tmp_path / "config.json").write_text('{"format": "tfedu-course-gpt 1"}')
    with pytest.raises(ValueError, match="not an induction-gpt config"):
        induction.load(tmp_path)
    with pytest.raises(ValueError, match="n_ctx >= 61"):
        induction.periodic_batch(2, generator=torch.Generator(), n_ctx=32)
    with pytest.raises(TypeError, match="seeded torch.Generator"):
        induction.periodic_batch(2, generator=0)
    with pytest.raises(ValueError, match="d_vocab > 24"):
        induction.train(1, cfg=induction.MODEL_CONFIG.replace(d_vocab=10))


def test_the_cli_preset_writes_a_loadable_folder(tmp_path, capsys):
    from tfedu.course import cli

    assert cli.main(["train", "--preset", "induction-gpt", "--steps", "3", "--out", str(tmp_path), "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["out"] == str(tmp_path)
    assert induction.load(tmp_path).cfg == induction.MODEL_CONFIG
    assert cli.main(["train", "--preset", "induction-gpt", "--device", "cuda", "--out", str(tmp_path)]) == 2
