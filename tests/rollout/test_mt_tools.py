"""Multi-turn tools: hermes parsing, schemas from signatures, the isolated tool pool (faults contained)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from vlrl.rollout.multi_turn.parsing import ToolCall, ToolCallError, parse_tool_call
from vlrl.rollout.multi_turn.tool_pool import ToolPool
from vlrl.user_code.loading import UserCodeError

TOOLS = str(Path(__file__).with_name("mt_tools.py"))
NAMES = ["add", "show", "secret", "boom", "hang", "slow", "crash", "bad_return"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', ToolCall("add", {"a": 1})),
        (
            'think <tool_call>\n{"name": "f", "arguments": "{\\"x\\": 2}"}\n</tool_call>',
            ToolCall("f", {"x": 2}),
        ),
        ('<tool_call>{"name": "f"}</tool_call>', ToolCall("f", {})),
        ("<tool_call>{name: f}</tool_call>", "not valid JSON"),
        ('<tool_call>["f"]</tool_call>', 'string "name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
        ("no call at all</tool_call>", "must be written as"),
    ],
)
def test_parse_tool_call(text, expected):
    got = parse_tool_call(text)
    if isinstance(expected, ToolCall):
        assert got == expected
    else:
        assert isinstance(got, ToolCallError) and expected in got.message


@pytest.fixture(scope="module")
def pool():
    with ToolPool([f"{TOOLS}:{n}" for n in NAMES], workers=3, timeout=2.0) as p:
        yield p


def test_schemas_from_signature_and_docstring(pool):
    add = pool.schemas[0]["function"]
    assert add["name"] == "add" and add["description"] == "Add two integers."
    assert add["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "the first number"},
            "b": {"type": "integer", "description": "the second number"},
        },
        "required": ["a"],
    }
    show = pool.schemas[1]["function"]["parameters"]
    assert list(show["properties"]) == ["colour"]  # keyword-only `size` is context, hidden
    assert pool.schemas[2]["function"]["parameters"]["properties"] == {}


def test_faults_are_contained_and_parallel(pool):
    start = time.monotonic()
    out = pool.call(
        [
            ("add", {"a": 1, "b": 2}, {}),
            ("hang", {}, {}),
            ("boom", {}, {}),
            ("show", {"colour": "red"}, {}),
            ("secret", {}, {"answer": "blue", "unused": 1}),
            ("crash", {}, {}),
            ("nope", {}, {}),
            ("add", {"c": 1}, {}),
            ("bad_return", {}, {}),
            ("slow", {"seconds": 1.0}, {}),
        ]
    )
    elapsed = time.monotonic() - start
    assert [o.text for o in out[:1]] == ["3"] and not out[0].error
    assert out[1].error and out[1].timed_out and "timed out after 2s" in out[1].text
    assert out[2].error and "boom raised ValueError: kaboom" in out[2].text
    assert out[3].text == "here is red" and out[3].images[0].size == (56, 56) and not out[3].error
    assert out[4].text == "blue"
    assert out[5].error and "exit code 3" in out[5].text
    assert out[6].error and "no tool named 'nope'" in out[6].text
    assert out[7].error and "has no argument(s) ['c']" in out[7].text
    assert out[8].error and "returned a dict" in out[8].text
    assert out[9].text == "slept" and not out[9].timed_out
    # the hang costs one timeout, the slow call runs next to it (3 workers in parallel)
    assert elapsed < 2.0 + 1.0 + 3.0, elapsed
    # the pool recovered: killed workers were replaced
    assert pool.call([("add", {"a": 5}, {})] * 4)[3].text == "5"


def test_submitted_calls_are_polled_as_they_finish(pool):
    """submit_calls returns at once; poll without blocking takes only what has finished, a blocking
    poll waits for the next result, and a blocking `call` made meanwhile leaves the others' results."""
    slow, fast, hang = pool.submit_calls(
        [("slow", {"seconds": 0.5}, {}), ("add", {"a": 2}, {}), ("hang", {}, {})]
    )
    start = time.monotonic()
    got = pool.poll({slow, fast, hang}, block=False)  # no wait: at most the fast one is back
    assert time.monotonic() - start < 0.3 and slow not in got and hang not in got
    assert pool.call([("add", {"a": 7}, {})])[0].text == "7"  # a blocking call in between
    while fast not in got or slow not in got:
        got |= pool.poll({slow, fast, hang} - got.keys(), block=True)
    assert got[fast].text == "2" and got[slow].text == "slept" and hang not in got
    assert time.monotonic() - start < 1.9  # before the hang's 2 s timeout
    timed_out = pool.poll({hang}, block=True)[hang]
    assert timed_out.timed_out and "hang timed out after 2s" in timed_out.text
    assert pool.poll({slow, fast, hang}, block=True) == {}  # all taken: returns, does not wait


def test_bad_tool_file_fails_at_start_up(tmp_path):
    bad = tmp_path / "t.py"
    bad.write_text("import no_such_module\n")
    with pytest.raises(UserCodeError, match="tool file .*t.py failed to import"):
        ToolPool([f"{bad}:f"], workers=1)
    with pytest.raises(UserCodeError, match="function 'missing' not found"):
        ToolPool([f"{TOOLS}:missing"], workers=1)
