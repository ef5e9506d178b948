"""How long splitting takes: densenet121 (1746 nodes) and a generated 50,000-node model.

Splitting is one pass of graph analysis plus one pass per stage over that stage's nodes, so the time
should grow linearly with the graph, not with graph x cuts. Goals on a 2-core machine: densenet121
under 1 s, the 50,000-node model under 10 s (both including shape inference and onnx.checker).

    python -m benchmarks.split_speed [--nodes 50000] [--cuts 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxpipe.splitter import split
from onnxpipe.splitter._graph import GraphIndex

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def generated_model(nodes: int, width: int = 16, skip: int = 10) -> onnx.ModelProto:
    """A deep residual-style DAG: Add/Mul/Relu nodes, a skip edge every ``skip`` nodes, a weight
    every fifth node (shared in groups of four so some weights land in several stages)."""
    rng = np.random.default_rng(0)
    inits = []
    graph_nodes = []
    prev = "x"
    produced = ["x"]
    for i in range(nodes):
        out = f"t{i}"
        if i % skip == skip - 1 and i >= skip:
            graph_nodes.append(helper.make_node("Add", [prev, produced[-skip]], [out], name=f"n{i}"))
        elif i % 5 == 0:
            w = f"w{i // 20}"
            if i % 20 == 0:
                inits.append(helper.make_tensor(w, TensorProto.FLOAT, [width], rng.uniform(0.9, 1.1, width).astype(np.float32)))
            graph_nodes.append(helper.make_node("Mul", [prev, w], [out], name=f"n{i}"))
        else:
            graph_nodes.append(helper.make_node("Relu" if i % 2 else "Neg", [prev], [out], name=f"n{i}"))
        produced.append(out)
        prev = out
    graph = helper.make_graph(
        graph_nodes,
        "generated",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["N", width])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _time_split(model: onnx.ModelProto, cuts: int) -> dict[str, float]:
    t0 = time.perf_counter()
    index = GraphIndex(model)
    compute = index.compute_nodes()
    names = [index.nodes[compute[len(compute) * (k + 1) // (cuts + 1)]].output[0] for k in range(cuts)]
    t1 = time.perf_counter()
    plan = split(model, names, check=False)
    t2 = time.perf_counter()
    split(model, names, check=True)
    t3 = time.perf_counter()
    return {
        "nodes": len(model.graph.node),
        "stages": len(plan.stages),
        "analyse_s": t1 - t0,
        "split_s": t2 - t1,
        "split_checked_s": t3 - t2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=50_000)
    parser.add_argument("--cuts", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = {
        "densenet121": _time_split(onnx.load(os.path.join(LIGHT, "light_densenet121.onnx")), args.cuts),
        f"generated-{args.nodes}": _time_split(generated_model(args.nodes), args.cuts),
    }
    goals = {"densenet121": 1.0, f"generated-{args.nodes}": 10.0 * args.nodes / 50_000}
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'model':<20} {'nodes':>7} {'stages':>6} {'analyse':>9} {'split':>9} {'+checker':>9} {'goal':>7}")
    for name, r in rows.items():
        print(
            f"{name:<20} {r['nodes']:>7} {r['stages']:>6} {r['analyse_s']:>8.3f}s {r['split_s']:>8.3f}s "
            f"{r['split_checked_s']:>8.3f}s {'<' + format(goals[name], 'g') + 's':>7}"
        )


if __name__ == "__main__":
    main()
