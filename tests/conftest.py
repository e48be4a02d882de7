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

# -- one XLA compilation cache for the processes the tests start --------------------------------------------------
# Many tests start the same tiny rollout server, CLI command or training process again (a resume, a second
# process, a fault injected), and each new process compiled the same programs again. Those processes share
# JAX's persistent compilation cache (keyed by the program, the XLA flags, the backend and jax's version) and
# load what an earlier one compiled. The pytest processes themselves do not use it: a cache hit skips the
# backend compile that `train/compiles.count_compilations` counts, and the "never recompiles" tests must see
# every compile. The folder is new and empty for each session, so a fresh clone still pays every first
# compilation; it is made before the xdist workers start, so they pass the same one on through the environment,
# and it is deleted at the end. A JAX_COMPILATION_CACHE_DIR set by the caller is passed on as it is, and kept.
_SESSION_XLA_CACHE = None
_XLA_CACHE = os.environ.pop("JAX_COMPILATION_CACHE_DIR", "")  # out of the environment while jax reads it

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", None)  # in case a plugin imported jax before this file
if not _XLA_CACHE:
    _XLA_CACHE = _SESSION_XLA_CACHE = tempfile.mkdtemp(prefix="jaxrl-tests-xla-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE  # for every process the tests start

import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


# -- one tiny warm start for the whole session -----------------------------------------------------------------
# Several test files need a small policy that already answers the arithmetic task (rollouts that end with EOS,
# a reward that moves). Training it takes tens of seconds, so it is built once per test session and shared by
# every xdist worker: the first worker to take the lock builds it under the session's common temp folder,
# the others wait for the lock and reuse it.
TINY_BASE_ARGS = ("--steps", "40", "--num-eval", "0", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
                  "--intermediate", "64", "--layers", "1", "--num-train", "500")


def _session_root(tmp_path_factory) -> "os.PathLike":
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's basetemp is <session temp>/popen-gwN: share their parent.
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tiny_base_model(tmp_path_factory):
    """A warm-started 1-layer, hidden-32 policy (HF checkpoint folder); read-only for the tests that use it."""
    import fcntl

    from jaxrl_mismatch.jobs import warmstart

    root = _session_root(tmp_path_factory)
    out = root / "tiny_base_model"
    with open(root / "tiny_base_model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            assert warmstart.main(["--out", str(out), *TINY_BASE_ARGS]) == 0
    return out


def pytest_unconfigure(config):
    """Delete the session's compilation cache, in the process that made it (the xdist controller, or -n 0)."""
    if _SESSION_XLA_CACHE is not None:
        shutil.rmtree(_SESSION_XLA_CACHE, ignore_errors=True)


@pytest.fixture(scope="module")
def xla_cache():
    """The session's compilation cache in this pytest process too, for one file: for files that build the same
    Trainer, Learner or engine more than once and count no compilations (a cache hit skips the backend compile
    that `count_compilations` counts). Off again when the file is done. Use with
    `pytestmark = pytest.mark.usefixtures("xla_cache")`."""
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
    compilation_cache.reset_cache()  # the next compilation opens the cache at that folder
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()


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
