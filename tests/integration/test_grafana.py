"""docs/grafana/kvscope.json: an importable Grafana 10+ board that references only metrics a
KVScope engine serves on /metrics (scraped from a real tiny engine here) and, for the vllm:
names, only metrics vLLM 0.32 serves (VLLM_METRICS; tests/vllm/test_vllm.py checks that list
against a real vLLM), with the alert's threshold drawn."""
from __future__ import annotations

import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from kvscope_contract import protocol as p
from engine.model.engine import LLMEngine
from engine.model.model_loader import load_model
from engine.serve.server import start_in_thread
from tests.grafana_board import ALERTS, VLLM_METRICS, board, exprs

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                "bool", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or label_values(...)) reads."""
    expr = re.sub(r'"[^"]*"', "", expr)                       # strings (label matchers' values)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)          # label matchers, ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", expr)
    names = set(re.findall(r"[A-Za-z_:][\w:]*(?![\w:]*\s*\()", expr))
    return {n for n in names if n not in PROMQL_WORDS and not n.startswith("$")}


def test_the_board_is_a_grafana_10_dashboard_with_the_alert_threshold_drawn():
    b = board()
    assert b["schemaVersion"] >= 36 and b["uid"] and b["title"]
    assert {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"} in b["__requires"]
    ids = [panel["id"] for panel in b["panels"]]
    assert len(ids) == len(set(ids))
    ds = [v for v in b["templating"]["list"] if v["type"] == "datasource"]
    assert ds and ds[0]["query"] == "prometheus"
    for panel in b["panels"]:  # every query on the chosen data source, every panel placed
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        assert all(t["datasource"]["uid"] == "${datasource}" and t["expr"] for t in panel["targets"])
    titles = " ".join(panel["title"] for panel in b["panels"]).lower()
    for what in ("kv-cache usage", "blocks", "hit rate", "preemptions", "running and waiting by reason",
                 "throughput", "cached prompt tokens", "block lifetime", "idle time before eviction", "reuse gap",
                 "blocks by tier", "moves between tiers"):
        assert what in titles, what
    # the alert's threshold, as alerts.yml says it, drawn on the usage panel and the blocks panel
    threshold = float(re.search(r"vllm:kv_cache_usage_perc > ([\d.]+)", ALERTS.read_text()).group(1))
    usage = next(panel for panel in b["panels"] if panel["title"] == "KV-cache usage by engine")
    custom = usage["fieldConfig"]["defaults"]["custom"]
    assert custom["thresholdsStyle"]["mode"] in ("line", "line+area", "dashed", "line+area+dashed")
    assert threshold in [s["value"] for s in usage["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    blocks = next(panel for panel in b["panels"] if "blocks" in panel["title"].lower())
    assert f"{threshold} * kvscope_device_blocks" in " ".join(t["expr"] for t in blocks["targets"])


def test_every_series_on_the_board_and_every_alert_names_its_engine():
    """Two engines serving the same model draw apart: each legend names the instance, and no query
    sums engines together (an aggregation keeps `instance`; the live Prometheus test checks the
    label on every series); every alert's summary says which instance."""
    for panel in board()["panels"]:
        for t in panel["targets"]:
            assert "{{instance}}" in t["legendFormat"], (panel["title"], t["legendFormat"])
            for grouping in re.findall(r"\b(?:sum|max|min|avg)\s+by\s*\(([^)]*)\)", t["expr"]):
                assert "instance" in grouping, (panel["title"], t["expr"])
            assert not re.search(r"\b(?:sum|max|min|avg)\s*\(", t["expr"]), (panel["title"], t["expr"])
            assert 'instance=~"$instance"' in t["expr"], (panel["title"], t["expr"])
    alerts = re.findall(r"- alert: (\w+).*?summary: \"([^\"]*)\"", ALERTS.read_text(), re.S)
    assert len(alerts) == 5
    for name, summary in alerts:
        assert "$labels.instance" in summary, name


def test_metric_names_are_read_off_promql():
    assert metric_names('rate(vllm:prefix_cache_hits_total{model_name=~"$m"}[$__rate_interval]) / '
                        'sum by (model_name) (rate(x_total[5m]))') == {"vllm:prefix_cache_hits_total", "x_total"}
    assert metric_names("0.9 * kvscope_device_blocks") == {"kvscope_device_blocks"}


@pytest.fixture(scope="module")
def served() -> set[str]:
    """Every sample name a real tiny engine serves on /metrics."""
    engine = LLMEngine(EngineConfig(model="tiny", pool=p.PoolConfig(num_device_blocks=32)), load_model("tiny"))
    srv = start_in_thread(engine)
    try:
        with urllib.request.urlopen(srv.url.replace("ws://", "http://") + "metrics", timeout=30) as r:
            text = r.read().decode()
    finally:
        srv.stop()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_every_metric_on_the_board_is_served_by_the_engine_and_vllm(served):
    names = set().union(*map(metric_names, exprs(board())))
    assert {"vllm:kv_cache_usage_perc", "kvscope_free_blocks", "vllm:num_preemptions_total"} <= names
    assert names <= served, names - served
    vllm_names = {n for n in names if n.startswith("vllm:")}
    assert vllm_names <= VLLM_METRICS, vllm_names - VLLM_METRICS
    assert names - vllm_names <= {n for n in served if n.startswith("kvscope_")}
