"""Cost of the start-up image check (vlrl.data.image_check): images/s decoded, by thread count,
and with a warm cache (a restart with unchanged files).

    python benchmarks/bench_image_check.py [--small 512] [--large 32]

Writes noisy 112x112 PNGs and 1000x1000 JPEGs to a temporary folder and prints a table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
from PIL import Image

from vlrl.data.image_check import ImageChecker


def _write_images(folder: str, count: int, size: int, ext: str, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        # smooth gradient plus noise: compresses like a photo, not like a flat colour
        base = np.linspace(0, 255, size, dtype=np.float32)[None, :, None] * np.ones((size, 1, 3), np.float32)
        pixels = np.clip(base + rng.normal(0, 20, (size, size, 3)), 0, 255).astype(np.uint8)
        path = os.path.join(folder, f"{ext}_{i}.{ext}")
        Image.fromarray(pixels).save(path, quality=90) if ext == "jpg" else Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def _time_check(paths: list[str], cache: str, threads: int) -> tuple[float, int, int]:
    """(seconds, decoded, cached) for one start-up check of `paths` (one row per image)."""
    rows = [(i, [p]) for i, p in enumerate(paths)]
    start = time.perf_counter()
    with ImageChecker("bench", cache, threads=threads) as checker:
        problems = checker.check(rows, "/")
    assert not problems
    return time.perf_counter() - start, checker.num_decoded, checker.num_cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=512, help="112x112 PNGs")
    parser.add_argument("--large", type=int, default=32, help="1000x1000 JPEGs")
    args = parser.parse_args()
    print(f"cpu cores: {os.cpu_count()}")
    print(f"{'images':<26}{'threads':>8}{'cache':>7}{'seconds':>9}{'images/s':>10}")
    with tempfile.TemporaryDirectory() as folder:
        sets = {
            f"{args.small} x 112x112 PNG": _write_images(folder, args.small, 112, "png", 0),
            f"{args.large} x 1000x1000 JPEG": _write_images(folder, args.large, 1000, "jpg", 1),
        }
        for name, paths in sets.items():
            for threads in (1, 2, 4):
                cache = tempfile.mkdtemp(dir=folder)
                seconds, decoded, _ = _time_check(paths, cache, threads)
                print(f"{name:<26}{threads:>8}{'cold':>7}{seconds:>9.3f}{decoded / seconds:>10.0f}")
            seconds, _, cached = _time_check(paths, cache, 2)
            print(f"{name:<26}{2:>8}{'warm':>7}{seconds:>9.3f}{cached / seconds:>10.0f}")


if __name__ == "__main__":
    main()
