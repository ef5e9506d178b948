"""KServe's own clients against a running ``onnxpipe serve`` (run by the Python of ``.venv-kserve``,
which ``make test`` makes: kserve's dependencies are not ours). Prints one JSON object: what each
call gave, for tests/serve/test_kserve_clients.py to check.

    .venv-kserve/bin/python tests/serve/kserve_clients.py HTTP_URL GRPC_URL MODEL INPUT SHAPE_JSON VALUES_JSON
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig


async def main(http: str, grpc_url: str, model: str, name: str, shape: list[int], values: list[float]) -> dict[str, object]:
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
    await rest.close()
    client = InferenceGRPCClient(grpc_url)
    out["grpc_live"] = await client.is_server_live()
    out["grpc_ready"] = await client.is_server_ready()
    out["grpc_model_ready"] = await client.is_model_ready(model)
    tensor = InferInput(name, shape, "FP32")
    tensor.set_data_from_numpy(array, binary_data=True)
    response = await client.infer(InferRequest(model_name=model, infer_inputs=[tensor], request_id="grpc"))
    out["grpc_infer"] = {o.name: o.as_numpy().tolist() for o in response.outputs}
    await client.close()
    return out


if __name__ == "__main__":
    http, grpc_url, model, name, shape, values = sys.argv[1:7]
    print(json.dumps(asyncio.run(main(http, grpc_url, model, name, json.loads(shape), json.loads(values)))))
