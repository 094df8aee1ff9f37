"""Attention implementations and document-masked packing (job.model.attention, data.document_mask).

Every implementation that runs on this machine is compared with the xla reference, with segment
ids, in outputs and gradients (splash in Pallas interpret mode; cuDNN only with an NVIDIA GPU).
The tolerances are the documented ones: 2e-5 absolute in float32 (only the summation order
differs). A packed row's summed loss equals the sum of its documents' losses computed one at a
time, for both model families and every implementation that runs here.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from runner.data.documents import DocumentMask, DocumentMasked
from runner.errors import ConfigError
from runner.models.attention import kernels as attention
from runner.models.gpt.model import GPT, GPTConfig
from runner.models.llama.model import Llama, LlamaConfig
from tests.conftest import ROOT, fork_server, read_metrics, run_runner, runner_env
from tests.forked import run as forked

HERE_IMPLS = ["xla", "splash_interpret"]  # in float32
GPU = jax.default_backend() == "gpu"
TOL = 2e-5  # float32 (summation order only); cuDNN has bfloat16 kernels only (test_cudnn_agrees_in_bfloat16)
EOD = 7


def qkv_and_segments(batch: int = 2, seq: int = 128, heads: int = 4, kv_heads: int = 2, dim: int = 32,
                     dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (batch, seq, heads, dim), dtype)
    k, v = (jax.random.normal(key, (batch, seq, kv_heads, dim), dtype) for key in ks[1:])
    # Row 0: three documents; row 1: one document, then a second from position 77.
    cuts = [(0, 30, 90), (0, 77)]
    segments = np.zeros((batch, seq), np.int32)
    for row, starts in enumerate(cuts):
        for i, start in enumerate(starts):
            segments[row, start:] = i
    return q, k, v, jnp.asarray(segments)


def outputs_and_grads(impl: str, q, k, v, segments):
    """The output and the gradients of sum(sin(output)), from one forward pass."""
    out, pullback = jax.vjp(lambda q, k, v: attention.attend(impl, q, k, v, segments), q, k, v)
    return out, pullback(jnp.cos(out.astype(jnp.float32)).astype(out.dtype))


@pytest.mark.parametrize("impl", [i for i in HERE_IMPLS if i != "xla"])
@pytest.mark.parametrize("kv_heads", [2, 1])  # grouped, multi-query (multi-head: the GPT loss test)
def test_every_implementation_agrees_with_xla_with_segments(impl: str, kv_heads: int) -> None:
    q, k, v, segments = qkv_and_segments(kv_heads=kv_heads)
    with jax.default_matmul_precision("float32"):  # a GPU's XLA would otherwise multiply float32 in TF32
        want, want_grads = outputs_and_grads("xla", q, k, v, segments)
        got, got_grads = outputs_and_grads(impl, q, k, v, segments)
    np.testing.assert_allclose(got, want, atol=TOL)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=TOL)
    # The segments matter here (an implementation that ignored them would fail above).
    with jax.default_matmul_precision("float32"):
        unsegmented = attention.attend("xla", q, k, v, None)
        assert float(jnp.max(jnp.abs(unsegmented - want))) > 0.1
        np.testing.assert_allclose(attention.attend(impl, q, k, v, None), unsegmented, atol=TOL)


def windowed_reference(q, k, v, segments, window: int):
    """Attention by an explicit boolean mask: earlier keys of the query's document, within its window."""
    i = np.arange(q.shape[1])
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    mask = jnp.asarray(allowed)[None, None] & (segments[:, :, None] == segments[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


@pytest.mark.parametrize("impl", HERE_IMPLS)
def test_a_sliding_window_masks_every_implementation_by_place_with_segments(impl: str) -> None:
    """A query sees its last `window` keys (itself included, Hugging Face's sliding_window) of its
    own document: each implementation against an explicit mask, outputs and gradients; splash's
    windowed mask skips the blocks out of reach (windows of 40: blocks of 128 partly in reach)."""
    q, k, v, segments = qkv_and_segments()

    def run(fn):
        out, pullback = jax.vjp(fn, q, k, v)
        return out, pullback(jnp.cos(out))

    with jax.default_matmul_precision("float32"):
        for window in (40, 1):
            want, want_grads = run(lambda a, b, c: windowed_reference(a, b, c, segments, window))
            got, got_grads = run(lambda a, b, c: attention.attend(impl, a, b, c, segments, window=window))
            np.testing.assert_allclose(got, want, atol=TOL)
            for g, w in zip(got_grads, want_grads):
                np.testing.assert_allclose(g, w, atol=TOL)
        whole = attention.attend(impl, q, k, v, segments)
    assert float(jnp.max(jnp.abs(whole - attention.attend(impl, q, k, v, segments, window=40)))) > 0.1
    np.testing.assert_allclose(attention.attend(impl, q, k, v, segments, window=128), whole, atol=TOL)


@pytest.mark.skipif(not GPU, reason="cuDNN attention needs an NVIDIA GPU")
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_cudnn_agrees_in_bfloat16(kv_heads: int) -> None:
    q, k, v, segments = qkv_and_segments(kv_heads=kv_heads, dtype=jnp.bfloat16)
    want, want_grads = outputs_and_grads("xla", q, k, v, segments)
    got, got_grads = outputs_and_grads("cudnn", q, k, v, segments)
    # bfloat16 keeps 8 significant bits: a few units in the last place (1/64 of a value near 12)
    # apart is the summation order, not a bug. Seen on an H100: 2 of 8192 gradients one unit apart.
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=2e-2, rtol=2e-2)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.float32(g), np.float32(w), atol=5e-2, rtol=2e-2)


SHARDED = """
import json, jax, jax.numpy as jnp, numpy as np, flax.linen as nn
from tests.models.test_attention import qkv_and_segments, outputs_and_grads
from runner.parallel.mesh import make_mesh
from runner.models.llama.model import axis_rules, LlamaConfig
mesh = make_mesh({"data": 2, "fsdp": 1, "tensor": 2})
errors = {}
for kv_heads in (2, 1):  # kv heads split over tensor; one kv head, replicated
    cfg = LlamaConfig(vocab_size=8, context_length=128, d_model=8, n_layers=1, n_heads=4, n_kv_heads=kv_heads,
                      head_dim=32, d_ff=8)
    q, k, v, seg = qkv_and_segments(kv_heads=kv_heads)
    want, want_grads = outputs_and_grads("xla", q, k, v, seg)
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(cfg, 2)):
        run = jax.jit(lambda q, k, v, s: outputs_and_grads("splash_interpret", q, k, v, s))
        got, got_grads = run(q, k, v, seg)
        text = run.lower(q, k, v, seg).as_text()
    errors[kv_heads] = [float(jnp.max(jnp.abs(a - b))) for a, b in zip((got, *got_grads), (want, *want_grads))]
    errors[f"{kv_heads}_shard_map"] = "shard_map" in text or "sdy.manual_computation" in text
print(json.dumps(errors))
"""


@pytest.mark.deep
def test_splash_under_a_data_and_tensor_mesh_agrees_with_xla(tmp_path) -> None:
    """shard_map per device on a (data 2, tensor 2) mesh of 4 CPU devices, kv heads split and replicated."""
    proc = forked(fork_server(), "code", SHARDED, [], ROOT, runner_env(tmp_path, devices=4), 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    for kv_heads in ("2", "1"):
        assert max(errors[kv_heads]) < TOL, errors
        assert errors[f"{kv_heads}_shard_map"], "splash must run per device inside shard_map"


@pytest.mark.deep
def test_splash_trains_document_masked_rows_on_a_tensor_mesh_and_cudnn_is_refused_on_a_cpu(tmp_path) -> None:
    """Through `python -m runner`, as a user would: docs/speed.md's names end to end."""
    args = ["job=llama_tiny", "train.steps=2", "eval.every=0", "eval.rows=8", "logging.wandb=disabled",
            "data.document_mask=true"]
    proc = run_runner([*args, "job.model.attention=splash", "topology=cpu-4", "mesh.data=2", "mesh.tensor=2",
                       "run.dir=splash"], tmp_path, devices=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attention: splash_interpret" in proc.stdout
    assert all(np.isfinite(r["loss"]) for r in read_metrics(tmp_path / "splash") if "loss" in r)
    refused = run_runner([*args, "job.model.attention=cudnn", "job.model.compute_dtype=bfloat16", "run.dir=cudnn"],
                         tmp_path)
    assert refused.returncode == 2 and "job.model.attention" in refused.stderr and "NVIDIA" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "cudnn" / "checkpoints").exists()


def test_auto_picks_the_platforms_kernel_and_impossible_choices_are_refused() -> None:
    assert attention.resolve("auto", "tpu", "bfloat16") == "splash"
    assert attention.resolve("auto", "tpu", "bfloat16", seq_len=32) == "xla"  # shorter than one tile
    assert attention.resolve("auto", "gpu", "bfloat16") == "cudnn"
    assert attention.resolve("auto", "gpu", "float32") == "xla"  # cuDNN has no float32 kernel
    assert attention.resolve("auto", "cpu", "bfloat16") == "xla"
    assert attention.resolve("splash", "cpu", "float32") == "splash_interpret"
    refusals = [("cudnn", "cpu", "bfloat16", 128, "NVIDIA GPUs"), ("cudnn", "gpu", "float32", 128, "bfloat16"),
                ("splash", "gpu", "bfloat16", 128, "TPU kernel"), ("splash", "tpu", "bfloat16", 100, "128"),
                ("flash", "cpu", "float32", 128, "auto, xla, cudnn, splash")]
    for name, platform, dtype, seq, says in refusals:
        with pytest.raises(ConfigError, match=says):
            attention.check(name, platform, dtype, seq)


# ----------------------------------------------------------------------------- document masking


def test_document_mask_gives_segments_positions_and_masks_cross_document_targets() -> None:
    window = np.array([5, 6, EOD, 1, 2, 3, EOD, EOD, 4, 9], np.int32)
    example = {"x": window[:-1], "y": window[1:], "mask": np.ones(9, np.float32)}
    out = DocumentMask(EOD)(example)
    np.testing.assert_array_equal(out["segment_ids"], [0, 0, 0, 1, 1, 1, 1, 2, 3])
    np.testing.assert_array_equal(out["positions"], [0, 1, 2, 0, 1, 2, 3, 0, 0])
    # x[t] == EOD: its target is the next document's first token, which nothing predicts
    np.testing.assert_array_equal(out["mask"], [1, 1, 0, 1, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(out["x"], example["x"])


class NoDocuments:
    fingerprint = "x"
    eod_id = None


def test_document_mask_needs_documents_and_changes_the_fingerprint() -> None:
    with pytest.raises(ConfigError, match="data.document_mask"):
        DocumentMasked(NoDocuments())
    inner = NoDocuments()
    inner.eod_id = EOD
    assert DocumentMasked(inner).fingerprint != inner.fingerprint


def row_losses(model, params, tokens: np.ndarray, **inputs) -> jax.Array:
    """Per-target losses of one row (jitted: eager flax is op-by-op and slow)."""
    logits = jax.jit(model.apply)({"params": params}, jnp.asarray(tokens[None, :-1]),
                                  **{k: jnp.asarray(v[None]) for k, v in inputs.items()})
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(tokens[None, 1:]))[0]


MODELS = {
    "gpt": lambda impl, dtype="float32": GPT(GPTConfig(vocab_size=16, context_length=128, d_model=32, n_layers=2,
                                                       n_heads=2, attention=impl, compute_dtype=dtype)),
    "llama": lambda impl, dtype="float32": Llama(LlamaConfig(vocab_size=16, context_length=128, d_model=32, n_layers=2,
                                                             n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64,
                                                             attention=impl, compute_dtype=dtype)),
}

@pytest.mark.parametrize("family", sorted(MODELS))
def test_init_traces_no_kernel_and_gives_the_kernels_parameters(family: str, monkeypatch) -> None:
    """model.init traces a forward pass it throws away: it attends by XLA, so a kernel's tables are
    never built for it (minutes for a million-token row), and the parameters are the same."""
    from runner.models.attention import splash

    tokens = jnp.zeros((1, 128), jnp.int32)
    want = jax.eval_shape(MODELS[family]("xla").init, jax.random.PRNGKey(0), tokens)
    built: list[int] = []
    real = splash.causal_kernel
    monkeypatch.setattr(splash, "causal_kernel", lambda *a, **k: built.append(1) or real(*a, **k))
    model = MODELS[family]("splash_interpret")
    params = model.init(jax.random.PRNGKey(0), tokens)
    assert built == [] and jax.tree.map(lambda a: (a.shape, a.dtype), params) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), want)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params,
                                     MODELS[family]("xla").init(jax.random.PRNGKey(0), tokens)))
    model.apply(params, tokens)
    assert built  # the forward pass itself runs the kernel


# (implementation, compute dtype, relative tolerance of a row's summed loss): float32 sums agree to
# about 1e-7 (this CPU and an H200); cuDNN in bfloat16 against XLA's per-document bfloat16 losses to
# 5.4e-6 on an H200 (0.0019 of 344), while dropping the segments moves the sum by 0.10 to 0.56.
PACKED = [*((i, "float32", 1e-6) for i in HERE_IMPLS),
          pytest.param("cudnn", "bfloat16", 2e-5,
                       marks=pytest.mark.skipif(not GPU, reason="cuDNN attention needs an NVIDIA GPU"))]


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("impl, dtype, tol", PACKED)
def test_packed_row_loss_is_the_sum_of_its_documents_losses(family: str, impl: str, dtype: str, tol: float) -> None:
    rng = np.random.default_rng(0)
    lengths = [40, 1, 57, 30]  # a one-token document too; EOD ends each but the cut-off last
    docs = [np.append(rng.integers(0, EOD, n), EOD) for n in lengths[:-1]] + [rng.integers(0, EOD, lengths[-1])]
    row = np.concatenate(docs)[:129].astype(np.int32)  # seq_len 128 + the last target
    model = MODELS[family](impl, dtype)
    params = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"]
    packed = DocumentMask(EOD)({"x": row[:-1], "y": row[1:], "mask": np.ones(128, np.float32)})
    inputs = {k: packed[k] for k in ("segment_ids", "positions")}
    packed_sum = float(jnp.sum(row_losses(model, params, row, **inputs) * packed["mask"]))
    alone = []
    start = 0
    for doc in docs:
        piece = row[start:start + len(doc)]  # this document (and, within the row, no more)
        start += len(doc)
        if len(piece) > 1:  # predictions inside the document: every token but its last
            alone.append(float(jnp.sum(row_losses(MODELS[family]("xla", dtype), params, piece))))
    allowed = tol * max(1.0, abs(packed_sum))
    assert abs(packed_sum - sum(alone)) < allowed, (packed_sum, sum(alone), allowed)
    without = float(jnp.sum(row_losses(model, params, row) * packed["mask"]))
    # without segments the documents see each other: a difference far outside the tolerance
    assert abs(without - packed_sum) > 5 * allowed, (without, packed_sum, allowed)


def test_precision_knobs_store_parameters_and_optimizer_state_as_asked() -> None:
    from runner.optim import build_optimizer

    cfg = LlamaConfig(vocab_size=16, context_length=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                      head_dim=8, d_ff=32)
    f32 = jax.jit(Llama(cfg).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    bf16 = jax.jit(Llama(dataclasses.replace(cfg, param_dtype="bfloat16")).init)(
        jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    assert {x.dtype for x in jax.tree.leaves(f32)} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(bf16)} == {jnp.dtype("bfloat16")}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01, jnp.float32), f32)
    plain = build_optimizer("adamw", 1e-2)
    narrow = build_optimizer("adamw", 1e-2, state_dtype="bfloat16")
    state = narrow.init(f32)
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and {x.dtype for x in floats} == {jnp.dtype("bfloat16")}
    assert any(jnp.issubdtype(x.dtype, jnp.integer) for x in jax.tree.leaves(state))  # counts stay integers
    want, _ = plain.update(grads, plain.init(f32), f32)
    got, new_state = narrow.update(grads, state, f32)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-2)  # computed in float32, stored narrow
    assert {x.dtype for x in jax.tree.leaves(new_state) if jnp.issubdtype(x.dtype, jnp.floating)} == {
        jnp.dtype("bfloat16")}
    # float32 state for bfloat16 parameters (optax alone would keep their moments in bfloat16)
    wide = build_optimizer("adamw", 1e-2).init(bf16)
    assert {x.dtype for x in jax.tree.leaves(wide) if jnp.issubdtype(x.dtype, jnp.floating)} == {
        jnp.dtype("float32")}


@pytest.mark.parametrize("seq_len, block, ways", [(1024, 128, 1), (2048, 512, 1), (4096, 256, 1), (2048, 256, 2),
                                                  (4096, 128, 4)])
def test_the_splash_mask_tables_are_splash_s_own_built_without_evaluating_every_entry(seq_len: int, block: int,
                                                                                      ways: int) -> None:
    """runner's causal masks answer the blocks wholly before or after every query without
    evaluating them (what lets a million-token row's kernel be built: 70 s here, hours entry by
    entry); the forward and backward tables splash builds from them are exactly the ones it builds
    from its own CausalMask (whole rows) and from the same placed mask evaluated entry by entry
    (the zig-zag order of `ways` context shards)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info

    from runner.models.attention import splash
    from runner.models.attention.context import zigzag_order

    placed = splash._placed_causal_mask()

    class EntryByEntry(placed):  # type: ignore[misc, valid-type]
        def __getitem__(self, idx: object) -> np.ndarray:
            return sa.splash_attention_mask._ComputableMask.__getitem__(self, idx)

    def tables(mask: object) -> list[object]:
        return [info._process_mask(sa.MultiHeadMask([mask]), (block, block), dkv, q_seq_shards=ways)[0]
                for dkv in (False, True)]

    order = zigzag_order(seq_len, ways) if ways > 1 else np.arange(seq_len)
    want = tables(sa.CausalMask((seq_len, seq_len)) if ways == 1 else EntryByEntry(order))
    got = tables(placed(order))
    for a, b in zip(got, want, strict=True):
        for field in a._fields:
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None) == (y is None), field
            if x is not None:
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=field)
    assert any(isinstance(placed(order)[0:block, k:k + block], splash._UniformBlock)
               for k in range(block, seq_len, block))  # blocks after the first queries: answered at once
