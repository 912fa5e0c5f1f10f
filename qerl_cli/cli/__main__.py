"""``python -m qerl_cli.cli ...``: the ``qerl`` command (``qerl compare --jobs N`` starts its runs so)."""

import sys

from qerl_cli.cli import main

if __name__ == "__main__":
    sys.exit(main())
