"""vLLM request dicts, built in one place: token ids, images and videos, and a content id per image.

vLLM keys its multimodal processor cache and its prefix cache by a hash of each media item. Without
an id from the caller it hashes every image of every request again (vllm 0.32:
vllm/multimodal/processing/inputs.py, `get_mm_hashes`, over the image's pixels). A multi-turn call
sends each prompt image once per sample and per turn (64 prompts x 4 samples x 2 turns: ~500 requests
for 64 distinct images) and each tool image once per later turn, so that hashing cost ~0.3 ms a
request on CPU. `ImageIds` hashes each image object once per call and the request carries the
digest as `multi_modal_uuids`; vLLM then hashes the short id (with its processor kwargs) instead.
The id is a function of the pixels (mode, size, bytes), as vLLM's own hash is, so equal ids still
mean equal content for both caches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from vlrl.data.encoded_images import decoded


class ImageIds:
    """Content ids of images, each image object hashed once until `clear` (one generation call)."""

    def __init__(self) -> None:
        # id(image) -> (image, its content id); holding the image keeps its id() from being reused
        self._ids: dict[int, tuple[Any, str]] = {}

    def __call__(self, image: Any) -> str:
        entry = self._ids.get(id(image))
        if entry is None:
            digest = hashlib.blake2b(image.tobytes(), digest_size=16)
            digest.update(f"{image.mode}:{image.size}".encode())
            entry = self._ids[id(image)] = (image, "vlrl-" + digest.hexdigest())
        return entry[1]

    def clear(self) -> None:
        self._ids.clear()


def vllm_request(
    ids: Sequence[int],
    images: Sequence[Any] = (),
    videos: Sequence[Any] = (),
    image_ids: ImageIds | None = None,
) -> dict[str, Any]:
    """One vLLM prompt: unexpanded token ids (vLLM expands the image and video placeholders itself),
    PIL images, and videos as vLLM items (`Video.vllm_item()`: frames [T, H, W, 3] + metadata).
    With `image_ids`, the images carry their content ids (vLLM skips hashing their pixels)."""
    request: dict[str, Any] = {"prompt_token_ids": list(ids)}
    media: dict[str, Any] = {}
    images = [decoded(image) for image in images]  # a rank's fetch decoded them already: a no-op
    if images:
        media["image"] = list(images)
        if image_ids is not None:
            request["multi_modal_uuids"] = {"image": [image_ids(image) for image in images]}
    if videos:
        media["video"] = list(videos)
    if media:
        request["multi_modal_data"] = media
    return request
