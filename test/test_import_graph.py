"""
tools/importgraph.py: the check of C{tox -e lint} that keeps streamproto
free of import circles and its layers standing the right way up
(doc/architecture.rst).  Each test plants a circle (or a layer turned over)
in a package of its own and sees it caught.
"""

import importlib.util
import os
import sys
import textwrap
from pathlib import Path

from twisted.trial import unittest

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "importgraph.py"


def _load():
    spec = importlib.util.spec_from_file_location("importgraph", _TOOL)
    module = importlib.util.module_from_spec(spec)
    # registered before it runs: its dataclass looks its module up by name
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


importgraph = _load()


class PlantedCircleTests(unittest.TestCase):
    """A circle is found however its imports are written."""

    def package(self, files):
        """
        A package C{pkg} in a fresh directory with C{files} (name: source).

        @return: the package's directory.
        """
        root = Path(self.mktemp()) / "pkg"
        for name, source in {"__init__.py": "", **files}.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
        return root

    def assertCircle(self, root, members):
        found = importgraph.circles(importgraph.arrows(root))
        self.assertEqual(found, [sorted(members)])
        problems = importgraph.report(root, layers=())
        self.assertTrue(problems[0].startswith("import circle between "), problems)

    def test_none(self):
        root = self.package({"a.py": "import pkg.b\n", "b.py": "import os\n"})
        self.assertEqual(importgraph.report(root, layers=()), [])
        self.patch(importgraph, "LAYERS", ())
        self.assertEqual(importgraph.main([os.fspath(root)]), 0)

    def test_top_level(self):
        root = self.package({"a.py": "import pkg.b\n", "b.py": "from pkg.a import x\n"})
        self.assertCircle(root, ["pkg.a", "pkg.b"])

    def test_type_checking(self):
        """An import only for the type checker is an arrow too."""
        root = self.package({
            "a.py": "from pkg.b import B\n",
            "b.py": """\
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from pkg.a import A
                class B: pass
                """,
        })
        self.assertCircle(root, ["pkg.a", "pkg.b"])

    def test_function_local(self):
        """An import inside a function (made to dodge the circle at import
        time) is an arrow too."""
        root = self.package({
            "a.py": "from pkg.b import B\n",
            "b.py": """\
                class B:
                    def f(self):
                        from pkg.a import A
                        return A
                """,
        })
        self.assertCircle(root, ["pkg.a", "pkg.b"])

    def test_relative(self):
        root = self.package({
            "sub/__init__.py": "",
            "sub/a.py": "from . import b\n",
            "sub/b.py": "from ..c import C\n",
            "c.py": "from .sub.a import A\n",
        })
        self.assertCircle(root, ["pkg.c", "pkg.sub.a", "pkg.sub.b"])

    def test_through_a_package(self):
        """C{from pkg import name} where C{pkg}'s C{__init__} imports back."""
        root = self.package({
            "__init__.py": "from pkg.a import A\n",
            "a.py": "from pkg.b import B\n",
            "b.py": "from pkg import A\n",
        })
        self.assertCircle(root, ["pkg", "pkg.a", "pkg.b"])

    def test_submodule_import_is_not_the_package(self):
        """C{from pkg import b} is an arrow to C{pkg.b}, not to C{pkg}'s
        C{__init__} (which may gather its modules without a circle)."""
        root = self.package({
            "__init__.py": "from pkg.a import A\n",
            "a.py": "from pkg import b\n",
            "b.py": "x = 1\n",
        })
        self.assertEqual(importgraph.circles(importgraph.arrows(root)), [])

    def test_layer_turned_over(self):
        """A lower layer importing a higher one is reported, with its line."""
        root = self.package({
            "low/__init__.py": "",
            "low/x.py": "import os\nfrom pkg.high.y import Y\n",
            "high/__init__.py": "",
            "high/y.py": "from pkg.low.x import X\n",
        })
        problems = importgraph.report(root, layers=(("pkg.low",), ("pkg.high",)))
        self.assertIn("layer turned over: pkg.low.x:2 imports pkg.high.y", problems)

    def test_side_by_side(self):
        """Packages of one layer do not import one another."""
        root = self.package({
            "one/__init__.py": "from pkg.two import T\n",
            "two/__init__.py": "T = 1\n",
        })
        problems = importgraph.report(root, layers=(("pkg.one", "pkg.two"),))
        self.assertEqual(problems, ["layer turned over: pkg.one:1 imports pkg.two"])

    def test_unplaced(self):
        root = self.package({"low.py": "", "new.py": ""})
        self.assertEqual(importgraph.report(root, layers=(("pkg.low",),)),
                         ["in no layer: pkg.new (tools/importgraph.py LAYERS)"])

    def test_exit_status(self):
        root = self.package({"a.py": "import pkg.b\n", "b.py": "import pkg.a\n"})
        self.patch(importgraph, "LAYERS", ())
        self.assertEqual(importgraph.main([os.fspath(root)]), 1)


class StreamprotoTests(unittest.TestCase):
    """streamproto itself: no circle, every layer the right way up."""

    def test_streamproto(self):
        root = Path(__file__).resolve().parents[1] / "streamproto"
        self.assertEqual(importgraph.report(root), [])

    def test_packaged(self):
        """
        Every package of streamproto is in setup.cfg's list (written by
        hand): a new one left out is missing from the wheel tox installs.
        """
        import configparser
        top = Path(__file__).resolve().parents[1]
        config = configparser.ConfigParser()
        config.read(top / "setup.cfg")
        listed = set(config["options"]["packages"].split())
        packages = {
            ".".join(path.parent.relative_to(top).parts)
            for path in (top / "streamproto").rglob("__init__.py")
        }
        self.assertEqual(packages - listed, set())
