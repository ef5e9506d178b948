"""Makes tests/data/corpus/: small random-weight exports of the model families users bring, each exported
with optimum-onnx the way its users export it, one folder per family:

- ``bert/model.onnx``: BertModel, ``feature-extraction`` (input_ids, attention_mask, token_type_ids, with a
  type vocabulary of 2: sample inputs that draw token types from 0..3 fail on it);
- ``vit/model.onnx``: ViTForImageClassification, ``image-classification`` (pixel_values with symbolic
  height and width, 10 labels);
- ``wav2vec2/model.onnx``: Wav2Vec2ForCTC, ``automatic-speech-recognition`` (input_values of a symbolic
  length through two strided convolutions);
- ``gpt2/model.onnx``: GPT2LMHeadModel, ``text-generation-with-past`` (an attention mask of the formula dim
  ``past_sequence_length + sequence_length``);
- ``t5/`` and ``whisper/``: T5ForConditionalGeneration, ``text2text-generation-with-past``, and
  WhisperForConditionalGeneration, ``automatic-speech-recognition-with-past``: ``encoder_model.onnx``,
  ``decoder_model.onnx`` (no past: it makes the cross-attention KV), ``decoder_with_past_model.onnx`` and
  ``decoder_model_merged.onnx`` (the file optimum's ORTModel loads: one ``If`` on ``use_cache_branch``
  over the two decoders).

Every model: hidden 32, 2 layers, 4 attention heads, feed-forward 64, vocabulary 128 (wav2vec2's CTC: 32);
``torch.manual_seed(0)`` then every parameter drawn from N(0, 0.5), norm weights from 1 + N(0, 0.5), so
greedy tokens are not near ties (at 0.2 T5 and Whisper repeat one token from the first step). Whisper
takes 16 mel bins over 64 frames (32 encoder positions). Nothing is downloaded: each model is a
transformers config, ``save_pretrained``, then optimum's ``main_export``.

For T5 and Whisper the script also writes ``expected.json``: four seeded requests (T5: token ids of
lengths 5 to 8; Whisper: mel features), the 16 greedy tokens transformers' own model gives for each,
running the whole sequence every step (no cache), and the logits of its last step (random models soon
repeat a token: the logits check what tokens alone cannot), and it stops unless onnxruntime's greedy loop over the
encoder and the merged decoder (an empty past first, then one token a step) gives the same tokens. The
tests compare onnxpipe's tokens with those, since transformers is not a test dependency.

The exporter needs torch, transformers and optimum-onnx, too heavy for ``make test``, so the exports (about
2.5 MB in all) are committed and this script says how they were made, in the venv of
``tests/data/make_decoders.py`` (``make bench-decoders`` makes it):

    .venv-decoders/bin/python tests/data/make_corpus.py [--only t5,whisper]

(made 2026-12-03 with torch 2.13.0+cpu, transformers 4.57.6, optimum-onnx 0.1.0, onnx 1.23.2, onnxruntime 1.32.0).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().with_name("corpus")
FAMILIES = ("bert", "vit", "wav2vec2", "gpt2", "t5", "whisper")
SEQ2SEQ_FILES = ("encoder_model", "decoder_model", "decoder_with_past_model", "decoder_model_merged")
NEW_TOKENS = 16
REQUESTS = 4
#: Whisper's mel bins and frames: the exporter's dummy input takes nb_max_frames, the encoder 2 frames per position
MELS, FRAMES = 16, 64


def hf_model(family: str):
    """``(model, optimum task, export keywords)`` for ``family``: the same weights every call."""
    import torch
    import transformers as tf

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if family == "bert":
        model, task, extra = tf.BertModel(tf.BertConfig(vocab_size=128, max_position_embeddings=64, type_vocab_size=2, **small)), "feature-extraction", {}
    elif family == "vit":
        config = tf.ViTConfig(image_size=32, patch_size=8, num_channels=3, num_labels=10, **small)
        model, task, extra = tf.ViTForImageClassification(config), "image-classification", {}
    elif family == "wav2vec2":
        config = tf.Wav2Vec2Config(vocab_size=32, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
                                   num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, do_stable_layer_norm=True, **small)
        model, task, extra = tf.Wav2Vec2ForCTC(config), "automatic-speech-recognition", {}
    elif family == "gpt2":
        config = tf.GPT2Config(vocab_size=128, n_positions=128, n_embd=32, n_layer=2, n_head=4, n_inner=64, bos_token_id=1, eos_token_id=2)
        model, task, extra = tf.GPT2LMHeadModel(config), "text-generation-with-past", {}
    elif family == "t5":
        config = tf.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                             relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        model, task, extra = tf.T5ForConditionalGeneration(config), "text2text-generation-with-past", {}
    elif family == "whisper":
        config = tf.WhisperConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=MELS, max_source_positions=FRAMES // 2, max_target_positions=64,
                                  decoder_start_token_id=3, pad_token_id=0, bos_token_id=3, eos_token_id=2, suppress_tokens=[], begin_suppress_tokens=[])
        model, task, extra = tf.WhisperForConditionalGeneration(config), "automatic-speech-recognition-with-past", {"nb_max_frames": FRAMES}
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.5)
    return model.eval(), task, extra


def requests(family: str) -> list[dict]:
    """The seeded requests of ``expected.json``: T5's token ids (lengths 5..8, within the vocabulary, no pad
    or eos) or Whisper's mel features."""
    import numpy as np

    rng = np.random.default_rng(0)
    if family == "t5":
        return [{"input_ids": rng.integers(3, 128, size=(1, 5 + k)).tolist()} for k in range(REQUESTS)]
    return [{"input_features": rng.standard_normal((1, MELS, FRAMES)).astype(np.float32).round(4).tolist()} for _ in range(REQUESTS)]


def torch_greedy(model, family: str, request: dict) -> tuple[list[int], list[float]]:
    """Greedy tokens of the transformers model itself and its last step's logits: the encoder once, the
    whole decoder sequence each step."""
    import torch

    with torch.no_grad():
        if family == "t5":
            ids = torch.tensor(request["input_ids"])
            encoded = model.get_encoder()(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
            kwargs = {"attention_mask": torch.ones_like(ids)}
        else:
            encoded = model.get_encoder()(input_features=torch.tensor(request["input_features"])).last_hidden_state
            kwargs = {}
        tokens = [model.config.decoder_start_token_id]
        for _ in range(NEW_TOKENS):
            out = model(encoder_outputs=(encoded,), decoder_input_ids=torch.tensor([tokens]), use_cache=False, **kwargs)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens[1:], [round(float(x), 5) for x in out.logits[0, -1]]


def ort_greedy(folder: Path, family: str, request: dict, start: int) -> list[int]:
    """Greedy tokens of the exports with onnxruntime: the encoder, then the merged decoder with an empty past
    and ``use_cache_branch`` false, then one token a step with the presents fed back."""
    import numpy as np
    import onnxruntime as ort

    def session(name):
        return ort.InferenceSession(str(folder / f"{name}.onnx"), providers=["CPUExecutionProvider"])

    encoder, decoder = session("encoder_model"), session("decoder_model_merged")
    feeds = {k: np.array(v, dtype=np.int64 if family == "t5" else np.float32) for k, v in request.items()}
    if family == "t5":
        feeds["attention_mask"] = np.ones_like(feeds["input_ids"])
    hidden = encoder.run(None, feeds)[0]
    past = {}
    for x in decoder.get_inputs():
        if x.name.startswith("past_key_values."):
            past[x.name] = np.zeros((1, x.shape[1], 0, x.shape[3]), dtype=np.float32)
    names = [o.name for o in decoder.get_outputs()]
    tokens, ids = [], [start]
    for step in range(NEW_TOKENS):
        step_feeds = {"input_ids": np.array([ids], dtype=np.int64), "encoder_hidden_states": hidden, "use_cache_branch": np.array([step > 0]), **past}
        if family == "t5":
            step_feeds["encoder_attention_mask"] = feeds["attention_mask"]
        out = dict(zip(names, decoder.run(None, step_feeds), strict=True))
        token = int(np.argmax(out["logits"][0, -1]))
        tokens.append(token)
        # the cached branch passes the encoder KV through unchanged; the first step made it
        past = {n.replace("present", "past_key_values", 1): v for n, v in out.items() if n.startswith("present") and (step == 0 or ".decoder." in n)} | \
            {n: v for n, v in past.items() if ".encoder." in n and step > 0}
        ids = [token]
    return tokens


def export(family: str, tmp: Path) -> dict | None:
    """Exports ``family`` into ``OUT / family``; for T5 and Whisper, returns what ``expected.json`` holds."""
    from optimum.exporters.onnx import main_export

    model, task, extra = hf_model(family)
    model.save_pretrained(tmp / "hf")
    main_export(str(tmp / "hf"), output=tmp / "onnx", task=task, device="cpu", **extra)
    folder = OUT / family
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    names = SEQ2SEQ_FILES if family in ("t5", "whisper") else ("model",)
    for name in names:
        shutil.copy(tmp / "onnx" / f"{name}.onnx", folder / f"{name}.onnx")
    if family not in ("t5", "whisper"):
        return None
    start = model.config.decoder_start_token_id
    cases = []
    for request in requests(family):
        (want, logits), got = torch_greedy(model, family, request), ort_greedy(folder, family, request, start)
        if want != got:
            raise SystemExit(f"{family}: onnxruntime's greedy tokens {got} are not transformers' {want}: WRONG EXPORT")
        cases.append({"inputs": request, "tokens": want, "last_logits": logits})
    expected = {"decoder_start_token_id": start, "eos_token_id": model.config.eos_token_id, "new_tokens": NEW_TOKENS, "requests": cases}
    (folder / "expected.json").write_text(json.dumps(expected) + "\n")
    return expected


def describe(path: Path) -> tuple[str, str]:
    """The inputs and outputs of ``path`` with their shapes, for the README (past and present folded)."""
    import onnx

    graph = onnx.load(path, load_external_data=False).graph

    def fmt(values) -> str:
        plain = [v for v in values if not v.name.startswith(("past_key_values.", "present."))]
        state = [v for v in values if v not in plain]
        out = [f"{v.name} [{', '.join(str(d.dim_param or d.dim_value) for d in v.type.tensor_type.shape.dim)}]" for v in plain]
        if state:
            out.append(f"{len(state)} {state[0].name.split('.')[0]}.* ({state[0].name}, ...)")
        return ", ".join(out)

    return fmt(graph.input), fmt(graph.output)


def write_readme() -> None:
    rows = ["| file | inputs | outputs | size |", "| --- | --- | --- | --- |"]
    for family in FAMILIES:
        for path in sorted((OUT / family).glob("*.onnx")):
            inputs, outputs = describe(path)
            rows.append(f"| `{family}/{path.name}` | {inputs} | {outputs} | {path.stat().st_size / 1e3:.0f} kB |")
    (OUT / "README.md").write_text(
        "# A corpus of small exports\n\n"
        "Made by `tests/data/make_corpus.py` (its docstring says how, with which versions): random weights, hidden 32, 2 layers, "
        "4 heads, feed-forward 64, optimum-onnx's exports as users make them. `t5/expected.json` and `whisper/expected.json` hold "
        "four seeded requests each, the 16 greedy tokens transformers gives for them and the logits of the last step.\n\n" + "\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(FAMILIES), help="comma-separated families to remake (default: all of %(default)s)")
    args = parser.parse_args()
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    if unknown := sorted(set(only) - set(FAMILIES)):
        parser.error(f"unknown: {', '.join(unknown)} (choose from {', '.join(FAMILIES)})")
    for family in (f for f in FAMILIES if f in only):
        with tempfile.TemporaryDirectory() as tmp:
            expected = export(family, Path(tmp))
        size = sum(p.stat().st_size for p in (OUT / family).iterdir())
        print(f"{family}: {size / 1e3:.0f} kB" + (f", greedy tokens {[c['tokens'] for c in expected['requests']]}" if expected else ""), flush=True)
    write_readme()
    print(f"wrote {OUT / 'README.md'}")


if __name__ == "__main__":
    main()
