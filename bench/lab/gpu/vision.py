"""Images on a GPU, printed as tables: the vision tower's time per image and a one-image chat's time to first token:

    python -m bench.lab.gpu.vision [--cores DIR] [--layers N]

The core is made here with `ignition synth --preset qwen3-vl-8b` (random bf16 weights of Qwen3-VL-8B's architecture;
--layers shortens only the text model). Measured: the vision tower's time for 1, 4 and 16 prepared 1024x1024 JPEGs
(CUDA events, median of 5) three ways: eagerly with torch's SDPA per image, eagerly with the Triton segment attention
(engine/kernels/triton/segment_attention.py), and replayed from the graphs the GraphExecutor captures
(engine/executor/vision_graphs.py, at every capacity up to MAX_PATCHES); and, through `flare run` and the openai
client, time to first token of a one-image chat against a text chat of the same prompt length. Image steps run their
text model eagerly, the steps after them in graphs (engine/model/qwen3_vl.py); greedy tokens graph vs eager, and
kernel path vs torch path, are `pytest -m gpu tests/kernels/test_qwen3_vl_kernels.py tests/engine/test_vision_graphs.py`.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import time
from pathlib import Path

import openai
import torch

from common.protocol import ImageInput
from engine.executor.vision_graphs import VisionGraphs, vision_capacities
from engine.model.backends.triton import KernelTower
from engine.model.image_features import Tower
from engine.model.loader import load_model
from engine.model.qwen3_vl import VisionLanguageLM
from frontend.images.decode import ImageLimits
from frontend.images.prepare import prepare
from ignition.main import main as ignition
from tests.support.servers import Server
from tests.support.image_samples import encode, picture

SIDE = 1024


def core(cores: Path, layers: int | None) -> Path:
    out = cores / ("qwen3-vl-8b" + (f"-{layers}l" if layers else ""))
    if not (out / "manifest.json").is_file():
        args = ["synth", "--preset", "qwen3-vl-8b", "--dtype", "bfloat16", str(out)]
        if ignition(args + (["--layers", str(layers)] if layers else [])) != 0:
            raise RuntimeError("ignition synth qwen3-vl-8b failed")
    return out


def jpegs(count: int) -> list[bytes]:
    return [encode(picture(SIDE, SIDE, seed=i), "JPEG", quality=90) for i in range(count)]


def encode_ms(model: VisionLanguageLM, images: list[ImageInput], tower: Tower) -> float:
    """Median of 5 timed calls after one warm-up of `tower`: the module (its SDPA path), the kernel path's, or
    the graphs."""
    times = []
    with torch.inference_mode():
        for _ in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model.encode_images(images, tower)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def tower_times(core_dir: Path) -> None:
    manifest, model = load_model(core_dir, torch.device("cuda"))
    capacities = vision_capacities(1 << 20, model.visual.config.merge_size)
    graphs = VisionGraphs(KernelTower(model.visual), capacities, torch.device("cuda"))
    print(f"Vision graphs at {capacities} patches: captured in {graphs.capture_seconds:.1f} s, "
          f"{graphs.memory_bytes / 2**20:.0f} MiB of pool\n")
    print(f"| images of {SIDE}x{SIDE} | tokens | SDPA eager ms | Triton eager ms | graphs ms | graphs ms per image |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for count in (1, 4, 16):
        prepared = [prepare(data, manifest.vision, ImageLimits(), "bench") for data in jpegs(count)]
        images = [ImageInput(p.identity, 0, list(p.grid), p.patches.tobytes()) for p in prepared]
        sdpa = encode_ms(model, images, model.visual)
        triton = encode_ms(model, images, KernelTower(model.visual))
        replayed = encode_ms(model, images, graphs)
        print(f"| {count} | {sum(p.tokens for p in prepared)} | {sdpa:.1f} | {triton:.1f} | {replayed:.1f} | "
              f"{replayed / count:.1f} |")
    graphs.close()
    del model, graphs
    torch.cuda.empty_cache()


def ttft(client: openai.OpenAI, content: object) -> tuple[float, int]:
    started = time.perf_counter()
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    first, prompt_tokens = None, 0
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
        if chunk.usage:
            prompt_tokens = chunk.usage.prompt_tokens
    return first or float("nan"), prompt_tokens


def serving_ttft(core_dir: Path) -> None:
    server = Server(core_dir, "--device", "cuda")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        url = "data:image/jpeg;base64," + base64.b64encode(jpegs(1)[0]).decode()
        image_chat = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]
        _, image_tokens = ttft(client, image_chat)  # warm-up, and the prompt length to match
        _, text_tokens = ttft(client, "hello " * image_tokens)
        words = "hello " * max(round(image_tokens * image_tokens / text_tokens), 1)
        rows = {"one-image chat": image_chat, "text chat": words}
        print("| chat | prompt tokens | TTFT ms (median of 5) |")
        print("| --- | ---: | ---: |")
        for name, content in rows.items():
            # A different picture each time, so the prefix cache cannot answer for the tower.
            samples = []
            for i in range(5):
                if name == "one-image chat":
                    data = encode(picture(SIDE, SIDE, seed=100 + i), "JPEG", quality=90)
                    content = [{"type": "image_url", "image_url": {
                        "url": "data:image/jpeg;base64," + base64.b64encode(data).decode()}}, image_chat[1]]
                else:
                    content = f"{i} " + words
                seconds, tokens = ttft(client, content)
                samples.append(seconds)
            print(f"| {name} | {tokens} | {statistics.median(samples) * 1e3:.0f} |")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.gpu.vision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=Path, default=Path("cores"))
    parser.add_argument("--layers", type=int, help="text layers (default: all 36)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.lab.gpu.vision needs a CUDA GPU")
    core_dir = core(args.cores, args.layers)
    print(f"## Qwen3-VL-8B architecture (synth, bf16) on {torch.cuda.get_device_name()}\n")
    tower_times(core_dir)
    print()
    serving_ttft(core_dir)


if __name__ == "__main__":
    main()
