"""runner.checkpoint.replicas on four CPU devices: which arrays the devices of one data-parallel
replica can rebuild, and a rebuild that gives every device a holder's exact bits."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, fork_server, runner_env
from tests.forked import run

_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from runner.checkpoint import replicas

mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
holders = {d.id for d in mesh.devices[1]}  # the second data-parallel replica survived
rng = np.random.default_rng(0)
w = rng.standard_normal((8, 6)).astype(np.float32)
w[0, 0], w[0, 1] = -0.0, np.float32("nan")
true = {
    "w": (w, P("fsdp", None)),
    "b": (rng.standard_normal(6).astype(jnp.bfloat16), P()),
    "step": (np.int32(-7), P()),
    "mask": (np.array([True, False, True, True]), P("fsdp")),
    "key": (np.array([3, 4294967295], np.uint32), P()),
    "full": (rng.standard_normal((4, 3)).astype(np.float32), P(("data", "fsdp"), None)),
}

def damaged(value, spec):
    # holders' shards are the true ones; every other device holds garbage
    sharding = NamedSharding(mesh, spec)
    value = np.asarray(value)
    shards = []
    for device, index in sharding.addressable_devices_indices_map(value.shape).items():
        shard = value[index]
        if device.id not in holders:
            shard = np.full_like(shard, 1) if shard.dtype != bool else ~shard
        shards.append(jax.device_put(shard, device))
    return jax.make_array_from_single_device_arrays(value.shape, sharding, shards)

tree = {k: damaged(v, s) for k, (v, s) in true.items()}
# optimizer.offload=host: an array in host memory is rebuilt there
tree["w_host"] = jax.device_put(tree["w"], tree["w"].sharding.with_memory_kind("pinned_host"))
true["w_host"] = true["w"]
out = {"unreplicated": replicas.unreplicated(tree, holders),
       "all_devices": replicas.unreplicated(tree, {d.id for d in mesh.devices.flat})}
del tree["full"]
rebuilt = replicas.rebuild(tree, holders)
exact = {}
for k, x in rebuilt.items():
    value = np.asarray(true[k][0])
    exact[k] = x.sharding == tree[k].sharding and all(
        np.asarray(s.data).tobytes() == value[s.index].tobytes() for s in x.addressable_shards)
out["exact"] = exact
abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
zeros = replicas.zeros(abstract)
out["zeros"] = all(z.sharding == tree[k].sharding and not np.asarray(z).any() for k, z in zeros.items())
print(json.dumps(out))
"""


@pytest.mark.deep
def test_replicas_rebuild_every_shard_bit_exact_and_name_what_they_cannot(tmp_path) -> None:
    proc = run(fork_server(), "code", _SCRIPT, [], ROOT, runner_env(tmp_path, 4), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["unreplicated"] == ["['full']"]  # split over data too: the other replica's half is lost
    assert out["all_devices"] == []
    assert out["exact"] == {"w": True, "b": True, "step": True, "mask": True, "key": True, "w_host": True}
    assert out["zeros"]
