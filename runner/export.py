"""`python -m runner.export RUN_DIR_OR_STEP_DIR OUT_DIR`: a runner checkpoint as a Hugging Face
model directory that `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads.

It reads the newest complete checkpoint of a run directory (or the step directory named), on
this machine's CPU, whatever topology it was saved on: the parameters only, one leaf at a time.
It writes config.json, generation_config.json, safetensors shards (with an index when there are
several), and the tokenizer's files when the training data's tokenizer is a Hugging Face one.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path
from typing import Any, Sequence

from runner.checkpoint import META, find_state_dir
from runner.errors import UserError
from runner.exits import USAGE_EXIT_CODE
from runner.hf import CheckpointParams, export_tensors, write_model_dir
from runner.models import family_for
from runner.spec import spec_from_dict


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    upper = text.strip().upper()
    for unit, scale in sorted(units.items(), key=lambda u: -len(u[0])):
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * scale)
    return int(upper)


def _tokenizer_files(spec: Any) -> tuple[dict[str, bytes], int | None]:
    """The training data's tokenizer files (a Hugging Face tokenizer's), and its end-of-document id."""
    from runner.data.strategies import build_strategy
    from runner.evaluation.base import text_tokenizer

    try:
        strategy = build_strategy(spec.data.strategy, spec.data)
        tokenizer = text_tokenizer(type("Ctx", (), {"strategy": strategy, "spec": spec})(), "runner.export")
    except UserError:
        return {}, None
    if getattr(strategy, "tokenizer", None) != "hf" or not hasattr(tokenizer, "files"):
        return {}, int(tokenizer.eod_id)
    files = dict(tokenizer.files())
    special = getattr(tokenizer, "eod_token", None)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": spec.job.model.context_length,
              **({"eos_token": special, "bos_token": special} if special else {})}
    files["tokenizer_config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    return files, int(tokenizer.eod_id)


def export(source: str | Path, out_dir: str | Path, max_shard_bytes: int = 2 * 2**30) -> dict[str, Any]:
    state_dir = find_state_dir(source, key="source")
    try:
        meta = json.loads((state_dir.parent / META / "metadata").read_text())
        spec = spec_from_dict(meta["spec"])
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{state_dir.parent} has no readable meta/ (the spec it was trained with): {err}. Fix: "
                        "point at a checkpoint runner wrote.") from None
    family = family_for(spec)
    config = family.config(spec.job.model)
    if not hasattr(family, "hf_layout"):
        raise UserError(f"The model family {spec.job.model.family!r} has no Hugging Face layout (hf_config, "
                        "hf_layout). Fix: add them to the family to export it.")
    hf_config = family.hf_config(config)
    files, eod = _tokenizer_files(spec)
    if eod is not None:
        hf_config.update(bos_token_id=eod, eos_token_id=eod)
    out = Path(out_dir)
    reader = CheckpointParams(state_dir)
    shards = write_model_dir(out, export_tensors(family.hf_layout(config), reader, config.scan_layers), hf_config,
                             {"bos_token_id": eod, "eos_token_id": eod, "do_sample": False}, max_shard_bytes)
    for name, data in files.items():
        (out / name).write_bytes(data)
    params = sum(int(__import__("numpy").prod(s)) * d.itemsize for s, d in reader.shapes.values())
    return {"step": int(meta.get("step", 0)), "shards": [str(s) for s in shards], "parameter_bytes": params,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "architecture": hf_config["architectures"][0], "tokenizer_files": sorted(files)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.export", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a run directory, its checkpoints/ directory, or one checkpoints/<step>")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write")
    parser.add_argument("--max-shard-size", default="2GiB", help="largest safetensors shard (default 2GiB)")
    args = parser.parse_args(argv)
    try:
        report = export(args.source, args.out_dir, _size(args.max_shard_size))
    except UserError as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return USAGE_EXIT_CODE
    print(f"Exported step {report['step']} as {report['architecture']} to {args.out_dir}: "
          f"{len(report['shards'])} shard(s), {report['parameter_bytes'] / 2**20:.1f} MiB of parameters, "
          f"peak host memory {report['peak_rss_bytes'] / 2**20:.1f} MiB", flush=True)
    print(json.dumps({"report": "export", **report}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
