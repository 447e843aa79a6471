"""Cache of converted GGUF files: dequantizing and converting the tokenizer takes ~16 s for
SmolLM2, so the result is kept as a HF model directory under the user's cache directory, keyed by
the file's sha256, and written atomically (built in a temporary directory, then renamed)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from .gguf_file import GGUFFile


def cache_root() -> Path:
    if os.environ.get("EAGLET_CACHE"):
        return Path(os.environ["EAGLET_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eaglet"


def file_sha256(path: Path) -> str:
    return hash_file(hashlib.sha256(), path).hexdigest()


def hash_file(h, path: Path):
    """Feed a file's bytes to hash object `h` in 4 MiB chunks (never the whole file in memory); returns h."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h


def converted_dir(path: Path, progress: bool = True) -> Path:
    """The HF directory holding `path`'s weights (float32), config and tokenizer; converts once."""
    digest = file_sha256(path)
    final = cache_root() / "gguf" / f"{path.stem}-{digest[:16]}"
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        g = GGUFFile(path)
        tensors = g.tensors()
        if progress:
            from tqdm import tqdm

            tensors = tqdm(tensors, total=len(g.reader.tensors), desc=f"converting {path.name}", leave=False)
        state = dict(tensors)
        if g.hf_config()["tie_word_embeddings"]:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"))
        if "tokenizer.ggml.tokens" in g.reader.fields:
            g.save_tokenizer(tmp)
        (tmp / "eaglet-source.json").write_text(json.dumps({"gguf": str(path), "sha256": digest}))
        (tmp / "config.json").write_text(json.dumps(g.hf_config(), indent=1))  # written last: marks complete
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first; its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
