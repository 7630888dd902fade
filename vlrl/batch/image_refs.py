"""Images (and videos) by reference: batches between the driver and the ranks carry `ImageRef`s,
not pixels.

An image is put into Ray's object store once, by whoever made it (the driver for dataset images,
as their encoded files, `vlrl.data.encoded_images`; a rank for images a tool returned), and every
later hop of the step moves a reference of a few dozen bytes: prompts to the engines, rollouts back
to the driver, shards to the log-prob and update passes. A rank fetches the references it consumes,
once per step (one batched `get`), turns each fetched object into the one it uses (`local`: an
encoded image decoded), and maps each reference to that one object for the whole step, so each
image is decoded once per rank and step, and the vision cache (keyed by image object) encodes each
distinct image once across the log-prob, reference and update passes.

Without Ray (`InProcessRanks`) there is nothing to move: the trainer and the ranks skip this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageRef:
    """A stored image: `ref` is its object-store handle (a `ray.ObjectRef` under Ray)."""

    ref: Any


class ImageRefs:
    """One process's two-way map between its image objects and their references, for one step.

    `put(image) -> handle` and `get([handles]) -> [images]` are the object store's (ray.put and
    ray.get); `clear` at the end of the step drops this side's hold on every image."""

    def __init__(
        self,
        put: Callable[[Any], Any],
        get: Callable[[list[Any]], list[Any]],
        local: Callable[[Any], Any] | None = None,
    ) -> None:
        # `local`: the object this process uses for a fetched one (a rank: the decoded pixels of an
        # encoded image, `vlrl.data.encoded_images.decoded`); handed back, it maps to the same reference
        self._put, self._get = put, get
        self._local = local or (lambda obj: obj)
        self._ref_of: dict[int, tuple[Any, ImageRef]] = {}  # id(image) -> (image, its ref); keeps it alive
        self._image_of: dict[ImageRef, Any] = {}  # ref -> the local image object

    @classmethod
    def ray(cls, local: Callable[[Any], Any] | None = None) -> ImageRefs:
        import ray

        return cls(ray.put, ray.get, local)

    def to_refs(self, images: list[list[Any]]) -> list[list[Any]]:
        """Per-sample image lists with every image replaced by its reference (stored on first sight;
        samples sharing an image object share its reference)."""
        return [[self._ref(img) for img in row] for row in images]

    def resolve(self, images: list[list[Any]]) -> list[list[Any]]:
        """Per-sample image lists with every reference replaced by its image: one fetch for the
        references this process has not seen this step, then the same object for each reference
        (made by `local` from the fetched one, once)."""
        missing = list(
            {img for row in images for img in row if isinstance(img, ImageRef) and img not in self._image_of}
        )
        if missing:
            for ref, fetched in zip(missing, self._get([r.ref for r in missing])):
                image = self._local(fetched)
                self._image_of[ref] = image
                self._ref_of[id(image)] = (image, ref)
        return [[self._image_of[img] if isinstance(img, ImageRef) else img for img in row] for row in images]

    def refer(self, batch: Any) -> None:
        """`batch.images` and `batch.videos` (when present) as references, in place."""
        batch.images = self.to_refs(batch.images)
        if getattr(batch, "videos", None) is not None:
            batch.videos = self.to_refs(batch.videos)

    def fetch(self, batch: Any) -> None:
        """`batch.images` and `batch.videos` (when present) as the objects, in place."""
        batch.images = self.resolve(batch.images)
        if getattr(batch, "videos", None) is not None:
            batch.videos = self.resolve(batch.videos)

    def clear(self) -> None:
        self._ref_of.clear()
        self._image_of.clear()

    def __len__(self) -> int:
        return len(self._image_of)

    def _ref(self, image: Any) -> ImageRef:
        if isinstance(image, ImageRef):
            return image
        known = self._ref_of.get(id(image))
        if known is not None:
            return known[1]
        ref = ImageRef(self._put(image))
        self._ref_of[id(image)] = (image, ref)
        self._image_of[ref] = image
        return ref
