"""The two grammar backends accept and refuse the same texts: JSON with closed objects,
and the tool-call structural tags the parsers build (a trigger written as text, or as
the one added token the tokenizer has for it)."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.openai.tool_parsers import HermesToolParser
from pagedserve.sampling_params import StructuredOutputsParams as S
from pagedserve.structured_output import StructuredOutputManager
from pagedserve.structured_output.backend_guidance import _closed_objects
from tests.engine.helpers import make_tokenizer

EOS = 2
TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                                "required": ["city"]}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def tokenizer(with_tool_tokens: bool):
    tok = make_tokenizer()
    if with_tool_tokens:
        tok.add_tokens(["<tool_call>", "</tool_call>"])
    return tok


def accepts(tok, backend: str, params: S, text: str) -> bool:
    """Whether `text` (then EOS) is a complete output under `params`."""
    mgr = StructuredOutputManager(tok, len(tok), [EOS], max_num_seqs=1, backend=backend)
    request = mgr.request(params)
    mgr.compile(params).result()
    assert request.is_ready() and request.error is None
    ok = all(request.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
    ok = ok and request.accept_token(EOS) and request.is_terminated()
    mgr.shutdown()
    return ok


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
@pytest.mark.parametrize("tool_tokens", [False, True], ids=["text-trigger", "token-trigger"])
def test_tool_call_structural_tags(backend, tool_tokens):
    tok = tokenizer(tool_tokens)
    auto = S(structural_tag=HermesToolParser().structural_tag(TOOLS))
    one = S(structural_tag=HermesToolParser().structural_tag(TOOLS, one_call=True))
    assert accepts(tok, backend, auto, "Just text, no call.")
    assert accepts(tok, backend, auto, "Let me look. " + CALL)
    assert accepts(tok, backend, auto, CALL + "\n" + CALL.replace("Rome", "Paris"))
    assert not accepts(tok, backend, auto, CALL.replace("Rome", "Oslo"))  # not in the enum
    assert not accepts(tok, backend, auto, CALL.replace("get_weather", "get_time"))  # no such tool
    assert not accepts(tok, backend, auto, CALL.replace('"Rome"}', '"Rome", "evil": 1}'))  # a key not declared
    assert not accepts(tok, backend, one, CALL.replace('"Rome"}', '"Rome", "evil": 1}'))
    assert accepts(tok, backend, one, CALL)
    assert not accepts(tok, backend, one, CALL + " and more")  # nothing after the one call


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_a_tools_refs_point_into_its_own_parameters(backend):
    """In a structural tag each tool's schema is a document of its own (what the depth
    check in limits.py assumes): its "#/$defs/..." resolve inside it."""
    tok = tokenizer(False)
    city = {"$defs": {"city": {"enum": ["Paris", "Rome"]}}, "type": "object",
            "properties": {"city": {"$ref": "#/$defs/city"}}, "required": ["city"]}
    tag = S(structural_tag=HermesToolParser().structural_tag([{"name": "get_weather", "parameters": city}]))
    assert accepts(tok, backend, tag, CALL)
    assert not accepts(tok, backend, tag, CALL.replace("Rome", "Oslo"))


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_json_objects_are_closed_unless_the_schema_opens_them(backend):
    tok = tokenizer(False)
    closed = S(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    opened = S(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                     "additionalProperties": {"type": "integer"}})
    assert accepts(tok, backend, closed, '{"a": 1}')
    assert not accepts(tok, backend, closed, '{"a": 1, "b": 2}')
    assert accepts(tok, backend, opened, '{"a": 1, "b": 2}')


def test_closing_objects_walks_subschemas_only():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                                               "items": {"type": "array", "items": {"properties": {}}}},
              "$defs": {"d": {"properties": {}}}, "anyOf": [{"properties": {}}]}
    out = _closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False  # a property named "properties"
    assert "additionalProperties" not in out["properties"]  # the name -> schema map itself is not a schema
    assert out["properties"]["items"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False and out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is left alone


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"anyOf": [{"$ref": "#"}]},
                                    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
                                    {"type": "object", "properties": {"n": {"$ref": "#"}, "m": {"$ref": "#/$defs/a"}},
                                     "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}])
def test_a_schema_that_admits_no_value_is_refused(backend, schema) -> None:
    """Its grammar compiled, and the output was an empty text (no JSON value), finished as
    "stop"; a property whose $refs only loop compiled, and an output that wrote its key
    failed mid-answer (the grammar had nothing it could accept next)."""
    import json

    from pagedserve.errors import InvalidRequestError

    tok = tokenizer(False)
    mgr = StructuredOutputManager(tok, len(tok), [EOS], max_num_seqs=1, backend=backend)
    with pytest.raises(InvalidRequestError, match=r"admits no value|Circular \$ref"):  # (xgrammar: its own words)
        mgr.compile(S(json=json.dumps(schema))).result()
    mgr.compile(S(json=json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}}))).result()
    # a loop in a $defs entry nothing uses leaves the answer's grammar whole (both libraries take it)
    mgr.compile(S(json=json.dumps({"type": "string", "$defs": {"unused": {"$ref": "#/$defs/unused"}}}))).result()
    mgr.shutdown()


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
@pytest.mark.parametrize("params", [S(regex="[^\\s\\S]"), S(grammar='root ::= a\na ::= a "x"'), S(regex="")],
                         ids=["empty-class", "no-base-case", "empty-regex"])
def test_a_regex_or_grammar_that_admits_no_text_is_refused_at_compile(backend, params) -> None:
    """As a schema that admits no value: it was refused only after the first step, in the
    guidance library's words ("refused a token its own mask allowed")."""
    from pagedserve.errors import InvalidRequestError

    mgr = StructuredOutputManager(tokenizer(False), len(tokenizer(False)), [EOS], max_num_seqs=1, backend=backend)
    with pytest.raises(InvalidRequestError, match="admits no text"):
        mgr.compile(params).result()
    mgr.shutdown()


# What xgrammar 0.2 compiled as if absent (each answer broke its own schema) or compiled
# in time growing with the square of a count: refused by name under that backend.
XGRAMMAR_REFUSED = [
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, "contains"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 3}}, "'if'"),
    ({"type": "object", "properties": {"a": {"not": {"const": 1}}}}, r"schema.properties.a: .*'not'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["zz"]}, "required property 'zz'"),
    ({"type": "string", "format": "hostname", "maxLength": 20}, "minLength/maxLength beside a format"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "beside a pattern"),
    ({"type": "string", "format": "zzz-unknown"}, "does not enforce format 'zzz-unknown'"),
    ({"type": "string", "pattern": "^(?!a)[a-c]{2}$"}, "look-around"),
    ({"type": "string", "pattern": "^[a-z]{1,20000}$"}, "come to 20000"),
    # (nested counts multiply: each token's mask took longer, the 6th 50 s on the engine thread)
    ({"type": "string", "pattern": "(.{0,1000}){0,300}"}, "come to 300000"),
    ({"type": "object", "patternProperties": {"^(a{0,100}){0,100}$": {}}}, r"patternProperties.*come to 10000"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "additionalItems": {"type": "number", "multipleOf": 3}},
     r"additionalItems: .*multipleOf"),
    ({"$ref": "http://example.com/s.json"}, "the xgrammar backend takes '#'"),
    # (each compiled, and was not enforced: oneOf as anyOf, a $ref into a place the check skips,
    # an enum beside a $ref, a required name of an open object)
    ({"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}] * 2}, "oneOf"),
    ({"type": "object", "properties": {"a": {"$ref": "#/x-extra/s"}}, "x-extra": {"s": {"type": "integer",
                                                                                      "multipleOf": 1000}}}, "'#/x-extra/s'"),
    ({"$defs": {"s": {"type": "string"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/s", "enum": ["z"]}}},
     "drops 'enum' beside a \\$ref"),
    ({"type": "object", "required": ["a"], "additionalProperties": {"type": "integer"}}, "required property 'a'"),
    ({"type": "object", "required": ["a"]}, "list it in properties"),
    ({"type": "array", "prefixItems": [{"anyOf": [{"type": "integer", "multipleOf": 2}]}]},
     r"prefixItems\[0\].anyOf\[0\]: .*multipleOf"),
]


@pytest.mark.parametrize(("schema", "match"), XGRAMMAR_REFUSED)
def test_xgrammar_refuses_what_it_would_not_enforce(schema, match) -> None:
    import json

    from pagedserve.errors import InvalidRequestError

    tok = tokenizer(False)
    mgr = StructuredOutputManager(tok, len(tok), [EOS], max_num_seqs=1, backend="xgrammar")
    with pytest.raises(InvalidRequestError, match=match):
        mgr.compile(S(json=json.dumps(schema))).result()
    tag = S(structural_tag=HermesToolParser().structural_tag([{"name": "f", "parameters": {
        "type": "object", "properties": {"x": schema}}}]))
    with pytest.raises(InvalidRequestError, match="a tool's parameters"):  # (a tool's schema too, under "auto")
        mgr.compile(tag).result()
    # what it enforces still compiles: formats it knows, bounds alone, closed objects that list what they require
    for fine in ({"type": "string", "format": "date"}, {"type": "string", "maxLength": 5},
                 {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                 {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
                 {"type": "object", "properties": {"not": {"type": "integer"}, "allOf": {"type": "string"}}},
                 {"$defs": {"s": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/s", "description": "d"}}},
                 # a discriminated union (pydantic's): its branches exclude each other, as oneOf asks
                 {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                            {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}],
                  "discriminator": {"propertyName": "k"}}):
        mgr.compile(S(json=json.dumps(fine))).result()
    mgr.shutdown()


def test_nested_counts_multiply_and_a_regex_request_is_bounded_too() -> None:
    from pagedserve.errors import InvalidRequestError
    from pagedserve.structured_output.backend_xgrammar import repetition_product

    assert repetition_product("(.{0,1000}){0,300}") == 300_000
    assert repetition_product(r"(\d{1,3}\.){3}\d{1,3}") == 9 and repetition_product("(a{2}|b{7}){3}") == 21
    assert repetition_product("[{]{5}") == 5 and repetition_product(r"\{1000\}") == 1  # (classes, escapes)
    assert repetition_product("[]{9}]x") == 1 and repetition_product("a{3,}") == 3
    tok = tokenizer(False)
    mgr = StructuredOutputManager(tok, len(tok), [EOS], max_num_seqs=1, backend="xgrammar")
    with pytest.raises(InvalidRequestError, match="come to 125000"):
        mgr.compile(S(regex="((a{1,50}){1,50}){1,50}")).result()
    tag = {"type": "structural_tag", "format": {"type": "qwen_xml_parameter", "json_schema": {
        "type": "object", "properties": {"a": {"type": "integer", "multipleOf": 7}}, "required": ["a"]}}}
    with pytest.raises(InvalidRequestError, match="multipleOf"):  # (this format's schema was not walked)
        mgr.compile(S(structural_tag=tag)).result()
    with pytest.raises(InvalidRequestError, match="come to 300000"):  # (a GBNF grammar's ranges too)
        mgr.compile(S(grammar='root ::= ("a"{0,1000}){0,300}')).result()
    assert repetition_product('root ::= "{5000}" "x"{3}', quoted=True) == 3  # (a quoted brace is text)
    # (a comment is stepped over: an apostrophe in one hid the rest of the grammar)
    assert repetition_product('# don\'t\nroot ::= ("a"{0,1000}){0,1000}', quoted=True) == 1_000_000
    assert repetition_product('root ::= "x"{3} # {9999}\n', quoted=True) == 3
    mgr.compile(S(regex=r"(\d{1,3}\.){3}\d{1,3}")).result()
    mgr.compile(S(grammar='root ::= "{" [0-9]{1,3} "}"')).result()
    # a count over a rule multiplies the rule's own (read alone, each passed, and the engine stalled)
    with pytest.raises(InvalidRequestError, match="come to 300000"):
        mgr.compile(S(grammar='root ::= x{0,300}\nx ::= [^\\n]{0,1000}\n')).result()
    mgr.compile(S(grammar='root ::= x{0,3}\nx ::= "a" x | "b"{2}\n')).result()  # (recursion is no count)
    chain = "\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(600)) + '\nr600 ::= "b"\n'
    mgr.compile(S(grammar="root ::= r0\n" + chain)).result()  # (600 rules deep: a RecursionError's 400)
    mgr.shutdown()


def test_a_lark_grammar_under_xgrammar_names_the_backend_that_reads_it() -> None:
    from pagedserve.errors import InvalidRequestError

    tok = tokenizer(False)
    mgr = StructuredOutputManager(tok, len(tok), [EOS], max_num_seqs=1, backend="xgrammar")
    with pytest.raises(InvalidRequestError, match="Lark grammar needs --structured-outputs-backend guidance"):
        mgr.compile(S(grammar='start: "x" NUM\nNUM: /[0-9]{1,3}/')).result()  # (was "EBNF lexer error ... ':'")
    with pytest.raises(InvalidRequestError, match="schema `false` admits no value"):
        S(json=False).validate()  # (was "needs exactly one of json, ...: got none")
    mgr.shutdown()


def test_a_guidance_matcher_whose_lexer_failed_while_masking_refuses_even_the_stop_token() -> None:
    """Copies of a compiled grammar share its lexer: once one ran out of fuel, the next
    copy's mask allowed only the stop token and accepted it (an empty answer finished as
    "stop"); it refuses it, with the library's reason."""
    import torch

    from pagedserve.model_loader.sources import resolve_source
    from pagedserve.model_loader.tokenizer import saved_tokenizer
    from pagedserve.structured_output.backend_guidance import GuidanceBackend

    tok = saved_tokenizer(resolve_source("smollm2-135m-instruct", "auto").path)
    backend = GuidanceBackend(tok, 49152, [2])
    grammar = backend.compile("grammar", 'root ::= a{1000}\na ::= b{1000}\nb ::= "K"{1000}')
    mask = torch.zeros((1, 49152 // 32), dtype=torch.int32)
    first, second = backend.new_matcher(grammar), backend.new_matcher(grammar)
    backend.fill_bitmask(mask, [(first, 0)])
    assert not first.accept_token(tok.encode("K", add_special_tokens=False)[0])
    backend.fill_bitmask(mask, [(second, 0)])
    assert not second.accept_token(2) and not second.is_terminated()
    assert "too many expressions" in second.refusal()


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
@pytest.mark.parametrize("tool_tokens", [False, True], ids=["text-trigger", "token-trigger"])
def test_an_answer_in_the_schema_or_calls(backend, tool_tokens):
    """tool_choice "auto" beside a response format (serving_chat builds this tag): the
    answer is the schema's JSON, or calls from its first token (xgrammar's at_least_one);
    never free text alone."""
    tok = tokenizer(tool_tokens)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    tag = S(**HermesToolParser().answer_or_calls(TOOLS, schema))
    assert accepts(tok, backend, tag, '{"answer": "yes"}')
    assert accepts(tok, backend, tag, CALL)
    assert accepts(tok, backend, tag, CALL + "\n" + CALL.replace("Rome", "Paris"))
    assert not accepts(tok, backend, tag, "Let me look. " + CALL)
    assert not accepts(tok, backend, tag, "Just text, no call.")
    assert not accepts(tok, backend, tag, '{"answer": "maybe"}')
    assert not accepts(tok, backend, tag, CALL.replace("Rome", "Oslo"))


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_llama3_json_answers_in_the_schema_or_one_call(backend):
    from pagedserve.entrypoints.openai.tool_parsers import Llama3JsonToolParser, PythonicToolParser

    tok = tokenizer(False)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    either = S(**Llama3JsonToolParser().answer_or_calls(TOOLS, schema))
    assert accepts(tok, backend, either, '{"answer": "no"}')
    assert accepts(tok, backend, either, '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert not accepts(tok, backend, either, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert not accepts(tok, backend, either, "Plain text.")
    assert PythonicToolParser().answer_or_calls(TOOLS, schema) is None  # (refused by name by the chat handler)


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_a_choice_past_the_basic_plane_is_the_choice(backend) -> None:
    """xgrammar compiled an emoji's JSON escape (a surrogate pair) as six bytes of garbage."""
    tok = tokenizer(False)
    assert accepts(tok, backend, S(choice=["😀", "é"]), "😀") and not accepts(tok, backend, S(choice=["😀"]), "é")


def test_guidances_refusal_of_one_of_gives_no_advice_the_client_cannot_follow() -> None:
    """llguidance said to "Enable 'coerce_one_of' option", which no request field sets."""
    import json

    from pagedserve.errors import InvalidRequestError

    tok = tokenizer(False)
    mgr = StructuredOutputManager(tok, len(tok), [EOS], max_num_seqs=1, backend="guidance")
    try:
        with pytest.raises(InvalidRequestError, match=r"oneOf .*not supported \(anyOf is") as refused:
            mgr.compile(S(json=json.dumps({"oneOf": [{"type": "integer"}, {"type": "number"}]}))).result()
        assert "coerce_one_of" not in str(refused.value)
    finally:
        mgr.shutdown()
