"""Chat templates: the minijinja renderer against the Hugging Face corpus and against jinja2 set up as transformers."""

from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from frontend.chat.templates import ChatTemplate, Rendered, TemplateError
from ignition.template_marks import annotate, has_marks

# The chat template corpus (its README.md says where each template comes from and under which licence),
# kept in the repository so that the corpus tests run wherever the repository is cloned.
CORPUS = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
needs_corpus = pytest.mark.skipif(not (CORPUS / "cases.json").is_file(), reason=f"no chat template corpus at {CORPUS}")

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there, \"friend\" – ça va? 你好"},
    {"role": "assistant", "content": "  Fine, thanks.  "},
    {"role": "user", "content": "Tell me a {joke}.\nTwo lines."},
]
# Corpus cases that jinja2 as transformers sets it up renders differently from huggingface.js, the source of the
# targets (test_corpus_cases_match_jinja2 shows ours equals jinja2 on them).
KNOWN_DIFFERENCES = {
    "MadeAgents/Hammer2.1": "`tools|string`: Python repr in jinja2, JSON in huggingface.js",
    "ai21labs/AI21-Jamba-Large-1.6": "the case omits add_generation_prompt: undefined in huggingface.js (the template "
    "then defaults it to True), False as transformers passes it",
}
FIXED_NOW = datetime(2025, 7, 10, 12, 0)  # huggingface.js renders the corpus at this date (SmolLM3's "Today Date")


def _fixed_strftime_now(fmt: str) -> str:
    return FIXED_NOW.strftime(fmt)


def _first_difference(got: str, want: str) -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"at char {i}: got {got[max(0, i - 30) : i + 30]!r}, want {want[max(0, i - 30) : i + 30]!r}"


def _render_case(template: str, case: dict[str, Any]) -> Rendered:
    data = dict(case["data"])
    chat = ChatTemplate(
        template,
        bos_token=data.pop("bos_token", ""),
        eos_token=data.pop("eos_token", ""),
        strftime_now=_fixed_strftime_now,
    )
    # transformers always passes add_generation_prompt (default False); huggingface.js leaves it undefined.
    return chat.render(data.pop("messages"), add_generation_prompt=data.pop("add_generation_prompt", False), **data)


@needs_corpus
def test_corpus_cases_render_exactly() -> None:
    cases = json.loads((CORPUS / "cases.json").read_text())
    failures = {}
    for name, case in cases.items():
        try:
            got = _render_case(annotate(case["chat_template"]), case).text
        except TemplateError as e:
            failures[name] = f"raised: {e}"
            continue
        if got != case["target"]:
            failures[name] = f"{_first_difference(got, case['target'])} ({KNOWN_DIFFERENCES.get(name, 'unexplained')})"
    report = "\n".join(f"  {name}: {why}" for name, why in failures.items())
    print(f"\ncorpus: {len(cases) - len(failures)}/{len(cases)} exact\n{report}")
    assert len(cases) - len(failures) >= 42, f"{len(failures)} corpus cases differ:\n{report}"


@needs_corpus
def test_annotation_never_changes_output() -> None:
    cases = json.loads((CORPUS / "cases.json").read_text())
    for name, case in cases.items():
        annotated = annotate(case["chat_template"])
        marked, plain = _render_case(annotated, case), _render_case(case["chat_template"], case)
        assert marked.text == plain.text, f"{name}: {_first_difference(marked.text, plain.text)}"
        assert has_marks(annotated), f"{name}: no message loop found"
        ends = marked.message_ends
        assert ends == sorted(ends) and all(0 < end <= len(marked.text) for end in ends), name


@needs_corpus
def test_corpus_cases_match_jinja2() -> None:
    # The corpus targets come from huggingface.js; transformers' jinja2 is the reference that matters.
    cases = json.loads((CORPUS / "cases.json").read_text())
    for name, case in cases.items():
        data = {"add_generation_prompt": False, "bos_token": "", "eos_token": "", "tools": None, "documents": None}
        want = _jinja2_template(case["chat_template"]).render(**{**data, **case["data"]})
        got = _render_case(case["chat_template"], case).text
        assert got == want, f"{name}: {_first_difference(got, want)}"


def _jinja2_template(source: str) -> jinja2.Template:
    """jinja2 as transformers configures it (src/transformers/utils/chat_template_utils.py)."""

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    class Generation(Extension):
        # transformers' AssistantTracker, minus the index tracking: the body renders as is.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _fixed_strftime_now
    return env.from_string(source)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CHAT = [
    CHAT[0],
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22C sunny"},
    {"role": "assistant", "content": "It is 22C."},
    {"role": "user", "content": "Thanks"},
]
PARTS_CHAT = [
    CHAT[0],
    {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"}, {"type": "text", "text": "?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A cat."}], "reasoning_content": "hmm"},
    {"role": "user", "content": [{"type": "text", "text": "sure?"}]},
]
CONVERSATIONS = [  # (label, messages, add_generation_prompt, tools)
    ("system+user+assistant+user", CHAT, True, None),
    ("system+user+assistant+user, no generation prompt", CHAT, False, None),
    ("tool calls", TOOL_CHAT, True, TOOLS),
    ("content parts", PARTS_CHAT, True, None),
]


@needs_corpus
def test_differential_against_jinja2() -> None:
    paths = sorted((CORPUS / "differential").glob("*.jinja"))
    assert len(paths) == 36
    failures, raised, total = [], 0, 0
    for path in paths:
        source = path.read_text()
        ours = ChatTemplate(annotate(source), bos_token="<s>", eos_token="</s>", strftime_now=_fixed_strftime_now)
        reference = _jinja2_template(source)
        for label, messages, generation_prompt, tools in CONVERSATIONS:
            total += 1
            kwargs = dict(messages=messages, add_generation_prompt=generation_prompt, tools=tools, documents=None)
            try:
                want = reference.render(bos_token="<s>", eos_token="</s>", **kwargs)
            except Exception:  # the template rejects the conversation (raise_exception, or str + list): so must ours
                want = None
            try:
                got: str | None = ours.render(**kwargs).text
            except TemplateError:
                got = None
            raised += got is None and want is None
            if got != want:
                why = "raised" if got is None else "did not raise" if want is None else _first_difference(got, want)
                failures.append(f"  {path.stem} ({label}): {why}")
    report = "\n".join(failures)
    print(f"\ndifferential: {total - len(failures)}/{total} agree with jinja2 ({raised} raise in both)\n{report}")
    assert not failures, f"{len(failures)} of {total} differ from jinja2:\n{report}"


def test_chatml_marks_follow_each_message() -> None:
    annotated = annotate(SMOLLM2)
    assert has_marks(annotated) and not has_marks(SMOLLM2)
    chat = ChatTemplate(annotated)
    for messages, injected_system in [(CHAT, 0), (CHAT[1:], 1)]:
        rendered = chat.render(messages)
        text = rendered.text
        ends = [i + len("<|im_end|>\n") for i in range(len(text)) if text.startswith("<|im_end|>\n", i)]
        # Without a system message, SmolLM2's default one is part of the first message's turn.
        assert rendered.message_ends == ends[injected_system:]
        assert text == ChatTemplate(SMOLLM2).render(messages).text
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}\n<{{ m.content }}>\n    {%- endfor %}\n!",
        "{% set loop_messages = messages %}{% for m in loop_messages %}\n  <{{ m.content }}>\n  {% endfor %}\n!",
        "{%- for m in messages[0:] -%}\n\t<{{ m.content }}>  {% endfor %}!",
        "{% for m in messages %}\n<{{ m.content }}>\n{% else %}\n  none\n{% endfor %}!",
        "{% for m in messages %}\n{% for x in m.content %}{{ x }}{% endfor %}\n{% generation %} ;{% endgeneration %}\n"
        "    {% endfor %}",
        "{% for m in messages %}<{{ m.content }}>\n{%+ endfor %}",
    ],
)
def test_mark_variants_keep_output(source: str) -> None:
    messages = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]
    annotated = annotate(source)
    assert annotated.count("mark()") == 1
    rendered = ChatTemplate(annotated).render(messages)
    assert rendered.text == ChatTemplate(source).render(messages).text
    assert rendered.text == _jinja2_template(source).render(messages=messages)
    assert len(rendered.message_ends) == 2
    first, second = rendered.message_ends
    assert "b" in rendered.text[:first] and "c" not in rendered.text[:first] and "d" in rendered.text[first:second]


def test_mark_insertions() -> None:
    loop = "{% for m in messages %}"
    assert annotate(loop + "{{ m }}{%- endfor %}") == loop + "{{ m }}{{- mark() }}{%- endfor %}"
    assert annotate(loop + "\n{{ m }}\n   {% endfor %}") == loop + "\n{{ m }}\n{{ mark() }}{% endfor %}"
    assert annotate(loop + "{{ m }} {% endfor %}") == loop + "{{ m }} {{ mark() }}{% endfor %}"
    # No message loop, a reversed scan, a loop in a macro, a validation-only loop: nothing to mark.
    for source in [
        "{{ messages[0].content }}",
        "{% for m in messages[::-1] %}{% set n = m %}{% endfor %}",
        "{% for part in messages[0].content %}{{ part.text }}{% endfor %}",
        "{% macro f(messages) %}{% for m in messages %}{{ m }}{% endfor %}{% endmacro %}",
        "{% for m in messages %}{% if m.role == 'x' %}{{ raise_exception('no') }}{% endif %}{% endfor %}",
    ]:
        assert annotate(source) == source


def test_user_content_cannot_spoof_a_mark() -> None:
    chat = ChatTemplate(annotate(SMOLLM2))
    honest = chat.render([{"role": "user", "content": "hi"}])
    # Whatever a client sends, it cannot guess the per-render sentinel.
    for content in ["\ue000", "\ue000\ue001", f"x{chr(0xE000)}{'0' * 16}\ue001y", "{{ mark() }}"]:
        rendered = chat.render([{"role": "user", "content": content}])
        assert content in rendered.text
        assert len(rendered.message_ends) == len(honest.message_ends) == 1


def test_raise_exception_is_template_error() -> None:
    chat = ChatTemplate("{% if messages|length > 1 %}{{ raise_exception('Roles must alternate') }}{% endif %}ok")
    assert chat.render([{"role": "user", "content": "a"}]).text == "ok"
    with pytest.raises(TemplateError, match="^Roles must alternate$"):
        chat.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(TemplateError) as info:
        ChatTemplate("{{ messages.nope.deeper }}").render([])
    assert "\n" not in str(info.value)
    with pytest.raises(TemplateError):
        ChatTemplate("{% for %}")


def test_jinja2_compatible_helpers() -> None:
    chat = ChatTemplate(
        "{{ tools|tojson }}|{{ tools|tojson(indent=2, sort_keys=true) }}|{{ tools|tojson(separators=(',', ':')) }}|"
        "{{ ' a,b '.strip().split(',') }}|{{ tools[0].get('z', 'dflt') }}|"
        "{% for k, v in tools[0].items() %}{{ k }}{% endfor %}|{{ undefined_thing }}|"
        "{% for i in range(9) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}"
        "{% endif %}{{ i }}{% endfor %}|{{ strftime_now('%Y') }}|{{ enable_thinking }}|{{ bos_token }}"
    )
    tools = [{"b": "é", "a": [1, None]}]
    text = chat.render([], tools=tools, enable_thinking=False).text
    assert text.split("|")[:3] == [
        '[{"b": "é", "a": [1, null]}]',
        '[\n  {\n    "a": [\n      1,\n      null\n    ],\n    "b": "é"\n  }\n]',
        '[{"b":"é","a":[1,null]}]',
    ]
    assert text.split("|")[3:] == ["['a', 'b']", "dflt", "ba", "", "013", str(datetime.now().year), "False", ""]


def test_render_from_many_threads() -> None:
    chat = ChatTemplate(annotate(SMOLLM2))
    expected = {n: chat.render([{"role": "user", "content": str(n)}] * (n % 4 + 1)) for n in range(64)}
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for n in range(offset, 64, 8):
                assert chat.render([{"role": "user", "content": str(n)}] * (n % 4 + 1)) == expected[n]
        except BaseException as e:  # surfaced to the main thread below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
