"""The vLLM rollout engine on real vLLM and a GPU: start-up, adapter sync, the merge backends, AQN noise,
sleep / wake and the staleness check, through qerl's own factory (``rollout.factory.make_engine``).

Skipped without a GPU or vLLM (tests/conftest.py); CI's GPU job runs them (``pytest -m "gpu or vllm"``,
one process). ``tests/test_vllm_engine.py`` proves qerl's call sequence against a stand-in of vLLM's API;
these prove that vLLM itself behaves as modelled there.

The model is written here, with no download: a random Qwen2 of hidden size 256, two layers and the tiny
byte-level tokenizer (widths Marlin's FP4 kernels accept), in BF16 and NVFP4. The LoRA is random with
a large scale, so that serving it or not moves the logprobs far beyond the kernels' numerics. The
trainer's side of each comparison is qerl's own model (the HF engine's, on the GPU) with the same
adapter. Each engine takes a tenth of the GPU and no CUDA graphs (``enforce_eager``: faster starts);
at most one engine with sleep mode lives at a time (vLLM's sleep allocator is one per process).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from qerl_cli.bench.adapter import write_random_lora
from qerl_cli.errors import QerlError
from qerl_cli.modeling.loading import load_tokenizer
from qerl_cli.modeling.prompt_tokens import encode_prompt
from qerl_cli.modeling.tiny import build_tokenizer
from qerl_cli.rollout.base import SamplingSpec
from qerl_cli.rollout.factory import EngineRequest, make_engine
from qerl_cli.rollout.vllm_outputs import mean_abs_gap
from qerl_cli.torch_utils import free_accelerator_memory

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

RANK = 16
LORA_SCALE = 16  # lora_alpha / r: the adapter's effect dwarfs the kernels' rounding
MAX_LEN = 256
SHARE = 0.1  # of the GPU, per engine
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Twelve plus thirty is forty-two."
GREEDY = SamplingSpec(max_new_tokens=16, temperature=0.0, top_p=1.0)


def shape() -> dict[str, Any]:
    from qerl_cli.modeling.random_checkpoint import SHAPES  # imports transformers

    return {**SHAPES["tiny"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def strong_lora(model_dir: Path, out: Path, seed: int) -> Path:
    folder = write_random_lora(model_dir, out, RANK, seed=seed)
    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["lora_alpha"] = LORA_SCALE * RANK
    config_file.write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """BF16 and NVFP4 checkpoints of one random model, two adapters; the FP8 and BF16 copies go to a temp
    cache."""
    from qerl_cli.modeling.random_checkpoint import write_random_checkpoint  # imports transformers

    root = tmp_path_factory.mktemp("vllm-tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QERL_CACHE_DIR", str(root / "cache"))
        out: dict[str, Path] = {}
        for fmt in ("bf16", "nvfp4"):
            folder = write_random_checkpoint(root / fmt, shape(), fmt, seed=0, device="cuda")
            build_tokenizer().save_pretrained(folder)
            out[fmt] = Path(folder)
        out["lora"] = strong_lora(out["bf16"], root / "lora", seed=1)
        out["lora2"] = strong_lora(out["bf16"], root / "lora2", seed=2)
        yield out


def start(folder: Path, **settings: Any) -> Any:
    request = EngineRequest(
        "vllm", str(folder), gpu_memory_utilization=SHARE, max_lora_rank=RANK, max_model_len=MAX_LEN,
        seed=0, vllm_kwargs={"enforce_eager": True}, **settings,
    )  # fmt: skip
    return make_engine(request)


def stop(engine: Any) -> None:
    engine.close()
    del engine
    free_accelerator_memory()


def probe_ids(folder: Path) -> list[int]:
    return encode_prompt(PROBE_TEXT, load_tokenizer(str(folder)))


def trainer_logprobs(folder: Path, adapter: Path | None, ids: list[int]) -> list[float]:
    """qerl's model of ``folder`` (with ``adapter``) on the GPU: log p(ids[i + 1] | ids[: i + 1])."""
    hf = make_engine(
        EngineRequest("hf", str(folder), adapter=str(adapter) if adapter else None, device="cuda")
    )
    try:
        tokens = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            logits = hf.model(input_ids=tokens).logits.float()
        logprobs = logits.log_softmax(-1)[0, :-1].gather(-1, tokens[0, 1:, None])[:, 0]
        return logprobs.tolist()
    finally:
        hf.close()
        del hf
        free_accelerator_memory()


def greedy_tokens(engine: Any) -> list[int]:
    return list(engine.generate([PROBE_TEXT], 1, GREEDY).completions[0][0].token_ids)


# -- one BF16 engine with LoRA and sleep mode, as training runs it ------------------------------------
@pytest.fixture(scope="class")
def lora_engine(folders: dict[str, Path]) -> Iterator[Any]:
    engine = start(folders["bf16"], enable_sleep_mode=True, enable_lora=True)
    try:
        yield engine
    finally:
        stop(engine)


@pytest.mark.usefixtures("lora_engine")
class TestLoraEngine:
    def test_starts_and_samples_with_logprobs(self, lora_engine: Any) -> None:
        result = lora_engine.generate(
            [PROBE_TEXT], 2, SamplingSpec(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0)
        )
        completions = result.completions[0]
        assert len(completions) == 2 and lora_engine.linear_backend == "default"
        for completion in completions:
            assert 1 <= len(completion.token_ids) <= 8
            assert len(completion.logprobs) == len(completion.token_ids)
            assert all(lp <= 0 and lp == lp for lp in completion.logprobs)  # finite, not NaN
        assert result.stats["rollout/seconds"] > 0 and lora_engine.num_norms >= 4  # 2 per layer (+ the final)
        print(f"vLLM BF16 engine started in {lora_engine.load_seconds:.1f} s; sampled 2 x "
              f"{[len(c.token_ids) for c in completions]} tokens with their logprobs")  # fmt: skip

    def test_an_adapter_sync_changes_generation_and_none_restores_the_base(
        self, lora_engine: Any, folders: dict[str, Path]
    ) -> None:
        ids = probe_ids(folders["bf16"])
        base_lp, base_tokens = lora_engine.prompt_logprobs(ids), greedy_tokens(lora_engine)
        lora_engine.sync_adapter(str(folders["lora"]))
        assert lora_engine.stats()["rollout/lora_id"] == 1.0
        lora_lp, lora_tokens = lora_engine.prompt_logprobs(ids), greedy_tokens(lora_engine)
        lora_engine.sync_adapter(str(folders["lora2"]))
        assert lora_engine.stats()["rollout/lora_id"] == 2.0  # a new id every sync
        other_lp = lora_engine.prompt_logprobs(ids)
        lora_engine.sync_adapter(None)
        again_lp = lora_engine.prompt_logprobs(ids)
        assert lora_tokens != base_tokens, "greedy generation did not change after the LoRA sync"
        assert mean_abs_gap(lora_lp, base_lp) > 0.05 and mean_abs_gap(other_lp, lora_lp) > 0.05
        assert mean_abs_gap(again_lp, base_lp) < 1e-3
        moved = mean_abs_gap(lora_lp, base_lp)
        print(f"LoRA sync: greedy tokens changed, logprobs moved {moved:.3f} nats/token; "
              f"a second adapter {mean_abs_gap(other_lp, lora_lp):.3f}; none restores the base "
              f"({mean_abs_gap(again_lp, base_lp):.1e})")  # fmt: skip

    def test_the_staleness_check_passes_a_fresh_adapter_and_refuses_a_stale_one(
        self, lora_engine: Any, folders: dict[str, Path]
    ) -> None:
        ids = probe_ids(folders["bf16"])
        fresh = trainer_logprobs(folders["bf16"], folders["lora"], ids)
        stale = trainer_logprobs(folders["bf16"], folders["lora2"], ids)
        base = trainer_logprobs(folders["bf16"], None, ids)
        lora_engine.sync_adapter(str(folders["lora"]))
        gap = lora_engine.check_staleness(ids, lambda p: fresh, lambda p: base)
        assert gap <= lora_engine.staleness_tolerance and lora_engine.stats()["rollout/staleness_gap"] == gap
        stale_gap = mean_abs_gap(lora_engine.prompt_logprobs(ids), stale)
        assert stale_gap > 3 * gap, (gap, stale_gap)
        tolerance = lora_engine.staleness_tolerance
        lora_engine.staleness_tolerance = (gap + stale_gap) / 2  # between the fresh and the stale gap
        try:
            with pytest.raises(QerlError):
                lora_engine.check_staleness(ids, lambda p: stale)
        finally:
            lora_engine.staleness_tolerance = tolerance
        print(f"staleness: vLLM vs qerl's model {gap:.4f} nats/token with the synced adapter, "
              f"{stale_gap:.3f} against another adapter (refused)")  # fmt: skip

    def test_norm_noise_changes_the_outputs_and_sigma_zero_restores_them(
        self, lora_engine: Any, folders: dict[str, Path]
    ) -> None:
        ids = probe_ids(folders["bf16"])
        clean = lora_engine.prompt_logprobs(ids)
        perturbed = lora_engine.set_norm_noise(0.1, seed=3)
        noisy = lora_engine.prompt_logprobs(ids)
        assert perturbed == lora_engine.num_norms and lora_engine.stats()["rollout/noise_sigma"] == 0.1
        assert lora_engine.set_norm_noise(0.0, seed=3) == 0  # the clean weights back: none perturbed
        restored = lora_engine.prompt_logprobs(ids)
        assert mean_abs_gap(noisy, clean) > 1e-3
        assert mean_abs_gap(restored, clean) < 1e-4
        print(f"AQN: sigma 0.1 on {perturbed} norms moved logprobs {mean_abs_gap(noisy, clean):.4f} "
              f"nats/token; sigma 0 restored them ({mean_abs_gap(restored, clean):.1e})")  # fmt: skip

    def test_sleep_frees_memory_and_wake_serves_the_adapter_synced_while_asleep(
        self, lora_engine: Any, folders: dict[str, Path]
    ) -> None:
        ids = probe_ids(folders["bf16"])
        lora_engine.sync_adapter(str(folders["lora2"]))
        awake_lp = lora_engine.prompt_logprobs(ids)
        lora_engine.sync_adapter(str(folders["lora"]))
        lora_lp = lora_engine.prompt_logprobs(ids)
        lora_engine.sleep()
        assert lora_engine.is_sleeping and (lora_engine.last_sleep_freed_bytes or 0) > 0
        lora_engine.sync_adapter(str(folders["lora2"]))  # recorded; activated at wake-up
        lora_engine.wake_up()
        assert not lora_engine.is_sleeping
        woken_lp = lora_engine.prompt_logprobs(ids)
        assert mean_abs_gap(woken_lp, awake_lp) < 1e-3 and mean_abs_gap(woken_lp, lora_lp) > 0.05
        tokens = greedy_tokens(lora_engine)
        assert 1 <= len(tokens) <= GREEDY.max_new_tokens
        print(f"sleep freed {lora_engine.last_sleep_freed_bytes / 2**30:.2f} GiB; after wake-up vLLM serves "
              "the adapter synced while asleep and generates")  # fmt: skip


# -- NVFP4 on Marlin, and the merge backends -----------------------------------------------------------
def test_nvfp4_engine_serves_the_adapter_as_qerls_quantized_model_does(folders: dict[str, Path]) -> None:
    engine = start(folders["nvfp4"], enable_sleep_mode=False, enable_lora=True)
    try:
        assert engine.linear_backend == "marlin"  # Hopper: no native FP4, vLLM's default Marlin kernels
        ids = probe_ids(folders["nvfp4"])
        base_lp = engine.prompt_logprobs(ids)
        engine.sync_adapter(str(folders["lora"]))
        lora_lp = engine.prompt_logprobs(ids)
        fresh = trainer_logprobs(folders["nvfp4"], folders["lora"], ids)
        reference = trainer_logprobs(folders["nvfp4"], None, ids)
        gap = engine.check_staleness(ids, lambda p: fresh, lambda p: reference)
        assert mean_abs_gap(lora_lp, base_lp) > 0.05 and gap <= engine.staleness_tolerance
        print(f"NVFP4 on {engine.linear_backend}: LoRA moved logprobs {mean_abs_gap(lora_lp, base_lp):.3f}; "
              f"vLLM vs qerl's NVFP4 model {gap:.4f} nats/token")  # fmt: skip
    finally:
        stop(engine)


@pytest.mark.parametrize(("fmt", "backend"), [("bf16", "merged"), ("nvfp4", "fp8-merged")])
def test_a_merge_backend_serves_the_adapter_inside_the_weights(
    folders: dict[str, Path], fmt: str, backend: str
) -> None:
    """vLLM runs without LoRA; each sync rewrites its linears as base + B A (onto the FP8 copy of a 4-bit
    base), and a sync of no adapter writes the base back."""
    engine = start(folders[fmt], enable_sleep_mode=False, linear_backend=backend)
    try:
        assert engine.linear_backend == backend and not engine.enable_lora
        ids = probe_ids(folders[fmt])
        base_lp = engine.prompt_logprobs(ids)
        engine.sync_adapter(str(folders["lora"]))
        merged_lp = engine.prompt_logprobs(ids)
        merged = int(engine.stats()["rollout/merged_linears"])
        assert merged > 0
        fresh = trainer_logprobs(folders[fmt], folders["lora"], ids)
        gap = engine.check_staleness(ids, lambda p: fresh)  # raises past the backend's tolerance
        engine.sync_adapter(None)
        unmerged_lp = engine.prompt_logprobs(ids)
        assert mean_abs_gap(merged_lp, base_lp) > 0.05
        assert mean_abs_gap(unmerged_lp, base_lp) < 0.02  # the base written back (rounded as before)
        print(f"{backend} on a {fmt} base: {merged} linears merged, "
              f"logprobs moved {mean_abs_gap(merged_lp, base_lp):.3f}; vLLM vs qerl's model {gap:.4f} "
              "nats/token; no adapter restores the base")  # fmt: skip
    finally:
        stop(engine)


# Largest vLLM-vs-trainer gap (nats/token) allowed for the BF16 copy with the LoRA merged: its merged
# weights are rounded once to BF16 (8 significant bits), finer than the FP8 copy's E4M3 (4), so the gap
# stays below what fp8-merged is allowed, and far below what the adapter moves logprobs by.
BF16_MERGE_GAP = 0.05


def test_merged_serves_a_4bit_base_as_a_bf16_copy_and_survives_sleep(folders: dict[str, Path]) -> None:
    """``merged`` on an NVFP4 base: vLLM loads the BF16 copy of the dequantized base (no LoRA), each sync
    writes deq(base) + scaling B A into it in BF16, a sync made while asleep lands at wake-up, and a
    sync of no adapter writes the copy's own weights back."""
    engine = start(folders["nvfp4"], enable_sleep_mode=True, linear_backend="merged")
    try:
        assert engine.linear_backend == "merged" and not engine.enable_lora
        assert engine.backend_choice.weight_format == "bf16" and "bf16-rollout" in engine.model_path
        ids = probe_ids(folders["nvfp4"])
        base_lp = engine.prompt_logprobs(ids)
        engine.sync_adapter(str(folders["lora"]))
        merged_lp = engine.prompt_logprobs(ids)
        merged = int(engine.stats()["rollout/merged_linears"])
        fresh = trainer_logprobs(folders["nvfp4"], folders["lora"], ids)
        gap = engine.check_staleness(ids, lambda p: fresh)  # raises past the tolerance
        moved = mean_abs_gap(merged_lp, base_lp)
        print(f"merged on an NVFP4 base (BF16 copy): {merged} linears merged, logprobs moved {moved:.3f}; "
              f"vLLM vs qerl's NVFP4 model {gap:.4f} nats/token")  # fmt: skip
        assert merged > 0 and moved > 0.05
        assert gap <= BF16_MERGE_GAP, (gap, moved)
        engine.sync_adapter(str(folders["lora2"]))
        other_lp = engine.prompt_logprobs(ids)
        engine.sync_adapter(str(folders["lora"]))
        engine.sleep()
        assert engine.is_sleeping and (engine.last_sleep_freed_bytes or 0) > 0
        engine.sync_adapter(str(folders["lora2"]))  # recorded; merged at wake-up
        engine.wake_up()
        woken_lp = engine.prompt_logprobs(ids)
        assert mean_abs_gap(woken_lp, other_lp) < 1e-3 and mean_abs_gap(woken_lp, merged_lp) > 0.05
        tokens = greedy_tokens(engine)
        assert 1 <= len(tokens) <= GREEDY.max_new_tokens
        engine.sync_adapter(None)
        unmerged_lp = engine.prompt_logprobs(ids)
        assert mean_abs_gap(unmerged_lp, base_lp) < 1e-3  # the copy's own weights, bit for bit
        print(f"sleep freed {engine.last_sleep_freed_bytes / 2**30:.2f} GiB; the adapter synced while asleep "
              f"was merged at wake-up ({mean_abs_gap(woken_lp, other_lp):.1e} from it awake); no adapter "
              f"restores the copy ({mean_abs_gap(unmerged_lp, base_lp):.1e})")  # fmt: skip
    finally:
        stop(engine)


# -- qerl's own NVFP4 kernel inside vLLM ----------------------------------------------------------------
# Largest mean |qerl-triton - Marlin| over the probe's prompt logprobs (nats/token) on the same weights:
# both dequantize the checkpoint's exact products; they differ in BF16 rounding and summation order only.
KERNELS_GAP = 0.02


def test_qerl_triton_serves_nvfp4_with_cuda_graphs_lora_noise_and_sleep(folders: dict[str, Path]) -> None:
    """``rollout.linear_backend: qerl-triton``: vLLM runs qerl's Triton kernel on every NVFP4 layer, with
    CUDA graphs and torch.compile on (not ``enforce_eager``), vLLM's LoRA around it, AQN's norm noise,
    and an adapter synced while asleep served after wake-up; its logprobs agree with Marlin's."""
    ids = probe_ids(folders["nvfp4"])
    marlin = start(folders["nvfp4"], enable_sleep_mode=False, enable_lora=True)
    try:
        marlin_base = marlin.prompt_logprobs(ids)
        marlin.sync_adapter(str(folders["lora"]))
        marlin_lora = marlin.prompt_logprobs(ids)
    finally:
        stop(marlin)
    request = EngineRequest(
        "vllm", str(folders["nvfp4"]), gpu_memory_utilization=SHARE, max_lora_rank=RANK,
        max_model_len=MAX_LEN,
        seed=0, enable_sleep_mode=True, enable_lora=True, linear_backend="qerl-triton",
        vllm_kwargs={"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16]}},
    )  # fmt: skip
    engine = make_engine(request)
    try:
        assert engine.linear_backend == "qerl-triton" and engine.llm_kwargs["linear_backend"] == "triton"
        served = engine.llm.apply_model(
            lambda model: sum(hasattr(m, "qerl_accumulator_scale") for m in model.modules())
        )
        assert min(served) >= 2 * 4  # qkv, o, gate_up, down of each of the two layers
        base_lp = engine.prompt_logprobs(ids)
        tokens = greedy_tokens(engine)  # decode steps replay the captured CUDA graphs
        engine.sync_adapter(str(folders["lora"]))
        lora_lp = engine.prompt_logprobs(ids)
        assert mean_abs_gap(base_lp, marlin_base) < KERNELS_GAP, mean_abs_gap(base_lp, marlin_base)
        assert mean_abs_gap(lora_lp, marlin_lora) < KERNELS_GAP, mean_abs_gap(lora_lp, marlin_lora)
        assert mean_abs_gap(lora_lp, base_lp) > 0.05 and 1 <= len(tokens) <= GREEDY.max_new_tokens
        fresh = trainer_logprobs(folders["nvfp4"], folders["lora"], ids)
        gap = engine.check_staleness(ids, lambda p: fresh)  # raises past the tolerance
        perturbed = engine.set_norm_noise(0.1, seed=3)
        noisy = engine.prompt_logprobs(ids)
        assert engine.set_norm_noise(0.0, seed=3) == 0 and perturbed == engine.num_norms
        assert mean_abs_gap(noisy, lora_lp) > 1e-3
        engine.sync_adapter(str(folders["lora2"]))
        other_lp = engine.prompt_logprobs(ids)
        engine.sync_adapter(str(folders["lora"]))
        engine.sleep()
        engine.sync_adapter(str(folders["lora2"]))  # recorded; served at wake-up
        engine.wake_up()
        woken_lp = engine.prompt_logprobs(ids)
        assert mean_abs_gap(woken_lp, other_lp) < 1e-3, mean_abs_gap(woken_lp, other_lp)
        assert 1 <= len(greedy_tokens(engine)) <= GREEDY.max_new_tokens
        print(f"qerl-triton: {min(served)} NVFP4 layers on qerl's kernel; vs Marlin "
              f"{mean_abs_gap(base_lp, marlin_base):.4f} (base) / {mean_abs_gap(lora_lp, marlin_lora):.4f} "
              f"(LoRA) nats/token; vs qerl's model {gap:.4f}; AQN moved {mean_abs_gap(noisy, lora_lp):.4f}; "
              f"after sleep {mean_abs_gap(woken_lp, other_lp):.1e} from awake")  # fmt: skip
    finally:
        stop(engine)
