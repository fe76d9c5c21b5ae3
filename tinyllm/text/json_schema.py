"""JSON schemas as the grammars take them: objects closed to keys they do not declare."""

# Keys whose value maps names to schemas (not a schema itself), and keys whose value is data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("const", "enum", "default", "examples", "required")
_OPENED_BY = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: object, in_all_of: bool = False) -> object:
    """The schema with every object that declares `properties` closed to others
    (`additionalProperties: false`) unless it says otherwise: OpenAI's strict mode and vLLM's
    default (xgrammar's strict mode). JSON Schema's own default lets any other key in, and a
    small model fills that room with keys it invents until max_tokens. The parts of an `allOf`
    stay open: each declares only some of the object's properties."""
    if isinstance(schema, list):
        return [closed_objects(s, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict = {}
    for key, value in schema.items():
        if key in _DATA:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(s) for name, s in value.items()}
        else:
            out[key] = closed_objects(value, in_all_of=key == "allOf")
    if "properties" in out and not in_all_of and not any(k in out for k in _OPENED_BY):
        out["additionalProperties"] = False
    return out
