"""The run card: what this run is, in one Markdown file in its run directory.

Written at start (parameters, FLOPs per token, mesh, per-device memory estimate, the resolved
spec) and rewritten at the end with the final metrics.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from omegaconf import OmegaConf

RUN_CARD = "RUN_CARD.md"


def _human(n: float, unit: str = "") -> str:
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def summary_lines(facts: Mapping[str, Any]) -> list[str]:
    mem = facts.get("memory_per_device_bytes")
    return [
        f"parameters: {facts['parameters']:,} ({_human(facts['parameters'])})",
        f"training FLOPs per token: {_human(facts['flops_per_token'], 'FLOP')}",
        f"mesh: {facts['mesh']} over {facts['devices']} devices, {facts['processes']} process(es)",
        "memory per device (estimate): " + (f"{mem / 2**20:,.1f} MiB ({facts['memory_source']})" if mem else "unknown"),
    ]


def write(run_dir: Path, spec: Any, facts: Mapping[str, Any], final: Mapping[str, float] | None = None) -> Path:
    lines = [f"# Run card: {spec.job.name}", "", f"Run directory: `{run_dir}`", ""]
    lines += [f"- {line}" for line in summary_lines(facts)]
    if final:
        lines += ["", "## Final metrics", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |"
                  for k, v in final.items() if "_norm/" not in k]
    lines += ["", "## Resolved spec", "", "```yaml", OmegaConf.to_yaml(OmegaConf.structured(spec)).rstrip(), "```", ""]
    path = run_dir / RUN_CARD
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, path)
    return path
