"""Image input: what a prompt's images become before the engine core sees them.

`inputs.py` holds the plain data (an image's processed features, a prompt with its
images), `image.py` turns what a client sent (PIL images, bytes, `data:` URLs) into
checked images within the bounds of `request_limits.py`, and each family's
`ImagePromptProcessor` (`<family>.py`, found through `registry.py`) expands a prompt's
image placeholders the way the checkpoint's own HF processor does.
"""
