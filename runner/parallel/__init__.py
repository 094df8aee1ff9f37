"""Devices and parallelism: topology names, the device mesh, jax.distributed, mode=compile for a
topology without its hardware, and the persistent compilation cache."""
