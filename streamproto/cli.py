"""
The C{streamproto} command: C{streamproto PROTOCOL COMMAND ...}.

Each protocol's commands live in C{streamproto.<protocol>.cli} as
C{main(argv) -> exit status}; this module only dispatches.
"""

import importlib
import sys

COMMANDS = {
    "styx": ("streamproto.styx.cli", "Styx logs, produce/consume, benchmark"),
    "lumberjack": ("streamproto.lumberjack.cli", "send JSON lines to a Lumberjack server"),
    "reliable": ("streamproto.reliable.cli", "reliable-stream client"),
    "pravega": ("streamproto.pravega.cli", "Pravega segment admin, write, read"),
    "relink": ("streamproto.relink.cli", "Relink client"),
    "status": ("streamproto.status", "live summary from a metrics endpoint"),
    "store": ("streamproto.storecli", "copy logs between stores, list a store"),
    "auth": ("streamproto.core.authcli", "hash a bearer token, check a policy file"),
}


def usage(out):
    out.write("usage: streamproto [--version] COMMAND [ARGS...]\n\ncommands:\n")
    for name, (module, help_) in COMMANDS.items():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        out.write(f"  {name:<12} {help_}\n")
    out.write("\nevery command: -s/--server ADDRESS, --tls, --ca/--cert/--key, -t/--timeout,\n"
              "-f/--format text|json, -v/-q; exit status 0 done, 1 failure, 2 usage\n"
              "(doc/cli.rst).  streamproto COMMAND --help for a command's options.\n")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        usage(sys.stdout)
        return 0
    if argv[0] in ("-V", "--version"):
        from twisted import __version__ as twisted_version

        from streamproto import __version__
        sys.stdout.write(f"streamproto {__version__} (Twisted {twisted_version}, "
                         f"Python {sys.version.split()[0]})\n")
        return 0
    entry = COMMANDS.get(argv[0])
    if entry is None:
        sys.stderr.write(f"streamproto: unknown command {argv[0]!r}\n")
        usage(sys.stderr)
        return 2
    try:
        module = importlib.import_module(entry[0])
    except ModuleNotFoundError:
        sys.stderr.write(f"streamproto: {argv[0]} is not available in this build\n")
        return 2
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
