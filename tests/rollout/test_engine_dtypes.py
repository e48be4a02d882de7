"""The engine's dtype names (written out in the JAX-free `rollout.engine`) are the precision module's."""

from jaxrl_mismatch import precision
from jaxrl_mismatch.rollout.engine import ENGINE_DTYPES
from jaxrl_mismatch.train.config_checks import _CHOICES


def test_engine_dtypes_are_the_precision_modules_and_the_configs_choices():
    assert ENGINE_DTYPES == precision.DTYPES
    assert _CHOICES["rollout.dtype"] == precision.DTYPES
