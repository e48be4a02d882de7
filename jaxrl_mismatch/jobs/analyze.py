"""`jaxrl-mismatch analyze`: offline training–inference mismatch analysis.

One module per subcommand (documented with measured tables in `docs/analysis.md`):

``analyze rollouts`` (`jobs/analyze_rollouts.py`) — the FP16 paper's §3.5 offline analysis (Fig. 2) and the
objective-level hacking paper's token-level views (Figs. 3, 7): engine rollouts at one precision scored by the
trainer's own scorer at another.

``analyze bf16-softmax`` (`jobs/analyze_softmax.py`) — the objective-level hacking paper's App. C.1 simulation of
BF16 softmax discretisation (its eq. 45 and Table 2), next to the paper's numbers.

``analyze attribute`` (`jobs/attribute.py`) — per-layer / per-op divergence of the engine's KV-cache path vs the
trainer's forward and the fp32 ablation matrix.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jaxrl_mismatch.jobs import analyze_rollouts, analyze_softmax, attribute
from jaxrl_mismatch.usage import ArgumentParser

PROG = "jaxrl-mismatch analyze"
SUBCOMMANDS = {"rollouts": analyze_rollouts, "bf16-softmax": analyze_softmax, "attribute": attribute}


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return SUBCOMMANDS[a.what].run(a)
