"""A MoE policy's forward and backward on a mesh: the experts expert-parallel under `shard_map` against XLA
partitioning the plain expert function.

    .venv/bin/python benchmarks/moe_expert_parallel.py [--rows 16] [--seq 64] [--rounds 5]

When the model carries its mesh (`Transformer.mesh`), each MoE layer's expert FFN runs under `jax.shard_map`
(`models/moe.py`: the expert group's tokens all-gathered, each device computing its own experts' assignments, the
outputs reduce-scattered); without it, XLA partitions the plain grouped-experts function (a sort and gathers over
all tokens) itself. The trainer loads its policy with `load_hf(..., mesh=)`, which placed the weights on the mesh
but, until 2026-11-29, left `Transformer.mesh` unset: the trainer took the second path. This measures both, for
the log-prob forward and backward the update differentiates (sum of `token_logprobs`), on the trainer's default
data-parallel mesh and on a data × expert one: XLA's compiled cost per device (FLOPs, bytes accessed, temporary
memory), the median time of `--rounds` interleaved calls, and whether both give the same log-probs and gradients
(float32, within 1e-5 / 2e-5). On a CPU the devices are 8 fake host devices sharing this machine's cores, so the
times show the work each way does, not an accelerator's wall time. A random 3-layer Qwen3-MoE (8 experts, top 2,
one dense layer). Writes benchmarks/results/moe_expert_parallel.json.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._args import ArgumentParser, description, positive_int  # noqa: E402
from benchmarks._paths import check_out, repo_relative_args, write_json  # noqa: E402

DEVICES = 8
MESHES = {"data8": {"data": 8}, "data2_expert4": {"data": 2, "expert": 4}}
MODEL = dict(architecture="Qwen3MoeForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-6,
             rope_theta=1e6, rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
             max_position_embeddings=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
             norm_topk_prob=True, mlp_only_layers=(1,))


def main() -> int:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--rows", type=positive_int, default=16, help="sequences in the batch (a multiple of 8)")
    ap.add_argument("--seq", type=positive_int, default=64, help="tokens per sequence (at most 512)")
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "moe_expert_parallel.json"))
    a = ap.parse_args()
    check_out("--out", a.out, __file__)
    if a.rows % DEVICES:
        ap.error(f"--rows must be a multiple of {DEVICES}, got {a.rows}")
    if not 2 <= a.seq <= MODEL["max_position_embeddings"]:  # one token leaves nothing to predict
        ap.error(f"--seq must be in [2, {MODEL['max_position_embeddings']}], got {a.seq}")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxrl_mismatch import precision
    from jaxrl_mismatch.models import ModelConfig, Transformer, token_logprobs
    from jaxrl_mismatch.models import sharding as sh

    def loss(params, graphdef, rest, tokens, mask):
        logp, _ = token_logprobs(nnx.merge(graphdef, params, rest), tokens[:, :-1], tokens[:, 1:], mask[:, :-1])
        return jnp.sum(logp), logp

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    cfg = ModelConfig(**MODEL)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, cfg.vocab_size, size=(a.rows, a.seq)).astype(np.int32)
    mask = np.ones_like(tokens)
    rows, cost, same = {}, {}, {}
    for mesh_name, axes in MESHES.items():
        mesh = sh.make_mesh(axes)
        placed = [jax.device_put(x, sh.batch_sharding(mesh)) for x in (tokens, mask)]
        outs = {}
        for way in ("shard_map", "xla"):
            model = sh.shard_model(Transformer(cfg, precision.policy("fp32"), rngs=nnx.Rngs(0)), mesh)
            if way == "xla":
                model.mesh = None  # what the trainer's model carried before: XLA partitions the plain function
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            compiled = grad.lower(params, graphdef, rest, *placed).compile()
            ca = compiled.cost_analysis()
            ca = ca[0] if isinstance(ca, list) else ca
            key = f"{mesh_name}/{way}"
            cost[key] = {"flops_per_device": float(ca.get("flops", 0.0)),
                         "bytes_accessed_per_device": float(ca.get("bytes accessed", 0.0)),
                         "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}
            (_, logp), g = compiled(params, rest, *placed)
            outs[way] = (np.asarray(logp), jax.tree.map(np.asarray, g))
            rows[key] = (compiled, (params, rest, *placed))
        lp_ok = np.allclose(outs["shard_map"][0], outs["xla"][0], atol=1e-5, rtol=0)
        g_ok = all(np.allclose(x, y, atol=2e-5, rtol=0) for x, y in zip(jax.tree.leaves(outs["shard_map"][1]),
                                                                        jax.tree.leaves(outs["xla"][1])))
        same[mesh_name] = bool(lp_ok and g_ok)
    times: dict[str, list[float]] = {k: [] for k in rows}
    names = list(rows)
    for i in range(a.rounds):
        for k in names[i % len(names):] + names[: i % len(names)]:
            compiled, args = rows[k]
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("| mesh | experts | GFLOP / device | MB accessed / device | temp MB | median s | xla / shard_map (time) "
          "| same results |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for k in names:
        mesh_name, way = k.split("/")
        c = cost[k]
        ratio = med[f"{mesh_name}/xla"] / med[f"{mesh_name}/shard_map"]
        print(f"| {mesh_name} | {way} | {c['flops_per_device'] / 1e9:.2f} | {c['bytes_accessed_per_device'] / 1e6:.1f} "
              f"| {c['temp_bytes'] / 1e6:.1f} | {med[k]:.4f} | {ratio:.2f}× | {same[mesh_name]} |")
    print(f"{DEVICES} devices ({jax.devices()[0].platform}), {os.cpu_count()} cores, {a.rounds} interleaved rounds, "
          f"batch [{a.rows}, {a.seq}]")
    write_json(a.out, {"config": repo_relative_args(vars(a)), "model": MODEL, "cost": cost, "median_s": med,
                       "seconds": times, "same_results": same, "platform": jax.devices()[0].platform,
                       "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "load_avg": os.getloadavg()}, __file__)
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
