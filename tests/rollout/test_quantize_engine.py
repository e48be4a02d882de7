"""Quantized rollouts in the built-in engine (issue 19; FlashRL / TIS setting, models/quantize.py).

The option reaches the sampled tokens' log-probs; exact mode composes with it (μ equals the trainer's exact
π computed on the same quantized weights, bit for bit); pushed weights are quantized on arrival, server
side; a request's `quantize_strength` blends full-precision and quantized weights (mid-run onset).
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import load_hf
from jaxrl_mismatch.models.exact import score_exact
from jaxrl_mismatch.models.quantize import quantize_params
from jaxrl_mismatch.rollout.client import RolloutClient, RolloutError
from jaxrl_mismatch.rollout.engine import SamplingSpec
from jaxrl_mismatch.rollout.jax_engine import JaxEngine

from .conftest import REPO, TOKEN, read_checkpoint, write_checkpoint
from .test_exact_mode import MAX_TOKENS, PRESETS, PROMPTS, batch_of, spec

pytestmark = pytest.mark.xla_full_opt  # exact mode: bit-for-bit claims about the programs users compile

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def quantized_scorer(ckpt, dtype: str, method: str):
    """The trainer's exact scorer on the engine-precision weights, fake-quantized as the engine does."""
    _, model = load_hf(str(ckpt), policy=precision.policy(PRESETS[dtype], param_dtype="float32"))
    graphdef, params = nnx.split(model, nnx.Param)
    params = quantize_params(jax.tree.map(lambda a: a.astype(DTYPES[dtype]), params), method)
    return lambda b: score_exact(graphdef, params, b.tokens, b.attention_mask, b.response_mask,
                                 max_tokens=MAX_TOKENS, temperature=1.0)


def test_quantize_reaches_the_logprobs(tiny_checkpoints):
    ckpt = str(tiny_checkpoints["untied"])
    plain, int8 = JaxEngine(ckpt), JaxEngine(ckpt, quantize="int8")
    assert int8.info().quantize == "int8" and "quantize_strength" in int8.info().options
    assert plain.info().quantize == "none" and "quantize_strength" not in plain.info().options
    s = spec(exact=False)
    a, b = plain.generate(PROMPTS, s), int8.generate(PROMPTS, s)
    # Compare the first token of each row (same prompt, same random draw; later tokens may diverge).
    first = lambda out: np.array([c.logprobs[0] for g in out for c in g])  # noqa: E731
    diff = np.abs(first(a) - first(b))
    assert diff.max() > 1e-3 and diff.max() < 0.5  # int8 error: visible, but far from noise σ = 3
    tokens = lambda out: [c.token_ids for g in out for c in g]  # noqa: E731
    assert tokens(a) != tokens(b)  # the same random draws pick other tokens from the quantized model
    # Strength 0 serves the full-precision weights: identical to the unquantized engine, token for token.
    assert int8.generate(PROMPTS, spec(exact=False, quantize_strength=0.0)) == a
    half = int8.generate(PROMPTS, spec(exact=False, quantize_strength=0.5))
    assert 0 < np.abs(first(half) - first(a)).max() < diff.max()


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_composes_with_quantize(tiny_checkpoints, method, dtype):
    ckpt = tiny_checkpoints["untied"]
    out = JaxEngine(str(ckpt), dtype=dtype, quantize=method).generate(PROMPTS, spec())
    b = batch_of(PROMPTS, out)
    m = b.response_mask > 0
    pi_q = quantized_scorer(ckpt, dtype, method)(b)
    assert np.array_equal(pi_q[m], b.rollout_logp[m])  # μ = π(Q(θ_old)) bit for bit
    pi = quantized_scorer(ckpt, dtype, "none")(b)
    assert np.abs(pi[m] - b.rollout_logp[m]).max() > 1e-4  # and the mismatch vs π(θ_old) is the quantization's


def test_push_is_quantized_on_arrival(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints["untied"]
    engine = JaxEngine(str(ckpt), quantize="int8")
    rng = np.random.default_rng(0)
    new = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in read_checkpoint(ckpt).items()}
    engine.update_weights(new, version=1)
    out = engine.generate(PROMPTS, spec())
    b = batch_of(PROMPTS, out)
    m = b.response_mask > 0
    ref = write_checkpoint(ckpt, tmp_path / "new", new)
    assert np.array_equal(quantized_scorer(ref, "float32", "int8")(b)[m], b.rollout_logp[m])
    assert {c.weight_version for g in out for c in g} == {1}


@pytest.mark.slow
def test_server_quantizes_pushes_and_checks_strength(tiny_checkpoints, start_server, token_file, tmp_path):
    ckpt = tiny_checkpoints["untied"]
    server = start_server(ckpt, extra=("--quantize", "int8"))
    with RolloutClient(server.target, token=TOKEN, wait_ready_s=60) as client:
        info = client.info()
        assert info.quantize == "int8" and "quantize_strength" in info.options
        rng = np.random.default_rng(1)
        new = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in read_checkpoint(ckpt).items()}
        client.push_weights(new, version=1)
        out = client.generate(PROMPTS, spec())
        b = batch_of(PROMPTS, out)
        m = b.response_mask > 0
        ref = write_checkpoint(ckpt, tmp_path / "new", new)
        assert np.array_equal(quantized_scorer(ref, "float32", "int8")(b)[m], b.rollout_logp[m])
        with pytest.raises(RolloutError, match="quantize_strength"):
            client.generate(PROMPTS, spec(quantize_strength=1.5))


@pytest.mark.slow
def test_vllm_refuses_int8_by_name(tiny_checkpoints, token_file):
    proc = subprocess.run([sys.executable, "-m", "jaxrl_mismatch.cli", "serve", "--engine", "vllm", "--model",
                           str(tiny_checkpoints["untied"]), "--token-file", str(token_file), "--port", "0",
                           "--quantize", "int8"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --quantize int8: not available with the vllm engine")
    assert "Traceback" not in proc.stderr
