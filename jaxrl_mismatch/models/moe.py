"""Mixture-of-experts feed-forward of Qwen3-MoE: top-k softmax router, dropless grouped expert matmuls,
expert parallelism, routing replay, router statistics and the load-balancing loss.

**Router** (top-k gating, Shazeer et al. 2017 eqs. 3–5 without the noise; HF `Qwen3MoeTopKRouter`):

    p = softmax(x W_r)          (logits in the compute dtype, softmax in float32)
    S = top-k(p)                (k = num_experts_per_tok)
    g_e = p_e / Σ_{e'∈S} p_e'   for e ∈ S   (norm_topk_prob; else g_e = p_e), cast to the compute dtype
    y = Σ_{e∈S} g_e · E_e(x),   E_e(x) = W_down,e (silu(x W_gate,e) ⊙ x W_up,e)   (SwiGLU, Shazeer 2020 eq. 6)

**Dispatch: dropless, sort + grouped matmul.** Every token goes to all k of its experts (no capacity, no
dropped tokens, so the trainer and the engine apply the same function whatever the batch). The N·k
(token, slot) assignments are sorted by expert (stable), the tokens gathered in that order, and each expert's
contiguous group multiplied by its weights with `jax.lax.ragged_dot` (group sizes = tokens per expert);
results are gathered back to (token, slot) order and summed over the k slots in a fixed order (no
scatter-add, so the result is deterministic). Intermediates are `[N·k, D]` and `[N·k, F]`: the FLOPs of the
k selected experts only, never `[N, E, F]`. A dense one-hot einsum would cost E/k times the FLOPs and
`[N, E, F]` memory (16x for Qwen3-30B-A3B's 128 experts, top-8); padded per-expert capacity buffers would
either drop tokens or, sized for the worst case, hold `[E, N·k, D]`.

**Expert parallelism** (mesh axis `expert`, `models/sharding.py`). Expert weights `[E, D, F]` are split
over `expert` on E (and over `fsdp`/`tensor` like the dense MLP). When the model carries a mesh
(`Transformer.mesh`, set by `load_hf(..., mesh=)` / `sharding.shard_model`), the expert FFN runs under
`jax.shard_map`: each device all-gathers its expert group's tokens (the batch is split over `expert` too),
computes only its local experts' assignments (the others sort past the last group and cost nothing), then
the partial outputs are reduce-scattered back over `expert` and summed over `tensor`; FSDP-split weights are
all-gathered just before use. This is the all-gather/reduce-scatter token dispatcher (Megatron-Core's
"allgather" dispatcher); it keeps the sort local to a device. Without a mesh (or when the local batch does
not divide) the same function runs under XLA's automatic partitioning.

**Routing replay.** `forced_ids` (`[N, k]` expert ids) replaces the selection S; the gate weights are still
the *current* router's probabilities of those experts, renormalised over them when `norm_topk_prob` — so
gradients reach the router through g, as in R3 (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers", rollout routing replay). R2 replays the trainer's own θ_old
routing the same way (see `train/step.py`).

**Load balancing** (Switch Transformer, Fedus et al. 2021, eqs. 4–6, as HF `load_balancing_loss_func`
computes it for Qwen3-MoE): over the valid tokens of all sparse layers, f_e = share of the top-k assignments
that went to expert e (summing to k), P_e = mean router probability of e, loss = E · Σ_e f_e P_e.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from jaxrl_mismatch.models.attention import matmul_precision
from jaxrl_mismatch.models.config import ModelConfig
from jaxrl_mismatch.models.sharding import batch_axes, param_partition_spec
from jaxrl_mismatch.precision import DTypePolicy


def routing_dtype(num_experts: int) -> jnp.dtype:
    """The narrowest unsigned integer type holding every expert id: what the engines return and send, and what a
    batch keeps (`train.batch.routing_rows`, `replay_routing`). At the Qwen3-30B-A3B config's step (2,048 rows ×
    10,240 tokens × 48 sparse layers × top-8) one `[B, S, L, k]` array is 8 GB as uint8, 32 GB as int32."""
    return jnp.dtype(jnp.uint8 if num_experts <= 256 else jnp.uint16 if num_experts <= 65536 else jnp.int32)


_INIT = nnx.initializers.normal(0.02)
# Routing replay modes (`trainer.routing_replay`): "off" = every forward routes freely; "R2" = the update's θ
# forwards replay θ_old's own routing; "R3" = the θ_old and θ forwards replay the rollout engine's routing.
REPLAY_MODES = ("off", "R2", "R3")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterOutput:
    """What the sparse layers' routers did in one forward (layers = `cfg.sparse_layers`, in order).

    expert_ids: the experts each token was sent to (the replayed ids under routing replay).
    router_ids: the router's own top-k (equal to `expert_ids` without replay), for agreement metrics.
    entropy: H(p) of each token's router distribution, nats.
    load / prob_sum: Σ over valid tokens of the assignments to each expert (counts of `expert_ids`) and of
      p — the sufficient statistics of the load-balancing loss and of the load metrics.
    num_tokens: valid tokens (the same in every layer).
    """

    expert_ids: Int[Array, "batch seq layers k"]
    router_ids: Int[Array, "batch seq layers k"]
    entropy: Float[Array, "batch seq layers"]
    load: Float[Array, "layers experts"]
    prob_sum: Float[Array, "layers experts"]
    num_tokens: Float[Array, ""]


def stack_layers(outputs: list[RouterOutput]) -> RouterOutput:
    """Per-layer outputs (a layer axis of size 1 each, or none) → one output over all sparse layers."""
    return RouterOutput(
        expert_ids=jnp.stack([o.expert_ids for o in outputs], axis=2),
        router_ids=jnp.stack([o.router_ids for o in outputs], axis=2),
        entropy=jnp.stack([o.entropy for o in outputs], axis=2),
        load=jnp.stack([o.load for o in outputs]),
        prob_sum=jnp.stack([o.prob_sum for o in outputs]),
        num_tokens=outputs[0].num_tokens,
    )


def from_scan(stacked: RouterOutput) -> RouterOutput:
    """A `lax.scan` over layers stacks per-layer outputs on a leading axis; move it where `stack_layers` puts it."""
    return RouterOutput(
        expert_ids=jnp.moveaxis(stacked.expert_ids, 0, 2), router_ids=jnp.moveaxis(stacked.router_ids, 0, 2),
        entropy=jnp.moveaxis(stacked.entropy, 0, 2), load=stacked.load, prob_sum=stacked.prob_sum,
        num_tokens=stacked.num_tokens[0],
    )


def route(
    logits: Float[Array, "n experts"], top_k: int, *, norm_topk_prob: bool,
    forced_ids: Int[Array, "n k"] | None = None,
) -> tuple[Int[Array, "n k"], Float[Array, "n k"], Float[Array, "n experts"], Int[Array, "n k"]]:
    """(expert ids, gate weights g in the logits' dtype, p in float32, the router's own top-k ids).

    Top-k of softmax(logits) (module docstring); with `forced_ids` the selection is those ids (clipped into
    range: the trainer validates them on the host) and g is p over them, renormalised when `norm_topk_prob`.
    """
    num_experts = logits.shape[-1]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, top_k)
    top_i = top_i.astype(jnp.int32)
    if forced_ids is None:
        ids, sel = top_i, top_p
    else:
        ids = jnp.clip(forced_ids.astype(jnp.int32), 0, num_experts - 1)
        sel = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        # Replayed experts the current router gives no float32 probability at all (a gap over ~100 nats) would be
        # 0 / 0 = NaN, which reaches real tokens through attention (0 · NaN): their gates are 0 instead. Any sum
        # ≥ tiny divides as before, bit for bit.
        sel = sel / jnp.maximum(jnp.sum(sel, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return ids, sel.astype(logits.dtype), probs, top_i


def grouped_experts(
    x: Float[Array, "n d"], ids: Int[Array, "n k"], gates: Float[Array, "n k"],
    w_gate: Float[Array, "e d f"], w_up: Float[Array, "e d f"], w_down: Float[Array, "e f d"],
) -> Float[Array, "n d"]:
    """Σ_slots g · E_ids(x) by sort + `ragged_dot` (module docstring), in x's dtype.

    Ids outside [0, e) (another device's experts under expert parallelism) contribute 0 and cost nothing:
    they sort after the last group, past `sum(group_sizes)`, where `ragged_dot` writes zeros.
    """
    x, ids, gates = jnp.asarray(x), jnp.asarray(ids), jnp.asarray(gates)
    n, d = x.shape
    k = ids.shape[1]
    num_experts = w_gate.shape[0]
    dtype = x.dtype
    precision = matmul_precision(dtype)
    flat = ids.reshape(n * k)
    local = (flat >= 0) & (flat < num_experts)
    key = jnp.where(local, flat, num_experts)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    xs = x[order // k]
    w_gate, w_up, w_down = (w.astype(dtype) for w in (w_gate, w_up, w_down))
    h = (jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, group_sizes, precision=precision))
         * jax.lax.ragged_dot(xs, w_up, group_sizes, precision=precision))
    ys = jax.lax.ragged_dot(h, w_down, group_sizes, precision=precision)
    g = jnp.where(local, gates.reshape(n * k).astype(dtype), jnp.zeros((), dtype))
    ys = ys * g[order][:, None]
    y = jnp.zeros_like(ys).at[order].set(ys)  # a permutation: every row written exactly once
    return jnp.sum(y.reshape(n, k, d), axis=1)


def _expert_parallel(mesh: Mesh, x, ids, gates, w_gate, w_up, w_down):
    """`grouped_experts` under `shard_map` over the whole mesh (module docstring), or None when the batch does
    not split evenly over the batch axes (then XLA partitions the plain function)."""
    axes = batch_axes(mesh)
    shards = 1
    for a in axes:
        shards *= mesh.shape[a]
    if x.shape[0] % shards:
        return None
    spec_in = param_partition_spec("layers/0/mlp/experts/gate_proj", w_gate.shape, mesh)
    spec_out = param_partition_spec("layers/0/mlp/experts/down_proj", w_down.shape, mesh)
    ep = spec_in[0] == "expert" and mesh.shape.get("expert", 1) > 1
    num_local = w_gate.shape[0] // (mesh.shape["expert"] if ep else 1)
    tok = P(axes, None, None)

    def local(x, ids, gates, w_gate, w_up, w_down):
        if spec_in[1] == "fsdp":  # FSDP: the weights' model dimension is gathered just before use
            w_gate = jax.lax.all_gather(w_gate, "fsdp", axis=1, tiled=True)
            w_up = jax.lax.all_gather(w_up, "fsdp", axis=1, tiled=True)
        if spec_out[2] == "fsdp":
            w_down = jax.lax.all_gather(w_down, "fsdp", axis=2, tiled=True)
        if ep:  # tokens of the whole expert group meet this device's experts
            x, ids, gates = (jax.lax.all_gather(a, "expert", axis=0, tiled=True) for a in (x, ids, gates))
            ids = ids - jax.lax.axis_index("expert") * num_local
        b, s, d = x.shape
        y = grouped_experts(x.reshape(b * s, d), ids.reshape(b * s, -1), gates.reshape(b * s, -1),
                            w_gate, w_up, w_down).reshape(b, s, d)
        if spec_in[2] == "tensor":  # row-parallel down projection: partial sums over the F shards
            y = jax.lax.psum(y, "tensor")
        if ep:
            y = jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)
        return y

    fn = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, spec_in, spec_in, spec_out), out_specs=tok,
                       check_vma=False)
    return fn(x, ids, gates, w_gate, w_up, w_down)


class Experts(nnx.Module):
    """The E SwiGLU experts' weights, stacked: gate/up `[E, D, F]`, down `[E, F, D]` (`[in, out]` per expert)."""

    def __init__(self, cfg: ModelConfig, policy: DTypePolicy, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nnx.Param(_INIT(rngs.params(), (e, d, f), policy.param_dtype))
        self.up_proj = nnx.Param(_INIT(rngs.params(), (e, d, f), policy.param_dtype))
        self.down_proj = nnx.Param(_INIT(rngs.params(), (e, f, d), policy.param_dtype))


class SparseMoE(nnx.Module):
    """The sparse MLP block: router + experts (module docstring). Parameter paths `mlp/router/kernel` `[D, E]`,
    `mlp/experts/{gate,up,down}_proj`."""

    def __init__(self, cfg: ModelConfig, policy: DTypePolicy, rngs: nnx.Rngs):
        dtype = policy.dtype_of("router")
        self.expert_dtype = None if "mlp" not in policy.fp32_components else jnp.float32  # precision.COMPONENTS
        self.router = nnx.Linear(cfg.hidden_size, cfg.num_experts, use_bias=False, dtype=dtype,
                                 param_dtype=policy.param_dtype, precision=matmul_precision(dtype),
                                 kernel_init=_INIT, rngs=rngs)
        self.experts = Experts(cfg, policy, rngs)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def __call__(
        self, x: Float[Array, "batch seq d"], valid: Bool[Array, "batch seq"],
        forced_ids: Int[Array, "batch seq k"] | None = None, mesh: Mesh | None = None,
    ) -> tuple[Float[Array, "batch seq d"], RouterOutput]:
        """(y, this layer's `RouterOutput` without a layer axis: ids `[B, S, k]`, entropy `[B, S]`, load `[E]`)."""
        b, s, d = x.shape
        logits = self.router(x).reshape(b * s, -1)
        num_experts = logits.shape[-1]
        forced = None if forced_ids is None else forced_ids.reshape(b * s, self.top_k)
        ids, gates, probs, own = route(logits, self.top_k, norm_topk_prob=self.norm_topk_prob, forced_ids=forced)
        w = (self.experts.gate_proj[...], self.experts.up_proj[...], self.experts.down_proj[...])
        if getattr(self, "expert_dtype", None) is not None:
            dt = self.expert_dtype
            x, gates, w = x.astype(dt), gates.astype(dt), [t.astype(dt) for t in w]
        shaped = (ids.reshape(b, s, -1), gates.reshape(b, s, -1))
        y = None if mesh is None else _expert_parallel(mesh, x, *shaped, *w)
        if y is None:
            y = grouped_experts(x.reshape(b * s, d), ids, gates, *w).reshape(b, s, d)
        v = valid.reshape(b * s)
        logp = jnp.log(jnp.maximum(probs, jnp.finfo(jnp.float32).tiny))
        entropy = -jnp.sum(probs * logp, axis=-1)
        slot_valid = jnp.broadcast_to(v[:, None], ids.shape).reshape(-1).astype(jnp.int32)
        load = jnp.zeros((num_experts,), jnp.int32).at[ids.reshape(-1)].add(slot_valid).astype(jnp.float32)
        prob_sum = jnp.sum(jnp.where(v[:, None], probs, 0.0), axis=0)
        out = RouterOutput(expert_ids=ids.reshape(b, s, -1), router_ids=own.reshape(b, s, -1),
                           entropy=entropy.reshape(b, s), load=load, prob_sum=prob_sum,
                           num_tokens=jnp.sum(v).astype(jnp.float32))
        return y, out


def load_balancing_loss(router: RouterOutput) -> Float[Array, ""]:
    """Switch Transformer eqs. 4–6 over all sparse layers and valid tokens, as HF's
    `load_balancing_loss_func` for Qwen3-MoE: E · Σ_e f_e · P_e with f_e = (assignments to e) / (L·T) (Σ_e f_e
    = k) and P_e = (Σ router probability of e) / (L·T). Counts use `expert_ids` (the replayed ids under
    routing replay: the experts that computed); the gradient flows through P only, as in HF."""
    layers, num_experts = router.load.shape
    total = jnp.maximum(router.num_tokens * layers, 1.0)
    f = jnp.sum(router.load, axis=0) / total
    p = jnp.sum(router.prob_sum, axis=0) / total
    return num_experts * jnp.sum(f * p)
