"""The fleet page's pool overview (app/modes/fleet_view.py): each pixel the mean colour of its
blocks, compared with that mean taken block by block."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from app.modes.fleet_view import OVERVIEW_CELLS, OVERVIEW_COLS, STATE_RGB, overview_png


def pixels(url: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")).reshape(-1, 3)


@pytest.mark.parametrize("n", [1, 5, 64, 1000, 1024, 1025, 4097, 32768, 33000])
def test_each_pixel_is_the_mean_colour_of_its_blocks(n):
    states = np.random.default_rng(n).integers(0, len(STATE_RGB), n).astype(np.uint8)
    per = -(-n // OVERVIEW_CELLS) if n > OVERVIEW_CELLS else 1
    got = pixels(overview_png(states))
    cells = -(-n // per)
    assert len(got) == -(-cells // min(OVERVIEW_COLS, cells)) * min(OVERVIEW_COLS, cells)
    for c in range(cells):
        colours = [STATE_RGB[s] for s in states[c * per:(c + 1) * per]]
        colours += [(255, 255, 255)] * (per - len(colours))  # the last cell's padding is white
        want = np.array(colours, np.float64).mean(axis=0)
        assert np.abs(got[c].astype(float) - want).max() <= 1, (c, got[c], want)
    assert (got[cells:] == 255).all()  # the picture's last row, past the pool
