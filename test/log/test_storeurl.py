"""The store URL (C{nats://...}): what it accepts, what it refuses and why."""

from twisted.trial.unittest import SynchronousTestCase

from streamproto.log.storeurl import StoreURLError, is_store_url, parse_store_url


class StoreURLTests(SynchronousTestCase):

    def test_servers_and_defaults(self):
        url = parse_store_url("nats://n1:4222,n2,10.0.0.3:5222,n1:4222")
        self.assertEqual(url.servers, ("nats://n1:4222", "nats://n2:4222",
                                       "nats://10.0.0.3:5222"))
        self.assertEqual((url.replicas, url.prefix, url.tls), (None, "streamproto", False))
        self.assertEqual(str(url), "nats://n1:4222,n2:4222,10.0.0.3:5222")

    def test_query_and_tls(self):
        url = parse_store_url("tls://[::1]:4222?replicas=3&prefix=prod2")
        self.assertEqual(url.servers, ("tls://[::1]:4222",))
        self.assertEqual((url.replicas, url.prefix, url.tls), (3, "prod2", True))
        self.assertEqual(parse_store_url(str(url)), url)

    def test_monitor(self):
        url = parse_store_url("nats://n1,n2?monitor=n1:8222,https://n2:8443/")
        self.assertEqual(url.monitor, ("http://n1:8222", "https://n2:8443"))
        self.assertEqual(parse_store_url(str(url)), url)
        self.assertEqual(parse_store_url("nats://n1").monitor, ())

    def test_refused(self):
        for bad, why in [("/var/lib/streamproto", "nats://"),
                         ("nats://", "no server"),
                         ("nats://h:99999", "out of range"),
                         ("nats://h:x", "HOST[:PORT]"),
                         ("nats://h?replicas=0", "replicas must be 1 to 5"),
                         ("nats://h?replicas=6", "replicas must be 1 to 5"),
                         ("nats://h?prefix=a_b", "prefix must be"),
                         ("nats://h?size=1", "unknown parameter 'size'"),
                         ("nats://h?replicas", "the query must be"),
                         ("nats://h?monitor=n1", "is not [http(s)://]HOST:PORT"),
                         ("nats://h?monitor=ftp://n1:21", "is not [http(s)://]HOST:PORT")]:
            e = self.assertRaises(StoreURLError, parse_store_url, bad)
            self.assertIn(why, str(e), bad)

    def test_is_store_url(self):
        self.assertTrue(is_store_url("nats://h"))
        self.assertTrue(is_store_url("tls://h"))
        self.assertFalse(is_store_url("streamproto-data"))
        self.assertFalse(is_store_url(None))
