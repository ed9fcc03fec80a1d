"""The libjpeg-turbo ceiling the kernel benchmark measures against (src/bench/)."""
import io

import numpy as np
import pytest
from PIL import Image

from echo_native.lab import _bench


def _jpeg(h, w, seed=0, **kw):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG", **kw)
    return buf.getvalue()


@pytest.mark.parametrize("mode", sorted(_bench.MODES))
@pytest.mark.parametrize("denom", [1, 2, 8])
def test_every_mode_decodes_the_crops_rows(mode, denom):
    data = _jpeg(96, 160, quality=90)
    # rows of the crop at 1/denom, clipped to the image: ceil(40/denom), ceil(90/denom)
    assert _bench.roi_decode(data, 8, 16, 40, 64, denom, mode) == -(-40 // denom)
    assert _bench.roi_decode(data, 80, 0, 90, 160, denom, mode) == -(-96 // denom) - 80 // denom


def test_store_grows_its_buffer_for_a_crop_larger_than_the_last():
    small, large = _jpeg(64, 64), _jpeg(1200, 900, seed=1)  # 3.2 MB of rows > the 192 KiB start
    assert _bench.roi_decode(small, 0, 0, 64, 64, 1, "store") == 64
    assert _bench.roi_decode(large, 0, 0, 1200, 900, 1, "store") == 1200
    assert _bench.roi_decode(small, 0, 0, 64, 64, 1, "store") == 64


@pytest.mark.parametrize("mode", ["rgb", "store"])
def test_a_truncated_file_fails_only_where_the_ceiling_reads_it(mode):
    data = _jpeg(256, 256, seed=2)
    cut = data[:len(data) // 3]
    with pytest.raises(ValueError, match="warned"):
        _bench.roi_decode(cut, 0, 0, 256, 256, 1, "finish")
    # libjpeg pads missing data with zeros and warns; only "finish" refuses warnings
    assert _bench.roi_decode(cut, 0, 0, 256, 256, 1, mode) == 256
    with pytest.raises(ValueError, match="could not decode"):
        _bench.roi_decode(b"\xff\xd8not a jpeg", 0, 0, 8, 8, 1, mode)


@pytest.mark.parametrize("mode", sorted(_bench.MODES))
def test_a_crop_below_the_image_decodes_no_rows(mode):
    assert _bench.roi_decode(_jpeg(64, 64), 200, 0, 16, 16, 1, mode) == 0
