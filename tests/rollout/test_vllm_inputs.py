"""vLLM request dicts and image content ids (`vlrl.rollout.vllm_inputs`), without an engine."""

from __future__ import annotations

from PIL import Image

from vlrl.rollout.vllm_inputs import ImageIds, vllm_request


class CountingImage(Image.Image):
    """A PIL image that counts how often its pixels are read."""

    reads = 0

    def tobytes(self, *args, **kwargs):  # type: ignore[override]
        CountingImage.reads += 1
        return super().tobytes(*args, **kwargs)


def counting(colour: str, size: tuple[int, int] = (28, 28)) -> CountingImage:
    image = Image.new("RGB", size, colour)
    image.__class__ = CountingImage
    return image  # type: ignore[return-value]


def test_ids_follow_content_and_each_object_is_hashed_once():
    ids = ImageIds()
    red, red_again, blue = counting("red"), counting("red"), counting("blue")
    CountingImage.reads = 0
    first = [ids(red), ids(red_again), ids(blue), ids(red), ids(red)]
    assert first[0] == first[1] == first[3]  # equal pixels, equal id (vLLM's caches may share them)
    assert first[2] != first[0]
    assert CountingImage.reads == 3  # three objects, each read once
    # same pixel bytes but another size or mode is another image
    assert ids(Image.new("RGB", (28, 28), "red")) != ids(Image.new("RGB", (14, 56), "red"))
    assert ids(Image.new("L", (28, 28), 0)) != ids(Image.new("P", (28, 28), 0))
    ids.clear()
    ids(red)
    assert CountingImage.reads == 4  # a new call hashes again


def test_requests_carry_ids_for_images_only():
    ids = ImageIds()
    image = Image.new("RGB", (28, 28), "red")
    video = ("frames", {"fps": 2.0})
    assert vllm_request([1, 2]) == {"prompt_token_ids": [1, 2]}
    assert vllm_request((1, 2), [image]) == {
        "prompt_token_ids": [1, 2],
        "multi_modal_data": {"image": [image]},
    }
    request = vllm_request([1], [image, image], [video], image_ids=ids)
    assert request["multi_modal_data"] == {"image": [image, image], "video": [video]}
    assert request["multi_modal_uuids"] == {"image": [ids(image)] * 2}  # videos are hashed by vLLM
