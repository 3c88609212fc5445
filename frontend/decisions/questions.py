"""System One requests (docs/design.md, Decisions): validation, questions with their options, answers.

A request is `{"model", "state", "questions": {name: question}, "assets"}`; a question is a `choice` (criteria map
options to descriptions), a `score` (criteria list the levels, lowest first) or a `noul` (optional criteria describe
`true` and `false`). Validation errors are the API's: FastAPI's 422 details (`loc`, `msg`, `type`), every invalid
question named in one `value_error`, with an example of a valid question. The semantics are those of transformers'
`decision` package (the reference of `/v1/systemone`); the code is Flare's.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

MAX_QUESTIONS = 64
MAX_ASSETS = 4
QUESTION_TYPES = ("noul", "choice", "score")
EXAMPLES = {
    "noul": '{"type": "noul", "instructions": "Is this message spam?", '
            '"criteria": {"true": "Unsolicited ads", "false": "A real conversation"}}',
    "choice": '{"type": "choice", "instructions": "What is the tone?", '
              '"criteria": {"calm": "A polite message", "angry": null}}',
    "score": '{"type": "score", "instructions": "How urgent is it?", '
             '"criteria": ["Can wait", "This week", "Today"]}',
}


class DecisionInvalid(ValueError):
    """A request the API refuses with 422: FastAPI's error details, each {"type", "loc", "msg"}."""

    def __init__(self, detail: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, item['loc'][1:]))}: {item['msg']}" for item in detail))
        self.detail = detail


def error(loc: tuple, kind: str, msg: str) -> dict[str, Any]:
    return {"type": kind, "loc": ["body", *loc], "msg": msg}


def is_content(value: object) -> bool:
    return isinstance(value, (str, dict, list))


@dataclass(frozen=True)
class Question:
    """One question, with its options (choice keys, score levels or true/false) in template order."""

    name: str
    type: str
    instructions: Any
    options: list[str]
    labels: list[str]  # the single-token label of each option, read after the prompt
    descriptions: list[Any]

    def template_value(self) -> dict[str, Any]:
        """What a template sees as `question`."""
        return {"name": self.name, "type": self.type, "instructions": self.instructions, "options": self.options,
                "labels": self.labels, "descriptions": self.descriptions}

    def answer(self, probabilities: list[float]) -> dict[str, Any]:
        """The System One answer, from the probability of each option."""
        by_option, n = dict(zip(self.options, probabilities)), len(probabilities)
        if self.type == "noul":
            return {"type": "noul", "noul": by_option["true"]}
        best = max(by_option, key=by_option.get)
        if self.type == "choice":
            confidence = 1.0 if n == 1 else max(0.0, (by_option[best] - 1 / n) / (1 - 1 / n))
            return {"type": "choice", "choice": best, "confidence": confidence, "probabilities": by_option}
        distance = sum(p * abs(level - int(best)) for level, p in enumerate(probabilities))
        uniform_distance = sum(abs(level - (n - 1) / 2) for level in range(n)) / n
        return {"type": "score", "score": sum(level * p for level, p in enumerate(probabilities)),
                "legend": dict(zip(self.options, self.descriptions)),
                "confidence": 1.0 if n == 1 else max(0.0, 1 - distance / uniform_distance),
                "probabilities": by_option}


def _criteria_problem(kind: str, criteria: object) -> str | None:
    """What is wrong with a question's criteria, by its type; None when nothing is."""
    if kind == "score":
        if not isinstance(criteria, list) or not all(is_content(level) for level in criteria):
            return "`criteria` must be a list of levels (strings, objects or lists), lowest first"
        return None
    if kind == "noul" and criteria is None:
        return None
    if not isinstance(criteria, dict):
        return "`criteria` must be an object"
    if kind == "noul" and set(criteria) - {"true", "false"}:
        return f"`criteria` of a noul question has only the keys 'true' and 'false', got {sorted(criteria)!r}"
    if not all(value is None or is_content(value) for value in criteria.values()):
        return "the descriptions in `criteria` must be strings, objects, lists or null"
    return None


def parse_question(name: str, question: object, labels: dict[str, list[str]],
                   noul_options: list[str]) -> Question:
    """One question of a request, or a ValueError naming it. `labels` and `noul_options` come from the model's
    decision config."""
    kind = question.get("type") if isinstance(question, dict) else None
    if kind not in QUESTION_TYPES:
        got = kind if isinstance(question, dict) else question
        raise ValueError(f"Question {name!r}: `type` must be one of {', '.join(QUESTION_TYPES)}, got {got!r}.")
    unknown = sorted(set(question) - {"type", "instructions", "criteria"})
    instructions, criteria = question.get("instructions"), question.get("criteria")
    problem = (f"unknown fields {unknown!r}" if unknown
               else "`instructions` must be a string, an object, a list or null"
               if not (instructions is None or is_content(instructions))
               else "`criteria` is required" if kind != "noul" and "criteria" not in question
               else _criteria_problem(kind, criteria))
    if problem:
        raise ValueError(f"Question {name!r}: {problem} (a {kind} question looks like {EXAMPLES[kind]})")
    if kind != "noul" and not criteria:
        raise ValueError(f"Question {name!r}: a {kind} question needs `criteria` with its options.")
    if kind == "noul":
        criteria = {option: (criteria or {}).get(option) for option in noul_options}
    elif kind == "score":
        criteria = {str(index): level for index, level in enumerate(criteria)}
    allowed = labels.get(kind) or (["Yes", "No"] if kind == "noul" else list(string.ascii_uppercase))
    if len(allowed) < len(criteria):
        raise ValueError(f"Question {name!r}: this model reads at most {len(allowed)} options for a {kind} "
                         f"question, got {len(criteria)} (`labels.{kind}` in its decision config).")
    return Question(name, kind, instructions, list(criteria), allowed[:len(criteria)], list(criteria.values()))


def parse_questions(questions: dict[str, object], labels: dict[str, list[str]],
                    noul_options: list[str]) -> list[Question]:
    """Every question, or one DecisionInvalid listing each invalid one."""
    parsed, problems = [], []
    for name, question in questions.items():
        try:
            parsed.append(parse_question(name, question, labels, noul_options))
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise DecisionInvalid([error(("questions",), "value_error", "\n".join(problems))])
    return parsed


def _check_map(body: dict, key: str, low: int, high: int, problems: list[dict]) -> None:
    """`body[key]` must be an object of `low` to `high` objects (FastAPI's messages)."""
    value = body[key]
    if not isinstance(value, dict):
        problems.append(error((key,), "dict_type", "Input should be a valid dictionary"))
        return
    if len(value) < low:
        problems.append(error((key,), "too_short", f"Dictionary should have at least {low} item after "
                                                   f"validation, not {len(value)}"))
    elif len(value) > high:
        problems.append(error((key,), "too_long", f"Dictionary should have at most {high} items after "
                                                  f"validation, not {len(value)}"))
    for name, item in value.items():
        if not isinstance(item, dict):
            problems.append(error((key, name), "dict_type", "Input should be a valid dictionary"))


def check_state(state: object, loc: tuple) -> list[dict]:
    if isinstance(state, (str, dict, list)):
        return []
    return [error(loc, "union_type", "Input should be a valid string, dictionary or list")]


def validate(body: dict, states_key: str, max_states: int | None = None) -> list[dict]:
    """The problems of a request's fields: `model`, the state(s) under `states_key` (`state`, or `states`: a list
    of 1 to `max_states`), `questions` (1 to 64) and `assets` (at most 4), and nothing else."""
    problems = [error((key,), "extra_forbidden", "Extra inputs are not permitted")
                for key in body if key not in ("model", states_key, "questions", "assets")]
    for key in ("model", states_key, "questions"):
        if key not in body:
            problems.append(error((key,), "missing", "Field required"))
    if "model" in body and not isinstance(body["model"], str):
        problems.append(error(("model",), "string_type", "Input should be a valid string"))
    if states_key in body and max_states is None:
        problems += check_state(body[states_key], (states_key,))
    elif states_key in body:
        states = body[states_key]
        if not isinstance(states, list) or not 1 <= len(states) <= max_states:
            problems.append(error((states_key,), "list_type", f"Input should be a list of 1 to {max_states} states"))
        else:
            for i, state in enumerate(states):
                problems += check_state(state, (states_key, i))
    if "questions" in body:
        _check_map(body, "questions", 1, MAX_QUESTIONS, problems)
    if "assets" in body:
        _check_map(body, "assets", 0, MAX_ASSETS, problems)
    return problems
