# The two set-up commands of the README. Both create .venv themselves from nothing but python3.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# KServe's clients, for the tests, and the peer of bench-serve (its dependencies are not ours).
KSERVE := .venv-kserve
DEMO_OUT ?= demo-out

.PHONY: demo test test-oldest-ort test-openvino perf-analyzer protos lint bench bench-serve bench-decoders clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[cpu]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml examples/pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,ray,serve,qnn]' -e examples  # dev includes cpu: plain onnxruntime
	touch $@ $(VENV)/.installed

LIGHT_MODEL = $(BIN)/python -c 'import onnx, os; print(os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", "light_$(1).onnx"))'

# The main job end to end on a real model (resnet50 from the onnx wheel, no download): where to cut,
# an automatic 2-stage split checked against the whole model, a build with one core per stage, a
# single-file bundle, then the deployment host's side in a separate process that imports only the
# runtime: stream requests, check outputs, compare with one session and replicas, write a timeline.
demo: $(VENV)/.installed
	@set -e; model=$$($(call LIGHT_MODEL,resnet50)); out=$(DEMO_OUT); \
	if [ "$$(nproc)" -ge 2 ]; then pin="--stage 0:threads=1,affinity=0 --stage 1:threads=1,affinity=1"; else pin="--stage *:threads=1"; fi; \
	echo "== 1. onnxpipe inspect: where is it cheap to cut?"; $(BIN)/onnxpipe inspect "$$model" --top 4; \
	echo; echo "== 2. onnxpipe split --auto: 2 stages balanced by measured per-node costs"; \
	$(BIN)/onnxpipe split "$$model" -o $$out/split --auto --stages 2 --overwrite; \
	echo; echo "== 3. onnxpipe verify: chained stages == whole model, outputs and boundary tensors"; \
	$(BIN)/onnxpipe verify $$out/split --model "$$model" --samples 2; \
	echo; echo "== 4. onnxpipe build: one thread and one core per stage"; \
	$(BIN)/onnxpipe build $$out/split -o $$out/built $$pin --overwrite; \
	echo; echo "== 5. onnxpipe export: one file to ship, with reference outputs of the whole model"; \
	$(BIN)/onnxpipe export $$out/built -o $$out/resnet50.onnxpipe --reference 2 --model "$$model" --overwrite; \
	echo; echo "== 6. the deployment host: a separate process with only the runtime"; \
	$(BIN)/python tutorials/host_demo.py $$out/resnet50.onnxpipe "$$model" --trace $$out/trace.json

# perf_analyzer (Triton's load generator, for tests/serve and benchmarks.serve) is installed when it
# can be; where it cannot, its tests skip saying so. .ci/run installs it strictly first.
# KServe's own clients drive the server in tests/serve/test_kserve_clients.py from a venv of their
# own (.venv-kserve, also the peer of bench-serve): kserve pins psutil below 6, ipython needs 7.
test: $(VENV)/.installed-dev $(KSERVE)/.installed
	@.ci/install-perf-analyzer $(VENV) || echo "perf_analyzer could not be installed: its tests will skip (see .ci/install-perf-analyzer)"
	$(BIN)/python -m pytest -n 2 -q

perf-analyzer: $(VENV)/.installed-dev
	.ci/install-perf-analyzer $(VENV)

# The gRPC messages of onnxpipe serve, generated from their .proto (checked in; tests/serve/test_proto.py
# fails when they are stale).
protos: $(VENV)/.installed-dev
	cd onnxpipe/serve/_proto && ../../../$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. oip.proto

# The bundle-safety suite under the oldest onnxruntime pyproject.toml admits: onnxpipe's own checks
# must refuse hostile bundles whatever onnxruntime would do with them (docs/bundle-format.md). A
# throwaway venv with that onnxruntime and the onnx and numpy of its time; .ci/run runs it after `make test`.
OLDEST_ORT := onnxruntime==1.18.0 onnx==1.17.0 "numpy<2"
OLDEST := .venv-oldest-ort
SAFETY_TESTS := tests/runtime/test_bundle.py tests/runtime/test_bundle_hostile.py tests/runtime/test_protoscan.py tests/runtime/test_bundle_limits.py

$(OLDEST)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST)/bin/python -m pip install --quiet -e '.[dev]' $(OLDEST_ORT)
	touch $@

test-oldest-ort: $(OLDEST)/.installed
	$(OLDEST)/bin/python -c 'import onnxruntime; print("onnxruntime", onnxruntime.__version__)'
	$(OLDEST)/bin/python -m pytest -q -p no:cacheprovider $(SAFETY_TESTS)

# A second real execution provider: a venv whose onnxruntime is Intel's onnxruntime-openvino (it
# is the package `onnxruntime` too, so it cannot share .venv), installed as docs/building.md says
# (the openvino extra: no plain onnxruntime, a clean `pip check`), with Ray for both engines and the
# serve extra. The PP-OCR models of the rapidocr wheel are unpacked from it as a bare package
# folder: installed, its metadata would require plain onnxruntime, which `pip check` would then miss.
# The target tests run there (tests/targets: stages on OpenVINO and on the CPU, fallback, provider
# options, a bundle built by .venv, which lacks OpenVINO; installing as documented gives a clean
# pip check; two onnxruntime builds over each other are diagnosed), and so do the distribution
# tests, which read .venv's metadata beside this venv's; .ci/run runs it after `make test`.
OPENVINO_ORT := onnxruntime-openvino==1.24.1
OPENVINO := .venv-openvino
# onnxpipe with the openvino extra and then plain onnxruntime installed over it, as `pip install
# 'onnxpipe[cpu]' onnxruntime-openvino` (or any package requiring onnxruntime) leaves a host:
# tests/targets/test_openvino_install.py checks the diagnosis there, and its fix in a copy (about
# 25 s to make, from the wheels pip's cache holds once .venv-openvino is made).
OPENVINO_MIXED := .venv-openvino-mixed

$(OPENVINO)/.installed: pyproject.toml
	rm -rf $(OPENVINO)
	$(PYTHON) -m venv $(OPENVINO)
	$(OPENVINO)/bin/python -m pip install --quiet --upgrade pip
	$(OPENVINO)/bin/python -m pip install --quiet -e '.[openvino,ray,serve]' $(OPENVINO_ORT) 'pytest>=8' 'pytest-xdist>=3.5' 'hypothesis>=6.100'
	$(OPENVINO)/bin/python -m pip download --quiet --no-deps --dest $(OPENVINO)/wheels rapidocr_onnxruntime==1.4.4
	$(OPENVINO)/bin/python -c 'import sys, sysconfig, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sysconfig.get_paths()["purelib"], [n for n in z.namelist() if n.startswith("rapidocr_onnxruntime/")])' $(OPENVINO)/wheels/rapidocr_onnxruntime-1.4.4-*.whl
	touch $@

$(OPENVINO_MIXED)/.installed: pyproject.toml
	rm -rf $(OPENVINO_MIXED)
	$(PYTHON) -m venv $(OPENVINO_MIXED)
	$(OPENVINO_MIXED)/bin/python -m pip install --quiet --upgrade pip
	$(OPENVINO_MIXED)/bin/python -m pip install --quiet -e '.[openvino]' $(OPENVINO_ORT)
	$(OPENVINO_MIXED)/bin/python -m pip install --quiet onnxruntime
	touch $@

test-openvino: $(OPENVINO)/.installed $(OPENVINO_MIXED)/.installed $(VENV)/.installed-dev
	$(OPENVINO)/bin/python -c 'import onnxruntime as ort; print("onnxruntime", ort.__version__, ort.get_available_providers()); assert "OpenVINOExecutionProvider" in ort.get_available_providers()'
	$(OPENVINO)/bin/python -m pytest -q -p no:cacheprovider tests/targets tests/runtime/test_distributions.py

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check onnxpipe tests benchmarks
	$(BIN)/mypy

bench: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks --out bench-out
	$(BIN)/python -m benchmarks.engines
	$(BIN)/python -m benchmarks.streams
	$(BIN)/python -m benchmarks.batching
	$(BIN)/python -m benchmarks.ocr_chain

# benchmarks.serve: onnxpipe serve beside the same bundle in process and beside KServe's Python
# ModelServer, the peer, which lives in the venv of KServe's clients (KSERVE, defined above); then
# (--vs-triton, issue 30) the planner's bundle for each concurrency beside PyTriton, whose wheel
# bundles tritonserver 2.51 (Triton's core, HTTP and gRPC front ends, dynamic batcher), in a venv
# of its own (it pins numpy below 2), with onnxruntime for its Python model
# (benchmarks/pytriton_peer.py). The PP-OCR recognizer is read from .venv's rapidocr_onnxruntime.
PYTRITON := .venv-pytriton

$(KSERVE)/.installed:
	$(PYTHON) -m venv $(KSERVE)
	$(KSERVE)/bin/python -m pip install --quiet --upgrade pip
	$(KSERVE)/bin/python -m pip install --quiet kserve==0.21.0 onnxruntime
	touch $@

$(PYTRITON)/.installed:
	$(PYTHON) -m venv $(PYTRITON)
	$(PYTRITON)/bin/python -m pip install --quiet --upgrade pip
	$(PYTRITON)/bin/python -m pip install --quiet nvidia-pytriton==0.7.0 onnxruntime
	touch $@

bench-serve: $(VENV)/.installed-dev $(KSERVE)/.installed $(PYTRITON)/.installed
	@.ci/install-perf-analyzer $(VENV) || echo "perf_analyzer could not be installed: served rows use the tritonclient load generator"
	$(BIN)/python -m benchmarks.serve --peer $(KSERVE)/bin/python
	$(BIN)/python -m benchmarks.serve --vs-triton --triton-python $(PYTRITON)/bin/python

# benchmarks.batching on Llama decoders as users export them, beside onnxruntime-genai's Generator on
# its own export of the same weights (issue 26). Two venvs, since the exporters disagree on
# transformers: optimum-onnx 0.1.0 wants 4.x, onnxruntime-genai 0.18.0's model builder imports 5.x.
# The Llamas are made locally with random weights (benchmarks/llama_exports.py); nothing is downloaded.
DECODERS := .venv-decoders
GENAI_BUILDER := .venv-genai-builder
LLAMAS := bench-out/llama

$(DECODERS)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DECODERS)
	$(DECODERS)/bin/python -m pip install --quiet --upgrade pip
	$(DECODERS)/bin/python -m pip install --quiet torch==2.13.0 'transformers<5' optimum-onnx==0.1.0 onnxruntime-genai==0.18.0 onnxscript -e '.[cpu]'
	touch $@

$(GENAI_BUILDER)/.installed:
	$(PYTHON) -m venv $(GENAI_BUILDER)
	$(GENAI_BUILDER)/bin/python -m pip install --quiet --upgrade pip
	$(GENAI_BUILDER)/bin/python -m pip install --quiet torch==2.13.0 transformers onnxruntime-genai==0.18.0 onnx_ir
	touch $@

$(LLAMAS)/24m/about.json: $(DECODERS)/.installed $(GENAI_BUILDER)/.installed benchmarks/llama_exports.py
	$(DECODERS)/bin/python -m benchmarks.llama_exports --out $(LLAMAS) --builder-python $(GENAI_BUILDER)/bin/python

# Issue 38's moonshot peer: OpenVINO GenAI's ContinuousBatchingPipeline (benchmarks/ovgenai_peer.py) on
# an OpenVINO IR of the same weights, exported by optimum-intel (fp32, uncompressed). A third venv:
# optimum-intel 2.2.0 wants transformers < 5.6 and huggingface-hub < 1.22. It requires torchvision,
# which pip takes as a build that fails to import beside the CPU torch ("operator torchvision::nms
# does not exist") and so breaks transformers' imports; nothing a text model's export runs needs it.
OVGENAI := .venv-ovgenai

$(OVGENAI)/.installed:
	$(PYTHON) -m venv $(OVGENAI)
	$(OVGENAI)/bin/python -m pip install --quiet --upgrade pip
	$(OVGENAI)/bin/python -m pip install --quiet torch==2.13.0 openvino-genai==2026.4.1.0 'optimum-intel[openvino]==2.2.0'
	$(OVGENAI)/bin/python -m pip uninstall --quiet --yes torchvision
	touch $@

# Only the openvino folders: the HF checkpoint is remade from the same seed by the decoders' venv.
$(LLAMAS)/24m/openvino/openvino_model.xml: $(LLAMAS)/24m/about.json $(OVGENAI)/.installed
	$(DECODERS)/bin/python -m benchmarks.llama_exports --out $(LLAMAS) --only openvino --openvino-python $(OVGENAI)/bin/python

# Issue 38's rows: onnxpipe batched (one driver, a thread per stream), og.Generator (genai export) and a
# plain session with its KV bound or fed numpy, and OpenVINO GenAI's continuous batching, at each
# context, for each Llama and export; on the genai export onnxpipe's rows in three layouts (2 stages
# x 1 thread pinned, 1 stage x 2 threads spinning, and 2 x 2 threads in one micro-batch: docs/batching.md,
# --layouts). The plain sessions run with onnxruntime's defaults (their idle threads spin).
# The optimum export materialises a batch of prompts' attention scores (streams x heads x context^2 per
# layer): at 2048 it outgrows a 23 GB machine, so it runs the shorter contexts.
CONTEXTS := 128,512,2048
OPTIMUM_CONTEXTS := 128,512

bench-decoders: $(LLAMAS)/24m/about.json $(LLAMAS)/24m/openvino/openvino_model.xml
	for llama in tiny 24m; do \
		$(DECODERS)/bin/python -m benchmarks.batching --llama $(LLAMAS)/$$llama --export genai --contexts $(CONTEXTS) --streams 8,16 --rounds 3 --layouts 2x1,1x2+spin,2x2:1 --ovgenai-python $(OVGENAI)/bin/python || exit 1; \
		$(DECODERS)/bin/python -m benchmarks.batching --llama $(LLAMAS)/$$llama --export optimum --contexts $(OPTIMUM_CONTEXTS) --streams 8,16 --rounds 3 --ovgenai-python $(OVGENAI)/bin/python || exit 1; \
	done

clean:
	rm -rf $(VENV) $(OLDEST) $(OPENVINO) $(OPENVINO_MIXED) $(KSERVE) $(PYTRITON) $(DECODERS) $(GENAI_BUILDER) $(OVGENAI) $(DEMO_OUT) .pytest_cache .hypothesis
