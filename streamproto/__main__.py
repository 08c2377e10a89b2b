import sys

from streamproto.cli import main

sys.exit(main())
