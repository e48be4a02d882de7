"""jaxrl_mismatch: a JAX/Flax RL trainer for LLMs that measures and controls the training–inference mismatch."""

__version__ = "0.1.0"
