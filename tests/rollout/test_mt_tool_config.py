"""Tool schemas from a YAML file (`multi_turn.tool_config_path`): shape checks at config time, schema
against signature in the tool workers, every error naming the file and the tool."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vlrl.config import ConfigError, MultiTurnConfig
from vlrl.config.loader import load_config
from vlrl.rollout.multi_turn.tool_config import ToolConfigError, read_tool_config, tool_entries
from vlrl.rollout.multi_turn.tool_pool import ToolPool
from vlrl.user_code.loading import UserCodeError

TOOLS = Path(__file__).with_name("mt_tools.py")
ADD_SCHEMA = {
    "type": "function",
    "function": {
        "name": "plus",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "description": "second"}},
            "required": ["a", "b"],
        },
    },
}


def write(tmp_path: Path, tools: list, name: str = "tools.yaml") -> str:
    """A tool YAML in a sub-folder of tmp_path, with mt_tools.py copied beside it."""
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    (folder / "mt_tools.py").write_text(TOOLS.read_text())
    path = folder / name
    path.write_text(yaml.safe_dump({"tools": tools}))
    return str(path)


def with_schema(**changes) -> dict:
    schema = yaml.safe_load(yaml.safe_dump(ADD_SCHEMA))  # a deep copy
    schema["function"].update(changes)
    return schema


def test_yaml_tools_load_with_their_schemas_and_names(tmp_path):
    path = write(tmp_path, [{"callable": "mt_tools.py:add", "tool_schema": ADD_SCHEMA}])
    entries = read_tool_config(path)
    assert entries[0].callable == f"{tmp_path}/cfg/mt_tools.py:add"  # relative to the YAML's folder
    config = MultiTurnConfig(enable=True, tools=[f"{TOOLS}:show"], tool_config_path=path)
    with ToolPool(tool_entries(config), workers=1) as pool:
        assert pool.names == ["show", "plus"]
        assert pool.schemas[1] == ADD_SCHEMA  # shown to the model exactly as written
        out = pool.call([("plus", {"a": 2, "b": 5}, {}), ("add", {"a": 1}, {})])
    assert out[0].text == "7" and not out[0].error
    assert out[1].error and "no tool named 'add'" in out[1].text  # the model calls the YAML's name


@pytest.mark.parametrize(
    "tool, message",
    [
        ("not a mapping", r"tools\[0\] must be a mapping"),
        ({"callable": "mt_tools.py:add"}, r"tools\[0\] must have exactly the keys"),
        ({"callable": "mt_tools.py:add", "tool_schema": ADD_SCHEMA, "extra": 1}, r"exactly the keys"),
        ({"callable": "mt_tools.py:add", "tool_schema": {"function": {}}}, r"must be \{type: function"),
        ({"callable": "mt_tools.py:add", "tool_schema": with_schema(name="a b")}, r"name must be an identifier"),
        ({"callable": "mt_tools.py:add", "tool_schema": with_schema(description="")},
         r"tool 'plus'.*description must be a non-empty string"),
        ({"callable": "mt_tools.py:add", "tool_schema": with_schema(parameters={"type": "array"})},
         r"'plus'.*parameters must be \{type: object"),
        ({"callable": "mt_tools.py:add",
          "tool_schema": with_schema(parameters={"type": "object", "properties": {"a": {"type": "int"}}})},
         r"argument 'a' needs a `type:`"),
        ({"callable": "mt_tools.py:add",
          "tool_schema": with_schema(parameters={"type": "object", "properties": {}, "required": ["a"]})},
         r"required must list arguments of parameters.properties"),
        ({"callable": "mt_tools.py:add", "tool_schema": with_schema(examples=[])}, r"unknown key\(s\) \['examples'\]"),
        ({"callable": "mt_tools.py", "tool_schema": ADD_SCHEMA}, r"tool 'plus': `callable` must be"),
        ({"callable": "nope.py:add", "tool_schema": ADD_SCHEMA}, r"tool 'plus': callable file .*nope.py' does not exist"),
    ],
)  # fmt: skip
def test_bad_yaml_shape_fails_naming_file_and_tool(tmp_path, tool, message):
    path = write(tmp_path, [tool])
    with pytest.raises(ToolConfigError, match=message) as info:
        read_tool_config(path)
    assert path in str(info.value)


def test_bad_yaml_file(tmp_path):
    with pytest.raises(ToolConfigError, match="does not exist"):
        read_tool_config(str(tmp_path / "none.yaml"))
    (tmp_path / "bad.yaml").write_text("tools: [\n")
    with pytest.raises(ToolConfigError, match="bad.yaml: not valid YAML"):
        read_tool_config(str(tmp_path / "bad.yaml"))
    (tmp_path / "top.yaml").write_text("functions: []\n")
    with pytest.raises(ToolConfigError, match="one key, `tools:`"):
        read_tool_config(str(tmp_path / "top.yaml"))
    twice = write(tmp_path, [{"callable": "mt_tools.py:add", "tool_schema": ADD_SCHEMA}] * 2)
    with pytest.raises(ToolConfigError, match=r"\['plus'\] declared more than once"):
        read_tool_config(twice)


@pytest.mark.parametrize(
    "function, parameters, message",
    [
        # `b` is not a parameter of secret(*, answer)
        ("secret", {"type": "object", "properties": {"b": {"type": "string"}}, "required": []},
         r"\['b'\] are not parameters of the function"),
        # `answer` is keyword-only: per-row context, never the model's
        ("secret", {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
         r"\['answer'\] are keyword-only"),
        # add(a, b=0): `a` has no default, so the schema must require it
        ("add", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": []},
         r"needs \['a'\] \(no default\)"),
        ("missing", ADD_SCHEMA["function"]["parameters"], r"function 'missing' not found"),
    ],
)  # fmt: skip
def test_schema_must_fit_the_signature(tmp_path, function, parameters, message):
    path = write(
        tmp_path, [{"callable": f"mt_tools.py:{function}", "tool_schema": with_schema(parameters=parameters)}]
    )
    with pytest.raises(UserCodeError, match=message) as info:
        ToolPool(read_tool_config(path), workers=1)
    if function != "missing":
        assert path in str(info.value) and "tool 'plus'" in str(info.value)


def test_a_defaulted_parameter_may_stay_out_of_the_schema(tmp_path):
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    path = write(
        tmp_path, [{"callable": "mt_tools.py:add", "tool_schema": with_schema(parameters=parameters)}]
    )
    with ToolPool(read_tool_config(path), workers=1) as pool:
        assert pool.call([("plus", {"a": 4}, {})])[0].text == "4"


def test_config_checks_the_yaml_at_start_up(base, tmp_path):
    good = write(tmp_path, [{"callable": "mt_tools.py:add", "tool_schema": ADD_SCHEMA}])
    on = ["worker.rollout.multi_turn.enable=true"]
    config = load_config([*base, *on, f"worker.rollout.multi_turn.tool_config_path={good}"])
    assert config.worker.rollout.multi_turn.tool_config_path == good
    bad = write(
        tmp_path, [{"callable": "mt_tools.py:add", "tool_schema": with_schema(description=" ")}], "b.yaml"
    )
    with pytest.raises(ConfigError, match=r"b.yaml: tool 'plus'.*description"):
        load_config([*base, *on, f"worker.rollout.multi_turn.tool_config_path={bad}"])
    with pytest.raises(ConfigError, match=r"tool_config_path: file '/no/t.yaml' does not exist"):
        load_config([*base, *on, "worker.rollout.multi_turn.tool_config_path=/no/t.yaml"])
