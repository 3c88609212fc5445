"""Frontend image preparation per worker (one thread): Pillow-SIMD (the venv's PIL) against stock Pillow of the same
base version (`make stock-pillow` puts it in .cache/stock-pillow), in the same run, on the same JPEG; and how far
apart their resizes land. Each PIL runs in its own subprocess (both are the `PIL` package).

    python -m bench.lab.host.images [--seconds 5] [--stock-pillow .cache/stock-pillow]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
SIDE = 1024
# Qwen3-VL's processor (a 1024² picture keeps its size: decode, normalize, patchify), and one that resizes it.
CONFIGS = {"qwen3-vl (no resize)": 16777216, "max 512x512 (bicubic resize)": 512 * 512}


def settings(max_pixels: int):  # noqa: ANN201 (common.vision.ImageProcessing; imported in the child)
    from common.vision import ImageProcessing
    return ImageProcessing(image_token_id=0, vision_start_token_id=0, vision_end_token_id=0, min_pixels=65536,
                           max_pixels=max_pixels)


def child(jpeg: Path, seconds: float, dump: Path) -> None:
    """Runs under one PIL: prepared images per second for each config, and the resized test patches."""
    import PIL

    from frontend.images.decode import ImageLimits
    from frontend.images.prepare import prepare
    from tests.support.image_samples import samples
    data = jpeg.read_bytes()
    rates = {}
    for name, max_pixels in CONFIGS.items():
        config, count = settings(max_pixels), 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            prepare(data, config, ImageLimits(), "bench")
            count += 1
        rates[name] = count / (time.perf_counter() - start)
    small = settings(32 * 32 * 24)  # every sample resized
    arrays = {name: prepare(source, small, ImageLimits(), name).patches for name, (source, _) in samples().items()}
    arrays["jpeg-1024"] = prepare(data, settings(512 * 512), ImageLimits(), "bench").patches
    np.savez(dump, **arrays)
    print(json.dumps({"pil": PIL.__version__, "rates": rates}))


def run_child(jpeg: Path, seconds: float, dump: Path, extra_path: str | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (extra_path, str(ROOT), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-m", "bench.lab.host.images", "--child", str(jpeg), "--seconds", str(seconds),
                          "--dump", str(dump)], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.host.images", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="timed seconds per config and PIL")
    parser.add_argument("--stock-pillow", type=Path, default=ROOT / ".cache" / "stock-pillow")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.seconds, args.dump)
        return
    if not (args.stock_pillow / "PIL").is_dir():
        sys.exit(f"bench.lab.host.images: no stock Pillow at {args.stock_pillow} (make stock-pillow)")
    from tests.support.image_samples import encode, picture
    with tempfile.TemporaryDirectory() as tmp:
        jpeg = Path(tmp) / "picture.jpg"
        jpeg.write_bytes(encode(picture(SIDE, SIDE), "JPEG", quality=90))
        simd = run_child(jpeg, args.seconds, Path(tmp) / "simd.npz", None)
        stock = run_child(jpeg, args.seconds, Path(tmp) / "stock.npz", str(args.stock_pillow))
        a, b = np.load(Path(tmp) / "simd.npz"), np.load(Path(tmp) / "stock.npz")
        # Normalized with mean and std 0.5, one level of 8-bit colour is 2/255 in a patch.
        diffs = {name: float(np.abs(a[name] - b[name]).max()) * 255 / 2 for name in a.files}
    print(f"images prepared per second, one worker, {SIDE}x{SIDE} JPEG")
    print(f"| config | Pillow-SIMD {simd['pil']} | Pillow {stock['pil']} | speed-up |")
    print("| --- | ---: | ---: | ---: |")
    for name in CONFIGS:
        print(f"| {name} | {simd['rates'][name]:.1f} | {stock['rates'][name]:.1f} | "
              f"{simd['rates'][name] / stock['rates'][name]:.2f}x |")
    worst = max(diffs, key=diffs.get)
    print(f"\nresize, Pillow-SIMD vs Pillow: largest difference {diffs[worst]:.2f} levels of 255 ({worst}); "
          f"identical on {sum(d == 0 for d in diffs.values())} of {len(diffs)} pictures")


if __name__ == "__main__":
    main()
