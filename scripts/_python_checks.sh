# Sourced by scripts/setup_env.sh and scripts/setup_gpu.sh from the repo root, not run on its own: the checks
# both make before they create or reuse .venv, so the two setups refuse the same things the same way (one line
# through the caller's `die`, exit 2, nothing touched). The caller sets PY, the interpreter that creates .venv.

py_version() {  # "3.11" for an interpreter $1 that runs (python 2 included); empty otherwise
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

# A .venv that is not a virtual environment (a folder of yours, say), a .venv whose python is not Python 3.11,
# and, when .venv would be created, a PYTHON that is missing or not Python 3.11 (pyproject.toml: >=3.11,<3.12).
check_venv_and_python() {
  local v
  if [ -e .venv ] || [ -L .venv ]; then
    [ -f .venv/pyvenv.cfg ] || die ".venv exists but is not a virtual environment (no .venv/pyvenv.cfg); move it away or remove it, and rerun"
  fi
  if [ -x .venv/bin/python ]; then
    v=$(py_version .venv/bin/python)
    [ "$v" = 3.11 ] || die ".venv/bin/python is Python ${v:-(does not run)}, this project needs 3.11; remove .venv and rerun (PYTHON, default python3, a Python 3.11, creates it)"
  else
    command -v "$PY" >/dev/null 2>&1 || die "PYTHON '$PY': no such interpreter; set PYTHON to a Python 3.11"
    v=$(py_version "$PY")
    [ "$v" = 3.11 ] || die "PYTHON '$PY' is Python ${v:-(does not run)}, this project needs 3.11 (>=3.11,<3.12); set PYTHON to a Python 3.11"
  fi
}
