"""The Llama decoders ``benchmarks.batching --llama`` measures, made locally with random weights: a
transformers config, ``save_pretrained`` (with a word-level tokenizer of the model's vocabulary made
here, which onnxruntime-genai's builder insists on), then exports of the same weights:
optimum-onnx's (``optimum/model.onnx``, what onnxpipe splits), onnxruntime-genai's model builder
(``genai/``, what ``og.Generator`` runs) and, with ``--only openvino``, optimum-intel's OpenVINO IR
(``openvino/``, fp32, what OpenVINO GenAI's continuous batching runs: ``benchmarks.ovgenai_peer``).
Nothing is downloaded; the same seed makes the same weights, so each export can be made on its own.

Needs torch, transformers and optimum-onnx, and for the builder a Python with onnxruntime-genai and
the newer transformers it imports (optimum-onnx 0.1.0 wants transformers 4, onnxruntime-genai
0.18.0's builder transformers 5), for the OpenVINO IR a Python with optimum-intel[openvino]:
``make bench-decoders`` makes a venv of each. Not part of ``make test``.

    python -m benchmarks.llama_exports --out bench-out/llama --builder-python .venv-genai-builder/bin/python [--which tiny,24m]
    python -m benchmarks.llama_exports --out bench-out/llama --only openvino --openvino-python .venv-ovgenai/bin/python
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
#: The exports :func:`make` can make, each in its folder of that name.
EXPORTS = ("optimum", "genai", "openvino")


def make(out: Path, name: str, builder_python: str | None, openvino_python: str | None = None, only: tuple[str, ...] = EXPORTS) -> Path:
    """The exports ``only`` names of the Llama ``name`` under ``out/name`` (the genai one by
    ``builder_python -m onnxruntime_genai.models.builder``, the openvino one by ``openvino_python``'s
    optimum-intel: :func:`openvino_command`); its folder. about.json is written with the optimum or
    genai export, or when absent: making the openvino export alone touches nothing else."""
    import torch
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
        _export(hf, folder, only, builder_python, openvino_python)
    if {"optimum", "genai"} & set(only) or not (folder / "about.json").exists():
        (folder / "about.json").write_text(json.dumps({"name": name, "parameters": params, "hidden": hidden, "layers": layers, "heads": heads,
                                                       "kv_heads": kv_heads, "intermediate": intermediate, "vocab": vocab, "positions": POSITIONS},
                                                      indent=2))
    return folder


def _export(hf: Path, folder: Path, only: tuple[str, ...], builder_python: str | None, openvino_python: str | None) -> None:
    """The exports ``only`` names of the checkpoint ``hf``, each in its folder under ``folder``."""
    if "optimum" in only:
        from optimum.exporters.onnx import main_export

        main_export(str(hf), output=folder / "optimum", task="text-generation-with-past", device="cpu")
    if "genai" in only:
        assert builder_python is not None
        subprocess.run([builder_python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(folder / "genai"), "-p", "fp32",
                        "-e", "cpu", "-c", str(hf.parent / "cache")], check=True)
    if "openvino" in only:
        assert openvino_python is not None
        subprocess.run(openvino_command(openvino_python, hf, folder / "openvino"), check=True)


def openvino_command(python: str, checkpoint: Path, folder: Path) -> list[str]:
    """optimum-intel's export of the HF ``checkpoint`` to an OpenVINO IR in ``folder``
    (``openvino_model.xml``, what OpenVINO GenAI's ContinuousBatchingPipeline loads), run by
    ``python``: fp32 weights, uncompressed (optimum-intel compresses a model's weights to int8 by
    default above a size, and this one must be the very weights the other exports hold)."""
    return [python, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(checkpoint), "--task", "text-generation-with-past",
            "--weight-format", "fp32", str(folder)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/llama"))
    parser.add_argument("--which", default="tiny,24m")
    parser.add_argument("--builder-python", help="a Python with onnxruntime-genai's model builder and what it imports (for the genai export)")
    parser.add_argument("--openvino-python", help="a Python with optimum-intel[openvino] (for the openvino export)")
    parser.add_argument("--only", default="optimum,genai", metavar="EXPORT[,EXPORT...]", help=f"the exports to make, of {', '.join(EXPORTS)}")
    args = parser.parse_args()
    only = tuple(args.only.split(","))
    if unknown := set(only) - set(EXPORTS):
        parser.error(f"unknown export(s) {sorted(unknown)}; choices: {', '.join(EXPORTS)}")
    for export, python in (("genai", "--builder-python"), ("openvino", "--openvino-python")):
        if export in only and getattr(args, python[2:].replace("-", "_")) is None:
            parser.error(f"the {export} export needs {python}")
    for name in args.which.split(","):
        folder = make(args.out, name, args.builder_python, args.openvino_python, only)
        about = json.loads((folder / "about.json").read_text())
        print(f"{folder}: {about['parameters'] / 1e6:.1f} M parameters")


if __name__ == "__main__":
    main()
