VENV ?= .venv
PY := $(VENV)/bin/python
CORE_STAMP := $(VENV)/.installed-core
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed-test

.PHONY: demo test lint docs bench clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch first, pinned to the CPU build that lies on local disk; the package itself asks for torch>=2.4.
$(CORE_STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e .
	touch $(CORE_STAMP)

# The demo needs the package and its report extra (matplotlib) only.
$(DEMO_STAMP): $(CORE_STAMP)
	$(PY) -m pip install --quiet -e ".[report]"
	touch $(DEMO_STAMP)

# The tests need the extras: report (matplotlib), lightning, transformers, accelerate, tensorboard, mypy, the docs
# tool and the engines (deepspeed, torchtitan). deepspeed builds from source against the torch already here: an
# isolated build would fetch another torch.
$(STAMP): $(CORE_STAMP)
	$(PY) -c "import deepspeed" 2>/dev/null || $(PY) -m pip install --quiet --no-build-isolation "deepspeed>=0.16"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/nanguard demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest

# The documentation site (README.md is the front page; docs/ holds the rest): site/, every warning an error.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	cd benchmarks && ../$(PY) locate_cost.py && ../$(PY) overhead.py --ddp && ../$(PY) guard_cost.py && ../$(PY) zoo_compare.py --ranks 2

clean:
	rm -rf $(VENV) build dist site .pytest_cache
