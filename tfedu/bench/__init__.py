"""`tfedu bench NAME`: tfedu's speed measured against named peers in the same run.

Each bench module has ``run(quick: bool) -> dict`` (raw times, sizes and ratios, JSON-ready)
and ``format_table(result) -> str``. Ratios are always the peer's time divided by tfedu's,
so above 1 means tfedu is faster.
"""

BENCHES = {"tokenizer": "tfedu.bench.tokenizer"}

__all__ = ["BENCHES"]
