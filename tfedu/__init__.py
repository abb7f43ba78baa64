"""tfedu: the Transformer, built by hand. This file only re-exports, lazily (the grader's runner
imports ``tfedu.course.grading.inside`` in every sandbox and must not pay for torch there)."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["device", "seed_everything", "pretrained", "hint", "solution", "solutions_off", "use_mine", "keep_parts_on_drive",
           "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("device", "seed_everything"):
        from tfedu import runtime

        return getattr(runtime, name)
    if name == "pretrained":
        from tfedu.checkpoints import pretrained

        return pretrained
    if name in ("hint", "solution", "solutions_off"):
        from tfedu.course import hints

        return getattr(hints, name)
    if name in ("use_mine", "keep_parts_on_drive"):
        from tfedu.checks import carry

        return getattr(carry, name)
    raise AttributeError(f"module 'tfedu' has no attribute {name!r}")
