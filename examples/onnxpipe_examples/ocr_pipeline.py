"""Author and build the PP-OCR chain as one onnxpipe bundle (the build host's side).

The deployment host needs only :mod:`onnxpipe_examples.ocr` (the glue the code stages name) and
onnxpipe's runtime; this module imports the splitter and builder, so it stays apart from it.

    bundle = build_ocr_bundle("work/ocr.onnxpipe")
    with runtime.load(bundle, allow_code=ALLOW_CODE) as pipe:
        out = pipe({"image": bgr})            # texts, scores, boxes, angles
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from onnxpipe.builder import PipelineConfig, Stage, build, export
from onnxpipe.runtime import Endpoint, TensorSpec
from onnxpipe.splitter import MeasuredPolicy, SplitPlan, SplitPolicy, split
from onnxpipe_examples import ocr

__all__ = ["ALLOW_CODE", "CODE_PORTS", "DET_CUT", "DET_PROFILE_DIMS", "build_ocr_bundle", "ocr_config", "pipeline_file", "split_detector"]

#: What a host passes to ``runtime.load(..., allow_code=...)`` to run this bundle's code stages.
ALLOW_CODE = ["onnxpipe_examples.ocr:*"]
#: The detector's dynamic dims (batch, height, width) when the splitter profiles it: a small image, so
#: that splitting takes a second or two; a conv net's per-layer cost shares barely change with size.
DET_PROFILE_DIMS = {"p2o.DynamicDimension.0": 1, "p2o.DynamicDimension.1": 320, "p2o.DynamicDimension.2": 320}

#: Where the measured policy cuts the detector (profiled at :data:`DET_PROFILE_DIMS`): after the
#: backbone, whose four feature maps cross to the DB neck and head. The pipeline file cuts there by name.
DET_CUT = ["p2o.Add.43", "p2o.Add.71", "p2o.Add.147", "hardswish_80.tmp_0"]

_ENTRY = "onnxpipe_examples.ocr:"


def _t(name: str, dtype: str, *shape: int | str) -> TensorSpec:
    return TensorSpec(name, dtype, tuple(shape))


#: Each code stage's ports (inputs, outputs). Symbolic dims: ``boxes`` is the number of boxes found
#: in the request's image (0 or more), ``results`` those kept after the score filter.
CODE_PORTS: dict[str, tuple[list[TensorSpec], list[TensorSpec]]] = {
    "preprocess": (
        [_t("image", "uint8", "height", "width", 3)],
        [_t("det_input", "float32", 1, 3, "det_h", "det_w"), _t("image", "uint8", "img_h", "img_w", 3), _t("transform", "float64", 5)],
    ),
    "boxes": (
        [_t("det_prob", "float32", 1, 1, "det_h", "det_w"), _t("image", "uint8", "img_h", "img_w", 3), _t("transform", "float64", 5)],
        [
            _t("boxes", "float32", "boxes", 4, 2),
            _t("crops", "uint8", "boxes", "crop_h", "crop_w", 3),
            _t("crop_sizes", "int64", "boxes", 2),
            _t("cls_input", "float32", "boxes", 3, 48, 192),
        ],
    ),
    "rotate": (
        [_t("crops", "uint8", "boxes", "crop_h", "crop_w", 3), _t("crop_sizes", "int64", "boxes", 2), _t("cls_prob", "float32", "boxes", 2)],
        [_t("rec_input", "float32", "rec_batch", 3, 48, "rec_w"), _t("angles", "int64", "boxes")],
    ),
    "decode": (
        [_t("rec_prob", "float32", "rec_batch", "steps", "classes"), _t("boxes", "float32", "boxes", 4, 2), _t("angles", "int64", "boxes")],
        [_t("texts", "string", "results"), _t("scores", "float64", "results"), _t("boxes", "float32", "results", 4, 2), _t("angles", "int64", "results")],
    ),
}


def _code_params(rec_model: Path) -> dict[str, dict[str, Any]]:
    """Each code stage's params: RapidOCR's settings, and the dictionary read from the rec model."""
    return {
        "preprocess": ocr.PREPROCESS_PARAMS,
        "boxes": ocr.DET_PARAMS,
        "rotate": ocr.CLS_PARAMS,
        "decode": {**ocr.DECODE_PARAMS, "characters": ocr.characters(rec_model)},
    }


def split_detector(policy: SplitPolicy | None = None, model: str | os.PathLike[str] | None = None) -> SplitPlan:
    """The detector split by onnxpipe's splitter.

    Args:
        policy: How to split it (default: 2 stages by measured costs, profiled at :data:`DET_PROFILE_DIMS`).
        model: The det model (default: the wheel's).
    """
    return split(model or ocr.model_paths()["det"], policy=policy or MeasuredPolicy(stages=2, dims=DET_PROFILE_DIMS, runs=3))


def _add_split(config: PipelineConfig, plan: SplitPlan, prefix: str) -> tuple[list[Stage], dict[str, Endpoint], dict[str, Endpoint]]:
    """Add the stages of ``plan`` as ``<prefix><i>``, linked to each other as in the plan.

    Returns:
        The stages, and where the model's inputs go (name -> stage input) and its outputs come
        from (name -> stage output), for the caller to wire.
    """
    names = {s.name: f"{prefix}{s.index}" for s in plan.stages}
    stages = [config.add_stage(s.model, names[s.name], source_dir=plan.source_dir) for s in plan.stages]
    inputs: dict[str, Endpoint] = {}
    outputs: dict[str, Endpoint] = {}
    for link in plan.spec.links:
        src, dst = link.src, link.dst
        if src.stage is None and dst.stage is not None:
            inputs[src.tensor] = Endpoint(names[dst.stage], dst.tensor)
        elif dst.stage is None and src.stage is not None:
            outputs[dst.tensor] = Endpoint(names[src.stage], src.tensor)
        elif src.stage is not None and dst.stage is not None:
            config.stage(names[src.stage]).output(src.tensor).connect(config.stage(names[dst.stage]).input(dst.tensor))
    return stages, inputs, outputs


def ocr_config(
    det: SplitPlan | None = None,
    models: Mapping[str, str | os.PathLike[str]] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> PipelineConfig:
    """The OCR chain as a :class:`PipelineConfig`: preprocess (code) -> det (ONNX, split in 2 stages by
    onnxpipe's splitter) -> boxes (code: DB post-processing and crops) -> cls (ONNX) -> rotate (code)
    -> rec (ONNX) -> decode (code: CTC with the rec model's dictionary).

    Args:
        det: The detector's split (default: :func:`split_detector`'s).
        models: det / cls / rec model paths (default: the wheel's, :func:`ocr.model_paths`).
        settings: Settings for every ONNX stage (e.g. ``{"intra_op_threads": 1}``; default: 1 thread).

    Returns:
        The config: one input ``image`` (uint8 height x width x 3, BGR) and outputs ``texts``,
        ``scores``, ``boxes`` and ``angles`` (see :func:`ocr.decode`).
    """
    paths = {**ocr.model_paths(), **{k: Path(v) for k, v in (models or {}).items()}}
    config = PipelineConfig("ocr")
    config.metadata["example"] = "onnxpipe_examples PP-OCR (rapidocr_onnxruntime 1.4.4 models)"
    params = _code_params(paths["rec"])

    def code(name: str) -> Stage:
        inputs, outputs = CODE_PORTS[name]
        return config.add_python_stage(_ENTRY + name, inputs=inputs, outputs=outputs, params=params[name], name=name)

    pre = code("preprocess")
    det_stages, det_in, det_out = _add_split(config, det or split_detector(model=paths["det"]), "det_")
    found = code("boxes")
    cls = config.add_stage(paths["cls"], "cls")
    turn = code("rotate")
    rec = config.add_stage(paths["rec"], "rec")
    dec = code("decode")
    for stage in (*det_stages, cls, rec):
        stage.configure(**{"intra_op_threads": 1, **(settings or {})})

    config.input("image").connect(pre.input("image"))
    ((first, det_input),) = ((config.stage(e.stage or ""), e.tensor) for e in det_in.values())
    pre.output("det_input").connect(first.input(det_input))
    ((last, det_output),) = ((config.stage(e.stage or ""), e.tensor) for e in det_out.values())
    last.output(det_output).connect(found.input("det_prob"))
    for t in ("image", "transform"):
        pre.output(t).connect(found.input(t))
    found.output("cls_input").connect(cls.input(cls.inputs[0].name))
    for t in ("crops", "crop_sizes"):
        found.output(t).connect(turn.input(t))
    cls.output(cls.outputs[0].name).connect(turn.input("cls_prob"))
    turn.output("rec_input").connect(rec.input(rec.inputs[0].name))
    rec.output(rec.outputs[0].name).connect(dec.input("rec_prob"))
    found.output("boxes").connect(dec.input("boxes"))
    turn.output("angles").connect(dec.input("angles"))
    for t in ("texts", "scores", "boxes", "angles"):
        dec.output(t).connect(config.output(t))
    return config


def build_ocr_bundle(out: str | os.PathLike[str], det: SplitPlan | None = None, settings: Mapping[str, Any] | None = None, overwrite: bool = False) -> Path:
    """Build the chain of :func:`ocr_config` and export it as one bundle.

    Args:
        out: The bundle (a folder, or one archive when the name ends with ``.onnxpipe``).
        det: See :func:`ocr_config`.
        settings: See :func:`ocr_config`.
        overwrite: Replace ``out`` if it exists.

    Returns:
        The bundle's path; load it with ``runtime.load(path, allow_code=ALLOW_CODE)``.
    """
    config = ocr_config(det, settings=settings)
    with tempfile.TemporaryDirectory(prefix="ocr-build-") as tmp:
        built = build(config, Path(tmp) / "built")
        return export(built.path, out, overwrite=overwrite)


def _toml(value: Any) -> str:
    # JSON strings, numbers, booleans and arrays are valid TOML; tables become inline tables.
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k if re.fullmatch(r'[A-Za-z0-9_-]+', str(k)) else json.dumps(str(k))} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def pipeline_file(path: str | os.PathLike[str], models: Mapping[str, str | os.PathLike[str]] | None = None) -> Path:
    """Write the chain as an onnxpipe pipeline file (``onnxpipe build PATH -o built``).

    The same stages and wiring as :func:`ocr_config`, declared: the detector split in place at
    :data:`DET_CUT`, tensors wired by name (``input_map`` / ``output_map`` rename the ``x`` inputs of
    the three models and the tensors two stages both call ``image``, ``boxes`` or ``angles``). The
    file is written rather than stored because it names the wheel's models where they are installed
    and carries the 6625-entry dictionary as the decode stage's params.

    Args:
        path: The ``.toml`` file to write.
        models: det / cls / rec model paths (default: the wheel's).

    Returns:
        ``path``.
    """
    paths = {**ocr.model_paths(), **{k: Path(v) for k, v in (models or {}).items()}}

    params = _code_params(paths["rec"])

    def port(t: TensorSpec) -> str:
        return _toml({"name": t.name, "dtype": t.dtype, "shape": list(t.shape or ())})

    def code(name: str, **maps: Mapping[str, str]) -> str:
        inputs, outputs = CODE_PORTS[name]
        lines = ["[[stages]]", f'name = "{name}"', f'code = "{_ENTRY}{name}"', f"params = {_toml(params[name])}"]
        lines += [f"inputs = [{', '.join(map(port, inputs))}]", f"outputs = [{', '.join(map(port, outputs))}]"]
        lines += [f"{k} = {_toml(v)}" for k, v in maps.items()]
        return "\n".join(lines)

    def model(name: str, **extra: Any) -> str:
        lines = ["[[stages]]", f'name = "{name}"', f"model = {_toml(str(paths[name].resolve()))}"]
        lines += [f"{k} = {_toml(v)}" for k, v in {**extra, "settings": {"intra_op_threads": 1}}.items()]
        return "\n".join(lines)

    stages = [
        code("preprocess", output_map={"image": "letterboxed"}),
        model("det", at=[DET_CUT], input_map={"x": "det_input"}, output_map={"sigmoid_0.tmp_0": "det_prob"}),
        code("boxes", input_map={"image": "letterboxed"}, output_map={"boxes": "all_boxes"}),
        model("cls", input_map={"x": "cls_input"}, output_map={"save_infer_model/scale_0.tmp_1": "cls_prob"}),
        code("rotate", output_map={"angles": "all_angles"}),
        model("rec", input_map={"x": "rec_input"}, output_map={"softmax_11.tmp_0": "rec_prob"}),
        code("decode", input_map={"boxes": "all_boxes", "angles": "all_angles"}),
    ]
    head = [
        "# The PP-OCR chain of onnxpipe_examples (docs/ocr-example.md), written by onnxpipe_examples.ocr_pipeline.pipeline_file.",
        'format = "onnxpipe.pipeline-file"',
        "version = 1",
        'name = "ocr"',
        'inputs = ["image"]',
        'outputs = ["texts", "scores", "boxes", "angles"]',
    ]
    out = Path(path)
    out.write_text("\n\n".join(["\n".join(head), *stages]) + "\n", encoding="utf-8")
    return out
