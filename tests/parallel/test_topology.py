"""Topology names parse to the right counts and shapes, and mistakes name the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runner.errors import ConfigError, UserError
from runner.parallel.topology import CHIPS, aot_topology_args, check_devices, parse_topology


def _devices(n: int, platform: str = "cpu", hosts: int = 1) -> list[SimpleNamespace]:
    return [SimpleNamespace(platform=platform, process_index=i * hosts // n) for i in range(n)]


def test_v4_32_counts_cores_and_is_megacore():
    t = parse_topology("v4-32")
    assert (t.platform, t.chip.name) == ("tpu", "v4")
    assert (t.num_chips, t.num_devices, t.num_hosts, t.devices_per_host) == (16, 16, 4, 4)
    assert t.physical_shape == (2, 2, 4)
    assert t.num_slices == 1 and t.peak_bf16_flops == 16 * 275e12


def test_v5litepod_and_v5e_are_the_same_slice():
    a, b = parse_topology("v5litepod-16"), parse_topology("v5e-16")
    assert a == b and a.name == "v5litepod-16"
    assert (a.num_chips, a.num_devices, a.num_hosts, a.physical_shape) == (16, 16, 4, (4, 4))


def test_tpu7x_counts_cores_and_shows_two_devices_per_chip():
    t = parse_topology("tpu7x-16")  # Ironwood: 8 chips of two chiplets, 4 chips per host
    assert (t.chips_per_slice, t.num_devices, t.num_hosts, t.physical_shape) == (8, 16, 2, (2, 2, 2))
    assert t.chip.hbm_bytes_per_device == 96 * 2**30
    assert t.peak_bf16_flops == 8 * 2307e12
    assert aot_topology_args(t)["topology_name"] == "tpu7x:2x2x2"


def test_v6e_8_is_one_host_of_8_chips():
    t = parse_topology("v6e-8")
    assert (t.num_chips, t.num_devices, t.num_hosts, t.physical_shape) == (8, 8, 1, (2, 4))


def test_v2_8_exposes_two_devices_per_chip():
    t = parse_topology("v2-8")
    assert (t.num_chips, t.num_devices, t.num_hosts, t.devices_per_host) == (4, 8, 1, 8)
    assert t.chip.hbm_bytes_per_device == 8 * 2**30


def test_v5p_128():
    t = parse_topology("v5p-128")
    assert (t.num_chips, t.num_devices, t.num_hosts, t.physical_shape) == (64, 64, 16, (4, 4, 4))
    assert t.chip.hbm_bytes == 95 * 2**30


@pytest.mark.parametrize("name, shape", [("v4-8", (2, 2, 1)), ("v4-16", (2, 2, 2)), ("v4-64", (2, 4, 4)),
                                         ("v4-128", (4, 4, 4)), ("v5e-8", (2, 4)), ("v5e-32", (4, 8)),
                                         ("v5e-64", (8, 8)), ("v5e-128", (8, 16)), ("v6e-256", (16, 16)),
                                         ("v3-32", (4, 4)), ("v5p-8", (2, 2, 1))])
def test_standard_slice_shapes(name, shape):
    assert parse_topology(name).physical_shape == shape


def test_multislice_prefix_multiplies_totals():
    t = parse_topology("2xv4-32")
    assert (t.num_slices, t.chips_per_slice, t.num_chips) == (2, 16, 32)
    assert (t.num_devices, t.num_hosts, t.devices_per_slice, t.hosts_per_slice) == (32, 8, 16, 4)
    assert t.physical_shape == (2, 2, 4) and t.name == "2xv4-32"


def test_cpu_gpu_and_auto():
    cpu = parse_topology("cpu-4")
    assert (cpu.platform, cpu.chip, cpu.num_devices, cpu.num_hosts, cpu.physical_shape) == ("cpu", None, 4, 1, None)
    gpu = parse_topology("gpu-16")
    assert (gpu.platform, gpu.num_devices, gpu.num_hosts, gpu.devices_per_host) == ("gpu", 16, 2, 8)
    assert parse_topology("h100-8").chip == CHIPS["h100"]
    auto = parse_topology("auto")
    assert (auto.platform, auto.num_devices, auto.num_hosts, auto.chip) == ("auto", 0, 0, None)


@pytest.mark.parametrize("name", ["v4-3", "v4-31", "v5e-3", "v6e-12", "tpu-8", "v9-8", "bogus", "", "2xcpu-4",
                                  "0xv4-32", "gpu-12", "cpu-0"])
def test_invalid_names_list_the_valid_forms(name):
    with pytest.raises(ConfigError) as err:
        parse_topology(name)
    msg = str(err.value)
    assert err.value.key == "topology" and repr(name) in msg
    for example in ("v4-", "v5litepod", "2xv4-32", "cpu-N", "auto"):
        assert example in msg


def test_invalid_count_names_the_valid_sizes():
    msg = str(pytest.raises(ConfigError, parse_topology, "v4-31").value)
    assert "8, 16, 32, 64" in msg and "TensorCores" in msg


def test_check_devices_accepts_a_match_and_auto():
    check_devices(parse_topology("cpu-4"), _devices(4))
    check_devices(parse_topology("v4-32"), _devices(16, "tpu", hosts=4))
    check_devices(parse_topology("gpu-8"), _devices(8, "cuda"))
    check_devices(parse_topology("auto"), _devices(1))


def test_check_devices_mismatch_explains_mode_compile():
    with pytest.raises(UserError) as err:
        check_devices(parse_topology("v4-32"), _devices(1))
    msg = str(err.value)
    assert "topology=v4-32 expects 16 tpu devices on 4 hosts" in msg
    assert "sees 1 cpu device on 1 host" in msg
    assert "mode=compile" in msg and "topology=auto" in msg


def test_check_devices_catches_wrong_host_count_and_cpu_count():
    with pytest.raises(UserError, match="on 4 hosts"):
        check_devices(parse_topology("v4-32"), _devices(16, "tpu", hosts=1))
    with pytest.raises(UserError, match="xla_force_host_platform_device_count=8"):
        check_devices(parse_topology("cpu-8"), _devices(4))


def test_aot_args_follow_the_libtpu_spelling():
    assert aot_topology_args(parse_topology("v4-32")) == {
        "platform": "tpu", "topology_name": "v4:2x2x4", "chip_config_name": "megacore",
        "chips_per_host_bounds": (2, 2, 1), "num_slices": 1, "wrap": (False, False, False),
    }
    v5p = aot_topology_args(parse_topology("2xv5p-128"))
    assert (v5p["topology_name"], v5p["num_slices"], v5p["wrap"]) == ("v5:4x4x4", 2, (True, True, True))
    v6e = aot_topology_args(parse_topology("v6e-8"))
    assert (v6e["topology_name"], v6e["chip_config_name"], v6e["chips_per_host_bounds"]) == (
        "v6e:2x4", "default", (2, 4, 1))
    assert aot_topology_args(parse_topology("v5litepod-16"))["topology_name"] == "v5e:4x4"


@pytest.mark.parametrize("name", ["cpu-4", "gpu-8", "auto"])
def test_aot_args_need_a_tpu(name):
    with pytest.raises(ConfigError, match="only available for TPU"):
        aot_topology_args(parse_topology(name))
