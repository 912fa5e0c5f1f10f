"""`qerl quantize`: AWQ/RTN calibration to NVFP4 or MXFP4 (llm-compressor) and NF4 (bitsandbytes layout).

>>> from qerl_cli.config import QuantizeConfig
>>> report = run_quantize(QuantizeConfig(model="Qwen/Qwen2.5-7B-Instruct", format="nvfp4"))
>>> rich.print(quantize_table(report))
"""

from __future__ import annotations

from qerl_cli.quantize.report import REPORT_NAME, quantize_table
from qerl_cli.quantize.run import run_quantize

__all__ = ["REPORT_NAME", "quantize_table", "run_quantize"]
