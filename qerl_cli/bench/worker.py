"""Child process that measures one bench case: ``python -m qerl_cli.bench.worker CASE.json OUT.json``.

A fresh process per vLLM engine gives each one the whole GPU and clean peak-memory counters (see
``engines``). A failure is written to OUT.json as ``{"error": message}`` (a crash also prints its traceback on
stderr), so the parent can record that case as failed and go on with the others.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from qerl_cli.bench.engines import Case, measure_case
from qerl_cli.errors import QerlError


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m qerl_cli.bench.worker CASE.json OUT.json", file=sys.stderr)
        return 2
    case = Case(**json.loads(Path(argv[0]).read_text()))
    out = Path(argv[1])
    try:
        result = measure_case(case)
    except QerlError as exc:
        out.write_text(json.dumps({"error": str(exc)}))
        return 2
    except Exception as exc:  # noqa: BLE001 - e.g. vLLM cannot serve this format on this GPU
        traceback.print_exc()
        out.write_text(json.dumps({"error": f"crashed with {type(exc).__name__}: {exc} (traceback above)"}))
        return 1
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
