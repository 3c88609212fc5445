"""`ignition`: offline preparation of cores (docs/design.md, Cores).

Each subcommand is a `_add_<name>` that registers its arguments and a handler; a handler returns nothing and
raises CoreError (whose message names the file) on failure. `main` turns every failure into one line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

from common.errors import CoreError

QUANT_CHOICES = ("q4", "q8", "fp8", "none")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    subject = getattr(args, args.subject)  # the file a failure is about, unless the error names another
    # Preparation is offline: never reach for the Hugging Face Hub, and keep library chatter off stderr,
    # where a failure must be exactly one line.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.simplefilter("ignore")
    try:
        args.handler(args)
    except KeyboardInterrupt:
        print("ignition: interrupted", file=sys.stderr)
        return 130
    except CoreError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"{exc.filename or subject}: {exc.strerror or exc}")
    except Exception as exc:  # the contract is one line naming the file, never a traceback
        return _fail(f"{subject}: {type(exc).__name__}: {exc}")
    return 0


def _fail(message: str) -> int:
    print(f"ignition: error: {' '.join(message.split())}", file=sys.stderr)
    return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ignition", description="Prepare Flare cores, offline.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_export(commands)
    _add_synth(commands)
    _add_verify(commands)
    return parser


def _add_export(commands: argparse._SubParsersAction) -> None:
    command = commands.add_parser("export", help="turn a GGUF file or a Hugging Face directory into a core",
                                  description="Turn a GGUF file or a Hugging Face directory into a core.")
    command.add_argument("source", type=Path, metavar="SOURCE", help="a .gguf file or a Hugging Face directory")
    command.add_argument("out", type=Path, metavar="OUT", help="the core directory to create")
    command.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                         help="dtype of dense weights and activations (default: float32 for GGUF, the checkpoint's "
                              "own otherwise); given without --quant, every weight is dense")
    command.add_argument("--quant", choices=QUANT_CHOICES,
                         help="keep linear and embedding weights in 4- or 8-bit groups of 32, run by the CPU's int4 "
                              "kernel, or the decoder layers' linears as FP8 (e4m3, a scale per output channel) "
                              "(default: the source's own precision: a GGUF's Q4_0/Q4_1/Q8_0 blocks exactly, an FP8 "
                              "checkpoint's e4m3 weights and scales; none with --dtype)")
    command.add_argument("--served-name", dest="served_names", action="extend", nargs="+", default=[],
                         metavar="NAME", help="model names clients may ask for (default: derived from SOURCE)")
    command.add_argument("--context-limit", type=_positive, metavar="N",
                         help="cap the context below max_position_embeddings")
    command.add_argument("--pooling", choices=("last", "mean"),
                         help="make an embedding core that pools the final hidden states of the last token or their "
                              "mean, L2-normalised (default: a sentence-transformers layout's own pooling, else a "
                              "generation core)")
    command.add_argument("--matryoshka", action="store_true",
                         help="the embedding model was trained for truncated vectors (Qwen3-Embedding): requests may "
                              "ask for fewer dimensions")
    command.add_argument("--force", action="store_true", help="replace OUT if it exists")
    command.set_defaults(handler=_export, subject="source")


def _export(args: argparse.Namespace) -> None:
    from ignition.export import ExportOptions, export

    started = time.monotonic()
    quant = args.quant or ("none" if args.dtype else None)
    options = ExportOptions(dtype=args.dtype, served_names=tuple(args.served_names),
                            context_limit=args.context_limit, force=args.force, quant=quant, pooling=args.pooling,
                            matryoshka=args.matryoshka)
    manifest = export(args.source, args.out, options)
    size = sum(file.stat().st_size for file in args.out.iterdir())
    precision = f"{manifest.dtype}, {manifest.quantization}" if manifest.quantization else manifest.dtype
    if manifest.pooling is not None:
        precision += f"; embeddings, {manifest.pooling.mode} pooling"
    print(f"ignition: wrote {args.out} ({', '.join(manifest.served_names)}; {precision}; "
          f"{size / 2**20:.0f} MiB) in {time.monotonic() - started:.1f} s")


def _add_synth(commands: argparse._SubParsersAction) -> None:
    from ignition.synth import PRESETS

    command = commands.add_parser("synth", help="write a core with random weights of a real architecture",
                                  description="Write a core with random weights of a real architecture "
                                              "(for benchmarks; nothing is downloaded).")
    command.add_argument("out", type=Path, metavar="OUT", help="the core directory to create")
    command.add_argument("--preset", required=True, choices=sorted(PRESETS),
                         help="the architecture (its family and sizes)")
    command.add_argument("--layers", type=_positive, metavar="N", help="keep only N decoder layers")
    command.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                         help="weight dtype (default: bfloat16)")
    command.add_argument("--quant", choices=QUANT_CHOICES,
                         help="quantize the weights as `ignition export --quant` does (default: none)")
    command.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: 0)")
    command.add_argument("--force", action="store_true", help="replace OUT if it exists")
    command.set_defaults(handler=_synth, subject="out")


def _synth(args: argparse.Namespace) -> None:
    from ignition.export import ExportOptions, export_source
    from ignition.synth import SynthSource

    started = time.monotonic()
    source = SynthSource(args.preset, args.layers, args.dtype, args.seed)
    manifest = export_source(source, args.out, ExportOptions(dtype=args.dtype, force=args.force, quant=args.quant))
    size = sum(file.stat().st_size for file in args.out.iterdir())
    precision = f"{manifest.dtype}, {manifest.quantization}" if manifest.quantization else manifest.dtype
    print(f"ignition: wrote {args.out} ({manifest.checkpoint}; {precision}; {size / 2**20:.0f} MiB) "
          f"in {time.monotonic() - started:.1f} s")


def _add_verify(commands: argparse._SubParsersAction) -> None:
    command = commands.add_parser("verify", help="check a core's manifest and the SHA-256 of its files",
                                  description="Check a core's manifest and the SHA-256 of its files.")
    command.add_argument("core", type=Path, metavar="CORE")
    command.set_defaults(handler=_verify, subject="core")


def _verify(args: argparse.Namespace) -> None:
    from common.manifest import load_manifest

    manifest = load_manifest(args.core, verify=True)
    print(f"ignition: {args.core} is intact ({len(manifest.files)} files)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


if __name__ == "__main__":
    sys.exit(main())
