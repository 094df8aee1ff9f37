"""Mesh sizing rules, and a real mesh over simulated CPU devices (in a subprocess, since
the device count must be fixed before JAX starts)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.errors import ConfigError, UserError
from runner.parallel.mesh import make_mesh, resolve_mesh_shape
from tests.conftest import fork_server, runner_env
from tests.forked import run

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args, expected", [
    ((-1, 1, 1, 8), {"stage": 1, "data": 8, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}),
    ((1, -1, 2, 8), {"stage": 1, "data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}),
    ((2, 2, -1, 8), {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}),
    ((2, 2, 2, 8), {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}),
    ((1, 1, 1, 1), {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}),
])
def test_resolve_mesh_shape(args, expected):
    assert resolve_mesh_shape(*args) == expected
    staged = resolve_mesh_shape(*args[:3], args[3] * 2, stage=2)
    assert staged == {**expected, "stage": 2}  # the stage axis multiplies the devices the others split


@pytest.mark.parametrize("args, words", [
    ((-1, -1, 1, 8), "at most one"),
    ((2, 2, 1, 8), "multiply to 4 but there are 8 devices"),
    ((-1, 3, 1, 8), "does not divide the 8 devices"),
    ((0, 1, 1, 8), "mesh.data=0 must be >= 1 or -1"),
    ((1, -2, 1, 8), "mesh.fsdp=-2"),
    ((1, 1.5, 1, 8), "not an integer"),
])
def test_resolve_mesh_shape_errors(args, words):
    with pytest.raises(ConfigError) as err:
        resolve_mesh_shape(*args)
    msg = str(err.value)
    assert err.value.key == "mesh" and words in msg
    assert "Fix:" in msg and "8" in msg


def test_make_mesh_rejects_bad_shapes_before_touching_devices():
    fake = [SimpleNamespace(id=i, slice_index=0, process_index=0) for i in range(4)]
    with pytest.raises(ConfigError, match="multiply to 8 but there are 4 devices"):
        make_mesh({"data": 8, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}, fake)
    with pytest.raises(ConfigError, match="exactly the axes"):
        make_mesh({"data": 4, "model": 1}, fake)
    with pytest.raises(ConfigError, match="multiple of the slice count"):
        make_mesh({"data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1}, fake, num_slices=2)
    with pytest.raises(ConfigError, match="mesh.stage=3`: with 2 slices the stage axis is split across them"):
        make_mesh({"stage": 3, "data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1},
                  [SimpleNamespace(id=i, slice_index=0, process_index=0) for i in range(6)], num_slices=2)
    with pytest.raises(UserError, match="asks for 2 slices but the devices span 1"):
        make_mesh({"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 1}, fake, num_slices=2)


_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp
    from runner.parallel.mesh import (batch_sharding, make_mesh, microbatch_sharding,
                             resolve_mesh_shape)
    devices = jax.devices()
    shape = resolve_mesh_shape(-1, 2, 1, len(devices))
    mesh = make_mesh(shape)
    x = jax.device_put(jnp.zeros((8, 16)), batch_sharding(mesh))
    mb = jax.device_put(jnp.zeros((3, 8, 5)), microbatch_sharding(mesh))
    y = jax.jit(lambda a: a * 2, in_shardings=batch_sharding(mesh),
                out_shardings=batch_sharding(mesh))(x)
    multi = make_mesh({"data": 4, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}, num_slices=2)
    # slices: devices 0-1 and 2-3 (CPU devices have no slice_index)
    staged = make_mesh({"stage": 2, "data": 2, "fsdp": 1, "tensor": 1}, num_slices=2)
    print(json.dumps({
        "n": len(devices), "shape": shape, "mesh": dict(mesh.shape),
        "axis_types": [t.name for t in mesh.axis_types + multi.axis_types],
        "shards": [list(s.data.shape) for s in x.addressable_shards],
        "mb_shards": sorted({tuple(s.data.shape) for s in mb.addressable_shards}),
        "y_shards": len(y.addressable_shards),
        "multi": dict(multi.shape),
        "multi_ids": [d.id for d in multi.devices.flat],
        "stage_ids": [sorted(d.id for d in row.flat) for row in staged.devices],
        "staged_axes": list(staged.axis_names),
    }))
""")


@pytest.mark.deep
def test_mesh_on_four_simulated_cpu_devices(tmp_path):
    proc = run(fork_server(), "code", _SCRIPT, [], REPO, runner_env(tmp_path, 4), 300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["n"] == 4
    assert out["shape"] == out["mesh"] == {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 1}
    assert out["axis_types"] == ["Auto"] * 12  # both meshes, every axis
    assert out["shards"] == [[2, 16]] * 4
    assert out["mb_shards"] == [[3, 2, 5]]
    assert out["y_shards"] == 4
    assert out["multi"] == {"stage": 1, "data": 4, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    assert sorted(out["multi_ids"]) == [0, 1, 2, 3]
    assert out["staged_axes"][0] == "stage" and out["stage_ids"] == [[0, 1], [2, 3]]  # each stage in one slice
