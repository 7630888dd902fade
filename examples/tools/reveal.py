"""The multi-turn demo's tool: the prompt shows the shape in grey; `reveal` shows it in colour.

The row's `tools_kwargs` column gives it the coloured image and the colour's name (context the
model never sees); the model only chooses to call it.
"""

from PIL import Image


def reveal(*, image_path: str, colour: str):
    """Show the shape of the image in its true colour."""
    return colour, Image.open(image_path).convert("RGB")
