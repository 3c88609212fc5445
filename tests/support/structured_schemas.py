"""JSON schemas of the kinds applications send with response_format, each with the request that asks for it.

Strings mostly carry a maxLength, as production schemas for extraction do, so that a 135M model at temperature 1
finishes within the tests' token budget; a few are left unbounded on purpose.
"""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 40}
AGE = {"type": "integer", "minimum": 0, "maximum": 130}


def obj(properties: dict, required: list[str] | None = None, closed: bool = True, **extra: object) -> dict:
    schema = {"type": "object", "properties": properties, "required": list(properties) if required is None
              else required, **extra}
    if closed:
        schema["additionalProperties"] = False
    return schema


SCHEMAS: list[tuple[str, dict]] = [
    ("a person", obj({"name": NAME, "age": AGE})),
    ("a city and its country", obj({"city": NAME, "country": NAME})),
    ("a yes/no verdict", obj({"answer": {"type": "boolean"}})),
    ("a sentiment label", obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}})),
    ("a rating from 1 to 5", obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("a probability", obj({"p": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("a temperature reading", obj({"celsius": {"type": "number", "minimum": -90, "maximum": 60},
                                   "unit": {"const": "C"}})),
    ("three tags", obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                 "minItems": 3, "maxItems": 3}})),
    ("one to four keywords", obj({"keywords": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                               "minItems": 1, "maxItems": 4}})),
    ("a list of small numbers", obj({"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}, "maxItems": 5}})),
    ("an address", obj({"street": SHORT, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("a nested user profile", obj({"user": obj({"name": NAME, "contact": obj({"email": SHORT})})})),
    ("an order with items", obj({"order_id": {"type": "integer", "minimum": 1}, "items": {
        "type": "array", "maxItems": 3, "items": obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                       "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}})),
    ("a color in hex", obj({"color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("a date", obj({"date": {"type": "string", "format": "date"}})),
    ("a timestamp", obj({"at": {"type": "string", "format": "date-time"}})),
    ("an email", obj({"email": {"type": "string", "format": "email"}})),
    ("a uuid", obj({"id": {"type": "string", "format": "uuid"}})),
    ("an optional nickname", obj({"name": NAME, "nickname": NAME}, required=["name"])),
    ("a shape", {"anyOf": [obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0,
                                                                         "maximum": 100}}),
                           obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0,
                                                                       "maximum": 100}})]}),
    ("an id that is a number or a string", obj({"id": {"anyOf": [{"type": "integer"}, {"type": "string",
                                                                                         "maxLength": 10}]}})),
    ("a nullable middle name", obj({"first": NAME, "middle": {"type": ["string", "null"], "maxLength": 12}})),
    ("a tree of two levels", {"$defs": {"leaf": obj({"label": NAME})},
                              **obj({"root": {"$ref": "#/$defs/leaf"},
                                     "children": {"type": "array", "items": {"$ref": "#/$defs/leaf"},
                                                  "maxItems": 2}})}),
    ("two points", {"$defs": {"point": obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                            "y": {"type": "integer", "minimum": -9, "maximum": 9}})},
                    **obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}})}),
    ("a priority task", obj({"title": SHORT, "priority": {"enum": ["low", "medium", "high"]},
                             "done": {"type": "boolean"}})),
    ("a list of tasks", {"type": "array", "items": obj({"title": SHORT, "done": {"type": "boolean"}}),
                         "minItems": 1, "maxItems": 2}),
    ("a bare string", {"type": "string", "maxLength": 30}),
    ("a bare integer", {"type": "integer", "minimum": 10, "maximum": 20}),
    ("a bare enum", {"enum": ["red", "green", "blue"]}),
    ("a price", obj({"amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                     "currency": {"enum": ["USD", "EUR", "JPY"]}})),
    ("a multiple of five", obj({"n": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}})),
    ("a free-form metadata object", obj({"title": SHORT}, closed=False, maxProperties=3)),
    ("any JSON object", {"type": "object", "maxProperties": 2}),
    ("a book", obj({"title": SHORT, "author": NAME, "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
                    "isbn": {"type": "string", "pattern": "^[0-9]{13}$"}})),
    ("an HTTP request", obj({"method": {"enum": ["GET", "POST", "PUT", "DELETE"]},
                             "path": {"type": "string", "pattern": "^/[a-z/]{0,20}$"},
                             "status": {"type": "integer", "minimum": 100, "maximum": 599}})),
    ("a classification with confidence", obj({"label": {"enum": ["spam", "ham"]},
                                              "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("entities in a sentence", obj({"entities": {"type": "array", "maxItems": 3, "items": obj(
        {"text": {"type": "string", "maxLength": 20}, "type": {"enum": ["PERSON", "PLACE", "ORG"]}})}})),
    ("a matrix of booleans", obj({"grid": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "boolean"}}}})),
    ("a username", obj({"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"}})),
    ("a phone number", obj({"phone": {"type": "string", "pattern": "^\\+[0-9]{8,12}$"}})),
    ("a version string", obj({"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$",
                                          "maxLength": 11}})),
    ("a summary", obj({"summary": {"type": "string"}})),
    ("a short poem title and lines", obj({"title": {"type": "string"}, "lines": {
        "type": "array", "items": {"type": "string"}, "maxItems": 2}})),
    ("a recipe", obj({"name": SHORT, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                      "ingredients": {"type": "array", "minItems": 1, "maxItems": 3, "items": obj(
                          {"item": NAME, "grams": {"type": "integer", "minimum": 1, "maximum": 1000}})}})),
    ("a boolean flag set", obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}})),
    ("a weekday", obj({"day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]}})),
]
