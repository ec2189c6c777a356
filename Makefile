# make demo | make test | make bench — each creates .venv and installs what it needs (pip -c constraints.txt).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hfl3-installed
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/build/torch_extensions

.PHONY: demo test test-distributed test-fast bench install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,deepspeed,fp8]'
	touch $(STAMP)

install: $(STAMP)

# demo and test print their elapsed time after the installation (issue 14: demo <= 5 min, test <= 10 min on 2 cores).
demo: $(STAMP)
	@start=$$(date +%s); \
	$(BIN)/accelerate launch --config_file accelerate_configs/cpu.yaml recipes/pretrain.py \
		--config recipes/configs/demo.yaml --overwrite_output_dir \
	&& $(BIN)/accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft_lora.py \
		--config recipes/configs/sft_demo.yaml --overwrite_output_dir; \
	rc=$$?; echo "make demo: $$(( $$(date +%s) - start )) s elapsed after installation (exit $$rc)"; exit $$rc

test: $(STAMP)
	@start=$$(date +%s); $(BIN)/pytest -q; \
	rc=$$?; echo "make test: $$(( $$(date +%s) - start )) s elapsed after installation (exit $$rc)"; exit $$rc

test-distributed: $(STAMP)
	$(BIN)/pytest -q -m distributed

test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow and not distributed"

bench: $(STAMP)
	$(BIN)/python benchmarks/l3_forward.py --json benchmarks/results/l3_forward_cpu.json

clean:
	rm -rf $(VENV) build outputs
