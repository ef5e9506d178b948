# The two set-up commands of the README. Both create .venv themselves from nothing but python3.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_OUT ?= demo-out

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.installed

LIGHT_MODEL = $(BIN)/python -c 'import onnx, os; print(os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", "light_$(1).onnx"))'

# A real model (resnet50 from the onnx wheel, no download): where to cut, a 3-stage split, and a
# check that the chained stages give the whole model's outputs and intermediate tensors.
demo: $(VENV)/.installed
	@set -e; model=$$($(call LIGHT_MODEL,resnet50)); \
	echo "== onnxpipe inspect $$model"; $(BIN)/onnxpipe inspect "$$model" --top 5; \
	echo; echo "== onnxpipe split (3 stages; the second cut is named by two tensors)"; \
	$(BIN)/onnxpipe split "$$model" -o $(DEMO_OUT)/split --at r35 --at r88,r90 --overwrite; \
	echo; echo "== onnxpipe verify"; $(BIN)/onnxpipe verify $(DEMO_OUT)/split --model "$$model" --samples 2

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -n 2 -q

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check onnxpipe tests benchmarks
	$(BIN)/mypy

bench: $(VENV)/.installed
	$(BIN)/python -m benchmarks.split_speed

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache .hypothesis
