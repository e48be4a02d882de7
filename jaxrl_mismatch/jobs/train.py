"""`jaxrl-mismatch train --config configs/NAME.py [--config.field=value ...] [--accept-config-changes]`.

The config file is an ml_collections config (`get_config()`), overridable field by field from the
command line. The run: load + validate the config (before any work) → initialise multi-host JAX when
launched on several hosts → warm start the demo policy if asked and missing → RL loop against the rollout
server (a loopback subprocess unless `rollout.address` is set) → report PNG.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
from typing import Sequence

from jaxrl_mismatch.usage import EXIT_STOPPED, ArgumentParser, UsageError

PROG = "jaxrl-mismatch train"


def parse(argv: Sequence[str]):
    """(config, accept_config_changes) from the command line; UsageError naming a bad flag or field."""
    p = ArgumentParser(prog=PROG, description="Run an RL training job from an ml_collections config.",
                       epilog="Any config field can be overridden as --config.SECTION.FIELD=VALUE "
                              "(e.g. --config.optim.lr=1e-6 --config.controller.kwargs.surge_ratio=2.5); "
                              "every field is listed with a comment in jaxrl_mismatch/train/config.py.")
    p.add_argument("--config", required=True, metavar="FILE[:ARG]", help="config file defining get_config()")
    p.add_argument("--accept-config-changes", action="store_true",
                   help="resume a run directory whose checkpoint was made with a different config")
    args, rest = p.parse_known_args(argv)
    from jaxrl_mismatch.train.config_overrides import load_config, parse_overrides

    c = load_config(args.config, parse_overrides(rest, PROG))
    # The checks build the optimizer (JAX): imported once the file and the overrides have been read, so a
    # missing file or a misspelt flag is answered in a fraction of a second.
    from jaxrl_mismatch.jobs._inputs import check_warmstart_args
    from jaxrl_mismatch.train.config_checks import check_paths, check_task_files, validate

    validate(c)
    check_paths(c)
    check_task_files(c)
    check_warmstart_args(c)
    return c, args.accept_config_changes


def _warmstart(c) -> None:
    if os.path.exists(os.path.join(c.model.path, "config.json")):
        return
    from jaxrl_mismatch.jobs import warmstart
    from jaxrl_mismatch.outputs import check_out_dir

    # Only into a new or empty directory (or an earlier warm start's): never over what a user keeps there.
    check_out_dir("config.model.path", c.model.path, "warmstart", force=False)
    print(f"train: no checkpoint at {c.model.path}; running the warm start first", flush=True)
    try:
        rc = warmstart.main(["--out", c.model.path, *shlex.split(c.model.warmstart_args)])
    except UsageError as e:
        # Another train of the same model.path finished its warm start first (the write is renamed into place
        # whole): that base is this run's too. It was refused naming warmstart's --out and --force.
        if os.path.isfile(os.path.join(c.model.path, "config.json")):
            print(f"train: {c.model.path} was warm-started by another process meanwhile; training from it",
                  flush=True)
            return
        raise UsageError(f"config.model.path (the warm start's --out): {e}") from None
    if rc:
        raise UsageError(f"config.model.warmstart_args: the warm start failed (exit {rc})")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    c, accept_changes = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    logging.getLogger("jax").setLevel(logging.WARNING)  # backend probing (no TPU here) is not news
    from jaxrl_mismatch.train import distributed

    multi_process = distributed.initialize(c.distributed.initialize)
    try:
        return _run(c, accept_changes)
    finally:
        if multi_process:
            distributed.shutdown()


def _run(c, accept_changes: bool) -> int:
    """The job once JAX's processes are up (one process, or every process of a multi-host job)."""
    import jax

    if jax.process_count() > 1:
        print(f"train: process {jax.process_index()} of {jax.process_count()}, {jax.local_device_count()} of "
              f"{jax.device_count()} devices", flush=True)

    from jaxrl_mismatch.train.config_checks import check_mesh

    check_mesh(c)  # the devices are known only now (multi-host); before any warm start or load

    if c.model.warmstart_if_missing:
        if jax.process_index() == 0:
            _warmstart(c)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("warmstart")
    from jaxrl_mismatch.train.config_checks import check_model_dir
    from jaxrl_mismatch.train.loop import RolloutFailure, Trainer

    check_model_dir(c)  # a damaged policy or a context it cannot serve: before the run directory is made
    trainer = Trainer(c, accept_config_changes=accept_changes)

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
        print(f"error: {e}", file=sys.stderr)
        return 3
    finally:
        trainer.close()
    if summary.get("stopped_early"):
        print(f"train: stopped at step {summary['end_step']} on request; checkpoint written, rerun to resume "
              f"(exit {EXIT_STOPPED})", flush=True)
        return EXIT_STOPPED
    print(f"train: finished steps {summary['start_step']} → {summary['end_step']}", flush=True)
    for key in ("initial", "final"):
        if key in summary:
            print(f"train: {key}: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(summary[key].items())), flush=True)
    if c.log.report and jax.process_index() == 0:
        from jaxrl_mismatch.report.plot import check_figure_out, make_report

        out = os.path.join(c.run_dir, "report.png")
        try:  # as `report` does: never over a symbolic link or a file another tool wrote
            check_figure_out("config.log.report", out)
        except UsageError as e:  # the run itself finished and is checkpointed: say so, keep its exit code
            print(f"train: report not written: {e}", file=sys.stderr, flush=True)
            return 0
        print(f"train: report written to {make_report(c.run_dir, out)}", flush=True)
    return 0
