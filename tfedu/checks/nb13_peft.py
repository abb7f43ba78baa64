"""Checkers for notebooks/13_peft.ipynb: LoRA, a bottleneck adapter and prefix attention by hand.

Three exercises, each checked against its tfedu reference after first trying the known mistakes:

- 13.1 ``LoRA(base, r, alpha)``, an ``nn.Module`` wrapping a frozen ``nn.Linear`` ``base``, with ``A``
  (r, d_in) and ``B`` (d_out, r), ``forward(x) = base(x) + (alpha / r) B A x`` and ``merged_weight()``
  ``= W_0 + (alpha / r) B @ A``. Named mistakes: B not zero at initialisation (the model does not start
  at the pretrained one), A zero as well (no gradient ever reaches B's partner: nothing learns), the
  base weight left trainable, A and B in each other's shapes ((d_in, r) and (r, d_out)), the alpha / r
  scale missing, alpha alone or alpha // r (rounded down; the cases' alpha is never a multiple of r), A and
  B made in float32 for a float64 base layer (dtype=base.weight.dtype), an activation between A and B (ReLU or GELU: then no merge exists), a
  merge that adds (B @ A).T (the Conv1D habit of GPT-2's checkpoints) or drops the scale, a forward or
  a merge that changes the base weight in place, gradients that do not reach A and B. Compared with the
  formula on several shapes (square ones too, where a transposed merge has the right shape), with B set
  to random values first, then the gradients to A and B. Then what an optimizer and a checkpoint see:
  A and B kept as plain tensors with requires_grad (not parameters of the module: model.parameters() and
  state_dict() miss them, so nothing trains), the base layer's bias left trainable, and one SGD step over
  the module's trainable parameters from B = 0 must change B and leave the base layer as it was.
  ``tfedu.peft`` is refused.
- 13.2 ``Adapter(d_model, bottleneck)``, an ``nn.Module`` with ``nn.Linear`` layers ``down`` (d_model to
  bottleneck) and ``up`` (back), ``forward(h) = h + up(gelu(down(h)))``, ``up`` zero at the start (weight and
  bias) as ``tfedu.peft.Adapter`` (Houlsby et al. 2019, fig. 2). Run in float32 and float64 with the
  reference's weights copied in (``up`` made non-zero), then from a fresh start. Named mistakes: no residual
  (only the bottleneck's output), no activation between down and up (a low-rank linear map), the activation
  after up, ReLU or tanh-approximated GELU for the exact GELU, down and up in each other's shapes, biases
  missing, up random at the start or only its weight zeroed (the adapted model is no longer the base model at
  step 0), down zero as well (nothing ever learns), weights kept as plain tensors (not registered: no
  optimizer sees them), an output in another dtype than its input, and one SGD step that changes nothing.
- 13.3 ``prefix_attention(x, attn, prefix_k, prefix_v)``: the causal self-attention of a multi-head layer
  ``attn`` (``W_Q``, ``W_K``, ``W_V``, ``W_O`` as ``nn.Linear``, ``n_heads``: exercise 5.3's layout) over ``x``
  (batch, pos, d_model), with learned keys and values ``(n_heads, n_prefix, d_head)`` in front of the tokens':
  every query reads the whole prefix and the tokens up to its own; the output is (batch, pos, d_model). Equal to
  ``tfedu.layers.Attention`` with ``prefix`` set (``tfedu.peft.apply_prefix_tuning``'s plain prefix) and the same
  weights, in float64 and float32, and the gradients reach the prefix. While it is checked and graded a correct
  ``masked_attention`` stands in for the learner's of exercise 5.2, and says which of its arguments disagree.
  Named mistakes: the prefix under the causal mask (laid over all n_prefix + pos keys from the first column:
  query i sees the first i + 1 keys), the mask not extended (one column per token: the shapes disagree), the
  causal mask missing, the prefix ignored, the prefix before the queries too (the output n_prefix rows longer),
  the prefix on the keys but not the values (or the reverse), prefix_k prepended to the values, the prefix
  appended after the tokens (with an end-aligned mask or one built for the front), every head reading the first
  head's prefix, the heads scrambled by a reshape to (n_prefix, d_model) without moving the head axis, the
  scale from d_model or none, the output's dtype changed, and no gradient to the prefix. (The course GPT's
  positions are learned vectors added before the blocks, so attention has no positions to give the prefix.)
  ``tfedu.peft`` and ``tfedu.layers`` are refused.

A class whose construction raises NotImplementedError, or a forward that returns None, is taken for an
unfinished exercise (``ExerciseNotDone``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from tfedu.checks.building_blocks import ACTIVATIONS, EINOPS, ELEMENTARY, MODULES, SOFTMAX
from tfedu.checks.core import CheckFailure, ExerciseNotDone, Hints, Probe, checker, expect, global_names, names_bound
from tfedu.checks.probes import CLEANUP, HELPERS

FORBIDDEN = ("tfedu.peft",)
FORBIDDEN_PREFIX = ("tfedu.peft", "tfedu.layers")  # 13.3: both run a prefix already

# Run in the student's kernel (in the probe's run code) and, for the checker, here: one source.
LORA_HELPERS = '''\
def _lora_record(LoRA, case):
    """What a learner's LoRA does on one case, as plain data (NumPy arrays, bools, strings)."""
    torch.manual_seed(int(case["seed"]))
    base = torch.nn.Linear(int(case["d_in"]), int(case["d_out"])).double()
    with torch.no_grad():
        base.weight.copy_(torch.from_numpy(case["W"]))
        base.bias.copy_(torch.from_numpy(case["b"]))
    W_before = base.weight.detach().clone()
    try:
        layer = LoRA(base, int(case["r"]), float(case["alpha"]))
    except NotImplementedError:
        return {"status": "not done"}
    A, B = getattr(layer, "A", None), getattr(layer, "B", None)
    if not isinstance(A, torch.Tensor) or not isinstance(B, torch.Tensor):
        return {"status": "no A, B", "got": type(A).__name__ + ", " + type(B).__name__}
    record = {"status": "ok", "A_shape": list(A.shape), "B_shape": list(B.shape),
              "B_zero": bool((B.detach() == 0).all()), "A_zero": bool((A.detach() == 0).all()),
              "base_trainable": bool(getattr(getattr(layer, "base", base), "weight", base.weight).requires_grad),
              "A_trainable": bool(A.requires_grad), "B_trainable": bool(B.requires_grad)}
    if record["A_shape"] != [int(case["r"]), int(case["d_in"])] or record["B_shape"] != [int(case["d_out"]), int(case["r"])]:
        return record
    record["AB_dtypes"] = [str(A.dtype).replace("torch.", ""), str(B.dtype).replace("torch.", "")]
    if A.dtype != base.weight.dtype or B.dtype != base.weight.dtype:
        return record
    with torch.no_grad():
        A.copy_(torch.from_numpy(case["A"]).to(A.dtype))
        B.copy_(torch.from_numpy(case["B"]).to(B.dtype))
    x = torch.from_numpy(case["x"])
    try:
        out = layer(x)
    except NotImplementedError:
        return {"status": "not done"}
    if out is None:
        return {"status": "not done"}
    record["out"] = out.detach().double().numpy() if isinstance(out, torch.Tensor) else type(out).__name__
    record["grads"] = "missing"
    if isinstance(out, torch.Tensor) and out.requires_grad and tuple(out.shape) == tuple(x.shape[:-1]) + (int(case["d_out"]),):
        grads = torch.autograd.grad((out * torch.from_numpy(case["upstream"]).to(out.dtype)).sum(), [A, B], allow_unused=True)
        record["grads"] = ["none" if g is None else g.double().numpy() for g in grads]
    record["forward_changed_W"] = not torch.equal(base.weight.detach(), W_before)
    try:
        merged = layer.merged_weight() if hasattr(layer, "merged_weight") else "no merged_weight method"
    except NotImplementedError:
        return {"status": "not done"}
    except Exception as err:
        merged = "an error: " + type(err).__name__ + ": " + str(err)[:200]
    record["merged"] = merged.detach().double().numpy() if isinstance(merged, torch.Tensor) else str(merged)
    record["merge_changed_W"] = not torch.equal(base.weight.detach(), W_before)
    # What an optimizer and a checkpoint see: the module's parameters, the trainable ones, its state_dict.
    params = {id(p): name for name, p in layer.named_parameters()}
    record["registered"] = [id(A) in params, id(B) in params]
    stored = [t.data_ptr() for t in layer.state_dict().values() if isinstance(t, torch.Tensor)]
    record["in_state_dict"] = [A.data_ptr() in stored, B.data_ptr() in stored]
    record["trainable_base"] = sorted(name for name, p in base.named_parameters() if p.requires_grad and id(p) in params)
    trainable = [p for p in layer.parameters() if p.requires_grad]
    record["step_changed_B"] = False
    if trainable and isinstance(out, torch.Tensor) and out.requires_grad:
        base_before = [p.detach().clone() for p in base.parameters()]
        with torch.no_grad():
            B.zero_()  # a fresh adapter, as after __init__
        B_before = B.detach().clone()
        optimizer = torch.optim.SGD(trainable, lr=0.1)
        optimizer.zero_grad()
        (layer(x) * torch.from_numpy(case["upstream"]).to(x.dtype)).sum().backward()
        optimizer.step()
        record["step_changed_B"] = not torch.equal(B.detach(), B_before)
        record["step_changed_base"] = any(not torch.equal(p.detach(), q) for p, q in zip(base.parameters(), base_before))
    return record


'''
LORA_CLEANUP = "del _lora_record\n"

_helpers: dict[str, Any] = {"torch": torch}
exec(compile(LORA_HELPERS, "<lora probe helpers>", "exec"), _helpers)
lora_record = _helpers["_lora_record"]

HINT_SHORTCUT = "your LoRA uses tfedu.peft ({name}): LoRA is the exercise itself, so build it from torch operations"
HINT_NOT_DONE = "this exercise is not done yet (replace the `raise NotImplementedError` with your code)"
HINT_NO_AB = "LoRA should keep its two matrices as attributes A (r, d_in) and B (d_out, r) (nn.Parameters), got {got}"
HINT_SWAPPED_SHAPES = (
    "your A is {A} and B is {B} for d_in = {d_in}, d_out = {d_out}, r = {r}: A maps the input down to r numbers, "
    "so it is (r, d_in), like the weight of an nn.Linear from d_in to r features; B maps them up, (d_out, r). "
    "Then B @ A is (d_out, d_in), "
    "the shape of W_0, which is what lets it merge"
)
HINT_B_NOT_ZERO = (
    "your B is not zero at initialisation: then the LoRA model is not the pretrained model at step 0 (B A x adds "
    "random noise to every layer). Initialise B with zeros (and A randomly), as Hu et al. 2021 sec. 4.1 do"
)
HINT_A_ZERO = (
    "your A is zero at initialisation as well as B: then the gradient to B (which is upstream times A x) and the "
    "gradient to A (which passes through B) are both zero, and nothing ever learns. Only B starts at zero; A "
    "starts random (Kaiming-uniform, like an nn.Linear's weight)"
)
HINT_BASE_TRAINABLE = (
    "your base layer's weight still requires grad: LoRA freezes W_0 and trains A and B only (that is the whole "
    "saving). Switch off requires_grad on the base layer's weight, and on its bias too"
)
HINT_NOT_REGISTERED = (
    "your {which} is a tensor held by the module but not one of its parameters: layer.parameters() and "
    "state_dict() do not list it, so an optimizer built from model.parameters() never updates it and a saved "
    "checkpoint loses it. A trainable weight of an nn.Module must be an nn.Parameter assigned as an attribute"
)
HINT_BASE_PART_TRAINABLE = (
    "the base layer's {names} still trains: LoRA freezes every parameter of W_0's layer, the bias included; "
    "only A and B learn"
)
HINT_STEP = (
    "one optimizer step over your module's trainable parameters (starting from B = 0) did not change B: the "
    "adapter does not learn. Check that B is a trainable parameter of the module and that the forward uses it"
)
HINT_STEP_BASE = "one optimizer step over your module's trainable parameters changed the frozen base layer"
HINT_AB_FROZEN = "your A and B should be trainable nn.Parameters (requires_grad=True): they are all that LoRA trains"
HINT_NO_SCALE = (
    "your forward leaves out the alpha / r scale: the output is W_0 x + (alpha / r) B A x. The scale keeps the "
    "update's size "
    "the same when you change r, so the learning rate need not change with it"
)
HINT_ALPHA_ONLY = "your forward scales B A x by alpha, not alpha / r: divide by the rank r too"
HINT_FLOOR_DIV = "your forward scales B A x by alpha // r, which rounds down (3.5 // 2 is 1.0): use alpha / r"
HINT_DTYPE = (
    "your A and B are {got} but the base layer's weight is float64 (the check uses float64 layers): create them "
    "in the base weight's dtype (and on its device), so that LoRA fits any layer it wraps"
)
HINT_ACTIVATION = (
    "your forward puts a nonlinearity ({act}) between A and B: LoRA has none (deck: \"No activation in-between\"), "
    "so B A is one linear map that can be merged into W_0"
)
HINT_FORWARD = "your forward does not give base(x) + (alpha / r) * B A x{detail}"
HINT_MERGE_TRANSPOSED = (
    "your merged_weight adds (B @ A).T: W_0 is nn.Linear's (d_out, d_in) and B @ A is already (d_out, d_in); the "
    "transpose is only for GPT-2's Conv1D layers, which store [d_in, d_out]"
)
HINT_MERGE_NO_SCALE = "your merged_weight adds B @ A without the alpha / r scale: the merged layer must equal the forward"
HINT_MERGE = "your merged_weight is not W_0 + (alpha / r) B @ A{detail}"
HINT_IN_PLACE = (
    "your {what} changed the base layer's weight in place: forward must leave W_0 alone, and merged_weight should "
    "return W_0 + (alpha / r) B @ A as a new tensor (calling it twice must not add B @ A twice)"
)
HINT_GRADS = "no gradient reaches your {which}: do not detach it or use torch.no_grad() in forward"
HINT_GRADS_WRONG = "the gradient to your {which} is not that of base(x) + (alpha / r) B A x"


def _close(a: Any, b: np.ndarray, rtol: float = 1e-6, atol: float = 1e-8) -> bool:
    return isinstance(a, np.ndarray) and a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=atol))


def _mistake_outputs(case: dict) -> dict[str, np.ndarray]:
    x, W, b, A, B = (torch.from_numpy(case[k]) for k in ("x", "W", "b", "A", "B"))
    scale = case["alpha"] / case["r"]
    base = x @ W.T + b
    return {
        k: v.numpy() for k, v in {
            "right": base + scale * (x @ A.T) @ B.T, "no scale": base + (x @ A.T) @ B.T,
            "alpha only": base + case["alpha"] * (x @ A.T) @ B.T,
            "floor division": base + (case["alpha"] // case["r"]) * (x @ A.T) @ B.T, "ReLU": base + scale * torch.relu(x @ A.T) @ B.T,
            "GELU": base + scale * torch.nn.functional.gelu(x @ A.T) @ B.T, "merged": W + scale * B @ A,
            "merged transposed": W + scale * (B @ A).T if W.shape[0] == W.shape[1] else torch.zeros(0),
            "merged no scale": W + B @ A}.items()}


def _grads(case: dict) -> list[np.ndarray]:
    x, A, B, up = (torch.from_numpy(case[k]) for k in ("x", "A", "B", "upstream"))
    A, B = A.clone().requires_grad_(), B.clone().requires_grad_()
    out = case["alpha"] / case["r"] * (x @ A.T) @ B.T
    return [g.numpy() for g in torch.autograd.grad((out * up).sum(), [A, B])]


def diagnose(record: dict, case: dict) -> None:
    """Raise CheckFailure naming what is wrong with one record of ``_lora_record``; return when it is right."""
    if record["status"] == "not done":
        raise ExerciseNotDone(HINT_NOT_DONE)
    if record["status"] == "no A, B":
        raise CheckFailure(HINT_NO_AB.format(got=record["got"]))
    d_in, d_out, r = case["d_in"], case["d_out"], case["r"]
    if record["A_shape"] != [r, d_in] or record["B_shape"] != [d_out, r]:
        raise CheckFailure(HINT_SWAPPED_SHAPES.format(A=tuple(record["A_shape"]), B=tuple(record["B_shape"]),
                                                      d_in=d_in, d_out=d_out, r=r))
    dtypes = record.get("AB_dtypes", ["float64", "float64"])
    expect(dtypes == ["float64", "float64"], HINT_DTYPE.format(got=" and ".join(dict.fromkeys(dtypes))))
    expect(not (record["A_zero"] and record["B_zero"]), HINT_A_ZERO)
    expect(record["B_zero"], HINT_B_NOT_ZERO)
    expect(not record["base_trainable"], HINT_BASE_TRAINABLE)
    expect(record["A_trainable"] and record["B_trainable"], HINT_AB_FROZEN)
    want = _mistake_outputs(case)
    out = record["out"]
    if not _close(out, want["right"]):
        for name, hint in (("no scale", HINT_NO_SCALE), ("alpha only", HINT_ALPHA_ONLY), ("floor division", HINT_FLOOR_DIV)):
            expect(not _close(out, want[name]), hint)
        for act in ("ReLU", "GELU"):
            expect(not _close(out, want[act]), HINT_ACTIVATION.format(act=act))
        detail = f" (it returned {out})" if isinstance(out, str) else (
            f" (shape {out.shape}, expected {want['right'].shape})" if out.shape != want["right"].shape else
            f" (largest difference {np.abs(out - want['right']).max():.3g})")
        raise CheckFailure(HINT_FORWARD.format(detail=detail))
    expect(not record["forward_changed_W"], HINT_IN_PLACE.format(what="forward"))
    grads = record["grads"]
    expect(grads != "missing", HINT_GRADS.format(which="A and B"))
    for which, got, expected in zip(("A", "B"), grads, _grads(case)):
        expect(not isinstance(got, str), HINT_GRADS.format(which=which))
        expect(_close(got, expected, rtol=1e-5, atol=1e-7), HINT_GRADS_WRONG.format(which=which))
    merged = record["merged"]
    if not _close(merged, want["merged"]):
        expect(not (want["merged transposed"].size and _close(merged, want["merged transposed"])), HINT_MERGE_TRANSPOSED)
        if isinstance(merged, np.ndarray) and merged.shape == (d_in, d_out) and d_in != d_out:
            raise CheckFailure(HINT_MERGE_TRANSPOSED)
        expect(not _close(merged, want["merged no scale"]), HINT_MERGE_NO_SCALE)
        detail = f" (it returned {merged})" if isinstance(merged, str) else (
            f" (shape {merged.shape}, expected {want['merged'].shape})" if merged.shape != want["merged"].shape else "")
        raise CheckFailure(HINT_MERGE.format(detail=detail))
    expect(not record["merge_changed_W"], HINT_IN_PLACE.format(what="merged_weight"))
    for which, registered in zip(("A", "B"), record["registered"]):
        expect(registered, HINT_NOT_REGISTERED.format(which=which))
    for which, stored in zip(("A", "B"), record["in_state_dict"]):
        expect(stored, HINT_NOT_REGISTERED.format(which=which))
    expect(not record["trainable_base"], HINT_BASE_PART_TRAINABLE.format(names=" and ".join(record["trainable_base"])))
    expect(record["step_changed_B"], HINT_STEP)
    expect(not record.get("step_changed_base"), HINT_STEP_BASE)


def make_cases(rng: np.random.Generator) -> list[dict]:
    """Fresh cases: one wide, one square (where a transposed merge has the right shape), one with r = 1."""
    cases = []
    # The square case first: there a transposed merge has the right shape and gets its named hint.
    for d_in, d_out, r in ((6, 6, 2), (int(rng.integers(5, 9)), int(rng.integers(2, 5)), int(rng.integers(2, 4))),
                           (int(rng.integers(3, 7)), int(rng.integers(3, 7)), 1)):
        # alpha != r and alpha != 1: the scale shows; never a multiple of r: alpha // r differs from alpha / r
        alpha = float(rng.choice([4.0, 16.0]) * (1 + r)) + 0.5  # alpha // r >= 2: not the unscaled forward either
        cases.append({"d_in": d_in, "d_out": d_out, "r": r, "alpha": alpha, "seed": int(rng.integers(0, 1000)),
                      "W": rng.standard_normal((d_out, d_in)), "b": rng.standard_normal(d_out),
                      "A": rng.standard_normal((r, d_in)), "B": rng.standard_normal((d_out, r)),
                      "x": 2 * rng.standard_normal((2, 3, d_in)), "upstream": rng.standard_normal((2, 3, d_out))})
    return cases


def _refuse_peft(cls: Any) -> None:
    import tfedu.peft as peft

    if getattr(cls, "__module__", None) == "tfedu.peft" or (isinstance(cls, type) and issubclass(cls, peft.LoRALinear)):
        raise CheckFailure(HINT_SHORTCUT.format(name="you passed tfedu.peft's own LoRALinear"))
    functions = [getattr(cls, name) for name in ("__init__", "forward", "merged_weight") if hasattr(cls, name)]
    for fn in functions:
        scope = getattr(fn, "__globals__", {})
        used = sorted(n for n in global_names(fn) if n in scope and (scope[n] is peft or
                                                                      getattr(scope[n], "__module__", "") == "tfedu.peft"))
        expect(not used, HINT_SHORTCUT.format(name=", ".join(used)))


@checker("LoRA")
def check_lora(LoRA: Any) -> None:
    """Check the learner's LoRA class (exercise 13.1); see the module docstring for the mistakes it names."""
    if LoRA is None:
        raise ExerciseNotDone(HINT_NOT_DONE)
    _refuse_peft(LoRA)
    for case in make_cases(np.random.default_rng(13)):
        diagnose(lora_record(LoRA, case), case)
    print("✓ LoRA: B starts at zero, W_0 frozen, forward = W_0 x + (alpha / r) B A x, merged_weight = W_0 + (alpha / r) B A")


# ----------------------------------------------------------------------------- 13.2: a bottleneck adapter

# Run in the student's kernel (in the probe's run code) and, for the checker, here: one source.
ADAPTER_HELPERS = '''\
def _adapter_record(Adapter, case, dtype_name):
    """What a learner's Adapter does on one case in one dtype, as plain data (NumPy arrays, bools, strings)."""
    dtype = getattr(torch, dtype_name)
    d_model, bottleneck = int(case["d_model"]), int(case["bottleneck"])
    torch.manual_seed(int(case["seed"]))
    try:
        adapter = Adapter(d_model, bottleneck)
    except NotImplementedError:
        return {"status": "not done"}
    if not isinstance(adapter, torch.nn.Module):
        return {"status": "not a module", "got": type(adapter).__name__}
    adapter = adapter.to(dtype)  # as tfedu.peft.apply_adapters moves each adapter to the model's dtype
    plain = []  # tensors held as attributes (or in lists and dicts) but not registered with the module
    for module_name, module in adapter.named_modules():
        for name, value in vars(module).items():
            values = list(value.values()) if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            if not name.startswith("_") and any(isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)
                                                for v in values):
                plain.append(module_name + "." + name if module_name else name)
    params = dict(adapter.named_parameters())
    record = {"status": "ok", "plain": sorted(plain), "params": {name: list(p.shape) for name, p in params.items()}}
    expected = {"down.weight": [bottleneck, d_model], "down.bias": [bottleneck],
                "up.weight": [d_model, bottleneck], "up.bias": [d_model]}
    if record["params"] != expected:
        return record
    record["down_zero"] = bool((params["down.weight"].detach() == 0).all())
    record["up_weight_zero"] = bool((params["up.weight"].detach() == 0).all())
    record["up_bias_zero"] = bool((params["up.bias"].detach() == 0).all())
    y = torch.from_numpy(case["y"]).to(dtype)
    try:
        start = adapter(y)
    except NotImplementedError:
        return {"status": "not done"}
    if start is None:
        return {"status": "not done"}
    record["start_equal"] = (isinstance(start, torch.Tensor) and start.dtype == y.dtype
                             and torch.equal(start.detach(), y))
    with torch.no_grad():  # the reference's weights, up non-zero: now the bottleneck's path shows
        for name in expected:
            params[name].copy_(torch.from_numpy(case[name]).to(dtype))
    out = adapter(y)
    record["out"] = out.detach().double().numpy() if isinstance(out, torch.Tensor) else type(out).__name__
    record["out_dtype"] = str(out.dtype).replace("torch.", "") if isinstance(out, torch.Tensor) else ""
    # One SGD step over the trainable parameters of a fresh adapter: what training will do.
    torch.manual_seed(int(case["seed"]))
    fresh = Adapter(d_model, bottleneck).to(dtype)
    trainable = [p for p in fresh.parameters() if p.requires_grad]
    record["step"] = "no trainable parameters"
    if trainable:
        upstream = torch.from_numpy(case["upstream"]).to(dtype)
        with torch.no_grad():
            before = fresh(y).clone()
        optimizer = torch.optim.SGD(trainable, lr=0.1)
        optimizer.zero_grad()
        loss = (fresh(y) * upstream).sum()
        if loss.requires_grad:
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            record["step"] = "unchanged" if torch.equal(fresh(y), before) else "changed"
    return record


'''
ADAPTER_CLEANUP = "del _adapter_record\n"
exec(compile(ADAPTER_HELPERS, "<adapter probe helpers>", "exec"), _helpers)
adapter_record = _helpers["_adapter_record"]
DTYPES = ("float64", "float32")

HINT_AD_SHORTCUT = "your Adapter uses tfedu.peft ({name}): the adapter is the exercise itself, so build it from torch"
HINT_AD_NOT_A_MODULE = "Adapter(d_model, bottleneck) should build an nn.Module, got {got}"
HINT_AD_NOT_REGISTERED = (
    "your adapter keeps {names} as plain tensors, not as parameters of the module: adapter.parameters() and "
    "state_dict() do not list them, so an optimizer built from model.parameters() never trains them, .to() never "
    "moves them and a checkpoint loses them. Make down and up nn.Linear layers assigned as attributes"
)
HINT_AD_SWAPPED = (
    "your down.weight is {down} and up.weight is {up} for d_model = {d_model}, bottleneck = {bottleneck}: down maps "
    "d_model features to bottleneck ones, and a linear layer stores its weight as (out, in), so down.weight is "
    "(bottleneck, d_model) and up.weight is (d_model, bottleneck). Keeping them as (in, out) is the habit of "
    "GPT-2's Conv1D, not of nn.Linear"
)
HINT_AD_NO_BIAS = (
    "your adapter has no {which}: Houlsby et al.'s down and up projections are full linear layers, weight and "
    "bias (the reference Adapter has down.bias and up.bias), so keep the bias of both"
)
HINT_AD_NAMES = (
    "the adapter's parameters should be those of two linear layers named down (d_model to bottleneck) and up "
    "(bottleneck back to d_model): down.weight {bd}, down.bias {b}, up.weight {db}, up.bias {d}; yours are {got}"
)
HINT_AD_NO_RESIDUAL = (
    "your forward returns only the bottleneck's output, up(act(down(h))): the adapter keeps its own skip "
    "connection and adds that output to h. Without it the adapter replaces the sublayer's output with what "
    "squeezes through its {bottleneck}-wide bottleneck, and at the start (up = 0) it outputs zeros instead of passing h through"
)
HINT_AD_NO_ACTIVATION = (
    "your forward has no nonlinearity between down and up: then up(down(h)) is one low-rank linear map, "
    "the same kind of update as LoRA's B A, only placed after the sublayer and with biases. The adapter's "
    "bottleneck is a small MLP: GELU sits between the two projections, like in the feed-forward layer"
)
HINT_AD_ACTIVATION_AFTER = (
    "your forward applies the GELU after the up-projection: the nonlinearity belongs in the bottleneck, between "
    "down and up, and the up-projection's output is added to h as it is"
)
HINT_AD_RELU = (
    "your forward uses ReLU between down and up: the reference adapter uses GELU (the activation of this "
    "course's feed-forward layers), so that your adapter can take its place"
)
HINT_AD_TANH_GELU = (
    "your forward uses the tanh approximation of GELU: the reference adapter uses the exact GELU, with the error "
    "function (the default of PyTorch's GELU)"
)
HINT_AD_FORWARD = "your forward does not give h + up(gelu(down(h))) with up and down the linear layers{detail}"
HINT_AD_DTYPE = (
    "your forward returned {got} for a {dtype} input and a {dtype} adapter: keep the input's dtype (no fixed "
    "float32 inside), so the adapter works in whatever dtype the model runs"
)
HINT_AD_DOWN_ZERO = (
    "your down-projection's weight is zero at the start as well as up's: then the bottleneck sees nothing, up's "
    "weight gets no gradient (it multiplies down's zero output) and down's gets none either (it passes through "
    "up's zeros); only up's bias ever learns. Only up starts at zero; down starts random, as a linear layer does"
)
HINT_AD_UP_NOT_ZERO = (
    "your up-projection is not zero at the start: then the adapted model is not the pretrained model before "
    "training (every block's output gets random noise added). Set up's weight and its bias to zero after "
    "creating it, as Houlsby et al. start near the identity; tfedu starts exactly at it"
)
HINT_AD_UP_BIAS = (
    "your up-projection's weight starts at zero but its bias does not (a new linear layer's bias is random): the "
    "adapter then adds a constant vector to every position, and the model is not the base model at step 0. "
    "Zero up's bias too"
)
HINT_AD_START = (
    "your adapter does not return its input unchanged at the start (up = 0): then the adapted model is not the "
    "base model before training{detail}"
)
HINT_AD_STEP = (
    "one optimizer step over your adapter's trainable parameters changed nothing: the adapter does not learn. "
    "Its down and up layers must be trainable parameters of the module, and the forward must not detach them or "
    "run under torch.no_grad(){detail}"
)

_TOL = {"float64": (1e-9, 1e-11), "float32": (1e-5, 1e-5)}  # (rtol, atol): a float32 forward differs by ~1e-6


def _adapter_outputs(case: dict) -> dict[str, np.ndarray]:
    """The reference forward and the named mistakes' forwards, in float64, with the case's weights."""
    y, W_down, b_down, W_up, b_up = (torch.from_numpy(case[k]) for k in
                                     ("y", "down.weight", "down.bias", "up.weight", "up.bias"))
    gelu = torch.nn.functional.gelu
    hidden = y @ W_down.T + b_down  # (..., bottleneck)

    def up(z):
        return z @ W_up.T + b_up

    return {k: v.numpy() for k, v in {
        "right": y + up(gelu(hidden)), "no residual": up(gelu(hidden)), "no activation": y + up(hidden),
        "activation after": y + gelu(up(hidden)), "ReLU": y + up(torch.relu(hidden)),
        "tanh GELU": y + up(gelu(hidden, approximate="tanh"))}.items()}


def diagnose_adapter(record: dict, case: dict, dtype: str) -> None:
    """Raise CheckFailure naming what is wrong with one record of ``_adapter_record``; return when it is right."""
    if record["status"] == "not done":
        raise ExerciseNotDone(HINT_NOT_DONE)
    if record["status"] == "not a module":
        raise CheckFailure(HINT_AD_NOT_A_MODULE.format(got=record["got"]))
    d, b = case["d_model"], case["bottleneck"]
    params = record["params"]
    expected = {"down.weight": [b, d], "down.bias": [b], "up.weight": [d, b], "up.bias": [d]}
    if params != expected:
        if record["plain"]:
            raise CheckFailure(HINT_AD_NOT_REGISTERED.format(names=", ".join(record["plain"])))
        if params.get("down.weight") == [d, b] and params.get("up.weight") == [b, d]:
            raise CheckFailure(HINT_AD_SWAPPED.format(down=tuple(params["down.weight"]), up=tuple(params["up.weight"]),
                                                      d_model=d, bottleneck=b))
        weights = {k: v for k, v in expected.items() if k.endswith("weight")}
        if all(params.get(k) == v for k, v in weights.items()):
            missing = [k for k in ("down.bias", "up.bias") if k not in params]
            expect(not missing, HINT_AD_NO_BIAS.format(which=" or ".join(missing)))
        got = ", ".join(f"{k} {tuple(v)}" for k, v in params.items()) or "none"
        raise CheckFailure(HINT_AD_NAMES.format(bd=(b, d), b=(b,), db=(d, b), d=(d,), got=got))
    want = _adapter_outputs(case)
    rtol, atol = _TOL[dtype]
    out = record["out"]
    if isinstance(out, np.ndarray) and out.shape == want["right"].shape:
        expect(record["out_dtype"] == dtype, HINT_AD_DTYPE.format(got=record["out_dtype"], dtype=dtype))
    if not _close(out, want["right"], rtol=rtol, atol=atol):
        for name, hint in (("no residual", HINT_AD_NO_RESIDUAL.format(bottleneck=b)),
                           ("no activation", HINT_AD_NO_ACTIVATION), ("activation after", HINT_AD_ACTIVATION_AFTER),
                           ("ReLU", HINT_AD_RELU), ("tanh GELU", HINT_AD_TANH_GELU)):
            expect(not _close(out, want[name], rtol=rtol, atol=atol), hint)
        detail = f" (it returned {out})" if isinstance(out, str) else (
            f" (shape {out.shape}, expected {want['right'].shape})" if out.shape != want["right"].shape else
            f" (largest difference {np.abs(out - want['right']).max():.3g}, in {dtype})")
        raise CheckFailure(HINT_AD_FORWARD.format(detail=detail))
    expect(not record["down_zero"], HINT_AD_DOWN_ZERO)
    if not record["start_equal"]:
        expect(not (record["up_weight_zero"] and not record["up_bias_zero"]), HINT_AD_UP_BIAS)
        expect(record["up_weight_zero"], HINT_AD_UP_NOT_ZERO)
        raise CheckFailure(HINT_AD_START.format(detail=f" (in {dtype})"))
    expect(record["step"] == "changed", HINT_AD_STEP.format(
        detail=" (it has no trainable parameter)" if record["step"] == "no trainable parameters" else ""))


def make_adapter_cases(rng: np.random.Generator) -> list[dict]:
    """Fresh cases, the bottleneck always narrower than d_model (so down and up in each other's shapes show)."""
    cases = []
    for d_model, bottleneck in ((int(rng.integers(6, 11)), int(rng.integers(2, 5))), (int(rng.integers(4, 8)), 1)):
        case = {"d_model": d_model, "bottleneck": bottleneck, "seed": int(rng.integers(0, 1000)),
                "y": 2 * rng.standard_normal((2, 3, d_model)), "upstream": rng.standard_normal((2, 3, d_model))}
        # up non-zero here (the trained adapter's weights), so the bottleneck's path shows in the output
        for name, shape in (("down.weight", (bottleneck, d_model)), ("down.bias", (bottleneck,)),
                            ("up.weight", (d_model, bottleneck)), ("up.bias", (d_model,))):
            case[name] = rng.standard_normal(shape)
        cases.append(case)
    return cases


def _refuse_peft_adapter(cls: Any) -> None:
    import tfedu.peft as peft

    if getattr(cls, "__module__", None) == "tfedu.peft" or (isinstance(cls, type) and issubclass(cls, peft.Adapter)):
        raise CheckFailure(HINT_AD_SHORTCUT.format(name="you passed tfedu.peft's own Adapter"))
    for fn in [getattr(cls, name) for name in ("__init__", "forward") if hasattr(cls, name)]:
        scope = getattr(fn, "__globals__", {})
        used = sorted(n for n in global_names(fn) if n in scope and (scope[n] is peft or
                                                                      getattr(scope[n], "__module__", "") == "tfedu.peft"))
        expect(not used, HINT_AD_SHORTCUT.format(name=", ".join(used)))


@checker("Adapter")
def check_adapter(Adapter: Any) -> None:
    """Check the learner's Adapter class (exercise 13.2); see the module docstring for the mistakes it names."""
    if Adapter is None:
        raise ExerciseNotDone(HINT_NOT_DONE)
    _refuse_peft_adapter(Adapter)
    for case in make_adapter_cases(np.random.default_rng(1302)):
        for dtype in DTYPES:
            diagnose_adapter(adapter_record(Adapter, case, dtype), case, dtype)
    print("✓ Adapter: h + up(gelu(down(h))), up zero so it starts as the identity, its parameters train "
          "(float32 and float64)")


# ----------------------------------------------------------------------------- 13.3: prefix attention

# Run in the student's kernel (in the probe's run code) and, for the checker, here: one source.
PREFIX_HELPERS = '''\
class _PrefixLayer(torch.nn.Module):
    """One attention layer's weights, laid out as exercise 5.3's: W_Q, W_K, W_V, W_O (nn.Linear), n_heads, d_head."""

    def __init__(self, case, dtype):
        super().__init__()
        self.d_model, self.n_heads, self.d_head = int(case["d_model"]), int(case["n_heads"]), int(case["d_head"])
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            linear = torch.nn.Linear(self.d_model, self.d_model).to(dtype)
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(case[name + ".weight"]))
                linear.bias.copy_(torch.from_numpy(case[name + ".bias"]))
            linear.requires_grad_(False)
            self.add_module(name, linear)

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer holds only its weights: prefix_attention computes the attention itself, "
                           "from W_Q, W_K, W_V and W_O")


def _prefix_record(prefix_attention, case, dtype_name):
    """What a learner's prefix_attention does on one case in one dtype, as plain data."""
    dtype = getattr(torch, dtype_name)
    layer = _PrefixLayer(case, dtype)
    x = torch.from_numpy(case["x"]).to(dtype).clone()  # copies: the case's arrays stay as drawn, whatever the answer does
    keys = torch.from_numpy(case["prefix_k"]).to(dtype).clone().requires_grad_()
    values = torch.from_numpy(case["prefix_v"]).to(dtype).clone().requires_grad_()
    try:
        out = prefix_attention(x, layer, keys, values)
    except NotImplementedError:
        return {"status": "not done"}
    except Exception as err:
        return {"status": "raised", "error": type(err).__name__ + ": " + str(err)[:300]}
    if out is None:
        return {"status": "not done"}
    if not isinstance(out, torch.Tensor):
        return {"status": "not a tensor", "got": type(out).__name__}
    record = {"status": "ok", "shape": list(out.shape), "dtype": str(out.dtype).replace("torch.", ""),
              "out": out.detach().double().numpy(), "grads": "missing"}
    if out.requires_grad and tuple(out.shape) == tuple(x.shape) and out.is_floating_point():
        upstream = torch.from_numpy(case["upstream"]).to(out.dtype)
        grads = torch.autograd.grad((out * upstream).sum(), [keys, values], allow_unused=True)
        record["grads"] = ["none" if g is None else g.double().numpy() for g in grads]
    return record


'''
PREFIX_CLEANUP = "del _PrefixLayer, _prefix_record\n"
exec(compile(PREFIX_HELPERS, "<prefix probe helpers>", "exec"), _helpers)
prefix_record = _helpers["_prefix_record"]

# The learner's prefix_attention calls their masked_attention of exercise 5.2 (notebook 05, brought in with
# tfedu.use_mine). While 13.3 is checked and graded, this stand-in takes its place, so a slip in 5.2 costs 5.2
# alone; it also says in words which of its arguments disagree, which names two of the prefix's slips.
# Primitive ops only (no tfedu).
MASKED_ATTENTION_STANDIN = """\
def masked_attention(q, k, v, mask):
    \"\"\"Stand-in for exercise 5.2: softmax(q k^T / sqrt(d_k), -inf where mask is False) v, returning (output, weights).\"\"\"
    if k.shape[-2] > v.shape[-2]:
        raise ValueError(f"masked_attention got more keys ({k.shape[-2]}) than values ({v.shape[-2]}): every key needs its value")
    if k.shape[-2] < v.shape[-2]:
        raise ValueError(f"masked_attention got more values ({v.shape[-2]}) than keys ({k.shape[-2]}): every value needs its key")
    if mask.shape[-1] not in (1, k.shape[-2]):
        raise ValueError(f"masked_attention got a mask with {mask.shape[-1]} key columns for {k.shape[-2]} keys")
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights
"""
_standin_scope: dict[str, Any] = {"torch": torch, "math": math, "__name__": "tfedu_standins"}
exec(compile(MASKED_ATTENTION_STANDIN, "<stand-in for exercise 5.2>", "exec"), _standin_scope)
standin_masked_attention = _standin_scope["masked_attention"]


def reference_parts() -> dict[str, Any]:
    """The earlier notebooks' parts notebook 13 brings in with ``tfedu.use_mine`` (a switch cell, not a solution
    cell), as references under the names the notebook gives them: what the notebook holds with TFEDU_MY_PARTS off."""
    from tfedu import attention as tfa

    return {"masked_attention": tfa.scaled_dot_product_attention}

HINT_PF_SHORTCUT = (
    "your prefix_attention uses {name}: tfedu's attention layers already run a prefix, which is the exercise itself; "
    "build it from the layer's W_Q, W_K, W_V and W_O and your masked_attention"
)
HINT_PF_NOT_A_TENSOR = "prefix_attention should return one tensor (batch, pos, d_model), got {got}"
HINT_PF_QUERIES = (
    "your output has {got} positions for {n} tokens and a prefix of {p}: the prefix went in front of the queries "
    "too. The prefix is only keys and values that every query can read; the queries are the tokens' own, so the "
    "output keeps one row per token, (batch, pos, d_model)"
)
HINT_PF_SHAPE = "your output is {got}, expected {want}: one d_model-vector per token, as the layer's input"
HINT_PF_DTYPE = "your output is {got} for a {dtype} input: keep the input's dtype (no fixed dtype inside)"
HINT_PF_VALUES = (
    "the prefix went in front of the keys but not of the values: masked_attention got more keys than values. "
    "Prefix tuning learns both, a key that decides how much attention a position gets and a value that says what "
    "it then contributes; prepend prefix_v to the values as prefix_k to the keys"
)
HINT_PF_KEYS = (
    "the prefix went in front of the values but not of the keys: masked_attention got more values than keys. "
    "Prepend prefix_k to the keys as prefix_v to the values"
)
HINT_PF_MASK = (
    "the mask was not extended for the prefix: masked_attention got a mask with one column per token, but the "
    "keys are n_prefix + pos long. The causal mask covers the tokens; in front of it goes one column per prefix "
    "position, all True, since every query may read the whole prefix"
)
HINT_PF_RAISED = (
    "your prefix_attention raised {error}. The keys and the values each get the prefix in front, n_prefix + pos "
    "positions along the key axis, for every sequence of the batch (the prefix has no batch axis of its own), "
    "and the mask needs one column per key"
)
HINT_PF_PREFIX_MASKED = (
    "the causal mask hides the prefix: with it laid over all n_prefix + pos keys from the first column, query i "
    "sees only the first i + 1 keys, so the first query reads one prefix position and nothing of itself. The "
    "prefix comes before every token: each query sees all of it, then the tokens up to its own"
)
HINT_PF_NO_CAUSAL = (
    "your tokens see later tokens: the causal mask is missing among the real tokens. Every query sees the whole "
    "prefix and the tokens up to and including its own, never a later one"
)
HINT_PF_IGNORED = (
    "your output is plain causal attention with no prefix at all: the prefix's keys and values never reach the "
    "softmax (or the mask hides every prefix column)"
)
HINT_PF_AFTER = (
    "your prefix sits after the tokens: the keys were built as the tokens' followed by the prefix, and the mask "
    "then lines up with the wrong columns (some queries see later tokens, some lose part of the prefix). "
    "Prefix tuning puts the learned keys and values in front, before the first token"
)
HINT_PF_SHARED = (
    "every head reads the same prefix, the first head's: the prefix is learned per head, (n_heads, n_prefix, "
    "d_head), and head h's keys and values get head h's prefix"
)
HINT_PF_SCRAMBLED = (
    "the prefix's heads are scrambled: (n_heads, n_prefix, d_head) was reshaped into (n_prefix, d_model) without "
    "first moving the head axis behind the positions, so head h reads pieces of other heads' prefixes. Either "
    "prepend the prefix after the keys are split into heads (its layout is already theirs), or move its axes "
    "before flattening it"
)
HINT_PF_KEYS_AS_VALUES = (
    "the values' prefix is prefix_k: the learned keys were prepended to the values too. The values get prefix_v"
)
HINT_PF_SCALE_D_MODEL = (
    "the scores are divided by sqrt(d_model): each head compares d_head-wide queries and keys, so the scale is "
    "1 / sqrt(d_head), the same for the prefix's keys and the tokens'"
)
HINT_PF_NO_SCALE = "the scores are not scaled: divide them by sqrt(d_head) (masked_attention does this for you)"
HINT_PF_FORWARD = (
    "your output is not the causal attention of the layer with the prefix in front of its keys and values{detail}"
)
HINT_PF_NO_GRAD = (
    "no gradient reaches prefix_k and prefix_v through your output: the prefix is all that prefix tuning trains. "
    "Do not detach it, copy it into a new tensor or compute under torch.no_grad()"
)
HINT_PF_GRAD_WRONG = "the gradient to {which} is not that of the attention with the prefix in front"

PREFIX_DTYPES = ("float64", "float64", "float32")  # the course GPT runs float32; float64 makes the variants exact
PREFIX_MISTAKES = {  # the named slips the checker recognises by their output, with their hints
    "prefix masked": HINT_PF_PREFIX_MASKED,
    "no causal": HINT_PF_NO_CAUSAL,
    "prefix ignored": HINT_PF_IGNORED,
    "after, end-aligned mask": HINT_PF_AFTER,
    "after, front mask": HINT_PF_AFTER,
    "shared across heads": HINT_PF_SHARED,
    "heads scrambled": HINT_PF_SCRAMBLED,
    "keys as values": HINT_PF_KEYS_AS_VALUES,
    "scale d_model": HINT_PF_SCALE_D_MODEL,
    "no scale": HINT_PF_NO_SCALE,
}


def prefix_variant(case: dict, mistake: str = "", *, keys: torch.Tensor | None = None,
                   values: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's causal self-attention with the case's prefix in front (``mistake=""``) or with one named slip.

    Float64, by hand; ``keys`` and ``values`` (default: the case's prefix) may be leaves that require grad.
    """
    x = torch.from_numpy(case["x"]).double()
    batch, n, d_model = x.shape
    h, d = int(case["n_heads"]), int(case["d_head"])
    pk = torch.from_numpy(case["prefix_k"]).double() if keys is None else keys
    pv = torch.from_numpy(case["prefix_v"]).double() if values is None else values
    p = pk.shape[1]

    def project(name: str) -> torch.Tensor:  # batch n_heads pos d_head
        W, b = (torch.from_numpy(case[f"{name}.{k}"]).double() for k in ("weight", "bias"))
        return (x @ W.T + b).unflatten(-1, (h, d)).transpose(1, 2)

    q, k, v = project("W_Q"), project("W_K"), project("W_V")
    if mistake == "shared across heads":
        pk, pv = pk[:1].expand(h, -1, -1), pv[:1].expand(h, -1, -1)
    elif mistake == "heads scrambled":
        pk, pv = pk.reshape(p, h, d).transpose(0, 1), pv.reshape(p, h, d).transpose(0, 1)
    elif mistake == "keys as values":
        pv = pk
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    front = torch.cat([torch.ones(n, p, dtype=torch.bool), causal], dim=1)  # the prefix's columns, then the tokens'
    if mistake == "prefix ignored":
        keys_all, values_all, mask = k, v, causal
    elif mistake.startswith("after"):
        keys_all = torch.cat([k, pk.expand(batch, -1, -1, -1)], dim=2)
        values_all = torch.cat([v, pv.expand(batch, -1, -1, -1)], dim=2)
        mask = torch.ones(n, n + p, dtype=torch.bool).tril(diagonal=p) if mistake == "after, end-aligned mask" else front
    else:
        keys_all = torch.cat([pk.expand(batch, -1, -1, -1), k], dim=2)
        values_all = torch.cat([pv.expand(batch, -1, -1, -1), v], dim=2)
        mask = {"prefix masked": torch.ones(n, p + n, dtype=torch.bool).tril(),
                "no causal": torch.ones(n, p + n, dtype=torch.bool)}.get(mistake, front)
    scale = {"scale d_model": math.sqrt(d_model), "no scale": 1.0}.get(mistake, math.sqrt(d))
    scores = (q @ keys_all.transpose(-2, -1) / scale).masked_fill(~mask, float("-inf"))
    z = torch.softmax(scores, dim=-1) @ values_all  # batch n_heads pos d_head
    W_O, b_O = (torch.from_numpy(case[f"W_O.{k}"]).double() for k in ("weight", "bias"))
    return z.transpose(1, 2).flatten(2) @ W_O.T + b_O


class _GivenPrefix(torch.nn.Module):
    """A prefix module (as ``tfedu.peft.Prefix``) that returns given keys and values."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values


def reference_prefix_attention(x: torch.Tensor, attn: Any, prefix_k: torch.Tensor, prefix_v: torch.Tensor) -> torch.Tensor:
    """What ``tfedu.peft``'s prefix computes: a ``tfedu.layers.Attention`` with ``attn``'s weights and this prefix, causal."""
    from tfedu.layers import Attention

    layer = Attention(attn.d_model, attn.n_heads, impl="manual").to(x.dtype)
    layer.load_state_dict({name: p for name, p in attn.state_dict().items() if name.split(".")[0] in
                           ("W_Q", "W_K", "W_V", "W_O")})
    layer.prefix = _GivenPrefix(prefix_k, prefix_v)
    return layer(x, causal=True)


def prefix_reference(case: dict) -> dict[str, np.ndarray]:
    """The reference output (tfedu.layers.Attention with the prefix) and its gradients to the prefix, float64."""
    layer = _helpers["_PrefixLayer"](case, torch.float64)
    keys = torch.from_numpy(case["prefix_k"]).double().requires_grad_()
    values = torch.from_numpy(case["prefix_v"]).double().requires_grad_()
    out = reference_prefix_attention(torch.from_numpy(case["x"]).double(), layer, keys, values)
    grads = torch.autograd.grad((out * torch.from_numpy(case["upstream"])).sum(), [keys, values])
    return {"out": out.detach().numpy(), "grads": [g.numpy() for g in grads]}


def diagnose_prefix(record: dict, case: dict, dtype: str, reference: dict | None = None) -> None:
    """Raise CheckFailure naming what is wrong with one record of ``_prefix_record``; return when it is right."""
    status = record.get("status")
    if status == "not done":
        raise ExerciseNotDone(HINT_NOT_DONE)
    if status == "raised":
        error = record["error"]
        for phrase, hint in (("more keys", HINT_PF_VALUES), ("more values", HINT_PF_KEYS), ("key columns", HINT_PF_MASK)):
            expect(phrase not in error, hint)
        raise CheckFailure(HINT_PF_RAISED.format(error=error))
    if status == "not a tensor":
        raise CheckFailure(HINT_PF_NOT_A_TENSOR.format(got=record["got"]))
    batch, n, d_model = case["x"].shape
    p = case["prefix_k"].shape[1]
    shape = record["shape"]
    expect(not (len(shape) == 3 and shape[1] == n + p and shape[1] != n),
           HINT_PF_QUERIES.format(got=shape[1] if len(shape) == 3 else "?", n=n, p=p))
    expect(shape == [batch, n, d_model], HINT_PF_SHAPE.format(got=tuple(shape), want=(batch, n, d_model)))
    expect(record["dtype"] == dtype, HINT_PF_DTYPE.format(got=record["dtype"], dtype=dtype))
    reference = reference if reference is not None else prefix_reference(case)
    rtol, atol = _TOL[dtype]
    out = record["out"]
    if not _close(out, reference["out"], rtol=rtol, atol=atol):
        for mistake, hint in PREFIX_MISTAKES.items():
            expect(not _close(out, prefix_variant(case, mistake).numpy(), rtol=rtol, atol=atol), hint)
        worst = np.nan_to_num(np.abs(out - reference["out"]), nan=np.inf).max()
        raise CheckFailure(HINT_PF_FORWARD.format(detail=f" (largest difference {worst:.3g}, in {dtype}, with "
                                                         f"n_heads={case['n_heads']}, n_prefix={p}, pos={n})"))
    grads = record["grads"]
    expect(grads != "missing" and not all(isinstance(g, str) for g in grads), HINT_PF_NO_GRAD)
    for which, got, want in zip(("prefix_k", "prefix_v"), grads, reference["grads"]):
        expect(not isinstance(got, str), HINT_PF_NO_GRAD)
        expect(_close(got, want, rtol=100 * rtol, atol=100 * atol), HINT_PF_GRAD_WRONG.format(which=which))


def make_prefix_cases(rng: np.random.Generator) -> list[dict]:
    """Fresh cases: two or three heads, a prefix of 2 to 4 positions, 3 to 6 tokens, a batch of two."""
    cases = []
    for dtype in PREFIX_DTYPES:
        n_heads, d_head = int(rng.integers(2, 4)), int(rng.integers(2, 5))
        n, p = int(rng.integers(3, 7)), int(rng.integers(2, 5))
        d_model = n_heads * d_head
        case = {"dtype": dtype, "n_heads": n_heads, "d_head": d_head, "d_model": d_model,
                "x": rng.standard_normal((2, n, d_model)), "upstream": rng.standard_normal((2, n, d_model)),
                "prefix_k": rng.standard_normal((n_heads, p, d_head)),
                "prefix_v": rng.standard_normal((n_heads, p, d_head))}
        for name in ("W_Q", "W_K", "W_V", "W_O"):  # queries and keys of unit size: the softmax is neither flat nor one-hot
            case[name + ".weight"] = rng.standard_normal((d_model, d_model)) / math.sqrt(d_model)
            case[name + ".bias"] = 0.1 * rng.standard_normal(d_model)
        cases.append(case)
    return cases


def _refuse_prefix_shortcut(fn: Any) -> None:
    import tfedu.layers
    import tfedu.peft

    if getattr(fn, "__module__", None) in ("tfedu.peft", "tfedu.layers"):
        raise CheckFailure(HINT_PF_SHORTCUT.format(name=f"{fn.__module__}'s own code"))
    scope = getattr(fn, "__globals__", {})
    used = sorted(n for n in global_names(fn) if n in scope and (
        scope[n] in (tfedu.peft, tfedu.layers) or getattr(scope[n], "__module__", "") in ("tfedu.peft", "tfedu.layers")))
    expect(not used, HINT_PF_SHORTCUT.format(name=", ".join(used)))


@checker("prefix_attention")
def check_prefix_attention(prefix_attention: Any) -> None:
    """Check the learner's ``prefix_attention(x, attn, prefix_k, prefix_v)`` (exercise 13.3); see the module docstring.

    While it runs, a correct masked_attention stands in for the learner's (exercise 5.2, from notebook 05).
    """
    if prefix_attention is None:
        raise ExerciseNotDone(HINT_NOT_DONE)
    if not callable(prefix_attention):
        raise CheckFailure(f"prefix_attention should be a function, got {type(prefix_attention).__name__}")
    _refuse_prefix_shortcut(prefix_attention)
    namespace = getattr(prefix_attention, "__globals__", None)
    standins = {"masked_attention": standin_masked_attention} if isinstance(namespace, dict) else {}
    with names_bound(namespace if standins else {}, standins):
        for case in make_prefix_cases(np.random.default_rng(1303)):
            diagnose_prefix(prefix_record(prefix_attention, case, case["dtype"]), case, case["dtype"])
    print("✓ prefix_attention: every query reads the whole prefix and the tokens up to its own, per head, equal to "
          "tfedu's prefix on tfedu.layers.Attention; the prefix gets its gradients")


# ----------------------------------------------------------------------------- the hidden test

LORA_PROBE_RUN = HELPERS + LORA_HELPERS + """\
outputs = {'records': [_lora_record(LoRA, _c) for _c in inputs['cases']]}
""" + LORA_CLEANUP + CLEANUP


def _lora_probe_inputs(rng: np.random.Generator) -> dict:
    return {"cases": make_cases(rng)}


def _lora_probe_reference(inputs: dict) -> dict:
    return {"cases": inputs["cases"]}


def _compare_lora(outputs: dict, expected: dict) -> str | None:
    records = outputs.get("records") if isinstance(outputs, dict) else None
    if not isinstance(records, list) or len(records) != len(expected["cases"]):
        return "LoRA's hidden test did not run every case"
    for i, (record, case) in enumerate(zip(records, expected["cases"])):
        try:
            diagnose(record, case)
        except CheckFailure as failure:
            return f"hidden test {i + 1} (d_in={case['d_in']}, d_out={case['d_out']}, r={case['r']}): {failure}"
    return None


ADAPTER_PROBE_RUN = HELPERS + ADAPTER_HELPERS + """\
outputs = {'records': [[_adapter_record(Adapter, _c, _d) for _d in ('float64', 'float32')] for _c in inputs['cases']]}
""" + ADAPTER_CLEANUP + CLEANUP


def _adapter_probe_inputs(rng: np.random.Generator) -> dict:
    return {"cases": make_adapter_cases(rng)}


def _compare_adapter(outputs: dict, expected: dict) -> str | None:
    records = outputs.get("records") if isinstance(outputs, dict) else None
    if not isinstance(records, list) or len(records) != len(expected["cases"]):
        return "Adapter's hidden test did not run every case"
    for i, (pair, case) in enumerate(zip(records, expected["cases"])):
        if not isinstance(pair, list) or len(pair) != len(DTYPES):
            return "Adapter's hidden test did not run every case"
        for record, dtype in zip(pair, DTYPES):
            try:
                diagnose_adapter(record, case, dtype)
            except CheckFailure as failure:
                sizes = f"d_model={case['d_model']}, bottleneck={case['bottleneck']}, {dtype}"
                return f"hidden test {i + 1} ({sizes}): {failure}"
    return None


PREFIX_PROBE_RUN = HELPERS + PREFIX_HELPERS + """\
outputs = {'records': [_prefix_record(prefix_attention, _c, _c['dtype']) for _c in inputs['cases']]}
""" + PREFIX_CLEANUP + CLEANUP


def _prefix_probe_inputs(rng: np.random.Generator) -> dict:
    return {"cases": make_prefix_cases(rng)}


def _prefix_probe_reference(inputs: dict) -> dict:
    return {"cases": inputs["cases"], "references": [prefix_reference(case) for case in inputs["cases"]]}


def _compare_prefix(outputs: dict, expected: dict) -> str | None:
    records = outputs.get("records") if isinstance(outputs, dict) else None
    if not isinstance(records, list) or len(records) != len(expected["cases"]):
        return "prefix_attention's hidden test did not run every case"
    for i, (record, case, reference) in enumerate(zip(records, expected["cases"], expected["references"])):
        try:
            diagnose_prefix(record, case, case["dtype"], reference)
        except CheckFailure as failure:
            sizes = (f"n_heads={case['n_heads']}, d_head={case['d_head']}, n_prefix={case['prefix_k'].shape[1]}, "
                     f"pos={case['x'].shape[1]}, {case['dtype']}")
            return f"hidden test {i + 1} ({sizes}): {failure}"
    return None


PROBES = {
    "check_lora": Probe(exercise="ex_lora", make_inputs=_lora_probe_inputs, run=LORA_PROBE_RUN,
                        reference=_lora_probe_reference, compare=_compare_lora, forbidden=FORBIDDEN,
                        builds=ELEMENTARY | MODULES),
    "check_adapter": Probe(exercise="ex_adapter", make_inputs=_adapter_probe_inputs, run=ADAPTER_PROBE_RUN,
                           reference=_lora_probe_reference, compare=_compare_adapter, forbidden=FORBIDDEN,
                           builds=ELEMENTARY | MODULES | ACTIVATIONS | frozenset({"torch.nn.GELU"})),
    "check_prefix_attention": Probe(exercise="ex_prefix_attention", make_inputs=_prefix_probe_inputs, run=PREFIX_PROBE_RUN,
                                    reference=_prefix_probe_reference, compare=_compare_prefix, forbidden=FORBIDDEN_PREFIX,
                                    builds=ELEMENTARY | SOFTMAX | EINOPS | MODULES, standins=MASKED_ATTENTION_STANDIN),
}


HINTS = {
    "ex_lora": Hints(
        number="13.1",
        check="check_lora",
        idea=(
            "LoRA leaves the pretrained layer W_0 untouched and frozen, and learns only a low-rank change beside "
            "it: A squeezes the d_in input features down to r numbers, B expands them back to d_out, and nothing "
            "nonlinear sits between them, so B A is one linear map that can later be added into W_0. B starts at "
            "zero, so at step 0 the wrapped layer is exactly the pretrained one; A starts random, because if both "
            "were zero neither would ever get a gradient. The update is scaled by alpha / r."
        ),
        approach=(
            "In __init__, keep base and the scale alpha / r, and switch off requires_grad on every parameter of "
            "base (the bias too). A is an nn.Parameter of shape (r, d_in) with a random start (nn.init has the "
            "Kaiming-uniform that nn.Linear uses); B an nn.Parameter of shape (d_out, r) full of zeros; both in "
            "base.weight's dtype (d_in and d_out are the base layer's in_features and out_features). In forward, "
            "x is (..., d_in): base(x), plus alpha / r times x sent through A, giving (..., r), and then through B, "
            "giving (..., d_out); the weights are stored (out, in), so multiply x by their transposes. "
            "merged_weight is W_0 plus alpha / r times B @ A, a new (d_out, d_in) tensor; nothing writes into base."
        ),
        skeleton=(
            "class LoRA(nn.Module):\n"
            "    def __init__(self, base, r, alpha):\n"
            "        super().__init__()\n"
            "        self.base = base\n"
            "        self.scale = ____  # the factor on the low-rank update\n"
            "        for p in ____:\n"
            "            ____  # freeze W_0 and its bias\n"
            "        self.A = nn.Parameter(torch.empty(____, ____, dtype=base.weight.dtype))  # (r, d_in)\n"
            "        ____  # a random start for A, like nn.Linear's weight\n"
            "        self.B = nn.Parameter(____)  # (d_out, r): what must B be at step 0?\n"
            "\n"
            "    def forward(self, x):\n"
            "        return self.base(x) + ____  # (..., d_out): x through A, then B, scaled; no activation between\n"
            "\n"
            "    def merged_weight(self):\n"
            "        return ____  # (d_out, d_in): W_0 plus the scaled B @ A, as a new tensor\n"
        ),
    ),
    "ex_adapter": Hints(
        number="13.2",
        check="check_adapter",
        idea=(
            "A bottleneck adapter is a tiny MLP placed after a frozen sublayer, with its own skip connection: it "
            "squeezes the sublayer's output h from d_model features down to a few, applies a nonlinearity, expands "
            "back to d_model, and adds the result to h. The up-projection starts at zero, weight and bias, so at "
            "step 0 the adapter hands h through unchanged and the adapted model is exactly the pretrained one; the "
            "down-projection starts random, or nothing would get a gradient. The nonlinearity is what makes it more "
            "than LoRA's low-rank linear map, and also why it cannot be merged away."
        ),
        approach=(
            "In __init__, make two linear layers with biases, named down (d_model to bottleneck) and up (bottleneck "
            "to d_model), as attributes so that they register as parameters; then fill both of up's tensors with "
            "zeros, without recording it for autograd (nn.init has a function for that). Leave down as a linear "
            "layer starts. In forward, h is (..., d_model): send it through down to get (..., bottleneck), then the "
            "exact GELU, then up back to (..., d_model), and add h itself. Nothing in it fixes a dtype."
        ),
        skeleton=(
            "class Adapter(nn.Module):\n"
            "    def __init__(self, d_model, bottleneck):\n"
            "        super().__init__()\n"
            "        self.down = ____  # d_model -> bottleneck, with a bias\n"
            "        self.up = ____  # bottleneck -> d_model, with a bias\n"
            "        ____  # up's weight: what must it be at step 0?\n"
            "        ____  # and up's bias\n"
            "\n"
            "    def forward(self, h):\n"
            "        return ____  # (..., d_model): h plus the bottleneck's output; where does the GELU go?\n"
        ),
    ),
    "ex_prefix_attention": Hints(
        number="13.3",
        check="check_prefix_attention",
        idea=(
            "Prefix tuning gives every attention layer a few extra key and value vectors per head, learned, that "
            "sit in front of the tokens' own keys and values. Nothing else changes: the queries are still the "
            "tokens', one per token, so the output has the input's shape. Every query may read the whole prefix "
            "(it stands before the first token, so it is never in anyone's future), and the tokens causally, as "
            "before. The prefix takes a share of each query's attention and adds its values to the mix."
        ),
        approach=(
            "Project x with the layer's W_Q, W_K and W_V and split each into heads, (batch, n_heads, pos, d_head), "
            "as in exercise 5.3. The prefix is already per head, (n_heads, n_prefix, d_head): give it a batch axis "
            "of the batch's size and put it in front of the keys, and prefix_v in front of the values, along the "
            "positions axis, so both are (batch, n_heads, n_prefix + pos, d_head). The mask is (pos, n_prefix + "
            "pos): n_prefix columns that are all True, then the usual (pos, pos) causal mask. Your masked_attention "
            "does the scaled scores, the mask and the softmax (q's last axis is d_head). Then merge the heads back "
            "to (batch, pos, n_heads * d_head), heads outer, and apply W_O."
        ),
        skeleton=(
            "def prefix_attention(x, attn, prefix_k, prefix_v):\n"
            "    batch, n, _ = x.shape\n"
            "    n_prefix = ____\n"
            "    q, k, v = (____ for W in (attn.W_Q, attn.W_K, attn.W_V))  # (batch, n_heads, n, d_head) each\n"
            "    k = torch.cat([____, k], dim=____)  # the prefix in front, for every sequence\n"
            "    v = ____\n"
            "    mask = torch.cat([____, ____], dim=____)  # (n, n_prefix + n)\n"
            "    z, _ = masked_attention(____)\n"
            "    return attn.W_O(____)  # (batch, n, d_model), heads outer\n"
        ),
    ),
}
