"""The collectives microbenchmark on 8 virtual CPU devices: correct results, files written, sane numbers."""
import argparse
import csv
import json
import math
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.bench import collectives as bench
from jaxpar.config import ConfigError
from jaxpar.measure import hlo

N = 8


@pytest.fixture(scope="module")
def mesh():
    return bench.make_bench_mesh()


def test_each_collective_computes_what_it_says(mesh):
    """Device i holds a row of (i + 1)s; check every op's result on every device."""
    size = 64 * 4                       # 64 float32 per device
    expected_rows = {
        "all-reduce": lambda i: np.full(64, N * (N + 1) / 2),
        "all-gather": lambda i: np.repeat(np.arange(1, N + 1), 64 // N),
        "reduce-scatter": lambda i: np.full(64 // N, N * (N + 1) / 2),
        "all-to-all": lambda i: np.repeat(np.arange(1, N + 1), 64 // N),   # chunk i from every device
        "permute": lambda i: np.full(64, (i - 1) % N + 1),
        "broadcast": lambda i: np.full(64, 1.0),
    }
    for op, row in expected_rows.items():
        fn, x, _ = bench.build(op, mesh, size)
        out = np.asarray(fn(x))
        assert out.shape[0] == N, op
        for i in range(N):
            np.testing.assert_allclose(out[i], row(i), err_msg=op)


def test_bench_all_reduce_is_one_all_reduce_of_the_size(mesh):
    """The benchmark measures what the HLO parser would count: one all-reduce of `size` bytes over x."""
    fn, x, _ = bench.build("all-reduce", mesh, 4096)
    (c,) = hlo.collectives(fn.lower(x).compile().as_text(), mesh)
    assert c.op == "all-reduce" and c.result_bytes == 4096 and c.axes == ("x",)
    assert c.bytes_per_run == pytest.approx(4096 * bench.bus_factor("all-reduce", N))


def test_tiny_sweep_writes_files(tmp_path):
    result = bench.run_collectives_bench("all", "1M", "2M", 0.02, tmp_path)
    for name in ("collectives.csv", "collectives.json", "collectives.md", "collectives.png"):
        assert (tmp_path / name).stat().st_size > 0, name

    rows = result["results"]
    assert {r["op"] for r in rows} == set(bench.OPS)
    assert sorted({r["bytes"] for r in rows}) == [2**20, 2**21]
    for r in rows:
        assert r["busbw_GBps"] > 0 and r["algbw_GBps"] > 0 and r["time_us"] > 0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bench.bus_factor(r["op"], N))
        assert r["theory_GBps"] > 0 and r["ratio"] == pytest.approx(r["busbw_GBps"] / r["theory_GBps"])
    for op, fit in result["fits"].items():
        assert math.isfinite(fit["alpha_us"]) and fit["alpha_us"] >= 0, op
        small, large = (r["time_us"] for r in rows if r["op"] == op)
        if large > small:       # a 2-point fit has a beta when time grows with size (on a loaded host it may not)
            assert math.isfinite(fit["beta_GBps"]) and fit["beta_GBps"] > 0, op
        else:
            assert fit["beta_GBps"] is None, op

    saved = json.loads((tmp_path / "collectives.json").read_text())
    assert saved["meta"]["n_devices"] == N and len(saved["results"]) == len(rows)
    with open(tmp_path / "collectives.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    table = (tmp_path / "collectives.md").read_text()
    assert "| op | bytes | time µs | algbw GB/s | busbw GB/s | theory GB/s | ratio |" in table


def test_fit_recovers_alpha_and_beta():
    sizes = [2**k for k in range(10, 24)]
    alpha, beta = 20e-6, 3e9
    fit_alpha, fit_beta = bench.fit_alpha_beta(sizes, [alpha + s / beta for s in sizes])
    assert fit_alpha == pytest.approx(alpha, rel=1e-6) and fit_beta == pytest.approx(beta, rel=1e-6)
    assert bench.fit_alpha_beta([1024, 2048], [1e-3, 0.9e-3])[1] is None     # time falls with size: no beta


def test_bus_factors_follow_nccl_tests():
    assert bench.bus_factor("all-reduce", 8) == pytest.approx(2 * 7 / 8)
    for op in ("all-gather", "reduce-scatter", "all-to-all"):
        assert bench.bus_factor(op, 8) == pytest.approx(7 / 8)
    assert bench.bus_factor("broadcast", 8) == bench.bus_factor("permute", 8) == 1


def test_sizes_and_ops_parsing():
    assert bench.sweep_sizes(1024, 8192, 8) == [1024, 2048, 4096, 8192]
    assert bench.sweep_sizes(4, 16, 8) == [32]          # at least one float32 per device, deduplicated
    assert bench.parse_bytes("64K", "--min-bytes") == 65536 and bench.parse_bytes("1MiB", "x") == 2**20
    assert bench.parse_ops("psum,ppermute") == ["all-reduce", "permute"]
    assert bench.parse_ops("all") == list(bench.OPS)


@pytest.mark.parametrize("kwargs, field", [
    (dict(ops="all-reduce", min_bytes="1K", max_bytes=2**50), "--max-bytes"),
    (dict(ops="all-sum", min_bytes="1K", max_bytes="2K"), "--ops"),
    (dict(ops="all-reduce", min_bytes="lots", max_bytes="2K"), "--min-bytes"),
    (dict(ops="all-reduce", min_bytes="4K", max_bytes="2K"), "--min-bytes"),
])
def test_bad_input_is_a_config_error(tmp_path, kwargs, field):
    with pytest.raises(ConfigError) as err:
        bench.run_collectives_bench(time_budget_s=0.01, out_dir=tmp_path, **kwargs)
    assert err.value.field == field
    assert not list(tmp_path.iterdir())


def test_cli_arguments(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    args = parser.parse_args(["--ops", "permute", "--min-bytes", "4K", "--max-bytes", "4K",
                              "--budget", "0.01", "--out", str(tmp_path)])
    assert bench.run_bench(args) == 0
    assert "| permute | 4096 |" in capsys.readouterr().out
    assert (tmp_path / "collectives.md").exists()


@pytest.mark.parametrize("entry", [["jaxpar.cli", "bench", "collectives"], ["jaxpar.bench.collectives"]])
def test_one_device_is_refused(tmp_path, entry):
    """Without --cpu-devices the CPU backend has one device: no collective to time, so exit 2 in one line."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", *entry, "--ops", "all-reduce", "--min-bytes", "4K", "--max-bytes", "4K",
         "--budget", "0.01", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(err) == 1 and err[0].startswith("error: --cpu-devices: ") and ">= 2 devices" in err[0], err
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes(tmp_path):
    """2 processes x 4 CPU devices joined by jax.distributed: one 8-device mesh, only process 0 writes."""
    port = _free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAXPAR_COORDINATOR=f"localhost:{port}", JAXPAR_NUM_PROCESSES="2",
                   JAXPAR_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu")
        out = tmp_path / f"out{pid}"
        procs.append((out, subprocess.Popen(
            [sys.executable, "-m", "jaxpar.bench.collectives", "--cpu-devices", "4", "--ops", "all-reduce,permute",
             "--min-bytes", "4K", "--max-bytes", "8K", "--budget", "0.01", "--out", str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for _out, proc in procs:
        log, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, log
    (out0, _), (out1, _) = procs
    meta = json.loads((out0 / "collectives.json").read_text())["meta"]
    assert meta["n_devices"] == 8 and meta["process_count"] == 2
    assert not out1.exists()
