"""MoE routing over gRPC (issue 11 item 3): the built-in engine returns the experts each sparse layer chose for
every prompt and completion token, packed as uint8 bytes; replaying them in the trainer's teacher-forced
forward (R3) reproduces the engine's own log-probs (fp32, ≤ 1e-5); engines without the option (vLLM, dense
models) and exact mode refuse the request by name; a malformed routing message is refused by name.

A real in-process `RolloutServer` + `RolloutClient` on loopback, a tiny random Qwen3-MoE checkpoint saved by
transformers (a dense middle layer, so the layer axis of the routing is the sparse layers only).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tests.models.moe_tiny import make_moe_model

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import hf_io, logprobs_from_hidden, positions_from_mask
from jaxrl_mismatch.rollout import rollout_pb2
from jaxrl_mismatch.rollout.client import RolloutClient, RolloutError
from jaxrl_mismatch.rollout.engine import EngineInfo, SamplingSpec
from jaxrl_mismatch.rollout.jax_engine import JaxEngine
from jaxrl_mismatch.rollout.protocol import Limits, MalformedMessageError, routing_from_proto, routing_to_proto
from jaxrl_mismatch.rollout.server import RolloutServer
from jaxrl_mismatch.rollout.validation import RequestError, parse_generate

TOKEN = "moe-routing-token"
PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79], [7]]
SPEC = SamplingSpec(n=4, max_tokens=24, seed=5, return_routing=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_ckpt")
    make_moe_model(False, seed=4, mlp_only_layers=[1]).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def served(moe_dir):
    server = RolloutServer(port=0, token=TOKEN)
    server.attach(JaxEngine(str(moe_dir), dtype="float32"))
    client = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=60)
    yield client
    client.close()
    server.stop(0)


def _rows(prompts, completions):
    seqs = [(p, c) for p, samples in zip(prompts, completions) for c in samples]
    length = max(len(p) + len(c.token_ids) for p, c in seqs)
    tokens = np.zeros((len(seqs), length), np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    routing = np.zeros((len(seqs), length, 2, 2), np.int32)
    for b, (p, c) in enumerate(seqs):
        n = len(p) + len(c.token_ids)
        tokens[b, :n], mask[b, :n], routing[b, :n] = p + c.token_ids, 1, c.routing
    return seqs, tokens, mask, routing


@jax.jit
def _trainer_forwards(model, tokens, mask, routing):
    """(the trainer's own top-k, teacher-forced log-probs under `routing`): one program, not one per eager op."""
    ids, targets, m = tokens[:, :-1], tokens[:, 1:], mask[:, :-1]
    _, router = model.forward_routed(ids, positions_from_mask(m), m)
    hidden = model(ids, positions_from_mask(m), m, routing=routing[:, :-1])
    return router.router_ids, logprobs_from_hidden(model, hidden, targets, m)[0]


@pytest.mark.slow
def test_engine_routing_over_grpc_and_replay_reproduces_mu(served, moe_dir):
    info = served.info()
    assert "routing" in info.options
    # 2 sparse layers × top-2 × uint8, advertised so that clients size return_routing requests by it
    assert info.routing_bytes_per_token == 4 and served.request_limits().routing_bytes_per_token == 4
    completions = served.generate(PROMPTS, SPEC)
    seqs, tokens, mask, routing = _rows(PROMPTS, completions)
    for p, c in seqs:
        assert c.routing.dtype == np.uint8 and c.routing.shape == (len(p) + len(c.token_ids), 2, 2)
        assert c.routing.max() < 8
        assert all(len(set(row)) == 2 for row in c.routing.reshape(-1, 2))  # k distinct experts per token

    _, model = hf_io.load_hf(moe_dir, policy=precision.policy("fp32"))
    router_ids, logp = _trainer_forwards(model, tokens, mask, routing)
    # The engine's routing is the trainer's own choice in fp32 (same weights, same function).
    real = mask[:, :-1].astype(bool)
    own = np.sort(np.asarray(router_ids), -1)[real]
    assert np.mean(np.all(own == np.sort(routing[:, :-1], -1)[real], axis=(-2, -1))) > 0.99
    # R3: teacher-forced log-probs under the engine's routing equal μ.
    logp = np.asarray(logp)
    err = max(float(np.abs(logp[b, len(p) - 1: len(p) - 1 + len(c.token_ids)] - np.asarray(c.logprobs)).max())
              for b, (p, c) in enumerate(seqs))
    assert err <= 1e-5, err


@pytest.mark.slow
def test_without_return_routing_no_routing_is_sent(served):
    plain = served.generate(PROMPTS[:1], SamplingSpec(n=1, max_tokens=4, seed=1))
    assert plain[0][0].routing is None


@pytest.mark.slow
def test_engines_without_the_option_and_exact_mode_refuse(served):
    req = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=[1, 2])], max_tokens=4, return_routing=True)
    vllm = EngineInfo(architecture="Qwen3MoeForCausalLM", vocab_size=256, dtype="bfloat16", engine="vllm",
                      weight_version=0, max_model_len=128, options=())
    with pytest.raises(RequestError, match="return_routing: not supported by the vllm engine"):
        parse_generate(req, vllm, Limits())
    dense = EngineInfo(architecture="Qwen3ForCausalLM", vocab_size=256, dtype="float32", engine="jax",
                       weight_version=0, max_model_len=128, options=("exact", "logit_noise_std"))
    with pytest.raises(RequestError, match="return_routing: not supported by the jax engine"):
        parse_generate(req, dense, Limits())
    with pytest.raises(RolloutError, match="return_routing: not available in exact mode"):
        served.generate(PROMPTS[:1], SamplingSpec(n=1, max_tokens=4, exact=True, return_routing=True))
    # The same request shape as SPEC's (rows and lengths bucketed alike): the engine's program is reused.
    assert served.generate(PROMPTS, SPEC)[0][0].routing is not None


def test_routing_wire_format_round_trip_and_malformed():
    rng = np.random.default_rng(0)
    for dtype, experts in ((np.uint8, 128), (np.uint16, 1000)):
        r = rng.integers(0, experts, size=(9, 3, 4)).astype(dtype)
        pb = routing_to_proto(r, num_prompt_tokens=5)
        assert pb.itemsize == np.dtype(dtype).itemsize and len(pb.expert_ids) == r.nbytes
        np.testing.assert_array_equal(routing_from_proto(pb, 9), r)
    with pytest.raises(MalformedMessageError, match="malformed routing: 107 bytes for 9 tokens x 3 layers x top-4"):
        routing_from_proto(rollout_pb2.Routing(expert_ids=b"\0" * 107, num_layers=3, top_k=4, itemsize=1), 9)
    with pytest.raises(MalformedMessageError, match="malformed routing: itemsize 3"):
        routing_from_proto(rollout_pb2.Routing(expert_ids=b"", num_layers=3, top_k=4, itemsize=3), 0)
