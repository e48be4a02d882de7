"""The training config: defaults for every field (with a comment each) and validation before any work.

Config files in `configs/` start from `base_config()` and override fields; the command line overrides
them again (`--config.optim.lr=1e-6`). `validate(config)` runs before the warm start, the rollout
server or JAX allocate anything, and raises `ConfigError` naming the bad field.
"""

from __future__ import annotations

import ml_collections

from jaxrl_mismatch import precision


class ConfigError(ValueError):
    """A config field has a bad value; the message starts with the field's dotted path."""


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.run_dir = "runs/run"  # metrics.jsonl, TensorBoard events, checkpoints, report.png, server log
    c.seed = 0  # model-independent randomness: data order, rollout seeds, diagnostics
    c.steps = 100  # RL steps (one rollout batch each)
    c.resume = True  # continue from the latest checkpoint in run_dir/checkpoints if there is one

    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # local HF checkpoint dir (config.json + safetensors + tokenizer files)
    c.model.warmstart_if_missing = False  # run the tiny-demo SFT warm start when model.path is empty
    c.model.warmstart_args = ""  # extra `jaxrl-mismatch warmstart` arguments, e.g. "--steps 700"

    c.task = ml_collections.ConfigDict()
    c.task.name = "arithmetic"  # data.TASKS: arithmetic | gsm8k | math | dapo | prompts | arithmetic_prompts
    c.task.template = ""  # data.templates name; "" = the task's default template
    c.task.train_split = "train"
    c.task.val_split = "validation"
    c.task.num_train = 20000  # synthetic tasks only: number of generated train problems
    c.task.num_val = 128  # validation prompts used by periodic evaluation
    c.task.files = ml_collections.ConfigDict()  # file-backed tasks: split -> JSONL path
    c.task.data_dir = ""  # file-backed tasks: where the TFDS array_record dataset is built
    c.task.max_prompt_len = 1024

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "jax"  # jax (built-in) | vllm
    c.rollout.address = ""  # "host:port" of an external server; "" = start one as a subprocess on loopback
    c.rollout.token_file = ""  # shared token for weight pushes (external server); generated when managed
    c.rollout.dtype = "float32"  # rollout precision: float32 | bfloat16 | float16 (separate from the trainer's)
    c.rollout.group_size = 8  # samples per prompt (GRPO group)
    c.rollout.max_tokens = 64  # max response tokens
    c.rollout.temperature = 1.0  # the trainer scores π at the same temperature (softmax(logits / T))
    c.rollout.top_p = 1.0  # must stay 1.0 for training rollouts (see validate)
    c.rollout.top_k = 0  # must stay 0 (off) for training rollouts
    c.rollout.max_model_len = 0  # 0 = the model's max_position_embeddings
    c.rollout.startup_timeout_s = 600.0
    c.rollout.generate_timeout_s = 1800.0
    c.rollout.push_timeout_s = 600.0  # deadline of one UpdateWeights stream (GBs over a network take minutes)
    c.rollout.restart_on_failure = True  # managed server died: restart it and continue

    c.batch = ml_collections.ConfigDict()
    c.batch.prompts_per_step = 16  # groups in one training batch (batch rows = prompts × group_size)
    c.batch.dynamic_sampling = True  # DAPO: drop all-correct / all-wrong groups and oversample
    c.batch.max_oversample_rounds = 3  # extra Generate rounds to refill the batch after filtering
    c.batch.ppo_epochs = 1  # passes over the rollout batch
    c.batch.minibatches = 1  # optimizer steps per epoch (1 = fully on-policy)
    c.batch.microbatches = 1  # gradient-accumulation splits of each minibatch (lax.scan)

    c.trainer = ml_collections.ConfigDict()
    c.trainer.precision = "fp32"  # fp32 | bf16 | fp16 (compute); master weights stay float32
    c.trainer.fp32_lm_head = False  # keep the LM head + softmax in float32 under bf16/fp16
    c.trainer.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
    c.trainer.chunk_size = 256  # sequence chunk of the log-prob computation (memory vs speed)
    c.trainer.remat = False  # recompute each block in the backward pass (activation memory vs ~1/3 more FLOPs)

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"  # schedules.OPTIMIZERS
    c.optim.lr = 1e-6
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.01
    c.optim.max_grad_norm = 1.0
    c.optim.schedule = "constant"  # schedules.SCHEDULES (in-graph); the controller multiplies it
    c.optim.schedule_kwargs = ml_collections.ConfigDict()  # e.g. decay_steps for cosine (counted in optimizer steps)
    c.optim.warmup_steps = 0  # linear warmup before `schedule` (joined with optax.join_schedules)

    c.controller = ml_collections.ConfigDict()
    c.controller.name = "none"  # none | length_triggered_decay | metric_triggered | combined | constant
    c.controller.kwargs = ml_collections.ConfigDict()  # constructor arguments (see docs/schedules.md)

    c.objective = ml_collections.ConfigDict()
    c.objective.preset = "grpo"  # objectives.PRESETS
    c.objective.overrides = ml_collections.ConfigDict()  # ObjectiveConfig fields, e.g. correction="token_tis"
    c.objective.advantages = "grpo"  # grpo | drgrpo | rloo
    c.objective.kl_coef = 0.0  # k3 KL to the initial policy (0 = no reference forward)
    c.objective.entropy_coef = 0.0

    c.diagnostics = ml_collections.ConfigDict()
    c.diagnostics.zero_mismatch = False  # μ := π(θ_old): the VeXact zero-mismatch setting
    c.diagnostics.inject_mismatch_scale = 0.0  # Gaussian noise added to rollout log-probs (controlled mismatch)
    c.diagnostics.weight_distortion_delta = -1.0  # φ: objective-hacking eq. 18 (< 0 = off)
    c.diagnostics.weight_distortion_pi_low = 0.1
    c.diagnostics.variance_sigma = 0.0  # ξ ~ N(1, σ²): objective-hacking eq. 21 (0 = off)

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 10  # steps between validations (0 = only at the start and the end)
    c.eval.k = 4  # samples per prompt: avg@k
    c.eval.temperature = 1.0
    c.eval.greedy = True  # also report greedy (temperature 0) accuracy

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 10
    c.checkpoint.keep = 3

    c.log = ml_collections.ConfigDict()
    c.log.tensorboard = True
    c.log.progress = True  # tqdm progress bar with step, reward, LR and mismatch
    c.log.report = True  # write report.png at the end

    c.distributed = ml_collections.ConfigDict()
    c.distributed.initialize = "auto"  # auto (when launched multi-host) | always | never
    return c


_CHOICES = {
    "rollout.engine": ("jax", "vllm"),
    "rollout.dtype": ("float32", "bfloat16", "float16"),
    "trainer.precision": precision.PRESETS,
    "objective.advantages": ("grpo", "drgrpo", "rloo"),
    "distributed.initialize": ("auto", "always", "never"),
}
_POSITIVE_INTS = (
    "steps", "rollout.group_size", "rollout.max_tokens", "batch.prompts_per_step", "batch.ppo_epochs",
    "batch.minibatches", "batch.microbatches", "trainer.chunk_size", "task.num_val", "eval.k",
    "checkpoint.keep", "task.max_prompt_len",
)
_NON_NEGATIVE = (
    "batch.max_oversample_rounds", "eval.every", "checkpoint.every", "optim.warmup_steps", "rollout.top_k",
    "rollout.max_model_len", "optim.weight_decay", "objective.kl_coef", "objective.entropy_coef",
    "diagnostics.inject_mismatch_scale", "diagnostics.variance_sigma",
)


def _get(c: ml_collections.ConfigDict, path: str):
    node = c
    for part in path.split("."):
        if part not in node:
            raise ConfigError(f"config.{path}: missing field")
        node = node[part]
    return node


def validate(c: ml_collections.ConfigDict) -> None:
    """Check every field that can be checked without loading anything; raise ConfigError naming it."""
    for path, choices in _CHOICES.items():
        v = _get(c, path)
        if v not in choices:
            raise ConfigError(f"config.{path}: {v!r} is not one of {list(choices)}")
    for path in _POSITIVE_INTS:
        v = _get(c, path)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"config.{path}: must be an integer >= 1, got {v!r}")
    for path in _NON_NEGATIVE:
        v = _get(c, path)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"config.{path}: must be a number >= 0, got {v!r}")
    if not c.optim.lr > 0:
        raise ConfigError(f"config.optim.lr: must be > 0, got {c.optim.lr!r}")
    if not c.rollout.temperature >= 1e-5:
        raise ConfigError(f"config.rollout.temperature: training rollouts need a temperature > 0 (the trainer "
                          f"scores π as softmax(logits / T)), got {c.rollout.temperature!r}")
    # With top-p / top-k the engine's log-probs are renormalised over the kept tokens while the trainer's
    # recompute covers the whole vocabulary: ρ = π/μ would be biased (TRL #6789). Refuse rather than
    # report a mismatch that is an artefact of the sampler (rollout/sampling.py has the processing for
    # consumers that want to compare the processed distributions).
    if c.rollout.top_p != 1.0:
        raise ConfigError(f"config.rollout.top_p: must be 1.0 for training rollouts (got {c.rollout.top_p!r}); "
                          "top-p renormalised log-probs would bias ρ = π/μ")
    if c.rollout.top_k != 0:
        raise ConfigError(f"config.rollout.top_k: must be 0 for training rollouts (got {c.rollout.top_k!r}); "
                          "top-k renormalised log-probs would bias ρ = π/μ")
    from jaxrl_mismatch.rollout.validation import Limits

    limit = Limits().max_request_completion_tokens
    for what, n in (("rollout.group_size", c.rollout.group_size), ("eval.k", c.eval.k)):
        if n * c.rollout.max_tokens > limit:
            raise ConfigError(f"config.{what}: {n} samples × rollout.max_tokens {c.rollout.max_tokens} exceed one "
                              f"Generate request's {limit} completion tokens")
    if not c.eval.temperature >= 0:
        raise ConfigError(f"config.eval.temperature: must be >= 0 (0 = greedy), got {c.eval.temperature!r}")
    if not 0 < c.diagnostics.weight_distortion_pi_low <= 1:
        raise ConfigError("config.diagnostics.weight_distortion_pi_low: must be in (0, 1], got "
                          f"{c.diagnostics.weight_distortion_pi_low!r}")
    for path in ("rollout.generate_timeout_s", "rollout.push_timeout_s", "rollout.startup_timeout_s"):
        if not _get(c, path) > 0:
            raise ConfigError(f"config.{path}: must be > 0, got {_get(c, path)!r}")
    if c.rollout.group_size < 2:
        raise ConfigError("config.rollout.group_size: group-relative advantages need >= 2 samples per prompt")
    if not c.model.path and not c.model.warmstart_if_missing:
        raise ConfigError("config.model.path: empty; point it to a local HF checkpoint directory")
    rows = c.batch.prompts_per_step * c.rollout.group_size
    split = c.batch.minibatches * c.batch.microbatches
    if rows % split:
        raise ConfigError(
            f"config.batch: prompts_per_step × group_size = {rows} rows is not divisible by "
            f"minibatches × microbatches = {split}"
        )
    for axis, size in c.trainer.mesh.items():
        if axis not in ("data", "fsdp", "tensor"):
            raise ConfigError(f"config.trainer.mesh: unknown axis {axis!r}; valid: data, fsdp, tensor")
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise ConfigError(f"config.trainer.mesh.{axis}: must be a positive integer or -1, got {size!r}")
    # Names resolved by their registries (each raises listing the valid names).
    from jaxrl_mismatch.data import TASKS
    from jaxrl_mismatch.objectives import objective_config
    from jaxrl_mismatch.schedules import CONTROLLERS, OPTIMIZERS, SCHEDULES

    if c.task.name not in TASKS:
        raise ConfigError(f"config.task.name: unknown task {c.task.name!r}; valid: {sorted(TASKS)}")
    if c.optim.name not in OPTIMIZERS:
        raise ConfigError(f"config.optim.name: unknown optimizer {c.optim.name!r}; valid: {sorted(OPTIMIZERS)}")
    if c.optim.schedule not in SCHEDULES:
        raise ConfigError(f"config.optim.schedule: unknown schedule {c.optim.schedule!r}; valid: {sorted(SCHEDULES)}")
    try:
        build_schedule(c.optim)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.optim.schedule_kwargs: {e}") from None
    try:
        build_optimizer(c.optim)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.optim: {e}") from None
    if c.controller.name != "none" and c.controller.name not in CONTROLLERS:
        raise ConfigError(
            f"config.controller.name: unknown controller {c.controller.name!r}; valid: ['none'] + {sorted(CONTROLLERS)}"
        )
    try:
        objective_config(c.objective.preset, **c.objective.overrides.to_dict())
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.objective: {e}") from None
    if c.controller.name != "none":
        from jaxrl_mismatch.schedules import make_controller

        try:
            make_controller(c.controller.name, **c.controller.kwargs.to_dict())
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"config.controller.kwargs: {e}") from None


def build_schedule(optim: ml_collections.ConfigDict):
    """The in-graph LR schedule of `config.optim`: a float for "constant", else an Optax schedule.

    The schedule's peak/initial value is `optim.lr`; `warmup_steps` prepends a linear warmup with
    `optax.join_schedules`. Host controllers multiply the result through the `lr_scale` hyperparameter.
    """
    import optax

    from jaxrl_mismatch.schedules import linear_warmup_schedule, make_schedule

    kwargs = optim.schedule_kwargs.to_dict()
    if optim.schedule == "constant" and not kwargs:
        sched = float(optim.lr)
    else:
        first = {"constant": "value", "linear_warmup": "peak_value"}.get(optim.schedule, "init_value")
        sched = make_schedule(optim.schedule, **{first: float(optim.lr)}, **kwargs)
    if optim.warmup_steps:
        after = sched if callable(sched) else make_schedule("constant", value=float(optim.lr))
        warm = linear_warmup_schedule(peak_value=float(optim.lr), warmup_steps=int(optim.warmup_steps))
        sched = optax.join_schedules([warm, after], [int(optim.warmup_steps)])
    return sched


def build_optimizer(optim: ml_collections.ConfigDict):
    """The Optax chain of `config.optim`, passing each optimizer only the hyperparameters it takes."""
    from jaxrl_mismatch.schedules import OPTIMIZERS, make_optimizer

    accepted = OPTIMIZERS[optim.name][1]
    hparams = {k: optim[k] for k in accepted if k in optim}
    return make_optimizer(optim.name, learning_rate=build_schedule(optim), max_grad_norm=optim.max_grad_norm, **hparams)
