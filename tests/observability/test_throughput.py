"""MFU on every logged step: the arithmetic, the peak per device, and MetricsReport adding it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import pytest

from runner.observability.throughput import Throughput, chip_of
from runner.parallel.topology import CHIPS, parse_topology
from runner.train.hooks import MetricsReport


def test_rates_are_per_device_and_against_the_peak() -> None:
    t = Throughput(flops_per_token=6e9, devices=8, peak_flops_per_device=275e12, peak_source="v4 bf16 peak")
    rates = t.rates(tokens_per_s=80_000.0)
    assert rates["tokens_per_s_per_device"] == 10_000.0
    assert rates["tflops_per_device"] == pytest.approx(60.0)
    assert rates["mfu"] == pytest.approx(60e12 / 275e12)
    assert "mfu" not in Throughput(6e9, 8, None, "unknown device").rates(1.0)
    assert "tflops_per_device" not in Throughput(None, 8, 1e12, "x").rates(1.0)


def test_the_peak_comes_from_the_topology_the_device_kind_or_a_cpu_measurement(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    v4 = parse_topology("v4-32")
    cpu = jax.devices()[:1]
    assert Throughput.for_run(1.0, v4, cpu).peak_flops_per_device == CHIPS["v4"].peak_bf16_flops_per_device
    assert chip_of(SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")) is CHIPS["h100"]
    assert chip_of(SimpleNamespace(device_kind="TPU v5 lite")) is CHIPS["v5e"]
    assert chip_of(SimpleNamespace(device_kind="TPU v5")) is CHIPS["v5p"]
    assert chip_of(SimpleNamespace(device_kind="cpu")) is None
    measured = Throughput.for_run(1.0, parse_topology("cpu-1"), cpu)
    assert 1e8 < measured.peak_flops_per_device < 1e14 and "measured" in measured.peak_source
    kept = json.loads((tmp_path / "cpu_peak.json").read_text())
    assert list(kept.values()) == [measured.peak_flops_per_device]  # measured once per machine
    (tmp_path / "cpu_peak.json").write_text(json.dumps({k: 1e9 for k in kept}))
    assert Throughput.for_run(1.0, parse_topology("cpu-1"), cpu).peak_flops_per_device == 1e9


class FakeLogger:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.progress = SimpleNamespace(update=lambda *a: None)
        self.wandb_run = None

    def log(self, step: int, values: dict) -> None:
        self.logged.append((step, values))


def test_metrics_report_adds_mfu_from_the_measured_step_time_without_touching_the_device() -> None:
    spec = SimpleNamespace(train=SimpleNamespace(batch_size=4, seq_len=100, steps=10, log_every=1),
                           debug=SimpleNamespace(norms_every=0))
    times = iter([0.0, 0.5])
    throughput = Throughput(flops_per_token=1e9, devices=2, peak_flops_per_device=1e12, peak_source="test")
    logger = FakeLogger()
    report = MetricsReport(spec, logger, 0, clock=lambda: next(times), throughput=throughput)
    metrics = {"loss": 1.0}  # plain floats: the loop has already fetched them, one step late
    report.on_metrics(SimpleNamespace(state=None), 1, metrics)
    step, logged = logger.logged[0]
    assert logged["tokens_per_s"] == pytest.approx(400 / 0.5)
    assert logged["tokens_per_s_per_device"] == pytest.approx(400)
    assert logged["mfu"] == pytest.approx(400 * 1e9 / 1e12)
    assert metrics["mfu"] == logged["mfu"]  # the components after it see it too
