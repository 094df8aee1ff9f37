"""Persistence: storage (local paths and gs:// as one Path), atomic files, and the checkpointer
(orbax: state + meta, the save policy, damaged-checkpoint fallback)."""
