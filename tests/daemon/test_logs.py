"""The daemon's logs: the event's fields in both formats, nothing at INFO per step; a taken metrics port named."""

from __future__ import annotations

import json
import logging
import re

import pytest

from tests.helpers import random_grad, run_all
from zend.daemon.logs import JsonFormatter, TextFormatter
from zend.protocol.session import TrainerSession


def record(**fields: object) -> logging.LogRecord:
    r = logging.LogRecord("zend.daemon.trainer_steps", logging.WARNING, __file__, 1, "step failed", (), None)
    r.__dict__.update(fields)
    return r


@pytest.mark.inprocess
def test_text_log_lines_carry_the_events_fields():
    line = TextFormatter().format(record(event="step_failed", code="ABORTED", step=7,
                                         error="peer 1 left: step 7 aborted"))
    assert "WARNING zend.daemon.trainer_steps: step failed" in line
    assert 'event=step_failed code=ABORTED step=7 error="peer 1 left: step 7 aborted"' in line
    assert TextFormatter().format(record()).endswith("step failed")  # no fields, no trailing space
    as_json = json.loads(JsonFormatter().format(record(code="ABORTED", step=7)))
    assert as_json["code"] == "ABORTED" and as_json["step"] == 7 and as_json["msg"] == "step failed"


@pytest.mark.inprocess
def test_a_text_traceback_stays_below_the_fields():
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        r = record(code="INTERNAL")
        r.exc_info = sys.exc_info()
    head, _, rest = TextFormatter().format(r).partition("\n")
    assert head.endswith("code=INTERNAL") and "ValueError: boom" in rest


@pytest.mark.daemon
def test_steps_log_nothing_at_info(fresh_cluster):
    c = fresh_cluster(2, extra=["--log-format", "text", "--log-level", "info", "--scheme", "zen"])

    def trainer(node: int) -> None:
        with TrainerSession(c.socket_dir(node), "logs", c.token("logs"), 0, 1) as link:
            h = link.register("emb", (200, 4))
            for step in range(20):
                link.allreduce(h, random_grad(200, 4, step + node), step)

    assert all(r is None for r in run_all([lambda n=n: trainer(n) for n in range(2)]))
    lines = c.log_path(0).read_text().splitlines()
    info = [line for line in lines if " INFO " in line]
    assert not [line for line in info if re.search(r"INFO \S+: step", line)], info
    assert len(info) < 20, f"{len(info)} INFO lines for 20 steps: {info[-3:]}"  # start-up and sessions only
    assert any("session opened" in line and "job=logs" in line for line in lines), lines[-10:]


@pytest.mark.inprocess
def test_a_taken_metrics_port_is_named():
    import socket

    import pytest

    from zend.daemon.metrics import DaemonMetrics

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"metrics port {port} on 127.0.0.1: .*--metrics-port"):
            DaemonMetrics(0).serve("127.0.0.1", port)
