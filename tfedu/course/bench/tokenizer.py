"""``tfedu bench tokenizer``: BPE training and encoding, tfedu against its peers.

Measured in one run, on the default corpus (``tfedu.data.load_corpus()``):

- training time at each vocabulary size for ``tfedu.tokenizer.train_bpe`` and Hugging Face
  ``tokenizers`` (BpeTrainer on a ByteLevel BPE model, split with the same GPT-4 pattern);
- training time of ``train_bpe_naive`` (recounts every pair after every merge) at a small
  vocabulary size, with tfedu timed at that same size so the ratio is like for like;
- encoding throughput, single thread, of tfedu, tiktoken built from tfedu's own ranks
  (the same merges, so the same ids), and Hugging Face ``tokenizers``.

Every ratio is the peer's time divided by tfedu's: above 1 means tfedu is faster. Times are
the best of a few repeats (the least disturbed by other work on the machine).
"""

from __future__ import annotations

import os
import sys
import time

from tfedu.course.bench.common import best_time, machine, version
from tfedu.data import load_corpus
from tfedu.tokenizer import GPT4_PATTERN, Tokenizer, train_bpe, train_bpe_naive

FULL = {"n_chars": None, "vocab_sizes": (1000, 5000), "naive_vocab_size": 300, "repeats": 5, "encode_repeats": 5}
QUICK = {"n_chars": 20_000, "vocab_sizes": (300, 400), "naive_vocab_size": 270, "repeats": 1, "encode_repeats": 2}
HF_PRE_TOKENIZER = "Split(Regex(GPT4_PATTERN), behavior='isolated') then ByteLevel(add_prefix_space=False, use_regex=False)"


def hf_train(text: str, vocab_size: int):
    """Train Hugging Face's ByteLevel BPE with the GPT-4 split; vocab_size counts the 256 bytes."""
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GPT4_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=0, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([text], trainer=trainer)
    return tok


def run(quick: bool = False) -> dict:
    """Measure everything; returns a JSON-ready dict (see the module docstring)."""
    import tiktoken
    import tokenizers

    cfg = QUICK if quick else FULL
    text = load_corpus()
    if cfg["n_chars"]:
        text = text[: cfg["n_chars"]]
    n_bytes = len(text.encode("utf-8"))
    repeats = cfg["repeats"]
    result: dict = {
        "quick": quick,
        "corpus": "pydoc" + (f"[:{cfg['n_chars']}]" if cfg["n_chars"] else ""),
        "corpus_chars": len(text),
        "corpus_bytes": n_bytes,
        "pattern": "gpt4",
        "hf_pre_tokenizer": HF_PRE_TOKENIZER,
        **machine(),  # python, platform, cpu_model, cpu_count, load_average_1min
        "torch": version("torch"),
        "tiktoken": tiktoken.__version__,
        "tokenizers": tokenizers.__version__,
        "repeats": repeats,
    }

    # --- training: tfedu vs Hugging Face, at each vocabulary size ------------------------
    train = {}
    tokenizers_by_size = {}
    hf_by_size = {}
    for vocab_size in cfg["vocab_sizes"]:
        # Repeats interleave the three so that a burst of load elsewhere hits all of them.
        tfedu_s = hf_s = hf1_s = float("inf")
        for _ in range(repeats):
            seconds, tok = best_time(lambda: train_bpe(text, vocab_size, pattern="gpt4"), 1)
            tfedu_s = min(tfedu_s, seconds)
            os.environ.pop("TOKENIZERS_PARALLELISM", None)  # tokenizers' default: all cores
            seconds, hf_tok = best_time(lambda: hf_train(text, vocab_size), 1)
            hf_s = min(hf_s, seconds)
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by tokenizers at each call
            hf1_s = min(hf1_s, best_time(lambda: hf_train(text, vocab_size), 1)[0])
        train[str(vocab_size)] = {
            "tfedu_s": tfedu_s,
            "hf_s": hf_s,
            "hf_1thread_s": hf1_s,
            "tfedu_vocab_size": tok.vocab_size,
            "hf_vocab_size": hf_tok.get_vocab_size(),
            "vs_hf": hf_s / tfedu_s,
            "vs_hf_1thread": hf1_s / tfedu_s,
        }
        tokenizers_by_size[vocab_size] = tok
        hf_by_size[vocab_size] = hf_tok
    result["train"] = train
    result["train_vs_hf"] = min(row["vs_hf"] for row in train.values())  # the worst size, not the best
    result["train_vs_hf_1thread"] = min(row["vs_hf_1thread"] for row in train.values())

    # --- training: tfedu vs the naive recount trainer, same small vocabulary --------------
    naive_vocab = cfg["naive_vocab_size"]
    naive_s, naive_merges = best_time(lambda: train_bpe_naive(text, naive_vocab, pattern="gpt4"), 1)
    tfedu_small_s, small_tok = best_time(lambda: train_bpe(text, naive_vocab, pattern="gpt4"), repeats)
    result["naive"] = {
        "vocab_size": naive_vocab,
        "naive_s": naive_s,
        "tfedu_s": tfedu_small_s,
        "same_merges": naive_merges == small_tok.merges,
        "naive_s_per_merge": naive_s / max(1, len(naive_merges)),
    }
    result["train_vs_naive"] = naive_s / tfedu_small_s

    # --- encoding: single thread, same text, same vocabulary size ------------------------
    vocab_size = cfg["vocab_sizes"][-1]
    tok, hf_tok = tokenizers_by_size[vocab_size], hf_by_size[vocab_size]
    enc = tiktoken.Encoding(
        "tfedu-bench", pat_str=tok.pattern, mergeable_ranks=tok.mergeable_ranks(), special_tokens={}
    )
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    enc_repeats = cfg["encode_repeats"]

    def fresh_tfedu():  # an empty pre-token cache: the first pass over new text
        fresh = Tokenizer(tok.merges, pattern=tok.pattern)
        start = time.perf_counter()
        ids = fresh.encode_ordinary(text)
        return time.perf_counter() - start, ids

    tok.encode_ordinary(text)  # warm the cache
    cold_s = warm_s = tiktoken_s = hf_enc_s = float("inf")
    for _ in range(enc_repeats):
        cold_s = min(cold_s, fresh_tfedu()[0])
        seconds, ids = best_time(lambda: tok.encode_ordinary(text), 1)
        warm_s = min(warm_s, seconds)
        seconds, tiktoken_ids = best_time(lambda: enc.encode_ordinary(text), 1)
        tiktoken_s = min(tiktoken_s, seconds)
        seconds, hf_encoding = best_time(lambda: hf_tok.encode(text, add_special_tokens=False), 1)
        hf_enc_s = min(hf_enc_s, seconds)
    result["encode"] = {
        "vocab_size": vocab_size,
        "bytes": n_bytes,
        "tfedu_s": warm_s,
        "tfedu_cold_s": cold_s,
        "tiktoken_s": tiktoken_s,
        "hf_s": hf_enc_s,
        "tfedu_MBps": n_bytes / warm_s / 1e6,
        "tfedu_cold_MBps": n_bytes / cold_s / 1e6,
        "tiktoken_MBps": n_bytes / tiktoken_s / 1e6,
        "hf_MBps": n_bytes / hf_enc_s / 1e6,
        "tfedu_tokens": len(ids),
        "hf_tokens": len(hf_encoding.ids),
        "tiktoken_ids_equal": tiktoken_ids == ids,
    }
    result["encode_vs_hf"] = hf_enc_s / warm_s
    result["encode_vs_tiktoken"] = tiktoken_s / warm_s
    result["encode_vs_hf_cold"] = hf_enc_s / cold_s
    result["encode_vs_tiktoken_cold"] = tiktoken_s / cold_s
    return result


def format_table(r: dict) -> str:
    """The results as a plain-text table (the JSON holds the same numbers)."""
    lines = [
        f"tfedu bench tokenizer{' (quick: sizes too small to mean anything)' if r['quick'] else ''}",
        f"corpus {r['corpus']}: {r['corpus_chars']:,} chars, {r['corpus_bytes']:,} bytes; split pattern gpt4; "
        f"best of {r['repeats']}; {r['cpu_count']} CPUs, load average {r['load_average_1min']}",
        f"Hugging Face pre-tokenizer: {r['hf_pre_tokenizer']}",
        "",
        f"{'training':<34}{'tfedu s':>10}{'peer s':>10}{'peer/tfedu':>12}",
    ]
    for size, row in r["train"].items():
        lines.append(f"{'vocab ' + size + ' vs HF tokenizers':<34}{row['tfedu_s']:>10.3f}{row['hf_s']:>10.3f}{row['vs_hf']:>12.2f}")
        lines.append(f"{'vocab ' + size + ' vs HF, 1 thread':<34}{row['tfedu_s']:>10.3f}{row['hf_1thread_s']:>10.3f}{row['vs_hf_1thread']:>12.2f}")
    n = r["naive"]
    lines.append(f"{'vocab ' + str(n['vocab_size']) + ' vs naive recount':<34}{n['tfedu_s']:>10.3f}{n['naive_s']:>10.3f}{r['train_vs_naive']:>12.1f}")
    e = r["encode"]
    lines += [
        "",
        f"{'encoding, 1 thread, vocab ' + str(e['vocab_size']):<34}{'MB/s':>10}{'tfedu/peer':>12}",
        f"{'tfedu (warm pre-token cache)':<34}{e['tfedu_MBps']:>10.2f}",
        f"{'tfedu (empty cache)':<34}{e['tfedu_cold_MBps']:>10.2f}",
        f"{'tiktoken (tfedu ranks)':<34}{e['tiktoken_MBps']:>10.2f}{r['encode_vs_tiktoken']:>12.2f}",
        f"{'HF tokenizers':<34}{e['hf_MBps']:>10.2f}{r['encode_vs_hf']:>12.2f}",
        "",
        f"train_vs_hf {r['train_vs_hf']:.2f} (worst vocab size; 1 thread {r['train_vs_hf_1thread']:.2f})  "
        f"train_vs_naive {r['train_vs_naive']:.0f}  encode_vs_hf {r['encode_vs_hf']:.2f}  "
        f"encode_vs_tiktoken {r['encode_vs_tiktoken']:.2f}  (above 1: tfedu faster)",
    ]
    if not (n["same_merges"] and e["tiktoken_ids_equal"]):
        lines.append("WARNING: tfedu disagrees with its oracle (naive merges or tiktoken ids): the timings compare unequal work")
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    out = run(quick="--quick" in sys.argv)
    print(format_table(out))
    print(json.dumps(out, sort_keys=True))
