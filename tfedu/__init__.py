"""tfedu: the Transformer, built by hand. This file only re-exports."""

from tfedu.runtime import device, seed_everything

__version__ = "0.1.0"
__all__ = ["device", "seed_everything", "__version__"]
