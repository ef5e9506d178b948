"""Stages on a second real execution provider (OpenVINO): run by `make test-openvino`, in a venv
whose onnxruntime is `onnxruntime-openvino`; they skip elsewhere, saying so."""
