"""Every option of every `pnmix` command, given values it must refuse.

The commands and their options come from the Typer app itself (through Click's introspection), and
the bad values from each option's declared domain (its `pnmix.inputs` parser: a range, a set of
names, a kind of path), so a new option is fuzzed without editing this test; an option without a
parser fails the test. Each case runs the real entry point, `api.cli.main`, in this process (a
subprocess per case would cost a minute of start-ups) and must:
- exit with code 2, print exactly one line on stderr (`error: ...`) and no traceback;
- create no file or folder (in the working folder, the home and data folders, the model cache:
  all of them in the test's own folder)
  and leave a symbolic link, device or directory it was pointed at as it was;
- leave the default database's fronts as they were.
No case loads a model: every value here is refused before that (no command needs an exclusion).
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main

from pnmix import inputs
from pnmix.api import cli
from pnmix.storage import vocabulary

# Command paths -> why some of their options' bad values cannot be run here (none so far).
EXCLUDED: dict[tuple[str, ...], str] = {}


def leaf_commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, command in sorted(getattr(group, "commands", {}).items()):
        if getattr(command, "commands", None):
            yield from leaf_commands(command, (*path, name))
        else:
            yield (*path, name), command


def parser_of(param: Any) -> Any:
    """The `parser=` an option was declared with (typer keeps it on its parameter info)."""
    info = getattr(getattr(param, "type_descriptor", None), "parameter_info", None)
    if info is not None and getattr(info, "parser", None) is not None:
        return info.parser
    return getattr(getattr(param, "type", None), "func", None)


def is_flag(param: Any) -> bool:
    return bool(getattr(param, "is_flag", False) or getattr(param, "is_bool_flag", False))


def number_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


class Places:
    """The special paths the path options are given, made once in the test's folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folder = root / "a-folder"
        self.folder.mkdir()
        self.target = root / "target.json"
        self.target.write_text("{}\n")
        self.link = root / "link.json"
        self.link.symlink_to(self.target)
        self.fifo = root / "fifo"
        os.mkfifo(self.fifo)
        self.regular = root / "regular.txt"
        self.regular.write_text("not a folder\n")
        self.missing = root / "missing-folder" / "x.json"
        self.long = str(root / ("x" * 10_000))
        self.unwritable = "/proc/pnmix-fuzz-nothing.json"  # no one, not even root, makes a file in /proc
        # Config files whose contents are bad in the ways a parser lets slip: a key twice (in the
        # config, in a layer range, a range twice), layers in other scripts' digits, other encodings.
        contents = {
            "twice": ('{"b_high": 4, "b_high": 3}', "utf-8"),
            "range-twice": ('{"default": {}, "layers": {"0-3": {"b_high": 4}, "0-3": {"b_high": 2}}}', "utf-8"),
            "field-twice": ('{"default": {"b_low": 1, "b_low": 2}}', "utf-8"),
            "superscript": ('{"default": {}, "layers": {"\u00b2": {"b_high": 4}}}', "utf-8"),
            "arabic-digits": ('{"default": {}, "layers": {"\u0661-\u0663": {"b_high": 4}}}', "utf-8"),
            "fullwidth": ('{"default": {}, "layers": {"\uff11": {"b_high": 4}}}', "utf-8"),
            "utf16": ('{"b_high": 3}', "utf-16"),
            "utf32": ('{"b_high": 3}', "utf-32"),
        }
        self.bad_configs = []
        for name, (text, encoding) in contents.items():
            path = root / f"config-{name}.json"
            path.write_bytes(text.encode(encoding))
            self.bad_configs.append(str(path))


def bad_values(parser: Any, places: Places) -> list[str]:
    """Values `parser`'s domain excludes, generated from the domain itself."""
    junk = ["", "x" * 10_000, "\u00e9\u00e8\u2603", "-"]
    if isinstance(parser, inputs.Int):
        r = parser.range
        values = ["", "x", "1.5", "nan", "inf", "0x10", " 7", "\u0661\u0662", "\u00b2", "\uff17", "9" * 5000,
                  "-" + "9" * 40,
                  number_text(r.low - 1), number_text(r.high + 1)]
        if parser.values:  # a gap between allowed values
            values += [str(v) for v in range(int(r.low), int(r.high)) if v not in parser.values][:2]
        if r.even:
            values.append(number_text(r.low + 1))
        return values
    if isinstance(parser, inputs.Number):
        r = parser.range
        values = ["", "x", "nan", "inf", "-inf", "1e309", "1e308", "1,5", "0x1p3", "9" * 5000,
                  number_text(r.low - 1), number_text(r.high + 1)]
        return values + ([number_text(r.low)] if r.low_open else [])
    if isinstance(parser, inputs.Names):
        names = parser.names
        values = ["", ",,", "nope", f"{names[0]},{names[0]}", f"{names[0]},nope", "x" * 10_000, f"{names[0]}:"]
        if parser.must_include:
            values.append(parser.must_include[0])  # one of those it must include, alone
        return values
    if isinstance(parser, inputs.Choice):
        names = parser.names
        return [*junk, "nope", names[0] + " ", names[0].upper() if names[0].upper() != names[0] else "NOPE"]
    if isinstance(parser, inputs.ModelName):
        # unknown everywhere: not in the registry, the database, the disk or the local hub cache
        return ["", "x" * 256, "a\nb", "no-such-model-\u00e9", "pnmix-fuzz-org/not-cached", "a/b/c"]
    if isinstance(parser, inputs.Text):
        values = [""] if parser.min_length >= 1 else []
        if parser.max_length < 1 << 21:
            values.append("x" * (parser.max_length + 1))
        return values + ([] if parser.lines else ["a\x01b"])
    if isinstance(parser, vocabulary.Host):
        return ["", "bad host", "x" * 300, "\u00e9.example", "a/b"]
    if isinstance(parser, vocabulary.DatabaseUrl):
        values = ["", "nonsense", "x" * 10_000, "sqlite://", "sqlite:///:memory:", "mysql://u@h/db",
                  "postgresql://u:pw@/db"]
        # query parameters that the driver would read as numbers or flags
        values += [f"sqlite:///{places.root}/q.db?{q}" for q in ("timeout=abc", "timeout=inf", "uri=true&mode=ro")]
        if parser.must_exist:
            values += [f"sqlite:///{places.missing.with_suffix('.db')}", f"sqlite:///{places.folder}"]
        return values
    if isinstance(parser, inputs.OutputFile):
        values = ["", " ", places.long, str(places.folder), str(places.link), "/dev/null", str(places.fifo),
                  places.unwritable if not parser.create_folders else "/proc/pnmix-fuzz/x.json"]
        return values + ([] if parser.create_folders else [str(places.missing)])
    if isinstance(parser, inputs.OutputFolder):
        return ["", places.long, str(places.regular), str(places.link), "/dev/null", str(places.fifo),
                "/proc/pnmix-fuzz"]
    if isinstance(parser, inputs.InputFile):
        return ["", places.long, str(places.missing), str(places.folder), "/dev/null", str(places.fifo)]
    if isinstance(parser, vocabulary.Shard):
        return ["", "1/1", "2/1", "-1/2", "a/b", "0/0", "1/", "9" * 50 + "/1"]
    raise AssertionError(f"no bad values for parser {type(parser).__name__}: teach this test its domain")


# Valid values for the options a command requires, so that the option under test is what is refused.
REQUIRED = {"prompt": "hi", "out": "sweep.jsonl",
            "config_file": str(Path(__file__).resolve().parent / "data" / "config.json")}  # pnmix-paper


def cases(places: Places) -> list[tuple[tuple[str, ...], list[str]]]:
    app = typer.main.get_command(cli.app)
    out = []
    for path, command in leaf_commands(app):
        if path in EXCLUDED:
            continue
        required = []
        for param in command.params:
            if getattr(param, "required", False):
                required += [max(param.opts, key=len), REQUIRED[param.name]]
        for param in command.params:
            if is_flag(param) or param.name == "help":
                continue
            parser = parser_of(param)
            assert isinstance(parser, inputs.Parser), (
                f"pnmix {' '.join(path)} {param.opts}: no pnmix.inputs parser, so nothing checks its values")
            option = max(param.opts, key=len)
            contents = places.bad_configs if param.name == "config_file" else []
            for value in [*bad_values(parser, places), *contents]:
                others = [a for i, a in enumerate(required) if not (i % 2 == 0 and a == option)
                          and not (i % 2 == 1 and required[i - 1] == option)]
                out.append((path, [*path, *others, option, value]))
    return out


def snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every path under the roots with its type and size; SQLite's -wal/-shm beside the existing
    database are its own (a reader opens them), not something a command made."""
    seen: dict[str, tuple[int, int]] = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            for name in [*dirs, *files]:
                if name.endswith(("-wal", "-shm")):
                    continue
                p = os.path.join(folder, name)
                st = os.lstat(p)
                seen[p] = (stat.S_IFMT(st.st_mode), st.st_size if stat.S_ISREG(st.st_mode) else 0)
    return seen


def stored_fronts(url: str) -> list[tuple]:
    from pnmix.storage import Database, list_front_points

    db = Database(url, create=False)
    try:
        with db.session(readonly=True) as s:
            page = list_front_points(s, "smollm2-135m")
            return sorted((p.campaign_id, p.budget, p.trial_number, p.accuracy, p.key_bits) for p in page.items)
    finally:
        db.dispose()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Places, Path, str]]:
    """A home, a data folder with the default database (fronts stored), a working folder, special paths."""
    from pnmix.config import preset
    from pnmix.storage import Database, FrontPointIn, create_campaign, replace_front, upgrade

    root = tmp_path_factory.mktemp("fuzz")
    home, data, work, special = root / "home", root / "data", root / "work", root / "places"
    for folder in (home, data, work, special):
        folder.mkdir()
    places = Places(special)
    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.startswith("PNMIX_")]:
            mp.delenv(name)
        mp.setenv("PNMIX_CACHE_DIR", str(root / "cache"))  # its own: other test runs write to the shared one
        mp.setenv("HOME", str(home))
        mp.setenv("XDG_DATA_HOME", str(data))
        mp.chdir(work)
        url = f"sqlite:///{data / 'pnmix' / 'pnmix.db'}"
        db = Database(url)
        upgrade(db)
        with db.session() as s:
            campaign = create_campaign(s, "smollm2-135m", [3.0], n_trials=4, status="running", worker_id="fuzz")
            replace_front(s, campaign.id, 3.0, [
                FrontPointIn(preset("pnmix-paper"), 0.9, 2000, 20.0, 1, "torch", "cpu", accuracy_se=0.02),
                FrontPointIn(preset("kivi2"), 0.85, 1900, 40.0, 2, "torch", "cpu", accuracy_se=0.02)])
        db.dispose()
        yield places, root, url


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(argv)
        except SystemExit as exc:
            return int(exc.code or 0), out.getvalue(), err.getvalue()
    return 0, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("part", [0, 1])
def test_every_option_refuses_bad_values_in_one_line_and_changes_nothing(world, part):
    """Every other case in each part: two halves that a parallel run spreads over its workers."""
    places, root, url = world
    before, fronts = snapshot(root), stored_fronts(url)
    link_target = os.readlink(places.link)
    all_cases = cases(places)
    assert len(all_cases) > 500 and len({path for path, _ in all_cases}) >= 15  # all but `models`
    all_cases = all_cases[part::2]
    failures = []
    for _, argv in all_cases:
        code, _, err = run(argv)
        lines = err.strip().splitlines()
        if code != 2 or len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in err:
            failures.append(f"pnmix {inputs.shorten(' '.join(argv), 200)}: exit {code}, stderr {err[-800:]!r}")
            continue
        after = snapshot(root)
        if after != before:
            made = sorted(set(after) - set(before)) + sorted(k for k in before if after.get(k) != before[k])
            failures.append(f"pnmix {inputs.shorten(' '.join(argv), 200)}: changed {made[:5]}")
            before = after
    assert not failures, f"{len(failures)} of {len(all_cases)} cases:\n" + "\n".join(failures[:30])
    assert stored_fronts(url) == fronts
    assert os.readlink(places.link) == link_target and places.target.read_text() == "{}\n"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and stat.S_ISFIFO(os.lstat(places.fifo).st_mode)
