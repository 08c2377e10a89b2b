"""
The checker must catch each kind of anomaly: histories with planted
anomalies, one kind at a time, and clean ones that must pass.
"""

from twisted.trial.unittest import SynchronousTestCase

from test.faults import checker
from test.faults.checker import FAILED, OK, UNKNOWN, Op, Promise, check, encode


def clean(producers=2, n=5):
    """A clean history: each producer writes n payloads one after another."""
    history, records = [], []
    t = 0.0
    for seq in range(n):
        for p in range(producers):
            history.append(Op(f"p{p}", seq, t, t + 0.5, OK))
            records.append(encode(f"p{p}", seq))
            t += 1.0
    return history, records


class CodecTests(SynchronousTestCase):
    def test_roundtrip(self):
        for size in (0, 16, 64, 1000):
            self.assertEqual(checker.decode(encode("w-1", 42, size)), ("w-1", 42))

    def test_size(self):
        self.assertEqual(len(encode("p", 7, 200)), 200)

    def test_every_changed_byte_is_caught(self):
        payload = encode("p0", 3, 48)
        for i in range(len(payload)):
            bad = bytearray(payload)
            bad[i] ^= 0x01
            self.assertIsNone(checker.decode(bytes(bad)), i)

    def test_garbage(self):
        for junk in (b"", b"\x00" * 64, b"a:b:c:d", b"p:1:zzzzzzzz:"):
            self.assertIsNone(checker.decode(junk))


class CheckerTests(SynchronousTestCase):
    def test_clean_history_is_valid(self):
        history, records = clean()
        verdict = check(history, records)
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual((verdict.ops, verdict.acknowledged, verdict.records_read),
                         (10, 10, 10))

    def test_lost_acknowledged(self):
        history, records = clean()
        del records[3]
        verdict = check(history, records)
        self.assertFalse(verdict.valid)
        self.assertEqual(verdict.anomalies[checker.LOST], 1)
        self.assertIn("('p1', 1)", verdict.examples[checker.LOST][0])

    def test_duplicate_beyond_promise(self):
        history, records = clean()
        records.append(records[0])
        verdict = check(history, records)
        self.assertEqual(verdict.anomalies[checker.DUPLICATE], 1)
        self.assertFalse(verdict.valid)

    def test_duplicate_allowed_at_least_once(self):
        history, records = clean()
        records.append(records[0])
        verdict = check(history, records, Promise(at_most_once=False))
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual(verdict.allowed_duplicates, 1)

    def test_retried_payload_may_be_present_per_invocation(self):
        """A payload invoked twice (retry after unknown) may be there twice."""
        history = [Op("p", 0, 0.0, 1.0, UNKNOWN), Op("p", 0, 2.0, 3.0, OK)]
        records = [encode("p", 0), encode("p", 0)]
        verdict = check(history, records)
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual(verdict.allowed_duplicates, 1)
        verdict = check(history, records + [encode("p", 0)])
        self.assertEqual(verdict.anomalies[checker.DUPLICATE], 1)

    def test_reorder_realtime(self):
        history, records = clean()
        # p0's seq 1 (acked before seq 2 was invoked) moved behind seq 2
        i, j = records.index(encode("p0", 1)), records.index(encode("p0", 2))
        records[i], records[j] = records[j], records[i]
        verdict = check(history, records)
        self.assertEqual(verdict.anomalies[checker.REORDERED], 1)

    def test_concurrent_ops_may_be_in_any_order_realtime(self):
        history = [Op("p", 0, 0.0, 5.0, OK), Op("p", 1, 1.0, 4.0, OK)]
        verdict = check(history, [encode("p", 1), encode("p", 0)])
        self.assertTrue(verdict.valid, verdict.describe())

    def test_reorder_invocation_order(self):
        history = [Op("p", 0, 0.0, 5.0, OK), Op("p", 1, 1.0, 4.0, OK)]
        verdict = check(history, [encode("p", 1), encode("p", 0)],
                        Promise(order="invocation"))
        self.assertEqual(verdict.anomalies[checker.REORDERED], 1)

    def test_other_producers_interleave_freely(self):
        history, records = clean()
        records.sort(key=lambda r: checker.decode(r)[0])  # all p0 then all p1
        self.assertTrue(check(history, records).valid)

    def test_no_order_promise(self):
        history, records = clean()
        verdict = check(history, list(reversed(records)), Promise(order=None))
        self.assertTrue(verdict.valid, verdict.describe())

    def test_corrupt_bytes(self):
        history, records = clean()
        bad = bytearray(records[2])
        bad[-1] ^= 0xFF
        records[2] = bytes(bad)
        records.append(b"\x00" * 64)   # a zeroed page
        verdict = check(history, records)
        self.assertEqual(verdict.anomalies[checker.CORRUPT], 2)
        # the damaged record's payload is lost as well: counted apart
        self.assertEqual(verdict.anomalies[checker.LOST], 1)

    def test_phantom_record(self):
        history, records = clean()
        records.append(encode("p0", 99))
        records.append(encode("intruder", 0))
        verdict = check(history, records)
        self.assertEqual(verdict.anomalies[checker.PHANTOM], 2)

    def test_unknown_counted_apart_not_lost(self):
        history, records = clean()
        history += [Op("p0", 10, 20.0, None, UNKNOWN), Op("p1", 10, 20.0, 25.0, UNKNOWN)]
        records.append(encode("p1", 10))
        verdict = check(history, records)
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual((verdict.unknown, verdict.unknown_present, verdict.unknown_absent),
                         (2, 1, 1))

    def test_failed_must_be_absent(self):
        history, records = clean()
        history += [Op("p0", 10, 20.0, 21.0, FAILED), Op("p1", 10, 20.0, 21.0, FAILED)]
        records.append(encode("p1", 10))
        verdict = check(history, records)
        self.assertEqual(verdict.failed, 2)
        self.assertEqual(verdict.anomalies[checker.FAILED_PRESENT], 1)

    def test_every_kind_at_once(self):
        history, records = clean()
        del records[0]                                   # lost
        records.append(records[1])                       # duplicate
        records.append(b"torn")                          # corrupt
        records.append(encode("ghost", 1))               # phantom
        verdict = check(history, records)
        for kind in (checker.LOST, checker.DUPLICATE, checker.CORRUPT, checker.PHANTOM):
            self.assertEqual(verdict.anomalies[kind], 1, kind)
        text = verdict.describe()
        self.assertTrue(text.startswith("INVALID"))
        for kind in (checker.LOST, checker.DUPLICATE, checker.CORRUPT, checker.PHANTOM):
            self.assertIn(f"  {kind}: ", text)

    def test_examples_are_bounded(self):
        history, _ = clean(producers=1, n=20)
        verdict = check(history, [])
        self.assertEqual(verdict.anomalies[checker.LOST], 20)
        self.assertEqual(len(verdict.examples[checker.LOST]), checker.EXAMPLES)


class UnavailabilityTests(SynchronousTestCase):
    def test_longest_gap_between_acks(self):
        history = [Op("p", 0, 0.0, 1.0, OK), Op("p", 1, 1.0, 2.0, OK),
                   Op("p", 2, 2.0, 9.0, UNKNOWN), Op("p", 3, 9.0, 9.5, OK),
                   Op("p", 4, 9.5, 10.0, OK)]
        self.assertEqual(checker.longest_gap(history), 7.5)

    def test_gap_to_the_end(self):
        history = [Op("p", 0, 0.0, 1.0, OK), Op("p", 1, 1.0, 3.0, FAILED)]
        self.assertEqual(checker.longest_gap(history, end=11.0), 10.0)
        self.assertEqual(check(history, [encode("p", 0)], end=11.0)
                         .longest_unavailability, 10.0)

    def test_empty(self):
        self.assertEqual(checker.longest_gap([]), 0.0)


def transactions(producers=2, n=4, parts=3):
    """A clean history of transactions of C{parts} records each."""
    history, records = [], []
    t = 0.0
    for seq in range(n):
        for p in range(producers):
            history.append(Op(f"p{p}", seq, t, t + 0.5, OK))
            records += [checker.encode_part(f"p{p}", seq, i) for i in range(parts)]
            t += 1.0
    return history, records


class TransactionTests(SynchronousTestCase):
    """Operations of several records (Relink log-tx commits): exactly once, whole."""

    promise = Promise(at_most_once=True, order="realtime", parts=3)

    def test_clean(self):
        history, records = transactions()
        verdict = check(history, records, self.promise)
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual(verdict.records_read, 24)

    def test_partial(self):
        history, records = transactions()
        del records[4]          # the middle record of p1's first transaction
        verdict = check(history, records, self.promise)
        self.assertEqual(verdict.anomalies[checker.PARTIAL], 1, verdict.describe())
        self.assertIn("('p1', 0)", verdict.examples[checker.PARTIAL][0])
        self.assertEqual(verdict.anomalies[checker.LOST], 1)

    def test_transaction_stored_twice(self):
        """A commit resent to a new listener and stored again: a duplicate."""
        history, records = transactions()
        records += records[3:6]
        verdict = check(history, records, self.promise)
        self.assertEqual(verdict.anomalies[checker.DUPLICATE], 1, verdict.describe())
        self.assertEqual(verdict.anomalies[checker.PARTIAL], 0)

    def test_unknown_commit_absent_or_present(self):
        history, records = transactions()
        history[1] = Op("p1", 0, history[1].invoke, None, UNKNOWN)
        verdict = check(history, records[:3] + records[6:], self.promise)
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual((verdict.unknown, verdict.unknown_absent), (1, 1))
        verdict = check(history, records, self.promise)
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual(verdict.unknown_present, 1)

    def test_part_out_of_range(self):
        history, records = transactions()
        records.append(checker.encode_part("p0", 0, 7))
        verdict = check(history, records, self.promise)
        self.assertEqual(verdict.anomalies[checker.PHANTOM], 1)


class AtLeastOnceTests(SynchronousTestCase):
    """Lumberjack and Relink log: resends allowed, loss and disorder not."""

    promise = Promise(at_most_once=False, order="realtime")

    def test_resent_copies_are_allowed(self):
        history, records = clean()
        records = records[:6] + records[2:6] + records[6:]
        verdict = check(history, records, self.promise)
        self.assertTrue(verdict.valid, verdict.describe())
        self.assertEqual(verdict.allowed_duplicates, 4)

    def test_same_copies_under_at_most_once_are_duplicates(self):
        history, records = clean()
        verdict = check(history, records + records[2:4], Promise())
        self.assertEqual(verdict.anomalies[checker.DUPLICATE], 2)

    def test_loss_is_still_caught(self):
        history, records = clean()
        verdict = check(history, records[:4] + records[2:4] + records[5:], self.promise)
        self.assertEqual(verdict.anomalies[checker.LOST], 1, verdict.describe())

    def test_first_copy_out_of_order(self):
        """A resend may follow newer records; a first copy may not."""
        history, records = clean(producers=1)
        verdict = check(history, [records[1], records[0]] + records[2:], self.promise)
        self.assertEqual(verdict.anomalies[checker.REORDERED], 1, verdict.describe())
