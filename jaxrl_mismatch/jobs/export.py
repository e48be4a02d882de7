"""`jaxrl-mismatch export RUN_DIR --out DIR [--step N] [--dtype float32]`: a trained policy as an HF checkpoint.

Reads the run's checkpoint (the latest complete step unless --step), rebuilds the abstract train state
from the config saved in it (model architecture from the base checkpoint's config.json, optimizer from
`config.optim`) and restores it onto this host's devices; then writes `config.json` + safetensors
(`models.save_hf`) and copies the base checkpoint's tokenizer and generation files, so transformers,
vLLM and `jaxrl-mismatch serve` load the directory as they load the base model.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Sequence

from jaxrl_mismatch.usage import ArgumentParser, UsageError, existing_dir

PROG = "jaxrl-mismatch export"
# Files of an HF checkpoint directory besides the weights that a loader needs next to them.
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
          "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "task.json")


def export(run_dir: str, out: str, *, step: int | None = None, dtype: str = "float32", base: str | None = None) -> int:
    """Write checkpoint `step` of `run_dir` to `out` as an HF checkpoint; returns the exported step."""
    import jax
    import jax.numpy as jnp
    import ml_collections
    from flax import nnx

    from jaxrl_mismatch import precision
    from jaxrl_mismatch.models import ModelConfig, save_hf
    from jaxrl_mismatch.models.hf_io import abstract_model
    from jaxrl_mismatch.train.checkpoint import Checkpointer, CheckpointError
    from jaxrl_mismatch.train.config import build_optimizer
    from jaxrl_mismatch.train.state import init_state

    ckpt_dir = os.path.join(run_dir, "checkpoints")
    existing_dir("RUN_DIR", run_dir)
    if not os.path.isdir(ckpt_dir):
        raise UsageError(f"RUN_DIR {run_dir}: no checkpoints/ directory (not a training run, or none saved yet)")
    with Checkpointer(ckpt_dir) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            raise UsageError(f"RUN_DIR {run_dir}: holds no complete checkpoint")
        if step is not None and step not in steps:
            raise UsageError(f"--step {step}: no such checkpoint in {ckpt_dir}; available: {steps}")
        step = steps[-1] if step is None else step
        c = ml_collections.ConfigDict(ckpt.read_meta(step)["config"])
        base = base or c.model.path
        if not os.path.isfile(os.path.join(base, "config.json")):
            raise UsageError(f"--base {base}: the run's base checkpoint (config.json, tokenizer) is not there; "
                             "pass --base DIR pointing to it")
        cfg = ModelConfig.from_hf(base)
        policy = precision.policy(c.trainer.precision, fp32_lm_head=c.trainer.fp32_lm_head, param_dtype="float32")
        graphdef, abstract_params = nnx.split(abstract_model(cfg, policy), nnx.Param)
        opt = build_optimizer(c.optim)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.eval_shape(lambda p: init_state(p, opt, precision.loss_scale_for(policy), seed=0),
                                  abstract_params)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
        try:
            state, _ = ckpt.restore(step, abstract_state=abstract)
        except CheckpointError as e:
            raise UsageError(f"RUN_DIR {run_dir}: checkpoint {step} does not match its config: {e}") from None
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), state.params)
    # The written config.json names the stored dtype (save_hf reads it from the model's policy).
    out_policy = precision.policy(c.trainer.precision, fp32_lm_head=c.trainer.fp32_lm_head, param_dtype=dtype)
    graphdef = nnx.split(abstract_model(cfg, out_policy), nnx.Param)[0]
    tmp = out.rstrip("/") + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(nnx.merge(graphdef, params), cfg, tmp)  # config.json records the stored dtype
    for name in COPIED:
        if os.path.isfile(os.path.join(base, name)):
            shutil.copy2(os.path.join(base, name), os.path.join(tmp, name))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # a killed export never leaves a half-written directory under `out`
    return step


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (config.run_dir)")
    p.add_argument("--out", required=True, help="directory to write the HF checkpoint to (replaced if it exists)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="dtype of the written weights (the trainer's master weights are float32)")
    p.add_argument("--base", default=None, help="base checkpoint dir (default: the run's config.model.path)")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if os.path.abspath(a.out) == os.path.abspath(a.run_dir):
        raise UsageError("--out: must not be the run directory itself")
    step = export(a.run_dir, a.out, step=a.step, dtype=a.dtype, base=a.base)
    print(f"export: step {step} of {a.run_dir} → {a.out} ({a.dtype})", flush=True)
    return 0
