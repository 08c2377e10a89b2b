"""
C{--config FILE}: every server option in one TOML file.

One table per server, named as its twistd plugin (C{[styx-server]},
C{[lumberjack-server]}, ...), and C{[streamproto]} for the umbrella's own
options.  A key is an option's long name (C{max-frame} or C{max_frame});
a value is what the command line would take (a list for a repeatable
option such as C{port}; C{true} for a flag).  The command line wins: an
option given there ignores the file's value (for a repeatable option, all
of the file's values).

The file is read with the standard library's C{tomllib}; nothing is
derived by hand per server: the keys a table accepts are the options of
the plugin's own C{usage.Options}, so an option a server gains is
available in the file at once.
"""

import getopt
import sys
import tomllib
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from twisted.python import reflect, usage

#: an option's value from a table: what the command line would give, or
#: C{True} for a flag that is set
OptionValue = str | Literal[True]


def load_config(path: str) -> dict[str, Any]:
    """
    @return: the parsed TOML document (a dict of tables).
    @raise usage.UsageError: naming the file and why it cannot be used.
    """
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as e:
        raise usage.UsageError(f"--config {path!r}: cannot read it: {e.strerror or e}")
    except tomllib.TOMLDecodeError as e:
        raise usage.UsageError(f"--config {path!r}: not valid TOML: {e}")
    for name, table in document.items():
        if not isinstance(table, dict):
            raise usage.UsageError(f"--config {path!r}: {name!r} must be a table "
                                   f"([{name}]), one per server")
    return document


def given_options(options: usage.Options, argv: Sequence[str]) -> set[str]:
    """
    The long names of the options C{argv} gives on the command line (for
    C{options}, a C{usage.Options}); empty if it does not parse (the real
    parse then reports why).
    """
    try:
        opts, _ = getopt.getopt(argv, options.shortOpt, options.longOpt)
    except getopt.error:
        return set()
    given: set[str] = set()
    for opt, _ in opts:
        name = opt[2:] if opt.startswith("--") else opt[1:]
        given.add(_long_name(options, name) or name)
    return given


def _long_name(options: usage.Options, name: str) -> str | None:
    """The canonical long name of option C{name} (a long or short name), or None."""
    for candidate in (name, name.replace("-", "_"), name.replace("_", "-")):
        # usage.Options builds synonyms (alias -> long name) untyped
        canonical: str | None = options.synonyms.get(candidate)
        if canonical is not None:
            return canonical.replace("_", "-")
    return None


def _takes_value(options: usage.Options, name: str) -> bool:
    return any(o.rstrip("=") == name and o.endswith("=") for o in options.longOpt) or any(
        o.rstrip("=") == name.replace("-", "_") and o.endswith("=") for o in options.longOpt)


def table_values(options: usage.Options, table: Mapping[str, Any], where: str,
                 skip: Collection[str] = ()) -> list[tuple[str, OptionValue]]:
    """
    The option values C{table} gives for C{options}: C{(long name, value)}
    pairs in the table's order, each value as the command line would give
    it (a string), or C{True} for a flag that is set.

    @param where: names the table in errors (C{"--config x.toml [styx-server]"}).
    @param skip: long names not to take from the table (given on the
        command line, or set by the caller).
    @raise usage.UsageError: for a key that is not an option of C{options},
        or a value of the wrong kind.
    """
    values: list[tuple[str, OptionValue]] = []
    for key, value in table.items():
        name = _long_name(options, str(key))
        if name is None or name in ("config", "help", "version"):
            raise usage.UsageError(f"{where}: unknown option {key!r}")
        if name in skip:
            continue
        if _takes_value(options, name):
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, (dict, list)):
                    raise usage.UsageError(f"{where}: {key!r} takes a value, not {v!r}")
                if isinstance(v, bool):
                    v = "true" if v else "false"
                values.append((name, str(v)))
        else:
            if not isinstance(value, bool):
                raise usage.UsageError(f"{where}: {key!r} is a flag: true or false")
            if value:
                values.append((name, True))
    return values


def table_arguments(options: usage.Options, table: Mapping[str, Any], where: str,
                    skip: Collection[str] = ()) -> list[str]:
    """
    The command-line arguments equivalent to C{table} for C{options} (see
    L{table_values}), for a parse where the command line wins.
    """
    return [f"--{name}" if value is True else f"--{name}={value}"
            for name, value in table_values(options, table, where, skip)]


def set_option(options: usage.Options, name: str, value: OptionValue) -> None:
    """
    Give option C{name} (a long name) of C{options}, a C{usage.Options},
    C{value} as its command line would, without one: through the option's
    C{opt_} method, or coerced as its C{optParameters} entry says (the
    same usage error for a bad value); C{True} sets a flag.  Nothing is
    checked beyond that: C{postOptions} is not called.
    """
    method = getattr(options, "opt_" + name.replace("-", "_"), None)
    if method is not None:
        if value is True:
            method()
        else:
            method(value)
        return
    # optParameters entries: [long, short, default, doc(, coerce)]
    parameters: list[list[Any]] = []
    reflect.accumulateClassList(  # type: ignore[no-untyped-call]  # untyped in Twisted
        type(options), "optParameters", parameters)
    for parameter in reversed(parameters):     # the last entry wins, as in usage.Options
        if parameter[0] != name:
            continue
        coerce = (parameter[4] if len(parameter) > 4 else None) or str
        try:
            value = coerce(value)
        except ValueError as e:
            # usage.Options' own wording
            raise usage.UsageError(f"Parameter type enforcement failed: {e}")
        options[name] = value
        return
    if value is True:
        options[name] = 1       # a flag, as usage.Options sets it
        return
    raise usage.UsageError(f"unknown option {name!r}")


class ConfigurableOptions(usage.Options):
    """
    A C{usage.Options} that also takes C{--config FILE} and reads the table
    named C{configTable} from it (the command line winning).

    @ivar config_document: the parsed file (None without C{--config}), for
        an umbrella to hand the other tables on.
    """

    configTable: str | None = None

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in Twisted
        self.config_document: dict[str, Any] | None = None
        #: long names of the options set explicitly (command line or file)
        self.explicit: set[str] = set()

    def opt_config(self, path: str) -> None:
        """TOML file with one table per server (see doc/operations.rst); the command line wins."""
        self["config"] = path

    def parseOptions(self, options: Sequence[str] | None = None) -> None:
        if options is None:
            options = sys.argv[1:]
        options = list(options)
        self.explicit = given_options(self, options)
        path = _config_path(options)
        if path is not None:
            self.config_document = load_config(path)
            # no table without a name (TOML keys are strings: None is never one)
            table = ({} if self.configTable is None
                     else self.config_document.get(self.configTable, {}))
            where = f"--config {path!r} [{self.configTable}]"
            from_file = table_arguments(self, table, where, skip=self.explicit)
            self.explicit |= given_options(self, from_file)
            options = from_file + options
        super().parseOptions(options)  # type: ignore[no-untyped-call]  # untyped in Twisted


def _config_path(argv: Sequence[str]) -> str | None:
    """The value of C{--config} in C{argv} (the last one), without parsing the rest."""
    path = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg[len("--config="):]
    return path
