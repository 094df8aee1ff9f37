"""optimizer.offload=host: the optimizer state kept in the host's pinned memory between steps.

AdamW's two float32 moments are eight bytes a parameter, twice a bfloat16 model's weights and
gradients together: at long context the device needs that memory for activations, and the state
is only read once a step, by the update. With `host`, every leaf of the state lives in host
memory (JAX's memory kind `pinned_host`) as the train step's input and output; the step copies
it to the device after the backward pass's activations are gone, updates it and copies it back
(MaxText's optimizer offload). Checkpoints do not record where the state lived: a run saved with
it resumes without it and the other way round.

The runtime must give its devices a host memory kind (JAX on TPU, GPU and CPU does; a CPU's
device memory is the host's, so there it places the state and saves nothing). A platform
without one is refused, naming it.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax

from runner.errors import ConfigError

HOST_MEMORY = "pinned_host"  # where the state lives between steps
DEVICE_MEMORY = "device"


def host_memory_kinds(device: Any) -> set[str]:
    """The memory kinds a device (or a compile-only one) offers; empty when its runtime has none."""
    try:
        return {memory.kind for memory in device.addressable_memories()}
    except Exception:  # noqa: BLE001 (a runtime without memory kinds raises; any such is "none")
        return set()


def check_devices(offload: str, devices: Iterable[Any]) -> None:
    """Refuse optimizer.offload=host on devices whose runtime has no pinned host memory. Devices
    that list no memory at all are another process's (a pod's compile-only devices list only the
    first host's): the ones that do list them decide."""
    if offload != "host":
        return
    devices = list(devices)
    listed = [(device, kinds) for device in devices if (kinds := host_memory_kinds(device))]
    lacking = [(device, kinds) for device, kinds in listed if HOST_MEMORY not in kinds] or \
        ([] if listed else [(devices[0], set())])
    if lacking:
        device, kinds = lacking[0]
        raise ConfigError("optimizer.offload", offload, f"it keeps the optimizer state in the host's pinned memory "
                          f"between steps, and this run's {device.platform} devices offer no such memory (their "
                          f"memory kinds: {sorted(kinds) or 'none'}).", "use optimizer.offload=none here, or a TPU "
                          "or GPU topology.")


def on_host(shardings: Any) -> Any:
    """The same shardings in the host's pinned memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings)


def fetch(tree: Any, shardings: Any) -> Any:
    """Inside a jitted step: the leaves kept in host memory, copied to the device (same layout)."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind(DEVICE_MEMORY))
                        if s.memory_kind == HOST_MEMORY else x, tree, shardings)


def store(tree: Any, shardings: Any) -> Any:
    """Inside a jitted step: the leaves that live in host memory, copied back there."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s) if s.memory_kind == HOST_MEMORY else x, tree, shardings)
