"""No answer on the page (issue 38, item 1): no line of an exercise's solution appears before the exercise.

For every exercise of every source notebook, each line of its solution (the code between the solution
markers; for an assignment or a ``return``, its expression too) is looked for, with whitespace, comments,
quote styles and the names of variables ignored (``resid_mid = resid_pre + attn(ln1(resid_pre))`` is the
line ``resid_mid = resid + attn(ln1(resid))``), in:

- every cell before the exercise, as the learner sees it in the release (code cells, string literals
  inside them, so printed code counts, and the code spans of markdown cells);
- the exercise cell itself, as released (its comments and docstring);
- every message its checker module can print (its string constants, except the code it runs: stand-ins,
  probe runs and docstrings).

A line that is also a line of an earlier exercise's solution (in this notebook or an earlier one) is the
learner's own work by then, not this exercise's answer, and may be shown. Lines shorter than
:data:`MIN_TOKENS` tokens (``loss.backward()``, ``d_k = q.shape[-1]``) are steps every
learner writes, not answers, and are not looked for. Prose that describes a line in words ("set the
forbidden logits to -inf, then take the softmax") is not code and is not found here: that is left to the
author and to a learner's read-through.

When it landed it found 43 answers on the page (checker messages that spelled out the fix, teaching cells that
printed the solution's lines, briefs and docstrings); all were rewritten in words (issue 38, item 1).
"""

import ast
import builtins
import io
import keyword
import re
import textwrap
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

from tfedu.course import nbtools
from tfedu.course.grading.release import student_version

from per_notebook import NOTEBOOKS

ROOT = Path(__file__).resolve().parents[1]
MIN_TOKENS = 8  # a solution line's (or expression's) length, in tokens, before it counts as an answer
# Names kept as they are (not renamed): the language's and the libraries' own.
KEPT = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {"torch", "F", "np", "math", "nn"}
LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
# Strings in a checker module that are code it runs, not messages it prints.
# (whole words of the constant's name, so HINT_TRUNCATE or HINT_ZP_CODES, which are messages, are read)
CODE_CONSTANTS = re.compile(r"^(?!HINT_)(?:\w+_)?(?:STANDINS?|RUN|SOURCE|HELPERS|CLEANUP|EXPORT|CODE)(?:_\w+)?$")
SOLUTION = re.compile(r"### BEGIN SOLUTION\n(.*?)\n[ \t]*### END SOLUTION", re.S)


def tokens(text: str, depth: int = 0) -> list[str]:
    """The Python tokens of ``text``; a string literal is its value, and is read as code too (printed code)."""
    out: list[str] = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type in LAYOUT:
                continue
            if token.type == tokenize.STRING:
                try:
                    value = ast.literal_eval(token.string)
                except (ValueError, SyntaxError):
                    value = token.string
                out.append(repr(value))
                if isinstance(value, str) and depth < 2 and value != text and not re.fullmatch(r"\S{0,20}", value):
                    out += ["\n", *tokens(value, depth + 1), "\n"]
                continue
            out.append(token.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):  # prose, half a statement: words and symbols
        for word in re.findall(r"'[^'\s]{1,20}'|\"[^\"\s]{1,20}\"|[A-Za-z_]\w*|\d+\.?\d*(?:e-?\d+)?|\*\*|//|==|!=|<=|>=|->|[^\s\w]",
                               text):
            out.append(repr(word[1:-1]) if word[0] in "'\"" and len(word) > 1 else word)  # a short literal: its value
    return out


def renamed(toks: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Variable names replaced by v0, v1, ... in order of first use; attributes, keywords and libraries kept."""
    names: dict[str, str] = {}
    out, previous = [], ""
    for tok in toks:
        is_name = tok.isidentifier() and tok not in KEPT and previous != "."
        out.append(names.setdefault(tok, f"v{len(names)}") if is_name else tok)
        previous = tok
    return tuple(out)


def solution_lines(cell_source: str) -> list[tuple[str, tuple[str, ...]]]:
    """(the line as written, the renamed tokens to look for) for each line of the solution, and for an
    assignment or a ``return`` also its expression alone."""
    found = []
    for solution in SOLUTION.findall(cell_source):
        code = textwrap.dedent(solution)
        for line in code.splitlines():
            toks = tokens(line.strip()) if line.strip() and not line.strip().startswith("#") else []
            text = line.strip()
            candidates = [toks]
            if toks[:1] == ["return"]:
                candidates.append(toks[1:])
            if "=" in toks and toks.index("=") < len(toks) - 1:
                candidates.append(toks[toks.index("=") + 1:])
            for candidate in candidates:
                if len(candidate) >= MIN_TOKENS:
                    found.append((text, renamed(candidate)))
    return found


def windows(toks: list[str], n: int) -> set[tuple[str, ...]]:
    return {renamed(toks[k:k + n]) for k in range(len(toks) - n + 1)}


class Haystack:
    """Tokens to search, indexed by token, so that a pattern is tried only where its first fixed token is."""

    def __init__(self, toks: list[str] = ()):
        self.toks: list[str] = []
        self.at: dict[str, list[int]] = {}
        self.add(list(toks))

    def add(self, toks: list[str]) -> None:
        for tok in toks:
            self.at.setdefault(tok, []).append(len(self.toks))
            self.toks.append(tok)

    def __contains__(self, pattern: tuple[str, ...]) -> bool:
        n = len(pattern)
        anchor = next((i for i, tok in enumerate(pattern) if not re.fullmatch(r"v\d+", tok)), None)
        if anchor is None:
            return pattern in windows(self.toks, n)
        starts = (k - anchor for k in self.at.get(pattern[anchor], ()))
        return any(0 <= k <= len(self.toks) - n and renamed(self.toks[k:k + n]) == pattern for k in starts)


def messages(module: Path) -> list[str]:
    """The strings a checker module can print: its constants, less docstrings and the code it runs."""
    tree = ast.parse(module.read_text())
    code: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            code.add(id(body[0].value))  # a docstring
        if isinstance(node, ast.keyword) and node.arg in ("standins", "run"):
            code |= {id(n) for n in ast.walk(node.value)}
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and CODE_CONSTANTS.match(t.id) for t in node.targets):
            code |= {id(n) for n in ast.walk(node.value)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in code]


def markdown_code(text: str) -> str:
    return "\n".join(re.findall(r"```[^\n]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text))


def earlier_solutions(path: Path) -> list[tuple[str, ...]]:
    """The solution lines of every exercise in the notebooks before ``path``, as patterns."""
    return [pattern for earlier in NOTEBOOKS[:NOTEBOOKS.index(path)] for cell in nbtools.read(earlier).cells
            if cell.cell_type == "code" for _, pattern in solution_lines(cell.source)]


@lru_cache(maxsize=None)
def leaks(path: Path) -> tuple[str, ...]:
    nb = nbtools.read(path)
    released = student_version(nb, path.name)
    module = next((ROOT / "tfedu" / "checks").glob(f"nb{path.stem[:2]}_*.py"), None)
    checker = Haystack()
    for text in messages(module) if module else []:
        checker.add(["\n", *tokens(text)])
    before = Haystack()
    found = []
    done = set(earlier_solutions(path))  # lines the learner wrote in an earlier exercise are theirs to reuse
    for original, shown in zip(nb.cells, released.cells):
        lines = solution_lines(original.source) if original.cell_type == "code" else []
        if lines:
            grade_id = (nbtools.nbgrader_meta(original) or {}).get("grade_id")
            own = Haystack(tokens(shown.source))
            for text, pattern in lines:
                if pattern in done:
                    continue
                where = [name for name, haystack in (("a cell before it", before), ("its own cell", own),
                                                     ("its checker's messages", checker)) if pattern in haystack]
                if where:
                    found.append(f"{grade_id}: `{text}` is shown in {' and '.join(where)}")
        before.add(["\n", *tokens(markdown_code(shown.source) if shown.cell_type == "markdown" else shown.source)])
        done |= {pattern for _, pattern in lines}
    return tuple(dict.fromkeys(found))


def test_the_matching_ignores_names_spaces_and_quotes_but_not_structure():
    line = renamed(tokens("resid_mid = resid + attn(ln1(resid))"))
    assert line in Haystack(tokens('print("resid_mid = resid_pre + attn(ln1(resid_pre))")'))
    assert line not in Haystack(tokens("out = a + attn(ln1(b))"))  # b is not a: another line
    expr = renamed(tokens("logits.masked_fill(logits < kth_largest, float(\"-inf\"))"))
    assert expr in Haystack(tokens("e.g. logits.masked_fill(logits < kth, float('-inf')) will do"))
    assert [t for _, t in solution_lines("    ### BEGIN SOLUTION\n    return logits.masked_fill(logits < k, 0.0)\n"
                                         "    ### END SOLUTION")][-1][0] == "v0"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_line_of_a_solution_is_on_the_page_before_it(path):
    found = leaks(path)
    assert not found, f"{path.name}: the answer is on the page:\n" + "\n".join(found)
