"""The vLLM rollout engine: `vllm.LLM` inside the rollout-server process, weights reloaded in place.

What this engine guarantees, and how:

* **Log-probs of the distribution actually sampled.** vLLM's default (`raw_logprobs`) reports
  log-softmax of the unprocessed logits, i.e. before temperature / top-k / top-p, which is not μ when
  any of them is active. The engine starts vLLM with `logprobs_mode="processed_logprobs"`, so the
  returned value is log-softmax of logits/T after the top-k/top-p masks, renormalised over the kept
  tokens — the same quantity as `rollout.sampling.processed_logprobs` (TRL #6789; docs/rollout.md).
  Temperatures below vLLM's greedy threshold (1e-5) would silently switch vLLM to greedy decoding with
  *unprocessed* log-probs; they are sent as top_k=1 instead, which samples the same arg-max token from
  a point mass and reports its exact log-prob, 0.
* **Token ids in, token ids out.** No tokenizer is loaded (`skip_tokenizer_init`), nothing is
  detokenized, and the model's `generation_config.json` is ignored (`generation_config="vllm"`,
  `ignore_eos`): a completion stops only on the request's stop ids or max_tokens, exactly as the JAX
  engine does, so both engines produce comparable completions for the same request.
* **In-place weight updates.** The trainer pushes HF-named tensors (torch layout); they are loaded with
  `collective_rpc("reload_weights", weights_iterator=...)`, which only works with the in-process engine
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`; the multiprocess engine cannot pickle tensors). Prefix caching
  stays on for speed, so the cache is reset after every update — otherwise a prompt seen before the
  update would reuse KV entries computed with the old weights.
* **Atomicity.** One lock serialises `generate` and `update_weights` (the server calls them from
  different gRPC threads; `vllm.LLM` is not thread-safe anyway). A generation therefore sees either
  the old or the new weights, never a mix, and every completion carries the version it was made with.

This engine seeds torch's global RNG and lowers torch's thread count in its process (the in-process
engine does that); keep it in the rollout-server process, never in the trainer. The CPU-specific choices
are measured in `tests/rollout/test_vllm_engine.py` (log-prob agreement, the tied-head reload below).
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from jaxrl_mismatch.rollout.engine import (
    ENGINE_DTYPES,
    Completion,
    Engine,
    EngineInfo,
    EngineUnusableError,
    NonFiniteLogprobsError,
    SamplingSpec,
    TensorSpec,
    WeightReloadError,
    resolve_max_model_len,
)
from jaxrl_mismatch.rollout.validation import is_greedy
from jaxrl_mismatch.usage import UsageError

# vLLM treats temperature < 1e-5 as greedy (vllm.sampling_params._SAMPLING_EPS).
VLLM_GREEDY_TEMPERATURE = 1e-5
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
CPU_BATCHED_TOKENS = 4096  # vLLM's default token budget per step, kept (at least max_model_len)
# Checkpoint entries that are buffers, not weights: vLLM's loaders skip them and the trainer never sends them.
_NON_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightUpdateError(ValueError):
    """A pushed weight set does not fit the model (name, shape, dtype) or its version goes backwards.

    Raised before anything is applied, so the previous weights and version stay in service. A ValueError,
    so the server answers INVALID_ARGUMENT. Non-finite values are refused earlier, by the server's
    UpdateWeights validation (`validation.TensorAssembler`), for every engine alike.
    """


# WeightReloadError and EngineUnusableError (raised below) are defined in engine.py, so that the server
# maps them to gRPC status codes without importing this module (and torch); they stay importable from here.


def checkpoint_weight_shapes(model_dir: str, *, tied: bool) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, read from the safetensors headers only (no tensor data is loaded).

    With tied embeddings the LM head is the embedding matrix: a checkpoint may still carry a copy of
    `lm_head.weight`, but vLLM ignores it and the trainer never sends it, so it is not part of the spec.
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                if name.endswith(_NON_WEIGHT_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                shapes[name] = tuple(int(s) for s in f.get_slice(name).get_shape())
    return shapes


def request_seed(seed: int, prompt_index: int) -> int:
    """Seed of prompt `prompt_index` of a request seeded with `seed`.

    vLLM gives sample j of a request seeded s the seed s + j. Passing `seed` itself to every prompt would
    make identical prompts in one batch produce identical samples, and `seed + i * n` would collide with
    the next request's seed; hashing (seed, i) makes every (request seed, prompt, sample) its own stream
    while keeping a request reproducible. The result stays below 2**62 so that s + j fits in int64.
    """
    state = np.random.SeedSequence([seed % (1 << 64), prompt_index]).generate_state(1, np.uint64)[0]
    return int(state) >> 2


def _to_torch(arr: np.ndarray):
    """Zero-copy numpy -> torch view (bfloat16 arrays come from ml_dtypes, which torch cannot read directly)."""
    import torch

    arr = np.ascontiguousarray(arr)
    if not arr.flags.writeable:  # torch.from_numpy warns on read-only memory; copy instead
        arr = arr.copy()
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


# -- functions run on the vLLM worker (in this process) through collective_rpc -------------------------
def _inspect_lm_head(worker) -> dict:
    """Whether the LM head shares the embedding Parameter and uses a CPU pre-packed GEMM."""
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    shares = lm_head is not None and embed is not None and lm_head.weight is embed.weight
    return {"shares_embedding": shares, "prepacked": lm_head is not None and hasattr(lm_head, "cpu_linear")}


def _retie_cpu_lm_head(worker) -> None:
    """Re-tie the LM head to the embedding and rebuild its pre-packed CPU GEMM.

    Why: on CPU, vLLM's linear layers (the LM head included) compute with a private pre-packed copy of
    their weight (oneDNN / sgl kernels), made by `dispatch_cpu_unquantized_gemm` when a layer's weights
    are processed. `reload_weights` re-processes a layer only when one of its own tensors is loaded. A
    tied checkpoint has no `lm_head.weight`, so after a reload the embedding holds the new values but the
    LM head keeps computing with the packed copy of the *old* ones (logprobs off by nats; the tied case of
    `tests/rollout/test_vllm_engine.py` catches it). Untied heads load their own tensor and are re-packed; GPU kernels read the
    shared Parameter directly. So this runs only for tied heads with a CPU-dispatched GEMM.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = worker.model_runner.get_model()
    model.lm_head.weight = model.model.embed_tokens.weight
    dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


def _abandon_partial_reload(worker) -> None:
    """Bring every layer out of vLLM's layer-wise reload state after a reload raised mid-way.

    `reload_weights` moves layers to the meta device and buffers their tensors until a layer is complete.
    If it raised, some layers may still hold buffered tensors from the failed attempt, which a new reload
    would mix with the new ones. Finalising materialises and resets every layer, so the restore that
    follows starts from a clean state and overwrites all of them.
    """
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    finalize_layerwise_reload(worker.model_runner.get_model(), worker.model_config)


# rollout.quantize -> vLLM's own online quantization (vllm/config/quantization.py shorthands). "fp8_per_channel"
# is FP8 e4m3 weights with one scale per output channel, as ours, but vLLM also quantizes activations per token
# (W8A8), so its numbers are not those of the built-in engine's weight-only fp8. vLLM's int8 online shorthand
# ("int8_per_channel_weight_only") leaves every linear layer unquantized (MoE experts only): refused.
VLLM_QUANTIZATION = {"none": None, "fp8": "fp8_per_channel"}


def check_quantize(quantize: str) -> None:
    """UsageError naming `--quantize` when vLLM (here) cannot serve the method; before vLLM starts."""
    if quantize not in ("none", "int8", "fp8"):
        raise UsageError(f"--quantize: {quantize!r} is not one of none, int8, fp8")
    if quantize == "int8":
        raise UsageError("--quantize int8: not available with the vllm engine (vLLM's online int8 quantizes MoE "
                         "experts only, no linear layer); use --engine jax, or --quantize fp8")
    if quantize == "fp8":
        import torch
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and not torch.cpu._is_amx_tile_supported():
            raise UsageError("--quantize fp8: vLLM's CPU fp8 kernels need AMX tiles (Sapphire Rapids or newer) and "
                             "this CPU has none; use --engine jax (weight-only fp8 in the built-in engine)")


class VLLMEngine(Engine):
    """A `vllm.LLM` over an HF checkpoint directory, with in-place versioned weight updates.

    Args:
      model_dir: HF checkpoint (config.json + safetensors), read from the local disk only.
      dtype: serving dtype, "float32" | "bfloat16" | "float16"; also the wire dtype of weight pushes
        (`weight_specs`), so the trainer sends exactly the values that will be served.
      max_model_len: prompt + completion limit; defaults to the model's max_position_embeddings (resolved
        here with `engine.resolve_max_model_len`, the JAX engine's rule, instead of vLLM's own derivation).
      seed: vLLM's engine seed (requests carry their own seeds; see `request_seed`).
      kv_cache_bytes: KV-cache size. On CPU it defaults to 1 GiB (vLLM would otherwise size it from
        `gpu_memory_utilization` x total RAM, and refuse to start when that much is not free); the
        VLLM_CPU_KVCACHE_SPACE environment variable (GiB), if set, takes precedence inside vLLM. On GPU,
        None leaves sizing to `gpu_memory_utilization`.
      gpu_memory_utilization: fraction of accelerator memory vLLM may use (GPU only in practice).
      enforce_eager: skip torch.compile / CUDA graphs. Defaults to True on CPU, where compiling the tiny
        graphs costs far more start-up time than it saves, and False on GPU.
      eager_sampler_ops: run vLLM's few `torch.compile`d sampler helpers (the logprob-rank count)
        eagerly. Defaults to True on CPU with enforce_eager, where their first-call Inductor compile
        takes 4-20 s (measured here) for a result that costs microseconds eagerly; on GPU the compiled
        kernel avoids large temporaries.
      enable_prefix_caching: vLLM's prefix cache (reset after every weight update).

    The engine keeps references to the arrays of the last applied update, to restore them if a later
    reload fails mid-way; callers must not modify those arrays afterwards (the server never does).
    """

    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        *,
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool | None = None,
        eager_sampler_ops: bool | None = None,
        enable_prefix_caching: bool = True,
        quantize: str = "none",
    ):
        check_quantize(quantize)
        if dtype not in ENGINE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(ENGINE_DTYPES)}, got {dtype!r}")
        model_dir = os.fspath(model_dir)
        with open(os.path.join(model_dir, "config.json")) as f:
            hf_config = json.load(f)
        architectures = hf_config.get("architectures") or []
        if not architectures:
            raise ValueError(f"{model_dir}/config.json has no 'architectures' entry")
        max_model_len = resolve_max_model_len(max_model_len, hf_config.get("max_position_embeddings"))
        self._model_dir = model_dir
        self._dtype = dtype
        self._quantize = quantize
        self._architecture = str(architectures[0])
        self._lock = threading.Lock()  # serialises generate / update_weights / close on the vLLM engine
        self._version = 0
        self._last_good: list | None = None  # None: the checkpoint on disk
        self._unusable: str | None = None

        # The in-process engine is required (reload_weights with a tensor iterator); it must be chosen
        # before vLLM reads its environment. No network at run time: models load from local paths.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        import vllm
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if enforce_eager is None:
            enforce_eager = on_cpu
        if eager_sampler_ops is None:
            # Only with enforce_eager: force_eager would also bypass a torch.compile'd model.
            eager_sampler_ops = on_cpu and enforce_eager
        if kv_cache_bytes is None and on_cpu:
            kv_cache_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        self._eager_sampler_ops = eager_sampler_ops
        self._torch = torch
        # On a CPU, whole prefills only: a step over vLLM's token budget (4,096) split a prompt's prefill, and vLLM
        # then rewound the request's seeded generator with `set_offset`, which a CPU generator lacks — the generate
        # failed, left its requests queued, and the engine was unusable (every request here is seeded).
        scheduler = {}
        if on_cpu:
            scheduler = {"enable_chunked_prefill": False,
                         "max_num_batched_tokens": max(max_model_len, CPU_BATCHED_TOKENS)}

        self._llm = vllm.LLM(
            model=model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            skip_tokenizer_init=True,
            generation_config="vllm",
            logprobs_mode="processed_logprobs",
            enforce_eager=enforce_eager,
            kv_cache_memory_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            quantization=VLLM_QUANTIZATION.get(quantize),
            **scheduler,
        )
        try:
            engine_core = self._llm.llm_engine.engine_core
            if type(engine_core).__name__ != "InprocClient":
                raise RuntimeError(
                    f"vLLM started a {type(engine_core).__name__} engine core, but in-place weight updates need the "
                    "in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING must be 0 before vLLM is first used in "
                    "this process"
                )
            model_config = self._llm.llm_engine.model_config
            self._max_model_len = int(model_config.max_model_len)
            self._vocab_size = int(model_config.hf_config.vocab_size)
            tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
            head = self._llm.collective_rpc(_inspect_lm_head)[0]
            if tied and not head["shares_embedding"]:
                raise RuntimeError(
                    f"{self._architecture}: config ties the word embeddings but vLLM's model has no "
                    "lm_head sharing model.embed_tokens; in-place weight updates would leave a stale LM head"
                )
            # See _retie_cpu_lm_head for why only tied heads with a pre-packed CPU GEMM need re-tying.
            self._retie_lm_head = tied and head["prepacked"]
            self._specs = {
                name: TensorSpec(shape, dtype)
                for name, shape in checkpoint_weight_shapes(model_dir, tied=tied).items()
            }
        except BaseException:
            self.close()
            raise

    # -- Engine interface --------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        return EngineInfo(
            architecture=self._architecture,
            vocab_size=self._vocab_size,
            dtype=self._dtype,
            engine="vllm",
            weight_version=self._version,
            max_model_len=self._max_model_len,
            quantize=self._quantize,
        )

    def weight_specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        params = [self._sampling_params(spec, i) for i in range(len(prompts))]
        requests = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        with self._lock:
            self._check_usable()
            version = self._version
            try:
                with self._sampler_context():
                    outputs = self._llm.generate(requests, params, use_tqdm=False)
            except Exception as e:
                # vLLM keeps a failed call's unfinished requests queued: the next call would return them as well
                # (and a weight push's prefix-cache reset is refused while they run). Stop serving instead.
                if self._llm.llm_engine.has_unfinished_requests():
                    self._unusable = (f"a generate failed inside vLLM ({type(e).__name__}: {e}) and left its "
                                      "requests queued")
                raise
        return completions_from_outputs(outputs, spec, version, prompts=prompts)

    def update_weights(self, tensors: dict[str, np.ndarray], version: int) -> None:
        """Validate the full weight set, reload it in place, re-tie the head, reset the prefix cache.

        Validation (names, shapes, dtypes, version) happens before anything is applied; a rejected set
        raises WeightUpdateError and leaves the old weights and version in service. If vLLM then fails
        while loading, the previous weights are reloaded (WeightReloadError, restored=True); if even that
        fails, the engine refuses every further call (restored=False). The version changes only after a
        complete, successful update.
        """
        self.validate_weights(tensors, version)
        batch = [(name, _to_torch(tensors[name])) for name in self._specs]
        with self._lock:
            self._check_usable()
            if version < self._version:
                raise WeightUpdateError(f"version {version} is older than the version in service ({self._version})")
            try:
                self._apply(batch)
            except Exception as e:
                restored = self._restore()
                state = (
                    f"the previous weights (version {self._version}) were restored and stay in service"
                    if restored
                    else "restoring the previous weights failed too; the engine refuses further calls, "
                    "restart the server"
                )
                raise WeightReloadError(
                    f"vLLM failed to load weight version {version}: {type(e).__name__}: {e}; {state}",
                    restored=restored,
                ) from e
            self._last_good = batch
            self._version = version

    def close(self) -> None:
        """Shut the engine core down and release vLLM's process-wide state, so another engine can start.

        Waits (up to a minute) for a running generate or update to finish; the server calls this after
        its grace period for in-flight calls, so a call still running then is abandoned.
        """
        acquired = self._lock.acquire(timeout=60)
        try:
            llm = self.__dict__.pop("_llm", None)
            if llm is None:
                return
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        finally:
            if acquired:
                self._lock.release()

    # -- helpers ------------------------------------------------------------------------------------
    def validate_weights(self, tensors: dict[str, np.ndarray], version: int) -> None:
        """Raise WeightUpdateError naming the first tensor that does not match `weight_specs`.

        Only metadata is checked here (cheap); the values' finiteness is checked once per push by the
        server, which reassembles every tensor anyway, instead of a second full pass over the weights.
        """
        if not isinstance(version, (int, np.integer)) or isinstance(version, bool):
            raise WeightUpdateError(f"version must be an integer, got {version!r}")
        unknown = sorted(set(tensors) - set(self._specs))
        if unknown:
            raise WeightUpdateError(
                f"tensor {unknown[0]!r}: unknown tensor name for this model (unknown: {unknown[:5]})"
            )
        missing = sorted(set(self._specs) - set(tensors))
        if missing:
            raise WeightUpdateError(
                f"tensor {missing[0]!r}: missing from the update ({len(missing)} missing; updates replace the full set)"
            )
        for name, spec in self._specs.items():
            arr = tensors[name]
            if not isinstance(arr, np.ndarray):
                raise WeightUpdateError(f"tensor {name!r}: expected a numpy array, got {type(arr).__name__}")
            if tuple(arr.shape) != spec.shape:
                raise WeightUpdateError(f"tensor {name!r}: shape {tuple(arr.shape)} != expected {spec.shape}")
            if arr.dtype.name != spec.dtype:
                raise WeightUpdateError(f"tensor {name!r}: dtype {arr.dtype.name} != expected {spec.dtype}")

    def _sampling_params(self, spec: SamplingSpec, prompt_index: int):
        from vllm import SamplingParams

        temperature, top_k = spec.temperature, spec.top_k
        if is_greedy(temperature):
            # See the module docstring: vLLM's greedy path would report unprocessed log-probs.
            temperature, top_k = 1.0, 1
        else:  # 1e-5 as float32 (9.99999975e-06) is not greedy here (`is_greedy`), but is for vLLM's float64 check
            temperature = max(float(temperature), VLLM_GREEDY_TEMPERATURE)
        return SamplingParams(
            n=spec.n,
            max_tokens=spec.max_tokens,
            temperature=temperature,
            top_p=spec.top_p,
            top_k=top_k,  # 0 disables in vLLM as in SamplingSpec
            seed=request_seed(spec.seed, spec.prompt_offset + prompt_index),
            stop_token_ids=list(spec.stop_token_ids),
            ignore_eos=True,
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,
            detokenize=False,
        )

    def _sampler_context(self):
        if self._eager_sampler_ops:
            return self._torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()

    def _apply(self, batch: list) -> None:
        """Reload `batch` into the model, re-tie the LM head where needed, drop KV computed with old weights."""
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._weights_iterator(batch)})
        if self._retie_lm_head:
            self._llm.collective_rpc(_retie_cpu_lm_head)
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")

    def _weights_iterator(self, batch: list) -> Iterable:
        """What reload_weights consumes; a separate method so tests can inject a failure mid-way."""
        return list(batch)

    def _restore(self) -> bool:
        """Reload the last good weights (the checkpoint if no update succeeded yet); False if that fails."""
        try:
            self._llm.collective_rpc(_abandon_partial_reload)
            if self._last_good is None:
                from safetensors.torch import load_file

                batch = []
                for path in sorted(glob.glob(os.path.join(self._model_dir, "*.safetensors"))):
                    batch += [(k, v) for k, v in load_file(path).items() if k in self._specs]
            else:
                batch = self._last_good
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(batch)})
            if self._retie_lm_head:
                self._llm.collective_rpc(_retie_cpu_lm_head)
            if not self._llm.reset_prefix_cache():
                raise RuntimeError("prefix cache reset refused")
            return True
        except Exception as e:  # the state is unknown: stop serving rather than serve wrong weights
            self._unusable = (
                f"restoring weight version {self._version} after a failed update failed: {type(e).__name__}: {e}"
            )
            return False

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise EngineUnusableError(f"vLLM engine unusable: {self._unusable}; restart the rollout server")
        if "_llm" not in self.__dict__:
            raise EngineUnusableError("vLLM engine is closed")


def completions_from_outputs(outputs: Sequence, spec: SamplingSpec, version: int, *,
                             prompts: Sequence[Sequence[int]] | None = None) -> list[list[Completion]]:
    """Convert vLLM RequestOutputs (one per prompt, in prompt order) into Completions.

    Checks what the contract promises instead of trusting it: one output per prompt, for that prompt (given
    `prompts`: its prompt ids), n samples per prompt, one log-prob per token, a known finish reason, and a finite
    log-prob everywhere (NonFiniteLogprobsError names the prompt, sample and position of the first bad value).
    """
    if prompts is not None:
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        for i, (out, p) in enumerate(zip(outputs, prompts)):
            if list(out.prompt_token_ids) != [int(t) for t in p]:
                raise RuntimeError(f"vLLM's output {i} is not for prompt {i} (another request's completions)")
    result: list[list[Completion]] = []
    for i, out in enumerate(outputs):
        samples = sorted(out.outputs, key=lambda c: c.index)
        if len(samples) != spec.n:
            raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {i}, expected {spec.n}")
        row: list[Completion] = []
        for j, c in enumerate(samples):
            token_ids = [int(t) for t in c.token_ids]
            logprobs = _sampled_logprobs(c.logprobs, token_ids, i, j)
            bad = [t for t, v in enumerate(logprobs) if not math.isfinite(v)]
            if bad:
                raise NonFiniteLogprobsError(i, j, bad[0], logprobs[bad[0]], version)
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"prompt {i}, sample {j}: unexpected vLLM finish reason {c.finish_reason!r}")
            row.append(Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=c.finish_reason,
                                  weight_version=version))
        result.append(row)
    return result


def _sampled_logprobs(flat, token_ids: list[int], prompt: int, sample: int) -> list[float]:
    """The sampled token's log-prob at each position, from vLLM's FlatLogprobs (requested with logprobs=0)."""
    if flat is None or len(flat.start_indices) != len(token_ids):
        got = None if flat is None else len(flat.start_indices)
        raise RuntimeError(f"prompt {prompt}, sample {sample}: vLLM returned {got} log-prob positions for "
                           f"{len(token_ids)} tokens")
    values = []
    for t, (start, token) in enumerate(zip(flat.start_indices, token_ids)):
        if flat.end_indices[t] <= start or flat.token_ids[start] != token:
            raise RuntimeError(f"prompt {prompt}, sample {sample}, position {t}: vLLM's log-prob entry is not "
                               f"for the sampled token {token}")
        values.append(float(flat.logprobs[start]))
    return values
