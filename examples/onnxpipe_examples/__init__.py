"""Worked examples of onnxpipe pipelines that mix ONNX models and Python code stages.

This package is not part of ``onnxpipe``: nothing in ``onnxpipe`` imports it, and it is a distribution of
its own (``examples/pyproject.toml``: ``pip install -e examples``). ``onnxpipe_examples.ocr`` builds the PP-OCR
chain of the ``rapidocr_onnxruntime`` wheel as one bundle.
"""
