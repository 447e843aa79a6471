"""eaglet: a speculative-decoding engine for Llama-family, MoE and MLA models (EAGLE-3, n-gram, draft model)."""
from .config import ModelConfig
from .errors import EagletError, InvalidInput, ModelLoadError
from .generate import Completion, GenerationConfig, Generator, TokenEvent
from .sampling import SamplingParams
from .weights import LoadedModel, load_model

__version__ = "0.1.0"
__all__ = ["ModelConfig", "EagletError", "InvalidInput", "ModelLoadError", "Completion", "GenerationConfig",
           "Generator", "TokenEvent", "SamplingParams", "LoadedModel", "load_model"]
