"""The training config's schema: defaults for every field (with a comment each) and what a field may hold.

Config files in `configs/` start from `base_config()` and override fields; the command line overrides
them again (`--config.optim.lr=1e-6`, `train/config_overrides.py`). `train/config_checks.validate` runs once,
before the warm start, the rollout server or JAX allocate anything, and raises `ConfigError` naming the bad
field. The sections in `OPEN_SECTIONS` take any key (constructor arguments); everything else is a fixed
schema, so a typo'd field is an error, not a silently ignored new one. What a resumed run may change is in
`train/config_resume.py`; the optimizer and controller a config describes are built by `train/optimizer.py`.
"""

from __future__ import annotations

import difflib
from typing import Any, Sequence

import ml_collections

from jaxrl_mismatch.usage import UsageError


class ConfigError(UsageError):
    """A config field has a bad value; the message starts with the field's dotted path."""


# Sections whose keys are free (passed on as keyword arguments / file maps / mesh axes, checked by `validate`)
# rather than a fixed schema. `trainer.mesh` may name the optional `expert` axis (MoE expert parallelism).
OPEN_SECTIONS = ("controller.kwargs", "optim.schedule_kwargs", "objective.overrides", "task.files", "trainer.mesh")
# The words a boolean field takes on the command line (and `trainer.exact_forward`, a None-valued field, as text).
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def base_config() -> ml_collections.ConfigDict:
    """Every field at its default: the schema `check_schema` holds a config to."""
    c = ml_collections.ConfigDict()
    c.run_dir = "runs/run"  # metrics.jsonl, TensorBoard events, checkpoints, report.png, server log
    c.seed = 0  # model-independent randomness: data order, rollout seeds, diagnostics (problems: task.data_seed)
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
    # Synthetic tasks: the seed that generates the train and validation problems. Separate from `seed` so that
    # runs with different seeds are scored on the same held-out prompts (paired comparisons across seeds).
    c.task.data_seed = 0
    c.task.files = ml_collections.ConfigDict()  # file-backed tasks: split -> JSONL path
    c.task.data_dir = ""  # file-backed tasks: where the TFDS array_record dataset is built
    c.task.max_prompt_len = 1024
    # DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl's `overlong_buffer`): a response longer than
    # rollout.max_tokens - overlong_buffer_len loses up to overlong_penalty_factor of reward, linearly, the whole
    # factor at rollout.max_tokens. 0 = off. Dynamic sampling still filters on the task's reward (verl's
    # filter_groups.metric "acc"), and reward/* report it; reward/overlong_penalty the mean penalty.
    c.task.overlong_buffer_len = 0
    c.task.overlong_penalty_factor = 1.0

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "jax"  # jax (built-in) | vllm
    # "host:port" of an external server, or several comma-separated (a fleet: rollout/fleet.py); "" = start
    # rollout.num_servers servers as subprocesses on loopback
    c.rollout.address = ""
    c.rollout.num_servers = 1  # servers to start when managed (address ""): requests spread by tokens, failover
    c.rollout.token_file = ""  # shared token for weight pushes (external server); generated when managed
    c.rollout.dtype = "float32"  # rollout precision: float32 | bfloat16 | float16 (separate from the trainer's)
    c.rollout.group_size = 8  # samples per prompt (GRPO group)
    c.rollout.max_tokens = 64  # max response tokens
    c.rollout.temperature = 1.0  # the trainer scores π at the same temperature (softmax(logits / T))
    # Top-p / top-k (jax engine): the engine returns each token's kept-set size and the trainer renormalises π
    # over the same support inside the jitted step (models/truncation.py), so ρ compares like with like.
    c.rollout.top_p = 1.0  # 1.0 = off
    c.rollout.top_k = 0  # 0 = off
    c.rollout.max_model_len = 0  # 0 = the model's max_position_embeddings
    c.rollout.startup_timeout_s = 600.0
    c.rollout.generate_timeout_s = 1800.0
    c.rollout.push_timeout_s = 600.0  # deadline of one UpdateWeights stream (GBs over a network take minutes)
    # How long one call keeps retrying a server that does not answer (UNAVAILABLE, deadline exceeded) before
    # the run checkpoints and stops; raise it when a supervisor restarts an external server (vLLM takes minutes)
    c.rollout.retry_s = 10.0
    c.rollout.restart_on_failure = True  # managed server died: restart it and continue
    c.rollout.stall_timeout_s = 600.0  # fleet: a longer Generate marks its server stalled, its prompts go elsewhere
    # Weight pushes: auto = shared memory when the server is on this host (rollout/shm.py), else the gRPC
    # stream | shm = shared memory or fail | grpc = always the stream
    c.rollout.weight_transport = "auto"
    # Zero mismatch (VeXact review): the built-in engine samples from, and returns, exactly the trainer's
    # π(θ_old) (batch-invariant, bit for bit; models/exact.py). Needs the jax engine, rollout.dtype equal to
    # trainer.precision, no fp32_lm_head, a single-device or data-parallel mesh. Slower sampling.
    c.rollout.exact = False
    # Controlled mismatch: the engine samples from softmax((logits + σ·ε) / T), ε ~ N(0, 1), and returns
    # that distribution's log-probs as μ, so the tokens come from μ ≠ π (jax engine). 0 = off.
    c.rollout.logit_noise_std = 0.0
    # Realistic mismatch (FlashRL / TIS setting, models/quantize.py): the engine serves quantize-then-
    # dequantized weights of every decoder linear layer: none | int8 (weight-only, per-output-channel absmax) |
    # fp8 (e4m3, per-output-channel scale). Pushed weights are quantized on arrival, server side.
    c.rollout.quantize = "none"
    # Mismatch that starts mid-run (rollout/mismatch_schedule.py): logit_noise_std and quantize act from this
    # step on, their strength ramping linearly to 1 over mismatch_ramp_steps steps (0 = full at once).
    c.rollout.mismatch_onset_step, c.rollout.mismatch_ramp_steps = 0, 0
    # Asynchronous rollouts (train/rollout_producer.py): the next steps' batches are generated while the
    # current step trains, from weights at most this many versions old; a batch beyond it is dropped and
    # counted (rollout/dropped_batches). 0 = the synchronous loop. Keeps s copies of the parameters for the
    # staleness/precision split (metrics/staleness.py).
    c.rollout.max_staleness = 0
    c.rollout.fixed_staleness = False  # experiments: every batch (after the first s) exactly s versions old

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
    # With remat: what each block keeps for the backward pass (docs/models.md): "full" (keep nothing),
    # "save_dots" (keep the weight-matmul outputs), "offload" (park them in pinned host memory; GPU/TPU).
    c.trainer.remat_policy = "full"
    c.trainer.scan_layers = False  # layers under lax.scan: compile time and program size flat in depth
    # auto | xla | cudnn | chunked (docs/models.md): auto = cuDNN flash on GPU in bf16/fp16, else chunked
    # query blocks from 1024 positions on (memory linear in the length), else XLA's S×S attention.
    c.trainer.attention_impl = "auto"
    # Sequence packing: whole sequences share rows (segment-aware attention), so the θ_old / reference
    # forwards of prepare and the update's θ forward/backward skip most padding of uneven RL batches; the
    # step computes the same values (dense policies; benchmarks/packing.py measures what it saves).
    c.trainer.packing = False
    # Bit-exact training forward: the update computes log π(θ) with the exact scorer's batch-invariant program
    # (train/exact_forward.py), and π(θ_old) comes from that scorer too, so at θ = θ_old every PPO ratio is
    # exactly 1. None = on iff rollout.exact. Unpacked, dense, unrolled layers, data-parallel mesh.
    c.trainer.exact_forward = None
    # MoE routing replay (docs/models.md): "off" = every forward routes freely; "R2" = the update's θ forwards
    # replay θ_old's own routing; "R3" = the θ_old and θ forwards replay the engine's routing (jax engine only:
    # vLLM does not return routing). MoE policies only.
    c.trainer.routing_replay = "off"

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"  # schedules.OPTIMIZERS
    c.optim.lr = 1e-6
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.01
    c.optim.momentum = None  # sgd only: None is plain SGD; a fraction in [0, 1) is heavy-ball momentum
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
    c.objective.kl_coef = 0.0  # k3 KL to the initial policy (0 = no reference forward)
    c.objective.entropy_coef = 0.0
    c.objective.router_aux_coef = 0.0  # MoE: Switch load-balancing loss weight (HF router_aux_loss_coef); 0 = off

    c.diagnostics = ml_collections.ConfigDict()
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


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": leaf} of a (Config)dict; open sections are leaves as a whole."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, (dict, ml_collections.ConfigDict)) and path not in OPEN_SECTIONS:
            out.update(flatten(v, path + "."))
        else:
            out[path] = v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v
    return out


def unknown_field(path: str, known: Sequence[str]) -> ConfigError:
    """ConfigError for a field the schema lacks, suggesting the nearest known one."""
    near = difflib.get_close_matches(path, known, n=1)
    hint = f" (did you mean config.{near[0]}?)" if near else ""
    return ConfigError(f"config.{path}: unknown field{hint}")


def check_schema(c: ml_collections.ConfigDict) -> None:
    """`c` has the fields of `base_config()`, no more and no fewer (open sections take any key but are sections),
    and none whose default is not None is None (the checks and the trainer compare and read them); ConfigError
    naming a missing, None or stray field (`--config.log={}` dropped fields the trainer then failed to read)."""
    known, have = flatten(base_config()), flatten(c)
    for path, default in known.items():
        if path not in have:
            raise ConfigError(f"config.{path}: missing field")
        if have[path] is None and default is not None:
            what = ("True or False" if isinstance(default, bool) else "a number" if isinstance(default, (int, float))
                    else "a string" if isinstance(default, str) else f"a {type(default).__name__}")
            raise ConfigError(f"config.{path}: must be {what}, got None")
    for path in OPEN_SECTIONS:
        section = c
        for part in path.split("."):
            section = section[part]
        if not isinstance(section, (dict, ml_collections.ConfigDict)):
            raise ConfigError(f"config.{path}: must be a section (a dict), got {section!r}")
    for path in have:
        if path not in known:
            raise unknown_field(path, list(known))


def exact_forward_enabled(c: ml_collections.ConfigDict) -> bool:
    """`trainer.exact_forward`, where None follows `rollout.exact` (a string is the command line's true/false)."""
    v = c.trainer.exact_forward
    if isinstance(v, str):
        return v.lower() in TRUE_WORDS
    return bool(c.rollout.exact if v is None else v)
