"""``echo-native`` command line (also ``python -m echo_native``).

``echo-native make-shards SRC OUT --shard-size 256MB`` packs an ImageFolder (a
folder) or a FileList (a ``path,label`` file) into tar shards with index
sidecars, locally or to object storage (:mod:`echo_native.shards`).

``echo-native profile DIR --step-ms T`` (or ``--model-fn module:function``)
measures the upstream rate and the consumer's step time and recommends an echo
factor (the paper's rule e ~ R = t_upstream / t_downstream, capped) and placement,
then runs ``echo="auto"`` against the consumer for ``--auto-seconds`` and shows how
its e moved and why (:mod:`echo_native.profile` holds the measurements).

Benchmarks, data-set builders and the training demo are lab tooling: they live in
``echo-native-lab`` (:mod:`echo_native.lab.cli`).  The small helpers here
(:class:`UsageError`, :func:`open_folder`, :func:`check_device`, :func:`echo_list`,
:func:`run`, :func:`command_parser`, :func:`loader_options`) are shared with it.  Errors a user can hit print one line: a bad argument
exits 2 (found before anything runs, as argparse does), a failure while running
(memory, the step function, the store) exits 1.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

from echo_native.errors import DecodeError
from echo_native.profile import measure_upstream, recommend, time_step, trial_auto

__all__ = ["UsageError", "CommandError", "open_folder", "check_device", "echo_list", "run",
           "command_parser", "loader_options", "build_parser", "main", "recommend",
           "storage_option"]

# Commands that moved to the lab's command line (``echo-native-lab``).
LAB_COMMANDS = ("bench", "make-dataset", "demo")


class UsageError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit 2."""


class CommandError(Exception):
    """A failure while the command runs (memory, the user's step, a store): one line,
    exit 1."""


def open_folder(root, batch_size=1):
    """An ImageFolder at ``root``, or a one-line UsageError saying what is wrong."""
    import echo_native as en

    if not os.path.exists(root):
        raise UsageError(f"{root}: no such folder")
    if not os.path.isdir(root):
        raise UsageError(f"{root}: not a folder")
    try:
        folder = en.ImageFolder(root)
    except (OSError, ValueError) as e:
        msg = str(e)
        if "no class sub-folders" in msg:
            msg += " (expected ROOT/<class>/<image>.jpg)"
        raise UsageError(msg) from None
    if len(folder) < batch_size:
        raise UsageError(f"{root} has {len(folder)} images, fewer than --batch-size "
                         f"{batch_size}")
    return folder


def check_device(device):
    """Refuse a device that is not there (e.g. --device cuda without a GPU) in one line."""
    from echo_native.backends import resolve

    try:
        resolve(device)
    except (RuntimeError, ValueError, ImportError) as e:
        raise UsageError(f"--device {device}: {e}") from None


def echo_list(text):
    """``"1,2,auto"`` -> ``[1, 2, 'auto']`` (an argparse type)."""
    try:
        values = [v if v == "auto" else float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of echo factors: {text!r}") from None
    return [int(v) if isinstance(v, float) and v.is_integer() else v for v in values]


def command_parser(prog, description, epilog):
    """(parser, its subcommands) of one of the package's commands: ``echo-native`` and
    ``echo-native-lab`` are built alike, a subcommand required, so they fail alike."""
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
    return p, p.add_subparsers(dest="command", required=True)


def loader_options(p):
    """The loader a measuring command runs over a folder (``profile`` here, the lab's
    ``bench``): one meaning and one default for both, so their figures compare."""
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=0, help="default: available cores")


def run(parser, argv=None):
    """Parses ``argv`` and runs ``args.func``; a UsageError is one line on stderr, exit 2."""
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, CommandError) as e:
        # One line whatever the message holds (a backend's or a step's text may not).
        print(f"{parser.prog}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130


# -- profile ---------------------------------------------------------------------------
def _load_callable(spec):
    """``module:function`` (module importable, or a .py path) -> the callable."""
    import importlib
    import importlib.util

    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise UsageError(f"--model-fn {spec!r}: expected module:function")
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise UsageError(f"--model-fn {spec!r}: no such file {mod_name}")
            loc = importlib.util.spec_from_file_location("_echo_native_model_fn", mod_name)
            module = importlib.util.module_from_spec(loc)
            loc.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"--model-fn {spec!r}: cannot import {mod_name}: {e}") from None
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module failed while it was imported
        raise UsageError(f"--model-fn {spec!r}: cannot import {mod_name}: "
                         f"{type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"--model-fn {spec!r}: {mod_name} has no callable {fn_name!r}")
    return fn


def cmd_profile(args):
    # nan or inf would make a measuring loop endless or a recommendation made up.
    for flag, value in (("--step-ms", args.step_ms), ("--seconds", args.seconds),
                        ("--max-echo", args.max_echo), ("--auto-seconds", args.auto_seconds)):
        if value is not None and not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number, got {value}")
    if args.step_ms is None and not args.model_fn:
        raise UsageError("give the consumer's step time: --step-ms T or --model-fn "
                         "module:function")
    if args.step_ms is not None and args.step_ms <= 0:
        raise UsageError(f"--step-ms must be positive, got {args.step_ms}")
    if args.max_echo < 1:
        raise UsageError(f"--max-echo must be >= 1, got {args.max_echo}")
    from echo_native.ring import MAX_WORKERS

    for flag, value in (("--batch-size", args.batch_size), ("--image-size", args.image_size),
                        ("--min-batches", args.min_batches)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.image_size > 65535:  # the decoder's largest side
        raise UsageError(f"--image-size must be at most 65535, got {args.image_size}")
    if not 0 <= args.workers <= MAX_WORKERS:
        raise UsageError(f"--workers must be >= 1 and at most {MAX_WORKERS} (0: one per "
                         f"core), got {args.workers}")
    if not 0 <= args.seed < 2**64:
        raise UsageError(f"--seed must be an integer in [0, 2**64), got {args.seed}")
    if args.seconds < 0:
        raise UsageError(f"--seconds must be >= 0, got {args.seconds}")
    if args.auto_seconds < 0:
        raise UsageError(f"--auto-seconds must be >= 0, got {args.auto_seconds}")
    _check_json_target(args.json)  # before minutes of measuring, not after
    folder = open_folder(args.dir, args.batch_size)
    check_device(args.device)
    fn = _load_callable(args.model_fn) if args.model_fn else None
    args.workers = args.workers or min(len(os.sched_getaffinity(0)), MAX_WORKERS)
    try:
        return _profile(args, folder, fn)
    except _StepFailed as e:
        cause = e.__cause__
        raise CommandError(f"--model-fn {args.model_fn}: calling it on a batch raised "
                           f"{type(cause).__name__}: {cause}") from None
    except MemoryError as e:
        raise CommandError(f"{e} On the command line: lower --batch-size, --image-size or "
                           f"--workers") from None
    except DecodeError as e:  # every file of the folder failed: the epoch has no batch
        raise CommandError(str(e)) from None


class _StepFailed(Exception):
    """The user's --model-fn raised on a batch (the cause holds what it raised)."""


def _guarded(fn):
    def step(batch):
        try:
            return fn(batch)
        except Exception as e:  # noqa: BLE001 - the user's step, reported in one line
            raise _StepFailed() from e
    return step


def measuring_deadline(seconds):
    """How long the upstream is measured at most, --min-batches reached or not: ten
    times --seconds, at least 30 s."""
    return max(30.0, 10.0 * seconds)


def _check_json_target(path):
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) and not os.path.islink(path):
        raise UsageError(f"--json {path}: is a folder, not a file name")
    if not os.path.isdir(parent):
        raise UsageError(f"--json {path}: no such folder {parent}")


def _write_json(path, result):
    """``result`` written to ``path`` atomically: a temporary beside it (``mkstemp``,
    ``O_EXCL``) renamed into place, so a reader never sees half a file and a link
    planted at ``path`` is replaced, never written through."""
    from echo_native.tarindex import umask

    parent = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".echo_native_profile-", suffix=".tmp", dir=parent)
    except OSError as e:
        raise CommandError(f"--json {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o666 & ~umask())
            json.dump(result, f, indent=2)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise CommandError(f"--json {path}: {e.strerror or e}") from None
        raise


def _profile(args, folder, fn):
    print(f"measuring the upstream ({len(folder)} images, batch {args.batch_size}, "
          f"{args.image_size}px, {args.workers} workers) ...", file=sys.stderr)
    deadline = measuring_deadline(args.seconds)
    up, batches = measure_upstream(folder, args.batch_size, args.image_size, args.workers,
                                   seconds=args.seconds, min_batches=args.min_batches,
                                   max_seconds=deadline, with_batches=True)
    if batches < args.min_batches:
        print(f"--min-batches {args.min_batches} not reached in "
              f"{deadline:g} s: the rate is over the {batches} batches timed",
              file=sys.stderr)
    t_up = args.batch_size / up
    if fn is not None:
        fn = _guarded(fn)
        t_down = time_step(fn, folder, args.batch_size, args.image_size, args.workers,
                           seed=args.seed, device=args.device)
        how = f"--model-fn {args.model_fn}"
    else:
        t_down = args.step_ms / 1000.0
        how = "--step-ms"
    R, e = recommend(t_up, t_down, args.max_echo)
    bound = R > 1.0
    placement = "before_augment"
    steps_e1 = 1.0 / max(t_up, t_down)
    steps_e = min(e / t_up, 1.0 / t_down)
    result = {
        "dir": str(args.dir), "images": len(folder), "batch_size": args.batch_size,
        "image_size": args.image_size, "workers": args.workers,
        "upstream_img_per_s": up, "t_upstream_ms": t_up * 1000,
        "t_downstream_ms": t_down * 1000, "step_time_from": how, "R": R,
        "input_bound": bound, "recommended_echo": e, "recommended_placement": placement,
        "max_echo": args.max_echo,
        "steps_per_s_no_echo": steps_e1, "steps_per_s_recommended": steps_e,
        "step_speedup": steps_e / steps_e1,
    }
    print(f"upstream: {up:,.0f} img/s = {t_up * 1000:.1f} ms per batch of {args.batch_size}")
    print(f"consumer: {t_down * 1000:.1f} ms per batch ({how})")
    print(f"R = t_up / t_down = {R:.2f}")
    if bound:
        print(f"the input pipeline is the bottleneck: recommended echo={e:g}, "
              f"placement={placement!r} (rule e ~ R, capped at {args.max_echo:g}); "
              f"training steps/s x{steps_e / steps_e1:.2f}")
    else:
        print("the consumer is the bottleneck: no echo needed (echo=1)")
    if args.auto_seconds > 0:
        result["auto_trial"] = _auto_trial(args, folder, fn, t_down)
    if args.json:
        _write_json(args.json, result)
        print(f"JSON: {args.json}")
    return 0


def _auto_trial(args, folder, fn, t_down):
    """echo="auto" against the consumer for --auto-seconds: where e went and why."""
    print(f"\nrunning echo='auto' for {args.auto_seconds:g} s against the consumer ...",
          file=sys.stderr)
    s = trial_auto(fn or t_down, folder, args.batch_size, args.image_size, args.workers,
                   seconds=args.auto_seconds, max_echo=args.max_echo, seed=args.seed,
                   device=args.device)
    trace = s["echo_trace"]
    n = s["batches"]
    if n < 8:
        print(f"echo='auto' for {args.auto_seconds:g} s: only {n} batch{'es' * (n != 1)}, "
              f"too few to measure the rates (give --auto-seconds room for a dozen steps)")
        return {"echo": s["echo_factor"], "batches": n, "trace": trace, "measured": False}
    print(f"echo='auto' for {args.auto_seconds:g} s: e = {s['echo_factor']:.2f} after "
          f"{s['batches']} batches ({s['fresh']} fresh, {s['delivered']} delivered, "
          f"{s['stall_s']:.2f} s waiting for data); {len(trace)} changes of e:")
    shown = trace if len(trace) <= 8 else trace[:4] + [None] + trace[-3:]
    for t in shown:
        if t is None:
            print("    ...")
            continue
        r = f", R = {t['R']:.2f}" if t["R"] is not None else ""
        print(f"  {t['t_s']:7.2f} s  batch {t['batch']:5d}  e -> {t['echo']:.2f}  "
              f"({t['reason']}{r})")
    return {"echo": s["echo_factor"], "batches": s["batches"], "fresh": s["fresh"],
            "delivered": s["delivered"], "stall_s": s["stall_s"], "trace": trace,
            "measured": True}


# -- make-shards ------------------------------------------------------------------------
def storage_option(text):
    """``KEY=VALUE`` -> (key, value), the value read as JSON when it is JSON (an argparse type)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(value)
    except ValueError:
        pass
    return key, value


def cmd_make_shards(args):
    from echo_native import shards
    from echo_native.remote import RemoteReadError, is_url

    try:
        size = shards.parse_size(args.shard_size)
    except ValueError as e:
        raise UsageError(f"--shard-size: {e}") from None
    if size <= 0:
        raise UsageError(f"--shard-size must be positive, got {args.shard_size}")
    for flag, value in (("--max-count", args.max_count), ("--max-side", args.max_side)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if not 1 <= args.quality <= 100:
        raise UsageError(f"--quality must be in 1..100, got {args.quality}")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    restart = None
    if args.restart is not None:
        if not args.seekable:
            raise UsageError("--restart needs --seekable")
        if args.restart != "row" and not (args.restart.isdigit() and int(args.restart) >= 1):
            raise UsageError(f"--restart must be a number of MCUs >= 1 or 'row', got "
                             f"{args.restart!r}")
        restart = 0 if args.restart == "row" else int(args.restart)
    options = dict(args.storage_option or [])
    src = args.src
    if not is_url(src):
        if not os.path.exists(src):
            raise UsageError(f"{shards.shown(src)}: no such folder or list file")
        if os.path.isdir(src) and shards.shard_files(src):
            # Existing shards (of make-shards or any WebDataset writer): re-packed, e.g.
            # made seekable, sample by sample in their order.
            from echo_native.tarshards import TarShards
            src = TarShards(shards.shard_files(src))
        elif os.path.isdir(src):
            src = open_folder(src)
    progress = not args.quiet and sys.stderr.isatty()

    def report(name, message):
        line = f"skipped {shards.shown(name)}: {message}"
        try:
            from tqdm import tqdm
        except ImportError:
            print(line, file=sys.stderr)
            return
        with tqdm.external_write_mode(file=sys.stderr):  # above the progress bar
            print(line, file=sys.stderr)
    try:
        result = shards.write_shards(
            src, args.out, shard_size=size, max_count=args.max_count, max_side=args.max_side,
            quality=args.quality, verify=not args.no_verify, strict=args.strict,
            overwrite=args.overwrite, progress=progress, report=report,
            storage_options=options, trust_list=args.trust_list, seekable=args.seekable,
            restart=restart, resume=args.resume,
            workers=args.workers or len(os.sched_getaffinity(0)))
    except shards.ShardWriteError as e:
        print(f"echo-native make-shards: {e} (--strict: nothing more written)", file=sys.stderr)
        return 1
    except (FileExistsError, FileNotFoundError, RemoteReadError, ImportError) as e:
        raise UsageError(str(e)) from None
    except ValueError as e:  # a bad list file, an empty folder
        raise UsageError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - sorted below: a store's or the disk's, or ours
        where = next((w for w in (args.out, args.src) if is_url(str(w))), None)
        if not _from_a_store(e) or where is None and not isinstance(e, OSError):
            raise  # a bug here: its traceback is what helps
        raise CommandError(_store_failure(e, where or args.out)) from None
    skipped = len(result.failures)
    if not args.quiet:
        extra = f", {result.reencoded} re-encoded" if result.reencoded else ""
        if args.seekable:
            extra += f", {len(result.not_seekable)} not seekable (stored as they were)"
        if result.resumed:
            extra += f", {result.resumed} shards kept from an interrupted run"
        print(f"wrote {result.samples} samples in {len(result)} shards to "
              f"{shards.shown(result[0].rsplit('/', 1)[0] if result else args.out)}"
              f"{extra}; {skipped} inputs skipped")
    return 0 if result.samples or result.resumed else 1


# Packages whose exceptions are a store's answer (or its absence), not a bug here.
_BACKENDS = {"botocore", "aiobotocore", "boto3", "s3fs", "fsspec", "aiohttp", "gcsfs",
             "google", "adlfs", "azure", "requests", "urllib3"}


def _from_a_store(e):
    from echo_native.remote_errors import _chain

    return any(isinstance(x, OSError) or type(x).__module__.split(".")[0] in _BACKENDS
               for x in _chain(e))


def _store_failure(e, where):
    """One line for a failure of the store (or disk) at ``where``: what happened, without
    credentials, and for a missing configuration where it comes from."""
    from echo_native.remote_errors import _CONFIG_ERRORS, _chain, _error_text, redact
    from echo_native.remote import is_url

    shown = redact(str(where)) if is_url(str(where)) else str(where)
    text = f"{shown}: {_error_text(e)}"
    if any(type(x).__name__ in _CONFIG_ERRORS for x in _chain(e)):
        text += (" (credentials, region and endpoint come from the backend's environment "
                 "or config files, or -o KEY=VALUE storage options)")
    return text


def build_parser():
    p, sub = command_parser(
        "echo-native", "echo_native: fused JPEG decode + shared-memory ring + data echoing.",
        "Benchmarks, data sets and the training demo: echo-native-lab --help.")
    pr = sub.add_parser("profile", help="measure R = t_upstream / t_downstream and recommend "
                                        "an echo factor")
    pr.add_argument("dir", help="ImageFolder root")
    pr.add_argument("--step-ms", type=float, default=None,
                    help="the consumer's (training step's) time per batch in ms")
    pr.add_argument("--model-fn", default=None, metavar="MODULE:FUNCTION",
                    help="time FUNCTION(batch) on a real batch instead of --step-ms "
                         "(batch.images is (B,H,W,3) uint8, batch.labels (B,))")
    loader_options(pr)
    pr.add_argument("--seconds", type=float, default=3.0, help="upstream measuring time")
    pr.add_argument("--min-batches", type=int, default=8)
    pr.add_argument("--max-echo", type=float, default=4.0, help="cap on the recommended e")
    pr.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    pr.add_argument("--auto-seconds", type=float, default=5.0,
                    help="then run echo='auto' against the consumer this long and show "
                         "how e moved (0: skip)")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--json", default=None,
                    help="write the result here as JSON (default: not written)")
    pr.set_defaults(func=cmd_profile)

    ms = sub.add_parser("make-shards", aliases=["shards"],
                        help="pack an ImageFolder, a FileList or existing shards into tar "
                             "shards (local or object storage), seekable with --seekable",
                        description="Pack images into WebDataset-style tar shards (key.jpg + "
                                    "key.cls, shard-000000.tar, ...) with .idx sidecars, "
                                    "for TarShards.")
    ms.add_argument("src", help="an ImageFolder root, a FileList (path,label rows; a file "
                                "or a URL), or a folder of shard-*.tar")
    ms.add_argument("out", help="output folder or URL (s3://bucket/prefix, gs://..., ...)")
    ms.add_argument("--shard-size", default="256MB",
                    help="largest shard, e.g. 256MB, 1GiB (default 256MB)")
    ms.add_argument("--max-count", type=int, default=None, help="most samples per shard")
    ms.add_argument("--max-side", type=int, default=None,
                    help="re-encode images whose longer side is over this many pixels "
                         "(aspect kept) as JPEG")
    ms.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded "
                                                            "images (default 90)")
    ms.add_argument("--no-verify", action="store_true",
                    help="check image headers only (default: decode each image once)")
    ms.add_argument("--strict", action="store_true",
                    help="stop at the first unreadable or corrupt input (default: report, "
                         "skip and count it)")
    ms.add_argument("--overwrite", action="store_true",
                    help="replace shards already in OUT")
    ms.add_argument("--trust-list", action="store_true",
                    help="a list read from a URL may name local paths and other schemes "
                         "(default: only paths relative to the list, or URLs of its scheme)")
    ms.add_argument("-o", "--storage-option", type=storage_option, action="append",
                    metavar="KEY=VALUE",
                    help="fsspec storage option for URLs, e.g. endpoint_url=http://host:9000 "
                         "(repeatable; JSON values allowed)")
    ms.add_argument("--seekable", action="store_true",
                    help="store each JPEG seekable: losslessly re-encoded with restart markers "
                         "and an index, so crops decode only their own blocks (same pixels)")
    ms.add_argument("--restart", default=None, metavar="MCUS|row",
                    help="with --seekable: MCUs per restart interval, or 'row' (default: "
                         "segments 128 pixels wide)")
    ms.add_argument("--workers", type=int, default=None,
                    help="threads reading, verifying and transcoding (default: every core)")
    ms.add_argument("--resume", action="store_true",
                    help="keep the complete shards an interrupted run left in OUT (local) and "
                         "go on after them")
    ms.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    ms.set_defaults(func=cmd_make_shards)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in LAB_COMMANDS:
        print(f"echo-native: error: {argv[0]!r} is a lab command: run echo-native-lab "
              f"{argv[0]} (or python -m echo_native.lab {argv[0]})", file=sys.stderr)
        return 2
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
