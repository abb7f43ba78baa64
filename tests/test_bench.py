"""`tfedu bench tokenizer` runs end to end (quick sizes) and reports the promised fields.

Speeds are not checked here: they depend on the machine and its load. The numbers that
matter are measured with the full `tfedu bench tokenizer --json`.
"""

import json

import pytest

from tfedu.course import cli
from tfedu.course.bench import tokenizer as bench_tokenizer

RATIOS = ("train_vs_hf", "train_vs_naive", "encode_vs_hf", "encode_vs_tiktoken")


@pytest.fixture(scope="module")
def quick_output(tmp_path_factory):
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = cli.main(["bench", "tokenizer", "--json", "--quick"])
    return code, buffer.getvalue()


def test_bench_is_a_cli_subcommand():
    assert "tfedu.course.bench.cli" in cli.SUBCOMMAND_MODULES
    args = cli.build_parser().parse_args(["bench", "tokenizer", "--quick"])
    assert args.name == "tokenizer" and args.quick and not args.json


def test_quick_bench_prints_a_table_then_one_json_object(quick_output):
    code, out = quick_output
    assert code == 0
    lines = out.strip().splitlines()
    result = json.loads(lines[-1])
    for key in RATIOS:
        assert isinstance(result[key], float) and result[key] > 0, key
    for key in ("python", "torch", "cpu_count", "corpus_bytes", "hf_pre_tokenizer", "train", "naive", "encode"):
        assert key in result, key
    for row in result["train"].values():
        assert row["tfedu_vocab_size"] == row["hf_vocab_size"]
        assert row["tfedu_s"] > 0 and row["hf_s"] > 0
    assert result["naive"]["same_merges"] and result["encode"]["tiktoken_ids_equal"]
    assert result["encode_vs_hf"] == pytest.approx(result["encode"]["hf_s"] / result["encode"]["tfedu_s"])
    table = "\n".join(lines[:-1])
    assert "HF tokenizers" in table and "tiktoken" in table and "naive" in table and "pre-tokenizer" in table


def test_table_without_json(capsys):
    result = bench_tokenizer.run(quick=True)
    table = bench_tokenizer.format_table(result)
    assert "train_vs_hf" in table and "WARNING" not in table


def test_missing_peer_library_is_a_clear_error(monkeypatch, capsys):
    def no_peer(quick):
        raise ModuleNotFoundError("No module named 'tiktoken'", name="tiktoken")

    monkeypatch.setattr(bench_tokenizer, "run", no_peer)
    assert cli.main(["bench", "tokenizer"]) == 2
    assert "needs tiktoken" in capsys.readouterr().err


# ----------------------------------------------------------------------------- tfedu bench model

MODEL_RATIOS = ("manual_vs_hf", "sdpa_vs_hf", "manual_vs_hf_eager")


@pytest.fixture(scope="module")
def quick_model_output():
    import contextlib
    import io

    pytest.importorskip("transformers")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = cli.main(["bench", "model", "--json", "--quick", "--device", "cpu"])
    return code, buffer.getvalue()


def test_model_bench_is_a_cli_subcommand():
    args = cli.build_parser().parse_args(["bench", "model", "--quick", "--device", "cpu"])
    assert args.name == "model" and args.quick and args.device == "cpu" and not args.json


def test_quick_model_bench_prints_a_table_then_one_json_object(quick_model_output):
    code, out = quick_model_output
    assert code == 0
    lines = out.strip().splitlines()
    result = json.loads(lines[-1])
    for key in MODEL_RATIOS:
        assert isinstance(result[key], float) and result[key] > 0, key
    for key in ("python", "torch", "transformers", "cpu_model", "cpu_count", "hf_attn_implementation",
                "d_model", "n_layers", "n_heads", "d_vocab", "batch", "context", "goal", "goal_met_sdpa"):
        assert key in result, key
    assert result["goal"] == 0.9 and result["hf_eager_attn_implementation"] == "eager"
    assert result["devices"]["cpu"]["torch_threads"] >= 1
    assert list(result["runs"]) == ["cpu float32"]
    run = result["runs"]["cpu float32"]
    for name in ("hf", "hf_eager", "tfedu_manual", "tfedu_sdpa"):
        timing = run["timings"][name]
        assert 0 < timing["best_s"] <= timing["median_s"] and len(timing["all_s"]) == run["rounds"]
        assert timing["tokens_per_s_median"] == pytest.approx(run["tokens_per_step"] / timing["median_s"])
        # Same weights, same batch: the same logits, loss and gradients as Hugging Face's GPT-2.
        agreement = run["agreement"][name]
        assert agreement["max_abs_logit_diff"] < 1e-5 and agreement["abs_loss_diff"] < 1e-5, name
        assert agreement["max_abs_embedding_grad_diff"] < 1e-6, name
    assert result["logits_agree"] and result["max_abs_logit_diff"] < 1e-5
    hf, manual = run["timings"]["hf"], run["timings"]["tfedu_manual"]
    assert run["ratios"]["tfedu_manual/hf"] == pytest.approx(hf["best_s"] / manual["best_s"])
    assert run["ratios_median"]["tfedu_manual/hf"] == pytest.approx(hf["median_s"] / manual["median_s"])
    assert result["manual_vs_hf"] == run["ratios"]["tfedu_manual/hf"]
    table = "\n".join(lines[:-1])
    assert "HF GPT-2 (sdpa)" in table and "HF GPT-2 (eager)" in table and "tfedu GPT (manual)" in table
    assert "WARNING" not in table


def test_quick_model_bench_times_tfedu_train_against_a_plain_hf_loop(quick_model_output):
    code, out = quick_model_output
    lines = out.strip().splitlines()
    result = json.loads(lines[-1])
    for key in ("train_sdpa_vs_hf_loop", "train_manual_vs_hf_loop"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert isinstance(result["goal_met_train_sdpa"], bool) and isinstance(result["goal_met_train_manual"], bool)
    assert list(result["train"]) == ["cpu float32"]
    run = result["train"]["cpu float32"]
    assert run["steps_per_call"] >= 1 and run["check_steps"] >= 2
    for name in ("hf_loop", "tfedu_manual", "tfedu_sdpa"):
        timing = run["timings"][name]
        assert 0 < timing["best_s"] <= timing["median_s"] and len(timing["all_s"]) == run["rounds"]
        assert timing["tokens_per_s_best"] == pytest.approx(run["tokens_per_step"] / timing["best_s"])
        # Same weights, same batches, float32: train()'s loss is the plain loop's at every step
        # (so the optimizer, the schedule and the clipping did the same thing in between).
        agreement = run["agreement"][name]
        assert len(agreement["losses"]) == run["check_steps"]
        assert agreement["max_abs_loss_diff"] < 1e-5 and agreement["max_rel_grad_norm_diff"] < 1e-5, name
    assert run["losses_agree"] and result["train_losses_agree"]
    assert run["hf_loop_losses"][0] == pytest.approx(5.55, abs=0.3)  # about ln(256): untrained, 256 tokens
    assert result["train_sdpa_vs_hf_loop"] == run["ratios"]["tfedu_sdpa/hf_loop"]
    loop, sdpa = run["timings"]["hf_loop"], run["timings"]["tfedu_sdpa"]
    assert run["ratios"]["tfedu_sdpa/hf_loop"] == pytest.approx(loop["best_s"] / sdpa["best_s"])
    assert "reported_tokens_per_s_median" in sdpa and "reported_tokens_per_s_median" not in loop
    table = "\n".join(lines[:-1])
    assert "plain loop, HF GPT-2 (sdpa)" in table and "tfedu.train, GPT (sdpa)" in table
    assert "train_sdpa_vs_hf_loop" in table


def test_model_bench_device_flag_is_refused_by_cpu_only_benches(capsys):
    assert cli.main(["bench", "tokenizer", "--device", "cpu"]) == 2
    assert "no --device" in capsys.readouterr().err


def test_model_bench_rejects_an_unknown_device():
    from tfedu.course.bench import model as bench_model

    with pytest.raises(ValueError, match="device must be"):
        bench_model.run(quick=True, device="tpu")


def test_model_bench_on_cuda_without_a_gpu_is_a_clear_error(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "model", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_model_bench_under_bfloat16_autocast_reports_without_holding_to_float32_tolerance():
    # The CUDA run's bfloat16 branch, exercised on the CPU (CI has no GPU).
    pytest.importorskip("transformers")
    import torch

    from tfedu.course.bench import model as bench_model

    shape = {key: bench_model.QUICK[key] for key in ("d_vocab", "n_ctx", "d_model", "n_layers", "n_heads", "batch", "context")}
    run = bench_model.bench_one(bench_model.build_models(shape), shape, "cpu", torch.bfloat16, rounds=1, warmup=1)
    assert run["dtype"] == "bfloat16 autocast" and run["logits_agree"] is None
    assert 0 < run["max_abs_logit_diff"] < 0.1
    assert set(run["ratios"]) == {"tfedu_manual/hf", "tfedu_sdpa/hf", "tfedu_manual/hf_eager", "tfedu_sdpa/hf_eager"}


# ----------------------------------------------------------------------------- tfedu bench attention


def test_attention_bench_is_a_cli_subcommand():
    args = cli.build_parser().parse_args(["bench", "attention", "--quick", "--device", "cpu"])
    assert args.name == "attention" and args.quick and args.device == "cpu"


def quick_bench_on_the_cpu(name: str) -> tuple[dict, str]:
    """``tfedu bench NAME --json --quick --device cpu``: its JSON result and its table."""
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = cli.main(["bench", name, "--json", "--quick", "--device", "cpu"])
    assert code == 0
    lines = buffer.getvalue().strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


def test_quick_attention_bench_on_the_cpu_prints_a_table_then_one_json_object():
    pytest.importorskip("tfedu.flash")
    result, table = quick_bench_on_the_cpu("attention")
    for key in ("python", "torch", "triton", "triton_available", "flop_convention", "goals", "devices", "cpu"):
        assert key in result, key
    assert "cuda" not in result and result["devices"]["cpu"]["torch_threads"] >= 1
    cpu = result["cpu"]
    assert [(row["N"], row["causal"]) for row in cpu["rows"]] == [(128, False), (128, True), (256, False), (256, True)]
    for row in cpu["rows"]:
        assert set(row["timings"]) == {"tiles", "standard", "sdpa"}
        assert all(timing["median_s"] > 0 for timing in row["timings"].values())
        assert all(peak > 0 for peak in row["peak_bytes"].values())
        assert max(row["agreement"].values()) < 1e-5
        assert row["ratios"]["tiles_vs_standard"] == pytest.approx(
            row["timings"]["standard"]["best_s"] / row["timings"]["tiles"]["best_s"])
    # The whole point of the tiles: less memory than the (N x N) scores, more so as N grows.
    assert cpu["rows"][2]["memory_ratios"]["standard_over_tiles"] > cpu["rows"][0]["memory_ratios"]["standard_over_tiles"] > 1
    assert "tiles s" in table and "standard s" in table and "WARNING" not in table


def test_attention_bench_flop_count_follows_the_flash_attention_convention():
    from tfedu.course.bench import attention as bench_attention

    forward = bench_attention.attention_flops(4, 16, 4096, 128, causal=False)
    assert forward == 4 * 4 * 16 * 4096**2 * 128
    assert bench_attention.attention_flops(4, 16, 4096, 128, causal=True) == forward / 2
    assert bench_attention.attention_flops(4, 16, 4096, 128, causal=False, backward=True) == 3.5 * forward


def fake_cuda_row(n, causal, triton_s, flash_s, cudnn_s):
    """A CUDA row as bench_cuda_shape returns it (CI has no GPU: the formatting and goals are checked on this)."""
    from tfedu.course.bench import attention as bench_attention

    def timing(seconds, mode):
        flops = bench_attention.attention_flops(16, 32, n, 64, causal, backward=mode == "fwd_bwd")
        return {"best_s": seconds, "median_s": seconds, "all_s": [seconds], "tflops": flops / seconds / 1e12,
                "peak_extra_bytes": 2**20}

    row = {"N": n, "d_head": 64, "causal": causal, "batch": 16, "n_heads": 32, "dtype": "bfloat16",
           "skipped": {"sdpa_math": "N > 4096: the (N x N) scores would not fit"}, "errors": {},
           "agreement": {name: {"max_abs_out_diff": 1e-3, "max_abs_grad_diff": 2e-3, "agrees": True}
                         for name in ("triton", "sdpa_flash", "sdpa_cudnn")}}
    for mode, factor in (("forward", 1.0), ("fwd_bwd", 3.0)):
        row[mode] = {name: timing(seconds * factor, mode) for name, seconds in
                     (("triton", triton_s), ("sdpa_flash", flash_s), ("sdpa_cudnn", cudnn_s))}
    row["ratios"] = bench_attention.cuda_ratios(row)
    return row


def test_attention_bench_cuda_ratios_goals_and_table_from_fake_rows():
    from tfedu.course.bench import attention as bench_attention

    rows = [fake_cuda_row(1024, False, 1.0, 1.1, 0.8), fake_cuda_row(1024, True, 1.0, 0.9, 0.6)]
    assert rows[0]["ratios"]["forward_vs_flash"] == pytest.approx(1.1)
    assert rows[1]["ratios"]["forward_vs_cudnn"] == pytest.approx(0.6)
    summary = bench_attention.summarize_cuda(rows)
    assert summary["worst"]["forward_vs_flash"] == pytest.approx(0.9) and summary["goals_met"]["forward_vs_flash"] is False
    assert summary["goals_met"]["forward_vs_cudnn"] is False and summary["goals_met"]["fwd_bwd_vs_flash"] is True
    cuda = {"dtype": "bfloat16", "tokens_per_call": 16384, "width": 2048, "warmup": 1, "rounds": 1, "rows": rows, **summary}
    result = {"quick": True, "torch": "x", "triton": "3.6.0", "triton_available": [True, "on the GPU"],
              "load_average_1min": 0.1, "load_average_1min_end": 0.1, "goals": bench_attention.GOALS,
              "devices": {"cuda": {"name": "H100", "memory_gib": 80, "capability": "9.0", "cuda": "13.0"}}, "cuda": cuda}
    table = bench_attention.format_table(result)
    assert "SDPA flash backend" in table and "SDPA cuDNN backend" in table and "tfedu Triton kernel" in table
    assert "skipped: N > 4096" in table and "forward_vs_flash 0.90 (goal 1.0: NOT met)" in table
    assert "fwd_bwd_vs_flash" in table and "WARNING" not in table


def test_attention_bench_without_a_usable_kernel_times_the_sdpa_backends_and_says_why(monkeypatch):
    import tfedu.kernels
    from tfedu.course.bench import attention as bench_attention

    monkeypatch.setattr(tfedu.kernels, "available", lambda: (False, "triton is not installed: pip install triton"))
    fns, skipped = bench_attention.contenders_for_cuda(16384)
    assert skipped["triton"] == "triton is not installed: pip install triton"
    assert "sdpa_flash" in fns and "sdpa_cudnn" in fns and "sdpa_math" in skipped


def test_attention_bench_on_cuda_without_a_gpu_is_a_clear_error(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "attention", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


# ----------------------------------------------------------------------------- tfedu bench decode


def test_quick_decode_bench_prints_a_table_then_one_json_object():
    pytest.importorskip("transformers")
    result, table = quick_bench_on_the_cpu("decode")
    for key in ("cached_vs_hf", "manual_cached_vs_hf", "cached_vs_uncached"):
        assert isinstance(result[key], float) and result[key] > 0, key
    for key in ("python", "torch", "transformers", "hf_attn_implementation", "d_model", "n_layers", "prompt",
                "new_tokens", "goals", "goal_met_cached_vs_hf", "goal_met_cached_vs_uncached", "devices"):
        assert key in result, key
    assert result["goals"] == {"cached_vs_hf": 1.0, "cached_vs_uncached": 5.0} and result["tokens_identical"]
    assert list(result["runs"]) == ["cpu float32"]
    run = result["runs"]["cpu float32"]
    for name in ("hf_cached", "tfedu_cached", "tfedu_cached_manual", "tfedu_uncached"):
        timing = run["timings"][name]
        assert 0 < timing["best_s"] <= timing["median_s"] and len(timing["all_s"]) == run["rounds"]
        assert timing["tokens_per_s_best"] == pytest.approx(result["new_tokens"] / timing["best_s"])
        assert timing["peak_bytes"] > 0
    cached, hf = run["timings"]["tfedu_cached"], run["timings"]["hf_cached"]
    assert run["ratios"]["tfedu_cached/hf_cached"] == pytest.approx(hf["best_s"] / cached["best_s"])
    assert result["cached_vs_uncached"] == run["ratios"]["tfedu_cached/tfedu_uncached"]
    # The cache holds prompt + new - 1 tokens: 2 * n_layers * n_kv_heads * d_head * 4 bytes each.
    assert run["kv_cache_bytes"] == 2 * 2 * 4 * 16 * 4 * (result["prompt"] + result["new_tokens"] - 1)
    assert "transformers, its cache" in table and "tfedu, no cache" in table and "cached_vs_uncached" in table


def test_decode_bench_asserts_identical_tokens(monkeypatch):
    pytest.importorskip("transformers")
    from tfedu.course.bench import decode as bench_decode

    real = bench_decode.decoders

    def one_wrong(hf, ours, ids, new_tokens):
        fns = real(hf, ours, ids, new_tokens)
        right = fns["tfedu_cached"]

        def wrong():
            out = right().clone()
            out[0, -1] = (out[0, -1] + 1) % hf.config.vocab_size  # the last token changed
            return out

        return {**fns, "tfedu_cached": wrong}

    monkeypatch.setattr(bench_decode, "decoders", one_wrong)
    with pytest.raises(AssertionError, match="tfedu, KV cache \\(sdpa\\) decoded other tokens than transformers on cpu"):
        bench_decode.run(quick=True, device="cpu")


# ----------------------------------------------------------------------------- tfedu bench serve


def test_quick_serve_bench_prints_a_table_then_one_json_object(capsys):
    pytest.importorskip("transformers")
    assert cli.main(["bench", "serve", "--json", "--quick"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result, table = json.loads(lines[-1]), "\n".join(lines[:-1])
    assert result["goals"] == {"continuous_vs_static": 2.0} and result["tokens_identical"]
    assert list(result["models"]) == ["tiny"]
    m = result["models"]["tiny"]
    assert m["requests"] == 6 and len(m["rounds"]["continuous"]) == len(m["rounds"]["static"]) == 1
    for server in ("continuous", "static"):
        best = m["best"][server]
        assert best["tokens"] == m["new_tokens_total"] and best["tokens_per_s"] == pytest.approx(
            best["tokens"] / best["seconds"])
        assert 0 < best["latency_p50_s"] <= best["latency_p90_s"] <= best["seconds"]
    assert m["ratio"] == pytest.approx(m["best"]["continuous"]["tokens_per_s"] / m["best"]["static"]["tokens_per_s"])
    assert result["continuous_vs_static"] == m["ratio"]
    assert "transformers generate, static batches" in table and "continuous_vs_static" in table


def test_serve_bench_trace_is_seeded_and_loads_the_servers():
    import torch

    from tfedu.course.bench import serve as bench_serve

    spec = {"requests": 40, "max_batch": 4, "prompt": (2, 8), "new_tokens": (2, 64), "load": 2.0}
    a, b = (bench_serve.trace(spec, 100, step_seconds=0.01) for _ in range(2))
    assert [(len(r.prompt), r.max_new_tokens, r.arrival) for r in a] == [(len(r.prompt), r.max_new_tokens, r.arrival)
                                                                         for r in b]
    assert all(torch.equal(x.prompt, y.prompt) for x, y in zip(a, b))
    assert a[0].arrival == 0 and all(2 <= len(r.prompt) <= 8 and 2 <= r.max_new_tokens <= 64 for r in a)
    # Twice the rate a full batch serves: 4 rows / (mean answer * 0.01 s) requests a second, on average.
    mean = sum(r.max_new_tokens for r in a) / len(a)
    rate = (len(a) - 1) / a[-1].arrival
    assert 0.5 * 2 * 4 / (mean * 0.01) < rate < 2 * 2 * 4 / (mean * 0.01)


def test_serve_bench_asserts_identical_tokens(monkeypatch):
    pytest.importorskip("transformers")
    from tfedu.course.bench import serve as bench_serve

    real = bench_serve.hf_batch_generator

    def one_wrong(hf):
        generate_batch = real(hf)

        def wrong(prompts, max_new_tokens):
            out = [t.clone() for t in generate_batch(prompts, max_new_tokens)]
            out[0][0] = (out[0][0] + 1) % hf.config.vocab_size  # the first request's first new token changed
            return out

        return wrong

    monkeypatch.setattr(bench_serve, "hf_batch_generator", one_wrong)
    with pytest.raises(AssertionError, match="continuous batching and transformers' static batches decoded other "
                                             "tokens \\(request .*: new token 0\\)"):
        bench_serve.run(quick=True)


# ----------------------------------------------------------------------------- tfedu bench moe


def test_quick_moe_bench_compares_both_dispatches_and_hf_mixtral(capsys):
    pytest.importorskip("transformers")
    assert cli.main(["bench", "moe", "--json", "--quick", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert "loop/sorted" in "\n".join(out[:-1]) and result["bench"] == "moe"
    [row] = result["rows"]
    assert set(row["times"]) == {"sorted", "loop", "hf"} and set(row["ratios"]) == {"loop_vs_sorted", "hf_vs_sorted"}
    assert row["device"] == "cpu" and result["versions"]["transformers"]


# ---- tfedu bench grade ----------------------------------------------------------------------------------


def fake_grading(monkeypatch, solved_points=None):
    """bench grade with the grader replaced by one that answers at once: the bench's own logic, no kernel."""
    from tfedu.course.bench import grading as bench_grading

    calls = []

    def fake(paths, source, *, jobs, sandboxed, full=False, cold=False):
        calls.append((len(paths), jobs, full, "released" in str(paths[0]), cold))
        solved = "released" not in str(paths[0])
        points = (solved_points if solved_points is not None else 5.0) if solved else 0.0
        entries = [{"total": points, "max": 5.0, "cells_skipped": 0 if full else 7, "kernel_start": "cold" if cold else "warm",
                    "exercises": {"check_x": {"points": points, "max": 5.0, "feedback": "the check cell failed: x"}}}
                   for _ in paths]
        return {1: 4.0, 2: 5.0}[jobs] * (3.0 if full else 1.5 if cold else 1.0), entries

    monkeypatch.setattr(bench_grading, "_grade", fake)
    return bench_grading, calls


def test_bench_grade_reports_seconds_per_submission_the_class_and_the_full_and_cold_runs_as_peers(monkeypatch):
    bench_grading, calls = fake_grading(monkeypatch)
    result = bench_grading.run(quick=True)
    [row] = result["rows"]
    assert row["notebook"] == "00_start_here" and row["solved_s"] == 4.0 and row["jobs2_s_per_submission"] == 2.5
    assert row["full_s"] == 12.0 and row["full_over_solved"] == 3.0 and row["cells_skipped"] == 7
    assert row["class_minutes"] == round(300 * 2.5 / 60, 1)
    assert row["cold_s"] == 6.0 and row["cold_over_solved"] == 1.5 and row["kernel_start"] == "warm"
    assert sorted(calls) == sorted([(1, 1, False, False, False), (2, 2, False, False, False), (1, 1, False, True, False),
                                    (1, 1, True, False, False), (1, 1, False, False, True)])
    table = bench_grading.format_table(result)
    assert "00_start_here" in table and "3.0x" in table and "1.5x" in table and "warm" in table and "goal:" in table
    assert "met" in table
    args = cli.build_parser().parse_args(["bench", "grade", "--quick", "--json"])
    assert args.name == "grade"


def test_bench_grade_stops_on_a_wrong_grade(monkeypatch):
    bench_grading, _ = fake_grading(monkeypatch, solved_points=3.0)
    with pytest.raises(RuntimeError, match="the solved notebook scored 3 / 5 .check_x: the check cell failed"):
        bench_grading.run(quick=True)
