"""`jaxrl-mismatch analyze bf16-softmax` (jobs/analyze_softmax.py): the BF16 softmax simulation against the
objective-level hacking paper's Table 2, and one-line errors for bad flags."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_mismatch.jobs import analyze, analyze_softmax
from jaxrl_mismatch.outputs import marker_name
from jaxrl_mismatch.usage import UsageError

pytestmark = pytest.mark.xla_full_opt  # the Table 2 simulation runs 5x slower unoptimized (tests/conftest.py)


def _sim(seed, *, vocab=64, tokens=500, dtype="bfloat16", scale=1.5, shared=False):
    p_ref, p_low, kl = analyze_softmax.simulate_softmax(jnp.asarray(seed, jnp.uint32), jnp.float32(scale), vocab=vocab,
                                                tokens=tokens, dtype=dtype, shared_logits=shared)
    return np.asarray(p_ref), np.asarray(p_low), np.asarray(kl)


# -- Q_bf16 / Q_fp16 (eq. 45) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, np_dtype", [("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)])
def test_quantize_equals_the_dtype_cast(dtype, np_dtype):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=20000) * 3.0,                       # logits
                        np.exp(rng.uniform(-30.0, 0.0, 20000)),             # probabilities, fp16 subnormals included
                        [2.0**-14, 2.0**-24, 1.5 * 2.0**-24, 2.5 * 2.0**-24, 1e-9, 0.0]]).astype(np.float32)
    want = x.astype(np_dtype).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: analyze_softmax.quantize(v, dtype))(x))
    np.testing.assert_array_equal(got, want)


def test_low_precision_softmax_survives_jit_fusion():
    """The rounding of eq. 45 is still there inside one fused program (an astype round trip was not)."""
    z = 1.5 * np.random.default_rng(1).normal(size=(4, 2048)).astype(np.float32)
    p_low, p_ref = jax.jit(lambda v: (analyze_softmax.low_precision_softmax(v, "bfloat16"), jax.nn.softmax(v, axis=-1)))(z)
    p_low, p_ref = np.asarray(p_low), np.asarray(p_ref)
    np.testing.assert_array_equal(p_low, p_low.astype(ml_dtypes.bfloat16).astype(np.float32))  # bf16 values
    # Q(z) moves the logits by up to 2^-9 relative: a probability ratio spread far above output rounding alone.
    rel = np.abs(p_ref / p_low - 1.0)
    assert rel.max() > 2.0**-8
    np.testing.assert_allclose(p_low, p_ref, rtol=0.03)


# -- the simulation -------------------------------------------------------------------------------------------


def test_simulation_is_deterministic_per_seed_and_independent_of_token_count():
    a, b = _sim(3), _sim(3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    c = _sim(4)
    assert not np.array_equal(a[0], c[0])
    # token t depends on (seed, t) only: 1500 tokens (two lax.map chunks) start with the 500 above
    long = _sim(3, tokens=1500)
    np.testing.assert_array_equal(long[0][:500], a[0])
    np.testing.assert_array_equal(long[1][:500], a[1])
    assert analyze_softmax.ratio_stats(*a[:2]) == analyze_softmax.ratio_stats(*b[:2])


def test_fp32_ratio_is_exactly_one_and_fp16_spreads_less_than_bf16():
    p_ref, p_low, kl = _sim(0, vocab=256, tokens=4000, dtype="float32")
    np.testing.assert_array_equal(p_ref, p_low)
    assert np.all((kl >= 0) & (kl < 1e-6))  # float32 rounding only, never below 0 (rows read −4e-8 before)
    bf16 = analyze_softmax.ratio_stats(*_sim(0, vocab=256, tokens=4000, dtype="bfloat16")[:2])
    fp16 = analyze_softmax.ratio_stats(*_sim(0, vocab=256, tokens=4000, dtype="float16")[:2])
    # 3 more mantissa bits: 8x finer rounding; the ratio's spread shrinks by about that much
    assert 5.0 < bf16["std"] / fp16["std"] < 12.0
    assert fp16["max"] - 1 < (bf16["max"] - 1) / 4
    # sampling from p̃: E[p/p̃] = Σ p over p̃'s support / Σ p̃ ≈ 1 — no bias beyond sampling noise
    for stats in (bf16, fp16):
        assert abs(stats["mean"] - 1.0) < 5 * stats["std"] / np.sqrt(4000)


def test_shared_logits_draw_every_token_from_one_row():
    p_ref, p_low, kl = _sim(0, vocab=32, tokens=2000, shared=True)
    assert kl.shape == (1,)
    assert len(np.unique(p_ref)) <= 32 and len(np.unique(p_ref)) > 10


def test_paper_setting_matches_table2_within_the_seed_spread():
    """OLH App. C.1 at the paper's setting (V = 2048, z ~ N(0, 1.5²), 5·10⁴ tokens, 5 seeds)."""
    result = analyze_softmax.run_softmax_simulation(vocab=2048, scale=1.5, tokens=50_000, seeds=[0, 1, 2, 3, 4])
    cmp_ = result["comparison"]
    assert cmp_ is not None and set(cmp_) == {"mean", "std", "max", "min"}
    assert all(v["within"] for v in cmp_.values()), cmp_
    rows = result["seeds"]
    assert all(abs(r["std"] - 0.0048) < 0.00015 for r in rows)
    assert all(1.0175 < r["max"] < 1.0205 and 0.9795 < r["min"] < 0.9825 for r in rows)
    # one logit row per seed (the other reading of App. C.1) does not reproduce the max/min
    shared = analyze_softmax.run_softmax_simulation(vocab=2048, scale=1.5, tokens=50_000, seeds=[0], shared_logits=True)
    assert shared["comparison"] is None
    assert shared["seeds"][0]["max"] < 1.017


def test_bf16_softmax_command_writes_json_markdown_and_figure(tmp_path, capsys, monkeypatch):
    out = tmp_path / "sim"
    args = ["bf16-softmax", "--vocab", "128", "--tokens", "800", "--seeds", "0,1", "--out", str(out)]
    assert analyze.main(args) == 0
    data = json.loads((out / "bf16_softmax.json").read_text())
    assert [r["seed"] for r in data["seeds"]] == [0, 1]
    assert data["comparison"] is None  # not the paper's setting
    assert data["paper_table2"]["rows"][0][:2] == [1234, 1.0]
    md = (out / "bf16_softmax.md").read_text()
    assert "| ours | 0 |" in md and "| paper |" not in md
    assert (out / "bf16_softmax.png").stat().st_size > 10_000
    assert "not the paper's setting" in capsys.readouterr().out
    # the folder is the command's own (outputs.staged_dir): marked, no temporary sibling left
    assert (out / marker_name(analyze_softmax.KIND)).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["sim"]
    with pytest.raises(UsageError, match="--force"):  # an earlier output: kept unless --force
        analyze.main(args)
    first = (out / "bf16_softmax.json").read_bytes()
    # interrupted while writing the replacement: the earlier output stays whole, the temporary is removed
    from jaxrl_mismatch.report import analysis

    def interrupt(*_a, **_k):
        raise KeyboardInterrupt

    again = [*args[:6], "2", *args[7:], "--force"]  # seed 2 in place of 0,1 (an option is given once)
    with monkeypatch.context() as m:
        m.setattr(analysis, "plot_softmax_simulation", interrupt)
        with pytest.raises(KeyboardInterrupt):
            analyze.main(again)
    assert (out / "bf16_softmax.json").read_bytes() == first and [p.name for p in tmp_path.iterdir()] == ["sim"]
    assert analyze.main(again) == 0
    assert [r["seed"] for r in json.loads((out / "bf16_softmax.json").read_text())["seeds"]] == [2]
    assert [p.name for p in tmp_path.iterdir()] == ["sim"]


# -- bad input: one line naming the flag -------------------------------------------------------------------------------


@pytest.mark.parametrize("args, flag", [
    (["--seeds", "a,b"], "--seeds"),
    (["--seeds", "-1"], "--seeds"),
    (["--vocab", "1"], "--vocab"),
    (["--tokens", "0"], "--tokens"),
    (["--scale", "-1"], "--scale"),
    (["--dtype", "int8"], "--dtype"),
    (["--logits", "some"], "--logits"),
])
def test_bf16_softmax_bad_flags(tmp_path, args, flag):
    with pytest.raises(UsageError) as e:
        analyze.main(["bf16-softmax", "--out", str(tmp_path / "o"), *args])
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_bf16_softmax_refuses_an_out_folder_it_did_not_write(tmp_path):
    """Checked before the simulation (the defaults: 2.5·10⁵ tokens): one line naming --out, nothing changed."""
    out = tmp_path / "sim"
    out.mkdir()
    (out / "bf16_softmax.png").write_text("my notes")
    for force in ([], ["--force"]):  # --force replaces only an earlier bf16-softmax output
        with pytest.raises(UsageError) as e:
            analyze.main(["bf16-softmax", "--out", str(out), *force])
        message = str(e.value)
        assert message.startswith(f"--out {out}: is a non-empty directory not written by "
                                  "`jaxrl-mismatch analyze bf16-softmax`") and "\n" not in message
    assert (out / "bf16_softmax.png").read_text() == "my notes" and [p.name for p in tmp_path.iterdir()] == ["sim"]
    assert [p.name for p in out.iterdir()] == ["bf16_softmax.png"]
    (tmp_path / "file").write_text("mine")  # --out names a file: refused in one line, not a FileExistsError
    with pytest.raises(UsageError, match=f"--out {tmp_path / 'file'}: is a file"):
        analyze.main(["bf16-softmax", "--out", str(tmp_path / "file")])


def test_kl_is_finite_where_the_float32_softmax_underflows():
    """At a large logit scale p = softmax(z) underflows to 0 in float32 where p̃ > 0: log p was −inf and the KL
    of such a row inf (1 of 200 rows at --scale 1000, a review). log_softmax keeps it finite and right."""
    z = jnp.asarray(np.random.default_rng(2).normal(0, 1000.0, (200, 64)).astype(np.float32))
    p_low = analyze_softmax.low_precision_softmax(z, "bfloat16")
    kl = np.asarray(analyze_softmax._kl_low_vs_ref(p_low, z))
    assert np.all(np.isfinite(kl))
    q = np.asarray(p_low, np.float64)
    q = q / q.sum(-1, keepdims=True)
    z64 = np.asarray(z, np.float64)
    log_p = z64 - z64.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    want = np.sum(np.where(q > 0, q * (np.log(np.where(q > 0, q, 1.0)) - log_p), 0.0), axis=-1)
    np.testing.assert_allclose(kl, want, rtol=1e-3, atol=1e-5)
