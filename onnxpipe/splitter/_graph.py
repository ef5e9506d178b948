"""Graph analysis: reading a model, and one pass over it that every split, inspect and plan starts from.

Note: weights and compute.
    A node is a *weight node* when its value can never depend on what a caller feeds: it is a
    deterministic standard op without subgraphs whose inputs are all initializers or weight-node
    outputs (``Constant``, ``ConstantOfShape`` of a stored shape, a ``Cast`` of a weight, ...). The
    onnx light models build every weight this way. Weight nodes are never assigned to a stage and
    never cross a boundary: each stage carries the weight nodes and initializers its own nodes read,
    so a weight shared by two stages is stored in both. Every other node is a *compute node*; only
    those are cut. Initializers count as weights even when the graph also lists them as inputs (IR 3
    requires that listing; it does not make them inputs a caller must feed).

Note: subgraphs.
    A node with a subgraph (If, Loop, Scan) is one unit for the splitter: a cut never goes inside a
    body. The tensors a body reads from the outer scope count as inputs of the node, so the stage
    that runs the node receives them like any other input.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import GraphProto, ModelProto, NodeProto

from onnxpipe._errors import SplitError, closest

__all__ = ["GraphIndex", "load_model", "node_label", "subgraphs"]

_STANDARD_DOMAINS = ("", "ai.onnx")
_NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"})


def load_model(model: ModelProto | str | os.PathLike[str]) -> tuple[ModelProto, Path | None]:
    """A model and the folder its external data lives in; weights stay on disk when external.

    Raises:
        SplitError: the file cannot be read as an ONNX model.
    """
    if isinstance(model, ModelProto):
        return model, None
    path = Path(model)
    try:
        proto = onnx.load(path, load_external_data=False)
    except FileNotFoundError:
        raise SplitError(f"model file '{path}' does not exist") from None
    except (OSError, DecodeError) as e:
        raise SplitError(f"cannot read '{path}' as an ONNX model: {e}") from e
    if not proto.ir_version or not proto.HasField("graph"):
        # Protobuf reads an empty file (and some other bytes) as an empty message: no model at all.
        raise SplitError(f"cannot read '{path}' as an ONNX model: it has no IR version or no graph (an empty or truncated file?)")
    return proto, path.parent


def subgraphs(node: NodeProto) -> Iterator[GraphProto]:
    """The graphs held in a node's attributes (If branches, Loop and Scan bodies)."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def node_label(node: NodeProto, index: int) -> str:
    """How messages name a node: its name, or its op type and first output when it has none."""
    if node.name:
        return node.name
    first = next((o for o in node.output if o), "")
    return f"#{index} {node.op_type} -> '{first}'"


def _node_names(node: NodeProto) -> Iterator[str]:
    """Names of the nodes inside a node's subgraphs, at any depth."""
    for sub in subgraphs(node):
        for inner in sub.node:
            if inner.name:
                yield inner.name
            yield from _node_names(inner)


def _outer_refs(graph: GraphProto, inner: dict[str, None]) -> set[str]:
    """Names a graph reads from its enclosing scopes; records names defined inside into ``inner``."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}
    used: set[str] = set()
    for node in graph.node:
        used.update(i for i in node.input if i)
        for sub in subgraphs(node):
            used |= _outer_refs(sub, inner)
        defined.update(o for o in node.output if o)
    inner.update(dict.fromkeys(defined))
    return used - defined


@dataclass
class GraphIndex:
    """What the splitter needs to know about a model's top-level graph, computed once.

    Node indices are positions in ``model.graph.node``. ``order`` lists them topologically (the file
    order when it is already topological, which valid models are).
    """

    model: ModelProto
    nodes: list[NodeProto] = field(init=False)
    weights: set[str] = field(init=False)
    inputs: list[str] = field(init=False)
    outputs: list[str] = field(init=False)
    producer: dict[str, int] = field(init=False)
    node_inputs: list[tuple[str, ...]] = field(init=False)
    consumers: dict[str, list[int]] = field(init=False)
    order: list[int] = field(init=False)
    position: list[int] = field(init=False)
    is_weight: list[bool] = field(init=False)
    live: list[bool] = field(init=False)
    inner_owner: dict[str, int] = field(init=False)
    inner_nodes: dict[str, int] = field(init=False)
    by_name: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        g = self.model.graph
        self.nodes = list(g.node)
        self.weights = {t.name for t in g.initializer} | {t.values.name for t in g.sparse_initializer}
        self.inputs = [v.name for v in g.input if v.name not in self.weights]
        self.outputs = [v.name for v in g.output]
        self._index_nodes()
        self._sort()
        self._classify()

    def _index_nodes(self) -> None:
        self.producer, self.consumers, self.inner_owner, self.inner_nodes, self.by_name = {}, {}, {}, {}, {}
        self.node_inputs = []
        for i, node in enumerate(self.nodes):
            names = [x for x in node.input if x]
            inner: dict[str, None] = {}
            for sub in subgraphs(node):
                names.extend(sorted(_outer_refs(sub, inner)))
            for name in inner:
                self.inner_owner.setdefault(name, i)
            for name in _node_names(node):
                self.inner_nodes.setdefault(name, i)
            deps = tuple(dict.fromkeys(names))
            self.node_inputs.append(deps)
            for name in deps:
                self.consumers.setdefault(name, []).append(i)
            for out in node.output:
                if not out:
                    continue
                if out in self.producer or out in self.weights or out in self.inputs:
                    raise SplitError(f"tensor '{out}' is defined twice (by {self.label(i)} and before it); the model is not valid ONNX")
                self.producer[out] = i
            if node.name:
                self.by_name.setdefault(node.name, i)

    def _sort(self) -> None:
        # Kahn's algorithm with the file position as priority: the file order when it is already
        # topological, a stable order otherwise.
        known = self.weights | set(self.inputs)
        missing = [0] * len(self.nodes)
        for i, deps in enumerate(self.node_inputs):
            for name in deps:
                if name in self.producer:
                    missing[i] += 1
                elif name not in known:
                    raise SplitError(f"node {self.label(i)} reads tensor '{name}', which no node, input or initializer defines")
        heap = [i for i, m in enumerate(missing) if m == 0]
        heapq.heapify(heap)
        self.order = []
        while heap:
            i = heapq.heappop(heap)
            self.order.append(i)
            for out in self.nodes[i].output:
                for j in self.consumers.get(out, ()) if out else ():
                    missing[j] -= 1
                    if missing[j] == 0:
                        heapq.heappush(heap, j)
        if len(self.order) != len(self.nodes):
            stuck = [self.label(i) for i, m in enumerate(missing) if m > 0][:3]
            raise SplitError(f"the graph has a cycle through {', '.join(stuck)}")
        self.position = [0] * len(self.nodes)
        for pos, i in enumerate(self.order):
            self.position[i] = pos

    def _classify(self) -> None:
        self.is_weight = [False] * len(self.nodes)
        for i in self.order:
            node = self.nodes[i]
            self.is_weight[i] = (
                node.domain in _STANDARD_DOMAINS
                and node.op_type not in _NONDETERMINISTIC
                and not any(True for _ in subgraphs(node))
                and all(self.is_weight_tensor(x) for x in self.node_inputs[i])
            )
        self.live = [False] * len(self.nodes)
        stack = [self.producer[o] for o in self.outputs if o in self.producer]
        while stack:
            i = stack.pop()
            if self.live[i]:
                continue
            self.live[i] = True
            stack.extend(self.producer[x] for x in self.node_inputs[i] if x in self.producer)

    # -- queries -----------------------------------------------------------------------------------

    def is_weight_tensor(self, name: str) -> bool:
        """True for initializers and outputs of weight nodes."""
        if name in self.weights:
            return True
        p = self.producer.get(name)
        return p is not None and self.is_weight[p]

    def is_compute(self, i: int) -> bool:
        """True for live compute nodes: the nodes a split assigns to stages."""
        return self.live[i] and not self.is_weight[i]

    def compute_nodes(self) -> list[int]:
        """Live compute nodes in topological order."""
        return [i for i in self.order if self.is_compute(i)]

    def label(self, i: int) -> str:
        """The node's name for messages, quoted."""
        node = self.nodes[i]
        return f"'{node.name}'" if node.name else node_label(node, i)

    def unknown_node(self, name: str, what: str = "unknown node") -> SplitError:
        """The error for a node name that is not a top-level node (inside a subgraph, or nowhere)."""
        owner = self.inner_nodes.get(name)
        if owner is not None:
            return SplitError(
                f"node '{name}' is inside a subgraph of node {self.label(owner)} ({self.nodes[owner].op_type}); "
                "only top-level nodes can be cut after or assigned, e.g. that node"
            )
        return SplitError(f"{what} '{name}'; {closest(name, self.by_name)}")

    def tensor_names(self) -> Iterable[str]:
        """Every top-level tensor name (for 'closest name' suggestions)."""
        yield from self.inputs
        yield from self.producer

    def weight_closure(self, names: Iterable[str]) -> tuple[list[int], set[str]]:
        """Weight nodes and initializers needed to compute the weight tensors in ``names``.

        Returns:
            The weight nodes (unordered) and the initializer names they and ``names`` read.
        """
        nodes: set[int] = set()
        inits: set[str] = set()
        stack = list(names)
        while stack:
            name = stack.pop()
            if name in self.weights:
                inits.add(name)
                continue
            p = self.producer.get(name)
            if p is None or not self.is_weight[p] or p in nodes:
                continue
            nodes.add(p)
            stack.extend(self.node_inputs[p])
        return list(nodes), inits


def reroute(index: GraphIndex, i: int, old: str, new: str) -> None:
    """Make node ``i`` read ``new`` where it read ``old``, in ``index`` only (the node is copied:
    the model it came from is left as it was). ``new`` must be defined before node ``i``."""
    node = NodeProto()
    node.CopyFrom(index.nodes[i])
    for k, name in enumerate(node.input):
        if name == old:
            node.input[k] = new
    index.nodes[i] = node
    index.node_inputs[i] = tuple(new if name == old else name for name in index.node_inputs[i])
    index.consumers[old] = [j for j in index.consumers.get(old, []) if j != i]
    index.consumers.setdefault(new, []).append(i)
