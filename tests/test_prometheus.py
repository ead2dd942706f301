"""The shipped Prometheus config, alert rules and Grafana dashboard against a real
Prometheus (the Debian package) scraping a real inferd: promtool accepts the rules and
the exposition, every dashboard and alert expression evaluates, the rules are healthy,
and the request rate shows the traffic that was sent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ROOT, InferdServer, arithmetic_model, free_port, push_source

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (shutil.which("prometheus") and shutil.which("promtool")),
        reason="prometheus/promtool not installed (scripts/ensure-services.sh installs them)",
    ),
]
DEPLOY = ROOT / "deploy"


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "inferd.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    # Grafana's variables, as it would fill them in
    return [e.replace("$__rate_interval", "1m").replace("$model", ".*") for e in exprs]


def alert_expressions() -> list[str]:
    import yaml

    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [r["expr"] for group in rules["groups"] for r in group["rules"]]


def test_promtool_accepts_the_rules_and_the_config():
    rules = subprocess.run(
        ["promtool", "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = subprocess.run(
        ["promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert config.returncode == 0, config.stdout + config.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    data = tmp_path_factory.mktemp("prom-inferd")
    push_source(data, "plus", arithmetic_model("x + 1"))
    server = InferdServer(data, workers=1, env={"INFERD_INFERENCE_LOG__FLUSH_INTERVAL_S": "0.2"})
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def prometheus(server: InferdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("prometheus")
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", folder / "alerts.yml")
    config = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    config = config.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    config = config.replace("scrape_interval: 15s", "scrape_interval: 1s")
    config = config.replace("evaluation_interval: 15s", "evaluation_interval: 1s")
    (folder / "prometheus.yml").write_text(config)
    port = free_port()
    log = open(folder / "prometheus.log", "w")  # noqa: SIM115 -- closed below
    process = subprocess.Popen(
        ["prometheus", f"--config.file={folder / 'prometheus.yml'}",
         f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=folder, env=os.environ,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError((folder / "prometheus.log").read_text()[-3000:])
        yield url
    finally:
        process.terminate()
        process.wait(20)
        log.close()


def query(url: str, expr: str) -> dict:
    reply = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = reply.json()
    assert reply.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]


def wait_for(url: str, expr: str, timeout_s: float = 30) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = query(url, expr)["result"]
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"{expr} stayed empty for {timeout_s}s")


def test_a_real_prometheus_evaluates_the_dashboard_and_the_alerts(
    server: InferdServer, prometheus: str
):
    metrics = httpx.get(f"{server.url}/metrics").text
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=metrics, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    wait_for(prometheus, 'up{job="inferd"} == 1')
    for i in range(40):  # traffic over a few scrapes
        server.client.post("/api/v1/models/plus/predict", json={"inputs": [{"x": float(i)}]})
        time.sleep(0.05)
    rate = wait_for(prometheus, 'sum(rate(inferd_requests_total{model="plus",code="200"}[1m])) > 0')
    assert float(rate[0]["value"][1]) > 0
    for expr in dashboard_expressions() + alert_expressions():
        query(prometheus, expr)  # evaluates without error (empty where no GPU or generation)
    p99 = query(
        prometheus,
        "histogram_quantile(0.99, sum by (le) (rate(inferd_request_duration_seconds_bucket[1m])))",
    )["result"]
    assert p99 and 0 < float(p99[0]["value"][1]) < 1.0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        groups = httpx.get(f"{prometheus}/api/v1/rules").json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules):
            break
        time.sleep(0.5)
    assert len(rules) == len(alert_expressions())
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    firing = [r["name"] for r in rules if r["state"] == "firing"]
    assert firing == []  # a healthy server raises no alert
