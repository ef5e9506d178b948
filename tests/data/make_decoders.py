"""Makes tests/data/decoders/: a matrix of small decoder LLMs with random weights, each exported as users
export decoders, one folder per exporter and architecture (``<exporter>-<arch>``):

- ``optimum-{llama,qwen2,phi3}``: optimum-onnx's ``text-generation-with-past`` (``model.onnx``);
- ``genai-{llama,qwen2,phi3}``: onnxruntime-genai's model builder, fp32 for the CPU (``model.onnx``,
  ``genai_config.json`` and the tokenizer files, a folder ``og.Model`` opens);
- ``dynamo-llama``: ``torch.onnx.export(..., dynamo=True)`` of the Llama with a flat KV cache
  (``model.onnx``).

Every model: hidden 64, 2 layers, 4 attention heads over 2 KV heads, intermediate 128 (Phi-3's 96: see
``hf_model``), vocabulary 256, 256 positions, untied embeddings, bos 1, eos 2; ``torch.manual_seed(0)``
then every parameter drawn from N(0, 0.2), larger than the initializer's 0.02 so greedy tokens are not
near ties. The exports of one architecture have the same weights. Nothing is downloaded: each model is a
transformers config (Llama, Qwen2 and transformers' native Phi-3), ``save_pretrained`` with a
word-level tokenizer made here (t0..t255, bos t1, eos t2), then exported. Each ``model.onnx`` is
re-saved as one file with its weights inside. ``README.md`` beside the folders (written by this
script) lists their inputs, outputs and file sizes. After each export the script runs a greedy loop
over the file with onnxruntime (an empty past first, then one token a step) and, for the genai folders,
``og.Generator``, and stops unless both give the transformers model's own greedy tokens.

The exporters need torch, transformers, optimum-onnx and onnxruntime-genai's builder, too heavy for
``make test``, so the exported files (about 3.5 MB in all) are committed and this script says how they
were made. optimum-onnx 0.1.0 wants transformers 4, onnxruntime-genai 0.18.0's builder imports
transformers 5, so there are two venvs, those of ``make bench-decoders`` (the Makefile's
``$(DECODERS)/.installed`` and ``$(GENAI_BUILDER)/.installed``), the first with onnxscript added, which
the dynamo export needs:

    python3 -m venv .venv-decoders
    .venv-decoders/bin/python -m pip install torch==2.13.0 'transformers<5' optimum-onnx==0.1.0 onnxruntime-genai==0.18.0 onnxscript -e .
    python3 -m venv .venv-genai-builder
    .venv-genai-builder/bin/python -m pip install torch==2.13.0 transformers onnxruntime-genai==0.18.0 onnx_ir
    .venv-decoders/bin/python tests/data/make_decoders.py --builder-python .venv-genai-builder/bin/python [--only genai-phi3,dynamo-llama]

(made 2026-12-02: .venv-decoders with torch 2.13.0+cpu, transformers 4.57.6, optimum-onnx 0.1.0,
onnxscript 0.7.2, onnx 1.23.2, onnxruntime 1.32.0, onnxruntime-genai 0.18.0; the builder in
.venv-genai-builder with torch 2.13.0+cpu, transformers 5.24.0, onnxruntime-genai 0.18.0, onnx_ir 1.1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().with_name("decoders")
MATRIX = ("optimum-llama", "optimum-qwen2", "optimum-phi3", "genai-llama", "genai-qwen2", "genai-phi3", "dynamo-llama")
SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
#: what the genai folders keep besides model.onnx: the config og.Model reads and the tokenizer files the builder wrote
GENAI_FILES = ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
#: Phi-3's intermediate size: not 128, see hf_model
PHI3_INTERMEDIATE = 96
PROMPT = [1, 5, 9, 13]
NEW_TOKENS = 8


def hf_model(arch: str):
    """The random-weight model ``arch`` (llama, qwen2, phi3): the same weights every call."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch == "llama":
        config, cls = LlamaConfig(**SIZES), LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**SIZES), Qwen2ForCausalLM
    elif arch == "phi3":
        # Phi3Config's defaults are Phi-3-mini's: pad 32000 (outside this vocabulary) and 4096 original
        # positions (the genai builder would take it for a LongRoPE model); neither fits here. And the
        # genai builder takes every Linear with vocab_size outputs for the LM head: Phi-3's fused
        # gate_up_proj has 2 * intermediate, so intermediate 128 (256 = the vocabulary) would wire the
        # logits to layer 0 (a wrong model, no error). Hence PHI3_INTERMEDIATE.
        config = Phi3Config(**{**SIZES, "intermediate_size": PHI3_INTERMEDIATE}, pad_token_id=None,
                            original_max_position_embeddings=SIZES["max_position_embeddings"])
        cls = Phi3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def save_hf(model, folder: Path) -> None:
    """``save_pretrained`` of ``model`` with a word-level tokenizer of its vocabulary (genai's builder needs one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"t{k}": k for k in range(model.config.vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(folder)


def one_file(src: Path, dst: Path, drop_metadata: tuple[str, ...] = ()) -> None:
    """``src`` (with any external data beside it) re-saved as the one file ``dst``, weights inside, less
    the nodes' metadata ``drop_metadata`` (the dynamo exporter's stack traces name this machine's paths
    and this script's line numbers, and make up a third of the file)."""
    import onnx

    model = onnx.load(src)
    for node in model.graph.node:
        keep = [(p.key, p.value) for p in node.metadata_props if p.key not in drop_metadata]
        del node.metadata_props[:]
        for key, value in keep:
            node.metadata_props.add(key=key, value=value)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, dst)


def export_optimum(hf: Path, folder: Path, tmp: Path) -> None:
    from optimum.exporters.onnx import main_export

    main_export(str(hf), output=tmp / "optimum", task="text-generation-with-past", device="cpu")
    one_file(tmp / "optimum" / "model.onnx", folder / "model.onnx")


def export_genai(hf: Path, folder: Path, tmp: Path, builder_python: str) -> None:
    out = tmp / "genai"
    subprocess.run([builder_python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p", "fp32",
                    "-e", "cpu", "-c", str(tmp / "cache")], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    one_file(out / "model.onnx", folder / "model.onnx")
    for name in GENAI_FILES:
        if (out / name).exists():
            shutil.copy(out / name, folder / name)
    # genai_config.json names the model file only (decoder.filename); were the external data file named
    # anywhere, it would no longer exist
    text = (folder / "genai_config.json").read_text()
    if "model.onnx.data" in text:
        raise RuntimeError("genai_config.json names model.onnx.data, which the re-saved folder lacks")


def flat_cache(model):
    """``model`` wrapped to take and return its KV cache as flat tensors, what the ONNX graph's inputs and
    outputs are: (input_ids, attention_mask, position_ids, key 0, value 0, key 1, ...) -> (logits,
    present key 0, present value 0, ...), through a transformers DynamicCache inside."""
    import torch
    from transformers import DynamicCache

    layers = model.config.num_hidden_layers

    class FlatCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache()
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return FlatCache().eval()


def export_dynamo(model, folder: Path, tmp: Path) -> None:
    """``torch.onnx.export(dynamo=True)`` with dynamic batch, sequence, past and total lengths; the example
    has a past of 5 (torch.export specializes sizes 0 and 1), the export runs with an empty past too."""
    import torch
    from torch.export import Dim

    config = model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    batch, seq, past = 2, 3, 5
    args = (torch.randint(0, config.vocab_size, (batch, seq)), torch.ones(batch, past + seq, dtype=torch.int64),
            torch.arange(past, past + seq).expand(batch, seq).contiguous(),
            *[torch.randn(batch, kv_heads, past, head_dim) for _ in range(2 * layers)])
    b, s, p, t = Dim("batch"), Dim("sequence_length"), Dim("past_sequence_length"), Dim("total_sequence_length")
    dynamic_shapes = ({0: b, 1: s}, {0: b, 1: t}, {0: b, 1: s}, tuple({0: b, 2: p} for _ in range(2 * layers)))
    kv = [f"{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    program = torch.onnx.export(flat_cache(model), args, None, dynamo=True, dynamic_shapes=dynamic_shapes,
                                input_names=["input_ids", "attention_mask", "position_ids"] + [f"past_key_values.{n}" for n in kv],
                                output_names=["logits"] + [f"present.{n}" for n in kv])
    program.save(str(tmp / "dynamo.onnx"))
    one_file(tmp / "dynamo.onnx", folder / "model.onnx", drop_metadata=("pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node"))


def torch_greedy(model, prompt=PROMPT, new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens of the transformers model itself (the whole sequence each step, no cache): what
    every export of it must give."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def ort_feeds(session, ids, past: dict | None, past_len: int) -> dict:
    """The feeds of one step of ``session`` (any of the matrix's exports): batch 1, ``ids`` new tokens after
    ``past_len`` cached ones; ``past`` maps past input names to the previous step's presents (None: empty)."""
    import numpy as np

    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64, "tensor(int32)": np.int32}
    feeds = {}
    for x in session.get_inputs():
        dtype = dtypes[x.type]
        if x.name == "input_ids":
            feeds[x.name] = np.array([ids], dtype=dtype)
        elif x.name == "attention_mask":
            feeds[x.name] = np.ones((1, past_len + len(ids)), dtype=dtype)
        elif x.name == "position_ids":
            feeds[x.name] = np.arange(past_len, past_len + len(ids), dtype=dtype)[None]
        elif x.name.startswith("past_key_values."):
            if past is None:  # [batch 1, kv_heads, past_len 0, head_dim]; genai's head_dim is symbolic (kv_cache_dim)
                fixed = {1: SIZES["num_key_value_heads"], 3: SIZES["hidden_size"] // SIZES["num_attention_heads"]}
                shape = [1 if i == 0 else 0 if i == 2 else d if isinstance(d, int) else fixed[i] for i, d in enumerate(x.shape)]
                feeds[x.name] = np.zeros(shape, dtype=dtype)
            else:
                feeds[x.name] = past[x.name]
        else:
            raise ValueError(f"no feed for input {x.name} {x.type} {x.shape}")
    return feeds


def ort_greedy(path: Path, prompt=PROMPT, new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens of the whole model ``path`` with onnxruntime: the prompt with an empty past, then one
    token a step, the presents fed back as the next step's past."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    tokens, ids, past, past_len = [], list(prompt), None, 0
    for _ in range(new_tokens):
        out = dict(zip(names, session.run(None, ort_feeds(session, ids, past, past_len)), strict=True))
        token = int(np.argmax(out["logits"][0, -1]))
        tokens.append(token)
        past = {n.replace("present", "past_key_values", 1): v for n, v in out.items() if n.startswith("present")}
        past_len += len(ids)
        ids = [token]
    return tokens


def og_greedy(folder: Path, prompt=PROMPT, new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens of the genai folder with onnxruntime-genai's ``og.Generator`` (it stops at eos)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens, batch_size=1)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt):]


def versions(python: str) -> dict:
    """The exporters' package versions in the venv of ``python`` (those it has)."""
    code = """
import importlib.metadata as m, json
found = {}
for p in ("torch", "transformers", "optimum-onnx", "onnxruntime-genai", "onnxscript", "onnx"):
    try:
        found[p] = m.version(p)
    except m.PackageNotFoundError:
        pass
print(json.dumps(found))
"""
    return json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)


def describe(folder: Path) -> dict:
    """Inputs, outputs and state shapes of ``folder/model.onnx``, for the README."""
    import onnx

    graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
    types = {1: "float32", 6: "int32", 7: "int64", 10: "float16"}

    def names(values):
        plain = [f"{v.name} ({types[v.type.tensor_type.elem_type]})" for v in values if "key_values" not in v.name and "present" not in v.name]
        state = [v for v in values if "key_values" in v.name or "present" in v.name]
        if state:
            stem = state[0].name.split(".")[0]
            layers = sorted({v.name.split(".")[1] for v in state})
            plain.append(f"{stem}.{{{','.join(layers)}}}.{{key,value}} ({types[state[0].type.tensor_type.elem_type]})")
        return ", ".join(plain), ([d.dim_param or d.dim_value for d in state[0].type.tensor_type.shape.dim] if state else None)

    inputs, past_shape = names(graph.input)
    outputs, present_shape = names(graph.output)
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f.name != "README.md")
    return {"inputs": inputs, "outputs": outputs, "past": past_shape, "present": present_shape,
            "model_bytes": (folder / "model.onnx").stat().st_size, "folder_bytes": size}


def write_readme(exporters: dict) -> None:
    rows = ["| folder | exporter | inputs | outputs | state shapes (past -> present) | model.onnx (folder) |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name in MATRIX:
        folder = OUT / name
        if not (folder / "model.onnx").exists():
            continue
        d = describe(folder)
        shape = lambda s: "[" + ", ".join(str(x) for x in s) + "]"  # noqa: E731
        rows.append(f"| `{name}/` | {exporters.get(name.split('-')[0], '?')} | {d['inputs']} | {d['outputs']} | "
                    f"`{shape(d['past'])}` -> `{shape(d['present'])}` | {d['model_bytes'] / 1e6:.2f} MB ({d['folder_bytes'] / 1e6:.2f} MB) |")
    (OUT / "README.md").write_text(
        "# Small decoder exports\n\n"
        "Made by `tests/data/make_decoders.py` (its docstring says how, with which versions): random weights, hidden 64, "
        "2 layers, 4 attention heads over 2 KV heads, intermediate 128 (Phi-3: 96, see the script), vocabulary 256, bos 1, "
        "eos 2; the exports of one architecture share weights and give the same greedy tokens. Every `model.onnx` is one "
        "file, weights inside, and takes an empty past (past length 0) on the first step. The `genai-*` folders also hold "
        "`genai_config.json` and the tokenizer files the builder wrote: `og.Model` and `og.Generator` run them on token "
        "ids (`og.Tokenizer` cannot read the word-level tokenizer). Their past and present tensors come keys first "
        "(`past_key_values.0.key, past_key_values.1.key, past_key_values.0.value, ...`), the others' layer by layer; "
        "their head size is the symbolic `kv_cache_dim` (16).\n\n" + "\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builder-python", required=True, help="a Python with onnxruntime-genai's model builder and the transformers 5 it imports")
    parser.add_argument("--only", default=",".join(MATRIX), help="comma-separated folders to remake (default: all of %(default)s)")
    args = parser.parse_args()
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    if unknown := sorted(set(only) - set(MATRIX)):
        parser.error(f"unknown: {', '.join(unknown)} (choose from {', '.join(MATRIX)})")
    mine, builder = versions(sys.executable), versions(args.builder_python)
    exporters = {"optimum": f"optimum-onnx {mine['optimum-onnx']} (transformers {mine['transformers']}, torch {mine['torch']})",
                 "genai": f"onnxruntime-genai {builder['onnxruntime-genai']} builder (transformers {builder['transformers']}, torch {builder['torch']})",
                 "dynamo": f"torch.onnx dynamo (torch {mine['torch']}, onnxscript {mine.get('onnxscript', '?')}, transformers {mine['transformers']})"}
    for name in (n for n in MATRIX if n in only):
        exporter, arch = name.split("-")
        folder = OUT / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        model = hf_model(arch)
        expected = torch_greedy(model)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            if exporter == "dynamo":
                export_dynamo(model, folder, tmp)
            else:
                save_hf(model, tmp / "hf")
                if exporter == "optimum":
                    export_optimum(tmp / "hf", folder, tmp)
                else:
                    export_genai(tmp / "hf", folder, tmp, args.builder_python)
        tokens = ort_greedy(folder / "model.onnx")
        line = f"{name}: {(folder / 'model.onnx').stat().st_size / 1e6:.2f} MB, onnxruntime greedy {tokens}"
        ok = tokens == expected
        if exporter == "genai":
            og_tokens = og_greedy(folder)
            line += f", og.Generator {og_tokens}"
            ok = ok and og_tokens == expected
        print(line + ("" if ok else f"; transformers gives {expected}: WRONG EXPORT"), flush=True)
        if not ok:
            raise SystemExit(f"{name}: the export's greedy tokens are not the model's")
    write_readme(exporters)
    print(f"wrote {OUT / 'README.md'}")


if __name__ == "__main__":
    main()
