"""Write the default model (dequantized from its GGUF) as an HF model directory:
config.json, model.safetensors and the tokenizer. Other engines, such as vLLM, need one.

    python scripts/export_hf_dir.py OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch

from baton.services.common.tokenizer import load_tokenizer
from baton.services.engine.loader import resolve_model_path
from baton.tools.bench.offline import build_hf_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    hf = build_hf_model(args.model, getattr(torch, args.dtype))
    hf.save_pretrained(args.out)
    load_tokenizer(resolve_model_path(args.model)).save_pretrained(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
