"""The fixtures every test module may ask for; the inputs themselves are built by
``jpegs.py`` (JPEG kinds, Pillow references, byte surgery, other formats),
``ring_helpers.py`` (corpora, rings), ``echo_helpers.py`` and ``sources_helpers.py``.

Fixtures:
  ``images``      session factory: photos, encoders, Pillow references, byte surgery
  ``corpus_root`` an ImageFolder tree of 48 real-photo JPEGs (per test module)
  ``jpeg_kind``   parametrised over every JPEG input kind in :data:`KINDS`
  ``other_format``  parametrised over the non-JPEG formats in :data:`OTHER_FORMATS`
"""
from __future__ import annotations

import os
import sys

import pytest

# The helper modules (jpegs, ring_helpers, echo_helpers, sources_helpers) live in this
# folder; make them importable from test files in subfolders too (and, through sys.path,
# in forkserver workers).
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from jpegs import (KIND_NAMES, OTHER_FORMAT_NAMES, SOF_MARKERS, Sample, count_scans,  # noqa: E402
                   diff, find_segment, fit, ink_to_rgb, jpeg_sample, other_format_bytes,
                   patch, photo, pil_crop, pil_decode, pil_draft, pil_encode, pil_jpeg,
                   pil_resize, rgb_to_ink, segments, set_sof_size)


# ---------------------------------------------------------------------------
# fixtures


class Images:
    """The helpers of ``jpegs.py``, as one session fixture."""
    photo = staticmethod(photo)
    fit = staticmethod(fit)
    pil_jpeg = staticmethod(pil_jpeg)
    pil_encode = staticmethod(pil_encode)
    pil_decode = staticmethod(pil_decode)
    pil_draft = staticmethod(pil_draft)
    pil_crop = staticmethod(pil_crop)
    pil_resize = staticmethod(pil_resize)
    diff = staticmethod(diff)
    segments = staticmethod(segments)
    find_segment = staticmethod(find_segment)
    patch = staticmethod(patch)
    set_sof_size = staticmethod(set_sof_size)
    count_scans = staticmethod(count_scans)
    rgb_to_ink = staticmethod(rgb_to_ink)
    ink_to_rgb = staticmethod(ink_to_rgb)
    sample = staticmethod(jpeg_sample)
    other = staticmethod(other_format_bytes)
    SOF_MARKERS = SOF_MARKERS
    KIND_NAMES = KIND_NAMES
    OTHER_FORMAT_NAMES = OTHER_FORMAT_NAMES


@pytest.fixture(scope="session")
def images() -> Images:
    """Photographs, encoders, Pillow references and JPEG byte surgery."""
    return Images()


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    """An ImageFolder tree of 48 JPEGs cut from real photographs, 3 classes (the ring,
    loader, worker and fault tests' corpus; ``ring_helpers.make_corpus``)."""
    import ring_helpers as rh

    return rh.make_corpus(tmp_path_factory.getbasetemp() / "ring_corpus_48", 48, seed=1,
                          classes=3)


@pytest.fixture
def jpeg_kind(request) -> Sample:
    """One JPEG input kind (parametrised over all of them)."""
    return jpeg_sample(request.param)


@pytest.fixture
def other_format(request) -> tuple[str, bytes]:
    """(name, bytes) of one non-JPEG format (parametrised over all of them)."""
    return request.param, other_format_bytes(request.param)


def pytest_generate_tests(metafunc):
    if "jpeg_kind" in metafunc.fixturenames:
        metafunc.parametrize("jpeg_kind", KIND_NAMES, indirect=True)
    if "other_format" in metafunc.fixturenames:
        metafunc.parametrize("other_format", OTHER_FORMAT_NAMES, indirect=True)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``--dist loadgroup``, pyproject.toml), each test file runs on
    one worker, so a module-scoped fixture (a corpus, the soak run, the hostile corpus's
    checker, a server) is built once rather than once per worker.  Tests marked with
    their own ``xdist_group`` (those sharing the host's /dev/shm) keep it."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
