"""The training config: defaults for every field (with a comment each), loading with command-line
overrides, and validation before any work.

Config files in `configs/` start from `base_config()` and override fields; the command line overrides
them again (`--config.optim.lr=1e-6`, see `load_config`). `validate(config)` runs before the warm start,
the rollout server or JAX allocate anything, and raises `ConfigError` naming the bad field. The sections
in `OPEN_SECTIONS` take any key (constructor arguments); everything else is a fixed schema, so a typo'd
field is an error, not a silently ignored new one.
"""

from __future__ import annotations

import ast
import difflib
import math
import os
from typing import Any, Sequence

import ml_collections

from jaxrl_mismatch import precision
from jaxrl_mismatch.usage import UsageError, call_file_function, host_port


class ConfigError(UsageError):
    """A config field has a bad value; the message starts with the field's dotted path."""


# Sections whose keys are free (passed on as keyword arguments / file maps / mesh axes, checked by `validate`)
# rather than a fixed schema. `trainer.mesh` may name the optional `expert` axis (MoE expert parallelism).
OPEN_SECTIONS = ("controller.kwargs", "optim.schedule_kwargs", "objective.overrides", "task.files", "trainer.mesh")
# Fields a resumed run may change without changing what it trains (length, logging, plumbing, memory knobs).
RESUME_MAY_CHANGE = (
    "steps", "resume", "run_dir", "log", "checkpoint", "eval.every", "distributed", "model.warmstart_if_missing",
    "model.warmstart_args", "rollout.address", "rollout.token_file", "rollout.startup_timeout_s",
    "rollout.generate_timeout_s", "rollout.push_timeout_s", "rollout.restart_on_failure", "trainer.mesh",
    "rollout.num_servers", "rollout.stall_timeout_s", "rollout.weight_transport",
    "trainer.chunk_size", "trainer.remat", "trainer.remat_policy", "trainer.attention_impl", "trainer.packing",
)


def base_config() -> ml_collections.ConfigDict:
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


_CHOICES = {
    "rollout.engine": ("jax", "vllm"),
    "rollout.dtype": ("float32", "bfloat16", "float16"),
    "rollout.quantize": ("none", "int8", "fp8"),
    "rollout.weight_transport": ("auto", "shm", "grpc"),
    "trainer.precision": precision.PRESETS,
    "distributed.initialize": ("auto", "always", "never"),
}


def _model_choices() -> dict[str, tuple[str, ...]]:
    """The trainer's model options, from the registries that implement them (imported here, not at module
    load, so that reading a config does not import Flax)."""
    from jaxrl_mismatch.models import ATTENTION_IMPLS, REMAT_POLICIES
    from jaxrl_mismatch.train.step import REPLAY_MODES

    return {
        "trainer.routing_replay": REPLAY_MODES,
        "trainer.remat_policy": tuple(p for p in REMAT_POLICIES if p != "none"),  # "none" is trainer.remat = False
        "trainer.attention_impl": ATTENTION_IMPLS,
    }
_POSITIVE_INTS = (
    "steps", "rollout.group_size", "rollout.max_tokens", "batch.prompts_per_step", "batch.ppo_epochs",
    "batch.minibatches", "batch.microbatches", "trainer.chunk_size", "task.num_val", "eval.k",
    "checkpoint.keep", "task.max_prompt_len", "rollout.num_servers",
)
_NON_NEGATIVE = (
    "batch.max_oversample_rounds", "eval.every", "checkpoint.every", "optim.warmup_steps", "rollout.top_k",
    "rollout.max_model_len", "task.data_seed", "optim.weight_decay", "objective.kl_coef", "objective.entropy_coef",
    "diagnostics.variance_sigma", "rollout.logit_noise_std", "objective.router_aux_coef",
    "rollout.mismatch_onset_step", "rollout.mismatch_ramp_steps", "rollout.max_staleness",
)


def _get(c: ml_collections.ConfigDict, path: str):
    node = c
    for part in path.split("."):
        if part not in node:
            raise ConfigError(f"config.{path}: missing field")
        node = node[part]
    return node


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": leaf} of a (Config)dict; open sections are leaves as a whole."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, (dict, ml_collections.ConfigDict)) and path not in OPEN_SECTIONS:
            out.update(_flatten(v, path + "."))
        else:
            out[path] = v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v
    return out


def _unknown_field(path: str, known: Sequence[str]) -> ConfigError:
    near = difflib.get_close_matches(path, known, n=1)
    hint = f" (did you mean config.{near[0]}?)" if near else ""
    return ConfigError(f"config.{path}: unknown field{hint}")


def check_schema(c: ml_collections.ConfigDict) -> None:
    """Every field of `c` exists in `base_config()` (open sections excepted); ConfigError naming a stray one."""
    known = _flatten(base_config())
    for path in _flatten(c):
        if path not in known:
            raise _unknown_field(path, list(known))


def _check_mismatch_sources(c: ml_collections.ConfigDict) -> None:
    """rollout.quantize and the mismatch onset: what each engine can serve (docs/rollout.md)."""
    for path in ("rollout.mismatch_onset_step", "rollout.mismatch_ramp_steps"):
        if not isinstance(_get(c, path), int) or isinstance(_get(c, path), bool):
            raise ConfigError(f"config.{path}: must be an integer >= 0 (a step count), got {_get(c, path)!r}")
    if c.rollout.engine == "vllm" and c.rollout.quantize == "int8":
        raise ConfigError("config.rollout.quantize: 'int8' is not available with the vllm engine (vLLM's online "
                          "'int8_per_channel_weight_only' quantizes MoE experts only, no linear layer); use "
                          "rollout.engine = 'jax' or rollout.quantize = 'fp8'")
    ramped = c.rollout.mismatch_onset_step > 0 or c.rollout.mismatch_ramp_steps > 0
    if c.rollout.engine == "vllm" and c.rollout.quantize != "none" and ramped:
        raise ConfigError("config.rollout.mismatch_onset_step: a quantization onset/ramp blends the full-precision "
                          "and quantized weights per request, which only the built-in jax engine can do")


def validate(c: ml_collections.ConfigDict) -> None:
    """Check every field that can be checked without loading anything; raise ConfigError naming it."""
    check_schema(c)
    for path, choices in {**_CHOICES, **_model_choices()}.items():
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
    if c.rollout.max_staleness != int(c.rollout.max_staleness):
        raise ConfigError(f"config.rollout.max_staleness: must be a whole number of versions, got {c.rollout.max_staleness!r}")
    if not c.rollout.temperature >= 1e-5:
        raise ConfigError(f"config.rollout.temperature: training rollouts need a temperature > 0 (the trainer "
                          f"scores π as softmax(logits / T)), got {c.rollout.temperature!r}")
    # With top-p / top-k the engine's log-probs are renormalised over the kept tokens; the trainer renormalises
    # π over the same support from the kept-set sizes the engine returns (TRL #6789). vLLM does not return them.
    if not 0.0 < c.rollout.top_p <= 1.0:
        raise ConfigError(f"config.rollout.top_p: must be in (0, 1], got {c.rollout.top_p!r}")
    if not (isinstance(c.rollout.top_k, int) and c.rollout.top_k >= 0):
        raise ConfigError(f"config.rollout.top_k: must be an integer >= 0 (0 = off), got {c.rollout.top_k!r}")
    if c.rollout.top_p < 1.0 or c.rollout.top_k > 0:
        field = "rollout.top_p" if c.rollout.top_p < 1.0 else "rollout.top_k"
        if c.rollout.engine != "jax":
            raise ConfigError(f"config.{field}: needs the jax engine, which returns each token's kept-set size for "
                              f"the trainer to renormalise π over (the {c.rollout.engine} engine does not)")
        if c.trainer.packing:
            raise ConfigError(f"config.trainer.packing: must be False with {field} (packed rows do not carry the "
                              "kept-set sizes)")
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
    if c.rollout.address and c.rollout.num_servers != 1:
        raise ConfigError(f"config.rollout.num_servers: {c.rollout.num_servers} servers are started only when managed "
                          "(rollout.address empty); to use several external servers, list their addresses in "
                          "rollout.address, comma-separated")
    for path in ("rollout.generate_timeout_s", "rollout.push_timeout_s", "rollout.startup_timeout_s",
                 "rollout.stall_timeout_s"):
        if not _get(c, path) > 0:
            raise ConfigError(f"config.{path}: must be > 0, got {_get(c, path)!r}")
    if (c.rollout.exact or c.rollout.logit_noise_std) and c.rollout.engine != "jax":
        field = "rollout.exact" if c.rollout.exact else "rollout.logit_noise_std"
        raise ConfigError(f"config.{field}: needs the built-in jax engine (rollout.engine = 'jax'), got "
                          f"{c.rollout.engine!r}")
    _check_mismatch_sources(c)
    if c.trainer.routing_replay == "R3":
        if c.rollout.engine != "jax":
            raise ConfigError(f"config.trainer.routing_replay: 'R3' replays the experts the rollout engine chose, and "
                              f"the {c.rollout.engine} engine does not return them (vLLM's API exposes no per-token "
                              "routing); use rollout.engine = 'jax', or 'R2' (θ_old's own routing)")
        if c.rollout.exact:
            raise ConfigError("config.trainer.routing_replay: 'R3' needs the normal sampler; exact mode returns no "
                              "routing (it already gives μ = π(θ_old))")
    if c.rollout.exact:
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[c.trainer.precision]
        if c.rollout.dtype != dtype:
            raise ConfigError(f"config.rollout.exact: the engine must compute in the trainer's precision: "
                              f"rollout.dtype = {dtype!r} for trainer.precision = {c.trainer.precision!r}, got "
                              f"{c.rollout.dtype!r}")
        if c.trainer.fp32_lm_head:
            raise ConfigError("config.rollout.exact: trainer.fp32_lm_head must be False (the engine has no fp32 head)")
        if c.trainer.scan_layers:
            raise ConfigError("config.trainer.scan_layers: must be False with rollout.exact (the exact scorer "
                              "repeats the engine's unrolled layer program)")
        split = {k: v for k, v in c.trainer.mesh.items() if k != "data" and v != 1}
        if split:
            raise ConfigError(f"config.rollout.exact: needs a single-device or data-parallel trainer mesh (FSDP and "
                              f"tensor parallelism split reductions across devices), got trainer.mesh {split}")
    v = c.trainer.exact_forward  # a None-valued field takes literals from the command line: also accept true/false
    if not (v is None or isinstance(v, bool) or (isinstance(v, str) and v.lower() in _TRUE + _FALSE)):
        raise ConfigError(f"config.trainer.exact_forward: must be None, True or False, got {c.trainer.exact_forward!r}")
    if exact_forward_enabled(c):
        why = "trainer.exact_forward" + (" (implied by rollout.exact)" if c.trainer.exact_forward is None else "")
        if c.trainer.packing:
            raise ConfigError(f"config.trainer.packing: must be False with {why}: the exact forward scores every row "
                              "alone at its canonical length (or set trainer.exact_forward = False)")
        if c.trainer.scan_layers:
            raise ConfigError(f"config.trainer.scan_layers: must be False with {why} (the exact scorer runs the "
                              "unrolled layer program)")
        split = {k: v for k, v in c.trainer.mesh.items() if k != "data" and v != 1}
        if split:
            raise ConfigError(f"config.trainer.mesh: {why} needs a single-device or data-parallel mesh, got {split}")
    if c.rollout.group_size < 2:
        raise ConfigError("config.rollout.group_size: group-relative advantages need >= 2 samples per prompt")
    if c.rollout.address:  # one host:port, or several separated by commas (a fleet, rollout/fleet.py)
        addresses = [a.strip() for a in c.rollout.address.split(",")]
        try:
            for address in addresses:
                host_port("config.rollout.address:", address)
        except UsageError as e:
            raise ConfigError(str(e)) from None
        if c.rollout.weight_transport == "shm":
            remote = [a for a in addresses if host_port("", a)[0] not in ("127.0.0.1", "localhost", "::1")]
            if remote:
                raise ConfigError(f"config.rollout.weight_transport: 'shm' needs a server on this host (loopback "
                                  f"address), got {', '.join(remote)}; use 'auto' or 'grpc'")
    if c.rollout.fixed_staleness and not c.rollout.max_staleness:
        raise ConfigError("config.rollout.fixed_staleness: needs rollout.max_staleness >= 1 (with 0 every batch "
                          "is on the current weights already)")
    if not c.model.path:
        raise ConfigError("config.model.path: empty; point it to a local HF checkpoint directory")

    rows = c.batch.prompts_per_step * c.rollout.group_size
    split = c.batch.minibatches * c.batch.microbatches
    if rows % split:
        raise ConfigError(
            f"config.batch: prompts_per_step × group_size = {rows} rows is not divisible by "
            f"minibatches × microbatches = {split}"
        )
    for axis, size in c.trainer.mesh.items():
        if axis not in ("data", "fsdp", "expert", "tensor"):
            raise ConfigError(f"config.trainer.mesh: unknown axis {axis!r}; valid: data, fsdp, expert, tensor")
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise ConfigError(f"config.trainer.mesh.{axis}: must be a positive integer or -1, got {size!r}")
    # Names resolved by their registries (each raises listing the valid names).
    from jaxrl_mismatch.data import TASKS
    from jaxrl_mismatch.objectives import objective_config
    from jaxrl_mismatch.schedules import CONTROLLERS, OPTIMIZERS, SCHEDULES

    if c.task.name not in TASKS:
        raise ConfigError(f"config.task.name: unknown task {c.task.name!r}; valid: {sorted(TASKS)}")
    if c.task.name != "arithmetic":  # file-backed tasks read local JSONL files, one per split
        for split in (c.task.train_split, c.task.val_split):
            path = c.task.files.get(split)
            if not path:
                raise ConfigError(f"config.task.files.{split}: task {c.task.name!r} reads local JSONL files; "
                                  f"set --config.task.files.{split}=PATH")

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
    try:
        build_controller(c.controller)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"config.controller.kwargs: {e}") from None


def check_paths(c: ml_collections.ConfigDict) -> None:
    """The local files a run reads exist (model checkpoint, task files); ConfigError naming the field.

    Separate from `validate` so that configs for other machines (GPU/TPU paths) validate anywhere.
    """
    if os.path.lexists(c.run_dir) and not os.path.isdir(c.run_dir):
        raise ConfigError(f"config.run_dir: {c.run_dir} is a file; expected a (new or existing) run directory")
    existing = os.path.abspath(c.run_dir)
    while not os.path.exists(existing):  # the run directory, or the ancestor it will be created in
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"config.run_dir: {c.run_dir} cannot be written ({existing} is "
                          f"{'not a directory' if not os.path.isdir(existing) else 'not writable'})")
    if not c.model.warmstart_if_missing and not os.path.isfile(os.path.join(c.model.path, "config.json")):
        what = "does not exist" if not os.path.exists(c.model.path) else "has no config.json"
        raise ConfigError(f"config.model.path: {c.model.path} {what}; point it to a local HF checkpoint directory")
    if c.task.name != "arithmetic":
        for split in (c.task.train_split, c.task.val_split):
            path = c.task.files[split]
            for p in [path] if isinstance(path, str) else list(path):
                if not os.path.isfile(p):
                    raise ConfigError(f"config.task.files.{split}: {p} does not exist")


def exact_forward_enabled(c: ml_collections.ConfigDict) -> bool:
    """`trainer.exact_forward`, where None follows `rollout.exact` (a string is the command line's true/false)."""
    v = c.trainer.exact_forward
    if isinstance(v, str):
        return v.lower() in _TRUE
    return bool(c.rollout.exact if v is None else v)


def check_model(c: ml_collections.ConfigDict, model_cfg) -> None:
    """The options that need a mixture-of-experts policy are off for a dense one; ConfigError naming the field."""
    if model_cfg.is_moe:
        if exact_forward_enabled(c):
            raise ConfigError(f"config.trainer.exact_forward: the exact training forward is for dense policies; "
                              f"{c.model.path} is a mixture of experts (set trainer.exact_forward = False)")
        if c.trainer.packing:
            raise ConfigError(f"config.trainer.packing: not available for the mixture-of-experts {c.model.path} "
                              "(packed rows do not carry routing); set it to False")
        return
    if c.trainer.routing_replay != "off":
        raise ConfigError(f"config.trainer.routing_replay: {c.trainer.routing_replay!r} replays expert routing, but "
                          f"{c.model.path} is a dense {model_cfg.architecture}; set it to 'off'")
    if c.objective.router_aux_coef:
        raise ConfigError(f"config.objective.router_aux_coef: {c.objective.router_aux_coef!r} weights the MoE "
                          f"load-balancing loss, but {c.model.path} is a dense {model_cfg.architecture}; set it to 0")


def check_mesh(c: ml_collections.ConfigDict):
    """The trainer's mesh on this job's devices; ConfigError naming `trainer.mesh` if it does not fit."""
    from jaxrl_mismatch.models.sharding import make_mesh

    try:
        return make_mesh(c.trainer.mesh.to_dict())
    except ValueError as e:
        raise ConfigError(f"config.trainer.mesh: {e}") from None


def build_controller(controller: ml_collections.ConfigDict):
    """The host LR controller of `config.controller` (None for "none")."""
    if controller.name == "none":
        return None
    from jaxrl_mismatch.schedules import make_controller

    return make_controller(controller.name, **controller.kwargs.to_dict())


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


# -- loading and overriding --------------------------------------------------------------------------
def load_config(path: str, overrides: Sequence[tuple[str, str]] = ()) -> ml_collections.ConfigDict:
    """`get_config()` of the Python file `path` (`path:ARG` passes ARG), then `--config.a.b=value` overrides.

    Values are parsed by the type of the field they replace (bool: true/false/1/0/yes/no); a key new to
    an open section (`OPEN_SECTIONS`) is parsed as a Python literal, else kept as a string.
    """
    file, _, arg = path.partition(":")
    c = call_file_function(file, "get_config", f"--config {file}", *([arg] if arg else []))
    if not isinstance(c, ml_collections.ConfigDict):
        raise UsageError(f"--config {file}: get_config() returned {type(c).__name__}, not an ml_collections.ConfigDict")
    for dotted, text in overrides:
        apply_override(c, dotted, text)
    return c


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _parse_as(text: str, old: Any, field: str) -> Any:
    """`text` as a value of `old`'s type; ConfigError naming the field otherwise."""
    def bad(kind: str) -> ConfigError:
        return ConfigError(f"config.{field}: expected {kind}, got {text!r}")

    if isinstance(old, bool):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise bad("true or false")
    if isinstance(old, int):
        try:
            return int(text)
        except ValueError:
            raise bad("an integer") from None
    if isinstance(old, float):
        try:
            value = float(text)
        except ValueError:
            raise bad("a number") from None
        if not math.isfinite(value):
            raise bad("a finite number")
        return value
    if isinstance(old, str):
        return text
    value = _literal(text)
    if isinstance(old, (tuple, list)):
        if not isinstance(value, (tuple, list)):
            raise bad("a list such as [1, 2]")
        return type(old)(value)
    if isinstance(old, (dict, ml_collections.ConfigDict)):
        if not isinstance(value, dict):
            raise bad("a dict such as {'key': 1}")
        return ml_collections.ConfigDict(value)
    return value  # None-valued fields: any literal


def apply_override(c: ml_collections.ConfigDict, dotted: str, text: str) -> None:
    """Set `config.<dotted>` from the command-line text `text` (see `load_config`)."""
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"config.{dotted}: malformed field name")
    node = c
    for i, part in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if part not in node:
            raise _unknown_field(here, list(_flatten(c)))
        node = node[part]
        if not isinstance(node, ml_collections.ConfigDict):
            raise ConfigError(f"config.{here}: is a value, not a section; cannot set config.{dotted}")
    key, section = parts[-1], ".".join(parts[:-1])
    if key in node:
        value = _parse_as(text, node[key], dotted)
    elif section in OPEN_SECTIONS:
        value = _literal(text)
    else:
        raise _unknown_field(dotted, list(_flatten(c)))
    with node.unlocked():
        try:
            node[key] = value
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.{dotted}: {e}") from None


def config_changes(saved: dict, current: dict) -> list[str]:
    """`field: old → new` for every field that differs and changes what a resumed run trains. A field the saved
    config lacks (added to the schema after the run started) counts only when it is not at its default."""
    old, new, base = _flatten(saved), _flatten(current), _flatten(base_config())
    if "task.data_seed" not in old and "seed" in old:
        old["task.data_seed"] = old["seed"]  # a run from before the field drew its problems from `seed`
    out = []
    for path in sorted(set(old) | set(new)):
        if any(path == p or path.startswith(p + ".") for p in RESUME_MAY_CHANGE):
            continue
        if path not in old and path in base and new.get(path) == base[path]:
            continue  # a field added after the run started, at its default: the run trains as before
        a, b = old.get(path, "<unset>"), new.get(path, "<unset>")
        if a != b:
            out.append(f"{path}: {a!r} → {b!r}")
    return out
