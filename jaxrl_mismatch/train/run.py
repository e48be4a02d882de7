"""`jaxrl-mismatch train --config configs/NAME.py [--config.field=value ...]`.

The config file is an ml_collections config (`get_config()`), overridable field by field from the
command line. The run: validate the config (before any work) → initialise multi-host JAX when launched
on several hosts → warm start the demo policy if asked and missing → RL loop against the rollout server
(a loopback subprocess unless `rollout.address` is set) → report PNG.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
from typing import Sequence

from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "path to an ml_collections config file", lock_config=True)


def _parse(argv: Sequence[str]):
    fl = flags.FLAGS
    if not fl.is_parsed():
        fl(["jaxrl-mismatch train", *argv])
    else:  # a second call in one process (tests): re-parse
        fl.unparse_flags()
        fl(["jaxrl-mismatch train", *argv])
    if _CONFIG.value is None:
        raise SystemExit("jaxrl-mismatch train: --config configs/NAME.py is required")
    return _CONFIG.value


def _warmstart(c) -> None:
    if os.path.exists(os.path.join(c.model.path, "config.json")):
        return
    from jaxrl_mismatch.data import warmstart

    print(f"train: no checkpoint at {c.model.path}; running the warm start first", flush=True)
    rc = warmstart.main(["--out", c.model.path, *shlex.split(c.model.warmstart_args)])
    if rc:
        raise SystemExit(f"train: warm start failed (exit {rc})")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    from jaxrl_mismatch.train.config import ConfigError, validate

    c = _parse(argv)
    try:
        validate(c)
    except ConfigError as e:
        print(f"jaxrl-mismatch train: bad config: {e}", file=sys.stderr)
        return 2
    from jaxrl_mismatch.train import distributed

    distributed.initialize(c.distributed.initialize)
    import jax

    if c.model.warmstart_if_missing:
        if jax.process_index() == 0:
            _warmstart(c)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("warmstart")
    from jaxrl_mismatch.train.loop import RolloutFailure, Trainer

    trainer = Trainer(c)

    # SIGTERM (a scheduler's preemption, `kill`): finish the current step, checkpoint it, stop the
    # rollout server and exit; the same command resumes. (Interrupting mid-update would leave a donated,
    # half-updated state behind.)
    def request_stop(signum, frame):
        print(f"train: signal {signum}: stopping after the current step", file=sys.stderr, flush=True)
        trainer.stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    try:
        summary = trainer.run()
    except RolloutFailure as e:
        print(f"jaxrl-mismatch train: {e}", file=sys.stderr)
        return 3
    finally:
        trainer.close()
    if summary.get("stopped_early"):
        print(f"train: stopped at step {summary['end_step']} on request; checkpoint written, rerun to resume",
              flush=True)
        return 0
    print(f"train: finished steps {summary['start_step']} → {summary['end_step']}", flush=True)
    for key in ("initial", "final"):
        if key in summary:
            print(f"train: {key}: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(summary[key].items())), flush=True)
    if c.log.report and jax.process_index() == 0:
        from jaxrl_mismatch.report.plot import make_report

        print(f"train: report written to {make_report(c.run_dir)}", flush=True)
    return 0
