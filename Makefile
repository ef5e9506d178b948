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

# Split a real model (resnet50 from the onnx wheel), check the stages against the whole model.
demo: $(VENV)/.installed
	$(BIN)/python -m onnxpipe.cli demo --out $(DEMO_OUT)

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -n 2 -q

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check onnxpipe tests benchmarks
	$(BIN)/mypy

bench: $(VENV)/.installed
	$(BIN)/python -m benchmarks.split_speed

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache .hypothesis
