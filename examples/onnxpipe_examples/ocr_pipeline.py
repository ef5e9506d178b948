"""Author and build the PP-OCR chain as one onnxpipe bundle (the build host's side).

The deployment host needs only :mod:`onnxpipe_examples.ocr` (the glue the code stages name) and
onnxpipe's runtime; this module imports the splitter and builder, so it stays apart from it.

    bundle = build_ocr_bundle("work/ocr.onnxpipe")
    with runtime.load(bundle, allow_code=ALLOW_CODE) as pipe:
        out = pipe({"image": bgr})            # texts, scores, boxes, angles
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from onnxpipe.builder import PipelineConfig, Stage, build, export
from onnxpipe.runtime import Endpoint, TensorSpec
from onnxpipe.splitter import MeasuredPolicy, SplitPlan, SplitPolicy, split
from onnxpipe_examples import ocr

__all__ = ["ALLOW_CODE", "DET_PROFILE_DIMS", "build_ocr_bundle", "ocr_config", "split_detector"]

#: What a host passes to ``runtime.load(..., allow_code=...)`` to run this bundle's code stages.
ALLOW_CODE = ["onnxpipe_examples.ocr:*"]
#: The detector's dynamic dims (batch, height, width) when the splitter profiles it: a small image, so
#: that splitting takes a second or two; a conv net's per-layer cost shares barely change with size.
DET_PROFILE_DIMS = {"p2o.DynamicDimension.0": 1, "p2o.DynamicDimension.1": 320, "p2o.DynamicDimension.2": 320}

_ENTRY = "onnxpipe_examples.ocr:"


def _t(name: str, dtype: str, *shape: int | str) -> TensorSpec:
    return TensorSpec(name, dtype, tuple(shape))


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
    code = config.add_python_stage
    pre = code(
        _ENTRY + "preprocess",
        inputs=[_t("image", "uint8", "height", "width", 3)],
        outputs=[_t("det_input", "float32", 1, 3, "det_h", "det_w"), _t("image", "uint8", "img_h", "img_w", 3), _t("transform", "float64", 5)],
        params=ocr.PREPROCESS_PARAMS,
        name="preprocess",
    )
    det_stages, det_in, det_out = _add_split(config, det or split_detector(model=paths["det"]), "det")
    found = code(
        _ENTRY + "boxes",
        inputs=[_t("det_prob", "float32", 1, 1, "det_h", "det_w"), _t("image", "uint8", "img_h", "img_w", 3), _t("transform", "float64", 5)],
        outputs=[
            _t("boxes", "float32", "boxes", 4, 2),
            _t("crops", "uint8", "boxes", "crop_h", "crop_w", 3),
            _t("crop_sizes", "int64", "boxes", 2),
            _t("cls_input", "float32", "boxes", 3, 48, 192),
        ],
        params=ocr.DET_PARAMS,
        name="boxes",
    )
    cls = config.add_stage(paths["cls"], "cls")
    turn = code(
        _ENTRY + "rotate",
        inputs=[_t("crops", "uint8", "boxes", "crop_h", "crop_w", 3), _t("crop_sizes", "int64", "boxes", 2), _t("cls_prob", "float32", "boxes", 2)],
        outputs=[_t("rec_input", "float32", "rec_batch", 3, 48, "rec_w"), _t("angles", "int64", "boxes")],
        params=ocr.CLS_PARAMS,
        name="rotate",
    )
    rec = config.add_stage(paths["rec"], "rec")
    dec = code(
        _ENTRY + "decode",
        inputs=[_t("rec_prob", "float32", "rec_batch", "steps", "classes"), _t("boxes", "float32", "boxes", 4, 2), _t("angles", "int64", "boxes")],
        outputs=[
            _t("texts", "string", "results"),
            _t("scores", "float64", "results"),
            _t("boxes", "float32", "results", 4, 2),
            _t("angles", "int64", "results"),
        ],
        params={**ocr.DECODE_PARAMS, "characters": ocr.characters(paths["rec"])},
        name="decode",
    )
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
