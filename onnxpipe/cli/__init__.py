"""The ``onnxpipe`` command line: ``split``, ``inspect``, ``verify``, ``build``, ``export``, ``run``, thin over the library.

Importing this package is cheap: it pulls in click and nothing heavy. Each command imports onnx,
onnxruntime and rich only when it runs, so ``onnxpipe --help`` stays fast.
"""

from onnxpipe.cli._main import main

__all__ = ["main"]
