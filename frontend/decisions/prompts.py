"""Decision prompts (docs/design.md, Decisions): a core's decision config, the prompts of a request,
and where their label logits are read.

A core may carry `decision.json` (labels, temperatures, noul option order, whether user text is escaped) and
`decision_template.jinja` (a template of `state` with `question`, one prompt per question, or with `questions`, one
prompt for all). Without a template, each question becomes the generic prompt below, sent as the user message of
the model's chat template: the state comes first, so the questions about one state share its prefix, and the
logits of the option labels (`A`, `B`, ... or `Yes`/`No`) are read after the generation prompt. A decision
template places `<|mark|>` where a label is read (the logits of the token before it) and may place `<|split|>`
to cut the encoding; both are dropped from the token ids. The semantics are those of transformers' `decision`
package and `DecisionPipeline`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from common.errors import CoreError, InvalidRequest
from common.manifest import DECISION_FILES
from frontend.chat.control_tokens import ControlTokens
from frontend.chat.templates import ChatTemplate, TemplateError
from frontend.decisions.questions import Question, parse_questions
from frontend.limits import check_prompt_chars
from frontend.model import ServedModel

CONFIG_FILE, TEMPLATE_FILE = DECISION_FILES
MARK, SPLIT = "<|mark|>", "<|split|>"

# The prompt of a question for any chat model (transformers' DECISION_PROMPT, the prompt of its /v1/systemone).
GENERIC_PROMPT = """
{%- macro text(x) %}{{ "" if x is none else x if x is string else x|tojson }}{% endmacro -%}
{%- set ns = namespace(lines=[text(question.instructions)]) -%}
{%- for option in question.options -%}
    {%- set label, answer = question.labels[loop.index0], text(question.descriptions[loop.index0]) -%}
    {%- if question.type == "noul" -%}
        {%- set answer = answer or (option if question.labels != ["Yes", "No"] else "") -%}
        {%- set ns.lines = ns.lines + ([label ~ ": " ~ answer] if answer else []) -%}
    {%- else -%}
        {%- set answer = (option ~ ": " ~ answer if answer else option) if question.type == "choice" else answer -%}
        {%- set ns.lines = ns.lines + [label ~ ". " ~ answer] -%}
    {%- endif -%}
{%- endfor -%}
{{- text(state) ~ "\\n\\n" ~ ns.lines|select|join("\\n") ~ "\\n" -}}
{%- if question.type == "noul" -%}
    {{- "Answer " ~ question.labels[0] ~ " or " ~ question.labels[1] ~ " only." -}}
{%- else -%}
    {%- set kind = "letter" if question.labels == "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: question.labels|length]|list else "label" -%}
    {{- "Answer with the " ~ kind ~ " of the " ~ ("option" if question.type == "choice" else "level") -}}
    {{- " that fits best (" ~ question.labels[0] ~ " to " ~ question.labels[-1] ~ ") only." -}}
{%- endif -%}
"""


@dataclass(frozen=True)
class DecisionConfig:
    labels: dict[str, list[str]] = field(default_factory=dict)
    temperature: dict[str, float] = field(default_factory=dict)
    noul_options: list[str] = field(default_factory=lambda: ["true", "false"])
    sanitize_control_tokens: bool = True
    adapter: str | None = None  # a LoRA the reference loads; Flare does not
    template: str | None = None

    @classmethod
    def from_core(cls, core: Path) -> DecisionConfig:
        """The core's decision config, or the defaults; a CoreError names a file that is not valid."""
        path, template = core / CONFIG_FILE, core / TEMPLATE_FILE
        try:
            raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            config = cls(labels=dict(raw.get("labels") or {}), temperature=dict(raw.get("temperature") or {}),
                         noul_options=list(raw.get("noul_options") or ["true", "false"]),
                         sanitize_control_tokens=bool(raw.get("sanitize_control_tokens", True)),
                         adapter=raw.get("adapter"),
                         template=template.read_text(encoding="utf-8") if template.is_file() else None)
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise CoreError(f"{path}: not a valid decision config: {exc}") from None
        if sorted(config.noul_options) != ["false", "true"]:
            raise CoreError(f"{path}: noul_options must order 'true' and 'false', got {config.noul_options!r}")
        if not all(isinstance(t, (int, float)) and t > 0 for t in config.temperature.values()):
            raise CoreError(f"{path}: every temperature must be a positive number")
        if not all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in config.labels.values()):
            raise CoreError(f"{path}: labels map question types to lists of strings")
        return config

    def probabilities(self, question: Question, logits: list[float]) -> list[float]:
        """The softmax of the label logits at the question type's temperature (the reference's processing)."""
        scaled = [x / float(self.temperature.get(question.type, 1.0)) for x in logits]
        top = max(scaled)
        weights = [math.exp(x - top) for x in scaled]
        total = sum(weights)
        return [w / total for w in weights]


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    questions: list[Question]
    positions: list[int]  # per question, the position whose logits hold its labels'


class Decider:
    """Everything a frontend needs to turn decision requests into scored prompts for one served model."""

    def __init__(self, model: ServedModel) -> None:
        self.config = DecisionConfig.from_core(model.core)
        self.model = model
        # A tokenizer of its own with the sentinels: the chat routes' tokenizer never learns them.
        self.tokenizer = Tokenizer.from_str(model.tokenizer.to_str())
        self.tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in (MARK, SPLIT)])
        self.sentinels = (self.tokenizer.token_to_id(MARK), self.tokenizer.token_to_id(SPLIT))
        self.unknown_id = self._unknown_id()
        try:
            self.template = ChatTemplate(self.config.template) if self.config.template is not None else None
            self.generic = ChatTemplate(GENERIC_PROMPT)
        except TemplateError as exc:
            raise CoreError(f"{model.core / TEMPLATE_FILE}: {exc}") from None
        # A template that reads `questions` gets one prompt for all of them.
        self.together = self.template is not None and re.search(r"\bquestions\b", self.config.template) is not None
        source = self.config.template if self.template is not None else model.template_source
        self.escape = ControlTokens(self.tokenizer, source)
        self.label_ids = lru_cache(maxsize=256)(self._label_ids)

    def _unknown_id(self) -> int | None:
        unknown = json.loads(self.tokenizer.to_str())["model"].get("unk_token")
        return self.tokenizer.token_to_id(unknown) if unknown else None

    def questions(self, questions: dict[str, Any]) -> list[Question]:
        return parse_questions(questions, self.config.labels, self.config.noul_options)

    def _label_ids(self, labels: tuple[str, ...]) -> list[int]:
        ids = [self.tokenizer.encode(label, add_special_tokens=False).ids for label in labels]
        single = [i[0] for i in ids if len(i) == 1 and i[0] != self.unknown_id]
        if len(set(single)) != len(labels):
            raise InvalidRequest(f"The labels {list(labels)} are not distinct single tokens for this model.")
        return single

    def prompts(self, state: Any, questions: list[Question]) -> list[Prompt]:
        """The tokenized prompts about one state: one per question, or one for all when the template says so."""
        if self.config.adapter:
            raise InvalidRequest(f"this core's decision config needs the LoRA adapter {self.config.adapter!r}, "
                                 "which Flare does not load")
        for question in questions:
            self.label_ids(tuple(question.labels))
        groups = [questions] if self.together else [[q] for q in questions]
        return [self._prompt(state, group) for group in groups]

    def _prompt(self, state: Any, questions: list[Question]) -> Prompt:
        sanitize = self.config.sanitize_control_tokens
        group = [q.template_value() for q in questions]
        if not sanitize:  # the template escapes user text itself: only the sentinels are taken out of it
            state, group = _without_sentinels(state), _without_sentinels(group)
        chat = self.template or self.model.template
        if chat is None:
            raise InvalidRequest("this model has no chat template, so it cannot answer decisions")
        try:
            if self.template is None:
                content = self.generic.render([], state=state, question=group[0]).text
                messages, variables = [{"role": "user", "content": content}], {}
            else:
                messages = [{"role": "user", "content": ""}]
                variables = {"state": state, "question": group[0], "questions": group}
            if sanitize:
                messages, variables = self.escape.mark(messages), self.escape.mark(variables)
            text = chat.render(messages, add_generation_prompt=True, enable_thinking=False, **variables).text
        except TemplateError as exc:
            raise InvalidRequest(f"the decision template rejected the request: {exc}") from None
        check_prompt_chars(len(text), self.model.manifest.context_limit, "state")
        ids = self.escape.encode(text) if sanitize else self.tokenizer.encode(text, add_special_tokens=False).ids
        kept, marks = [], []
        for token in ids:
            if token == self.sentinels[0]:
                marks.append(len(kept))
            elif token != self.sentinels[1]:
                kept.append(token)
        marks = marks or [len(kept)]
        if len(marks) != len(questions) or min(marks) < 1:
            raise InvalidRequest(f"the decision template placed {len(marks)} marks for {len(questions)} questions")
        return Prompt(kept, questions, [mark - 1 for mark in marks])


def _without_sentinels(value: Any) -> Any:
    text = json.dumps(value, ensure_ascii=False).replace(MARK, "").replace(SPLIT, "")
    return json.loads(text)
