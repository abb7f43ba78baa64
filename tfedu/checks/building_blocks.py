"""What an exercise that says "build it" may call from a library: an allow-list per exercise.

A hand-kept list of what an answer may *not* call always has gaps: every library grows another
shortcut (``F.pixel_unshuffle`` cuts patches, ``transformers.audio_utils`` builds mel filters, a
``LogitsProcessor`` filters top-k). So an exercise that rebuilds something a library already has
names what it is built *from* instead: ``Probe.builds``, a set of library names made of the groups
below. The static scan (:func:`tfedu.checks.scan.scan_answer`, ``allowed=``) follows every library
name the answer uses to the object it names (:func:`tfedu.checks.scan.resolve`) and flags a function
or class of a library in :data:`LIBRARIES` that is not in the set. Constants (``torch.float32``,
``np.pi``), the standard library (``math``, ``itertools``) and the course's own earlier concepts
(``tfedu.*``, policed by ``Probe.forbidden``) are not library shortcuts. A method called on a tensor
(``x.unfold(...)``) is not a name the scan can follow; ``Probe.forbidden`` and the run-time tripwire
watch those.
"""

from __future__ import annotations

# Libraries whose functions and classes an exercise with an allow-list may use only from it.
LIBRARIES = frozenset({
    "torch", "numpy", "scipy", "transformers", "torchaudio", "torchvision", "librosa", "einops", "sklearn",
    "tiktoken", "tokenizers", "sentencepiece", "peft", "trl", "accelerate", "jax", "tensorflow", "keras", "timm",
    "datasets", "safetensors", "numba", "cupy", "pandas", "opt_einsum", "kornia", "scikit_learn",
})


def _both(*names: str) -> frozenset[str]:
    """Each name under ``torch.`` and ``numpy.`` (most elementary operations exist in both)."""
    return frozenset(f"{lib}.{name}" for lib in ("torch", "numpy") for name in names)


# Tensors and arrays made from numbers: creation, random draws, dtypes, the types themselves.
CREATION = _both(
    "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like", "arange", "linspace",
    "logspace", "eye", "tril_indices", "triu_indices", "asarray", "array", "tensor", "as_tensor", "from_numpy",
    "float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool_", "complex64",
) | frozenset({
    "torch.Tensor", "torch.Size", "torch.device", "torch.dtype", "torch.Generator", "torch.manual_seed", "torch.rand",
    "torch.randn", "torch.randint", "torch.randperm", "torch.rand_like", "torch.randn_like", "torch.randint_like",
    "torch.multinomial", "torch.bernoulli", "torch.normal", "torch.get_default_dtype", "torch.finfo", "torch.iinfo",
    "torch.is_tensor", "torch.is_floating_point", "torch.numel", "torch.no_grad", "torch.inference_mode",
    "torch.enable_grad", "torch.set_grad_enabled",
    "numpy.ndarray", "numpy.dtype", "numpy.random.default_rng", "numpy.random.Generator", "numpy.finfo", "numpy.iinfo",
    "numpy.intp", "numpy.ascontiguousarray", "numpy.random.seed", "numpy.random.rand", "numpy.random.randn",
    "numpy.random.randint", "numpy.random.normal", "numpy.random.uniform", "numpy.random.choice",
    "numpy.random.permutation",
})
# One number in, one number out (or two in, one out), element by element, and comparisons.
ELEMENTWISE = _both(
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "square", "pow", "power", "abs", "absolute",
    "negative", "neg", "sign", "sin", "cos", "tan", "arcsin", "arccos", "arctan", "arctan2", "asin", "acos", "atan",
    "atan2", "sinh", "cosh", "floor", "ceil", "round", "trunc", "clip", "clamp", "maximum", "minimum", "fmax", "fmin",
    "where", "isfinite", "isnan", "isinf", "isneginf", "isposinf", "nan_to_num", "reciprocal", "rsqrt", "add",
    "subtract", "sub", "multiply", "mul", "divide", "div", "true_divide", "floor_divide", "remainder", "fmod", "mod",
    "lerp", "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_not", "bitwise_left_shift", "bitwise_right_shift", "left_shift", "right_shift", "eq", "ne", "lt", "le",
    "gt", "ge", "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "allclose", "isclose",
    "array_equal", "erf", "hypot", "deg2rad", "rad2deg", "copysign", "signbit", "heaviside", "frac", "clamp_min",
    "clamp_max",
)
# Many numbers in, fewer out: sums, extremes, sorting and ranking, counting, cumulative sums.
REDUCTIONS = _both(
    "sum", "mean", "prod", "max", "min", "amax", "amin", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
    "var", "std", "all", "any", "count_nonzero", "sort", "argsort", "topk", "kthvalue", "median", "quantile",
    "unique", "bincount", "histc", "histogram", "searchsorted", "bucketize", "digitize", "nansum", "nanmean",
    "average", "ptp", "diff",
)
# Moving numbers around without computing on them: shapes, joins, splits, indexing, masks.
SHAPES = _both(
    "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "column_stack", "reshape", "flatten",
    "unflatten", "ravel", "squeeze", "unsqueeze", "expand_dims", "transpose", "permute", "movedim", "moveaxis",
    "swapaxes", "swapdims", "t", "split", "array_split", "chunk", "unbind", "narrow", "gather", "scatter",
    "scatter_add", "index_select", "masked_select", "masked_fill", "take", "take_along_dim", "take_along_axis",
    "put_along_axis", "tril", "triu", "roll", "flip", "fliplr", "flipud", "repeat_interleave", "repeat", "tile",
    "broadcast_to", "broadcast_tensors", "broadcast_arrays", "meshgrid", "diag", "diagonal", "diag_embed",
    "nonzero", "argwhere", "flatnonzero", "atleast_1d", "atleast_2d", "copy", "clone", "pad",
) | frozenset({"torch.nn.functional.pad"})
# Products of vectors and matrices.
PRODUCTS = _both("matmul", "mm", "bmm", "einsum", "dot", "vdot", "inner", "outer", "tensordot", "kron", "mv")

# The elementary operations: what "build it from tensor operations" means.
ELEMENTARY = CREATION | ELEMENTWISE | REDUCTIONS | SHAPES | PRODUCTS

# Softmax and its log, for exercises that use it as a step (attention, top-p) rather than build it.
SOFTMAX = frozenset({"torch.softmax", "torch.log_softmax", "torch.nn.functional.softmax",
                     "torch.nn.functional.log_softmax", "torch.logsumexp"})
# Point-wise nonlinearities, for exercises that use one as a step (an LSTM cell's gates).
ACTIVATIONS = frozenset({"torch.sigmoid", "torch.tanh", "torch.relu", "torch.nn.functional.relu",
                         "torch.nn.functional.sigmoid", "torch.nn.functional.tanh", "torch.nn.functional.logsigmoid",
                         "torch.nn.functional.silu", "torch.nn.functional.gelu", "torch.nn.functional.softplus"})
# The parts a module is assembled from (not the layers an exercise builds).
MODULES = frozenset({"torch.nn.Module", "torch.nn.Parameter", "torch.nn.ModuleList", "torch.nn.ModuleDict",
                     "torch.nn.ParameterList", "torch.nn.Linear", "torch.nn.Embedding", "torch.nn.Dropout",
                     "torch.nn.Identity", "torch.nn.Sequential", "torch.nn.init.kaiming_uniform_",
                     "torch.nn.init.normal_", "torch.nn.init.zeros_", "torch.nn.init.ones_", "torch.nn.init.uniform_",
                     "torch.nn.init.xavier_uniform_", "torch.nn.init.xavier_normal_", "torch.nn.init.trunc_normal_",
                     "torch.nn.functional.linear", "torch.nn.functional.dropout", "torch.nn.functional.embedding"})

# einops' notation for the same shape moves and products (an exercise whose point is not the layout).
EINOPS = frozenset({"einops.rearrange", "einops.reduce", "einops.repeat", "einops.einsum", "einops.pack",
                    "einops.unpack", "einops.parse_shape"})

GROUP_WORDS = ("element-wise maths and comparisons, sums, extremes and sorting, shapes and indexing, matrix "
               "products, and making tensors")


def library_of(dotted: str) -> str | None:
    """The library a dotted name belongs to, when it is one of :data:`LIBRARIES`; else None.

    >>> library_of("torch.nn.functional.pixel_unshuffle"), library_of("math.sqrt")
    ('torch', None)
    """
    top = dotted.split(".")[0]
    return top if top in LIBRARIES else None
