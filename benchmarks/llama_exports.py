"""The Llama decoders ``benchmarks.batching --llama`` measures, made locally with random weights: a
transformers config, ``save_pretrained`` (with a word-level tokenizer of the model's vocabulary made
here, which onnxruntime-genai's builder insists on), then two exports of the same weights:
optimum-onnx's (``optimum/model.onnx``, what onnxpipe splits) and onnxruntime-genai's model builder
(``genai/``, what ``og.Generator`` runs). Nothing is downloaded.

Needs torch, transformers and optimum-onnx, and for the builder a Python with onnxruntime-genai and
the newer transformers it imports (optimum-onnx 0.1.0 wants transformers 4, onnxruntime-genai
0.18.0's builder transformers 5): ``make bench-decoders`` makes a venv of each. Not part of
``make test``.

    python -m benchmarks.llama_exports --out bench-out/llama --builder-python .venv-genai-builder/bin/python [--which tiny,24m]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

#: name -> (hidden, layers, attention heads, KV heads, intermediate, vocabulary): issue 26's two Llamas.
SIZES = {
    "tiny": (256, 4, 4, 2, 512, 1024),
    "24m": (512, 8, 8, 4, 1408, 1024),
}
#: Positions the exports hold: the genai builder's rotary cache (``cos_cache``) and ``context_length``
#: stop there, and ``benchmarks.batching --contexts`` goes to 2048 + 64 tokens.
POSITIONS = 4096


def make(out: Path, name: str, builder_python: str) -> Path:
    """Both exports of the Llama ``name`` under ``out/name`` (the genai one by ``builder_python -m
    onnxruntime_genai.models.builder``); its folder."""
    import torch
    from optimum.exporters.onnx import main_export
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hidden, layers, heads, kv_heads, intermediate, vocab = SIZES[name]
    folder = out / name
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=POSITIONS,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        model.save_pretrained(hf)
        words = {f"t{k}": k for k in range(vocab)}
        tokenizer = Tokenizer(models.WordLevel(words, unk_token="t0"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(hf)
        main_export(str(hf), output=folder / "optimum", task="text-generation-with-past", device="cpu")
        subprocess.run([builder_python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(folder / "genai"), "-p", "fp32",
                        "-e", "cpu", "-c", str(Path(tmp) / "cache")], check=True)
    (folder / "about.json").write_text(json.dumps({"name": name, "parameters": params, "hidden": hidden, "layers": layers, "heads": heads,
                                                   "kv_heads": kv_heads, "intermediate": intermediate, "vocab": vocab, "positions": POSITIONS}, indent=2))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/llama"))
    parser.add_argument("--which", default="tiny,24m")
    parser.add_argument("--builder-python", required=True, help="a Python with onnxruntime-genai's model builder and what it imports")
    args = parser.parse_args()
    for name in args.which.split(","):
        folder = make(args.out, name, args.builder_python)
        about = json.loads((folder / "about.json").read_text())
        print(f"{folder}: {about['parameters'] / 1e6:.1f} M parameters")


if __name__ == "__main__":
    main()
