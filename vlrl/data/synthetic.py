"""Synthetic image-question datasets drawn with PIL: coloured shapes on a plain background.

Deterministic for a seed; small enough for a CPU quickstart. Each row of train.jsonl/val.jsonl:
    {"problem": "<image>What colour is the shape?", "answer": "red", "images": ["images/train_00000.png"]}
Answers are one lowercase word (a colour, a shape name, or a count as a digit).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (235, 200, 20)}
SHAPES = ("circle", "square", "triangle")
TASKS = ("colour", "shape", "count", "mixed")
BACKGROUND = (245, 245, 245)
QUESTIONS = {
    "colour": "<image>What colour is the shape?",
    "shape": "<image>What shape is in the image?",
    "count": "<image>How many shapes are in the image?",
}


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill: tuple) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def draw_shapes(
    rng: random.Random, size: int, count: int, colour: str | None = None
) -> tuple[Image.Image, list]:
    """An image with `count` non-overlapping shapes (cells of a grid); returns (image, [(shape, colour)])."""
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    cells = 2 if count > 1 else 1  # one shape: the whole canvas; several: a 2x2 grid
    cell = size // cells
    drawn = []
    for slot in rng.sample(range(cells * cells), count):
        shape = rng.choice(SHAPES)
        name = colour or rng.choice(sorted(COLOURS))
        side = rng.randint(cell // 2, cell - 4)
        x = (slot % cells) * cell + rng.randint(2, cell - side - 2)
        y = (slot // cells) * cell + rng.randint(2, cell - side - 2)
        _draw_shape(draw, shape, (x, y, x + side, y + side), COLOURS[name])
        drawn.append((shape, name))
    return image, drawn


def _shapes_row(rng: random.Random, task: str, size: int) -> tuple[Image.Image, str, str]:
    """(image, question, answer) for one row of `task`."""
    if task == "mixed":
        task = rng.choice(TASKS[:3])
    if task == "count":
        count = rng.randint(1, 4)
        image, _ = draw_shapes(rng, size, count)
        return image, QUESTIONS["count"], str(count)
    image, drawn = draw_shapes(rng, size, 1)
    shape, colour = drawn[0]
    return image, QUESTIONS[task], colour if task == "colour" else shape


def write_split(out: Path, split: str, rows: list[tuple[list[Image.Image], str, str, dict]]) -> Path:
    (out / "images").mkdir(parents=True, exist_ok=True)
    path = out / f"{split}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, (images, problem, answer, extra) in enumerate(rows):
            names = []
            for k, image in enumerate(images):
                name = f"images/{split}_{i:05d}" + (f"_{k}" if len(images) > 1 else "") + ".png"
                image.save(out / name)
                names.append(name)
            record: dict[str, Any] = {"problem": problem, "answer": answer, "images": names, **extra}
            f.write(json.dumps(record) + "\n")
    return path


def make_shapes_dataset(
    out_dir: str | Path,
    n_train: int = 512,
    n_val: int = 64,
    seed: int = 0,
    task: str = "colour",
    image_size: int = 56,
) -> tuple[Path, Path]:
    """Write train.jsonl / val.jsonl and their PNGs to `out_dir`; returns (train_path, val_path)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    if image_size < 16:
        raise ValueError("image_size must be at least 16 pixels")
    out = Path(out_dir)
    paths = []
    for split, n, split_seed in (("train", n_train, seed), ("val", n_val, seed + 1_000_003)):
        rng = random.Random(split_seed)
        rows = []
        for _ in range(n):
            image, question, answer = _shapes_row(rng, task, image_size)
            rows.append(([image], question, answer, {"task": task}))
        paths.append(write_split(out, split, rows))
    return paths[0], paths[1]


def make_multi_image_dataset(
    out_dir: str | Path, n_train: int = 256, n_val: int = 32, seed: int = 0, image_size: int = 56
) -> tuple[Path, Path]:
    """Two images per prompt, exactly one of them red: "Which image is red, first or second?"."""
    out = Path(out_dir)
    others = sorted(c for c in COLOURS if c != "red")
    paths = []
    for split, n, split_seed in (("train", n_train, seed), ("val", n_val, seed + 1_000_003)):
        rng = random.Random(split_seed)
        rows = []
        for _ in range(n):
            red_first = rng.random() < 0.5
            colours = ["red", rng.choice(others)] if red_first else [rng.choice(others), "red"]
            images = [draw_shapes(rng, image_size, 1, colour)[0] for colour in colours]
            problem = "<image><image>Which image is red, first or second?"
            rows.append((images, problem, "first" if red_first else "second", {"task": "multi_image"}))
        paths.append(write_split(out, split, rows))
    return paths[0], paths[1]


DIRECTIONS = ("left", "right")
VIDEO_QUESTION = "<video>Which way does the square move, left or right?"


def moving_square_frames(
    rng: random.Random, direction: str, frames: int = 4, size: int = 56
) -> list[Image.Image]:
    """`frames` images of one coloured square crossing the canvas towards `direction`."""
    colour = COLOURS[rng.choice(sorted(COLOURS))]
    side = size // 4
    y = rng.randint(2, size - side - 2)
    xs = [round(2 + k * (size - side - 4) / (frames - 1)) for k in range(frames)]
    if direction == "left":
        xs.reverse()
    out = []
    for x in xs:
        image = Image.new("RGB", (size, size), BACKGROUND)
        ImageDraw.Draw(image).rectangle((x, y, x + side, y + side), fill=colour)
        out.append(image)
    return out


def _write_mp4(path: Path, frames: list[Image.Image], fps: int) -> None:
    import av
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame), format="rgb24")))
        container.mux(stream.encode())


def make_moving_square_dataset(
    out_dir: str | Path,
    n_train: int = 256,
    n_val: int = 32,
    seed: int = 0,
    frames: int = 4,
    image_size: int = 56,
    fps: int = 2,
    as_frames: bool = False,
) -> tuple[Path, Path]:
    """A video task: a square moves left or right; answer `left` or `right`.

    Each video is an MPEG-4 file of `frames` frames at `fps` (`videos/{split}_{i}.mp4`), or with
    `as_frames` a list of PNG frames (`videos/{split}_{i}_{k}.png`). Rows:
    {"problem": "<video>Which way ...?", "answer": "left", "videos": ["videos/train_00000.mp4"]}"""
    if frames < 2:
        raise ValueError("a moving square needs at least 2 frames")
    out = Path(out_dir)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n, split_seed in (("train", n_train, seed), ("val", n_val, seed + 1_000_003)):
        rng = random.Random(split_seed)
        path = out / f"{split}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for i in range(n):
                direction = rng.choice(DIRECTIONS)
                clip = moving_square_frames(rng, direction, frames, image_size)
                stem = f"videos/{split}_{i:05d}"
                if as_frames:
                    for k, frame in enumerate(clip):
                        frame.save(out / f"{stem}_{k}.png")
                    video: Any = [f"{stem}_{k}.png" for k in range(frames)]
                else:
                    _write_mp4(out / f"{stem}.mp4", clip, fps)
                    video = f"{stem}.mp4"
                record = {"problem": VIDEO_QUESTION, "answer": direction, "videos": [video], "task": "video"}
                f.write(json.dumps(record) + "\n")
        paths.append(path)
    return paths[0], paths[1]
