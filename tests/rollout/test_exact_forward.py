"""Bit-exact training forward (issue 21, item 2): the update's log π(θ) is the exact scorer's program, so at
θ = θ_old every PPO ratio is exactly 1 (first minibatch: no clipping, ratio min = max = 1) in fp32, bf16 and
fp16, with microbatches; without it the bf16/fp16 ratios are not 1; packing is refused by name."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import load_hf
from jaxrl_mismatch.models.exact import score_exact
from jaxrl_mismatch.models.scoring import score_tokens
from jaxrl_mismatch.rollout.engine import SamplingSpec
from jaxrl_mismatch.rollout.jax_engine import JaxEngine
from jaxrl_mismatch.train.batch import from_completions
from jaxrl_mismatch.train.exact_forward import candidate_lengths, exact_forward_logprobs, exact_valued

pytestmark = pytest.mark.xla_full_opt  # exact mode: bit-for-bit claims about the programs users compile

PROMPTS = [[3, 4, 5], [7] * 9, list(range(10, 24)), [30, 31, 32, 33, 34, 35]]  # canonical lengths 32 and 48
MAX_TOKENS = 20
PRESETS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _batch(ckpt, dtype):
    out = JaxEngine(str(ckpt), dtype=dtype).generate(PROMPTS, SamplingSpec(
        n=4, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, stop_token_ids=(5, 11), exact=True))
    p = [PROMPTS[i] for i, g in enumerate(out) for _ in g]
    return out, from_completions(p, [c.token_ids for g in out for c in g], [c.logprobs for g in out for c in g],
                                 np.zeros(len(p)), pad_id=0)


@pytest.mark.parametrize("dtype", ["bfloat16"])  # fp32 / fp16: through the Learner below
def test_exact_forward_equals_the_exact_scorer_bitwise(tiny_checkpoints, dtype):
    ckpt = tiny_checkpoints["untied"]
    _, b = _batch(ckpt, dtype)
    _, model = load_hf(str(ckpt), policy=precision.policy(PRESETS[dtype], param_dtype="float32"))
    graphdef, params = nnx.split(model, nnx.Param)
    longest = max(len(p) for p in PROMPTS)  # the trainer's bound, task.max_prompt_len: fewer lengths to compile
    assert 2 <= len(candidate_lengths(b.tokens.shape[1], MAX_TOKENS, longest)) < len(
        candidate_lengths(b.tokens.shape[1], MAX_TOKENS))
    ref = score_exact(graphdef, params, b.tokens, b.attention_mask, b.response_mask, max_tokens=MAX_TOKENS,
                      temperature=1.0)

    def loss(p, tokens, attention_mask, response_mask, exact):
        batched, entropy, _ = score_tokens(graphdef, p, tokens, attention_mask, chunk_size=8)
        logp = batched
        if exact:
            logp, entropy = exact_forward_logprobs(graphdef, jax.lax.stop_gradient(p), tokens, attention_mask,
                                                   response_mask, max_tokens=MAX_TOKENS, temperature=1.0,
                                                   max_prompt_len=longest)
            logp = exact_valued(logp, batched)
        return jnp.sum(logp * response_mask), (logp, entropy)

    grad = jax.jit(jax.grad(loss, has_aux=True), static_argnums=4)
    grads, (logp, entropy) = grad(params, b.tokens, b.attention_mask, b.response_mask, True)
    m = b.response_mask > 0
    assert np.array_equal(np.asarray(logp)[m], ref[m])  # with gradients, inside jit: the scorer's bits
    assert np.all(np.asarray(entropy)[m] > 0)
    plain, _ = grad(params, b.tokens, b.attention_mask, b.response_mask, False)
    for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(plain)):  # the gradient is the batched forward's
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) > 0


def _learner(ckpt, tmp_path, precision_name, **trainer):
    from jaxrl_mismatch.train.config import base_config
    from jaxrl_mismatch.train.config_checks import validate
    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    c = base_config()
    c.model.path, c.run_dir = str(ckpt), str(tmp_path)
    c.rollout.group_size, c.batch.prompts_per_step, c.trainer.chunk_size = 4, len(PROMPTS), 8
    c.rollout.max_tokens, c.optim.lr = MAX_TOKENS, 1e-2
    c.task.max_prompt_len = max(len(p) for p in PROMPTS)  # the exact forward compiles the lengths such rows have
    c.trainer.precision = precision_name
    c.rollout.dtype = {v: k for k, v in PRESETS.items()}[precision_name]
    c.batch.minibatches, c.batch.microbatches = 2, 2
    c.rollout.exact = True  # π(θ_old) from the exact scorer; trainer.exact_forward decides the update's π(θ)
    c.trainer.update(trainer)
    validate(c)
    return Learner(learner_config(c))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_first_minibatch_ratio_is_exactly_one(tiny_checkpoints, tmp_path, dtype):
    ckpt = tiny_checkpoints["untied"]
    out, b = _batch(ckpt, dtype)
    rewards = np.array([float(9 in c.token_ids) + 0.1 * len(c.token_ids) for g in out for c in g], np.float32)
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    b = b.replace(advantages=(adv[:, None] * b.response_mask).astype(np.float32))
    ratios = {}
    # The control (the ordinary batched forward's ratios move) runs in bf16 only: in fp32 they may well be 1, and
    # in fp16 they depend on the CPU: they moved on the machines of earlier sessions (one with AVX512-FP16) and
    # were exactly 1 on an AVX2-only AMD EPYC (2026-11-27). The exact run's ratios of one hold in every dtype.
    for exact in (True, False) if dtype == "bfloat16" else (True,):
        learner = _learner(ckpt, tmp_path / f"{dtype}{exact}", PRESETS[dtype], exact_forward=exact)
        prepared, _ = learner.prepare(b, seed=0)
        learner.cfg = dataclasses.replace(learner.cfg, minibatches=1)  # one minibatch (two microbatches) at θ = θ_old
        learner.minibatch_rows = b.num_rows
        stats = learner.optimize(prepared, seed=0)
        ratios[exact] = (stats["ppo/ratio_min"], stats["ppo/ratio_max"], stats["ppo/clip_frac_low"],
                         stats["ppo/clip_frac_high"])
    assert ratios[True] == (1.0, 1.0, 0.0, 0.0), ratios
    if dtype == "bfloat16":  # the ordinary batched forward is not the scorer's program: its ratios move
        assert ratios[False][:2] != (1.0, 1.0), ratios


def _random_rows(rng: np.random.Generator, b: int, s: int, max_tokens: int) -> tuple[np.ndarray, ...]:
    """`b` right-padded rows of width `s`: a prompt of 3-9 random tokens, then up to `max_tokens` - 1 more."""
    from tests.rollout.conftest import VOCAB

    plen = rng.integers(3, 10, size=b)
    n = np.minimum(plen + rng.integers(1, max_tokens, size=b), s)
    tokens = np.where(np.arange(s)[None] < n[:, None], rng.integers(1, VOCAB, size=(b, s)), 0).astype(np.int32)
    attention_mask = (np.arange(s)[None] < n[:, None]).astype(np.int32)
    response_mask = ((np.arange(1, s)[None] >= plen[:, None]) & (np.arange(1, s)[None] < n[:, None])
                     ).astype(np.float32)
    return tokens, attention_mask, response_mask


def test_exact_forward_equals_the_scorer_at_a_temperature_given_as_a_python_float(tiny_checkpoints):
    """The update gets T from the config (a Python float, a constant in its program); the scorer gets it as an
    argument. At T = 0.7 in fp32 XLA's x / const -> x * (1/const) gave other bits until the exact forward kept
    T a value (issue 23); the same rewrite of a division by a traced T still hit rows of canonical length 16
    (5 of 17 log-probs) until the exact head divided behind a barrier (`models.exact.chunk_logprobs`)."""

    _, model = load_hf(str(tiny_checkpoints["untied"]), policy=precision.policy("fp32", param_dtype="float32"))
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    for s, max_tokens in ((30, 20), (16, 6)):
        tokens, attention_mask, response_mask = _random_rows(rng, 6, s, max_tokens)
        ref = score_exact(graphdef, params, tokens, attention_mask, response_mask, max_tokens=max_tokens,
                          temperature=0.7)
        logp, _ = jax.jit(lambda p: exact_forward_logprobs(graphdef, p, tokens, attention_mask, response_mask,
                                                           max_tokens=max_tokens, temperature=0.7))(params)
        m = response_mask > 0
        assert np.array_equal(np.asarray(logp)[m], ref[m]), (s, max_tokens)


def test_a_prompt_longer_than_the_exact_forward_was_compiled_for_is_refused_by_prepare(tiny_checkpoints, tmp_path):
    """The update's exact forward compiles the canonical lengths of prompts up to task.max_prompt_len; a longer
    row would be scored at a too-short length inside jit (other bits, no error), so `prepare` refuses it on the
    host, naming the row and the field."""
    learner = _learner(tiny_checkpoints["untied"], tmp_path, "fp32")  # task.max_prompt_len = 14
    prompts = [[3, 4, 5]] * 14 + [list(range(10, 24)), list(range(10, 25))]  # the last two: 14 and 15 tokens
    b = from_completions(prompts, [[6, 7]] * 16, [[-1.0, -1.0]] * 16, np.zeros(16), pad_id=0)
    with pytest.raises(ValueError, match=r"row 15: its prompt has 15 tokens > task\.max_prompt_len=14"):
        learner.step(b, seed=0, minibatch_seed=0)


def test_a_row_past_the_prompt_bound_is_nan_inside_the_program(tiny_checkpoints):
    """Should a longer row reach the program compiled for a prompt bound (past `prepare`'s check), its values are
    NaN, not another canonical length's bits; the other rows keep the unbounded program's bits."""
    from tests.rollout.conftest import VOCAB

    _, model = load_hf(str(tiny_checkpoints["untied"]), policy=precision.policy("fp32", param_dtype="float32"))
    graphdef, params = nnx.split(model, nnx.Param)
    s, max_tokens, plen = 24, 8, np.array([3, 12])
    n = plen + 6
    tokens = np.where(np.arange(s)[None] < n[:, None], np.arange(1, s + 1)[None] % VOCAB, 0).astype(np.int32)
    attention_mask = (np.arange(s)[None] < n[:, None]).astype(np.int32)
    response_mask = ((np.arange(1, s)[None] >= plen[:, None]) & (np.arange(1, s)[None] < n[:, None])).astype(np.float32)
    run = lambda bound: jax.jit(lambda p: exact_forward_logprobs(  # noqa: E731
        graphdef, p, tokens, attention_mask, response_mask, max_tokens=max_tokens, temperature=1.0,
        max_prompt_len=bound))(params)
    (logp, ent), (ref, ref_ent) = run(8), run(None)
    assert np.all(np.isnan(np.asarray(logp)[1])) and np.all(np.isnan(np.asarray(ent)[1]))
    assert np.array_equal(np.asarray(logp)[0], np.asarray(ref)[0]) and np.array_equal(np.asarray(ent)[0],
                                                                                       np.asarray(ref_ent)[0])


def test_exact_forward_refuses_packing_by_name():
    from jaxrl_mismatch.train.config import ConfigError, base_config
    from jaxrl_mismatch.train.config_checks import validate

    c = base_config()
    c.model.path, c.rollout.exact, c.trainer.packing = "x", True, True
    with pytest.raises(ConfigError, match=r"trainer\.packing.*implied by rollout\.exact"):
        validate(c)
    c.trainer.exact_forward = "false"  # explicit opt-out keeps rollout.exact with a packed ordinary update
    validate(c)
    from jaxrl_mismatch.train.config import exact_forward_enabled
    assert not exact_forward_enabled(c)
    c = base_config()
    c.model.path, c.trainer.exact_forward, c.trainer.scan_layers = "x", True, True
    with pytest.raises(ConfigError, match=r"trainer\.scan_layers"):
        validate(c)


def test_on_a_data_parallel_mesh_each_device_scores_its_own_rows_with_the_same_bits(tiny_checkpoints):
    """On a data-parallel mesh the per-row loop under plain jit gathered the batch (an all-gather of the tokens)
    and ran every row on every device: N× the work on N devices. Given the mesh, the exact forward and the
    scorer split the rows over its devices (`jax.shard_map`) — no all-gather — and every row keeps its bits."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxrl_mismatch.models.sharding import make_mesh

    mesh = make_mesh({"data": -1})
    assert mesh.shape["data"] == 8
    _, model = load_hf(str(tiny_checkpoints["untied"]), policy=precision.policy("fp32", param_dtype="float32"),
                       mesh=mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    max_tokens = 20
    tokens, attention_mask, response_mask = _random_rows(np.random.default_rng(1), 16, 30, max_tokens)
    rows = NamedSharding(mesh, P("data"))
    placed = [jax.device_put(x, rows) for x in (tokens, attention_mask, response_mask)]
    out = {}
    for name, m in (("plain", None), ("mesh", mesh)):
        fn = jax.jit(lambda p, t, a, r, m=m: exact_forward_logprobs(graphdef, p, t, a, r, max_tokens=max_tokens,
                                                                    temperature=1.0, mesh=m))
        hlo = fn.lower(params, *placed).compile().as_text()
        out[name] = np.asarray(fn(params, *placed)[0]), "all-gather" in hlo
    assert out["plain"][1] and not out["mesh"][1]  # the control gathers the rows; the split version does not
    ref = score_exact(graphdef, params, tokens, attention_mask, response_mask, max_tokens=max_tokens, temperature=1.0)
    split = score_exact(graphdef, params, tokens, attention_mask, response_mask, max_tokens=max_tokens,
                        temperature=1.0, mesh=mesh)
    m = response_mask > 0
    assert np.array_equal(split, ref)
    assert np.array_equal(out["mesh"][0][m], ref[m]) and np.array_equal(out["plain"][0][m], ref[m])
