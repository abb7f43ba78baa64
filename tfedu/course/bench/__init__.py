"""`tfedu bench NAME`: tfedu's speed measured against named peers in the same run.

Each bench module has ``run(quick: bool) -> dict`` (raw times, sizes and ratios, JSON-ready;
benches that run models also take ``device``) and ``format_table(result) -> str``. Ratios are
always the peer's time divided by tfedu's, so above 1 means tfedu is faster. Shared helpers
(interleaved timing, best and median, the machine's description) live in ``tfedu.course.bench.common``.
"""

BENCHES = {"tokenizer": "tfedu.course.bench.tokenizer", "model": "tfedu.course.bench.model", "attention": "tfedu.course.bench.attention",
           "decode": "tfedu.course.bench.decode", "moe": "tfedu.course.bench.moe", "grade": "tfedu.course.bench.grading",
           "serve": "tfedu.course.bench.serve"}

__all__ = ["BENCHES"]
