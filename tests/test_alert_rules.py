"""deploy/prometheus and deploy/grafana: the rules pass `promtool check rules`, their unit tests
(deploy/prometheus/tests/*.yml) pass `promtool test rules` and test every alert firing and quiet,
the dashboard's queries parse, and every metric the rules, the dashboard and their docs name is
one that serve (Metrics) or the gateway (GatewayMetrics) exports, so a rename fails here."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from thermostat.api.metrics import Metrics
from thermostat.gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "thermostat-rules.yml"
UNIT_TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "thermostat-dashboard.json"
DOCS = PROMETHEUS / "README.md"
SEVERITIES = {"info", "warning", "critical"}
METRIC_NAME = re.compile(r"\bthermostat_[a-z0-9_]*[a-z0-9]")  # recorded series use `thermostat:`


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: run tools/setup.sh (installs Debian's prometheus package)")
    return path


def promtool_ok(promtool: str, *args: str) -> str:
    proc = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    return output


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def alerts() -> dict[str, dict[str, Any]]:
    """The alerting rules by name."""
    groups = load(RULES)["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def seconds(duration: str) -> int:
    """A Prometheus duration (15m, 1h30m) in seconds."""
    parts = re.findall(r"(\d+)([smhd])", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[u] for n, u in parts)


def test_rules_pass_promtool_check(promtool):
    out = promtool_ok(promtool, "check", "rules", str(RULES))
    assert "SUCCESS" in out


@pytest.mark.parametrize("path", UNIT_TESTS, ids=lambda p: p.name)
def test_rule_unit_tests_pass(promtool, path):
    assert load(path)["rule_files"] == ["../thermostat-rules.yml"]
    promtool_ok(promtool, "test", "rules", str(path))


def test_every_alert_is_tested_firing_and_quiet():
    """Each alert has a case where it fires and one where it does not, at least its `for` in."""
    rules = alerts()
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in UNIT_TESTS:
        for test in load(path)["tests"]:
            for case in test.get("alert_rule_test") or []:
                name = case["alertname"]
                assert name in rules, f"{path.name}: no alert {name}"
                if case.get("exp_alerts"):
                    fires.add(name)
                elif seconds(case["eval_time"]) >= seconds(rules[name].get("for", "0s")):
                    quiet.add(name)
    assert UNIT_TESTS
    assert sorted(set(rules) - fires) == [], "never tested firing"
    assert sorted(set(rules) - quiet) == [], "never tested quiet"


def test_alerts_say_what_and_which_command():
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["annotations"]["summary"], name
        assert "`thermostat " in rule["annotations"]["description"], name


def test_dashboard_parses_and_its_queries_are_promql(promtool, tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    exprs = []
    for panel in panels:
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            exprs += [t["expr"] for t in panel["targets"]]
    # Grafana's variables as Prometheus would see them once substituted.
    subs = {"$__rate_interval": "5m", "$job": ".*", "$instance": ".*"}
    for old, new in subs.items():
        exprs = [e.replace(old, new) for e in exprs]
    rules = [{"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    promtool_ok(promtool, "check", "rules", str(path))


def exported() -> set[str]:
    """Every metric name serve and the gateway put on the wire: each family's TYPE name and, for
    a histogram, its _bucket, _count and _sum series."""
    names: set[str] = set()
    for metrics in (Metrics(), GatewayMetrics()):
        for line in metrics.render(None).decode().splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                names.add(name)
                if kind == "histogram":
                    names.update(name + suffix for suffix in ("_bucket", "_count", "_sum"))
    return names


@pytest.mark.parametrize(
    "path", [RULES, *UNIT_TESTS, DASHBOARD, DOCS], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_metric_named_is_exported(path):
    used = set(METRIC_NAME.findall(path.read_text()))
    assert used, f"{path}: no metric names found"
    assert sorted(used - exported()) == []
