"""Jobs built from the library's parts, each a `jaxrl-mismatch` subcommand: the demo's supervised warm
start, the FP16 paper's perfectible filter, export of a trained policy as an HF checkpoint."""
