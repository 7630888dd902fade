"""Prompt preparation throughput: samples/s of `RLDataset.__getitem__` + `collate_prompts`.

    python benchmarks/bench_data.py [--n 256] [--batch 32] [--image-size 224]

One-image prompts from the synthetic shapes set, the tiny Qwen2.5-VL processor (built offline),
224x224 PNGs (64 image tokens each). Reports both expansion paths: predicted grids (the
default) and the processor (`use_processor=True`). Also reports construction (validation) rows/s.
Numbers on a shared 2-core CPU vary with load; torch ops inside the processor suffer most.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=256, help="prompts to prepare")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224, help="side of the synthetic PNGs")
    parser.add_argument("--max-pixels", type=int, default=28 * 28 * 64)
    args = parser.parse_args(argv)

    from vlrl.config import DataConfig
    from vlrl.data import RLDataset, StatefulPromptLoader
    from vlrl.data.synthetic import make_shapes_dataset
    from vlrl.models.processor import load_processor
    from vlrl.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", arch="qwen2_5_vl")
        train, _ = make_shapes_dataset(
            Path(tmp) / "data", n_train=args.n, n_val=1, image_size=args.image_size
        )
        tokenizer, processor = load_processor(str(model))

        def data_config(cache: str) -> DataConfig:
            return DataConfig(
                train_files=str(train),
                min_pixels=28 * 28 * 4,
                max_pixels=args.max_pixels,
                max_prompt_length=1024,
                image_check_cache_dir=str(Path(tmp) / cache),
            )

        RLDataset(str(train), data_config("warm-up"), tokenizer, processor)  # template compile, caches
        config = data_config("image_checks")
        for cache in ("cold", "warm"):  # the start-up image check decodes (cold) or trusts its cache
            start = time.perf_counter()
            RLDataset(config.train_files, config, tokenizer, processor)
            build = time.perf_counter() - start
            print(
                f"construction (validate {args.n} rows, {cache} image-check cache): {args.n / build:,.0f} rows/s"
            )
        for use_processor in (False, True):
            dataset = RLDataset(config.train_files, config, tokenizer, processor, use_processor=use_processor)
            loader = StatefulPromptLoader(dataset, args.batch, seed=0)
            next(iter(loader))  # warm-up (first processor call initialises lazily)
            loader = StatefulPromptLoader(dataset, args.batch, seed=1)
            start = time.perf_counter()
            count = sum(len(batch) for batch in loader)
            elapsed = time.perf_counter() - start
            tokens = dataset[0].image_grid_thw.prod().item() // 4
            path = "processor expansion" if use_processor else "predicted-grid expansion (default)"
            print(
                f"getitem+collate, {path}: {count / elapsed:,.0f} samples/s ({tokens} image tokens per prompt)"
            )


if __name__ == "__main__":
    main()
