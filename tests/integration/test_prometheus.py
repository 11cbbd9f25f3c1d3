"""docs/prometheus/: the alert rules checked and unit-tested by promtool, and a real Prometheus
(Debian's package, `make test` installs it) scraping a real engine server and firing the
free-blocks alert when a scenario fills the pool, and the not-scraped alert when it dies.

The live test evaluates a copy of alerts.yml whose `for:` durations are cut to 2 s (the
expressions are the file's own, untouched): a minute-long wait per alert has no place in
`make test`, and the minute itself is what `promtool test rules` proves on made-up series
(alerts_test.yml: pending at 1m30s, firing at 2m15s)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from app.link.launcher import ServerProcess
from tests.protocol_client import Client
from tests.grafana_board import board
from kvscope_contract.ready import free_port
from tests.waiting import wait

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "prometheus"
PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
pytestmark = pytest.mark.skipif(not (PROMTOOL and PROMETHEUS),
                                reason="Debian's prometheus package is not installed (make test installs it)")
POOL = 16  # device blocks: the alert fires above 90% held, 15 of them


def test_promtool_checks_the_rules_and_the_config():
    for args in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"]):
        r = subprocess.run([PROMTOOL, *args], cwd=RULES, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 5 rules found" in r.stdout + r.stderr


def test_promtool_unit_tests_the_rules(tmp_path):
    r = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=RULES, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    # and the tests can fail: a threshold of 96% misses the 95% pool they feed it, one of 70% the
    # two thirds of misses evicted
    for rule, wrong, alert in (
            ("vllm:kv_cache_usage_perc > 0.90", "vllm:kv_cache_usage_perc > 0.96", "KVCacheFreeBlocksLow"),
            ("          > 0.5\n", "          > 0.7\n", "PrefixCacheMissesMostlyEvicted")):
        for name in ("alerts.yml", "alerts_test.yml"):
            shutil.copy(RULES / name, tmp_path / name)
        rules = tmp_path / "alerts.yml"
        assert rules.read_text().count(rule) == 1
        rules.write_text(rules.read_text().replace(rule, wrong))
        r = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode != 0 and alert in r.stdout + r.stderr


def api(base: str, path: str, **params) -> dict:
    url = f"{base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


def wait_for(what: str, cond, timeout: float = 120.0):
    return wait(cond, timeout, what)


def alert(base: str, name: str, state: str) -> dict | None:
    return next((a for a in api(base, "alerts")["alerts"]
                 if a["labels"]["alertname"] == name and a["state"] == state), None)


def start_engine() -> ServerProcess:
    proc = ServerProcess("engine.serve.server", ["--model", "tiny", "--port", "0", "--block-size", "16",
                                                 "--num-device-blocks", str(POOL), "--num-host-blocks", "8"]).start()
    assert proc.wait_ready(300), "\n".join(proc.tail(30))
    return proc


def legend(fmt: str, labels: dict[str, str]) -> str:
    """A Grafana legend format filled from a series' labels."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def test_a_real_prometheus_scrapes_two_engines_and_fires_the_alerts_by_engine(tmp_path):
    """Two engines serving the same model: the board draws each apart (every series of every query
    carries its instance, and no two series share a legend), and the alert names the one that fills."""
    engine, idle = start_engine(), start_engine()
    engine_port, idle_port = (urllib.parse.urlsplit(e.url).port for e in (engine, idle))
    busy, quiet = f"127.0.0.1:{engine_port}", f"127.0.0.1:{idle_port}"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    rules = re.sub(r"(?m)^(\s+)for: \S+$", r"\1for: 2s", (RULES / "alerts.yml").read_text())
    assert rules.count("for: 2s") == 5
    (tmp_path / "alerts.yml").write_text(rules)
    (tmp_path / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [alerts.yml]
scrape_configs:
  - job_name: kvscope
    static_configs: [{{targets: ["{busy}", "{quiet}"]}}]
""")
    prom_log = (tmp_path / "prometheus.log").open("w")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            cwd=tmp_path, stdout=prom_log, stderr=subprocess.STDOUT)
    c = None
    try:
        # it scrapes KVScope's metrics: both targets up and the pool's size is what each engine serves
        wait_for("both kvscope targets up", lambda: prom.poll() is None and _ready(base) and sum(
            t["health"] == "up" for t in api(base, "targets")["activeTargets"]) == 2)
        blocks = wait_for("kvscope_device_blocks scraped from both", lambda: len(
            r := api(base, "query", query="kvscope_device_blocks")["result"]) == 2 and r)
        assert {float(b["value"][1]) for b in blocks} == {POOL} and {b["metric"]["job"] for b in blocks} == {"kvscope"}
        assert {b["metric"]["instance"] for b in blocks} == {busy, quiet}
        names = set(api(base, "label/__name__/values"))
        assert {"vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                "kvscope_free_blocks", "kvscope_slot_utilisation", "vllm:kv_block_lifetime_seconds_bucket",
                "vllm:num_requests_waiting_by_reason", "vllm:prompt_tokens_cached_total",
                "kvscope_prefix_cache_miss_tokens_total"} <= names
        evaluations = set()  # a few evaluations of an empty pool: no alert
        wait_for("three rule evaluations", lambda: evaluations.add(api(base, "rules")["groups"][0]["lastEvaluation"])
                 or len(evaluations) > 3)
        assert not [a for a in api(base, "alerts")["alerts"] if a["labels"]["alertname"] == "KVCacheFreeBlocksLow"]

        # a scenario: a shared prompt twice (prefix hits, blocks cached then reused), then long requests
        # stepped until 15 of the 16 blocks are held, then paused
        c = Client(f"ws://127.0.0.1:{engine_port}/")
        for i in range(2):
            ack = c.request(op="submit", request_id=f"warm{i}",
                            prompt="the KV cache holds what attention has seen " * 3, max_tokens=4)
            c.sync(c.finished(ack["seq_ids"][0]))
        c.request(op="pause")
        for i in range(4):
            ack = c.request(op="submit", request_id=f"fill{i}", prompt="paged attention keeps keys in blocks " * 12,
                            max_tokens=150, ignore_eos=True)
            assert ack["type"] == "ack", ack
        while c.state.counts().used < POOL - 1:
            steps = c.kinds["step"]
            c.request(op="step", count=1)
            c.until(lambda: c.kinds["step"] > steps)
        held = c.state.counts().used
        assert c.kinds["evict"] > 0 and c.kinds["prefix_hit"] > 0  # residency samples of every kind
        firing = wait_for("KVCacheFreeBlocksLow firing", lambda: alert(base, "KVCacheFreeBlocksLow", "firing"))
        assert float(firing["value"]) == pytest.approx(held / POOL)
        assert firing["labels"]["model_name"] and firing["labels"]["severity"] == "warning"
        # the engine that filled, named; the idle one (same model) does not fire
        assert firing["labels"]["instance"] == busy and firing["annotations"]["summary"].startswith(busy)
        assert [a["labels"]["instance"] for a in api(base, "alerts")["alerts"]
                if a["labels"]["alertname"] == "KVCacheFreeBlocksLow"] == [busy]
        usage = {r["metric"]["instance"]: float(r["value"][1])
                 for r in api(base, "query", query="vllm:kv_cache_usage_perc")["result"]}
        assert usage == {busy: pytest.approx(held / POOL), quiet: 0}
        # every query of the Grafana board (docs/grafana/kvscope.json) answers on these metrics, each
        # series named by its engine: no two share a legend, and both engines are drawn
        drawn = set()
        for panel in board()["panels"]:
            for t in panel["targets"]:
                expr = t["expr"].replace("$__rate_interval", "30s").replace("$model_name", ".*") \
                    .replace("$instance", ".*")
                result = wait_for(f"{panel['title']}: {expr}", lambda: api(base, "query", query=expr)["result"], 30)
                assert all(r["metric"].get("instance") in (busy, quiet) for r in result), (expr, result)
                legends = [legend(t["legendFormat"], r["metric"]) for r in result]
                assert len(set(legends)) == len(legends), (panel["title"], legends)
                drawn |= {r["metric"]["instance"] for r in result}
        assert drawn == {busy, quiet}
        for v in board()["templating"]["list"]:
            if v["type"] == "query":
                label = re.search(r",\s*(\w+)\)$", v["definition"]).group(1)
                want = [firing["labels"]["model_name"]] if label == "model_name" else sorted([busy, quiet])
                assert sorted(api(base, f"label/{label}/values")) == want
        # the residency histograms: the busy engine's evictions and hits, counted
        counts = {r["metric"]["instance"]: float(r["value"][1]) for r in api(
            base, "query", query="vllm:kv_block_idle_before_evict_seconds_count")["result"]}
        assert counts == {busy: c.kinds["evict"], quiet: 0}

        # the requests go: the pool empties and the alert resolves
        for i in range(4):
            c.request(op="abort", request_id=f"fill{i}")
        c.request(op="step", count=1)
        c.until(lambda: c.state.counts().used == 0)
        wait_for("KVCacheFreeBlocksLow resolved", lambda: not [
            a for a in api(base, "alerts")["alerts"] if a["labels"]["alertname"] == "KVCacheFreeBlocksLow"])
        c.close()
        c = None

        # the engine dies: no scrape answers, the not-scraped alert fires for it alone
        assert not alert(base, "KVScopeEngineNotScraped", "firing")
        engine.stop()
        down = wait_for("KVScopeEngineNotScraped firing", lambda: alert(base, "KVScopeEngineNotScraped", "firing"))
        assert down["labels"]["instance"] == busy and busy in down["annotations"]["summary"]
    except BaseException:
        for name, proc in (("engine", engine), ("idle engine", idle)):
            print(f"{name} log:\n", "\n".join(proc.tail(60)))
        print("prometheus log:\n", (tmp_path / "prometheus.log").read_text()[-3000:])
        raise
    finally:
        if c is not None:
            c.close()
        engine.stop()
        idle.stop()
        if prom.poll() is None:
            prom.terminate()
            prom.wait(timeout=60)


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False
