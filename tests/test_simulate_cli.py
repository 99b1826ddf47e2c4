import json
import subprocess
import sys

import numpy as np
import pytest

from zend.cli import main


@pytest.mark.inprocess
def test_simulate_table_on_the_real_trace(capsys):
    assert main(["simulate", "--nodes", "4,8", "--dim", "16", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    for scheme in ("zen", "hc", "agsparse", "omnireduce", "sparse_ps", "dense", "auto"):
        assert f" {scheme} " in out
    assert "NO" not in out.split("recv/sent")[0]  # every rank got identical bits


@pytest.mark.inprocess
def test_simulate_json_meets_the_shape_of_the_claims(capsys):
    assert main(["simulate", "--nodes", "8", "--dim", "32", "--json", "--schemes", "zen,sparse_ps,dense"]) == 0
    rows = {r["scheme"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["dense"]["vs_dense"] == pytest.approx(1.0, rel=1e-3)
    assert rows["zen"]["bottleneck_bytes"] < rows["sparse_ps"]["bottleneck_bytes"] < rows["dense"]["bottleneck_bytes"]
    assert rows["zen"]["vs_lower_bound"] < 1.15
    assert rows["sparse_ps"]["push_imbalance"] > 2


@pytest.mark.inprocess
def test_any_token_stream_and_vocabulary(tmp_path, capsys):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).zipf(1.3, 20_000).clip(max=999))
    assert main(["simulate", "--tokens", str(ids), "--vocab", "1000", "--batch", "4x64",
                 "--nodes", "4", "--dim", "8", "--steps", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["scheme"] for r in rows} == {"zen", "hc", "agsparse", "omnireduce", "sparse_ps", "dense", "auto"}


@pytest.mark.daemon
@pytest.mark.parametrize("args, message", [
    (["--nodes", "4,x"], "not a comma-separated list"),
    (["--schemes", "zen,ring"], "unknown scheme"),
    (["--batch", "8by512"], "not SEQSxLEN"),
    (["--tokens", "/nonexistent.npy", "--vocab", "10"], "nonexistent.npy"),
    (["--tokens", "x.npy"], "needs --vocab"),
])
def test_bad_arguments_are_named(args, message):
    proc = subprocess.run([sys.executable, "-m", "zend", "simulate", *args], capture_output=True, text=True)
    assert proc.returncode != 0
    assert message in proc.stderr


@pytest.mark.inprocess
@pytest.mark.slow  # 8 exact runs of every scheme, 7 s: `make test` runs them, `make test-fast` does not
@pytest.mark.parametrize("n", [2, 5, 8, 12])
@pytest.mark.parametrize("dim", [1, 64])
def test_counted_traffic_equals_the_exchanged_traffic_byte_for_byte(n, dim):
    """traffic_model is how `zend simulate` reaches n = 1,024: it must agree with the real run exactly,
    for every scheme, power of two or not, element- and row-sparse."""
    from zend.simulator.simulation import simulate
    from zend.simulator.traces import TokenTrace

    trace = TokenTrace.default(seqs=2, seq_len=128)
    exact = simulate(trace, [n], dim=dim, steps=2, method="exact")
    model = simulate(trace, [n], dim=dim, steps=2, method="model")
    for e, m in zip(exact, model, strict=True):
        assert (e.scheme, e.ran) == (m.scheme, m.ran)
        assert (e.max_recv_bytes, e.max_sent_bytes) == (m.max_recv_bytes, m.max_sent_bytes), e.scheme
        assert e.push_imbalance == pytest.approx(m.push_imbalance) and e.pull_imbalance == pytest.approx(
            m.pull_imbalance), e.scheme
        assert e.push_load_imbalance == pytest.approx(m.push_load_imbalance), e.scheme
        assert e.method == "exact" and m.method == "model" and m.identical_on_all_ranks is None


@pytest.mark.inprocess
@pytest.mark.slow  # 15 s of counting: `make test` runs it, `make test-fast` does not
def test_simulate_reaches_a_thousand_ranks_by_counting():
    from zend.simulator.simulation import simulate
    from zend.simulator.traces import TokenTrace

    rows = simulate(TokenTrace.default(seqs=2, seq_len=128), [1024], schemes=["zen", "dense"], steps=1)
    zen, dense = rows
    assert zen.method == dense.method == "model"
    assert 0 < zen.bottleneck < dense.bottleneck
    assert zen.pull_imbalance < 1.5


@pytest.mark.inprocess
def test_every_registered_scheme_has_a_traffic_model_and_is_simulated_by_default():
    import torch

    from zend.core import SCHEMES
    from zend.simulator import simulation, traffic_model

    missing = [name for name, cls in SCHEMES.items() if cls not in traffic_model.TRAFFIC_MODELS]
    assert not missing, f"registered schemes without a traffic model (zend/simulator/traffic_model.py): {missing}"
    assert traffic_model.MODELLED == simulation.DEFAULT_SCHEMES == tuple(SCHEMES)
    with pytest.raises(ValueError, match="scheme 'ring' has no traffic model; modelled: zen, hc, agsparse, "
                                         "omnireduce, sparse_ps, dense, auto"):
        traffic_model.step_traffic("ring", [np.arange(3)], 10, 4, torch.float32, 0)
