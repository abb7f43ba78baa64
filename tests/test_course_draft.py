"""The shipped draft model (data/course-draft) and notebook 18's speculative-decoding measurements: it loads, a
fresh run of `tfedu train --preset course-draft` starts as the shipped log says, and the measuring functions give
the target's own tokens, counts in range and the speed-up formula of Leviathan et al. (2023)."""

import pytest
import torch

import tfedu
from tfedu.course import cli
from tfedu.config import preset
from tfedu.experiments import course_draft, course_gpt
from tfedu.model import GPT
from tfedu.speculative import prompt_lookup_draft
from tfedu.train import evaluate, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def shipped():
    return course_draft.load()


@pytest.fixture(scope="module")
def tokenizer():
    return course_gpt.tokenizer()


@pytest.fixture(scope="module")
def tiny_pair():
    torch.manual_seed(0)
    target = GPT(preset("tiny")).eval()
    draft = GPT(preset("tiny").replace(n_layers=1, d_model=32, n_heads=2)).eval()
    prompts = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    return target, draft, prompts


def test_the_folder_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in course_draft.FOLDER.iterdir()}
    assert set(files) == {"model.safetensors", "config.json", "train_log.json"}
    assert sum(files.values()) < 2 * 2**20


def test_it_loads_in_eval_mode_with_the_course_gpt_tokenizer_and_through_tfedu_pretrained(shipped, tokenizer):
    model, tok = shipped
    assert not model.training and model.cfg == course_draft.MODEL_CONFIG
    target_cfg = course_gpt.MODEL_CONFIG
    assert model.cfg.d_vocab == target_cfg.d_vocab and model.cfg.n_layers < target_cfg.n_layers
    assert tok.merges == tokenizer.merges and tok.special_tokens == tokenizer.special_tokens
    again = tfedu.pretrained("course-draft")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_held_out_loss_matches_the_log(shipped, tokenizer):
    _, val_data = course_gpt.datasets(tokenizer)
    assert abs(evaluate(shipped[0], val_data, shipped[0].cfg.n_ctx) - course_draft.load_log()["val_loss"]) < 1e-4


def test_a_fresh_run_of_the_preset_reproduces_the_first_logged_steps(tokenizer):
    train_data, _ = course_gpt.datasets(tokenizer)
    first = 5
    result = train(course_draft.fresh_model(), train_data, course_draft.TRAIN_CONFIG, progress=False,
                   on_step=course_gpt._stop_after(first))
    logged = course_draft.load_log()["history"][:first]
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor([r["loss"] for r in logged]),
                               rtol=1e-4, atol=1e-5)
    assert [r["lr"] for r in result.history] == pytest.approx([r["lr"] for r in logged])


def test_a_missing_or_foreign_folder_gets_a_clear_error_and_the_preset_is_cpu_only(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="tfedu train --preset course-draft"):
        course_draft.load(tmp_path)
    (tmp_path / "model.safetensors").write_text("x")
    (tmp_path / "config.json").write_text('{"format": "tfedu-course-gpt 1"}')
    with pytest.raises(ValueError, match="not a course-draft config"):
        course_draft.load(tmp_path)
    assert cli.main(["train", "--preset", "course-draft", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "course-draft runs on the CPU" in capsys.readouterr().out


def test_the_predicted_speedup_is_leviathan_et_als_formula():
    assert course_draft.predicted_speedup(0.5, 1, 0.0) == 1.5
    for k in (1, 3, 8):
        assert course_draft.predicted_speedup(1.0, k, 0.0) == k + 1  # every draft kept, drafting free
        assert course_draft.predicted_speedup(1 - 1e-9, k, 0.0) == pytest.approx(k + 1)
        assert course_draft.predicted_speedup(0.0, k, 0.0) == 1.0  # nothing kept: one token per pass
    alpha, k, c = 0.7, 4, 0.25
    by_hand = (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))
    assert course_draft.predicted_speedup(alpha, k, c) == pytest.approx(by_hand)
    assert course_draft.predicted_speedup(alpha, k, c, verify_cost=2.0) == pytest.approx(
        course_draft.expected_tokens_per_pass(alpha, k) / (k * c + 2))
    for a in (0.0, 0.3, 0.9, 1.0):
        tokens_per_pass = course_draft.expected_tokens_per_pass(a, 3)
        assert course_draft.alpha_from_tokens_per_pass(tokens_per_pass, 3) == pytest.approx(a, abs=1e-9)
    with pytest.raises(ValueError, match="alpha"):
        course_draft.predicted_speedup(1.5, 2, 0.1)
    with pytest.raises(ValueError, match="k"):
        course_draft.predicted_speedup(0.5, 0, 0.1)
    with pytest.raises(ValueError, match="tokens per pass"):
        course_draft.alpha_from_tokens_per_pass(5.0, 2)


def test_acceptance_vs_k_counts_are_in_range(tiny_pair):
    target, draft, prompts = tiny_pair
    for do_sample in (False, True):
        rows = course_draft.acceptance_vs_k(target, draft, prompts, [1, 3], new_tokens=8, do_sample=do_sample,
                                            seeds=[0, 1])
        assert [r["k"] for r in rows] == [1, 3]
        for r in rows:
            assert r["runs"] == len(prompts) * (2 if do_sample else 1)
            assert 0 <= r["acceptance_rate_min"] <= r["acceptance_rate"] <= 1 and r["acceptance_rate_max"] <= 1
            assert 1 <= r["tokens_per_pass_min"] <= r["tokens_per_pass_mean"] <= r["tokens_per_pass_max"] <= r["k"] + 1
            assert 0 <= r["alpha"] <= 1 and r["acceptance_rate_sem"] >= 0
    # a draft that is the target itself agrees every time: k + 1 tokens per pass but at the shortened last round
    same = course_draft.acceptance_vs_k(target, target, prompts[:1], [2], new_tokens=9, do_sample=False)[0]
    assert same["acceptance_rate"] == 1.0 and same["tokens_per_pass"] == 3.0
    lookup = course_draft.acceptance_vs_k(target, None, prompts, [2], new_tokens=8, do_sample=False,
                                          drafter=prompt_lookup_draft)[0]
    assert 0 <= lookup["acceptance_rate"] <= 1 and 1 <= lookup["tokens_per_pass"] <= 3
    with pytest.raises(ValueError, match="2-D integer tensor"):
        course_draft.acceptance_vs_k(target, draft, prompts[0], [1], new_tokens=4, do_sample=False)


def test_speedup_vs_k_checks_the_tokens_and_measures_costs(tiny_pair):
    target, draft, prompts = tiny_pair
    result = course_draft.speedup_vs_k(target, draft, prompts, [1, 2], new_tokens=6, repeats=1, pass_calls=2)
    assert result["c"] > 0 and result["target_pass_seconds"] > 0 and result["baseline_seconds_per_token"] > 0
    for r in result["rows"]:
        assert r["speedup"] > 0 and r["verify_cost"] > 0 and 1 <= r["tokens_per_pass"] <= r["k"] + 1
        assert r["predicted_speedup"] == pytest.approx(course_draft.predicted_speedup(r["alpha"], r["k"], result["c"]))
    lookup = course_draft.speedup_vs_k(target, None, prompts, [2], new_tokens=6, repeats=1, pass_calls=2,
                                       drafter=prompt_lookup_draft)
    assert lookup["c"] == 0.0 and lookup["draft_pass_seconds"] is None


def test_speedup_vs_k_refuses_a_decoder_that_changes_the_tokens(tiny_pair, monkeypatch):
    target, draft, prompts = tiny_pair

    def wrong(target, draft, ids, max_new_tokens, **kwargs):
        tokens, stats = real(target, draft, ids, max_new_tokens, **kwargs)
        tokens[0, -1] = (tokens[0, -1] + 1) % target.cfg.d_vocab
        return tokens, stats

    real = course_draft.speculative_generate
    monkeypatch.setattr(course_draft, "speculative_generate", wrong)
    with pytest.raises(AssertionError, match="other tokens than the target alone"):
        course_draft.speedup_vs_k(target, draft, prompts, [1], new_tokens=4, repeats=1, pass_calls=1)


def test_held_out_prompts_come_from_the_held_out_split(tokenizer):
    prompts = course_draft.held_out_prompts(tokenizer, n=3, length=5)
    _, val_data = course_gpt.datasets(tokenizer)
    held_out = val_data.ids.tolist()
    assert prompts.shape == (3, 5) and prompts.dtype == torch.int64
    assert prompts[0].tolist() == held_out[:5] and prompts[-1].tolist() == held_out[-5:]
