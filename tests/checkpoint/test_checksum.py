"""Checksums catch what orbax's reads do not: a flipped bit in an array's data."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.checkpoint import checksum
from runner.checkpoint.checkpointer import Checkpointer, SavePolicy, abstract_like
from runner.spec import CheckpointSpec


def tree() -> dict:
    rng = np.random.default_rng(0)
    return {"step": jnp.asarray(7, jnp.int32), "w": jnp.asarray(rng.normal(size=(256, 256)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(8,)), jnp.bfloat16), "key": jax.random.key_data(jax.random.key(3)),
            "flag": jnp.asarray([True, False])}


def flip(x: jax.Array, index: int, bit: int) -> jax.Array:
    raw = np.asarray(x).copy()
    flat = raw.view(np.dtype(f"u{raw.dtype.itemsize}")).reshape(-1)
    flat[index] ^= np.array(1 << bit, flat.dtype)
    return jnp.asarray(raw)


def test_arrays_in_host_memory_have_their_device_checksums() -> None:
    """optimizer.offload=host keeps arrays in the host's pinned memory: summed there the same."""
    t = tree()
    on_host = {k: jax.device_put(v, v.sharding.with_memory_kind("pinned_host")) for k, v in t.items()}
    assert {x.sharding.memory_kind for x in on_host.values()} == {"pinned_host"}
    assert checksum.checksums(on_host) == checksum.checksums(t)
    assert checksum.checksums({**t, "w": on_host["w"]}) == checksum.checksums(t)  # mixed, in order


@pytest.mark.parametrize("name", ["step", "w", "b", "key"])
def test_every_single_bit_flip_changes_the_checksum(name) -> None:
    t = tree()
    before = checksum.checksums(t)
    x = t[name]
    bits = 8 * x.dtype.itemsize
    for index in range(min(x.size, 5)):
        for bit in range(bits):
            after = checksum.checksums({**t, name: flip(x, index, bit)})
            assert after[f"['{name}']"] != before[f"['{name}']"], (index, bit)
            assert {k: v for k, v in after.items() if k != f"['{name}']"} == \
                {k: v for k, v in before.items() if k != f"['{name}']"}


def test_a_swap_of_two_values_changes_the_checksum() -> None:
    t = tree()
    w = np.asarray(t["w"]).copy()
    w[0, 0], w[3, 5] = w[3, 5], w[0, 0]
    assert checksum.checksums({**t, "w": jnp.asarray(w)})["['w']"] != checksum.checksums(t)["['w']"]


def test_verify_names_the_changed_arrays_and_passes_old_checkpoints() -> None:
    t = tree()
    saved = checksum.checksums(t)
    checksum.verify(t, saved)
    checksum.verify(t, None)  # a checkpoint written before checksums: nothing to compare
    with pytest.raises(checksum.ChecksumMismatch, match=r"\['w'\]"):
        checksum.verify({**t, "w": flip(t["w"], 3, 30)}, saved)


def _saved_run(tmp_path: Path, steps: tuple[int, ...]) -> tuple[Checkpointer, dict]:
    spec = CheckpointSpec(every_steps=1, keep=5, async_save=False)
    store = Checkpointer(tmp_path / "checkpoints", spec, SavePolicy(spec))
    states = {}
    for s in steps:
        states[s] = {**tree(), "w": tree()["w"] * s}
        store.save(s, states[s], lambda s=s: {"step": s})
    store.wait()
    return store, states


def test_a_silently_changed_array_in_the_newest_checkpoint_is_set_aside(tmp_path) -> None:
    """Orbax reads back whatever the files hold: rewrite step 2's state item with one bit flipped
    (its meta untouched), as a disk or a copy gone wrong would leave it."""
    import orbax.checkpoint as ocp

    store, states = _saved_run(tmp_path, (1, 2))
    damaged = {**states[2], "w": flip(states[2]["w"], 17, 4)}
    with ocp.PyTreeCheckpointer() as writer:
        writer.save(tmp_path / "checkpoints" / "2" / "state", damaged, force=True)
    warnings: list[str] = []
    restored = store.restore_latest(abstract_like(states[2]), warn=warnings.append)
    assert restored is not None and restored.step == 1
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.asarray(states[1]["w"]))
    assert "checksum mismatch" in warnings[0] and "['w']" in warnings[0]
    assert [p.name.split("-")[0] for p in (tmp_path / "damaged_checkpoints").iterdir()] == ["2"]
    store.close()


def test_random_bit_flips_in_the_files_are_never_restored_as_good_state(tmp_path) -> None:
    """Flip one bit anywhere in the newest checkpoint's largest array file: the restore either
    gets the saved arrays exactly (a byte no read uses) or rejects the step and restores the
    previous one. Some flips orbax's reads notice (a shard index checksum, a decompression
    error); the others only runner's checksums catch."""
    import shutil

    store, states = _saved_run(tmp_path, (1, 2))
    store.close()
    victim = max((p for p in (tmp_path / "checkpoints" / "2" / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    pristine = victim.read_bytes()
    rng = np.random.default_rng(1)
    caught_by = []
    for _ in range(12):
        data = bytearray(pristine)
        data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
        victim.write_bytes(bytes(data))
        spec = CheckpointSpec(every_steps=1, keep=5, async_save=False)
        again = Checkpointer(tmp_path / "checkpoints", spec, SavePolicy(spec))
        warnings: list[str] = []
        restored = again.restore_latest(abstract_like(states[2]), warn=warnings.append)
        again.close()
        assert restored is not None
        for key, value in states[restored.step].items():
            np.testing.assert_array_equal(np.asarray(restored.state[key]), np.asarray(value))
        if restored.step == 1:  # set aside: put step 2 back for the next trial
            caught_by.append("checksum" if "checksum mismatch" in warnings[0] else "orbax")
            next((tmp_path / "damaged_checkpoints").iterdir()).rename(tmp_path / "checkpoints" / "2")
            shutil.rmtree(tmp_path / "damaged_checkpoints")
        victim.write_bytes(pristine)
    assert "checksum" in caught_by, caught_by  # flips that would have been restored as good state
