"""`qerl quantize`: AWQ/RTN calibration to NVFP4 or MXFP4 (llm-compressor) and NF4 (bitsandbytes layout).

>>> from qerl_cli.config import QuantizeConfig
>>> result = run_quantize(QuantizeConfig(model="Qwen/Qwen2.5-7B-Instruct", format="nvfp4"))
>>> rich.print(quantize_table(result))
"""

from __future__ import annotations

from qerl_cli.quantize.report import REPORT_NAME, QuantizeResult, quantize_table, read_report
from qerl_cli.quantize.run import run_quantize

__all__ = ["REPORT_NAME", "QuantizeResult", "quantize_table", "read_report", "run_quantize"]
