"""The peer a Python user would deploy instead of onnxpipe serve: one onnxruntime session behind
KServe's Python ModelServer (the ``kserve`` package), written as KServe's docs write a custom
model. Run by ``benchmarks.serve`` with the Python of a venv that has kserve (``make
bench-serve`` makes ``.venv-kserve``); not imported by onnxpipe.

Usage: python benchmarks/kserve_peer.py --model_name NAME --model_path MODEL.onnx --http_port P --grpc_port Q
"""

from __future__ import annotations

import argparse
from typing import Any

import kserve
import onnxruntime as ort
from kserve import InferOutput, InferRequest, InferResponse
from kserve.utils.utils import generate_uuid


class OnnxModel(kserve.Model):
    """``predict`` runs the session, as the docs' custom models do."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name)
        self.path = path
        self.session: ort.InferenceSession | None = None
        self.load()

    def load(self) -> bool:
        self.session = ort.InferenceSession(self.path, providers=["CPUExecutionProvider"])
        self.ready = True
        return True

    async def predict(self, payload: InferRequest, headers: dict[str, str] | None = None, response_headers: dict[str, str] | None = None) -> Any:
        assert self.session is not None
        feeds = {i.name: i.as_numpy() for i in payload.inputs}
        names = [o.name for o in self.session.get_outputs()]
        values = self.session.run(names, feeds)
        outputs = [InferOutput(name=n, shape=list(v.shape), datatype="FP32", data=v) for n, v in zip(names, values, strict=True)]
        return InferResponse(model_name=self.name, infer_outputs=outputs, response_id=payload.id or generate_uuid())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(parents=[kserve.model_server.parser], conflict_handler="resolve")
    parser.add_argument("--model_path", required=True)
    args, _ = parser.parse_known_args()
    kserve.ModelServer(http_port=args.http_port, grpc_port=args.grpc_port, workers=1).start([OnnxModel(args.model_name, args.model_path)])
