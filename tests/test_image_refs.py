"""Images by reference: stored once, fetched once per step in one batch, one object per reference."""

from __future__ import annotations

import pickle

from PIL import Image

from vlrl.batch.image_refs import ImageRef, ImageRefs


class _Store:
    """An object store in a dict: `put` pickles (like Ray), `get` unpickles; counts the calls."""

    def __init__(self) -> None:
        self.blobs: dict[int, bytes] = {}
        self.puts, self.gets = 0, []

    def put(self, obj: object) -> int:
        self.puts += 1
        self.blobs[len(self.blobs)] = pickle.dumps(obj)
        return len(self.blobs) - 1

    def get(self, handles: list[int]) -> list[object]:
        self.gets.append(len(handles))
        return [pickle.loads(self.blobs[h]) for h in handles]


def test_driver_stores_each_image_once_and_sends_small_references() -> None:
    store = _Store()
    a, b = Image.new("RGB", (56, 56), "red"), Image.new("RGB", (56, 28), "blue")
    images = [[a], [a, b], [], [b]]  # a group shares the object `a`
    driver = ImageRefs(store.put, store.get)
    refs = driver.to_refs(images)
    assert store.puts == 2 and refs[0][0] == refs[1][0] and refs[2] == []
    assert all(isinstance(r, ImageRef) for row in refs for r in row)
    assert len(pickle.dumps(refs)) < 300 < len(pickle.dumps(images))
    assert driver.to_refs(images) == refs and store.puts == 2  # a second round stores nothing


def test_rank_fetches_once_and_maps_each_reference_to_one_object() -> None:
    store = _Store()
    a, b = Image.new("RGB", (56, 56), "red"), Image.new("RGB", (56, 28), "blue")
    refs = ImageRefs(store.put, store.get).to_refs([[a], [a, b], [b]])
    rank = ImageRefs(store.put, store.get)
    first = rank.resolve(refs)
    assert store.gets == [2]  # one batched fetch of the two distinct images
    assert first[0][0] is first[1][0] and first[1][1] is first[2][0]
    assert first[0][0].tobytes() == a.tobytes() and first[2][0].size == (56, 28)
    again = rank.resolve(list(reversed(refs)))  # a later pass of the step: no fetch, same objects
    assert store.gets == [2] and again[2][0] is first[0][0]
    # images handed back (e.g. in the rollout) map to their original references, new ones are stored
    tool = Image.new("RGB", (28, 28), "green")
    back = rank.to_refs([first[1] + [tool]])
    assert back[0][:2] == refs[1] and store.puts == 3
    rank.clear()
    assert len(rank) == 0
    rank.resolve(refs)
    assert store.gets == [2, 2]  # a new step fetches again


def test_plain_images_pass_through_resolve() -> None:
    a = Image.new("RGB", (28, 28))
    assert ImageRefs(lambda x: x, lambda xs: xs).resolve([[a]])[0][0] is a


def test_a_batch_refers_and_fetches_images_and_videos_in_place() -> None:
    from types import SimpleNamespace

    store = _Store()
    frames = ["frame0", "frame1"]  # any object stands for a video
    image = Image.new("RGB", (28, 28))
    batch = SimpleNamespace(images=[[image], [image]], videos=[[frames], []])
    ImageRefs(store.put, store.get).refer(batch)
    assert store.puts == 2 and isinstance(batch.videos[0][0], ImageRef) and batch.videos[1] == []
    ImageRefs(store.put, store.get).fetch(batch)
    assert batch.videos[0][0] == frames and batch.images[0][0] is batch.images[1][0]
    no_videos = SimpleNamespace(images=[[image]], videos=None)
    ImageRefs(store.put, store.get).refer(no_videos)
    assert no_videos.videos is None


def test_a_rank_decodes_each_fetched_image_once_and_hands_back_its_reference() -> None:
    """Dataset images are stored encoded; a rank's `local` decodes each reference once per step, and
    the decoded image handed back (in its rollout) maps to the encoded one's reference."""
    import io

    from vlrl.data.encoded_images import EncodedImage, decoded

    store = _Store()
    buffer = io.BytesIO()
    Image.new("RGB", (56, 28), "red").save(buffer, format="PNG")
    encoded = EncodedImage(buffer.getvalue(), 28, 56)
    refs = ImageRefs(store.put, store.get).to_refs([[encoded], [encoded]])
    assert len(store.blobs[0]) < len(buffer.getvalue()) + 200  # bytes in the store, not pixels
    rank = ImageRefs(store.put, store.get, local=decoded)
    images = rank.resolve(refs)
    assert isinstance(images[0][0], Image.Image) and images[0][0] is images[1][0]
    assert images[0][0].getpixel((0, 0)) == (255, 0, 0) and images[0][0].size == (56, 28)
    assert rank.resolve(refs)[1][0] is images[0][0] and store.gets == [1]
    assert rank.to_refs(images) == refs and store.puts == 1  # nothing stored again
