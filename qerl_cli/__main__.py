"""``python -m qerl_cli ...``: the ``qerl`` command, also as the module torchrun starts
(``torchrun --nproc-per-node N -m qerl_cli train RECIPE.yaml``)."""

import sys

from qerl_cli.cli import main

if __name__ == "__main__":
    sys.exit(main())
