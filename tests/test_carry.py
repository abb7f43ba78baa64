"""The learner's parts carried forward (issue 38, item 3): kept when a check passes, used by a later notebook's
switch in a fresh kernel, and the reference with the reason when the part is missing or no longer passes."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from tfedu.checks import carry

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = json.loads((ROOT / "tfedu" / "course" / "solutions.json").read_text(encoding="utf-8"))


def test_a_cell_keeps_its_definitions_and_drops_what_it_runs():
    cell = textwrap.dedent('''
        import math
        SCALE = 2.0


        def f(x):
            return helper(x) * SCALE + math.pi


        print(f(1))
        f(2)
    ''')
    kept = carry.definitions(cell)
    assert "def f(x)" in kept and "SCALE = 2.0" in kept and "print" not in kept and "f(2)" not in kept
    assert carry.free_names(kept) == ["helper"]


def test_names_a_part_needs_are_brought_by_import_or_carried_part_or_said_missing():
    from tfedu import attention as tfa

    part = object()
    carry._carried[id(part)] = "5.3"
    try:
        namespace = {"tfa": tfa, "sdpa": tfa.scaled_dot_product_attention, "N": 3, "mine": part, "data": [1]}
        assert carry.bring("tfa", namespace, set()) == "import tfedu.attention as tfa"
        assert carry.bring("sdpa", namespace, set()) == "from tfedu.attention import scaled_dot_product_attention as sdpa"
        assert carry.bring("N", namespace, set()) == "N = 3"
        assert "_use_mine('5.3')" in carry.bring("mine", namespace, set())
        assert "not carried" in carry.bring("data", namespace, set())
        assert "not defined" in carry.bring("nowhere", namespace, set())
        assert carry.bring("g", namespace, {"g"}) == ""
    finally:
        del carry._carried[id(part)]


@pytest.fixture
def parts(tmp_path, monkeypatch):
    monkeypatch.delenv(carry.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / carry.FOLDER


def test_the_reference_comes_with_its_reason_when_the_part_is_missing_broken_or_failing(parts, capsys):
    from tfedu import attention as tfa

    assert carry.use_mine("5.3", tfa.MultiHeadAttention) is tfa.MultiHeadAttention
    assert "nb05.py does not exist" in capsys.readouterr().out
    parts.mkdir()
    (parts / "nb05.py").write_text("KEPT = {'5.3': 'MultiHeadAttention'}\nraise ValueError('half an edit')\n")
    assert carry.use_mine("5.3", tfa.MultiHeadAttention) is tfa.MultiHeadAttention
    assert "does not load: ValueError: half an edit" in capsys.readouterr().out
    (parts / "nb05.py").write_text("from torch import nn\nKEPT = {'5.3': 'MultiHeadAttention'}\n"
                                   "class MultiHeadAttention(nn.Module):\n"
                                   "    def __init__(self, d_model, n_heads):\n        super().__init__()\n"
                                   "    def forward(self, x, context=None, mask=None):\n        return x\n")
    assert carry.use_mine("5.3", tfa.MultiHeadAttention) is tfa.MultiHeadAttention
    assert "no longer passes its check: multi-head attention:" in capsys.readouterr().out
    os.environ[carry.ENV] = "off"
    try:
        assert carry.use_mine("5.3", tfa.MultiHeadAttention) is tfa.MultiHeadAttention
        assert "is off here" in capsys.readouterr().out
    finally:
        del os.environ[carry.ENV]


def run_cells(cwd: Path, cells: list[str]) -> list[str]:
    """Run ``cells`` in one fresh IPython kernel started in ``cwd`` (as Jupyter does for a notebook); their outputs."""
    from jupyter_client.manager import start_new_kernel

    env = {k: v for k, v in os.environ.items() if k != carry.ENV}
    km, kc = start_new_kernel(cwd=str(cwd), env=env, startup_timeout=120)
    outputs = []
    try:
        for source in cells:
            texts: list[str] = []
            reply = kc.execute_interactive(source, timeout=180, output_hook=lambda msg: texts.append(
                msg["content"].get("text", "") + "".join(msg["content"].get("traceback", []))
                + str(msg["content"].get("data", {}).get("text/plain", ""))))
            outputs.append("".join(texts))
            assert reply["content"]["status"] == "ok", (source, outputs[-1])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return outputs


def notebook_07_cells() -> list[str]:
    """Notebook 07's cells up to its switch for 5.3: imports, the two exercises and switches the GPT uses, the switch."""
    from tfedu.course import nbtools

    cells = [c.source for c in nbtools.read(ROOT / "notebooks" / "07_transformer_block.ipynb").cells if c.cell_type == "code"]
    wanted = ("from tfedu.model import GPT", "def layer_norm(", "USE_MY_LAYER_NORM = ", "def pre_norm_block(",
              "USE_MY_BLOCK = ", 'tfedu.use_mine("5.3"')
    picked = [next(c for c in cells if marker in c) for marker in wanted]
    return ["import torch", *picked]


def test_a_passed_part_is_kept_and_notebook_07_uses_it_in_a_fresh_kernel_then_falls_back_when_deleted(tmp_path):
    mha = SOLUTIONS["5.3"]["code"]
    setup = "import math, einops, torch\nfrom torch import nn\nfrom tfedu import attention as tfa\n"
    first = run_cells(tmp_path, [setup, mha, "from tfedu.checks import nb05_masks_and_heads as checks\n"
                                              "checks.check_multi_head_attention(MultiHeadAttention)"])
    kept = tmp_path / carry.FOLDER / "nb05.py"
    assert "kept in" in first[-1] and kept.is_file()
    text = kept.read_text()
    assert "class MultiHeadAttention(nn.Module)" in text and "KEPT['5.3'] = 'MultiHeadAttention'" in text
    later = notebook_07_cells()
    second = run_cells(tmp_path, [*later, "print(MultiHeadAttention.__module__, type(gpt_of_parts.blocks[0].attn.mha).__module__)"])
    assert "exercise 5.3 MultiHeadAttention: yours, from" in second[-2]
    assert "attention (5.3): yours" in second[-2]
    assert second[-1].split() == ["my_tfedu_nb05", "my_tfedu_nb05"]  # the GPT's blocks attend with the learner's class
    kept.unlink()
    third = run_cells(tmp_path, later)
    assert "nb05.py does not exist" in third[-1] and "attention (5.3): the reference" in third[-1]


def test_a_script_keeps_its_definition_and_exec_says_why_it_cannot(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "mine.py"
    script.write_text("import torch\nfrom tfedu.checks import nb05_masks_and_heads as checks\n\n\n"
                      "def causal_mask(n):\n    return torch.ones(n, n, dtype=torch.bool).tril()\n\n\n"
                      "checks.check_causal_mask(causal_mask)\n"
                      "exec('def causal_mask(n):\\n    return torch.ones(n, n, dtype=torch.bool).tril()')\n"
                      "checks.check_causal_mask(causal_mask)\n")
    env = {k: v for k, v in os.environ.items() if k != carry.ENV}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "kept in" in out.stdout and "could not find the source of causal_mask" in out.stdout
    assert "return torch.ones(n, n, dtype=torch.bool).tril()" in (tmp_path / carry.FOLDER / "nb05.py").read_text()


def test_a_block_function_runs_a_tfedu_gpt_and_gives_its_logits_only_when_it_is_right():
    import torch

    from tfedu.config import preset
    from tfedu.model import GPT

    namespace: dict = {}
    exec(SOLUTIONS["7.4"]["code"], namespace)  # the reference solution of 7.4, as a learner's function
    torch.manual_seed(0)
    model = GPT(preset("tiny")).eval()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        expected = model(ids)
        assert torch.allclose(carry.with_block_function(model, namespace["pre_norm_block"])(ids), expected, atol=1e-5)

        def post_norm(resid, ln1, attn, ln2, mlp):
            resid = ln1(resid + attn(resid))
            return ln2(resid + mlp(resid))

        assert not torch.allclose(carry.with_block_function(model, post_norm)(ids), expected, atol=1e-3)
    assert torch.equal(model(ids), expected)  # the original is untouched
    with pytest.raises(ValueError, match="pre-norm decoder blocks"):
        carry.with_block_function(GPT(preset("tiny").replace(norm_position="post")), post_norm)


def kept_file(folder: Path, number: str, name: str) -> None:
    """A learner's file holding the reference solution of ``number`` as if its check had passed in a notebook."""
    folder.mkdir(exist_ok=True)
    path = folder / f"nb{int(number.split('.')[0]):02d}.py"
    path.write_text(carry.HEADER.format(notebook=path.stem[2:]) + "\n" + SOLUTIONS[number]["code"]
                    + f"\n\nKEPT[{number!r}] = {name!r}\n", encoding="utf-8")


def code_cells(name: str, *markers: str) -> str:
    from tfedu.course import nbtools

    cells = [c.source for c in nbtools.read(ROOT / "notebooks" / name).cells if c.cell_type == "code"]
    return "\n".join(next(c for c in cells if marker in c) for marker in markers)


def test_notebook_07_rotates_with_the_learners_rope_and_08_runs_the_course_gpt_with_their_block(parts, capsys):
    kept_file(parts, "6.3", "apply_rope")
    kept_file(parts, "7.4", "pre_norm_block")
    seven = code_cells("07_transformer_block.ipynb", "from tfedu.model import GPT", 'tfedu.use_mine("6.3"')
    exec(compile("import torch\nimport tfedu\n" + seven, "07", "exec"), {})
    out = capsys.readouterr().out
    assert "exercise 6.3 apply_rope: yours" in out and "a RoPE GPT rotating with your apply_rope gives the reference logits" in out
    imports, switch = (code_cells("08_training_and_decoding.ipynb", marker)
                       for marker in ("from tfedu.experiments import course_gpt", 'tfedu.use_mine("7.4"'))
    exec(compile(f"import torch\n{imports}\ncourse, course_tok = course_gpt.load()\n{switch}", "08", "exec"), {})
    out = capsys.readouterr().out
    assert "exercise 7.4 pre_norm_block: yours" in out and "run by your pre_norm_block, give its own logits" in out
