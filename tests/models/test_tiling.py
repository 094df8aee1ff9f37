"""Tiles of each row's tokens (runner.models.common.tiling, job.model.loss_tiles and mlp_tiles): the output
head with its loss, and the dense feed-forward, computed tile by tile give the untiled loss and
every gradient, under an outer scale of the loss, for both families and an MoE, with packed
documents, on one device and on 4 and 8; the whole logits never exist in the tiled step; auto
tiles only when the logits would be large; what would not equal the untiled run is refused.
(20-step curves and a resume after SIGKILL with tiles: tests/parallel/test_context_parallel.py.)"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from tests.conftest import TINY, refused_in_process
from tests.parallel.equivalence import relative_error, run_script

MODELS = """
import dataclasses, jax, jax.numpy as jnp, numpy as np, flax.linen as nn
from runner.models.llama.model import Llama, LlamaConfig, LlamaFamily
from runner.models.gpt.model import GPT, GPTConfig, GPTFamily
from tests.models.test_moe import moe_config

tokens = jax.random.randint(jax.random.PRNGKey(3), (4, 32), 0, 64)
targets = jnp.roll(tokens, -1, axis=1)
seg = np.array([[1] * 5 + [2] * 3 + [3] * 5 + [4] * 11 + [5] * 8, [1] * 32, [1] * 16 + [2] * 12 + [0] * 4,
                [1] * 7 + [2] * 25])
starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1) != 0, np.arange(32), 0), axis=1)
positions, seg = jnp.asarray(np.arange(32) - starts), jnp.asarray(seg)
weights = jnp.asarray((seg > 0) * (1.0 + (np.arange(32) % 3)), jnp.float32)  # a mask and uneven weights
llama = dict(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4, head_dim=8, d_ff=48)
MODELS = {"llama": (Llama, LlamaFamily, LlamaConfig(**llama, n_kv_heads=2)),
          "gpt": (GPT, GPTFamily, GPTConfig(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4)),
          "moe": (Llama, LlamaFamily, dataclasses.replace(moe_config(), context_length=32, moe_dispatch="dense"))}


def loss_and_grads(model, params, scale=3.5):
    \"\"\"(scale x the weighted sum of per-token losses, (per-token losses, argmax hits)) and the
    gradients: the outer scale must reach every gradient, the hidden states' included.\"\"\"
    def loss(p):
        losses, correct = model.apply({"params": p}, tokens, segment_ids=seg, positions=positions, targets=targets)
        return scale * jnp.sum(losses * weights), (losses, correct)

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return step(params), step.lower(params).compile().as_text()
"""


def _namespace() -> dict:
    scope: dict = {}
    exec(MODELS, scope)  # noqa: S102 - the same definitions the multi-device script runs
    return scope


@pytest.mark.parametrize("name", ["llama", "gpt", "moe"])
def test_tiles_give_the_untiled_loss_and_every_gradient_under_an_outer_scale(name: str) -> None:
    """One device: loss_tiles 4, mlp_tiles 8 (dense MLPs), both, against the untiled model with the
    same parameters: the loss, each token's loss and argmax hit, and every gradient within float32
    rounding, with a mask, uneven weights and a scale of 3.5 on the loss; a scale of 1 gives
    gradients 3.5 times smaller (the scale is not dropped anywhere)."""
    scope = _namespace()
    Model, _, cfg = scope["MODELS"][name]
    params = nn.unbox(Model(cfg).init(jax.random.PRNGKey(0), scope["tokens"])["params"])
    ((want_loss, (want_losses, want_correct)), want_grads), _ = scope["loss_and_grads"](Model(cfg), params)
    cases = [{"loss_tiles": 4}] + ([] if name == "moe" else [{"mlp_tiles": 8}, {"loss_tiles": 2, "mlp_tiles": 4}])
    for tiles in cases:
        tiled = Model(dataclasses.replace(cfg, **tiles))
        ((loss, (losses, correct)), grads), _ = scope["loss_and_grads"](tiled, params)
        assert relative_error((loss, losses), (want_loss, want_losses)) < 1e-6, tiles
        np.testing.assert_array_equal(correct, want_correct)
        assert relative_error(grads, want_grads) < 1e-5, tiles
        (_, unscaled), _ = scope["loss_and_grads"](tiled, params, scale=1.0)
        assert relative_error(jax.tree.map(lambda g: 3.5 * g, unscaled), want_grads) < 1e-5, tiles


def test_the_whole_logits_never_exist_in_the_tiled_step() -> None:
    """The compiled loss-and-gradient program of the untiled model holds (4, 32, 64) float32
    logits; tiled over 4, no buffer of that shape (nor a stack of the tiles' logits) exists, forward
    or backward: only one tile's (4, 8, 64) at a time."""
    scope = _namespace()
    Model, _, cfg = scope["MODELS"]["llama"]
    params = nn.unbox(Model(cfg).init(jax.random.PRNGKey(0), scope["tokens"])["params"])
    _, whole = scope["loss_and_grads"](Model(cfg), params)
    _, tiled = scope["loss_and_grads"](Model(dataclasses.replace(cfg, loss_tiles=4)), params)
    assert "f32[4,32,64]" in whole
    assert not re.search(r"f32\[4,32,64\]|f32\[4,4,8,64\]|f32\[4,8,4,64\]", tiled)
    assert "f32[4,8,64]" in tiled


@pytest.mark.deep
def test_tiles_on_4_and_8_devices_give_the_one_device_loss_and_gradients(tmp_path) -> None:
    """8 CPU devices, meshes of 4 and of 8: tiles beside data, fsdp, tensor, context (allgather,
    ring, ulysses, usp) and expert axes, for llama (grouped-query), gpt and an MoE (loss tiles; against its dense
    dispatch), with packed documents: the loss and every gradient within float32 rounding of the
    untiled model on one device."""
    out = run_script(MODELS + TILED_MESHES, tmp_path, devices=8)
    assert len(out) == 9
    for name, error in out.items():
        assert error < 1e-5, (name, error)


TILED_MESHES = """
import json
from runner.parallel.mesh import make_mesh
from tests.parallel.equivalence import relative_error

cases = {"llama": [({"data": 2, "context": 2}, "ulysses", {"loss_tiles": 4, "mlp_tiles": 2}),
                   ({"fsdp": 2, "tensor": 2}, "auto", {"loss_tiles": 2, "mlp_tiles": 4}),
                   ({"data": 2, "context": 4}, "usp", {"loss_tiles": 2, "mlp_tiles": 2}),
                   ({"fsdp": 2, "context": 2, "tensor": 2}, "ring", {"loss_tiles": 4, "mlp_tiles": 4})],
         "gpt": [({"data": 2, "context": 2}, "allgather", {"loss_tiles": 4, "mlp_tiles": 4}),
                 ({"data": 2, "fsdp": 2, "tensor": 2}, "auto", {"loss_tiles": 8, "mlp_tiles": 2}),
                 ({"fsdp": 2, "context": 4}, "ulysses", {"loss_tiles": 2, "mlp_tiles": 2})],
         "moe": [({"expert": 2, "context": 2}, "ulysses", {"loss_tiles": 4}),
                 ({"data": 2, "expert": 2, "context": 2}, "allgather", {"loss_tiles": 2})]}
out = {}
for name, (Model, Family, cfg) in MODELS.items():
    params = nn.unbox(Model(cfg).init(jax.random.PRNGKey(0), tokens)["params"])
    want, _ = loss_and_grads(Model(cfg), params)
    for axes, kind, tiles in cases[name]:
        shape = {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1, **axes}
        size = int(np.prod(list(shape.values())))
        c = dataclasses.replace(cfg, context_parallel=kind, ulysses_ways=2 if kind == "usp" else 0, **tiles,
                                **({"moe_dispatch": "ragged"} if name == "moe" else {}))
        with jax.set_mesh(make_mesh(shape, jax.devices()[:size])), nn.logical_axis_rules(Family.axis_rules(c, shape)):
            got, _ = loss_and_grads(Model(c), params)
        key = name + "/" + "/".join(f"{k}{v}" for k, v in axes.items()) + "/" + kind + "/" + str(tiles)
        out[key] = relative_error((got[0][0], got[0][1][0], got[1]), (want[0][0], want[0][1][0], want[1]))
print(json.dumps(out))
"""


def _spec(*overrides: str, tiny: bool = True):
    from tests.test_spec import spec_for

    return spec_for(*(TINY if tiny else []), *overrides)


def test_auto_tiles_the_head_only_when_a_devices_logits_would_be_large() -> None:
    """loss_tiles=0 (the default): the tiny jobs' logits are small, so untiled; llama3_8b at 131,072
    tokens a row on a v5p-256 (1.96 GiB of logits a device) in tiles of at most 256 MiB, said at launch; a quantized
    head stays whole (a tile's scales would differ)."""
    from runner.models import model_config
    from runner.models.common import tiling

    tiny = _spec("job=llama_tiny")
    assert model_config(tiny).loss_tiles == 1 and tiling.describe(model_config(tiny), tiny) == ""
    long = _spec("job=llama3_8b", "topology=v5p-256", "train.seq_len=131072", "job.model.context_length=131072",
                 "train.batch_size=4", "train.accumulate_steps=1", "eval.batch_size=4", "mesh.fsdp=4",
                 "mesh.context=32", tiny=False)
    assert tiling.tokens_per_device(long) == 4096
    filled = _spec("job=llama3_8b", "topology=v5p-8", "train.seq_len=8192", "train.batch_size=32",
                   "train.accumulate_steps=1", "eval.batch_size=32", tiny=False)
    assert filled.mesh.fsdp == -1 and tiling.tokens_per_device(filled) == 8 * 8192  # fsdp fills v5p-8's 4 devices
    config = model_config(long)
    assert config.loss_tiles == 8  # 4,096 tokens x 128,256 words x 4 bytes = 1.96 GiB; 8 tiles of 251 MiB
    line = tiling.describe(config, long)
    assert line.startswith("tiles: output head and loss over 8 tiles")
    assert line.endswith("(auto): 250.5 MiB of float32 logits at a time on a device, not 1.96 GiB")
    fp8_head = dataclasses.replace(long, job=dataclasses.replace(long.job, model=dataclasses.replace(
        long.job.model, quantization="fp8", quantization_scope=("attention", "mlp", "head"))))
    assert model_config(fp8_head).loss_tiles == 1
    asked = _spec("job=llama_tiny", "job.model.loss_tiles=4", "job.model.mlp_tiles=2")
    assert (model_config(asked).loss_tiles, model_config(asked).mlp_tiles) == (4, 2)
    assert "by loss_tiles=4" in tiling.describe(model_config(asked), asked)


REFUSED = [
    (["job=llama_tiny", "job.model.loss_tiles=3"], "job.model.loss_tiles=3", "does not divide by 3"),
    (["job=llama_tiny", "job.model.mlp_tiles=0"], "job.model.mlp_tiles=0", "it must be > 0"),
    (["job=llama_tiny", "job.model.loss_tiles=-1"], "job.model.loss_tiles=-1", "it must be >= 0"),  # 0: auto
    (["job=llama_tiny", "topology=cpu-2", "mesh.data=1", "mesh.context=2", "job.model.mlp_tiles=32"],
     "job.model.mlp_tiles=32", "train.seq_len=32 / mesh.context=2 = 16 tokens"),
    (["job=moe_tiny", "job.model.mlp_tiles=2"], "job.model.mlp_tiles=2", "routes all of a micro-batch's tokens"),
    (["job=gpt_tiny", "job.model.dropout=0.1", "job.model.mlp_tiles=2"], "job.model.mlp_tiles=2", "dropout=0.1"),
    (["job=llama_tiny", "job.model.quantization=fp8", "job.model.quantization_scope=[mlp]", "job.model.mlp_tiles=2"],
     "job.model.mlp_tiles=2", "quantized to fp8"),
    (["job=llama_tiny", "job.model.quantization=int8", "job.model.quantization_scope=[head]",
      "job.model.quantization_scaling=channel", "job.model.loss_tiles=2"], "job.model.loss_tiles=2",
     "quantized to int8"),
]


@pytest.mark.parametrize("overrides, key, reason", REFUSED, ids=[r[1] + "/" + r[0][0] for r in REFUSED])
def test_tiles_that_would_not_equal_the_untiled_run_are_refused(overrides, key, reason, capsys, tmp_path,
                                                                monkeypatch) -> None:
    """Each one line naming the key and value, exit 2, nothing written: tiles that do not divide
    each device's share of a row, a tiled MoE feed-forward, tiles beside dropout, and tiles of
    quantized matmuls (per tensor or per channel: the weight gradient's scales span the tokens;
    int8 per channel measured 2% off in the gradients)."""
    monkeypatch.chdir(tmp_path)
    line = refused_in_process([*TINY, *overrides], capsys, build=True)
    assert key in line and reason in line, line
    assert not any(tmp_path.iterdir())
