"""Custom resources checked against their real CRD schemas (vendored under k8s/schemas/ with their
source and release), as closed objects.

A CRD's ``openAPIV3Schema`` lists each object's properties but leaves ``additionalProperties``
open, so plain JSON-schema validation accepts a misspelled field, which the API server prunes or
refuses.  ``closed`` makes every object schema with properties closed, except where the CRD says
``x-kubernetes-preserve-unknown-fields`` (the API server keeps unknown fields there too)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

SCHEMAS = Path(__file__).resolve().parents[2] / "k8s" / "schemas"


def closed(schema: dict) -> dict:
    """A copy of ``schema`` whose object schemas refuse properties they do not list."""
    if not isinstance(schema, dict):
        return schema
    result = {key: value for key, value in schema.items()}
    for key in ("properties", "patternProperties"):
        if key in result:
            result[key] = {name: closed(child) for name, child in result[key].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(result.get(key), dict):
            result[key] = closed(result[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in result:
            result[key] = [closed(child) for child in result[key]]
    if ("properties" in result and "additionalProperties" not in result
            and not result.get("x-kubernetes-preserve-unknown-fields")):
        result["additionalProperties"] = False
    return result


def vendored(name: str) -> dict:
    """The vendored file ``name`` (its ``openAPIV3Schema`` and where it came from)."""
    return json.loads((SCHEMAS / name).read_text())


def validate_closed(instance, schema: dict) -> None:
    """Raise ``jsonschema.ValidationError`` for a field ``schema`` does not list, or a wrong value."""
    jsonschema.validate(instance, closed(schema), cls=jsonschema.Draft7Validator)
