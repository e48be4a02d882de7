"""The built-in JAX rollout engine: batched KV-cache sampling with the trainer's own model code.

Because the engine runs `models.Transformer` (the same module the trainer differentiates), the
training–inference mismatch left with identical weights and dtype is that of cached vs. full-sequence
evaluation (different matmul shapes, ~1e-6 in float32) — the zero-mismatch baseline the vexact review
asks for, against which vLLM's mismatch is measured. In bf16/fp16 one more difference remains: the engine
divides by T and takes the log-softmax in float32 (like vLLM's sampler), the trainer in its logits dtype
(unless `fp32_lm_head`); with top-k/top-p, the trainer's kept set rebuilt from bf16 log-probs can include
tokens tied with the k-th, which only lowers π (one review run, tiny random model, 256 tokens per setting: π − μ
−0.02 to −0.06 on the 3–11 % of tokens where that happens). Exact mode (`rollout.exact`) removes all of it.

One Generate call is one jitted program: prefill of the left-padded prompts, then `kv_cache.decode_loop`
(decode steps) that ends when every row has stopped or `max_tokens` is reached. Shapes are bucketed
(rows, prompt length and max_tokens to powers of two) so a training run compiles a handful of programs,
not one per request; sampling settings (temperature, top-k, top-p, stop ids, max_tokens) are traced
values, so changing them never recompiles, except that top-k/top-p and greedy (T < 1e-5) select the variant
with the sort.

Mixture-of-experts routing (`SamplingSpec.return_routing`, engine option "routing" for MoE models): the
program also records the experts each sparse layer chose for every prompt token (prefill) and every sampled
token (the decode step that consumes it), as uint8/uint16 ids `[tokens, layers, k]` per completion, so the
trainer can replay them (R3, `train/step.py`).

Quantized rollouts (`quantize` = int8 | fp8, the FlashRL setting): the engine holds the full-precision weights
W and their fake-quantized copy Q(W) (models/quantize.py), both rebuilt on every push; a request computes with
Q(W), or with W + s·(Q(W) − W) for its `quantize_strength` s < 1 (mid-run onset), exact mode included.

Sampling randomness is per row: row (prompt i, sample j) at step t uses
fold_in(fold_in(fold_in(PRNGKey(seed), prompt_offset + i), j), t), so a request is reproducible from its
seed and a row's draws do not depend on how many other rows share the batch, nor on how the caller split
its batch into requests (`SamplingSpec.prompt_offset`).
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import hf_io, kv_cache, quantize as quant
from jaxrl_mismatch.models.moe import routing_dtype
from jaxrl_mismatch.rollout import sampling
from jaxrl_mismatch.rollout.exact_sampler import perturb, sample_exact
from jaxrl_mismatch.rollout.spec_exact import SpecStats, sample_exact_speculative, verify_workers_default
from jaxrl_mismatch.rollout.engine import (
    Completion,
    Engine,
    EngineInfo,
    GenerationCancelled,
    NonFiniteLogprobsError,
    SamplingSpec,
    TensorSpec,
    resolve_max_model_len,
)
from jaxrl_mismatch.rollout.validation import check_request

_POLICY = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
MAX_STOP_SLOTS = 64  # stop ids are padded to a fixed length (a traced value, never a new shape)


def _hf_specs(params, dtype: str) -> dict[str, TensorSpec]:
    """HF name -> torch-layout shape of every HF tensor (one per expert of a stacked expert weight), from
    shapes alone (no host copy of the weights)."""
    return {name: TensorSpec(shape, dtype) for name, (shape, _) in hf_io.hf_tensor_shapes(params).items()}


class JaxEngine(Engine):
    """Engine over an HF checkpoint directory, served with the trainer's model code.

    Args:
      model_dir: HF checkpoint (config.json + safetensors).
      dtype: weights and compute dtype (precision preset fp32 / bf16 / fp16).
      max_model_len: prompt + completion limit; defaults to the model's max_position_embeddings, and may
        not exceed it (`engine.resolve_max_model_len`, the rule the vLLM engine follows too).
      max_batch_rows: rows (prompts x n) per jitted program; larger requests run in several programs,
        bounding the KV cache's memory.
      quantize: "none" | "int8" | "fp8": serve fake-quantized decoder linear weights (models/quantize.py).
        Loaded and pushed weights are quantized on arrival; the full-precision copy is kept too (twice the
        weight memory) so a request's `quantize_strength` can blend the two (mid-run onset).
      exact_sampler: how exact mode samples — "speculative" (KV-cache draft verified by the exact forward,
        `spec_exact.py`) or "reference" (a full forward per token, `exact_sampler.py`); same bits either way.
      exact_verify_workers: groups of rows the speculative exact sampler verifies concurrently; default
        `spec_exact.verify_workers_default()` (the process's cores on CPU, 1 on an accelerator). Same bits
        for every value.
      share_prefill: prefill each distinct prompt of a batch once and copy its KV cache to its n samples
        (GRPO asks n samples per prompt), instead of prefilling every row. Off: one prefill per row. The
        normal sampler's option; the speculative exact sampler's draft always shares (it only proposes
        tokens), and exact mode's row forwards compute each row alone by design.
    """

    def __init__(self, model_dir: str, *, dtype: str = "float32", max_model_len: int | None = None,
                 max_batch_rows: int = 256, quantize: str = "none", exact_sampler: str = "speculative",
                 exact_verify_workers: int | None = None, share_prefill: bool = True):
        if exact_verify_workers is not None and exact_verify_workers < 1:
            raise ValueError(f"exact_verify_workers must be ≥ 1, got {exact_verify_workers}")
        self._verify_workers = exact_verify_workers or verify_workers_default()
        if exact_sampler not in ("speculative", "reference"):
            raise ValueError(f"exact_sampler must be 'speculative' or 'reference', got {exact_sampler!r}")
        self._exact_sampler = exact_sampler
        self.exact_stats = SpecStats()  # draft/verify counters of the speculative exact sampler, cumulative
        if dtype not in _POLICY:
            raise ValueError(f"dtype must be one of {', '.join(_POLICY)}, got {dtype!r}")
        if quantize not in quant.METHODS:
            raise ValueError(f"quantize must be one of {', '.join(quant.METHODS)}, got {quantize!r}")
        self._quantize = quantize
        self._dtype = dtype
        self._policy = precision.policy(_POLICY[dtype])
        cfg, model = hf_io.load_hf(model_dir, policy=self._policy)
        self.cfg = cfg
        self._graphdef, params, self._rest = nnx.split(model, nnx.Param, ...)
        self._abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params)
        self._specs = _hf_specs(params, dtype)
        self._max_model_len = resolve_max_model_len(max_model_len, cfg.max_position_embeddings)
        self._max_batch_rows = max_batch_rows
        self._share_prefill = share_prefill
        self._lock = threading.Lock()  # guards the (params, version) pair, nothing else
        self._params, self._quantized, self._version = params, self._quantized_of(params), 0

    # -- Engine interface --------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        with self._lock:
            version = self._version
        options = (("exact", "logit_noise_std", "kept_counts") + (("routing",) if self.cfg.is_moe else ())
                   + (("quantize_strength",) if self._quantize != "none" else ()))
        routing_bytes = (len(self.cfg.sparse_layers) * self.cfg.num_experts_per_tok
                         * np.dtype(routing_dtype(self.cfg.num_experts)).itemsize) if self.cfg.is_moe else 0
        return EngineInfo(architecture=self.cfg.architecture, vocab_size=self.cfg.vocab_size, dtype=self._dtype,
                          engine="jax", weight_version=version, max_model_len=self._max_model_len,
                          options=options, quantize=self._quantize, routing_bytes_per_token=routing_bytes)

    def weight_specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def update_weights(self, tensors: dict[str, np.ndarray], version: int) -> None:
        """Convert HF tensors to a complete new param tree, then swap it in under the lock.

        The tensors come from the server's validation (names, shapes, dtype, finite values), which is
        shared with the vLLM engine, so both engines accept and refuse exactly the same pushes.

        The new tree is built (and placed on device) before the lock is taken, so a generation running
        meanwhile finishes on the old tree and the next one starts on the new one — never a mix.
        """
        new_params = hf_io.hf_to_params(tensors, self.cfg, self._abstract)  # casts, places on device
        new_quantized = self._quantized_of(new_params)  # quantized on arrival, server side
        jax.block_until_ready((new_params, new_quantized))
        with self._lock:
            self._params, self._quantized, self._version = new_params, new_quantized, version

    def _quantized_of(self, params):
        """The fake-quantized weights served (the same tree when not quantizing)."""
        return params if self._quantize == "none" else _quantize_program(params, method=self._quantize)

    def _pick(self, params, quantized, strength: float):
        """The weights a request with `quantize_strength` = strength computes with: W, Q(W) or a blend."""
        if self._quantize == "none" or strength <= 0.0:
            return params
        return quantized if strength >= 1.0 else _blend_program(params, quantized, np.float32(strength))

    def generate_cancellable(self, prompts: list[list[int]], spec: SamplingSpec,
                             cancelled: threading.Event) -> list[list[Completion]]:
        return self.generate(prompts, spec, cancelled=cancelled)

    def generate(self, prompts: list[list[int]], spec: SamplingSpec, *,
                 cancelled: threading.Event | None = None) -> list[list[Completion]]:
        """`Engine.generate`; with `cancelled`, checked before each batch of `max_batch_rows` rows."""
        # The server's checks of every request (`validation.check_request`, a RequestError naming the field): the
        # jobs that drive the engine in-process (attribute, analyze) reach it directly, where an empty row sampled
        # from a fully masked prefill, a negative id read the vocabulary's last row, exact mode at greedy crashed.
        check_request(prompts, spec, self.info())
        with self._lock:
            params, quantized, version = self._params, self._quantized, self._version
        params = self._pick(params, quantized, spec.quantize_strength)
        rows = [(i, j) for i in range(len(prompts)) for j in range(spec.n)]
        tokens = np.zeros((len(rows), spec.max_tokens), np.int32)
        logps = np.zeros((len(rows), spec.max_tokens), np.float32)
        lengths = np.zeros((len(rows),), np.int32)
        stopped = np.zeros((len(rows),), bool)
        routing: list[np.ndarray | None] = [None] * len(rows)
        filtering = sampling.uses_filtering(spec.top_k, spec.top_p, spec.temperature)
        kept = np.zeros((len(rows), spec.max_tokens), np.int32) if filtering else None
        for start in range(0, len(rows), self._max_batch_rows):
            if cancelled is not None and cancelled.is_set():
                raise GenerationCancelled(f"the caller went away after {start} of {len(rows)} rows")
            part = rows[start : start + self._max_batch_rows]
            sl = slice(start, start + len(part))
            if spec.exact:  # batch-invariant, trainer-identical log-probs (spec_exact.py, exact_sampler.py)
                kw = dict(max_tokens=spec.max_tokens, temperature=spec.temperature,
                          logit_noise_std=spec.logit_noise_std, stop_token_ids=spec.stop_token_ids,
                          base_key=seed_key_data(spec.seed), stop_slots=MAX_STOP_SLOTS,
                          prompt_offset=spec.prompt_offset)
                if self._exact_sampler == "reference":
                    if filtering:
                        raise ValueError("top_k/top_p in exact mode need the speculative exact sampler")
                    t, lp, n, s = sample_exact(self._graphdef, params, self._rest, prompts, part, **kw)
                else:
                    t, lp, n, s, st, kc = sample_exact_speculative(self._graphdef, params, self._rest, prompts, part,
                                                                  top_k=spec.top_k, top_p=spec.top_p,
                                                                  verify_workers=self._verify_workers, **kw)
                    self.exact_stats.add(st)
                    if filtering:
                        kept[sl] = kc
            else:
                t, lp, n, s, r, kc = self._generate_rows(params, prompts, part, spec)
                if r is not None:
                    routing[sl] = r
                if filtering:
                    kept[sl] = kc
            tokens[sl], logps[sl], lengths[sl], stopped[sl] = t, lp, n, s
        out: list[list[Completion]] = [[] for _ in prompts]
        for r, (i, j) in enumerate(rows):
            n = int(lengths[r])
            lp = logps[r, :n]
            bad = np.flatnonzero(~np.isfinite(lp))
            if bad.size:
                raise NonFiniteLogprobsError(i, j, int(bad[0]), float(lp[bad[0]]), version)
            out[i].append(Completion(token_ids=tokens[r, :n].tolist(), logprobs=lp.tolist(),
                                     finish_reason="stop" if stopped[r] else "length", weight_version=version,
                                     routing=None if routing[r] is None else routing[r][: len(prompts[i]) + n],
                                     kept_counts=None if kept is None else kept[r, :n].tolist()))
        return out

    # -- batching ----------------------------------------------------------------------------------
    def _generate_rows(self, params, prompts, rows, spec: SamplingSpec):
        """Pad one batch of rows to bucketed shapes, run the jitted program, un-pad the results."""
        n_rows = kv_cache.bucket(len(rows))
        prompt_len = kv_cache.bucket(max(len(prompts[i]) for i, _ in rows), 16)
        new_len = kv_cache.bucket(spec.max_tokens, 16)
        ids, mask, row_src = kv_cache.prefill_inputs([prompts[i] for i, _ in rows], batch=n_rows, width=prompt_len,
                                                     share=self._share_prefill)
        keys = np.zeros((n_rows,), np.int32)
        samples = np.zeros((n_rows,), np.int32)
        for r, (i, j) in enumerate(rows):
            keys[r], samples[r] = spec.prompt_offset + i, j
        # Padding rows (up to the bucketed row count) may draw nothing: with the batch's limit they decoded their
        # own continuation, and the loop ran until they stopped too (up to max_tokens past the real rows' end).
        limits = np.zeros((n_rows,), np.int32)
        limits[: len(rows)] = spec.max_tokens
        stop = np.full((MAX_STOP_SLOTS,), -1, np.int32)
        stop[: len(spec.stop_token_ids)] = spec.stop_token_ids
        base_key = seed_key_data(spec.seed)
        out = _sample_program(
            self._graphdef, params, self._rest, jnp.asarray(ids), jnp.asarray(mask), base_key,
            jnp.asarray(keys), jnp.asarray(samples), np.float32(spec.temperature), np.int32(spec.top_k),
            np.float32(spec.top_p), jnp.asarray(stop), jnp.asarray(limits), np.float32(spec.logit_noise_std),
            None if row_src is None else jnp.asarray(row_src),
            new_len=new_len, filtering=sampling.uses_filtering(spec.top_k, spec.top_p, spec.temperature),
            inject=spec.logit_noise_std > 0, routing=spec.return_routing,
        )
        k = len(rows)
        tokens, logps, lengths, stopped, prompt_routes, new_routes, kept = jax.device_get(out)
        routes = None
        if spec.return_routing:  # prompt tokens sit right-aligned in the left-padded prefill
            routes = [np.concatenate([prompt_routes[r, prompt_len - len(prompts[i]):], new_routes[r, : int(lengths[r])]])
                      for r, (i, _) in enumerate(rows)]
        return (tokens[:k, : spec.max_tokens], logps[:k, : spec.max_tokens], lengths[:k], stopped[:k], routes,
                kept[:k, : spec.max_tokens])


_quantize_program = jax.jit(quant.quantize_params, static_argnames=("method",))
_blend_program = jax.jit(quant.blend)


def seed_key_data(seed: int) -> np.ndarray:
    """threefry key data for a 64-bit seed, all 64 bits used.

    `jax.random.PRNGKey` keeps only the low 32 bits when x64 is off, so seeds 3 and 2**40 + 3 would
    draw identical completions; here the high word goes into the key's first half (as PRNGKey does
    with x64 on).
    """
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return np.array([s >> 32, s & 0xFFFFFFFF], dtype=np.uint32)


def step_logprobs(
    logits: Float[Array, "rows vocab"], temperature, top_k, top_p, *, filtering: bool
) -> Float[Array, "rows vocab"]:
    """log μ over the vocabulary for one decode step (sampling.py; the sort only when filtering)."""
    if filtering:
        return sampling.processed_logprobs(logits, temperature, top_k, top_p)
    return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)


class _RoutingRecorder:
    """The model as `kv_cache.prefill` / `decode_step` use it (`forward_prefill`, `forward_cached`, `logits`),
    keeping the expert ids of the last call's tokens, so the cache bookkeeping stays in one place."""

    def __init__(self, model, dtype):
        self.model, self.dtype, self.last = model, dtype, None

    def forward_prefill(self, *args):
        hidden, kv, router = self.model.forward_prefill_routed(*args)
        self.last = router.expert_ids.astype(self.dtype)
        return hidden, kv

    def forward_cached(self, *args, **kwargs):
        hidden, k, v, router = self.model.forward_cached_routed(*args, **kwargs)
        self.last = router.expert_ids.astype(self.dtype)
        return hidden, k, v

    def logits(self, hidden):
        return self.model.logits(hidden)


@functools.partial(jax.jit, static_argnames=("graphdef", "new_len", "filtering", "inject", "routing"))
def _sample_program(
    graphdef, params, rest,
    prompt_ids: Int[Array, "prefill prompt"],
    prompt_mask: Int[Array, "prefill prompt"],
    base_key, prompt_idx: Int[Array, " rows"], sample_idx: Int[Array, " rows"],
    temperature, top_k, top_p,
    stop_ids: Int[Array, " stops"],
    max_tokens: Int[Array, " rows"], sigma,
    row_src: Int[Array, " rows"] | None = None,
    *, new_len: int, filtering: bool, inject: bool, routing: bool = False,
) -> tuple[Int[Array, "rows new"], Float[Array, "rows new"], Int[Array, " rows"], Bool[Array, " rows"], Array, Array]:
    """Prefill + sampled decode until every row stopped or has its `max_tokens` (≤ new_len; 0 for padding) tokens.

    `row_src`: None, one prompt row per sampled row; else the prompts are the distinct ones, each prefilled
    once, and row r decodes from a copy of prompt row `row_src[r]`'s cache and last logits.
    Also returns the expert ids of the prompt tokens `[rows, prompt, layers, k]` and of each sampled token
    `[rows, new, layers, k]` when `routing` (else two empty arrays)."""
    model = nnx.merge(graphdef, params, rest)
    prompt_len = prompt_ids.shape[1]
    rows = prompt_ids.shape[0] if row_src is None else row_src.shape[0]
    cfg = model.cfg
    route_dtype = routing_dtype(cfg.num_experts)
    route_shape = (len(cfg.sparse_layers), cfg.num_experts_per_tok) if routing else (0, 0)
    runner = _RoutingRecorder(model, route_dtype) if routing else model
    cache = kv_cache.init_cache(cfg, prompt_ids.shape[0], prompt_len + new_len, model.policy.dtype_of("attention"))
    logits, cache = kv_cache.prefill(runner, prompt_ids, prompt_mask, cache)
    prompt_routes = runner.last if routing else jnp.zeros((rows, 0) + route_shape, route_dtype)
    if row_src is not None:
        logits, cache = logits[row_src], kv_cache.select_rows(cache, row_src)
        prompt_routes = prompt_routes[row_src] if routing else prompt_routes
    keys = sampling.row_keys(base_key, prompt_idx, sample_idx)

    def pick(t, logits):
        logp_all = step_logprobs(logits, temperature, top_k, top_p, filtering=filtering)
        kept = jnp.sum(jnp.isfinite(logp_all), axis=-1).astype(jnp.int32)
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, t)
        if inject:  # controlled mismatch: sample from, and report, the perturbed distribution
            logp_all = perturb(logp_all, step_keys, sigma, temperature)
        tok = jax.vmap(jax.random.categorical)(step_keys, logp_all).astype(jnp.int32)
        lp = jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]
        return tok, {"logps": lp, "kept": kept}

    records = {"logps": jnp.zeros((rows, new_len), jnp.float32), "kept": jnp.zeros((rows, new_len), jnp.int32)}
    observe = None
    if routing:  # the experts that processed token t (as the input of the decode step that consumed it)
        records["routes"] = jnp.zeros((rows, new_len) + route_shape, route_dtype)
        observe = lambda: {"routes": runner.last[:, 0]}  # noqa: E731
    tokens, records, lengths, stopped = kv_cache.decode_loop(
        runner, logits, cache, pick, new_len=new_len, max_tokens=max_tokens, stop_ids=stop_ids, records=records,
        observe=observe)
    routes = records.get("routes", jnp.zeros((rows, 0) + route_shape, route_dtype))
    return tokens, records["logps"], lengths, stopped, prompt_routes, routes, records["kept"]
