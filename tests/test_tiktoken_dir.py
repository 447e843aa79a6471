"""Kimi-K2's tokenizer files (tiktoken.model + tokenizer_config.json, no tokenizer.json), written here
from BPE ranks trained on a small mixed corpus: eaglet's tokenizer encodes exactly as tiktoken with
Kimi's pattern and the same special tokens, decodes back, and applies the chat template."""
import base64
import json
from collections import Counter

import pytest

from eaglet.config import ModelConfig
from eaglet.errors import ModelLoadError
from eaglet.tiktoken_dir import KIMI_PATTERN
from eaglet.tokenizer import Tokenizer

tiktoken = pytest.importorskip("tiktoken")

CORPUS = ["Hello world, hello there!", "中文English混合 北京市 Pascal", "1234567890 apples and 42 pears",
          "It's the model's turn; they'll see.\n\nNew paragraph   with  spaces", "你好世界，你好！"] * 3
SPECIAL = {300: "<|im_end|>", 301: "<|im_user|>", 302: "<|im_assistant|>", 305: "<|im_system|>"}


def train_ranks(merges: int = 40) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair merged, repeatedly."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for w in " ".join(CORPUS).split(" ")]
    for _ in range(merges):
        pairs = Counter((a, b) for w in words for a, b in zip(w, w[1:]))
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks[a + b] = len(ranks)
        words = [merge(w, a, b) for w in words]
    return ranks


def merge(w: list[bytes], a: bytes, b: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(w):
        if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(w[i])
            i += 1
    return out


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi")
    ranks = train_ranks()
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in SPECIAL.items()},
        "eos_token": "<|im_end|>", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "chat_template": "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|im_assistant|>{% endif %}"}))
    assert len(ranks) == 296  # the special ids (300 on) leave a gap: reserved placeholders fill it
    return d, ranks


def test_encodes_as_tiktoken_with_kimis_pattern(kimi_dir):
    d, ranks = kimi_dir
    tok = Tokenizer.from_dir(d, ModelConfig.from_hf(dict(model_type="llama", vocab_size=306, hidden_size=8,
                                                         intermediate_size=8, num_hidden_layers=1,
                                                         num_attention_heads=1)))
    ref = tiktoken.Encoding("kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                            special_tokens={c: i for i, c in SPECIAL.items()})
    for text in CORPUS[:5] + ["中文English混合<|im_end|>", "  trailing\n\n", "汉字abc DEF's"]:
        assert tok.ids(text, special=False) == ref.encode(text, allowed_special="all"), text
        assert tok.decode(tok.ids(text, special=False), skip_special=False) == text
    # Kimi's first branch: Han runs apart from the Latin one (o200k's letter class would keep one word)
    assert len(tok.hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str("中文English混合")) == 3
    assert tok.eos_ids == {300} and tok.vocab_size == 306
    chat = tok.apply_chat([{"role": "user", "content": "hello"}])
    assert chat[0] == 301 and chat[-1] == 302 and 300 in chat  # <|im_user|> ... <|im_end|><|im_assistant|>


def test_special_ids_inside_the_ranks_are_refused(kimi_dir, tmp_path):
    d, _ = kimi_dir
    (tmp_path / "tiktoken.model").write_bytes((d / "tiktoken.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"12": {"content": "<x>"}}}))
    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=306, hidden_size=8, intermediate_size=8,
                                   num_hidden_layers=1, num_attention_heads=1))
    with pytest.raises(ModelLoadError, match="special token id 12 falls inside the 296 BPE ranks"):
        Tokenizer.from_dir(tmp_path, cfg)
