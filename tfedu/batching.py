"""Continuous batching: a server that lets requests join and leave the running batch at every step.

A *static* server (``serve_static``) waits for a batch of requests, decodes them together until the
longest is done, and only then takes the next batch: a request that arrives a moment too late waits
for the whole batch, and a row whose request finished early keeps its place in every later step,
decoding nothing useful. *Continuous* (iteration-level) batching schedules per step instead (Yu et al.
2022, "Orca: A Distributed Serving System for Transformer-Based Generative Models", OSDI, sec. 3):
at every step the scheduler admits waiting requests into the running batch and retires the finished
ones, so the batch stays full and a short request leaves as soon as it is done. With a paged KV cache
(``tfedu.paged``; Kwon et al. 2023, the vLLM paper) a finished request's blocks serve the next one at
once, and memory held tracks the tokens actually held.

One step of ``ContinuousBatcher.step``:

1. ``admit``: take requests from the head of the queue while the batch has a free row and their
   blocks fit in what the pool has not yet promised to anyone;
2. prefill: one forward pass over the admitted requests' prompts, each getting its first token;
3. decode: one forward pass over the requests that were already running, one new token each;
4. retire: every request that ``is_finished`` is done gives its blocks back and leaves as a ``Completion``.

Greedy by default: each request's tokens are those of ``tfedu.generate.generate`` on its prompt alone
(tests/test_batching.py). A request with ``do_sample`` draws from its own distribution (temperature,
top-k, top-p) with its own ``torch.Generator``, so it gets the tokens ``generate`` gives its prompt alone
with that generator, whichever requests share its batch.

- ``Request``, ``Completion``: what goes in (prompt, ``max_new_tokens``, arrival time) and comes out
  (new tokens, time of the first and of the last).
- ``blocks_needed``, ``admit``, ``is_finished``: the scheduler's pure parts (``admit`` is exercise 18.3).
- ``ContinuousBatcher``: the scheduler around a ``PagedKVCache``; ``steps`` records each step's batch
  occupancy and memory for plots.
- ``serve``: an arrival trace run in real time through a ``ContinuousBatcher``; ``serve_static``: the same
  trace through static batches of a ``generate_batch`` function (``tfedu_static_batch`` builds one from
  ``tfedu.generate.generate``).
- ``StepClock``: a fake clock that advances one unit per forward pass, so that a trace runs
  deterministically, in forward passes instead of seconds.

>>> from tfedu.config import preset
>>> from tfedu.model import GPT
>>> _ = torch.manual_seed(0); model = GPT(preset("tiny"))
>>> clock = StepClock()
>>> requests = [Request("a", torch.tensor([72, 105]), 3), Request("b", torch.tensor([1, 2, 3]), 2, arrival=1.0)]
>>> with clock.count_passes(model):
...     done = serve(model, requests, block_size=4, clock=clock, sleep=clock.sleep)
>>> [(c.id, len(c.tokens), c.first_token, c.finish) for c in done]  # b joins while a decodes
[('a', 3, 1.0, 4.0), ('b', 2, 2.0, 4.0)]

Built by hand in notebooks/18_serving.ipynb.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor, nn

from tfedu.generate import _check_sampling, _sample, generate, next_token_distribution, pad_prompts
from tfedu.paged import PagedKVCache

GenerateBatch = Callable[[list[Tensor], int], list[Tensor]]


def _check_count(name: str, value: object, *, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return value


def _check_time(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------- requests and completions


@dataclass(eq=False)
class Request:
    """One user's request: ``prompt`` (1-D integer token ids, at least one), ``max_new_tokens`` (>= 1) to decode.

    ``arrival``: seconds after the trace starts (``serve``); the ``id`` (any hashable) names it in the
    ``Completion`` and must be unique among the requests a batcher holds. Decoded greedily unless
    ``do_sample``: then each token is drawn with ``generator`` (None: torch's global one) from the
    distribution ``temperature``, ``top_k`` and ``top_p`` shape, as ``tfedu.generate.generate`` draws.

    >>> Request("a", torch.tensor([72, 105]), max_new_tokens=4, arrival=0.5).arrival
    0.5
    """

    id: Hashable
    prompt: Int[Tensor, "pos"]
    max_new_tokens: int
    arrival: float = 0.0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        try:
            hash(self.id)
        except TypeError:
            raise TypeError(f"a request's id must be hashable (a str, an int, a tuple), got {type(self.id).__name__}") \
                from None
        prompt = self.prompt
        if not isinstance(prompt, Tensor) or prompt.dim() != 1 or prompt.numel() == 0 or prompt.is_floating_point() \
                or prompt.is_complex() or prompt.dtype == torch.bool:
            got = f"{prompt.dtype} of shape {tuple(prompt.shape)}" if isinstance(prompt, Tensor) else type(prompt).__name__
            raise ValueError(f"request {self.id!r}: prompt must be a 1-D integer tensor of token ids with at least one "
                             f"token (torch.tensor([72, 105])), got {got}")
        self.max_new_tokens = _check_count(f"request {self.id!r}: max_new_tokens", self.max_new_tokens, least=1)
        self.arrival = _check_time(f"request {self.id!r}: arrival", self.arrival)
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"request {self.id!r}: do_sample must be True or False, got {self.do_sample!r}")
        _check_sampling(self.temperature, self.top_k, self.top_p)
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(f"request {self.id!r}: generator must be None or a torch.Generator (one per request), "
                            f"got {type(self.generator).__name__}")


@dataclass(eq=False)
class Completion:
    """A finished request: its ``tokens`` (1-D, the new tokens only) and when they existed.

    ``first_token``, ``finish``: the clock's time when the first and the last new token existed (for
    ``serve`` and ``serve_static``, seconds after the trace started, like ``arrival``).
    """

    id: Hashable
    prompt: Int[Tensor, "pos"]
    tokens: Int[Tensor, "n_new"]
    arrival: float
    first_token: float
    finish: float

    @property
    def latency(self) -> float:
        """Seconds from arrival to the last token: what the user waited for the whole answer."""
        return self.finish - self.arrival

    @property
    def time_to_first_token(self) -> float:
        """Seconds from arrival to the first new token (TTFT): what a user watching a stream waits before text."""
        return self.first_token - self.arrival


# ----------------------------------------------------------------------------- the scheduler's pure parts


def blocks_needed(request: Request, block_size: int) -> int:
    """The most KV cache blocks ``request`` ever holds: its prompt and every new token but the last, in blocks.

    The last new token is emitted and never fed back, so it is never written to the cache.

    >>> blocks_needed(Request(0, torch.arange(5), max_new_tokens=4), block_size=4)  # 5 + 4 - 1 = 8 positions
    2
    """
    _check_count("block_size", block_size, least=1)
    positions = request.prompt.numel() + request.max_new_tokens - 1
    return -(-positions // block_size)


def admit(waiting: Sequence[Request], n_running: int, n_free_blocks: int, *, max_batch: int, block_size: int) -> int:
    """How many requests from the head of the FIFO queue ``waiting`` to admit into the running batch now.

    In order, a request is admitted while the batch has a free row (``n_running + admitted < max_batch``)
    and its ``blocks_needed`` fit in the blocks not yet promised to anyone: ``n_free_blocks`` (the
    caller's count: free blocks minus those promised to running requests and not allocated yet) minus
    what the requests admitted before it here need. The first request that does not fit stops the
    admission, even if a smaller one behind it would fit: letting small requests overtake would starve
    a long one for as long as small ones keep arriving. (A request larger than the whole pool never
    fits: the batcher refuses it when it is submitted.)

    >>> reqs = [Request(i, torch.arange(n), max_new_tokens=1) for i, n in enumerate([4, 8, 4])]  # 1, 2, 1 blocks
    >>> admit(reqs, n_running=0, n_free_blocks=3, max_batch=8, block_size=4)  # 1 + 2 blocks fit
    2
    >>> admit(reqs, n_running=0, n_free_blocks=2, max_batch=8, block_size=4)  # 2 blocks do not fit in 1: no overtaking
    1
    >>> admit(reqs, n_running=7, n_free_blocks=9, max_batch=8, block_size=4)  # one free row
    1
    """
    _check_count("n_running", n_running, least=0)
    _check_count("n_free_blocks", n_free_blocks, least=0)
    _check_count("max_batch", max_batch, least=1)
    _check_count("block_size", block_size, least=1)
    admitted, blocks_left = 0, n_free_blocks
    for request in waiting:
        if n_running + admitted >= max_batch:
            break
        needed = blocks_needed(request, block_size)
        if needed > blocks_left:
            break
        admitted, blocks_left = admitted + 1, blocks_left - needed
    return admitted


def is_finished(tokens: Sequence[int] | Int[Tensor, "n_new"], max_new_tokens: int, eos_token_id: int | None) -> bool:
    """Whether a request that has generated ``tokens`` (new tokens only) is done: it has enough, or the last is eos.

    >>> is_finished([5, 6], 3, None), is_finished([5, 6, 7], 3, None), is_finished([5, 0], 3, eos_token_id=0)
    (False, True, True)
    """
    n = len(tokens)
    if n >= max_new_tokens:
        return True
    return eos_token_id is not None and n > 0 and int(tokens[-1]) == eos_token_id


# ----------------------------------------------------------------------------- the batcher


@dataclass(frozen=True)
class StepRecord:
    """What one ``ContinuousBatcher.step`` did: for plots of batch occupancy and memory.

    ``time``: the clock after the step's forward passes; ``n_prefill``, ``n_decode``: rows in its prefill
    and decode passes (``n_prefill + n_decode`` is the batch occupancy); ``n_finished``: requests it
    retired; ``n_waiting``: requests left in the queue; ``tokens_held``, ``bytes_held``: positions in the
    cache and ``PagedKVCache.bytes_held`` after the passes, before the retired requests' blocks went back.
    """

    time: float
    n_prefill: int
    n_decode: int
    n_finished: int
    n_waiting: int
    tokens_held: int
    bytes_held: int


@dataclass(eq=False)
class _Running:
    request: Request
    tokens: list[int]
    first_token: float = 0.0


class ContinuousBatcher:
    """A continuous-batching scheduler (Yu et al. 2022, Orca's iteration-level scheduling) around a ``PagedKVCache``.

    ``submit(request)`` queues a request; each ``step()`` admits, prefills, decodes one token per running
    request and retires the finished ones (see the module's docstring), returning their ``Completion``s.
    Every request gets the tokens ``tfedu.generate.generate`` gives its prompt alone: greedy, or drawn with
    the request's own generator when it samples (``Request.do_sample``).

    Memory is reserved at admission: a request is admitted only if its ``blocks_needed`` (for its whole
    prompt and ``max_new_tokens``) fit in the free blocks minus those promised to running requests and
    not allocated yet. So a running request can never run out of blocks and nothing is ever preempted.
    vLLM (Kwon et al. 2023, sec. 4.5) admits optimistically instead, for the blocks the prompt needs now,
    and when the pool runs dry preempts the latest requests (freeing their blocks, to recompute or swap
    them back in later): a fuller batch, at the cost of wasted work when it guesses wrong. A request
    that stops early at ``eos_token_id`` gives back blocks it was promised and never used.

    Prefill and decode happen in the same step but in two forward passes. The model takes a rectangular
    batch, so one pass over both would pad every decode row, which brings one token, to the longest
    prompt: batch x prompt length of work for a few real tokens. (Orca's *selective batching* runs the
    tokens of all rows as one flat sequence, no padding, and splits them only for attention; a tfedu
    ``GPT`` pads.)

    ``cache``: the ``PagedKVCache`` (its ``bytes_held`` for memory plots); ``steps``: a ``StepRecord`` per
    step; ``clock``: called for the time of each first token, last token and step record; ``admit``: the
    admission rule (notebook 18 runs the learner's), with ``admit``'s arguments and result.

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> _ = torch.manual_seed(0); model = GPT(preset("tiny"))
    >>> batcher = ContinuousBatcher(model, n_blocks=8, block_size=4, max_batch=2)
    >>> for i, n in enumerate([3, 1, 2]):
    ...     batcher.submit(Request(i, torch.tensor([72, 105]), max_new_tokens=n))
    >>> done = batcher.step(); [c.id for c in done], batcher.n_running, batcher.n_waiting  # 1 is done at once
    ([1], 1, 1)
    >>> [(s.n_prefill, s.n_decode) for s in batcher.steps]
    [(2, 0)]
    >>> while not batcher.idle:
    ...     done += batcher.step()
    >>> [(c.id, len(c.tokens)) for c in done], [(s.n_prefill, s.n_decode) for s in batcher.steps]
    ([(1, 1), (0, 3), (2, 2)], [(2, 0), (1, 1), (0, 2)])
    """

    def __init__(self, model: nn.Module, *, n_blocks: int, block_size: int = 16, max_batch: int = 16,
                 eos_token_id: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 admit: Callable[..., int] = admit) -> None:
        _check_count("n_blocks", n_blocks, least=1)
        _check_count("block_size", block_size, least=1)
        self.max_batch = _check_count("max_batch", max_batch, least=1)
        d_vocab = model.cfg.d_vocab
        if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)
                                         or not 0 <= eos_token_id < d_vocab):
            raise ValueError(f"eos_token_id must be None or a token id in 0..{d_vocab - 1}, got {eos_token_id!r}")
        if not callable(clock):
            raise TypeError(f"clock must be a function () -> seconds (time.perf_counter), got {type(clock).__name__}")
        if not callable(admit):
            raise TypeError(f"admit must be a function like tfedu.batching.admit, got {type(admit).__name__}")
        self._admit = admit
        self._cache = PagedKVCache.for_model(model, n_blocks=n_blocks, block_size=block_size)
        self.model, self.block_size, self.eos_token_id, self.clock = model, block_size, eos_token_id, clock
        self._waiting: deque[Request] = deque()
        self._running: dict[Hashable, _Running] = {}  # in order of admission
        self.steps: list[StepRecord] = []

    @property
    def cache(self) -> PagedKVCache:
        return self._cache

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_running(self) -> int:
        return len(self._running)

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing running."""
        return not self._waiting and not self._running

    def submit(self, request: Request) -> None:
        """Queue ``request`` (first in, first out); a clear error now if it could never run."""
        if not isinstance(request, Request):
            raise TypeError(f"submit takes a tfedu.batching.Request, got {type(request).__name__}")
        cfg = self.model.cfg
        positions = request.prompt.numel() + request.max_new_tokens - 1
        if positions > cfg.n_ctx:
            raise ValueError(f"request {request.id!r}: a prompt of {request.prompt.numel()} tokens and "
                             f"{request.max_new_tokens} new tokens need {positions} positions, more than n_ctx="
                             f"{cfg.n_ctx} (the last new token is never fed back): shorten the prompt or ask for fewer")
        low, high = int(request.prompt.min()), int(request.prompt.max())
        if low < 0 or high >= cfg.d_vocab:
            raise ValueError(f"request {request.id!r}: token ids must be in 0..{cfg.d_vocab - 1} (d_vocab), the prompt "
                             f"holds {low if low < 0 else high}")
        needed, n_blocks = blocks_needed(request, self.block_size), self._cache.allocator.n_blocks
        if needed > n_blocks:
            raise ValueError(f"request {request.id!r} needs {needed} blocks of {self.block_size} positions, more than the "
                             f"whole pool ({n_blocks}): it could never be admitted; make a larger pool")
        if request.id in self._running or any(w.id == request.id for w in self._waiting):
            raise ValueError(f"request id {request.id!r} is already queued or running: ids must be unique")
        self._waiting.append(request)

    def _unallocated_promises(self) -> int:
        """Blocks promised to running requests at admission that their sequences have not taken yet."""
        return sum(blocks_needed(r.request, self.block_size) - len(self._cache.block_table(seq_id))
                   for seq_id, r in self._running.items())

    def step(self) -> list[Completion]:
        """One scheduling step: admit, prefill the admitted, decode the others, retire the finished.

        Returns the ``Completion``s of the requests retired in this step, in order of admission; an idle
        batcher does nothing (no record). Every request the queue holds fits the pool, so a step with
        nothing running always admits the head of the queue: the batcher never stalls.
        """
        if self.idle:
            return []
        cache, model = self._cache, self.model
        decoding = list(self._running)  # admitted in an earlier step: one token each
        n_free = cache.allocator.n_free - self._unallocated_promises()
        n_admit = self._admit(list(self._waiting), len(self._running), n_free, max_batch=self.max_batch,
                              block_size=self.block_size)
        if isinstance(n_admit, bool) or not isinstance(n_admit, int) or not 0 <= n_admit <= len(self._waiting):
            raise ValueError(f"the admission rule must return how many requests to admit: an int in 0.."
                             f"{len(self._waiting)} (the queue's length), got {n_admit!r}")
        admitted = [self._waiting.popleft() for _ in range(n_admit)]
        device = cache.keys[0].device
        was_training = model.training
        if was_training:  # eval() walks every module: only when needed (it costs a step's time on a small model)
            model.eval()
        try:
            with torch.inference_mode():
                if admitted:
                    for request in admitted:
                        cache.add_sequence(request.id)
                        self._running[request.id] = _Running(request, [])
                    logits = cache.run(model, [r.id for r in admitted], [r.prompt.to(device) for r in admitted])
                    self._append([r.id for r in admitted], self._choose([r.id for r in admitted], logits[:, -1]),
                                 first=True)
                if decoding:
                    last = [torch.tensor([self._running[seq_id].tokens[-1]], device=device) for seq_id in decoding]
                    logits = cache.run(model, decoding, last)
                    self._append(decoding, self._choose(decoding, logits[:, -1]), first=False)
        finally:
            if was_training:
                model.train()
        finished = [seq_id for seq_id, r in self._running.items()
                    if is_finished(r.tokens, r.request.max_new_tokens, self.eos_token_id)]
        now = self.clock()
        self.steps.append(StepRecord(time=now, n_prefill=len(admitted), n_decode=len(decoding),
                                     n_finished=len(finished), n_waiting=len(self._waiting),
                                     tokens_held=sum(cache.length(s) for s in cache.seq_ids),
                                     bytes_held=cache.bytes_held))
        completions = []
        for seq_id in finished:
            r = self._running.pop(seq_id)
            cache.free_sequence(seq_id)
            tokens = torch.tensor(r.tokens, dtype=r.request.prompt.dtype, device=r.request.prompt.device)
            completions.append(Completion(id=seq_id, prompt=r.request.prompt, tokens=tokens,
                                          arrival=r.request.arrival, first_token=r.first_token, finish=now))
        return completions

    def _choose(self, seq_ids: list[Hashable], logits: Tensor) -> Tensor:
        """Each row's next token: the argmax, or a draw from its request's distribution with its generator."""
        next_ids = logits.argmax(dim=-1)  # batch
        for row, seq_id in enumerate(seq_ids):
            request = self._running[seq_id].request
            if request.do_sample:
                probs = next_token_distribution(logits[row:row + 1].float(), temperature=request.temperature,
                                                top_k=request.top_k, top_p=request.top_p)
                next_ids[row] = _sample(probs, request.generator)[0]
        return next_ids

    def _append(self, seq_ids: list[Hashable], next_ids: Tensor, *, first: bool) -> None:
        now = self.clock()  # the tokens exist once the pass is done (tolist below waits for the device)
        for seq_id, token in zip(seq_ids, next_ids.tolist(), strict=True):
            running = self._running[seq_id]
            running.tokens.append(token)
            if first:
                running.first_token = now

    def __repr__(self) -> str:
        return (f"ContinuousBatcher(max_batch={self.max_batch}, block_size={self.block_size}, "
                f"n_blocks={self._cache.allocator.n_blocks}, waiting={self.n_waiting}, running={self.n_running})")


# ----------------------------------------------------------------------------- serving a trace


class StepClock:
    """A fake clock for deterministic traces: time advances only when told, by ``tick`` or ``sleep``.

    ``clock()`` is the time; ``tick(n)`` advances it by n (1 by default); ``sleep(seconds)`` advances it by
    ``seconds`` at once (no real waiting), so ``serve(..., clock=clock, sleep=clock.sleep)`` runs a trace
    instantly. ``with clock.count_passes(model):`` ticks once per forward pass of ``model``: times are then
    counted in forward passes, the unit both servers pay per step, whatever the machine's speed.

    >>> clock = StepClock()
    >>> clock.tick(); clock.sleep(2.5); clock()
    3.5
    """

    def __init__(self, start: float = 0.0) -> None:
        self.time = float(start)

    def __call__(self) -> float:
        return self.time

    def tick(self, n: float = 1) -> None:
        self.time += n

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot sleep a negative time, got {seconds!r}")
        self.time += seconds

    @contextmanager
    def count_passes(self, model: nn.Module) -> Iterator[StepClock]:
        """Tick once after every forward pass of ``model`` while the block runs."""
        handle = model.register_forward_hook(lambda module, args, output: self.tick())
        try:
            yield self
        finally:
            handle.remove()

    def __repr__(self) -> str:
        return f"StepClock(time={self.time})"


def _check_requests(requests: object) -> list[Request]:
    if not isinstance(requests, (list, tuple)) or not requests or not all(isinstance(r, Request) for r in requests):
        raise ValueError("requests must be a non-empty list of tfedu.batching.Request")
    ids = [r.id for r in requests]
    if len(set(ids)) != len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"request id {twice!r} appears twice: each request in a trace needs its own id")
    return list(requests)


def _in_arrival_order(requests: list[Request]) -> deque[Request]:
    return deque(sorted(requests, key=lambda r: r.arrival))  # stable: equal arrivals keep the list's order


def serve(model: nn.Module, requests: Sequence[Request], *, n_blocks: int | None = None, block_size: int = 16,
          max_batch: int = 16, eos_token_id: int | None = None, clock: Callable[[], float] = time.perf_counter,
          sleep: Callable[[float], None] = time.sleep, admit: Callable[..., int] = admit,
          record: list | None = None) -> list[Completion]:
    """Run the arrival trace ``requests`` in real time through a ``ContinuousBatcher``; their ``Completion``s, in order.

    Before each step every request whose ``arrival`` has passed (``arrival <= clock() - start``) is
    submitted; when nothing is running or queued and nothing has arrived, it sleeps until the next
    arrival. Times in the ``Completion``s are seconds after the start, as the arrivals. ``n_blocks=None``:
    enough for ``max_batch`` (or all, if fewer) of the largest requests, so memory never limits the batch.
    For a fake clock: ``StepClock``. ``admit``: the admission rule (``ContinuousBatcher``); ``record``: a list
    that receives the batcher's ``StepRecord``s, one per step (for plots of occupancy and memory).
    """
    requests = _check_requests(requests)
    _check_count("block_size", block_size, least=1)
    _check_count("max_batch", max_batch, least=1)
    if n_blocks is None:
        n_blocks = min(max_batch, len(requests)) * max(blocks_needed(r, block_size) for r in requests)
    start = clock()
    batcher = ContinuousBatcher(model, n_blocks=n_blocks, block_size=block_size, max_batch=max_batch,
                                eos_token_id=eos_token_id, clock=lambda: clock() - start, admit=admit)
    if record is not None:
        batcher.steps = record  # the batcher appends its records to the caller's list
    pending, done = _in_arrival_order(requests), {}
    while pending or not batcher.idle:
        now = clock() - start
        while pending and pending[0].arrival <= now:
            batcher.submit(pending.popleft())
        if batcher.idle:
            sleep(pending[0].arrival - now)
            continue
        done |= {c.id: c for c in batcher.step()}
    return [done[r.id] for r in requests]


def serve_static(generate_batch: GenerateBatch, requests: Sequence[Request], *, batch_size: int,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> list[Completion]:
    """The baseline: run the trace ``requests`` through static batches; their ``Completion``s, in order.

    Whenever the server is free it takes up to ``batch_size`` of the requests that have arrived (first
    come, first served; if none has, it sleeps until the next arrival) and calls
    ``generate_batch(prompts, max_new_tokens)`` (each prompt's new tokens) with the batch's largest
    ``max_new_tokens``, then cuts each answer to its own. Requests arriving meanwhile wait for the
    whole batch. ``generate`` returns the whole batch at once, so every request in it gets
    ``first_token = finish =`` the batch's end. ``generate_batch``: ``tfedu_static_batch(model)``, or a
    wrapper of ``transformers``' ``generate``.
    """
    requests = _check_requests(requests)
    _check_count("batch_size", batch_size, least=1)
    sampling = [r.id for r in requests if r.do_sample]
    if sampling:
        raise ValueError(f"serve_static decodes greedily (a generate_batch takes no sampling settings), and request "
                         f"{sampling[0]!r} samples: run sampling requests through serve or a ContinuousBatcher")
    start = clock()
    pending, done = _in_arrival_order(requests), {}
    while pending:
        now = clock() - start
        if pending[0].arrival > now:
            sleep(pending[0].arrival - now)
            continue
        batch = []
        while pending and len(batch) < batch_size and pending[0].arrival <= now:
            batch.append(pending.popleft())
        outputs = generate_batch([r.prompt for r in batch], max(r.max_new_tokens for r in batch))
        end = clock() - start
        if not isinstance(outputs, (list, tuple)) or len(outputs) != len(batch) \
                or not all(isinstance(o, Tensor) and o.dim() == 1 for o in outputs):
            raise ValueError(f"generate_batch must return a list of {len(batch)} 1-D tensors (each prompt's new tokens), "
                             f"got {type(outputs).__name__}")
        for r, tokens in zip(batch, outputs, strict=True):
            done[r.id] = Completion(id=r.id, prompt=r.prompt, tokens=tokens[:r.max_new_tokens], arrival=r.arrival,
                                    first_token=end, finish=end)
    return [done[r.id] for r in requests]


def tfedu_static_batch(model: nn.Module, *, eos_token_id: int | None = None) -> GenerateBatch:
    """A ``generate_batch`` for ``serve_static``: greedy ``tfedu.generate.generate`` over the prompts, left-padded.

    The prompts go in padded on the left with a ``padding_mask`` (``pad_prompts``), so each row gets
    the tokens it would alone. With ``eos_token_id`` a row's tokens end at its first eos.

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> _ = torch.manual_seed(0); model = GPT(preset("tiny"))
    >>> out = tfedu_static_batch(model)([torch.tensor([72, 105]), torch.tensor([1, 2, 3])], 4)
    >>> [tuple(o.shape) for o in out]
    [(4,), (4,)]
    """

    def generate_batch(prompts: list[Tensor], max_new_tokens: int) -> list[Tensor]:
        ids, padding_mask = pad_prompts(prompts)
        out = generate(model, ids, max_new_tokens, padding_mask=padding_mask, eos_token_id=eos_token_id)
        answers = []
        for row in out[:, ids.shape[1]:]:
            if eos_token_id is not None and bool((row == eos_token_id).any()):
                row = row[:int((row == eos_token_id).nonzero()[0, 0]) + 1]
            answers.append(row.to(prompts[0].dtype))
        return answers

    return generate_batch


def random_trace(n: int, *, prompt_lengths: tuple[int, int], new_tokens: tuple[int, int], rate: float,
                 texts: Sequence[Int[Tensor, "pos"]] | None = None, d_vocab: int | None = None,
                 seed: int = 0) -> list[Request]:
    """``n`` seeded requests: prompt lengths uniform, answer lengths log-uniform, arrivals a Poisson process.

    Prompt lengths are uniform in ``prompt_lengths`` (both ends included); answer lengths (``max_new_tokens``)
    log-uniform between the two ends of ``new_tokens``: as many answers of 4-8 tokens as of 64-128, the
    many short and few long answers of chat traffic. Arrivals: the first at 0, then gaps drawn from an
    exponential distribution of mean ``1 / rate`` (``rate`` requests per unit of time: seconds for
    ``serve``, forward passes with a ``StepClock``). The prompts are slices of ``texts`` (1-D token ids,
    each at least ``prompt_lengths[1]`` long) or, without them, random ids below ``d_vocab``. Request ids
    are 0 .. n-1, in arrival order.

    >>> trace = random_trace(3, prompt_lengths=(2, 4), new_tokens=(1, 8), rate=0.5, d_vocab=10)
    >>> [(r.id, len(r.prompt) in (2, 3, 4), 1 <= r.max_new_tokens <= 8) for r in trace], trace[0].arrival
    ([(0, True, True), (1, True, True), (2, True, True)], 0.0)
    """
    _check_count("n", n, least=1)
    (p_lo, p_hi), (n_lo, n_hi) = prompt_lengths, new_tokens
    if not 1 <= p_lo <= p_hi or not 1 <= n_lo <= n_hi:
        raise ValueError(f"prompt_lengths and new_tokens must be (low, high) with 1 <= low <= high, got "
                         f"{prompt_lengths} and {new_tokens}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
        raise ValueError(f"rate must be a positive number of requests per unit of time, got {rate!r}")
    if (texts is None) == (d_vocab is None):
        raise ValueError("give either texts (token ids to cut prompts from) or d_vocab (random prompts), not both")
    if texts is not None and (not texts or any(len(t) < p_hi for t in texts)):
        raise ValueError(f"every text must hold at least {p_hi} tokens (the longest prompt)")
    generator = torch.Generator().manual_seed(seed)

    def draw(high: int) -> int:  # uniform in 0 .. high - 1
        return int(torch.randint(0, high, (), generator=generator))

    requests, arrival = [], 0.0
    for i in range(n):
        length = p_lo + draw(p_hi - p_lo + 1)
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        answer = round(math.exp(math.log(n_lo) + u * (math.log(n_hi) - math.log(n_lo))))
        if texts is None:
            prompt = torch.randint(0, d_vocab, (length,), generator=generator)
        else:
            text = texts[draw(len(texts))]
            start = draw(len(text) - length + 1)
            prompt = torch.as_tensor(text[start:start + length], dtype=torch.long).clone()
        if i:
            arrival += float(torch.empty((), dtype=torch.float64).exponential_(rate, generator=generator))
        requests.append(Request(i, prompt, answer, arrival=arrival))
    return requests
