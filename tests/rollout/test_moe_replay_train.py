"""MoE routing from a real engine into the trainer (issue 11): rollouts with `return_routing` through a real
in-process `RolloutServer` + `RolloutSession`, `collect.to_batch` into `RolloutBatch.routing`, then
`Learner.prepare` (the jitted θ_old forward and step metrics).

- R3, fp32 engine and trainer: π(θ_old) under the engine's routing equals μ (≤ 1e-5) on every response token.
- R3 on an expert-parallel mesh (data 4 × expert 2): the same π(θ_old), replayed experts and update as on a
  data-parallel mesh.
- Replay off, bf16 engine vs fp32 trainer: the routers disagree on some tokens (`moe/router_disagree_frac` > 0)
  and ρ = π/μ is wider where they did (`moe/rho_std_routing_disagreed` > `..._agreed`).

The checkpoint is a tiny random Qwen3-MoE saved by transformers (`tests/models/moe_tiny.py`) with a dense
middle layer, its router drawn at N(0, 0.15²): close enough to ties that bf16 rounding flips some top-2 sets.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from tests.models.moe_tiny import make_moe_model

from jaxrl_mismatch.objectives import compute_advantages
from jaxrl_mismatch.rollout.client import RolloutClient
from jaxrl_mismatch.rollout.engine import SamplingSpec
from jaxrl_mismatch.rollout.jax_engine import JaxEngine
from jaxrl_mismatch.rollout.server import RolloutServer
from jaxrl_mismatch.rollout.session import RolloutSession
from jaxrl_mismatch.train.collect import sample_groups, to_batch
from jaxrl_mismatch.train.config import base_config
from jaxrl_mismatch.train.learner import Learner
from jaxrl_mismatch.train.learner_config import learner_config

TOKEN = "moe-replay-train-token"
PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79], [7, 1], [200, 17, 4, 4]]
GROUP = 4


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_replay_ckpt")
    model = make_moe_model(False, seed=11, mlp_only_layers=[1])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(0.3)
    model.save_pretrained(d)
    return d


def _batch(moe_dir, dtype: str, seed: int):
    server = RolloutServer(port=0, token=TOKEN)
    server.attach(JaxEngine(str(moe_dir), dtype=dtype))
    session = RolloutSession(RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=60))
    try:
        assert "routing" in session.info().options
        spec = SamplingSpec(n=GROUP, max_tokens=24, seed=seed, return_routing=True)
        groups = sample_groups(session, PROMPTS, [""] * len(PROMPTS), spec, lambda ids, _: float(len(ids) % 2))
    finally:
        session.close()
        server.stop(0)

    def advantages(rewards, gids, n):
        return np.asarray(compute_advantages("grpo", rewards, gids, n))

    return to_batch(groups, advantages, pad_id=0, with_routing=True)


def _learner(moe_dir, replay: str, optim: dict | None = None, **trainer) -> Learner:
    c = base_config()
    c.optim.update(optim or {})
    c.model.path = str(moe_dir)
    c.rollout.group_size = GROUP
    c.batch.prompts_per_step = len(PROMPTS)
    c.trainer.chunk_size = 16
    c.trainer.routing_replay = replay
    for k, v in trainer.items():
        c.trainer[k] = v
    return Learner(learner_config(c))


@pytest.fixture(scope="module")
def fp32_batch(moe_dir):
    """The fp32 engine's rollouts, read by both R3 tests. Their advantages are all 0, so random ones replace them
    (the update test needs a nonzero step; `prepare`'s θ_old forward and metrics do not read them)."""
    batch = _batch(moe_dir, "float32", seed=3)
    adv = np.random.default_rng(0).normal(size=(batch.num_rows, 1)).astype(np.float32)
    return batch.replace(advantages=adv * batch.response_mask)


def _sgd_learner(moe_dir, mesh: dict) -> Learner:
    # SGD at lr 1 without clipping: the update is -∇ (Adam's 1/√v would blow rounding up to lr scale).
    return _learner(moe_dir, "R3", optim=dict(name="sgd", lr=1.0, max_grad_norm=1e9), mesh=mesh)


@pytest.fixture(scope="module")
def r3_data_parallel(moe_dir, fp32_batch):
    """(learner, θ_old, prepared batch, metrics): R3 on a data-parallel mesh, prepared once for the μ test and the
    mesh comparison (one jitted prepare instead of two); only the comparison then steps the learner."""
    learner = _sgd_learner(moe_dir, {"data": -1})
    theta0 = {k: v.copy() for k, v in learner.hf_weights().items()}
    out, metrics = learner.prepare(fp32_batch, seed=0)
    return learner, theta0, out, metrics


def test_r3_prepare_reproduces_mu_in_fp32(fp32_batch, r3_data_parallel):
    batch = fp32_batch
    # the engine's uint8 ids (8 experts) stay uint8 through the batch and prepare: 4x less memory than int32
    assert batch.routing.shape == batch.tokens.shape + (2, 2) and batch.routing.dtype == np.uint8
    _, _, out, metrics = r3_data_parallel
    m = batch.response_mask.astype(bool)
    err = float(np.max(np.abs(np.asarray(out.old_logp) - batch.rollout_logp)[m]))  # numpy: no eager-op compiles
    assert err <= 1e-5, err
    assert out.routing is None and out.replay_routing is not None and out.replay_routing.dtype == np.uint8
    valid = batch.attention_mask[:, :-1].astype(bool)
    np.testing.assert_array_equal(np.asarray(out.replay_routing)[:, :-1][valid], batch.routing[:, :-1][valid])
    # Same weights, same fp32 function: the trainer's own router agrees with the engine's almost everywhere.
    assert metrics["moe/router_disagree_frac"] < 0.02
    assert metrics["mismatch/rho_std"] < 1e-5


def test_replay_off_bf16_engine_disagreement_widens_rho(moe_dir):
    batch = _batch(moe_dir, "bfloat16", seed=5)
    out, metrics = _learner(moe_dir, "off").prepare(batch, seed=0)
    assert out.replay_routing is None and out.routing is None
    frac, agreed, disagreed = (metrics[k] for k in ("moe/router_disagree_frac", "moe/rho_std_routing_agreed",
                                                    "moe/rho_std_routing_disagreed"))
    print(f"bf16 engine vs fp32 trainer: router_disagree_frac={frac:.4f} "
          f"token_frac={metrics['moe/router_disagree_token_frac']:.4f} rho_std agreed={agreed:.4f} "
          f"disagreed={disagreed:.4f} (layer0={metrics['moe/router_disagree_frac_layer0']:.4f}, "
          f"layer2={metrics['moe/router_disagree_frac_layer2']:.4f})")
    assert 0 < frac < 0.5
    assert disagreed > agreed > 0


def test_r3_on_an_expert_parallel_mesh_matches_data_parallel(moe_dir, fp32_batch, r3_data_parallel):
    """Routing replay where the experts are sharded over the `expert` axis (and the batch over data × expert):
    prepare replays the engine's experts and the update moves the weights exactly as on a data-only mesh."""
    out, params = {}, {}
    for name in ("data", "expert"):
        if name == "data":
            learner, theta0, out[name], _ = r3_data_parallel
        else:
            learner = _sgd_learner(moe_dir, {"data": -1, "expert": 2})
            theta0 = {k: v.copy() for k, v in learner.hf_weights().items()}
            out[name], _ = learner.prepare(fp32_batch, seed=0)
        specs = {str(x.sharding.spec) for x in jax.tree.leaves(learner.state.params)}
        assert any("'expert'" in spec for spec in specs) == (name == "expert"), specs  # the experts are split
        assert np.isfinite(learner.optimize(out[name], seed=0)["loss/total"])
        params[name] = {k: v - theta0[k] for k, v in learner.hf_weights().items()}  # the update
    np.testing.assert_array_equal(out["expert"].replay_routing, out["data"].replay_routing)
    assert float(np.max(np.abs(out["expert"].old_logp - out["data"].old_logp))) <= 1e-5
    step = max(float(np.max(np.abs(v))) for v in params["data"].values())
    diff = max(float(np.max(np.abs(params["expert"][k] - params["data"][k]))) for k in params["data"])
    print({"max |update|": step, "max |update difference| expert vs data mesh": diff})
    assert step > 0 and diff <= 1e-3 * step
