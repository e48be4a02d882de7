"""The one mapping between the engine's types and rollout.proto (rollout/protocol.py): what the client encodes,
the server decodes to the same value, field by field, and back."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxrl_mismatch.rollout import protocol, rollout_pb2
from jaxrl_mismatch.rollout.engine import Completion, EngineInfo, SamplingSpec, TensorSpec

PROMPTS = [[5, 6, 7], [1]]


def test_every_sampling_field_crosses_the_wire():
    """Every field of SamplingSpec, set away from its default, comes back equal: a field added to the spec but
    not to the mapping fails here (the guard below makes the test name every field)."""
    spec = SamplingSpec(n=3, max_tokens=9, temperature=0.75, top_p=0.5, top_k=4, seed=2**40 + 3,
                        stop_token_ids=(2, 0), exact=True, logit_noise_std=0.25, return_routing=True,
                        quantize_strength=0.125, prompt_offset=17)
    default = SamplingSpec()
    assert [f.name for f in dataclasses.fields(SamplingSpec) if getattr(spec, f.name) == getattr(default, f.name)] == []
    req = protocol.request_to_proto(PROMPTS, spec)
    assert [list(p.token_ids) for p in req.prompts] == PROMPTS
    assert protocol.spec_from_proto(rollout_pb2.GenerateRequest.FromString(req.SerializeToString())) == spec


def test_unset_fields_take_the_specs_defaults():
    req = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=[1])], max_tokens=5)
    assert protocol.spec_from_proto(req) == SamplingSpec(max_tokens=5)
    # The default strength is not sent, so a server that does not quantize never sees the field.
    assert not protocol.request_to_proto(PROMPTS, SamplingSpec()).HasField("quantize_strength")
    assert protocol.request_to_proto(PROMPTS, SamplingSpec(quantize_strength=0.0)).HasField("quantize_strength")


def test_completions_round_trip():
    routing = np.arange(5 * 2 * 3, dtype=np.uint16).reshape(5, 2, 3) * 97
    comps = [[Completion(token_ids=[4, 5], logprobs=[-0.5, -0.25], finish_reason="stop", weight_version=3,
                         routing=routing, kept_counts=[2, 9])],
             [Completion(token_ids=[6], logprobs=[-1.0], finish_reason="length", weight_version=3)]]
    resp = protocol.completions_to_proto(comps, "srv", prompts=[[1, 2, 3], [1]])
    assert resp.server_id == "srv" and resp.prompts[0].samples[0].routing.num_prompt_tokens == 3
    back = protocol.completions_from_proto(rollout_pb2.GenerateResponse.FromString(resp.SerializeToString()))
    np.testing.assert_array_equal(back[0][0].routing, routing)
    assert back[0][0].routing.dtype == np.uint16
    assert dataclasses.replace(back[0][0], routing=None) == dataclasses.replace(comps[0][0], routing=None)
    assert back[1] == comps[1]


def test_engine_info_limits_and_weight_specs_round_trip():
    info = EngineInfo(architecture="Qwen3ForCausalLM", vocab_size=151936, dtype="bfloat16", engine="jax",
                      weight_version=7, max_model_len=4096, options=("exact", "routing"), quantize="int8",
                      routing_bytes_per_token=384)
    limits = protocol.Limits(max_request_prompt_tokens=123, max_request_completion_tokens=456)
    specs = {"model.norm.weight": TensorSpec((8,), "bfloat16"), "lm_head.weight": TensorSpec((16, 8), "bfloat16")}
    resp = protocol.info_to_proto(info, server_id="abc", limits=limits, shm_host_id="host", weight_specs=specs)
    resp = rollout_pb2.GetInfoResponse.FromString(resp.SerializeToString())
    assert protocol.info_from_proto(resp) == info
    # the client's limits carry the engine's routing size, which its request splitting budgets for
    assert protocol.limits_from_proto(resp) == dataclasses.replace(limits, routing_bytes_per_token=384)
    assert protocol.weight_specs_from_proto(resp) == specs
    assert (resp.server_id, resp.shm_host_id) == ("abc", "host")
    bare = protocol.info_to_proto(dataclasses.replace(info, quantize=""), server_id="", limits=limits, shm_host_id="")
    assert protocol.weight_specs_from_proto(bare) == {} and protocol.info_from_proto(bare).quantize == "none"


@pytest.mark.parametrize("finish", [99, rollout_pb2.FINISH_REASON_UNSPECIFIED])
def test_unknown_finish_reason_reads_unspecified(finish):
    pb = rollout_pb2.Completion(token_ids=[1], logprobs=[-1.0], finish_reason=finish)
    assert protocol.completion_from_proto(pb).finish_reason == "unspecified"


def test_weight_chunks_decode_to_the_pushed_tensors():
    """The weight layout has one owner: what `weight_chunks` writes, `TensorAssembler` (through
    `tensor_from_bytes`) reads back bit for bit — big-endian input, bfloat16, a non-contiguous view, an empty
    tensor, a 0-d one, and tensors split over several chunks in offset order."""
    from jaxrl_mismatch.rollout.validation import TensorAssembler

    rng = np.random.default_rng(0)
    base = rng.normal(size=(6, 5)).astype(np.float32)
    tensors = {
        "big_endian": base.astype(">f4"),
        "bf16": base.astype(protocol.wire_dtype("bfloat16")),
        "strided": base[:, ::2],
        "empty": np.zeros((0, 3), np.float32),
        "ids": np.arange(7, dtype=np.int32),
        "scalar": np.float32(2.5).reshape(()),  # shape () was sent as (1,), and the server refused it
    }
    chunks = list(protocol.weight_chunks(tensors, 3, chunk_bytes=16))
    assert [c.offset for c in chunks if c.name == "big_endian"] == list(range(0, 6 * 5 * 4, 16))
    assert [(c.offset, c.data) for c in chunks if c.name == "empty"] == [(0, b"")]
    assert chunks[0].data == base.reshape(-1)[:4].astype("<f4").tobytes()  # little-endian bytes on the wire
    specs = {n: TensorSpec(tuple(a.shape), protocol.little_endian(a).dtype.name) for n, a in tensors.items()}
    assembler = TensorAssembler(specs, current_version=1)
    for c in chunks:
        assembler.add(c)
    got, version = assembler.finish()
    assert version == 3
    for name, arr in tensors.items():
        assert got[name].dtype == protocol.wire_dtype(specs[name].dtype) and got[name].shape == arr.shape
        assert got[name].tobytes() == np.ascontiguousarray(protocol.little_endian(arr)).tobytes(), name
        assert protocol.tensor_nbytes(specs[name]) == arr.nbytes


@pytest.mark.parametrize("routing_bytes", [0, 12])
def test_response_bytes_bound_holds_for_the_largest_encodings(routing_bytes):
    """The bound the server refuses and the client splits by is an upper bound of the real encoding: token
    ids and kept counts as large as varints get, every finish reason and version field set, routing for the
    prompt and completion tokens of every sample (uint16 ids, 2 layers × top-3), and not loose by much."""
    spec = SamplingSpec(n=3, max_tokens=7, return_routing=routing_bytes > 0)
    prompts = [[1] * 40, [2] * 3]
    big = 2**31 - 1
    comps = [[Completion(token_ids=[big] * spec.max_tokens, logprobs=[-1e30] * spec.max_tokens,
                         finish_reason="length", weight_version=2**62, kept_counts=[big] * spec.max_tokens,
                         routing=(np.full((len(p) + spec.max_tokens, 2, 3), 65535, np.uint16)
                                  if routing_bytes else None))
              for _ in range(spec.n)] for p in prompts]
    size = len(protocol.completions_to_proto(comps, "s" * 64, prompts=prompts).SerializeToString())
    bound = protocol.response_bytes_bound([len(p) for p in prompts], spec, routing_bytes)
    assert size <= bound and bound - protocol.RESPONSE_OVERHEAD_BYTES < 2 * size, (size, bound)


def test_a_moe_batch_is_split_by_its_routing_bytes_and_the_server_refuses_it_whole():
    """A Qwen3-30B-A3B-sized routing (48 layers × top-8 × 1 byte) makes 64 prompts × 16 samples × ~1.5k tokens
    a ~600 MB response while the token limits allow it in one request: gRPC failed it (RESOURCE_EXHAUSTED) only
    after the whole batch was generated. The client splits it within the message limit; the server refuses it
    whole, before any generation, naming return_routing; without routing it is one request, and accepted."""
    from jaxrl_mismatch.rollout.session import request_chunks
    from jaxrl_mismatch.rollout.validation import RequestError, parse_generate

    rb = 48 * 8
    limits = protocol.Limits(routing_bytes_per_token=rb)
    prompts = [[3] * (150 + i) for i in range(64)]
    spec = SamplingSpec(n=16, max_tokens=1280, return_routing=True)
    chunks = request_chunks(prompts, spec, limits)
    assert [i for c in chunks for i in range(c.start, c.stop)] == list(range(64))  # contiguous, all, once
    sizes = [protocol.response_bytes_bound([len(p) for p in prompts[c]], spec, rb) for c in chunks]
    assert max(sizes) <= protocol.MAX_MESSAGE_BYTES and len(chunks) >= 9, (len(chunks), sizes)
    assert sum(sizes) > 8 * protocol.MAX_MESSAGE_BYTES  # it really was oversize (~590 MB)
    plain = dataclasses.replace(spec, return_routing=False)
    assert request_chunks(prompts, plain, limits) == [slice(0, 64)]

    info = EngineInfo(architecture="Qwen3MoeForCausalLM", vocab_size=151936, dtype="bfloat16", engine="jax",
                      weight_version=1, max_model_len=4096, options=("routing",), routing_bytes_per_token=rb)
    whole = protocol.request_to_proto(prompts, spec)
    with pytest.raises(RequestError, match=r"^return_routing: the response could reach \d+ bytes .*384 bytes of "
                                           r"routing.*over the 67108864-byte message limit; split the batch"):
        parse_generate(whole, info, protocol.Limits())
    parse_generate(protocol.request_to_proto(prompts, plain), info, protocol.Limits())
    for c in chunks:  # each piece the client sends is accepted
        parse_generate(protocol.request_to_proto(prompts[c], spec), info, protocol.Limits())


def test_weights_digest_is_of_the_tensors_names_dtypes_shapes_and_bytes():
    from jaxrl_mismatch.rollout.validation import RequestError, check_version_weights, weights_digest

    rng = np.random.default_rng(0)
    w = {"b": rng.normal(size=(2, 3)).astype(np.float32), "a": rng.normal(size=(4,)).astype(np.float16)}
    d = weights_digest(w)
    assert weights_digest(dict(reversed(list(w.items())))) == d  # not the order they came in
    assert weights_digest({"a": w["a"], "b": np.asfortranarray(w["b"])}) == d  # not their memory layout
    changed = {"a": w["a"], "b": w["b"].copy()}
    changed["b"][1, 2] = np.nextafter(changed["b"][1, 2], np.float32(1))  # one ulp
    for other in (changed, {"a": w["a"], "b": w["b"].reshape(3, 2)}, {"a": w["a"], "c": w["b"]},
                  {"a": w["a"].view(np.int16), "b": w["b"]}):
        assert weights_digest(other) != d
    assert check_version_weights(3, None, d) is False and check_version_weights(3, (2, 0), d) is False
    assert check_version_weights(3, (3, d), d) is True
    with pytest.raises(RequestError, match="version 3 is in service with other weights"):
        check_version_weights(3, (3, d ^ 1), d)
