"""Imported first by :mod:`onnxpipe.runtime` (and :mod:`onnxpipe.builder`, whose modules import
onnxruntime before the runtime): ``import onnxruntime``, or one :class:`OnnxruntimeImportError`
saying what to install (see :mod:`onnxpipe.runtime._distributions`) instead of a traceback from
whichever module happened to import it first."""

from onnxpipe.runtime._distributions import require_onnxruntime

require_onnxruntime()
