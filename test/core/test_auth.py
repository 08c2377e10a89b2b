"""
The authorization policy (streamproto.core.auth): the file format and its
usage errors, token lookup, certificate principals, the matcher against a
brute-force model (hypothesis), reloading, and --auth-policy on every plugin.
"""

import fnmatch
import os
import signal
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.python import usage
from twisted.trial import unittest
from zope.interface.verify import verifyObject

from streamproto.core import auth
from streamproto.core.auth import (
    ALLOW_ALL, IAuthorizer, Policy, PolicyError, PolicyHolder, hash_token,
)
from test.support.tlsutil import certs

EXAMPLE = """
[tokens]
dashboards = "%s"

[[allow]]
principal = "cn:ingest-1"
logs = ["beats-*", "events"]
ops = ["write"]

[[allow]]
principal = "token:dashboards"
logs = ["*"]
ops = ["read"]

[[allow]]
principal = "san:spiffe://example.org/admin"
logs = ["*"]
ops = ["read", "write", "admin"]
""" % hash_token("s3cret")


def write_file(case, text):
    fd, path = tempfile.mkstemp(suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    case.addCleanup(os.unlink, path)
    return path


class PolicyFileTests(unittest.SynchronousTestCase):
    def test_example(self):
        policy = Policy.from_toml(EXAMPLE)
        verifyObject(IAuthorizer, policy)
        self.assertTrue(policy.allows(["cn:ingest-1"], "write", "beats-2024"))
        self.assertTrue(policy.allows(["cn:ingest-1"], "write", "events"))
        self.assertFalse(policy.allows(["cn:ingest-1"], "write", "events2"))
        self.assertFalse(policy.allows(["cn:ingest-1"], "read", "events"))
        self.assertFalse(policy.allows(["cn:ingest-2"], "write", "events"))
        self.assertTrue(policy.allows(["token:dashboards"], "read", "anything"))
        self.assertFalse(policy.allows(["token:dashboards"], "admin", "anything"))
        self.assertTrue(policy.allows(["cn:x", "san:spiffe://example.org/admin"], "admin", "a"))
        self.assertFalse(policy.allows(["anonymous"], "read", "events"))

    def test_star_and_anonymous(self):
        policy = Policy.from_toml('[[allow]]\nprincipal = "*"\nlogs = ["pub-*"]\nops = ["read"]\n'
                                  '[[allow]]\nprincipal = "anonymous"\nlogs = ["open"]\n'
                                  'ops = ["write"]\n')
        self.assertTrue(policy.allows(["anonymous"], "read", "pub-1"))
        self.assertTrue(policy.allows(["cn:a"], "read", "pub-1"))
        self.assertTrue(policy.allows(["anonymous"], "write", "open"))
        self.assertFalse(policy.allows(["cn:a"], "write", "open"))

    def test_empty_policy_denies(self):
        self.assertFalse(Policy.from_toml("").allows(["anonymous"], "read", "x"))

    def test_no_policy_allows(self):
        verifyObject(IAuthorizer, ALLOW_ALL)
        self.assertTrue(ALLOW_ALL.allows(["anonymous"], "admin", "x"))
        self.assertFalse(ALLOW_ALL.enabled)

    def assertBad(self, text, *fragments):
        with self.assertRaises(PolicyError) as e:
            Policy.from_toml(text, "p.toml")
        for fragment in fragments:
            self.assertIn(fragment, str(e.exception))
        return str(e.exception)

    def test_bad_files(self):
        self.assertBad("[[allow]\n", "not valid TOML")
        self.assertBad("[rules]\n", "unknown key 'rules'")
        self.assertBad('[tokens]\na = "md5:00"\n', "[tokens]", "'a'", "sha256:")
        self.assertBad('[tokens]\na = "sha256:%s"\n' % ("0" * 63), "64 hex")
        self.assertBad('[[allow]]\nprincipal = "*"\nlogs = ["x"]\nops = ["delete"]\n',
                       "#1", "unknown op 'delete'")
        self.assertBad('[[allow]]\nprincipal = "*"\nlogs = ["x"]\n', "'ops' is missing")
        self.assertBad('[[allow]]\nprincipal = "*"\nlogs = ["x"]\nops = ["read"]\nop = 1\n',
                       "unknown key 'op'")
        self.assertBad('[[allow]]\nprincipal = "bob"\nlogs = ["x"]\nops = ["read"]\n',
                       "principal 'bob'")
        self.assertBad('[[allow]]\nprincipal = "token:nope"\nlogs = ["x"]\nops = ["read"]\n',
                       "names no token")
        self.assertBad('[[allow]]\nprincipal = "*"\nlogs = [1]\nops = ["read"]\n', "'logs'")
        self.assertBad('allow = 3\n', "array of tables")
        self.assertBad('[pravega]\ntoken-secret = "short"\n', "token-secret")

    def test_token_lookup(self):
        policy = Policy.from_toml(EXAMPLE)
        self.assertEqual(policy.token_principal("s3cret"), "token:dashboards")
        self.assertIsNone(policy.token_principal("s3cret2"))
        self.assertIsNone(policy.token_principal(""))
        self.assertIsNone(ALLOW_ALL.token_principal("s3cret"))

    def test_token_comparison_is_constant_time(self):
        """Every stored digest goes through hmac.compare_digest, match or not."""
        policy = Policy.from_toml('[tokens]\na = "%s"\nb = "%s"\nc = "%s"\n' % (
            hash_token("1"), hash_token("2"), hash_token("3")))
        calls = []
        from streamproto.core.auth import policy as policy_module
        real = policy_module.hmac.compare_digest

        def spy(a, b):
            calls.append((a, b))
            return real(a, b)
        self.patch(policy_module.hmac, "compare_digest", spy)
        self.assertEqual(policy.token_principal("1"), "token:a")
        self.assertEqual(len(calls), 3)

    def test_auth_command(self):
        """streamproto auth: new-token, hash-token from stdin, check; 0/1/2 exit statuses."""
        from io import StringIO

        from streamproto import cli
        from streamproto.core import authcli
        out = StringIO()
        self.assertEqual(authcli.main(["new-token"], stdout=out), 0)
        token, digest = out.getvalue().split()
        self.assertEqual(digest, hash_token(token))
        out = StringIO()
        self.assertEqual(authcli.main(["hash-token"], stdout=out,
                                      stdin=StringIO(token + "\n")), 0)
        self.assertEqual(out.getvalue().strip(), digest)
        out, err = StringIO(), StringIO()
        self.assertEqual(authcli.main(["check", write_file(self, EXAMPLE)], stdout=out,
                                      stderr=err), 0)
        self.assertIn("3 rules, 1 tokens", out.getvalue())
        bad = write_file(self, '[[allow]]\nprincipal = "*"\n')
        self.assertEqual(authcli.main(["check", bad], stdout=out, stderr=err), 1)
        self.assertIn("'logs' is missing", err.getvalue())
        self.assertEqual(authcli.main(["frobnicate"], stdout=out, stderr=err), 2)
        self.assertEqual(authcli.main(["hash-token"], stdout=out, stdin=StringIO("\n"),
                                      stderr=err), 2)
        self.assertIn("auth", cli.COMMANDS)

    def test_hash_token_command(self):
        from io import StringIO

        from streamproto.core import authcli
        out = StringIO()
        self.assertEqual(authcli.main(["hash-token", "s3cret"], stdout=out), 0)
        self.assertEqual(out.getvalue().strip(), hash_token("s3cret"))
        Policy.from_toml('[tokens]\nx = "%s"\n' % out.getvalue().strip())


class PrincipalTests(unittest.SynchronousTestCase):
    def test_certificate(self):
        from OpenSSL import crypto
        with open(certs().server_cert, "rb") as f:
            cert = crypto.load_certificate(crypto.FILETYPE_PEM, f.read())
        self.assertEqual(auth.certificate_principals(cert), ["cn:localhost", "san:localhost"])

    def test_san_uri(self):
        from test.support.tlsutil import make_client_cert
        key, cert = make_client_cert("svc", san_dns=["svc.example.org"],
                                     san_uri=["spiffe://example.org/svc"])
        with open(cert, "rb") as f:
            from OpenSSL import crypto
            x509 = crypto.load_certificate(crypto.FILETYPE_PEM, f.read())
        self.assertEqual(auth.certificate_principals(x509),
                         ["cn:svc", "san:svc.example.org", "san:spiffe://example.org/svc"])

    def test_connection_without_certificate(self):
        from twisted.internet.testing import StringTransport
        self.assertEqual(auth.connection_principals(StringTransport()), ("anonymous",))
        self.assertEqual(auth.connection_principals(StringTransport(), ["token:x"]),
                         ("token:x",))

    def test_unreadable_certificate_gives_no_principals(self):
        class Broken:
            def to_cryptography(self):
                raise ValueError("duplicate extension")

        class T:
            def getPeerCertificate(self):
                return Broken()
        self.assertEqual(auth.connection_principals(T()), ("anonymous",))
        self.assertEqual(auth.connection_principals(T(), ["token:a"]), ("token:a",))

    def test_connection_with_certificate(self):
        from OpenSSL import crypto
        with open(certs().client_cert, "rb") as f:
            cert = crypto.load_certificate(crypto.FILETYPE_PEM, f.read())

        class T:
            def getPeerCertificate(self):
                return cert
        self.assertEqual(auth.connection_principals(T()), ("cn:test-client",))
        self.assertEqual(auth.connection_principals(T(), ["token:a"]),
                         ("token:a", "cn:test-client"))


# -- the matcher against a model ------------------------------------------------

ALPHABET = "ab-*?"
names = st.text(alphabet="ab-", min_size=0, max_size=5)
globs = st.text(alphabet=ALPHABET, min_size=1, max_size=5)
principal_values = st.sampled_from(["cn:a", "cn:b", "san:a", "token:t", "anonymous"])
rules = st.fixed_dictionaries({
    "principal": st.one_of(principal_values, st.just("*"), st.just("cn:*")),
    "logs": st.lists(globs, min_size=1, max_size=3),
    "ops": st.lists(st.sampled_from(auth.OPS), min_size=1, max_size=3, unique=True),
})


def model_allows(rule_dicts, principals, op, resource):
    """Brute force: some rule grants op, names one principal, matches the resource."""
    for r in rule_dicts:
        if op not in r["ops"]:
            continue
        if not any(fnmatch.fnmatchcase(p, r["principal"]) for p in principals):
            continue
        if any(fnmatch.fnmatchcase(resource, g) for g in r["logs"]):
            return True
    return False


class MatcherModelTests(unittest.SynchronousTestCase):
    @settings(max_examples=300, deadline=None)
    @given(st.lists(rules, max_size=4),
           st.lists(principal_values, min_size=1, max_size=3),
           st.sampled_from(auth.OPS), names)
    def test_matches_model(self, rule_dicts, principals, op, resource):
        document = {"tokens": {"t": hash_token("x")}, "allow": rule_dicts}
        policy = Policy.from_document(document)
        expected = model_allows(rule_dicts, principals, op, resource)
        self.assertEqual(policy.allows(principals, op, resource), expected)
        # remembered decisions agree (and a list of principals is the same as a tuple)
        self.assertEqual(policy.allows(list(principals), op, resource), expected)

    @settings(max_examples=100, deadline=None)
    @given(st.lists(rules, max_size=4), names)
    def test_more_principals_never_less_allowed(self, rule_dicts, resource):
        policy = Policy.from_document({"tokens": {"t": hash_token("x")}, "allow": rule_dicts})
        for op in auth.OPS:
            if policy.allows(["cn:a"], op, resource):
                self.assertTrue(policy.allows(["cn:a", "cn:b"], op, resource))


# -- reloading ------------------------------------------------------------------

class HolderTests(unittest.SynchronousTestCase):
    def test_reload(self):
        path = write_file(self, EXAMPLE)
        holder = PolicyHolder(path)
        verifyObject(IAuthorizer, holder)
        self.assertFalse(holder.allows(["cn:new"], "read", "x"))
        with open(path, "w") as f:
            f.write('[[allow]]\nprincipal = "cn:new"\nlogs = ["*"]\nops = ["read"]\n')
        self.assertTrue(holder.reload())
        self.assertTrue(holder.allows(["cn:new"], "read", "x"))
        self.assertIsNone(holder.token_principal("s3cret"))

    def test_bad_reload_keeps_old_policy(self):
        path = write_file(self, EXAMPLE)
        holder = PolicyHolder(path)
        with open(path, "w") as f:
            f.write('[[allow]]\nprincipal = "*"\nlogs = ["*"]\nops = ["everything"]\n')
        events = []
        from twisted.logger import globalLogPublisher
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        self.assertFalse(holder.reload())
        self.assertTrue(holder.allows(["cn:ingest-1"], "write", "events"))
        self.assertFalse(holder.allows(["cn:x"], "read", "x"))
        messages = [e.get("error", "") for e in events if e.get("log_level") is not None]
        self.assertTrue(any("unknown op 'everything'" in m for m in messages), messages)

    def test_sighup(self):
        """SIGHUP reloads every watched holder (in the reactor thread)."""
        if not hasattr(signal, "SIGHUP"):
            raise unittest.SkipTest("no SIGHUP on this platform")
        path = write_file(self, EXAMPLE)
        holder = PolicyHolder(path)
        calls = []

        class Reactor:
            def callFromThread(self, f, *a):
                calls.append(f)
        before = signal.getsignal(signal.SIGHUP)
        auth.watch_sighup(holder, Reactor())
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            self.assertEqual(calls, [auth.reload_all])
        finally:
            auth.unwatch_sighup(holder)
        self.assertEqual(signal.getsignal(signal.SIGHUP), before)


# -- --auth-policy ---------------------------------------------------------------

class OptionTests(unittest.SynchronousTestCase):
    def setUp(self):
        self.data = tempfile.mkdtemp()

    def plugins(self):
        from streamproto import tap as umbrella
        return [module.Options for _, module in umbrella.available_servers()] + [
            umbrella.Options]

    def test_every_plugin(self):
        path = write_file(self, EXAMPLE)
        for options_class in self.plugins():
            options = options_class()
            options.parseOptions(["--data", self.data, "--auth-policy", path])
            if options_class.__module__ == "streamproto.tap":
                for sub in options.server_options.values():
                    self.assertIsInstance(sub["authorizer"], PolicyHolder)
                    self.assertEqual(sub["auth-policy"], path)
            else:
                self.assertIsInstance(options["authorizer"], PolicyHolder)

    def test_without(self):
        from streamproto.styx.tap import Options
        options = Options()
        options.parseOptions(["--data", self.data])
        self.assertIs(options["authorizer"], ALLOW_ALL)

    def test_usage_errors(self):
        bad = write_file(self, '[[allow]]\nprincipal = "*"\nlogs = ["*"]\nops = ["rw"]\n')
        for options_class in self.plugins():
            with self.assertRaises(usage.UsageError) as e:
                options_class().parseOptions(["--data", self.data, "--auth-policy", bad])
            self.assertIn("unknown op 'rw'", str(e.exception))
            with self.assertRaises(usage.UsageError) as e:
                options_class().parseOptions(["--data", self.data, "--auth-policy",
                                              "/nonexistent/p.toml"])
            self.assertIn("cannot read it", str(e.exception))

    def test_config_file(self):
        from streamproto import tap as umbrella
        path = write_file(self, EXAMPLE)
        config = write_file(self, f'[streamproto]\nauth-policy = "{path}"\n')
        options = umbrella.Options()
        options.parseOptions(["--data", self.data, "--config", config])
        for sub in options.server_options.values():
            self.assertIsInstance(sub["authorizer"], PolicyHolder)


class ServiceTests(unittest.SynchronousTestCase):
    def test_reload_on_sighup_while_running(self):
        """A server made by its plugin with --auth-policy reloads on SIGHUP while it runs."""
        if not hasattr(signal, "SIGHUP"):
            raise unittest.SkipTest("no SIGHUP on this platform")
        from streamproto.styx import tap
        path = write_file(self, EXAMPLE)
        options = tap.Options()
        options.parseOptions(["--data", tempfile.mkdtemp(), "--auth-policy", path,
                              "--port", "tcp:0:interface=127.0.0.1"])
        top = tap.makeService(options)
        services = [s for s in top if isinstance(s, auth.PolicyService)]
        self.assertEqual([s.holder for s in services], [options["authorizer"]])
        before = signal.getsignal(signal.SIGHUP)
        services[0].startService()
        try:
            self.assertIsNot(signal.getsignal(signal.SIGHUP), before)
            self.assertEqual(auth._watched, [options["authorizer"]])
        finally:
            services[0].stopService()
        self.assertEqual(signal.getsignal(signal.SIGHUP), before)
        self.assertEqual(auth._watched, [])
        from streamproto.core.tap import StoreService
        for child in top:
            if isinstance(child, StoreService):
                child.store.close()
