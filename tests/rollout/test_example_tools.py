"""The shipped tools (examples/tools/): the calculator and the crop/zoom tool, on hand-computed cases
and malformed input, then each through its YAML in a real tool pool (schema checked against the
function, errors reaching the model as text)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from vlrl.rollout.multi_turn.tool_config import read_tool_config
from vlrl.rollout.multi_turn.tool_pool import ToolPool
from vlrl.user_code.loading import load_function

TOOLS = Path(__file__).resolve().parents[2] / "examples" / "tools"
calculate = load_function(f"{TOOLS / 'calculator.py'}:calculate", "tool")[0]
zoom_in = load_function(f"{TOOLS / 'zoom.py'}:zoom_in", "tool")[0]


@pytest.mark.parametrize(
    "expression, value",
    [
        ("(12 + 30) * 4 / 7", "24"),
        ("7 / 2", "3.5"),
        ("10 // 3", "3"),
        ("10 % 4", "2"),
        ("2 ** 10", "1024"),
        ("3^2", "9"),  # written as a power, not xor
        ("-3 + +5", "2"),
        ("0.1 + 0.2", "0.3"),  # 12 significant digits hide the binary rounding
        ("1 / 3", "0.333333333333"),
        ("sqrt(16) + abs(-2)", "6"),
        ("round(3.14159, 2)", "3.14"),
        ("max(3, 8, 5) - min(4, 1)", "7"),
        (" 48 * 2 - 6 ", "90"),
        ("2 ** -2", "0.25"),
    ],
)
def test_calculator_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("", "non-empty string"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1,000 + 5", "without thousands separators"),
        ("__import__('os').system('true')", "is not allowed"),
        ("x + 1", "'x' is not allowed"),
        ("'a' * 3", "is not allowed"),
        ("2 ** 1000", "exponents are limited to 64"),
        ("10 ** 40", "larger than 1e+30"),
        ("(-8) ** 0.5", "not a finite real number"),
        ("sqrt(-1)", "sqrt(): math domain error"),
        ("round(x=1)", "takes numbers only"),
        ("3 +", "cannot parse"),
        ("1" * 301, "longer than 300"),
    ],
)
def test_calculator_refuses_with_a_reason(expression, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        calculate(expression)


@pytest.fixture
def halves(tmp_path):
    """A 200x100 original: left half red, right half blue."""
    image = Image.new("RGB", (200, 100), "red")
    image.paste(Image.new("RGB", (100, 100), "blue"), (100, 0))
    path = tmp_path / "halves.png"
    image.save(path)
    return str(path)


def colours(image):
    return {c for _, c in image.getcolors(maxcolors=1 << 16)}


def test_zoom_maps_the_shown_frame_to_the_original(halves):
    # The model saw the image at 400x200: its right half is x 200..400 there, 100..200 in the original.
    text, crop = zoom_in([200, 0, 400, 200], image_path=halves, shown_size=[400, 200])
    assert text == "zoomed into [200, 0, 400, 200]"
    assert crop.size == (448, 448) and colours(crop) == {(0, 0, 255)}  # 100x100 blue, enlarged 4.48x
    text, crop = zoom_in([0, 0, 50, 100], image_path=halves)  # no shown_size: original pixels
    assert crop.size == (224, 448) and colours(crop) == {(255, 0, 0)}
    _, crop = zoom_in([0, 0, 200, 100], image_path=halves, upscale_to=100)  # never shrunk
    assert crop.size == (200, 100)


def test_zoom_clamps_and_grows_boxes(halves):
    text, crop = zoom_in([-50, -20, 60, 300], image_path=halves, upscale_to=0)
    assert text == "zoomed into [0, 0, 60, 100]" and crop.size == (60, 100)
    text, crop = zoom_in([10, 10, 12, 12], image_path=halves, upscale_to=0)  # grown to 28x28 around it
    assert text == "zoomed into [0, 0, 28, 28]" and crop.size == (28, 28)
    text, _ = zoom_in([190, 90, 199, 99], image_path=halves, upscale_to=0)  # grown, kept inside
    assert text == "zoomed into [172, 72, 200, 100]"
    _, crop = zoom_in([0, 50, 200, 51], image_path=halves, upscale_to=0)  # a line: grown to 28 high
    assert crop.size == (200, 28)


@pytest.mark.parametrize(
    "box, message",
    [
        ([1, 2, 3], "four numbers"),
        ("0 0 10 10", "four numbers"),
        ([0, 0, "10", 10], "numbers only"),
        ([0, 0, True, 10], "numbers only"),
        ([0, 0, float("nan"), 10], "numbers only"),
        ([50, 0, 10, 10], "is empty"),
        ([0, 5, 10, 5], "is empty"),
        ([300, 0, 400, 50], "outside the image along x"),
        ([0, -40, 10, -1], "outside the image along y"),
    ],
)
def test_zoom_refuses_bad_boxes(halves, box, message):
    with pytest.raises(ValueError, match=message):
        zoom_in(box, image_path=halves)


def test_zoom_refuses_a_bad_shown_size(halves):
    with pytest.raises(ValueError, match="shown_size must be"):
        zoom_in([0, 0, 10, 10], image_path=halves, shown_size=[0, 10])


def test_both_yaml_tools_in_a_pool(halves):
    entries = read_tool_config(str(TOOLS / "calculator.yaml")) + read_tool_config(str(TOOLS / "zoom.yaml"))
    context = {"image_path": halves, "shown_size": [400, 200]}
    with ToolPool(entries, workers=1) as pool:
        assert pool.names == ["calculate", "zoom_in"]
        out = pool.call(
            [
                ("calculate", {"expression": "(3 + 4) * 6"}, {}),
                ("calculate", {"expression": "7 / 0"}, {}),
                ("zoom_in", {"bbox_2d": [0, 0, 200, 200]}, context),
                ("zoom_in", {"bbox_2d": [0, 0, 1]}, context),
            ]
        )
    assert out[0].text == "42" and not out[0].error
    assert out[1].error and out[1].text == "error: calculate raised ValueError: division by zero"
    assert not out[2].error and colours(out[2].images[0]) == {(255, 0, 0)}
    assert out[3].error and "bbox_2d must be four numbers" in out[3].text
