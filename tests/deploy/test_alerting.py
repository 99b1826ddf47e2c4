"""deploy/prometheus/alerts.yml, deploy/alertmanager/alertmanager.yml and deploy/RUNBOOK.md, checked for real.

* `promtool test rules` fires every alert on made-up series and leaves it quiet where it must: a
  lost node's alerts carry the labels the inhibition matches on, a client's INVALID_ARGUMENT never
  fires ZenErrors, a burst of ABORTED does not either.
* A real Alertmanager (Debian package prometheus-alertmanager) with the shipped inhibit_rules is
  given exactly the alerts those unit tests expect, and holds back the per-peer ones of a lost node
  (in its namespace only); `amtool check-config` passes.
* End to end: three real daemons, a real Prometheus evaluating alerts.yml (each `for` cut 30-fold)
  and sending to a real Alertmanager with the shipped config: one daemon is killed, and the webhook
  hears ZenDaemonDown for its node, never ZenPeerDown or ZenNodeLost.
* Every alert links a section of deploy/RUNBOOK.md that exists and says what it means, how to
  confirm and what to do; every `zend` command the runbook shows parses with zend's own parser.
"""

from __future__ import annotations

import datetime
import http.server
import json
import re
import shlex
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import pytest
import yaml

from tests.daemon.prometheus import PrometheusServer, end_process, prometheus_binary
from tests.helpers import poll_for
from zend.cluster.local import free_port

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTMANAGER_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
RUNBOOK = ROOT / "deploy" / "RUNBOOK.md"
RUNBOOK_BASE = "https://github.com/zen-sync/zen/blob/main/deploy/RUNBOOK.md#"
PROMTOOL = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
AMTOOL = shutil.which("amtool") or ("/usr/bin/amtool" if Path("/usr/bin/amtool").exists() else None)
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package 'prometheus'; "
                                                               ".ci/run installs it)")
needs_alertmanager = pytest.mark.skipif(
    ALERTMANAGER is None or AMTOOL is None,
    reason="needs alertmanager and amtool (Debian package 'prometheus-alertmanager'; .ci/run installs it)")
needs_prometheus = pytest.mark.skipif(
    prometheus_binary() is None, reason="needs the prometheus server binary (Debian package 'prometheus')")


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
            if "alert" in rule]


# ---------------------------------------------------------------------- promtool unit tests


def _alert(name: str, labels: dict[str, str], summary: str, description: str) -> dict[str, Any]:
    return {"exp_labels": labels, "exp_annotations": {"summary": summary, "description": description,
                                                      "runbook_url": RUNBOOK_BASE + name.lower()}}


def _test(eval_time: str, name: str, *alerts: tuple[dict[str, str], str, str]) -> dict[str, Any]:
    return {"eval_time": eval_time, "alertname": name, "exp_alerts": [_alert(name, *a) for a in alerts]}


def _zend(instance: str, **labels: str) -> dict[str, str]:
    return {"job": "zend", "instance": f"{instance}:7071", **labels}


def _series(metric: str, labels: dict[str, str], values: str) -> dict[str, str]:
    return {"series": metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


DOWN = ("Prometheus has failed to scrape the zend daemon at {} for over a minute. Trainers on that node cannot "
        "synchronise, and every other node's steps for the same jobs stall until the step timeout.")
PEER_DOWN = ("The data-plane link from the daemon at {} to peer node {} has been down for three minutes; steps "
             "that need that peer fail with UNAVAILABLE.")
NODE_LOST = ("Every daemon that reports a link to node {} has had it down for two minutes. Steps of every job that "
             "spans that node fail or wait until it is back (or, with --elastic, until the others form a "
             "generation without it).")


def _peer_down(instance: str, node: str, peer: str) -> tuple[dict[str, str], str, str]:
    return ({"severity": "critical", **_zend(instance, node=node, peer=peer, lost_node=peer)},
            f"zend {instance}:7071 (node {node}) lost its link to node {peer}",
            PEER_DOWN.format(f"{instance}:7071", peer))


def _node_lost(node: str) -> tuple[dict[str, str], str, str]:
    return ({"severity": "critical", "job": "zend", "peer": node, "node": node, "lost_node": node},
            f"zen node {node} is lost: no peer reaches it", NODE_LOST.format(node))


# Three nodes; zend-2's daemon dies at 2m (its series end: staleness markers), zend-9 was never scraped.
LOST_NODE = {
    "interval": "1m",
    "input_series": [
        *(_series("up", _zend(f"zend-{n}"), "1x70") for n in (0, 1)),
        _series("up", _zend("zend-2"), "1 1 0x70"),
        _series("up", _zend("zend-9"), "0x70"),
        *(_series("zen_node_info", _zend(f"zend-{n}", node=str(n)), "1x70") for n in (0, 1)),
        _series("zen_node_info", _zend("zend-2", node="2"), "1 1 stale"),
        _series("zen_peer_up", _zend("zend-0", peer="1"), "1x70"),
        _series("zen_peer_up", _zend("zend-1", peer="0"), "1x70"),
        *(_series("zen_peer_up", _zend(f"zend-{n}", peer="2"), "1 1 0x70") for n in (0, 1)),
        *(_series("zen_peer_up", _zend("zend-2", peer=str(n)), "1 1 stale") for n in (0, 1)),
    ],
    "alert_rule_test": [
        # zend-9 never reported a rank: it fires all the same, with no node to inhibit by
        _test("2m", "ZenDaemonDown", ({"severity": "critical", **_zend("zend-9")}, "zend daemon zend-9:7071 is down",
                                      DOWN.format("zend-9:7071"))),
        _test("3m", "ZenDaemonDown",
              ({"severity": "critical", **_zend("zend-2", node="2", lost_node="2")},
               "zend daemon zend-2:7071 (node 2) is down", DOWN.format("zend-2:7071")),
              ({"severity": "critical", **_zend("zend-9")}, "zend daemon zend-9:7071 is down",
               DOWN.format("zend-9:7071"))),
        # an hour after its last report the rank is forgotten: still down, no longer named
        _test("63m", "ZenDaemonDown",
              ({"severity": "critical", **_zend("zend-2")}, "zend daemon zend-2:7071 is down",
               DOWN.format("zend-2:7071")),
              ({"severity": "critical", **_zend("zend-9")}, "zend daemon zend-9:7071 is down",
               DOWN.format("zend-9:7071"))),
        _test("3m", "ZenNodeLost"),  # down since 2m, not for 2m yet
        _test("4m", "ZenNodeLost", _node_lost("2")),
        _test("4m", "ZenPeerDown"),  # not for 3m yet: ZenDaemonDown and ZenNodeLost fire first
        _test("5m", "ZenPeerDown", _peer_down("zend-0", "0", "2"), _peer_down("zend-1", "1", "2")),
    ],
}

# Three daemons, all scraped; zend-2's data plane is cut off from 1m.
PARTITION = {
    "interval": "1m",
    "input_series": [
        *(_series("up", _zend(f"zend-{n}"), "1x10") for n in range(3)),
        *(_series("zen_node_info", _zend(f"zend-{n}", node=str(n)), "1x10") for n in range(3)),
        _series("zen_peer_up", _zend("zend-0", peer="1"), "1x10"),
        _series("zen_peer_up", _zend("zend-1", peer="0"), "1x10"),
        *(_series("zen_peer_up", _zend(f"zend-{n}", peer="2"), "1 0x10") for n in (0, 1)),
        *(_series("zen_peer_up", _zend("zend-2", peer=str(n)), "1 0x10") for n in (0, 1)),
    ],
    "alert_rule_test": [
        _test("5m", "ZenDaemonDown"),
        _test("5m", "ZenNodeLost", _node_lost("2")),  # nodes 0 and 1 still reach each other
        _test("5m", "ZenPeerDown", _peer_down("zend-0", "0", "2"), _peer_down("zend-1", "1", "2"),
              _peer_down("zend-2", "2", "0"), _peer_down("zend-2", "2", "1")),
    ],
}


def _errors(instance: str, code: str, value: str) -> tuple[dict[str, str], str, str]:
    return ({"severity": "warning", **_zend(instance, code=code)}, f"zend {instance}:7071: {code} errors",
            f"The daemon at {instance}:7071 has been failing requests or steps with {code} for 10 minutes "
            f"({value} per second).")


ERRORS = {
    "interval": "1m",
    "input_series": [
        # a fault that goes on: 3 a minute
        _series("zen_errors_total", _zend("zend-1", code="UNAVAILABLE", cause="fault"), "0+3x40"),
        # a client's mistake, 10 a second for 40 minutes: never ZenErrors
        _series("zen_errors_total", _zend("zend-0", code="INVALID_ARGUMENT", cause="client"), "0+600x40"),
        # a client's mistake at 3 a minute: under ZenClientErrors' threshold
        _series("zen_errors_total", _zend("zend-1", code="NOT_FOUND", cause="client"), "0+3x40"),
        # one burst of aborts (a generation change) at 2m: over within the window, never 10 minutes on end
        _series("zen_errors_total", _zend("zend-0", code="ABORTED", cause="fault"), "0 0 20x40"),
    ],
    "alert_rule_test": [
        _test("8m", "ZenErrors"),
        _test("12m", "ZenErrors", _errors("zend-1", "UNAVAILABLE", "0.05")),
        _test("40m", "ZenErrors", _errors("zend-1", "UNAVAILABLE", "0.05")),
        _test("12m", "ZenClientErrors"),
        _test("20m", "ZenClientErrors", (
            {"severity": "info", **_zend("zend-0", code="INVALID_ARGUMENT")},
            "zend zend-0:7071: callers keep getting INVALID_ARGUMENT",
            "Requests to the daemon at zend-0:7071 have been refused with INVALID_ARGUMENT for 15 minutes (10 per "
            "second): a trainer or client is misconfigured.")),
    ],
}


def _state(instance: str, state: str, values: str) -> dict[str, str]:
    return _series("zen_node_state", _zend(instance, state=state), values)


NODE_STATES_AND_PROCESS = {
    "interval": "1m",
    "input_series": [
        _state("zend-0", "changing", "0 1x40"),  # stuck from 1m
        _state("zend-1", "changing", "0 1 1 0x40"),  # a change of two minutes: fine
        _state("zend-1", "joining", "1x40"),
        _state("zend-2", "draining", "1x40"),
        _state("zend-0", "serving", "0x40"),
        # descriptors: zend-0 at 88% of its limit, zend-1 at 49%, Prometheus' own process is not a daemon
        _series("process_open_fds", _zend("zend-0"), "900x40"),
        _series("process_max_fds", _zend("zend-0"), "1024x40"),
        _series("process_open_fds", _zend("zend-1"), "500x40"),
        _series("process_max_fds", _zend("zend-1"), "1024x40"),
        _series("process_open_fds", {"job": "prometheus", "instance": "localhost:9090"}, "1000x40"),
        _series("process_max_fds", {"job": "prometheus", "instance": "localhost:9090"}, "1024x40"),
        # zend-0 starts three times in four minutes, zend-1 twice
        _series("process_start_time_seconds", _zend("zend-0"), "100 100 200 300 400 400x40"),
        _series("process_start_time_seconds", _zend("zend-1"), "100 200 300 300x40"),
    ],
    "alert_rule_test": [
        _test("5m", "ZenGenerationChangeStuck"),
        _test("7m", "ZenGenerationChangeStuck", (
            {"severity": "warning", **_zend("zend-0", state="changing")},
            "zend zend-0:7071: membership change not done after 5 minutes",
            "The daemon at zend-0:7071 left its generation over five minutes ago and has not formed the next: its "
            "trainers' steps are refused with ABORTED until it does.")),
        _test("9m", "ZenNodeJoining"),
        _test("11m", "ZenNodeJoining", (
            {"severity": "warning", **_zend("zend-1", state="joining")},
            "zend zend-1:7071: still joining its cluster after 10 minutes",
            "The daemon at zend-1:7071 started over ten minutes ago and has not joined its cluster: it refuses its "
            "trainers' steps with UNAVAILABLE.")),
        _test("29m", "ZenNodeDrained"),
        _test("31m", "ZenNodeDrained", (
            {"severity": "warning", **_zend("zend-2", state="draining")},
            "zend zend-2:7071: drained for over 30 minutes",
            "The daemon at zend-2:7071 was drained (zend status --drain) over 30 minutes ago and not undrained: it "
            "refuses new steps and sessions, so the jobs that span it cannot step.")),
        _test("4m", "ZenFileDescriptorsHigh"),
        _test("6m", "ZenFileDescriptorsHigh", (
            {"severity": "warning", **_zend("zend-0")},
            "zend zend-0:7071: 87.89% of its file descriptors open",
            "The daemon at zend-0:7071 has had over 80% of its descriptor limit open for five minutes; at the "
            "limit it cannot accept trainers, peers or scrapes.")),
        _test("5m", "ZenDaemonRestarting", (
            {"severity": "warning", **_zend("zend-0")},
            "zend zend-0:7071 restarted 3 times in 30 minutes",
            "The daemon at zend-0:7071 has started 3 times in the last 30 minutes: it is crashing or being killed "
            "(a liveness probe, the OOM killer).")),
        _test("40m", "ZenDaemonRestarting"),  # thirty quiet minutes later
    ],
}

STEPS_AND_MEMBERSHIP = {
    "interval": "1m",
    "input_series": [
        _series("zen_membership_generation", _zend("zend-0"), "1 1 2x5"),
        # steps stop at 3m with one still open
        _series("zen_steps_in_flight", _zend("zend-1"), "0 0 0 1x20"),
        _series("zen_tensor_steps_total", _zend("zend-1", scheme="zen"), "0+10x3 30x20"),
    ],
    "alert_rule_test": [
        _test("3m", "ZenMembershipChanged", (
            {"severity": "info", **_zend("zend-0")}, "zend zend-0:7071: cluster membership changed",
            "The membership generation on zend-0:7071 changed 1 times in the last 10 minutes: nodes joined or "
            "left.")),
        _test("7m", "ZenStepsStalled"),  # rate[5m] still sees steps
        _test("15m", "ZenStepsStalled", (
            {"severity": "warning", **_zend("zend-1")}, "zend zend-1:7071: steps open, none finishing",
            "1 steps have been open on zend-1:7071 with no step finished for 10 minutes; look for a stuck trainer "
            "or a peer that never submits.")),
    ],
}

# An hour of 60 steps a minute under 10 ms, then 30 minutes of steps between 1 and 2.5 s.
SYNC_TIME = {
    "interval": "1m",
    "input_series": [
        *(_series("zen_step_duration_seconds_bucket", {"instance": "zend-0:7071", "scheme": "zen", "le": le},
                  "0+60x65 3900x30") for le in ("0.01", "0.1", "1")),
        *(_series("zen_step_duration_seconds_bucket", {"instance": "zend-0:7071", "scheme": "zen", "le": le},
                  "0+60x95") for le in ("2.5", "+Inf")),
    ],
    "alert_rule_test": [
        _test("60m", "ZenSyncTimeRegression"),
        _test("60m", "ZenSyncTimeHigh"),
        _test("90m", "ZenSyncTimeRegression", (
            {"severity": "warning", "instance": "zend-0:7071"},
            "zend zend-0:7071: p99 step time more than doubled in an hour",
            "The 99th percentile of a trainer's step time in the daemon on zend-0:7071 is 2.485s, over twice what "
            "it was an hour ago. Look at the dashboard's phases (wait points at trainers, exchange at the network) "
            "and at push / pull imbalance.")),
        _test("90m", "ZenSyncTimeHigh", (
            {"severity": "warning", "instance": "zend-0:7071"}, "zend zend-0:7071: p99 step time above 1 s",
            "The 99th percentile of a trainer's step time in the daemon on zend-0:7071 has been 2.485s for 10 "
            "minutes (threshold 1 s).")),
    ],
}

ALERT_UNIT_TESTS = {
    "rule_files": [str(ALERTS)],
    "evaluation_interval": "1m",
    "tests": [LOST_NODE, PARTITION, ERRORS, NODE_STATES_AND_PROCESS, STEPS_AND_MEMBERSHIP, SYNC_TIME],
}


def expected(group: dict[str, Any], eval_time: str, *names: str) -> list[dict[str, str]]:
    """The labels of the alerts `group`'s unit test expects at `eval_time` (with their alertname)."""
    return [{"alertname": t["alertname"], **a["exp_labels"]} for t in group["alert_rule_test"]
            if t["eval_time"] == eval_time and t["alertname"] in names for a in t["exp_alerts"]]


@pytest.mark.daemon
@needs_promtool
def test_alert_rules_fire_on_made_up_series(tmp_path):
    tests = tmp_path / "alerts_test.yml"
    tests.write_text(json.dumps(ALERT_UNIT_TESTS, indent=1))  # JSON is YAML
    run = subprocess.run([PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    tested = {t["alertname"] for group in ALERT_UNIT_TESTS["tests"] for t in group["alert_rule_test"]}
    assert tested == {r["alert"] for r in alert_rules()}, "every alert rule has a unit test"
    fired = {t["alertname"] for group in ALERT_UNIT_TESTS["tests"] for t in group["alert_rule_test"]
             if t["exp_alerts"]}
    assert fired == tested, "every alert rule is seen firing"


@pytest.mark.inprocess
def test_a_client_mistake_never_fires_zen_errors():
    """What the promtool test above shows, stated: INVALID_ARGUMENT at 10/s is in its input, and no ZenErrors
    it expects is about anything but the UNAVAILABLE fault."""
    assert any("INVALID_ARGUMENT" in s["series"] and 'cause="client"' in s["series"] for s in ERRORS["input_series"])
    zen_errors = [t for t in ERRORS["alert_rule_test"] if t["alertname"] == "ZenErrors"]
    assert zen_errors and all(a["exp_labels"]["code"] == "UNAVAILABLE" for t in zen_errors for a in t["exp_alerts"])
    (rule,) = [r for r in alert_rules() if r["alert"] == "ZenErrors"]
    assert 'cause="fault"' in rule["expr"]


@pytest.mark.inprocess
def test_alert_rules_name_only_exported_metrics():
    """Every metric an alert or recording rule reads is one a daemon exports (or `up`): a renamed metric fails
    here before it fails in a live test."""
    from prometheus_client.metrics_core import Metric

    from zend.daemon.metrics import DaemonMetrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count"),
                "info": ("_info",)}

    def exported(family: Metric) -> set[str]:
        return {family.name + s for s in suffixes.get(family.type, ("",))}

    names = {n for family in DaemonMetrics(0).registry.collect() for n in exported(family)}
    text = ALERTS.read_text()
    used = set(re.findall(r"\b((?:zen|process|python)_[a-z_]*[a-z])\b", text)) - {"zen_job"}
    assert used and used <= names, f"not exported: {sorted(used - names)}"


# ---------------------------------------------------------------------- runbook


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_sections() -> dict[str, str]:
    """Anchor -> the text under that heading (to the next heading of the same or a higher level)."""
    text = RUNBOOK.read_text()
    heads = list(re.finditer(r"^(#{1,6}) (.+)$", text, re.MULTILINE))
    out = {}
    for i, m in enumerate(heads):
        level = len(m.group(1))
        end = next((h.start() for h in heads[i + 1:] if len(h.group(1)) <= level), len(text))
        out[github_anchor(m.group(2))] = text[m.end():end]
    return out


@pytest.mark.inprocess
def test_every_alert_links_its_runbook_section():
    sections = runbook_sections()
    for rule in alert_rules():
        url = rule["annotations"].get("runbook_url", "")
        assert url == RUNBOOK_BASE + rule["alert"].lower(), f"{rule['alert']}: runbook_url {url!r}"
        anchor = url.partition("#")[2]
        assert anchor in sections, f"{rule['alert']}: no heading for #{anchor} in deploy/RUNBOOK.md"
        body = sections[anchor]
        for part in ("**What it means.**", "**Confirm.**", "**What to do.**"):
            assert part in body, f"RUNBOOK.md#{anchor} lacks {part}"
    links = set(re.findall(r"\]\(#([\w-]+)\)", RUNBOOK.read_text()))
    assert links <= set(sections), f"links to no heading: {sorted(links - set(sections))}"
    assert {"a-node-lost", "draining-and-undraining-a-node", "a-generation-change",
            "descriptor-exhaustion"} <= set(sections)


def shown_commands(markdown: str) -> list[list[str]]:
    """The argument lists of the `zend ...` commands in the code blocks and code spans of `markdown`."""
    blocks = re.findall(r"```(?:sh|bash)?\n(.*?)```", markdown, re.DOTALL)
    spans = re.findall(r"`(zend [^`]+)`", markdown)
    out = []
    for line in [*(ln for b in blocks for ln in b.splitlines()), *spans]:
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if word == "zend" and i + 1 < len(words) and not words[i + 1].startswith("-"):
                args = []
                for w in words[i + 1:]:
                    if w in ("|", "&&", ";", "||"):
                        break
                    args.append(w)
                out.append(args)
    return out


@pytest.mark.inprocess
def test_the_runbooks_zend_commands_are_real(capsys):
    """`zend status --drain 60`, `zend health`, ...: each parses with zend's own parser, so the runbook names no
    flag or command that does not exist. Spans that only name a command in prose (`zend store`) parse too."""
    from zend.cli import build_parser

    parser = build_parser()
    commands = shown_commands(RUNBOOK.read_text())
    assert {"status", "health"} <= {c[0] for c in commands}
    assert ["status", "--drain", "60"] in commands and ["status", "--undrain"] in commands
    for args in commands:
        if args[0] == "store" and len(args) == 1:
            continue  # `zend store` in prose: the command, its required --listen unsaid
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"RUNBOOK.md shows `zend {' '.join(args)}`, which zend does not take: "
                        f"{capsys.readouterr().err}")


# ---------------------------------------------------------------------- Alertmanager


class Alertmanager:
    """A real Alertmanager on `config` for the length of a `with` block (no cluster peers)."""

    def __init__(self, config: dict[str, Any], workdir: Path):
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "alertmanager.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Alertmanager:
        assert ALERTMANAGER is not None
        for attempt in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port()
            self._log = open(self.workdir / "alertmanager.log", "ab")
            self._proc = subprocess.Popen(
                [ALERTMANAGER, f"--config.file={self.config_path}", f"--storage.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
                stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
            try:
                poll_for(self._ready, 30, "alertmanager ready", interval_s=0.1)
                return self
            except AssertionError:
                self.stop()
                if attempt == 2:
                    raise AssertionError(f"alertmanager did not start:\n{self.log_tail()}") from None
        raise AssertionError("unreachable")

    def _ready(self) -> bool:
        assert self._proc is not None
        if self._proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self) -> str:
        path = self.workdir / "alertmanager.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-30:]) if path.exists() else ""

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        log, self._log = self._log, None
        end_process(proc, log)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def post(self, alerts: Sequence[dict[str, str]]) -> None:
        now = datetime.datetime.now(datetime.UTC)
        body = [{"labels": labels, "annotations": {}, "startsAt": now.isoformat(),
                 "endsAt": (now + datetime.timedelta(hours=1)).isoformat()} for labels in alerts]
        request = urllib.request.Request(f"{self.url}/api/v2/alerts", json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert it holds, with its status: state active, suppressed (with inhibitedBy) or unprocessed."""
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts", timeout=10) as response:
            result: list[dict[str, Any]] = json.load(response)
            return result


def shipped_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    return config


@pytest.mark.daemon
@needs_alertmanager
def test_amtool_checks_the_alertmanager_config():
    run = subprocess.run([AMTOOL or "amtool", "check-config", str(ALERTMANAGER_CONFIG)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    config = shipped_config()
    rules = config["inhibit_rules"]
    assert all({"namespace", "cluster"} <= set(r["equal"]) for r in rules), "one cluster never inhibits another's"
    # info never reaches the pager
    run = subprocess.run([AMTOOL or "amtool", "config", "routes", "test", f"--config.file={ALERTMANAGER_CONFIG}",
                          "alertname=ZenClientErrors", "severity=info"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "none", run.stdout + run.stderr


def _state_of(alert: dict[str, Any]) -> str:
    return str(alert["status"]["state"])


def _key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


@pytest.mark.daemon
@needs_alertmanager
def test_alertmanager_holds_back_the_per_peer_alerts_of_a_lost_node(tmp_path):
    """The alerts the promtool unit tests expect, as Prometheus would send them, into the shipped inhibit_rules.

    namespace "lost": a daemon down (LOST_NODE at 5m): ZenDaemonDown pages, its node's ZenNodeLost and
    ZenPeerDown and the cluster's ZenErrors are held back; the never-scraped daemon's ZenDaemonDown pages too.
    namespace "cut": a node cut off (PARTITION): ZenNodeLost pages, every ZenPeerDown (the others' about it,
    its own about them) is held back. namespace "other": the same ranks and a ZenErrors, untouched."""
    lost = [{**a, "namespace": "lost"} for a in expected(LOST_NODE, "5m", "ZenPeerDown")
            + expected(LOST_NODE, "4m", "ZenNodeLost") + expected(LOST_NODE, "3m", "ZenDaemonDown")]
    lost.append({**expected(ERRORS, "12m", "ZenErrors")[0], "namespace": "lost"})
    cut = [{**a, "namespace": "cut"} for a in expected(PARTITION, "5m", "ZenNodeLost", "ZenPeerDown")]
    other = [{**expected(ERRORS, "12m", "ZenErrors")[0], "namespace": "other"},
             {**expected(PARTITION, "5m", "ZenPeerDown")[0], "namespace": "other"}]
    assert len(lost) == 6 and len(cut) == 5
    paging = {_key(a) for a in lost + cut + other
              if a["alertname"] == "ZenDaemonDown" or (a["alertname"] == "ZenNodeLost" and a["namespace"] == "cut")
              or a["namespace"] == "other"}
    with Alertmanager(shipped_config(), tmp_path / "am") as am:
        am.post(lost + cut + other)

        def settled() -> dict[tuple[tuple[str, str], ...], str] | None:
            states = {_key(a["labels"]): _state_of(a) for a in am.alerts()}
            return states if len(states) == len(lost + cut + other) and "unprocessed" not in states.values() else None

        states = poll_for(settled, 30, "every alert processed", interval_s=0.2)
        # the inhibition is computed on every read: ask until it holds (the sources are registered asynchronously)
        want = {_key(a): "active" if _key(a) in paging else "suppressed" for a in lost + cut + other}
        try:
            poll_for(lambda: settled() == want, 15, "the inhibition", interval_s=0.2)
        except AssertionError:
            states = settled() or {}
            wrong = {dict(k)["alertname"] + " " + json.dumps(dict(k)): (v, want[k]) for k, v in states.items()
                     if want.get(k) != v}
            pytest.fail(f"state (got, want) of:\n{json.dumps(wrong, indent=1)}\n{am.log_tail()}")


# ---------------------------------------------------------------------- end to end


class RulesPrometheus(PrometheusServer):
    """tests/daemon/prometheus.py's server, evaluating `rule_files` and sending alerts to `alertmanager`."""

    def __init__(self, targets: Sequence[str], workdir: Path, *, rule_files: Sequence[Path] = (),
                 alertmanager: str | None = None, **kwargs: Any):
        self.rule_files, self.alertmanager = [str(p) for p in rule_files], alertmanager
        super().__init__(targets, workdir, **kwargs)

    def _config(self) -> str:
        header, _, body = super()._config().partition("\n")
        config = json.loads(body)
        if self.rule_files:
            config["rule_files"] = self.rule_files
        if self.alertmanager:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [self.alertmanager]}]}]}
        return f"{header}\n{json.dumps(config, indent=2)}\n"


_UNITS = {"s": 1, "m": 60, "h": 3600}


def quickened_rules(factor: int) -> dict[str, Any]:
    """alerts.yml with every `for` divided by `factor` (whole milliseconds), everything else as shipped."""
    rules: dict[str, Any] = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                m = re.fullmatch(r"(\d+)([smh])", rule["for"])
                assert m, rule["for"]
                rule["for"] = f"{int(m.group(1)) * _UNITS[m.group(2)] * 1000 // factor}ms"
    return rules


class Webhook:
    """An HTTP server taking Alertmanager's webhook notifications: `alerts()` is every alert notified."""

    def __init__(self) -> None:
        received: list[dict[str, Any]] = []
        self.received = received

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, name="webhook", daemon=True)

    def __enter__(self) -> Webhook:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def alerts(self) -> list[dict[str, Any]]:
        return [a for message in list(self.received) for a in message["alerts"]]


QUICKER = 30  # every `for` divided by this: 1m -> 2 s, 3m -> 6 s


@pytest.mark.daemon
@needs_prometheus
@needs_alertmanager
def test_a_lost_node_pages_once(fresh_cluster, tmp_path):
    """Three daemons, Prometheus on alerts.yml (each `for` 30 times shorter, their order kept), Alertmanager on the
    shipped config (its receiver a webhook here, its waits short). Node 2's daemon is killed: Alertmanager gets
    ZenDaemonDown{node="2"}, ZenNodeLost{lost_node="2"} and both peers' ZenPeerDown{lost_node="2"}, and notifies
    ZenDaemonDown alone."""
    c = fresh_cluster(3, extra=["--log-format", "text", "--peer-timeout-s", "1"])
    targets = [f"127.0.0.1:{p}" for p in c.metrics_ports]
    rules = tmp_path / "alerts.yml"
    rules.write_text(yaml.safe_dump(quickened_rules(QUICKER), sort_keys=False))
    config = shipped_config()
    with Webhook() as hook:
        config["route"].update(group_wait="1s", group_interval="1s")
        config["receivers"] = [{"name": "default", "webhook_configs": [{"url": hook.url, "send_resolved": False}]},
                               {"name": "none"}]
        with Alertmanager(config, tmp_path / "am") as am, RulesPrometheus(
                targets, tmp_path / "prom", scrape_interval_s=0.5, rule_files=[rules],
                alertmanager=f"127.0.0.1:{am.port}") as prom:
            prom.wait_for('instance_node:zen_node_info:timestamp{node="2"}')  # the rank is on record
            c.kill(2)
            lost = targets[2]

            def about_node_2() -> dict[str, list[str]]:
                out: dict[str, list[str]] = {}
                for a in am.alerts():
                    if a["labels"].get("lost_node") == "2":
                        out.setdefault(a["labels"]["alertname"], []).append(_state_of(a))
                return out

            want = {"ZenDaemonDown": ["active"], "ZenNodeLost": ["suppressed"],
                    "ZenPeerDown": ["suppressed", "suppressed"]}
            try:
                poll_for(lambda: {k: sorted(v) for k, v in about_node_2().items()} == want, 90,
                         "the lost node's alerts", interval_s=0.5)
            except AssertionError:
                pytest.fail(f"alerts about node 2: {about_node_2()}\nPrometheus alerts: "
                            f"{prom.query('ALERTS')}\n{am.log_tail()}")
            (down,) = [a for a in am.alerts() if a["labels"]["alertname"] == "ZenDaemonDown"]
            assert down["labels"]["instance"] == lost and down["labels"]["node"] == "2"
            poll_for(lambda: any(a["labels"]["alertname"] == "ZenDaemonDown" for a in hook.alerts()), 30,
                     "the ZenDaemonDown notification", interval_s=0.2)
            time.sleep(3)  # three group intervals: a notification of the others would have come by now
            notified = {a["labels"]["alertname"] for a in hook.alerts()}
            assert "ZenDaemonDown" in notified and not notified & {"ZenNodeLost", "ZenPeerDown"}, notified
