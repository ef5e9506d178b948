"""A stage on a GPU beside a stage on the CPU: the check to run where a GPU and onnxruntime-gpu are.

    python -m benchmarks.gpu_check [--device 0] [--requests 200] [--steps 16] [--mb 100]

It builds a convolutional net with random weights (8 Conv+Relu layers, 64 channels, input
[1, 3, 224, 224]) in-process, splits it in 2 at the middle, and runs it three ways:

1. the whole model in one CPU session (the reference);
2. the pipeline with stage 0 on ``cuda:DEVICE`` and stage 1 on the CPU, then the other way round;
3. each of them once per request, one at a time, to time a request end to end beside what its stages
   computed (``stats()``): the difference is the hand-off per hop (device to host copies included).

4. host <-> device bytes per hop (Note: hand-offs as OrtValues, ``onnxpipe/runtime/_handoff.py``): the
   same net with both stages on ``cuda:DEVICE`` (then stage 1 on ``cuda:DEVICE+1`` where there is one),
   driven stage by stage: what each stage call bound across its session's edge (``transfers()``:
   host -> device, device -> host) and the bytes of the ``MemcpyToHost`` / ``MemcpyFromHost`` nodes
   inside each stage's session (onnxruntime's profile); a CUDA -> CUDA hop on one device must move 0
   bytes through the host;
5. host <-> device bytes per decode step: a 4-layer GPT decoder (tests/stateful_models.py) in 2
   stages on ``cuda:DEVICE`` with its KV cache as stage state, ``--steps`` greedy steps of one stream.

It checks and prints: outputs equal the whole model's within rtol 1e-3, atol 1e-4 (TF32 off:
``use_tf32=0``); every node of the CUDA stage placed on CUDA (``pipe.placement()``); requests/s of each
pipeline through ``pipe.map``; the hop of step 4 on one device moving nothing through the host.
Before that, on any host, it measures what a CPU stage's hand-off costs on a ``--mb`` MB tensor (why a
CPU stage keeps ``session.run`` and numpy: Note: why a CPU stage keeps numpy). Exit code 0 when every
check passes, or when this host has no CUDA provider (it says what it would measure, and that it did
not), 1 when a check fails.

It has not been run by the suite's machines, which have no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.builder import build, export
from onnxpipe.runtime import load, read_bundle
from onnxpipe.runtime._handoff import Device, Handoff, Transfers, transfers
from onnxpipe.runtime._spec import Endpoint
from onnxpipe.runtime._stage import Request, StageRunner, make_runner, plan_stages
from onnxpipe.splitter import split
from tests.stateful_models import generate, gpt_decoder

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
LAYERS, CHANNELS = 8, 64


def conv_net(seed: int = 0) -> onnx.ModelProto:
    """``x`` [1, 3, 224, 224] -> ``y`` [1, 64, 224, 224]: Conv 3x3 + Relu, ``LAYERS`` times (He-initialised)."""
    rng = np.random.default_rng(seed)
    nodes, inits, prev, cin = [], [], "x", 3
    for k in range(LAYERS):
        w = (rng.standard_normal((CHANNELS, cin, 3, 3)) * np.sqrt(2.0 / (cin * 9))).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{k}"), numpy_helper.from_array(np.zeros(CHANNELS, np.float32), f"b{k}")]
        nodes += [helper.make_node("Conv", [prev, f"w{k}", f"b{k}"], [f"c{k}"], pads=[1, 1, 1, 1], name=f"conv{k}"),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}" if k < LAYERS - 1 else "y"], name=f"relu{k}")]
        prev, cin = f"r{k}", CHANNELS
    graph = helper.make_graph(nodes, "conv_net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 224, 224])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, CHANNELS, 224, 224])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


#: What the device part measures, said where it cannot run.
WOULD_MEASURE = (
    "outputs of a cuda -> cpu and a cpu -> cuda pipeline against the whole model on the CPU, every node of the CUDA stage on CUDA, "
    "the hand-off per hop and req/s; host <-> device bytes per hop (a cuda -> cuda hop on one device must move 0 bytes through the host; "
    "one across two devices, where there are two) from the bindings and the Memcpy nodes of each stage's profile; "
    "host <-> device bytes per decode step of a 2-stage GPT decoder on CUDA"
)


def _median_ms(call: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def cpu_copies(mb: int, rounds: int = 5) -> dict[str, Any]:
    """What a CPU stage's hand-off costs on an ``mb`` MB float32 tensor through a ``Relu``: a numpy
    copy of it, ``session.run`` fed it as it is and fed a strided view (which onnxruntime must copy
    first), the same call through a :class:`Handoff` on device ``cpu``, ``ortvalue_from_numpy`` and
    ``OrtValue.numpy()``; and whether ``session.run``'s output is onnxruntime's own buffer."""
    n = mb * 2**20 // 4
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(), options, providers=[CPU])
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    wide = np.repeat(x, 2)[::2]  # the same values, strided
    bound = Handoff(session, ["y"], [Device("cpu")])
    value = ort.OrtValue.ortvalue_from_numpy(x)
    out = session.run(["y"], {"x": x})[0]
    return {
        "numpy copy": _median_ms(lambda: x.copy(), rounds),
        "session.run": _median_ms(lambda: session.run(["y"], {"x": x}), rounds),
        "session.run, strided input": _median_ms(lambda: session.run(["y"], {"x": wide}), rounds),
        "IOBinding (Handoff on cpu)": _median_ms(lambda: bound({"x": x}), rounds),
        "ortvalue_from_numpy": _median_ms(lambda: ort.OrtValue.ortvalue_from_numpy(x), rounds),
        "OrtValue.numpy()": _median_ms(value.numpy, rounds),
        "output owns its memory": bool(out.flags.owndata),
        "OrtValue.numpy() shares the input": bool(np.shares_memory(value.numpy(), x)),
    }


def _print_cpu_copies(mb: int) -> None:
    measured = cpu_copies(mb)
    print(f"CPU hand-off costs on a {mb} MB float32 tensor (Relu, 1 thread; medians of 5):")
    for what, got in measured.items():
        print(f"  {what}: {got:.3f} ms" if isinstance(got, float) else f"  {what}: {got}")


def memcpy_bytes(module: str | bytes, config: dict[str, str], provider: tuple[str, dict[str, str]], feeds: dict[str, Any]) -> int:
    """Bytes the ``MemcpyToHost`` / ``MemcpyFromHost`` nodes of one session's graph copy in one call
    (onnxruntime's profile: each node event's ``output_size``)."""
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tmp, "stage")
        for key, value in config.items():
            options.add_session_config_entry(key, value)
        session = ort.InferenceSession(module, options, providers=[provider, CPU])
        session.run(None, {k: v.numpy() if isinstance(v, ort.OrtValue) else v for k, v in feeds.items()})
        events = json.loads(Path(session.end_profiling()).read_text())
    return sum(int(e.get("args", {}).get("output_size", 0)) for e in events
               if e.get("cat") == "Node" and e.get("args", {}).get("op_name", "") in ("MemcpyToHost", "MemcpyFromHost") and e["name"].endswith("_kernel_time"))


def _moved(before: Transfers) -> str:
    now = transfers()
    return f"host->device {now.to_device - before.to_device} B, device->host {now.to_host - before.to_host} B"


def hop_bytes(model: onnx.ModelProto, x: np.ndarray, devices: tuple[int, int], tmp: Path) -> bool:
    """Stage by stage on ``cuda:devices[0]`` then ``cuda:devices[1]``: the bytes each call bound
    across its session's edge, and its Memcpy nodes'. True when a hop on one device moved nothing."""
    plan = split(model, [f"r{LAYERS // 2 - 1}"])
    for stage, device in zip(plan.config.stages, devices, strict=True):
        stage.configure(target=f"cuda:{device}", provider_options={"use_tf32": "0"}, fallback=False)
    name = f"cuda:{devices[0]} -> cuda:{devices[1]}"
    bundle = read_bundle(export(build(plan.config, tmp / f"built-hop{devices[1]}").path, tmp / f"bundle-hop{devices[1]}"))
    plans, _ = plan_stages(bundle.spec)
    runners = [make_runner(bundle, p, 0) for p in plans]
    warm = Request(0, {Endpoint(None, "x"): x}, {}, time.perf_counter())
    for runner in runners:  # the first call of a CUDA session allocates and tunes: not what a hop costs
        runner(warm)
    request = Request(1, {Endpoint(None, "x"): x}, {}, time.perf_counter())
    ok = True
    for runner, stage_plan, device in zip(runners, plans, devices, strict=True):
        assert isinstance(runner, StageRunner)
        feeds = {name_: request.values[key] for name_, key in stage_plan.sources}
        before = transfers()
        start = time.perf_counter()
        runner(request)
        took = 1e3 * (time.perf_counter() - start)
        moved = transfers()
        module, config = bundle.session_source(stage_plan.stage)
        inside = memcpy_bytes(module, config, (CUDA, {"device_id": str(device), "use_tf32": "0"}), feeds)
        print(f"  {name}, {stage_plan.stage.name} ({took:.2f} ms, its input's hop in): {_moved(before)} at the session's edge; "
              f"Memcpy nodes inside {inside} B; handed on as OrtValue: {list(runner.handoff.on_device()) if runner.handoff else []}")
        if devices[0] == devices[1] and stage_plan is plans[0]:
            ok &= moved.to_host == before.to_host  # its output stayed on the device
        if devices[0] == devices[1] and stage_plan is plans[1]:
            ok &= moved.to_device == before.to_device  # its input came as the device's OrtValue
    print(f"  {name}: {'no host trip between the stages' if ok else 'FAIL: the hop went through the host'}")
    return ok


def decode_bytes(device: int, steps: int, tmp: Path) -> None:
    """Host <-> device bytes per greedy step of a 2-stage GPT decoder on ``cuda:device`` (its KV cache in the stages' state)."""
    plan = split(gpt_decoder(), ["layer1.out"], states="auto")
    for stage in plan.config.stages:
        stage.configure(target=f"cuda:{device}", provider_options={"use_tf32": "0"})
    bundle = export(build(plan.config, tmp / "built-decoder").path, tmp / "bundle-decoder")
    per_step: list[Transfers] = []
    with load(bundle) as pipe, pipe.stream() as stream:
        def step(feeds: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
            before = transfers()
            out = stream.step(feeds)
            now = transfers()
            per_step.append(Transfers(now.to_device - before.to_device, now.to_host - before.to_host, now.across - before.across, now.calls - before.calls))
            return out

        generate(step, [3, 4, 5], steps)
    for k, moved in enumerate(per_step):
        print(f"  decode step {k}: host->device {moved.to_device} B, device->host {moved.to_host} B over {moved.calls} stage calls")


def _second_device(device: int) -> int | None:
    """Another CUDA device here, if onnxruntime can open a session on one."""
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    try:
        session = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(),
                                       providers=[(CUDA, {"device_id": str(device + 1)})])
    except Exception:  # onnxruntime's own types: no such device
        return None
    return device + 1 if CUDA in session.get_providers() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--mb", type=int, default=100)
    args = parser.parse_args()
    if CUDA not in ort.get_available_providers():
        print(f"not run: this onnxruntime ({ort.__version__}) has no {CUDA} (providers: {', '.join(ort.get_available_providers())}); "
              "install onnxruntime-gpu on a host with a GPU")
        print(f"it would measure: {WOULD_MEASURE}")
        _print_cpu_copies(args.mb)
        return 0
    _print_cpu_copies(args.mb)
    model = conv_net()
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    reference = ort.InferenceSession(model.SerializeToString(), providers=[CPU]).run(None, {"x": x})[0]
    ok = True
    print(f"onnxruntime {ort.__version__}; conv net of {LAYERS} Conv+Relu layers, {CHANNELS} channels, [1, 3, 224, 224]")
    with tempfile.TemporaryDirectory() as tmp:
        for order in (("cuda", "cpu"), ("cpu", "cuda")):
            plan = split(model, [f"r{LAYERS // 2 - 1}"])
            for stage, target in zip(plan.config.stages, order, strict=True):
                if target == "cuda":
                    stage.configure(target=f"cuda:{args.device}", provider_options={"use_tf32": "0"}, fallback=False)
                else:
                    stage.configure(target="cpu", intra_op_threads=0)
            name = " -> ".join(order)
            bundle = export(build(plan.config, Path(tmp) / f"built-{order[0]}").path, Path(tmp) / f"bundle-{order[0]}")
            with load(bundle) as pipe:
                out = pipe({"x": x})["y"]
                where = pipe.placement()
                error = float(np.abs(out - reference).max())
                close = bool(np.allclose(out, reference, rtol=1e-3, atol=1e-4))
                gpu_stage = plan.config.stages[order.index("cuda")].name
                placed = where[gpu_stage]
                on_cuda = placed is not None and list(placed) == [CUDA]
                pipe.reset_stats()
                times = []
                for _ in range(30):
                    start = time.perf_counter()
                    pipe({"x": x})
                    times.append(time.perf_counter() - start)
                stats = pipe.stats()
                hop = (statistics.median(times) - sum(s.p50_ms for s in stats.stages) / 1e3) / 2  # two hops: into stage 1, out of the pipeline
                start = time.perf_counter()
                for _ in pipe.map({"x": x} for _ in range(args.requests)):
                    pass
                rate = args.requests / (time.perf_counter() - start)
            ok &= close and on_cuda
            counts = {ep: len(nodes) for ep, nodes in (placed or {}).items()}
            print(f"{name}: max abs error {error:.2e} ({'ok' if close else 'FAIL'}); {gpu_stage} nodes {counts} ({'all on CUDA' if on_cuda else 'FAIL'}); "
                  f"stages p50 {', '.join(f'{s.p50_ms:.2f} ms' for s in stats.stages)}; hand-off per hop {1e3 * hop:.2f} ms; {rate:.1f} req/s")
        print("host <-> device bytes per hop:")
        ok &= hop_bytes(model, x, (args.device, args.device), Path(tmp))
        other = _second_device(args.device)
        if other is None:
            print("  one CUDA device here: no cross-device hop measured")
        else:
            hop_bytes(model, x, (args.device, other), Path(tmp))
        print(f"host <-> device bytes per decode step (GPT decoder, 2 stages on cuda:{args.device}):")
        decode_bytes(args.device, args.steps, Path(tmp))
    print("all checks passed" if ok else "a check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
