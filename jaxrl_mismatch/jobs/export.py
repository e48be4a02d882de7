"""`jaxrl-mismatch export RUN_DIR --out DIR [--step N] [--dtype float32]`: a trained policy as an HF checkpoint.

Reads the run's checkpoint (the latest complete step unless --step), rebuilds the abstract train state
from the config saved in it (model architecture from the base checkpoint's config.json, optimizer from
`config.optim`) and restores it onto this host's devices; then writes `config.json` + safetensors
(`models.save_hf`) and copies the base checkpoint's tokenizer and generation files, so transformers,
vLLM and `jaxrl-mismatch serve` load the directory as they load the base model.

`--out` must be new, empty, or an earlier export (replaced only with `--force`), and outside the run directory
(paths compared resolved); the checkpoint is written into a temporary sibling and renamed into place
(`outputs.staged_dir`), so a run directory or a user's folder is never emptied and a failed export leaves
nothing behind. Without `--step`, a damaged newest
checkpoint is skipped with a warning (the run directory is only read, never changed) and the newest
readable one exported; an explicit damaged `--step` is refused by name (exit 4).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
from typing import Sequence

from jaxrl_mismatch.outputs import check_out_dir, staged_dir
from jaxrl_mismatch.rollout.engine import ENGINE_DTYPES
from jaxrl_mismatch.usage import ArgumentParser, UsageError, existing_dir

log = logging.getLogger(__name__)

PROG = "jaxrl-mismatch export"
# Files of an HF checkpoint directory besides the weights that a loader needs next to them.
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
          "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "task.json")


def export(run_dir: str, out: str, *, step: int | None = None, dtype: str = "float32", base: str | None = None,
           force: bool = False) -> int:
    """Write checkpoint `step` of `run_dir` to `out` as an HF checkpoint; returns the exported step."""
    # The arguments first: a bad one is refused before jax and orbax are imported (~0.3 CPU-s, not ~2).
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    existing_dir("RUN_DIR", run_dir)
    if not os.path.isdir(ckpt_dir):
        raise UsageError(f"RUN_DIR {run_dir}: no checkpoints/ directory (not a training run, or none saved yet)")
    _check_out(run_dir, out, force)
    if step is not None and step < 0:
        raise UsageError(f"--step {step}: must be >= 0")

    import jax
    import jax.numpy as jnp
    import ml_collections
    from flax import nnx

    from jaxrl_mismatch import precision
    from jaxrl_mismatch.jobs._inputs import model_config
    from jaxrl_mismatch.models import save_hf
    from jaxrl_mismatch.models.hf_io import abstract_model
    from jaxrl_mismatch.train.checkpoint import (Checkpointer, CheckpointDamagedError, CheckpointMismatchError,
                                                 require_meta)
    from jaxrl_mismatch.train.optimizer import build_optimizer
    from jaxrl_mismatch.train.state import init_state

    def load(s: int):
        """(run config, base dir, model config, state) of step `s`; CheckpointDamagedError if unreadable."""
        where = os.path.join(ckpt_dir, str(s))
        meta = require_meta(ckpt.read_meta(s), where, {"config": dict})
        require_meta(meta["config"], f"{where} (its meta's config)", {"model": dict, "trainer": dict, "optim": dict})
        c = ml_collections.ConfigDict(meta["config"])
        # The base the run trained from: its absolute path in the meta (runs before it: model.path, which may be
        # relative to where train ran; read from elsewhere it found nothing, or another run's base of that name).
        recorded = meta.get("model_dir")
        b = base or (recorded if isinstance(recorded, str) else c.model.path)
        if not base and b != c.model.path and not os.path.isfile(os.path.join(b, "config.json")) and os.path.isfile(
                os.path.join(c.model.path, "config.json")):  # the run moved with its base: model.path from here
            print(f"warning: the run's base {b} is not there; exporting with config.model.path {c.model.path!r} as "
                  f"found from {os.getcwd()}", file=sys.stderr, flush=True)
            b = c.model.path
        if not os.path.isfile(os.path.join(b, "config.json")):
            where = "--base" if base else f"config.model.path of the run ({c.model.path!r}, as train resolved it)"
            raise UsageError(f"{where} {b}: the run's base checkpoint (config.json, tokenizer) is not there; "
                             "pass --base DIR pointing to it")
        cfg = model_config("--base" if base else "config.model.path", b, weights=False)  # config and tokenizer only
        _check_trained_config(meta.get("model_config"), cfg, "--base" if base else "config.model.path", b)
        if not os.path.isfile(os.path.join(b, "tokenizer.json")):  # the trainer needed it; so do serve and vLLM
            raise UsageError(f"{'--base' if base else 'config.model.path'} {b}: no tokenizer.json; the export would "
                             "hold no tokenizer. Pass --base DIR pointing to the run's base checkpoint")
        policy = precision.policy(c.trainer.precision, fp32_lm_head=c.trainer.fp32_lm_head, param_dtype="float32")
        abstract_params = nnx.split(abstract_model(cfg, policy, scan_layers=_scan_layers(c)), nnx.Param)[1]
        opt = build_optimizer(c.optim)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.eval_shape(lambda p: init_state(p, opt, precision.loss_scale_for(policy), seed=0),
                                  abstract_params)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
        try:
            return c, b, cfg, ckpt.restore(s, abstract_state=abstract)[0]
        except CheckpointMismatchError as e:
            raise UsageError(f"RUN_DIR {run_dir}: checkpoint {s} does not match its config (--base "
                             f"{b}?): {' '.join(str(e).split())[:400]}") from None

    # Opened read-only in effect: no cleanup of temporaries and no renames, a trainer may be writing there.
    with Checkpointer(ckpt_dir, tidy=False) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            raise UsageError(f"RUN_DIR {run_dir}: holds no complete checkpoint")
        if step is not None:
            if step not in steps:
                raise UsageError(f"--step {step}: no such checkpoint in {ckpt_dir}; available: {steps}")
            try:
                c, base, cfg, state = load(step)
            except CheckpointDamagedError as e:
                others = [s for s in steps if s != step]
                raise CheckpointDamagedError(f"--step {step}: {' '.join(str(e).split())}; other steps: {others}") from None
        else:
            for s in reversed(steps):
                try:
                    c, base, cfg, state = load(s)
                    step = s
                    break
                except CheckpointDamagedError as e:
                    log.warning("%s; skipping it (the run directory is left as it is)", " ".join(str(e).split()))
            else:
                raise CheckpointDamagedError(f"RUN_DIR {run_dir}: none of its checkpoints {steps} can be read")
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), state.params)
    # The written config.json names the stored dtype (save_hf reads it from the model's policy).
    out_policy = precision.policy(c.trainer.precision, fp32_lm_head=c.trainer.fp32_lm_head, param_dtype=dtype)
    graphdef = nnx.split(abstract_model(cfg, out_policy, scan_layers=_scan_layers(c)), nnx.Param)[0]
    with staged_dir("--out", out, "export", force=force) as tmp:
        # config.json records the stored dtype, and the base's special-token ids (generate() stops at eos_token_id)
        save_hf(nnx.merge(graphdef, params), cfg, tmp, extra_config=_token_ids(base))
        for name in COPIED:
            if os.path.isfile(os.path.join(base, name)):
                shutil.copyfile(os.path.join(base, name), os.path.join(tmp, name))
    return step


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def _check_trained_config(recorded: object, cfg, flag: str, base: str) -> None:
    """UsageError naming the fields where the base's config.json differs from the model the run trained (recorded in
    its checkpoints since 2026-11-29): only shapes were checked, so a base of other settings (rope_theta, a norm's
    eps) exported the trained weights under a config that computes something else. Older checkpoints: no check."""
    if not isinstance(recorded, dict):
        return
    now = json.loads(json.dumps(dataclasses.asdict(cfg)))
    diff = [f"{k}: trained {recorded[k]!r}, base {now.get(k)!r}" for k in sorted(recorded) if recorded[k] != now.get(k)]
    if diff:
        raise UsageError(f"{flag} {base}: its config.json is not the model the run trained ({'; '.join(diff[:4])}); "
                         "pass --base DIR pointing to the run's base checkpoint")


def _token_ids(base: str) -> dict:
    """The special-token ids of the base's config.json (`ModelConfig` does not hold them)."""
    with open(os.path.join(base, "config.json"), encoding="utf-8") as f:
        config = json.load(f)  # model_config has read it already
    return {k: config[k] for k in TOKEN_ID_KEYS if config.get(k) is not None}


def _scan_layers(c) -> bool:
    """Whether the run trained in the stacked-layers layout (`trainer.scan_layers`): its checkpoint is in it, and
    save_hf writes either layout as HF's per-layer tensors."""
    return bool(c.trainer.get("scan_layers", False))


def _check_out(run_dir: str, out: str, force: bool) -> None:
    """--out may not be the run directory, lie inside it (its checkpoints folder included, wherever a link there
    leads) or contain it; and must be a new, empty or earlier export directory. Paths are compared resolved
    (`realpath`): a link to the run, or a `..` back into it, is the run."""
    if not out:
        raise UsageError("--out: empty path; give the directory to write the HF checkpoint to")
    target = os.path.realpath(out)
    run = os.path.realpath(run_dir)
    for root in dict.fromkeys((run, os.path.realpath(os.path.join(run_dir, "checkpoints")))):
        what = "the run directory" if root == run else "the run's checkpoints directory"
        if target == root:
            where = what
        elif target.startswith(root.rstrip(os.sep) + os.sep):
            where = f"inside {what}"
        elif root.startswith(target.rstrip(os.sep) + os.sep):
            where = f"a parent of {what}"
        else:
            continue
        raise UsageError(f"--out {out}: is {where} (RUN_DIR {run_dir}); export only reads the run, choose a "
                         "directory outside it")
    check_out_dir("--out", out, "export", force=force)


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (config.run_dir)")
    p.add_argument("--out", required=True,
                   help="directory to write the HF checkpoint to: new, empty, or an earlier export (with --force)")
    p.add_argument("--force", action="store_true", help="replace --out if it holds an earlier export (never other files)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--dtype", choices=ENGINE_DTYPES, default="float32",
                   help="dtype of the written weights (the trainer's master weights are float32)")
    p.add_argument("--base", default=None, help="base checkpoint dir (default: the run's config.model.path)")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.base is not None:
        existing_dir("--base", a.base)
    step = export(a.run_dir, a.out, step=a.step, dtype=a.dtype, base=a.base, force=a.force)
    print(f"export: step {step} of {a.run_dir} → {a.out} ({a.dtype})", flush=True)
    return 0
