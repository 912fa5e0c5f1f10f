"""The GPU workflow (.github/workflows/gpu.yml): what it installs, its baseline gate and cache."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


# -- the GPU workflow ----------------------------------------------------------------------------
def test_gpu_workflow_installs_nf4_and_gates_on_a_baseline() -> None:
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "gpu.yml").read_text())
    steps = workflow["jobs"]["bench"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert '.[vllm,nf4]"' in runs
    assert "--baseline baseline/bench.json" in runs and "no baseline bench.json yet" in runs
    uses = [s.get("uses", "") for s in steps]
    assert any(u.startswith("actions/cache/restore") for u in uses)
    assert any(u.startswith("actions/cache/save") for u in uses)
    save = next(s for s in steps if s.get("uses", "").startswith("actions/cache/save"))
    assert "refs/heads/main" in save["if"]  # only main's results become the baseline
    # --baseline refuses another gen_len: a change of the default must also rename the baseline's key.
    from qerl_cli.config import BenchConfig

    assert save["with"]["key"].startswith(f"qerl-bench-baseline-gen{BenchConfig().gen_len}-")
    # The checkpoint cache must outlive the workspace, which checkout cleans before every job.
    assert "workspace" not in str(workflow["jobs"]["bench"].get("env", {}))
