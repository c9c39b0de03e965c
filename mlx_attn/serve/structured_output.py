"""``response_format`` -> a constraint factory for the engine: JSON
(``json_object``) or JSON matching a schema (``json_schema``) by constrained
decoding (:mod:`mlx_attn.serve.constraints`); ``text`` or no field: none.
A bad field or a schema the grammar library rejects is a 400 naming
``response_format``."""

from __future__ import annotations

from collections.abc import Callable

from mlx_attn.serve.api_error import APIError
from mlx_attn.serve.constraints import JSON_OBJECT_SCHEMA, JSON_OPTIONS, Constraint, SchemaError, json_grammars
from mlx_attn.serve.tool_calls import ToolUse, forced_call_grammar, tool_call_format

__all__ = ["response_format_constraint", "schema_constraint", "tool_choice_constraint"]

FIELD = "response_format"
FORMAT_TYPES = ("text", "json_object", "json_schema")


def _grammars(state, field: str):
    try:
        grammars = json_grammars(state.tokenizer, state.engine.model.config.vocab_size)
    except ImportError:
        raise APIError(400, f"{field} needs llguidance on the server: pip install 'mlx_attn[serve]'", field) from None
    except (ValueError, RuntimeError) as error:  # llguidance cannot read this tokenizer
        raise APIError(400, f"{field}: this model's tokenizer cannot be constrained: {error}", field) from None
    return grammars


def schema_constraint(state, schema: dict, field: str) -> Callable[[], Constraint]:
    """A constraint factory for output matching ``schema`` (compiled now,
    cached); a 400 naming ``field`` when the grammar library rejects it.
    The seam for anything else that constrains output to a schema."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{field}: a JSON schema must be an object, got {type(schema).__name__}", field)
    grammars = _grammars(state, field)
    try:
        return grammars.factory(schema)
    except SchemaError as error:
        raise APIError(400, f"{field}: the JSON schema is not supported: {error}", field) from None


def response_format_constraint(state, body: dict) -> Callable[[], Constraint] | None:
    """The request's ``response_format`` as a constraint factory, or None."""
    form = body.get(FIELD)
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") not in FORMAT_TYPES:
        raise APIError(400, f"{FIELD} must be an object whose type is one of {', '.join(FORMAT_TYPES)}", FIELD)
    if form["type"] == "text":
        return None
    if form["type"] == "json_object":
        return schema_constraint(state, JSON_OBJECT_SCHEMA, FIELD)
    spec = form.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, f"{FIELD}.json_schema must be an object with the schema under 'schema'", FIELD)
    if not isinstance(spec.get("name", ""), str):
        raise APIError(400, f"{FIELD}.json_schema.name must be a string", FIELD)
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise APIError(400, f"{FIELD}.json_schema.strict must be a boolean", FIELD)
    if "schema" not in spec:
        raise APIError(400, f"{FIELD}.json_schema.schema is required (the JSON schema of the answer)", FIELD)
    return schema_constraint(state, spec["schema"], FIELD)


def tool_choice_constraint(state, tool_use: ToolUse | None) -> Callable[[], Constraint] | None:
    """A ``required`` or named ``tool_choice`` as a constraint factory: the
    model writes one call of an offered tool (the named one), its arguments
    matching the tool's schema (:func:`~mlx_attn.serve.tool_calls.forced_call_grammar`);
    None when nothing is forced or the model's format is not one a grammar
    spells. A tool schema llguidance rejects is a 400 naming ``tools``."""
    if tool_use is None or tool_use.forced is None:
        return None
    grammar = forced_call_grammar(tool_call_format(state.tokenizer), tool_use, JSON_OPTIONS)
    if grammar is None:
        return None
    grammars = _grammars(state, "tools")
    for index, tool in enumerate(tool_use.tools):  # each schema alone first: the error names its tool
        if tool_use.forced in ("", tool["function"]["name"]):
            try:
                grammars.grammar(tool["function"]["parameters"])
            except SchemaError as error:
                raise APIError(400, f"tools[{index}].function.parameters: the JSON schema is not supported: {error}",
                               "tools") from None
    try:
        return grammars.lark_factory(grammar)
    except SchemaError as error:
        raise APIError(400, f"tools: the tool call cannot be constrained: {error}", "tools") from None
