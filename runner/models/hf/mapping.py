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

from runner.checkpoint.files import atomic_write_json
from runner.errors import ConfigError, UserError, first_line

HF_PREFIX = "hf:"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Weight files transformers may read from a model directory: what `runner.main.export --overwrite` clears
# (with the config and tokenizer files), and what an import that finds no safetensors names.
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json",
                   "tf_model*.h5", "flax_model*.msgpack", "model.ckpt*")
MODEL_FILE_PATTERNS = (*WEIGHT_PATTERNS, "config.json", "generation_config.json", "tokenizer*.json", "tokenizer.model",
                       "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                       "chat_template.j*")


@dataclass(frozen=True)
class HFTensor:
    """One Hugging Face tensor: made of `sources` (runner parameter paths, '/'-joined, relative
    to layer `layer`'s parameters, or to the model's when `layer` is None) by `to_hf`, and split
    back into them by `from_hf`. `split`: the model's first `split` layers are scanned apart, as
    `dense_blocks` (an MoE model's leading dense layers; 0: every layer is in `blocks`). `part`:
    the tensor is that slice of each source (one expert of a stacked expert parameter: Hugging
    Face stores each expert's matrices apart)."""

    name: str
    sources: tuple[str, ...]
    layer: int | None
    to_hf: Callable[..., np.ndarray]
    from_hf: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    split: int = 0
    part: tuple[int, ...] = ()


def same(x: np.ndarray) -> np.ndarray:
    return x


def one(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], tuple[np.ndarray, ...]]:
    return lambda x: (fn(x),)


def zeros_of(name: str, shape: tuple[int, ...]) -> tuple[str, tuple[str, ...], Callable[..., np.ndarray],
                                                         Callable[[np.ndarray], tuple[np.ndarray, ...]]]:
    """A layout template for a tensor the architecture has and the runner model lacks (a bias it
    was trained without): exported as zeros, the same function; on import it must be all zeros."""

    def check(x: np.ndarray) -> tuple[np.ndarray, ...]:
        if np.any(x != 0):
            raise UserError(f"The tensor {name} is not zero, and this model has no parameter for it. Fix: import "
                            "with the model settings config.json implies (leave the job.model keys it sets alone).")
        return ()

    return name, (), lambda: np.zeros(shape, np.float32), check


# A source that starts with this names a leaf of the model state (MODEL_STATE: an MoE router's
# moving selection bias), not a parameter: an export reads it from the checkpoint and `to_hf` adds it
# in; an import leaves it alone (a run's model state starts afresh, and the parameter it is added to
# carries the imported value).
STATE_SOURCE = "model_state:"


def param_path(source: str, layer: int | None, scanned: bool, split: int = 0) -> tuple[tuple[str, ...], int | None]:
    """(runner parameter path, index into its stacked layer axis or None). Unrolled, layer i is
    `block_i`; scanned, layers [0, split) are stacked as `dense_blocks` and the rest as `blocks`
    (runner.models.llama.model.Llama.layers), each from index 0. A model-state source's path starts
    with STATE_SOURCE."""
    state = source.startswith(STATE_SOURCE)
    parts = tuple(source[len(STATE_SOURCE) if state else 0:].split("/"))
    mark = (STATE_SOURCE,) if state else ()
    if layer is None:
        return (*mark, *parts), None
    if not scanned:
        return (*mark, f"block_{layer}", *parts), None
    return ((*mark, "dense_blocks", *parts), layer) if layer < split else ((*mark, "blocks", *parts), layer - split)


def _index(tensor: HFTensor, layer_index: int | None) -> tuple[int, ...]:
    """Where a tensor's part lies in its source leaf: the stacked layer, then `part`."""
    return (() if layer_index is None else (layer_index,)) + tensor.part


# ----------------------------------------------------------------------------- reading checkpoints


class CheckpointParams:
    """A checkpoint's parameters (and its model state, by paths that start with STATE_SOURCE), read
    one leaf at a time as numpy arrays (orbax partial restores on the CPU), the few most recent kept."""

    def __init__(self, state_dir: Any, keep: int = 3) -> None:
        import orbax.checkpoint as ocp

        from runner.checkpoint import storage

        self.state_dir = storage.absolute(state_dir)  # local, or gs://
        self._ocp = ocp
        with ocp.PyTreeCheckpointer() as checkpointer:
            metadata = checkpointer.metadata(self.state_dir)
        tree = getattr(metadata, "item_metadata", metadata)
        tree = getattr(tree, "tree", tree)
        self.shapes: dict[tuple[str, ...], tuple[tuple[int, ...], Any]] = {}
        for path, leaf in _flatten(dict(tree).get("params", {})):
            self.shapes[path] = (tuple(leaf.shape), np.dtype(leaf.dtype))
        for path, leaf in _flatten(dict(tree).get("model_state", None) or {}):
            self.shapes[(STATE_SOURCE, *path)] = (tuple(leaf.shape), np.dtype(leaf.dtype))
        self._cache: OrderedDict[tuple[str, ...], np.ndarray] = OrderedDict()
        self.keep = keep

    def __call__(self, path: tuple[str, ...]) -> np.ndarray:
        if path not in self._cache:
            if path not in self.shapes:
                raise UserError(f"The checkpoint {self.state_dir} has no parameter {'/'.join(path)}. Fix: export it "
                                "with the model settings it was trained with (its meta/ holds them).")
            shape, dtype = self.shapes[path]
            collection, inner = ("model_state", path[1:]) if path[0] == STATE_SOURCE else ("params", path)
            item = _nest(inner, np.zeros(shape, dtype))
            restore_args = _nest(inner, self._ocp.RestoreArgs(restore_type=np.ndarray))
            with self._ocp.PyTreeCheckpointer() as checkpointer:
                out = checkpointer.restore(self.state_dir, args=self._ocp.args.PyTreeRestore(
                    item={collection: item}, restore_args={collection: restore_args}, partial_restore=True))
            value = out[collection]
            for key in inner:
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
    """(Hugging Face name, array) for every tensor of `layout`, reading runner leaves with `read`.
    A tensor made of no parameter (a zero bias the model lacks) takes the dtype of the one before."""
    dtype = None
    for tensor in layout:
        arrays = []
        for source in tensor.sources:
            path, index = param_path(source, tensor.layer, scanned, tensor.split)
            leaf = read(path)
            at = _index(tensor, index)
            arrays.append(leaf[at] if at else leaf)
        array = np.ascontiguousarray(tensor.to_hf(*arrays))
        if tensor.sources:
            dtype = array.dtype
        elif dtype is not None:
            array = array.astype(dtype)
        yield tensor.name, array


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


# ----------------------------------------------------------------------------- reading config.json
#
# Each family declares, per Hugging Face model_type, a rule for every config.json field its
# transformers config class has (and the generic PretrainedConfig fields are declared here). A rule
# reads the field into job.model settings, accepts it because it cannot change the computed
# function, or refuses its value. A field nobody declared is refused too: a converter that skips
# what it does not know trains a different model, exit 0 (issue 26).


class Refused(Exception):
    """A rule's refusal of one config.json value: what is wrong, what runner supports, the fix."""

    def __init__(self, problem: str, supported: str, fix: str) -> None:
        super().__init__(problem)
        self.problem, self.supported, self.fix = problem, supported, fix


class HFConfigError(ConfigError):
    """An imported model's config.json field that runner does not implement: one paragraph naming
    the field, its value, what runner supports and the fix."""

    def __init__(self, init_from: str, field: str, value: Any, refusal: Refused) -> None:
        UserError.__init__(self, f"Cannot import run.init_from={init_from!r}: its config.json has {field}={value!r}: "
                                 f"{refusal.problem} runner supports {refusal.supported}. Fix: {refusal.fix}")
        self.key, self.value, self.field = "run.init_from", init_from, field


# A rule: (the field's value, the whole config.json with the architecture's defaults under it,
# the job's job.model section) -> the job.model settings it implies ({} when it implies none).
Rule = Callable[[Any, Mapping[str, Any], Any], Mapping[str, Any]]


def inert(_why: str) -> Rule:
    """A field that cannot change the logits or the gradients (bookkeeping, generation defaults,
    the stored dtype, the initializer of untrained weights); `_why` documents it."""
    return lambda value, config, model: {}


def only(*allowed: Any, supported: str, fix: str) -> Rule:
    """A field whose other values change the model in ways runner does not implement."""

    def rule(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
        if value not in allowed:
            raise Refused("runner computes a different model for that value.", supported, fix)
        return {}

    return rule


def into(key: str, convert: Callable[[Any], Any] = lambda v: v) -> Rule:
    """A field read into job.model.`key` (dotted below job.model)."""
    return lambda value, config, model: {key: convert(value)}


def activation_rule(field: str) -> Rule:
    """An activation by transformers' name, read into job.model.activation when runner computes it."""
    from runner.spec import ACTIVATIONS

    def rule(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
        if value not in ACTIVATIONS:
            raise Refused("runner does not implement that activation.", f"{field} {', '.join(ACTIVATIONS)}",
                          "import a model with one of those activations.")
        return {"activation": "silu" if value == "swish" else value}

    return rule


def token_ids(key: str) -> Rule:
    """bos_token_id / eos_token_id: kept for the export (job.model.hf.*); None is the data's."""

    def rule(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
        if key == "hf.eos_token_id":
            return {key: [] if value is None else [int(v) for v in (value if isinstance(value, list) else [value])]}
        return {key: None if value is None else int(value)}

    return rule


def refuse(problem: str, supported: str, fix: str) -> Rule:
    """A field whose presence alone means a model runner does not implement."""

    def rule(value: Any, config: Mapping[str, Any], model: Any) -> Mapping[str, Any]:
        raise Refused(problem, supported, fix)

    return rule


# The PretrainedConfig fields every architecture has; each family's table comes first.
GENERIC_RULES: dict[str, Rule] = {
    **{name: inert("bookkeeping: names, versions, output switches, classification labels, the stored dtype")
       for name in ("_name_or_path", "transformers_version", "output_hidden_states", "output_attentions",
                    "return_dict", "dtype", "torch_dtype", "id2label", "label2id", "problem_type", "finetuning_task",
                    "tokenizer_class", "prefix", "torchscript", "use_cache", "use_return_dict",
                    "output_router_logits")},
    **{name: inert("token ids for padding, separators and encoder-decoders: not the model's function")
       for name in ("pad_token_id", "sep_token_id", "decoder_start_token_id")},
    **{name: inert("generation defaults of transformers v4 configs: how to sample, not the model")
       for name in ("max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
                    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
                    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
                    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
                    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
                    "suppress_tokens", "begin_suppress_tokens", "task_specific_params")},
    "initializer_range": inert("the initial weights' scale: the weights come from the file"),
    "chunk_size_feed_forward": inert("computing the MLP in chunks gives the same values"),
    "bos_token_id": token_ids("hf.bos_token_id"),
    "eos_token_id": token_ids("hf.eos_token_id"),
    "is_encoder_decoder": only(False, None, supported="decoder-only models", fix="import a decoder-only model."),
    "is_decoder": inert("causal decoding is what every supported architecture does"),
    "add_cross_attention": only(False, None, supported="decoder-only models without cross-attention",
                                fix="import a model without cross-attention."),
    "tie_encoder_decoder": only(False, None, supported="decoder-only models", fix="import a decoder-only model."),
    "pruned_heads": only({}, None, supported="unpruned attention (every head of every layer)",
                         fix="import the model before pruning, or un-prune it in transformers first."),
    "quantization_config": refuse(
        "the weights are quantized, and runner reads plain floating-point weights.",
        "float32, bfloat16 and float16 safetensors",
        "dequantize it in transformers (from_pretrained, then save_pretrained with a float dtype) and import that."),
    "auto_map": refuse(
        "the model ships its own modelling code (trust_remote_code), which may compute something other than "
        "transformers' built-in class.", "transformers' built-in architectures",
        "if its code is transformers' own architecture unchanged, delete auto_map from config.json; "
        "otherwise runner cannot import it."),
}


def read_hf_config(init_from: str, config: Mapping[str, Any], rules: Mapping[str, Rule],
                   defaults: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """job.model settings (dotted keys below job.model) from config.json: every field (and every
    default of the architecture's config class that config.json leaves out) goes through its rule;
    a field without one, or a value its rule refuses, is an HFConfigError."""
    full = {**defaults, **config}
    settings: dict[str, Any] = {}
    for field, value in full.items():
        rule = rules.get(field, GENERIC_RULES.get(field))
        try:
            if rule is None:
                raise Refused("runner does not know that field, so it cannot tell whether it changes the model.",
                              f"the fields of transformers' {full.get('model_type')} config it declares "
                              "(docs/huggingface.md)",
                              "import a model of a supported architecture; if you know the field cannot change the "
                              "model, delete it from config.json.")
            settings.update(rule(value, full, model))
        except Refused as refusal:
            raise HFConfigError(init_from, field, value, refusal) from None
    return settings


# ----------------------------------------------------------------------------- import


def hf_dir(init_from: str) -> Path:
    """The directory of `run.init_from=hf:DIR`, checked."""
    where = Path(init_from[len(HF_PREFIX):]).expanduser()
    if not (where / "config.json").is_file():
        raise ConfigError("run.init_from", init_from, f"{where} has no config.json (not a Hugging Face model "
                          "directory).", "point it at a directory written by save_pretrained or runner.main.export.")
    if (where / INDEX_FILE).is_file():
        try:
            shards = set(json.loads((where / INDEX_FILE).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise ConfigError("run.init_from", init_from, f"its {INDEX_FILE} is unreadable ({first_line(err)}).",
                              "point it at an intact model directory (save_pretrained writes one).") from None
        missing = sorted(name for name in shards if not (where / name).is_file())
        if missing:
            raise ConfigError("run.init_from", init_from, f"its {INDEX_FILE} names shards that are not there: "
                              f"{', '.join(missing[:3])}.", "copy the whole model directory.")
    elif not (where / SINGLE_FILE).is_file():
        others = sorted(p.name for pattern in WEIGHT_PATTERNS for p in where.glob(pattern))
        found = f" (it has {', '.join(others[:3])})" if others else ""
        raise ConfigError("run.init_from", init_from, f"{where} holds no {SINGLE_FILE} or {INDEX_FILE}{found}; "
                          "runner reads safetensors only.", "convert it in transformers: from_pretrained, then "
                          "save_pretrained (safetensors is its default).")
    return where


def read_config(where: Path) -> dict[str, Any]:
    try:
        config = json.loads((where / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"Cannot read {where / 'config.json'}: {first_line(err)}. Fix: point run.init_from at an "
                        "intact Hugging Face model directory.") from None
    if not isinstance(config, dict):
        raise UserError(f"{where / 'config.json'} holds a JSON {type(config).__name__}, not an object of settings. "
                        "Fix: point run.init_from at an intact Hugging Face model directory.")
    return config


class HFTensors:
    """The tensors of a model directory (model.safetensors, or the shards its index names): every
    name, and name -> array. A name the layout asks for with the base model's prefix
    (`model.`, `transformer.`) is also found without it, as the hub's older files store them."""

    def __init__(self, where: Path, base_prefix: str = "") -> None:
        from safetensors import safe_open

        self.where, self.base_prefix = where, base_prefix
        index = where / INDEX_FILE
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [SINGLE_FILE]
        self.file_of: dict[str, str] = {}
        for file in files:
            try:
                with safe_open(str(where / file), framework="numpy") as f:
                    self.file_of.update({name: file for name in f.keys()})
            except Exception as err:  # safetensors raises its own error types for damaged files
                raise UserError(f"Cannot read {where / file}: {first_line(err)}. Fix: point run.init_from at an "
                                "intact model directory.") from None

    def name(self, wanted: str) -> str | None:
        """The stored name of `wanted`, or None."""
        if wanted in self.file_of:
            return wanted
        if self.base_prefix and wanted.startswith(self.base_prefix) and wanted[len(self.base_prefix):] in self.file_of:
            return wanted[len(self.base_prefix):]
        return None

    def __call__(self, wanted: str) -> np.ndarray:
        from safetensors import safe_open

        name = self.name(wanted)
        if name is None:
            raise KeyError(wanted)
        with safe_open(str(self.where / self.file_of[name]), framework="numpy") as f:
            return f.get_tensor(name)


def hf_tensor_reader(where: Path) -> Callable[[str], np.ndarray]:
    """name -> array, from model.safetensors or the shards its index names."""
    return HFTensors(where)


# A tensor a checkpoint may carry that is computed, not learned (a rotary frequency table, a causal
# mask, a tied head's copy): accepted when the check of (its value, the reader) holds.
BufferCheck = Callable[[np.ndarray, Callable[[str], np.ndarray]], bool]


def _place(flat: dict[tuple[str, ...], np.ndarray], tensor: HFTensor, value: np.ndarray,
           shapes: Mapping[tuple[str, ...], Any], scanned: bool, where: Path) -> None:
    """Put one Hugging Face tensor's parts into `flat` (runner path -> array): whole, or into its
    layer's (and expert's) slot of a stacked parameter. A model-state source takes nothing; a
    parameter two tensors fill (a file's copy of a shared table) must get the same value from both."""
    for source, part in zip(tensor.sources, tensor.from_hf(value)):
        path, index = param_path(source, tensor.layer, scanned, tensor.split)
        if path[0] == STATE_SOURCE:
            continue
        at = _index(tensor, index)
        if not at:
            if path in flat and not np.array_equal(flat[path], part):
                raise UserError(f"{where} holds {tensor.name}, a copy of what fills {'/'.join(path)}, with "
                                "another value. Fix: import a model whose copies of its shared tensors agree.")
            flat[path] = part
            continue
        if path not in flat:
            if path not in shapes:
                raise UserError(f"{where} has {tensor.name}, and this model has no parameter {'/'.join(path)} to "
                                "hold it. Fix: use the model settings of its config.json.")
            flat[path] = np.zeros(shapes[path], np.float32)
        if flat[path][at].shape != part.shape:
            raise UserError(f"{where} holds {tensor.name} of shape {tuple(value.shape)}, which does not fit "
                            f"{'/'.join(path)} {tuple(shapes[path])}. Fix: use the model settings of its config.json.")
        flat[path][at] = part


def import_params(layout: Sequence[HFTensor], read: Callable[[str], np.ndarray], shapes: Mapping[tuple[str, ...], Any],
                  scanned: bool, where: Path, buffers: Mapping[str, BufferCheck] | None = None) -> dict[str, Any]:
    """runner's parameter tree (numpy, float32) from Hugging Face tensors, stacked for scanned
    layers. `shapes` are the runner parameters' (path -> shape), to check every one is filled.
    With an `HFTensors` reader, every tensor in the files must be used: by the layout, or as one of
    the `buffers` whose check holds; any other is refused by name (a bias the settings drop, say)."""
    flat: dict[tuple[str, ...], np.ndarray] = {}
    used: set[str] = set()
    for tensor in layout:
        try:
            value = read(tensor.name)
        except KeyError:
            raise UserError(f"{where} has no tensor {tensor.name}, which this model needs. Fix: check that "
                            "config.json and the weights belong together.") from None
        used.add(tensor.name)
        _place(flat, tensor, np.asarray(value, np.float32), shapes, scanned, where)
    missing = sorted("/".join(p) for p in shapes if p not in flat)
    wrong = sorted("/".join(p) for p, a in flat.items() if p in shapes and tuple(a.shape) != tuple(shapes[p]))
    if missing or wrong:
        raise UserError(f"The weights in {where} do not fit this model: missing {missing[:3]}, wrong shape "
                        f"{wrong[:3]}. Fix: use the model settings of its config.json.")
    if isinstance(read, HFTensors):
        stored_used = {read.name(name) for name in used}
        for name, check in (buffers or {}).items():
            stored = read.name(name)
            if stored is not None and stored not in stored_used:
                if not check(np.asarray(read(name)), read):
                    raise UserError(f"{where} holds {stored}, whose value is not the one this model computes "
                                    f"for it. Fix: import a model whose {stored} is standard, or delete it from "
                                    "the file if it is unused.")
                stored_used.add(stored)
        unused = sorted(set(read.file_of) - stored_used)
        if unused:
            raise UserError(f"{where} holds {len(unused)} tensor(s) this model does not use: "
                            f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}. Importing without them "
                            "would compute another model. Fix: check that config.json describes these weights "
                            "(a bias or a layer it does not declare); runner refuses tensors it cannot place.")
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree
