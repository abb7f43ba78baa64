"""Triton kernels: attention written for the GPU, readable top to bottom (``flash_attention``).

Where they run. Triton compiles kernels for a GPU, but it also has an *interpreter* that runs the
same kernels on CPU tensors through numpy (``TRITON_INTERPRET=1``). It has to be switched on before
any kernel is defined, so this package decides when it is first imported: if ``TRITON_INTERPRET`` is
unset and torch sees no CUDA device, it sets ``os.environ["TRITON_INTERPRET"] = "1"`` (for this
process and its children) and the kernels run on the CPU, slowly, which is enough to read them,
print inside them and check them on small inputs. Set ``TRITON_INTERPRET=0`` beforehand to keep
this package from touching it.

Import this package *before* ``triton`` itself (or set ``TRITON_INTERPRET=1`` before Python starts):
Triton's own helpers (``tl.max``, ``tl.sum``, ...) are kernels too, built when triton is first
imported, and helpers built for the GPU cannot run in the interpreter; ``available()`` says so.

``jit`` and ``tl`` are Triton's decorator and language module, for kernels written in a notebook
(stand-ins that let such a cell run, and its check say why, where Triton is missing).
``available()`` says whether the kernels can run here and how; without Triton installed (it ships
for Linux; ``pip install triton``) importing this package still works and ``available()`` says why
the kernels cannot run, while calling them raises ImportError.

The kernels' module is ``tfedu/kernels/flash_attention.py``; since the package's name
``flash_attention`` is the function, reach the module with
``importlib.import_module("tfedu.kernels.flash_attention")`` (for ``inspect.getsource``).

Built and explained in notebooks/09_efficient_attention.ipynb.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # no GPU: the CPU interpreter, set before triton is imported

try:
    from tfedu.kernels.flash_attention import (
        IMPORTED_TOO_EARLY,
        INTERPRETED,
        TRITON_IMPORTED_BEFORE_INTERPRETER,
        flash_attention,
        flash_forward,
    )
except ImportError as err:  # triton missing (macOS, Windows) or broken: report, do not crash
    _IMPORT_ERROR: ImportError | None = err
    INTERPRETED = TRITON_IMPORTED_BEFORE_INTERPRETER = False

    def flash_attention(*args, **kwargs):
        raise ImportError(f"tfedu.kernels.flash_attention needs Triton: {available()[1]}") from _IMPORT_ERROR

    def flash_forward(*args, **kwargs):
        raise ImportError(f"tfedu.kernels.flash_forward needs Triton: {available()[1]}") from _IMPORT_ERROR
else:
    _IMPORT_ERROR = None

if _IMPORT_ERROR is None:  # Triton's decorator and language, for kernels written in a notebook (exercise 9.7)
    import triton
    import triton.language as tl

    jit = triton.jit
else:

    class _NoTriton:
        """Stands in for ``triton.language`` without Triton: annotations such as ``tl.constexpr`` still evaluate."""

        def __getattr__(self, name: str) -> None:
            return None

    tl = _NoTriton()

    def jit(fn):  # noqa: ANN001, ANN201 - the kernel stays a plain function; its check says Triton is missing
        return fn

__all__ = ["INTERPRETED", "available", "flash_attention", "flash_forward", "jit", "tl"]


def available() -> tuple[bool, str]:
    """Whether the Triton kernels can run in this process, and how (or why not), in one sentence.

    >>> ok, how = available()
    >>> isinstance(ok, bool) and isinstance(how, str)
    True
    """
    if _IMPORT_ERROR is not None:
        if isinstance(_IMPORT_ERROR, ModuleNotFoundError) and _IMPORT_ERROR.name == "triton":
            return False, "triton is not installed: pip install triton (Linux; on a Mac or Windows use Colab or WSL)"
        return False, f"triton fails to import ({_IMPORT_ERROR}): reinstall it with pip install --force-reinstall triton"
    import triton

    if TRITON_IMPORTED_BEFORE_INTERPRETER:
        return False, IMPORTED_TOO_EARLY
    if INTERPRETED:
        return True, (f"triton {triton.__version__} through its CPU interpreter (TRITON_INTERPRET=1): "
                      "slow, for reading the kernels and small inputs")
    if torch.cuda.is_available():
        return True, f"triton {triton.__version__} compiling for the GPU ({torch.cuda.get_device_name()})"
    return False, ("no CUDA device and TRITON_INTERPRET is off: set TRITON_INTERPRET=1 before importing "
                   "tfedu.kernels to run the kernels on the CPU")
