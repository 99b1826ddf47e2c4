"""The data-plane engine a daemon runs (native or Python): chosen, said, and interoperating on one wire."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from tests.helpers import node_status, random_grad, run_all
from zend.cluster.local import LocalCluster
from zend.protocol.session import TrainerSession
from zend.transport.engine_choice import choose_engine, load_native

NATIVE, WHY_NOT = load_native()
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"the native engine is not built: {WHY_NOT}")


@pytest.mark.inprocess
def test_the_engine_setting_resolves_with_its_reason() -> None:
    assert choose_engine("python", "tcp") == ("python", "set to python")
    assert choose_engine("auto", "ucx")[0] == "python"  # ucx:// runs its own data plane
    with pytest.raises(ValueError, match="'native' serves tcp:// links only, not ucx://"):
        choose_engine("native", "ucx")
    with pytest.raises(ValueError, match="data-plane engine 'fast' is not one of"):
        choose_engine("fast", "tcp")
    engine, why = choose_engine("auto", "tcp")
    assert engine == ("native" if NATIVE is not None else "python"), why


@pytest.mark.daemon
@needs_native
def test_native_and_python_nodes_sum_alike_and_say_which_engine_they_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Three nodes, the middle one on the Python data plane: every step's sum is the reference on every
    node, sealed frames cross native<->Python both ways; status and metrics name each node's engine."""
    rows, dim, steps = 500, 8, 4
    engines = {0: "native", 1: "python", 2: "native"}
    with LocalCluster(3, tmp_path, extra=["--log-format", "json", "--step-timeout-s", "60"],
                      node_extra={n: ["--data-plane-engine", e] for n, e in engines.items()}) as c:
        def trainer(node: int) -> list[torch.Tensor]:
            with TrainerSession(c.socket_dir(node), "mixed", c.token("mixed"), 0, 1, timeout_s=30) as link:
                h = link.register("emb", (rows, dim))
                return [link.allreduce(h, random_grad(rows, dim, 10 * step + node), step).to_dense()
                        for step in range(steps)]

        results = run_all([lambda n=n: trainer(n) for n in range(3)])
        for step in range(steps):
            ref = sum(random_grad(rows, dim, 10 * step + n).to_dense() for n in range(3))
            for got in results:
                assert not isinstance(got, BaseException), got
                torch.testing.assert_close(got[step], ref, rtol=1e-5, atol=1e-5)
        for node, engine in engines.items():
            assert node_status(c, node).data_plane_engine == engine
            assert f'"engine": "{engine}"' in c.log_path(node).read_text()
            with urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_ports[node]}/metrics", timeout=10) as reply:
                page = reply.read().decode()
            assert f'engine="{engine}"' in page and "zen_build_info" in page
