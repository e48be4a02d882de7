"""The bash launchers and setup scripts (`launch/*.sh`, `scripts/*.sh`) on bad input and their plumbing.

Nothing real starts here: `nvidia-smi`, `gcloud`, the trainer processes and the `.venv` executables are small
fakes in tmp_path that record how they were called. Bad input must be one stderr line naming the variable,
flag or file, exit 2, no traceback, and nothing started or written.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*REPO.glob("launch/*.sh"), *REPO.glob("scripts/*.sh")])
REAL_PYTHON = REPO / ".venv" / "bin" / "python"
if not REAL_PYTHON.exists():
    REAL_PYTHON = Path(sys.executable)


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _fake_bin(tmp_path: Path, gpus: str = "0") -> Path:
    """A folder for PATH's front: nvidia-smi lists `gpus` (comma list) and records each call; gcloud records
    its --command argument."""
    bin_dir = tmp_path / "fakebin"
    listing = "".join(f"echo {g}\n" for g in gpus.split(","))
    _executable(bin_dir / "nvidia-smi", f"#!/bin/sh\necho called >> '{tmp_path}/nvidia-smi.calls'\n{listing}")
    _executable(bin_dir / "gcloud", f"""#!/usr/bin/env bash
while [ $# -gt 0 ]; do
  if [ "$1" = --command ]; then printf '%s' "$2" > '{tmp_path}/gcloud.command'; fi
  shift
done
""")
    return bin_dir


def _run(cmd, tmp_path: Path, cwd: Path = REPO, gpus: str = "0", timeout: float = 60, **env_vars):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_PROCESSES", "LOCAL_DEVICES", "PYTHON", "TOKEN_FILE", "REPO_DIR", "PORT",
                        "ROLLOUT_ENGINE", "ROLLOUT_DTYPE", "ROLLOUT_MEM", "TRAINER_MEM", "TRAINER_GPUS",
                        "ROLLOUT_GPU", "PYTEST_WORKERS", "QUANTIZE", "MAX_MODEL_LEN")}
    env["PATH"] = f"{_fake_bin(tmp_path, gpus)}:{env['PATH']}"
    env.update(env_vars)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _refused(out, *names: str) -> str:
    """Exit 2 with one stderr line naming every one of `names`, no traceback; the line."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_scripts_parse(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("script", ["launch/rollout_server.sh", "launch/single_node_gpu.sh",
                                    "launch/slurm_gpu.sh", "launch/tpu_pod.sh"])
def test_missing_arguments_are_a_usage_line(tmp_path, script):
    out = _run(["bash", str(REPO / script)], tmp_path, cwd=tmp_path)
    assert _refused(out).startswith("usage:")
    assert not (tmp_path / "nvidia-smi.calls").exists() and not (tmp_path / "gcloud.command").exists()
    assert not (tmp_path / "rollout_token").exists()


# --- launch/single_node_gpu.sh -------------------------------------------------------------------------------

BAD_ENV = [("ROLLOUT_ENGINE", "torch"), ("ROLLOUT_DTYPE", "fp8"), ("PORT", "0"), ("PORT", "65536"),
           ("PORT", "50o51"), ("ROLLOUT_MEM", "0"), ("ROLLOUT_MEM", "1.5"), ("ROLLOUT_MEM", "half"),
           ("TRAINER_MEM", "-0.2"), ("TRAINER_MEM", "0.0"), ("TRAINER_GPUS", "0,x"), ("TRAINER_GPUS", "0,,1"),
           ("ROLLOUT_GPU", "0,1"), ("ROLLOUT_GPU", "gpu0")]


@pytest.mark.parametrize("name,value", BAD_ENV, ids=[f"{n}={v}" for n, v in BAD_ENV])
def test_single_node_checks_environment_before_anything(tmp_path, name, value):
    token = tmp_path / "token"
    out = _run(["bash", "launch/single_node_gpu.sh", "configs/arith_length_cpu.py",
                f"--config.model.path={tmp_path / 'nomodel'}"], tmp_path, TOKEN_FILE=str(token), **{name: value})
    _refused(out, name)
    assert not (tmp_path / "nvidia-smi.calls").exists(), "nvidia-smi ran before the environment was checked"
    assert not token.exists()


@pytest.mark.parametrize("name,value", [("TRAINER_GPUS", "0,5"), ("ROLLOUT_GPU", "3")])
def test_single_node_refuses_gpus_the_node_lacks(tmp_path, name, value):
    token = tmp_path / "token"
    out = _run(["bash", "launch/single_node_gpu.sh", "configs/arith_length_cpu.py"], tmp_path, gpus="0,1",
               TOKEN_FILE=str(token), **{name: value})
    _refused(out, name)
    assert not token.exists()


def test_single_node_bad_config_is_one_line(tmp_path):
    (tmp_path / "broken.py").write_text("def get_config(:\n")
    cases = {"missing.py": "missing.py", "broken.py": "broken.py",
             # the documented FILE:VARIANT form, with a variant the config lacks
             str(REPO / "configs/arith_length_cpu.py") + ":nosuch": "arith_length_cpu.py"}
    for config, named in cases.items():
        token = tmp_path / "token"
        out = _run(["bash", str(REPO / "launch/single_node_gpu.sh"), config], tmp_path, cwd=tmp_path,
                   TOKEN_FILE=str(token))
        _refused(out, named)
        assert not token.exists()
    # the overrides are read as `train` reads them (config_overrides.parse_overrides): a stray argument is named
    for extra, named in ((["--bogus"], "unrecognised argument '--bogus'"), (["--config.steps"], "needs a value")):
        out = _run(["bash", "launch/single_node_gpu.sh", "configs/tiny_cpu.py", *extra], tmp_path,
                   TOKEN_FILE=str(tmp_path / "token"))
        _refused(out, named)
        assert out.stderr.count("single_node_gpu.sh:") == 1
    # a valid FILE:VARIANT is loaded (the refusal is then about its model.path, not the config)
    out = _run(["bash", "launch/single_node_gpu.sh", "configs/arith_length_cpu.py:long",
                f"--config.model.path={tmp_path / 'nomodel'}"], tmp_path, TOKEN_FILE=str(tmp_path / "token"))
    _refused(out, "model.path", "nomodel")


def _fake_repo(tmp_path: Path) -> Path:
    """A copy of launch/single_node_gpu.sh in a repo whose .venv runs the real interpreter (the config loader)
    and a fake `jaxrl-mismatch` that records its arguments; `serve` writes its ready file and waits."""
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    shutil.copy(REPO / "launch/single_node_gpu.sh", repo / "launch/single_node_gpu.sh")
    shutil.copy(REPO / "launch/config_model_path.py", repo / "launch/config_model_path.py")  # its config check
    _executable(repo / ".venv/bin/python", f'#!/bin/sh\nexec "{REAL_PYTHON}" "$@"\n')
    _executable(repo / ".venv/bin/jaxrl-mismatch", f"""#!/usr/bin/env bash
[ "$1" = serve ] && [ "$2" = --help ] && exit 0
printf '%s\\n' "$@" > '{tmp_path}/'"$1.args"
env > '{tmp_path}/'"$1.env"
if [ "$1" = serve ]; then
  while [ $# -gt 0 ]; do [ "$1" = --ready-file ] && echo '{{"ready": true}}' > "$2"; shift; done
  exec sleep 60
fi
""")
    return repo


@pytest.mark.parametrize("engine", ["vllm", "jax"])
def test_single_node_relative_paths_and_memory_share(tmp_path, engine):
    repo = _fake_repo(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    caller = tmp_path / "caller"
    caller.mkdir()
    (caller / "cfg.py").write_text(
        "from jaxrl_mismatch.train.config import base_config\n\n\n"
        "def get_config(variant=''):\n"
        "    assert variant == 'v', variant\n"
        "    c = base_config()\n"
        f"    c.model.path = {str(model)!r}\n"
        "    c.rollout.dtype = 'float16'\n"
        f"    c.rollout.quantize = {'fp8' if engine == 'vllm' else 'int8'!r}\n"
        f"    c.rollout.max_model_len = {0 if engine == 'vllm' else 256}\n"
        "    return c\n")
    start = time.monotonic()
    out = _run(["bash", str(repo / "launch/single_node_gpu.sh"), "cfg.py:v", "--config.steps=3"], tmp_path,
               cwd=caller, ROLLOUT_ENGINE=engine, TOKEN_FILE="tok", PYTHONPATH=str(REPO), timeout=30)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - start < 20
    serve = (tmp_path / "serve.args").read_text().splitlines()
    train = (tmp_path / "train.args").read_text().splitlines()
    token = caller / "tok"  # the caller's relative TOKEN_FILE, not the repo root's
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text().strip()) == 64
    assert not (repo / "tok").exists() and not (repo / "rollout_token").exists()
    assert serve[serve.index("--token-file") + 1] == str(token)
    assert serve[serve.index("--model") + 1] == str(model)
    assert train[:3] == ["train", "--config", f"{caller}/cfg.py:v"]
    assert f"--config.rollout.token_file={token}" in train and train[-1] == "--config.steps=3"
    # The server's precision is the config's (it was bfloat16 whatever the config said: an FP16 run measured the
    # BF16 mismatch); ROLLOUT_ENGINE, given, reaches both the server and the trainer's config.
    assert serve[serve.index("--dtype") + 1] == "float16" and serve[serve.index("--engine") + 1] == engine
    assert f"--config.rollout.engine={engine}" in train and not any("rollout.dtype" in a for a in train)
    # and its quantization and context limit (the trainer refused the server after it had loaded: no --quantize)
    assert serve[serve.index("--quantize") + 1] == ("fp8" if engine == "vllm" else "int8")
    assert (serve[serve.index("--max-model-len") + 1] == "256") if engine == "jax" else "--max-model-len" not in serve
    serve_env = (tmp_path / "serve.env").read_text().splitlines()
    if engine == "vllm":  # one GPU, shared: the server's share is passed, whatever serve --help says
        assert serve[serve.index("--gpu-memory-utilization") + 1] == "0.45"
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.45" not in serve_env
    else:
        assert "--gpu-memory-utilization" not in serve
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.45" in serve_env
    assert "shared" not in out.stderr and "flag" not in out.stderr


# --- launch/slurm_gpu.sh (local mode) ------------------------------------------------------------------------

FAKE_TRAINER = """#!/usr/bin/env bash
if [ "$1" = -c ]; then echo 12345; exit 0; fi
case "$1" in */launch/config_model_path.py) echo checked >> "{out}/checks"; exit 0;; esac
printf '%s\\n' "$JAX_NUM_PROCESSES" "$XLA_FLAGS" "$@" > "{out}/proc$JAX_PROCESS_ID.args"
case "$JAX_PROCESS_ID" in
  0) exit 0 ;;
  1) sleep 0.5; exit 3 ;;
  *) exec sleep 60 ;;
esac
"""


def test_slurm_local_first_failure_stops_the_others(tmp_path):
    py = _executable(tmp_path / "fakepy", FAKE_TRAINER.format(out=tmp_path))
    (tmp_path / "cfg.py").write_text("")
    start = time.monotonic()
    out = _run(["bash", "launch/slurm_gpu.sh", f"{tmp_path}/cfg.py:v", "--config.a=b c", "--config.x=;y"],
               tmp_path, LOCAL_PROCESSES="3", LOCAL_DEVICES="2", PYTHON=str(py), timeout=30,
               XLA_FLAGS="--xla_cpu_use_fusion_emitters=false")
    assert time.monotonic() - start < 20, "process 2 (sleeping) was not stopped"
    assert out.returncode == 3, (out.returncode, out.stderr)
    assert "no such job" not in out.stderr and "wait:" not in out.stderr, out.stderr
    for i in range(3):
        args = (tmp_path / f"proc{i}.args").read_text().splitlines()
        # the caller's XLA flags are kept; the device count is appended (XLA takes a flag's last value)
        assert args == ["3", "--xla_cpu_use_fusion_emitters=false --xla_force_host_platform_device_count=2",
                        "-m", "jaxrl_mismatch.cli", "train",
                        "--config", f"{tmp_path}/cfg.py:v", "--config.distributed.initialize=always",
                        "--config.a=b c", "--config.x=;y"]


@pytest.mark.parametrize("name,value", [("LOCAL_PROCESSES", "00"), ("LOCAL_PROCESSES", "08"),
                                        ("LOCAL_PROCESSES", "010"), ("LOCAL_PROCESSES", ""),
                                        ("LOCAL_DEVICES", "00"), ("LOCAL_DEVICES", "08"),
                                        ("LOCAL_DEVICES", "")])
def test_slurm_local_counts_without_leading_zeros(tmp_path, name, value):
    py = _executable(tmp_path / "fakepy", FAKE_TRAINER.format(out=tmp_path))
    (tmp_path / "cfg.py").write_text("")
    env = {"LOCAL_PROCESSES": "2", "PYTHON": str(py), name: value}
    out = _run(["bash", "launch/slurm_gpu.sh", str(tmp_path / "cfg.py")], tmp_path, **env)
    _refused(out, name)
    assert "srun" not in out.stderr
    assert not list(tmp_path.glob("proc*.args"))


def test_slurm_local_missing_config_checked_once(tmp_path):
    py = _executable(tmp_path / "fakepy", FAKE_TRAINER.format(out=tmp_path))
    out = _run(["bash", "launch/slurm_gpu.sh", f"{tmp_path}/missing.py:variant"], tmp_path,
               LOCAL_PROCESSES="2", PYTHON=str(py))
    line = _refused(out, f"{tmp_path}/missing.py")
    assert ":variant" not in line
    assert not list(tmp_path.glob("proc*.args"))


# --- launch/tpu_pod.sh -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("repo_dir", [None, "/srv/my repo"])
def test_tpu_pod_quotes_the_remote_command(tmp_path, repo_dir):
    args = ["--config.run_dir=runs/a b", "--config.note=x;touch pwned", "--config.q='\"$(id)`id`"]
    env = {} if repo_dir is None else {"REPO_DIR": repo_dir}
    out = _run(["bash", "launch/tpu_pod.sh", "tpu", "zone", "my configs/c.py:v", *args], tmp_path, **env)
    assert out.returncode == 0, out.stderr
    remote = (tmp_path / "gcloud.command").read_text()
    head, sep, rest = remote.partition(" && ")
    assert sep
    # the workers' shell would see exactly these words (the default repo's $HOME expands there, not here)
    home = "/home/worker"
    parsed = subprocess.run(["bash", "-c", f'HOME={home}; {head.replace("cd ", "printf %s ", 1)}'],
                            capture_output=True, text=True).stdout
    assert parsed == (f"{home}/jaxrl_mismatch" if repo_dir is None else repo_dir)
    words = subprocess.run(["bash", "-c", f"printf '%s\\n' {rest}"], capture_output=True, text=True).stdout
    assert words.splitlines() == [".venv/bin/jaxrl-mismatch", "train", "--config", "my configs/c.py:v",
                                  "--config.distributed.initialize=always", *args]
    assert shlex.split(rest)[3:] == ["my configs/c.py:v", "--config.distributed.initialize=always", *args]
    assert not (tmp_path / "pwned").exists() and not (REPO / "pwned").exists()


def test_tpu_pod_comment_matches_the_flag():
    text = (REPO / "launch/tpu_pod.sh").read_text()
    passed = text.split("--config.distributed.initialize=")[-1].split()[0].strip('"')
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert f"--config.distributed.initialize={passed}" in header


# --- launch/rollout_server.sh ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,named", [(["nomodel"], "MODEL_DIR"), (["model", "0"], "PORT"),
                                        (["model", "port"], "PORT"), (["model", "50051", "fp8"], "DTYPE")])
def test_rollout_server_checks_inputs_before_the_token(tmp_path, args, named):
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{}")
    out = _run(["bash", str(REPO / "launch/rollout_server.sh"), *args], tmp_path, cwd=tmp_path)
    _refused(out, named)
    assert not (tmp_path / "rollout_token").exists()


@pytest.mark.parametrize("env, named", [({"QUANTIZE": "int8"}, "QUANTIZE"), ({"MAX_MODEL_LEN": "0"}, "MAX_MODEL_LEN"),
                                       ({"MAX_MODEL_LEN": "4k"}, "MAX_MODEL_LEN")])
def test_rollout_server_checks_quantize_and_max_model_len_before_the_token(tmp_path, env, named):
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{}")
    out = _run(["bash", str(REPO / "launch/rollout_server.sh"), "model"], tmp_path, cwd=tmp_path, **env)
    _refused(out, named)
    assert not (tmp_path / "rollout_token").exists()


def test_rollout_server_passes_quantize_and_max_model_len_to_serve(tmp_path):
    """It could not serve a quantized config's rollouts: serve got no --quantize, and the trainer refused the server
    once it had loaded (config.rollout.quantize)."""
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    shutil.copy(REPO / "launch/rollout_server.sh", repo / "launch/rollout_server.sh")
    _executable(repo / ".venv/bin/jaxrl-mismatch", f"#!/bin/sh\nprintf '%s\\n' \"$@\" > '{tmp_path}/serve.args'\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{}")
    for env, want in (({}, (["--quantize", "none"], None)),
                      ({"QUANTIZE": "fp8", "MAX_MODEL_LEN": "4096"}, (["--quantize", "fp8"], "4096"))):
        out = _run(["bash", str(repo / "launch/rollout_server.sh"), "model"], tmp_path, cwd=tmp_path, **env)
        assert out.returncode == 0, out.stderr
        args = (tmp_path / "serve.args").read_text().splitlines()
        assert args[args.index("--quantize"): args.index("--quantize") + 2] == want[0]
        assert (args[args.index("--max-model-len") + 1] if "--max-model-len" in args else None) == want[1]


def test_rollout_server_keeps_an_empty_token_file(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{}")
    (tmp_path / "tok").write_text("")
    out = _run(["bash", str(REPO / "launch/rollout_server.sh"), "model"], tmp_path, cwd=tmp_path,
               TOKEN_FILE="tok")
    _refused(out, "TOKEN_FILE")
    assert (tmp_path / "tok").read_text() == ""


# --- scripts/setup_env.sh, scripts/test.sh -------------------------------------------------------------------

def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("entry", ["setup_env.sh", "test.sh"])
def test_setup_refuses_a_gpu_venv(tmp_path, entry):
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for name in ("setup_env.sh", "test.sh"):
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / ".venv").mkdir()
    (root / ".venv/.installed-gpu").write_text("stamp\n")
    before = _tree(root)
    args = ["test"] if entry == "setup_env.sh" else []
    out = _run(["bash", f"scripts/{entry}", *args], tmp_path, cwd=root, timeout=30)
    _refused(out, ".venv/.installed-gpu", "setup_gpu.sh")
    assert _tree(root) == before


@pytest.mark.parametrize("script, args", [("setup_env.sh", ["test", "vllm"]), ("setup_env.sh", ["demo", "--force"]),
                                          ("setup_gpu.sh", ["test"])])
def test_setups_refuse_an_argument_they_do_not_take(tmp_path, script, args):
    """An extra argument was ignored (`setup_env.sh test vllm` ran the test setup as if it meant something)."""
    root = _checkout(tmp_path, script)
    before = _tree(root)
    out = _run(["bash", f"scripts/{script}", *args], tmp_path, cwd=root, timeout=20, PYTHON=str(REAL_PYTHON))
    _refused(out, script, args[-1])
    assert _tree(root) == before


def test_test_sh_checks_pytest_workers(tmp_path):
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts/test.sh", root / "scripts/test.sh")
    _executable(root / "scripts/setup_env.sh", f"#!/bin/sh\ntouch '{tmp_path}/setup.ran'\n")
    out = _run(["bash", "scripts/test.sh"], tmp_path, cwd=root, PYTEST_WORKERS="two")
    _refused(out, "PYTEST_WORKERS")
    assert not (tmp_path / "setup.ran").exists()


def test_launch_docs_name_the_environment():
    docs = (REPO / "docs/models.md").read_text() + (REPO / "README.md").read_text()
    headers = {name: (REPO / name).read_text() for name in
               ("launch/tpu_pod.sh", "launch/rollout_server.sh", "scripts/test.sh", "scripts/setup_env.sh")}
    for script, var in (("launch/tpu_pod.sh", "REPO_DIR"), ("launch/rollout_server.sh", "TOKEN_FILE"),
                        ("scripts/test.sh", "PYTEST_WORKERS"), ("scripts/setup_env.sh", "PYTHON")):
        assert f"#   {var}" in headers[script], (script, var)
        assert var in docs, var
    assert "--gpu-memory-utilization" in (REPO / "launch/single_node_gpu.sh").read_text()
    assert "serve --help" not in (REPO / "launch/single_node_gpu.sh").read_text()


# --- signals, bounds and missing tools (launchers and setup scripts) ------------------------------------------

BASH = shutil.which("bash")


def _gone(pid: int, within: float = 10.0) -> bool:
    """Whether process `pid` is gone (or a zombie that nobody here owns) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
                return True
        except (OSError, IndexError):
            return True
        time.sleep(0.05)
    return False


def _wait_for(path: Path, within: float = 15.0) -> str:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written")


def _popen(cmd, tmp_path: Path, cwd: Path, **env_vars) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_PROCESSES", "LOCAL_DEVICES", "PYTHON",
                                                          "TOKEN_FILE", "LOCAL_STOP_GRACE")}
    env["PATH"] = f"{_fake_bin(tmp_path)}:{env['PATH']}"
    env.update(env_vars)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_signals)


def _default_signals() -> None:
    """Start the launcher with INT and HUP at their defaults, as a terminal or sbatch does. A suite run under
    `nohup` or as a background job without job control hands its children HUP / INT ignored, and bash cannot trap
    a signal ignored on entry: the launcher then (rightly) keeps ignoring it, which is not what these tests ask."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _reap(proc: subprocess.Popen, pids=()):
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.communicate(timeout=10)


@pytest.mark.parametrize("sig,name", [(15, "TERM"), (2, "INT"), (1, "HUP")])
def test_single_node_signal_reaches_the_trainer(tmp_path, sig, name):
    repo = _fake_repo(tmp_path)
    _executable(repo / ".venv/bin/jaxrl-mismatch", f"""#!/usr/bin/env bash
if [ "$1" = serve ]; then
  echo $$ > '{tmp_path}/serve.pid'
  while [ $# -gt 0 ]; do [ "$1" = --ready-file ] && echo '{{"ready": true}}' > "$2"; shift; done
  exec sleep 60
fi
trap 'kill $s 2>/dev/null; echo TERM > "{tmp_path}/train.sig"; exit 143' TERM
sleep 60 & s=$!
echo $$ > '{tmp_path}/train.pid'
wait $s
""")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    proc = _popen([BASH, str(repo / "launch/single_node_gpu.sh"), str(REPO / "configs/tiny_cpu.py"),
                   f"--config.model.path={model}"], tmp_path, cwd=tmp_path, TOKEN_FILE=str(tmp_path / "tok"),
                  PYTHONPATH=str(REPO))
    pids = []
    try:
        pids = [int(_wait_for(tmp_path / "serve.pid")), int(_wait_for(tmp_path / "train.pid"))]
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 143, (proc.returncode, err)
        assert (tmp_path / "train.sig").read_text().strip() == "TERM"  # forwarded as SIGTERM, whatever came
        assert _gone(pids[0]) and _gone(pids[1]), "the server or the trainer outlived the launcher"
    finally:
        if proc.returncode is None:
            _reap(proc, pids)


@pytest.mark.parametrize("script,rc", [("echo 'NVIDIA-SMI has failed because it could not communicate'", 9),
                                        ("echo 'No devices were found'", 0), ("echo 0; echo 'GPU 1: Err!'", 0)])
def test_single_node_nvidia_smi_failure_is_one_line(tmp_path, script, rc):
    bin_dir = tmp_path / "smi"
    _executable(bin_dir / "nvidia-smi", f"#!/bin/sh\n{script}\nexit {rc}\n")
    token = tmp_path / "token"
    out = _run(["bash", "launch/single_node_gpu.sh", "configs/tiny_cpu.py"], tmp_path, TOKEN_FILE=str(token),
               PATH=f"{bin_dir}:{os.environ['PATH']}")
    _refused(out, "nvidia-smi")
    assert not token.exists()


SLOW_TRAINER = """#!/usr/bin/env bash
if [ "$1" = -c ]; then echo 12345; exit 0; fi
case "$1" in */launch/config_model_path.py) exit 0;; esac
echo $$ > "{out}/proc$JAX_PROCESS_ID.pid"
case "$JAX_PROCESS_ID" in
  0) trap '' TERM; exec sleep 60 ;;   # ignores SIGTERM: only SIGKILL stops it
  1) {one} ;;
  *) exec sleep 60 ;;
esac
"""


def test_slurm_local_hup_stops_every_process(tmp_path):
    py = _executable(tmp_path / "fakepy", SLOW_TRAINER.format(out=tmp_path, one="exec sleep 60"))
    (tmp_path / "cfg.py").write_text("")
    proc = _popen([BASH, str(REPO / "launch/slurm_gpu.sh"), str(tmp_path / "cfg.py")], tmp_path, cwd=tmp_path,
                  LOCAL_PROCESSES="3", PYTHON=str(py), LOCAL_STOP_GRACE="1")
    pids = []
    try:
        pids = [int(_wait_for(tmp_path / f"proc{i}.pid")) for i in range(3)]
        start = time.monotonic()
        os.kill(proc.pid, 1)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode != 0, err
        assert time.monotonic() - start < 8
        assert all(_gone(pid) for pid in pids), "a process outlived the launcher"
    finally:
        if proc.returncode is None:
            _reap(proc, pids)


def test_slurm_local_failure_escalates_to_sigkill(tmp_path):
    py = _executable(tmp_path / "fakepy", SLOW_TRAINER.format(out=tmp_path, one="sleep 0.5; exit 3"))
    (tmp_path / "cfg.py").write_text("")
    start = time.monotonic()
    proc = _popen([BASH, str(REPO / "launch/slurm_gpu.sh"), str(tmp_path / "cfg.py")], tmp_path, cwd=tmp_path,
                  LOCAL_PROCESSES="3", PYTHON=str(py), LOCAL_STOP_GRACE="1")
    pids = []
    try:
        pids = [int(_wait_for(tmp_path / f"proc{i}.pid")) for i in (0, 2)]
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 3, (proc.returncode, err)
        assert time.monotonic() - start < 10
        assert all(_gone(pid) for pid in pids)
    finally:
        if proc.returncode is None:
            _reap(proc, pids)


@pytest.mark.parametrize("env,named", [({"LOCAL_PROCESSES": "100000"}, "LOCAL_PROCESSES"),
                                       ({"LOCAL_PROCESSES": "99999999999999999999999"}, "LOCAL_PROCESSES"),
                                       ({"LOCAL_PROCESSES": str(4 * (os.cpu_count() or 1) + 1)}, "LOCAL_PROCESSES"),
                                       ({"LOCAL_PROCESSES": "1", "LOCAL_DEVICES": "257"}, "LOCAL_DEVICES"),
                                       ({"LOCAL_PROCESSES": "2", "LOCAL_STOP_GRACE": "soon"}, "LOCAL_STOP_GRACE"),
                                       ({"LOCAL_PROCESSES": "2", "PYTHON": "/nonexistent/python"}, "PYTHON")],
                         ids=["100000", "huge", "4xcores+1", "devices", "grace", "python"])
def test_slurm_local_bounds_and_interpreter(tmp_path, env, named):
    env = {"PYTHON": str(_executable(tmp_path / "fakepy", FAKE_TRAINER.format(out=tmp_path))), **env}
    (tmp_path / "cfg.py").write_text("")
    out = _run(["bash", "launch/slurm_gpu.sh", str(tmp_path / "cfg.py")], tmp_path, timeout=20, **env)
    line = _refused(out, named)
    assert "command not found" not in line and "No such file" not in line
    assert not list(tmp_path.glob("proc*.args")) and not (tmp_path / "checks").exists()


def test_slurm_default_venv_is_the_repos(tmp_path):
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    shutil.copy(REPO / "launch/slurm_gpu.sh", repo / "launch/slurm_gpu.sh")
    shutil.copy(REPO / "launch/config_model_path.py", repo / "launch/config_model_path.py")
    (tmp_path / "cfg.py").write_text("")
    out = _run(["bash", str(repo / "launch/slurm_gpu.sh"), "cfg.py"], tmp_path, cwd=tmp_path, LOCAL_PROCESSES="1")
    _refused(out, "PYTHON", f"{repo}/.venv/bin/python")
    # SLURM mode: no srun on PATH
    out = _run([BASH, str(repo / "launch/slurm_gpu.sh"), "cfg.py"], tmp_path, cwd=tmp_path,
               PATH=str(tmp_path / "empty"))
    _refused(out, "srun")


def test_slurm_mode_checks_once_and_runs_the_repos_venv(tmp_path):
    bin_dir = tmp_path / "slurmbin"
    _executable(bin_dir / "srun", f"#!/bin/sh\nprintf '%s\\n' \"$@\" > '{tmp_path}/srun.args'\n")
    path = f"{bin_dir}:{os.environ['PATH']}"
    spool = tmp_path / "spool"  # sbatch runs a copy of the script: the repo is SLURM_SUBMIT_DIR
    spool.mkdir()
    shutil.copy(REPO / "launch/slurm_gpu.sh", spool / "slurm_script")
    out = _run(["bash", str(spool / "slurm_script"), str(REPO / "configs/tiny_cpu.py"), "--config.steps=2"],
               tmp_path, cwd=tmp_path, PATH=path, SLURM_SUBMIT_DIR=str(REPO), timeout=60)
    assert out.returncode == 0, out.stderr
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert args[1] == f"{REPO}/.venv/bin/jaxrl-mismatch" and args[-1] == "--config.steps=2"
    (tmp_path / "srun.args").unlink()
    out = _run(["bash", "launch/slurm_gpu.sh", "configs/tiny_cpu.py", "--bogus"], tmp_path, PATH=path, timeout=60)
    _refused(out, "--bogus")
    assert not (tmp_path / "srun.args").exists()


def test_slurm_local_bad_override_is_one_line_before_any_process(tmp_path):
    out = _run(["bash", "launch/slurm_gpu.sh", "configs/tiny_cpu.py", "--config.steps"], tmp_path,
               LOCAL_PROCESSES="2", PYTHON=str(REAL_PYTHON), timeout=60)
    line = _refused(out, "needs a value")
    assert out.stderr.count("slurm_gpu.sh:") == 1, line


@pytest.mark.parametrize("args,env,named", [
    (["", "zone", "cfg.py"], {}, "TPU_NAME"), (["tpu", "", "cfg.py"], {}, "ZONE"),
    (["tpu", "zone", ""], {}, "CONFIG"), (["tpu", "zone", "cfg.py"], {"REPO_DIR": ""}, "REPO_DIR")])
def test_tpu_pod_refuses_empty_values(tmp_path, args, env, named):
    out = _run(["bash", "launch/tpu_pod.sh", *args], tmp_path, **env)
    _refused(out, named)
    assert not (tmp_path / "gcloud.command").exists()


def test_tpu_pod_without_gcloud(tmp_path):
    out = _run([BASH, str(REPO / "launch/tpu_pod.sh"), "tpu", "zone", "cfg.py"], tmp_path,
               PATH=str(tmp_path / "empty"))
    _refused(out, "gcloud")


def _checkout(tmp_path: Path, *names: str) -> Path:
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for name in (*names, "_python_checks.sh"):  # both setups source the shared checks
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


# Both setups source scripts/_python_checks.sh; each is run here, so a setup that stops sourcing it is caught.
@pytest.mark.parametrize("script", ["setup_env.sh", "setup_gpu.sh"])
@pytest.mark.parametrize("case", ["notes", "py27", "missing", "venv312"])
def test_setup_refuses_foreign_venv_and_wrong_python(tmp_path, script, case):
    root = _checkout(tmp_path, script)
    env = {"PYTHON": str(REAL_PYTHON)}
    named = {"notes": "pyvenv.cfg", "py27": "PYTHON", "missing": "PYTHON", "venv312": ".venv/bin/python"}[case]
    if case == "notes":
        (root / ".venv").mkdir()
        (root / ".venv/notes.txt").write_text("mine\n")
    elif case == "py27":
        env["PYTHON"] = str(_executable(tmp_path / "python2.7", "#!/bin/sh\necho 2.7\n"))
    elif case == "missing":
        env["PYTHON"] = "/nonexistent/python3.11"
    else:
        (root / ".venv/bin").mkdir(parents=True)
        (root / ".venv/pyvenv.cfg").write_text("version = 3.12.1\n")
        _executable(root / ".venv/bin/python", "#!/bin/sh\necho 3.12\n")
    before = _tree(root)
    out = _run(["bash", f"scripts/{script}", *(["test"] if script == "setup_env.sh" else [])], tmp_path,
               cwd=root, timeout=20, **env)
    line = _refused(out, named)
    if case in ("py27", "missing"):
        assert env["PYTHON"] in line
    assert _tree(root) == before


def test_gen_proto_checks_python(tmp_path):
    out = _run(["bash", "scripts/gen_proto.sh"], tmp_path, PYTHON="/nonexistent/python")
    _refused(out, "PYTHON", "/nonexistent/python")


def test_demo_documents_relative_overrides():
    header = (REPO / "scripts/demo.sh").read_text()
    assert "repo root" in header and "--config.run_dir=myrun" in header
    assert "repo root's, not your current directory's" in (REPO / "docs/models.md").read_text()


@pytest.mark.parametrize("env, ids", [
    # sbatch --nodes=2 --gpus-per-node=8 launch/slurm_gpu.sh: one task per node sees all 8 GPUs (JAX gave it GPU 0)
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, list(range(8))),
    ({"SLURM_JOB_ID": "7", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_GPUS_ON_NODE": "4"}, [0, 1, 2, 3]),
    # one task per GPU (JAX's own default is right), one GPU, not SLURM, CPU processes: JAX decides
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, None),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": "3"}, None),
    ({"SLURM_NTASKS_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": "0,1"}, None),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": "0,1", "JAX_PLATFORMS": "cpu"}, None),
])
def test_one_slurm_task_per_node_trains_on_every_gpu_of_its_node(env, ids):
    """`jax.distributed.initialize` under SLURM gives a process only its local rank's GPU unless told otherwise."""
    from jaxrl_mismatch.train.distributed import slurm_local_device_ids

    assert slurm_local_device_ids(env) == ids
