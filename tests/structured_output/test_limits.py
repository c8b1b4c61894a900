"""What reaches the grammar compiler is bounded (structured_output/limits.py), and the
compile threads have the stack the bounds leave margin in."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.errors import InvalidRequestError
from pagedserve.request_limits import MAX_GRAMMAR_CHARS, MAX_GRAMMAR_RULES, MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES
from pagedserve.structured_output import COMPILE_THREAD_STACK_BYTES
from pagedserve.structured_output.limits import check_spec
from tests.hypothesis_budget import examples


def ref_chain(n: int, through_properties: bool = False) -> str:
    defs = {f"d{i}": ({"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} if through_properties
                      else {"$ref": f"#/$defs/d{i + 1}"}) for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


def refused(kind: str, spec: str, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words) as info:
        check_spec(kind, spec)
    assert info.value.param == "structured_outputs"


def test_ref_chains_past_the_depth_are_refused():
    check_spec("json", ref_chain(MAX_SCHEMA_DEPTH - 5))
    refused("json", ref_chain(3000), f"deeper than {MAX_SCHEMA_DEPTH}")
    refused("json", ref_chain(MAX_SCHEMA_DEPTH), "deeper")
    check_spec("json", ref_chain(30, through_properties=True))
    refused("json", ref_chain(3000, through_properties=True), "deeper")


def test_inline_nesting_counts_too():
    schema: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        schema = {"items": schema}
    refused("json", json.dumps(schema), "deeper")
    refused("json", "[" * 100_000 + "]" * 100_000, "deeper")  # past Python's own recursion limit


def test_recursive_schemas_and_shared_definitions_are_fine():
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    check_spec("json", json.dumps(tree))
    # 36 definitions, each referring to the next two: 2^36 paths, but each is walked once.
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 2}"}]} for i in range(36)}
    defs["d36"] = defs["d37"] = {"type": "null"}
    check_spec("json", json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}))


def test_node_count_and_size_are_bounded():
    refused("json", "[" + "{}, " * MAX_SCHEMA_NODES + "{}]", "subschemas")
    refused("regex", "a" * (MAX_GRAMMAR_CHARS + 1), "characters")


def test_grammar_rules_are_counted():
    chain = "\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(MAX_GRAMMAR_RULES)), 'r ::= "x"'])
    refused("grammar", chain, f"more than the {MAX_GRAMMAR_RULES}")
    check_spec("grammar", 'root ::= "a" | b\nb ::= [0-9]+\n')
    lark = "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(MAX_GRAMMAR_RULES)), 'r: "x"'])
    refused("grammar", lark, "rules")


@settings(max_examples=examples(60), deadline=None)
@given(st.recursive(st.none() | st.integers() | st.text(max_size=5),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
                        st.sampled_from(["$ref", "$defs", "items", "properties", "anyOf", "a", "type"]), kids,
                        max_size=4), max_leaves=60),
       st.sampled_from(["#", "#/$defs/a", "#/$defs", "#/properties/a", "#/items/0", "http://x", "#/~1"]))
def test_any_json_is_measured_without_crashing(doc, ref):
    """Whatever the document (refs anywhere, to anything, cycles included): a decision,
    never an exception other than the refusal."""
    if isinstance(doc, dict):
        doc = {**doc, "$ref": ref}
    try:
        check_spec("json", json.dumps(doc))
    except InvalidRequestError:
        pass


_DEEP_C_RECURSION = """
import json, sys, threading
sys.setrecursionlimit(10**7)
from pagedserve.structured_output import _large_stack_pool
nested = []
for _ in range(300_000):
    nested = [nested]
work = lambda: len(json.dumps(nested))  # the C encoder recurses, one native frame a level
if sys.argv[1] == "pool":
    pool = _large_stack_pool(1)
    print(pool.submit(work).result())
else:
    t = threading.Thread(target=work)
    t.start()
    t.join()
    print("survived")
"""


@pytest.mark.parametrize("where,ok", [("pool", True), ("default", False)])
def test_compile_threads_have_large_stacks(where, ok):
    """Native recursion 300,000 deep: fine on a compile thread, fatal on a default one
    (which is what llguidance did to the whole server)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _DEEP_C_RECURSION, where], capture_output=True, text=True,
                          timeout=120)
    if ok:
        assert proc.returncode == 0 and proc.stdout.strip() == str(600_002), proc.stderr[-500:]
    else:
        assert proc.returncode < 0, (proc.returncode, proc.stdout)  # killed by a signal (SIGSEGV)
    assert threading.stack_size() == 0 and COMPILE_THREAD_STACK_BYTES >= 256 << 20


def test_refs_resolve_as_a_compiler_would_so_no_chain_hides():
    """A dummy $defs in every definition must not make the walk resolve "#/$defs/..."
    against it (JSON Schema resolves "#" against the document); anchors are followed too."""
    n = 3000
    defs = {f"d{i}": {"$defs": {"x": {}}, "$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    refused("json", json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}), "deeper")
    anchored = {f"d{i}": {"$anchor": f"a{i}", "$ref": f"#a{i + 1}"} for i in range(n)}
    anchored[f"d{n}"] = {"$anchor": f"a{n}", "type": "integer"}
    refused("json", json.dumps({"$defs": anchored, "$ref": "#a0"}), "deeper")


def test_checks_take_linear_time_on_blank_lines():
    """A multi-line regex with a leading \\s* was quadratic on blank lines (40 KB: 15 s)."""
    import time

    from pagedserve.structured_output.limits import is_lark

    spec = " \n" * 60_000 + 'root ::= "x"\n'
    t0 = time.perf_counter()
    check_spec("grammar", spec)
    assert not is_lark(spec) and is_lark(" \n" * 60_000 + "start: x\n")
    assert time.perf_counter() - t0 < 1.0


def tool_tag(parameters: dict) -> str:
    """tool_choice "auto"'s structural tag for one tool (what serving_chat sends)."""
    from pagedserve.entrypoints.openai.tool_parsers import HermesToolParser

    return json.dumps(HermesToolParser().structural_tag([{"name": "f", "parameters": parameters}]))


def required_schema(parameters: dict) -> str:
    """tool_choice "required"'s schema for one tool: its parameters inside a larger document."""
    call = {"type": "object", "required": ["name", "parameters"],
            "properties": {"name": {"const": "f"}, "parameters": parameters}}
    return json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": [call]}})


def test_tool_schemas_are_measured_against_the_document_their_refs_point_into():
    """A tool's "#/$defs/..." point into its own parameters, not into the structural tag
    or the "required" array around them: resolved against those, a 200-long chain was
    not seen (auto: a 200 after 36 s of compiling; required: the compiler's "pointer
    does not exist" instead of the bound)."""
    chain, short = json.loads(ref_chain(200)), json.loads(ref_chain(20))
    refused("structural_tag", tool_tag(chain), f"deeper than {MAX_SCHEMA_DEPTH}")
    refused("json", required_schema(chain), f"deeper than {MAX_SCHEMA_DEPTH}")
    legacy = {"triggers": ["<f>"], "structures": [{"begin": "<f>", "schema": chain, "end": "</f>"}]}
    refused("structural_tag", json.dumps(legacy), "deeper")
    check_spec("structural_tag", tool_tag(short))
    check_spec("json", required_schema(short))
    # Each schema of a tag is its own document: the tag's own levels do not count against it.
    check_spec("structural_tag", tool_tag(json.loads(ref_chain(MAX_SCHEMA_DEPTH - 5))))


def test_a_schema_that_looks_like_a_tag_format_does_not_restart_the_count():
    """Only where the tag's format puts a schema does a new document start; inside a
    schema, {"type": "json_schema", "json_schema": ...} is just more schema."""
    schema: dict = {"type": "integer"}
    for i in range(3 * MAX_SCHEMA_DEPTH // 2):
        schema = {"type": "json_schema", "json_schema": schema} if i % 40 == 39 else {"items": schema}
    refused("structural_tag", tool_tag(schema), "deeper")


def test_a_deep_tool_schema_is_refused_within_two_seconds_by_the_compile_path():
    import time

    from pagedserve.sampling_params import StructuredOutputsParams
    from pagedserve.structured_output import StructuredOutputManager
    from tests.engine.helpers import make_tokenizer

    tok = make_tokenizer()
    mgr = StructuredOutputManager(tok, len(tok), [2], max_num_seqs=1, backend="guidance")
    try:
        mgr.compile(StructuredOutputsParams(json={"type": "integer"})).result()  # the backend, made once
        t0 = time.perf_counter()
        tag = json.loads(tool_tag(json.loads(ref_chain(200))))
        with pytest.raises(InvalidRequestError, match="deeper"):
            mgr.compile(StructuredOutputsParams(structural_tag=tag)).result()
        assert time.perf_counter() - t0 < 2.0
    finally:
        mgr.shutdown()


def test_property_counts_need_a_closed_object():
    """Both grammar libraries let a key past the listed ones repeat: {"a": 0, ",": 0, ",": 0}
    met minProperties 3 and parsed to 2 properties."""
    for schema in ({"type": "object", "minProperties": 3, "additionalProperties": {"type": "integer"}},
                   {"type": "object", "maxProperties": 1},
                   {"properties": {"a": {}}, "patternProperties": {"^x": {}}, "minProperties": 1},
                   {"properties": {"a": {}}, "patternProperties": {"^x": {}}, "additionalProperties": False,
                    "minProperties": 3}):  # (patternProperties' keys repeat too)
        with pytest.raises(InvalidRequestError, match="minProperties/maxProperties need a closed object"):
            check_spec("json", json.dumps({"type": "object", "properties": {"inner": schema}}))
    check_spec("json", json.dumps({"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1}))
    check_spec("json", json.dumps({"type": "object", "additionalProperties": False, "maxProperties": 0}))
    # (schema positions only: a property named maxProperties, a default's object, are data)
    check_spec("json", json.dumps({"type": "object", "properties": {"maxProperties": {"type": "integer"}},
                                   "additionalProperties": False}))
    check_spec("json", json.dumps({"type": "object", "properties": {"a": {"default": {"minProperties": 1}}}}))
