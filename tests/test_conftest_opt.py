"""The suite's two XLA optimization levels (tests/conftest.py).

Unmarked tests, and the processes they start, compile with `jax_disable_most_optimizations` and XLA:CPU's older
emitters; tests marked `xla_full_opt` (exact mode's bit-for-bit claims) compile with XLA's default optimization,
as users do. jit's in-memory cache does not key on that flag, so a marked test after an unmarked one must compile
its programs again rather than reuse the unoptimized ones.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxrl_mismatch.train.compiles import count_compilations
from tests.child_env import child_env

_RAN_UNMARKED: list[bool] = []


@jax.jit
def level_probe(x):
    return jnp.tanh(x) * 2.0 + 1.0


def _child_flag() -> bool:
    code = "import jax; print(int(jax.config.values['jax_disable_most_optimizations']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)  # our environment
    return bool(int(out.stdout))


def _child_legacy_emitters() -> bool:
    """Whether a process this test starts (with tests/child_env.py's environment) gets the older emitters."""
    code = "import os; print(int('--xla_cpu_use_fusion_emitters=false' in os.environ.get('XLA_FLAGS', '').split()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=child_env())
    return bool(int(out.stdout))


def _legacy_suite(low_opt_suite: bool) -> bool:
    return low_opt_suite and os.environ.get("JAXRL_TEST_FUSION_EMITTERS", "0") != "1"


def test_unmarked_tests_and_their_processes_compile_with_most_optimizations_off(low_opt_suite):
    assert jax.config.values["jax_disable_most_optimizations"] is low_opt_suite
    assert _child_flag() is low_opt_suite
    assert _child_legacy_emitters() is _legacy_suite(low_opt_suite)
    level_probe(jnp.arange(5.0)).block_until_ready()
    _RAN_UNMARKED.append(True)


@pytest.mark.xla_full_opt
def test_marked_tests_compile_at_full_optimization_without_reusing_the_other_level(low_opt_suite):
    assert jax.config.values["jax_disable_most_optimizations"] is False
    assert _child_flag() is False and not _child_legacy_emitters()
    with count_compilations("level_probe") as c:
        level_probe(jnp.arange(5.0)).block_until_ready()
    # Compiled here unless the unmarked test above compiled it at this same level (a run with the flag off).
    assert c["compiles"] == (0 if _RAN_UNMARKED and not low_opt_suite else 1)


def _legacy_emitters_in(options) -> bool:
    return ("xla_cpu_use_fusion_emitters", False) in [tuple(o) for o in options.env_option_overrides]


def test_unmarked_tests_compile_with_the_older_cpu_emitters(low_opt_suite):
    """The low level also takes XLA:CPU's older emitters (tests/conftest.py): the compile options jax builds carry
    the option, and it changes the persistent cache's key, unless JAXRL_TEST_FUSION_EMITTERS=1."""
    import numpy as np
    from jax._src import cache_key, compiler

    legacy = _legacy_suite(low_opt_suite)
    options = compiler.get_compile_options(1, 1)
    assert _legacy_emitters_in(options) is legacy
    plain = compiler.get_compile_options(1, 1)
    plain.env_option_overrides = [o for o in plain.env_option_overrides if o[0] != "xla_cpu_use_fusion_emitters"]
    module = jax.jit(level_probe.__wrapped__).lower(jnp.arange(5.0)).compiler_ir()
    backend = jax.devices()[0].client
    keys = {cache_key.get(module, np.array(jax.devices()[:1]), o, backend) for o in (options, plain)}
    assert len(keys) == (2 if legacy else 1)  # part of the persistent cache's key: no mixing of the two


@pytest.mark.xla_full_opt
def test_marked_tests_keep_the_fusion_emitters():
    from jax._src import compiler

    assert not _legacy_emitters_in(compiler.get_compile_options(1, 1))
