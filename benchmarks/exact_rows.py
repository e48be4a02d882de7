"""The exact programs on a data-parallel mesh: rows split over the devices against every device scoring every row.

    .venv/bin/python benchmarks/exact_rows.py [--devices 8] [--rows 64] [--prompt-len 24] [--max-tokens 40]

Exact mode scores each row alone (a per-row `lax.map`). Under plain jit on a data-parallel mesh that loop gathers
the rows and runs every row on every device: N× the work on N devices. Given the mesh, the exact scorer
(`models.exact.score_exact`, π(θ_old) in `prepare`) and the update's exact forward
(`train.exact_forward.exact_forward_logprobs`, its forward-only pass) split the rows with `jax.shard_map`. This
times both ways for both programs — `split` (the mesh given, as the trainer does) and `replicated` (no mesh, as
before) — compiled once each, then `--rounds` interleaved rounds; medians, their ratio, and whether every row's
log-probs are the same bits. On a CPU the devices are `--devices` fake host devices sharing this machine's cores
(`--xla_force_host_platform_device_count`): both ways keep every core busy, so the ratio is the work the split
saves (up to `--devices`×), as it would be the wall time on that many accelerators. Float32, a random 2-layer
model. Writes benchmarks/results/exact_rows.json.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._args import ArgumentParser, description, positive_int  # noqa: E402
from benchmarks._paths import check_out, repo_relative_args, write_json  # noqa: E402


def main() -> int:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--devices", type=positive_int, default=8, help="fake CPU devices (on a CPU); the mesh's data axis")
    ap.add_argument("--rows", type=positive_int, default=64)
    ap.add_argument("--prompt-len", type=positive_int, default=24)
    ap.add_argument("--max-tokens", type=positive_int, default=40)
    ap.add_argument("--rounds", type=positive_int, default=10)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "exact_rows.json"))
    a = ap.parse_args()
    check_out("--out", a.out, __file__)
    if a.rows % a.devices:
        print(f"error: --rows ({a.rows}) must divide by --devices ({a.devices})", file=sys.stderr)
        return 2
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={a.devices}".strip()

    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.exact_engine import DEMO_SHAPE
    from jaxrl_mismatch import precision
    from jaxrl_mismatch.models import ModelConfig, Transformer, load_hf, save_hf
    from jaxrl_mismatch.models.exact import score_exact
    from jaxrl_mismatch.models.sharding import make_mesh
    from jaxrl_mismatch.train.exact_forward import exact_forward_logprobs

    if jax.device_count() != a.devices:
        print(f"error: --devices {a.devices}: this backend has {jax.device_count()} devices", file=sys.stderr)
        return 2
    mesh = make_mesh({"data": -1})
    cfg = ModelConfig(**DEMO_SHAPE)
    rng = np.random.default_rng(0)
    s = a.prompt_len + a.max_tokens
    plen = rng.integers(max(1, a.prompt_len // 2), a.prompt_len + 1, size=a.rows)
    n = plen + rng.integers(1, a.max_tokens + 1, size=a.rows)
    tokens = np.where(np.arange(s)[None] < n[:, None], rng.integers(1, cfg.vocab_size, (a.rows, s)), 0).astype(np.int32)
    attention_mask = (np.arange(s)[None] < n[:, None]).astype(np.int32)
    response_mask = ((np.arange(1, s)[None] >= plen[:, None]) & (np.arange(1, s)[None] < n[:, None])).astype(np.float32)
    with tempfile.TemporaryDirectory() as d:
        save_hf(Transformer(cfg, precision.policy("fp32"), rngs=nnx.Rngs(0)), cfg, d)
        _, model = load_hf(d, policy=precision.policy("fp32", param_dtype="float32"), mesh=mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    placed = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (tokens, attention_mask, response_mask)]
    kw = dict(max_tokens=a.max_tokens, temperature=1.0)

    def forward(m):
        fn = jax.jit(lambda p, t, am, rm: exact_forward_logprobs(graphdef, p, t, am, rm, **kw, mesh=m)[0])
        return lambda: np.asarray(fn(params, *placed))

    def scorer(m):
        return lambda: score_exact(graphdef, params, tokens, attention_mask, response_mask, **kw, mesh=m)

    runs = {"scorer/split": scorer(mesh), "scorer/replicated": scorer(None),
            "forward/split": forward(mesh), "forward/replicated": forward(None)}
    first = {k: f() for k, f in runs.items()}  # compiles each program
    m = response_mask > 0
    same = {p: bool(np.array_equal(first[f"{p}/split"][m], first[f"{p}/replicated"][m])) for p in ("scorer", "forward")}
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for i in range(a.rounds):
        for k in names[i % len(names):] + names[: i % len(names)]:
            t0 = time.perf_counter()
            runs[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = {p: med[f"{p}/replicated"] / med[f"{p}/split"] for p in ("scorer", "forward")}
    print("| program | rows | median s | replicated / split | same bits |\n| --- | --- | --- | --- | --- |")
    for k, v in med.items():
        p = k.split("/")[0]
        print(f"| {k} | {a.rows} | {v:.4f} | {ratio[p]:.2f}× | {same[p]} |")
    print(f"{a.devices} devices ({jax.devices()[0].platform}), {os.cpu_count()} cores, {a.rounds} interleaved rounds")
    write_json(a.out, {"config": repo_relative_args(vars(a)), "median_s": med, "seconds": times,
                       "replicated_over_split": ratio, "same_bits": same, "platform": jax.devices()[0].platform,
                       "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "load_avg": os.getloadavg()}, __file__)
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
