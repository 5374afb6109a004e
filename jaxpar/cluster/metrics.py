"""Metrics sinks of the training loop: a Prometheus exporter and an optional TensorBoard writer.

The exporter serves http://<host>:<port + process index>/metrics (prometheus_client),
bound to loopback unless asked otherwise (`jaxpar train --metrics-host`: the endpoint
has no authentication, so exposing it is an explicit choice), one target per process, each
series labelled `process`. The metric names below are the ones the Prometheus config and the
Grafana dashboard (jaxpar/cluster/dashboard.py) query. TensorBoard events go to
<run_dir>/tensorboard from process 0 (tensorboardX, the `ops` extra).
"""
from __future__ import annotations

import time
from pathlib import Path

from jaxpar.config import ConfigError

STEP_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SAVE_TIME_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class PrometheusExporter:
    def __init__(self, port: int, process: int, addr: str = "127.0.0.1"):
        from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

        self.registry = CollectorRegistry()
        label = ["process"]

        def gauge(name, doc, labels=label):
            return Gauge(name, doc, labels, registry=self.registry)

        self.step = gauge("jaxpar_step", "last completed training step")
        self.loss = gauge("jaxpar_loss", "training loss at the last completed step")
        self.val_loss = gauge("jaxpar_val_loss", "validation loss at the last evaluation")
        self.tokens = gauge("jaxpar_tokens_per_second", "training throughput over the last logging interval")
        self.mfu = gauge("jaxpar_mfu", "model FLOPs utilisation over the last logging interval (0..1)")
        self.restarts = gauge("jaxpar_restarts", "restarts of this job before the current attempt")
        self.goodput = gauge("jaxpar_goodput_ratio", "productive training time over wall time since the job started")
        self.wall = gauge("jaxpar_wall_seconds", "wall time since the job first started")
        self.badput = gauge("jaxpar_badput_seconds", "time lost, by kind", ["process", "kind"])
        self.step_time = Histogram("jaxpar_step_time_seconds", "time of one training step", label,
                                   buckets=STEP_TIME_BUCKETS, registry=self.registry)
        self.save_time = Histogram("jaxpar_checkpoint_save_seconds", "blocking time of one checkpoint save", label,
                                   buckets=SAVE_TIME_BUCKETS, registry=self.registry)
        self.process = str(process)
        try:
            self.server, self.thread = start_http_server(port + process, addr=addr, registry=self.registry)
        except OSError as err:
            raise ConfigError("--metrics-port", f"cannot listen on {addr} port {port + process} "
                              f"({err.strerror}); choose another port or --metrics-host") from None
        for metric in (self.step, self.loss, self.tokens, self.mfu, self.restarts, self.goodput, self.wall,
                       self.step_time, self.save_time):
            metric.labels(self.process)   # every series exists from the start (0 until set): a rate starts at 0

    def log(self, step: int, record: dict) -> None:
        p = self.process
        self.step.labels(p).set(step)
        if record.get("loss") is not None:
            self.loss.labels(p).set(record["loss"])
        if record.get("val_loss") is not None:
            self.val_loss.labels(p).set(record["val_loss"])
        if record.get("tokens_per_s") is not None:
            self.tokens.labels(p).set(record["tokens_per_s"])
        if record.get("mfu") is not None:
            self.mfu.labels(p).set(record["mfu"])

    def step_times(self, seconds: float, count: int) -> None:
        for _ in range(count):
            self.step_time.labels(self.process).observe(seconds)

    def checkpoint(self, seconds: float) -> None:
        self.save_time.labels(self.process).observe(seconds)

    def goodput_totals(self, totals: dict) -> None:
        p = self.process
        self.goodput.labels(p).set(totals["goodput"])
        self.wall.labels(p).set(totals["wall_s"])
        self.restarts.labels(p).set(totals["restarts"])
        for kind, seconds in totals["badput_s"].items():
            self.badput.labels(p, kind).set(seconds)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def summary_writer_class():
    """tensorboardX's SummaryWriter; without tensorboardX, a ConfigError (the CLI asks before creating a run)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ConfigError("train.tensorboard", "needs tensorboardX: pip install 'jaxpar[ops]' "
                          "(or set train.tensorboard=false)") from None
    return SummaryWriter


class TensorBoardWriter:
    def __init__(self, directory: Path):
        self.writer = summary_writer_class()(str(directory))

    def log(self, step: int, record: dict) -> None:
        for key in ("loss", "val_loss", "grad_norm", "lr", "tokens_per_s", "mfu", "step_time_s"):
            if record.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", float(record[key]), step)

    def goodput_totals(self, step: int, totals: dict) -> None:
        self.writer.add_scalar("goodput/ratio", totals["goodput"], step)
        for kind, seconds in totals["badput_s"].items():
            self.writer.add_scalar(f"badput_seconds/{kind}", seconds, step)

    def close(self) -> None:
        self.writer.close()


class Sinks:
    """Every metrics sink the run asked for, behind one interface the loop calls."""

    def __init__(self, metrics: int | tuple[int | None, str] | None, tensorboard_dir: Path | None, process: int):
        """`metrics`: the exporter's port, or (port, bind address); None or port None: no exporter."""
        port, host = metrics if isinstance(metrics, tuple) else (metrics, "127.0.0.1")
        self.prometheus = PrometheusExporter(port, process, host) if port else None
        self.tensorboard = TensorBoardWriter(tensorboard_dir) if tensorboard_dir else None

    def log(self, step: int, record: dict) -> None:
        if self.prometheus:
            self.prometheus.log(step, record)
        if self.tensorboard:
            self.tensorboard.log(step, record)

    def step_times(self, seconds: float, count: int) -> None:
        if self.prometheus:
            self.prometheus.step_times(seconds, count)

    def checkpoint(self, seconds: float) -> None:
        if self.prometheus:
            self.prometheus.checkpoint(seconds)

    def goodput(self, step: int, totals: dict) -> None:
        if self.prometheus:
            self.prometheus.goodput_totals(totals)
        if self.tensorboard:
            self.tensorboard.goodput_totals(step, totals)

    def close(self, linger_s: float = 0.0) -> None:
        if self.prometheus and linger_s > 0:
            time.sleep(linger_s)
        for sink in (self.prometheus, self.tensorboard):
            if sink:
                sink.close()
