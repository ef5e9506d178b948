"""KServe's own clients against a running ``onnxpipe serve`` (run by the Python of ``.venv-kserve``,
which ``make test`` makes: kserve's dependencies are not ours). Prints one JSON object: what each
call gave, for tests/serve/test_kserve_clients.py to check.

    .venv-kserve/bin/python tests/serve/kserve_clients.py HTTP_URL GRPC_URL MODEL INPUT SHAPE_JSON VALUES_JSON [SEQ_MODEL STEPS_JSON]

With a model with state (``SEQ_MODEL``, input ``x``, output ``y``), it also steps one Triton sequence
of ``STEPS_JSON`` (a list of ``x`` values) over REST and another over gRPC, through KServe's
request ``parameters`` (``sequence_id``, ``sequence_start``, ``sequence_end``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig


async def main(http: str, grpc_url: str, model: str, name: str, shape: list[int], values: list[float], seq_model: str | None = None,
               steps: list[list[list[float]]] | None = None) -> dict[str, object]:
    array = np.array(values, np.float32).reshape(shape)
    out: dict[str, object] = {}
    rest = InferenceRESTClient(RESTConfig(protocol="v2"))
    base = f"http://{http}"
    out["rest_live"] = await rest.is_server_live(base)
    out["rest_ready"] = await rest.is_server_ready(base)
    out["rest_model_ready"] = await rest.is_model_ready(base, model)
    for binary in (False, True):
        tensor = InferInput(name, shape, "FP32")
        tensor.set_data_from_numpy(array, binary_data=binary)
        response = await rest.infer(base, InferRequest(model_name=model, infer_inputs=[tensor], request_id=f"rest-{binary}"), model_name=model)
        out[f"rest_infer_{'binary' if binary else 'json'}"] = {o.name: o.as_numpy().tolist() for o in response.outputs}
    if seq_model is not None and steps is not None:
        out["rest_sequence"] = [await _step(lambda r: rest.infer(base, r, model_name=seq_model), seq_model, 7001, t, steps) for t in range(len(steps))]
    await rest.close()
    client = InferenceGRPCClient(grpc_url)
    out["grpc_live"] = await client.is_server_live()
    out["grpc_ready"] = await client.is_server_ready()
    out["grpc_model_ready"] = await client.is_model_ready(model)
    tensor = InferInput(name, shape, "FP32")
    tensor.set_data_from_numpy(array, binary_data=True)
    response = await client.infer(InferRequest(model_name=model, infer_inputs=[tensor], request_id="grpc"))
    out["grpc_infer"] = {o.name: o.as_numpy().tolist() for o in response.outputs}
    if seq_model is not None and steps is not None:
        out["grpc_sequence"] = [await _step(client.infer, seq_model, 7002, t, steps) for t in range(len(steps))]
    await client.close()
    return out


async def _step(infer: Any, model: str, sid: int, t: int, steps: list[list[list[float]]]) -> list[list[float]]:
    """Step ``t`` of sequence ``sid``: its parameters as Triton's sequence extension names them."""
    tensor = InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.array(steps[t], np.float32), binary_data=False)
    parameters = {"sequence_id": sid, "sequence_start": t == 0, "sequence_end": t == len(steps) - 1}
    response = await infer(InferRequest(model_name=model, infer_inputs=[tensor], request_id=f"{sid}-{t}", parameters=parameters))
    return next(o for o in response.outputs if o.name == "y").as_numpy().tolist()


if __name__ == "__main__":
    http, grpc_url, model, name, shape, values = sys.argv[1:7]
    seq_model, steps = (sys.argv[7], json.loads(sys.argv[8])) if len(sys.argv) > 8 else (None, None)
    print(json.dumps(asyncio.run(main(http, grpc_url, model, name, json.loads(shape), json.loads(values), seq_model, steps))))
