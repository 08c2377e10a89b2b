"""
C{streamproto auth}: helpers for the authorization policy (doc/security.rst).

    streamproto auth hash-token [TOKEN]     # the [tokens] value of TOKEN
    streamproto auth new-token              # a random token and its hash
    streamproto auth check FILE             # parse a policy file

Without TOKEN, C{hash-token} reads it from standard input (one line), so
that it stays out of the shell's history and the process list.
"""

import secrets
import sys
from typing import TextIO

from streamproto.core.auth import PolicyError, hash_token, load_policy

USAGE = ("usage: streamproto auth hash-token [TOKEN] | new-token | check FILE\n"
         "  hash-token  print the policy file's sha256:HEX of TOKEN (read from stdin if absent)\n"
         "  new-token   print a new random token, then its sha256:HEX\n"
         "  check       parse a policy file; exit status 1 and the reason if it is invalid\n")


def main(argv: list[str], stdout: TextIO | None = None, stdin: TextIO | None = None,
         stderr: TextIO | None = None) -> int:
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    stdin = stdin or sys.stdin
    if not argv or argv[0] in ("-h", "--help"):
        stdout.write(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "hash-token" and len(rest) <= 1:
        token = rest[0] if rest else stdin.readline().rstrip("\r\n")
        if not token:
            stderr.write("streamproto auth: empty token\n")
            return 2
        stdout.write(hash_token(token) + "\n")
        return 0
    if command == "new-token" and not rest:
        token = secrets.token_urlsafe(32)
        stdout.write(f"{token}\n{hash_token(token)}\n")
        return 0
    if command == "check" and len(rest) == 1:
        try:
            policy = load_policy(rest[0])
        except PolicyError as e:
            stderr.write(f"streamproto auth: {e}\n")
            return 1
        stdout.write(f"{rest[0]}: {len(policy.rules)} rules, {len(policy.tokens)} tokens, "
                     f"{len(policy.users)} users\n")
        return 0
    stderr.write(USAGE)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
