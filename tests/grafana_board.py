"""docs/grafana/kvscope.json and docs/prometheus/alerts.yml as the monitoring tests read them, and
the vllm: metrics vLLM 0.32 serves (tests/vllm/test_vllm.py checks that list against a real vLLM)."""
from __future__ import annotations

import json
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
BOARD = ROOT / "docs" / "grafana" / "kvscope.json"
ALERTS = ROOT / "docs" / "prometheus" / "alerts.yml"
# what vLLM 0.32 (v1 engine) serves on /metrics and the board reads (samples, counters with _total;
# the residency histograms with --kv-cache-metrics)
VLLM_METRICS = {"vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                "vllm:num_requests_waiting_by_reason", "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                "vllm:prompt_tokens_cached_total", "vllm:generation_tokens_total",
                *(f"vllm:kv_block_{h}_seconds_{part}" for h in ("lifetime", "idle_before_evict", "reuse_gap")
                  for part in ("bucket", "sum", "count"))}


def board() -> dict:
    return json.loads(BOARD.read_text())


def exprs(b: dict) -> list[str]:
    out = [t["expr"] for panel in b["panels"] for t in panel["targets"]]
    out += [v["definition"] for v in b["templating"]["list"] if v["type"] == "query"]
    return out
