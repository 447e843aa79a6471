"""Numbers measured on other engines: the accept length read from a running server's Prometheus
metrics. SGLang exports the gauge `sglang:spec_accept_length` (τ, bonus counted); vLLM the counters
`vllm:spec_decode_num_drafts_total` and `vllm:spec_decode_num_accepted_tokens_total`, from which
τ = 1 + accepted / drafts; eaglet's server uses vLLM's names with the `eaglet:` prefix."""
from __future__ import annotations

import urllib.error
import urllib.request

from ..errors import InvalidInput


def accept_length_from_metrics(text: str) -> tuple[float, str]:
    """(τ, which metrics it came from) from Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                values[s.name] = values.get(s.name, 0.0) + s.value  # summed over label sets
    except ValueError as e:
        raise InvalidInput(f"not Prometheus metrics text ({e})") from None
    if "sglang:spec_accept_length" in values:
        return values["sglang:spec_accept_length"], "sglang:spec_accept_length"
    for prefix in ("vllm", "eaglet"):
        drafts = values.get(f"{prefix}:spec_decode_num_drafts_total", values.get(f"{prefix}:spec_decode_num_drafts"))
        acc = values.get(f"{prefix}:spec_decode_num_accepted_tokens_total",
                         values.get(f"{prefix}:spec_decode_num_accepted_tokens"))
        if drafts is not None and acc is not None:
            if drafts == 0:
                raise InvalidInput(f"{prefix} reports no speculative drafts yet; send it some requests first")
            return 1.0 + acc / drafts, f"1 + {prefix}:spec_decode_num_accepted_tokens_total / num_drafts_total"
    raise InvalidInput("no speculation metrics found (expected sglang:spec_accept_length or "
                       "vllm:spec_decode_num_drafts_total and vllm:spec_decode_num_accepted_tokens_total)")


def fetch_metrics(url: str, timeout: float = 10.0) -> str:
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise InvalidInput(f"cannot read metrics from {url} ({e})") from None
