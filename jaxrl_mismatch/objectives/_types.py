"""Shape aliases shared by the objective and metric modules (documentation; jaxtyping is not runtime-checked)."""

from jaxtyping import Array, Float, Int, Shaped

TokenFloat = Float[Array, "batch seq"]
TokenMask = Shaped[Array, "batch seq"]  # bool or {0, 1} numbers; True / non-zero = response token
SeqFloat = Float[Array, " batch"]
SeqInt = Int[Array, " batch"]
Scalar = Float[Array, ""]
