"""Config checks where two rollout features meet: a fleet of external addresses, shared-memory weight sync to a
remote server, fixed staleness without staleness — each accepted or refused by name before any work."""

from __future__ import annotations

import pytest

from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.config_checks import validate


def _config(**rollout):
    c = base_config()
    c.model.path = "/some/model"
    for k, v in rollout.items():
        setattr(c.rollout, k, v)
    return c


def test_a_comma_separated_fleet_address_is_accepted():
    validate(_config(address="127.0.0.1:5000, 127.0.0.1:5001,10.0.0.5:7000"))


@pytest.mark.parametrize("rollout, field, words", [
    ({"address": "127.0.0.1:5000,10.0.0.5"}, "config.rollout.address", "needs host:port"),
    ({"address": "10.0.0.5:5000", "weight_transport": "shm"}, "config.rollout.weight_transport", "10.0.0.5:5000"),
    ({"address": "127.0.0.1:1,10.0.0.5:2", "weight_transport": "shm"}, "config.rollout.weight_transport", "10.0.0.5:2"),
    ({"fixed_staleness": True}, "config.rollout.fixed_staleness", "max_staleness >= 1"),
    ({"retry_s": -1.0}, "config.rollout.retry_s", "must be a number >= 0, got -1.0"),
    ({"retry_s": float("nan")}, "config.rollout.retry_s", "got nan"),
    # vLLM samples any temperature in (0, 0.01) at 0.01, while the trainer scores π at the configured one
    ({"engine": "vllm", "temperature": 0.005}, "config.rollout.temperature", "at 0.01 (vLLM's floor), not at 0.005"),
    ({"engine": "vllm", "temperature": 1e-5}, "config.rollout.temperature", "use >= 0.01"),
    ({"engine": "vllm", "temperature": 2.5}, "config.rollout.temperature", "at most temperature 2 (vLLM's bound)"),
])
def test_combinations_refused_by_name(rollout, field, words):
    with pytest.raises(ConfigError) as e:
        validate(_config(**rollout))
    assert str(e.value).startswith(field) and words in str(e.value) and "\n" not in str(e.value)


def test_shm_to_a_loopback_fleet_and_fixed_staleness_with_staleness_are_accepted():
    validate(_config(address="127.0.0.1:5000,localhost:5001", weight_transport="shm"))
    # every address the shared-memory client takes as this host's (`shm.is_local_target`) was refused as remote
    validate(_config(address="127.0.1.1:5000,0.0.0.0:5001,LocalHost:5002,[::1]:5003", weight_transport="shm"))
    validate(_config(max_staleness=2, fixed_staleness=True))


def test_vllm_temperatures_it_samples_as_asked_are_accepted():
    """0.01 and above, greedy evaluation (0) with vLLM; any temperature with the JAX engine."""
    validate(_config(engine="vllm", temperature=0.01))
    c = _config(engine="vllm")
    c.eval.temperature = 0.0
    validate(c)
    c.eval.temperature = 0.003
    with pytest.raises(ConfigError, match=r"^config\.eval\.temperature: the vllm engine samples"):
        validate(c)
    c.rollout.engine = "jax"
    c.rollout.temperature = 0.005
    validate(c)


def test_fp16_trainer_refuses_temperatures_that_overflow_its_logits():
    """fp16 logits / T: at T = 1e-4 logits (8, 1, −3) give NaN log-probs where the engine's float32 are finite."""
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_mismatch.models.scoring import logprobs_from_logits

    assert not np.isfinite(np.asarray(logprobs_from_logits(jnp.array([8.0, 1.0, -3.0], jnp.float16), 1e-4))).any()
    assert np.isfinite(np.asarray(logprobs_from_logits(jnp.array([8.0, 1.0, -3.0], jnp.float32), 1e-4))).all()
    c = _config(temperature=1e-3)
    c.trainer.precision = "fp16"
    with pytest.raises(ConfigError, match=r"^config\.rollout\.temperature: 0\.001 with the fp16 trainer .* T >= 0\.01"):
        validate(c)
    c.trainer.fp32_lm_head = True  # float32 logits: fine
    validate(c)
    c.trainer.fp32_lm_head, c.rollout.temperature = False, 0.01
    validate(c)


def _info(engine: str, options: tuple[str, ...], quantize: str = "none"):
    from jaxrl_mismatch.rollout import EngineInfo

    return EngineInfo(architecture="Qwen3ForCausalLM", vocab_size=97, dtype="float32", engine=engine,
                      weight_version=0, max_model_len=256, options=options, quantize=quantize)


def test_top_p_with_a_server_that_returns_no_kept_set_sizes_is_refused():
    """An attached `serve --engine vllm` passed the config check (rollout.engine keeps its default 'jax') and its
    log-probs, renormalised over the nucleus, were trained against π over the full vocabulary."""
    from jaxrl_mismatch.train.loop import check_servers

    jax_server, vllm_server = _info("jax", ("exact", "logit_noise_std", "kept_counts")), _info("vllm", ())
    for rollout, field in (({"top_p": 0.9}, "config.rollout.top_p"), ({"top_k": 20}, "config.rollout.top_k")):
        c = _config(address="127.0.0.1:5000", **rollout)
        validate(c)
        check_servers(c.rollout, [jax_server], "the server at 127.0.0.1:5000")
        with pytest.raises(ConfigError, match=f"{field}: needs a rollout engine that returns each token's kept-set "
                                              r"size .*127.0.0.1:5000 \(vllm engine\) does not"):
            check_servers(c.rollout, [jax_server, vllm_server], "the server at 127.0.0.1:5000")
    check_servers(_config(address="127.0.0.1:5000", engine="vllm").rollout, [vllm_server], "x")  # untruncated: fine
    with pytest.raises(ConfigError, match="config.rollout.quantize: 'none', but x serves 'int8' weights"):
        check_servers(_config().rollout, [_info("jax", (), quantize="int8")], "x")


def test_an_attached_server_of_another_precision_or_engine_is_refused():
    """`launch/single_node_gpu.sh` served bfloat16 (its default) whatever the config said: an FP16 run's record said
    float16 while μ came from bf16, and nothing compared them."""
    import dataclasses

    from jaxrl_mismatch.train.loop import check_servers

    bf16 = dataclasses.replace(_info("vllm", ()), dtype="bfloat16")
    check_servers(_config(address="127.0.0.1:5000", engine="vllm", dtype="bfloat16").rollout, [bf16], "x")
    with pytest.raises(ConfigError, match=r"^config\.rollout\.dtype: 'float16', but the server at y serves in "
                                          r"'bfloat16' \(set --config\.rollout\.dtype=bfloat16, or serve --dtype "
                                          r"float16\)$"):
        check_servers(_config(address="y", engine="vllm", dtype="float16").rollout, [bf16], "the server at y")
    with pytest.raises(ConfigError, match=r"^config\.rollout\.engine: 'jax', but x is a 'vllm' server"):
        check_servers(_config(address="y", dtype="bfloat16").rollout, [bf16], "x")


def test_an_attached_servers_context_is_checked_against_the_config_and_the_longest_prompt():
    """`check_context` read the config's max_model_len or the model's: an attached server serving 256 tokens took
    a 4-token prompt + 254 max_tokens through the config check and refused the first rollout, after the load."""
    from jaxrl_mismatch.train.loop import check_servers

    server = _info("jax", ())  # serves max_model_len 256
    check_servers(_config(address="y", max_tokens=252).rollout, [server], "x", longest_prompt=4)  # 256: fits
    with pytest.raises(ConfigError, match=r"^config\.rollout\.max_tokens: the task's longest prompt \(4 tokens\) \+ "
                                          r"max_tokens \(253\) exceeds the max_model_len 256 x serves"):
        check_servers(_config(address="y", max_tokens=253).rollout, [server], "x", longest_prompt=4)
    with pytest.raises(ConfigError, match=r"^config\.rollout\.max_model_len: 128, but x serves 256 \(serve "
                                          r"--max-model-len 128\)$"):
        check_servers(_config(address="y", max_model_len=128).rollout, [server], "x")
    check_servers(_config(address="y", max_model_len=256).rollout, [server], "x")


def test_the_jax_engine_says_it_returns_kept_set_sizes_and_a_batch_without_them_is_refused(tmp_path):
    import numpy as np

    from jaxrl_mismatch.rollout import Completion
    from jaxrl_mismatch.rollout.jax_engine import JaxEngine
    from jaxrl_mismatch.train.collect import Group, to_batch
    from tests.rollout.conftest import make_tiny_qwen3

    assert "kept_counts" in JaxEngine(str(make_tiny_qwen3(tmp_path / "m", tied=True))).info().options
    group = Group(prompt_ids=[1, 2], answer="4", rewards=np.ones(1, np.float32), completions=[
        Completion(token_ids=[3, 4], logprobs=[-1.0, -2.0], finish_reason="length", weight_version=0)])
    adv = lambda r, g, n: np.zeros_like(r)  # noqa: E731
    assert to_batch([group], adv, pad_id=0).kept_count is None  # inferred: an untruncated request
    with pytest.raises(ValueError, match="kept_counts: some completions of a truncated"):
        to_batch([group], adv, pad_id=0, truncated=True)
