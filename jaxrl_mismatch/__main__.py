"""`python -m jaxrl_mismatch COMMAND ...`: the same command line as the `jaxrl-mismatch` console script."""

import sys

from jaxrl_mismatch.cli import main

sys.exit(main())
