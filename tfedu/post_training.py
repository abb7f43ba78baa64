"""Post-training data: instruction tasks a program can check, and a chat template with a loss mask.

Built by hand in notebooks/17_post_training.ipynb (issue 44). Two halves:

* **Verifiable tasks.** Small families of instructions (arithmetic, reversing a word, sorting letters,
  answering from a sentence, formatting as JSON) whose answer a program recomputes from the prompt
  alone (``solve``), so a completion is graded exactly (``verify``): the reward of RL with verifiable
  rewards (Lambert et al. 2024, "Tulu 3"; DeepSeek-AI 2025, "DeepSeek-R1"), and held-out accuracy for
  SFT. ``make_tasks`` draws them from ``random.Random(seed)`` only, so a seed gives the same list on any
  machine; ``split_tasks`` puts each prompt on one side by a hash of its text.
* **A chat template.** Each message is ``<|role|>content<|end|>`` (the shape of ChatML, OpenAI 2023, and
  of Hugging Face's ``apply_chat_template``), with the markers as special tokens of the course tokenizer
  (which only has ``<|endoftext|>``: ``add_chat_tokens`` adds them). ``answer_mask`` marks the tokens
  instruction tuning puts its loss on: the assistant's answers and their ``<|end|>`` (Ouyang et al. 2022,
  "InstructGPT", train on the completions only).

Texts are ASCII and short: a task and its answer fit the course GPT's ``n_ctx = 128`` with room to spare.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Sequence

from tfedu.tokenizer import Tokenizer

# ---------------------------------------------------------------------------------------------------------
# Verifiable tasks
# ---------------------------------------------------------------------------------------------------------

FAMILIES = ("add", "subtract", "reverse", "sort_letters", "read", "json")

WORDS = (
    "apple", "bread", "cat", "dog", "egg", "fish", "goat", "hat", "ink", "jam", "kite", "lamp",
    "moon", "nest", "owl", "pear", "queen", "rain", "sun", "tree", "vase", "wolf", "yarn", "zebra",
    "ball", "cake", "desk", "frog", "gold", "hill", "iron", "jar", "king", "leaf", "milk", "nose",
    "oak", "pig", "rose", "salt", "tent", "wind", "box", "cup", "map", "pen", "rug", "toy",
)  # fmt: skip
NAMES = ("Ann", "Ben", "Cat", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivy", "Jon", "Kim", "Leo", "Mia", "Ned", "Oli", "Sue", "Tom")
COLOURS = ("red", "blue", "green", "black", "white", "pink", "brown", "grey")
TOWNS = ("Paris", "Rome", "Oslo", "Lima", "Cairo", "Delhi", "Tokyo", "Quito")
PETS = ("cats", "dogs", "birds", "fish", "frogs", "mice", "goats", "owls")
THINGS = ("ball", "hat", "car", "kite", "cup", "bag", "bike", "box")

# "answer from a sentence": (sentence, question) templates; each has exactly one slot for the answer.
_READ_TEMPLATES = (
    ("{name} has a {colour} {thing}.", "What colour is {name}'s {thing}?", "colour"),
    ("{name} lives in {town}.", "Where does {name} live?", "town"),
    ("{name} is {age} years old.", "How old is {name}?", "age"),
    ("{name} likes {pets}.", "What does {name} like?", "pets"),
)


@dataclass(frozen=True)
class Example:
    """One instruction task: its family, the prompt and the one correct answer.

    >>> ex = Example("add", "What is 37 + 58?", "95")
    >>> ex.messages()
    [{'role': 'user', 'content': 'What is 37 + 58?'}, {'role': 'assistant', 'content': '95'}]
    """

    family: str
    prompt: str
    answer: str

    def messages(self) -> list[dict[str, str]]:
        """The example as a two-message conversation, ready for ``render`` / ``render_ids``."""
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.answer}]


def _make_prompt(family: str, rng: random.Random) -> str:
    """One prompt of ``family``, drawn from ``rng``; the answer is ``solve(family, prompt)``."""
    if family == "add":
        return f"What is {rng.randint(0, 99)} + {rng.randint(0, 99)}?"
    if family == "subtract":
        return f"What is {rng.randint(0, 99)} - {rng.randint(0, 99)}?"
    if family == "reverse":
        return f"Reverse the word: {rng.choice(WORDS)}"
    if family == "sort_letters":
        return f"Sort the letters of: {rng.choice(WORDS)}"
    if family == "read":
        sentence, question, _ = rng.choice(_READ_TEMPLATES)
        slots = dict(name=rng.choice(NAMES), colour=rng.choice(COLOURS), thing=rng.choice(THINGS),
                     town=rng.choice(TOWNS), age=rng.randint(2, 12), pets=rng.choice(PETS))  # fmt: skip
        return f"{sentence.format(**slots)} {question.format(**slots)}"
    if family == "json":
        return f"Write as JSON: name {rng.choice(NAMES)}, age {rng.randint(2, 12)}"
    raise ValueError(f"unknown task family {family!r}; expected one of {FAMILIES}")


_ARITH = re.compile(r"What is (\d{1,2}) ([+-]) (\d{1,2})\?")
_JSON = re.compile(r"Write as JSON: name ([A-Za-z]+), age (\d+)")


def solve(family: str, prompt: str) -> str:
    """The correct answer to ``prompt``, recomputed from the prompt's text alone.

    Raises ``ValueError`` if the prompt is not one that ``family`` makes.

    >>> solve("subtract", "What is 3 - 58?"), solve("sort_letters", "Sort the letters of: zebra")
    ('-55', 'aberz')
    >>> solve("json", "Write as JSON: name Ann, age 7")
    '{"name": "Ann", "age": 7}'
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; expected one of {FAMILIES}")
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    if family in ("add", "subtract"):
        m = _ARITH.fullmatch(prompt)
        if m and (m[2] == "+") == (family == "add"):
            a, b = int(m[1]), int(m[3])
            return str(a + b if family == "add" else a - b)
    elif family in ("reverse", "sort_letters"):
        lead = "Reverse the word: " if family == "reverse" else "Sort the letters of: "
        word = prompt[len(lead):]
        if prompt.startswith(lead) and word.isascii() and word.isalpha():
            return word[::-1] if family == "reverse" else "".join(sorted(word))
    elif family == "read":
        for sentence, question, slot in _READ_TEMPLATES:
            pattern = re.escape(f"{sentence} {question}").replace(r"\{", "{").replace(r"\}", "}")
            # each slot is a word; a slot used twice (the name, the thing) must say the same both times
            seen: set[str] = set()

            def group(m: re.Match) -> str:
                name = m[1]
                if name in seen:
                    return f"(?P={name})"
                seen.add(name)
                return rf"(?P<{name}>\w+)"

            m = re.fullmatch(re.sub(r"\{(\w+)\}", group, pattern), prompt)
            if m:
                return m[slot]
    else:  # json
        m = _JSON.fullmatch(prompt)
        if m:
            return json.dumps({"name": m[1], "age": int(m[2])})
    raise ValueError(f"{prompt!r} is not a prompt of the {family!r} family")


def _same_json(a, b) -> bool:
    """JSON values equal with their types: Python's ``True == 1`` and ``7 == 7.0`` must not pass."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return a == b


def verify(family: str, prompt: str, completion: str) -> bool:
    """Whether ``completion`` answers ``prompt`` exactly: the verifiable reward (1 if True, else 0).

    Surrounding whitespace is ignored; everything else counts (``"95."`` is wrong). JSON answers are
    compared parsed, with types (``{"age": "7"}`` is wrong), so key order and spacing do not matter.

    >>> verify("add", "What is 37 + 58?", " 95\\n"), verify("add", "What is 37 + 58?", "95.")
    (True, False)
    >>> verify("json", "Write as JSON: name Ann, age 7", '{"age":7,"name":"Ann"}')
    True
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    answer = solve(family, prompt)
    if family != "json":
        return completion.strip() == answer
    try:
        return _same_json(json.loads(completion.strip()), json.loads(answer))
    except ValueError:  # json.JSONDecodeError: not JSON at all
        return False


def make_tasks(n: int, seed: int, families: Sequence[str] = FAMILIES) -> list[Example]:
    """``n`` examples with distinct prompts, each of a family drawn uniformly from ``families``.

    Deterministic: only ``random.Random(seed)`` is used, never the global generator, so the same
    arguments give the same list on any machine and Python version that keeps ``random``'s documented
    reproducibility for ``randint``/``choice``. Raises ``ValueError`` if the families cannot make
    ``n`` distinct prompts.

    >>> [ex.prompt for ex in make_tasks(2, seed=0, families=["reverse"])] == [ex.prompt for ex in make_tasks(2, 0, ["reverse"])]
    True
    >>> make_tasks(1, seed=3, families=["add"])[0].family
    'add'
    """
    if isinstance(families, str):
        raise TypeError("families must be a sequence of family names, e.g. ['add'], not one string")
    families = list(families)
    unknown = [f for f in families if f not in FAMILIES]
    if not families or unknown:
        raise ValueError(f"families must be a non-empty subset of {FAMILIES}, got {families}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Example] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"families {families} could not make {n} distinct prompts (made {len(out)})")
        family = rng.choice(families)
        prompt = _make_prompt(family, rng)
        if prompt not in seen:
            seen.add(prompt)
            out.append(Example(family, prompt, solve(family, prompt)))
    return out


def is_held_out(prompt: str, held_out_fraction: float = 0.2) -> bool:
    """Whether ``prompt`` belongs to the held-out side: a fixed hash of its text, not a seed.

    SHA-256 (not Python's salted ``hash``) so the side is the same on every machine and run, and a
    prompt stays on its side whatever ``n`` or ``seed`` made the list: train sets of any size never
    contain a held-out prompt.

    >>> is_held_out("What is 37 + 58?", 0.0), is_held_out("What is 37 + 58?", 1.0)
    (False, True)
    """
    if not 0.0 <= held_out_fraction <= 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1], got {held_out_fraction}")
    h = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big")
    return h < held_out_fraction * 2**64


def split_tasks(examples: Sequence[Example], held_out_fraction: float = 0.2) -> tuple[list[Example], list[Example]]:
    """``(train, held_out)``: each example goes where ``is_held_out(example.prompt)`` says, order kept.

    No prompt is on both sides, even when ``examples`` repeats one.

    >>> train, held_out = split_tasks(make_tasks(200, seed=0))
    >>> len(train) + len(held_out), {ex.prompt for ex in train} & {ex.prompt for ex in held_out}
    (200, set())
    """
    train, held_out = [], []
    for ex in examples:
        if not isinstance(ex, Example):
            raise TypeError(f"split_tasks takes Example objects, got {type(ex).__name__}")
        (held_out if is_held_out(ex.prompt, held_out_fraction) else train).append(ex)
    return train, held_out


# ---------------------------------------------------------------------------------------------------------
# Chat template
# ---------------------------------------------------------------------------------------------------------

ROLES = ("system", "user", "assistant")
ROLE_MARKERS = {role: f"<|{role}|>" for role in ROLES}
END_OF_TURN = "<|end|>"
CHAT_SPECIAL_TOKENS = (*ROLE_MARKERS.values(), END_OF_TURN)
_MARKER_ROLE = {marker: role for role, marker in ROLE_MARKERS.items()}
_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in CHAT_SPECIAL_TOKENS) + ")")


def add_chat_tokens(tok: Tokenizer) -> Tokenizer:
    """A copy of ``tok`` with the chat specials ``<|system|> <|user|> <|assistant|> <|end|>`` at new ids.

    The new ids come after every existing id (the course tokenizer: 1024..1027, its ``<|endoftext|>``
    stays 1023), so every old id keeps its meaning and the model's ``d_vocab`` grows by 4: ``W_E`` gets
    4 new rows and ``W_U`` (``d_model d_vocab``) 4 new columns (the same numbers when
    ``cfg.tied_embeddings``), to be initialised (e.g. to the mean of the old rows) and learned during
    instruction tuning; the old rows are unchanged. Specials ``tok`` already
    has are kept at their ids. ``tok`` itself is not changed.

    >>> tok = add_chat_tokens(Tokenizer([], special_tokens={"<|endoftext|>": 256}))
    >>> tok.special_tokens
    {'<|endoftext|>': 256, '<|system|>': 257, '<|user|>': 258, '<|assistant|>': 259, '<|end|>': 260}
    """
    if not isinstance(tok, Tokenizer):
        raise TypeError(f"add_chat_tokens takes a tfedu Tokenizer, got {type(tok).__name__}")
    specials = dict(tok.special_tokens)
    next_id = max(tok.vocab) + 1
    for token in CHAT_SPECIAL_TOKENS:
        if token not in specials:
            specials[token] = next_id
            next_id += 1
    return Tokenizer(tok.merges, special_tokens=specials, pattern=tok.pattern, byte_ids=tok.byte_ids)


def _check_messages(messages) -> None:
    """Raise a clear error unless ``messages`` is a non-empty list of {"role", "content"} dicts."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of dicts with 'role' and 'content', got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or set(msg) != {"role", "content"}:
            raise ValueError(f"message {i} must be a dict with exactly the keys 'role' and 'content', got {msg!r}")
        if msg["role"] not in ROLES:
            raise ValueError(f"message {i} has unknown role {msg['role']!r}; expected one of {ROLES}")
        if not isinstance(msg["content"], str):
            raise TypeError(f"message {i} content must be a str, got {type(msg['content']).__name__}")


def render(messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The conversation as one string: ``<|role|>content<|end|>`` per message, nothing between.

    ``add_generation_prompt`` appends ``<|assistant|>``, the cue for the model to answer. A content that
    contains a chat marker is refused (``ValueError``): in a string it could not be told from a real one,
    so ``parse`` could not invert ``render``. ``render_ids`` accepts it (there the marker is ordinary text).

    >>> render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    '<|user|>Hi<|end|><|assistant|>Hello<|end|>'
    """
    _check_messages(messages)
    for i, msg in enumerate(messages):
        found = [t for t in CHAT_SPECIAL_TOKENS if t in msg["content"]]
        if found:
            raise ValueError(f"message {i} content contains the chat marker {found[0]!r}; render refuses it "
                             "(use render_ids, which encodes it as ordinary text)")  # fmt: skip
    text = "".join(f"{ROLE_MARKERS[m['role']]}{m['content']}{END_OF_TURN}" for m in messages)
    return text + (ROLE_MARKERS["assistant"] if add_generation_prompt else "")


def parse(text: str) -> list[dict[str, str]]:
    """The messages of a string made by ``render`` (without a generation prompt): its exact inverse.

    Raises ``ValueError`` on anything else: text outside a turn, a turn without ``<|end|>``, nested markers.

    >>> parse("<|user|>Hi<|end|><|assistant|>Hello<|end|>")
    [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}]
    """
    if not isinstance(text, str):
        raise TypeError(f"parse takes a str, got {type(text).__name__}")
    pieces = _SPLIT.split(text)  # text, marker, text, marker, ..., text
    if pieces[0]:
        raise ValueError(f"text before the first role marker: {pieces[0][:40]!r}")
    markers, texts = pieces[1::2], pieces[2::2]
    if not markers:
        raise ValueError("no chat markers: expected <|role|>content<|end|> ...")
    messages = []
    for k in range(0, len(markers), 2):
        marker = markers[k]
        if marker not in _MARKER_ROLE:
            raise ValueError(f"turn {k // 2} starts with {marker!r}; expected a role marker {tuple(_MARKER_ROLE)}")
        if k + 1 >= len(markers) or markers[k + 1] != END_OF_TURN:
            raise ValueError(f"turn {k // 2} ({marker}) is not closed by {END_OF_TURN}")
        if texts[k + 1]:
            raise ValueError(f"text between turns: {texts[k + 1][:40]!r}")
        messages.append({"role": _MARKER_ROLE[marker], "content": texts[k]})
    return messages


def _chat_ids(tok: Tokenizer) -> tuple[dict[str, int], int]:
    """The ids of the role markers and of ``<|end|>`` in ``tok``; a clear error if it lacks them."""
    missing = [t for t in CHAT_SPECIAL_TOKENS if t not in tok.special_tokens]
    if missing:
        raise ValueError(f"tokenizer has no chat tokens {missing}; make one with add_chat_tokens(tok)")
    return {role: tok.special_tokens[m] for role, m in ROLE_MARKERS.items()}, tok.special_tokens[END_OF_TURN]


def render_ids(messages: Sequence[dict[str, str]], tok: Tokenizer, add_generation_prompt: bool = False) -> list[int]:
    """The conversation as token ids: one special id per marker, each content encoded on its own.

    Contents go through ``encode_ordinary``, so text that looks like a marker (``"<|end|>"`` typed by a
    user) stays ordinary tokens and cannot end a turn: the same protection as tiktoken's
    ``disallowed_special``. ``tok`` must have the chat tokens (``add_chat_tokens``).

    >>> tok = add_chat_tokens(Tokenizer([]))
    >>> render_ids([{"role": "user", "content": "Hi"}], tok)
    [257, 72, 105, 259]
    """
    _check_messages(messages)
    role_id, end_id = _chat_ids(tok)
    ids: list[int] = []
    for msg in messages:
        ids += [role_id[msg["role"]], *tok.encode_ordinary(msg["content"]), end_id]
    return ids + ([role_id["assistant"]] if add_generation_prompt else [])


def _as_id_list(ids) -> list[int]:
    """A plain list of ints from a list or a 1-D tensor of ids."""
    if hasattr(ids, "tolist"):
        if getattr(ids, "ndim", 1) != 1:
            raise ValueError(f"ids must be 1-D (pos,), got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    return [int(i) for i in ids]


def parse_ids(ids: Sequence[int], tok: Tokenizer) -> list[dict[str, str]]:
    """The messages of ids made by ``render_ids`` (without a generation prompt): its exact inverse.

    >>> tok = add_chat_tokens(Tokenizer([]))
    >>> parse_ids([257, 72, 105, 259], tok)
    [{'role': 'user', 'content': 'Hi'}]
    """
    ids = _as_id_list(ids)
    role_id, end_id = _chat_ids(tok)
    id_role = {i: role for role, i in role_id.items()}
    messages, k = [], 0
    while k < len(ids):
        if ids[k] not in id_role:
            raise ValueError(f"position {k}: expected a role marker id {sorted(id_role)}, got {ids[k]}")
        start = k + 1
        end = start
        while end < len(ids) and ids[end] != end_id:
            if ids[end] in id_role:
                raise ValueError(f"position {end}: a role marker inside the turn that starts at {k}")
            end += 1
        if end == len(ids):
            raise ValueError(f"the turn that starts at position {k} is not closed by {END_OF_TURN}")
        messages.append({"role": id_role[ids[k]], "content": tok.decode(ids[start:end])})
        k = end + 1
    if not messages:
        raise ValueError("ids is empty: no messages")
    return messages


def answer_mask(ids: Sequence[int], tok: Tokenizer) -> list[bool]:
    """Per position, whether SFT puts its loss on that token: True on the assistant's answer tokens and
    the ``<|end|>`` that closes them, False on role markers, system and user turns.

    The ``<|end|>`` is learned so the model knows when to stop. An assistant turn cut off by ``n_ctx``
    (no ``<|end|>``) is masked to the end of ``ids``. ``ids`` is a list or a 1-D tensor ``(pos,)``;
    the loss mask for targets ``ids[1:]`` is ``answer_mask(ids, tok)[1:]``.

    >>> tok = add_chat_tokens(Tokenizer([]))
    >>> ids = render_ids([{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}], tok)
    >>> [int(m) for m in answer_mask(ids, tok)]
    [0, 0, 0, 0, 0, 0, 1, 1]
    """
    ids = _as_id_list(ids)
    role_id, end_id = _chat_ids(tok)
    markers = set(role_id.values())
    mask, inside = [], False
    for i in ids:
        if i in markers:
            mask.append(False)
            inside = i == role_id["assistant"]
        else:
            mask.append(inside)
            if i == end_id:
                inside = False
    return mask
