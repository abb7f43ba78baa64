"""``tfedu bench moe``: the MoE layer's two dispatches against each other and against Hugging Face's Mixtral block.

Three contenders run the same mixture of experts (SwiGLU experts, no biases, dropless: no capacity
limit, so all three compute the same function on the same weights):

- ``sorted``: ``tfedu.moe.MoE(dispatch="sorted")``, the default: sort the assignments by expert, gather them
  into an (E, capacity, d_model) buffer, run every expert in batched matmuls.
- ``loop``: ``tfedu.moe.MoE(dispatch="loop")``, the readable version: a masked gather per expert.
- ``hf``: ``transformers``' ``MixtralSparseMoeBlock`` built locally from a ``MixtralConfig`` (no download),
  its weights copied from ours; its eager path loops over the experts that received tokens.

Every size uses k = 2: Hugging Face's router divides the top-k probabilities by their sum for any k, so at
k = 1 its gate is always 1 (a different function from Switch's, and one whose router gets no gradient
through the gate). Before timing, the three outputs are compared (float32, 1e-4). Each call is forward + backward of
``out.sum()`` (plus our aux loss, a few hundred FLOPs), timed in turns (sorted, loop, hf, sorted, ...)
and reported by the best and the median. Ratios are the peer's time over ``sorted``'s: above 1 means
the sorted dispatch is faster.

``--quick`` runs one small size once: it checks that the bench runs, not the speed.
"""

from __future__ import annotations

import sys

from tfedu.course.bench.common import device_description, device_lines, devices_to_run, interleaved, machine, summary, timed, version

FULL = {"tokens": 2048, "sizes": [(64, 8, 2), (64, 32, 2), (256, 8, 2), (256, 32, 2), (256, 64, 2)],
        "rounds": 7}
QUICK = {"tokens": 64, "sizes": [(16, 4, 2)], "rounds": 1}
AGREE_ATOL = 1e-4


def _layers(d_model: int, n_experts: int, k: int, device: str):
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from tfedu.moe import MoE

    d_mlp = 2 * d_model
    torch.manual_seed(0)
    ours = {name: MoE(d_model, d_mlp, n_experts, top_k=k, activation="swiglu", bias=False, dispatch=name)
            for name in ("sorted", "loop")}
    ours["loop"].load_state_dict(ours["sorted"].state_dict())
    config = MixtralConfig(hidden_size=d_model, intermediate_size=d_mlp, num_local_experts=n_experts,
                           num_experts_per_tok=k, hidden_act="silu")
    config._experts_implementation = "eager"  # the plain loop over experts (a standalone block has no model to set it)
    hf = MixtralSparseMoeBlock(config)
    src = ours["sorted"]
    with torch.no_grad():
        hf.gate.weight.copy_(src.router.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([src.W_gate, src.W_in], dim=2).transpose(1, 2))
        hf.experts.down_proj.copy_(src.W_out.transpose(1, 2))
    return {**{name: layer.to(device) for name, layer in ours.items()}, "hf": hf.to(device)}


def _step(layer, x, sync):
    def run() -> float:
        def fwd_bwd():
            out = layer(x)
            loss = out.sum() + (layer.aux_loss if getattr(layer, "aux_loss", None) is not None else 0)
            loss.backward()

        seconds, _ = timed(fwd_bwd, sync)
        return seconds

    return run


def run(quick: bool = False, device: str | None = None) -> dict:
    import torch

    plan = QUICK if quick else FULL
    rows = []
    devices = {}
    for dev in devices_to_run("moe", device):
        devices[dev] = device_description(dev)
        sync = torch.cuda.synchronize if dev == "cuda" else None
        for d_model, n_experts, k in plan["sizes"]:
            layers = _layers(d_model, n_experts, k, dev)
            x = torch.randn(plan["tokens"], d_model, generator=torch.Generator().manual_seed(1)).to(dev)
            with torch.no_grad():
                reference = layers["sorted"](x)
                for name in ("loop", "hf"):
                    gap = (layers[name](x[None])[0] if name == "hf" else layers[name](x)) - reference
                    if gap.abs().max() > AGREE_ATOL:
                        raise AssertionError(f"{name} disagrees with sorted by {gap.abs().max():.2e} at "
                                             f"d_model={d_model}, E={n_experts}, k={k}")
            inputs = {"sorted": x, "loop": x, "hf": x[None]}
            steps = {name: _step(layer, inputs[name], sync) for name, layer in layers.items()}
            for step in steps.values():  # warm-up: first calls pay for allocations and caches
                step()
            times = interleaved(steps, plan["rounds"])
            stats = {name: summary(seconds) for name, seconds in times.items()}
            rows.append({"device": dev, "tokens": plan["tokens"], "d_model": d_model, "d_mlp": 2 * d_model,
                         "n_experts": n_experts, "top_k": k, "times": stats,
                         "ratios": {f"{name}_vs_sorted": stats[name]["best_s"] / stats["sorted"]["best_s"]
                                    for name in ("loop", "hf")}})
    return {"bench": "moe", "quick": quick, "machine": machine(), "devices": devices,
            "versions": {"torch": version("torch"), "transformers": version("transformers")}, "rows": rows}


def format_table(result: dict) -> str:
    lines = [f"tfedu bench moe{' (quick)' if result['quick'] else ''}: forward + backward of one MoE layer, "
             "SwiGLU experts, dropless, float32; best of the rounds"]
    lines += device_lines(result["devices"])
    lines.append(f"{'device':>6} {'tokens':>6} {'d_model':>7} {'E':>3} {'k':>2} {'sorted ms':>10} {'loop ms':>9} "
                 f"{'hf ms':>8} {'loop/sorted':>12} {'hf/sorted':>10}")
    for row in result["rows"]:
        t = {name: row["times"][name]["best_s"] * 1e3 for name in ("sorted", "loop", "hf")}
        lines.append(f"{row['device']:>6} {row['tokens']:>6} {row['d_model']:>7} {row['n_experts']:>3} {row['top_k']:>2} "
                     f"{t['sorted']:>10.2f} {t['loop']:>9.2f} {t['hf']:>8.2f} "
                     f"{row['ratios']['loop_vs_sorted']:>11.2f}x {row['ratios']['hf_vs_sorted']:>9.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(run(quick="--quick" in sys.argv)))
