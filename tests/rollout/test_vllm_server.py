"""`jaxrl-mismatch serve --engine vllm` as a real subprocess, driven through the trainer's RolloutClient.

The reference here is the trainer's own code: `models.scoring.token_logprobs` (and
`rollout.sampling.token_logprobs_processed` under temperature/top-k/top-p) on the JAX model loaded from
the same weights, teacher-forced without a KV cache. Bound 5e-5 in float32, as in test_vllm_engine.py
(whose docstring gives the reasoning).

One server (tied embeddings: the case with the CPU LM-head re-tie) for the whole module; the untied case is
covered at engine level. It starts without `--max-model-len`, so the server's default path (the model's
max_position_embeddings, resolved as for the JAX engine) is the one exercised; an explicit value is tested
at engine level. Start-up is 30-90 s on the shared CI machine, so the tests share it and push
versions in order.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import numpy as np
import pytest

from jaxrl_mismatch.rollout.engine import SamplingSpec

from .conftest import TOKEN, ServerProcess, read_checkpoint, write_checkpoint
from .test_vllm_engine import FILTERED, PLAIN, PROMPTS, TOL, VOCAB, make_tiny_qwen3, perturbed

MAX_POSITION_EMBEDDINGS = 256  # make_tiny_qwen3's config: the default max_model_len of both engines

pytestmark = pytest.mark.vllm


class TrainerReference:
    """Log-probs from the trainer's JAX model for one weight set (a checkpoint directory)."""

    def __init__(self, model_dir):
        from jaxrl_mismatch import precision
        from jaxrl_mismatch.models import hf_io

        _, self.model = hf_io.load_hf(model_dir, policy=precision.policy("fp32"))

    def logprobs(self, prompts, completions, spec: SamplingSpec) -> list[np.ndarray]:
        """Per completion, log μ(token) recomputed teacher-forced over prompt + completion (right-padded batch)."""
        import jax.numpy as jnp

        from jaxrl_mismatch.models.scoring import token_logprobs
        from jaxrl_mismatch.models.model import positions_from_mask
        from jaxrl_mismatch.rollout.sampling import token_logprobs_processed

        rows = [(p, c.token_ids) for p, samples in zip(prompts, completions) for c in samples]
        width = max(len(p) + len(c) for p, c in rows)
        tokens = np.zeros((len(rows), width), np.int32)
        mask = np.zeros((len(rows), width), np.int32)
        for b, (p, c) in enumerate(rows):
            tokens[b, : len(p) + len(c)], mask[b, : len(p) + len(c)] = p + c, 1
        ids, targets, m = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]), jnp.asarray(mask[:, :-1])
        if spec.temperature == 1.0 and spec.top_k == 0 and spec.top_p == 1.0:
            logp, _ = token_logprobs(self.model, ids, targets, m)
        else:
            logits = self.model.logits(self.model(ids, positions_from_mask(m), m))
            logp = token_logprobs_processed(logits, targets, spec.temperature, spec.top_k, spec.top_p)
        logp = np.asarray(logp, np.float64)
        return [logp[b, len(p) - 1 : len(p) - 1 + len(c)] for b, (p, c) in enumerate(rows)]

    def max_error(self, prompts, completions, spec: SamplingSpec) -> float:
        got = [np.asarray(c.logprobs) for samples in completions for c in samples]
        return max(float(np.max(np.abs(g - r))) for g, r in zip(got, self.logprobs(prompts, completions, spec)))


@pytest.fixture(scope="module")
def server(tmp_path_factory, token_file):
    root = tmp_path_factory.mktemp("vllm_server")
    ckpt = make_tiny_qwen3(root / "ckpt", tied=True)
    # The subprocess inherits the environment: a 1 GiB KV cache, and the session's vLLM caches (tests/conftest.py).
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    proc = ServerProcess(ckpt, token_file, engine="vllm")
    try:
        proc.start(timeout_s=420)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield proc, ckpt
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    from jaxrl_mismatch.rollout.client import RolloutClient

    proc, _ = server
    c = RolloutClient(proc.target, token=TOKEN, wait_ready_s=120)
    yield c
    c.close()


def test_info_and_specs_over_grpc(server, client):
    info = client.check_compatible(architecture="Qwen3ForCausalLM", vocab_size=VOCAB, tokenizer_vocab_size=VOCAB)
    assert (info.engine, info.dtype, info.max_model_len) == ("vllm", "float32", MAX_POSITION_EMBEDDINGS)
    specs = client.weight_specs()
    assert set(specs) == set(read_checkpoint(server[1])) and "lm_head.weight" not in specs


def test_logprobs_equal_trainer_recompute(server, client):
    ref = TrainerReference(server[1])
    for spec in (PLAIN, FILTERED):
        out = client.generate(PROMPTS, spec)
        assert all(len(c.token_ids) == spec.max_tokens and c.weight_version == 0 for s in out for c in s)
        assert ref.max_error(PROMPTS, out, spec) < TOL
    # The trainer's full-vocabulary, temperature-1 log-prob is a different quantity under FILTERED (TRL #6789).
    out = client.generate(PROMPTS, FILTERED)
    assert ref.max_error(PROMPTS, out, PLAIN) > 1e-2


def test_pushed_weights_are_served_and_bad_pushes_rejected(server, client, tmp_path):
    from jaxrl_mismatch.rollout import rollout_pb2_grpc
    from jaxrl_mismatch.rollout.client import RolloutError
    from jaxrl_mismatch.rollout.protocol import weight_chunks

    proc, ckpt = server
    version = client.info().weight_version + 1
    new = perturbed(read_checkpoint(ckpt), seed=21)  # embedding (= the tied LM head) changes too
    client.push_weights(new, version=version)
    assert client.info().weight_version == version
    ref = TrainerReference(write_checkpoint(ckpt, tmp_path / "new", new))
    served = {}
    for spec in (PLAIN, FILTERED):
        served[spec] = client.generate(PROMPTS, spec)
        assert all(c.weight_version == version for s in served[spec] for c in s)
        assert ref.max_error(PROMPTS, served[spec], spec) < TOL

    # Rejected: unknown name, wrong shape, a tied model's lm_head (not in the engine's specs) and non-finite
    # values (by the server's stream checks, shared with the JAX engine) -> INVALID_ARGUMENT naming the tensor.
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(proc.target))
    md = (("authorization", f"Bearer {TOKEN}"),)
    other = perturbed(new, seed=22)
    embed = "model.embed_tokens.weight"
    for tensors, needle in [
        ({**other, "model.layers.0.mlp.extra.weight": np.ones(4, np.float32)}, "'model.layers.0.mlp.extra.weight'"),
        ({**other, "model.norm.weight": np.ones(63, np.float32)}, "'model.norm.weight'"),
        ({**other, "lm_head.weight": other[embed]}, "'lm_head.weight'"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdateWeights(weight_chunks(tensors, version + 1), timeout=60, metadata=md)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()
    poisoned = {**other, embed: np.where(np.arange(VOCAB)[:, None] == 3, np.float32(np.inf), other[embed])}
    with pytest.raises(RolloutError, match=r"INVALID_ARGUMENT.*model\.embed_tokens\.weight.*non-finite"):
        client.push_weights(poisoned, version=version + 1)
    assert client.info().weight_version == version
    for spec in (PLAIN, FILTERED):
        assert client.generate(PROMPTS, spec) == served[spec]  # the old weights are still the ones served


def test_generate_never_sees_half_updated_weights(server, client, tmp_path):
    """Generate calls from two other clients run while three versions are pushed. A request's output is a
    deterministic function of (seed, weights), so every response must be the one its stamped version gives —
    equal across all responses of that version, and equal to the trainer's recompute on that version."""
    from jaxrl_mismatch.rollout.client import RolloutClient

    proc, ckpt = server
    spec = SamplingSpec(n=2, max_tokens=8, seed=5)
    prompts = PROMPTS[1:]
    weights = {client.info().weight_version: None}
    base = read_checkpoint(ckpt)
    responses: list = []
    done = threading.Event()
    errors: list[BaseException] = []

    def hammer():
        try:
            with RolloutClient(proc.target, max_staleness=None, wait_ready_s=60) as reader:
                while True:
                    last = done.is_set()
                    responses.append(reader.generate(prompts, spec))
                    if last:
                        return
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    def wait_for_responses(count: int) -> None:  # so that every version is generated with, not skipped
        deadline = time.monotonic() + 120
        while len(responses) < count and not errors and time.monotonic() < deadline:
            time.sleep(0.01)

    try:
        for k in range(3):
            wait_for_responses(len(responses) + 2)
            version = max(weights) + 1
            weights[version] = perturbed(base, seed=30 + k)
            client.push_weights(weights[version], version=version)
    finally:
        done.set()
        for t in threads:
            t.join(timeout=300)
    assert not errors, errors
    by_version: dict[int, list] = {}
    for out in responses:
        versions = {c.weight_version for s in out for c in s}
        assert len(versions) == 1, f"one Generate call mixed weight versions {versions}"
        by_version.setdefault(versions.pop(), []).append(out)
    for version, outs in by_version.items():
        assert all(o == outs[0] for o in outs[1:]), f"version {version}: responses differ"
        if weights.get(version) is not None:
            ref = TrainerReference(write_checkpoint(ckpt, tmp_path / f"v{version}", weights[version]))
            assert ref.max_error(prompts, outs[0], spec) < TOL
    assert set(by_version) == set(weights)  # generations ran on every version, the final push included
