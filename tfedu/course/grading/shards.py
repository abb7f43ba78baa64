"""A class graded on many machines: ``tfedu grade --shard K/N`` grades a share, ``--merge`` joins the shares.

Every shard is given the same list of submissions (a glob expands to the same sorted list on every
machine) and grades every N-th of them, starting with the K-th (K = 1..N): the shares are disjoint,
cover the list, and differ in size by at most one. A shard's results JSON records its place
(``"shard": {"index": K, "count": N, "submissions": TOTAL}``), so that merging puts every entry back
where a single run over the whole list would have written it, and refuses a set of shards with one
missing, repeated, or from another list.

With a Slurm job array (one task per shard; ``tfedu`` installed where the tasks run)::

    #SBATCH --array=1-10
    tfedu grade submissions/*.ipynb --shard "$SLURM_ARRAY_TASK_ID/10" --out "grades/part-$SLURM_ARRAY_TASK_ID.json"

and, once every task has finished (``sbatch --dependency=afterok:JOBID``)::

    tfedu grade --merge grades/part-*.json --out grades/all.json

A Kubernetes indexed Job (``completionMode: Indexed``, ``completions: 10``) numbers its pods from 0:
``--shard "$((JOB_COMPLETION_INDEX + 1))/10"``, the shares written to a shared volume.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ShardError(ValueError):
    """A --shard that is not K/N, or shard results that do not make one whole."""


def parse(text: str) -> tuple[int, int]:
    """``"K/N"`` as ``(K, N)`` with 1 <= K <= N.

    >>> parse("2/5")
    (2, 5)
    """
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise ShardError(f"expected --shard K/N with 1 <= K <= N (for example 1/4), got {text!r}")
    return int(match[1]), int(match[2])


def share(items: list[T], index: int, count: int) -> list[T]:
    """The K-th of N disjoint shares of ``items``: every N-th item, starting with the K-th.

    >>> share(list("abcdefg"), 1, 3), share(list("abcdefg"), 3, 3)
    (['a', 'd', 'g'], ['c', 'f'])
    """
    return items[index - 1::count]


def merge(paths: list[str | Path]) -> dict[str, Any]:
    """The results of a single run, from the results JSON of each of its shards."""
    shards: dict[int, list[dict[str, Any]]] = {}
    count = total = None
    for path in paths:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            place, entries = data["shard"], data["submissions"]
            index, n, size = int(place["index"]), int(place["count"]), int(place["submissions"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ShardError(f"{path}: not the results of a --shard run ({type(err).__name__}: {str(err)[:100]})") from None
        if not 1 <= index <= n or size < 0:
            raise ShardError(f"{path}: shard {index}/{n} of {size} submissions is not a shard (1 <= K <= N)")
        if (count, total) not in ((None, None), (n, size)):
            raise ShardError(f"{path} is shard {index}/{n} of {size} submissions; the others are of {count} shards "
                             f"and {total} submissions")
        count, total = n, size
        if index in shards:
            raise ShardError(f"shard {index}/{n} is given twice ({path})")
        if len(entries) != len(range(index - 1, size, n)):
            raise ShardError(f"{path}: shard {index}/{n} of {size} submissions should hold "
                             f"{len(range(index - 1, size, n))} results, it holds {len(entries)}")
        shards[index] = entries
    if count is None or total is None:
        raise ShardError("no shard results to merge")
    missing = sorted(set(range(1, count + 1)) - set(shards))
    if missing:
        raise ShardError(f"missing shard{'s' * (len(missing) > 1)}: {', '.join(f'{k}/{count}' for k in missing)} "
                         "(merge the results of every shard of the run)")
    merged: list[dict[str, Any]] = [{}] * total
    for index, entries in shards.items():
        for position, entry in zip(range(index - 1, total, count), entries):
            merged[position] = entry
    return {"submissions": merged}
