"""FP8 weights' effect on greedy tokens with real weights: a checkpoint exported twice, dense (fp32) and with
`--quant fp8` (ignition/fp8.py: every linear of the decoder layers as e4m3 with one fp32 scale per output channel;
the embeddings, the LM head and the norms stay fp32), each served in turn by `flare run` on the CPU and sent
the same chats through the chat template, greedy.

    python -m bench.lab.host.fp8_quality                           # the default GGUF, cores under --cores
    python -m bench.lab.host.fp8_quality --against fp8,q8,source,fp32 --max-tokens 128

`--against` holds other exports to the same fp32 reference: `q8` (8-bit groups of 32, run by the CPU's quantized
kernel), `source` (the source's own precision: the default GGUF's Q4_1/Q8_0 blocks, the core `make core` serves),
and `fp32` itself served a second time, a control that must agree on every chat.

On the CPU the engine dequantizes FP8 weights to fp32 at load (engine/model/fp8.py), so both servers compute in
fp32 and the only difference is the e4m3 rounding of the linears. Every chat asks for logprobs (top 2): its tokens
come back exactly (as bytes), and such requests decode without speculation. Requests go one at a time, in the same
order to every server. Prints a summary (chats with identical replies, the mean common token prefix, the median
first divergence and the reference's margins there: its top logprob minus its second, how near a tie the token was)
and one line per chat: where the replies part, the reference's margin there, and each reply's first words from
there.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import openai
from openai.types.chat import ChatCompletionTokenLogprob

from bench.lab.host.served import start_server

DEFAULT_SOURCE = Path(".cache/SmolLM2-135M-Instruct.Q4_1.gguf")
# Each core's name and the flags `ignition export` writes it with; fp32 is the reference the others are held to.
# `source` keeps the source's own precision (a GGUF's Q4_1/Q8_0 blocks: what `make core` serves).
EXPORTS = {"fp32": ["--dtype", "float32"], "fp8": ["--quant", "fp8"], "q8": ["--quant", "q8"], "source": []}
REFERENCE = "fp32"
WORDS_SHOWN = 6

Chat = list[dict[str, str]]


def user(text: str) -> Chat:
    return [{"role": "user", "content": text}]


def turns(*texts: str, system: str | None = None) -> Chat:
    """A conversation: user and assistant messages alternate from the first, which is the user's."""
    chat = [{"role": "system", "content": system}] if system else []
    return chat + [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(texts)]


CHATS: list[tuple[str, Chat]] = [
    ("question", user("Why is the sky blue?")),
    ("question", user("What is the difference between a virus and a bacterium?")),
    ("question", user("How does a refrigerator keep food cold?")),
    ("question", user("Who wrote Pride and Prejudice, and what is it about?")),
    ("question", user("What causes earthquakes?")),
    ("question", user("Is it healthier to walk or to run? Answer briefly.")),
    ("question", user("What is the capital of Australia, and why is it not Sydney?")),
    ("question", user("How many legs does a spider have, and how many does an insect have?")),
    ("instruction", user("Write a haiku about autumn leaves.")),
    ("instruction", user("Write a short, polite email asking my landlord to fix a leaking kitchen tap.")),
    ("instruction", user("Summarize in two sentences: The city council voted on Tuesday to build a new library "
                         "downtown. The project will cost twelve million dollars and open in three years. Critics "
                         "said the money should go to road repairs instead.")),
    ("instruction", user("Rewrite this sentence to sound more formal: hey, can u send me the report asap?")),
    ("instruction", user("Translate to French: Good morning, where is the train station?")),
    ("instruction", turns("Tell me a joke about computers.", system="You are a cheerful assistant who loves puns.")),
    ("code", user("Write a Python function that checks whether a string is a palindrome.")),
    ("code", user("Explain what this code does:\n\n```python\nprint(sum(x * x for x in range(10)))\n```")),
    ("code", user("Write a SQL query that returns the ten customers with the highest total order amount from "
                  "tables customers(id, name) and orders(id, customer_id, amount).")),
    ("code", user("How do I count the lines of every .txt file in a folder with a bash command?")),
    ("code", user("Find the bug:\n\n```python\ndef average(xs):\n    return sum(xs) / len(xs) - 1\n```")),
    ("code", user("Write a JavaScript function that returns the largest number in an array.")),
    ("list", user("List five fruits that are high in vitamin C.")),
    ("list", user("Give me the steps to make a cup of tea.")),
    ("list", user("List three advantages and three disadvantages of working from home.")),
    ("list", user("Name the planets of the solar system in order from the Sun.")),
    ("list", user("What should I pack for a weekend camping trip? Make a checklist.")),
    ("list", user("Give me four tips for learning a new language.")),
    ("multi-turn", turns("I want to start running. Any advice?",
                         "Start slowly: run for a few minutes, walk, and repeat. Increase the time each week.",
                         "How often should I run in the first month?")),
    ("multi-turn", turns("What is the boiling point of water?",
                         "At sea level, water boils at 100 degrees Celsius (212 degrees Fahrenheit).",
                         "And on top of a high mountain?")),
    ("multi-turn", turns("Can you help me name my new cat?", "Of course! What does your cat look like?",
                         "She is small, black, and very playful.")),
    ("multi-turn", turns("What is 12 times 7?", "12 times 7 is 84.", "Now divide that by 4.")),
    ("multi-turn", turns("Recommend a book for a long flight.",
                         "You might enjoy The Martian by Andy Weir: it is funny, tense and easy to read.",
                         "I have read it. Something similar?", system="You are a friendly librarian.")),
    ("multi-turn", turns("Write a Python list of three colors.", "colors = [\"red\", \"green\", \"blue\"]",
                         "Now sort it alphabetically and print it.")),
]


@dataclass(frozen=True)
class Reply:
    tokens: list[bytes]
    margins: list[float]  # per token: the top logprob minus the second (inf when there is no second)

    def words_from(self, position: int) -> str:
        """The reply's first words from token `position`, on one line, safe in a markdown table cell."""
        if position >= len(self.tokens):
            return "(end)"
        text = b"".join(self.tokens[position:]).decode("utf-8", "replace")
        words = text.split()
        shown = " ".join(words[:WORDS_SHOWN]) + (" ..." if len(words) > WORDS_SHOWN else "")
        lead = " " if text[:1].isspace() else ""  # a divergence on a space vs a word shows as such
        return "`" + (lead + shown).replace("`", "'").replace("|", "\\|") + "`"


def export(source: Path, cores: Path, name: str) -> Path:
    """The source exported as EXPORTS[name] under `cores`, kept and reused when already there."""
    core = cores / name
    if not (core / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "ignition.main", "export", str(source), str(core), *EXPORTS[name],
                        "--force"], check=True)
    return core


def replies(core: Path, port: int, extra: list[str], max_tokens: int) -> list[Reply]:
    server = start_server(core, port, extra)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
        model = client.models.list().data[0].id
        out = []
        for _, messages in CHATS:
            response = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                      max_tokens=max_tokens, logprobs=True, top_logprobs=2)
            entries = response.choices[0].logprobs.content or []
            out.append(Reply([bytes(e.bytes) for e in entries], [margin(e) for e in entries]))
        return out
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def margin(entry: ChatCompletionTokenLogprob) -> float:
    top = sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def common_prefix(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def summary(dense: list[Reply], results: dict[str, list[Reply]]) -> None:
    """One row per core held to the reference."""
    print(f"| core | chats | identical replies | mean common prefix (tokens) | mean {REFERENCE} reply (tokens) | "
          f"median first divergence (diverging chats) | {REFERENCE} margin there: median, largest |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for name, other in results.items():
        prefixes = [common_prefix(a.tokens, b.tokens) for a, b in zip(dense, other)]
        divergences = [p for p, a, b in zip(prefixes, dense, other) if a.tokens != b.tokens]
        margins = [a.margins[p] for p, a, b in zip(prefixes, dense, other) if a.tokens != b.tokens
                   and p < len(a.margins)]
        median = f"{statistics.median(divergences):g}" if divergences else "none"
        there = f"{statistics.median(margins):.2f}, {max(margins):.2f}" if margins else ""
        print(f"| {name} | {len(CHATS)} | {len(CHATS) - len(divergences)} | {statistics.mean(prefixes):.1f} | "
              f"{statistics.mean(len(a.tokens) for a in dense):.1f} | {median} | {there} |")


def chats(dense: list[Reply], name: str, other: list[Reply]) -> None:
    """One row per chat: where `other`'s reply parts from the reference's, and how."""
    print(f"\n| # | kind | tokens {REFERENCE} / {name} | first divergence | {REFERENCE} margin there | "
          f"{REFERENCE} from there | {name} from there |\n| --- | --- | --- | --- | --- | --- | --- |")
    for i, ((kind, _), a, b) in enumerate(zip(CHATS, dense, other)):
        p = common_prefix(a.tokens, b.tokens)
        lengths = f"{len(a.tokens)} / {len(b.tokens)}"
        if a.tokens == b.tokens:
            print(f"| {i} | {kind} | {lengths} | identical | | | |")
            continue
        there = f"{a.margins[p]:.2f}" if p < len(a.margins) else ""
        print(f"| {i} | {kind} | {lengths} | {p} | {there} | {a.words_from(p)} | {b.words_from(p)} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.host.fp8_quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE,
                        help=f"a GGUF file or Hugging Face directory (default: {DEFAULT_SOURCE}, `make core`'s)")
    parser.add_argument("--cores", type=Path, default=Path("/tmp/flare-fp8-quality"),
                        help="where the cores are written (reused when there: clear it for another source)")
    parser.add_argument("--against", default="fp8", metavar="CORE,...",
                        help=f"the exports held to {REFERENCE}, of {', '.join(EXPORTS)} (default: fp8)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per reply")
    parser.add_argument("--port", type=int, default=8132)
    parser.add_argument("--flare-arg", action="append", default=[], help="passed on to `flare run` (repeatable)")
    args = parser.parse_args(argv)
    against = args.against.split(",")
    if unknown := sorted(set(against) - set(EXPORTS)):
        parser.error(f"--against: unknown {', '.join(unknown)} (choose from {', '.join(EXPORTS)})")
    cores = {name: export(args.source, args.cores, name) for name in dict.fromkeys([REFERENCE, *against])}
    started = time.monotonic()
    dense = replies(cores[REFERENCE], args.port, args.flare_arg, args.max_tokens)
    results = {name: replies(cores[name], args.port, args.flare_arg, args.max_tokens) for name in against}
    print(f"{args.source}: {len(CHATS)} chats, greedy, {args.max_tokens} new tokens, {os.cpu_count()} CPUs here, "
          f"{time.monotonic() - started:.0f} s serving\n")
    summary(dense, results)
    for name, other in results.items():
        chats(dense, name, other)


if __name__ == "__main__":
    main()
