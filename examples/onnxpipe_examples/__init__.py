"""Worked examples of onnxpipe pipelines that mix ONNX models and Python code stages.

This package is not part of ``onnxpipe``: nothing in ``onnxpipe`` imports it. Its dependencies are the
``examples`` extra (``pip install 'onnxpipe[examples]'``). ``onnxpipe_examples.ocr`` builds the PP-OCR
chain of the ``rapidocr_onnxruntime`` wheel as one bundle.
"""
