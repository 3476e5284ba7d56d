"""`skip-harness`: look at, tidy, export and import rollout caches from the command line.

    skip-harness ls [DUMP_DIR] [--steps] [--sort name|size|written|accessed] [--json]
    skip-harness verify [DUMP_DIR] [--steps] [--json]
    skip-harness clean [DUMP_DIR] [--dry-run] [--quarantine] [--keep-last N] [--older-than AGE]
                       [--max-size SIZE] [--pin STEP ...] [--json]
    skip-harness show PATH [STEP [INNER]] [--rank R] [--head N] [--json]
    skip-harness export [DUMP_DIR] -o OUT [--format parquet|jsonl] [--namespace NS ...] [--steps 1,3,5-9]
    skip-harness import-verl VERL_DUMP_DIR [DUMP_DIR] --trust [--dry-run] [--json]
    skip-harness diff A B [--json]
    skip-harness pack NAMESPACE [--steps A-B] -o FILE [--json]
    skip-harness unpack FILE DUMP_DIR [--json]
    skip-harness replay PACK [--bless] [--json] -- COMMAND [ARGS...]
    skip-harness view [DUMP_DIR | NAMESPACE ...] [--host 127.0.0.1] [--port N] [--tokenizer NAME_OR_PATH] [--open]

Exit codes: 0 fine; 1 a corrupt step (verify, show, export), a failed removal (clean) or a verl step that
could not be converted (import-verl); 2 bad usage,
a path that is not there, or import-verl without --trust; 3 a namespace was locked by a running job
(clean, import-verl; other namespaces are still handled). diff: 0 identical, 1 they differ, 2 bad input. DUMP_DIR may be the cache root, one
`{experiment}_{project}` directory, or one namespace directory or a pack file (`skip-harness pack`; read in place); without it, the directory runs write to
($SKIP_HARNESS_DUMP_DIR, else the per-user cache directory), named in the output. Tables go to stdout; progress bars go
to stderr when it is a terminal (plain log lines otherwise); errors are one line on stderr.
"""
from __future__ import annotations

import argparse
import os
import logging
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from skip_harness.store.api import RetentionRules, UrlPath, is_pack, parse_age, parse_size
from skip_harness.errors import SkipHarnessError

from skip_harness.cli._common import (EXIT_OK, EXIT_USAGE, SORT_KEYS, CliError, check_place, default_dump_dir, emit_json,
                      namespaces_under, require_dir,
                      stdout_console, where_of)

__all__ = ["main", "build_parser"]


def _int_at_least(low: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{what} must be >= {low}, got {value}")
        return value
    return parse


def _age(text: str) -> float:
    try:
        return parse_age(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pins(text: str):
    out = []
    for part in text.split(","):
        try:
            out.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--pin takes step numbers, got {part!r}") from None
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:   # one line, exit 2, no usage dump
        sys.stderr.write(f"{self.prog}: {message}\n")
        sys.exit(EXIT_USAGE)


_DUMP_DIR_HELP = ("the cache root, one {experiment}_{project} directory or one namespace; default: where runs "
                  "write ($SKIP_HARNESS_DUMP_DIR, else the per-user cache directory)")


def _dump_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump_dir", metavar="DUMP_DIR", nargs="?", default=None, help=_DUMP_DIR_HELP)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="skip-harness", description="Inspect, tidy, export and import skip_harness rollout caches.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    ls = sub.add_parser("ls", help="namespaces and steps: status, sizes, ages, fingerprint, generation time")
    _dump_dir(ls)
    ls.add_argument("--steps", action="store_true", help="a table of every step too")
    ls.add_argument("--sort", choices=SORT_KEYS, default="name",
                    help="namespaces by name (default), size (largest first), last written or last read "
                         "(most recent first)")
    ls.add_argument("--json", action="store_true", help="print one JSON document")

    ve = sub.add_parser("verify", help="check every step: commit record, sizes, checksums, safe load")
    _dump_dir(ve)
    ve.add_argument("--steps", action="store_true", help="a table of every step, not only the failing ones")
    ve.add_argument("--json", action="store_true", help="print one JSON document")

    cl = sub.add_parser("clean", help="remove (or quarantine) incomplete and corrupt steps; retention rules")
    _dump_dir(cl)
    cl.add_argument("--dry-run", action="store_true", help="show what would go and the bytes freed; change nothing")
    cl.add_argument("--quarantine", action="store_true", help="move steps under {namespace}/.quarantine/")
    cl.add_argument("--keep-last", type=_int_at_least(0, "--keep-last"), metavar="N",
                    help="keep the N most recently written complete steps of each namespace, remove the others")
    cl.add_argument("--older-than", type=_age, metavar="AGE", help="remove complete steps written before AGE ago "
                    "(90s, 30m, 12h, 7d, 2w)")
    cl.add_argument("--max-size", type=_size, metavar="SIZE", help="remove the oldest complete steps until "
                    "everything under DUMP_DIR fits in SIZE (500MiB, 20GiB, 1TB)")
    cl.add_argument("--pin", type=_pins, action="append", default=[], metavar="STEP",
                    help="never remove this step by a retention rule (repeat, or 3,7,9)")
    cl.add_argument("--json", action="store_true", help="print one JSON document")

    sh = sub.add_parser("show", help="what one cached mini-batch holds (loaded safely)")
    sh.add_argument("path", metavar="PATH", help="a namespace, a step directory, or a payload file")
    sh.add_argument("step", metavar="STEP", nargs="?", type=_int_at_least(0, "STEP"),
                    help="default: the newest complete step")
    sh.add_argument("inner", metavar="INNER", nargs="?", type=_int_at_least(0, "INNER"),
                    help="inner index (default 0)")
    sh.add_argument("--rank", type=_int_at_least(0, "--rank"), default=0, help="rank (default 0)")
    sh.add_argument("--head", type=_int_at_least(0, "--head"), default=0, metavar="N",
                    help="also print the first N entries of every field")
    sh.add_argument("--json", action="store_true", help="print one JSON document")

    ex = sub.add_parser("export", help="every complete step as rows: Parquet or JSON lines")
    _dump_dir(ex)
    ex.add_argument("-o", "--output", required=True, metavar="OUT", help="the file to write")
    ex.add_argument("--format", choices=("parquet", "jsonl"), help="default: from OUT's suffix, else parquet")
    ex.add_argument("--namespace", action="append", default=[], metavar="NS",
                    help="only these namespaces (relative path, group or leaf name, or a pattern; repeat)")
    ex.add_argument("--steps", metavar="STEPS", help="only these steps: 1,3,10-20")
    ex.add_argument("--json", action="store_true", help="print a JSON summary")

    iv = sub.add_parser("import-verl", help="convert a cache verl wrote into committed skip_harness steps")
    iv.add_argument("verl_dump_dir", metavar="VERL_DUMP_DIR")
    _dump_dir(iv)
    iv.add_argument("--trust", action="store_true",
                    help="load verl's pickled payloads (torch.load(weights_only=False): runs code from the files)")
    iv.add_argument("--dry-run", action="store_true", help="list what would be converted; loads nothing")
    iv.add_argument("--json", action="store_true", help="print one JSON document")

    df = sub.add_parser("diff", help="two namespaces or cache roots step by step: rollouts, recorded values, config")
    df.add_argument("a", metavar="A", help="a namespace or a cache root (a path or an object-store URL)")
    df.add_argument("b", metavar="B", help="the same kind of thing as A")
    df.add_argument("--json", action="store_true", help="print one JSON document")
    df.add_argument("--rtol", type=float, metavar="R", help="compare values within this relative tolerance "
                    "(as skip.rollout_tq.replay_rtol; default: the replay side's replay check's, else exact)")
    df.add_argument("--atol", type=float, metavar="A", help="... and this absolute one (as replay_atol)")
    df.add_argument("--tolerances", metavar="JSON", help='per-key tolerances, as replay_tolerances: '
                    '\'{"loss": {"rtol": 1e-6, "atol": 0}}\' (fnmatch patterns, the first that matches wins)')

    pk = sub.add_parser("pack", help="one namespace's committed steps as one portable, checksummed file")
    pk.add_argument("namespace", metavar="NAMESPACE", help="the namespace to pack (its directory)")
    pk.add_argument("-o", "--output", required=True, metavar="FILE", help="the pack file to write (replaced atomically)")
    pk.add_argument("--steps", metavar="A-B", help="only these steps: 1-5, 3, 10-, 1,4,7 (default: every complete one)")
    pk.add_argument("--json", action="store_true", help="print the pack's manifest summary as JSON")

    up = sub.add_parser("unpack", help="restore the namespace a pack file holds under DUMP_DIR")
    up.add_argument("pack", metavar="FILE", help="a pack file")
    up.add_argument("target", metavar="DUMP_DIR", help="the cache root to restore it under")
    up.add_argument("--json", action="store_true", help="print one JSON document")
    rp = sub.add_parser("replay", help="run a trainer serving every step from a recording; exit 0 reproduced, "
                        "1 diverged, 2 could not run or generated a step")
    rp.add_argument("pack", metavar="PACK", help="a pack file (skip-harness pack) or a namespace directory")
    rp.add_argument("--bless", action="store_true",
                    help="accept the run's values as the recording's expected ones (with the change that made them)")
    rp.add_argument("--json", action="store_true", help="print the verdict as one JSON document")
    rp.add_argument("command_args", metavar="-- COMMAND [ARGS...]", nargs="*",
                    help="the trainer to run (any built on skip_harness), after --")

    vw = sub.add_parser("view", help="a read-only web viewer of the cache (extra [view])")
    vw.add_argument("targets", metavar="DUMP_DIR | NAMESPACE", nargs="*",
                    help="cache roots, group directories or namespaces (local or s3://); default: where runs write")
    vw.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine only)")
    vw.add_argument("--port", type=_int_at_least(0, "--port"), default=None, metavar="N",
                    help="port (default 8765; 0 picks a free one)")
    vw.add_argument("--tokenizer", metavar="NAME_OR_PATH",
                    help="decode token ids with this tokenizer (a local directory or tokenizer.json, or a name "
                         "in the local Hugging Face cache; never downloaded)")
    vw.add_argument("--open", action="store_true", help="open the viewer in a web browser")
    return p


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (so redirections and tests see it)."""

    def __init__(self):
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"skip-harness: {level}{record.getMessage()}"


def _setup_logging():
    pkg = logging.getLogger("skip_harness")
    cli = logging.getLogger("skip_harness.cli")
    saved = (pkg.handlers[:], pkg.level, pkg.propagate, cli.level)
    handler = _CurrentStderr()
    handler.setFormatter(_Formatter())
    pkg.handlers = [handler]
    pkg.propagate = False
    if pkg.level == logging.NOTSET or pkg.level > logging.WARNING:
        pkg.setLevel(logging.WARNING)
    cli.setLevel(logging.INFO)
    return saved


def _restore_logging(saved) -> None:
    pkg = logging.getLogger("skip_harness")
    pkg.handlers, level, pkg.propagate, cli_level = saved[0], saved[1], saved[2], saved[3]
    pkg.setLevel(level)
    logging.getLogger("skip_harness.cli").setLevel(cli_level)


#: The arguments that name a place (attribute, metavar): each is checked before any command starts.
_PLACES = (("dump_dir", "DUMP_DIR"), ("path", "PATH"), ("a", "A"), ("b", "B"), ("verl_dump_dir", "VERL_DUMP_DIR"),
           ("targets", "DUMP_DIR | NAMESPACE"), ("namespace", "NAMESPACE"), ("pack", "FILE"), ("target", "DUMP_DIR"))


def _run(args: argparse.Namespace) -> int:
    for attr, metavar in _PLACES:   # a URL look-alike (s3:/x) is the run's message, not "does not exist"
        value = getattr(args, attr, None)
        for text in ([] if value is None else value if isinstance(value, list) else [value]):
            check_place(text, metavar)
    if args.command == "diff":
        from skip_harness.cli.diff import cmd_diff, tolerances_of

        return cmd_diff(args.a, args.b, args.json, tolerances_of(args.rtol, args.atol, args.tolerances))
    if args.command == "show":
        from skip_harness.cli.show import cmd_show

        return cmd_show(where_of(args.path, "PATH"), args.step, args.inner, args.rank, args.head, args.json)  # type: ignore[arg-type]
    if args.command == "pack":
        from skip_harness.cli.pack import cmd_pack

        return cmd_pack(where_of(args.namespace, "NAMESPACE"), Path(args.output), args.steps, args.json)
    if args.command == "unpack":
        from skip_harness.cli.pack import cmd_unpack

        return cmd_unpack(Path(args.pack), where_of(args.target, "DUMP_DIR"), args.json)
    if args.command == "replay":
        from skip_harness.cli.replay import cmd_replay

        return cmd_replay(args.pack, args.command_args, args.bless, args.json)
    if args.command == "view":
        from skip_harness.cli.view import cmd_view

        return cmd_view(args.targets, args.host, args.port, args.tokenizer, args.open)
    where = ""
    # a Path, or an object store's UrlPath (opened through the store, never a Path): the commands below
    # take either, given or where runs write
    dump_dir: Any
    if args.dump_dir is None:   # where runs write
        dump_dir, where = default_dump_dir()
    else:
        dump_dir = where_of(args.dump_dir, "DUMP_DIR")
    if args.command == "import-verl":
        from skip_harness.cli.import_verl import cmd_import_verl

        require_dir(Path(args.verl_dump_dir))
        return cmd_import_verl(Path(args.verl_dump_dir), dump_dir, args.trust, args.dry_run, args.json)
    as_json = getattr(args, "json", False)
    if where and not isinstance(dump_dir, UrlPath) and not dump_dir.exists() and args.command != "export":
        # nothing was cached yet where runs write: nothing to list, verify or clean
        if as_json:
            emit_json({"dump_dir": str(dump_dir), "namespaces": []})
        else:
            stdout_console().print(f"no skip_harness cache at {dump_dir} yet ({where})")
        return EXIT_OK
    if not isinstance(dump_dir, UrlPath) and not is_pack(dump_dir):
        dump_dir = require_dir(dump_dir)
    layouts = namespaces_under(dump_dir)
    if not layouts and not as_json and args.command != "export":
        stdout_console().print(f"no skip_harness namespaces under {dump_dir}{f' ({where})' if where else ''}")
    if args.command == "ls":
        from skip_harness.cli.listing import cmd_ls

        return cmd_ls(layouts, dump_dir, as_json, args.steps, args.sort, where)
    if args.command == "verify":
        from skip_harness.cli.listing import cmd_verify

        return cmd_verify(layouts, dump_dir, as_json, args.steps)
    if args.command == "clean":
        from skip_harness.cli.clean import cmd_clean

        rules = RetentionRules(args.keep_last, args.older_than, args.max_size,
                               frozenset(s for group in args.pin for s in group))
        return cmd_clean(layouts, dump_dir, dry_run=args.dry_run, quarantine=args.quarantine, as_json=as_json,
                         rules=rules)
    from skip_harness.cli.export import cmd_export

    if not layouts:
        raise CliError(f"{dump_dir}: no skip_harness namespaces to export")
    return cmd_export(layouts, dump_dir, Path(args.output), args.format, args.namespace, args.steps, as_json)


def _quiet_stdout() -> None:
    """stdout's reader went away: point stdout at /dev/null, so the interpreter's flush at exit does not
    print `Exception ignored ... BrokenPipeError` (Python's documented way: the signal module's SIGPIPE note)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):   # stdout is not a file descriptor (a test's capture)
        pass


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """The arguments; `replay`'s COMMAND is everything after its first `--`, whatever options it holds."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["replay"] and "--" in words:
        cut = words.index("--")
        args = build_parser().parse_args(words[:cut])
        args.command_args = words[cut + 1:]
        return args
    return build_parser().parse_args(words)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    saved = _setup_logging()
    log = logging.getLogger("skip_harness.cli")
    try:
        return _run(args)
    except CliError as exc:
        log.error("%s", exc)
        return exc.code
    except SkipHarnessError as exc:   # anything the package raises on purpose names its path or key
        log.error("%s", exc)
        return EXIT_USAGE
    except BrokenPipeError:   # `skip-harness ls | head -2`: the reader has what it wanted; nothing failed
        _quiet_stdout()
        return EXIT_OK
    except OSError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    finally:
        _restore_logging(saved)


