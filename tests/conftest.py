"""Test-wide setup: 8 fake CPU devices for sharded tests, strict rank promotion (nanodo style).

XLA_FLAGS must be set before jax is imported anywhere, hence at the top of conftest.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
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
