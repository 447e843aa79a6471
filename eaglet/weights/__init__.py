"""Weight loading: iterators of (HF name, tensor) from safetensors directories and GGUF files,
fed through one table of names into a model built on the meta device."""
from .loader import LoadedModel, load_model, load_state

__all__ = ["LoadedModel", "load_model", "load_state"]
