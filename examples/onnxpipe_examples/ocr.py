"""PP-OCR as one onnxpipe pipeline: the glue code stages, and the chain they make with the models.

The ``rapidocr_onnxruntime`` wheel ships three PP-OCR models (text detection, angle classification,
recognition). Its ``RapidOCR`` class runs them with Python pre- and post-processing in between; this
module is that Python cut into code stages with onnxpipe's contract, ``fn(inputs, params) -> outputs``
(dicts of numpy arrays; params are plain JSON values), so the whole chain is one bundle::

    image ─ preprocess ─ det (2 ONNX stages) ─ boxes ─ cls (ONNX) ─ rotate ─ rec (ONNX) ─ decode ─ texts, scores, boxes
                       └── image, transform ──┘     └──── crops ────────┘             boxes ─┘

Every step follows rapidocr_onnxruntime 1.4.4 (``main.py``, ``ch_ppocr_det``, ``ch_ppocr_cls``,
``ch_ppocr_rec``) with its default ``config.yaml``; the defaults below are that file's numbers.

Note: one recognition batch.
    RapidOCR recognises the crops in batches of 6 (sorted by aspect ratio), each batch padded to
    its widest crop. A pipeline stage runs its model once per request, so :func:`rotate` makes one
    N x 3 x 48 x W batch padded to the widest crop of the image. Up to 6 boxes this is exactly
    RapidOCR's batch; with more, narrower crops get more zero padding on their right than RapidOCR
    gives them (the model reads padding as CTC blanks; results agree on the test images).

Note: the dictionary travels as params.
    The recogniser's character list is in the rec model's metadata (``character``). The chain
    builder reads it once at build time and gives it to :func:`decode` as a parameter, so the decode
    stage needs no model file and the bundle (whose ``pipeline.json`` carries the params) is
    complete and checked on its own: a host runs it without the wheel's model files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pyclipper
from shapely.geometry import Polygon

__all__ = [
    "CLS_PARAMS",
    "DECODE_PARAMS",
    "DET_PARAMS",
    "PREPROCESS_PARAMS",
    "SequentialOcr",
    "boxes",
    "characters",
    "decode",
    "model_paths",
    "preprocess",
    "render_lines",
    "rotate",
]

#: RapidOCR's ``Global`` and ``Det`` pre-processing settings.
PREPROCESS_PARAMS: dict[str, Any] = {
    "max_side_len": 2000,
    "min_side_len": 30,
    "min_height": 30,
    "width_height_ratio": 8,
    "limit_side_len": 736,
    "limit_type": "min",
    "mean": [0.5, 0.5, 0.5],
    "std": [0.5, 0.5, 0.5],
}
#: RapidOCR's DB post-processing settings (``Det``) and the classifier's input shape (``Cls``).
DET_PARAMS: dict[str, Any] = {
    "thresh": 0.3,
    "box_thresh": 0.5,
    "max_candidates": 1000,
    "unclip_ratio": 1.6,
    "use_dilation": True,
    "score_mode": "fast",
    "cls_image_shape": [3, 48, 192],
}
#: The angle classifier's labels and threshold, and the recogniser's input shape.
CLS_PARAMS: dict[str, Any] = {"label_list": ["0", "180"], "cls_thresh": 0.9, "rec_img_shape": [3, 48, 320]}
#: Results scoring below ``text_score`` are dropped (``Global.text_score``); ``characters`` is added at build time.
DECODE_PARAMS: dict[str, Any] = {"text_score": 0.5}

_MIN_SIZE = 3  # DBPostProcess.min_size


def model_paths() -> dict[str, Path]:
    """The det, cls and rec models inside the installed ``rapidocr_onnxruntime`` wheel.

    Raises:
        ModuleNotFoundError: the wheel is not installed (``pip install -e examples``).
    """
    import rapidocr_onnxruntime

    folder = Path(rapidocr_onnxruntime.__file__).parent / "models"
    return {
        "det": folder / "ch_PP-OCRv4_det_infer.onnx",
        "cls": folder / "ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "rec": folder / "ch_PP-OCRv4_rec_infer.onnx",
    }


def characters(rec_model: str | Path | None = None) -> list[str]:
    """The recogniser's dictionary, from its model's ``character`` metadata, as RapidOCR builds it:
    CTC blank first, then the listed characters, then a space.

    Args:
        rec_model: The rec model (default: the wheel's).
    """
    import onnx

    model = onnx.load(str(rec_model or model_paths()["rec"]), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    return ["blank", *meta["character"].splitlines(), " "]


# -- preprocess -----------------------------------------------------------------------------------


def _resize_to_32(img: np.ndarray, ratio: float) -> np.ndarray:
    # reduce_max_side / increase_min_side / DetPreProcess.resize: scale, then round each side to 32.
    h, w = img.shape[:2]
    resize_h = round(int(h * ratio) / 32) * 32
    resize_w = round(int(w * ratio) / 32) * 32
    if resize_h <= 0 or resize_w <= 0:
        raise ValueError(f"image of {h} x {w} pixels is too small to resize by {ratio}")
    return cv2.resize(img, (resize_w, resize_h))


def preprocess(inputs: Mapping[str, np.ndarray], params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Resize and pad the image as RapidOCR does, and make the detector's input.

    Args:
        inputs: ``image``: uint8 H x W x 3, BGR (as ``cv2.imread`` gives).
        params: :data:`PREPROCESS_PARAMS`.

    Returns:
        ``det_input``: float32 1 x 3 x h x w (sides multiples of 32); ``image``: the resized and
        letterboxed uint8 image the boxes are found in; ``transform``: float64 [ratio_h, ratio_w,
        pad_top, raw_h, raw_w], what maps boxes back onto the original image.
    """
    img = inputs["image"]
    raw_h, raw_w = img.shape[:2]
    ratio_h = ratio_w = 1.0
    # RapidOCR.preprocess: the later resize's ratios win, as there.
    for limit, too_big in ((params["max_side_len"], True), (params["min_side_len"], False)):
        h, w = img.shape[:2]
        if (max(h, w) > limit) if too_big else (min(h, w) < limit):
            side = (h if h > w else w) if too_big else (h if h < w else w)
            img = _resize_to_32(img, float(limit) / side)
            ratio_h, ratio_w = h / img.shape[0], w / img.shape[1]
    # RapidOCR.maybe_add_letterbox: pad short or very wide images top and bottom.
    h, w = img.shape[:2]
    top = 0
    wide = params["width_height_ratio"] != -1 and w / h > params["width_height_ratio"]
    if h <= params["min_height"] or wide:
        new_h = max(int(w / params["width_height_ratio"]), params["min_height"]) * 2
        top = int(abs(new_h - h) / 2)
        img = cv2.copyMakeBorder(img, top, top, 0, 0, cv2.BORDER_CONSTANT, value=(0, 0, 0))
    # DetPreProcess with limit_type "min" (or "max").
    h, w = img.shape[:2]
    limit = params["limit_side_len"]
    if params["limit_type"] == "max":
        ratio = float(limit) / (h if h > w else w) if max(h, w) > limit else 1.0
    else:
        ratio = float(limit) / (h if h < w else w) if min(h, w) < limit else 1.0
    resized = _resize_to_32(img, ratio)
    normed = (resized.astype("float32") * (1 / 255.0) - np.array(params["mean"])) / np.array(params["std"])
    det_input = np.expand_dims(normed.transpose((2, 0, 1)), axis=0).astype(np.float32)
    transform = np.array([ratio_h, ratio_w, top, raw_h, raw_w], dtype=np.float64)
    return {"det_input": det_input, "image": img, "transform": transform}


# -- DB post-processing and crops -----------------------------------------------------------------


def _mini_box(contour: np.ndarray) -> tuple[np.ndarray, float]:
    # DBPostProcess.get_mini_boxes: the min-area rectangle's corners, clockwise from top-left.
    rect = cv2.minAreaRect(contour)
    points = sorted(cv2.boxPoints(rect), key=lambda p: p[0])
    i1, i4 = (0, 1) if points[1][1] > points[0][1] else (1, 0)
    i2, i3 = (2, 3) if points[3][1] > points[2][1] else (3, 2)
    return np.array([points[i1], points[i2], points[i3], points[i4]]), min(rect[1])


def _box_score_fast(pred: np.ndarray, box: np.ndarray) -> float:
    h, w = pred.shape[:2]
    box = box.copy()
    xmin = np.clip(np.floor(box[:, 0].min()).astype(np.int32), 0, w - 1)
    xmax = np.clip(np.ceil(box[:, 0].max()).astype(np.int32), 0, w - 1)
    ymin = np.clip(np.floor(box[:, 1].min()).astype(np.int32), 0, h - 1)
    ymax = np.clip(np.ceil(box[:, 1].max()).astype(np.int32), 0, h - 1)
    mask = np.zeros((ymax - ymin + 1, xmax - xmin + 1), dtype=np.uint8)
    box[:, 0] -= xmin
    box[:, 1] -= ymin
    cv2.fillPoly(mask, [box.reshape(-1, 2).astype(np.int32)], 1)
    return float(cv2.mean(pred[ymin : ymax + 1, xmin : xmax + 1], mask)[0])


def _box_score_slow(pred: np.ndarray, contour: np.ndarray) -> float:
    h, w = pred.shape[:2]
    contour = np.reshape(contour.copy(), (-1, 2))
    xmin, xmax = np.clip(contour[:, 0].min(), 0, w - 1), np.clip(contour[:, 0].max(), 0, w - 1)
    ymin, ymax = np.clip(contour[:, 1].min(), 0, h - 1), np.clip(contour[:, 1].max(), 0, h - 1)
    mask = np.zeros((ymax - ymin + 1, xmax - xmin + 1), dtype=np.uint8)
    contour[:, 0] -= xmin
    contour[:, 1] -= ymin
    cv2.fillPoly(mask, [contour.reshape(-1, 2).astype(np.int32)], 1)
    return float(cv2.mean(pred[ymin : ymax + 1, xmin : xmax + 1], mask)[0])


def _unclip(box: np.ndarray, unclip_ratio: float) -> np.ndarray:
    poly = Polygon(box)
    distance = poly.area * unclip_ratio / poly.length
    offset = pyclipper.PyclipperOffset()
    offset.AddPath(box, pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    return np.array(offset.Execute(distance)).reshape((-1, 1, 2))


def _db_boxes(prob: np.ndarray, shape: tuple[int, int], params: Mapping[str, Any]) -> list[np.ndarray]:
    """DBPostProcess then TextDetector.filter_tag_det_res: int boxes in the image of ``shape``."""
    pred = prob[0, 0]
    bitmap = (pred > params["thresh"]).astype(np.uint8)
    if params["use_dilation"]:
        bitmap = cv2.dilate(bitmap, np.array([[1, 1], [1, 1]]))
    height, width = bitmap.shape
    dest_h, dest_w = shape
    contours, _ = cv2.findContours(bitmap * 255, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    found = []
    for contour in contours[: params["max_candidates"]]:
        points, side = _mini_box(contour)
        if side < _MIN_SIZE:
            continue
        score = _box_score_fast(pred, points.reshape(-1, 2)) if params["score_mode"] == "fast" else _box_score_slow(pred, contour)
        if params["box_thresh"] > score:
            continue
        box, side = _mini_box(_unclip(points, params["unclip_ratio"]))
        if side < _MIN_SIZE + 2:
            continue
        box[:, 0] = np.clip(np.round(box[:, 0] / width * dest_w), 0, dest_w)
        box[:, 1] = np.clip(np.round(box[:, 1] / height * dest_h), 0, dest_h)
        found.append(box.astype(np.int32))
    kept = []
    for box in found:
        box = _clockwise(box)
        box[:, 0] = np.clip(box[:, 0], 0, dest_w - 1)  # clip_det_res (the values are whole already)
        box[:, 1] = np.clip(box[:, 1], 0, dest_h - 1)
        if int(np.linalg.norm(box[0] - box[1])) <= 3 or int(np.linalg.norm(box[0] - box[3])) <= 3:
            continue
        kept.append(box)
    return kept


def _clockwise(pts: np.ndarray) -> np.ndarray:
    # TextDetector.order_points_clockwise: tl, tr, br, bl.
    by_x = pts[np.argsort(pts[:, 0]), :]
    left, right = by_x[:2], by_x[2:]
    tl, bl = left[np.argsort(left[:, 1]), :]
    tr, br = right[np.argsort(right[:, 1]), :]
    return np.array([tl, tr, br, bl], dtype="float32")


def _reading_order(found: list[np.ndarray]) -> list[np.ndarray]:
    # RapidOCR.sorted_boxes: top to bottom, then left to right within 10 pixels of height.
    order = sorted(found, key=lambda b: (b[0][1], b[0][0]))
    for i in range(len(order) - 1):
        for j in range(i, -1, -1):
            if abs(order[j + 1][0][1] - order[j][0][1]) < 10 and order[j + 1][0][0] < order[j][0][0]:
                order[j], order[j + 1] = order[j + 1], order[j]
            else:
                break
    return order


def _crop(img: np.ndarray, points: np.ndarray) -> np.ndarray:
    # RapidOCR.get_crop_img_list's get_rotate_crop_image: warp the box upright; tall crops turn 90 degrees.
    width = int(max(np.linalg.norm(points[0] - points[1]), np.linalg.norm(points[2] - points[3])))
    height = int(max(np.linalg.norm(points[0] - points[3]), np.linalg.norm(points[1] - points[2])))
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    warp = cv2.getPerspectiveTransform(points, target)
    crop = cv2.warpPerspective(img, warp, (width, height), borderMode=cv2.BORDER_REPLICATE, flags=cv2.INTER_CUBIC)
    return np.rot90(crop) if crop.shape[0] * 1.0 / crop.shape[1] >= 1.5 else crop


def _norm_crop(img: np.ndarray, shape: Sequence[int], width: int) -> np.ndarray:
    # TextClassifier / TextRecognizer.resize_norm_img: keep the aspect ratio, pad right with zeros.
    channels, height = shape[0], shape[1]
    ratio = img.shape[1] / float(img.shape[0])
    resized_w = width if math.ceil(height * ratio) > width else math.ceil(height * ratio)
    resized = cv2.resize(img, (resized_w, height)).astype("float32").transpose((2, 0, 1)) / 255
    resized -= 0.5
    resized /= 0.5
    out = np.zeros((channels, height, width), dtype=np.float32)
    out[:, :, :resized_w] = resized
    return out


def _original_points(found: list[np.ndarray], transform: np.ndarray) -> np.ndarray:
    # RapidOCR._get_origin_points: undo the letterbox, then the resize; clip to the original image.
    ratio_h, ratio_w, top, raw_h, raw_w = (float(v) for v in transform)
    pts = np.array(found).astype(np.float32).reshape(-1, 4, 2)
    pts[:, :, 1] -= top
    pts[:, :, 0] *= ratio_w
    pts[:, :, 1] *= ratio_h
    pts = np.where(pts < 0, 0, pts)
    pts[..., 0] = np.where(pts[..., 0] > raw_w, raw_w, pts[..., 0])
    pts[..., 1] = np.where(pts[..., 1] > raw_h, raw_h, pts[..., 1])
    return pts


def boxes(inputs: Mapping[str, np.ndarray], params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """DB post-processing: text boxes from the detector's probability map, in reading order, and
    their crops.

    Args:
        inputs: ``det_prob``: float32 1 x 1 x h x w (the detector's output); ``image`` and
            ``transform`` from :func:`preprocess`.
        params: :data:`DET_PARAMS`.

    Returns:
        For N boxes (N may be 0): ``boxes``: float32 N x 4 x 2, corners on the original image;
        ``crops``: uint8 N x H x W x 3, each upright crop at the top-left of a zero canvas as big as
        the largest; ``crop_sizes``: int64 N x 2 (height, width of each); ``cls_input``: float32
        N x 3 x 48 x 192, the classifier's batch.
    """
    img, transform = inputs["image"], inputs["transform"]
    found = _reading_order(_db_boxes(inputs["det_prob"], img.shape[:2], params))
    crops = [_crop(img, box.copy()) for box in found]
    sizes = np.array([c.shape[:2] for c in crops], dtype=np.int64).reshape(-1, 2)
    canvas = np.zeros((len(crops), *(sizes.max(axis=0) if len(crops) else (1, 1)), 3), dtype=np.uint8)
    for k, c in enumerate(crops):
        canvas[k, : c.shape[0], : c.shape[1]] = c
    shape = params["cls_image_shape"]
    cls_input = np.zeros((len(crops), *shape), dtype=np.float32)
    for k, c in enumerate(crops):
        cls_input[k] = _norm_crop(c, shape, shape[2])
    return {"boxes": _original_points(found, transform), "crops": canvas, "crop_sizes": sizes, "cls_input": cls_input}


# -- rotate -----------------------------------------------------------------------------------------


def rotate(inputs: Mapping[str, np.ndarray], params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Turn the crops the classifier reads as upside down, and make the recogniser's batch.

    Args:
        inputs: ``crops`` and ``crop_sizes`` from :func:`boxes`; ``cls_prob``: float32 N x 2, the
            classifier's output.
        params: :data:`CLS_PARAMS`.

    Returns:
        ``rec_input``: float32 N x 3 x 48 x W, W from the widest crop (see the note on one
        recognition batch; one blank row when N is 0); ``angles``: int64 N, 0 or 180 as the classifier read each crop.
    """
    crops, sizes, prob = inputs["crops"], inputs["crop_sizes"], inputs["cls_prob"]
    labels = params["label_list"]
    images, angles = [], []
    for k, (h, w) in enumerate(sizes.tolist()):
        img = crops[k, :h, :w]
        idx = int(prob[k].argmax())
        turn = "180" in labels[idx] and prob[k, idx] > params["cls_thresh"]
        images.append(cv2.rotate(img, cv2.ROTATE_180) if turn else img)
        angles.append(int(labels[idx]) if labels[idx].isdigit() else 0)
    channels, height, width = params["rec_img_shape"]
    max_ratio = max([width / height] + [w * 1.0 / h for h, w in sizes.tolist()])
    rec_w = int(height * max_ratio)
    # The rec model cannot take an empty batch (a Reshape to -1 of 0 elements fails): an image
    # without text sends one blank row, which decode ignores (it reads as many rows as boxes).
    rec_input = np.zeros((max(len(images), 1), channels, height, rec_w), dtype=np.float32)
    for k, img in enumerate(images):
        rec_input[k] = _norm_crop(img, (channels, height), rec_w)
    return {"rec_input": rec_input, "angles": np.array(angles, dtype=np.int64)}


# -- CTC decode -------------------------------------------------------------------------------------


def decode(inputs: Mapping[str, np.ndarray], params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Greedy CTC decoding (CTCLabelDecode), then RapidOCR's score filter.

    Args:
        inputs: ``rec_prob``: float32 N x T x C, the recogniser's output; ``boxes`` from :func:`boxes`;
            ``angles`` from :func:`rotate`.
        params: ``characters`` (the dictionary, blank first, see :func:`characters`) and
            ``text_score`` (:data:`DECODE_PARAMS`).

    Returns:
        For the M results scoring at least ``text_score``: ``texts``: string M; ``scores``: float64 M
        (mean probability of the kept characters); ``boxes``: float32 M x 4 x 2; ``angles``: int64 M.
    """
    chars = params["characters"]
    prob = inputs["rec_prob"][: len(inputs["boxes"])]  # no blank row for an image without text
    index, best = prob.argmax(axis=2), prob.max(axis=2)
    texts, scores = [], []
    for row, row_prob in zip(index, best, strict=True):
        keep = np.ones(len(row), dtype=bool)
        keep[1:] = row[1:] != row[:-1]
        keep &= row != 0  # the CTC blank
        texts.append("".join(chars[i] for i in row[keep]))
        conf = row_prob[keep].tolist() or [0]
        scores.append(float(np.mean(conf)))
    ok = [k for k, s in enumerate(scores) if s >= params["text_score"]]
    return {
        "texts": np.array([texts[k] for k in ok], dtype=object),
        "scores": np.array([scores[k] for k in ok], dtype=np.float64),
        "boxes": inputs["boxes"][ok].reshape(-1, 4, 2),
        "angles": inputs["angles"][ok],
    }


# -- the same chain in one thread, without onnxpipe -----------------------------------------------


class SequentialOcr:
    """The chain run step after step in the calling thread with one onnxruntime session per model:
    the glue's reference (against RapidOCR) and the pipeline's baseline in benchmarks.

    Args:
        threads: intra-op threads of each session.
        models: det / cls / rec model paths (default: the wheel's, :func:`model_paths`).
    """

    def __init__(self, threads: int = 1, models: Mapping[str, str | Path] | None = None) -> None:
        import onnxruntime as ort

        paths = {**model_paths(), **(models or {})}
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as onnxpipe's stages
        self.sessions = {k: ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"]) for k, p in paths.items()}
        self.characters = characters(paths["rec"])

    def _run(self, model: str, x: np.ndarray) -> np.ndarray:
        session = self.sessions[model]
        return session.run(None, {session.get_inputs()[0].name: x})[0]

    def __call__(self, image: np.ndarray) -> dict[str, np.ndarray]:
        """Read one BGR uint8 image; returns ``texts``, ``scores``, ``boxes`` and ``angles`` as :func:`decode` does."""
        pre = preprocess({"image": image}, PREPROCESS_PARAMS)
        found = boxes({"det_prob": self._run("det", pre["det_input"]), "image": pre["image"], "transform": pre["transform"]}, DET_PARAMS)
        rec = rotate({"crops": found["crops"], "crop_sizes": found["crop_sizes"], "cls_prob": self._run("cls", found["cls_input"])}, CLS_PARAMS)
        params = {**DECODE_PARAMS, "characters": self.characters}
        return decode({"rec_prob": self._run("rec", rec["rec_input"]), "boxes": found["boxes"], "angles": rec["angles"]}, params)


def render_lines(lines: Sequence[str], size: tuple[int, int] = (360, 240), font_size: int = 28, upside_down: Sequence[int] = ()) -> np.ndarray:
    """An image with one line of black text per entry on white, for tests and demos (no files).

    Uses Pillow's built-in scalable font (``ImageFont.load_default(size=...)``, Pillow >= 10.1).

    Args:
        lines: The text lines, top to bottom, spread evenly over the height.
        size: (width, height) in pixels.
        font_size: Font size in pixels.
        upside_down: Indexes of lines drawn turned by 180 degrees (what the angle classifier fixes).

    Returns:
        The image, uint8 height x width x 3, BGR as ``cv2.imread`` gives.
    """
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=font_size)
    image = Image.new("RGB", size, "white")
    step = size[1] // max(len(lines), 1)
    for k, text in enumerate(lines):
        _, _, right, bottom = font.getbbox(text)
        line = Image.new("RGB", (int(right) + 8, int(bottom) + 8), "white")
        ImageDraw.Draw(line).text((4, 4), text, font=font, fill="black")
        if k in upside_down:
            line = line.rotate(180)
        image.paste(line, (16, k * step + (step - line.height) // 2))
    return np.ascontiguousarray(np.asarray(image)[:, :, ::-1])
