"""The run card: what this run is, in one Markdown file in its run directory.

Written at start (parameters, FLOPs per token, mesh, per-device memory estimate, the resolved
spec) and rewritten at the end with the final metrics. `RunCard` does both for a training job;
the facts are kept here, not in the trainer, because they only describe the run.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from omegaconf import OmegaConf

from runner.checkpoint.files import atomic_write
from runner.observability.metrics import METRICS_FILE
from runner.parallel.compile import attention_summary

RUN_CARD = "RUN_CARD.md"


def _human(n: float, unit: str = "") -> str:
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def summary_lines(facts: Mapping[str, Any]) -> list[str]:
    mem = facts.get("memory_per_device_bytes")
    return [
        f"parameters: {facts['parameters']:,} ({_human(facts['parameters'])})"
        + (f", {facts['active_parameters']:,} ({_human(facts['active_parameters'])}) active per token"
           if facts.get("active_parameters") else ""),
        "training FLOPs per token: " + (_human(facts["flops_per_token"], "FLOP") if facts.get("flops_per_token")
                                         else "unknown"),
        f"mesh: {facts['mesh']} over {facts['devices']} devices, {facts['processes']} process(es)",
        "memory per device (estimate): " + (f"{mem / 2**20:,.1f} MiB ({facts['memory_source']})" if mem else "unknown")
        + (f"; in host memory: {facts['host_memory_bytes'] / 2**20:,.1f} MiB a device (the optimizer state, "
           "optimizer.offload=host)" if facts.get("host_memory_bytes") else ""),
        *([f"attention: {facts['attention']}"] if facts.get("attention") else []),
        *([facts["tiling"]] if facts.get("tiling") else []),
        *([facts["pipeline"]] if facts.get("pipeline") else []),
        *([facts["quantization"]] if facts.get("quantization") else []),
        *([facts["throughput"]] if facts.get("throughput") else []),
        *([facts["checkpoints"]] if facts.get("checkpoints") else []),
    ]


def write(run_dir: Any, spec: Any, facts: Mapping[str, Any], final: Mapping[str, float] | None = None) -> Any:
    lines = [f"# Run card: {spec.job.name}", "", f"Run directory: `{run_dir}`", ""]
    lines += [f"- {line}" for line in summary_lines(facts)]
    if final:
        lines += ["", "## Final metrics", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |"
                  for k, v in final.items() if "_norm/" not in k]
    lines += ["", "## Resolved spec", "", "```yaml", OmegaConf.to_yaml(OmegaConf.structured(spec)).rstrip(), "```", ""]
    path = run_dir / RUN_CARD
    return atomic_write(path, "\n".join(lines))


def run_facts(params: Any, flops_per_token: Optional[float], mesh: Any, executable: Any, state: Any) -> dict[str, Any]:
    """Parameter count, FLOPs per token, mesh and per-device memory: from the compiled step's
    memory analysis (arguments, outputs, temporaries), else from the state's shards."""
    import jax
    import numpy as np

    facts: dict[str, Any] = {
        "parameters": sum(int(x.size) for x in jax.tree.leaves(params)),
        "flops_per_token": flops_per_token,
        "mesh": dict(mesh.shape), "devices": jax.device_count(), "processes": jax.process_count(),
    }
    try:
        stats = executable.memory_analysis()
        facts["memory_per_device_bytes"] = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                                            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
        facts["memory_source"] = "compiled train step: arguments + outputs + temporaries"
    except Exception:  # some backends report no memory analysis
        shards = [s.data for x in jax.tree.leaves(state) for s in getattr(x, "addressable_shards", [])[:1]]
        facts["memory_per_device_bytes"] = sum(int(np.prod(d.shape)) * d.dtype.itemsize for d in shards)
        facts["memory_source"] = "train state only"
    facts["host_memory_bytes"] = sum(int(np.prod(x.addressable_shards[0].data.shape)) * x.dtype.itemsize
                                     for x in jax.tree.leaves(state) if _in_host_memory(x))
    return facts


def _in_host_memory(x: Any) -> bool:
    """Whether an array lives in the host's pinned memory (optimizer.offload=host)."""
    return getattr(getattr(x, "sharding", None), "memory_kind", None) == "pinned_host" and bool(x.addressable_shards)


def summary(spec: Any, step: int, restored_step: Optional[int], seconds: float, last_metrics: Mapping[str, float],
            last_eval: Mapping[str, float], checkpoint: Any, metrics_file: Any) -> str:
    """The lines printed when a run finishes."""
    trained = step - (restored_step or 0)
    tokens = trained * spec.train.batch_size * spec.train.seq_len
    lines = [
        "",
        f"Finished {spec.job.name}: {step} steps ({trained} this launch), {tokens:,} tokens in {seconds:.1f}s",
        f"  final train loss {last_metrics.get('loss', float('nan')):.4f}",
    ]
    lines += [f"  final eval {k.removeprefix('eval/')} {v:.4f}" for k, v in last_eval.items()
              if k.endswith(("loss", "perplexity"))]
    lines.append(f"  checkpoint: {checkpoint}")
    lines.append(f"  metrics:    {metrics_file}")
    return "\n".join(lines)


def job_facts(job: Any) -> dict[str, Any]:
    """`run_facts` of a job whose train step is compiled (a BaseTrainer), with what the job adds:
    the basis of its rates, its active parameters, attention, tiles, pipeline and quantization."""
    state = job.state
    facts = run_facts(state.params, job.flops_per_token(), job.mesh, job.program.train_executable(state), state)
    facts["throughput"] = job.throughput.describe()
    active = job.active_param_count()
    if active is not None and active != facts["parameters"]:
        facts["active_parameters"] = active
    if getattr(job, "attention", ""):
        facts["attention"] = attention_summary(job)
    facts["tiling"] = job.tiling()
    facts["pipeline"] = job.pipeline_schedule()
    quantized = getattr(job, "quantization", "")
    if quantized:
        facts["quantization"] = quantized
    return facts


class RunCard:
    """One launch's run card, of a training job (a BaseTrainer): the facts are gathered once its
    train step is compiled and the card written then, and again when the run finishes."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self.facts: dict[str, Any] = {}

    def start(self, say: Callable[[str], None]) -> None:
        """Gather the facts (warning of what the platform runs slowly), print them and write the card."""
        job = self.job
        self.facts = job_facts(job)
        if self.facts.get("quantization"):
            for warning in job.quantization_warnings():
                job.warn(warning)
        self.facts["checkpoints"] = job.checkpoints.describe(job.restored_step, job.restored_from)
        for line in summary_lines(self.facts):
            say(line)
        self._write(None)

    def end(self, seconds: float, goodput_line: str, say: Callable[[str], None]) -> None:
        """The summary a finished run prints, then where its time went; the card again, with the final
        metrics and the tiers' line with the local saves this launch had to skip."""
        job = self.job
        say(summary(job.spec, job.step, job.restored_step, seconds, job.last_metrics, job.last_eval,
                    job.checkpointer.directory / str(job.step), job.run_dir / METRICS_FILE))
        say(goodput_line)
        self.facts["checkpoints"] = job.checkpoints.describe(job.restored_step, job.restored_from)
        self._write({**job.last_metrics, **job.last_eval})

    def _write(self, final: Optional[Mapping[str, float]]) -> None:
        import jax

        if jax.process_index() == 0:
            write(self.job.run_dir, self.job.spec, self.facts, final)
