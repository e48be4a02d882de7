"""Test-wide setup: 8 fake CPU devices for sharded tests, strict rank promotion (nanodo style).

XLA_FLAGS must be set before jax is imported anywhere, hence at the top of conftest.
"""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# -- one XLA compilation cache for the session: the pytest workers and the processes the tests start ------------
# Many tests build the same tiny model, Trainer, Learner or engine again (a fresh jit per test, or per resume), and
# many start the same tiny rollout server, CLI command or training process again; each compiled the same programs
# again. All of them share JAX's persistent compilation cache (keyed by the program, the XLA flags, the backend and
# jax's version) and load what an earlier one compiled. Every program is cached, however fast it compiled (JAX's
# default keeps only those over 1 s, most of the tests' tiny programs are not). A cache hit still goes through the
# backend-compile step that `train/compiles.count_compilations` counts (jax 0.10: `pxla._cached_compilation` times
# `compile_or_get_cached`, hits included; tests/test_conftest_cache.py checks it), so the "never recompiles" tests
# still see every compile. The folder is new and empty for each session, so a fresh clone still pays every first
# compilation; it is made before the xdist workers start, so they pass the same one on through the environment,
# and it is deleted at the end. A JAX_COMPILATION_CACHE_DIR set by the caller is used as it is, and kept.
_SESSION_XLA_CACHE = None
_XLA_CACHE = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
if not _XLA_CACHE:
    _XLA_CACHE = _SESSION_XLA_CACHE = tempfile.mkdtemp(prefix="jaxrl-tests-xla-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE  # for this process and every process the tests start
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# -- one vLLM / torch Inductor cache for the session, likewise ------------------------------------------------------
# Every vLLM engine the tests start (in a worker, a server process, a trainer, a scoring script) inspects its model
# class in a subprocess and builds torch Inductor's CPU kernels, and caches both (vLLM's `modelinfos`, keyed by the
# model module's hash; Inductor's code cache, keyed by the kernel). With a cache per test, or the user's
# ~/.cache/vllm and /tmp/torchinductor_<user>, every start paid both again or wrote outside the test's folders:
# measured, one tiny model scored in a new process took 41 user-s cold and 16 with both caches warm (about 12 s
# each). One folder per session holds both, shared like the XLA cache above, deleted at the end; a
# VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR set by the caller is used as it is, and kept. (Inductor's precompiled
# headers stay in $TMPDIR/torchinductor_<user> whatever these say: torch keeps them global by design.)
_SESSION_VLLM_CACHE = None
if not (os.environ.get("VLLM_CACHE_ROOT") and os.environ.get("TORCHINDUCTOR_CACHE_DIR")):
    _SESSION_VLLM_CACHE = tempfile.mkdtemp(prefix="jaxrl-tests-vllm-cache-")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(_SESSION_VLLM_CACHE, "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_SESSION_VLLM_CACHE, "inductor"))

# -- XLA's optimization level: most tests compile with jax_disable_most_optimizations ----------------------------
# Compilation is half the suite's CPU time on 2 cores, and most tests compile many small programs that run once or
# twice. JAX's `jax_disable_most_optimizations` (LLVM backend optimization level 0, no expensive LLVM passes; the
# HLO passes are the same) compiles them about 35 % faster: the whole suite at that level took 1,312 CPU-s against
# 1,635 (paired runs); as set here, 1,356 against 1,711 (paired fresh clones, docs/testing.md). The programs' floats can change in the last bits (the demo's fp32 KL differs at 1e-9) and the speculative
# sampler's fp16 bitwise test fails at that level, so a test whose claim is the bits users get (exact mode: engine
# and trainer agree bit for bit) is marked `xla_full_opt` and runs with XLA's default optimization, as do tests
# whose run time outweighs their compile time, and the session's warm starts (the same policy whoever builds it).
# The mode is switched per test (the processes a test starts inherit it through the environment) and the in-memory
# jit caches are cleared at a switch, since they do not key on this flag; the persistent cache does. Running the
# suite with JAX_DISABLE_MOST_OPTIMIZATIONS=0 compiles every test with the default optimization.
_LOW_OPT_SUITE = os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1").lower() in ("1", "true", "yes", "on")

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)  # in case a plugin imported jax before this file
jax.config.update("jax_disable_most_optimizations", _LOW_OPT_SUITE)
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))

# -- ... and, at that level, XLA:CPU's older loop emitters instead of its fusion emitters --------------------------
# Of a tiny update program's compile, CPU code generation is most (XLA's own timing: 3.6 of 4.1 s); the older
# emitters (`xla_cpu_use_fusion_emitters=false`) generate it in about 40 % less time (the update of
# tests/train/tiny_policy.py on one device: 2.1-2.6 s against 3.5-3.7 s, quiet machine, 2026-11-28). XLA flags
# hold for a whole process, and the `xla_full_opt` tests must compile what users compile, so the option is given
# per compilation, through the compile options' `env_option_overrides` (what `jax.jit(compiler_options=...)`
# fills), and only while `jax_disable_most_optimizations` is on: the full-optimization programs are untouched.
# It is part of the programs' persistent-cache key like every compile option. Only the pytest workers compile
# so: the processes the tests start keep the fusion emitters (XLA_FLAGS is read once per process, and a worker's
# own full-optimization programs must not see it). JAXRL_TEST_FUSION_EMITTERS=1 keeps the fusion emitters.
_LEGACY_EMITTERS = _LOW_OPT_SUITE and os.environ.get("JAXRL_TEST_FUSION_EMITTERS", "0") != "1"


def _with_legacy_emitters(get_compile_options):
    def wrapped(*args, **kwargs):
        options = get_compile_options(*args, **kwargs)
        if jax.config.values["jax_disable_most_optimizations"]:
            options.env_option_overrides = [*options.env_option_overrides, ("xla_cpu_use_fusion_emitters", False)]
        return options

    return wrapped


if _LEGACY_EMITTERS:
    from jax._src import compiler as _jax_compiler  # the one place jax builds compile options (jax 0.10.2)

    _jax_compiler.get_compile_options = _with_legacy_emitters(_jax_compiler.get_compile_options)


import contextlib  # noqa: E402

import pytest  # noqa: E402


def _set_low_opt(low: bool) -> None:
    if jax.config.values["jax_disable_most_optimizations"] == low:
        return
    jax.config.update("jax_disable_most_optimizations", low)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1" if low else "0"  # for the processes the tests start
    jax.clear_caches()  # in-memory executables compiled at the other level must not be reused


@contextlib.contextmanager
def _full_opt():
    before = jax.config.values["jax_disable_most_optimizations"]
    _set_low_opt(False)
    try:
        yield
    finally:
        _set_low_opt(before)


@pytest.fixture(scope="session")
def low_opt_suite() -> bool:
    """Whether this run compiles unmarked tests with jax_disable_most_optimizations (the default: yes)."""
    return _LOW_OPT_SUITE


# -- ... and the processes a low-level test starts take the older emitters through XLA_FLAGS -----------------------
# A server, trainer or CLI run compiles its own programs (most of the CPU the suite spends outside the workers);
# one 3-step tiny train run took 17.0-17.5 user-s with the older emitters against 23.5-23.8 with the fusion ones.
# XLA reads XLA_FLAGS once per process, when its backend starts, so the flag is put into this process's
# environment only after its own backend has started (its full-optimization programs never see it), and taken
# out again for an `xla_full_opt` test, whose processes compile what users compile. The processes the tests
# start drop only the fake device count from XLA_FLAGS (tests/child_env.py; the trainer's launcher likewise).
_CHILD_LEGACY_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _child_emitters(low: bool) -> None:
    if not _LEGACY_EMITTERS:
        return
    jax.devices()  # this process's backend, and so its reading of XLA_FLAGS, comes first
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f != _CHILD_LEGACY_FLAG]
    os.environ["XLA_FLAGS"] = " ".join([*flags, _CHILD_LEGACY_FLAG] if low else flags)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures are set up, so the fixtures a test builds get its level. A module fixture keeps
    the level of the test that built it: the files that mark only some tests hold no compiled state in one."""
    low = _LOW_OPT_SUITE and item.get_closest_marker("xla_full_opt") is None
    _set_low_opt(low)
    _child_emitters(low)


jax.config.update("jax_numpy_rank_promotion", "raise")


# -- tiny warm starts for the whole session ----------------------------------------------------------------------
# Several test files need a small policy that already answers the arithmetic task (rollouts that end with EOS,
# a reward that moves). Training one takes tens of seconds, so each is built once per test session and shared by
# every xdist worker: the first worker to take the lock builds it under the session's common temp folder,
# the others wait for the lock and reuse it. Both are read-only for the tests that use them.
TINY_BASE_ARGS = ("--steps", "40", "--num-eval", "0", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
                  "--intermediate", "64", "--layers", "1", "--num-train", "500")
# Hidden 64 with 2 heads: head_dim 32, the least vLLM's CPU attention takes. 200 steps: long enough that some of a
# step's 64 samples are right (1-2 % at T=1), so a run's updates are not all zero (tests/jobs/test_faults.py needs
# it for "bit for bit" to cover the optimizer state; the vLLM loop test only needs the head_dim).
TINY_BASE_H64_ARGS = ("--steps", "200", "--num-eval", "0", "--hidden", "64", "--heads", "2", "--kv-heads", "1",
                      "--intermediate", "128", "--layers", "1", "--num-train", "2000")


def _session_root(tmp_path_factory) -> "os.PathLike":
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's basetemp is <session temp>/popen-gwN: share their parent.
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _shared_warmstart(tmp_path_factory, name: str, args: tuple[str, ...]):
    import fcntl

    from jaxrl_mismatch.jobs import warmstart

    root = _session_root(tmp_path_factory)
    out = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            with _full_opt():  # the same policy whichever test (at whichever level) asks first
                assert warmstart.main(["--out", str(out), *args]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_base_model(tmp_path_factory):
    """A warm-started 1-layer, hidden-32 policy (HF checkpoint folder); read-only for the tests that use it."""
    return _shared_warmstart(tmp_path_factory, "tiny_base_model", TINY_BASE_ARGS)


@pytest.fixture(scope="session")
def tiny_base_model_h64(tmp_path_factory):
    """A warm-started 1-layer, hidden-64 policy with head_dim 32 (vLLM serves it), 200 steps; read-only."""
    return _shared_warmstart(tmp_path_factory, "tiny_base_model_h64", TINY_BASE_H64_ARGS)


def pytest_unconfigure(config):
    """Delete the session's compilation caches, in the process that made it (the xdist controller, or -n 0)."""
    for made in (_SESSION_XLA_CACHE, _SESSION_VLLM_CACHE):
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


# -- heavy files first under xdist --------------------------------------------------------------------------------
# `--dist loadfile` hands whole files to the workers in a queue that xdist orders by each file's number of tests,
# so the files with one or two long end-to-end tests (two-process training, a resume, a warm start) came last
# and one worker ran them alone while the other sat idle. The queue is ordered here instead: files with tests
# marked `slow` or `vllm` first, most such tests first, then the rest by their number of tests (xdist's own
# order); within a file the order is kept. The light files at the end fill in whichever worker frees up first.
def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist present: keep the order set below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    heavy, count, first = {}, {}, {}
    for i, item in enumerate(items):
        path = item.nodeid.split("::")[0]
        first.setdefault(path, i)
        count[path] = count.get(path, 0) + 1
        marked = item.get_closest_marker("slow") is not None or item.get_closest_marker("vllm") is not None
        heavy[path] = heavy.get(path, 0) + int(marked)

    def key(item):
        path = item.nodeid.split("::")[0]
        return -heavy[path], -count[path], first[path]

    items.sort(key=key)  # stable: a file's tests keep their order
