"""Honest wrong answers score zero, end to end: the mistakes outside reviewers found scoring full
marks on notebooks 04 and 05 and (issue 37) 08, 10, 11, 13 and 15, graded the way an instructor grades
(released notebook, real answers, `grade` in sandboxes, two at a time), and the cascade: a wrong 4.1 no longer costs 4.2.

Each wrong submission is the notebook's own solution with ONE answer replaced, so every other
exercise must keep its full marks; the run must stay inside its limits, leave no process behind
and change no file outside the submissions' folder."""

import hashlib
import os
import re
import time
from pathlib import Path

import nbformat
import pytest

from tfedu.course import nbtools
from tfedu.course.grading import warm
from tfedu.course.grading.grade import Limits, grade
from tfedu.course.grading.release import student_version

from optional_parts import sandbox_or_skip

ROOT = Path(__file__).resolve().parents[1]
LIMITS = Limits(cell_timeout=60, timeout=240)

NO_SHIFT_ATTENTION = '''def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    e = scores.exp()  # no max shift: inf / inf = NaN once a score passes about 88
    weights = e / e.sum(dim=-1, keepdim=True)
    return weights @ v, weights
'''
TUPLE_SELF_ATTENTION = '''def self_attention(x: torch.Tensor, W_Q: torch.Tensor, W_K: torch.Tensor, W_V: torch.Tensor) -> torch.Tensor:
    return attention(x @ W_Q, x @ W_K, x @ W_V)  # the (output, weights) pair, where the spec says a tensor
'''
BUFFER_MASK = '''_MASK = torch.tril(torch.ones(16, 16, dtype=torch.bool))  # big enough for every check cell


def causal_mask(n: int) -> torch.Tensor:
    return _MASK[:n, :n]
'''
NO_SHIFT_MASKED = '''def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    e = scores.exp().masked_fill(~mask, 0.0)  # masking after exp, and no max shift
    weights = e / e.sum(dim=-1, keepdim=True)
    return weights @ v, weights
'''
# The red team's softmax in three more exercises (issue 37): exp over the sum, no max subtracted. Right on small
# scores; NaN once a score passes about 88 in float32, as with a confident model or a temperature of 0.1.
NO_SHIFT_TOP_P = '''def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    e = sorted_logits.exp()
    probs = e / e.sum(dim=-1, keepdim=True)
    drop_sorted = probs.cumsum(dim=-1) - probs >= p
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
'''
NO_SHIFT_DECODE = '''def decode_step(q, k_new, v_new, k_cache, v_cache):
    k_cache = torch.cat([k_cache, k_new], dim=2)
    v_cache = torch.cat([v_cache, v_new], dim=2)
    e = (q @ k_cache.transpose(-2, -1) / math.sqrt(q.shape[-1])).exp()
    return e / e.sum(dim=-1, keepdim=True) @ v_cache, k_cache, v_cache
'''
NO_SHIFT_CONSTRAINED = '''def constrained_probs(logits, allowed):
    e = logits.masked_fill(~allowed, float("-inf")).exp()
    return e / e.sum(dim=-1, keepdim=True)
'''
# LoRA's A and B kept as plain tensors with requires_grad (issue 37): right numbers, but not parameters of the
# module, so an optimizer built from model.parameters() trains nothing and state_dict() loses them.
PLAIN_TENSOR_LORA = '''class LoRA(nn.Module):
    def __init__(self, base, r, alpha):
        super().__init__()
        self.base, self.r, self.alpha = base, r, alpha
        for p in base.parameters():
            p.requires_grad_(False)
        self.A = torch.empty(r, base.in_features, dtype=base.weight.dtype)
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.A.requires_grad_(True)
        self.B = torch.zeros(base.out_features, r, dtype=base.weight.dtype, requires_grad=True)

    def forward(self, x):
        return self.base(x) + (self.alpha / self.r) * (x @ self.A.T) @ self.B.T

    def merged_weight(self):
        return self.base.weight + (self.alpha / self.r) * self.B @ self.A
'''
# Library shortcuts the hand-kept forbidden lists missed (issue 37, class 5): each gives the right numbers, and
# each calls the library's own version of what the exercise builds. The exercises' allow-lists
# (Probe.builds, tfedu.checks.building_blocks) refuse them without naming them.
PATCHIFY_BY_PIXEL_UNSHUFFLE = '''def patchify(images, patch_size):
    # (b, c * P * P, rows, cols), each channel's P x P block in row order: the patches, one per pixel
    return torch.nn.functional.pixel_unshuffle(images, patch_size).flatten(2).transpose(1, 2)
'''
MEL_FROM_TRANSFORMERS = '''from transformers.audio_utils import mel_filter_bank


def mel_filterbank(n_freqs, n_mels, sample_rate):
    bank = mel_filter_bank(num_frequency_bins=n_freqs, num_mel_filters=n_mels, min_frequency=0.0,
                           max_frequency=sample_rate / 2, sampling_rate=sample_rate, mel_scale="htk")
    return torch.from_numpy(bank).T
'''
TOP_K_BY_WARPER = '''from transformers.generation.logits_process import TopKLogitsWarper


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    return TopKLogitsWarper(top_k=k)(None, logits.clone())
'''

# name -> (notebook, {answer grade_id: wrong source (or a function of the solution)}, expected points by check;
# the checks left out score full marks)
CASES = {
    "04_full": ("04_attention", {}, None),
    "04_attention_without_max_shift": ("04_attention", {"ex_attention": NO_SHIFT_ATTENTION},
                                       {"check_attention": 0, "check_self_attention": "full"}),
    "04_self_attention_returns_a_tuple": ("04_attention", {"ex_self_attention": TUPLE_SELF_ATTENTION},
                                          {"check_attention": "full", "check_self_attention": 0}),
    "05_full": ("05_masks_and_heads", {}, None),
    "05_causal_mask_from_a_16x16_buffer": ("05_masks_and_heads", {"ex_causal_mask": BUFFER_MASK},
                                           {"check_causal_mask": 0, "check_masked_attention": "full",
                                            "check_multi_head_attention": "full"}),
    "05_masked_attention_without_max_shift": ("05_masks_and_heads", {"ex_masked_attention": NO_SHIFT_MASKED},
                                              {"check_causal_mask": "full", "check_masked_attention": 0,
                                               "check_multi_head_attention": "full"}),
    "05_multi_head_attention_under_no_grad": ("05_masks_and_heads", {"ex_multi_head_attention": "no_grad"},
                                              {"check_causal_mask": "full", "check_masked_attention": "full",
                                               "check_multi_head_attention": 0}),
    "08_top_p_without_max_shift": ("08_training_and_decoding", {"ex_top_p": NO_SHIFT_TOP_P},
                                   {"check_greedy": "full", "check_top_k": "full", "check_top_p": 0}),
    "08_top_k_by_transformers_warper": ("08_training_and_decoding", {"ex_top_k": TOP_K_BY_WARPER},
                                        {"check_greedy": "full", "check_top_k": 0, "check_top_p": "full"}),
    "10_decode_step_without_max_shift": ("10_inference_and_kv_cache", {"ex_decode_step": NO_SHIFT_DECODE},
                                         {"check_decode_step": 0, "check_cache_bytes": "full", "check_pool_kv_weight": "full"}),
    "11_patchify_and_mel_from_libraries": ("11_beyond_text", {"ex_patchify": PATCHIFY_BY_PIXEL_UNSHUFFLE,
                                                              "ex_mel_filterbank": MEL_FROM_TRANSFORMERS},
                                           {"check_patchify": 0, "check_mel_filterbank": 0}),
    "13_lora_as_plain_tensors": ("13_peft", {"ex_lora": PLAIN_TENSOR_LORA}, {"check_lora": 0}),
    "15_constrained_probs_without_max_shift": ("15_interpretability_and_decoding",
                                               {"ex_constrained_probs": NO_SHIFT_CONSTRAINED}, {"check_constrained_probs": 0}),
}


def solved(cell_source: str) -> str:
    """The answer cell a learner who got it right would submit: the solution without its markers."""
    return re.sub(r"\n *### (BEGIN|END) SOLUTION", "", cell_source)


def under_no_grad(cell_source: str) -> str:
    """The same forward pass, computed under torch.no_grad(): right numbers, nothing to train."""
    answer = solved(cell_source)
    head, body = answer.split("        context = x if context is None else context\n")
    return head + "        context = x if context is None else context\n        with torch.no_grad():\n" + "".join(
        "    " + line for line in body.splitlines(keepends=True))


def submission(notebook: str, wrong: dict[str, str]):
    source = nbtools.read(ROOT / "notebooks" / f"{notebook}.ipynb")
    solutions = {(nbtools.nbgrader_meta(c) or {}).get("grade_id"): c.source for c in source.cells}
    nb = student_version(source)
    for cell in nb.cells:
        grade_id = (nbtools.nbgrader_meta(cell) or {}).get("grade_id")
        if (nbtools.nbgrader_meta(cell) or {}).get("solution"):
            answer = wrong.get(grade_id)
            cell.source = (under_no_grad(solutions[grade_id]) if answer == "no_grad"
                           else answer if answer is not None else solved(solutions[grade_id]))
    return nb


RUN_TOKEN = f"TFEDU_HONEST_RUN_{os.getpid()}"  # in the environment of everything this module's grading starts


def ours() -> set[int]:
    """Processes of grading alive now: sandboxes, runners and kernels that descend from this test
    process, or that were orphaned to init and carry this module's token (tests running beside this
    one, under xdist, have graders of their own)."""
    parents, interesting = {}, set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                try:
                    environ = Path(f"/proc/{entry}/environ").read_bytes()
                except OSError:
                    environ = b""
            except (OSError, ValueError, IndexError):
                continue
            if any(word in cmdline for word in (b"bwrap", b"tfedu.course.grading.inside", b"ipykernel_launcher")):
                if parents[int(entry)] != 1 or RUN_TOKEN.encode() in cmdline + environ:
                    interesting.add(int(entry))

    def mine(pid: int) -> bool:  # a descendant of this test process (every chain ends at init: that is not enough)
        for _ in range(64):
            if pid == os.getpid():
                return True
            pid = parents.get(pid, 0)
            if pid <= 1:
                return False
        return False

    return {pid for pid in interesting if parents.get(pid) == 1 or mine(pid)}


def fingerprint(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def graded_each(folder: Path) -> dict:
    """Each notebook's cases graded in one call, as an instructor would; the entries by case."""
    results = {}
    for notebook in dict.fromkeys(nb_name for nb_name, _, _ in CASES.values()):
        paths = {}
        for name, (nb_name, wrong, _) in CASES.items():
            if nb_name == notebook:
                paths[name] = folder / f"{name}.ipynb"
                paths[name].write_text(nbformat.writes(submission(nb_name, wrong)))
        submissions = fingerprint(folder)
        out = grade(list(paths.values()), source=ROOT / "notebooks" / f"{notebook}.ipynb", limits=LIMITS, jobs=2)
        assert fingerprint(folder) == submissions, "grading changed a file in the submissions' folder"
        results.update({Path(e["file"]).stem: e for e in out["submissions"]})
    return results


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    sandbox_or_skip()
    folder = tmp_path_factory.mktemp("honest")
    notebooks_before = fingerprint(ROOT / "notebooks")
    os.environ[RUN_TOKEN] = "1"  # TFEDU_* variables reach the sandbox: an orphan would carry it
    before = ours()
    with warm.scope(fresh=True):  # one warm-kernel server for all these calls, ended before the check below
        results = graded_each(folder)
    del os.environ[RUN_TOKEN]
    left = ours() - before
    for _ in range(50):  # a sandbox being torn down (here or by a neighbouring test) is gone within moments
        if not left:
            break
        time.sleep(0.1)
        left &= ours()
    return {"entries": results, "left": left, "notebooks_changed": fingerprint(ROOT / "notebooks") != notebooks_before}


@pytest.mark.parametrize("name", CASES)
def test_one_honest_mistake_costs_its_own_exercise_and_nothing_else(graded, name):
    entry = graded["entries"][name]
    expected = CASES[name][2]
    for check, exercise in entry["exercises"].items():
        # A check the case does not name is one the mistake must not touch: full marks.
        want = exercise["max"] if expected is None or expected.get(check, "full") == "full" else expected[check]
        assert exercise["points"] == want, f"{name} {check}: {exercise['feedback']}"
    assert entry["seconds"] < LIMITS.timeout


FEEDBACK = {
    ("04_attention_without_max_shift", "check_attention"): "NaN",
    ("04_self_attention_returns_a_tuple", "check_self_attention"): "tensor",
    ("05_causal_mask_from_a_16x16_buffer", "check_causal_mask"): "16",
    ("05_masked_attention_without_max_shift", "check_masked_attention"): "NaN",
    ("05_multi_head_attention_under_no_grad", "check_multi_head_attention"): "grad",
    ("08_top_p_without_max_shift", "check_top_p"): "overflows",
    ("10_decode_step_without_max_shift", "check_decode_step"): "overflows",
    ("15_constrained_probs_without_max_shift", "check_constrained_probs"): "overflows",
    ("13_lora_as_plain_tensors", "check_lora"): "not one of its parameters",
    ("08_top_k_by_transformers_warper", "check_top_k"): "`transformers.generation.logits_process.TopKLogitsWarper`",
    ("11_patchify_and_mel_from_libraries", "check_patchify"): "`torch.nn.functional.pixel_unshuffle`",
    ("11_patchify_and_mel_from_libraries", "check_mel_filterbank"): "`transformers.audio_utils.mel_filter_bank`",
}


@pytest.mark.parametrize("case", FEEDBACK, ids=["-".join(c) for c in FEEDBACK])
def test_the_feedback_names_the_mistake(graded, case):
    name, check = case
    assert FEEDBACK[case] in graded["entries"][name]["exercises"][check]["feedback"]


def test_grading_left_no_process_and_changed_no_course_file(graded):
    assert not graded["left"], f"processes of grading outlived it: {sorted(graded['left'])}"
    assert not graded["notebooks_changed"]
