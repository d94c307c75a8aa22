"""`python -m proxy.doctor`: the same as `specgate doctor`."""

import sys

from .cli import main

sys.exit(main(prog="python -m proxy.doctor"))
