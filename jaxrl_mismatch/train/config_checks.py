"""Checking a config before any work: `validate` (what the config alone decides, anywhere), then what needs
this machine (`check_paths`, `check_mesh`) or the loaded model (`check_model`).

Each check raises `ConfigError` naming the field. `validate` and `check_paths` run once, where a run's
config is read (`jobs/train.py`, `jobs/compare.py`), before the warm start, the rollout server or JAX
allocate anything; `Trainer` takes the checked config as it is.
"""

from __future__ import annotations

import math
import os
import shlex

import ml_collections

from jaxrl_mismatch import precision
from jaxrl_mismatch.rollout.validation import GREEDY_TEMPERATURE, vllm_temperature_problem
from jaxrl_mismatch.train.config import (FALSE_WORDS, OPEN_SECTIONS, TRUE_WORDS, ConfigError, base_config,
                                         check_schema, exact_forward_enabled, flatten)
from jaxrl_mismatch.train.optimizer import build_controller, build_optimizer, build_schedule
from jaxrl_mismatch.train.runlock import HARNESS_LOG_FILE, HARNESS_STATUS_FILE, LOCK_FILE, is_run_dir
from jaxrl_mismatch.usage import (FLOAT32_MAX, FLOAT32_TINY, INT32_MAX, SEED_LIMIT, UsageError, host_port, listing,
                                  path_kind)

# The rollout protocol's int32 fields (rollout/rollout.proto: SamplingParams n, max_tokens, top_k); a larger value
# fails protobuf's range check ("Value out of range") at the first Generate, after the model loaded.
_INT32_FIELDS = ("rollout.top_k", "rollout.max_tokens", "rollout.group_size", "eval.k")
# Deadlines and waits in seconds: beyond this, gRPC's deadline arithmetic overflows (every call DEADLINE_EXCEEDED
# at once) or the wait is no wait at all; 30 days.
MAX_TIMEOUT_S = 30 * 24 * 3600
_TIMEOUTS = ("rollout.startup_timeout_s", "rollout.generate_timeout_s", "rollout.push_timeout_s",
             "rollout.retry_s", "rollout.stall_timeout_s")
_SEEDS = ("seed", "task.data_seed")

_CHOICES = {
    "rollout.engine": ("jax", "vllm"),
    "rollout.dtype": precision.DTYPES,
    "rollout.quantize": ("none", "int8", "fp8"),
    "rollout.weight_transport": ("auto", "shm", "grpc"),
    "trainer.precision": precision.PRESETS,
    "distributed.initialize": ("auto", "always", "never"),
}


def _model_choices() -> dict[str, tuple[str, ...]]:
    """The trainer's model options, from the registries that implement them (imported here, not at module
    load, so that reading a config does not import Flax)."""
    from jaxrl_mismatch.models import ATTENTION_IMPLS, REMAT_POLICIES
    from jaxrl_mismatch.models.moe import REPLAY_MODES

    return {
        "trainer.routing_replay": REPLAY_MODES,
        "trainer.remat_policy": tuple(p for p in REMAT_POLICIES if p != "none"),  # "none" is trainer.remat = False
        "trainer.attention_impl": ATTENTION_IMPLS,
    }


_POSITIVE_INTS = (
    "steps", "rollout.group_size", "rollout.max_tokens", "batch.prompts_per_step", "batch.ppo_epochs",
    "batch.minibatches", "batch.microbatches", "trainer.chunk_size", "task.num_val", "eval.k",
    "checkpoint.keep", "task.max_prompt_len", "rollout.num_servers", "task.num_train",
)
_NON_NEGATIVE = (
    "batch.max_oversample_rounds", "eval.every", "checkpoint.every", "optim.warmup_steps", "rollout.top_k",
    "rollout.max_model_len", "seed", "task.data_seed", "optim.weight_decay", "objective.kl_coef", "objective.entropy_coef",
    "diagnostics.variance_sigma", "rollout.logit_noise_std", "objective.router_aux_coef",
    "rollout.mismatch_onset_step", "rollout.mismatch_ramp_steps", "rollout.max_staleness", "rollout.retry_s",
    "task.overlong_buffer_len", "task.overlong_penalty_factor",
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
    check_schema(c)
    _check_types_and_ranges(c)
    _check_sampling(c)
    _check_options_act(c)
    _check_mismatch_sources(c)
    _check_exact_and_replay(c)
    _check_rollout_and_batch(c)
    _check_registries(c)


def _check_types_and_ranges(c: ml_collections.ConfigDict) -> None:
    """Choices, integer and sign constraints of single fields (the later checks rely on them)."""
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
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:  # NaN too
            raise ConfigError(f"config.{path}: must be a number >= 0, got {v!r}")
    for path in _SEEDS:  # numpy / nnx.Rngs / the engines' int32 sampling streams (usage.check_seed)
        v = _get(c, path)
        if not isinstance(v, int) or not 0 <= v < SEED_LIMIT:
            raise ConfigError(f"config.{path}: must be an integer in [0, 2^31), got {v!r}")
    for path in _INT32_FIELDS:
        v = _get(c, path)
        if isinstance(v, int) and v > INT32_MAX:
            raise ConfigError(f"config.{path}: must be <= {INT32_MAX} (an int32 of the rollout protocol), got {v!r}")
    for path in _TIMEOUTS:
        v = _get(c, path)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v <= MAX_TIMEOUT_S:  # inf and NaN too
            raise ConfigError(f"config.{path}: must be a number of seconds <= {MAX_TIMEOUT_S} (30 days), got {v!r}")
    _check_finite_and_int32(c)
    if not c.optim.lr > 0:
        raise ConfigError(f"config.optim.lr: must be > 0, got {c.optim.lr!r}")
    if c.optim.lr < FLOAT32_TINY:  # optax's float32 step: a rate this small changed no weight (1e-50 is 0.0)
        raise ConfigError(f"config.optim.lr: {c.optim.lr!r} is below float32's smallest normal number "
                          f"({FLOAT32_TINY:.4g}): the float32 update would change nothing")
    if c.rollout.max_staleness != int(c.rollout.max_staleness):
        raise ConfigError(f"config.rollout.max_staleness: must be a whole number of versions, got {c.rollout.max_staleness!r}")
    buffer = c.task.overlong_buffer_len
    if not isinstance(buffer, int) or buffer > c.rollout.max_tokens:
        raise ConfigError(f"config.task.overlong_buffer_len: must be a whole number of tokens in [0, "
                          f"rollout.max_tokens = {c.rollout.max_tokens}] (the last tokens of the budget that are "
                          f"penalised), got {buffer!r}")


def _check_finite_and_int32(c: ml_collections.ConfigDict) -> None:
    """Every number of the fixed schema (open sections are their constructors' to check): a float is finite
    and an integer fits an int32. inf passed the `>= 0` checks (temperatures, coefficients, noise) and broke
    the run later; an integer past int32 (optim.warmup_steps = 2^40, steps = 10^20) overflowed in a jitted
    computation after the model loaded, or never ended."""
    for path, v in flatten(c).items():
        if path in OPEN_SECTIONS or isinstance(v, bool):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"config.{path}: must be a finite number, got {v!r}")
        if isinstance(v, float) and abs(v) > FLOAT32_MAX:  # inf once the jitted step or the engine casts it
            raise ConfigError(f"config.{path}: must be within float32's range (|value| <= {FLOAT32_MAX:.4g}: the "
                              f"step and the engines compute in float32), got {v!r}")
        if isinstance(v, int) and not -INT32_MAX - 1 <= v <= INT32_MAX:
            raise ConfigError(f"config.{path}: must be within the int32 range (|value| <= {INT32_MAX}), got {v!r}")


FP16_LOGITS_MIN_TEMPERATURE = 0.01


def _check_sampling(c: ml_collections.ConfigDict) -> None:
    """Sampling, evaluation, fleet and timeout fields, and what each engine can sample."""
    if not c.rollout.temperature >= GREEDY_TEMPERATURE:
        raise ConfigError(f"config.rollout.temperature: training rollouts need a temperature > 0 (the trainer "
                          f"scores π as softmax(logits / T)), got {c.rollout.temperature!r}")
    for field in ("rollout", "eval"):
        if why := vllm_temperature_problem(c.rollout.engine, c[field].temperature):
            raise ConfigError(f"config.{field}.temperature: {why}")
    if (c.trainer.precision == "fp16" and not c.trainer.fp32_lm_head
            and c.rollout.temperature < FP16_LOGITS_MIN_TEMPERATURE):
        # fp16 logits / T overflow past 65504 once |logit| > 65504·T: π = −inf or NaN where μ is finite (the
        # engine divides in float32). At T = 0.01 that needs |logit| > 655, which no LM head reaches.
        raise ConfigError(f"config.rollout.temperature: {c.rollout.temperature!r} with the fp16 trainer divides fp16 "
                          f"logits past their range (log-probs −inf / NaN); use T >= {FP16_LOGITS_MIN_TEMPERATURE} "
                          "or trainer.fp32_lm_head = True")
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
    from jaxrl_mismatch.rollout.protocol import Limits

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


def _check_options_act(c: ml_collections.ConfigDict) -> None:
    """Options that only act with another one on: set without it, the run is the one without them."""
    base = base_config()
    if c.diagnostics.weight_distortion_delta < 0 and (c.diagnostics.weight_distortion_pi_low
                                                      != base.diagnostics.weight_distortion_pi_low):
        raise ConfigError(f"config.diagnostics.weight_distortion_pi_low: {c.diagnostics.weight_distortion_pi_low!r} "
                          "does nothing while the distortion is off (weight_distortion_delta < 0)")
    if not c.trainer.remat and c.trainer.remat_policy != base.trainer.remat_policy:
        raise ConfigError(f"config.trainer.remat_policy: {c.trainer.remat_policy!r} does nothing with trainer.remat "
                          "off; set trainer.remat = True to recompute blocks with it")


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


def _check_exact_and_replay(c: ml_collections.ConfigDict) -> None:
    """Routing replay R3, exact mode and the exact training forward: what each needs of the engine and trainer."""
    if c.trainer.routing_replay == "R3":
        if c.rollout.engine != "jax":
            raise ConfigError(f"config.trainer.routing_replay: 'R3' replays the experts the rollout engine chose, and "
                              f"the {c.rollout.engine} engine does not return them (vLLM's API exposes no per-token "
                              "routing); use rollout.engine = 'jax', or 'R2' (θ_old's own routing)")
        if c.rollout.exact:
            raise ConfigError("config.trainer.routing_replay: 'R3' needs the normal sampler; exact mode returns no "
                              "routing (it already gives μ = π(θ_old))")
        if c.rollout.max_staleness:
            # π_prox replays the engine's experts, but the π_behav forward of stale rows routes freely: the
            # routing mismatch moved from the precision part to the staleness part (measured: staleness/rho_std
            # 0.1 with identical weights at every version, 0 for R2 and off).
            raise ConfigError("config.trainer.routing_replay: 'R3' with asynchronous rollouts (rollout.max_staleness "
                              f"= {c.rollout.max_staleness}) is not supported: the stale rows' behaviour forward does "
                              "not replay the engine's routing, so the staleness/precision split would be wrong; use "
                              "'R2', or max_staleness = 0")
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
    # a None-valued field takes literals from the command line: also true/false words, and 1/0 as the boolean fields
    # take them (`--config.trainer.exact_forward=1` arrives as the int 1)
    v = c.trainer.exact_forward
    if not (v is None or isinstance(v, bool) or (isinstance(v, int) and v in (0, 1))
            or (isinstance(v, str) and v.lower() in TRUE_WORDS + FALSE_WORDS)):
        raise ConfigError(f"config.trainer.exact_forward: must be None, True or False (or 1 / 0), got "
                          f"{c.trainer.exact_forward!r}")
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


def _check_rollout_and_batch(c: ml_collections.ConfigDict) -> None:
    """Group size, rollout addresses, staleness, model path, the batch split and the mesh axes."""
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
            from jaxrl_mismatch.rollout.shm import is_local_target  # the client's own rule: 127.*, 0.0.0.0, LocalHost

            remote = [a for a in addresses if not is_local_target(a)]
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
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ConfigError(f"config.trainer.mesh.{axis}: must be a positive integer or -1, got {size!r}")


def _check_registries(c: ml_collections.ConfigDict) -> None:
    """Names resolved by their registries (each raises listing the valid names) and the arguments they take."""
    from jaxrl_mismatch.data import TASKS
    from jaxrl_mismatch.objectives.policy import InertOverrideError, check_overrides_act
    from jaxrl_mismatch.schedules import CONTROLLERS, OPTIMIZERS, SCHEDULES

    from jaxrl_mismatch.data.arithmetic import SPLITS
    from jaxrl_mismatch.data.templates import TEMPLATES

    if c.task.name not in TASKS:
        raise ConfigError(f"config.task.name: unknown task {c.task.name!r}; valid: {sorted(TASKS)}")
    if c.task.template and c.task.template not in TEMPLATES:
        raise ConfigError(f"config.task.template: unknown prompt template {c.task.template!r}; valid: "
                          f"{sorted(TEMPLATES)} (or '' for the task's default)")
    if c.task.name == "arithmetic":  # generated problems: the splits the generator hashes prompts into
        # it reads no files: task.files / task.data_dir would be silently ignored
        if c.task.files:
            raise ConfigError(f"config.task.files: {sorted(c.task.files.keys())} do nothing for task 'arithmetic', "
                              "which generates its problems; use a file-backed task (e.g. task.name = 'prompts') or "
                              "clear them (--config.task.files={})")
        if c.task.data_dir:
            raise ConfigError(f"config.task.data_dir: {c.task.data_dir!r} does nothing for task 'arithmetic', which "
                              "generates its problems; leave it empty")
        for field in ("train_split", "val_split"):
            if c.task[field] not in SPLITS:
                raise ConfigError(f"config.task.{field}: unknown split {c.task[field]!r}; valid: {list(SPLITS)}")
    else:  # file-backed tasks read local JSONL files, one per split
        base = base_config().task
        for field, what in (("num_train", "every record of the train file is used"),
                            ("data_seed", "the records are the files', in their order")):
            if c.task[field] != base[field]:  # the arithmetic generator's: a file task was silently given all
                raise ConfigError(f"config.task.{field}: {c.task[field]!r} does nothing for task {c.task.name!r} "
                                  f"({what}); it sizes and seeds the generated 'arithmetic' task only")
        for field in ("train_split", "val_split"):
            split = c.task[field]
            if not isinstance(split, str) or not split:
                raise ConfigError(f"config.task.{field}: must be a split name (a key of task.files), got {split!r}")
            path = c.task.files.get(split)
            if not path:
                raise ConfigError(f"config.task.files.{split}: task {c.task.name!r} reads local JSONL files; "
                                  f"set --config.task.files.{split}=PATH")
            paths = [path] if isinstance(path, str) else list(path) if isinstance(path, (list, tuple)) else None
            if paths is None or not all(isinstance(p, str) and p for p in paths):
                raise ConfigError(f"config.task.files.{split}: must be a path (or a list of paths), got {path!r}")
    if not isinstance(c.model.warmstart_args, str):
        raise ConfigError(f"config.model.warmstart_args: must be a string of arguments, got {c.model.warmstart_args!r}")
    try:
        shlex.split(c.model.warmstart_args)
    except ValueError as e:  # an unbalanced quote: `No closing quotation`
        raise ConfigError(f"config.model.warmstart_args: {e} in {c.model.warmstart_args!r}") from None

    if c.optim.name not in OPTIMIZERS:
        raise ConfigError(f"config.optim.name: unknown optimizer {c.optim.name!r}; valid: {sorted(OPTIMIZERS)}")
    if c.optim.schedule not in SCHEDULES:
        raise ConfigError(f"config.optim.schedule: unknown schedule {c.optim.schedule!r}; valid: {sorted(SCHEDULES)}")
    try:
        schedule = build_schedule(c.optim)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.optim.schedule_kwargs: {e}") from None
    try:  # the jitted schedule at the first step: a step count past int32 (warmup_steps, decay_steps) overflows
        if callable(schedule):
            schedule(0)
    except (OverflowError, ValueError, TypeError) as e:
        raise ConfigError(f"config.optim: the LR schedule cannot be evaluated ({' '.join(str(e).split())[:200]}); "
                          "check optim.warmup_steps and optim.schedule_kwargs") from None
    try:
        build_optimizer(c.optim)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.optim: {e}") from None
    if c.controller.name == "none" and c.controller.kwargs:  # build_controller reads them only for a controller
        raise ConfigError(f"config.controller.kwargs: {sorted(c.controller.kwargs.keys())} do nothing with "
                          "controller.name = 'none'; choose a controller or clear them (--config.controller.kwargs={})")
    if c.controller.name != "none" and c.controller.name not in CONTROLLERS:
        raise ConfigError(
            f"config.controller.name: unknown controller {c.controller.name!r}; valid: ['none'] + {sorted(CONTROLLERS)}"
        )
    try:
        check_overrides_act(c.objective.preset, c.objective.overrides.to_dict())  # builds it: every field's check
    except InertOverrideError as e:
        raise ConfigError(f"config.objective.overrides.{e.field}: {e}") from None
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
    if not str(c.run_dir).strip():
        raise ConfigError("config.run_dir: empty; give the run directory (new, empty, or an earlier run's)")
    if os.path.islink(c.run_dir) and not os.path.exists(c.run_dir):
        raise ConfigError(f"config.run_dir: {c.run_dir} is a symbolic link to a missing path "
                          f"({os.readlink(c.run_dir)}); expected a (new or existing) run directory")
    if os.path.lexists(c.run_dir) and not os.path.isdir(c.run_dir):
        raise ConfigError(f"config.run_dir: {c.run_dir} {path_kind(c.run_dir)}; expected a (new or existing) run "
                          "directory")
    lock = os.path.join(c.run_dir, LOCK_FILE)
    if os.path.lexists(lock) and (os.path.islink(lock) or not os.path.isfile(lock)):
        raise ConfigError(f"config.run_dir: its run lock {lock} is "
                          f"{'a symbolic link' if os.path.islink(lock) else 'not a regular file'}; the trainer "
                          "writes its PID there: remove it or use another run_dir")
    if os.path.isdir(c.run_dir):  # a run starts in a new or empty folder, or resumes its own
        entries = sorted(os.listdir(c.run_dir))
        if not is_run_dir(c.run_dir) and not set(entries) <= {HARNESS_LOG_FILE, HARNESS_STATUS_FILE}:
            raise ConfigError(f"config.run_dir: {c.run_dir} is a non-empty directory not written by "
                              f"`jaxrl-mismatch train` (holds {listing(entries)}); choose a new or empty directory "
                              "(nothing was changed)")
    existing = os.path.abspath(c.run_dir)
    while not os.path.exists(existing):  # the run directory, or the ancestor it will be created in
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"config.run_dir: {c.run_dir} cannot be written ({existing} is "
                          f"{'not a directory' if not os.path.isdir(existing) else 'not writable'})")
    has_model = os.path.isfile(os.path.join(c.model.path, "config.json"))
    if not c.model.warmstart_if_missing and not has_model:
        what = "does not exist" if not os.path.exists(c.model.path) else "has no config.json"
        raise ConfigError(f"config.model.path: {c.model.path} {what}; point it to a local HF checkpoint directory")
    if c.task.name != "arithmetic":
        for split in (c.task.train_split, c.task.val_split):
            path = c.task.files[split]
            for p in [path] if isinstance(path, str) else list(path):  # paths: `validate` checked their type
                if not os.path.isfile(p):
                    raise ConfigError(f"config.task.files.{split}: {p} {path_kind(p)}; expected a JSONL file")
    token = c.rollout.token_file
    if token and not os.path.isfile(token):  # read only when the server is attached: after the model loaded
        raise ConfigError(f"config.rollout.token_file: {token} {path_kind(token)}; give the file holding the server's "
                          "token")
    if c.task.name == "arithmetic" and has_model:  # a warm start's arguments: jobs/_inputs.check_warmstart_args
        from jaxrl_mismatch.data.arithmetic import ArithmeticSpec, read_task_json

        try:
            spec = ArithmeticSpec(**read_task_json(c.model.path)[0])
        except ValueError as e:  # a damaged task.json: one line naming the field and the file
            raise ConfigError(f"config.model.path: {e}") from None
        check_task_capacity(c, spec)


def check_task_files(c: ml_collections.ConfigDict) -> None:
    """Every line of a file task's JSONL files reads as a record with a gold answer the reward can read; ConfigError
    naming the file and line. Before any work: the run built the dataset (and found a bad line) only after a warm
    start or the model's load. Reading is cheap next to that (no dataset is built; `build` reads them again)."""
    from jaxrl_mismatch.data import get_task

    check = get_task(c.task.name).check_files
    if check is None:
        return
    try:
        check(c.task.files.to_dict())
    except (ValueError, OSError) as e:  # math_datasets.DataFormatError: file, line and field
        raise ConfigError(f"config.task.files: {e}") from None


def check_task_capacity(c: ml_collections.ConfigDict, spec) -> None:
    """`task.num_train` / `num_val` within the distinct problems of their arithmetic split (`data.arithmetic.generate`
    draws unique problems; asked for more, it failed after the run directory existed, or drew for hours)."""
    for field, split in (("num_train", c.task.train_split), ("num_val", c.task.val_split)):
        capacity = spec.split_capacity(split)
        if c.task[field] > capacity:
            raise ConfigError(f"config.task.{field}: {c.task[field]} unique problems asked for, but the {split!r} "
                              f"split of the task's {spec} holds at most {capacity} (its share of "
                              f"{spec.num_problems} distinct problems)")


def check_model(c: ml_collections.ConfigDict, model_cfg) -> None:
    """The options that need a mixture-of-experts policy are off for a dense one, a response fits the model's
    context, and `trainer.attention_impl = 'cudnn'` can run here; ConfigError naming the field."""
    if c.trainer.attention_impl == "cudnn":  # else the first jitted forward fails, after the warm start and a rollout
        import jax

        why = ("it needs a GPU (this process's JAX backend is " + jax.default_backend() + ")"
               if jax.default_backend() != "gpu" else
               "it needs bf16/fp16 compute (trainer.precision)" if c.trainer.precision == "fp32" else
               "it needs unpacked rows (trainer.packing = False)" if c.trainer.packing else
               f"it needs head_dim a multiple of 8, <= 128 (the model's is {model_cfg.head_dim})"
               if model_cfg.head_dim % 8 or model_cfg.head_dim > 128 else None)
        if why:
            raise ConfigError(f"config.trainer.attention_impl: 'cudnn' cannot run: {why}; use 'auto', 'xla' or "
                              "'chunked'")
    if c.rollout.max_tokens >= model_cfg.max_position_embeddings:  # the rollout server would fail at step 0
        raise ConfigError(f"config.rollout.max_tokens: {c.rollout.max_tokens} response tokens do not fit with a "
                          f"prompt in the context of {c.model.path} (max_position_embeddings "
                          f"{model_cfg.max_position_embeddings})")
    if c.rollout.max_model_len > model_cfg.max_position_embeddings:  # the server refuses it at start-up
        raise ConfigError(f"config.rollout.max_model_len: {c.rollout.max_model_len} exceeds the context of "
                          f"{c.model.path} (max_position_embeddings {model_cfg.max_position_embeddings}); use at "
                          "most that, or 0 for the model's own")
    if c.rollout.max_model_len and c.rollout.max_tokens >= c.rollout.max_model_len:
        raise ConfigError(f"config.rollout.max_tokens: {c.rollout.max_tokens} response tokens do not fit with a "
                          f"prompt in rollout.max_model_len {c.rollout.max_model_len}")
    expert = c.trainer.mesh.get("expert", 1)
    if model_cfg.is_moe:
        if expert > 1 and model_cfg.num_experts % expert:  # the split was dropped: every device held every expert
            raise ConfigError(f"config.trainer.mesh.expert: {expert} does not divide the {model_cfg.num_experts} "
                              f"experts of {c.model.path}; use a divisor of {model_cfg.num_experts}")
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
    if expert != 1:  # a dense model has no experts to split: the axis was one more data-parallel axis
        raise ConfigError(f"config.trainer.mesh.expert: {expert} splits experts, but {c.model.path} is a dense "
                          f"{model_cfg.architecture}; use the data or fsdp axis")


def check_model_dir(c: ml_collections.ConfigDict) -> None:
    """The policy at `model.path` (after any warm start): its config.json reads (`check_model` on it) and its
    weight files open and hold config.json's tensors (`hf_io.check_model_files`); ConfigError naming `model.path`. Run before the trainer creates
    or locks the run directory."""
    from jaxrl_mismatch.models.config import ModelConfig
    from jaxrl_mismatch.models.hf_io import ModelFilesError, check_model_files

    try:
        model_cfg = ModelConfig.from_hf(c.model.path)
    except (ValueError, OSError) as e:  # a damaged or unsupported config.json: one line naming it
        raise ConfigError(f"config.model.path: {c.model.path}: {e}") from None
    check_model(c, model_cfg)
    try:
        check_model_files(c.model.path, model_cfg)
    except ModelFilesError as e:
        raise ConfigError(f"config.model.path: {e}") from None


def check_mesh(c: ml_collections.ConfigDict):
    """The trainer's mesh on this job's devices; ConfigError naming `trainer.mesh` if it does not fit, or
    `batch` if a minibatch's rows cannot be split evenly over the devices the batch is sharded on (XLA would
    refuse the first update's sharding only after the model is loaded and a rollout collected)."""
    from jaxrl_mismatch.models.sharding import batch_axes, make_mesh

    try:
        mesh = make_mesh(c.trainer.mesh.to_dict())
    except ValueError as e:
        raise ConfigError(f"config.trainer.mesh: {e}") from None
    axes = batch_axes(mesh)
    shards = math.prod(mesh.shape[a] for a in axes)
    minibatch_rows = c.batch.prompts_per_step * c.rollout.group_size // c.batch.minibatches
    if minibatch_rows % shards:
        raise ConfigError(
            f"config.batch: a minibatch of {minibatch_rows} rows (prompts_per_step × group_size / minibatches) "
            f"does not split over the {shards} devices the batch is sharded on (trainer.mesh "
            f"{' × '.join(f'{a}={mesh.shape[a]}' for a in axes)}); make the minibatch a multiple of {shards} rows "
            "or shard the batch over fewer devices")
    return mesh
