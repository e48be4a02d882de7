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

jax.config.update("jax_numpy_rank_promotion", "raise")
