"""The suite's shared compilation cache (tests/conftest.py) keeps the "never recompiles" tests honest.

conftest turns JAX's persistent compilation cache on in the pytest processes, so a program compiled by an earlier
test is loaded instead of compiled. `count_compilations` must still count such a load: a jit whose in-memory cache
missed is a recompile in a run without the cache. If a jax upgrade stops timing cache hits as backend compiles,
this fails and the cache must come off in the files that count compilations.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_mismatch.train.compiles import count_compilations


def _fresh_jit():
    def cache_probe(x):  # a new function object each call: jit's in-memory cache cannot hit
        return jnp.cumsum(jnp.sin(x) * 3.0 + 0.5)

    return jax.jit(cache_probe)


def test_a_persistent_cache_hit_still_counts_as_a_compile():
    assert jax.config.jax_compilation_cache_dir  # conftest turned the cache on for this process
    hits = []

    def listener(event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.monitoring.register_event_listener(listener)
    try:
        x = jnp.arange(7.0)
        with count_compilations("cache_probe") as first:
            want = _fresh_jit()(x)
        with count_compilations("cache_probe") as second:
            got = _fresh_jit()(x)
    finally:
        jax.monitoring.unregister_event_listener(listener)
    assert len(hits) >= 1  # the second jit was loaded from the cache, not compiled
    assert first["compiles"] == 1 and second["compiles"] == 1
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
