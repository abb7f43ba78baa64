"""`tfedu bench tokenizer` runs end to end (quick sizes) and reports the promised fields.

Speeds are not checked here: they depend on the machine and its load. The numbers that
matter are measured with the full `tfedu bench tokenizer --json`.
"""

import json

import pytest

from tfedu import cli
from tfedu.bench import tokenizer as bench_tokenizer

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
    assert "tfedu.bench.cli" in cli.SUBCOMMAND_MODULES
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
