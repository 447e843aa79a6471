"""bench/average_drafters.py: exports of one vocabulary averaged tensor by tensor (a model soup);
exports of different vocabularies or configs refused; the output written whole."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "average_drafters.py"
spec = importlib.util.spec_from_file_location("average_drafters", SCRIPT)
avg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(avg)


def export(d: Path, seed: int, d2t=(0, 0, 3), config=None) -> Path:
    g = torch.Generator().manual_seed(seed)
    d.mkdir(parents=True)
    save_file({"fc.weight": torch.randn(4, 6, generator=g).bfloat16(), "d2t": torch.tensor(d2t),
               "t2d": torch.tensor([True, True, False, False, False, True])}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config or {"draft_vocab_size": 3}))
    return d


def test_average_is_the_mean_and_keeps_the_vocabulary(tmp_path, monkeypatch):
    dirs = [export(tmp_path / f"d{i}", i) for i in range(3)]
    monkeypatch.setattr("sys.argv", ["average_drafters.py", str(tmp_path / "soup"), *map(str, dirs)])
    assert avg.main() == 0
    soup = load_file(str(tmp_path / "soup" / "model.safetensors"))
    parts = [load_file(str(d / "model.safetensors")) for d in dirs]
    mean = sum(p["fc.weight"].float() for p in parts) / 3
    assert soup["fc.weight"].dtype == torch.bfloat16 and torch.equal(soup["fc.weight"], mean.bfloat16())
    assert torch.equal(soup["d2t"], parts[0]["d2t"]) and torch.equal(soup["t2d"], parts[0]["t2d"])
    assert json.loads((tmp_path / "soup" / "config.json").read_text()) == {"draft_vocab_size": 3}


def test_other_vocabularies_or_configs_are_refused(tmp_path):
    a = export(tmp_path / "a", 0)
    with pytest.raises(ValueError, match="d2t"):
        avg.average([a, export(tmp_path / "b", 1, d2t=(0, 1, 3))])
    with pytest.raises(ValueError, match="config"):
        avg.average([a, export(tmp_path / "c", 2, config={"draft_vocab_size": 4})])
