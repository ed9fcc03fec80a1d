"""The constructor's arguments as specs, folded once (``echo_native.specs``, and the
``Echo`` and ``Output`` folds beside their specs: ``echo_native.echo.spec.fold_echo``,
``echo_native.output.fold_output``), as units: the Workers spec's checks, each flat
shorthand landing in its spec, a shorthand next to its own spec refused naming both,
leftovers refused by name.

The other specs' own checks, and the shorthands giving the same batches as the specs
through EchoRing, are in ``test_api.py``; bad constructor arguments in
``robustness/test_bad_api.py``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import echo_native as en
from echo_native import specs
from echo_native._checks import take
from echo_native.echo.spec import SHORTHANDS as ECHO_SHORTHANDS
from echo_native.echo.spec import fold_echo
from echo_native.output import SHORTHANDS as OUTPUT_SHORTHANDS
from echo_native.output import fold_output
from echo_native.ring import MAX_WORKERS
from echo_native.specs import Specs, Workers, fold


# ---- Workers -----------------------------------------------------------------------------
@pytest.mark.parametrize("kw, exc, message", [
    ({"count": 0}, ValueError, (f"Workers: count must be an integer from 1 to {MAX_WORKERS}, "
                               f"got 0")),
    ({"count": MAX_WORKERS + 1}, ValueError, f"from 1 to {MAX_WORKERS}, got {MAX_WORKERS + 1}"),
    ({"count": True}, ValueError, "Workers: count must be an integer from 1"),
    ({"count": 2.0}, ValueError, "Workers: count must be an integer from 1"),
    ({"mode": "fiber"}, ValueError, ("Workers: mode must be one of ('process', 'thread'), "
                                    "got 'fiber'")),
    ({"slots": 1}, ValueError, "Workers: slots must be an integer >= 2, got 1"),
    ({"slots": 4.0}, ValueError, "Workers: slots must be an integer >= 2, got 4.0"),
    ({"timeout": "60"}, TypeError, ("Workers: timeout must be a positive number of seconds, "
                                   "got '60'")),
    ({"timeout": 0}, ValueError, "Workers: timeout must be a positive number of seconds"),
    ({"timeout": math.inf}, ValueError, "Workers: timeout must be a positive number"),
    ({"timeout": math.nan}, ValueError, "Workers: timeout must be a positive number"),
    ({"sample_timeout": "60"}, ValueError, ("Workers: sample_timeout must be a positive number "
                                           "of seconds or None, got '60'")),
    ({"sample_timeout": -1.0}, ValueError, "Workers: sample_timeout must be a positive"),
])
def test_workers_refuses_a_bad_value_naming_it(kw, exc, message):
    """Each field of Workers is checked when it is made, the message naming the spec, the
    field and the value."""
    with pytest.raises(exc) as e:
        Workers(**kw)
    assert message in str(e.value)


def test_workers_normalises_its_values():
    """NumPy integers are accepted, seconds become floats, sample_timeout=None turns the
    watchdog off, and equal specs are equal (frozen values)."""
    w = Workers(count=np.int64(3), mode="thread", slots=np.int32(5), timeout=7,
                sample_timeout=None)
    assert w.processes == 3 and type(w.processes) is int
    assert w.timeout == 7.0 and type(w.timeout) is float and w.sample_timeout is None
    assert w.ring_slots == 5
    assert Workers(timeout=7) == Workers(timeout=7.0)
    with pytest.raises(AttributeError):
        w.count = 4


@pytest.mark.parametrize("cpus, count, slots, processes, ring_slots", [
    (3, None, None, 3, 6),                       # the CPUs, two slots per worker
    (1, None, None, 1, 4),                       # at least 4 slots
    (10_000, None, None, MAX_WORKERS, 2 * MAX_WORKERS),   # at most MAX_WORKERS
    (8, 2, None, 2, 4),                          # count wins over the CPUs
    (8, None, 3, 8, 3),                          # slots as given
])
def test_workers_defaults_follow_the_cpus(monkeypatch, cpus, count, slots, processes,
                                          ring_slots):
    """count defaults to the CPUs this process may use, capped at MAX_WORKERS; slots to
    max(4, 2 x workers)."""
    monkeypatch.setattr(specs, "cpus", lambda: cpus)
    w = Workers(count=count, slots=slots)
    assert (w.processes, w.ring_slots) == (processes, ring_slots)


# ---- fold ------------------------------------------------------------------------------------
def test_fold_without_arguments_gives_the_default_specs():
    """No augment, decode, shard, workers nor shorthand: every spec's defaults."""
    assert fold("Loader") == Specs(en.RandomResizedCrop(), (), en.DecodeLimits(), en.Shard(),
                                   Workers())


def test_each_flat_shorthand_lands_in_its_spec():
    """image_size, scale, ratio, flip_p -> the crop; strict -> DecodeLimits; rank,
    world_size -> Shard; slots, timeout, sample_timeout, worker_mode -> Workers (with
    workers=2 its count); the caller's keywords are left as they were."""
    flat = {"image_size": (24, 32), "scale": (0.3, 1.0), "ratio": (0.5, 2.0), "flip_p": 0.25,
            "strict": False, "rank": 1, "world_size": 2, "slots": 3, "timeout": 9,
            "sample_timeout": None, "worker_mode": "thread"}
    given = dict(flat)
    got = fold("EchoRing", workers=2, shorthands=given)
    assert given == flat
    assert got == Specs(
        crop=en.RandomResizedCrop((24, 32), scale=(0.3, 1.0), ratio=(0.5, 2.0), flip_p=0.25),
        ops=(), decode=en.DecodeLimits(strict=False), shard=en.Shard(1, 2),
        workers=Workers(count=2, mode="thread", slots=3, timeout=9.0, sample_timeout=None))


def test_the_specs_themselves_pass_through_unchanged():
    """Specs given as specs are the specs folded (the same objects); an augment list is the
    crop and its per-example ops."""
    crop, jitter = en.RandomResizedCrop(16), en.ColorJitter(0.2)
    decode, shard = en.DecodeLimits(max_scans=9), en.Shard(0, 3, pad=False)
    workers = Workers(count=1, mode="thread")
    got = fold("Loader", augment=[crop, jitter], decode=decode, shard=shard, workers=workers)
    assert got.crop is crop and got.ops == (jitter,)
    assert got.decode is decode and got.shard is shard and got.workers is workers
    center = en.CenterCrop(20)
    assert fold("Loader", augment=center).crop is center


@pytest.mark.parametrize("kw, both", [
    ({"augment": en.RandomResizedCrop(16), "shorthands": {"scale": (0.5, 1.0)}},
     "augment= or scale"),
    ({"augment": en.CenterCrop(16), "shorthands": {"flip_p": 0.0, "ratio": (1.0, 1.0)}},
     "augment= or flip_p, ratio"),
    ({"decode": en.DecodeLimits(), "shorthands": {"strict": False}}, "decode= or strict="),
    ({"shard": en.Shard(), "shorthands": {"world_size": 2}}, "shard= or rank=/world_size="),
    ({"workers": Workers(count=1), "shorthands": {"slots": 4, "timeout": 5.0}},
     "workers=Workers(...) or slots, timeout"),
])
def test_a_shorthand_next_to_its_spec_is_a_type_error_naming_both(kw, both):
    """Which would win is not obvious: a shorthand given with the spec it belongs to is
    refused, the message naming the spec's argument and the shorthand."""
    with pytest.raises(TypeError) as e:
        fold("Loader", **kw)
    assert str(e.value) == f"Loader: give either {both}, not both"


def test_leftover_keywords_are_refused_by_name():
    """What no spec takes (a typo, or an EchoRing shorthand given to a Loader) is a
    TypeError naming every leftover, sorted, after the valid ones were taken."""
    with pytest.raises(TypeError) as e:
        fold("Loader", shorthands={"image_sise": 16, "slots": 4, "placement": "batch"})
    assert str(e.value) == "Loader got unexpected keyword argument(s) image_sise, placement"


@pytest.mark.parametrize("kw, exc, message", [
    ({"workers": 0}, ValueError, f"workers must be an integer from 1 to {MAX_WORKERS}, got 0"),
    ({"shorthands": {"worker_mode": "fiber"}}, ValueError,
     "worker_mode must be one of ('process', 'thread'), got 'fiber'"),
    ({"shorthands": {"slots": 1}}, ValueError, "slots must be an integer >= 2, got 1"),
    ({"shorthands": {"timeout": "60"}}, TypeError,
     "timeout must be a positive number of seconds, got '60'"),
    ({"workers": "two"}, ValueError,
     "Loader: workers must be a number of workers or an echo_native.Workers, got 'two'"),
    ({"workers": 2.0}, ValueError, ("Loader: workers must be a number of workers or an "
                                   "echo_native.Workers, got 2.0")),
])
def test_a_bad_worker_shorthand_is_named_as_the_user_wrote_it(kw, exc, message):
    """A bad flat worker keyword is reported under its own name (workers=, worker_mode=,
    slots=, timeout=), not as the Workers field it folds into."""
    with pytest.raises(exc) as e:
        fold("Loader", **kw)
    assert str(e.value) == message


def test_image_size_errors_name_image_size():
    """A bad image_size is reported as image_size, not as the crop's size field."""
    with pytest.raises(TypeError, match=r"^image_size must be an int or \(height, width\)"):
        fold("Loader", shorthands={"image_size": "16"})
    with pytest.raises(ValueError, match=r"^image_size must be positive"):
        fold("Loader", shorthands={"image_size": (16, 0)})


# ---- fold_echo ---------------------------------------------------------------------------
def test_fold_echo_folds_the_echo_shorthands_into_an_echo():
    """A factor (or "auto") with the flat echo keywords, taken by their SHORTHANDS names
    (echo_flip is Echo's flip), is one Echo; keywords of other specs stay behind."""
    kw = {"placement": "after_augment", "shuffle_buffer": 64, "echo_flip": True,
          "canvas_side": 40, "image_size": 16}
    got = fold_echo("EchoRing", 3, take(kw, ECHO_SHORTHANDS))
    assert got == en.Echo(3.0, placement="after_augment", shuffle_buffer=64, flip=True,
                          canvas_side=40)
    assert kw == {"image_size": 16}
    auto = fold_echo("EchoRing", "auto", take({"max_echo": 2.5}, ECHO_SHORTHANDS))
    assert auto == en.Echo("auto", max_echo=2.5)
    spec = en.Echo(2, placement="batch")
    assert fold_echo("EchoRing", spec) is spec and fold_echo("EchoRing", spec, {}) is spec


def test_fold_echo_refuses_a_shorthand_next_to_an_echo_and_what_is_no_echo():
    """echo=Echo(...) with a shorthand is a TypeError naming both; an echo that is neither
    an Echo, a number nor a string is a ValueError naming echo; the Echo's own errors
    about the factor say echo."""
    with pytest.raises(TypeError) as e:
        fold_echo("EchoRing", en.Echo(2), {"placement": "batch", "max_echo": 3.0})
    assert str(e.value) == "EchoRing: give either echo=Echo(...) or max_echo, placement, " \
                           "not both"
    for bad in ([2], None, {"factor": 2}):
        with pytest.raises(ValueError, match=r"^echo must be an echo_native.Echo, a number "
                                             r">= 1 or 'auto', got "):
            fold_echo("EchoRing", bad)
    with pytest.raises(ValueError, match=r"^echo must be a number >= 1"):
        fold_echo("EchoRing", 0.5, {"placement": "batch"})
    with pytest.raises(ValueError, match=r"^Echo: placement must be one of"):
        fold_echo("EchoRing", 2, {"placement": "after"})


# ---- fold_output -------------------------------------------------------------------------
def test_fold_output_folds_the_output_shorthands_into_an_output():
    """normalize, layout and dtype (OUTPUT_SHORTHANDS) make one Output; no output and no
    shorthand is uint8 NHWC; an Output given alone is used as it is."""
    kw = {"normalize": True, "layout": "NCHW", "dtype": "float16", "echo": 2}
    got = fold_output("EchoRing", None, take(kw, OUTPUT_SHORTHANDS))
    assert got == en.Output(True, layout="NCHW", dtype="float16") and kw == {"echo": 2}
    assert fold_output("EchoRing", None) == en.Output(normalize=False)
    assert fold_output("EchoRing", None, {}).dtype == "uint8"
    spec = en.Output(((0.5,) * 3, (0.25,) * 3))
    assert fold_output("EchoRing", spec) is spec


def test_fold_output_without_normalize_checks_layout_and_dtype_then_gives_uint8():
    """The original contract: layout and dtype without normalize=True are checked as if
    normalising, then the batches are uint8 NHWC; a bad one is refused by name."""
    assert fold_output("EchoRing", None, {"layout": "NCHW", "dtype": "float16"}) == \
        en.Output(normalize=False)
    assert fold_output("EchoRing", None, {"normalize": False, "dtype": "bfloat16"}) == \
        en.Output(normalize=False)
    with pytest.raises(ValueError, match=r"Output: layout must be one of"):
        fold_output("EchoRing", None, {"layout": "nchw"})
    with pytest.raises(ValueError, match=r"Output: dtype of normalised output must be one of"):
        fold_output("EchoRing", None, {"normalize": False, "dtype": "float64"})


def test_fold_output_refuses_a_shorthand_next_to_an_output_and_what_is_no_output():
    """output=Output(...) with a shorthand is a TypeError naming both (even normalize=False);
    an output that is not an Output is a TypeError naming output."""
    with pytest.raises(TypeError) as e:
        fold_output("EchoRing", en.Output(), {"layout": "NCHW", "dtype": "float16"})
    assert str(e.value) == "EchoRing: give either output=Output(...) or dtype, layout, not both"
    with pytest.raises(TypeError, match=r"or normalize, not both"):
        fold_output("EchoRing", en.Output(False), {"normalize": False})
    with pytest.raises(TypeError, match=r"^output must be an echo_native.Output or None, got "
                                        r"'float16'"):
        fold_output("EchoRing", "float16")
