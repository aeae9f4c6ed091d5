"""`treeopsd model import FILE.gguf OUT`: a GGUF model file as a Hugging Face folder every role loads.

    treeopsd model import SmolLM2-135M-Instruct.Q4_1.gguf runs/models/smollm2      # ~20 s, 260 MB (bf16)
    treeopsd eval --model runs/models/smollm2 ...                                   # then as any HF folder

Needs the `gguf` extra (`pip install -e '.[gguf]'`: the gguf and accelerate packages). The conversion is
runtime/model_import.py; `--model X.gguf` / `model.path=X.gguf` elsewhere run it once into runs/models/.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", required=True)
    imp = sub.add_parser("import", help="convert a .gguf file into a Hugging Face model folder")
    imp.add_argument("file", help="the .gguf model file")
    imp.add_argument("out", help="the folder to write (must not exist)")
    imp.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="weights dtype")
    imp.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from runtime.model_import import ModelImportError, import_gguf

    try:
        report = import_gguf(args.file, args.out, args.dtype)
    except ModelImportError as e:
        print(f"treeopsd model import: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        print(
            f"imported {report['source']} ({report['architecture']}, {report['params'] / 1e6:.1f} M "
            f"parameters, {report['dtype']}) into {report['out']} in {report['seconds']:.1f} s"
        )
    return 0
