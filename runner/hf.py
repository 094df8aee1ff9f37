"""Hugging Face exchange: runner checkpoints out to a transformers model directory, and a
transformers model directory in as a run's starting parameters (`run.init_from=hf:DIR`).

Each model family describes its layout as a list of `HFTensor`s: the Hugging Face tensor name,
the runner parameters it is made of (paths relative to a layer, or to the model), and the two
conversions. This module does the rest, the same for every family: it reads a checkpoint's
parameters leaf by leaf on the CPU (no optimizer state, any topology it was saved on), writes
safetensors shards with an index, config.json and generation_config.json, and reads them back
into runner's layout (scanned or unrolled layers).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from runner.errors import ConfigError, UserError, first_line
from runner.files import atomic_write_json

HF_PREFIX = "hf:"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class HFTensor:
    """One Hugging Face tensor: made of `sources` (runner parameter paths, '/'-joined, relative
    to layer `layer`'s parameters, or to the model's when `layer` is None) by `to_hf`, and split
    back into them by `from_hf`."""

    name: str
    sources: tuple[str, ...]
    layer: int | None
    to_hf: Callable[..., np.ndarray]
    from_hf: Callable[[np.ndarray], tuple[np.ndarray, ...]]


def same(x: np.ndarray) -> np.ndarray:
    return x


def one(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], tuple[np.ndarray, ...]]:
    return lambda x: (fn(x),)


def param_path(source: str, layer: int | None, scanned: bool) -> tuple[tuple[str, ...], int | None]:
    """(runner parameter path, index into its stacked layer axis or None)."""
    parts = tuple(source.split("/"))
    if layer is None:
        return parts, None
    return (("blocks", *parts), layer) if scanned else ((f"block_{layer}", *parts), None)


# ----------------------------------------------------------------------------- reading checkpoints


class CheckpointParams:
    """A checkpoint's parameters, read one leaf at a time as numpy arrays (orbax partial
    restores on the CPU), the few most recent kept."""

    def __init__(self, state_dir: Any, keep: int = 3) -> None:
        import orbax.checkpoint as ocp

        from runner import storage

        self.state_dir = storage.absolute(state_dir)  # local, or gs://
        self._ocp = ocp
        with ocp.PyTreeCheckpointer() as checkpointer:
            metadata = checkpointer.metadata(self.state_dir)
        tree = getattr(metadata, "item_metadata", metadata)
        tree = getattr(tree, "tree", tree)
        self.shapes: dict[tuple[str, ...], tuple[tuple[int, ...], Any]] = {}
        for path, leaf in _flatten(dict(tree).get("params", {})):
            self.shapes[path] = (tuple(leaf.shape), np.dtype(leaf.dtype))
        self._cache: OrderedDict[tuple[str, ...], np.ndarray] = OrderedDict()
        self.keep = keep

    def __call__(self, path: tuple[str, ...]) -> np.ndarray:
        if path not in self._cache:
            if path not in self.shapes:
                raise UserError(f"The checkpoint {self.state_dir} has no parameter {'/'.join(path)}. Fix: export it "
                                "with the model settings it was trained with (its meta/ holds them).")
            shape, dtype = self.shapes[path]
            item = _nest(path, np.zeros(shape, dtype))
            restore_args = _nest(path, self._ocp.RestoreArgs(restore_type=np.ndarray))
            with self._ocp.PyTreeCheckpointer() as checkpointer:
                out = checkpointer.restore(self.state_dir, args=self._ocp.args.PyTreeRestore(
                    item={"params": item}, restore_args={"params": restore_args}, partial_restore=True))
            value = out["params"]
            for key in path:
                value = value[key]
            self._cache[path] = np.asarray(value)
            while len(self._cache) > self.keep:
                self._cache.popitem(last=False)
        return self._cache[path]


def _flatten(tree: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _flatten(value, (*prefix, str(key)))
    else:
        yield prefix, tree


def _nest(path: Sequence[str], leaf: Any) -> dict[str, Any]:
    out: Any = leaf
    for key in reversed(path):
        out = {key: out}
    return out


# ----------------------------------------------------------------------------- export


def export_tensors(layout: Sequence[HFTensor], read: Callable[[tuple[str, ...]], np.ndarray],
                   scanned: bool) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, array) for every tensor of `layout`, reading runner leaves with `read`."""
    for tensor in layout:
        arrays = []
        for source in tensor.sources:
            path, index = param_path(source, tensor.layer, scanned)
            leaf = read(path)
            arrays.append(leaf[index] if index is not None else leaf)
        yield tensor.name, np.ascontiguousarray(tensor.to_hf(*arrays))


def write_model_dir(out_dir: Path, tensors: Iterator[tuple[str, np.ndarray]], config: Mapping[str, Any],
                    generation: Mapping[str, Any], max_shard_bytes: int = 2 * 2**30) -> list[Path]:
    """safetensors shards (with an index when there are several), config.json and
    generation_config.json. A shard is written once it would pass `max_shard_bytes`."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    written: list[Path] = []
    weight_map: dict[str, int] = {}
    size, total = 0, 0

    def flush(final: bool) -> None:
        index = len(written) + 1
        path = out_dir / f".shard-{index:05d}.tmp"
        save_file(shards[-1], str(path), metadata={"format": "pt"})
        written.append(path)

    for name, array in tensors:
        if size and size + array.nbytes > max_shard_bytes:
            flush(False)
            shards.append({})
            size = 0
        shards[-1][name] = array
        weight_map[name] = len(written)
        size += array.nbytes
        total += array.nbytes
    flush(True)
    shards.clear()
    names = [SINGLE_FILE] if len(written) == 1 else [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
                                                     for i in range(len(written))]
    final = [out_dir / n for n in names]
    for tmp, path in zip(written, final):
        tmp.replace(path)
    if len(final) > 1:
        atomic_write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": total},
                                                 "weight_map": {k: names[v] for k, v in sorted(weight_map.items())}},
                          indent=2)
    atomic_write_json(out_dir / "config.json", dict(config), indent=2, sort_keys=True)
    atomic_write_json(out_dir / "generation_config.json", dict(generation), indent=2, sort_keys=True)
    return final


# ----------------------------------------------------------------------------- import


def hf_dir(init_from: str) -> Path:
    """The directory of `run.init_from=hf:DIR`, checked."""
    where = Path(init_from[len(HF_PREFIX):]).expanduser()
    if not (where / "config.json").is_file():
        raise ConfigError("run.init_from", init_from, f"{where} has no config.json (not a Hugging Face model "
                          "directory).", "point it at a directory written by save_pretrained or runner.export.")
    return where


def read_config(where: Path) -> dict[str, Any]:
    try:
        return json.loads((where / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"Cannot read {where / 'config.json'}: {first_line(err)}. Fix: point run.init_from at an "
                        "intact Hugging Face model directory.") from None


def hf_tensor_reader(where: Path) -> Callable[[str], np.ndarray]:
    """name -> array, from model.safetensors or the shards its index names."""
    from safetensors import safe_open

    index = where / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (where / SINGLE_FILE).is_file():
        weight_map = None
    else:
        raise UserError(f"{where} holds no {SINGLE_FILE} or {INDEX_FILE}. Fix: save the model with safetensors "
                        "(save_pretrained's default).")

    def read(name: str) -> np.ndarray:
        file = where / (weight_map[name] if weight_map is not None else SINGLE_FILE)
        if weight_map is not None and name not in weight_map:
            raise KeyError(name)
        with safe_open(str(file), framework="numpy") as f:
            return f.get_tensor(name)

    return read


def import_params(layout: Sequence[HFTensor], read: Callable[[str], np.ndarray], shapes: Mapping[tuple[str, ...], Any],
                  scanned: bool, where: Path) -> dict[str, Any]:
    """runner's parameter tree (numpy, float32) from Hugging Face tensors, stacked for scanned
    layers. `shapes` are the runner parameters' (path -> shape), to check every one is filled."""
    flat: dict[tuple[str, ...], np.ndarray] = {}
    for tensor in layout:
        try:
            value = read(tensor.name)
        except KeyError:
            raise UserError(f"{where} has no tensor {tensor.name}, which this model needs. Fix: check that "
                            "config.json and the weights belong together.") from None
        for source, part in zip(tensor.sources, tensor.from_hf(np.asarray(value, np.float32))):
            path, index = param_path(source, tensor.layer, scanned)
            if index is None:
                flat[path] = part
            else:
                if path not in flat:
                    flat[path] = np.zeros(shapes[path], np.float32)
                flat[path][index] = part
    missing = sorted("/".join(p) for p in shapes if p not in flat)
    wrong = sorted("/".join(p) for p, a in flat.items() if p in shapes and tuple(a.shape) != tuple(shapes[p]))
    if missing or wrong:
        raise UserError(f"The weights in {where} do not fit this model: missing {missing[:3]}, wrong shape "
                        f"{wrong[:3]}. Fix: use the model settings of its config.json.")
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def check_dims(expected: Mapping[str, Any], config: Any, where: Path) -> None:
    """Refuse a Hugging Face model whose dims differ from the family's config (job.model, with its
    defaults resolved): one paragraph naming the job.model field."""
    for key, (hf_key, value) in expected.items():
        ours = getattr(config, key.replace(".", "_"))
        if ours != value:
            raise ConfigError(f"job.model.{key}", ours, f"{where / 'config.json'} says {hf_key}={value!r}.",
                              f"set job.model.{key}={value!r} (the imported model's dims come from its config.json).")
