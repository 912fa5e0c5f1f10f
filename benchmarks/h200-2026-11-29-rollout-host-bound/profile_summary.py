"""Summarise a py-spy raw profile (``py-spy record -f raw --idle --threads --subprocesses``) of a vLLM
rollout: for each process's main thread, the share of its samples inside vLLM's engine loop (the
in-process ``LLM._run_engine`` loop, or the engine core's ``run_busy_loop`` in its own process) that
falls in each part of the loop. Usage: python profile_summary.py PROFILE.txt[.gz] ..."""

from __future__ import annotations

import collections
import gzip
import sys

# The first pattern a stack contains names its part; the order matters (a detokenizer frame sits
# under the output processor's).
PARTS = (
    ("detokenizer", "vllm/v1/engine/detokenizer.py"),
    ("logprobs", "vllm/v1/engine/logprobs.py"),
    ("output processing", "output_processor.py"),
    ("scheduler", "vllm/v1/core/"),
    ("waiting on the GPU", "Event.synchronize"),
    ("inputs to the GPU", "buffer_utils.py"),
)
LOOPS = ("_run_engine", "run_busy_loop")


def summarise(path: str) -> dict[str, collections.Counter[str]]:
    opener = gzip.open if path.endswith(".gz") else open
    per_process: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with opener(path, "rt") as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            # frames: process, [child process,] thread, python frames...
            thread_at = next((i for i, f in enumerate(frames) if f.startswith("thread (")), None)
            if thread_at is None or "MainThread" not in frames[thread_at]:
                continue
            if not any(loop in stack for loop in LOOPS):
                continue
            process = frames[thread_at - 1].split(":", 1)[-1][:40]
            part = next((name for name, pattern in PARTS if pattern in stack), "other")
            per_process[process][part] += int(count)
    return per_process


if __name__ == "__main__":
    for name in sys.argv[1:]:
        for process, parts in summarise(name).items():
            total = sum(parts.values())
            print(f"{name} | {process} | {total} samples in the engine loop")
            for part, count in parts.most_common():
                print(f"  {part:20s} {100 * count / total:5.1f}%")
