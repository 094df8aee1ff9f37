"""`python -m runner.export RUN_DIR_OR_STEP_DIR OUT_DIR`: a runner checkpoint as a Hugging Face
model directory that `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads.

It reads the newest complete checkpoint of a run directory (or the step directory named), on
this machine's CPU, whatever topology it was saved on: the parameters only, one leaf at a time.
It writes config.json (its dtype the tensors'), generation_config.json, safetensors shards (with an
index when there are several), and the tokenizer's files when the training data's tokenizer is a
Hugging Face one. A model imported from Hugging Face (run.init_from=hf:DIR) goes back out as the
architecture it came in as, with its bos/eos token ids.

The output directory must be new or empty: old weight files beside new ones are loaded by
whichever reader looks first. `--overwrite` removes the model files there (weights, configs,
tokenizer files) before writing, and keeps anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

if __name__ == "__main__":  # the command reads files on the CPU: no accelerator probe (libtpu's page of
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # complaints on a machine without a TPU), before JAX loads

from runner.checkpoint.checkpointer import META, find_state_dir  # noqa: E402
from runner.errors import UserError  # noqa: E402
from runner.exits import USAGE_EXIT_CODE  # noqa: E402
from runner.models import family_for  # noqa: E402
from runner.models.hf.adapter import adapter_of  # noqa: E402
from runner.models.hf.mapping import (MODEL_FILE_PATTERNS, CheckpointParams, export_tensors,  # noqa: E402
                                      write_model_dir)
from runner.spec import spec_from_dict  # noqa: E402


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
        tokenizer = text_tokenizer(type("Ctx", (), {"strategy": strategy, "spec": spec})(), "runner.main.export")
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


def prepare_out_dir(out: Path, overwrite: bool) -> list[str]:
    """Refuse a non-empty output directory unless `overwrite`; then remove the model files in it
    (and only those). Returns the names removed."""
    if out.exists() and not out.is_dir():
        raise UserError(f"The output {out} is a file. Fix: name a new or empty directory.")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not present:
        return []
    if not overwrite:
        raise UserError(f"The output directory {out} is not empty (it holds {', '.join(present[:4])}"
                        f"{' ...' if len(present) > 4 else ''}); old weight files beside new ones would be loaded "
                        "instead of them. Fix: name a new or empty directory, or pass --overwrite to remove the "
                        "model files there first.")
    removed = sorted({p.name for pattern in (*MODEL_FILE_PATTERNS, ".shard-*.tmp") for p in out.glob(pattern)
                      if p.is_file()})
    for name in removed:
        (out / name).unlink()
    return removed


def _dtype_name(dtypes: Counter) -> str:
    """The dtype most of the parameter bytes are stored in, by transformers' name."""
    name = str(dtypes.most_common(1)[0][0]) if dtypes else "float32"
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(name, "float32")


def export(source: str | Path, out_dir: str | Path, max_shard_bytes: int = 2 * 2**30,
           overwrite: bool = False) -> dict[str, Any]:
    state_dir = find_state_dir(source, key="source")
    try:
        meta = json.loads((state_dir.parent / META / "metadata").read_text())
        spec = spec_from_dict(meta["spec"])
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{state_dir.parent} has no readable meta/ (the spec it was trained with): {err}. Fix: "
                        "point at a checkpoint runner wrote.") from None
    family = family_for(spec)
    config = family.config(spec.job.model)
    adapter = adapter_of(family)
    if adapter is None:
        raise UserError(f"The model family {spec.job.model.family!r} has no Hugging Face adapter (`hf` on the "
                        "family: runner.models.hf.adapter). Fix: declare one to export it.")
    hf_config = adapter.config(config)
    files, eod = _tokenizer_files(spec)
    origin = spec.job.model.hf  # an imported model's token ids survive its export
    bos = origin.bos_token_id if origin.bos_token_id is not None else eod
    eos: Any = list(origin.eos_token_id) or eod
    eos = eos[0] if isinstance(eos, list) and len(eos) == 1 else eos
    hf_config.update(bos_token_id=bos, eos_token_id=eos)
    out = Path(out_dir)
    reader = CheckpointParams(state_dir)
    byte_counts: Counter = Counter()
    for shape, dtype in reader.shapes.values():
        byte_counts[str(dtype)] += int(__import__("numpy").prod(shape)) * dtype.itemsize
    hf_config["dtype"] = _dtype_name(byte_counts)
    removed = prepare_out_dir(out, overwrite)
    shards = write_model_dir(out, export_tensors(adapter.layout(config), reader, config.scan_layers), hf_config,
                             {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}, max_shard_bytes)
    for name, data in files.items():
        (out / name).write_bytes(data)
    return {"step": int(meta.get("step", 0)), "shards": [str(s) for s in shards],
            "parameter_bytes": sum(byte_counts.values()), "dtype": hf_config["dtype"], "removed": removed,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "architecture": hf_config["architectures"][0], "tokenizer_files": sorted(files)}


def _quiet() -> None:
    """Export reads files on the CPU: no accelerator probe (libtpu's complaints on a machine
    without a TPU), and orbax's and absl's informational logging kept out of the output."""
    import logging

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    for name in ("absl", "orbax", "jax"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.export", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a run directory, its checkpoints/ directory, or one checkpoints/<step>")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write")
    parser.add_argument("--max-shard-size", default="2GiB", help="largest safetensors shard (default 2GiB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="remove the model files (weights, configs, tokenizer files) in a non-empty out_dir first")
    args = parser.parse_args(argv)
    _quiet()
    try:
        report = export(args.source, args.out_dir, _size(args.max_shard_size), args.overwrite)
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
