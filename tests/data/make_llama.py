"""Makes tests/data/llama-tiny.onnx: a Llama with random weights (hidden 64, 2 layers, 4 attention
heads over 2 KV heads, vocabulary 256), exported by optimum-onnx as users export decoders
(``text-generation-with-past``: input_ids, attention_mask, position_ids, past_key_values.N.key|value
-> logits, present.N.key|value). Nothing is downloaded: the model is a transformers config with
seeded weights, saved and exported locally.

The exporter needs torch, transformers and optimum-onnx, too heavy for ``make test``, so the
exported file (about 0.5 MB) is committed and this script says how it was made:

    python3 -m venv /tmp/venv-export
    /tmp/venv-export/bin/pip install torch==2.13.0 'transformers<5' optimum-onnx==0.1.0 onnx onnxruntime
    /tmp/venv-export/bin/python tests/data/make_llama.py

(made 2026-12-02 with torch 2.13.0+cpu, transformers 4.57.6, optimum-onnx 0.1.0, onnx 1.23.2).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import onnx
import torch
from optimum.exporters.onnx import main_export
from transformers import LlamaConfig, LlamaForCausalLM

OUT = Path(__file__).with_name("llama-tiny.onnx")


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)  # larger than the initializer's 0.02: logits far apart, so greedy tokens are not near ties
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(Path(tmp) / "hf")
        main_export(str(Path(tmp) / "hf"), output=Path(tmp) / "onnx", task="text-generation-with-past", device="cpu")
        exported = onnx.load(Path(tmp) / "onnx" / "model.onnx")
        onnx.save(exported, OUT)  # one file: the weights are small enough to sit inside it
        shutil.rmtree(Path(tmp) / "onnx")
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
