"""Masked reductions shared by the metric modules (inside jit)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_mismatch.objectives._types import Scalar


def f32(x) -> Scalar:
    return jnp.asarray(x, jnp.float32)


class Masked:
    """Reductions over the selected entries of an array (tokens or sequences); empty → ``empty`` value."""

    def __init__(self, sel):
        self.sel = sel
        self.n = jnp.sum(sel).astype(jnp.float32)
        self.nonempty = self.n > 0

    def sum(self, x):
        return jnp.sum(jnp.where(self.sel, x, 0.0))

    def mean(self, x, empty=0.0):
        return jnp.where(self.nonempty, self.sum(x) / jnp.maximum(self.n, 1.0), empty)

    def std(self, x):
        mu = self.mean(x)
        return jnp.sqrt(jnp.maximum(self.mean(jnp.square(x - mu)), 0.0))

    def max(self, x, empty=0.0):
        return jnp.where(self.nonempty, self.max_or_identity(x), empty)

    def min(self, x, empty=0.0):
        return jnp.where(self.nonempty, self.min_or_identity(x), empty)

    def max_or_identity(self, x):
        """Max over the selection, −inf (the identity of max) when empty: combines exactly across parts."""
        return jnp.max(jnp.where(self.sel, x, -jnp.inf), initial=-jnp.inf)

    def min_or_identity(self, x):
        return jnp.min(jnp.where(self.sel, x, jnp.inf), initial=jnp.inf)

    def frac(self, cond):
        return self.mean(cond.astype(jnp.float32))

    def count(self, cond):
        return jnp.sum(self.sel & cond).astype(jnp.float32)
