"""A real Prometheus scrapes a real short training run; every Grafana panel's query returns data.

Needs the `prometheus` binary (CI installs it with apt); skipped with the reason otherwise.
"""
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from jaxpar.cli import main
from jaxpar.cluster.dashboard import dashboard, prometheus_config, queries

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "scripts" / "monitoring"


try:
    import tensorboardX  # noqa: F401
    TENSORBOARD = True
except ImportError:   # the `ops` extra
    TENSORBOARD = False


def tensorboard_tags(directory: Path) -> set[str]:
    """Scalar tags in TensorBoard event files (TFRecord framing: length, crc, Event proto, crc)."""
    from tensorboardX.proto.event_pb2 import Event
    tags = set()
    for file in directory.glob("events.out.tfevents.*"):
        data, offset = file.read_bytes(), 0
        while offset < len(data):
            length = int.from_bytes(data[offset:offset + 8], "little")
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            tags |= {value.tag for value in event.summary.value}
            offset += 12 + length + 4
    return tags


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(base, path, **params):
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_shipped_files_are_the_generated_ones():
    assert json.loads((MONITORING / "grafana-dashboard.json").read_text()) == dashboard()
    shipped = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert shipped == prometheus_config(["localhost:9400", "localhost:9401"])


def test_the_exporter_shows_every_series_before_the_first_step():
    """A rate needs a sample before the first observation: a histogram that appears only at its first
    observation has no rate until a later scrape sees it change (a short run may end before that)."""
    from jaxpar.cluster.metrics import PrometheusExporter
    exporter = PrometheusExporter(free_port(), process=0)
    try:
        port = exporter.server.server_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        exporter.close()
    for series in ("jaxpar_step", "jaxpar_loss", "jaxpar_step_time_seconds_count",
                   "jaxpar_checkpoint_save_seconds_count"):
        assert f'{series}{{process="0"}} 0.0' in text, series


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="the prometheus binary is not installed here (apt-get install prometheus)")
def test_every_dashboard_query_returns_data_from_a_scraped_run(tmp_path):
    metrics_port, web_port = free_port(), free_port()
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())   # the shipped config, local targets
    # the step-time quantiles are rates: they need two scrapes with different counts. The exporter shows every
    # series at 0 from its start, so a scrape during the 2 s of the first step's compile and one in the linger
    # suffice. 1 s scrapes leave a loaded machine time to answer each one
    for section in (config["global"], config["scrape_configs"][0]):
        section["scrape_interval"] = section["scrape_timeout"] = "1s"
    config["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'data'}",
                               f"--web.listen-address=127.0.0.1:{web_port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{web_port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/-/ready", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "prometheus did not become ready"
                time.sleep(0.2)
        # Ready is not scraping: Prometheus hands new targets to its scrape loops every 5 s, so its first scrape
        # came ~6 s after ready here, later than a whole short run's steps (CI failed so). Wait for it.
        while [t["health"] for t in api(base, "/api/v1/targets")["data"]["activeTargets"]] in ([], ["unknown"]):
            assert time.monotonic() < deadline, "prometheus did not scrape its target"
            time.sleep(0.2)
        start = time.time()
        assert main(["train", "--config", "configs/test.py", "--run-dir", str(tmp_path / "run"),
                     "--metrics-port", str(metrics_port), "--metrics-linger", "4",
                     "--set", "train.steps=30", "--set", "train.eval_every=10",
                     "--set", "train.checkpoint_every=10", "--set", "train.sample_tokens=0",
                     "--set", f"train.tensorboard={TENSORBOARD}"]) == 0
        end = time.time()
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())["goodput"]
        assert 0 < summary["goodput"] < 1 and set(summary["badput_s"]) == {
            "startup_compile", "checkpoint", "restart", "data_wait", "other"}
        empty = []
        for expr in queries(dashboard()):
            result = api(base, "/api/v1/query_range", query=expr, start=start, end=end + 2, step="1s")
            assert result["status"] == "success", (expr, result)
            values = [v for series in result["data"]["result"] for _, v in series["values"] if v not in ("NaN",)]
            if not values:
                empty.append(expr)
        assert not empty, f"queries without data: {empty}"
        def peak(expr):
            result = api(base, "/api/v1/query_range", query=expr, start=start, end=end + 2, step="1s")
            return max(float(v) for series in result["data"]["result"] for _, v in series["values"])

        assert peak("jaxpar_step") == 30                   # the run's values, not only zeros
        assert peak("jaxpar_loss") > 0 and peak("jaxpar_tokens_per_second") > 0
        assert 0 < peak("jaxpar_goodput_ratio") < 1 and peak("jaxpar_checkpoint_save_seconds_count") >= 1
        if TENSORBOARD:   # the optional sink wrote the same run as TensorBoard events
            tags = tensorboard_tags(tmp_path / "run" / "tensorboard")
            assert {"train/loss", "train/val_loss", "goodput/ratio", "badput_seconds/checkpoint"} <= tags, tags
    finally:
        server.terminate()
        server.wait(timeout=30)
