"""A calculator tool for math tasks: evaluates one arithmetic expression safely.

The expression is parsed with `ast` and only numbers, + - * / // % **, unary signs, parentheses and
a few functions (abs, round, min, max, sqrt) are evaluated; nothing is passed to `eval`. A bad
expression raises `ValueError` with a short reason: the rollout turns it into the tool's answer
(`error: calculate raised ValueError: ...`), the model reads it and may try again, and it is
counted in `multi_turn/tool_errors`.

Declared with its schema in examples/tools/calculator.yaml.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

MAX_CHARS = 300  # longer expressions are refused
MAX_EXPONENT = 64  # bounds a ** b, so 9 ** 9 ** 9 cannot stall the worker
MAX_MAGNITUDE = 1e30  # results beyond this are refused (they are never a math-task answer)

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. (12 + 30) * 4 / 7
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("give the expression as a non-empty string, e.g. (12 + 30) * 4 / 7")
    if len(expression) > MAX_CHARS:
        raise ValueError(f"the expression is longer than {MAX_CHARS} characters")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    return format_number(_evaluate(tree.body))


def format_number(value: float) -> str:
    """Integers without a decimal point; other values to 12 significant digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer():
        return str(int(value))
    return f"{value:.12g}"


def _evaluate(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents are limited to {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        return _checked(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords or not node.args:
            raise ValueError(f"{node.func.id}() takes numbers only, e.g. {node.func.id}(2)")
        try:
            return _checked(_FUNCTIONS[node.func.id](*[_evaluate(arg) for arg in node.args]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{node.func.id}(): {exc}") from None
    if isinstance(node, ast.Tuple):
        raise ValueError("write numbers without thousands separators (1000, not 1,000); one expression only")
    allowed = "numbers, + - * / // % **, parentheses, " + ", ".join(_FUNCTIONS)
    raise ValueError(f"{ast.unparse(node)!r} is not allowed; use {allowed}")


def _checked(value: Any) -> Any:
    if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError("the result is not a finite real number")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"the result is larger than {MAX_MAGNITUDE:g}")
    return value
