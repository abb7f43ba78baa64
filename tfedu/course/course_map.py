"""The course map in one place: every notebook, its title, what it builds and its status.

Notebook 00's map and the README's table (with each notebook's exercise time, added up from its exercise
headers) are generated from ``CHAPTERS`` by ``tfedu clean``
(``course_map.sync``); ``tests/test_course_map.py`` fails when either drifts from it, when a title
differs from its notebook's header, or when a notebook is missing from the list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATUSES = ("ready", "coming")
MAP_NOTEBOOK = "00_start_here.ipynb"  # the notebook whose markdown holds the map
BEGIN = "<!-- course map: generated from tfedu/course/course_map.py by `tfedu clean`; edit it there -->"
END = "<!-- end of the course map -->"


@dataclass(frozen=True)
class Chapter:
    number: str  # "00".."20": the file name's prefix and the order
    name: str  # the rest of the file name: notebooks/{number}_{name}.ipynb
    title: str  # the header's title, after "# NN · "
    builds: str  # what the learner builds, one line of markdown
    status: str = "ready"  # ready | coming

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Chapter {self.number}: status must be one of {STATUSES}, got {self.status!r}")
        if "|" in self.builds or "\n" in self.builds:
            raise ValueError(f"Chapter {self.number}: builds must be one table cell (no '|' or newline)")

    @property
    def filename(self) -> str:
        return f"{self.number}_{self.name}.ipynb"


CHAPTERS: tuple[Chapter, ...] = (
    Chapter("00", "start_here", "Start here", (
        "how the course works, checks, your device, a stable softmax"
    )),
    Chapter("01", "tokenization", "Tokenization", (
        "byte-level BPE from the worked example to a fast, exact tokenizer; encoding by merge rank; "
        "WordPiece"
    )),
    Chapter("02", "embeddings", "Embeddings", (
        "one-hot vectors, embedding look-ups, word2vec (SGNS, CBOW, hierarchical softmax), weight tying"
    )),
    Chapter("03", "rnns_to_attention", "From RNNs to attention", (
        "recurrence, gradients through time, the LSTM, seq2seq, Bahdanau attention, convolutions, Table 1"
    )),
    Chapter("04", "attention", "Attention", (
        "scaled dot-product attention by hand, when sqrt(d_k) is right, fused QKV, attention dropout"
    )),
    Chapter("05", "masks_and_heads", "Masks and heads", (
        "causal and padding masks, what a causal mask tells about order, multi-head and cross-attention"
    )),
    Chapter("06", "positional_encoding", "Positional encoding", (
        "binary codes, sinusoids and their rotation, learned positions, ALiBi, RoPE in both layouts, a "
        "length-extrapolation experiment"
    )),
    Chapter("07", "transformer_block", "The Transformer block", (
        "the FFN (ReLU, GELU, SwiGLU), LayerNorm and RMSNorm, the residual stream, pre- and post-norm "
        "blocks, the course GPT checked against GPT-2, parameter and FLOP counts, pre- vs post-norm at "
        "depth, encoder / decoder / encoder-decoder"
    )),
    Chapter("08", "training_and_decoding", "Training and decoding", (
        "the next-token objective, the training loop (AdamW, warm-up and cosine, clipping, checkpoints), "
        "a GPT trained live against count baselines, the unmasked model that cheats, the shipped course "
        "GPT, greedy, temperature, top-k, top-p, beam search, repetition"
    )),
    Chapter("09", "efficient_attention", "Efficient attention: online softmax, tiles, FlashAttention and a Triton kernel", (
        "attention's cost measured (FLOPs, peak memory, time), HBM vs SRAM, softmax naive/safe/online, "
        "tiled matmul with its loads counted; FlashAttention-2's forward and backward written by tiles and run "
        "inside your own GPT of notebook 08 (the same losses, a fraction of the memory); model FLOPs "
        "utilisation measured; memory vs n, deck 000's IO table counted; the loop of a Triton FlashAttention "
        "kernel written (CPU interpreter or GPU); causal linear attention two ways and the retrieval it fails"
    )),
    Chapter("10", "inference_and_kv_cache", "Inference and the KV cache: decoding cost, identical tokens, MQA, GQA and MLA", (
        "decoding's cost without a cache, measured; why the past never changes; one cached decoding step "
        "and the cached generation loop written by hand, driving the course GPT; identical tokens cached and "
        "uncached (greedy, sampled, beam); prompts of different lengths in one left-padded batch, each row's "
        "tokens those it gets alone; grouped-query attention written and checked against transformers' Llama; "
        "per-step FLOPs counted exactly, O(bd^2 + bnd) vs O(bnd^2 + bn^2 d); the cache's bytes (deck "
        "004's 2ndL and its unstated conditions); MQA/GQA cache sizes, and the course GPT converted to "
        "fewer key/value heads and uptrained; MLA's latent cache against GQA's"
    )),
    Chapter("11", "beyond_text", "Beyond text: images, sound and the same blocks", (
        "an image as a sequence of patches, cut by hand, and the patch embedding two ways (conv with "
        "kernel = stride = P, and unfold + linear), equal bit for bit; the ViT assembled by hand from the "
        "learner's own patches, attention, FFN, norm and pre-norm block, equal logit for logit to transformers' "
        "ViTForImageClassification, and run on the ViT trained on digits; a CNN against a ViT on growing "
        "training sets; the deck's \"ViT: no inductive bias\" measured; mean attention distance per head; a "
        "log-mel spectrogram with a mel filterbank by hand (equal to librosa's); a spectrogram transformer on "
        "synthetic audio; the Conformer block, its half steps, and its convolution module written by hand, "
        "its shift equivariance measured on the learner's module"
    )),
    Chapter("12", "moe_and_scaling", "Mixture of experts and scaling laws", (
        "a mixture of experts in the course GPT (`ModelConfig(n_experts=E, top_k=k, capacity_factor=c)`): "
        "parameters grow by E and FLOPs by k, measured with torch's FLOP counter (and Mixtral's 46.7B / "
        "12.9B counted); the router by hand, and why one gate must not be renormalised; capacity and "
        "dropped tokens; Switch's balance loss trained on and off (without it the router collapses); loop "
        "vs sort-and-gather dispatch, equal, timed; the MoE layer's forward pass with capacity written by hand "
        "(route, queue, drop, combine by gate); five GPTs trained on the same bytes and a power law fitted, "
        "and the exponent moved by the learning rate; the compute frontier; C = 6ND, PF-days, Kaplan vs "
        "Chinchilla allocations and what separates them; IsoFLOP profiles from five models trained to equal "
        "compute, each budget's parabola in log N and its minimum, and N_opt proportional to C^a fitted by hand "
        "(and how poorly a CPU sweep determines a: bootstrap and leave-one-model-out)"
    )),
    Chapter("13", "peft", "Parameter-efficient fine-tuning", (
        "the course GPT fine-tuned to Python source code (a new style, measured) by full fine-tuning, "
        "LoRA (W_Q, W_V; the MLP; equal budgets), adapters, prefix tuning (a learned prefix on "
        "`tfedu.layers.Attention`) and prompt tuning, in one table of trainable fraction, held-out loss, "
        "time and training memory, the methods ranked over three seeds with paired gaps (and the pair that "
        "does not separate); prefix attention by hand on the learner's own masked attention, training the "
        "table's prefix row; LoRA by hand (B = 0, alpha / r, no activation), merged into plain "
        "layers with identical logits; a bottleneck adapter by hand (up-projection zero, the model unchanged "
        "at the start); a rank sweep over three seeds with the scale tied to r and held fixed; the deck's \"15%\" and \"W_Q and W_V\" checked against "
        "Hu et al.; `tfedu.peft` tested against Hugging Face peft"
    )),
    Chapter("14", "quantization", "Quantization", (
        "the bits of a float by hand (sign, exponent, mantissa; float32, bfloat16, float16, float8 e4m3, "
        "rounding to nearest even, subnormals), equal to torch's; absmax and zero-point quantization by hand; one outlier against per-tensor, per-row and "
        "per-group scales; int4 packed two per byte, memory as bytes stored; GPTQ's column loop written by "
        "hand (quantize a column, spread its error with the upper Cholesky factor of the inverse Hessian), "
        "equal to tfedu.quant's on a layer of the course GPT, the Cholesky update derived and checked against "
        "OBQ, against round-to-nearest; the course GPT at 32/16/8/4 bits, perplexity "
        "and bytes, RTN vs GPTQ; the deck's \"~4.5 bits\" and \"<5% for 1B+\" checked against Frantar et al."
    )),
    Chapter("15", "interpretability_and_decoding", "Looking inside, and steering the output", (
        "attention maps of the course GPT per head and averaged over the last layer (and what the average "
        "hides); previous-token and induction scores on a repeated random sequence against chance, the "
        "induction score written by hand (the course GPT has neither previous-token nor induction heads, "
        "measured; a two-layer attention-only model trained on repeating sequences has both); an ablation "
        "hook written by hand, zero and mean ablation at hook_z (ablating either layer undoes the copying; "
        "mean ablation of the induction heads lands on the first copy's loss, zeroing overshoots); "
        "activation patching written by hand, one head's clean output in a corrupted run (each induction head "
        "restores part of the copying, the previous-token head alone makes it worse); the logit lens written by hand, its last row equal to the logits bit for bit; direct logit attribution "
        "written by hand, the final norm's scale frozen, its parts adding up to the logit; constrained decoding by hand (-inf before the softmax), a regex constraint over "
        "the vocabulary's byte trie (`tfedu.constrained`, a logits processor for `tfedu.generate`), JSON "
        "valid in 100 of 100 samples, its cost per token; only bytes that can still become UTF-8 (the "
        "automaton read off RFC 3629's table, written by hand), so a byte-level model sampled hot never writes "
        "invalid UTF-8"
    )),
    Chapter("16", "modern_architectures", "From GPT-2 to today's open models", (
        "GPT-2, Llama 3.2 1B, Qwen3 0.6B and Gemma 3 270M side by side, generated from their published configs "
        "(norm, gated MLP, RoPE base and scaling, grouped heads, window pattern, tying, vocabulary), parameter "
        "counts equal to the published ones; a toy `tfedu` GPT of each family equal to `transformers`' "
        "LlamaForCausalLM, Qwen3ForCausalLM and Gemma3ForCausalLM (logits within 1e-5, greedy tokens with the "
        "KV cache); QK-norm written by hand (per head over d_head, before RoPE), and the attention-logit growth "
        "it prevents at a high learning rate, three seeds; the sliding-window mask written by hand, keys "
        "attended per query; the ring-buffer KV cache update written by hand (the uncached model's tokens), and "
        "Gemma 3's 5:1 local/global cache measured against all-global in bytes and tokens/s; Llama 3.1's RoPE "
        "scaling written by hand, and linear, dynamic NTK, Llama 3.1 and YaRN scaling read at 2x and 4x the "
        "trained length, three seeds; deck 002's \"usually 30k - 120k\" vocabulary checked"
    )),
    Chapter("17", "post_training", "After pretraining: instruction tuning, DPO and GRPO", (
        "verifiable instruction tasks (arithmetic, reversing and sorting a word, answering from a sentence, JSON), "
        "split by a hash of the prompt; a chat template with role markers as four new special tokens, the "
        "embedding grown by their mean; instruction tuning's loss on the answer tokens written by hand, "
        "reproducing the shipped chat model's first steps, held-out accuracy before and after and against the "
        "number of examples (three seeds); the DPO loss written by hand (equal to trl's), pairs made by the "
        "verifier, accuracy and KL to the SFT model against beta; GRPO's group-relative advantages and clipped, "
        "KL-penalised loss written by hand (equal to trl's), the reward over training and the held-out pass rate "
        "(three seeds); Chen et al.'s unbiased pass@k written by hand, before and after GRPO; multiple-choice "
        "scoring by log-likelihood, the whole answer against its first token"
    )),
    Chapter("18", "serving", "Serving many users: speculative decoding, a paged KV cache and continuous batching", (
        "why a pass over k + 1 tokens costs about one token's, measured; speculative sampling's acceptance step "
        "written by hand (exact: the first token's distribution through the draft equals the target's), greedy "
        "speculation giving the target's own tokens; acceptance and tokens per pass against k for a draft model "
        "trained like the course GPT but smaller, sampled and greedy, and for prompt lookup; the speed-up measured "
        "against Leviathan et al.'s formula, with and without the verifying pass's real cost; a paged KV cache, "
        "its block-table gather written by hand, equal to the contiguous cache; memory against the mix of "
        "request lengths; eight answers to one prompt sharing its blocks, copied on write (45% of the memory); "
        "continuous batching's admission step written by hand, running a server on an arrival "
        "trace: passes, latency and tokens/s against static batching (three seeds), every request's tokens "
        "identical; `tfedu bench serve` against transformers' static batches"
    )),
    Chapter("19", "beyond_attention", "Beyond attention: linear recurrences, Mamba, the delta rule and hybrids", (
        "what a generated token costs attention (a growing KV cache) and a recurrence (a fixed state), time and "
        "bytes measured to 65,536 tokens; gated linear attention's step written by hand, then its chunked form "
        "(equal to the step-by-step form, many times faster); Mamba's discretisation and selective scan step "
        "written by hand, decoding a layer equal to transformers' Mamba; the gated delta rule's step written by "
        "hand: add against replace, inside a Gated DeltaNet layer; associative recall against the number of pairs "
        "and the state's size for attention, four recurrences and a hybrid, language-model loss at equal size "
        "(three seeds each); hybrid layer patterns and their KV cache"
    )),
    Chapter("20", "parallel_training", "Training across devices: data parallelism, ZeRO, FSDP, tensor parallelism and "
            "mixed precision", (
        "real gloo processes started from the notebook on a laptop CPU; the collectives; the ring all-reduce "
        "written by hand, training a GPT in two processes equal to one process on the whole batch, its traffic "
        "counted against 2 (N - 1) / N; gradient buckets overlapping the backward pass and torch's "
        "DistributedDataParallel; ZeRO-1's sharded AdamW written by hand (state per process falling as 1 / N, the "
        "same traffic); FSDP with torch's fully_shard (three times the parameters' bytes per step, counted); the "
        "column- then row-parallel MLP written by hand, attention split by heads; bfloat16 and float16, the "
        "gradients float16 loses (three seeds), the loss scale's update written by hand; time per step for 1, 2 "
        "and 4 processes and the commands for NCCL on GPUs"
    )),
)


DIFFICULTIES = ("easy", "medium", "hard")
# How central an exercise's idea is to the course: core (later notebooks build on it), useful (worth doing,
# nothing later needs it), optional (a side path for the curious).
IMPORTANCES = ("core", "useful", "optional")
EXERCISE_HEADER = re.compile(
    r"^#{2,4} Exercise (?P<number>\d+\.\d+[a-z]?): .+ \((?P<difficulty>" + "|".join(DIFFICULTIES) + r"), "
    r"importance: (?P<importance>" + "|".join(IMPORTANCES) + r"), "
    r"about (?P<minutes>\d+)(?:[-–](?P<most>\d+))? minutes?, (?P<points>\d+(?:\.\d+)?) points?\)\s*$",
    re.MULTILINE,
)
HEADER_FORM = "'### Exercise N.M: title (difficulty, importance: core|useful|optional, about K minutes, P points)'"


def exercise_minutes(nb: Any) -> int:
    """The minutes a notebook's exercise headers ask for, added up (a range counts its upper end)."""
    return sum(int(m["most"] or m["minutes"]) for cell in nb.cells if cell.cell_type == "markdown"
               for m in EXERCISE_HEADER.finditer(cell.source))


NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"  # the source notebooks, in a checkout


def exercise_time(chapter: Chapter) -> str:
    """The minutes the chapter's exercise headers ask for, added up, as the map shows them."""
    import nbformat

    path = NOTEBOOKS / chapter.filename
    return f"{exercise_minutes(nbformat.read(path, as_version=4))} min" if path.is_file() else "–"


def notebook_table() -> str:
    """The map as notebook 00 shows it: links relative to notebooks/."""
    rows = [f"| [{c.number} · {c.title}]({c.filename}) | {c.builds} | {exercise_time(c)} | {c.status} |"
            for c in CHAPTERS]
    return "\n".join(["| notebook | what you build | exercises | status |", "|---|---|---|---|", *rows])


def readme_table() -> str:
    """The map as the README shows it: links from the repository root."""
    rows = [f"| {c.number} | [{c.title}](notebooks/{c.filename}) | {c.builds} | {exercise_time(c)} | {c.status} |"
            for c in CHAPTERS]
    return "\n".join(["| # | notebook | what you build | exercises | status |", "|---|---|---|---|---|", *rows])


def replace_table(text: str, table: str) -> str:
    """``text`` with what lies between the BEGIN and END markers replaced by ``table``; unchanged without markers."""
    if BEGIN not in text:
        return text
    before, rest = text.split(BEGIN, 1)
    if END not in rest:
        raise ValueError(f"the course map starts with {BEGIN!r} but its end marker {END!r} is missing")
    return f"{before}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}"


def sync_readme(path: str | Path, *, check_only: bool = False) -> bool:
    """Regenerate the README's table (between the markers); True when it changed (or, checking, would)."""
    path = Path(path)
    before = path.read_text(encoding="utf-8")
    if BEGIN not in before:
        raise ValueError(f"{path} has no course-map markers ({BEGIN!r} ... {END!r})")
    after = replace_table(before, readme_table())
    if after != before and not check_only:
        path.write_text(after, encoding="utf-8")
    return after != before
